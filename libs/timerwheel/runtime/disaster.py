"""Disaster recovery: rebuild the shards of a lost volume from Kafka (``timerwheel recover-from-kafka``).

Not the store's crash recovery (``store/recovery.py``, every writer's open) nor the repair of one
damaged shard (``store/repair.py``, ``timerwheel recover``): here every shard is made again.

The shared volume holds the TimerLogs, wheels and checkpoints; Kafka holds everything they were
built from. When the volume is lost (all of it, or it cannot be trusted any more), the pending
set is computed from Kafka alone (``Outcomes``: each message id's outcome) and scheduled again
into fresh, empty shards:

* **The timer topic**, every partition from its start to its end ``E`` (taken when the scan
  starts): for each message id, its latest record — the producer's original or a roll hop that
  dequeue-put wrote back (a hop keeps the partition and the id, so "latest" is the highest
  offset; across partitions, the newest timestamp) — and the ids named by ``tw-cancel`` records.
  Revisions (issue 31): for each ``(id, revision)`` the first cancel or reschedule record
  (``tw-first-offset``, else its offset) decides, as in the service: a cancel ends the message, a
  reschedule moves it to the next revision, whose latest copy (the message dequeue-put put back,
  or else the reschedule record itself) is then the one to judge.
* **The dead-letter topic**: the ids already dead-lettered (``tw-id``, else the default id of
  the timer record that ``tw-source`` names).
* **Every destination topic** that a candidate names: the ids already delivered (``tw-id``).

An id is then, in this order of precedence: *delivered* (it reached its destination: never
again), *dead-lettered* (in the DLQ, or its latest record is invalid — enqueue-get dead-letters
those), *cancelled* (a cancel names it), else *rescheduled*: its latest record is written again
to the timer topic, after ``E``, on the same partition, with its absolute delivery time
(``tw-deliver-at``), its id (``tw-id``, also when it had only the default one), and its
``tw-enqueued-at`` (the original record's timestamp unless a hop already carried one). Its key,
value and other headers (``tw-roll``, ``tw-held-since``, user headers, ``traceparent``) are kept.

Fresh shards are then created whose enqueue checkpoints start at ``E``: enqueue-get resumes
there, so the old records are never read again (nothing already delivered is delivered again),
and reads the copies (and whatever producers wrote meanwhile) as new timer records (nothing
pending is lost). ``W`` starts at now and ``R`` at its slot, so a copy already due is delivered
one tick after the stages start. The work queues are cleared first: an entry they still held
refers to the lost shards, and what it carried is in the pending set.

Preconditions, each refused with one line: every stage is stopped (no heartbeat and no shard
lease in Redis: a stage still running would write into the new shards, or deliver what is being
rescheduled), and the data directory holds no shard (rebuild into an empty one; a failed run is
repeated after removing the shards it made: its copies are then the latest records of their ids).
Order of the writes: queues cleared, copies written, shards made last (then the deployment file
records the timer topic's cluster and topic ids, ``store.deployment.Source``), so a run that fails
before the end left no shard behind and can simply be run again.

Memory: one entry per id of the timer topic (its latest partition and offset, its destination
as an index into the few topic names, and a flag), plus the set of cancelled ids; delivered and
dead-lettered ids are kept only when they are candidates. The records themselves are not held:
the pending ones are read again by offset when they are written. Roughly 200 bytes per id in
CPython (``ids_held`` in the report): a million ids, ~200 MB.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from timerwheel.config import TimerConfig
from timerwheel.errors import InvalidTimerMessage, TimerwheelError
from timerwheel.log import stage_logger
from timerwheel.records import OutRecord, Record
from timerwheel.runtime.wiring import QUEUES
from timerwheel.store.checkpoint import DequeueCheckpoint, EnqueueCheckpoint
from timerwheel.store.deployment import DeploymentSettings, Source, check_settings, store_source
from timerwheel.store.layout import found_shards, open_shard
from timerwheel.transports.base import CommitLog
from timerwheel.wire import (
    H_CANCEL,
    H_DELAY_LEVEL,
    H_DELAY_MS,
    H_DELIVER_AT,
    H_ENQUEUED_AT,
    H_FIRST_OFFSET,
    H_ID,
    H_REPLACES,
    H_REVISION,
    H_SOURCE,
    H_TOPIC,
    TimerRules,
    default_id,
    first_offset,
    marker_target,
    message_id_of,
    revision_of,
)

log = stage_logger("recover-from-kafka")

#: Records asked for per poll and per read of the pending records by offset.
READ_BATCH = 2_000
#: Copies written per append.
WRITE_BATCH = 500
#: A scan that makes no progress for this long gives up (an open transaction holds it back, or
#: the broker is gone).
STALL_S = 60.0
#: Control headers a copy replaces: its time is absolute, its id explicit (and a winning reschedule
#: record's copy is a message of its revision, no longer a marker).
_REPLACED = frozenset({H_DELIVER_AT, H_DELAY_MS, H_DELAY_LEVEL, H_ID, H_REPLACES, H_FIRST_OFFSET})


class KafkaRecoveryRefused(TimerwheelError):
    """A precondition of disaster recovery does not hold (stages running, shards present)."""


@dataclass(frozen=True, slots=True)
class Latest:
    """An id's latest timer record: where it is, its destination (index into ``Outcomes.topics``)
    and whether it passes the service's checks."""

    partition: int
    offset: int
    timestamp_ms: int
    topic: int
    valid: bool


