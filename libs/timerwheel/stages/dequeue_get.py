"""dequeue-get: wheel slots before ``W`` -> fetch requests, and ``R``.

Owns shards. From its cursor on, for each non-empty slot ``s`` with ``s + tick <= W``
(invariant 2: a slot is read only once every record in it is written and flushed — ``W``
and the flushed TimerLog position come from ``enqueue.ckpt``, the only thing a reader
trusts), walks the slot's chain:

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
delivery is at-least-once: what was delivered from slots at or after ``R`` is delivered again. Empty slots are
skipped in bulk (``TimerWheel.next_nonempty``), so catching up after a long outage is fast
and never skips a slot (PITFALLS: RocketMQ's 7-day catch-up cap).

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
from timerwheel.log import StageLogger, stage_logger
from timerwheel.stages.base import StageContext, decoded
from timerwheel.stages.codec import CONSUMER_OF, Q_FETCH, DoneEntry, FetchEntry, FetchItem, wire
from timerwheel.stages.ownership import Ownership
from timerwheel.store import DequeueCheckpoint, EnqueueCheckpoint, Flag, Shard, TimerRecord
from timerwheel.store.format import RecordArray
from timerwheel.transports.base import WorkQueue

STAGE = "dequeue-get"
STALL_S = 120.0
#: How often enqueue.ckpt is re-read when no in-process notice says it changed.
CKPT_POLL_S = 0.01
#: Slots with at most this many records are read in one pass; larger ones are streamed.
SMALL_SLOT = 20_000
GENERATION_BITS = 20


@dataclass
class SlotReader:
    slot_time: int
    markers: dict[int, tuple[int, int]]
    items: Iterator[FetchItem]
    matched: set[int] = field(default_factory=set)
    #: The source records' sizes (``src_size``), aligned with what ``items`` has yet to yield.
    sizes: deque[int] = field(default_factory=deque)


@dataclass
class GetShard:
    shard_id: int
    shard: Shard
    log: StageLogger
    epoch: int
    generation: int
    read_ms: int
    cursor: int
    pending: dict[int, int] = field(default_factory=dict)
    reader: SlotReader | None = None
    outbox: list[FetchEntry] = field(default_factory=list)
    last_progress: float = field(default_factory=time.monotonic)
    write_ms: int = 0
    ckpt: EnqueueCheckpoint | None = None
    ckpt_version: int = -1
    ckpt_read: float = 0.0
    #: The shard view shows every record below ``ckpt``'s flushed position (Shard.refresh).
    visible: bool = False
    #: Done entries a previous owner took and never acked are still to be claimed (e2e fix).
    reclaim: bool = True


_DELETE = int(Flag.DELETE)
_ROLL = int(Flag.ROLL)


def _is_marker(flags: int) -> bool:
    return flags & (_DELETE | _ROLL) == _DELETE


class DequeueGet:
    def __init__(self, ctx: StageContext, shard_ids: Iterable[int], open_shard: Callable[[int], Shard | None],
                 fetch_queue: WorkQueue, done_queue: WorkQueue, ownership: Ownership) -> None:
        """``open_shard(id)`` opens a read-only view of a shard, or None while it does not exist yet."""
        self.ctx = ctx
        self.fetch_q = fetch_queue
        self.done_q = done_queue
        self.ownership = ownership
        self.open_shard = open_shard
        self.logger = stage_logger(STAGE)
        self.owned: dict[int, GetShard] = {}
        self._views: dict[int, Shard] = {}
        self._waiting = set(shard_ids)
        self.take_shards()

    def take_shards(self) -> None:
        for shard_id in sorted(self._waiting):
            shard = self._views.get(shard_id) or self.open_shard(shard_id)
            if shard is None:
                continue  # enqueue-put has not created the shard yet
            self._views[shard_id] = shard
            ckpt = shard.load_dequeue_checkpoint()
            if ckpt is None:
                continue
            epoch = self.ownership.acquire(shard_id, floor=ckpt.epoch)
            if epoch is None:
                continue
            self._waiting.discard(shard_id)
            log = stage_logger(STAGE, shard_id)
            self.owned[shard_id] = GetShard(shard_id, shard, log, epoch, epoch << GENERATION_BITS,
                                            ckpt.read_ms, ckpt.read_ms)
            log.info("owning shard", epoch=epoch, read_ms=ckpt.read_ms)

    def step(self, timeout_s: float) -> int:
        for shard_id in self.ownership.renew_due():
            self._lose(shard_id, "lease lost")
        if self._waiting:
            self.take_shards()
        work = 0
        for st in list(self.owned.values()):
            try:
                work += self._step_shard(st)
            except FencedError as exc:
                self._lose(st.shard_id, str(exc))
        if not work:
            self.ctx.idle_wait(STAGE, timeout_s)
        return work

    def _step_shard(self, st: GetShard) -> int:
        work = self._drain_done(st)
        in_flight = sum(st.pending.values())
        tick = self.ctx.config.tick_ms
        batch = self.ctx.config.batch_size
        ckpt = None
        while self._flush_outbox(st) and in_flight < self.ctx.config.max_in_flight:
            if st.reader is None:
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
                st.reader = self._open(st, slot, ckpt.flushed_pos)
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
                st.pending[reader.slot_time] = st.pending.get(reader.slot_time, 0) + len(items)
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
        if st.ckpt is None or version != st.ckpt_version or now - st.ckpt_read >= CKPT_POLL_S:
            ckpt = st.shard.load_enqueue_checkpoint()
            if ckpt is None:
                return None
            st.ckpt_version, st.ckpt_read = version, now
            if ckpt != st.ckpt or not st.visible:
                st.ckpt = ckpt
                st.visible = st.shard.refresh(ckpt)
                if not st.visible:
                    self.ctx.metrics.inc("stale_views", shard=st.shard_id)
            st.write_ms = ckpt.write_ms
        return st.ckpt if st.visible else None

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

    def _open(self, st: GetShard, slot: int, flushed_pos: int) -> SlotReader:
        """Collect the slot's cancel markers, then stream its other records as fetch items."""
        shard = st.shard
        small = shard.slot(slot).num <= SMALL_SLOT
        dense = shard.read_dense_slot(slot, flushed_pos) if small else None
        if dense is not None:
            reader = SlotReader(slot, {}, iter(()))
            reader.items = iter(self._items_of(*dense, reader))  # sets reader.sizes
            return reader
        kept: list[tuple[int, TimerRecord]] = []
        markers: dict[int, tuple[int, int]] = {}
        for pos, rec in shard.read_slot(slot, flushed_pos):
            if _is_marker(rec.flags):
                markers.setdefault(rec.id_hash, (rec.src_partition, rec.src_offset))
            elif small:
                kept.append((pos, rec))
        records = iter(kept) if small else shard.read_slot(slot, flushed_pos)
        reader = SlotReader(slot, markers, iter(()))
        reader.items = self._items(records, reader)
        return reader

    @staticmethod
    def _items(records: Iterator[tuple[int, TimerRecord]], reader: SlotReader) -> Iterator[FetchItem]:
        markers = reader.markers
        new_tuple = tuple.__new__  # FetchItem(...) goes through a Python-level __new__: twice the cost
        for pos, rec in records:
            flags = rec.flags
            if flags & (_DELETE | _ROLL) == _DELETE:
                continue  # a cancel marker
            reader.sizes.append(rec.src_size)
            ref = markers.get(rec.id_hash) if markers and not flags & _ROLL else None
            if ref is None:
                yield new_tuple(FetchItem, (pos, flags, rec.src_partition, rec.src_offset, rec.deliver_ms,
                                            rec.enqueue_ms, -1, -1))
            else:
                reader.matched.add(rec.id_hash)
                yield FetchItem(pos, flags, rec.src_partition, rec.src_offset, rec.deliver_ms, rec.enqueue_ms,
                                ref[0], ref[1])

    @staticmethod
    def _items_of(positions: npt.NDArray[np.int64], records: RecordArray, reader: SlotReader) -> list[FetchItem]:
        """``_items`` of a slot read column-wise (``Shard.read_dense_slot``): its markers collected
        into the reader, fetch items built without a TimerRecord each."""
        all_flags = records["magic"] & 0xFF
        is_marker = all_flags & (_DELETE | _ROLL) == _DELETE
        markers = reader.markers
        for rec in records[is_marker][["id_hash", "src_partition", "src_offset"]].tolist():
            markers.setdefault(rec[0], (rec[1], rec[2]))  # newest first: the newest marker of an id wins
        msgs, flags = records[~is_marker], all_flags[~is_marker]
        reader.sizes.extend(msgs["src_size"].tolist())
        n = len(msgs)
        cancel_partition, cancel_offset = [-1] * n, [-1] * n
        if markers:
            id_hashes = msgs["id_hash"]
            may_match = np.isin(id_hashes, np.array(list(markers), dtype=np.uint64)) & (flags & _ROLL == 0)
            for k in np.flatnonzero(may_match).tolist():
                h = int(id_hashes[k])
                cancel_partition[k], cancel_offset[k] = markers[h]
                reader.matched.add(h)
        # FetchItem(...) goes through a Python-level __new__: tuple.__new__ in map is a C loop
        return list(map(tuple.__new__, itertools.repeat(FetchItem), zip(
            positions[~is_marker].tolist(), flags.tolist(), msgs["src_partition"].tolist(),
            msgs["src_offset"].tolist(), msgs["deliver_ms"].tolist(), msgs["enqueue_ms"].tolist(),
            cancel_partition, cancel_offset, strict=True,
        )))

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

    def _drain_done(self, st: GetShard) -> int:
        entries = []
        if st.reclaim:
            # e2e fix: a previous owner that died leaves the done entries it had taken pending for
            # good; they count against the queue bound until dequeue-put blocks. Claim and ack them
            # (their generation is old, so they are ignored below).
            st.reclaim = False
            entries = self.done_q.claim_stale(st.shard_id, self.ctx.consumer, 0, 4 * self.ctx.config.queue_bound)
        entries += self.done_q.get(st.shard_id, self.ctx.consumer, 1000, 0)
        if not entries:
            if st.pending and time.monotonic() - st.last_progress > STALL_S:
                self._resend(st)
            return 0
        for done in decoded(self.ctx, self.done_q, st.shard_id, entries, DoneEntry.decode, st.log):
            if done.generation != st.generation:
                continue
            for slot, n in done.counts.items():
                left = st.pending.get(slot, 0) - n
                if left > 0:
                    st.pending[slot] = left
                else:
                    st.pending.pop(slot, None)
        self.done_q.ack(st.shard_id, [eid for eid, _ in entries])
        st.last_progress = time.monotonic()
        return len(entries)

    def _resend(self, st: GetShard) -> None:
        st.log.warning("slots stalled, re-sending from R", read_ms=st.read_ms, pending=sum(st.pending.values()))
        self.ctx.metrics.inc("resends", shard=st.shard_id)
        st.generation += 1
        st.pending.clear()
        st.reader = None
        st.outbox.clear()
        st.cursor = st.read_ms
        st.last_progress = time.monotonic()

    def _advance_r(self, st: GetShard) -> bool:
        floor = [*st.pending]
        if st.reader is not None:
            floor.append(st.reader.slot_time)
        read_ms = min(floor) if floor else st.cursor
        moved = read_ms > st.read_ms
        if moved:
            self.ownership.check(st.shard_id)
            st.shard.save_dequeue_checkpoint(DequeueCheckpoint(read_ms=read_ms, epoch=st.epoch))
            st.read_ms = read_ms
            st.last_progress = time.monotonic()
            self.ctx.wake("enqueue-put")  # W may have been held back by R
        now = self.ctx.clock.now_ms()
        self.ctx.metrics.set("read_lag_ms", max(0, now - st.read_ms), shard=st.shard_id)
        self.ctx.metrics.set("in_flight", sum(st.pending.values()), shard=st.shard_id)
        self.ctx.metrics.set("read_ms", st.read_ms, shard=st.shard_id)
        self.ctx.metrics.set("owner_epoch", st.epoch, shard=st.shard_id, stage=STAGE)
        return moved

    def _lose(self, shard_id: int, why: str) -> None:
        st = self.owned.pop(shard_id, None)
        if st is not None:
            st.log.warning("shard ownership lost, stopped reading", reason=why)
            self.ctx.metrics.inc("fenced", shard=shard_id, stage=STAGE)
            self._waiting.add(shard_id)

    def caught_up(self) -> bool:
        """Every owned shard has read and seen delivered every slot before W."""
        def done(st: GetShard) -> bool:
            ckpt = st.shard.load_enqueue_checkpoint()
            end = st.shard.slot_time(ckpt.write_ms) if ckpt else st.cursor
            return st.reader is None and not st.pending and not st.outbox and st.cursor >= end

        return not self._waiting and all(done(st) for st in list(self.owned.values()))

    def close(self) -> None:
        self.ownership.release_all()
        for shard in self._views.values():
            shard.close()
