"""dequeue-put: each record at its own time -> its destination, or back to the timer topic (roll).

At least once (the default) it is stateless: no lease, any replica takes any deliver entry.
Exactly once (TW_DELIVERY_GUARANTEE, ``stages.exactly_once``) each shard's deliver partition is
read by the replica holding the shard's ``dequeue-put`` lease, whose releases commit in one Kafka
transaction per shard with a progress record. dequeue-get reads the wheel up to
TW_LOOKAHEAD_MS ahead, so a DELIVER item usually arrives before its time: it is **held** in a heap
by its delivery time ``t`` (the record's own ``tw-deliver-at``), and one loop **releases** each
held record once both

1. *not early*: this process's clock >= ``t`` (pods' clocks differ; ``W`` comes from
   enqueue-put's), and
2. *complete*: the shard's ``W`` (its ``enqueue.ckpt``, read through a read-only view of the
   shard, ``PublishedView``) is past ``t``. Every timer record due before ``W`` is then in the
   TimerLog below that checkpoint's flushed position ``F``, so is every cancel of the message
   acknowledged before ``t`` (``InputWatermark``), in the message's slot. Or, usually sooner for
   a DELIVER item, the **watch** covers ``t`` (``stages.watch``): this stage has read the shard's
   timer partitions itself from the checkpoint's input offsets up to their ends as asked after
   ``t``, and keeps the cancels it met there; those below the checkpoint's input offsets are in
   the TimerLog below ``F``, as for ``W``.

At release the slot's chain is read for markers at positions in ``[read_pos, F)``
(``read_pos``: where dequeue-get read the slot; it matched the markers below it, and dequeue-getmsg
confirmed those); a marker whose id hash matches is confirmed on the full id and revision
(dequeue-getmsg's ``confirmed``), as is one the watch met. Of the confirmed markers of a record
the first in its timer partition decides (``decider``, issue 31): a cancel drops it as CANCELLED;
a reschedule **redirects** it: the reschedule record's content goes back to the timer topic as the
message's next revision, due at its new time, like a roll hop (a REDIRECT item, decided by
dequeue-getmsg, is held like a ROLL one until ``W`` passes its slot). Two markers of one id hash
both count.

What is released in one loop round goes out in one append, ``tw-delivered-at`` stamped at release,
with the control headers removed and ``tw-id``, ``tw-roll``, ``tw-enqueued-at`` stamped. Items that
are not held go out in the round they arrive: a CANCELLED one (dequeue-getmsg confirmed a marker)
and a DUPLICATE (another copy of the message in its slot carries it) are dropped and counted; a
MISSING one and a destination the allow-list refuses (tightened since, or a forged entry) are
dead-lettered. A DELIVER item due more than the most a slot is read ahead (``lookahead_max_ms``)
+ EARLY_WAIT_MAX_S past this clock (a clock far off) goes back to the timer topic with its own
time, like a roll.
A ROLL item (a roll hop) is held too, until ``W`` passes its slot's time (so that a crash, which
reads the slots from ``R`` on again, never hops a message twice from a slot ``W`` had not passed),
then goes back to the timer topic's same partition (so it stays in its shard, where its cancel
marker will go) with an absolute ``tw-deliver-at`` and ``tw-roll`` + 1.
The append is retried until it succeeds: a due message is never dropped.

A held record whose entry a dequeue-get owner sent under an older epoch than the one its shard's
dequeue.ckpt now carries is **stale**: that owner was replaced, or let the shard go with it in
flight (it then saves the next epoch itself); the next owner reads the slot again from ``R`` and
sends the record anew, so this one is finished without output (``stale_dropped``).
On SIGTERM the stage takes nothing new and releases what it holds as its time comes, for at most
``stop_drain_s`` (``close``), so that a rolling update hands no held entry over.

An entry is **finished** once all its items are: its slot's count is reported to dequeue-get, and
only then is it acked. So held entries stay unacknowledged in the work queue: a crash makes their
records late, never lost (another replica claims a dead consumer's entries, after DEAD_IDLE_MS once
its heartbeat lapsed). A live replica's held entries are touched (their idle time reset, only while
still its own) every TOUCH_EVERY_S once held TOUCH_AFTER_S, so that no other replica takes them for
stuck (CLAIM_IDLE_MS) however long ``W`` keeps them. Memory: held records count as in flight for
dequeue-get (TW_MAX_IN_FLIGHT per shard) and their entries against the deliver queue's bounds
(TW_QUEUE_BOUND, TW_QUEUE_BYTES), so dequeue-getmsg blocks before this heap grows.

A destination topic that does not exist never holds back the others: the commit log does not
send its records (one bounded metadata wait per batch) and they are *held for the topic*: rolled
back to the timer topic like a roll hop, due again after a back-off that grows from 1 s to 1 min,
with ``tw-held-since`` set when first held. Once held for ``TW_MISSING_TOPIC_HOLD_MS`` a record is
dead-lettered with the reason instead. Such a record counts as finished (it is durable again in
the timer topic), so ``R`` moves on.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from timerwheel import telemetry
from timerwheel.errors import TimerLogDamagedError
from timerwheel.log import stage_logger
from timerwheel.records import OutRecord, Record
from timerwheel.stages.base import (
    CLAIM_IDLE_MS,
    QueueStage,
    StageContext,
    append_until_written,
    decoded,
    put_blocking,
)
from timerwheel.stages.codec import (
    CANCELLED,
    DELIVER,
    DUPLICATE,
    MISSING,
    REDIRECT,
    ROLL,
    DeliverEntry,
    DeliverItem,
    DoneEntry,
    wire,
)
from timerwheel.stages.dequeue_get import GENERATION_BITS, markers_of
from timerwheel.stages.dequeue_getmsg import decider, void_reschedules
from timerwheel.stages.exactly_once import Deliveries, ExactlyOnce, Source, source_of_item
from timerwheel.stages.owner import OwnedShard, ShardOwner
from timerwheel.stages.ownership import Ownership
from timerwheel.stages.published import CKPT_POLL_S, PublishedView
from timerwheel.stages.watch import Watch
from timerwheel.store import CorruptCheckpointError, EnqueueCheckpoint, Shard
from timerwheel.transports.base import CommitLog, WorkQueue
from timerwheel.wire import (
    H_CANCEL,
    H_ERROR,
    H_HELD_SINCE,
    H_PARTITION,
    H_ROLL,
    H_SOURCE,
    H_TOPIC,
    dead_letter_headers,
    delivered_headers,
    message_id_of,
    redirected_headers,
    revision_id_hash,
    revision_of,
    rolled_headers,
)

STAGE = "dequeue-put"
#: A held record (missing destination) is due again after half the time it has been held, within these.
HOLD_RETRY_MIN_MS = 1_000
HOLD_RETRY_MAX_MS = 60_000
#: A record due more than ``lookahead_max_ms`` + this past this process's clock is not held: its clock
#: and dequeue-get's disagree by that much, and it goes back to the timer topic with its own time.
EARLY_WAIT_MAX_S = 5.0
#: How long before the first held record's time the watch reads on (``DequeuePut._read_on``).
READ_ON_MS = 20
#: The last ms before a held record's release are slept out (``DequeuePut._wait_out``), not waited
#: in the queue's blocking read: Redis ends a blocking read's timeout up to ~2 ms late (measured:
#: releases began 1.7-3 ms past their time, against the 1 ms the watch needs).
FINE_WAIT_MS = 3
#: How often the release gate reads a shard's dequeue.ckpt for its owner's epoch (``_owner_epoch``).
OWNER_EPOCH_EVERY_S = 0.1
#: Held entries are touched (their pending idle time reset) once held this long, this often: a
#: third of the time after which another replica would take them for a stuck consumer's.
TOUCH_AFTER_S = CLAIM_IDLE_MS / 3000
TOUCH_EVERY_S = CLAIM_IDLE_MS / 6000


@dataclass(slots=True, eq=False)
class HeldEntry:
    """A deliver entry taken from the queue and not finished yet."""

    partition: int
    entry_id: str
    entry: DeliverEntry
    #: Items not finished yet.
    left: int
    #: When it was taken, and last touched (time.monotonic()).
    taken_at: float = field(default_factory=time.monotonic)
    touched_at: float = 0.0
    #: Another consumer has it now (a touch found it gone): its held items are dropped.
    lost: bool = False


@dataclass(slots=True, eq=False)
class Held:
    """A DELIVER item waiting for its time in the heap."""

    held: HeldEntry
    item: DeliverItem
    record: Record
    headers: dict[str, bytes]
    topic: str
    dest_partition: int | None
    #: Its delivery time (``TimerRules.valid_delivery_times``), once known.
    due: int = 0


@dataclass
class Round:
    """What one loop round writes, and what it finished."""

    now: int
    out: list[OutRecord] = field(default_factory=list)
    #: index in ``out`` of each delivery -> what it delivers.
    deliveries: dict[int, Held] = field(default_factory=dict)
    #: index in ``out`` of each roll hop (it carries the round's trace context, as a delivery does:
    #: the next hop's spans link it, one trace from the send to the consumer).
    hops: list[int] = field(default_factory=list)
    delivered: dict[str, int] = field(default_factory=dict)
    rolled: dict[str, int] = field(default_factory=dict)
    redirected: dict[str, int] = field(default_factory=dict)
    cancelled: dict[str, int] = field(default_factory=dict)
    #: Copies of a message in its slot finished without output (DUPLICATE).
    copies: dict[str, int] = field(default_factory=dict)
    #: Records of entries an older dequeue-get owner sent, finished without output (``_gate``).
    stale: dict[str, int] = field(default_factory=dict)
    dead: dict[str, int] = field(default_factory=dict)
    held_for_topic: dict[str, int] = field(default_factory=dict)
    #: Delivery times of the records delivered (lateness), by index in ``out``.
    dues: dict[int, int] = field(default_factory=dict)
    #: Items finished, with their entry (and for telemetry the item as it ended).
    finished: list[tuple[HeldEntry, DeliverItem]] = field(default_factory=list)
    #: Exactly-once: index in ``out`` -> the record's identity (shard, slot, source position).
    sources: dict[int, Source] = field(default_factory=dict)


def _count(counts: dict[str, int], topic: str) -> None:
    counts[topic] = counts.get(topic, 0) + 1


class DequeuePut(QueueStage):
    stage = STAGE

    def __init__(self, ctx: StageContext, commit_log: CommitLog, deliver_queue: WorkQueue, done_queue: WorkQueue,
                 partitions: Sequence[int], open_shard: Callable[[int], Shard | None], stop_drain_s: float = 0.0,
                 deliveries: Callable[[int], Deliveries] | None = None, ownership: Ownership | None = None) -> None:
        """``open_shard(id)``: a read-only view of a shard (None while it does not exist yet): the
        release gate reads its enqueue.ckpt and its slots' tails. ``stop_drain_s``: how long
        ``close`` releases what is held (STOP_DRAIN_S in a stage process, 0 in the embedded one).
        ``deliveries(shard)``: exactly-once (``stages.exactly_once``): a shard's transactional
        releases; None: at-least-once, one append per round. ``ownership`` (exactly-once): each
        shard's deliver partition is read by the replica that holds the shard's ``dequeue-put``
        lease only (``stages.owner``), so that two replicas do not take turns fencing each other's
        transactional producer; None: every replica reads every partition."""
        super().__init__(ctx, deliver_queue, partitions)
        self.stop_drain_s = stop_drain_s
        self.commit_log = commit_log
        self.deliver_q = deliver_queue
        self.done_q = done_queue
        self.open_shard = open_shard
        self.logger = stage_logger(STAGE)
        self._partition_counts: dict[str, int] = {}
        self._views: dict[int, PublishedView] = {}
        #: (delivery time, sequence, held record): the next record to release first.
        self._heap: list[tuple[int, int, Held]] = []
        self._seq = itertools.count()
        #: Entries taken and not finished, by (partition, entry id).
        self._entries: dict[tuple[int, str], HeldEntry] = {}
        #: The round being filled: what arrived and goes out at once, then what is released.
        self._round: Round | None = None
        self._touched = time.monotonic()
        #: Finished entries not reported and acknowledged yet, by (shard, generation) of their report
        #: (``_report``): a failed report or ack (Redis gone for a moment) is retried at the next
        #: step, so no finished entry is left held and touched for good.
        self._unreported: dict[tuple[int, int], list[HeldEntry]] = {}
        self._unacked: dict[int, list[HeldEntry]] = {}
        #: The timer partitions read beside W's gate (``stages.watch``), and the shards whose
        #: records the last gate left waiting for it (``_wait_s``).
        self._watch = Watch(ctx, commit_log)
        self._watching: set[int] = set()
        #: The delivery time the watch last read on for (``_read_on``).
        self._read_on_for = 0
        #: Shard -> (its dequeue.ckpt's epoch and R, when read): ``_dequeue_ckpt``.
        self._dequeue_ckpts: dict[int, tuple[int, int, float]] = {}
        self._eo = (ExactlyOnce(ctx, self.logger, deliveries, lambda s: self._dequeue_ckpt(s)[1])
                    if deliveries is not None else None)
        self._owner: ShardOwner[OwnedShard] | None = None
        if ownership is not None:
            self._owner = ShardOwner(ctx, STAGE, self.partitions, ownership, self._take_shard, self._let_go,
                                     "delivering")
            self.partitions = []

    # ---------------------------------------------------------------- the loop

    def step(self, timeout_s: float) -> int:
        """Take new entries (waiting at most until the next held record is due), then release
        every held record whose time has come, in one append with what arrived."""
        self._touch()
        self._report()  # what a failed step finished and could not report
        taken = self._own()
        if not self.partitions:  # owning no shard yet (exactly-once): what is held still goes out
            self.ctx.idle_wait(self.stage, min(timeout_s, self._wait_s(), 0.2))
        else:
            taken += super().step(min(timeout_s, self._wait_s()))
            self._wait_out(timeout_s)
        self._read_on()
        return taken + self._release()

    def _release_at(self) -> int | None:
        """When the first held record may be released: just past its time by this clock (the watch
        needs an observation after it), at it in the loose mode (one at its time grants
        ``TW_CANCEL_LEAD_MS`` past it)."""
        return self._heap[0][0] + (self.ctx.config.cancel_lead_ms <= 0) if self._heap else None

    def _wait_out(self, timeout_s: float) -> None:
        """Sleep out the last FINE_WAIT_MS (at most ``timeout_s``) to the first held record's
        release: an idle wait (new work, or a simulated clock's move, ends it)."""
        at = self._release_at()
        left = at - self.ctx.clock.now_ms() if at is not None else 0
        if timeout_s > 0 and 0 < left <= FINE_WAIT_MS:
            self.ctx.idle_wait(self.stage, min(timeout_s, left / 1000))

    def _read_on(self) -> None:
        """Once the first held record is due within READ_ON_MS, the watch reads what has arrived
        on the timer partitions (``Watch.read_on``), once per such time: the look at its time
        then has only the last moments to read, not all the input since the watch last looked.
        In the loose mode the watch takes its observation then too (``Watch.look_ahead``)."""
        if not self._heap:
            return
        due = self._heap[0][0]
        if due != self._read_on_for and due - self.ctx.clock.now_ms() <= READ_ON_MS:
            self._read_on_for = due
            self._watch.read_on(READ_ON_MS / 1000, self._newest_input)
            self._watch.look_ahead(due)

    def _newest_input(self, shard_id: int) -> EnqueueCheckpoint | None:
        """The shard's newest enqueue checkpoint (its ``W`` and input offsets ``O``), or None."""
        view = self._view(shard_id)
        return view.newest(self.ctx) if view is not None else None

    # ---------------------------------------------------------------- shard ownership (exactly-once)

    def _own(self) -> int:
        """Renew the leases, hand over the shards another replica ranks first for, take the wanted
        ones, and read the deliver partitions of the shards owned; a shard taken has the entries
        its previous owner left pending claimed at once. Returns the entries so claimed."""
        owner = self._owner
        if owner is None:
            return 0
        owner.renew()
        for state in owner.balance():
            owner.hand_over(state)
        if owner.waiting:
            owner.take_shards()
        self.partitions = sorted(owner.owned)
        taken = 0
        for state in list(owner.owned.values()):
            if state.reclaim:
                pending = state.take_over_pending(self.deliver_q, self.ctx)
                if pending:
                    self.handle_batches({state.shard_id: pending})
                    taken += len(pending)
        return taken

    def _take_shard(self, shard_id: int) -> OwnedShard | None:
        """The lease of ``shard_id`` (``ShardOwner.start``); None while the shard does not exist
        or another replica holds it."""
        view = self._view(shard_id)
        if view is None:
            return None
        assert self._owner is not None
        epoch = self._owner.ownership.acquire(shard_id)
        if epoch is None:
            return None
        log = stage_logger(STAGE, shard_id)
        log.info("owning shard's deliveries", epoch=epoch)
        return OwnedShard(shard_id, view.shard, log, epoch)

    def _let_go(self, state: OwnedShard) -> None:
        """A shard handed over or lost (``ShardOwner.stop``): what is held of it is dropped,
        unacknowledged (its next owner claims the entries and releases them, its transaction
        fencing ours), and its producer closed."""
        shard = state.shard_id
        if self._eo is not None:
            self._eo.drop(shard)
        dropped = 0
        for key, held in list(self._entries.items()):
            if held.partition == shard:
                held.lost = True
                del self._entries[key]
                dropped += 1
        if dropped:
            self._heap = [x for x in self._heap if not x[2].held.lost]
            heapq.heapify(self._heap)
        self.partitions = [p for p in self.partitions if p != shard]
        state.logger.info("shard's deliveries let go", held_entries_dropped=dropped)

    def owns(self, shard: int, renew: bool = False) -> bool:
        """This replica may release ``shard``'s records (always without ``ownership``); ``renew``:
        renew the leases first when due (a commit retried for long must not outlive its lease)."""
        if self._owner is None:
            return True
        if renew:
            self._owner.renew()
        return shard in self._owner.owned

    def _wait_s(self) -> float:
        """How long a step may wait for new entries: until FINE_WAIT_MS before the first held
        record's release (``_release_at``; the rest is slept out, ``_wait_out``), READ_ON_MS before
        it first (so that the watch reads on, ``_read_on``); while one is due and waits for
        its gate, until the watch may grant more (``Watch.next_look_s``) if the last gate left
        records waiting for it, at most CKPT_POLL_S (``W`` may pass them meanwhile)."""
        at = self._release_at()
        if at is None:
            return float("inf")
        due = self._heap[0][0]
        ahead = at - self.ctx.clock.now_ms()
        if ahead > 0:
            if ahead > READ_ON_MS and due != self._read_on_for:
                return (ahead - READ_ON_MS) / 1000  # wake to read on first (``_read_on``)
            return max(0, ahead - FINE_WAIT_MS) / 1000  # the rest slept out (``_wait_out``)
        if not self._watching:
            return CKPT_POLL_S
        return min(CKPT_POLL_S, *(self._watch.next_look_s(s) for s in self._watching))

    def holding(self, partition: int) -> int:
        """Entries of ``partition`` taken and not finished (held)."""
        return sum(1 for p, _ in self._entries if p == partition)

    def caught_up(self) -> bool:
        """No held record may be released now: each is not due by this clock or waits for ``W``
        (read again now)."""
        now = self.ctx.clock.now_ms()
        for due, _seq, h in list(self._heap):
            if due > now:
                continue
            view = self._view(h.held.entry.shard)
            ckpt = view.shard.load_enqueue_checkpoint() if view is not None else None
            if ckpt is not None and due < ckpt.write_ms:
                return False
        return True

    def _partitions_of(self, topic: str) -> int | None:
        """The destination's partition count; None while it does not exist (never created here)."""
        n = self._partition_counts.get(topic)
        if n is None:
            n = self.commit_log.partition_count(topic)
            if n is not None:
                self._partition_counts[topic] = n
        return n

    def _view(self, shard_id: int) -> PublishedView | None:
        view = self._views.get(shard_id)
        if view is None:
            shard = self.open_shard(shard_id)
            if shard is None:
                return None
            view = self._views[shard_id] = PublishedView(shard_id, shard)
        return view

    def _new_round(self) -> Round:
        if self._round is None:
            self._round = Round(self.ctx.clock.now_ms())
        return self._round

    # ---------------------------------------------------------------- intake

    def handle_batches(self, batches: dict[int, list[tuple[str, bytes]]]) -> None:
        """Hold the DELIVER items of the entries taken; what is not held goes into this round."""
        ctx = self.ctx
        cfg = ctx.config
        rnd = self._new_round()
        now = rnd.now
        rules = ctx.rules
        topics = rules.known_topics
        late_limit = now + cfg.lookahead_max_ms + int(EARLY_WAIT_MAX_S * 1000)
        early = 0
        to_hold: list[Held] = []
        for p, part in batches.items():
            for entry_id, payload in part:
                key = (p, entry_id)
                if key in self._entries:
                    continue  # claimed again while we hold it (idle for CLAIM_IDLE_MS): held already
                got = decoded(ctx, self.deliver_q, p, [(entry_id, payload)], DeliverEntry.decode, self.logger)
                if not got:
                    continue  # moved aside as undecodable
                entry = got[0]
                held = self._entries[key] = HeldEntry(p, entry_id, entry, len(entry.items))
                for item in entry.items:
                    self._intake(rnd, held, item, topics, to_hold)
                if not entry.items:
                    rnd.finished.append((held, DeliverItem(DELIVER, 0, 0, None, 0, 0)))
        if to_hold:
            dues = rules.valid_delivery_times([h.record for h in to_hold], [h.headers for h in to_hold])
            for h, due in zip(to_hold, dues, strict=True):
                h.due = due
                if due > late_limit:
                    self._roll_back(rnd, h, due)
                    continue
                if due > now + cfg.lookahead_max_ms + cfg.tick_ms:
                    early += 1
                heapq.heappush(self._heap, (due, next(self._seq), h))
        if early:
            # More ahead than reading ahead explains: this clock is behind dequeue-get's.
            ctx.metrics.inc("early_records", early)
            self.logger.warning("records handed over further ahead of their time than the look-ahead, held",
                                records=early)

    def _intake(self, rnd: Round, held: HeldEntry, item: DeliverItem, topics: dict[bytes, str],
                to_hold: list[Held]) -> None:
        cfg = self.ctx.config
        rules = self.ctx.rules
        kind, rec = item.kind, item.record
        if rec is None or kind == MISSING:
            src = f"{cfg.timer_topic}/{item.src_partition}/{item.src_offset}"
            self._source(rnd, held, item)
            rnd.out.append(OutRecord(cfg.dlq_topic, None, None, (
                (H_ERROR, f"source record {src} is gone from the log".encode()), (H_SOURCE, src.encode()))))
            _count(rnd.dead, "-")
            rnd.finished.append((held, item))
            return
        hdr = dict(rec.headers)  # one pass; the last of repeated headers wins, as Record.header
        raw_topic = hdr.get(H_TOPIC)
        topic = (topics.get(raw_topic) or raw_topic.decode("utf-8", "replace")) if raw_topic else "-"
        if kind == DELIVER:
            refused = rules.destination_error(topic) if raw_topic not in topics else ""
            if refused:  # the allow-list holds at delivery too
                self._dead_letter(rnd, held, item, topic, f"{refused} (checked at delivery)")
                return
            raw_part = hdr.get(H_PARTITION)
            dest_partition = int(raw_part) if raw_part else None
            # A topic that does not exist yet is checked when it does (the append holds it).
            if dest_partition is not None and dest_partition >= (self._partitions_of(topic) or dest_partition + 1):
                self._dead_letter(rnd, held, item, topic, f"tw-partition {dest_partition} out of range for {topic!r}")
                return
            to_hold.append(Held(held, item, rec, hdr, topic, dest_partition))
        elif kind == CANCELLED:
            _count(rnd.cancelled, topic)
            rnd.finished.append((held, item))
        elif kind == DUPLICATE:  # another copy of it in the slot carries the message
            _count(rnd.copies, topic)
            rnd.finished.append((held, item))
        else:
            assert kind in (ROLL, REDIRECT)  # REDIRECT: ``rec`` is the reschedule record
            # Held until W passes its slot's time, not rolled as soon as read ahead: a crash reads
            # again the slots from R on, and a hop done again is a second copy of the message.
            heapq.heappush(self._heap, (item.fire_ms, next(self._seq), Held(held, item, rec, hdr, topic, None,
                                                                          item.fire_ms)))

    def _roll(self, rnd: Round, h: Held) -> None:
        """A roll hop whose slot ``W`` passed: back to the timer topic, one roll more, carrying the
        round's trace context (``Round.hops``)."""
        rnd.hops.append(len(rnd.out))
        self._roll_back(rnd, h, self.ctx.rules.delivery_time(h.record, rnd.now, check_max=False, headers=h.headers))

    def _redirect(self, rnd: Round, h: Held, reschedule: Record) -> None:
        """The first marker of ``h``'s message is a reschedule (design 6.2 "Later"): its content goes
        back to the timer topic as the next revision, due at its new time, like a roll hop (the same
        partition: its shard, where its own cancels go)."""
        hdr = dict(reschedule.headers)
        due = self.ctx.rules.delivery_time(reschedule, rnd.now, check_max=False, headers=hdr)
        self._source(rnd, h.held, h.item)
        rnd.hops.append(len(rnd.out))
        rnd.out.append(OutRecord(self.ctx.config.timer_topic, reschedule.key, reschedule.value,
                                 redirected_headers(reschedule, message_id_of(reschedule, hdr), due,
                                                    h.item.enqueued_ms),
                                 partition=reschedule.partition))
        _count(rnd.redirected, h.topic)
        rnd.finished.append((h.held, h.item._replace(kind=REDIRECT, record=reschedule)))

    def _dead_letter(self, rnd: Round, held: HeldEntry, item: DeliverItem, topic: str, reason: str) -> None:
        rec = item.record
        assert rec is not None
        self._source(rnd, held, item)
        rnd.out.append(OutRecord(self.ctx.config.dlq_topic, rec.key, rec.value, dead_letter_headers(rec, reason)))
        _count(rnd.dead, topic)
        rnd.finished.append((held, item))

    def _roll_back(self, rnd: Round, h: Held, due: int) -> None:
        """Back to the timer topic, due at ``due``, one roll more: a roll hop (``_roll``), or a
        record due far past this clock (due at its own time)."""
        rec = h.record
        raw_roll = h.headers.get(H_ROLL)
        self._source(rnd, h.held, h.item)
        rnd.out.append(OutRecord(self.ctx.config.timer_topic, rec.key, rec.value,
                                 rolled_headers(rec, message_id_of(rec, h.headers), due,
                                                int(raw_roll) if raw_roll else 0, h.item.enqueued_ms),
                                 partition=rec.partition))
        _count(rnd.rolled, h.topic)
        rnd.finished.append((h.held, h.item))

    # ---------------------------------------------------------------- release

    def _release(self) -> int:
        """Release every held record whose time has come and whose shard's ``W`` passed it (after a
        look for cancel markers in its slot's tail), then write the round. Returns items finished."""
        now = self.ctx.clock.now_ms()
        due: list[Held] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            due.append(heapq.heappop(heap)[2])
        if due:
            self._gate(due, now)
        rnd = self._round
        if rnd is None:
            return 0
        self._round = None
        self._write(rnd)
        return len(rnd.finished)

    def _gate(self, due: list[Held], now: int) -> None:
        """Of the records due by this clock, release those whose shard's ``W`` passed them and that
        no cancel marker in their slot's tail cancels; hold the others again.

        A shard's records are decided only once everything that may fail for them is done (its
        view, its owner's epoch, the look for cancel markers, whose confirmation reads the timer
        topic); if that fails (a broker restarting), they and the shards not yet decided go back
        into the heap before the step's error is raised: taken off it and lost, they were never
        released and their entries never finished (seen in a chaos run)."""
        by_shard: dict[int, list[Held]] = {}
        self._watching.clear()
        for h in due:
            if not h.held.lost:
                by_shard.setdefault(h.held.entry.shard, []).append(h)
        undecided = list(by_shard.items())
        self._watch.want(set(by_shard))
        try:
            while undecided:
                shard_id, held = undecided[0]
                self._gate_shard(shard_id, held, now)
                undecided.pop(0)
        except BaseException:
            for _shard_id, held in undecided:
                for h in held:
                    heapq.heappush(self._heap, (h.due, next(self._seq), h))
            raise

    def _gate_shard(self, shard_id: int, held: list[Held], now: int) -> None:
        """``_gate`` for the due records of one shard: raises before it decided any of them, or not at all."""
        view = self._view(shard_id)
        ckpt = view.newest(self.ctx) if view is not None else None
        owner_epoch = self._owner_epoch(shard_id, view)
        stale: list[Held] = []
        ready: list[Held] = []
        waiting: list[Held] = []
        for h in held:
            if h.held.entry.generation >> GENERATION_BITS < owner_epoch:
                # Sent by a dequeue-get that has since lost the shard: its successor reads
                # the slots again from R, this record among them, and sends it anew.
                stale.append(h)
            elif ckpt is not None and h.due < ckpt.write_ms:
                ready.append(h)
            else:
                waiting.append(h)
        watched = [h for h in waiting if h.item.kind == DELIVER]
        if watched and view is not None and ckpt is not None:
            # W has not passed them: the watch may tell sooner (stages.watch).
            granted = self._watch.granted(shard_id, view.shard, ckpt, max(h.due for h in watched),
                                          patient=not ready and not stale)
            early = [h for h in watched if granted is not None and h.due < granted]
            if early:
                ready += early
                released = {id(h) for h in early}
                waiting = [h for h in waiting if id(h) not in released]
                self.ctx.metrics.inc("released_by_watch", len(early), shard=shard_id)
        decided: dict[int, Record] = {}
        if ready:
            assert view is not None and ckpt is not None
            delivers = [h for h in ready if h.item.kind == DELIVER]
            decided, undecided = self._decided(shard_id, view, delivers, ckpt.flushed_pos)
            if undecided:  # their slot's tail lost records: wait for the writer's recovery
                waiting += [h for h in ready if id(h) in undecided]
                ready = [h for h in ready if id(h) not in undecided]
        # Decided: nothing below raises.
        for h in waiting:
            heapq.heappush(self._heap, (h.due, next(self._seq), h))
            if h.item.kind == DELIVER:
                self._watching.add(shard_id)
        if not stale and not ready:
            return
        rnd = self._new_round()
        for h in stale:
            _count(rnd.stale, h.topic)
            rnd.finished.append((h.held, h.item))
        if not ready:
            return
        rnd.now = self.ctx.clock.now_ms()  # tw-delivered-at: the release (the gate may have taken a while)
        for h in ready:
            marker = decided.get(id(h))
            if h.item.kind == ROLL:
                self._roll(rnd, h)
            elif h.item.kind == REDIRECT:
                self._redirect(rnd, h, h.record)
            elif marker is None:
                self._deliver(rnd, h)
            elif marker.header(H_CANCEL) is not None:
                _count(rnd.cancelled, h.topic)
                rnd.finished.append((h.held, h.item._replace(kind=CANCELLED)))
            else:
                self._redirect(rnd, h, marker)

    def _owner_epoch(self, shard_id: int, view: PublishedView | None) -> int:
        """The epoch of the shard's dequeue-get owner as its dequeue.ckpt says (read at most every
        OWNER_EPOCH_EVERY_S; 0 while unknown: nothing is taken for stale then)."""
        return self._dequeue_ckpt(shard_id, view)[0]

    def _dequeue_ckpt(self, shard_id: int, view: PublishedView | None = None) -> tuple[int, int]:
        """The shard's dequeue.ckpt's (epoch, R), read at most every OWNER_EPOCH_EVERY_S; (0, 0)
        while unknown. R only moves on, so an older reading is below it, never past it."""
        mono = time.monotonic()
        known = self._dequeue_ckpts.get(shard_id)
        if known is not None and mono - known[2] < OWNER_EPOCH_EVERY_S:
            return known[0], known[1]
        epoch, read_ms = 0, known[1] if known is not None else 0
        view = view if view is not None else self._view(shard_id)
        if view is not None:
            try:
                ckpt = view.shard.load_dequeue_checkpoint()
            except CorruptCheckpointError:
                ckpt = None  # torn on a shared volume: unknown this time
            if ckpt is not None:
                epoch, read_ms = ckpt.epoch, max(read_ms, ckpt.read_ms)
        self._dequeue_ckpts[shard_id] = (epoch, read_ms, mono)
        return epoch, read_ms

    def _decided(self, shard_id: int, view: PublishedView, ready: list[Held], flushed_pos: int
                 ) -> tuple[dict[int, Record], set[int]]:
        """Of the records ``ready``, ``id()`` -> the marker that decides each (a cancel: dropped; a
        reschedule: moved), of those a marker was found for in their slot's tail
        ``[read_pos, flushed_pos)`` (matched on the id hash, confirmed on the full id and revision)
        or in the watch; the first in the timer partition decides (``decider``). And ``id()`` of
        those whose tail cannot be told (``TimerLogDamagedError``: records lost after the
        checkpoint published them)."""
        by_read: dict[tuple[int, int], list[Held]] = {}
        for h in ready:
            entry = h.held.entry
            if entry.read_pos < flushed_pos:
                by_read.setdefault((entry.slot_time, entry.read_pos), []).append(h)
        shard = view.shard
        candidates: list[tuple[Held, tuple[int, int]]] = []
        undecided: set[int] = set()
        for (slot_time, read_pos), held in by_read.items():
            markers: dict[int, list[tuple[int, int]]] = {}
            try:
                for _positions, records in shard.read_slot(slot_time, flushed_pos, read_pos, damage_raises=True):
                    markers_of(records, markers)
            except TimerLogDamagedError as exc:
                undecided.update(id(h) for h in held)
                view.damaged(self.ctx, self.logger, exc)
                continue
            if not markers:
                continue
            for h in held:
                ihash = revision_id_hash(message_id_of(h.record, h.headers), revision_of(h.headers))
                for ref in markers.get(ihash, ()):
                    candidates.append((h, ref))
        per_record: dict[int, tuple[Held, list[Record | None]]] = {}
        # Asked record by record only if the watch kept any (20,000 records: ~10 ms of Python less).
        for h in ready if self._watch.has_markers(shard_id) else ():
            if id(h) not in undecided:
                watched = self._watch.markers(shard_id, message_id_of(h.record, h.headers), revision_of(h.headers))
                if watched:
                    per_record[id(h)] = (h, list(watched))
        if candidates:
            refs = sorted({ref for _h, ref in candidates})
            found = dict(zip(refs, self.commit_log.read(self.ctx.config.timer_topic, refs), strict=True))
            for h, ref in candidates:
                per_record.setdefault(id(h), (h, []))[1].append(found[ref])
        out: dict[int, Record] = {}
        for key, (h, markers_found) in per_record.items():
            winner = decider(h.record, markers_found)
            if winner is None:
                self.ctx.metrics.inc("cancel_missed")  # id-hash collision: not the same message
                continue
            void_reschedules(self.ctx, self.logger, h.record, markers_found, winner)
            out[key] = winner
        return out, undecided

    def _deliver(self, rnd: Round, h: Held) -> None:
        rec = h.record
        headers = delivered_headers(rec, h.headers, str(h.item.enqueued_ms).encode(), str(rnd.now).encode())
        # OutRecord(...) goes through a Python-level __new__: twice the cost
        rnd.deliveries[len(rnd.out)] = h
        rnd.dues[len(rnd.out)] = h.due
        self._source(rnd, h.held, h.item)
        rnd.out.append(tuple.__new__(OutRecord, (h.topic, rec.key, rec.value, headers, h.dest_partition, None)))
        _count(rnd.delivered, h.topic)
        rnd.finished.append((h.held, h.item))

    def _epoch_of(self, shard: int) -> int:
        """The lease epoch under which this replica releases ``shard`` (0 without ``ownership``)."""
        state = self._owner.owned.get(shard) if self._owner is not None else None
        return state.epoch if state is not None else 0

    def _source(self, rnd: Round, held: HeldEntry, item: DeliverItem) -> None:
        """Exactly-once: the identity of the record about to be appended to ``rnd.out``."""
        if self._eo is not None:
            e = held.entry
            rnd.sources[len(rnd.out)] = source_of_item(e.shard, e.slot_time, item.src_partition, item.src_offset)

    def _commit_exactly_once(self, rnd: Round, hold: Callable[[int, str], OutRecord]) -> None:
        """Exactly-once: the round's records shard by shard, each shard's with its progress record
        in one transaction (``stages.exactly_once``); those a committed transaction released
        already are finished without output. A destination that does not exist is held before
        the transaction (a transactional send would wait for its metadata and fail the batch)."""
        assert self._eo is not None
        for i, h in list(rnd.deliveries.items()):
            if self._partitions_of(h.topic) is None:
                rnd.out[i] = hold(i, h.topic)
        by_shard: dict[int, dict[int, Source]] = {}
        for i, source in rnd.sources.items():
            by_shard.setdefault(source[0], {})[i] = source
        if len(rnd.sources) != len(rnd.out):
            raise AssertionError(f"{len(rnd.out) - len(rnd.sources)} released records without a source")
        for shard, sources in sorted(by_shard.items()):
            # None: let go meanwhile, its entries another replica's now (lost, never acked).
            dropped = self._eo.commit(shard, rnd.out, sources, rnd.now, epoch=self._epoch_of(shard),
                                      owned=functools.partial(self.owns, shard, renew=True))
            for i in dropped or ():
                if i in rnd.deliveries:
                    h = rnd.deliveries.pop(i)
                    rnd.delivered[h.topic] -= 1
                    rnd.dues.pop(i, None)

    def _write(self, rnd: Round) -> None:
        """Append the round's records (retried until written), then report and ack the entries it
        finished."""
        ctx = self.ctx
        cfg = ctx.config
        span = telemetry.dequeue_put_start() if rnd.out or rnd.finished else None
        if span is not None:
            trace = telemetry.inject(span)
            for i in (*rnd.deliveries, *rnd.hops):
                rnd.out[i] = rnd.out[i]._replace(headers=telemetry.replace_trace_headers(rnd.out[i].headers, trace))
        now = rnd.now

        def hold(i: int, topic: str) -> OutRecord:
            """The record to write instead of ``rnd.out[i]``, whose destination does not exist."""
            h = rnd.deliveries.pop(i)
            rnd.dues.pop(i, None)
            rec, hdr = h.record, h.headers
            rnd.delivered[topic] -= 1
            since = int(hdr.get(H_HELD_SINCE) or now)
            waited = now - since
            if waited >= cfg.missing_topic_hold_ms:
                _count(rnd.dead, topic)
                reason = f"destination topic {topic!r} does not exist (held {waited} ms, TW_MISSING_TOPIC_HOLD_MS)"
                return OutRecord(cfg.dlq_topic, rec.key, rec.value, dead_letter_headers(rec, reason))
            _count(rnd.held_for_topic, topic)
            again = now + min(HOLD_RETRY_MAX_MS, max(HOLD_RETRY_MIN_MS, waited // 2))
            raw_roll = hdr.get(H_ROLL)
            headers = rolled_headers(rec, message_id_of(rec, hdr), again, int(raw_roll) if raw_roll else 0,
                                     h.item.enqueued_ms, held_since_ms=since)
            return OutRecord(cfg.timer_topic, rec.key, rec.value, headers, partition=rec.partition)

        if self._eo is None:
            append_until_written(ctx, self.commit_log, rnd.out, self.logger, on_missing=hold)
        else:
            self._commit_exactly_once(rnd, hold)
        ctx.processed(sum(len(r.value) for r in rnd.out if r.value))
        if rnd.held_for_topic:
            self.logger.warning("destination topics missing, records held", topics=rnd.held_for_topic)
        self._finish(rnd.finished)
        m = ctx.metrics
        if rnd.held_for_topic:
            m.inc_many("held", "topic", rnd.held_for_topic)
        delivered = {t: n for t, n in rnd.delivered.items() if n}
        if delivered:
            m.inc_many("delivered", "topic", delivered)
            m.observe_many("delivery_lateness_ms", [now - t for t in rnd.dues.values()])
        if rnd.rolled:
            m.inc_many("rolled", "topic", rnd.rolled)
        if rnd.redirected:
            m.inc_many("redirected", "topic", rnd.redirected)
        if rnd.cancelled:
            m.inc_many("cancelled", "topic", rnd.cancelled)
        if rnd.copies:
            m.inc_many("copies_dropped", "topic", rnd.copies)
        if rnd.stale:
            m.inc_many("stale_dropped", "topic", rnd.stale)
        if rnd.dead:
            m.inc_many("dead_lettered", "topic", rnd.dead)
        if span is not None:
            ended: dict[int, tuple[HeldEntry, list[DeliverItem]]] = {}
            for held, item in rnd.finished:
                ended.setdefault(id(held), (held, []))[1].append(item)
            entries = [DeliverEntry(e.entry.shard, e.entry.generation, e.entry.slot_time, e.entry.read_pos, tuple(items))
                       for e, items in ended.values()]
            telemetry.dequeue_put_batch(span, cfg, ctx.rules, entries, rnd.out, now,
                                        {"DELIVER": DELIVER, "ROLL": ROLL, "CANCELLED": CANCELLED, "REDIRECT": REDIRECT,
                                         "DUPLICATE": DUPLICATE})

    def _finish(self, finished: list[tuple[HeldEntry, DeliverItem]]) -> None:
        """Count the items finished; report each entry all of whose items are (its slot's count to
        dequeue-get), then ack it. Report before ack: a crash in between redelivers the entry (a
        bounded duplicate) instead of stalling the slot until dequeue-get sends it again."""
        for held, _item in finished:
            held.left -= 1
            if held.left == 0 and not held.lost:  # a lost one is another consumer's to ack
                e = held.entry
                self._unreported.setdefault((e.shard, e.generation), []).append(held)
        self._report()

    def _report(self) -> None:
        """Report the finished entries (one done entry per shard and generation), then ack them;
        each report and each ack leaves the to-do lists only once it succeeded, so a failure
        (raised to the step) is retried by the next step without counting anything twice."""
        while self._unreported:
            (shard, generation), done = next(iter(self._unreported.items()))
            by_slot: dict[int, int] = {}
            for held in done:
                by_slot[held.entry.slot_time] = by_slot.get(held.entry.slot_time, 0) + len(held.entry.items)
            put_blocking(self.ctx, self.done_q, shard, [wire(self.done_q, DoneEntry(shard, generation, by_slot))],
                         self.logger.bind(shard=shard))
            del self._unreported[(shard, generation)]
            for held in done:
                self._unacked.setdefault(held.partition, []).append(held)
        while self._unacked:
            partition, done = next(iter(self._unacked.items()))
            self.deliver_q.ack(partition, [held.entry_id for held in done])
            del self._unacked[partition]
            for held in done:
                self._entries.pop((held.partition, held.entry_id), None)

    # ---------------------------------------------------------------- held entries

    def _touch(self) -> None:
        """Reset the pending idle time of entries held TOUCH_AFTER_S, every TOUCH_EVERY_S, while
        they are still ours; one another consumer took is dropped from the heap (it delivers it)."""
        mono = time.monotonic()
        if mono - self._touched < TOUCH_EVERY_S:
            return
        self._touched = mono
        old: dict[int, list[HeldEntry]] = {}
        for held in self._entries.values():
            if mono - max(held.taken_at, held.touched_at) >= TOUCH_AFTER_S:
                old.setdefault(held.partition, []).append(held)
        for partition, held_list in old.items():
            gone = set(self.deliver_q.touch(partition, self.ctx.consumer, [h.entry_id for h in held_list]))
            for held in held_list:
                held.touched_at = mono
                if held.entry_id in gone:
                    held.lost = True
                    self._entries.pop((partition, held.entry_id), None)
                    self.logger.warning("held entry taken by another consumer, dropped", partition=partition,
                                        entry=held.entry_id)
        if any(h.held.lost for _d, _s, h in self._heap):
            self._heap = [x for x in self._heap if not x[2].held.lost]
            heapq.heapify(self._heap)

    def close(self) -> None:
        """Stopping (SIGTERM): take nothing new, release what is held as its time comes (read
        ahead: about TW_LOOKAHEAD_MS), report and ack it, for at most ``stop_drain_s``; so a
        rolling update hands over no held entry. What is still held then stays pending: another
        replica claims it once this process's heartbeat is gone (the runner ends it on stop)."""
        deadline = time.monotonic() + self.stop_drain_s
        try:
            while self._entries and time.monotonic() < deadline:
                self._touch()
                self._report()
                self._release()
                time.sleep(max(0.001, min(self._wait_s(), 0.02, deadline - time.monotonic())))
            if self.stop_drain_s > 0:
                self.logger.info("drained on stop", held=len(self._entries))
        except Exception as exc:  # noqa: BLE001 - best effort: another replica takes what is left
            self.logger.warning("drain on stop ended", reason=str(exc)[:200], held=len(self._entries))
        self._watch.close()
        if self._owner is not None:
            self._owner.leave()
        if self._eo is not None:
            self._eo.close()
        for view in self._views.values():
            view.shard.close()