@dataclass
class Outcomes:
    """The outcome of each message id of a timer topic (delivered, dead-lettered, cancelled, or to
    be rescheduled: the pending set), fed record by record (no I/O: tests feed it directly)."""

    rules: TimerRules
    dlq_topic: str
    timer_topic: str
    latest: dict[str, Latest] = field(default_factory=dict)
    cancels: set[str] = field(default_factory=set)
    #: (id, revision) -> the first cancel or reschedule of it: (its first offset, a cancel, where it is).
    deciders: dict[tuple[str, int], tuple[int, bool, Latest]] = field(default_factory=dict)
    #: (id, revision above 0) -> its latest copy as a message (put back by dequeue-put, or rolled).
    moved: dict[tuple[str, int], Latest] = field(default_factory=dict)
    delivered: set[str] = field(default_factory=set)
    dead: set[str] = field(default_factory=set)
    topics: list[str] = field(default_factory=list)
    scanned: int = 0
    _topic_index: dict[str, int] = field(default_factory=dict)

    def add_timer_record(self, record: Record) -> None:
        self.scanned += 1
        hdr = dict(record.headers)
        aimed = marker_target(record)
        if aimed is not None:
            is_cancel = H_CANCEL in hdr
            if is_cancel:
                self.cancels.add(aimed[0])
            first = self.deciders.get(aimed)
            if first is None or first_offset(record) < first[0]:
                self.deciders[aimed] = (first_offset(record), is_cancel, self._entry(record, hdr))
            return
        mid = message_id_of(record, hdr)
        revision = revision_of(hdr) if hdr.get(H_REVISION, b"").isdigit() else 0
        if revision:
            known = self.moved.get((mid, revision))
            if known is None or known.offset < record.offset:
                self.moved[(mid, revision)] = self._entry(record, hdr)
            return
        before = self.latest.get(mid)
        if before is not None and (before.offset > record.offset if before.partition == record.partition
                                   else before.timestamp_ms > record.timestamp_ms):
            return
        self.latest[mid] = self._entry(record, hdr)

    def _entry(self, record: Record, hdr: dict[str, bytes]) -> Latest:
        try:
            self.rules.parse(record, record.timestamp_ms, hdr)
            valid = True
        except InvalidTimerMessage:
            valid = False
        raw = hdr.get(H_TOPIC)
        topic = raw.decode("utf-8", "replace") if raw else ""
        index = self._topic_index.get(topic)
        if index is None:
            index = self._topic_index[topic] = len(self.topics)
            self.topics.append(topic)
        return Latest(record.partition, record.offset, record.timestamp_ms, index, valid)

    def current(self, mid: str) -> tuple[Latest, bool]:
        """The id's record to judge, following its reschedules (the first marker of each revision
        decides), and whether a cancel ended it."""
        entry, revision = self.latest[mid], 0
        while True:
            first = self.deciders.get((mid, revision))
            if first is None:
                return entry, False
            if first[1]:
                return entry, True
            revision += 1
            entry = self.moved.get((mid, revision), first[2])

    def add_destination_record(self, record: Record) -> None:
        raw = record.header(H_ID)
        if raw is not None:
            mid = raw.decode("utf-8", "replace")
            if mid in self.latest:
                self.delivered.add(mid)

    def add_dead_letter(self, record: Record) -> None:
        raw = record.header(H_ID)
        if raw is not None:
            mid = raw.decode("utf-8", "replace")
        else:  # no tw-id: the default id of the timer record that tw-source names
            topic, _, place = (record.header(H_SOURCE) or b"").decode("utf-8", "replace").rpartition("/")
            topic, _, partition = topic.rpartition("/")
            if topic != self.timer_topic or not partition.isdigit() or not place.isdigit():
                return
            mid = default_id(int(partition), int(place))
        if mid in self.latest:
            self.dead.add(mid)

    def destinations(self) -> list[str]:
        """The destination topics to read for deliveries: those of valid, uncancelled candidates."""
        used = {e.topic for e, cancelled in map(self.current, self.latest) if e.valid and not cancelled}
        return sorted(self.topics[i] for i in used if self.topics[i])

    def outcome(self, mid: str) -> str:
        entry, cancelled = self.current(mid)
        if mid in self.delivered:
            return "delivered"
        if mid in self.dead or not entry.valid:
            return "dead_lettered"
        if cancelled:
            return "cancelled"
        return "rescheduled"

    def to_reschedule(self) -> list[tuple[str, Latest]]:
        """The ids to reschedule and their records to copy (``current``), in (partition, offset) order."""
        out = [(mid, self.current(mid)[0]) for mid in self.latest if self.outcome(mid) == "rescheduled"]
        out.sort(key=lambda x: (x[1].partition, x[1].offset))
        return out

    def counts(self) -> dict[str, int]:
        out = {"delivered": 0, "cancelled": 0, "dead_lettered": 0, "rescheduled": 0}
        for mid in self.latest:
            out[self.outcome(mid)] += 1
        return out


