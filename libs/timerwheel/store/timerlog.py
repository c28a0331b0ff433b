"""TimerLog: append-only segments of fixed-size records (the RIP-43 TimerLog).

A position is a byte offset into the whole log, a multiple of RECORD_SIZE (64). Segment files
hold ``segment_bytes`` each and are named by their base position (``00000000000067108864.tlog``),
so a position alone says which file holds it. Only the writer appends, at the end; a record is
never changed in place.

Guarantees: when ``flush()`` returns P, every byte below P is on disk (fdatasync of every segment
written since the previous flush, fsync of the directory when a segment was created or deleted).
Assumes: one writer per directory (the Shard holds a lock); readers open ``readonly`` and read only
below a position the writer published.

Opening as the writer repairs what a crash can leave in the file layout itself:

- a partial record at the end of the last segment (a torn write) is cut off (``trimmed_bytes``);
- a segment before the last that is shorter than ``segment_bytes`` (its unflushed tail was lost
  while the next segment's survived) is padded with zeros, which no record check accepts, so
  recovery reports those positions instead of reading past them.

Whole records that fail their CRC are recovery's business (recovery.py), not the log's.
"""

from __future__ import annotations

import logging
import os
import re
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt

from timerwheel.errors import ConfigError, CorruptRecordError, FormatMismatchError, TimerwheelError
from timerwheel.files import FILE_MODE, fsync_dir, pwrite_all
from timerwheel.store.format import (
    RECORD_DTYPE,
    RECORD_SIZE,
    RecordArray,
    TimerRecord,
    pack_records,
    records_from_array,
    seal,
    unpack_record,
    valid_mask,
    why_invalid,
)
from timerwheel.store.fresh import DirectFile, drop_cached

log = logging.getLogger(__name__)

SEGMENT_SUFFIX = ".tlog"
_SEGMENT_NAME = re.compile(r"^(\d{20})\.tlog$")
_MAX_READ_FDS = 32
#: Records per chunk for bulk reads: 4 MiB, big enough to amortise the Python overhead.
CHUNK_RECORDS = 65536


