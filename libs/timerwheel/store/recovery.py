"""Crash recovery: make a shard's TimerLog and TimerWheel agree again after a crash (ARCHITECTURE §4.4).

It runs on every open of a shard by its writer (``Shard.open``), by itself; the repair tools that an
operator runs on a stopped shard are ``store/repair.py``, and rebuilding lost shards from Kafka
is ``runtime/disaster.py``.

When the writer's ``Shard.open`` returns, recovery guarantees:

- the TimerLog ends just after its last valid record: a torn or corrupt tail (bad records with
  nothing valid after them) is cut off;
- every valid record from ``checked_from`` on is linked into its own slot exactly once, chains
  newest first; a bad record in the middle (valid records follow) is reported with its position in
  ``corrupt`` and never linked;
- no wheel slot names a position at or past the end (a slot that did is rebuilt by a scan; a
  wheel this open created holds only what recovery linked, so it is not scanned);
- ``max_src_offsets`` holds the highest source offset per timer-topic partition among the valid
  records checked, so enqueue-put resumes after them and writes nothing twice;
- the TimerLog is fsynced and the wheel is durable and says so (its synced_pos is the end).

Why it may start late: below the enqueue checkpoint's flushed_pos the TimerLog is durable, and
below the wheel header's synced_pos the wheel is; so ``checked_from`` = min(both). Everything from
there is checked and re-linked with ``TimerWheel.revise``, which is idempotent: a slot on file is a
state it really had after some earlier publish, and records it already counts are not counted again.

How it stays fast and small: 64K records at a time are read into one reused buffer; their checks
(CRC by table lookups), their slots and the per-slot aggregation (sort, reduceat) are numpy over
the whole chunk. Memory does not grow with the log: one chunk, its temporaries, and the pages of
the wheel the records touch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from timerwheel.store.format import RECORD_SIZE, valid_mask
from timerwheel.store.timerlog import CHUNK_RECORDS, TimerLog
from timerwheel.store.wheel import Slot, TimerWheel, group_order

log = logging.getLogger(__name__)

#: At most this many corrupt positions are listed one by one in a report.
MAX_LISTED_CORRUPT = 10_000


@dataclass(frozen=True, slots=True)
class CrashRecoveryReport:
    """What recovery found and did. Positions are TimerLog byte offsets."""

    checked_from: int
    end_pos: int
    records_checked: int
    truncated_bytes: int
    relinked: int
    corrupt: tuple[tuple[int, str], ...]
    max_src_offsets: dict[int, int]
    seconds: float
    #: Wheel slots that named a position past the end and were rebuilt.
    repaired_slots: int = 0
    #: All corrupt records in the middle; ``corrupt`` lists the first MAX_LISTED_CORRUPT.
    corrupt_count: int = 0
    notes: tuple[str, ...] = field(default=())


def _runs(positions: npt.NDArray[np.int64]) -> list[tuple[int, int]]:
    """[start, end) runs of consecutive record positions."""
    breaks = np.flatnonzero(np.diff(positions) != RECORD_SIZE) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(positions)])) - 1
    return [(int(positions[s]), int(positions[e]) + RECORD_SIZE) for s, e in zip(starts, ends, strict=True)]


def _raise_max(best: dict[int, int], partitions: npt.NDArray[np.int64], offsets: npt.NDArray[np.int64]) -> None:
    order = group_order(partitions)
    parts, offs = partitions[order], offsets[order]
    starts = np.flatnonzero(np.concatenate(([True], parts[1:] != parts[:-1])))
    for p, o in zip(parts[starts].tolist(), np.maximum.reduceat(offs, starts).tolist(), strict=True):
        if o > best.get(p, -1):
            best[p] = o


def recover_from_crash(
    timer_log: TimerLog, wheel: TimerWheel, flushed_pos: int | None, *, chunk_records: int = CHUNK_RECORDS
) -> CrashRecoveryReport:
    """Check the TimerLog from min(flushed_pos, wheel.synced_pos), cut a bad tail, re-link the rest."""
    started = time.perf_counter()
    notes: list[str] = []
    end = timer_log.end_pos
    if flushed_pos is not None and flushed_pos > end:
        notes.append(f"TimerLog ends at {end}, before the checkpoint's flushed position {flushed_pos}: durable data is gone")
    if wheel.synced_pos > end:
        notes.append(f"TimerLog ends at {end}, before the wheel's synced position {wheel.synced_pos}")
    checked_from = max(timer_log.start_pos, min(flushed_pos or 0, wheel.synced_pos, end))
    tick = wheel.tick_ms

    bad: list[tuple[int, int]] = []
    good_end = checked_from
    checked = relinked = 0
    max_offsets: dict[int, int] = {}
    for first, arr in timer_log.iter_chunks(checked_from, end, chunk_records=chunk_records):
        ok = valid_mask(arr)
        positions = first + RECORD_SIZE * np.arange(len(arr), dtype=np.int64)
        whole = bool(ok.all())
        if not whole:
            for run in _runs(positions[~ok]):
                if bad and bad[-1][1] == run[0]:
                    bad[-1] = (bad[-1][0], run[1])
                else:
                    bad.append(run)
        if ok.any():
            good, at = (arr, positions) if whole else (arr[ok], positions[ok])  # no copy of a chunk all valid
            good_end = int(at[-1]) + RECORD_SIZE
            deliver = good["deliver_ms"].astype(np.int64)
            relinked += wheel.revise(deliver - deliver % tick, at)
            _raise_max(max_offsets, good["src_partition"].astype(np.int64), good["src_offset"].astype(np.int64))
        checked += len(arr)

    if good_end < end:
        log.warning("TimerLog %s: cutting a bad tail of %d bytes at %d", timer_log.directory, end - good_end, good_end)
        timer_log.truncate(good_end)
    middle = [(start, min(stop, good_end)) for start, stop in bad if start < good_end]
    corrupt_count = sum((stop - start) // RECORD_SIZE for start, stop in middle)
    corrupt: list[tuple[int, str]] = []
    for start, stop in middle:
        for pos in range(start, stop, RECORD_SIZE):
            if len(corrupt) == MAX_LISTED_CORRUPT:
                break
            corrupt.append((pos, timer_log.why_at(pos) or "invalid record"))
    if corrupt_count:
        log.error("TimerLog %s: %d corrupt records in the middle, skipped (first at %d: %s)",
                  timer_log.directory, corrupt_count, corrupt[0][0], corrupt[0][1])

    # A wheel this open created holds only the slots linked above, whose records all lie below
    # good_end: no slot of it can name a lost position (spares reading the whole file).
    repaired = 0 if wheel.created else _repair_slots_past_end(timer_log, wheel, good_end)
    timer_log.flush()
    wheel.flush(synced_pos=timer_log.end_pos)
    return CrashRecoveryReport(
        checked_from=checked_from,
        end_pos=timer_log.end_pos,
        records_checked=checked,
        truncated_bytes=end - good_end + timer_log.trimmed_bytes,
        relinked=relinked,
        corrupt=tuple(corrupt),
        max_src_offsets=max_offsets,
        seconds=time.perf_counter() - started,
        repaired_slots=repaired,
        corrupt_count=corrupt_count,
        notes=tuple(notes),
    )


def _repair_slots_past_end(timer_log: TimerLog, wheel: TimerWheel, end: int) -> int:
    """Rebuild every slot naming a position >= end from the records still below it."""
    damaged = wheel.referencing(end)
    for i in damaged.tolist():
        slot = wheel.stored(i)
        found = []
        if 0 <= slot.first_pos < end:
            found = [
                pos
                for pos, record, _why in timer_log.scan_back(slot.first_pos, end, slot.slot_time, wheel.tick_ms)
                if record is not None
            ]
        repaired = Slot(slot.slot_time, found[-1], found[0], len(found), 0) if found else Slot(
            slot.slot_time, -1, -1, 0, 0
        )
        log.warning("wheel slot %d (time %d) named position %d past the TimerLog end %d; rebuilt with %d records",
                    i, slot.slot_time, slot.last_pos, end, len(found))
        wheel.overwrite(i, repaired)
    return len(damaged)
