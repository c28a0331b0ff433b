"""Shard ownership for the shard-owning stages (enqueue-put, dequeue-get).

A shard is written by one owner at a time. Owners take shards through leases whose epoch
only grows; the epoch goes into the shard's checkpoints, and ``check`` runs before every
write batch, so an owner that was paused past its lease (and replaced) fails with
``FencedError`` instead of writing. Leases run on real time, never on a simulated clock.
"""

from __future__ import annotations

import time

from timerwheel.errors import FencedError
from timerwheel.transports.base import LeaseStore

DEFAULT_TTL_MS = 10_000


class Ownership:
    def __init__(self, leases: LeaseStore, role: str, owner: str, ttl_ms: int = DEFAULT_TTL_MS) -> None:
        self.leases = leases
        self.role = role
        self.owner = owner
        self.ttl_ms = ttl_ms
        self.epochs: dict[int, int] = {}
        self._renewed = time.monotonic()

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

    def release_all_of(self, shard: int) -> None:
        epoch = self.epochs.pop(shard, None)
        if epoch is not None:
            self.leases.release(self.role, shard, self.owner, epoch)

    def release_all(self) -> None:
        for shard, epoch in list(self.epochs.items()):
            self.leases.release(self.role, shard, self.owner, epoch)
        self.epochs.clear()
