"""ShardOwner: the lease lifecycle of a shard-owning stage (take, renew, balance, hand over, lose),
on an in-memory lease and member store; the stage's part (``start``, ``stop``) is a recording fake."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

from timerwheel import SimulatedClock, TimerConfig
from timerwheel.log import stage_logger
from timerwheel.stages.base import StageContext
from timerwheel.stages.owner import OwnedShard, ShardOwner
from timerwheel.stages.ownership import Ownership, assignment
from timerwheel.transports.memory import MemoryLeaseStore, MemoryWorkQueue

START = 1_700_000_000_000
SHARDS = range(4)
ROLE = "some-stage"


class Stage:
    """What a stage hands its ShardOwner: ``start`` takes the lease (once ``ready`` says so), ``stop`` records."""

    def __init__(self, ctx: StageContext, ownership: Ownership) -> None:
        self.ready: Callable[[int], bool] = lambda shard_id: True
        self.stopped: list[int] = []
        self.owner = ShardOwner(ctx, ROLE, SHARDS, ownership, self.start, self.stop, "doing")

    def start(self, shard_id: int) -> OwnedShard | None:
        if not self.ready(shard_id):
            return None
        epoch = self.owner.ownership.acquire(shard_id)
        if epoch is None:
            return None
        return OwnedShard(shard_id, cast(Any, None), stage_logger(ROLE, shard_id), epoch)

    def stop(self, state: OwnedShard) -> None:
        self.stopped.append(state.shard_id)


def _stage(store: MemoryLeaseStore, clock: SimulatedClock, member: str, ttl_ms: int = 10_000) -> tuple[Stage, StageContext]:
    ctx = StageContext(TimerConfig(fsync=False), clock, consumer=member)
    ownership = Ownership(store, ROLE, member, ttl_ms, members=store, beat_every_s=0)
    return Stage(ctx, ownership), ctx


def _until(what: str, ok: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.005)


def test_a_shard_is_owned_once_its_stage_started_it() -> None:
    clock = SimulatedClock(START)
    a, ctx = _stage(MemoryLeaseStore(clock), clock, "a")
    a.ready = lambda shard_id: shard_id != 2  # shard 2 cannot be opened yet
    a.owner.take_shards()
    assert set(a.owner.owned) == {0, 1, 3} and a.owner.waiting == {2}
    assert ctx.metrics.gauge("owned_shards", stage=ROLE) == 3
    a.ready = lambda shard_id: True
    a.owner.take_shards()
    assert set(a.owner.owned) == set(SHARDS) and not a.owner.waiting
    assert ctx.metrics.gauge("owned_shards", stage=ROLE) == 4


def test_the_shards_another_replica_ranks_first_are_handed_over_and_taken_at_once() -> None:
    clock = SimulatedClock(START)
    store = MemoryLeaseStore(clock)
    a, a_ctx = _stage(store, clock, "a")
    a.owner.take_shards()
    b, _ = _stage(store, clock, "b")  # joins: ranks first for some shards, whose leases a holds
    b.owner.take_shards()
    assert not b.owner.owned
    to_b = {s for s, m in assignment(["a", "b"], ROLE, SHARDS).items() if m == "b"}
    assert to_b and to_b != set(SHARDS)
    unwanted = a.owner.balance()
    assert {st.shard_id for st in unwanted} == to_b
    epochs = {st.shard_id: st.epoch for st in unwanted}
    for st in unwanted:
        a.owner.hand_over(st)
    assert sorted(a.stopped) == sorted(to_b) and set(a.owner.owned) == set(SHARDS) - to_b
    assert a.owner.waiting == to_b
    assert a_ctx.metrics.counter("handovers", shard=min(to_b), stage=ROLE) == 1
    b.owner.balance()
    b.owner.take_shards()
    assert set(b.owner.owned) == to_b
    assert all(b.owner.owned[s].epoch > epochs[s] for s in to_b)
    assert a.owner.balance() == []  # what a still owns is its own


def test_a_shard_whose_lease_was_taken_over_is_lost_and_stopped() -> None:
    clock = SimulatedClock(START)
    store = MemoryLeaseStore(clock)
    a, a_ctx = _stage(store, clock, "a", ttl_ms=30)
    a.owner.take_shards()
    clock.advance(1_000)  # a paused past its leases
    b, _ = _stage(store, clock, "b", ttl_ms=30)
    b.ready = lambda shard_id: shard_id == 0
    b.owner.take_shards()
    assert set(b.owner.owned) == {0}

    def renewed() -> bool:
        a.owner.renew()  # renews once a third of the TTL has passed (real time)
        return 0 not in a.owner.owned

    _until("lost shard", renewed)
    assert a.stopped == [0] and 0 in a.owner.waiting
    assert a_ctx.metrics.counter("fenced", shard=0, stage=ROLE) == 1
    assert a_ctx.metrics.gauge("owned_shards", stage=ROLE) == 3


def test_a_lease_kept_for_a_shard_not_started_is_let_go_once_another_replica_ranks_first() -> None:
    clock = SimulatedClock(START)
    store = MemoryLeaseStore(clock)
    a, _ = _stage(store, clock, "a")
    b, _ = _stage(store, clock, "b")
    to_b = {s for s, m in assignment(["a", "b"], ROLE, SHARDS).items() if m == "b"}
    kept = min(to_b)
    epoch = a.owner.ownership.acquire(kept)  # as enqueue-put keeps a lease while the old owner closes the shard
    assert epoch is not None
    a.ready = lambda shard_id: False
    assert a.owner.balance() == []
    assert kept not in a.owner.ownership.epochs
    assert b.owner.ownership.acquire(kept) == epoch + 1  # free at once, not when the lease lapses


def test_a_new_owner_takes_over_the_entries_its_predecessor_took_and_never_acknowledged() -> None:
    clock = SimulatedClock(START)
    ctx = StageContext(TimerConfig(fsync=False), clock, consumer="new-owner")
    queue = MemoryWorkQueue("put", 4, 64)
    queue.put(2, [b"a", b"b", b"c"], 1.0)
    taken = queue.get(2, "dead-owner", 2, 0)  # taken by the owner that died, never acked
    state = OwnedShard(2, cast(Any, None), stage_logger(ROLE, 2), 1)
    claimed = state.take_over_pending(queue, ctx)
    assert claimed == taken
    assert queue.pending(2) == {eid: "new-owner" for eid, _ in taken}
    assert state.take_over_pending(queue, ctx) == []  # once: later entries come through the stage's reads
