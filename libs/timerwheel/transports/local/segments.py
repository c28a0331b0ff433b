"""One partition of the local log: its segment files, read by any thread or process, appended
to under a lock, recovered after a crash, deleted by retention.

A partition is a directory of segments: ``<base:020d>.log`` holds record frames back to back
(``frames``) and ``<base:020d>.idx`` one u64 per offset, the END position of its frame in .log
(bit 63 marks the last record of an append batch); ``lock`` is the appenders' flock. A segment
holds the dense offsets ``base, base+1, ...``; record ``i`` of a segment occupies
``[end[i-1], end[i])`` of its .log (``end[-1]`` = 0), so a lookup is one ``pread`` of the index.

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
import os
import struct
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from timerwheel.errors import TimerwheelError
from timerwheel.files import FILE_MODE, fsync_dir, pwrite_all
from timerwheel.records import Record
from timerwheel.transports.local.frames import PREFIX, CorruptLogRecordError, decode, decode_run

__all__ = ["DEFAULT_SEGMENT_BYTES", "PartitionLog", "SegmentFiles"]

DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024
_BATCH_END = 1 << 63
#: A directory modified this recently may have changed again within the same timestamp (file
#: systems stamp with a coarse clock): its unchanged mtime proves nothing then (``_dir_changed``).
_RACY_MTIME_NS = 2_000_000_000
_POS_MASK = _BATCH_END - 1
_MAX_FETCH_BYTES = 8 * 1024 * 1024
#: Sparse reads: offsets this close share one index pread, frames this close one data pread.
_INDEX_GAP = 512
_DATA_GAP_BYTES = 64 * 1024


def _u64s(raw: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(raw) // 8}Q", raw)


def _pread_exact(fd: int, size: int, position: int) -> bytes:
    data = os.pread(fd, size, position)
    if len(data) != size:
        raise OSError(errno.EIO, f"short read: {len(data)} of {size} bytes at {position}")
    return data


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)



class SegmentFiles:
    """Open file descriptors of one segment's .log and .idx; they close when the last holder lets go."""

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


class PartitionLog:
    """One partition's segments (in ``directory``): the reader's view, and the appender's work
    under the lock."""

    def __init__(self, directory: Path, topic: str, number: int, *, segment_bytes: int, fsync: bool) -> None:
        self.topic = topic
        self.number = number
        self.dir = directory
        self._segment_bytes = segment_bytes
        self._fsync = fsync
        self.write_lock = threading.Lock()
        self._view_lock = threading.Lock()
        self._bases: list[int] = []
        #: The directory's mtime when it was last listed (``_dir_changed``).
        self._listed_mtime_ns = -1
        self._open: dict[int, SegmentFiles] = {}
        self._closed = False
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, FILE_MODE)
        with self.locked():
            self._recover()

    # -- reader's view ------------------------------------------------------------------

    def _refresh(self) -> None:
        """Re-list segments (another process may have rolled or deleted some). View lock held."""
        self._listed_mtime_ns = os.stat(self.dir).st_mtime_ns  # before: a change after it is seen next time
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
            return self._dir_changed()  # a partition nobody wrote yet: one stat, not a listing
        seg = self._open.get(self._bases[-1])
        if seg is None:
            return True
        st = os.fstat(seg.log_fd)
        return st.st_size >= self._segment_bytes or st.st_nlink == 0

    def _dir_changed(self) -> bool:
        """Could a segment have been created or removed since the last listing? Its directory's
        mtime moved, or is too recent to tell (``_RACY_MTIME_NS``). View lock held."""
        mtime = os.stat(self.dir).st_mtime_ns
        return mtime != self._listed_mtime_ns or time.time_ns() - mtime < _RACY_MTIME_NS

    def _segment(self, base: int) -> SegmentFiles | None:
        """View lock held."""
        seg = self._open.get(base)
        if seg is None:
            if self._closed:
                raise TimerwheelError(f"{self.topic}/{self.number}: the LocalCommitLog was closed")
            try:
                seg = SegmentFiles(self.dir, base)
            except FileNotFoundError:
                return None
            self._open[base] = seg
        return seg

    def _locate(self, offset: int) -> tuple[SegmentFiles, int] | None:
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
        return decode_run(blob, [(e & _POS_MASK) - start for e in ends[:take]], self.topic, self.number,
                           offset), offset + take, stop - start

    def read_offsets(self, offsets: Sequence[int]) -> dict[int, Record]:
        """Records at the sorted, distinct ``offsets`` that are held."""
        by_segment: list[tuple[SegmentFiles, list[int]]] = []
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

    def _read_sparse(self, seg: SegmentFiles, rels: list[int], out: dict[int, Record]) -> None:
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
                    out[offset] = decode(blob, start - lo, end - lo, self.topic, self.number, offset)
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

    def _create_segment(self, base: int) -> SegmentFiles:
        seg = SegmentFiles(self.dir, base, create=True)
        # A roll torn by a crash may have left a stray file under this name; it holds nothing.
        os.ftruncate(seg.log_fd, 0)
        os.ftruncate(seg.idx_fd, 0)
        if self._fsync:
            fsync_dir(self.dir)
        with self._view_lock:
            self._open[base] = seg
            self._refresh()
        return seg

    def _tail(self) -> tuple[SegmentFiles, int, int]:
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

    def tail_offset(self) -> int:
        """The offset the next record takes (a torn tail cut first). Lock held."""
        seg, count, _ = self._tail()
        return seg.base + count

    def write(self, bodies: Sequence[tuple[int, bytes]]) -> tuple[SegmentFiles, int]:
        """Write pre-encoded frames (not synced); return the segment and the first offset. Lock held."""
        seg, count, end = self._tail()
        first = seg.base + count
        parts: list[bytes] = []
        ends: list[int] = []
        pos = end
        for i, (crc, body) in enumerate(bodies):
            parts += (PREFIX.pack(crc, first + i), body)
            pos += PREFIX.size + len(body)
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
                    decode(
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

