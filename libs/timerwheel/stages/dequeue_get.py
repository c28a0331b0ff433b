"""dequeue-get: wheel slots -> fetch requests, read ahead of ``W``; and ``R``.

Owns shards. ``W`` and the flushed TimerLog position ``P`` come from ``enqueue.ckpt``, the only
thing a reader trusts. From its cursor on, each non-empty slot ``s`` is read at the newest
checkpoint (``Shard.read_slot``: its records below ``P``, column-wise, a bounded piece at a time)
once ``s + tick <= W`` (*final*: every record of it is written and flushed, invariant 2), and with
TW_LOOKAHEAD_MS ``L`` > 0 already once ``s <= min(now, W) + L`` (issue 30): dequeue-put then holds
its messages and releases each at its own time. A burst is read further ahead than ``L``, by the
time its records take to move (``_lead_ms``, at most ``lookahead_max_ms``), so it is held in time.
A slot read before ``W`` passed its end is *open*: at each newer checkpoint ``P'`` its *tail*
(its records in ``[P, P')``: the TimerLog only appends) is read and its new messages sent; empty
slots passed by the cursor are open too. It is final,
and forgotten, once read up to the flushed position of a checkpoint whose ``W`` passed its end
(enqueue-put writes nothing into it after that, invariant 1). Each fetch entry carries the
position its slot was read at, so dequeue-put knows which markers it must look for itself.
With ``L`` = 0 every slot is final when read: read once, as before issue 30.

* DELETE markers (not ROLL) are collected first; a message whose id hash matches some is
  sent with references to them all so dequeue-getmsg can confirm on the full id (a hash
  collision must never cancel the wrong message, and two colliding cancels both count). The
  markers of an open slot are kept until it is final and match the messages of its later
  tails too. Markers that match nothing are counted (``cancel_missed``): a cancel that came
  after delivery has no effect (one read after its message was sent from an open slot is
  dequeue-put's to apply, not counted).
* Copies of one message in a slot (the same id hash and delivery time: a roll hop done twice
  after a crash, design 2.5) are sent with a reference to the first copy (``same_as``), kept for
  an open slot's later tails too; dequeue-getmsg confirms on the full id and the copy finishes
  as a DUPLICATE, without output. Roll hops never multiply a delivery, in both modes.
* Every other record — a message due now or a roll hop — is sent to the fetch queue in
  batches, at most ``max_in_flight`` messages per shard outstanding (flow control; a slot of
  a million messages is streamed, never held). A batch also ends at TW_BATCH_BYTES of source
  records (their ``src_size``): a fetch entry stands for a bounded read in dequeue-getmsg.

``R`` (``dequeue.ckpt``) advances past a slot only when dequeue-put has reported every
message of it done (invariant 3) and it is final (never past an open slot, nor ``W``'s slot),
so after a crash the slots from ``R`` on are read again:
delivery is at-least-once: what was delivered from slots at or after ``R`` is delivered again.
An owner that lets a shard go (a hand-over, a stop) with every message it sent done saves its
open slots beside ``R`` (``ReadAhead``: each slot's read position and what its read remembered:
markers, copies); the next owner reads only their new records, so what was released from them
is not read, nor delivered, again while ``W`` stands still (a window change, a rolling update of
enqueue-put beside dequeue-get). Any other save drops it: after a crash the slots from ``R`` on
are read again.
Empty slots are skipped in bulk (``TimerWheel.next_nonempty``), so catching up after a long
outage is fast and never skips a slot (PITFALLS: RocketMQ's 7-day catch-up cap).

A slot whose messages stop coming back (their work-queue entries lost, e.g. Redis flushed)
is re-sent after ``STALL_S`` under a new generation; reports of an older generation are
ignored.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from timerwheel import telemetry
from timerwheel.config import LOOKAHEAD_RECORDS_PER_S
from timerwheel.errors import FencedError, QueueFullError, TimerLogDamagedError
from timerwheel.log import StageLogger, stage_logger
from timerwheel.stages.base import StageContext, decoded, get_by
from timerwheel.stages.codec import CONSUMER_OF, Q_FETCH, DoneEntry, FetchEntry, FetchItem, wire
from timerwheel.stages.owner import OwnedShard, ShardOwner
from timerwheel.stages.ownership import Ownership
from timerwheel.stages.published import CKPT_POLL_S, PublishedView
from timerwheel.store import (
    CarriedSlot,
    CorruptCheckpointError,
    DequeueCheckpoint,
    EnqueueCheckpoint,
    Flag,
    ReadAhead,
    Shard,
)
from timerwheel.store.format import RecordArray
from timerwheel.store.shard import SlotPiece, recovery_needed
from timerwheel.store.wheel import SLOT_MAGIC
from timerwheel.transports.base import WorkQueue

STAGE = "dequeue-get"
STALL_S = 120.0
#: Slots with at most this many records are read in one pass; larger ones are streamed.
SMALL_SLOT = 20_000
#: W older than this (enqueue-put publishes an idle W every second): not worth looking for every CKPT_POLL_S.
W_STILL_MS = 3_000
#: How long a step with messages in flight, or a full fetch queue, waits when it found nothing to do.
BUSY_WAIT_S = 0.005
#: How often a shard's look-ahead is counted again while its cursor stands (``_lead_ms``): a
#: burst is read at most this much later than its records' count says. (Counted at every step,
#: dequeue-get took 1-2 % of a core more at 500 msg/s.)
LEAD_EVERY_MS = 20
GENERATION_BITS = 20
#: A shard being handed over is released after this even with messages still in flight (their
#: slots are read again by the next owner: duplicates, never a loss).
DRAIN_S = 10.0
#: ... and on stop (SIGTERM) after this: the pod's grace period is 30 s.
STOP_DRAIN_S = 5.0
#: Fetch items built at a time from a slot's records (a piece of up to SLOT_PIECE_RECORDS is
#: converted in parts: memory stays bounded by this, not by the piece).
ITEMS_AT_ONCE = 4096

_DELETE = int(Flag.DELETE)
_ROLL = int(Flag.ROLL)


#: Id hash -> (source partition, offset) of every cancel marker of that hash read in a slot so
#: far: two cancels whose ids collide both count (each is confirmed on the full id downstream).
Markers = dict[int, list[tuple[int, int]]]
#: Id hashes of the messages sent from an open slot kept at most (for ``cancel_missed`` only).
SENT_HASHES_MAX = 100_000
#: (id hash, delivery time) -> source position of the first copy of each message read in
#: a slot (``Seen``), kept for at most this many messages per slot (about 2 MB); past it, copies
#: are no longer told apart in that slot (delivered twice in at-least-once).
SEEN_MAX = 20_000
Seen = dict[int, int]
#: ``Seen``'s key of a message: its id hash XOR its delivery time times this (odd: one id hash
#: gives one key per delivery time); its value: the source ``partition << _OFFSET_BITS | offset``.
_KEY_MIX = np.uint64(0x9E3779B97F4A7C15)
_OFFSET_BITS = 40
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1
#: The markers and first copies (``Seen`` entries) an owner letting a shard go saves, in all, with
#: its open slots (``ReadAhead``: about 40 bytes each in dequeue.ckpt); the open slots past it are
#: read again, whole, by the next owner.
CARRY_MAX = 20_000


@dataclass
class OpenSlot:
    """A slot read before ``W`` passed its end (read ahead): records may still be written into it.
    Its tail ``[read_pos, P')`` is read at each newer checkpoint ``P'`` until a checkpoint's ``W``
    passes its end (then it is *final*, and dropped). ``R`` never passes it."""

    #: Every record of the slot below this TimerLog position has been read.
    read_pos: int
    markers: Markers = field(default_factory=dict)
    #: Id hashes of the markers some message matched.
    matched: set[int] = field(default_factory=set)
    #: Id hashes of the messages sent from the slot (a marker read later may cancel one of them in
    #: dequeue-put: not a missed cancel); None once past SENT_HASHES_MAX.
    sent: list[npt.NDArray[np.uint64]] | None = field(default_factory=list)
    #: The first copy of each message sent from the slot (``Seen``; None past SEEN_MAX): a copy read
    #: in a later tail is a DUPLICATE of it.
    seen: Seen | None = field(default_factory=dict)


@dataclass
class SlotReader:
    """A slot being sent (its first read, or the tail of an open slot): its cancel markers, and
    its other records as fetch items."""

    slot_time: int
    #: The TimerLog position the slot is read up to (the checkpoint's flushed position).
    read_pos: int
    markers: Markers
    items: Iterator[FetchItem]
    #: Id hashes of the markers some message matched.
    matched: set[int] = field(default_factory=set)
    #: The source records' sizes (``src_size``), aligned with what ``items`` has yet to yield.
    sizes: deque[int] = field(default_factory=deque)
    #: The markers' id hashes as an array, once they are all collected (``fetch_items`` matches on it).
    marker_hashes: npt.NDArray[np.uint64] = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    #: The open slot this read belongs to (None: the slot was final when read, read once).
    open: OpenSlot | None = None
    #: The first copy of each message read in the slot so far (``Seen``); None past SEEN_MAX.
    seen: Seen | None = field(default_factory=dict)


def open_slot(shard: Shard, slot_time: int, limit_pos: int, since_pos: int = 0,
              state: OpenSlot | None = None) -> SlotReader:
    """The reader of the slot's records in ``[since_pos, limit_pos)``: its cancel markers collected
    first (added to ``state``'s, whose markers match the messages of this read too), then its
    other records streamed as fetch items. The slot is read once and held while it has at most
    SMALL_SLOT records; a larger one is read again for its items, a piece at a time: memory stays
    bounded whatever its size."""
    reader = SlotReader(slot_time, limit_pos, state.markers if state is not None else {}, iter(()),
                        matched=state.matched if state is not None else set(), open=state,
                        seen=state.seen if state is not None else {})
    held: list[SlotPiece] | None = []
    count = 0
    for piece in shard.read_slot(slot_time, limit_pos, since_pos, damage_raises=True):
        markers_of(piece[1], reader.markers)
        count += len(piece[0])
        if held is not None and count <= SMALL_SLOT:
            held.append(piece)
        else:
            held = None
    reader.marker_hashes = np.fromiter(reader.markers, dtype=np.uint64, count=len(reader.markers))
    pieces = held if held is not None else shard.read_slot(slot_time, limit_pos, since_pos, damage_raises=True)
    reader.items = itertools.chain.from_iterable(
        fetch_items(positions[k:k + ITEMS_AT_ONCE], records[k:k + ITEMS_AT_ONCE], reader)
        for positions, records in pieces for k in range(0, len(positions), ITEMS_AT_ONCE))
    return reader


def markers_of(records: RecordArray, markers: Markers) -> None:
    """Add the cancel markers (DELETE, not ROLL) among ``records`` to ``markers``: id hash ->
    [(source partition, offset), ...], newest first as the records come."""
    is_marker = (records["magic"] & (_DELETE | _ROLL)) == _DELETE
    if is_marker.any():
        for id_hash, partition, offset in records[is_marker][["id_hash", "src_partition", "src_offset"]].tolist():
            markers.setdefault(id_hash, []).append((partition, offset))


def fetch_items(positions: npt.NDArray[np.int64], records: RecordArray, reader: SlotReader) -> list[FetchItem]:
    """The fetch items of a slot's records other than cancel markers, built column-wise; a
    message (not a roll hop) whose id hash matches some of ``reader.markers`` carries them all,
    for dequeue-getmsg to confirm on the full id. Their sizes go to ``reader.sizes``."""
    all_flags = records["magic"] & 0xFF
    keep = (all_flags & (_DELETE | _ROLL)) != _DELETE
    if keep.all():  # no cancel marker among them (most pieces): no copy
        msgs, flags, msg_positions = records, all_flags, positions
    else:
        msgs, flags, msg_positions = records[keep], all_flags[keep], positions[keep]
    reader.sizes.extend(msgs["src_size"].tolist())
    n = len(msgs)
    cancels: list[tuple[tuple[int, int], ...]] = [()] * n
    markers = reader.markers
    id_hashes = msgs["id_hash"]
    if markers:
        may_match = np.isin(id_hashes, reader.marker_hashes) & (flags & _ROLL == 0)
        for k in np.flatnonzero(may_match).tolist():
            h = int(id_hashes[k])
            cancels[k] = tuple(markers[h])
            reader.matched.add(h)
    same = _copies(reader, msgs, flags, msg_positions) if reader.seen is not None and n else [None] * n
    state = reader.open
    if state is not None and state.sent is not None and n:
        state.sent.append(id_hashes[(flags & _ROLL) == 0].copy())
        if sum(map(len, state.sent)) > SENT_HASHES_MAX:
            state.sent = None
    # FetchItem(...) goes through a Python-level __new__: tuple.__new__ in map is a C loop
    return list(map(tuple.__new__, itertools.repeat(FetchItem), zip(
        msg_positions.tolist(), flags.tolist(), msgs["src_partition"].tolist(), msgs["src_offset"].tolist(),
        msgs["deliver_ms"].tolist(), msgs["enqueue_ms"].tolist(), cancels, same, strict=True,
    )))


def _copies(reader: SlotReader, msgs: RecordArray, flags: npt.NDArray[np.integer[Any]],
            positions: npt.NDArray[np.int64]) -> list[tuple[int, int] | None]:
    """For each of ``msgs``, the source position of an earlier copy of the same message in the
    slot (same id hash and delivery time: design 2.5, the copies of a roll hop done twice), or
    None; the first copies are remembered in ``reader.seen``. Roll hops are not matched (their
    delivery time is in the record, not the TimerLog).

    Column-wise: a message's key is its id hash XOR its delivery time times an odd constant (two
    records of one id hash have one key only at one delivery time; other ids that collide are
    told apart downstream, on the full id), its source ``partition << 40 | offset``; the dict
    holds plain ints (measured: about half the cost of tuples, per message)."""
    seen = reader.seen
    assert seen is not None
    keys = msgs["id_hash"] ^ (msgs["deliver_ms"].astype(np.uint64) * _KEY_MIX)
    srcs = (msgs["src_partition"].astype(np.int64) << _OFFSET_BITS) | msgs["src_offset"].astype(np.int64)
    rolled = (flags & _ROLL) != 0
    key_list: list[int] = keys.tolist()
    if rolled.any():
        for k in np.flatnonzero(rolled).tolist():
            key_list[k] = -1 - int(positions[k])  # a key of its own (negative: never a message's)
    src_list: list[int] = srcs.tolist()
    firsts = np.fromiter(map(seen.setdefault, key_list, src_list), dtype=np.int64, count=len(src_list))
    if len(seen) > SEEN_MAX:
        reader.seen = None
        if reader.open is not None:
            reader.open.seen = None
    same: list[tuple[int, int] | None] = [None] * len(src_list)
    for k in np.flatnonzero(firsts != srcs).tolist():
        first = int(firsts[k])
        same[k] = (first >> _OFFSET_BITS, first & _OFFSET_MASK)
    return same


@dataclass
class GetShard(OwnedShard):
    #: Of the fetch and done entries: the epoch in the high bits, bumped by a re-send (``_resend``).
    generation: int
    #: R: every slot before it is delivered (dequeue.ckpt).
    read_ms: int
    #: The next slot to look at (every slot before it was read, final or open).
    cursor: int
    #: slot time -> messages sent from that slot and not reported done yet.
    in_flight: dict[int, int] = field(default_factory=dict)
    reader: SlotReader | None = None
    #: The slots read ahead, not final yet (TW_LOOKAHEAD_MS), by slot time; empty ones included.
    open: dict[int, OpenSlot] = field(default_factory=dict)
    outbox: list[FetchEntry] = field(default_factory=list)
    last_progress: float = field(default_factory=time.monotonic)
    #: W as enqueue.ckpt last said.
    write_ms: int = 0
    #: The shard's published checkpoint, as this view can trust it.
    view: PublishedView | None = None
    #: Being handed over (monotonic time it began): no new slot is opened, the shard is
    #: released once what was sent came back done (or after DRAIN_S).
    draining: float | None = None
    #: The last look-ahead counted (``DequeueGet._lead_ms``): (at_ms, cursor, lead_ms).
    lead: tuple[int, int, int] = (0, -1, 0)

    def messages_in_flight(self) -> int:
        """Messages sent and not reported done yet."""
        return sum(self.in_flight.values())

    def carriable(self) -> bool:
        """No slot being read, nothing waiting to be sent, nothing sent and not yet done: what this
        owner read is R and its open slots (``carry``)."""
        return self.reader is None and not self.in_flight and not self.outbox

    def carry(self) -> ReadAhead | None:
        """The open slots, in order, while their markers and copies stay within CARRY_MAX (None:
        none); the next owner reads the slots from the first one not carried. Only when
        ``carriable``."""
        slots: list[CarriedSlot] = []
        size = 0
        cursor = self.cursor
        for slot_ms, state in sorted(self.open.items()):
            size += len(state.markers) + len(state.seen or ())
            if size > CARRY_MAX:
                cursor = slot_ms
                break
            slots.append(CarriedSlot(slot_ms, state.read_pos, state.markers, frozenset(state.matched),
                                     None if state.seen is None else dict(state.seen)))
        return ReadAhead(self.shard.tick_ms, cursor, tuple(slots)) if slots else None


class DequeueGet:
    def __init__(self, ctx: StageContext, shard_ids: Iterable[int], open_shard: Callable[[int], Shard | None],
                 fetch_queue: WorkQueue, done_queue: WorkQueue, ownership: Ownership, stop_drain_s: float = 0.0) -> None:
        """``open_shard(id)`` opens a read-only view of a shard, or None while it does not exist yet.
        ``stop_drain_s``: how long ``close`` drains (STOP_DRAIN_S in a stage process, whose
        dequeue-put keeps running meanwhile; 0 embedded, where it has stopped already)."""
        self.stop_drain_s = stop_drain_s
        self.ctx = ctx
        self.fetch_q = fetch_queue
        self.done_q = done_queue
        self.open_shard = open_shard
        self.logger = stage_logger(STAGE)
        #: Shard views opened so far, kept across owners (a view is only read).
        self._views: dict[int, Shard] = {}
        #: The last step did nothing (the next one may wait, see ``StageContext.wait_on_inputs``).
        self._idle = False
        self.owner: ShardOwner[GetShard] = ShardOwner(ctx, STAGE, shard_ids, ownership, self._take, _keep_view,
                                                      "reading")
        self.owner.take_shards()

    @property
    def owned(self) -> dict[int, GetShard]:
        """The shards this replica owns now, by id."""
        return self.owner.owned

    @property
    def refused(self) -> dict[int, str]:
        """Shards left unstarted because their state needs ``timerwheel recover``: shard -> why."""
        return self.owner.refused

    def _take(self, shard_id: int) -> GetShard | None:
        """Open the shard's view and read R, then acquire the lease above R's epoch; None: not now."""
        unopenable = self.owner.unopenable
        try:
            shard = self._views.get(shard_id) or self.open_shard(shard_id)
            if shard is None:
                return None  # enqueue-put has not created the shard yet
            self._views[shard_id] = shard
            try:
                ckpt = shard.load_dequeue_checkpoint()
            except CorruptCheckpointError:
                ckpt = None
        except Exception as exc:  # noqa: BLE001 - one shard that cannot be opened must not stop the others
            unopenable.report(shard_id, exc)
            return None
        why = recovery_needed(shard.directory) if ckpt is None else None
        if why is not None:
            unopenable.refuse(shard_id, why)
            return None
        unopenable.clear(shard_id)
        if ckpt is None:
            return None  # enqueue-put has not started the shard yet
        epoch = self.owner.ownership.acquire(shard_id, floor=ckpt.epoch)
        if epoch is None:
            return None
        # Read R again now that the lease is ours: a previous owner saves its last R before
        # it releases, possibly after the read above.
        ckpt = shard.load_dequeue_checkpoint() or ckpt
        log = stage_logger(STAGE, shard_id)
        carry = _usable(shard, ckpt, log)
        log.info("owning shard", epoch=epoch, read_ms=ckpt.read_ms,
                 carried_slots=len(carry.slots) if carry is not None else 0)
        # R under our epoch at once: dequeue-put drops the entries of an older owner (it reads
        # again, from R, everything they carry), rather than deliver them beside ours.
        try:
            shard.save_dequeue_checkpoint(DequeueCheckpoint(read_ms=ckpt.read_ms, epoch=epoch, carry=carry))
        except FencedError:
            self.owner.ownership.release_all_of(shard_id)
            return None  # a newer owner saved already: not ours after all
        st = GetShard(shard_id, shard, log, epoch, epoch << GENERATION_BITS, ckpt.read_ms, ckpt.read_ms)
        if carry is not None:
            st.cursor = carry.cursor_ms
            st.open = {c.slot_ms: OpenSlot(c.read_pos, c.markers, set(c.matched), None, c.seen) for c in carry.slots}
            self.ctx.metrics.inc("read_ahead_carried", len(carry.slots), shard=shard_id)
        return st

    def step(self, timeout_s: float) -> int:
        owner = self.owner
        owner.renew()
        self._balance()
        if owner.waiting:
            owner.take_shards()
        wait = self.ctx.wait_on_inputs and bool(self.owned)
        block = self._idle_wait_s(timeout_s) if wait and self._idle else 0
        done = get_by(self.ctx, self.done_q, list(self.owned), 1000, block) if self.owned else {}
        work = 0
        try:
            # Every shard's done entries first: they are this consumer's pending entries now, and
            # one shard's failing read (a torn file on a shared volume) must not leave another's
            # uncounted; its R, and W with it (capped by R), would stand still until STALL_S.
            for st in list(self.owned.values()):
                work += self._drain_done(st, done.pop(st.shard_id, []))
        except BaseException:
            self._reclaim_pending()
            raise
        for st in list(self.owned.values()):
            try:
                work += self._step_shard(st, None)  # its done entries counted above
                if st.draining is not None and self._drained(st):
                    self._hand_over(st)
            except FencedError as exc:
                owner.lose(st.shard_id, str(exc))
        self._idle = not work
        if not work and not wait:
            self.ctx.idle_wait(STAGE, self._idle_wait_s(timeout_s) if self.ctx.frugal and self.owned else timeout_s)
        return work

    def _reclaim_pending(self) -> None:
        """A step failed with done entries taken and not counted: they stay pending for this
        consumer, and a plain read never returns them again, so each owned shard claims its own
        pending entries again at its next step (``take_over_pending``)."""
        for st in self.owned.values():
            st.reclaim = True

    def _idle_wait_s(self, timeout_s: float) -> float:
        """How long an idle step may wait on the done queue (``ctx.wait_on_inputs``): W comes
        from another process, so enqueue.ckpt is looked at once a tick; more often from the end
        of the next slot this view knows to hold records until W passes it (a due message then
        waits for enqueue-put's publication only, not for our next look)."""
        now = self.ctx.clock.now_ms()
        wait = timeout_s
        for st in self.owned.values():
            if st.outbox or st.in_flight:
                # Messages in flight: looked after as often as before issue 13 (their done entries
                # move R, and a full fetch queue makes room without one); idle means none in flight.
                return BUSY_WAIT_S
            tick = st.shard.tick_ms
            wait = min(wait, tick / 1000)
            lookahead = self._lead_ms(st, now)
            due = st.shard.next_nonempty(st.cursor, now + lookahead + tick)
            # Read once W passes the slot's end (read ahead: once its start is L ahead of now);
            # however late we are, unless W stood still for seconds (enqueue-put down or held back
            # by R: once a tick is enough then). An open slot's tail is looked for once a tick.
            if due is not None and now - st.write_ms < W_STILL_MS:
                at = due - lookahead if lookahead > 0 else due + tick
                wait = min(wait, max(CKPT_POLL_S, (at - now) / 1000))
        return wait

    def _step_shard(self, st: GetShard, done: list[tuple[str, bytes]] | None) -> int:
        work = self._drain_done(st, done) if done is not None else 0
        in_flight = st.messages_in_flight()
        batch = self.ctx.config.batch_size
        ckpt = None
        while self._flush_outbox(st) and in_flight < self.ctx.config.max_in_flight:
            if st.reader is None:
                if ckpt is None:
                    ckpt = self._published(st)
                    if ckpt is None:
                        break
                # Being handed over: no new slot is opened, but the open ones are read on until
                # final (else R stays at the first of them, and the next owner reads again, and
                # delivers again, what was read ahead).
                try:
                    st.reader = self._next_reader(st, ckpt, tails_only=st.draining is not None)
                except TimerLogDamagedError as exc:  # records lost after ckpt: its slots wait for the recovery
                    assert st.view is not None
                    st.view.damaged(self.ctx, st.logger, exc)
                    break
                if st.reader is None:
                    break
            reader = st.reader
            items = tuple(itertools.islice(reader.items, batch))
            taken = len(items)
            items = self._cut(reader, items)
            if len(items) < taken:
                taken = batch  # the rest went back to the reader: the slot is not done
            if items:
                tp = None
                if telemetry.tracer() is not None:
                    tp = telemetry.dequeue_get_batch(st.shard_id, reader.slot_time, items, self.ctx.clock.now_ms(), _ROLL)
                st.outbox.append(FetchEntry(st.shard_id, st.generation, reader.slot_time, reader.read_pos, items, tp))
                st.in_flight[reader.slot_time] = st.in_flight.get(reader.slot_time, 0) + len(items)
                in_flight += len(items)
                work += len(items)
            if taken < batch:
                if reader.open is None:  # read once, final: a marker that matched nothing missed
                    self._count_missed(reader.markers, reader.matched)
                st.reader = None
        if self._advance_r(st):
            work += 1  # a new R is progress too: enqueue-put may now move W past its cap
        return work

    def _horizon(self, st: GetShard, ckpt: EnqueueCheckpoint) -> int:
        """The end (exclusive) of the slots that may be read at ``ckpt``: those before ``W``'s slot
        (final: ``W`` passed their end), and with TW_LOOKAHEAD_MS ``L`` > 0 every slot that starts
        at or before ``min(now, W) + L`` (read ahead, open until ``W`` passes their end; further
        ahead for a burst: ``_lead_ms``)."""
        if self.ctx.config.effective_lookahead_ms <= 0:
            return st.shard.slot_time(ckpt.write_ms)
        base = min(self.ctx.clock.now_ms(), ckpt.write_ms)
        ahead = base + self._lead_ms(st, base)
        return max(st.shard.slot_time(ckpt.write_ms), st.shard.slot_time(ahead) + st.shard.tick_ms)

    def _lead_ms(self, st: GetShard, at_ms: int) -> int:
        """How far ahead of ``at_ms`` slots are read: TW_LOOKAHEAD_MS ``L``, or, when longer, the
        time the records not read yet and due from ``at_ms + L`` to ``at_ms + lookahead_max_ms``
        take to move at LOOKAHEAD_RECORDS_PER_S (at most ``lookahead_max_ms``): a burst due at once
        is read, fetched and held before its time. A steady load of up to ~300 msg/s a shard keeps
        ``L`` (250 a shard: 2,000 records in the 8 s stretch by default, 0.8 s); a busier one reads
        further too, which costs memory within ``max_in_flight``, not lateness. In flight, the read
        is bounded by ``max_in_flight`` as any."""
        cfg = self.ctx.config
        base, most = cfg.effective_lookahead_ms, cfg.lookahead_max_ms
        if most <= base:
            return base
        at, cursor, lead = st.lead
        if cursor == st.cursor and 0 <= at_ms - at < LEAD_EVERY_MS:
            return lead  # counted again at most every LEAD_EVERY_MS (a step may ask several times)
        ahead = st.shard.count_range(max(st.cursor, at_ms + base), at_ms + most + st.shard.tick_ms)
        lead = min(most, max(base, ahead * 1000 // LOOKAHEAD_RECORDS_PER_S))
        st.lead = (at_ms, st.cursor, lead)
        return lead

    def _next_reader(self, st: GetShard, ckpt: EnqueueCheckpoint, tails_only: bool = False) -> SlotReader | None:
        """What to read next at ``ckpt`` (flushed position P): the tail of an open slot read at an
        older position, else (unless ``tails_only``) the next slot before the horizon
        (``_horizon``); None: nothing.

        An open slot becomes final, and leaves ``st.open``, once its tail is read up to the flushed
        position of a checkpoint whose ``W`` passed its end: enqueue-put writes nothing into it
        after that (invariant 1), and wrote everything before into the TimerLog below P."""
        shard, tick = st.shard, st.shard.tick_ms
        pos, write_ms = ckpt.flushed_pos, ckpt.write_ms
        for slot_time, state in sorted(st.open.items()):
            if state.read_pos < pos:
                since = state.read_pos
                slot = shard.slot(slot_time)
                if slot.magic == SLOT_MAGIC and slot.slot_time == slot_time and slot.last_pos >= since:
                    reader = open_slot(shard, slot_time, pos, since, state)
                    state.read_pos = pos
                    return reader
                state.read_pos = pos
            if slot_time + tick <= write_ms:
                del st.open[slot_time]
                self._final(state)
        if tails_only:
            return None
        end = self._horizon(st, ckpt)
        if st.cursor >= end:
            return None
        found = shard.next_nonempty(st.cursor, end)
        # Read first: a read that raises (TimerLogDamagedError) leaves the cursor and the open slots as they were.
        opened = None if found is None or found + tick <= write_ms else OpenSlot(pos)
        first = None if found is None else open_slot(shard, found, pos, 0, opened)
        first_open = shard.slot_time(write_ms)
        for empty in range(max(st.cursor, first_open), end if found is None else found, tick):
            st.open[empty] = OpenSlot(pos)  # empty now: whatever is written into it comes as its tail
        if found is None:
            st.cursor = end
            return None
        st.cursor = found + tick
        if opened is not None:
            st.open[found] = opened
        return first

    def _final(self, state: OpenSlot) -> None:
        """An open slot became final: count its markers that matched no message it sent."""
        if state.sent is None:
            return  # too many messages to tell: not counted
        sent = np.concatenate(state.sent) if state.sent else np.zeros(0, dtype=np.uint64)
        unmatched = np.fromiter((h for h in state.markers if h not in state.matched), dtype=np.uint64)
        # a marker read after its message was sent is dequeue-put's to apply: not missed
        self._count_missed({h: state.markers[h] for h in unmatched[~np.isin(unmatched, sent)].tolist()}, set())

    def _count_missed(self, markers: Markers, matched: set[int]) -> None:
        """Markers that matched no message of their slot: a cancel that came after its delivery."""
        missed = sum(len(refs) for h, refs in markers.items() if h not in matched)
        if missed:
            self.ctx.metrics.inc("cancel_missed", missed)

    def _published(self, st: GetShard) -> EnqueueCheckpoint | None:
        """W and the flushed TimerLog position from enqueue.ckpt, the only thing a reader trusts
        (``PublishedView.newest``)."""
        if st.view is None:
            st.view = PublishedView(st.shard_id, st.shard)
        ckpt = st.view.newest(self.ctx)
        if st.view.ckpt is not None:
            st.write_ms = st.view.ckpt.write_ms
        return ckpt

    def _cut(self, reader: SlotReader, items: tuple[FetchItem, ...]) -> tuple[FetchItem, ...]:
        """``items`` up to TW_BATCH_BYTES of source records (at least one); the rest go back
        to the front of the reader, for the next entry."""
        sizes = [reader.sizes.popleft() for _ in items]
        budget = self.ctx.config.batch_bytes
        if sum(sizes) <= budget:
            return items
        total = 0
        for k, size in enumerate(sizes):
            total += size
            if total > budget:
                k = max(1, k)
                break
        reader.items = itertools.chain(items[k:], reader.items)
        reader.sizes.extendleft(reversed(sizes[k:]))
        return items[:k]

    def _flush_outbox(self, st: GetShard) -> bool:
        """Put what is waiting; False while the fetch queue is full."""
        if not st.outbox:
            return True
        try:
            self.fetch_q.put(st.shard_id, [wire(self.fetch_q, e) for e in st.outbox], 0.001)
        except QueueFullError:
            return False
        st.outbox.clear()
        self.ctx.wake(CONSUMER_OF[Q_FETCH])
        return True

    def _drain_done(self, st: GetShard, entries: list[tuple[str, bytes]]) -> int:
        """Count the done entries ``entries`` (taken by ``step`` for every shard at once)."""
        claimed = st.take_over_pending(self.done_q, self.ctx)
        if claimed:  # acked below; their generation is old, so they are ignored
            ids = {eid for eid, _ in claimed}  # idle 0 claims what step just took too
            entries = claimed + [e for e in entries if e[0] not in ids]
        if not entries:
            # Stalled: no message of a final slot came back for STALL_S (one of an open slot may
            # be held by dequeue-put until W passes it, however long W takes).
            final = st.in_flight and min(st.in_flight) + st.shard.tick_ms <= st.write_ms
            if final and time.monotonic() - st.last_progress > STALL_S:
                self._resend(st)
            return 0
        for done in decoded(self.ctx, self.done_q, st.shard_id, entries, DoneEntry.decode, st.logger):
            if done.generation != st.generation:
                continue
            for slot, n in done.counts.items():
                left = st.in_flight.get(slot, 0) - n
                if left > 0:
                    st.in_flight[slot] = left
                else:
                    st.in_flight.pop(slot, None)
        self.done_q.ack(st.shard_id, [eid for eid, _ in entries])
        st.last_progress = time.monotonic()
        return len(entries)

    def _resend(self, st: GetShard) -> None:
        st.logger.warning("slots stalled, re-sending from R", read_ms=st.read_ms, in_flight=st.messages_in_flight())
        self.ctx.metrics.inc("resends", shard=st.shard_id)
        st.generation += 1
        st.in_flight.clear()
        st.reader = None
        st.open.clear()
        st.outbox.clear()
        st.cursor = st.read_ms
        st.last_progress = time.monotonic()

    def _advance_r(self, st: GetShard) -> bool:
        """R = the first slot with messages in flight, being read or open (read ahead, not final),
        else the cursor; never past W's slot. After a crash the slots from R on are read again."""
        floor = [*st.in_flight, *st.open, st.cursor]
        if st.reader is not None:
            floor.append(st.reader.slot_time)
        if st.view is not None and st.view.ckpt is not None:
            floor.append(st.shard.slot_time(st.view.ckpt.write_ms))
        read_ms = min(floor)
        moved = read_ms > st.read_ms
        if moved:
            self.owner.ownership.check(st.shard_id)
            st.shard.save_dequeue_checkpoint(DequeueCheckpoint(read_ms=read_ms, epoch=st.epoch))
            st.read_ms = read_ms
            st.last_progress = time.monotonic()
            self.ctx.wake("enqueue-put")  # W may have been held back by R
        now = self.ctx.clock.now_ms()
        self.ctx.metrics.set("read_lag_ms", max(0, now - st.read_ms), shard=st.shard_id)
        self.ctx.metrics.set("in_flight", st.messages_in_flight(), shard=st.shard_id)
        self.ctx.metrics.set("read_ms", st.read_ms, shard=st.shard_id)
        self.ctx.metrics.set("owner_epoch", st.epoch, shard=st.shard_id, stage=STAGE)
        return moved

    def _balance(self) -> None:
        """Start handing over the shards another live replica ranks first for
        (``ShardOwner.balance``); keep one that became ours again."""
        unwanted = {st.shard_id for st in self.owner.balance()}
        for st in self.owned.values():
            if st.shard_id in unwanted and st.draining is None:
                st.draining = time.monotonic()
                st.logger.info("handing shard over, draining", in_flight=st.messages_in_flight())
            elif st.shard_id not in unwanted and st.draining is not None:
                st.draining = None
                st.logger.info("shard kept, ranked first again")

    @staticmethod
    def _drained(st: GetShard) -> bool:
        assert st.draining is not None
        return st.carriable() or time.monotonic() - st.draining >= DRAIN_S

    def _hand_over(self, st: GetShard) -> None:
        """Release a drained shard: R is saved already (``_advance_r``), so its next owner
        starts where this one stopped."""
        self.owner.ownership.check(st.shard_id)
        self._mark_released(st)
        self.owner.hand_over(st, read_ms=st.read_ms, in_flight=st.messages_in_flight())

    def _mark_released(self, st: GetShard) -> None:
        """Before the lease goes: with messages in flight, R under the epoch after ours, so that
        dequeue-put drops what we sent and it still holds (its ``_owner_epoch``) at once, not only
        when the next owner takes the shard. The next owner reads those slots again from R and
        sends them anew; released on their time meanwhile, they would go out twice (a
        StatefulSet's rolling update leaves the shard without an owner for seconds). The next
        owner's epoch is above this one (``_take`` acquires above the checkpoint's).

        With none in flight, R and the open slots (``GetShard.carry``): the next owner reads only
        what is written into them from now on."""
        if st.in_flight:
            st.shard.save_dequeue_checkpoint(DequeueCheckpoint(read_ms=st.read_ms, epoch=st.epoch + 1))
        elif st.carriable() and st.open:
            st.shard.save_dequeue_checkpoint(DequeueCheckpoint(read_ms=st.read_ms, epoch=st.epoch, carry=st.carry()))

    def caught_up(self) -> bool:
        """Every owned shard has sent every slot it may read now (``_horizon``) and the tails of its
        open slots up to the published flushed position, and seen delivered every message of a
        final slot that ended by now (those of open slots, and of slots ending after now, may be
        held by dequeue-put until their time)."""
        def done(st: GetShard) -> bool:
            ckpt = st.shard.load_enqueue_checkpoint()
            if ckpt is None:
                return st.reader is None and not st.outbox and not st.in_flight
            tick = st.shard.tick_ms
            # In flight and fine: an open slot's messages, and those of a slot that ends after now
            # (dequeue-put holds them for their time: W may be ahead of this clock, a restart on a
            # clock behind the stored W); dequeue-put's caught_up says none of them is due.
            held_until = min(ckpt.write_ms, self.ctx.clock.now_ms())
            return (st.reader is None and not st.outbox and st.cursor >= self._horizon(st, ckpt)
                    and all(o.read_pos >= ckpt.flushed_pos and t + tick > ckpt.write_ms for t, o in st.open.items())
                    and all(t + tick > held_until for t in st.in_flight))

        return not self.owner.waiting and all(done(st) for st in list(self.owned.values()))

    def close(self) -> None:
        """Stopping (SIGTERM): drain like a hand-over, for at most ``stop_drain_s``, so that the next
        owner reads again as little as possible; then release every shard and leave at once."""
        deadline = time.monotonic() + self.stop_drain_s
        for st in self.owned.values() if self.stop_drain_s > 0 else ():
            st.draining = st.draining or time.monotonic()
        while self.stop_drain_s > 0 and time.monotonic() < deadline:
            busy = False
            done = self.done_q.get_many(list(self.owned), self.ctx.consumer, 1000, 0) if self.owned else {}
            for st in list(self.owned.values()):
                try:
                    self._step_shard(st, done.get(st.shard_id, []))
                except Exception as exc:  # noqa: BLE001 - best effort: the next owner reads from R
                    st.logger.warning("drain on stop ended", reason=str(exc)[:200])
                    self.owned.pop(st.shard_id, None)
                    continue
                busy = busy or not st.carriable()
            if not busy:
                break
            time.sleep(0.005)
        for st in list(self.owned.values()):
            try:
                self.owner.ownership.check(st.shard_id)
                self._mark_released(st)
            except Exception as exc:  # noqa: BLE001 - the next owner's take marks them all the same
                st.logger.warning("release not marked", reason=str(exc)[:200])
        self.owner.leave()
        for shard in self._views.values():
            shard.close()


def _usable(shard: Shard, ckpt: DequeueCheckpoint, log: StageLogger) -> ReadAhead | None:
    """The read-ahead ``ckpt`` carries, if it still describes this shard: the same tick, its slots
    between R and its cursor, read no further than the published flushed position (a rebuilt
    wheel or TimerLog drops it, as does an enqueue.ckpt that cannot be read now: the slots are
    read again from R)."""
    carry = ckpt.carry
    if carry is None:
        return None
    try:
        published = shard.load_enqueue_checkpoint()
    except CorruptCheckpointError:
        published = None
    flushed = published.flushed_pos if published is not None else -1
    tick = shard.tick_ms
    if carry.tick_ms == tick and ckpt.read_ms <= carry.cursor_ms and all(
            ckpt.read_ms <= c.slot_ms < carry.cursor_ms and c.slot_ms % tick == 0 and c.read_pos <= flushed
            for c in carry.slots):
        return carry
    log.warning("read-ahead not carried: it does not fit the shard, reading from R", read_ms=ckpt.read_ms,
                tick_ms=tick, carried_tick_ms=carry.tick_ms, flushed_pos=flushed)
    return None


def _keep_view(st: GetShard) -> None:
    """A shard no longer owned keeps its view open (``DequeueGet._views``): taken again, it is read on."""
