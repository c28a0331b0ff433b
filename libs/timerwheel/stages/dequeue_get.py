"""dequeue-get: wheel slots before ``W`` -> fetch requests, and ``R``.

Owns shards. From its cursor on, for each non-empty slot ``s`` with ``s + tick <= W``
(invariant 2: a slot is read only once every record in it is written and flushed — ``W``
and the flushed TimerLog position come from ``enqueue.ckpt``, the only thing a reader
trusts), reads the slot (``Shard.read_slot``: its records column-wise, a bounded piece at a time):

* DELETE markers (not ROLL) are collected first; a message whose id hash matches one is
  sent with a reference to the marker so dequeue-getmsg can confirm on the full id (a hash
  collision must never cancel the wrong message). Markers that match nothing are counted:
  a cancel that came after delivery has no effect.
* Every other record — a message due now or a roll hop — is sent to the fetch queue in
  batches, at most ``max_in_flight`` messages per shard outstanding (flow control; a slot of
  a million messages is streamed, never held). A batch also ends at TW_BATCH_BYTES of source
  records (their ``src_size``): a fetch entry stands for a bounded read in dequeue-getmsg.

``R`` (``dequeue.ckpt``) advances past a slot only when dequeue-put has reported every
message of it done (invariant 3), so after a crash the slots from ``R`` on are read again:
delivery is at-least-once: what was delivered from slots at or after ``R`` is delivered again.
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

import numpy as np
import numpy.typing as npt

from timerwheel import telemetry
from timerwheel.errors import FencedError, QueueFullError
from timerwheel.log import stage_logger
from timerwheel.stages.base import StageContext, decoded, get_by
from timerwheel.stages.codec import CONSUMER_OF, Q_FETCH, DoneEntry, FetchEntry, FetchItem, wire
from timerwheel.stages.owner import OwnedShard, ShardOwner
from timerwheel.stages.ownership import Ownership
from timerwheel.store import CorruptCheckpointError, DequeueCheckpoint, EnqueueCheckpoint, Flag, Shard
from timerwheel.store.format import RecordArray
from timerwheel.store.shard import SlotPiece, recovery_needed
from timerwheel.transports.base import WorkQueue

STAGE = "dequeue-get"
STALL_S = 120.0
#: How often enqueue.ckpt is re-read when no in-process notice says it changed.
CKPT_POLL_S = 0.01
#: Slots with at most this many records are read in one pass; larger ones are streamed.
SMALL_SLOT = 20_000
#: W older than this (enqueue-put publishes an idle W every second): not worth looking for every CKPT_POLL_S.
W_STILL_MS = 3_000
#: How long a step with messages in flight, or a full fetch queue, waits when it found nothing to do.
BUSY_WAIT_S = 0.005
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


@dataclass
class SlotReader:
    """A slot being sent: its cancel markers, and its other records as fetch items."""

    slot_time: int
    #: id hash -> (source partition, offset) of the newest cancel marker of that hash in the slot.
    markers: dict[int, tuple[int, int]]
    items: Iterator[FetchItem]
    #: Id hashes of the markers some message matched.
    matched: set[int] = field(default_factory=set)
    #: The source records' sizes (``src_size``), aligned with what ``items`` has yet to yield.
    sizes: deque[int] = field(default_factory=deque)
    #: The markers' id hashes as an array, once they are all collected (``fetch_items`` matches on it).
    marker_hashes: npt.NDArray[np.uint64] = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))


def open_slot(shard: Shard, slot_time: int, limit_pos: int) -> SlotReader:
    """The slot's reader: its cancel markers collected first, then its other records streamed as
    fetch items. The slot is read once and held while it has at most SMALL_SLOT records; a larger
    one is read again for its items, a piece at a time: memory stays bounded whatever its size."""
    reader = SlotReader(slot_time, {}, iter(()))
    held: list[SlotPiece] | None = []
    count = 0
    for piece in shard.read_slot(slot_time, limit_pos):
        markers_of(piece[1], reader.markers)
        count += len(piece[0])
        if held is not None and count <= SMALL_SLOT:
            held.append(piece)
        else:
            held = None
    reader.marker_hashes = np.fromiter(reader.markers, dtype=np.uint64, count=len(reader.markers))
    pieces = held if held is not None else shard.read_slot(slot_time, limit_pos)
    reader.items = itertools.chain.from_iterable(
        fetch_items(positions[k:k + ITEMS_AT_ONCE], records[k:k + ITEMS_AT_ONCE], reader)
        for positions, records in pieces for k in range(0, len(positions), ITEMS_AT_ONCE))
    return reader


def markers_of(records: RecordArray, markers: dict[int, tuple[int, int]]) -> None:
    """Add the cancel markers (DELETE, not ROLL) among ``records`` to ``markers``: id hash ->
    (source partition, offset). Records come newest first: the newest marker of an id wins."""
    is_marker = (records["magic"] & (_DELETE | _ROLL)) == _DELETE
    if is_marker.any():
        for id_hash, partition, offset in records[is_marker][["id_hash", "src_partition", "src_offset"]].tolist():
            markers.setdefault(id_hash, (partition, offset))


def fetch_items(positions: npt.NDArray[np.int64], records: RecordArray, reader: SlotReader) -> list[FetchItem]:
    """The fetch items of a slot's records other than cancel markers, built column-wise; a
    message (not a roll hop) whose id hash matches one of ``reader.markers`` carries that marker,
    for dequeue-getmsg to confirm on the full id. Their sizes go to ``reader.sizes``."""
    all_flags = records["magic"] & 0xFF
    keep = (all_flags & (_DELETE | _ROLL)) != _DELETE
    if keep.all():  # no cancel marker among them (most pieces): no copy
        msgs, flags, msg_positions = records, all_flags, positions
    else:
        msgs, flags, msg_positions = records[keep], all_flags[keep], positions[keep]
    reader.sizes.extend(msgs["src_size"].tolist())
    n = len(msgs)
    cancel_partition, cancel_offset = [-1] * n, [-1] * n
    markers = reader.markers
    if markers:
        id_hashes = msgs["id_hash"]
        may_match = np.isin(id_hashes, reader.marker_hashes) & (flags & _ROLL == 0)
        for k in np.flatnonzero(may_match).tolist():
            h = int(id_hashes[k])
            cancel_partition[k], cancel_offset[k] = markers[h]
            reader.matched.add(h)
    # FetchItem(...) goes through a Python-level __new__: tuple.__new__ in map is a C loop
    return list(map(tuple.__new__, itertools.repeat(FetchItem), zip(
        msg_positions.tolist(), flags.tolist(), msgs["src_partition"].tolist(), msgs["src_offset"].tolist(),
        msgs["deliver_ms"].tolist(), msgs["enqueue_ms"].tolist(), cancel_partition, cancel_offset, strict=True,
    )))


@dataclass
class GetShard(OwnedShard):
    #: Of the fetch and done entries: the epoch in the high bits, bumped by a re-send (``_resend``).
    generation: int
    #: R: every slot before it is delivered (dequeue.ckpt).
    read_ms: int
    #: The next slot to look at.
    cursor: int
    #: slot time -> messages sent from that slot and not reported done yet.
    in_flight: dict[int, int] = field(default_factory=dict)
    reader: SlotReader | None = None
    outbox: list[FetchEntry] = field(default_factory=list)
    last_progress: float = field(default_factory=time.monotonic)
    #: W as enqueue.ckpt last said.
    write_ms: int = 0
    #: enqueue.ckpt as last read, the in-process publication count then, and when (time.monotonic()).
    enqueue_ckpt: EnqueueCheckpoint | None = None
    enqueue_ckpt_version: int = -1
    enqueue_ckpt_read_at: float = 0.0
    #: The shard view shows every record below ``enqueue_ckpt``'s flushed position (Shard.refresh).
    visible: bool = False
    #: Being handed over (monotonic time it began): no new slot is opened, the shard is
    #: released once what was sent came back done (or after DRAIN_S).
    draining: float | None = None

    def messages_in_flight(self) -> int:
        """Messages sent and not reported done yet."""
        return sum(self.in_flight.values())

    def settled(self) -> bool:
        """No slot open, nothing waiting to be sent, nothing sent and not yet done."""
        return self.reader is None and not self.in_flight and not self.outbox


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
        log.info("owning shard", epoch=epoch, read_ms=ckpt.read_ms)
        return GetShard(shard_id, shard, log, epoch, epoch << GENERATION_BITS, ckpt.read_ms, ckpt.read_ms)

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
        for st in list(self.owned.values()):
            try:
                work += self._step_shard(st, done.get(st.shard_id, []))
                if st.draining is not None and self._drained(st):
                    self._hand_over(st)
            except FencedError as exc:
                owner.lose(st.shard_id, str(exc))
        self._idle = not work
        if not work and not wait:
            self.ctx.idle_wait(STAGE, self._idle_wait_s(timeout_s) if self.ctx.frugal and self.owned else timeout_s)
        return work

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
            due = st.shard.next_nonempty(st.cursor, now + tick)
            # Read once W passes the slot's end; however late we are, unless W stood still for
            # seconds (enqueue-put down or held back by R: once a tick is enough then).
            if due is not None and now - st.write_ms < W_STILL_MS:
                wait = min(wait, max(CKPT_POLL_S, (due + tick - now) / 1000))
        return wait

    def _step_shard(self, st: GetShard, done: list[tuple[str, bytes]]) -> int:
        work = self._drain_done(st, done)
        in_flight = st.messages_in_flight()
        tick = st.shard.tick_ms
        batch = self.ctx.config.batch_size
        ckpt = None
        while self._flush_outbox(st) and in_flight < self.ctx.config.max_in_flight:
            if st.reader is None:
                if st.draining is not None:
                    break  # being handed over: finish the slot in hand, open no other
                if ckpt is None:
                    ckpt = self._published(st)
                    if ckpt is None:
                        break
                end = st.shard.slot_time(ckpt.write_ms)
                if st.cursor >= end:
                    break
                slot = st.shard.next_nonempty(st.cursor, end)
                if slot is None:
                    st.cursor = end
                    break
                st.reader = open_slot(st.shard, slot, ckpt.flushed_pos)
                st.cursor = slot + tick
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
                st.outbox.append(FetchEntry(st.shard_id, st.generation, reader.slot_time, items, tp))
                st.in_flight[reader.slot_time] = st.in_flight.get(reader.slot_time, 0) + len(items)
                in_flight += len(items)
                work += len(items)
            if taken < batch:
                missed = len(reader.markers) - len(reader.matched)
                if missed:
                    self.ctx.metrics.inc("cancel_missed", missed)
                st.reader = None
        if self._advance_r(st):
            work += 1  # a new R is progress too: enqueue-put may now move W past its cap
        return work

    def _published(self, st: GetShard) -> EnqueueCheckpoint | None:
        """W and the flushed TimerLog position from enqueue.ckpt — the only thing a reader trusts —
        once the shard view shows every record below that position (``Shard.refresh``).

        Re-read when this process's enqueue-put says it published, else at most every
        CKPT_POLL_S (an enqueue-put in another process): reading the file each step costs
        more than the rest of an idle step. While the view is incomplete (another node's bytes
        not visible here yet) nothing new is read: a slot is never taken for empty on a stale view."""
        version = self.ctx.published_w.get(st.shard_id, 0)
        now = time.monotonic()
        if (st.enqueue_ckpt is None or version != st.enqueue_ckpt_version
                or now - st.enqueue_ckpt_read_at >= CKPT_POLL_S):
            ckpt = st.shard.load_enqueue_checkpoint()
            if ckpt is None:
                return None
            st.enqueue_ckpt_version, st.enqueue_ckpt_read_at = version, now
            if ckpt != st.enqueue_ckpt or not st.visible:
                st.enqueue_ckpt = ckpt
                st.visible = st.shard.refresh(ckpt)
                if not st.visible:
                    self.ctx.metrics.inc("stale_views", shard=st.shard_id)
            st.write_ms = ckpt.write_ms
        return st.enqueue_ckpt if st.visible else None

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
            if st.in_flight and time.monotonic() - st.last_progress > STALL_S:
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
        st.outbox.clear()
        st.cursor = st.read_ms
        st.last_progress = time.monotonic()

    def _advance_r(self, st: GetShard) -> bool:
        floor = [*st.in_flight]
        if st.reader is not None:
            floor.append(st.reader.slot_time)
        read_ms = min(floor) if floor else st.cursor
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
        return st.settled() or time.monotonic() - st.draining >= DRAIN_S

    def _hand_over(self, st: GetShard) -> None:
        """Release a drained shard: R is saved already (``_advance_r``), so its next owner
        starts where this one stopped."""
        self.owner.ownership.check(st.shard_id)
        self.owner.hand_over(st, read_ms=st.read_ms, in_flight=st.messages_in_flight())

    def caught_up(self) -> bool:
        """Every owned shard has read and seen delivered every slot before W."""
        def done(st: GetShard) -> bool:
            ckpt = st.shard.load_enqueue_checkpoint()
            end = st.shard.slot_time(ckpt.write_ms) if ckpt else st.cursor
            return st.settled() and st.cursor >= end

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
                busy = busy or not st.settled()
            if not busy:
                break
            time.sleep(0.005)
        self.owner.leave()
        for shard in self._views.values():
            shard.close()


def _keep_view(st: GetShard) -> None:
    """A shard no longer owned keeps its view open (``DequeueGet._views``): taken again, it is read on."""
