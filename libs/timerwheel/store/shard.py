"""Shard: one TimerLog, one TimerWheel and two checkpoints in a directory ``shard-NNNN/``.

Layout (ARCHITECTURE §3; FORMAT.md has the bytes)::

    meta.json      format version, record size, tick_ms, slots, segment_bytes (written once)
    timerlog/      TimerLog segments
    wheel          TimerWheel
    enqueue.ckpt   enqueue-put's progress: flushed_pos, W, next source offsets, epoch
    dequeue.ckpt   dequeue-get's progress: R, epoch
    writer.lock    flock held by the one writer

The writer (the enqueue-put owner) appends batches: each record is linked newest first into its
slot (prev_pos = the slot's last_pos, RIP-43), the batch is written to the TimerLog, and the slots'
new states are kept in memory. ``flush()`` fsyncs the TimerLog, then publishes those slot states
into the wheel file; every ``wheel_sync_records`` records, and on close, it also msyncs the wheel
and records in its header the position it is durable to. So when flush() returns P every record
below P is on disk and its slot link is recoverable: on disk, or re-linked by recovery from the
wheel's synced position. The caller then saves the enqueue checkpoint with flushed_pos = P.
(An msync per flush costs one random page write per touched slot: 25-40 ms per 1,000 records
spread over a 2-day wheel, against under 1 ms for the TimerLog's fdatasync; and the TimerLog
already holds every link, as in RIP-43. ``wheel_sync_records=0`` msyncs on every flush.)

Readers (``writer=False``: dequeue-get, tools) never recover and never trust a byte at or past
the published flushed position: ``read_slot`` stops following a chain there and finds the slot's
records below it by a scan.

Assumes one writer per shard: the lock catches a second one on the same node; across nodes the
operator's epochs fence (checkpoint saves refuse to go back to an older epoch).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from timerwheel.errors import (
    ConfigError,
    CorruptRecordError,
    FencedError,
    FormatMismatchError,
    TimerLogDamagedError,
    TimerwheelError,
)
from timerwheel.files import FILE_MODE, atomic_write
from timerwheel.store import checkpoint
from timerwheel.store.checkpoint import DequeueCheckpoint, EnqueueCheckpoint
from timerwheel.store.format import (
    FORMAT_VERSION,
    RECORD_DTYPE,
    RECORD_SIZE,
    RecordArray,
    TimerRecord,
    check_link,
    pack_records,
    seal,
    valid_mask,
    why_invalid,
)
from timerwheel.store.fresh import is_shared
from timerwheel.store.layout import recovery_command
from timerwheel.store.recovery import CrashRecoveryReport, recover_from_crash
from timerwheel.store.tail import TailIndex
from timerwheel.store.timerlog import CHUNK_RECORDS, SEGMENT_SUFFIX, TimerLog
from timerwheel.store.wheel import SLOT_MAGIC, Slot, TimerWheel

log = logging.getLogger(__name__)

#: What ``Shard.read_slot`` gives: the TimerLog positions of some records of a slot and the records.
SlotPiece = tuple[npt.NDArray[np.int64], RecordArray]

META_FILE = "meta.json"
LOG_DIR = "timerlog"
WHEEL_FILE = "wheel"
ENQUEUE_CKPT = "enqueue.ckpt"
DEQUEUE_CKPT = "dequeue.ckpt"
LOCK_FILE = "writer.lock"
#: read_slot scans instead of following links when a slot of at least DENSE_SLOT_MIN records
#: holds at least 1/DENSE_SLOT_SHARE of the positions between its first and last record.
DENSE_SLOT_MIN = 16
DENSE_SLOT_SHARE = 10
#: read_slot gives a slot's records in pieces of at most this many (4 MiB of records).
SLOT_PIECE_RECORDS = CHUNK_RECORDS
#: Records between two wheel msyncs: bounds the re-linking recovery does after a crash (~1 s).
DEFAULT_WHEEL_SYNC_RECORDS = 1_000_000
#: A reader retries an invalid TimerLog record below the published flushed position this long
#: (a stale view of a page: it reads fresh bytes each time) before it reports it corrupt.
STALE_RETRY_S = 5.0
#: A reader waits this long, under one checkpoint epoch, for a damaged link of a slot's chain below
#: the published flushed position (``_link_failed``) to be repaired by the writer's recovery before
#: it reports it corrupt and skips it (a real corrupt record in the middle must not stop a slot).
DAMAGE_WAIT_S = 60.0


def _meta(tick_ms: int, slots: int, segment_bytes: int) -> dict[str, int]:
    return {
        "format_version": FORMAT_VERSION,
        "record_size": RECORD_SIZE,
        "tick_ms": tick_ms,
        "slots": slots,
        "segment_bytes": segment_bytes,
    }


def _check_meta(directory: str, wanted: dict[str, int]) -> None:
    path = os.path.join(directory, META_FILE)
    try:
        with open(path, "rb") as f:
            stored: Any = json.load(f)
        if not isinstance(stored, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        raise TimerwheelError(f"shard meta file {path} is unreadable: {exc}") from None
    wrong = [
        f"{name}: stored {stored.get(name)}, requested {value}" for name, value in wanted.items() if stored.get(name) != value
    ]
    if wrong:
        raise FormatMismatchError(
            f"shard {directory} was written with other settings ({'; '.join(wrong)}); "
            "it is never reformatted silently: open it with its own settings, or rebuild it"
        )


def stored_settings(directory: str | os.PathLike[str]) -> tuple[int, int, int]:
    """``tick_ms``, ``slots``, ``segment_bytes`` the shard in ``directory`` was made with (its meta.json)."""
    path = os.path.join(os.fspath(directory), META_FILE)
    try:
        with open(path, "rb") as f:
            meta = json.load(f)
        return int(meta["tick_ms"]), int(meta["slots"]), int(meta["segment_bytes"])
    except FileNotFoundError:
        raise TimerwheelError(f"no shard at {os.fspath(directory)} (no {META_FILE})") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TimerwheelError(f"shard {os.fspath(directory)}: {META_FILE} is unreadable: {exc}") from None


def change_geometry(directory: str | os.PathLike[str], *, tick_ms: int, slots: int, fsync: bool) -> None:
    """Store another tick and slot count in the shard's meta.json, its other fields as they are.
    Only for ``repair.change_window``, which re-linked the TimerLog for them and deleted the wheel."""
    path = os.path.join(os.fspath(directory), META_FILE)
    with open(path, "rb") as f:
        meta = json.load(f)
    meta.update(tick_ms=tick_ms, slots=slots)
    atomic_write(path, json.dumps(meta, indent=1).encode() + b"\n", fsync)


def lock_writer(directory: str | os.PathLike[str]) -> int:
    """Take the shard's writer lock (``writer.lock``, flock; FencedError if another process holds
    it): its descriptor, held until closed."""
    directory = os.fspath(directory)
    lock_fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT, FILE_MODE)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock_fd)
        raise FencedError(f"shard {directory} is already open for writing (lock {LOCK_FILE} is held)") from None
    return lock_fd


def _has_data(directory: str) -> bool:
    log_dir = os.path.join(directory, LOG_DIR)
    segments = os.listdir(log_dir) if os.path.isdir(log_dir) else []
    return (
        any(name.endswith(SEGMENT_SUFFIX) and os.path.getsize(os.path.join(log_dir, name)) for name in segments)
        or checkpoint.published_file(os.path.join(directory, ENQUEUE_CKPT)) is not None
    )


def recovery_needed(directory: str | os.PathLike[str]) -> str | None:
    """Why the shard must not start without ``timerwheel recover``, or None.

    An unreadable enqueue checkpoint is refused too (Shard.open would fail on it). The dequeue checkpoint holds R: every slot before it is delivered. Without it (lost, or
    unreadable) there is no safe R to start from: a new one at "now" would skip every slot
    between the lost R and now, silently. A shard that has never written anything (no TimerLog
    record, no enqueue checkpoint) needs none: enqueue-put starts R at its first W.
    """
    directory = os.fspath(directory)
    path = os.path.join(directory, DEQUEUE_CKPT)
    try:
        checkpoint.load_enqueue(os.path.join(directory, ENQUEUE_CKPT))
        found = checkpoint.load_dequeue(path)
    except checkpoint.CorruptCheckpointError as exc:
        return f"{exc}; the shard is not started (R is unknown, nothing is skipped): run `{recovery_command(directory)}`"
    if found is None and _has_data(directory):
        return (f"dequeue checkpoint {path} is missing, but the shard holds data; the shard is not started (R is "
                f"unknown, nothing is skipped): run `{recovery_command(directory)}`")
    return None


class Shard:
    """A shard directory: TimerLog + TimerWheel + checkpoints, opened as the writer or a reader."""

    def __init__(
        self,
        directory: str,
        timer_log: TimerLog,
        wheel: TimerWheel,
        *,
        writer: bool,
        fsync: bool,
        wheel_sync_records: int,
        lock_fd: int,
    ) -> None:
        self.directory = directory
        #: Where this view last found each checkpoint (spares a directory listing per load).
        self._found: checkpoint.LoadMemo = {}
        self.log = timer_log
        self.wheel = wheel
        self.tick_ms = wheel.tick_ms
        self.slots = wheel.slots
        self.writer = writer
        self.fsync = fsync
        self.wheel_sync_records = wheel_sync_records
        #: What crash recovery found and did when this writer opened the shard (None for a reader).
        self.recovery: CrashRecoveryReport | None = None
        #: Corrupt records read_slot met (each logged with its position) and skipped.
        self.corrupt_seen = 0
        #: Slots with at least this many records may be read by a scan (see read_slot).
        self.dense_slot_min = DENSE_SLOT_MIN
        self._lock_fd = lock_fd
        self._unsynced_records = 0
        self._segment_max: dict[int, int] = {}
        self._closed = False
        #: Reader: the TimerLog records its wheel view may not show (see ``refresh``), the epoch of
        #: the enqueue checkpoint they were read under, and when an invalid record was first met.
        self.tail: TailIndex | None = None
        #: Another node may write this shard's files (``fresh.is_shared``): the reader needs a
        #: view of its own (``refresh``). On a local file system the page cache is shared.
        self.shared = is_shared(os.path.join(directory, META_FILE))
        self._tail_epoch = -1
        self._invalid_since: tuple[int, float] | None = None
        #: Reader: the epoch of the newest checkpoint ``refresh`` was given, and the damaged links
        #: met under it: position -> when first met (``_link_failed``).
        self._epoch = -1
        self._damaged: dict[int, float] = {}

    # ---------------------------------------------------------------- opening

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        *,
        tick_ms: int,
        slots: int,
        segment_bytes: int,
        fsync: bool = True,
        writer: bool = True,
        wheel_sync_records: int = DEFAULT_WHEEL_SYNC_RECORDS,
    ) -> Shard:
        """Open (the writer creates if missing and runs recovery) a shard directory."""
        directory = os.fspath(directory)
        if tick_ms <= 0:
            raise ConfigError("tick_ms", f"must be > 0, got {tick_ms}")
        if slots <= 0:
            raise ConfigError("slots", f"must be > 0, got {slots}")
        if segment_bytes <= 0 or segment_bytes % RECORD_SIZE:
            raise ConfigError("segment_bytes", f"must be a positive multiple of {RECORD_SIZE}, got {segment_bytes}")
        if wheel_sync_records < 0:
            raise ConfigError("wheel_sync_records", f"must be >= 0, got {wheel_sync_records}")
        wanted = _meta(tick_ms, slots, segment_bytes)
        if not writer:
            if not os.path.exists(os.path.join(directory, META_FILE)):
                raise TimerwheelError(f"no shard at {directory} (no {META_FILE})")
            _check_meta(directory, wanted)
            return cls(
                directory,
                TimerLog(os.path.join(directory, LOG_DIR), segment_bytes, fsync=fsync, readonly=True),
                TimerWheel(os.path.join(directory, WHEEL_FILE), tick_ms, slots, readonly=True, fsync=fsync),
                writer=False, fsync=fsync, wheel_sync_records=wheel_sync_records, lock_fd=-1,
            )

        os.makedirs(directory, exist_ok=True)
        lock_fd = lock_writer(directory)
        timer_log: TimerLog | None = None
        wheel: TimerWheel | None = None
        try:
            if os.path.exists(os.path.join(directory, META_FILE)):
                _check_meta(directory, wanted)
            elif _has_data(directory):
                raise FormatMismatchError(
                    f"shard {directory} holds a TimerLog or checkpoint but no {META_FILE}; refusing to guess its format"
                )
            else:
                atomic_write(os.path.join(directory, META_FILE), json.dumps(wanted, indent=1).encode() + b"\n", fsync)
            # The dequeue checkpoint is the dequeue owner's, which may be replacing it right now.
            checkpoint.remove_stale_temps(directory, (META_FILE, WHEEL_FILE, ENQUEUE_CKPT), foreign=(DEQUEUE_CKPT,))
            timer_log = TimerLog(os.path.join(directory, LOG_DIR), segment_bytes, fsync=fsync)
            wheel = TimerWheel(os.path.join(directory, WHEEL_FILE), tick_ms, slots, fsync=fsync)
            shard = cls(
                directory, timer_log, wheel,
                writer=True, fsync=fsync, wheel_sync_records=wheel_sync_records, lock_fd=lock_fd,
            )
            ckpt = shard.load_enqueue_checkpoint()
            shard.recovery = recover_from_crash(timer_log, wheel, ckpt.flushed_pos if ckpt else None)
            return shard
        except BaseException:
            if wheel is not None:
                wheel.close()
            if timer_log is not None:
                timer_log.close()
            os.close(lock_fd)
            raise

    def __enter__(self) -> Shard:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _need_writer(self, what: str) -> None:
        if not self.writer:
            raise TimerwheelError(f"shard {self.directory} is open read-only; cannot {what}")

    # ---------------------------------------------------------------- writing

    def slot_time(self, t_ms: int) -> int:
        return t_ms - t_ms % self.tick_ms

    def append(self, records: Sequence[TimerRecord]) -> list[int]:
        """Link the records into their slots (newest first), append them; returns their positions."""
        if not records:
            return []
        first = self.append_array(pack_records(records, with_prev_pos=False))
        return list(range(first, first + len(records) * RECORD_SIZE, RECORD_SIZE))

    def append_array(self, arr: RecordArray) -> int:
        """Bulk ``append`` of a RECORD_DTYPE array (``format.records_array``); returns the first position.

        Sets each record's prev_pos and CRC in ``arr``.
        """
        self._need_writer("append")
        first = self.log.end_pos
        if len(arr) == 0:
            return first
        deliver = arr["deliver_ms"].astype(np.int64)
        positions = first + RECORD_SIZE * np.arange(len(arr), dtype=np.int64)
        prev, update = self.wheel.chain(deliver - deliver % self.tick_ms, positions)
        arr["prev_pos"] = prev
        seal(arr)
        self.log.append_packed(arr)
        self.wheel.stage(update)
        self._unsynced_records += len(arr)
        return first

    def flush(self) -> int:
        """fsync the TimerLog, then publish the wheel (msync it every wheel_sync_records); returns the flushed position."""
        self._need_writer("flush")
        if self._unsynced_records >= max(self.wheel_sync_records, 1):
            return self.sync_wheel()
        pos = self.log.flush()
        self.wheel.publish()
        return pos

    def sync_wheel(self) -> int:
        """flush(), and make the wheel file itself durable up to the flushed position."""
        self._need_writer("sync the wheel")
        pos = self.log.flush()
        self.wheel.flush(synced_pos=pos)
        self._unsynced_records = 0
        return pos

    def skip_to(self, pos: int) -> int:
        """Leave the positions from the end up to ``pos`` unused: zero bytes there (invalid records,
        linked into no slot), made durable with the wheel (``sync_wheel``, so that no later
        recovery checks them again). Returns the bytes skipped.

        For a recovery that lost records a checkpoint had published (a torn or lost tail): readers
        saw positions up to that checkpoint's flushed position, and take what they read of a slot
        as read for good (dequeue-get's open slots, dequeue-put's look for cancels from where its
        record was read). A record written again at one of those positions, a cancel the source
        sends again for one, would be behind every reader of its slot."""
        self._need_writer("skip positions")
        gap = pos - self.log.end_pos
        if gap <= 0:
            return 0
        self.log.append_packed(bytes(gap))
        self.sync_wheel()
        return gap

    # ---------------------------------------------------------------- the reader's view

    def refresh(self, published: EnqueueCheckpoint) -> bool:
        """Reader: bring this view up to what ``published`` publishes; True once every record below
        its flushed position is visible to ``slot``, ``next_nonempty`` and ``read_slot``.

        The view is the wheel as of the synced position its header names (read past this node's
        cache, and its slots read again past the cache when that position moves: on another node
        the wheel is only known written that far) and a ``TailIndex`` of the TimerLog records from
        there to the flushed position, read past the cache too. False while some of those bytes
        cannot be seen yet (a short read, a stale page): the caller retries later and must not take
        the slots for empty meanwhile. The writer's view is always complete.
        """
        if published.epoch != self._epoch:
            self._epoch = published.epoch
            self._damaged.clear()  # a new writer recovered the shard: its checkpoint is looked at afresh
        if self.writer or not self.shared:
            return True  # one page cache: the writer's publishes are this view already
        limit = published.flushed_pos
        synced = self.wheel.fresh_synced_pos()
        if synced is None:
            return False  # the header is being rewritten: read it again next time
        start = max(min(synced, limit), self.log.start_pos)
        tail = self.tail
        if tail is None or published.epoch != self._tail_epoch or limit < tail.end:
            # A first view, or another owner opened the shard (its recovery may have cut the tail
            # and written other records in its place): start again from the wheel.
            fresh = self.wheel.reload()
            self.log.forget_cached()
            tail = self.tail = TailIndex(start if fresh else self.log.start_pos)
            self._tail_epoch = published.epoch
            self._invalid_since = None
        elif start > tail.start and self.wheel.reload():
            tail.forget_below(start)
        return self._read_tail(tail, limit)

    def _read_tail(self, tail: TailIndex, limit: int) -> bool:
        """Index the records of ``[tail.end, limit)``, read fresh; False if some cannot be seen yet."""
        segment_bytes = self.log.segment_bytes
        while tail.end < limit:
            pos = tail.end
            base = pos - pos % segment_bytes
            want = min(limit, base + segment_bytes, pos + CHUNK_RECORDS * RECORD_SIZE) - pos
            data = self.log.read_fresh(pos, want)
            data = data[: len(data) - len(data) % RECORD_SIZE]
            arr = np.frombuffer(data, dtype=RECORD_DTYPE)
            ok = valid_mask(arr)
            good = len(arr) if ok.all() else int(np.argmin(ok))
            positions = pos + RECORD_SIZE * np.arange(good, dtype=np.int64)
            deliver = arr["deliver_ms"][:good].astype(np.int64)
            tail.add(deliver - deliver % self.tick_ms, positions, pos + good * RECORD_SIZE)
            self.log.fresh_end = max(self.log.fresh_end, tail.end)
            if good == len(arr) and len(data) == want:
                continue
            # Bytes the checkpoint says are flushed, yet short or invalid here: a stale view of them
            # (another node's cache) until they stay so for STALE_RETRY_S; then a corrupt record.
            bad = tail.end
            now = time.monotonic()
            if self._invalid_since is None or self._invalid_since[0] != bad:
                self._invalid_since = (bad, now)
            if good < len(arr) and now - self._invalid_since[1] >= STALE_RETRY_S:
                self._report_corrupt(bad, why_invalid(arr[good : good + 1].tobytes()) or "invalid record", -1)
                tail.add(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), bad + RECORD_SIZE)
                continue
            log.warning("shard %s: TimerLog bytes at %d below the published flushed position %d are not "
                        "visible yet (%s); read again later", self.directory, bad, limit,
                        "invalid record" if good < len(arr) else "short read")
            return False
        self._invalid_since = None
        return True

    def slot(self, slot_time: int) -> Slot:
        """The slot as this view knows it: the wheel's, and for a reader its tail records too."""
        slot = self.wheel.get(slot_time)
        found = self.tail.get(slot.slot_time) if self.tail is not None and not self.writer else None
        if found is None:
            return slot
        head, first, num = found
        if slot.magic != SLOT_MAGIC:
            return Slot(slot.slot_time, first, head, num, SLOT_MAGIC)
        return Slot(slot.slot_time, min(slot.first_pos, first), max(slot.last_pos, head),
                    slot.num + num if slot.last_pos < first else max(slot.num, num), SLOT_MAGIC)

    def next_nonempty(self, from_ms: int, to_ms: int) -> int | None:
        """First slot time t with slot_time(from_ms) <= t < to_ms whose slot holds records, or None."""
        found = self.wheel.next_nonempty(from_ms, to_ms)
        if self.tail is None or self.writer:
            return found
        in_tail = self.tail.next_slot(self.slot_time(from_ms), to_ms if found is None else found)
        return found if in_tail is None else in_tail

    def count_range(self, from_ms: int, to_ms: int) -> int:
        """Records in the slots overlapping [from_ms, to_ms), as this view knows them (see ``slot``)."""
        total = self.wheel.count_range(from_ms, to_ms)
        if self.tail is None or self.writer:
            return total
        slot_time, _head, first, num = self.tail.merged(self.slot_time(from_ms), to_ms)
        if not len(slot_time):
            return total
        rows = self.wheel.rows((slot_time // self.tick_ms) % self.slots)
        has = (rows["magic"] == SLOT_MAGIC) & (rows["slot_time"] == slot_time)
        view = np.where(has, rows["num"], 0).astype(np.int64)
        merged = np.where(has & (rows["last_pos"] < first), view + num, np.maximum(view, num))
        return total + int(merged.sum() - view.sum())

    # ---------------------------------------------------------------- reading

    def _report_corrupt(self, pos: int, why: str, slot_time: int) -> None:
        self.corrupt_seen += 1
        log.error("shard %s: corrupt TimerLog record at position %d (reading slot %d): %s; skipped",
                  self.directory, pos, slot_time, why)

    def _link_failed(self, pos: int, why: str, slot_time: int, limit_pos: int) -> None:
        """A link of a slot's chain failed its checks (``limit_pos``: read_slot's with
        ``damage_raises``, else -1). The writer reports and skips it. A reader does too once it has
        met it for DAMAGE_WAIT_S under one checkpoint epoch; until then, if the link is below
        ``limit_pos``, it raises TimerLogDamagedError: the published checkpoint says the record is
        flushed, so it was cut after that (a torn or lost tail: a recovery the writer has not
        published yet). Its slot cannot be told meanwhile: were the record a cancel marker, its
        message would leave (e2e chaos). The writer's recovery repairs the chains and publishes a
        checkpoint of a newer epoch whose input offsets go back before what was lost."""
        if not self.writer and pos < limit_pos:
            now = time.monotonic()
            since = self._damaged.setdefault(pos, now)
            if now - since < DAMAGE_WAIT_S:
                raise TimerLogDamagedError(
                    f"shard {self.directory}: TimerLog record at {pos} of slot {slot_time}, below the published "
                    f"flushed position {limit_pos}: {why}")
        self._report_corrupt(pos, why, slot_time)

    def read_slot(self, slot_time: int, limit_pos: int | None = None, since_pos: int = 0, *,
                  damage_raises: bool = False) -> Iterator[SlotPiece]:
        """The slot's records, newest first, column-wise: (positions, records) pieces of at most
        SLOT_PIECE_RECORDS records each, so that a slot of any size is read in bounded memory.

        Only positions in ``[since_pos, limit_pos)``: the TimerLog only appends, so the records
        at or past a position the slot was read at are exactly those written into it since (its
        *tail*: dequeue-get reads an open slot's tail at each new checkpoint, dequeue-put looks
        for cancel markers there); the chain is followed down to ``since_pos`` only.
        Positions >= ``limit_pos`` are never read (readers pass the published flushed_pos; the
        default is the end of the log for the writer, the enqueue checkpoint's flushed_pos for a
        reader). A slot is read by following prev_pos from its last_pos, one pread per record; a
        dense slot (a burst: at least ``dense_slot_min`` records, and at least one in
        DENSE_SLOT_SHARE of the TimerLog's records between its first and its last) by a
        vectorised scan of that stretch instead: the same records, in the same order. A record
        that fails its checks is reported and skipped, and the rest of the slot is then found by
        a scan back to the slot's first_pos, so it does not hide its neighbours; with
        ``damage_raises`` a reader that must not take such a slot as read (dequeue-get and
        dequeue-put's look for cancels) gets TimerLogDamagedError instead (``_link_failed``).
        """
        slot_time = self.slot_time(slot_time)
        limit_pos = self._limit(limit_pos)
        slot = self.slot(slot_time)
        if since_pos > slot.first_pos:
            if since_pos > slot.last_pos or since_pos >= limit_pos:
                return
            slot = Slot(slot.slot_time, since_pos, slot.last_pos, slot.num, slot.magic)
        stretch = self._dense_stretch(slot, limit_pos)
        if stretch is not None:
            if damage_raises and slot.last_pos < limit_pos:
                # A scan finds no record where the log was cut: its newest link tells (a cut is at the end).
                try:
                    check_link(self.log.read_raw(slot.last_pos), slot.last_pos)
                except CorruptRecordError:
                    self._link_failed(slot.last_pos, "its newest record cut off or invalid", slot_time, limit_pos)
            yield from self._scan(slot_time, *stretch)
            return
        first, pos = slot.first_pos, slot.last_pos
        if 0 <= first <= pos and pos >= limit_pos:  # the chain starts past what may be read
            yield from self._scan(slot_time, first, limit_pos)
            return
        positions: list[int] = []
        data = bytearray()
        read = self.log.read_raw
        while 0 <= first <= pos:
            raw = read(pos)
            try:
                prev, deliver = check_link(raw, pos)
            except CorruptRecordError:
                self._link_failed(pos, why_invalid(raw) or "invalid record", slot_time, limit_pos if damage_raises else -1)
                break
            if deliver - deliver % self.tick_ms != slot_time or prev >= pos:
                self._link_failed(pos, f"record fires at {deliver} (prev_pos {prev}), not a link of slot {slot_time}",
                                  slot_time, limit_pos if damage_raises else -1)
                break
            positions.append(pos)
            data += raw
            if len(positions) == SLOT_PIECE_RECORDS:
                yield _piece(positions, data)
                positions, data = [], bytearray()
            pos = prev
        if positions:
            yield _piece(positions, data)
        if 0 <= first <= pos:  # the chain broke at pos: the rest of the slot lies below it
            yield from self._scan(slot_time, first, pos)

    def _limit(self, limit_pos: int | None) -> int:
        """``limit_pos`` of read_slot: by default the log's end for the writer, else what enqueue.ckpt says is flushed."""
        if limit_pos is not None:
            return limit_pos
        if self.writer:
            return self.log.end_pos
        published = self.load_enqueue_checkpoint()
        return published.flushed_pos if published else 0

    def _dense_stretch(self, slot: Slot, limit_pos: int) -> tuple[int, int] | None:
        """[lo, hi) to scan for a dense slot, or None to follow its chain. A slot run is exactly
        the valid records of its time from first_pos on, so when they are a good share of that
        stretch one vectorised scan beats a pread per link."""
        span = (min(slot.last_pos, limit_pos - RECORD_SIZE) - slot.first_pos) // RECORD_SIZE + 1
        if slot.num >= self.dense_slot_min and slot.num * DENSE_SLOT_SHARE >= span > 0:
            return slot.first_pos, min(slot.last_pos + RECORD_SIZE, limit_pos)
        return None

    def _scan(self, slot_time: int, lo: int, hi: int) -> Iterator[SlotPiece]:
        for positions, records, bad in self.log.scan_back_arrays(lo, hi, slot_time, self.tick_ms, SLOT_PIECE_RECORDS):
            for pos, why in bad:
                self._report_corrupt(pos, why, slot_time)
            if len(positions):
                yield positions, records

    # ---------------------------------------------------------------- checkpoints

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def save_enqueue_checkpoint(self, ckpt: EnqueueCheckpoint) -> None:
        """Atomically replace enqueue.ckpt (FencedError if it holds a newer epoch)."""
        checkpoint.save_enqueue(self._path(ENQUEUE_CKPT), ckpt, self.fsync)

    def load_enqueue_checkpoint(self) -> EnqueueCheckpoint | None:
        """The published enqueue checkpoint as it is now on the volume, or None (a newer owner's file is
        seen within checkpoint.LIST_EVERY_S)."""
        return checkpoint.load_enqueue(self._path(ENQUEUE_CKPT), self._found)

    def save_dequeue_checkpoint(self, ckpt: DequeueCheckpoint) -> None:
        """Atomically replace dequeue.ckpt (FencedError if it holds a newer epoch)."""
        checkpoint.save_dequeue(self._path(DEQUEUE_CKPT), ckpt, self.fsync)

    def load_dequeue_checkpoint(self) -> DequeueCheckpoint | None:
        """The published dequeue checkpoint as it is now on the volume, or None (see above)."""
        return checkpoint.load_dequeue(self._path(DEQUEUE_CKPT), self._found)

    # ---------------------------------------------------------------- retention

    def _segment_max_deliver(self, base: int) -> int:
        """Latest deliver_ms of a full segment's valid records (-1 if none), scanned once and cached."""
        cached = self._segment_max.get(base)
        if cached is None:
            cached = -1
            for _first, arr in self.log.iter_chunks(base, base + self.log.segment_bytes):
                deliver = arr["deliver_ms"][valid_mask(arr)]
                if deliver.size:
                    cached = max(cached, int(deliver.max()))
            self._segment_max[base] = cached
        return cached

    def retain(self, read_ms: int) -> int:
        """Delete leading segments whose every record fires in a slot before ``read_ms`` (R).

        Only full segments below the flushed position, never the last one. Returns how many.
        """
        self._need_writer("delete segments")
        segment_bytes = self.log.segment_bytes
        cut = -1
        for base in self.log.segment_bases()[:-1]:
            if base + segment_bytes > self.log.flushed_pos:
                break
            latest = self._segment_max_deliver(base)
            if latest >= 0 and self.slot_time(latest) + self.tick_ms > read_ms:
                break
            cut = base + segment_bytes
        if cut < 0:
            return 0
        deleted = self.log.delete_before(cut)
        for base in [b for b in self._segment_max if b < cut]:
            del self._segment_max[base]
        return deleted

    # ---------------------------------------------------------------- closing

    def close(self) -> None:
        """Writer: flush and sync the wheel; then release files and the writer lock."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.writer:
                self.sync_wheel()
        finally:
            self.wheel.close()
            self.log.close()
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1


def _piece(positions: list[int], data: bytearray) -> SlotPiece:
    """A piece of a slot read by its links: the positions and the records' bytes as arrays."""
    return np.array(positions, dtype=np.int64), np.frombuffer(data, dtype=RECORD_DTYPE)
