"""The shard repair tools: ``timerwheel recover`` (``repair_shard``) and ``timerwheel rebuild-wheel``
(``rebuild_wheel``, ``change_window``).

Not to be confused with the store's crash recovery (``recovery.py``: every writer's open, by
itself) or with rebuilding lost shards from Kafka (``runtime/disaster.py``). These act on one
stopped shard, by hand or from the operator's recovery Job, and each returns one JSON report
that the command prints; the report's keys and the exit codes are stable (README, "Recovering a
shard"; the codes are the CLI's, ``cli.EXIT_*``):

    0  the shard is consistent now (the report says what was changed)
    1  it could not be repaired or read (the error line says why)
    2  a bad argument, or the data directory's settings differ (one line naming them)
    3  refused: a live process owns the shard (the data directory's lock, the shard's writer
       lock, or a lease in Redis when TW_REDIS_URL is set), named in the error line

``recover`` (``repair_shard``, ARCHITECTURE §4.4 and §7):

1. refuses while the shard is owned (above), and holds the data directory's lock meanwhile;
2. moves an unreadable checkpoint aside (``<file>.corrupt``: kept for inspection, never read);
3. opens the shard as its writer, which runs the store's recovery: a torn TimerLog tail is cut,
   records past the wheel's durable position are re-linked, slots naming lost positions rebuilt;
4. rebuilds what is missing. The enqueue checkpoint: flushed position = the TimerLog's end,
   next source offsets after the newest record of each partition, W = the R chosen below (W only
   moves forward from there; a message due earlier goes to W's slot, invariant 1). The dequeue
   checkpoint: R = the earliest slot any retained record fires in (retention deletes a segment
   only when all its records fire before the old R, so every undelivered record is retained and
   none of its slots lies before this R), and no later than W's slot; with an empty TimerLog, W's
   slot (or now's, with no W either). Nothing is lost; messages in slots from the new R up to W
   may have been delivered before and are delivered again: ``may_deliver_twice`` counts them
   (messages and roll hops, not cancel markers).

``rebuild-wheel`` deletes the wheel file and re-links every retained TimerLog record into a new
one (the same recovery scan, from the TimerLog's first record).

``rebuild-wheel --change-window`` (``change_window``) does the same with another tick, wheel span or
roll window, then stores them in the data directory's deployment file (the shard count and the
timer topic never change). A wheel of another geometry needs three more things:

1. the span must hold every record not yet read: the slots from R (aligned down to the new tick)
   to the latest slot a retained record fires in must all be distinct wheel slots; a span too
   small for them is refused before anything is changed (exit 2, naming TW_WHEEL_SPAN_MS);
2. each record's ``prev_pos`` links the records of its slot, and a new tick makes new slots: the
   links are computed again (the previous retained record of the same new slot time) and each
   segment whose links differ is rewritten as a whole (a temp file renamed over it: a crash
   leaves every segment either old or new, and a second run computes the same links);
3. R moves down to a multiple of the new tick: the messages of the old slots in between were
   delivered and may be delivered again (``may_deliver_twice``). Never early: a slot is read
   only once ``W`` is past its end, and dequeue-put waits for a record not yet due.

The order makes a second run after a crash finish the job: R first (a multiple of both ticks
when the new one is coarser), then the links, the wheel, the shard's ``meta.json``, and the
deployment file last.

What it costs: two passes over the TimerLog, a segment at a time in one buffer (pass 1 checks
every CRC and the span before anything changes; pass 2 computes the links and rewrites only the
segments whose links change), then the store's recovery builds the wheel as ``rebuild-wheel``
does (it checks every CRC again: one code path builds every wheel). Besides the records, each
run pays for the wheel file: deleting the old one, page faults and an msync per 4 KiB page the
records touch (BENCHMARKS.md, "Rebuilding a wheel").
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from timerwheel.config import TimerConfig
from timerwheel.errors import ConfigError, FencedError, ShardInUseError, TimerwheelError
from timerwheel.files import atomic_write
from timerwheel.store import checkpoint
from timerwheel.store.checkpoint import CorruptCheckpointError, DequeueCheckpoint, EnqueueCheckpoint
from timerwheel.store.deployment import DeploymentSettings, load_settings, store_window
from timerwheel.store.format import RECORD_SIZE, Flag, as_bytes, crc32_rows, valid_mask
from timerwheel.store.layout import DataDirLock, recovery_command, shard_dir
from timerwheel.store.recovery import CrashRecoveryReport
from timerwheel.store.shard import (
    DEQUEUE_CKPT,
    ENQUEUE_CKPT,
    LOCK_FILE,
    LOG_DIR,
    WHEEL_FILE,
    Shard,
    change_geometry,
    lock_writer,
    stored_settings,
)
from timerwheel.store.timerlog import TimerLog
from timerwheel.store.wheel import group_order

_DELETE, _ROLL = int(Flag.DELETE), int(Flag.ROLL)
#: The roles that own a shard through a lease (stages.ownership).
LEASE_ROLES = ("enqueue-put", "dequeue-get")


@contextlib.contextmanager
def _stopped_shard(config: TimerConfig, shard: int) -> Iterator[str]:
    """The shard's directory, while no live process may own it: the data directory's lock held
    here, and no lease in Redis (when TW_REDIS_URL names one). ShardInUseError otherwise."""

    directory = shard_dir(config.data_dir, shard)
    stored_settings(directory)  # no shard there: say so before taking any lock
    try:
        lock = DataDirLock(config.data_dir)
    except TimerwheelError as exc:
        raise ShardInUseError(f"shard {shard}: {exc}; stop it first") from None
    try:
        if config.redis_url:
            _check_leases(config, shard)
        yield directory
    finally:
        lock.release()


def _check_leases(config: TimerConfig, shard: int) -> None:
    from timerwheel.security import redis_client
    from timerwheel.transports.redisq import RedisLeaseStore

    leases = RedisLeaseStore(redis_client(config))
    for role in LEASE_ROLES:
        holder = leases.holder(role, shard)
        if holder is not None:
            raise ShardInUseError(f"shard {shard} is owned by {role} {holder[0]!r} (lease epoch {holder[1]} in "
                                  f"{config.redis_url}); stop it first, or wait {config.lease_ttl_ms} ms for its lease to lapse")


def _open_writer(directory: str, fsync: bool) -> Shard:
    tick_ms, slots, segment_bytes = stored_settings(directory)
    try:
        return Shard.open(directory, tick_ms=tick_ms, slots=slots, segment_bytes=segment_bytes, fsync=fsync)
    except FencedError as exc:
        raise ShardInUseError(f"{exc}; stop its owner first") from None


def _set_aside_unreadable(directory: str, name: str, kind: str) -> list[str]:
    """Rename unreadable files of checkpoint ``name`` to ``<file>.corrupt``, newest first, until a
    readable one (or none) is published; the files set aside."""
    path = os.path.join(directory, name)
    moved: list[str] = []
    load = checkpoint.load_enqueue if kind == "enqueue" else checkpoint.load_dequeue
    while True:
        try:
            load(path)
            return moved
        except CorruptCheckpointError:
            bad = checkpoint.published_file(path)
            if bad is None:
                return moved
            os.replace(bad, bad + ".corrupt")
            moved.append(os.path.basename(bad))


def _scan(shard: Shard) -> tuple[int, int | None, dict[int, int]]:
    """Valid records retained, the earliest slot one fires in, the newest source offset per partition."""
    count, earliest = 0, None
    newest: dict[int, int] = {}
    for _first, arr in shard.log.iter_chunks(shard.log.start_pos, shard.log.end_pos):
        good = arr[valid_mask(arr)]
        if not len(good):
            continue
        count += len(good)
        low = int(good["deliver_ms"].min())
        earliest = low if earliest is None else min(earliest, low)
        parts, offs = good["src_partition"].astype(np.int64), good["src_offset"].astype(np.int64)
        for p in np.unique(parts).tolist():
            newest[p] = max(newest.get(p, -1), int(offs[parts == p].max()))
    return count, None if earliest is None else shard.slot_time(earliest), newest


def _fired_between(shard: Shard, lo_ms: int, hi_ms: int) -> int:
    """Messages and roll hops (not cancel markers) whose slot lies in [lo_ms, hi_ms)."""
    total = 0
    for _first, arr in shard.log.iter_chunks(shard.log.start_pos, shard.log.end_pos):
        good = arr[valid_mask(arr)]
        deliver = good["deliver_ms"].astype(np.int64)
        slot = deliver - deliver % shard.tick_ms
        marker = (good["magic"].astype(np.int64) & (_DELETE | _ROLL)) == _DELETE
        total += int(np.count_nonzero((slot >= lo_ms) & (slot < hi_ms) & ~marker))
    return total


def repair_shard(config: TimerConfig, shard_id: int, now_ms: int | None = None) -> dict[str, Any]:
    """Validate and repair one stopped shard (see the module header); the JSON report."""
    started = time.perf_counter()
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    with _stopped_shard(config, shard_id) as directory:
        set_aside = _set_aside_unreadable(directory, ENQUEUE_CKPT, "enqueue")
        set_aside += _set_aside_unreadable(directory, DEQUEUE_CKPT, "dequeue")
        shard = _open_writer(directory, config.fsync)
        try:
            found = shard.recovery
            assert found is not None  # the writer's open always runs recovery
            enq, deq = shard.load_enqueue_checkpoint(), shard.load_dequeue_checkpoint()
            records, earliest, newest = _scan(shard)
            epoch = checkpoint.highest_epoch(directory)
            w_slot = shard.slot_time(enq.write_ms) if enq else None
            if deq is None:
                candidates = [t for t in (earliest, w_slot) if t is not None]
                read_ms = min(candidates) if candidates else shard.slot_time(now_ms)
            else:
                read_ms = deq.read_ms
            if enq is None:
                enq = EnqueueCheckpoint(flushed_pos=shard.flush(), write_ms=read_ms,
                                        next_offsets={p: o + 1 for p, o in newest.items()}, epoch=epoch)
                shard.save_enqueue_checkpoint(enq)
                enq_action = "rebuilt"
            else:
                enq_action = "kept"
            twice = 0
            # The wheel is durable before the dequeue checkpoint appears: that file is what lets a
            # waiting dequeue-get (which opens a reader view, so the writer lock held here does not
            # stop it) start reading, and it must find the re-linked wheel on the volume.
            shard.sync_wheel()
            if deq is None:
                # Every slot before W may have been read and delivered by the owner whose R was lost.
                twice = _fired_between(shard, read_ms, w_slot if w_slot is not None else shard.slot_time(now_ms))
                shard.save_dequeue_checkpoint(DequeueCheckpoint(read_ms=read_ms, epoch=epoch))
                deq_action = "rebuilt"
            else:
                deq_action = "kept"
        finally:
            shard.close()
    changed = bool(set_aside or found.truncated_bytes or found.relinked or found.repaired_slots
                   or enq_action != "kept" or deq_action != "kept")
    return {
        "command": "recover", "shard": shard_id, "data_dir": os.path.abspath(config.data_dir),
        "status": "repaired" if changed else "ok",
        "enqueue_checkpoint": enq_action, "dequeue_checkpoint": deq_action, "set_aside": set_aside,
        "read_ms": read_ms, "write_ms": enq.write_ms, "flushed_pos": enq.flushed_pos,
        "timerlog_start": shard.log.start_pos, "timerlog_end": found.end_pos, "records": records,
        "truncated_bytes": found.truncated_bytes, "relinked": found.relinked,
        "repaired_slots": found.repaired_slots, "corrupt_records": found.corrupt_count,
        "may_deliver_twice": twice, "notes": list(found.notes),
        "seconds": round(time.perf_counter() - started, 3),
    }


def rebuild_wheel(config: TimerConfig, shard_id: int) -> dict[str, Any]:
    """Replace the shard's wheel by one re-linked from every retained TimerLog record; the JSON report."""
    started = time.perf_counter()
    with _stopped_shard(config, shard_id) as directory:
        fd = _writer_lock(directory)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, WHEEL_FILE))
        finally:
            os.close(fd)
        found, slots, tick_ms = _relink(directory, config.fsync)
    return {
        "command": "rebuild-wheel", "shard": shard_id, "data_dir": os.path.abspath(config.data_dir),
        "status": "rebuilt", "tick_ms": tick_ms, "slots": slots,
        "timerlog_start": found.checked_from, "timerlog_end": found.end_pos, "records": found.records_checked,
        "relinked": found.relinked, "truncated_bytes": found.truncated_bytes,
        "corrupt_records": found.corrupt_count, "notes": list(found.notes),
        "seconds": round(time.perf_counter() - started, 3),
    }


