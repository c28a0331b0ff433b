"""Shard ownership for the shard-owning stages (enqueue-put, dequeue-get).

A shard is written by one owner at a time. Owners take shards through leases whose epoch
only grows; the epoch goes into the shard's checkpoints, and ``check`` runs before every
write batch, so an owner that was paused past its lease (and replaced) fails with
``FencedError`` instead of writing. Leases run on real time, never on a simulated clock.

Balancing among replicas (``members`` given, production): each replica says it is alive in a
member set (``MemberStore.beat``, every ``BEAT_EVERY_S``, lapsing after the lease TTL) and
reads the live members back. Each shard belongs to the member that ranks first for it by
rendezvous (highest-random-weight) hashing with bounded loads: ``weight(member, role, shard)``,
a hash every replica computes alike, ranks the members per shard, and each shard goes to the
highest-ranked member not yet holding its even share (``assignment``). All replicas agree
without talking to each other, every member gets an even share, and a member joining or
leaving moves about its share of the shards, not a reshuffle.

``wanted`` is the set of shards this replica ranks first for. A stage releases an owned shard
that is no longer wanted (after finishing what it has in hand) and only tries to acquire wanted
ones; the lease decides the rest: a shard is taken only once its old owner released it or its
lease lapsed, and the epoch fences every write, so two owners never write one shard even
while the members disagree (one saw a join the other has not seen yet).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Sequence

from timerwheel.errors import FencedError
from timerwheel.transports.base import LeaseStore, MemberStore

DEFAULT_TTL_MS = 10_000
#: How often a replica renews its membership and re-reads the others'.
BEAT_EVERY_S = 1.0


def weight(member: str, role: str, shard: int) -> int:
    """Rendezvous weight of ``member`` for ``shard`` of ``role``: the same in every process."""
    digest = hashlib.blake2b(f"{role}\x00{shard}\x00{member}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_owner(members: Iterable[str], role: str, shard: int) -> str | None:
    """The member ranked first for ``shard`` (ties, which need a hash collision, by name)."""
    return max(members, key=lambda m: (weight(m, role, shard), m), default=None)


def assignment(members: Sequence[str], role: str, shards: Iterable[int]) -> dict[int, str]:
    """Shard -> the member that should own it: rendezvous with bounded loads. Shards are placed
    in order, each with the highest-ranked member that holds fewer than ceil(shards / members);
    plain rendezvous can give two members' two shards to one of them (a chance in four)."""
    live = sorted(set(members))
    todo = sorted(set(shards))
    if not live:
        return {}
    cap = -(-len(todo) // len(live))
    load = dict.fromkeys(live, 0)
    out: dict[int, str] = {}
    for shard in todo:
        for member in sorted(live, key=lambda m: (weight(m, role, shard), m), reverse=True):
            if load[member] < cap:
                out[shard] = member
                load[member] += 1
                break
    return out


class Ownership:
    def __init__(self, leases: LeaseStore, role: str, owner: str, ttl_ms: int = DEFAULT_TTL_MS,
                 members: MemberStore | None = None, beat_every_s: float = BEAT_EVERY_S) -> None:
        self.leases = leases
        self.role = role
        self.owner = owner
        self.ttl_ms = ttl_ms
        self.members = members
        self.beat_every_s = beat_every_s
        self.epochs: dict[int, int] = {}
        self._renewed = time.monotonic()
        self._beat = -float("inf")
        self._live: tuple[str, ...] = (owner,)

    def acquire(self, shard: int, floor: int = 0) -> int | None:
        epoch = self.leases.acquire(self.role, shard, self.owner, self.ttl_ms, floor=floor)
        if epoch is not None:
            self.epochs[shard] = epoch
        return epoch

    def check(self, shard: int) -> None:
        """Raise FencedError unless we still hold the newest epoch of ``shard``."""
        mine = self.epochs.get(shard)
        current = self.leases.current_epoch(self.role, shard)
        if mine is None or current != mine:
            self.epochs.pop(shard, None)
            raise FencedError(f"{self.role} shard {shard}: epoch {mine} fenced by epoch {current}")

    def renew_due(self) -> list[int]:
        """Renew every lease if a third of the TTL passed; return the shards whose lease was lost."""
        now = time.monotonic()
        if (now - self._renewed) * 1000 < self.ttl_ms / 3:
            return []
        self._renewed = now
        lost = []
        for shard, epoch in list(self.epochs.items()):
            if not self.leases.renew(self.role, shard, self.owner, epoch, self.ttl_ms):
                self.epochs.pop(shard, None)
                lost.append(shard)
        return lost

    def live_members(self) -> tuple[str, ...]:
        """The live members of this role (this one always among them), renewing ours when due."""
        if self.members is None:
            return (self.owner,)
        now = time.monotonic()
        if now - self._beat >= self.beat_every_s:
            self._beat = now
            live = set(self.members.beat(self.role, self.owner, self.ttl_ms))
            live.add(self.owner)
            self._live = tuple(sorted(live))
        return self._live

    def wanted(self, shards: Iterable[int]) -> set[int]:
        """The shards of ``shards`` this replica should own: all of them without a member store."""
        return {s for s, m in assignment(self.live_members(), self.role, shards).items() if m == self.owner}

    def release_all_of(self, shard: int) -> None:
        epoch = self.epochs.pop(shard, None)
        if epoch is not None:
            self.leases.release(self.role, shard, self.owner, epoch)

    def release_all(self) -> None:
        for shard, epoch in list(self.epochs.items()):
            self.leases.release(self.role, shard, self.owner, epoch)
        self.epochs.clear()

    def leave(self) -> None:
        """Release every lease, then leave the member set: the others take our shards at once."""
        self.release_all()
        if self.members is not None:
            self.members.leave(self.role, self.owner)
