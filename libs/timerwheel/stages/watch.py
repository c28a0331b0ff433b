"""dequeue-put's watch of the timer topic: a record leaves once the input up to its time is seen,
not once ``W`` passed it (design precision-and-exactly-once.md 2.2; issue 30).

``W`` trails the clock by the whole input path: enqueue-get's fetch, the put queue, the TimerLog's
fsync, the checkpoint (a p50 of ~110 ms at 500 msg/s on the shared machine). A record due at ``t``
needs less before it may leave: every cancel of it acknowledged before ``t`` must be found. Such a
cancel is at an offset below the shard's timer partitions' high watermarks ``E`` asked at any
``t0 >= t``, and either

- below the input offsets ``O`` of the shard's enqueue.ckpt (``next_offsets``): then it is in the
  TimerLog below that checkpoint's flushed position, in the message's slot, where the release's
  look in the slot's tail finds it (``DequeuePut._cancelled``), as for the W gate; or
- in ``[O, E)``: this watch reads those offsets itself, a read_committed consumer per shard, and
  keeps the cancels it meets (``markers``), and the reschedules (issue 31: a reschedule is a
  marker of the revision it replaces; of a record's markers the first decides, in dequeue-put).

So a DELIVER record of shard ``s`` due at ``t`` may leave once an observation ``(t0, E, R0)`` with
``t < t0`` is *covered*: the shard's consumer is at or past ``E`` on each of its partitions, having
kept every cancel from an offset at or below the checkpoint's ``O`` on. It is granted up to
``min(t0, R0 + w_cap)``, ``R0`` the shard's R read before ``t0`` and ``w_cap`` enqueue-put's cap
(``enqueue_put.w_cap_ms``), exactly as enqueue-put grants W: a rolled message or cancel due at
``t`` sits in a roll slot at least a third of the window before ``t``, its hop is in Kafka once R
passed that slot, and ``t < R0 + w_cap`` says R had before ``t0`` (so the hop is below ``E``). An
open transaction on a partition holds the consumer at its last stable offset, below ``E``: the
record waits (late, never wrong). In the loose mode (``TW_CANCEL_LEAD_MS`` = N) an observation
grants up to ``t0 + N`` instead, and is taken shortly before the records' time (``look_ahead``),
so that they leave at it: a cancel acknowledged in the last N ms may then miss. ROLL items still
wait for ``W``; so does everything when the watch cannot tell (no observation yet, the broker
restarting, a checkpoint whose ``O`` went back after a lossy recovery: the consumer is moved back
and the watch covers again once it reads on).

Cost, only while records wait for their gate: one ListOffsets for every shard whose records wait
at most every OBSERVE_S (``want``: one request serves them all), and the
consumer's fetches of ``[O, E)`` (what enqueue-put has not checkpointed yet: a few hundred ms of
input). An idle watch is not polled; its consumer is moved up to ``O`` when it is needed again, so
it never reads what the TimerLog holds already.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from timerwheel.log import stage_logger
from timerwheel.records import Record
from timerwheel.stages.base import StageContext
from timerwheel.stages.enqueue_put import w_cap_ms
from timerwheel.store import CorruptCheckpointError, EnqueueCheckpoint, Shard
from timerwheel.transports.base import CommitLog, Consumer
from timerwheel.wire import H_CANCEL, H_REPLACES, marker_target

#: How often a shard's timer partitions' ends are asked while records wait for the gate.
OBSERVE_S = 0.01
#: How soon a look that did not reach the pursued observation's ends reads on (``next_look_s``).
READ_AGAIN_S = 0.001
#: How long one look waits for the consumer to reach the observed ends.
CATCH_UP_S = 0.02
#: How long ``read_on`` waits for what has arrived.
READ_ON_WAIT_S = 0.002
#: Records read per poll.
POLL_RECORDS = 2_000


@dataclass(frozen=True, slots=True)
class Observation:
    """The shard's timer partitions' high watermarks ``ends`` asked at ``t0`` (this clock, before
    the request), and its R as read before ``t0``."""

    t0: int
    ends: dict[int, int]
    read_ms: int


@dataclass
class ShardWatch:
    """One shard's consumer, what it kept and its last observation."""

    shard_id: int
    partitions: list[int]
    consumer: Consumer | None = None
    #: Partition -> the offset from which every cancel up to the consumer's position is kept.
    kept_from: dict[int, int] = field(default_factory=dict)
    #: (message id, revision) -> each marker of it met: a cancel, or a reschedule (issue 31; the
    #: first of them decides, ``DequeuePut._decided``, which needs a reschedule's content).
    cancels: dict[tuple[str, int], list[Record]] = field(default_factory=dict)
    #: The observation being pursued (its ends not reached yet), when it was asked (monotonic).
    seen: Observation | None = None
    asked_at: float = 0.0
    #: What the reached observations grant (``Watch.granted``); None while none is valid.
    grant: int | None = None
    #: The checkpoint whose input offsets the consumer was last moved to (``Watch._follow_from``).
    floor: EnqueueCheckpoint | None = None
    #: The shard's store, as the last ``granted`` passed it (``Watch._observe`` reads its R).
    shard: Shard | None = None
    #: When its consumer was last polled (monotonic).
    polled_at: float = 0.0