def _writer_lock(directory: str) -> int:
    """The shard's writer lock, held (never delete a live writer's wheel); its fd."""
    try:
        return lock_writer(directory)
    except FencedError:
        raise ShardInUseError(f"shard {directory} is open for writing (lock {LOCK_FILE} is held); "
                              "stop its owner first") from None


def _relink(directory: str, fsync: bool) -> tuple[CrashRecoveryReport, int, int]:
    """Open the shard (its wheel deleted) as a writer, which re-links every retained TimerLog
    record into a new wheel; its recovery report, slots and tick."""
    try:
        shard = _open_writer(directory, fsync)
    except CorruptCheckpointError as exc:
        raise TimerwheelError(f"{exc}: run `{recovery_command(directory)}`, then rebuild-wheel") from None
    try:
        found = shard.recovery
        assert found is not None
        return found, shard.slots, shard.tick_ms
    finally:
        shard.close()


def _timer_log(directory: str, segment_bytes: int) -> TimerLog:
    """The shard's TimerLog, read only: a writer's open would cut a torn tail and pad a short
    segment, and pass 1 changes nothing (the store's recovery does that when it re-links)."""
    log_dir = os.path.join(directory, LOG_DIR)
    os.makedirs(log_dir, exist_ok=True)  # a shard whose writer died before its first segment
    return TimerLog(log_dir, segment_bytes, readonly=True)


