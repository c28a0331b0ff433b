"""Shard balancing among the replicas of a shard-owning stage: rendezvous hashing over the live
members, each shard handed over only by its owner's release (or its lease lapsing)."""

from __future__ import annotations

from timerwheel import SimulatedClock
from timerwheel.stages.ownership import Ownership, assignment, rendezvous_owner
from timerwheel.transports.memory import MemoryLeaseStore

START = 1_700_000_000_000
SHARDS = range(64)


def test_every_shard_has_exactly_one_owner_and_all_replicas_agree() -> None:
    members = ["pod-a", "pod-b", "pod-c"]
    first = assignment(members, "enqueue-put", SHARDS)
    assert set(first) == set(SHARDS)
    assert assignment(list(reversed(members)), "enqueue-put", SHARDS) == first  # order does not matter
    counts = {m: sum(1 for o in first.values() if o == m) for m in members}
    assert all(10 <= n <= 35 for n in counts.values()), counts  # 64/3 each, give or take


def test_a_joining_member_takes_shards_only_from_others_and_a_leaving_one_gives_only_its_own() -> None:
    two = assignment(["pod-a", "pod-b"], "dequeue-get", SHARDS)
    three = assignment(["pod-a", "pod-b", "pod-c"], "dequeue-get", SHARDS)
    moved = {s for s in SHARDS if two[s] != three[s]}
    assert moved and all(three[s] == "pod-c" for s in moved)
    assert assignment(["pod-a", "pod-b"], "dequeue-get", SHARDS) == two  # pod-c left: back as before


def test_the_roles_rank_members_independently() -> None:
    members = ["pod-a", "pod-b"]
    put = assignment(members, "enqueue-put", SHARDS)
    get = assignment(members, "dequeue-get", SHARDS)
    assert put != get
    assert rendezvous_owner([], "enqueue-put", 0) is None


def test_replicas_on_one_member_store_want_disjoint_shards_covering_all() -> None:
    clock = SimulatedClock(START)
    leases = MemoryLeaseStore(clock)
    a = Ownership(leases, "enqueue-put", "pod-a", 10_000, members=leases, beat_every_s=0)
    assert a.wanted(SHARDS) == set(SHARDS)  # alone
    b = Ownership(leases, "enqueue-put", "pod-b", 10_000, members=leases, beat_every_s=0)
    wanted_b = b.wanted(SHARDS)
    wanted_a = a.wanted(SHARDS)
    assert wanted_a and wanted_b and not wanted_a & wanted_b and wanted_a | wanted_b == set(SHARDS)
    clock.advance(10_001)  # b's beat lapsed (it stopped without leaving): a wants everything again
    assert a.wanted(SHARDS) == set(SHARDS)
    b.wanted(SHARDS)  # b is back
    b.leave()
    assert a.wanted(SHARDS) == set(SHARDS)


def test_without_a_member_store_a_replica_wants_every_shard() -> None:
    own = Ownership(MemoryLeaseStore(SimulatedClock(START)), "dequeue-get", "solo", 10_000)
    assert own.wanted(range(4)) == set(range(4))
