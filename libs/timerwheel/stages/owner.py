"""ShardOwner: the ownership lifecycle of a shard-owning stage (enqueue-put, dequeue-get, and
dequeue-put in exactly-once mode).

A shard-owning stage works on the shards it holds a lease for (``Ownership``: the lease's epoch
fences an owner that was replaced). The lifecycle is the same for every such stage; what it
does to a shard is its own:

* **take** (``take_shards``): each shard the stage wants (``Ownership.wanted``: the replica
  ranked first for it) and does not own yet is handed to the stage's ``start(shard_id)``, which
  acquires the lease and opens the shard in the order its work needs (a writer opens only once
  the lease is its own; a reader needs the checkpoint's epoch before it asks for the lease), and
  returns the shard's state, or None to try again next step. A shard that cannot be opened, or
  whose state needs ``timerwheel recover``, is reported through ``unopenable``.
* **renew** (``renew``): the leases, every third of their TTL; a shard whose lease was lost is
  dropped (``lose``).
* **balance** (``balance``): follows the member set and returns the owned shards another live
  replica now ranks first for; the stage hands each over when it is ready (enqueue-put at once,
  dequeue-get once what it sent came back) with ``hand_over``, which releases the lease so that
  the next owner takes the shard at once. A lease kept for a shard not started yet (its old owner
  still holds it open) is let go as soon as another replica ranks first for it.
* **lose** (``lose``): a write or a renewal found the lease gone (``FencedError``): the shard is
  dropped at once and nothing more is written for it; it is taken again once wanted and free.

Each owned shard is an ``OwnedShard`` (id, ``Shard``, logger, epoch) that the stage extends with
what it tracks. dequeue-put in exactly-once mode is the third owning stage: its ``start`` takes
the lease, its ``stop`` drops what it holds of the shard and closes the shard's transactional
producer, and its queue partitions are the keys of ``owned``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from timerwheel.log import StageLogger, stage_logger
from timerwheel.stages.base import StageContext, Unopenable
from timerwheel.stages.ownership import Ownership
from timerwheel.store import Shard
from timerwheel.transports.base import WorkQueue


@dataclass
class OwnedShard:
    """What every owning stage knows of a shard it owns."""

    shard_id: int
    shard: Shard
    logger: StageLogger
    #: The lease's epoch when the shard was taken: its checkpoints carry it.
    epoch: int
    #: The entries a previous owner took from the shard's queue partition are still to be claimed.
    reclaim: bool = field(default=True, kw_only=True)

    def take_over_pending(self, queue: WorkQueue, ctx: StageContext) -> list[tuple[str, bytes]]:
        """Once, at the shard's first step with us: the entries of its partition of ``queue`` that
        a previous owner took and never acknowledged, claimed now (idle 0; also those this owner
        took already). Only the shard's owner reads its partition, so entries left pending by an
        owner that died stay pending for good otherwise, counting against the queue's bound (e2e fix)."""
        if not self.reclaim:
            return []
        self.reclaim = False
        return queue.claim_stale(self.shard_id, ctx.consumer, 0, 4 * ctx.config.queue_bound)


S = TypeVar("S", bound=OwnedShard)


class ShardOwner(Generic[S]):
    """The shards a stage owns, and their lease lifecycle (module docstring).

    ``start(shard_id)``: acquire the lease and open the shard, or None (not now); ``stop(state)``:
    close what the stage holds open for a shard it no longer owns; ``activity``: what the stage
    does to a shard ("writing", "reading"), for the log line of a lost shard."""

    def __init__(self, ctx: StageContext, stage: str, shard_ids: Iterable[int], ownership: Ownership,
                 start: Callable[[int], S | None], stop: Callable[[S], None], activity: str) -> None:
        self.ctx = ctx
        self.stage = stage
        self.ownership = ownership
        self.shard_ids = frozenset(shard_ids)
        self.owned: dict[int, S] = {}
        #: Shards of ``shard_ids`` not owned: those also ``wanted`` are tried at each ``take_shards``.
        self.waiting = set(self.shard_ids)
        self.wanted = ownership.wanted(self.shard_ids)
        self.unopenable = Unopenable(ctx, stage, stage_logger(stage))
        self._start = start
        self._stop = stop
        self._activity = activity

    @property
    def refused(self) -> dict[int, str]:
        """Shards left unstarted because their state needs ``timerwheel recover``: shard -> why."""
        return self.unopenable.refused

    def take_shards(self) -> None:
        """Start the wanted shards not owned yet (``start``); ``owned_shards`` says how many we own."""
        for shard_id in sorted(self.waiting & self.wanted):
            state = self._start(shard_id)
            if state is not None:
                self.waiting.discard(shard_id)
                self.owned[shard_id] = state
        self.ctx.metrics.set("owned_shards", len(self.owned), stage=self.stage)

    def renew(self) -> None:
        """Renew the leases when due; drop the shards whose lease was lost."""
        for shard_id in self.ownership.renew_due():
            self.lose(shard_id, "lease lost")

    def balance(self) -> list[S]:
        """The owned shards another live replica ranks first for (to hand over); leases kept for
        shards we have not started and no longer want are released here."""
        self.wanted = self.ownership.wanted(self.shard_ids)
        for shard_id in sorted(set(self.ownership.epochs) - set(self.owned) - self.wanted):
            self.ownership.release_all_of(shard_id)
        return [state for shard_id, state in sorted(self.owned.items()) if shard_id not in self.wanted]

    def hand_over(self, state: S, **progress: Any) -> None:
        """Let go of a shard whose progress is saved: ``stop``, then release the lease, so that its
        next owner takes it at once. ``progress`` goes into the log line."""
        del self.owned[state.shard_id]
        self._stop(state)
        self.ownership.release_all_of(state.shard_id)
        self.waiting.add(state.shard_id)
        self.ctx.metrics.set("owned_shards", len(self.owned), stage=self.stage)
        self.ctx.metrics.inc("handovers", shard=state.shard_id, stage=self.stage)
        state.logger.info("shard handed over", epoch=state.epoch, **progress)

    def lose(self, shard_id: int, why: str) -> None:
        """Drop a shard whose lease is gone (fenced, or not renewed in time): nothing more is done to it."""
        state = self.owned.pop(shard_id, None)
        if state is None:
            return
        state.logger.warning(f"shard ownership lost, stopped {self._activity}", reason=why)
        self.ctx.metrics.inc("fenced", shard=shard_id, stage=self.stage)
        self._stop(state)
        self.waiting.add(shard_id)
        self.ctx.metrics.set("owned_shards", len(self.owned), stage=self.stage)

    def leave(self) -> None:
        """Release every lease and leave the member set: the other replicas take our shards at once."""
        self.ownership.leave()
