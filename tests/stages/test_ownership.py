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
    assert sorted(counts.values()) == [20, 22, 22], counts  # an even share each (bounded loads)


def test_two_members_of_two_shards_get_one_each_whatever_their_names() -> None:
    for k in range(50):
        got = assignment([f"pod-{k}-a", f"pod-{k}-b"], "enqueue-put", range(2))
        assert sorted(got.values()) == [f"pod-{k}-a", f"pod-{k}-b"], got


def test_a_joining_member_takes_about_its_share_and_a_leaving_one_restores_the_assignment() -> None:
    two = assignment(["pod-a", "pod-b"], "dequeue-get", SHARDS)
    three = assignment(["pod-a", "pod-b", "pod-c"], "dequeue-get", SHARDS)
    moved = {s for s in SHARDS if two[s] != three[s]}
    to_c = {s for s in moved if three[s] == "pod-c"}
    assert len(to_c) == 22 and len(moved) <= 32, (len(to_c), len(moved))  # about its share, not a reshuffle
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
