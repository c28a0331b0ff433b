"""What a reader of a shard may trust: the newest published ``enqueue.ckpt`` (``W`` and the
flushed TimerLog position) once the reader's view shows every record below that position.

dequeue-get reads slots through it (which slots ``W`` lets it read, and up to where), dequeue-put
gates its releases on it (a record due at ``t`` leaves once ``W > t``, after a look for cancel
markers below the flushed position). Both hold a read-only ``Shard`` view of the shared data
directory; only enqueue-put writes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from timerwheel.errors import TimerLogDamagedError
from timerwheel.log import StageLogger
from timerwheel.stages.base import StageContext
from timerwheel.store import CorruptCheckpointError, EnqueueCheckpoint, Shard

#: How often enqueue.ckpt is re-read when no in-process notice says it changed.
CKPT_POLL_S = 0.01
#: How long enqueue.ckpt may read as unreadable before that is an error: on a volume shared by two
#: nodes (NFS, FUSE) a reader may see a file just replaced with the old one's size for a moment.
TORN_READ_PATIENCE_S = 5.0


@dataclass
class PublishedView:
    """A read-only shard view and the newest checkpoint it is complete for (``newest``)."""

    shard_id: int
    shard: Shard
    #: enqueue.ckpt as last read, the in-process publication count then, and when (time.monotonic()).
    ckpt: EnqueueCheckpoint | None = None
    version: int = -1
    read_at: float = 0.0
    #: The shard view shows every record below ``ckpt``'s flushed position (Shard.refresh).
    visible: bool = False
    #: Since when enqueue.ckpt reads as unreadable (time.monotonic()), or 0.
    torn_since: float = 0.0
    #: The last damaged link reported (``damaged``): each is logged once, not at every look.
    said_damage: str = ""

    def damaged(self, ctx: StageContext, logger: StageLogger, exc: TimerLogDamagedError) -> None:
        """A read of one of the shard's slots met a record the checkpoint calls flushed cut off or
        invalid (``Shard._link_failed``): counted, and logged once; the caller's records wait."""
        ctx.metrics.inc("damaged_views", shard=self.shard_id)
        if str(exc) != self.said_damage:
            self.said_damage = str(exc)
            logger.warning("TimerLog records lost after their checkpoint; the slot's records wait for the writer's "
                           "recovery", shard=self.shard_id, reason=str(exc))

    def newest(self, ctx: StageContext) -> EnqueueCheckpoint | None:
        """The published checkpoint once the view shows every record below its flushed position,
        else None (another node's bytes not visible here yet: nothing may be taken for absent).

        Re-read when this process's enqueue-put says it published (``ctx.published_w``), else at
        most every CKPT_POLL_S (an enqueue-put in another process): reading the file each step
        costs more than the rest of an idle step."""
        version = ctx.published_w.get(self.shard_id, 0)
        now = time.monotonic()
        if self.ckpt is None or version != self.version or now - self.read_at >= CKPT_POLL_S:
            try:
                ckpt = self.shard.load_enqueue_checkpoint()
            except CorruptCheckpointError:
                # Another node's rename seen half (new name, old size): what we had still holds,
                # and the file is read again next time; for long, it is an error (the step's).
                self.torn_since = self.torn_since or now
                if now - self.torn_since >= TORN_READ_PATIENCE_S:
                    raise
                ctx.metrics.inc("stale_views", shard=self.shard_id)
                self.read_at = now
                return self.ckpt if self.visible else None
            self.torn_since = 0.0
            if ckpt is None:
                return None
            self.version, self.read_at = version, now
            if ckpt != self.ckpt or not self.visible:
                self.ckpt = ckpt
                self.visible = self.shard.refresh(ckpt)
                if not self.visible:
                    ctx.metrics.inc("stale_views", shard=self.shard_id)
        return self.ckpt if self.visible else None