class Watch:
    """The watches of the shards a DequeuePut releases records of (module header)."""

    def __init__(self, ctx: StageContext, commit_log: CommitLog) -> None:
        self.ctx = ctx
        self.commit_log = commit_log
        self.topic = ctx.config.timer_topic
        self.logger = stage_logger("dequeue-put")
        self._shards: dict[int, ShardWatch] = {}
        self._partitions: int | None = None
        self._wanted: set[int] = set()

    def granted(self, shard_id: int, shard: Shard, ckpt: EnqueueCheckpoint, wanted_ms: int,
                patient: bool = True) -> int | None:
        """The time before which the shard's DELIVER records may leave by the watch (their
        cancels then in ``cancelled`` or below ``ckpt``'s flushed position), or None.

        An observation is pursued until the consumer reaches its ends (the input keeps coming: a
        newer one each time would never be reached); a new one is asked (at most every OBSERVE_S)
        once the last is reached and grants no more than ``wanted_ms``. Not ``patient`` (records
        are ready by ``W`` and wait for this): no waiting for the consumer to get there."""
        sw = self._shard(shard_id)
        if sw is None:
            return None
        sw.shard = shard
        consumer = self._follow_from(sw, ckpt)
        if consumer is None:
            return None
        cap = w_cap_ms(self.ctx.config, shard)
        self._settle(sw, consumer, cap, patient)
        if sw.seen is None and (sw.grant or 0) <= wanted_ms and self._may_ask(sw, time.monotonic()):
            self._observe(sw)
            self._settle(sw, consumer, cap, patient)
        return sw.grant

    def want(self, shard_ids: set[int]) -> None:
        """The shards whose records are about to ask ``granted`` (one release): the first of them
        to ask a new observation asks it for all of them, one ListOffsets for every shard."""
        self._wanted = shard_ids

    def next_look_s(self, shard_id: int) -> float:
        """How long until ``granted`` of ``shard_id`` may grant more than it did: READ_AGAIN_S while
        an observation is pursued (its consumer reads on), else until a new one may be asked
        (OBSERVE_S after the last). A caller whose records wait for this watch sleeps that long
        instead of a fixed poll: a record due just after an observation then leaves with the next
        one, not a poll later (issue 30)."""
        sw = self._shards.get(shard_id)
        if sw is None or sw.consumer is None:
            return OBSERVE_S
        if sw.seen is not None:
            return READ_AGAIN_S
        return max(0.0, OBSERVE_S - (time.monotonic() - sw.asked_at))

    def read_on(self, idle_s: float, newest: Callable[[int], EnqueueCheckpoint | None]) -> None:
        """Read what has arrived on the timer partitions of each shard whose consumer was not
        polled for ``idle_s``, keeping the cancels met: called shortly before records are due, so
        that the look at their time reads only the last moments' input, not all since the last.
        Each consumer first moves up to the ``O`` of its shard's ``newest`` checkpoint: one idle
        since long ago (a burst written ahead) read again what the TimerLog had taken in since
        then, and in the peers' burst row that ran 11 ms past the burst's time."""
        mono = time.monotonic()
        for sw in self._shards.values():
            if sw.consumer is not None and mono - sw.polled_at >= idle_s:
                ckpt = newest(sw.shard_id)
                consumer = self._follow_from(sw, ckpt) if ckpt is not None else sw.consumer
                if consumer is not None:
                    self._poll(sw, consumer, READ_ON_WAIT_S)

    def look_ahead(self, due_ms: int) -> None:
        """The loose mode (``TW_CANCEL_LEAD_MS`` = N > 0): an observation taken now grants up to
        N ms past it, so one taken shortly before ``due_ms`` (``DequeuePut._read_on``) lets the
        records due then leave at their time, with no look at the timer topic's ends at it. Asked
        for every shard the watch follows whose grant does not reach past ``due_ms`` yet (one
        ListOffsets for all, at most every OBSERVE_S a shard), and read up to its ends. Nothing to
        do in the strict mode, or when N does not reach from now to ``due_ms``: the look at their
        time decides then, as always."""
        lead = self.ctx.config.cancel_lead_ms
        if lead <= 0 or self.ctx.clock.now_ms() + lead <= due_ms:
            return
        mono = time.monotonic()
        ready = [sw for sw in self._shards.values() if sw.consumer is not None and sw.shard is not None
                 and (sw.grant or 0) <= due_ms]
        asking = [sw for sw in ready if sw.seen is None and self._may_ask(sw, mono)]
        if asking:
            self._wanted = {sw.shard_id for sw in asking}
            self._observe(asking[0])
        for sw in ready:
            assert sw.consumer is not None and sw.shard is not None
            self._settle(sw, sw.consumer, w_cap_ms(self.ctx.config, sw.shard), patient=True)

    def markers(self, shard_id: int, message_id: str, revision: int) -> list[Record]:
        """The cancels and reschedules of ``(message_id, revision)`` read on the shard's timer
        partitions (from where the checkpoint's TimerLog ends)."""
        sw = self._shards.get(shard_id)
        return list(sw.cancels.get((message_id, revision), ())) if sw is not None else []

    def has_markers(self, shard_id: int) -> bool:
        """Any cancel or reschedule kept for the shard: ``markers`` finds none for any message else."""
        sw = self._shards.get(shard_id)
        return sw is not None and bool(sw.cancels)

    def cancelled(self, shard_id: int, message_id: str, revision: int = 0) -> bool:
        """A cancel or reschedule of ``(message_id, revision)`` was read on the shard's timer partitions."""
        return bool(self.markers(shard_id, message_id, revision))

    def close(self) -> None:
        for sw in self._shards.values():
            if sw.consumer is not None:
                sw.consumer.close()
                sw.consumer = None

    # ---------------------------------------------------------------- internals

    def _shard(self, shard_id: int) -> ShardWatch | None:
        sw = self._shards.get(shard_id)
        if sw is None:
            if self._partitions is None:
                n = self.commit_log.partition_count(self.topic)
                if n is None:
                    return None
                self._partitions = n
            shards = self.ctx.config.shards
            sw = self._shards[shard_id] = ShardWatch(shard_id, [p for p in range(self._partitions)
                                                                if p % shards == shard_id])
        return sw

    def _settle(self, sw: ShardWatch, consumer: Consumer, cap: int, patient: bool) -> None:
        """Once the pursued observation's ends are reached, what it grants is granted."""
        seen = sw.seen
        if seen is not None and self._reach(sw, consumer, seen.ends, patient):
            sw.grant = max(sw.grant or 0, min(seen.t0 + self.ctx.config.cancel_lead_ms, seen.read_ms + cap))
            sw.seen = None

    def _follow_from(self, sw: ShardWatch, ckpt: EnqueueCheckpoint) -> Consumer | None:
        """The shard's consumer, reading on from the checkpoint's input offsets ``O`` at the latest
        (what is below them is in the TimerLog); moved back to ``O`` if ``O`` went below where it
        keeps cancels from (a recovery that lost records). Cancels below ``O`` are dropped. None
        while no consumer can be made (a broker restarting). Nothing to do for the checkpoint
        followed last time (a view hands out the same one until it changes)."""
        if sw.consumer is not None and ckpt is sw.floor:
            return sw.consumer
        have = ckpt.next_offsets
        if sw.consumer is None:
            kept_from = {p: have.get(p, 0) for p in sw.partitions}
            try:
                sw.consumer = self.commit_log.consumer(self.topic, kept_from, keep=False)
            except Exception as exc:  # noqa: BLE001 - as _observe
                self._failed(sw, "consumer", exc)
                return None
            sw.kept_from, sw.grant = kept_from, None
        consumer = sw.consumer
        for p in sw.partitions:
            o = have.get(p, 0)
            if o < sw.kept_from[p]:
                # Records below the old floor were lost from the TimerLog: read again, and what
                # was granted does not hold until then.
                consumer.seek(p, o)
                sw.kept_from[p] = o
                sw.grant = None
            elif consumer.position(p) < o:
                consumer.seek(p, o)
                sw.kept_from[p] = o
        if sw.cancels:
            kept = {key: [m for m in rs if m.offset >= have.get(m.partition, 0)] for key, rs in sw.cancels.items()}
            sw.cancels = {key: ats for key, ats in kept.items() if ats}
        sw.floor = ckpt
        return consumer

    @staticmethod
    def _may_ask(sw: ShardWatch, mono: float) -> bool:
        return mono - sw.asked_at >= OBSERVE_S

    def _observe(self, sw: ShardWatch) -> None:
        """A new observation for ``sw``, and for each other wanted shard that may ask one and
        pursues none: each shard's R, then ``t0``, then the ends of every partition in one
        request (the order the grant needs). A shard whose R cannot be read, or all of them if
        the ends cannot, get none this time."""
        mono = time.monotonic()
        asking = [sw, *(other for i in sorted(self._wanted) if (other := self._shards.get(i)) is not None
                        and other is not sw and other.seen is None and other.consumer is not None
                        and other.shard is not None and self._may_ask(other, mono))]
        read_ms: dict[int, int] = {}
        for one in asking:
            one.asked_at = mono
            try:
                dq = one.shard.load_dequeue_checkpoint() if one.shard is not None else None
            except CorruptCheckpointError:
                dq = None
            if dq is not None:
                read_ms[one.shard_id] = dq.read_ms
        if not read_ms:
            return
        t0 = self.ctx.clock.now_ms()
        try:
            ends = self.commit_log.high_watermarks(self.topic)
        except Exception as exc:  # noqa: BLE001 - a broker restarting: the W gate holds meanwhile
            self._failed(sw, "observation", exc)
            return
        for one in asking:
            if one.shard_id in read_ms:
                one.seen = Observation(t0, {p: ends.get(p, 0) for p in one.partitions}, read_ms[one.shard_id])

    def _reach(self, sw: ShardWatch, consumer: Consumer, ends: dict[int, int], patient: bool) -> bool:
        """Read the shard's partitions up to ``ends`` (at most CATCH_UP_S if ``patient``, else what
        has arrived), keeping the cancels met; whether every partition got there."""
        deadline = time.monotonic() + (CATCH_UP_S if patient else 0.0)
        polled = False
        while True:
            behind = [p for p in sw.partitions if consumer.position(p) < ends[p]]
            if not behind:
                return True
            left = deadline - time.monotonic()
            if left <= 0 and polled:
                return False
            polled = True
            if not self._poll(sw, consumer, min(max(left, 0.0005), 0.002)):
                return False

    def _poll(self, sw: ShardWatch, consumer: Consumer, wait_s: float) -> bool:
        """One poll of the shard's consumer (always a positive wait: a poll without one makes a
        Kafka consumer fetch in batches), keeping the cancels and reschedules met; False if it failed."""
        sw.polled_at = time.monotonic()
        try:
            records = consumer.poll(POLL_RECORDS, wait_s)
        except Exception as exc:  # noqa: BLE001 - as _observe
            self._failed(sw, "read", exc)
            return False
        for r in records:
            if r.header(H_CANCEL) is not None or r.header(H_REPLACES) is not None:
                key = marker_target(r)
                if key is not None:
                    sw.cancels.setdefault(key, []).append(r)
        return True

    def _failed(self, sw: ShardWatch, what: str, exc: Exception) -> None:
        """Count a failed Kafka call of the watch; its records wait for ``W`` meanwhile."""
        self.ctx.metrics.inc("watch_failures", shard=sw.shard_id)
        self.logger.debug("watch failed", shard=sw.shard_id, what=what, reason=str(exc)[:200])
