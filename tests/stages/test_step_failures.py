"""A dequeue-get step that fails part-way (a torn checkpoint read on a shared volume, Redis gone
for a moment) leaves no shard's done entries uncounted: they were taken from the queue, so a plain
read never returns them again, and a shard whose in-flight count never falls keeps R, and W with
it (capped by R), still until STALL_S (CI: a two-node chaos run stopped delivering a shard)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from timerwheel import SimulatedClock, TimerConfig
from timerwheel.stages.base import StageContext
from timerwheel.stages.codec import DoneEntry, FetchEntry, PutEntry, PutRequest
from timerwheel.stages.dequeue_get import DequeueGet
from timerwheel.stages.enqueue_put import EnqueuePut
from timerwheel.stages.ownership import Ownership
from timerwheel.stages.published import TORN_READ_PATIENCE_S, PublishedView
from timerwheel.store import CorruptCheckpointError
from timerwheel.store.layout import open_reader_if_exists, open_shard
from timerwheel.transports.memory import MemoryLeaseStore, MemoryWorkQueue

START = 1_700_000_000_000
SHARDS = 2


class Rig:
    def __init__(self, tmp_path: Path) -> None:
        self.clock = SimulatedClock(START)
        self.config = TimerConfig(data_dir=str(tmp_path), shards=SHARDS, fsync=False, tick_ms=100)
        leases = MemoryLeaseStore(self.clock)
        self.put_q = MemoryWorkQueue("put", SHARDS, 64)
        self.fetch_q = MemoryWorkQueue("fetch", SHARDS, 1000)
        self.done_q = MemoryWorkQueue("done", SHARDS, 1000)
        self.put = EnqueuePut(StageContext(self.config, self.clock, consumer="put"), range(SHARDS),
                              lambda s: open_shard(self.config, s, writer=True), self.put_q,
                              Ownership(leases, "enqueue-put", "a", 10_000, members=leases, beat_every_s=0))
        self.get = DequeueGet(StageContext(self.config, self.clock, consumer="get"), range(SHARDS),
                              lambda s: open_reader_if_exists(self.config, s), self.fetch_q, self.done_q,
                              Ownership(leases, "dequeue-get", "a", 10_000, members=leases, beat_every_s=0))

    def sent_and_reported_done(self) -> None:
        """Three messages per shard, due in the past: read, sent, and reported done by 'dequeue-put'."""
        for s in range(SHARDS):
            self.put_q.put(s, [PutEntry.of(s, 0, 3, [PutRequest(o, 100, START, START + 1_000, False, 7, 1_000 + o)
                                                     for o in range(3)])], 1.0)
        self.put.step(0)
        self.clock.set(START + 2_000)
        self.put.step(0)
        self.get.step(0)
        for s in range(SHARDS):
            sent = [FetchEntry.decode(p) for _eid, p in self.fetch_q.get(s, "getmsg", 1000, 0)]
            assert sum(len(e.items) for e in sent) == 3
            self.done_q.put(s, [DoneEntry(s, e.generation, {e.slot_time: len(e.items)}) for e in sent], 1.0)
        assert all(self.get.owned[s].in_flight for s in range(SHARDS))

    def close(self) -> None:
        self.put.close()
        self.get.close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    yield r
    r.close()


def test_a_failing_read_of_one_shard_leaves_no_shards_done_entries_uncounted(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    rig.sent_and_reported_done()
    real = PublishedView.newest

    def fails_for_shard_0(self: PublishedView, ctx: StageContext):  # type: ignore[no-untyped-def]
        if self.shard_id == 0:
            raise OSError("shard 0: enqueue.ckpt: Input/output error")
        return real(self, ctx)

    monkeypatch.setattr(PublishedView, "newest", fails_for_shard_0)
    with pytest.raises(OSError):
        rig.get.step(0)  # shard 0 is stepped first and fails; shard 1's entries were taken too
    monkeypatch.setattr(PublishedView, "newest", real)
    rig.get.step(0)
    assert {s: rig.get.owned[s].in_flight for s in range(SHARDS)} == {0: {}, 1: {}}
    assert all(rig.get.owned[s].read_ms > START + 1_000 for s in range(SHARDS))  # R passed the slot


def test_done_entries_taken_by_a_step_that_failed_before_counting_them_are_claimed_again(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    rig.sent_and_reported_done()
    real_ack = MemoryWorkQueue.ack

    def redis_gone(self: MemoryWorkQueue, partition: int, entry_ids):  # type: ignore[no-untyped-def]
        raise ConnectionError("Redis gone")

    monkeypatch.setattr(MemoryWorkQueue, "ack", redis_gone)
    with pytest.raises(ConnectionError):
        rig.get.step(0)  # both shards' done entries taken; shard 0's counted, not acknowledged
    monkeypatch.setattr(MemoryWorkQueue, "ack", real_ack)
    rig.get.step(0)
    assert {s: rig.get.owned[s].in_flight for s in range(SHARDS)} == {0: {}, 1: {}}
    assert all(rig.done_q.depth(s) == 0 for s in range(SHARDS))  # and acknowledged


def test_a_checkpoint_read_torn_for_a_moment_is_not_an_error_but_one_that_stays_is(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(tmp_path)
    try:
        rig.put.step(0)
        shard = rig.get.owned[0].shard
        view = PublishedView(0, shard)
        ctx = rig.get.ctx
        now = [1000.0]
        monkeypatch.setattr("timerwheel.stages.published.time.monotonic", lambda: now[0])
        first = view.newest(ctx)
        assert first is not None
        now[0] += 1.0

        def torn() -> None:
            raise CorruptCheckpointError("checkpoint enqueue.00000000000000000001.ckpt is unreadable: Extra data")

        monkeypatch.setattr(shard, "load_enqueue_checkpoint", torn)
        assert view.newest(ctx) == first  # what was published before still holds
        now[0] += TORN_READ_PATIENCE_S - 0.5
        assert view.newest(ctx) == first
        now[0] += 1.0
        with pytest.raises(CorruptCheckpointError):
            view.newest(ctx)
    finally:
        rig.close()
