"""dequeue-put's exactly-once release (``TW_DELIVERY_GUARANTEE=exactly-once``, issue 31, design 7.1).

What one round releases with output (a delivery, a roll hop, a hold for a missing topic, a dead
letter) goes out shard by shard: each shard's records and one progress record naming them (slot
time and source position in the timer topic, ``timerwheel.progress``) in one Kafka transaction
under the shard's transactional id ``<prefix>-deliver-<shard>`` (``ShardDeliveries``). Before a
shard's first commit, and again after any failed one, the shard is **taken**: ``init_transactions``
fences every other producer of that id (a paused or replaced replica: its next commit fails) and
ends the transaction it left open, then the shard's progress partition is read back,
``read_committed``, from ``R`` (its dequeue.ckpt) on. Each record of the round that a committed
progress record names already is finished without output (``duplicates_dropped``): a crash after
the commit and before the work-queue acknowledgement, a commit whose answer was lost, a zombie
replica that committed before it was fenced, or dequeue-get reading the slots from ``R`` again
after a crash. A failed commit is retried, after a take, until it succeeds: late, never lost, and
never twice.

The records' identity is their source: (slot time, timer partition, offset). A roll hop and a
record held for a missing topic are new source records of their own; a TimerLog recovery that
rewrote a record at a new position keeps its source.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from timerwheel.log import StageLogger
from timerwheel.progress import Finished, Progress, source_position
from timerwheel.records import OutRecord
from timerwheel.stages.base import RetryWait, StageContext, refused_record

__all__ = ["Deliveries", "ExactlyOnce", "Source"]

#: A released record's identity: (shard, slot time, source position).
Source = tuple[int, int, int]


class Deliveries(Protocol):
    """One shard's transactional releases (``transports.kafka.transactions.ShardDeliveries``)."""

    ready: bool

    def take(self, read_ms: int) -> Finished: ...

    def commit(self, records: Sequence[OutRecord], progress: Progress, now_ms: int) -> list[tuple[int, int]]: ...

    def close(self) -> None: ...


def source_of_item(shard: int, slot: int, src_partition: int, src_offset: int) -> Source:
    return shard, slot, source_position(src_partition, src_offset)


class ExactlyOnce:
    """The shards' transactional releases of one dequeue-put (module docstring).

    ``open_deliveries(shard)`` makes a shard's ``Deliveries``; ``read_ms(shard)`` is the shard's
    ``R`` as its dequeue.ckpt says now (0 while there is none)."""

    def __init__(self, ctx: StageContext, logger: StageLogger, open_deliveries: Callable[[int], Deliveries],
                 read_ms: Callable[[int], int]) -> None:
        self.ctx = ctx
        self.logger = logger
        self._open = open_deliveries
        self._read_ms = read_ms
        self._deliveries: dict[int, Deliveries] = {}
        self._finished: dict[int, Finished] = {}

    def _taken(self, shard: int, floor: int) -> tuple[Deliveries, Finished]:
        """The shard's deliveries, taken, and a finished set that covers the slots from ``floor``
        (the oldest slot of the batch to commit) on. The set is read back from ``R`` usually;
        from ``floor`` when a record of an older slot is in the batch: a replica paused in the
        middle of a commit whose records another replica has since delivered, and whose slot
        ``R`` has since passed (seen in the zombie test: read back from ``R`` only, it delivered
        such a record a second time)."""
        deliveries = self._deliveries.get(shard)
        if deliveries is None:
            deliveries = self._deliveries[shard] = self._open(shard)
        finished = self._finished.get(shard)
        if not deliveries.ready or finished is None or finished.since > floor:
            read_ms = min(self._read_ms(shard), floor)
            finished = self._finished[shard] = deliveries.take(read_ms)
            self.ctx.metrics.inc("delivery_takes", shard=shard)
            self.logger.info("shard deliveries taken (fenced older producers, progress read back)", shard=shard,
                             read_ms=read_ms, finished=len(finished))
        else:
            finished.forget_before(min(self._read_ms(shard), floor))
        return deliveries, finished

    def commit(self, shard: int, out: list[OutRecord], sources: dict[int, Source], now_ms: int, *,
               epoch: int = 0, owned: Callable[[], bool] = lambda: True) -> set[int] | None:
        """Write ``out[i]`` for each ``i`` of ``sources`` (all of ``shard``) with their progress
        record in one transaction, retried (after a take) until it succeeds. Returns the indexes
        finished without output: a committed transaction released them already (or one of this
        batch carries the same source). A record Kafka refuses for good is replaced in ``out`` by
        its dead letter (``refused_record``). ``epoch``: the releasing replica's lease epoch (the
        progress records carry it); ``owned()`` false (the shard let go between attempts): None,
        nothing more is tried."""
        retry = RetryWait(self.ctx, self.logger.bind(shard=shard), "delivery transaction failed, retrying",
                          "delivery_transaction_retries", shard=shard)
        keep: list[int] = []
        while True:
            if not owned():
                return None
            try:
                deliveries, finished = self._taken(shard, min(slot for _s, slot, _p in sources.values()))
                keep = []
                dropped: set[int] = set()
                seen: set[tuple[int, int]] = set()
                for i, (_shard, slot, pos) in sorted(sources.items()):
                    if (slot, pos) in seen or finished.holds_position(slot, pos):
                        dropped.add(i)
                    else:
                        seen.add((slot, pos))
                        keep.append(i)
                if keep:
                    by_slot: dict[int, list[int]] = {}
                    for i in keep:
                        _s, slot, pos = sources[i]
                        by_slot.setdefault(slot, []).append(pos)
                    progress = Progress(shard, epoch, by_slot)
                    deliveries.commit([out[i] for i in keep], progress, now_ms)
                    finished.add(progress)
                if dropped:
                    self.ctx.metrics.inc("duplicates_dropped", len(dropped), shard=shard)
                return dropped
            except Exception as exc:  # noqa: BLE001 - any failure is retried after a take, never dropped
                refused = getattr(exc, "refused", None) or {}
                for k, reason in refused.items():
                    i = keep[k]
                    out[i] = refused_record(out[i], reason, self.ctx.config.dlq_topic)
                    self.ctx.metrics.inc("refused_records")
                    self.logger.error("record refused by the log, dead-lettered", shard=shard, reason=reason)
                retry.after(exc, shard=shard, records=len(sources))

    def drop(self, shard: int) -> None:
        """Let go of ``shard``: its producer closed, its finished set forgotten (a later owner of
        it here takes it again)."""
        deliveries = self._deliveries.pop(shard, None)
        if deliveries is not None:
            deliveries.close()
        self._finished.pop(shard, None)

    def close(self) -> None:
        for deliveries in self._deliveries.values():
            deliveries.close()
        self._deliveries.clear()
        self._finished.clear()