class _Links:
    """prev_pos of records taken a segment at a time in position order: the position of the
    previous record of the same slot time, kept per wheel index of the new geometry (as
    ``TimerWheel.chain`` links them, except that a record older than what its index holds,
    delivered long ago, starts no chain). Within one segment a record follows the previous record
    of its slot time; across segments only the newest slot time of each index carries over."""

    def __init__(self, tick_ms: int, slots: int) -> None:
        self.tick_ms, self.slots = tick_ms, slots
        # Zeros: the pages of indexes no record touches are never faulted in (16 bytes a slot).
        self.last_t = np.zeros(slots, dtype=np.int64)
        self.last_p = np.zeros(slots, dtype=np.int64)  # position + 1; 0: the index holds nothing yet

    def prev(self, slot_times: Any, positions: Any) -> Any:
        n = len(positions)
        out = np.full(n, -1, dtype=np.int64)
        if not n:
            return out
        low, high = int(slot_times.min()), int(slot_times.max())
        if high - low < 1 << 62:  # ticks since the earliest: a small key group_order sorts stably
            order = group_order((slot_times - low) // self.tick_ms)
        else:
            order = np.argsort(slot_times, kind="stable")
        t_s, p_s = slot_times[order], positions[order]  # positions ascend within a slot time
        start = np.ones(n, dtype=np.bool_)
        start[1:] = t_s[1:] != t_s[:-1]
        prev_s = np.empty(n, dtype=np.int64)
        prev_s[1:] = p_s[:-1]
        first = np.flatnonzero(start)
        idx = (t_s[first] // self.tick_ms) % self.slots
        held_t, held_p = self.last_t[idx], self.last_p[idx]
        prev_s[first] = np.where((held_p > 0) & (held_t == t_s[first]), held_p - 1, -1)
        out[order] = prev_s
        last = np.append(first[1:], n) - 1
        # Ascending slot times: the newest of an index wins (an empty index counts as time -1).
        newer = t_s[last] >= np.where(held_p > 0, held_t, -1)
        self.last_t[idx[newer]] = t_s[last][newer]
        self.last_p[idx[newer]] = p_s[last][newer] + 1
        return out


def change_window(config: TimerConfig, shard_id: int, check_only: bool = False) -> dict[str, Any]:
    """Rebuild one stopped shard's wheel with ``config``'s tick, wheel span and roll window and store
    them in the deployment file (see the module header); the JSON report. ``check_only``: pass 1
    alone (CRCs, the span against the records ahead of R), nothing changed: ``status`` "fits", or
    the ``ConfigError`` a rebuild would raise."""
    started = time.perf_counter()
    tick, slots = config.tick_ms, config.wheel_slots
    stored = load_settings(config.data_dir)
    wanted = (DeploymentSettings(stored.shards, tick, slots * tick, config.roll_window_ms, stored.timer_topic)
              if stored is not None else DeploymentSettings.of(config))
    report: dict[str, Any] = {
        "command": "rebuild-wheel", "change_window": True, "shard": shard_id,
        "data_dir": os.path.abspath(config.data_dir), "tick_ms": tick, "slots": slots,
        "wheel_span_ms": slots * tick, "roll_window_ms": config.roll_window_ms,
        "before": None if stored is None else {"tick_ms": stored.tick_ms, "wheel_span_ms": stored.wheel_span_ms,
                                               "roll_window_ms": stored.roll_window_ms},
    }
    if not os.path.isdir(shard_dir(config.data_dir, shard_id)):
        if check_only:
            return {**report, "status": "fits", "records": 0, "seconds": round(time.perf_counter() - started, 3)}
        store_window(config.data_dir, wanted, fsync=config.fsync)
        return {**report, "status": "no-shard", "records": 0, "records_per_s": 0.0, "relinked": 0,
                "rechained": 0, "segments_rewritten": 0, "may_deliver_twice": 0,
                "seconds": round(time.perf_counter() - started, 3)}
    with _stopped_shard(config, shard_id) as directory:
        fd = _writer_lock(directory)
        try:
            old_tick, _old_slots, segment_bytes = stored_settings(directory)
            path = os.path.join(directory, DEQUEUE_CKPT)
            try:
                deq = checkpoint.load_dequeue(path)
            except CorruptCheckpointError as exc:
                raise TimerwheelError(f"{exc}: run `{recovery_command(directory)}` first") from None
            timer_log = _timer_log(directory, segment_bytes)
            read_ms = deq.read_ms if deq is not None else None
            new_read = None if read_ms is None else read_ms - read_ms % tick
            invalid, records, latest, twice = _scan_segments(timer_log, tick, read_ms, new_read, shard_id, directory)
            if latest is not None and new_read is not None and latest - new_read >= slots * tick:
                raise ConfigError("TW_WHEEL_SPAN_MS", f"a span of {slots * tick} ms cannot hold shard {shard_id}: "
                                  f"its records fire from R={new_read} to {latest}, so the span must exceed "
                                  f"{latest - new_read} ms; nothing was changed")
            if check_only:
                return {**report, "status": "fits", "read_ms": new_read, "latest_ms": latest, "records": records,
                        "seconds": round(time.perf_counter() - started, 3)}
            # R first: a multiple of the new tick (and of the old one when the new is coarser).
            if deq is not None and new_read is not None and new_read != deq.read_ms:
                checkpoint.save_dequeue(path, DequeueCheckpoint(read_ms=new_read, epoch=deq.epoch), config.fsync)
            # Pass 2: the links of the new slots; a segment whose links change is rewritten whole.
            rechained, rewritten = _rewrite_links(timer_log, invalid, tick, slots, config.fsync)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, WHEEL_FILE))
            change_geometry(directory, tick_ms=tick, slots=slots, fsync=config.fsync)
        finally:
            os.close(fd)
        found, _slots, _tick = _relink(directory, config.fsync)
    store_window(config.data_dir, wanted, fsync=config.fsync)
    seconds = time.perf_counter() - started
    return {
        **report, "status": "rebuilt", "old_tick_ms": old_tick,
        "read_ms_before": read_ms, "read_ms": new_read, "may_deliver_twice": twice,
        "timerlog_start": found.checked_from, "timerlog_end": found.end_pos, "records": records,
        "relinked": found.relinked, "rechained": rechained, "segments_rewritten": rewritten,
        "truncated_bytes": found.truncated_bytes, "corrupt_records": found.corrupt_count,
        "notes": list(found.notes), "seconds": round(seconds, 3),
        "records_per_s": round(records / seconds, 1) if seconds > 0 else 0.0,
    }