class TimerLog:
    """Append-only fixed-size 64-byte records in segment files named by base position."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        segment_bytes: int,
        fsync: bool = True,
        readonly: bool = False,
    ) -> None:
        if segment_bytes <= 0 or segment_bytes % RECORD_SIZE:
            raise ConfigError("segment_bytes", f"must be a positive multiple of {RECORD_SIZE}, got {segment_bytes}")
        self.directory = os.fspath(directory)
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self.readonly = readonly
        #: Bytes of a partial trailing record cut off when the writer opened the log.
        self.trimmed_bytes = 0
        self._read_fds: OrderedDict[int, int] = OrderedDict()
        self._write_fd = -1
        self._write_base = -1
        self._bases: list[int] = []
        self._end = 0
        self._flushed = 0
        self._dir_dirty = False
        #: Reader: records below this position were read valid past the page cache (Shard.refresh);
        #: a cached read of them that comes back short or invalid is a stale page, read again fresh.
        self.fresh_end = 0
        self._direct: dict[int, DirectFile] = {}
        if readonly:
            if not os.path.isdir(self.directory):
                raise TimerwheelError(f"no TimerLog directory at {self.directory}")
            self._check_layout(self._scan())
        else:
            os.makedirs(self.directory, exist_ok=True)
            self._open_writer()

    # ---------------------------------------------------------------- layout

    def _path(self, base: int) -> str:
        return os.path.join(self.directory, f"{base:020d}{SEGMENT_SUFFIX}")

    def segment_path(self, base: int) -> str:
        """The file of the segment starting at position ``base``."""
        return self._path(base)

    def forget_cached(self) -> None:
        """Reader: close the cached descriptors, drop their cached pages and ``fresh_end``."""
        for fd in self._read_fds.values():
            drop_cached(fd)
            os.close(fd)
        self._read_fds.clear()
        self._close_direct()
        self.fresh_end = 0

    def _close_direct(self, below: int | None = None) -> None:
        for base in [b for b in self._direct if below is None or b < below]:
            self._direct.pop(base).close()

    def read_fresh(self, pos: int, length: int) -> bytes:
        """Up to ``length`` bytes at ``pos``, within one segment, past this node's page cache
        (``fresh.DirectFile``, kept open per segment: a few, the newest ones)."""
        base = pos - pos % self.segment_bytes
        direct = self._direct.get(base)
        if direct is None:
            try:
                direct = self._direct[base] = DirectFile(self._path(base))
            except FileNotFoundError:
                return b""
            self._close_direct(below=base - 4 * self.segment_bytes)
        return direct.pread(pos - base, length)

    def _stale(self, pos: int, length: int) -> bool:
        """A reader's cached read of [pos, pos + length) that failed may be stale (see fresh_end)."""
        return self.readonly and pos + length <= self.fresh_end

    def _read_fresh(self, pos: int, length: int) -> bytes:
        """[pos, pos + length) of one segment past the page cache; the cached pages dropped too."""
        base = pos - pos % self.segment_bytes
        fd = self._read_fds.get(base)
        if fd is not None:
            drop_cached(fd, pos - base, length)
        return self.read_fresh(pos, length)

    def _scan(self) -> list[tuple[int, int]]:
        """(base, size) of every segment file, by base."""
        found = []
        for name in os.listdir(self.directory):
            match = _SEGMENT_NAME.match(name)
            if match:
                found.append((int(match.group(1)), os.stat(os.path.join(self.directory, name)).st_size))
        return sorted(found)

    def _check_layout(self, segments: list[tuple[int, int]]) -> None:
        for base, size in segments:
            if base % self.segment_bytes or size > self.segment_bytes:
                raise FormatMismatchError(
                    f"TimerLog segment {self._path(base)} ({size} bytes) does not fit segment_bytes="
                    f"{self.segment_bytes}; was the log written with another segment size?"
                )
        for (base, _), (following, _) in zip(segments, segments[1:], strict=False):
            if following != base + self.segment_bytes:
                raise TimerwheelError(
                    f"TimerLog {self.directory} has a gap: segment {base} is followed by {following}, "
                    f"expected {base + self.segment_bytes}"
                )

    def _open_writer(self) -> None:
        segments = self._scan()
        self._check_layout(segments)
        for base, size in segments[:-1]:
            if size < self.segment_bytes:
                log.warning(
                    "TimerLog segment %s is %d bytes short of %d; padding with zeros (positions %d..%d "
                    "will be reported corrupt)", self._path(base), self.segment_bytes - size,
                    self.segment_bytes, base + size, base + self.segment_bytes,
                )
                os.truncate(self._path(base), self.segment_bytes)
        self._bases = [base for base, _ in segments]
        if segments:
            last_base, last_size = segments[-1]
            self.trimmed_bytes = last_size % RECORD_SIZE
            if self.trimmed_bytes:
                log.warning("TimerLog %s: cutting off a partial record of %d bytes at its end",
                            self._path(last_base), self.trimmed_bytes)
                os.truncate(self._path(last_base), last_size - self.trimmed_bytes)
            self._end = last_base + last_size - self.trimmed_bytes
            self._write_fd = os.open(self._path(last_base), os.O_RDWR)
            self._write_base = last_base
        # Nothing is known to be on disk yet: the first flush syncs every segment once.
        self._flushed = self.start_pos

    def segment_bases(self) -> list[int]:
        """Base positions of the segments held, oldest first."""
        if self.readonly:
            return [base for base, _ in self._scan()]
        return list(self._bases)

    @property
    def start_pos(self) -> int:
        """First position still held (segments before it were deleted by retention)."""
        bases = self.segment_bases()
        return bases[0] if bases else 0

    @property
    def end_pos(self) -> int:
        """Position the next record will be written at (readonly: as the files are now)."""
        if self.readonly:
            segments = self._scan()
            if not segments:
                return 0
            base, size = segments[-1]
            return base + size - size % RECORD_SIZE
        return self._end

    @property
    def flushed_pos(self) -> int:
        """Bytes below this position are on disk (writer only)."""
        return self._flushed

    # ---------------------------------------------------------------- file descriptors

    def _fd(self, base: int) -> int:
        if base == self._write_base:
            return self._write_fd
        fd = self._read_fds.get(base)
        if fd is not None:
            self._read_fds.move_to_end(base)
            return fd
        try:
            fd = os.open(self._path(base), os.O_RDONLY)
        except FileNotFoundError:
            raise IndexError(f"TimerLog {self.directory} holds no segment for positions from {base}") from None
        self._read_fds[base] = fd
        if len(self._read_fds) > _MAX_READ_FDS:
            os.close(self._read_fds.popitem(last=False)[1])
        return fd

    def _forget(self, base: int) -> None:
        fd = self._read_fds.pop(base, None)
        if fd is not None:
            os.close(fd)
        if base == self._write_base:
            os.close(self._write_fd)
            self._write_fd, self._write_base = -1, -1

    def _writable(self, base: int) -> int:
        if base == self._write_base:
            return self._write_fd
        fd = os.open(self._path(base), os.O_RDWR | os.O_CREAT, FILE_MODE)
        if not self._bases or self._bases[-1] < base:
            self._bases.append(base)
            self._dir_dirty = True
        if self._write_fd >= 0:
            os.close(self._write_fd)
        self._write_fd, self._write_base = fd, base
        return fd

    def _need_writer(self, what: str) -> None:
        if self.readonly:
            raise TimerwheelError(f"TimerLog {self.directory} is open read-only; cannot {what}")

    # ---------------------------------------------------------------- writing

    def append(self, records: Sequence[TimerRecord]) -> int:
        """Append records as given (prev_pos included); returns the position of the first."""
        arr = pack_records(records)
        seal(arr)
        return self.append_packed(arr)

    def append_packed(self, data: RecordArray | bytes | memoryview) -> int:
        """Append whole sealed records (a RECORD_DTYPE array or their bytes); returns the first position."""
        self._need_writer("append")
        view = data.view(np.uint8).reshape(-1).data if isinstance(data, np.ndarray) else memoryview(data)
        view = view.cast("B")
        if len(view) % RECORD_SIZE:
            raise ValueError(f"append of {len(view)} bytes is not a whole number of {RECORD_SIZE}-byte records")
        first = self._end
        try:
            while view:
                base = self._end - self._end % self.segment_bytes
                room = base + self.segment_bytes - self._end
                chunk, view = view[:room], view[room:]
                pwrite_all(self._writable(base), chunk, self._end - base)
                self._end += len(chunk)
        except OSError:
            # Leave the log as it was (no partial batch), so the caller may retry the whole batch.
            self._cut(first)
            raise
        return first

    def flush(self) -> int:
        """Make every appended byte durable; returns the flushed position. Free when nothing was
        appended since the last flush (enqueue-put publishes W without new records often)."""
        if self.readonly or self._flushed == self._end and not self._dir_dirty:
            return self._flushed
        if self.fsync:
            for base in reversed(self._bases):
                if base + self.segment_bytes <= self._flushed:
                    break
                if base < self._end:
                    os.fdatasync(self._fd(base))
            if self._dir_dirty:
                fsync_dir(self.directory)
        self._dir_dirty = False
        self._flushed = self._end
        return self._flushed

    def truncate(self, pos: int) -> None:
        """Cut the log at ``pos``: every record at or after it is gone, durably."""
        self._need_writer("truncate")
        self._check_pos(pos)
        if not self.start_pos <= pos <= self._end:
            raise ValueError(f"cannot truncate TimerLog at {pos}: it holds [{self.start_pos}, {self._end})")
        if pos < self._end:
            self._cut(pos)

    def _cut(self, pos: int) -> None:
        keep = pos - pos % self.segment_bytes
        while self._bases and self._bases[-1] > keep:
            base = self._bases.pop()
            self._forget(base)
            os.unlink(self._path(base))
        if self._bases:
            os.truncate(self._path(keep), pos - keep)
            if self._write_base != keep:
                self._writable(keep)
            if self.fsync:
                os.fsync(self._write_fd)
        if self.fsync:
            fsync_dir(self.directory)
        self._end = pos
        self._flushed = min(self._flushed, pos)

    def delete_before(self, pos: int) -> int:
        """Delete segments lying entirely before ``pos`` (never the last one); returns how many."""
        self._need_writer("delete segments")
        deleted = 0
        while len(self._bases) > 1 and self._bases[0] + self.segment_bytes <= pos:
            base = self._bases.pop(0)
            self._forget(base)
            os.unlink(self._path(base))
            deleted += 1
        if deleted and self.fsync:
            fsync_dir(self.directory)
        return deleted

    # ---------------------------------------------------------------- reading

    def _check_pos(self, pos: int) -> None:
        if pos < 0 or pos % RECORD_SIZE:
            raise ValueError(f"TimerLog position {pos} is not a non-negative multiple of {RECORD_SIZE}")

    def read(self, pos: int) -> TimerRecord:
        """The record at ``pos``. CorruptRecordError if it fails its checks, IndexError if not held."""
        return unpack_record(self.read_raw(pos), pos)

    def read_raw(self, pos: int) -> bytes:
        """The unchecked bytes of the record at ``pos`` (short if the log ends inside it; a stale
        view of them is read again fresh if they do not check). IndexError if not held."""
        if pos < 0 or pos % RECORD_SIZE:
            self._check_pos(pos)
        offset = pos % self.segment_bytes
        data = os.pread(self._fd(pos - offset), RECORD_SIZE, offset)
        if self._stale(pos, RECORD_SIZE) and (len(data) < RECORD_SIZE or why_invalid(data) is not None):
            data = self._read_fresh(pos, RECORD_SIZE)
        if not data:
            raise IndexError(f"TimerLog {self.directory} holds nothing at position {pos}")
        return data

    def read_into(self, pos: int, buf: memoryview) -> int:
        """Read raw bytes at ``pos`` into ``buf``, stopping at the segment's end; returns the count."""
        self._check_pos(pos)
        base = pos - pos % self.segment_bytes
        buf = buf[: base + self.segment_bytes - pos]
        got = os.preadv(self._fd(base), [buf], pos - base)
        if got < len(buf) and self._stale(pos, min(len(buf), self.fresh_end - pos)):
            data = self._read_fresh(pos, len(buf))
            buf[: len(data)] = data
            got = len(data)
        return got

    def iter_chunks(
        self, start: int, end: int, *, reverse: bool = False, chunk_records: int = CHUNK_RECORDS
    ) -> Iterator[tuple[int, RecordArray]]:
        """Raw, unchecked records of [start, end) as (first position, RECORD_DTYPE array) chunks.

        Each array is a view of one reused buffer: it is valid until the next chunk is read.
        ``reverse`` yields the chunks from the end backwards (records inside a chunk stay in order).
        """
        self._check_pos(start)
        self._check_pos(end)
        buf = bytearray(chunk_records * RECORD_SIZE)
        view = memoryview(buf)
        if not reverse:
            pos = start
            while pos < end:
                got = self.read_into(pos, view[: min(len(buf), end - pos)])
                got -= got % RECORD_SIZE
                if got == 0:
                    raise IndexError(f"TimerLog {self.directory} ends at {pos}, before {end}")
                yield pos, np.frombuffer(buf, dtype=RECORD_DTYPE, count=got // RECORD_SIZE)
                pos += got
        else:
            hi = end
            while hi > start:
                last = hi - RECORD_SIZE
                lo = max(start, hi - len(buf), last - last % self.segment_bytes)
                got = self.read_into(lo, view[: hi - lo])
                if got < hi - lo:
                    raise IndexError(f"TimerLog {self.directory} ends at {lo + got}, before {hi}")
                yield lo, np.frombuffer(buf, dtype=RECORD_DTYPE, count=(hi - lo) // RECORD_SIZE)
                hi = lo

    def read_segment(self, base: int, buf: bytearray) -> tuple[RecordArray, memoryview]:
        """The segment that starts at ``base``, whole, as its file holds it now, read into ``buf``
        (at least ``segment_bytes`` long; the results are views of it, valid until it is reused):
        its whole records as a writable RECORD_DTYPE array, unchecked, and its bytes as read, a
        partial record at its end included, with what is changed through the records.

        For a tool that reads a stopped shard's log one segment at a time (``repair.change_window``);
        the file is opened afresh, so a segment replaced since the last read is read as it is now."""
        self._check_pos(base)
        if base % self.segment_bytes:
            raise ValueError(f"TimerLog position {base} is not a segment's base (segments of {self.segment_bytes} bytes)")
        if len(buf) < self.segment_bytes:
            raise ValueError(f"a buffer of {len(buf)} bytes cannot hold a segment of {self.segment_bytes}")
        view = memoryview(buf)[: self.segment_bytes]
        fd = os.open(self._path(base), os.O_RDONLY)
        try:
            got = 0
            while got < len(view):
                n = os.preadv(fd, [view[got:]], got)
                if n == 0:
                    break
                got += n
        finally:
            os.close(fd)
        return np.frombuffer(buf, dtype=RECORD_DTYPE, count=got // RECORD_SIZE), view[:got]

    def iter_range(self, start: int, end: int) -> Iterator[tuple[int, TimerRecord]]:
        """(position, record) for [start, end), oldest first; CorruptRecordError at a bad record."""
        for first, arr in self.iter_chunks(start, end):
            ok = valid_mask(arr)
            bad = np.flatnonzero(~ok)
            good = len(arr) if bad.size == 0 else int(bad[0])
            for i, record in enumerate(records_from_array(arr[:good])):
                yield first + i * RECORD_SIZE, record
            if good < len(arr):
                pos = first + good * RECORD_SIZE
                raise CorruptRecordError(pos, why_invalid(arr[good : good + 1].tobytes()) or "invalid record")

    def why_at(self, pos: int) -> str | None:
        """Why the record at ``pos`` fails its checks, or None if it is valid."""
        self._check_pos(pos)
        base = pos - pos % self.segment_bytes
        return why_invalid(os.pread(self._fd(base), RECORD_SIZE, pos - base))

    def scan_back(
        self, lo: int, hi: int, slot_time: int, tick_ms: int
    ) -> Iterator[tuple[int, TimerRecord | None, str | None]]:
        """Newest first over [lo, hi): (pos, record, None) for each valid record firing in
        ``slot_time``, and (pos, None, why) for each record that fails its checks.

        The fallback when a slot's chain is broken: a linear scan, vectorised a chunk at a time.
        """
        for first, arr, ok, hits in self._slot_hits(lo, hi, slot_time, tick_ms):
            good = ok[hits]
            positions = (first + RECORD_SIZE * hits).tolist()
            records = records_from_array(arr[hits[good]])
            if len(records) == len(hits):
                for pos, record in zip(positions, records, strict=True):
                    yield pos, record, None
                continue
            found = iter(records)
            for k, pos, is_good in zip(hits.tolist(), positions, good.tolist(), strict=True):
                if is_good:
                    yield pos, next(found), None
                else:
                    yield pos, None, why_invalid(arr[k : k + 1].tobytes()) or "invalid record"

    def scan_back_arrays(
        self, lo: int, hi: int, slot_time: int, tick_ms: int, chunk_records: int = CHUNK_RECORDS
    ) -> Iterator[tuple[npt.NDArray[np.int64], RecordArray, list[tuple[int, str]]]]:
        """``scan_back`` column-wise, a chunk of ``chunk_records`` at a time, newest first: the
        positions and the records (a copy) of the valid records firing in ``slot_time``, and
        (position, why) of each record that fails its checks."""
        for first, arr, ok, hits in self._slot_hits(lo, hi, slot_time, tick_ms, chunk_records):
            good = ok[hits]
            positions = first + RECORD_SIZE * hits.astype(np.int64)
            if good.all():
                yield positions, arr[hits], []
                continue
            bad = [(first + RECORD_SIZE * k, why_invalid(arr[k : k + 1].tobytes()) or "invalid record")
                   for k in hits[~good].tolist()]
            yield positions[good], arr[hits[good]], bad

    def _slot_hits(
        self, lo: int, hi: int, slot_time: int, tick_ms: int, chunk_records: int = CHUNK_RECORDS
    ) -> Iterator[tuple[int, RecordArray, npt.NDArray[np.bool_], npt.NDArray[np.intp]]]:
        """Newest chunk first over [lo, hi): (first position, chunk, valid mask, indices newest
        first of its records that fire in ``slot_time`` or fail their checks)."""
        for first, arr in self.iter_chunks(max(lo, self.start_pos), hi, reverse=True, chunk_records=chunk_records):
            ok = valid_mask(arr)
            if not ok.all() and self._stale(first, len(arr) * RECORD_SIZE):
                fresh = self._read_fresh(first, len(arr) * RECORD_SIZE)
                if len(fresh) == len(arr) * RECORD_SIZE:
                    arr[:] = np.frombuffer(fresh, dtype=RECORD_DTYPE)
                    ok = valid_mask(arr)
            deliver = arr["deliver_ms"]
            yield first, arr, ok, np.flatnonzero((ok & (deliver - deliver % tick_ms == slot_time)) | ~ok)[::-1]

    def close(self) -> None:
        for fd in self._read_fds.values():
            os.close(fd)
        self._read_fds.clear()
        self._close_direct()
        if self._write_fd >= 0:
            os.close(self._write_fd)
            self._write_fd, self._write_base = -1, -1
