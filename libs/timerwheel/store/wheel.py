"""TimerWheel: a file-backed array of slots, one per tick, reused every revolution (RIP-43).

The slot of time t is at index ``(t // tick) % slots``. A slot remembers the time it was written
for; asked for another time (a previous or later revolution) it reads empty. A slot names the
newest (``last_pos``) and oldest (``first_pos``) TimerLog record firing in it; the records link
newest first through their ``prev_pos``. The wheel must span at least twice the roll window, so a
slot is read (dequeue-get) long before its index comes round again.

File ``wheel``, little-endian: a 64-byte header, then ``slots`` slots of 32 bytes::

    header: magic 8s "TWWHEEL\\0" | version u32 | tick_ms u32 | slots u64 | synced_pos i64
            | reserved 28 bytes | crc32 u32 (of bytes 0..59)
    slot:   slot_time i64 | first_pos i64 | last_pos i64 | num i32 | magic i32

A slot's magic is SLOT_MAGIC once written; a never-written slot is all zeros (the file is created
sparse). Each slot is written as one 32-byte copy and never straddles a page.

Durability. The writer keeps slot changes in memory (``pending``) until ``publish()`` copies them
into the mapped file, where readers on the same node see them. The Shard publishes only after
fsyncing the TimerLog, so a slot on disk only ever names records that are on disk. ``flush``
additionally msyncs the file and then records in the header ``synced_pos``: the TimerLog position
up to which the file is known durable. Recovery re-links from there with ``revise``, which is
idempotent: any slot the file holds is a state the slot really had at some publish, and a record
at or below that state's ``last_pos`` (same slot time) is already counted.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from timerwheel.errors import ConfigError, FormatMismatchError, TimerwheelError
from timerwheel.files import FILE_MODE, fsync_dir, temp_path
from timerwheel.store.format import FORMAT_VERSION
from timerwheel.store.fresh import DirectFile, drop_cached, is_shared

log = logging.getLogger(__name__)

_SLOT_LAYOUT = (("slot_time", "q"), ("first_pos", "q"), ("last_pos", "q"), ("num", "i"), ("magic", "i"))
_NUMPY_CODE = {"q": "<i8", "i": "<i4"}
SLOT_STRUCT = struct.Struct("<" + "".join(code for _, code in _SLOT_LAYOUT))
SLOT_DTYPE = np.dtype([(name, _NUMPY_CODE[code]) for name, code in _SLOT_LAYOUT])
SLOT_SIZE = SLOT_STRUCT.size
assert SLOT_SIZE == SLOT_DTYPE.itemsize == 32

HEADER_STRUCT = struct.Struct("<8sIIqq28sI")
HEADER_SIZE = HEADER_STRUCT.size
assert HEADER_SIZE == 64
WHEEL_MAGIC = b"TWWHEEL\0"
SLOT_MAGIC = (0x5457 << 16) | FORMAT_VERSION
_SYNCED_POS_OFFSET = 24
_CHUNK_SLOTS = 1 << 18
#: A reader on a shared file system reads the slots past the page cache this many at a time
#: (128 KiB: one O_DIRECT read), and keeps at most FRESH_MAX_BLOCKS of them (64 MiB) between reloads.
FRESH_BLOCK_SLOTS = 4096
FRESH_MAX_BLOCKS = 512
#: A range read of more blocks than this does not keep the ones it had to read.
FRESH_SCAN_KEEP_BLOCKS = 8
_INT64_MAX = np.iinfo(np.int64).max

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Slot:
    """One wheel slot; empty: first_pos = last_pos = -1, num = 0."""

    slot_time: int
    first_pos: int
    last_pos: int
    num: int
    magic: int


class SlotUpdate(NamedTuple):
    """New states for wheel indexes, as parallel arrays (from ``TimerWheel.chain``)."""

    slot_index: IntArray
    slot_time: IntArray
    first_pos: IntArray
    last_pos: IntArray
    num: IntArray


def group_order(idx: IntArray) -> IntArray:
    """argsort(idx, kind="stable"), ~5x faster: sort one int64 key holding (index, arrival)."""
    n = len(idx)
    bits = max(n - 1, 1).bit_length()
    if n and int(idx.max()) < (1 << (62 - bits)):
        key = (idx << bits) | np.arange(n, dtype=np.int64)
        key.sort()
        return key & ((1 << bits) - 1)
    return np.argsort(idx, kind="stable").astype(np.int64)


class FreshSlots:
    """A reader's slots on a shared file system, read past this node's page cache.

    Why not the mapping: ``drop_cached`` cannot drop pages that another process of this node
    keeps mapped (dequeue-put and dequeue-get map the same wheel), so a reader's fresh mapping
    kept showing the slots as they were when that process faulted them in. After a recovery the
    writer syncs the wheel and the reader's ``TailIndex`` starts at the new synced position, so
    records below it that the stale pages did not show were taken for an empty slot: R moved past
    them and they were lost (two-mount chaos test, measured: a second mapping of the file
    through the same FUSE mount kept the old bytes after a remap and ``DONTNEED``).

    Blocks of FRESH_BLOCK_SLOTS slots are read with ``DirectFile`` when first used and kept until
    ``clear`` (``TimerWheel.reload``); a block read later than another is only fresher, which a
    reader's view takes as it takes a newer publish. Indexing as the mapped array: a slice or an
    array of indexes."""

    def __init__(self, direct: DirectFile, slots: int) -> None:
        self._direct = direct
        self._slots = slots
        self._blocks: dict[int, npt.NDArray[np.void]] = {}

    def clear(self) -> None:
        self._blocks.clear()

    def _block(self, b: int, keep: bool = True) -> npt.NDArray[np.void]:
        got = self._blocks.get(b)
        if got is None:
            i0 = b * FRESH_BLOCK_SLOTS
            n = min(FRESH_BLOCK_SLOTS, self._slots - i0)
            data = self._direct.pread(HEADER_SIZE + i0 * SLOT_SIZE, n * SLOT_SIZE)
            got = np.zeros(n, dtype=SLOT_DTYPE)  # a short read (a sparse tail): never-written slots
            got[: len(data) // SLOT_SIZE] = np.frombuffer(data[: len(data) - len(data) % SLOT_SIZE], dtype=SLOT_DTYPE)
            if keep:
                if len(self._blocks) >= FRESH_MAX_BLOCKS:
                    self._blocks.clear()
                self._blocks[b] = got
        return got

    def row(self, i: int) -> tuple[int, int, int, int, int]:
        r = self._block(i // FRESH_BLOCK_SLOTS)[i % FRESH_BLOCK_SLOTS]
        return int(r["slot_time"]), int(r["first_pos"]), int(r["last_pos"]), int(r["num"]), int(r["magic"])

    def __getitem__(self, key: slice | IntArray) -> npt.NDArray[np.void]:
        if isinstance(key, slice):
            i0, i1, _ = key.indices(self._slots)
            b0, b1 = i0 // FRESH_BLOCK_SLOTS, max(i0, i1 - 1) // FRESH_BLOCK_SLOTS
            # A long scan (the ``pending`` gauge counts the whole wheel) passes through uncached
            # blocks without keeping them: the blocks around R stay.
            keep = b1 - b0 < FRESH_SCAN_KEEP_BLOCKS
            if i1 <= i0:
                return np.zeros(0, SLOT_DTYPE)
            rows = self._block(b0, keep) if b0 == b1 else np.concatenate(
                [self._block(b, keep) for b in range(b0, b1 + 1)])
            return rows[i0 - b0 * FRESH_BLOCK_SLOTS : i1 - b0 * FRESH_BLOCK_SLOTS]
        idx = np.asarray(key, dtype=np.int64)
        out = np.empty(idx.shape, dtype=SLOT_DTYPE)
        blocks = idx // FRESH_BLOCK_SLOTS
        for b in np.unique(blocks).tolist():
            hit = blocks == b
            out[hit] = self._block(b)[idx[hit] - b * FRESH_BLOCK_SLOTS]
        return out


class TimerWheel:
    """File-backed array of slots; index ``(t // tick) % slots``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        tick_ms: int,
        slots: int,
        readonly: bool = False,
        fsync: bool = True,
    ) -> None:
        if tick_ms <= 0:
            raise ConfigError("tick_ms", f"must be > 0, got {tick_ms}")
        if slots <= 0:
            raise ConfigError("slots", f"must be > 0, got {slots}")
        self.path = os.fspath(path)
        self.tick_ms = tick_ms
        self.slots = slots
        self.readonly = readonly
        self.fsync = fsync
        self._direct: DirectFile | None = None
        #: True when this call created the file (an empty wheel, synced_pos 0).
        self.created = False
        if not os.path.exists(self.path):
            if readonly:
                raise TimerwheelError(f"no TimerWheel file at {self.path}")
            self._create()
        self._fd = os.open(self.path, os.O_RDONLY if readonly else os.O_RDWR)
        try:
            self._check_header(os.pread(self._fd, HEADER_SIZE, 0))
            size = HEADER_SIZE + slots * SLOT_SIZE
            if os.fstat(self._fd).st_size != size:
                raise FormatMismatchError(
                    f"TimerWheel {self.path} is {os.fstat(self._fd).st_size} bytes, expected {size} for {slots} slots"
                )
            self._mm = mmap.mmap(self._fd, size, access=mmap.ACCESS_READ if readonly else mmap.ACCESS_WRITE)
        except BaseException:
            os.close(self._fd)
            raise
        self._slots: npt.NDArray[np.void] = np.ndarray((slots,), dtype=SLOT_DTYPE, buffer=self._mm, offset=HEADER_SIZE)
        #: A reader on a shared file system reads its slots through this, never the mapping (see FreshSlots).
        self._fresh: FreshSlots | None = None
        if readonly and is_shared(self.path):
            self._direct = DirectFile(self.path)
            self._fresh = FreshSlots(self._direct, slots)
        # Slot states not yet published, kept as arrays: sorted unique indexes and their
        # (slot_time, first_pos, last_pos, num) rows.
        self._pending_idx: IntArray = np.empty(0, dtype=np.int64)
        self._pending: IntArray = np.empty((0, 4), dtype=np.int64)

    # ---------------------------------------------------------------- file

    def _header(self, synced_pos: int) -> bytes:
        body = HEADER_STRUCT.pack(WHEEL_MAGIC, FORMAT_VERSION, self.tick_ms, self.slots, synced_pos, b"", 0)
        return body[:-4] + struct.pack("<I", zlib.crc32(body[:-4]))

    def _create(self) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        tmp = temp_path(self.path)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, FILE_MODE)
        try:
            os.pwrite(fd, self._header(0), 0)
            os.ftruncate(fd, HEADER_SIZE + self.slots * SLOT_SIZE)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        if self.fsync:
            fsync_dir(directory)
        self.created = True

    def _check_header(self, data: bytes) -> None:
        if len(data) < HEADER_SIZE:
            raise FormatMismatchError(f"TimerWheel {self.path} is too short for its header ({len(data)} bytes)")
        magic, version, tick_ms, slots, _synced, _reserved, crc = HEADER_STRUCT.unpack(data)
        if magic != WHEEL_MAGIC:
            raise FormatMismatchError(f"{self.path} is not a TimerWheel file (magic {magic!r})")
        if crc != zlib.crc32(data[:-4]):
            raise TimerwheelError(f"TimerWheel header of {self.path} fails its CRC")
        wrong = [
            f"{name}: stored {stored}, requested {asked}"
            for name, stored, asked in (
                ("format version", version, FORMAT_VERSION),
                ("tick_ms", tick_ms, self.tick_ms),
                ("slots", slots, self.slots),
            )
            if stored != asked
        ]
        if wrong:
            raise FormatMismatchError(f"TimerWheel {self.path} does not match: " + "; ".join(wrong))

    def fresh_synced_pos(self) -> int | None:
        """``synced_pos`` as the file holds it now, read past this node's cache (None while the
        header fails its CRC: being rewritten)."""
        if self._direct is None:
            self._direct = DirectFile(self.path)
        data = self._direct.pread(0, HEADER_SIZE)
        if len(data) < HEADER_SIZE or zlib.crc32(data[:-4]) != struct.unpack_from("<I", data, 60)[0]:
            return None
        return int(struct.unpack_from("<q", data, _SYNCED_POS_OFFSET)[0])

    def reload(self) -> bool:
        """Reader: slots read from now on are at least as new as the file's last msync (another
        node's writes). On a shared file system the fresh reads start over (``FreshSlots``);
        elsewhere the file is mapped again with this node's cached pages of it dropped. False if
        the old mapping is still in use (a view held by another thread): its pages stay cached
        then, and the caller must not count on the new mapping being fresh."""
        if not self.readonly:
            return True
        if self._fresh is not None:
            self._fresh.clear()
            return True
        old = self._mm
        self._mm = mmap.mmap(self._fd, HEADER_SIZE + self.slots * SLOT_SIZE, access=mmap.ACCESS_READ)
        self._slots = np.ndarray((self.slots,), dtype=SLOT_DTYPE, buffer=self._mm, offset=HEADER_SIZE)
        try:
            old.close()
        except BufferError:  # a caller still holds a view; the mapping goes when it does
            return False
        drop_cached(self._fd)  # pages mapped by a process (the new mapping faults lazily) stay
        return True

    def rows(self, idx: IntArray) -> npt.NDArray[np.void]:
        """The stored rows at wheel indexes ``idx`` (pending changes not included)."""
        return self._view[idx]

    @property
    def _view(self) -> npt.NDArray[np.void] | FreshSlots:
        """The slots to read: the mapping, or a shared file system's reader's fresh reads."""
        return self._slots if self._fresh is None else self._fresh

    @property
    def synced_pos(self) -> int:
        """TimerLog position up to which this file is known durable (0 for a new wheel)."""
        return int(struct.unpack_from("<q", self._mm, _SYNCED_POS_OFFSET)[0])

    def _need_writer(self, what: str) -> None:
        if self.readonly:
            raise TimerwheelError(f"TimerWheel {self.path} is open read-only; cannot {what}")

    # ---------------------------------------------------------------- single slots

    def slot_time(self, t_ms: int) -> int:
        return t_ms - t_ms % self.tick_ms

    def index(self, t_ms: int) -> int:
        return (t_ms // self.tick_ms) % self.slots

    def get(self, t_ms: int) -> Slot:
        """The slot of ``t_ms``; empty if the stored slot belongs to another revolution."""
        slot_time = self.slot_time(t_ms)
        i = self.index(t_ms)
        pending = self._pending_at(i)
        if pending is not None:
            stored, first, last, num = pending
            magic = SLOT_MAGIC
        elif self._fresh is not None:
            stored, first, last, num, magic = self._fresh.row(i)
        else:
            stored, first, last, num, magic = SLOT_STRUCT.unpack_from(self._mm, HEADER_SIZE + i * SLOT_SIZE)
        if magic != SLOT_MAGIC or stored != slot_time:
            return Slot(slot_time, -1, -1, 0, 0)
        return Slot(slot_time, first, last, num, magic)

    def put(self, slot_time: int, first_pos: int, last_pos: int, num: int) -> None:
        """Set a slot (kept in memory until publish or flush)."""
        self._need_writer("put")
        if slot_time % self.tick_ms:
            raise ValueError(f"slot time {slot_time} is not a multiple of the tick {self.tick_ms} ms")
        self._add_pending(
            np.array([self.index(slot_time)], dtype=np.int64),
            np.array([[slot_time, first_pos, last_pos, num]], dtype=np.int64),
        )

    def _pending_at(self, i: int) -> tuple[int, int, int, int] | None:
        k = int(np.searchsorted(self._pending_idx, i))
        if k < len(self._pending_idx) and self._pending_idx[k] == i:
            t, first, last, num = self._pending[k].tolist()
            return t, first, last, num
        return None

    def _add_pending(self, idx: IntArray, states: IntArray) -> None:
        """Merge new states (unique ``idx``) into pending; a new state replaces an older one."""
        all_idx = np.concatenate((self._pending_idx, idx))
        all_states = np.concatenate((self._pending, states))
        order = group_order(all_idx)
        all_idx = all_idx[order]
        newest = np.ones(len(all_idx), dtype=np.bool_)
        newest[:-1] = all_idx[1:] != all_idx[:-1]
        self._pending_idx = all_idx[newest]
        self._pending = all_states[order][newest]

    # ---------------------------------------------------------------- batches

    def _lookup(self, idx: IntArray) -> tuple[IntArray, IntArray, IntArray, IntArray, npt.NDArray[np.bool_]]:
        """Current (slot_time, first, last, num, occupied) of each index, pending changes included."""
        rows = self._slots[idx]
        stored = rows["slot_time"].astype(np.int64)
        first = rows["first_pos"].astype(np.int64)
        last = rows["last_pos"].astype(np.int64)
        num = rows["num"].astype(np.int64)
        occupied = (rows["magic"] == SLOT_MAGIC) & (last >= 0)
        if len(self._pending_idx):
            at = np.minimum(np.searchsorted(self._pending_idx, idx), len(self._pending_idx) - 1)
            hit = self._pending_idx[at] == idx
            states = self._pending[at[hit]]
            stored[hit], first[hit], last[hit], num[hit] = states.T
            occupied[hit] = states[:, 2] >= 0
        return stored, first, last, num, occupied

    def chain(self, slot_times: IntArray, positions: IntArray) -> tuple[IntArray, SlotUpdate]:
        """Link new records (ascending ``positions``, firing in ``slot_times``) into their slots.

        Returns each record's prev_pos and the slots' new states, to ``stage`` once the records
        are written. A record for a slot time older than the one its index holds would silently
        hide that newer revolution: that raises instead (the wheel is too small for the delay).
        """
        n = len(positions)
        idx = (slot_times // self.tick_ms) % self.slots
        order = group_order(idx)
        idx_s, t_s, p_s = idx[order], slot_times[order], positions[order]
        new_group = np.ones(n, dtype=np.bool_)
        new_group[1:] = idx_s[1:] != idx_s[:-1]
        backwards = np.flatnonzero(~new_group[1:] & (t_s[1:] < t_s[:-1]))
        if backwards.size:
            k = int(backwards[0]) + 1
            raise TimerwheelError(
                f"slot {int(t_s[k])} and slot {int(t_s[k - 1])} share wheel index {int(idx_s[k])} in one batch: "
                f"the wheel ({self.slots} slots of {self.tick_ms} ms) is too small for these delays"
            )
        new_run = new_group.copy()
        new_run[1:] |= t_s[1:] != t_s[:-1]
        starts = np.flatnonzero(new_group)
        ends = np.append(starts[1:], n) - 1
        uniq = idx_s[starts]
        cur_t, cur_first, cur_last, cur_num, occupied = self._lookup(uniq)
        first_t = t_s[starts]
        stale = np.flatnonzero(occupied & (cur_t > first_t))
        if stale.size:
            k = int(stale[0])
            raise TimerwheelError(
                f"slot {int(first_t[k])} is older than slot {int(cur_t[k])} the wheel holds at index {int(uniq[k])}: "
                f"the wheel ({self.slots} slots of {self.tick_ms} ms) is too small for this delay"
            )
        cont = occupied & (cur_t == first_t)
        prev_s = np.empty(n, dtype=np.int64)
        prev_s[1:] = p_s[:-1]
        prev_s[new_run] = -1
        prev_s[starts[cont]] = cur_last[cont]
        prev = np.empty(n, dtype=np.int64)
        prev[order] = prev_s
        run_starts = np.flatnonzero(new_run)
        last_run = run_starts[np.searchsorted(run_starts, ends, side="right") - 1]
        run_len = ends - last_run + 1
        whole = cont & (last_run == starts)
        update = SlotUpdate(
            uniq,
            t_s[ends],
            np.where(whole, cur_first, p_s[last_run]),
            p_s[ends],
            np.where(whole, cur_num + run_len, run_len),
        )
        return prev, update

    def stage(self, update: SlotUpdate) -> None:
        """Keep new slot states in memory until the next publish or flush."""
        self._need_writer("stage")
        self._add_pending(
            update.slot_index, np.column_stack((update.slot_time, update.first_pos, update.last_pos, update.num))
        )

    def _write(self, idx: IntArray, slot_time: IntArray, first: IntArray, last: IntArray, num: IntArray) -> None:
        rows = np.empty(len(idx), dtype=SLOT_DTYPE)
        rows["slot_time"] = slot_time
        rows["first_pos"] = first
        rows["last_pos"] = last
        rows["num"] = num
        rows["magic"] = np.where(last >= 0, SLOT_MAGIC, 0)
        self._slots[idx] = rows

    def publish(self) -> None:
        """Copy pending slot changes into the mapped file (visible to readers on this node)."""
        if not len(self._pending_idx):
            return
        states = self._pending
        self._write(self._pending_idx, states[:, 0], states[:, 1], states[:, 2], states[:, 3])
        self._pending_idx = np.empty(0, dtype=np.int64)
        self._pending = np.empty((0, 4), dtype=np.int64)

    def flush(self, synced_pos: int | None = None) -> None:
        """Publish, msync; then, if given, record that the file reflects the TimerLog below ``synced_pos``."""
        self._need_writer("flush")
        self.publish()
        if self.fsync:
            self._mm.flush()
        if synced_pos is not None and synced_pos != self.synced_pos:
            # Written only once the slots are on disk, so the header never claims more than they hold.
            self._mm[:HEADER_SIZE] = self._header(synced_pos)
            if self.fsync:
                self._mm.flush(0, HEADER_SIZE)

    def revise(self, slot_times: IntArray, positions: IntArray) -> int:
        """Re-link valid records (ascending ``positions``, firing in ``slot_times``) idempotently.

        Used by recovery; writes the mapped file directly (``flush`` afterwards). Per wheel index
        only the newest slot time among the records and the file counts: an older one is a past
        revolution, a newer one starts the slot afresh (first_pos = its oldest record). For the
        slot time the file already holds, records at or below its last_pos are already counted.
        Returns the number of records newly linked.
        """
        self._need_writer("revise")
        self.publish()
        n = len(positions)
        if n == 0:
            return 0
        idx = (slot_times // self.tick_ms) % self.slots
        order = group_order(idx)
        idx_s, t_s, p_s = idx[order], slot_times[order], positions[order]
        new_group = np.ones(n, dtype=np.bool_)
        new_group[1:] = idx_s[1:] != idx_s[:-1]
        starts = np.flatnonzero(new_group)
        sizes = np.diff(np.append(starts, n))
        newest_t = np.maximum.reduceat(t_s, starts)
        in_newest = t_s == np.repeat(newest_t, sizes)
        uniq = idx_s[starts]
        rows = self._slots[uniq]
        cur_t = rows["slot_time"].astype(np.int64)
        cur_last = rows["last_pos"].astype(np.int64)
        occupied = (rows["magic"] == SLOT_MAGIC) & (cur_last >= 0)
        same = occupied & (cur_t == newest_t)
        newer_on_file = occupied & (cur_t > newest_t)
        fresh = in_newest & (p_s > np.repeat(np.where(same, cur_last, -1), sizes))
        count = np.add.reduceat(fresh.astype(np.int64), starts)
        first_new = np.minimum.reduceat(np.where(fresh, p_s, _INT64_MAX), starts)
        last_new = np.maximum.reduceat(np.where(fresh, p_s, -1), starts)
        write = ~newer_on_file & (count > 0)
        if newer_on_file.any():
            log.debug("revise: %d wheel slots hold a newer revolution than records re-linked into them; kept",
                        int(newer_on_file.sum()))
        self._write(
            uniq[write],
            newest_t[write],
            np.where(same, rows["first_pos"], first_new)[write],
            last_new[write],
            np.where(same, rows["num"].astype(np.int64) + count, count)[write],
        )
        return int(count[write].sum())

    # ---------------------------------------------------------------- ranges

    def _pieces(self, first_t: int, count: int) -> list[tuple[int, int, int]]:
        """(index start, index end, slot time at start) covering ``count`` slots from ``first_t``, in time order."""
        pieces = []
        i = (first_t // self.tick_ms) % self.slots
        t = first_t
        while count > 0:
            length = min(count, self.slots - i, _CHUNK_SLOTS)
            pieces.append((i, i + length, t))
            count -= length
            t += length * self.tick_ms
            i = (i + length) % self.slots
        return pieces

    def _span(self, from_ms: int, to_ms: int) -> tuple[int, int]:
        first_t = self.slot_time(from_ms)
        return first_t, max(0, -((first_t - to_ms) // self.tick_ms))

    def count_range(self, from_ms: int, to_ms: int) -> int:
        """Messages in the slots overlapping [from_ms, to_ms): slot times slot_time(from_ms) <= t < to_ms."""
        first_t, count = self._span(from_ms, to_ms)
        if count == 0:
            return 0
        total = 0
        if count >= self.slots:
            for c0 in range(0, self.slots, _CHUNK_SLOTS):
                rows = self._view[c0 : c0 + _CHUNK_SLOTS]
                t = rows["slot_time"]
                hit = (rows["magic"] == SLOT_MAGIC) & (t >= first_t) & (t < to_ms)
                total += int(rows["num"][hit].sum())
        else:
            for i0, i1, t0 in self._pieces(first_t, count):
                rows = self._view[i0:i1]
                expected = t0 + self.tick_ms * np.arange(i1 - i0, dtype=np.int64)
                hit = (rows["magic"] == SLOT_MAGIC) & (rows["slot_time"] == expected)
                total += int(rows["num"][hit].sum())
        for i, (pending_t, _first, _last, num) in zip(self._pending_idx.tolist(), self._pending.tolist(), strict=True):
            on_file, _f, _l, stored_num, magic = SLOT_STRUCT.unpack_from(self._mm, HEADER_SIZE + i * SLOT_SIZE)
            if magic == SLOT_MAGIC and first_t <= on_file < to_ms:
                total -= stored_num
            if first_t <= pending_t < to_ms:
                total += num
        return total

    def next_nonempty(self, from_ms: int, to_ms: int) -> int | None:
        """First slot time t with slot_time(from_ms) <= t < to_ms whose slot holds messages, or None."""
        first_t, count = self._span(from_ms, to_ms)
        if count == 0:
            return None
        best = min(
            (t for t, _f, _l, num in self._pending.tolist() if num > 0 and first_t <= t < to_ms), default=None
        )
        skip = self._pending_idx
        end = to_ms if best is None else best
        found = self._first_on_file(first_t, min(count, -((first_t - end) // self.tick_ms)), end, skip)
        if found is None:
            return best
        return found if best is None else min(found, best)

    def _first_on_file(self, first_t: int, count: int, to_ms: int, skip: IntArray) -> int | None:
        if count <= 0:
            return None
        if count >= self.slots:
            best: int | None = None
            for c0 in range(0, self.slots, _CHUNK_SLOTS):
                rows = self._view[c0 : c0 + _CHUNK_SLOTS]
                t = rows["slot_time"]
                hit = (rows["magic"] == SLOT_MAGIC) & (rows["num"] > 0) & (t >= first_t) & (t < to_ms)
                mine = skip[(skip >= c0) & (skip < c0 + len(rows))]
                hit[mine - c0] = False
                if hit.any():
                    low = int(t[hit].min())
                    best = low if best is None else min(best, low)
            return best
        for i0, i1, t0 in self._pieces(first_t, count):
            rows = self._view[i0:i1]
            expected = t0 + self.tick_ms * np.arange(i1 - i0, dtype=np.int64)
            hit = (rows["magic"] == SLOT_MAGIC) & (rows["num"] > 0) & (rows["slot_time"] == expected)
            mine = skip[(skip >= i0) & (skip < i1)]
            hit[mine - i0] = False
            k = int(np.argmax(hit))
            if hit[k]:
                return int(expected[k])
        return None

    # ---------------------------------------------------------------- repair

    def referencing(self, end_pos: int) -> IntArray:
        """Indexes of written slots naming a position at or past ``end_pos`` (read without mapping pages)."""
        found = []
        for c0 in range(0, self.slots, _CHUNK_SLOTS):
            n = min(_CHUNK_SLOTS, self.slots - c0)
            rows = np.frombuffer(os.pread(self._fd, n * SLOT_SIZE, HEADER_SIZE + c0 * SLOT_SIZE), dtype=SLOT_DTYPE)
            hit = (rows["magic"] == SLOT_MAGIC) & (rows["last_pos"] >= 0)
            hit &= (rows["last_pos"] >= end_pos) | (rows["first_pos"] >= end_pos)
            found.append(c0 + np.flatnonzero(hit))
        return np.concatenate(found).astype(np.int64)

    def stored(self, i: int) -> Slot:
        """The slot at index ``i`` as stored, whatever its time (pending changes included)."""
        pending = self._pending_at(i)
        if pending is not None:
            return Slot(*pending, SLOT_MAGIC)
        return Slot(*SLOT_STRUCT.unpack_from(self._mm, HEADER_SIZE + i * SLOT_SIZE))

    def overwrite(self, i: int, slot: Slot) -> None:
        """Write slot ``i`` straight into the file (recovery's repair of a damaged slot)."""
        self._need_writer("overwrite")
        keep = self._pending_idx != i
        self._pending_idx, self._pending = self._pending_idx[keep], self._pending[keep]
        one = np.array([slot.slot_time], dtype=np.int64)
        self._write(np.array([i], dtype=np.int64), one, np.array([slot.first_pos]), np.array([slot.last_pos]),
                    np.array([slot.num]))

    def close(self) -> None:
        if self._direct is not None:
            self._direct.close()
            self._direct = None
        if self._fd < 0:
            return
        del self._slots
        with contextlib.suppress(BufferError):  # a caller still holds a view; the mapping goes when it does
            self._mm.close()
        os.close(self._fd)
        self._fd = -1