def recovered_record(record: Record, message_id: str, deliver_ms: int) -> OutRecord:
    """The copy of a pending message's latest timer record (see the module docstring)."""
    headers = [(k, v) for k, v in record.headers if k not in _REPLACED]
    if record.header(H_ENQUEUED_AT) is None:
        headers.append((H_ENQUEUED_AT, str(record.timestamp_ms).encode()))
    headers.append((H_DELIVER_AT, str(deliver_ms).encode()))
    headers.append((H_ID, message_id.encode()))
    return OutRecord(record.topic, record.key, record.value, tuple(headers), partition=record.partition)


@dataclass(frozen=True)
class KafkaRecoveryReport:
    scanned: int
    delivered: int
    cancelled: int
    dead_lettered: int
    rescheduled: int
    #: Distinct message ids held in memory.
    ids_held: int
    #: Timer-topic partition -> the offset the new shards start at (the scan's end).
    start_offsets: dict[int, int]
    destinations: list[str]
    shards: int
    dry_run: bool
    seconds: float

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["start_offsets"] = {str(p): o for p, o in sorted(self.start_offsets.items())}
        return out


def scan(commit_log: CommitLog, topic: str, ends: Mapping[int, int], on_record: Callable[[Record], None],
         starts: Mapping[int, int] | None = None) -> int:
    """Feed every record of ``topic`` below ``ends`` (from ``starts``, default the log start) to
    ``on_record``; returns how many. Gives up after STALL_S without progress."""
    begin = dict(starts) if starts is not None else commit_log.start_offsets(topic)
    todo = {p: end for p, end in ends.items() if begin.get(p, 0) < end}
    if not todo:
        return 0
    consumer = commit_log.consumer(topic, {p: begin.get(p, 0) for p in todo})
    n = 0
    try:
        last_progress = time.monotonic()
        while todo:
            records = consumer.poll(READ_BATCH, 0.5)
            for r in records:
                if r.partition in todo and r.offset < todo[r.partition]:
                    on_record(r)
                    n += 1
            moved = False
            for p in list(todo):
                if consumer.position(p) >= todo[p]:
                    del todo[p]
                    moved = True
            if records or moved:
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > STALL_S:
                raise TimerwheelError(f"reading {topic!r} made no progress for {STALL_S:.0f} s at "
                                      f"{ {p: consumer.position(p) for p in todo} } (ends {dict(todo)}): an open "
                                      f"transaction holds it back, or the broker is unreachable")
    finally:
        consumer.close()
    return n


def read_outcomes(config: TimerConfig, commit_log: CommitLog) -> tuple[Outcomes, dict[int, int]]:
    """Scan the timer topic, the DLQ and the destinations; returns the set and the timer topic's
    end offsets the scan stopped at."""
    ends = commit_log.end_offsets(config.timer_topic)
    found = Outcomes(TimerRules(config), config.dlq_topic, config.timer_topic)
    scan(commit_log, config.timer_topic, ends, found.add_timer_record)
    log.info("timer topic read", records=found.scanned, ids=len(found.latest), cancels=len(found.cancels))
    if commit_log.partition_count(config.dlq_topic):
        scan(commit_log, config.dlq_topic, commit_log.end_offsets(config.dlq_topic), found.add_dead_letter)
    for topic in found.destinations():
        if not commit_log.partition_count(topic):
            continue  # never created: nothing was delivered to it
        scan(commit_log, topic, commit_log.end_offsets(topic), found.add_destination_record)
    log.info("destinations read", topics=len(found.destinations()), delivered=len(found.delivered),
             dead_lettered=len(found.dead))
    return found, ends