def _scan_segments(timer_log: TimerLog, tick: int, read_ms: int | None, new_read: int | None,
                   shard_id: int, directory: str) -> tuple[list[Any], int, int | None, int]:
    """change_window's pass 1, read only: each segment's invalid records (their indexes: every
    record's CRC is checked here, once), the valid records, the latest slot one fires in at or
    after the new R (``new_read``), and the messages of the old slots between the two R."""
    buf = bytearray(timer_log.segment_bytes)
    invalid: list[Any] = []
    records = twice = 0
    latest = None
    for base in timer_log.segment_bases():
        arr, _data = timer_log.read_segment(base, buf)
        ok = valid_mask(arr)
        bad = np.flatnonzero(~ok)
        invalid.append(bad)
        good = arr if not bad.size else arr[ok]
        records += len(good)
        if not len(good):
            continue
        if new_read is None:
            raise TimerwheelError(f"shard {shard_id} holds TimerLog records but no dequeue checkpoint: run "
                                  f"`{recovery_command(directory)}` first")
        deliver = good["deliver_ms"].astype(np.int64)
        slot = deliver - deliver % tick
        ahead = slot[slot >= new_read]
        if ahead.size:
            latest = max(latest or 0, int(ahead.max()))
        if new_read != read_ms:
            marker = (good["magic"].astype(np.int64) & (_DELETE | _ROLL)) == _DELETE
            twice += int(np.count_nonzero((deliver >= new_read) & (deliver < (read_ms or 0)) & ~marker))
    return invalid, records, latest, twice


