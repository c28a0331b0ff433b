"""LocalCommitLog: the embedded mode's commit log, Kafka's interface on local segment files.

Topics live in a directory (``layout``), each partition in segment files (``segments``, where
the guarantees are: dense offsets under concurrent processes, torn tails cut, CRCs checked,
retention by whole segments); ``consumers`` reads them, ``partitioner`` places keyed records as
Kafka's default partitioner would. ``read`` serves a followed topic's records from the
``ReadCache`` its consumers fill (``follow``, ``FollowingLog``); ``expire`` is the retention by
time (``ExpiringLog``) Kafka's brokers keep on their own.

Assumes one machine (flock, a shared page cache); not for network file systems.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path

import msgpack

from timerwheel.clock import Clock, SystemClock
from timerwheel.errors import TimerwheelError
from timerwheel.files import FILE_MODE, atomic_write, fsync_dir
from timerwheel.records import OutRecord, Record
from timerwheel.transports.local.consumers import LocalConsumer, LocalGroupConsumer
from timerwheel.transports.local.deliveries import LocalShardDeliveries
from timerwheel.transports.local.frames import encode_bodies
from timerwheel.transports.local.journal import Journal, JournalEntry
from timerwheel.transports.local.layout import (
    FORMAT_VERSION,
    LOG_ID_FILE,
    check_name,
    commit_log_dir,
    valid_name,
)
from timerwheel.transports.local.segments import DEFAULT_SEGMENT_BYTES, PartitionLog
from timerwheel.transports.partitioner import kafka_partitions
from timerwheel.transports.readcache import DEFAULT_MAX_BYTES, DEFAULT_MAX_RECORDS, ReadCache

__all__ = ["LocalCommitLog", "StaleWriterError"]


class StaleWriterError(TimerwheelError):
    """``append_atomic``'s ``expect_end`` did not hold: another writer appended to the partition."""


def _landed(part: PartitionLog, first: int, batch: Sequence[tuple[int, bytes]]) -> int:
    """How many of a journal's ``batch`` are in ``part`` from ``first`` on already (a prefix:
    one write put them there). An offset below the partition's start counts as landed: retention
    deleted it after it was written. Partition lock held."""
    end = part.tail_offset()
    found = part.read_offsets(list(range(first, min(end, first + len(batch)))))
    start = part.start()
    landed = 0
    for k, (_crc, body) in enumerate(batch):
        offset = first + k
        if offset >= end:
            break
        rec = found.get(offset)
        if rec is None:
            if offset < start:
                landed += 1
                continue
            break
        if (rec.timestamp_ms, rec.key, rec.value, rec.headers) != tuple(msgpack.unpackb(body, use_list=False)):
            break  # another process's record, appended after the crash: the rest goes after it
        landed += 1
    return landed


def _json_object(path: Path) -> dict[str, object] | None:
    """The JSON object in ``path``, or None if there is no such file."""
    try:
        body = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    if not isinstance(body, dict):
        raise TimerwheelError(f"{path}: not a JSON object")
    return body


