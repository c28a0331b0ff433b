"""Two replicas of enqueue-put and of dequeue-get balance their shards: a replica that joins gets
the shards it ranks first for once their owner handed them over (enqueue-put: a last checkpoint;
dequeue-get: what it sent came back done), with a greater epoch, writing nothing twice and
reading no slot again; one that leaves gives its shards back at once (no lease lapse)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from timerwheel import SimulatedClock, TimerConfig
from timerwheel.stages.base import StageContext
from timerwheel.stages.codec import DoneEntry, FetchEntry, PutEntry, PutRequest
from timerwheel.stages.dequeue_get import CKPT_POLL_S, DequeueGet
from timerwheel.stages.enqueue_put import EnqueuePut
from timerwheel.stages.ownership import Ownership, assignment
from timerwheel.store import Shard
from timerwheel.store.layout import open_reader_if_exists, open_shard
from timerwheel.transports.memory import MemoryLeaseStore, MemoryWorkQueue

START = 1_700_000_000_000
SHARDS = 4
A, B = "pod-a", "pod-b"


def _entry(partition: int, offsets: range, due: int) -> PutEntry:
    return PutEntry.of(partition, offsets.start, offsets.stop, [
        PutRequest(o, 100, START, due, False, 7, 1_000 + o) for o in offsets])


def _written(shard: Shard) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for _first, arr in shard.log.iter_chunks(shard.log.start_pos, shard.flush()):
        out += zip(arr["src_partition"].tolist(), arr["src_offset"].tolist(), strict=True)
    return out


class World:
    def __init__(self, tmp_path: Path) -> None:
        self.clock = SimulatedClock(START)
        self.config = TimerConfig(data_dir=str(tmp_path), shards=SHARDS, fsync=False, tick_ms=100)
        self.leases = MemoryLeaseStore(self.clock)
        self.put_q = MemoryWorkQueue("put", SHARDS, 64)
        self.fetch_q = MemoryWorkQueue("fetch", SHARDS, 1000)
        self.done_q = MemoryWorkQueue("done", SHARDS, 1000)

    def ownership(self, role: str, member: str) -> Ownership:
        return Ownership(self.leases, role, member, 10_000, members=self.leases, beat_every_s=0)

    def put(self, member: str) -> EnqueuePut:
        ctx = StageContext(self.config, self.clock, consumer=f"put-{member}")
        return EnqueuePut(ctx, range(SHARDS), lambda s: open_shard(self.config, s, writer=True), self.put_q,
                          self.ownership("enqueue-put", member))

    def get(self, member: str) -> DequeueGet:
        ctx = StageContext(self.config, self.clock, consumer=f"get-{member}")
        return DequeueGet(ctx, range(SHARDS), lambda s: open_reader_if_exists(self.config, s), self.fetch_q,
                          self.done_q, self.ownership("dequeue-get", member))


def test_enqueue_put_hands_shards_to_a_joining_replica_and_takes_them_back_when_it_leaves(tmp_path: Path) -> None:
    w = World(tmp_path)
    to_b = {s for s, m in assignment([A, B], "enqueue-put", range(SHARDS)).items() if m == B}
    assert to_b and to_b != set(range(SHARDS))  # the names split the shards
    a = w.put(A)
    b = None
    try:
        assert set(a.owned) == set(range(SHARDS))
        for s in range(SHARDS):
            w.put_q.put(s, [_entry(s, range(0, 5), START + 60_000)], 1.0)
        a.step(0)
        epochs = {s: a.owned[s].epoch for s in range(SHARDS)}
        b = w.put(B)
        assert not b.owned  # the shards are still a's: b waits for the hand-over
        a.step(0)
        assert set(a.owned) == set(range(SHARDS)) - to_b
        assert a.ctx.metrics.counter("handovers", shard=min(to_b), stage="enqueue-put") == 1
        for s in range(SHARDS):
            w.put_q.put(s, [_entry(s, range(3, 9), START + 60_000)], 1.0)  # 3, 4 again: written once
        b.step(0)
        a.step(0)
        assert set(b.owned) == to_b
        assert all(b.owned[s].epoch > epochs[s] for s in to_b)
        for s in range(SHARDS):
            owner = b if s in to_b else a
            assert _written(owner.owned[s].shard) == [(s, o) for o in range(9)], s
        assert b.ctx.metrics.gauge("owned_shards", stage="enqueue-put") == len(to_b)
        b.close()  # leaves: a takes the shards back at once, the clock never moved
        b = None
        a.step(0)
        assert set(a.owned) == set(range(SHARDS))
    finally:
        a.close()
        if b is not None:
            b.close()


def _fetched(w: World, shard: int) -> list[FetchEntry]:
    return [FetchEntry.decode(p) for _eid, p in w.fetch_q.get(shard, "test", 1000, 0)]


def test_dequeue_get_drains_before_it_hands_a_shard_over_and_the_next_owner_reads_no_slot_again(
        tmp_path: Path) -> None:
    """The draining owner waits for what it sent to come back done, then hands the shard over
    with the slots it read ahead (TW_LOOKAHEAD_MS) still open: it saves them beside R (its
    read-ahead, ``ReadAhead``), and the next owner reads none of them again (it did, and
    delivered them twice, while they were open at the hand-over); it makes them final itself once
    W passes them."""
    w = World(tmp_path)
    to_b = sorted(s for s, m in assignment([A, B], "dequeue-get", range(SHARDS)).items() if m == B)
    assert to_b and len(to_b) < SHARDS
    assert w.config.effective_lookahead_ms >= 600
    put = w.put(A)
    for s in range(SHARDS):
        w.put_q.put(s, [_entry(s, range(0, 3), START + 1_000), _entry(s, range(3, 4), START + 2_500)], 1.0)
    put.step(0)
    a = w.get(A)
    b = None
    try:
        w.clock.set(START + 2_000)
        put.step(0)  # W past the first messages' slot; the last one's is read ahead, open
        a.step(0)
        shard = to_b[0]
        sent = _fetched(w, shard)
        assert sum(len(e.items) for e in sent) == 4
        b = w.get(B)
        a.step(0)
        epoch_a = a.owned[shard].epoch
        assert a.owned[shard].draining is not None  # no longer a's, but 4 messages are in flight
        b.step(0)
        assert shard not in b.owned
        for e in sent:  # dequeue-put reports them done
            w.done_q.put(shard, [DoneEntry(shard, e.generation, {e.slot_time: len(e.items)})], 1.0)
        a.step(0)
        assert shard not in a.owned  # everything came back: handed over, the read-ahead slot open
        b.step(0)
        assert shard in b.owned and b.owned[shard].epoch > epoch_a
        assert START + 2_500 - (START + 2_500) % w.config.tick_ms in b.owned[shard].open  # carried
        b.step(0)
        assert _fetched(w, shard) == []  # neither the delivered slot nor the read-ahead one is read again
        w.clock.set(START + 4_000)
        put.step(0)  # W past every slot a read ahead: b makes them final
        for _ in range(100):  # b re-reads enqueue.ckpt at most every CKPT_POLL_S
            b.step(0)
            if b.owned[shard].read_ms > START + 2_500:
                break
            time.sleep(CKPT_POLL_S)
        assert b.owned[shard].read_ms > START + 2_500
        assert _fetched(w, shard) == []
        for s in range(SHARDS):
            w.put_q.put(s, [_entry(s, range(4, 6), START + 6_000)], 1.0)
        put.step(0)
        w.clock.set(START + 7_000)
        put.step(0)
        a.step(0)
        fetched: list[FetchEntry] = []
        for _ in range(100):  # b re-reads enqueue.ckpt at most every CKPT_POLL_S
            b.step(0)
            fetched += _fetched(w, shard)
            if fetched:
                break
            time.sleep(CKPT_POLL_S)
        assert sum(len(e.items) for e in fetched) == 2  # b serves the shard's new slots
    finally:
        put.close()
        a.close()
        if b is not None:
            b.close()


def test_a_shard_that_cannot_be_opened_is_reported_and_the_others_still_taken(tmp_path: Path) -> None:
    w = World(tmp_path)
    ctx = StageContext(w.config, w.clock, consumer="put-a")
    broken = {1}

    def open_writer(shard: int) -> Shard:
        if shard in broken:
            raise OSError(f"shard {shard}: enqueue.ckpt: Input/output error")
        return open_shard(w.config, shard, writer=True)

    put = EnqueuePut(ctx, range(SHARDS), open_writer, w.put_q, w.ownership("enqueue-put", A))
    try:
        assert set(put.owned) == set(range(SHARDS)) - {1}
        assert ctx.metrics.gauge("shard_open_failed", shard=1, stage="enqueue-put", error="OSError") == 1
        broken.clear()  # repaired (say, by a recovery Job): taken at the next step
        put.step(0)
        assert set(put.owned) == set(range(SHARDS))
        assert ctx.metrics.gauge("shard_open_failed", shard=1, stage="enqueue-put", error="OSError") == 0
    finally:
        put.close()


def test_dequeue_get_on_stop_waits_for_what_it_sent_so_the_next_owner_reads_nothing_again(tmp_path: Path) -> None:
    w = World(tmp_path)
    put = w.put(A)
    for s in range(SHARDS):
        w.put_q.put(s, [_entry(s, range(0, 3), START + 1_000)], 1.0)
    put.step(0)
    ctx = StageContext(w.config, w.clock, consumer="get-a")
    get = DequeueGet(ctx, range(SHARDS), lambda s: open_reader_if_exists(w.config, s), w.fetch_q, w.done_q,
                     w.ownership("dequeue-get", A), stop_drain_s=5.0)
    try:
        w.clock.set(START + 2_000)
        put.step(0)
        get.step(0)
        sent = {s: _fetched(w, s) for s in range(SHARDS)}
        assert all(sum(len(e.items) for e in sent[s]) == 3 for s in range(SHARDS))

        def report_done() -> None:  # dequeue-put, still running while dequeue-get stops
            time.sleep(0.2)
            for s, entries in sent.items():
                w.done_q.put(s, [DoneEntry(s, e.generation, {e.slot_time: len(e.items)}) for e in entries], 1.0)

        reporter = threading.Thread(target=report_done)
        reporter.start()
        get.close()
        reporter.join()
        for s in range(SHARDS):
            ckpt = put.owned[s].shard.load_dequeue_checkpoint()
            assert ckpt is not None and ckpt.read_ms > START + 1_000, s  # R past the delivered slot
            assert w.leases.current_epoch("dequeue-get", s) >= 1 and w.leases.acquire("dequeue-get", s, B, 10_000)
    finally:
        put.close()