def write_copies(config: TimerConfig, commit_log: CommitLog, found: Outcomes) -> int:
    """Write the pending messages' copies to the timer topic; returns how many."""
    rules = found.rules
    todo = found.to_reschedule()
    written = 0
    for i in range(0, len(todo), WRITE_BATCH):
        chunk = todo[i:i + WRITE_BATCH]
        records = commit_log.read(config.timer_topic, [(e.partition, e.offset) for _mid, e in chunk])
        copies = []
        for (mid, entry), rec in zip(chunk, records, strict=True):
            if rec is None:
                raise TimerwheelError(f"timer record {entry.partition}/{entry.offset} of {mid!r} is gone from "
                                      f"{config.timer_topic!r} (retention?) while recovering")
            copies.append(recovered_record(rec, mid, rules.delivery_time(rec, 0, check_max=False)))
        commit_log.append(copies)
        written += len(copies)
    return written


def make_shards(config: TimerConfig, ends: Mapping[int, int], now_ms: int) -> None:
    """Fresh shards whose enqueue checkpoints start at ``ends`` (partition p -> shard p % shards)."""
    for shard_id in range(config.shards):
        offsets = {p: o for p, o in ends.items() if p % config.shards == shard_id}
        shard = open_shard(config, shard_id, writer=True)
        try:
            shard.save_enqueue_checkpoint(EnqueueCheckpoint(flushed_pos=0, write_ms=now_ms, next_offsets=offsets,
                                                            epoch=0))
            shard.save_dequeue_checkpoint(DequeueCheckpoint(read_ms=shard.slot_time(now_ms), epoch=0))
        finally:
            shard.close()


def clear_queues(config: TimerConfig, redis_client: Any) -> int:
    """Empty the stages' work queues in Redis (their entries name positions of shards being made
    again); how many entries there were."""
    from timerwheel.transports.redisq import RedisWorkQueue

    cleared = 0
    for name in QUEUES:
        queue = RedisWorkQueue(redis_client, name, config.shards, config.queue_bound)
        cleared += sum(queue.clear(p) for p in range(config.shards))
    return cleared


def check_stopped(running: Iterable[str]) -> None:
    names = list(running)
    if names:
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        raise KafkaRecoveryRefused(f"stages are still running ({', '.join(names[:3])}{more}): stop every stage first "
                              f"(a killed one counts until its heartbeat and leases lapse, seconds)")


def check_empty(config: TimerConfig) -> None:
    shards = found_shards(config.data_dir)
    if shards:
        raise KafkaRecoveryRefused(f"--data-dir {config.data_dir} holds shards {shards[:5]}: recover-from-kafka "
                              f"rebuilds into a data directory without shards; move them away first")


def recover_from_kafka(config: TimerConfig, commit_log: CommitLog, redis_client: Any, *, dry_run: bool = False,
                       clock: Callable[[], int] | None = None) -> KafkaRecoveryReport:
    """Rebuild the shards of ``config.data_dir`` from Kafka (see the module docstring)."""
    from timerwheel.transports.redisq import running_processes

    t0 = time.monotonic()
    check_stopped(running_processes(redis_client))
    check_empty(config)
    settings = DeploymentSettings.of(config)
    check_settings(config.data_dir, settings, create=False)  # another deployment's directory: refused before the scan
    found, ends = read_outcomes(config, commit_log)
    counts = found.counts()
    if not dry_run:
        check_stopped(running_processes(redis_client))  # nobody started while we read
        cleared = clear_queues(config, redis_client)
        written = write_copies(config, commit_log, found)
        assert written == counts["rescheduled"], (written, counts)
        os.makedirs(config.data_dir, exist_ok=True)
        now = clock() if clock is not None else int(time.time() * 1000)
        make_shards(config, ends, now)
        check_settings(config.data_dir, settings, fsync=config.fsync)
        store_source(config.data_dir, Source(commit_log.cluster_id(), commit_log.topic_id(config.timer_topic)),
                     fsync=config.fsync)
        log.info("shards rebuilt", shards=config.shards, rescheduled=written, queue_entries_cleared=cleared,
                 start_offsets={str(p): o for p, o in sorted(ends.items())})
    return KafkaRecoveryReport(found.scanned, counts["delivered"], counts["cancelled"], counts["dead_lettered"],
                          counts["rescheduled"], len(found.latest), dict(ends), found.destinations(), config.shards,
                          dry_run, round(time.monotonic() - t0, 3))
