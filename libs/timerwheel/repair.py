"""The shard repair tools: ``timerwheel recover`` and ``timerwheel rebuild-wheel``.

Both act on one stopped shard and print one JSON report; the operator's recovery Job calls them,
so the report's keys and the exit codes are stable (README, "Recovering a shard"):

    0  the shard is consistent now (the report says what was changed)
    1  it could not be repaired or read (the error line says why)
    2  a bad argument, or the data directory's settings differ (one line naming them)
    3  refused: a live process owns the shard (the data directory's lock, the shard's writer
       lock, or a lease in Redis when TW_REDIS_URL is set), named in the error line

``recover`` (ARCHITECTURE §4.4 and §7):

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
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from timerwheel.config import TimerConfig
from timerwheel.errors import FencedError, ShardInUseError, TimerwheelError
from timerwheel.files import FILE_MODE
from timerwheel.store import checkpoint
from timerwheel.store.checkpoint import CorruptCheckpointError, DequeueCheckpoint, EnqueueCheckpoint
from timerwheel.store.format import Flag, valid_mask
from timerwheel.store.shard import (
    DEQUEUE_CKPT,
    ENQUEUE_CKPT,
    LOCK_FILE,
    WHEEL_FILE,
    Shard,
    recovery_command,
    shard_dir,
    stored_settings,
)

#: Exit codes of the repair commands (stable: the operator's Job reads them).
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_IN_USE = 0, 1, 2, 3

_DELETE, _ROLL = int(Flag.DELETE), int(Flag.ROLL)
#: The roles that own a shard through a lease (stages.ownership).
LEASE_ROLES = ("enqueue-put", "dequeue-get")


@contextlib.contextmanager
def _stopped_shard(config: TimerConfig, shard: int) -> Iterator[str]:
    """The shard's directory, while no live process may own it: the data directory's lock held
    here, and no lease in Redis (when TW_REDIS_URL names one). ShardInUseError otherwise."""
    from timerwheel.embedded import DataDirLock

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


def _highest_epoch(directory: str) -> int:
    """The highest owner epoch any checkpoint file of the shard is named by (set aside ones too)."""
    best = 0
    for name in os.listdir(directory):
        parts = name.split(".")
        if len(parts) >= 3 and parts[0] in ("enqueue", "dequeue") and parts[1].isdigit() and parts[2] == "ckpt":
            best = max(best, int(parts[1]))
    return best


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


def recover_shard(config: TimerConfig, shard_id: int, now_ms: int | None = None) -> dict[str, Any]:
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
            epoch = _highest_epoch(directory)
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
        fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # never delete a live writer's wheel
            except BlockingIOError:
                raise ShardInUseError(f"shard {directory} is open for writing (lock {LOCK_FILE} is held); "
                                      "stop its owner first") from None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, WHEEL_FILE))
        finally:
            os.close(fd)
        try:
            shard = _open_writer(directory, config.fsync)
        except CorruptCheckpointError as exc:
            raise TimerwheelError(f"{exc}: run `{recovery_command(directory)}`, then rebuild-wheel") from None
        try:
            found = shard.recovery
            assert found is not None
            slots, tick_ms = shard.slots, shard.tick_ms
        finally:
            shard.close()
    return {
        "command": "rebuild-wheel", "shard": shard_id, "data_dir": os.path.abspath(config.data_dir),
        "status": "rebuilt", "tick_ms": tick_ms, "slots": slots,
        "timerlog_start": found.checked_from, "timerlog_end": found.end_pos, "records": found.records_checked,
        "relinked": found.relinked, "truncated_bytes": found.truncated_bytes,
        "corrupt_records": found.corrupt_count, "notes": list(found.notes),
        "seconds": round(time.perf_counter() - started, 3),
    }