class LocalCommitLog:
    """The CommitLog of the embedded mode (see the module header for layout and guarantees).

    ``LocalCommitLog(data_dir)`` given an embedded timerwheel's data directory opens the log in
    it, ``<data_dir>/log`` (``commit_log_dir``)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        default_partitions: int = 1,
        fsync: bool = True,
        clock: Clock | None = None,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        read_cache_records: int = DEFAULT_MAX_RECORDS,
        read_cache_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        if default_partitions < 1:
            raise ValueError(f"LocalCommitLog: default_partitions must be >= 1, got {default_partitions}")
        if segment_bytes < 1:
            raise ValueError(f"LocalCommitLog: segment_bytes must be >= 1, got {segment_bytes}")
        self.directory = commit_log_dir(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.default_partitions = default_partitions
        self.fsync = fsync
        self.segment_bytes = segment_bytes
        self._clock: Clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._partitions: dict[tuple[str, int], PartitionLog] = {}
        self._round_robin: dict[str, Iterator[int]] = {}
        self._closed = False
        #: Records this process's consumers read of a followed topic, for ``read`` (see ``follow``).
        self.read_cache = ReadCache(read_cache_records, read_cache_bytes)
        #: The topics whose records the consumers keep in ``read_cache``.
        self.followed: set[str] = set()
        #: ``append_atomic``'s redo journal; a batch a crashed writer left in it is finished now.
        self.journal = Journal(self.directory, fsync=fsync)
        #: A test's crash point inside ``append_atomic``: called with "journaled", then
        #: "partition-written" after each partition, then "applied" (before the journal is emptied).
        self.journal_fault: Callable[[str], None] = lambda point: None
        self._dead_letters_lock = threading.Lock()
        #: (timer topic, partition) -> the offset below which its dead letters are written (``dead_letter_once``).
        self._dead_letters_done: dict[tuple[str, int], int] = {}
        self.recover_journal()

    # -- topics -------------------------------------------------------------------------

    def ensure_topic(self, topic: str, partitions: int) -> int:
        if partitions < 1:
            raise ValueError(f"ensure_topic {topic!r}: partitions must be >= 1, got {partitions}")
        return self._topic(topic, partitions)

    def partitions(self, topic: str) -> int:
        return self._topic(topic, self.default_partitions)

    def partition_count(self, topic: str) -> int | None:
        """As ``partitions``: the local log creates a topic on first use, so none is ever missing."""
        return self.partitions(topic)

    def _topic(self, topic: str, create_with: int) -> int:
        count = self._counts.get(topic)
        if count is not None:
            return count
        check_name("topic", topic)
        meta = self.directory / topic / "topic.json"
        with self._lock:
            if topic not in self._counts:
                if not meta.exists():
                    self._create_topic(topic, create_with)
                self._counts[topic] = int(json.loads(meta.read_text())["partitions"])
            return self._counts[topic]

    @contextlib.contextmanager
    def _directory_locked(self) -> Iterator[None]:
        """The log directory's ``.lock``, held while a topic or an id is made (any process)."""
        fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _create_topic(self, topic: str, partitions: int) -> None:
        with self._directory_locked():
            topic_dir = self.directory / topic
            meta = topic_dir / "topic.json"
            if meta.exists():  # another process created it first
                return
            for p in range(partitions):
                (topic_dir / str(p)).mkdir(parents=True, exist_ok=True)
            tmp = topic_dir / f"topic.json.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump({"format": FORMAT_VERSION, "partitions": partitions, "id": str(uuid.uuid4())}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, meta)
            fsync_dir(topic_dir)
            fsync_dir(self.directory)

    # -- identity: which log, which incarnation of a topic (the deployment file records both) --

    def cluster_id(self) -> str:
        """This log's id, made when first asked: a log directory deleted or replaced has another,
        as a Kafka cluster made again has."""
        found = self._id_in(self.directory / LOG_ID_FILE, create=True)
        assert found is not None
        return found

    def topic_id(self, topic: str) -> str | None:
        """The id of this incarnation of ``topic`` (None if it does not exist): a topic directory
        deleted and made again has another."""
        if not valid_name(topic):
            return None
        return self._id_in(self.directory / topic / "topic.json", create=False)

    def _id_in(self, path: Path, *, create: bool) -> str | None:
        """The ``id`` of the JSON object in ``path``, given one (atomically, under the directory's
        lock) if it has none; a missing file is made only with ``create``, else None."""
        body = _json_object(path)
        if body is not None and isinstance(body.get("id"), str):
            return str(body["id"])
        if body is None and not create:
            return None
        with self._directory_locked():  # another process may have given it one meanwhile
            body = _json_object(path) or {}
            if not isinstance(body.get("id"), str):
                body["id"] = str(uuid.uuid4())
                atomic_write(str(path), json.dumps(body).encode(), self.fsync)
        return str(body["id"])

    def partition_log(self, topic: str, partition: int) -> PartitionLog:
        """The segments of ``topic``'s partition ``partition`` (opened on first use)."""
        part = self._partitions.get((topic, partition))
        if part is None:
            count = self.partitions(topic)
            if not 0 <= partition < count:
                raise ValueError(f"topic {topic!r} has {count} partitions, no partition {partition}")
            with self._lock:
                if self._closed:
                    raise TimerwheelError(f"LocalCommitLog {self.directory} is closed")
                part = self._partitions.get((topic, partition))
                if part is None:
                    part = self._partitions[(topic, partition)] = PartitionLog(
                        self.directory / topic / str(partition), topic, partition,
                        segment_bytes=self.segment_bytes, fsync=self.fsync)
        return part

    # -- writing ------------------------------------------------------------------------

    def _placed(self, records: Sequence[OutRecord]) -> dict[tuple[str, int], list[int]]:
        """The indexes of ``records`` by (topic, partition) they go to."""
        groups: dict[tuple[str, int], list[int]] = {}
        keyed: dict[str, list[int]] = {}
        for i, r in enumerate(records):
            if r.partition is not None:
                count = self.partitions(r.topic)
                if not 0 <= r.partition < count:
                    raise ValueError(f"topic {r.topic!r} has {count} partitions, no partition {r.partition}")
                groups.setdefault((r.topic, r.partition), []).append(i)
            elif r.key is not None:
                keyed.setdefault(r.topic, []).append(i)
            else:
                p = next(self._round_robin.setdefault(r.topic, itertools.count())) % self.partitions(r.topic)
                groups.setdefault((r.topic, p), []).append(i)
        for topic, idxs in keyed.items():
            keys = [records[i].key or b"" for i in idxs]
            for i, p in zip(idxs, kafka_partitions(keys, self.partitions(topic)), strict=True):
                groups.setdefault((topic, p), []).append(i)
        return groups

    def append(self, records: Sequence[OutRecord]) -> list[tuple[int, int]]:
        if not records:
            return []
        groups = self._placed(records)
        bodies = encode_bodies(records, self._clock.now_ms())
        order = sorted(groups)  # one global lock order: no deadlock between processes
        parts = [self.partition_log(t, p) for t, p in order]
        result: list[tuple[int, int]] = [(0, 0)] * len(records)
        with ExitStack() as held:
            for part in parts:
                held.enter_context(part.locked())
            written = []
            for (topic, p), part in zip(order, parts, strict=True):
                idxs = sorted(groups[(topic, p)])
                seg, first = part.write([bodies[i] for i in idxs])
                written.append(seg)
                for k, i in enumerate(idxs):
                    result[i] = (p, first + k)
            if self.fsync:
                for seg in written:
                    os.fdatasync(seg.log_fd)
                    os.fdatasync(seg.idx_fd)
        return result

    def append_atomic(self, records: Sequence[OutRecord], transactional_id: str = "", *,
                      expect_end: tuple[str, int, int] | None = None) -> list[tuple[int, int]]:
        """As ``append``, all or nothing across partitions, also through a crash: through the
        journal (``journal`` module header). ``transactional_id`` is Kafka's (``AtomicLog``); here
        the journal's lock orders every writer, and a crashed one's batch is finished (or dropped)
        by the next ``recover_journal``. Readers may see the batch partition by partition while it
        is written (there is no read_committed here): exactly-once needs all or nothing after a
        crash, not at every instant. ``expect_end`` (topic, partition, end offset): nothing is
        written, ``StaleWriterError`` raised, unless that partition (one of the batch's) ends there
        under the locks: a compare-and-append, the local log's fencing."""
        if not records:
            return []
        groups = self._placed(records)
        bodies = encode_bodies(records, self._clock.now_ms())
        order = sorted(groups)
        parts = [self.partition_log(t, p) for t, p in order]
        result: list[tuple[int, int]] = [(0, 0)] * len(records)
        with self.journal.held():
            self._recover_journal_held()
            with ExitStack() as held:
                for part in parts:
                    held.enter_context(part.locked())
                entries: list[JournalEntry] = []
                for (topic, p), part in zip(order, parts, strict=True):
                    idxs = sorted(groups[(topic, p)])
                    first = part.tail_offset()
                    if expect_end is not None and expect_end[:2] == (topic, p) and first != expect_end[2]:
                        raise StaleWriterError(f"{topic}/{p} ends at {first}, not at {expect_end[2]}: "
                                               "another writer appended since")
                    entries.append((topic, p, first, [bodies[i] for i in idxs]))
                    for k, i in enumerate(idxs):
                        result[i] = (p, first + k)
                self.journal.write(entries)
                self.journal_fault("journaled")
                for part, (_t, _p, _o, batch) in zip(parts, entries, strict=True):
                    seg, _first = part.write(batch)
                    if self.fsync:
                        os.fdatasync(seg.log_fd)
                        os.fdatasync(seg.idx_fd)
                    self.journal_fault("partition-written")
                self.journal_fault("applied")
                self.journal.clear()
        return result

    def recover_journal(self) -> int:
        """Finish the batch a crashed (or failed) ``append_atomic`` left in the journal, or drop
        it if torn; returns the records appended now. Waits for a live writer's batch."""
        if not self.journal.pending():
            return 0
        with self.journal.held():
            return self._recover_journal_held()

    def _recover_journal_held(self) -> int:
        entries = self.journal.read()
        if entries is None:
            if self.journal.pending():
                self.journal.clear()  # torn: its writer died before any partition was written
            return 0
        appended = 0
        order = sorted(entries, key=lambda e: (e[0], e[1]))
        parts = [self.partition_log(t, p) for t, p, _o, _b in order]
        with ExitStack() as held:
            for part in parts:
                held.enter_context(part.locked())
            for part, (_t, _p, first, batch) in zip(parts, order, strict=True):
                landed = _landed(part, first, batch)
                if landed < len(batch):
                    seg, _ = part.write(batch[landed:])
                    appended += len(batch) - landed
                    if self.fsync:
                        os.fdatasync(seg.log_fd)
                        os.fdatasync(seg.idx_fd)
            self.journal.clear()
        return appended

    def dead_letter_once(self, prefix: str, source_topic: str, partition: int,
                         letters: Sequence[tuple[int, OutRecord]]) -> int:
        """enqueue-get's dead letters of one timer partition, once each (``DeadLetterLog``): those
        at or above the partition's done offset, with a record moving it past the last, in one
        ``append_atomic``. The done offsets are the records of topic ``<prefix>-dlq-done``
        (msgpack ``[source topic, partition, next offset]``; Kafka keeps them as group
        ``<prefix>-dlq``'s offsets), read on first use. Returns how many were written."""
        if not letters:
            return 0
        topic = f"{prefix}-dlq-done"
        with self._dead_letters_lock:
            key = (source_topic, partition)
            if key not in self._dead_letters_done:
                self.recover_journal()
                self.ensure_topic(topic, 1)
                done: dict[tuple[str, int], int] = {}
                for r in self.read_since(topic, 0, 0):
                    t, p, o = msgpack.unpackb(r.value or b"", raw=False)
                    done[(t, p)] = max(done.get((t, p), 0), o)
                self._dead_letters_done.update({k: v for k, v in done.items() if k not in self._dead_letters_done})
                self._dead_letters_done.setdefault(key, 0)
            todo = [r for o, r in letters if o >= self._dead_letters_done[key]]
            if not todo:
                return 0
            upto = letters[-1][0] + 1
            mark = OutRecord(topic, None, msgpack.packb([source_topic, partition, upto]), (), partition=0)
            self.append_atomic([*todo, mark])
            self._dead_letters_done[key] = upto
            return len(todo)

    def shard_deliveries(self, prefix: str, progress_topic: str, shard: int, *,
                         timeout_ms: int = 0) -> LocalShardDeliveries:
        """Exactly-once releases of ``shard``, their progress on ``progress_topic``
        (``deliveries.LocalShardDeliveries``; ``prefix`` and ``timeout_ms`` are Kafka's)."""
        return LocalShardDeliveries(self, progress_topic, shard)

    def delete_before(self, topic: str, partition: int, offset: int) -> int:
        """Retention: delete whole segments below ``offset``; return the new start offset.
        Offsets in the rest of the segment that holds ``offset`` stay readable."""
        part = self.partition_log(topic, partition)
        with part.locked():
            return part.delete_before(offset)

    def expire(self, now_ms: int, retention_ms: int) -> int:
        """Retention by time over every topic: delete whole segments whose newest record is older
        than ``retention_ms`` (as Kafka's ``retention.ms``); returns the segments deleted."""
        deleted = 0
        for meta in sorted(self.directory.glob("*/topic.json")):
            topic = meta.parent.name
            for p in range(self.partitions(topic)):
                part = self.partition_log(topic, p)
                with part.locked():
                    deleted += part.expire(now_ms - retention_ms)
        return deleted

    # -- reading ------------------------------------------------------------------------

    def follow(self, topic: str) -> None:
        """Keep what this process's consumers of ``topic`` read (within the read cache's bounds),
        so that ``read`` serves those records from memory: in embedded mode dequeue-getmsg finds a
        short delay's record where enqueue-get left it, instead of reading and decoding it a
        second time. A record leaves the cache when served."""
        if self.read_cache.enabled:
            self.followed.add(topic)

    def read(self, topic: str, positions: Sequence[tuple[int, int]]) -> list[Record | None]:
        count = self.partitions(topic)
        hits = self.read_cache.take(topic, positions) if topic in self.followed else {}
        if len(hits) < len(positions):  # else every position was in memory (and none repeated)
            wanted: dict[int, set[int]] = {}
            for p, o in positions:
                if 0 <= p < count and o >= 0 and (p, o) not in hits:
                    wanted.setdefault(p, set()).add(o)
            for p, offs in wanted.items():
                for o, rec in self.partition_log(topic, p).read_offsets(sorted(offs)).items():
                    hits[(p, o)] = rec
        return list(map(hits.get, positions))

    def read_since(self, topic: str, partition: int, since_ms: int) -> list[Record]:
        """The records of ``topic``'s ``partition`` from the first whose timestamp is at least
        ``since_ms`` to the partition's end as of the call (``KafkaCommitLog.read_since``'s
        semantics). The first is found by a binary search on the records' timestamps (Kafka's
        ``offsets_for_times``), which assumes them nondecreasing: true of a progress partition,
        stamped by the one releasing process's clock; a clock stepped back is covered by the
        read-back's margin (``progress.READ_BACK_MARGIN_MS``)."""
        log = self.partition_log(topic, partition)
        lo, hi = log.start(), log.end()
        while lo < hi:
            mid = (lo + hi) // 2
            rec = log.read_offsets([mid]).get(mid)
            if rec is None:  # below a start retention just moved: search above it
                lo = max(mid + 1, log.start())
            elif rec.timestamp_ms < since_ms:
                lo = mid + 1
            else:
                hi = mid
        end = log.end()
        out: list[Record] = []
        offset = lo
        while offset < end:
            got, offset, _ = log.read_from(offset, 10_000)
            if not got:
                break
            out += [r for r in got if r.offset < end]
        return out

    def consumer(self, topic: str, offsets: Mapping[int, int], *, keep: bool = True) -> LocalConsumer:
        return LocalConsumer(self, topic, offsets, keep=keep)

    def group_consumer(self, group: str, topics: Sequence[str],
                       options: Mapping[str, object] | None = None) -> LocalGroupConsumer:
        """The one member of consumer group ``group`` reading ``topics`` (``GroupConsumer``); the
        group's offsets live in ``GROUPS_DIR`` beside the topics. The local log takes no options."""
        if options:
            raise ValueError(f"group {group!r}: the local log takes no consumer options, got {sorted(options)}")
        return LocalGroupConsumer(self, group, topics)

    def end_offsets(self, topic: str) -> dict[int, int]:
        return {p: self.partition_log(topic, p).end() for p in range(self.partitions(topic))}

    def high_watermarks(self, topic: str) -> dict[int, int]:
        """The ends: a local append is visible to every reader once it returns (no transactions)."""
        return self.end_offsets(topic)

    def start_offsets(self, topic: str) -> dict[int, int]:
        return {p: self.partition_log(topic, p).start() for p in range(self.partitions(topic))}

    def close(self) -> None:
        self.journal.close()
        with self._lock:
            self._closed = True
            parts, self._partitions = list(self._partitions.values()), {}
        for part in parts:
            with part.write_lock:
                part.close()

