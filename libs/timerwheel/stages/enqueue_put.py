"""enqueue-put: put queue -> TimerLog + TimerWheel, then ``W`` and source offsets.

Owns shards. For each batch of entries of a shard:

1. skip requests whose source offset the shard already holds (re-reads after a restart or a
   rewind are free of duplicates: invariant 4);
2. choose each record's slot — the slot of its delivery time if that lies inside the roll
   window, a roll slot otherwise (design §5), the slot of ``W`` if already due (invariant 1);
3. append to the TimerLog, link into the wheel, flush (TimerLog, then wheel);
4. advance ``W`` (to now, capped so the wheel never laps an unread slot: a write never goes
   past ``R + span - tick``, and never past the time up to which the shard's input is complete,
   see ``InputWatermark``, plus ``TW_CANCEL_LEAD_MS`` if set), save ``enqueue.ckpt`` atomically, and only then ack the queue.

Idle in production (``StageContext.wait_on_inputs``), a step blocks on the put queue, and an
unchanged W is published once a second only (IDLE_PUBLISH_S), but at once at the end of a slot
that holds records: dequeue-get reads a due slot in its tick, while an empty wheel costs one
checkpoint a second. The embedded runtime does the same on the system clock
(``StageContext.frugal``), waiting in ``idle_wait`` instead (a put by enqueue-get wakes it).

A crash anywhere leaves either the old checkpoint (the entries are redelivered or re-read
and the duplicates skipped by offset) or the new one (the entries were durable).

Rolling: a message due at least ``roll_window`` past ``W`` is written with the ROLL flag at
``W + window/2`` when what remains beyond the window is under a third of it, else at
``W + window``. Once inside the window a message, and a cancel marker for it, go to the slot
of the delivery time itself whatever path they took, so the two always meet there
(RocketMQ #7991 computed roll targets from the write time and missed).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from timerwheel import telemetry
from timerwheel.errors import FencedError
from timerwheel.log import stage_logger
from timerwheel.stages.base import StageContext, decoded, get_by
from timerwheel.stages.codec import PUT_ROW_FIELDS, PutEntry, PutRequest, PutRow
from timerwheel.stages.owner import OwnedShard, ShardOwner
from timerwheel.stages.ownership import Ownership
from timerwheel.store import (
    CorruptCheckpointError,
    DequeueCheckpoint,
    EnqueueCheckpoint,
    Flag,
    Shard,
    shard_dir,
)
from timerwheel.store.format import RECORD_SIZE, RecordArray, records_array, records_from_array, valid_mask
from timerwheel.store.layout import recovery_command
from timerwheel.store.shard import recovery_needed
from timerwheel.transports.base import WorkQueue

STAGE = "enqueue-put"
_NORMAL, _ROLL, _DELETE = int(Flag.NORMAL), int(Flag.ROLL), int(Flag.DELETE)
RETAIN_EVERY_S = 30.0
#: A shard refused for want of ``timerwheel recover`` is looked at again this often.
RECOVERY_RETRY_S = 2.0
#: With ``ctx.frugal`` (production; embedded on the system clock), an idle shard's W is
#: published at most this often (R and the lag then move in steps of this size), but at once
#: when a slot that holds records becomes readable: a due message waits for its tick, never for this.
IDLE_PUBLISH_S = 1.0
#: The shortest idle wait (W held back by R: nothing to publish however often we look).
MIN_WAIT_S = 0.01
#: Observations of the timer topic's end a shard keeps while its input catches up with them.
MAX_UNREACHED_ENDS = 64
#: W waiting this long for the shard's input is logged (once until it moves again).
INPUT_WAIT_LOG_S = 10.0


def roll_targets(deliver_ms: npt.NDArray[np.int64], write_ms: int, base_ms: int,
                 roll_window_ms: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """The roll rule, for a batch: the time whose slot each record is written to, and whether
    that is a roll hop. A record due at least a roll window after ``base_ms`` (``_roll_base``)
    rolls to ``base_ms + window/2`` when what remains beyond the window is under a third of it,
    else to ``base_ms + window``; any other goes to its delivery time's slot, never one before W
    (``write_ms``): an already due record goes to the slot of W."""
    rolled = deliver_ms - base_ms >= roll_window_ms
    beyond = deliver_ms - (base_ms + roll_window_ms)
    fire = np.where(rolled, np.where(beyond < roll_window_ms // 3, base_ms + roll_window_ms // 2,
                                     base_ms + roll_window_ms),
                    np.maximum(deliver_ms, write_ms))
    return fire, rolled


def timerlog_records(partition: npt.NDArray[np.uint64], rows: list[PutRow], write_ms: int, base_ms: int,
                     roll_window_ms: int) -> RecordArray:
    """TimerLog records for a batch of put rows (``partition``: each row's source partition),
    built column-wise, each written to the slot ``roll_targets`` gives."""
    # fromiter over the flattened rows: a third faster than np.array(rows), which inspects each row
    flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.uint64, count=len(rows) * PUT_ROW_FIELDS)
    offset, size, enqueued, deliver, cancel, thash, ihash = flat.reshape(len(rows), PUT_ROW_FIELDS).T
    fire, rolled = roll_targets(deliver.astype(np.int64), write_ms, base_ms, roll_window_ms)
    flags = np.where(cancel.astype(bool), _DELETE, _NORMAL) | np.where(rolled, _ROLL, 0)
    return records_array(flags=flags, enqueue_ms=enqueued.astype(np.int64), deliver_ms=fire,
                         src_partition=partition, src_offset=offset.astype(np.int64), src_size=size,
                         topic_hash=thash, id_hash=ihash)


class InputWatermark:
    """Up to when each shard's input is complete: W never passes it.

    W is the time up to which a shard's slots may be read. Were it only the clock, a timer record
    that reaches the shard late (enqueue-get stopped, rebalancing, or rewinding after Redis lost
    its entries) would find its slot read already: a late message is merely late (it goes to the
    slot of W), but a late *cancel* misses its target, which is delivered. So W also waits for
    the input: at ``t0`` (our clock, read before the request) the timer topic ended at ``ends``
    (the last stable offsets: what a ``read_committed`` reader can reach), so every record the
    topic acknowledged before ``t0`` has an offset below its partition's end; once the shard has
    written every one of its partitions up to that end, its input is complete up to ``t0``. A
    cancel acknowledged before its target's delivery time is then in the wheel before the
    target's slot is read, however late it arrives, and it lands in the target's own slot
    (W is still before the delivery time when it is written).

    ``ends()`` (the timer topic's end offsets) is asked at most every ``interval_s`` of real time,
    and only while some shard's W waits for its input. With ``background`` (production) a thread
    asks, so the stage's loop never waits for Kafka (the request took 12 ms median and up to
    430 ms on a loaded machine, twice a tick): ``observe`` returns the newest answer at once and
    wakes the thread for the next one. In process (embedded, a simulated clock) the log answers
    at once and ``observe`` asks itself."""

    def __init__(self, ctx: StageContext, ends: Callable[[], dict[int, int]], interval_s: float,
                 background: bool = False) -> None:
        self.ctx = ctx
        self.ends = ends
        self.interval_s = interval_s
        self._last: tuple[float, int, dict[int, int]] | None = None
        #: When the last request failed (time.monotonic()): the next waits ``interval_s``.
        self._failed_at = -1e18
        #: Requests failed in a row (one warning a streak, one line when they work again).
        self._failures = 0
        self._asked = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="tw-input-ends", daemon=True)
            self._thread.start()

    def observe(self) -> tuple[int, dict[int, int]] | None:
        """(t0, end offsets): a new observation, or the last one when it is recent enough
        (``interval_s`` of real time, or taken at this very clock time); None if Kafka did not
        answer. In the background: the newest answer, None before the first."""
        if self._thread is not None:
            self._asked.set()
            last = self._last
            return None if last is None else (last[1], last[2])
        mono, now = time.monotonic(), self.ctx.clock.now_ms()
        last = self._last
        if last is not None and (last[1] == now or mono - last[0] < self.interval_s):
            return last[1], last[2]  # an observation is only ever its own time with its own ends
        if mono - self._failed_at < self.interval_s:
            return None
        self._request()
        last = self._last
        return None if last is None or last[0] < mono else (last[1], last[2])

    def _request(self) -> None:
        """One request: the clock read before it, the ends after. A failure keeps the last
        observation as it was (never its ends with the failure's time: W would run on)."""
        mono, now = time.monotonic(), self.ctx.clock.now_ms()
        try:
            ends = self.ends()
        except Exception as exc:  # noqa: BLE001 - W waits (deliveries pause); the stage carries on
            self.ctx.metrics.inc("input_end_failures")
            if not self._failures:
                stage_logger(STAGE).warning("timer topic end offsets unavailable, W waits", error=str(exc))
            self._failures += 1
            self._failed_at = mono
            return
        if self._failures:
            stage_logger(STAGE).info("timer topic end offsets available again", failed_requests=self._failures)
            self._failures = 0
        self._last = (mono, now, ends)

    def _run(self) -> None:
        """The background requests: one at most every ``interval_s``, each once ``observe``
        asked for it (an idle W that needs nothing costs no request)."""
        while not self._stop.is_set():
            if not self._asked.wait(0.5) or self._stop.is_set():
                continue
            self._asked.clear()
            started = time.monotonic()
            self._request()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def close(self) -> None:
        self._stop.set()
        self._asked.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


@dataclass
class PutShard(OwnedShard):
    #: W: the time up to which the shard's slots may be read once published.
    write_ms: int = 0
    #: How far W may run past R (the shard's own wheel less a roll window and a tick): a write,
    #: at most W + roll window, never laps an unread slot.
    headroom_ms: int = 0
    next_offsets: dict[int, int] = field(default_factory=dict)
    published_ms: int = -1
    #: When W was last published, or found with nothing new to publish (time.monotonic()).
    published_at: float = 0.0
    #: R as last read from dequeue.ckpt (a lower bound of the real R).
    read_ms: int = -(2**62)
    #: The shard's input is complete up to here (``InputWatermark``); W never passes it.
    input_ms: int = 0
    #: Observations (t0, end offset per partition of this shard) the input has not reached yet, oldest first.
    unreached_ends: list[tuple[int, dict[int, int]]] = field(default_factory=list)
    #: When W began to wait for the input (time.monotonic()), 0 if it does not; whether that was logged.
    input_wait_since: float = 0.0
    input_wait_logged: bool = False


class EnqueuePut:
    def __init__(self, ctx: StageContext, shard_ids: Iterable[int], open_shard: Callable[[int], Shard],
                 put_queue: WorkQueue, ownership: Ownership,
                 input_ends: Callable[[], dict[int, int]] | None = None) -> None:
        """``open_shard(id)`` opens a shard as its writer, which runs recovery: it is only
        called once the lease is ours, so two writers never touch one TimerLog.

        ``input_ends()``: the timer topic's end offsets (``CommitLog.end_offsets``); W then
        waits for the input (``InputWatermark``). Without it W follows the clock alone (unit
        tests that feed the put queue by hand)."""
        self.ctx = ctx
        # Production asks Kafka at most twice a tick while W waits; in process the log answers
        # at once, and a simulated clock must see its input complete as soon as it moves.
        self.input = None if input_ends is None else InputWatermark(
            ctx, input_ends, ctx.config.tick_ms / 2000 if ctx.wait_on_inputs else 0.0,
            background=ctx.wait_on_inputs)
        self.queue = put_queue
        self.open_shard = open_shard
        self.logger = stage_logger(STAGE)
        self._retained = time.monotonic()
        #: Shards whose lease we hold while their previous owner still has them open (logged once).
        self._blocked: set[int] = set()
        #: When each shard waiting for ``timerwheel recover`` was last looked at.
        self._refused_at: dict[int, float] = {}
        #: The last step found no entry (the next one may wait on the queue).
        self._idle = False
        self.owner: ShardOwner[PutShard] = ShardOwner(ctx, STAGE, shard_ids, ownership, self._take, self._close,
                                                      "writing")
        self.owner.take_shards()

    @property
    def owned(self) -> dict[int, PutShard]:
        """The shards this replica owns now, by id."""
        return self.owner.owned

    @property
    def refused(self) -> dict[int, str]:
        """Shards left unstarted because their state needs ``timerwheel recover``: shard -> why."""
        return self.owner.refused

    def _take(self, shard_id: int) -> PutShard | None:
        """Acquire the shard's lease, then open it as its writer (recovering it), or None: not now."""
        if shard_id in self.refused and time.monotonic() - self._refused_at.get(shard_id, 0.0) < RECOVERY_RETRY_S:
            return None
        ownership, unopenable = self.owner.ownership, self.owner.unopenable
        # A lease kept from an earlier try (below) is still ours.
        epoch = ownership.epochs.get(shard_id) or ownership.acquire(shard_id)
        if epoch is None:
            return None
        why = recovery_needed(self._dir(shard_id))  # before opening: Shard.open would fail or recover
        if why is not None:
            self._refuse(shard_id, why)
            return None
        try:
            shard = self.open_shard(shard_id)
        except FencedError as exc:
            # e2e fix: the previous owner still holds the shard's writer lock (paused past its
            # lease, or still closing). Keep the lease, which fences it, and retry next step;
            # raising here killed the new owner while it held the lease.
            if shard_id not in self._blocked:
                self._blocked.add(shard_id)
                self.logger.warning("shard still locked by its previous owner, waiting", shard=shard_id,
                                    error=str(exc))
            return None
        except CorruptCheckpointError as exc:
            self._refuse(shard_id, f"{exc}; the shard is not started: run `{recovery_command(self._dir(shard_id))}`")
            return None
        except Exception as exc:  # noqa: BLE001 - one shard that cannot be opened must not stop the others
            # Keep the lease (nobody else writes a shard in this state) and retry next step;
            # the operator marks the TimerWheel Degraded naming the shard and the error.
            unopenable.report(shard_id, exc)
            return None
        unopenable.clear(shard_id)
        self._blocked.discard(shard_id)
        ckpt = shard.load_enqueue_checkpoint()
        if ckpt is not None and ckpt.epoch >= epoch:
            # The lease store forgot (Redis flushed): take an epoch above the checkpoint's.
            ownership.release_all_of(shard_id)
            epoch = ownership.acquire(shard_id, floor=ckpt.epoch)
            if epoch is None:
                shard.close()
                return None
        return self._start(shard_id, shard, epoch)

    @staticmethod
    def _close(st: PutShard) -> None:
        st.shard.close()

    def _dir(self, shard_id: int) -> str:
        return shard_dir(self.ctx.config.data_dir, shard_id)

    def _refuse(self, shard_id: int, why: str) -> None:
        """Leave a shard whose state needs ``timerwheel recover`` unstarted (its lease released, so the
        tool may run), saying why once; it is looked at again every RECOVERY_RETRY_S and starts once repaired."""
        self.owner.ownership.release_all_of(shard_id)
        self._refused_at[shard_id] = time.monotonic()
        self.owner.unopenable.refuse(shard_id, why)

    def _start(self, shard_id: int, shard: Shard, epoch: int) -> PutShard:
        log = stage_logger(STAGE, shard_id)
        ckpt = shard.load_enqueue_checkpoint()
        now = self.ctx.clock.now_ms()
        tick = shard.tick_ms
        st = PutShard(shard_id, shard, log, epoch,
                      headroom_ms=shard.slots * tick - self.ctx.config.roll_window_ms - tick)
        if ckpt is None:
            # A new shard starts at the clock; from here on W waits for its input.
            st.write_ms = now
            if shard.load_dequeue_checkpoint() is None:
                # Bootstrap R at the shard's first W, so dequeue-get starts where writes start.
                shard.save_dequeue_checkpoint(DequeueCheckpoint(read_ms=shard.slot_time(now), epoch=0))
        else:
            st.write_ms = ckpt.write_ms
            st.next_offsets = dict(ckpt.next_offsets)
        report = shard.recovery
        if report is not None:
            if ckpt is not None and report.end_pos < ckpt.flushed_pos:
                # e2e fix: records the checkpoint called durable are gone (a torn or lost tail).
                # Resume after the newest source offset still in the TimerLog (design §4.4), not
                # after the checkpoint's, so that Kafka hands the lost records over again.
                st.next_offsets = _offsets_after_loss(shard, st.next_offsets, ckpt.flushed_pos - report.end_pos)
                log.warning("TimerLog lost checkpointed records; resuming from the records it still holds",
                            flushed_pos=ckpt.flushed_pos, end_pos=report.end_pos, offsets=st.next_offsets)
            for p, offset in report.max_src_offsets.items():
                st.next_offsets[p] = max(st.next_offsets.get(p, 0), offset + 1)
            log.info("recovered", epoch=epoch, checked_from=report.checked_from, end_pos=report.end_pos,
                     records=report.records_checked, truncated_bytes=report.truncated_bytes,
                     relinked=report.relinked, corrupt=len(report.corrupt), seconds=round(report.seconds, 3))
        # A checkpointed W had its input complete up to W less the lead it may have run ahead.
        st.input_ms = st.write_ms - self.ctx.config.cancel_lead_ms
        self._advance_w(st)
        self._publish(st)
        return st

    def shard_offsets(self, shard_id: int) -> dict[int, int]:
        st = self.owned.get(shard_id)
        return dict(st.next_offsets) if st else {}

    def step(self, timeout_s: float) -> int:
        """One pass over the owned shards; returns entries written plus W publications."""
        owner = self.owner
        owner.renew()
        for st in owner.balance():
            self._hand_over(st)
        self._blocked.intersection_update(owner.ownership.epochs)  # a lease let go: said again if blocked again
        if owner.waiting:
            owner.take_shards()
        self._retain()
        wait = self.ctx.wait_on_inputs and bool(self.owned)
        block, on_time = self._idle_wait_s(timeout_s) if wait and self._idle else (0.0, False)
        got: dict[int, list[tuple[str, bytes]]] = {}
        for st in self.owned.values():
            # Left pending by a previous owner, every later entry would look like a gap: taken
            # over first (offsets skip what the shard holds already).
            stale = st.take_over_pending(self.queue, self.ctx)
            if stale:
                got[st.shard_id] = stale
        take = get_by if on_time else _get_many
        for shard_id, fresh in take(self.ctx, self.queue, list(self.owned), self.ctx.config.queue_bound,
                                    0 if got else block).items():
            got[shard_id] = got.get(shard_id, []) + fresh
        self._idle = not got
        progress = 0
        for st in list(self.owned.values()):
            entries = got.get(st.shard_id)
            try:
                if entries:
                    self.write(st, entries)
                    progress += len(entries)
                elif self._idle_advance(st):
                    owner.ownership.check(st.shard_id)
                    self._publish(st)
                    progress += 1  # a new W is progress too: dequeue-get may now read more
            except FencedError as exc:
                owner.lose(st.shard_id, str(exc))
        if not progress and not wait:
            self.ctx.idle_wait(STAGE, self._idle_wait_s(timeout_s)[0] if self.ctx.frugal and self.owned else timeout_s)
        return progress

    def _idle_advance(self, st: PutShard) -> bool:
        """``_advance_w`` for a shard with no new entry. With ``ctx.frugal``, W stays where it
        was published for up to IDLE_PUBLISH_S, unless a slot holding records would become
        readable (one between the published W and the new one)."""
        if not self.ctx.frugal or st.published_ms < 0:
            return self._advance_w(st)
        if time.monotonic() - st.published_at < IDLE_PUBLISH_S:
            slot = st.shard.slot_time(self._target_w(st))
            if slot == st.published_ms or st.shard.next_nonempty(st.published_ms, slot) is None:
                return False
        if self._advance_w(st):
            return True
        st.published_at = time.monotonic()  # nothing new (W held back by R): look again in IDLE_PUBLISH_S
        return False

    def _idle_wait_s(self, timeout_s: float) -> tuple[float, bool]:
        """How long an idle step may wait on the queue: until some shard's W is due to be
        published (IDLE_PUBLISH_S after the last, or the end of the next slot holding records);
        and whether the wait must end on time (a due slot's end: see ``get_by``)."""
        now_ms = self.ctx.clock.now_ms()
        mono = time.monotonic()
        wait, on_time = timeout_s, False
        for st in self.owned.values():
            tick = st.shard.tick_ms
            wait = min(wait, max(st.published_at + IDLE_PUBLISH_S - mono, (st.published_ms + tick - now_ms) / 1000))
        for st in self.owned.values():
            if st.unreached_ends:
                continue  # W waits for entries of this shard, and an entry ends the wait
            tick = st.shard.tick_ms
            due = st.shard.next_nonempty(st.published_ms, st.published_ms + max(0, int(wait * 1000)) + tick)
            if due is not None and (due + tick - now_ms) / 1000 <= wait:
                wait, on_time = (due + tick - now_ms) / 1000, True
        return max(MIN_WAIT_S, wait), on_time

    def write(self, st: PutShard, entries: list[tuple[str, bytes]]) -> None:
        t0 = telemetry.batch_start()
        gaps = 0
        offsets = dict(st.next_offsets)
        rows: list[PutRow] = []
        partitions: list[int] = []
        counts: list[int] = []
        for entry in decoded(self.ctx, self.queue, st.shard_id, entries, PutEntry.decode, st.logger):
            p = entry.src_partition
            have = offsets.get(p, 0)
            if entry.from_offset > have:
                # Entries before this one were lost in transit; enqueue-get rewinds to `have`.
                gaps += 1
                continue
            new = entry.rows if entry.from_offset == have else [r for r in entry.rows if r[0] >= have]
            if new:
                rows += new
                partitions.append(p)
                counts.append(len(new))
            offsets[p] = max(have, entry.next_offset)
        if gaps:
            self.ctx.metrics.inc("put_gaps", gaps, shard=st.shard_id)
            st.logger.warning("entries after a gap skipped", entries=gaps)
        self.owner.ownership.check(st.shard_id)
        records = timerlog_records(np.repeat(np.array(partitions, dtype=np.uint64), counts), rows, st.write_ms,
                                   self._roll_base(st), self.ctx.config.roll_window_ms) if rows else None
        if records is not None:
            st.shard.append_array(records)
        st.next_offsets = offsets  # only once the records are in the TimerLog
        self._advance_w(st)
        self._publish(st)
        self.queue.ack(st.shard_id, [eid for eid, _ in entries])
        self.ctx.metrics.inc("timerlog_records", len(rows), shard=st.shard_id)
        if t0 is not None:
            written = records_from_array(records) if records is not None else []
            telemetry.enqueue_put_batch(t0, st.shard_id, _requests(entries), written, st.shard.slot_time)

    def _target_w(self, st: PutShard, observe: bool = True) -> int:
        """Now, capped so that no write (at most W + roll window) can lap an unread slot, and
        never past the time up to which the shard's input is complete (``InputWatermark``;
        ``observe``: ask where the timer topic ends if that would move W).

        R only grows, so the last R we read gives a safe cap; R is re-read only when that cap binds."""
        now = self.ctx.clock.now_ms()
        if now > st.read_ms + st.headroom_ms:
            dq = st.shard.load_dequeue_checkpoint()
            st.read_ms = dq.read_ms if dq else st.write_ms
        target = min(now, st.read_ms + st.headroom_ms)
        if self.input is not None and target > st.input_ms:
            if observe:
                self._input_complete(st)
            target = min(target, st.input_ms + self.ctx.config.cancel_lead_ms)
        return max(st.write_ms, target)

    def _roll_base(self, st: PutShard) -> int:
        """What rolling is relative to: W as the clock alone would set it (now, capped by R), not
        W held back for the input. A shard whose input lagged would otherwise roll messages due
        soon (due a roll window after a W far behind), and their hops, read only once W catches
        up, could come back after their delivery time, each into the slot of W then: a message
        and its cancel would no longer meet. Writes stay inside the wheel: up to this + roll
        window, which the cap keeps clear of unread slots."""
        return max(st.write_ms, min(self.ctx.clock.now_ms(), st.read_ms + st.headroom_ms))

    def _input_complete(self, st: PutShard) -> None:
        """Move ``st.input_ms`` to the newest observation of the timer topic's end that the
        shard's written offsets have reached, observing again if none is awaited."""
        assert self.input is not None
        have = st.next_offsets
        unreached = st.unreached_ends
        if len(unreached) < MAX_UNREACHED_ENDS:
            seen = self.input.observe()
            if seen is not None and (not unreached or seen[0] > unreached[-1][0]):
                t0, ends = seen
                shards = self.ctx.config.shards
                # An end that seems to move back (a broker just restarted) is not trusted: the
                # records below the higher end are waited for, as new ones soon pass it anyway.
                unreached.append((t0, {p: e for p, e in ends.items() if p % shards == st.shard_id}))
        done = 0
        for t0, ends in unreached:
            if any(have.get(p, 0) < e for p, e in ends.items()):
                break
            st.input_ms = max(st.input_ms, t0)
            done += 1
        if done:
            del unreached[:done]
        self._report_input_wait(st)

    def _report_input_wait(self, st: PutShard) -> None:
        """``input_wait_ms`` per shard, and one log line when W has waited INPUT_WAIT_LOG_S for
        its input (enqueue-get stopped or far behind): deliveries of the shard pause meanwhile."""
        waiting = bool(st.unreached_ends)
        now = self.ctx.clock.now_ms()
        self.ctx.metrics.set("input_wait_ms", max(0, now - st.input_ms) if waiting else 0, shard=st.shard_id)
        if not waiting:
            if st.input_wait_logged:
                st.logger.info("W no longer waits for the timer topic", input_ms=st.input_ms)
            st.input_wait_since, st.input_wait_logged = 0.0, False
            return
        mono = time.monotonic()
        if not st.input_wait_since:
            st.input_wait_since = mono
        elif not st.input_wait_logged and mono - st.input_wait_since >= INPUT_WAIT_LOG_S:
            st.input_wait_logged = True
            behind = {str(p): [st.next_offsets.get(p, 0), e] for p, e in st.unreached_ends[0][1].items()
                      if st.next_offsets.get(p, 0) < e}
            st.logger.warning("W waits for the timer topic: records acknowledged before it are not written yet "
                           "(is enqueue-get running?)", waited_s=round(mono - st.input_wait_since, 1),
                           input_ms=st.input_ms, behind=behind)

    def _advance_w(self, st: PutShard) -> bool:
        """Move W to its target. True if its slot differs from the published one."""
        st.write_ms = self._target_w(st)
        return st.shard.slot_time(st.write_ms) != st.published_ms

    def _publish(self, st: PutShard) -> None:
        flushed = st.shard.flush()
        st.published_at = time.monotonic()
        st.shard.save_enqueue_checkpoint(EnqueueCheckpoint(
            flushed_pos=flushed, write_ms=st.write_ms, next_offsets=dict(st.next_offsets), epoch=st.epoch))
        slot = st.shard.slot_time(st.write_ms)
        if slot != st.published_ms:
            st.published_ms = slot
            pub = self.ctx.published_w
            pub[st.shard_id] = pub.get(st.shard_id, 0) + 1
            self.ctx.wake("dequeue-get")  # a new slot may be readable
        now = self.ctx.clock.now_ms()
        self.ctx.metrics.set("write_lag_ms", max(0, now - st.write_ms), shard=st.shard_id)
        self.ctx.metrics.set("timerlog_bytes", flushed - st.shard.log.start_pos, shard=st.shard_id)
        self.ctx.metrics.set("write_ms", st.write_ms, shard=st.shard_id)
        self.ctx.metrics.set("owner_epoch", st.epoch, shard=st.shard_id, stage=STAGE)

    def _hand_over(self, st: PutShard) -> None:
        """Publish a last checkpoint, then let the shard go (``ShardOwner.hand_over``: closed, then
        its lease released): its next owner takes it at once and finds everything written so far durable."""
        try:
            self.owner.ownership.check(st.shard_id)
            self._publish(st)
        except FencedError as exc:
            self.owner.lose(st.shard_id, str(exc))
            return
        self.owner.hand_over(st, write_ms=st.write_ms)

    def _retain(self) -> None:
        """Delete TimerLog segments whose records all fire before R (every 30 s)."""
        now = time.monotonic()
        if now - self._retained < RETAIN_EVERY_S:
            return
        self._retained = now
        for st in self.owned.values():
            dq = st.shard.load_dequeue_checkpoint()
            if dq is not None:
                deleted = st.shard.retain(dq.read_ms)
                if deleted:
                    st.logger.info("retention", segments_deleted=deleted, read_ms=dq.read_ms)

    def caught_up(self) -> bool:
        """Every owned shard has published W for the current slot (or its cap)."""
        return all(st.shard.slot_time(self._target_w(st, observe=False)) == st.published_ms
                   for st in self.owned.values())

    def close(self) -> None:
        for st in self.owned.values():
            try:
                self._publish(st)
            except Exception:  # noqa: BLE001 - best effort on shutdown; recovery covers the rest
                st.logger.error("final checkpoint failed", exc=True)
            st.shard.close()
        self.owner.leave()
        if self.input is not None:
            self.input.close()


def _get_many(ctx: StageContext, queue: WorkQueue, partitions: list[int], max_entries: int,
              wait_s: float) -> dict[int, list[tuple[str, bytes]]]:
    """``get_by`` for a wait that may end late (Redis's timeout granularity)."""
    return queue.get_many(partitions, ctx.consumer, max_entries, wait_s)


def _requests(entries: list[tuple[str, bytes]]) -> Iterator[tuple[int, PutRequest]]:
    """(source partition, request) of each entry, decoded again: only when tracing is on."""
    for _eid, payload in entries:
        entry = PutEntry.decode(payload)
        for req in entry.requests:
            yield entry.src_partition, req


def _offsets_after_loss(shard: Shard, offsets: dict[int, int], lost_bytes: int) -> dict[int, int]:
    """Next source offset per partition after the newest record of it still in the TimerLog.

    A shard writes each partition's records in offset order, so any lost record of a partition
    lies past its newest surviving one. A partition with no record left is rewound by the number
    of records lost (its records may all have been among them)."""
    newest: dict[int, int] = {}
    for _first, arr in shard.log.iter_chunks(shard.log.start_pos, shard.log.end_pos):
        good = arr[valid_mask(arr)]
        if len(good):
            parts, offs = good["src_partition"].astype(np.int64), good["src_offset"].astype(np.int64)
            for p in np.unique(parts).tolist():
                newest[p] = max(newest.get(p, -1), int(offs[parts == p].max()))
    lost = -(-lost_bytes // RECORD_SIZE)
    out = {p: max(0, o - lost) for p, o in offsets.items()}
    out.update({p: o + 1 for p, o in newest.items()})
    return out