def _rewrite_links(timer_log: TimerLog, invalid: list[Any], tick: int, slots: int,
                   fsync: bool) -> tuple[int, int]:
    """change_window's pass 2: each record's prev_pos in the new slots (the links of a segment
    follow from those before it), and each segment whose links change rewritten whole (a temp
    file renamed over it): its relinked records with new CRCs, the rest (the invalid records pass 1
    found, ``invalid``, and a torn tail) byte for byte. The records relinked and the segments
    rewritten."""
    buf = bytearray(timer_log.segment_bytes)
    links = _Links(tick, slots)
    rechained = rewritten = 0
    for base, bad in zip(timer_log.segment_bases(), invalid, strict=True):
        arr, data = timer_log.read_segment(base, buf)
        at = np.delete(np.arange(len(arr), dtype=np.int64), bad)  # the valid records
        deliver = arr["deliver_ms"][at].astype(np.int64)
        prev = links.prev(deliver - deliver % tick, base + RECORD_SIZE * at)
        changed = np.flatnonzero(arr["prev_pos"][at] != prev)
        if not changed.size:
            continue
        rows = at[changed]
        arr["prev_pos"][rows] = prev[changed]
        arr["crc32"][rows] = crc32_rows(as_bytes(arr[rows]))  # only the records relinked
        atomic_write(timer_log.segment_path(base), data, fsync)
        rechained += int(changed.size)
        rewritten += 1
    return rechained, rewritten
