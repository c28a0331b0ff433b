"""LocalCommitLog: the embedded mode's commit log, Kafka's interface on local segment files.

Layout on disk (every integer little endian)::

    <directory>/.lock                          flock held while a topic or an id is created
    <directory>/@log.json                      {"id": uuid}: this log's own id (``cluster_id``), made when first asked
    <directory>/<topic>/topic.json             {"format": 1, "partitions": n, "id": uuid}, written once,
                                               atomically (a topic made before ids gets its "id" when first asked)
    <directory>/<topic>/<p>/lock               flock held by the appender of partition p (any process)
    <directory>/<topic>/<p>/<base:020d>.log    record frames, back to back
    <directory>/<topic>/<p>/<base:020d>.idx    one u64 per offset: END position of its frame in .log;
                                               bit 63 marks the last record of an append batch
    <directory>/@groups/<group>.json           a consumer group's committed offsets (``group_consumer``)
    <directory>/@groups/<group>.lock           flock held by the group's one member

A segment holds the dense offsets ``base, base+1, ...``; record ``i`` of a segment occupies
``[end[i-1], end[i])`` of its .log (``end[-1]`` = 0), so a lookup is one ``pread`` of the index.
A frame is::

    crc u32 | offset i64 | body: msgpack array [timestamp_ms, key, value, [[name, value], ...]]

``crc`` is CRC-32 of the body (key and value are msgpack bin or nil, header names str). ``offset``
is outside the CRC but compared with the offset the index says, so a misplaced or corrupt frame
is detected either way. msgpack because its C codec is several times faster than packing the
fields with ``struct`` in Python, and this is the embedded pipeline's hot path.

What it guarantees, and why:

* Offsets are dense per partition, also when several processes append at once: an appender
  holds the partition's ``flock`` (and an in-process lock, as flock is per open file) while it
  reads the tail, writes and syncs.
* A reader trusts only complete index entries. The appender writes the frames first, then their
  index entries, so any entry a reader can see (one machine, one page cache) points at complete
  data. A process that dies between the two writes leaves an unindexed tail in .log (or half an
  index entry); the next appender truncates it under the lock before it writes.
* ``fsync=True``: data and index are ``fdatasync``'ed before the lock is released and before
  ``append`` returns. Since the lock is held from write to sync, only a partition's last batch
  can be unsynced when the machine loses power. The first time a process opens a partition
  (reader or writer) it checks that batch under the lock (index entries increasing and inside
  .log, every frame's CRC, also past a missing batch-end mark) and cuts it at the first damaged
  record.
* Retention (``delete_before``) deletes whole segments, oldest first; the last segment is never
  deleted (an empty one is rolled first), so the end offset survives. ``expire`` does it by time,
  as Kafka's ``retention.ms``: segments whose newest record is older than the retention go.

Assumes one machine (flock, a shared page cache); not for network file systems.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import itertools
import json
import operator
import os
import re
import struct
import threading
import time
import uuid
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import msgpack
import numpy as np

from timerwheel.clock import Clock, SystemClock
from timerwheel.errors import CorruptRecordError, TimerwheelError
from timerwheel.files import FILE_MODE, atomic_write, fsync_dir, pwrite_all
from timerwheel.records import OutRecord, Record
from timerwheel.store.layout import holds_shards

FORMAT_VERSION = 1
#: The log's own id, beside the topics: ``@`` is in no topic name.
LOG_ID_FILE = "@log.json"
DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024
#: Kafka's rule for topic names; it also keeps a name from escaping the directory.
TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")

_PREFIX = struct.Struct("<Iq")  # crc, offset
_BATCH_END = 1 << 63
_POS_MASK = _BATCH_END - 1
_MAX_FETCH_BYTES = 8 * 1024 * 1024
#: Sparse reads: offsets this close share one index pread, frames this close one data pread.
_INDEX_GAP = 512
_DATA_GAP_BYTES = 64 * 1024
_IDLE_SLEEP_S = 0.002
_M32 = 0xFFFFFFFF


class InvalidTopicError(TimerwheelError, ValueError):
    """A topic name the local log cannot hold (Kafka's rule: 1..249 of ``[A-Za-z0-9._-]``)."""


class CorruptLogRecordError(CorruptRecordError):
    """A commit-log frame failed its CRC or offset check. ``position`` is the record's offset."""

    def __init__(self, topic: str, partition: int, offset: int, message: str) -> None:
        TimerwheelError.__init__(self, f"corrupt record in {topic}/{partition} at offset {offset}: {message}")
        self.position = offset
        self.topic = topic
        self.partition = partition


def murmur2(data: bytes) -> int:
    """Kafka's ``Utils.murmur2``: a signed 32-bit hash, bit for bit as the Java client computes it."""
    m = 0x5BD1E995
    length = len(data)
    h = (0x9747B28C ^ length) & _M32
    tail = length & ~3
    for (k,) in struct.iter_unpack("<I", data[:tail]):
        k = (k * m) & _M32
        k ^= k >> 24
        k = (k * m) & _M32
        h = ((h * m) & _M32) ^ k
    rest = length & 3
    if rest == 3:
        h ^= data[tail + 2] << 16
    if rest >= 2:
        h ^= data[tail + 1] << 8
    if rest >= 1:
        h = ((h ^ data[tail]) * m) & _M32
    h ^= h >> 13
    h = (h * m) & _M32
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def kafka_partition(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner gives a keyed record: toPositive(murmur2) % n."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def kafka_partitions(keys: Sequence[bytes], partitions: int) -> list[int]:
    """``kafka_partition`` of many keys: keys of one length are hashed together with numpy
    (uint32 arithmetic wraps as Java's int does), as murmur2 in Python costs microseconds a key."""
    out = [0] * len(keys)
    by_length: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        by_length.setdefault(len(key), []).append(i)
    m = np.uint32(0x5BD1E995)
    for length, idxs in by_length.items():
        if len(idxs) < 16:
            for i in idxs:
                out[i] = kafka_partition(keys[i], partitions)
            continue
        data = np.frombuffer(b"".join([keys[i] for i in idxs]), dtype=np.uint8).reshape(len(idxs), length)
        h = np.full(len(idxs), (0x9747B28C ^ length) & _M32, dtype=np.uint32)
        tail = length & ~3
        words = data[:, :tail].copy().view("<u4")
        for w in range(tail // 4):
            k = words[:, w] * m
            k ^= k >> np.uint32(24)
            k *= m
            h *= m
            h ^= k
        rest = length & 3
        if rest == 3:
            h ^= data[:, tail + 2].astype(np.uint32) << np.uint32(16)
        if rest >= 2:
            h ^= data[:, tail + 1].astype(np.uint32) << np.uint32(8)
        if rest >= 1:
            h ^= data[:, tail].astype(np.uint32)
            h *= m
        h ^= h >> np.uint32(13)
        h *= m
        h ^= h >> np.uint32(15)
        for i, p in zip(idxs, ((h & np.uint32(0x7FFFFFFF)) % np.uint32(partitions)).tolist(), strict=True):
            out[i] = p
    return out


def _u64s(raw: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(raw) // 8}Q", raw)


def _json_object(path: Path) -> dict[str, object] | None:
    """The JSON object in ``path``, or None if there is no such file."""
    try:
        body = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    if not isinstance(body, dict):
        raise TimerwheelError(f"{path}: not a JSON object")
    return body


def _pread_exact(fd: int, size: int, position: int) -> bytes:
    data = os.pread(fd, size, position)
    if len(data) != size:
        raise OSError(errno.EIO, f"short read: {len(data)} of {size} bytes at {position}")
    return data


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


_packers = threading.local()


def _encode_bodies(records: Sequence[OutRecord], now_ms: int) -> list[tuple[int, bytes]]:
    """Everything of each frame but ``crc | offset`` (the offset is known only under the lock)."""
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True, autoreset=True)
    crc32, pack = zlib.crc32, packer.pack
    out = []
    for r in records:
        ts = now_ms if r.timestamp_ms is None else r.timestamp_ms
        body: bytes = pack((ts, r.key, r.value, r.headers))
        out.append((crc32(body), body))
    return out


_new_record = tuple.__new__  # Record(...) goes through a Python-level __new__: twice the cost


def _decode_run(blob: bytes, ends: list[int], topic: str, partition: int, offset: int) -> list[Record]:
    """The consecutive frames ending at ``ends`` in ``blob`` (the first at 0), offsets from
    ``offset`` on: ``_decode`` inlined, the embedded pipeline's hottest loop."""
    unpack_prefix, prefix, crc32, unpackb = _PREFIX.unpack_from, _PREFIX.size, zlib.crc32, msgpack.unpackb
    view = memoryview(blob)
    out = []
    pos = 0
    for end in ends:
        if end - pos > prefix:
            crc, stored = unpack_prefix(blob, pos)
            body = view[pos + prefix : end]
            if stored == offset and crc32(body) == crc:
                try:
                    ts, key, value, headers = unpackb(body, use_list=False)
                except (ValueError, TypeError, msgpack.UnpackException):
                    pass
                else:
                    out.append(_new_record(Record, (topic, partition, offset, ts, key, value, headers)))
                    pos = end
                    offset += 1
                    continue
        out.append(_decode(blob, pos, end, topic, partition, offset))  # raises, naming what is wrong
        pos = end
        offset += 1
    return out


def _decode(blob: bytes, pos: int, end: int, topic: str, partition: int, offset: int) -> Record:
    """The frame at ``blob[pos:end]``, checked against its CRC and the offset the index gave."""
    if end - pos <= _PREFIX.size:
        raise CorruptLogRecordError(topic, partition, offset, f"frame of {end - pos} bytes is too short")
    crc, stored_offset = _PREFIX.unpack_from(blob, pos)
    if stored_offset != offset:
        raise CorruptLogRecordError(topic, partition, offset, f"frame says offset {stored_offset}")
    body = memoryview(blob)[pos + _PREFIX.size : end]
    if zlib.crc32(body) != crc:
        raise CorruptLogRecordError(topic, partition, offset, "CRC mismatch")
    try:
        timestamp_ms, key, value, headers = msgpack.unpackb(body, use_list=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:  # only a writer bug gets past the CRC
        raise CorruptLogRecordError(topic, partition, offset, f"undecodable body: {e}") from e
    return Record(topic, partition, offset, timestamp_ms, key, value, headers)


class _Segment:
    """Open file descriptors of one segment; they close when the last holder lets go."""

    __slots__ = ("base", "log_fd", "idx_fd", "_finalizer", "__weakref__")

    def __init__(self, directory: Path, base: int, *, create: bool = False) -> None:
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        self.base = base
        self.log_fd = os.open(directory / f"{base:020d}.log", flags, FILE_MODE)
        try:
            self.idx_fd = os.open(directory / f"{base:020d}.idx", flags, FILE_MODE)
        except BaseException:
            os.close(self.log_fd)
            raise
        # Readers in other threads may still hold this segment after retention dropped it.
        self._finalizer = weakref.finalize(self, _close_fds, self.log_fd, self.idx_fd)

    def entries(self) -> int:
        return os.fstat(self.idx_fd).st_size // 8

    def deleted(self) -> bool:
        return os.fstat(self.idx_fd).st_nlink == 0

    def close(self) -> None:
        self._finalizer()


class _Partition:
    """One partition's segments: the reader's view, and the appender's work under the lock."""

    def __init__(self, log: LocalCommitLog, topic: str, number: int) -> None:
        self.topic = topic
        self.number = number
        self.dir = log.directory / topic / str(number)
        self._segment_bytes = log.segment_bytes
        self._fsync = log.fsync
        self.write_lock = threading.Lock()
        self._view_lock = threading.Lock()
        self._bases: list[int] = []
        self._open: dict[int, _Segment] = {}
        self._closed = False
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, FILE_MODE)
        with self.locked():
            self._recover()

    # -- reader's view ------------------------------------------------------------------

    def _refresh(self) -> None:
        """Re-list segments (another process may have rolled or deleted some). View lock held."""
        logs, idxs = set(), set()
        for name in os.listdir(self.dir):
            stem, _, ext = name.partition(".")
            if ext == "log" and stem.isdigit():
                logs.add(int(stem))
            elif ext == "idx" and stem.isdigit():
                idxs.add(int(stem))
        self._bases = sorted(logs & idxs)
        for base in [b for b in self._open if b not in idxs]:
            del self._open[base]

    def _may_have_rolled(self) -> bool:
        """Could another segment have appeared since the last listing? Only once the last one is
        full (a writer rolls then) or was deleted (retention): two fstats instead of a listdir.
        View lock held."""
        if not self._bases:
            return True
        seg = self._open.get(self._bases[-1])
        if seg is None:
            return True
        st = os.fstat(seg.log_fd)
        return st.st_size >= self._segment_bytes or st.st_nlink == 0

    def _segment(self, base: int) -> _Segment | None:
        """View lock held."""
        seg = self._open.get(base)
        if seg is None:
            if self._closed:
                raise TimerwheelError(f"{self.topic}/{self.number}: the LocalCommitLog was closed")
            try:
                seg = _Segment(self.dir, base)
            except FileNotFoundError:
                return None
            self._open[base] = seg
        return seg

    def _locate(self, offset: int) -> tuple[_Segment, int] | None:
        """The segment holding ``offset`` and its record count, or None if ``offset`` is not
        held (below the start or at/after the end). View lock held."""
        for attempt in range(2):
            i = bisect.bisect_right(self._bases, offset) - 1
            if i >= 0:
                base = self._bases[i]
                seg = self._segment(base)
                if seg is not None:
                    last = i == len(self._bases) - 1
                    count = seg.entries() if last else self._bases[i + 1] - base
                    if offset < base + count:
                        return seg, count
            if attempt == 0:
                if not self._may_have_rolled():
                    return None
                self._refresh()
        return None

    def start(self) -> int:
        with self._view_lock:
            self._refresh()
            return self._bases[0] if self._bases else 0

    def end(self) -> int:
        with self._view_lock:
            if self._may_have_rolled():
                self._refresh()
            if not self._bases:
                return 0
            seg = self._segment(self._bases[-1])
            return self._bases[-1] + (seg.entries() if seg else 0)

    def read_from(self, offset: int, max_records: int) -> tuple[list[Record], int, int]:
        """Records from ``offset`` on (at least one if any, at most ``max_records`` and about
        ``_MAX_FETCH_BYTES``), the offset to go on from and the bytes read. An offset below the
        start moves to the start, as a Kafka consumer with ``auto.offset.reset=earliest`` does."""
        with self._view_lock:
            found = self._locate(offset)
            if found is None and self._bases and offset < self._bases[0]:
                offset = self._bases[0]
                found = self._locate(offset)
        if found is None:
            return [], offset, 0
        seg, count = found
        rel = offset - seg.base
        n = min(max_records, count - rel)
        if rel == 0:
            ends = _u64s(_pread_exact(seg.idx_fd, n * 8, 0))
            start = 0
        else:
            raw = _u64s(_pread_exact(seg.idx_fd, (n + 1) * 8, (rel - 1) * 8))
            start, ends = raw[0] & _POS_MASK, raw[1:]
        limit = start + _MAX_FETCH_BYTES
        take = 1
        while take < n and ends[take] & _POS_MASK <= limit:
            take += 1
        stop = ends[take - 1] & _POS_MASK
        blob = _pread_exact(seg.log_fd, stop - start, start)
        return _decode_run(blob, [(e & _POS_MASK) - start for e in ends[:take]], self.topic, self.number,
                           offset), offset + take, stop - start

    def read_offsets(self, offsets: Sequence[int]) -> dict[int, Record]:
        """Records at the sorted, distinct ``offsets`` that are held."""
        by_segment: list[tuple[_Segment, list[int]]] = []
        with self._view_lock:
            i = 0
            while i < len(offsets):
                found = self._locate(offsets[i])
                if found is None:
                    if not self._bases or offsets[i] >= self._bases[0]:
                        break  # at or past the end, and so are the rest
                    i = bisect.bisect_left(offsets, self._bases[0], i)  # below the start: gone
                    continue
                seg, count = found
                j = bisect.bisect_left(offsets, seg.base + count, i)
                by_segment.append((seg, [o - seg.base for o in offsets[i:j]]))
                i = j
            if any(seg.deleted() for seg, _ in by_segment):  # retention ran in another process
                self._refresh()
                by_segment = [(seg, rels) for seg, rels in by_segment if seg.base in self._open]
        out: dict[int, Record] = {}
        for seg, rels in by_segment:
            self._read_sparse(seg, rels, out)
        return out

    def _read_sparse(self, seg: _Segment, rels: list[int], out: dict[int, Record]) -> None:
        """Clusters of nearby offsets share one index pread; frames close together one data pread."""
        i = 0
        while i < len(rels):
            j = i + 1
            while j < len(rels) and rels[j] - rels[j - 1] <= _INDEX_GAP:
                j += 1
            first, last = rels[i], rels[j - 1]
            if first == 0:
                entries = (0, *_u64s(_pread_exact(seg.idx_fd, (last + 1) * 8, 0)))
            else:
                entries = _u64s(_pread_exact(seg.idx_fd, (last - first + 2) * 8, (first - 1) * 8))
            spans = [
                (entries[r - first] & _POS_MASK, entries[r - first + 1] & _POS_MASK, seg.base + r)
                for r in rels[i:j]
            ]
            k = 0
            while k < len(spans):
                m = k + 1
                while m < len(spans) and spans[m][0] - spans[m - 1][1] <= _DATA_GAP_BYTES:
                    m += 1
                lo, hi = spans[k][0], spans[m - 1][1]
                blob = _pread_exact(seg.log_fd, hi - lo, lo)
                for start, end, offset in spans[k:m]:
                    out[offset] = _decode(blob, start - lo, end - lo, self.topic, self.number, offset)
                k = m
            i = j

    # -- appender's work, under ``locked()`` --------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with self.write_lock:
            if self._closed:
                raise TimerwheelError(f"{self.topic}/{self.number}: the LocalCommitLog was closed")
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _create_segment(self, base: int) -> _Segment:
        seg = _Segment(self.dir, base, create=True)
        # A roll torn by a crash may have left a stray file under this name; it holds nothing.
        os.ftruncate(seg.log_fd, 0)
        os.ftruncate(seg.idx_fd, 0)
        if self._fsync:
            fsync_dir(self.dir)
        with self._view_lock:
            self._open[base] = seg
            self._refresh()
        return seg

    def _tail(self) -> tuple[_Segment, int, int]:
        """Last segment, its record count and .log end, after cutting a torn tail; rolls a
        full segment. Lock held."""
        with self._view_lock:
            self._refresh()
            seg = self._segment(self._bases[-1]) if self._bases else None
        if seg is None:
            seg = self._create_segment(0)
        idx_size = os.fstat(seg.idx_fd).st_size
        count = idx_size // 8
        if idx_size % 8:
            os.ftruncate(seg.idx_fd, count * 8)
        end = _u64s(_pread_exact(seg.idx_fd, 8, (count - 1) * 8))[0] & _POS_MASK if count else 0
        log_size = os.fstat(seg.log_fd).st_size
        if log_size < end:  # only after a power loss with fsync=False: let recovery decide
            self._recover()
            return self._tail()
        if log_size > end:
            os.ftruncate(seg.log_fd, end)
        if count and end >= self._segment_bytes:
            if self._fsync:
                os.fdatasync(seg.log_fd)
                os.fdatasync(seg.idx_fd)
            seg = self._create_segment(seg.base + count)
            count, end = 0, 0
        return seg, count, end

    def write(self, bodies: Sequence[tuple[int, bytes]]) -> tuple[_Segment, int]:
        """Write pre-encoded frames (not synced); return the segment and the first offset. Lock held."""
        seg, count, end = self._tail()
        first = seg.base + count
        parts: list[bytes] = []
        ends: list[int] = []
        pos = end
        for i, (crc, body) in enumerate(bodies):
            parts += (_PREFIX.pack(crc, first + i), body)
            pos += _PREFIX.size + len(body)
            ends.append(pos)
        ends[-1] |= _BATCH_END
        pwrite_all(seg.log_fd, memoryview(b"".join(parts)), end)
        pwrite_all(seg.idx_fd, memoryview(struct.pack(f"<{len(ends)}Q", *ends)), count * 8)
        return seg, first

    def _recover(self) -> None:
        """Cut what a power loss tore at the tail (see the module header). Lock held.

        Suspect are the records after the second-to-last batch-end mark: the last batch, and
        any entries of a batch whose index write was cut short (their mark never landed). Of
        those the intact prefix stays: a reader may already have seen them, so an offset is
        never taken back unless its frame is damaged."""
        with self._view_lock:
            self._refresh()
            seg = self._segment(self._bases[-1]) if self._bases else None
        if seg is None:
            return
        idx_size = os.fstat(seg.idx_fd).st_size
        raw = np.frombuffer(_pread_exact(seg.idx_fd, idx_size // 8 * 8, 0), dtype="<u8")
        log_size = os.fstat(seg.log_fd).st_size
        ends = (raw & np.uint64(_POS_MASK)).astype(np.int64)
        before = np.concatenate((np.zeros(1, dtype=np.int64), ends[:-1]))
        bad = (ends > log_size) | (ends <= before)
        keep = int(np.argmax(bad)) if bad.any() else len(raw)
        marks = np.flatnonzero(raw[:keep] & np.uint64(_BATCH_END))
        suspect = int(marks[-2]) + 1 if len(marks) > 1 else 0
        if keep > suspect:
            lo = int(before[suspect])
            blob = _pread_exact(seg.log_fd, int(ends[keep - 1]) - lo, lo)
            for i in range(suspect, keep):
                try:
                    _decode(
                        blob, int(before[i]) - lo, int(ends[i]) - lo, self.topic, self.number, seg.base + i
                    )
                except CorruptLogRecordError:
                    keep = i
                    break
        end = int(ends[keep - 1]) if keep else 0
        changed = False
        if idx_size != keep * 8:
            os.ftruncate(seg.idx_fd, keep * 8)
            changed = True
        if keep and not raw[keep - 1] & np.uint64(_BATCH_END):  # so the next recovery starts here
            pwrite_all(seg.idx_fd, memoryview(struct.pack("<Q", end | _BATCH_END)), (keep - 1) * 8)
            changed = True
        if log_size > end:
            os.ftruncate(seg.log_fd, end)
            changed = True
        if changed and self._fsync:
            os.fdatasync(seg.idx_fd)
            os.fdatasync(seg.log_fd)

    def delete_before(self, offset: int) -> int:
        """Delete every segment whose records are all below ``offset``. Lock held."""
        seg, count, _ = self._tail()
        if count and seg.base + count <= offset:
            self._create_segment(seg.base + count)
        with self._view_lock:
            self._refresh()
            bases = list(self._bases)
        for base, next_base in itertools.pairwise(bases):
            if next_base > offset:
                break
            for ext in ("idx", "log"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.dir / f"{base:020d}.{ext}")
        if self._fsync:
            fsync_dir(self.dir)
        return self.start()

    def expire(self, cutoff_ms: int) -> int:
        """Delete the oldest segments whose newest record is stamped before ``cutoff_ms`` (never
        the last segment); returns how many went. Lock held."""
        with self._view_lock:
            self._refresh()
            bases = list(self._bases)
        keep_from = None
        for _base, next_base in itertools.pairwise(bases):
            newest = self.read_offsets([next_base - 1]).get(next_base - 1)
            if newest is None or newest.timestamp_ms >= cutoff_ms:
                break
            keep_from = next_base
        if keep_from is None:
            return 0
        self.delete_before(keep_from)
        return bases.index(keep_from)

    def close(self) -> None:
        self._closed = True
        with self._view_lock:
            for seg in self._open.values():
                seg.close()
            self._open.clear()
        _close_fds(self._lock_fd)


def commit_log_dir(directory: str | os.PathLike[str]) -> Path:
    """The commit log's directory for ``directory``: an embedded timerwheel's data directory
    (it holds ``log/`` that is not a topic, or shard directories) keeps its log in ``<dir>/log``, so
    ``LocalCommitLog("./data")`` is the log the service in ./data reads; any other directory is
    the log itself. (Taking the data directory as the log used to wait forever on its ``.lock``,
    which the running service holds.)"""
    path = Path(directory)
    log_dir = path / "log"
    if log_dir.is_dir() and not (log_dir / "topic.json").exists():
        return log_dir
    if holds_shards(path):
        return log_dir
    return path


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
        read_cache_records: int = 100_000,
        read_cache_bytes: int = 64 * 1024 * 1024,
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
        self._partitions: dict[tuple[str, int], _Partition] = {}
        self._round_robin: dict[str, Iterator[int]] = {}
        self._closed = False
        #: followed topic -> records its consumers in this process read, for ``read`` (see ``follow``).
        self._cache: dict[str, _ReadCache] = {}
        self._read_cache_records = read_cache_records
        self._read_cache_bytes = read_cache_bytes

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
        if not TOPIC_NAME.fullmatch(topic) or topic in (".", ".."):
            raise InvalidTopicError(f"invalid topic name {topic!r}: Kafka allows 1..249 of [A-Za-z0-9._-]")
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
        if not TOPIC_NAME.fullmatch(topic) or topic in (".", ".."):
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

    def _partition(self, topic: str, partition: int) -> _Partition:
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
                    part = self._partitions[(topic, partition)] = _Partition(self, topic, partition)
        return part

    # -- writing ------------------------------------------------------------------------

    def append(self, records: Sequence[OutRecord]) -> list[tuple[int, int]]:
        if not records:
            return []
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
        bodies = _encode_bodies(records, self._clock.now_ms())
        order = sorted(groups)  # one global lock order: no deadlock between processes
        parts = [self._partition(t, p) for t, p in order]
        result: list[tuple[int, int]] = [(0, 0)] * len(records)
        with contextlib.ExitStack() as held:
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

    def delete_before(self, topic: str, partition: int, offset: int) -> int:
        """Retention: delete whole segments below ``offset``; return the new start offset.
        Offsets in the rest of the segment that holds ``offset`` stay readable."""
        part = self._partition(topic, partition)
        with part.locked():
            return part.delete_before(offset)

    def expire(self, now_ms: int, retention_ms: int) -> int:
        """Retention by time over every topic: delete whole segments whose newest record is older
        than ``retention_ms`` (as Kafka's ``retention.ms``); returns the segments deleted."""
        deleted = 0
        for meta in sorted(self.directory.glob("*/topic.json")):
            topic = meta.parent.name
            for p in range(self.partitions(topic)):
                part = self._partition(topic, p)
                with part.locked():
                    deleted += part.expire(now_ms - retention_ms)
        return deleted

    # -- reading ------------------------------------------------------------------------

    def follow(self, topic: str) -> None:
        """Keep what this process's consumers of ``topic`` read (the last ``read_cache_records``,
        at most ``read_cache_bytes`` of memory), so that ``read`` serves those records from memory: in
        embedded mode dequeue-getmsg finds a short delay's record where enqueue-get left it,
        instead of reading and decoding it a second time. A record leaves the cache when served."""
        if self._read_cache_records > 0 and topic not in self._cache:
            self._cache[topic] = _ReadCache(self._read_cache_records, self._read_cache_bytes)

    def read(self, topic: str, positions: Sequence[tuple[int, int]]) -> list[Record | None]:
        count = self.partitions(topic)
        cache = self._cache.get(topic)
        hits = cache.take(positions) if cache is not None else {}
        if len(hits) < len(positions):  # else every position was in memory (and none repeated)
            wanted: dict[int, set[int]] = {}
            for p, o in positions:
                if 0 <= p < count and o >= 0 and (p, o) not in hits:
                    wanted.setdefault(p, set()).add(o)
            for p, offs in wanted.items():
                for o, rec in self._partition(topic, p).read_offsets(sorted(offs)).items():
                    hits[(p, o)] = rec
        return list(map(hits.get, positions))

    def consumer(self, topic: str, offsets: Mapping[int, int]) -> LocalConsumer:
        return LocalConsumer(self, topic, offsets)

    def group_consumer(self, group: str, topics: Sequence[str],
                       options: Mapping[str, object] | None = None) -> LocalGroupConsumer:
        """The one member of consumer group ``group`` reading ``topics`` (``GroupConsumer``); the
        group's offsets live in ``GROUPS_DIR`` beside the topics. The local log takes no options."""
        if options:
            raise ValueError(f"group {group!r}: the local log takes no consumer options, got {sorted(options)}")
        return LocalGroupConsumer(self, group, topics)

    def end_offsets(self, topic: str) -> dict[int, int]:
        return {p: self._partition(topic, p).end() for p in range(self.partitions(topic))}

    def start_offsets(self, topic: str) -> dict[int, int]:
        return {p: self._partition(topic, p).start() for p in range(self.partitions(topic))}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            parts, self._partitions = list(self._partitions.values()), {}
        for part in parts:
            with part.write_lock:
                part.close()


#: Memory a cached record takes beyond its frame: the Record, its header tuples and the
#: cache's own entry (measured: ~970 bytes a record of 150 frame bytes).
_CACHED_RECORD_OVERHEAD = 800


class _Block:
    """Records a consumer read in one go: consecutive offsets of one partition from ``first``.
    A record served by ``take`` becomes None; ``live`` counts the others."""

    __slots__ = ("partition", "first", "end", "records", "size", "live")

    def __init__(self, partition: int, first: int, records: list[Record | None], size: int) -> None:
        self.partition = partition
        self.first = first
        self.end = first + len(records)
        self.records = records
        self.size = size
        self.live = len(records)


class _ReadCache:
    """Records by (partition, offset), kept a consumer's batch at a time (a block: no Python
    step per record on the consumer's side), oldest blocks evicted first past either bound
    (``max_bytes`` counts each record's frame plus ``_CACHED_RECORD_OVERHEAD``: it bounds the
    memory); a record leaves when served. Thread-safe (a consumer thread keeps, a reader takes)."""

    def __init__(self, max_records: int, max_bytes: int) -> None:
        self.max_records = max_records
        self.max_bytes = max_bytes
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # by id(), oldest first
        #: partition -> its blocks by first offset (a consumer reads forward; a seek back may
        #: overlap an older block, whose records are then found only if the newer one misses)
        self._by_partition: dict[int, list[_Block]] = {}
        self.records = 0
        self.bytes = 0
        self.lock = threading.Lock()

    def keep(self, partition: int, first_offset: int, records: list[Record], frame_bytes: int) -> None:
        """Keep ``records``: consecutive offsets of one partition from ``first_offset`` on."""
        block = _Block(partition, first_offset, list(records), frame_bytes // len(records) + _CACHED_RECORD_OVERHEAD)
        with self.lock:
            self._blocks[id(block)] = block
            blocks = self._by_partition.setdefault(partition, [])
            if blocks and blocks[-1].first > first_offset:
                bisect.insort(blocks, block, key=_FIRST)
            else:
                blocks.append(block)
            self.records += block.live
            self.bytes += block.live * block.size
            while self.records > self.max_records or self.bytes > self.max_bytes:
                self._drop(self._blocks.popitem(last=False)[1])

    def _drop(self, block: _Block) -> None:
        """Forget ``block`` (already out of ``_blocks``). Lock held."""
        self.records -= block.live
        self.bytes -= block.live * block.size
        block.live = 0
        self._by_partition[block.partition].remove(block)

    def take(self, positions: Sequence[tuple[int, int]]) -> dict[tuple[int, int], Record]:
        out: dict[tuple[int, int], Record] = {}
        with self.lock:
            block: _Block | None = None
            for pos in positions:
                p, o = pos
                if block is None or block.partition != p or not block.first <= o < block.end:
                    blocks = self._by_partition.get(p)
                    if not blocks:
                        continue
                    i = bisect.bisect_right(blocks, o, key=_FIRST) - 1
                    if i < 0 or o >= blocks[i].end:
                        continue
                    block = blocks[i]
                rec = block.records[o - block.first]
                if rec is not None:
                    out[pos] = rec
                    block.records[o - block.first] = None
                    block.live -= 1
                    self.records -= 1
                    self.bytes -= block.size
                    if not block.live:
                        del self._blocks[id(block)]
                        self._drop(block)
                        block = None
        return out

    def positions(self) -> list[tuple[int, int]]:
        """What is held, oldest block first (tests and inspection)."""
        with self.lock:
            return [(b.partition, b.first + k) for b in self._blocks.values() for k, r in enumerate(b.records)
                    if r is not None]


_FIRST = operator.attrgetter("first")


class LocalConsumer:
    """Consumer of some partitions of one LocalCommitLog topic; one thread at a time."""

    def __init__(self, log: LocalCommitLog, topic: str, offsets: Mapping[int, int]) -> None:
        for p, o in offsets.items():
            if o < 0:
                raise ValueError(f"consumer of {topic!r}: offset for partition {p} must be >= 0, got {o}")
        self.topic = topic
        self._parts = {p: log._partition(topic, p) for p in offsets}
        self._caches = log._cache  # a followed topic's reads are kept for ``read``
        self._positions = dict(offsets)
        self._order = sorted(offsets)
        self._turn = 0
        self._closed = False

    def poll(self, max_records: int, timeout_s: float) -> list[Record]:
        # Waiting is real time whatever the Clock: a simulated clock must not stall a poll.
        deadline = time.monotonic() + timeout_s
        while not self._closed and max_records > 0 and self._order:
            records = self._fetch(max_records)
            if records:
                return records
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            time.sleep(min(_IDLE_SLEEP_S, remaining))
        return []

    def _fetch(self, max_records: int) -> list[Record]:
        out: list[Record] = []
        cache = self._caches.get(self.topic)
        n = len(self._order)
        for k in range(n):  # start one partition further each poll, so none starves
            p = self._order[(self._turn + k) % n]
            while len(out) < max_records:
                records, self._positions[p], frame_bytes = self._parts[p].read_from(
                    self._positions[p], max_records - len(out))
                if not records:
                    break
                if cache is not None:
                    cache.keep(p, records[0].offset, records, frame_bytes)
                out += records
        self._turn = (self._turn + 1) % n
        return out

    def seek(self, partition: int, offset: int) -> None:
        if partition not in self._positions:
            raise ValueError(f"consumer of {self.topic!r} is not assigned partition {partition}")
        if offset < 0:
            raise ValueError(f"seek {self.topic!r}/{partition}: offset must be >= 0, got {offset}")
        self._positions[partition] = offset

    def position(self, partition: int) -> int:
        if partition not in self._positions:
            raise ValueError(f"consumer of {self.topic!r} is not assigned partition {partition}")
        return self._positions[partition]

    def close(self) -> None:
        self._closed = True


#: Consumer groups' offsets, beside the topics: ``@`` is in no topic name, so no topic collides.
GROUPS_DIR = "@groups"


class LocalGroupConsumer:
    """``GroupConsumer`` on the local log: a group has one member at a time (it holds
    ``<GROUPS_DIR>/<group>.lock``; a second is refused, a killed one lets go at once) that reads
    every partition of its topics. ``commit`` replaces ``<group>.json`` atomically
    (``{"format": 1, "offsets": {topic: {partition: next offset}}}``); a new group starts at the
    earliest offsets."""

    def __init__(self, log: LocalCommitLog, group: str, topics: Sequence[str]) -> None:
        if not TOPIC_NAME.fullmatch(group) or group in (".", ".."):
            raise InvalidTopicError(f"invalid group name {group!r}: the local log allows 1..249 of [A-Za-z0-9._-]")
        self.group = group
        directory = log.directory / GROUPS_DIR
        directory.mkdir(exist_ok=True)
        self._path = directory / f"{group}.json"
        self._fsync = log.fsync
        self._lock_fd = os.open(directory / f"{group}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise TimerwheelError(f"consumer group {group!r} of {log.directory} has a member already "
                                  "(the local log allows one per group)") from None
        try:
            saved = json.loads(self._path.read_text())["offsets"] if self._path.exists() else {}
            self._committed: dict[str, dict[str, int]] = {t: dict(saved.get(t, {})) for t in saved}
            self._consumers = [
                log.consumer(t, {p: max(int(self._committed.get(t, {}).get(str(p), 0)), start)
                                 for p, start in log.start_offsets(t).items()})
                for t in dict.fromkeys(topics)
            ]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            os.close(self._lock_fd)
            raise TimerwheelError(f"consumer group {group!r}: cannot read {self._path}: {exc}") from None
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._turn = 0

    def poll(self, max_records: int, timeout_s: float) -> list[Record]:
        deadline = time.monotonic() + timeout_s
        n = len(self._consumers)
        while True:
            out: list[Record] = []
            for k in range(n):  # a different topic first each time, so none starves
                if len(out) < max_records:
                    out += self._consumers[(self._turn + k) % n].poll(max_records - len(out), 0.0)
            self._turn = (self._turn + 1) % max(n, 1)
            remaining = deadline - time.monotonic()
            if out or remaining <= 0:
                return out
            time.sleep(min(_IDLE_SLEEP_S, remaining))

    def commit(self, offsets: Mapping[tuple[str, int], int]) -> None:
        for (topic, partition), offset in offsets.items():
            self._committed.setdefault(topic, {})[str(partition)] = offset
        body = json.dumps({"format": FORMAT_VERSION, "offsets": self._committed}, sort_keys=True).encode()
        try:
            atomic_write(str(self._path), body, fsync=self._fsync)
        except OSError as exc:
            raise TimerwheelError(f"commit of group {self.group!r} to {self._path} failed: {exc}") from exc

    def close(self) -> None:
        for consumer in self._consumers:
            consumer.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1
