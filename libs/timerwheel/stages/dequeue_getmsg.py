"""dequeue-getmsg: fetch requests -> the original records, read in batches.

Stateless. Takes fetch entries from its queue partitions, reads every source record they
name (and the cancel markers they reference) from the timer topic in one batched call
grouped per partition, and passes each on to dequeue-put as DELIVER, ROLL, CANCELLED (the
full id of the message equals the marker's ``tw-cancel``) or MISSING (the source record is
gone from the log: reported and dead-lettered, never retried forever — PITFALLS #7480).
"""

from __future__ import annotations

from collections.abc import Sequence

from timerwheel import telemetry
from timerwheel.log import stage_logger
from timerwheel.records import Record
from timerwheel.stages.base import QueueStage, StageContext, put_blocking
from timerwheel.stages.codec import (
    CANCELLED,
    DELIVER,
    MISSING,
    ROLL,
    DeliverEntry,
    DeliverItem,
    FetchEntry,
    wire,
)
from timerwheel.store import Flag
from timerwheel.transports.base import CommitLog, WorkQueue
from timerwheel.wire import H_CANCEL, message_id_of

STAGE = "dequeue-getmsg"
_ROLL = int(Flag.ROLL)


class DequeueGetMsg(QueueStage):
    stage = STAGE

    def __init__(self, ctx: StageContext, commit_log: CommitLog, fetch_queue: WorkQueue, deliver_queue: WorkQueue,
                 partitions: Sequence[int]) -> None:
        super().__init__(ctx, fetch_queue, partitions)
        self.log = commit_log
        self.fetch_q = fetch_queue
        self.deliver_q = deliver_queue
        self.logger = stage_logger(STAGE)
        # Kafka: read the timer topic ahead, so that short delays find their records in memory.
        follow = getattr(commit_log, "follow", None)
        if follow is not None:
            follow(ctx.config.timer_topic)

    def handle_batches(self, batches: dict[int, list[tuple[str, bytes]]]) -> None:
        """Every partition's fetch entries served by one read of the commit log."""
        t0 = telemetry.batch_start()
        fetches = {p: [FetchEntry.decode(payload) for _eid, payload in entries] for p, entries in batches.items()}
        wanted: dict[tuple[int, int], Record | None] = {}
        for part in fetches.values():
            for f in part:
                for item in f.items:
                    wanted[(item.src_partition, item.src_offset)] = None
                    if item.cancel_partition >= 0:
                        wanted[(item.cancel_partition, item.cancel_offset)] = None
        keys = sorted(wanted)
        for key, rec in zip(keys, self.log.read(self.ctx.config.timer_topic, keys), strict=True):
            wanted[key] = rec
        for partition, part in fetches.items():
            self._pass_on(partition, part, wanted)
            self.fetch_q.ack(partition, [eid for eid, _ in batches[partition]])
        if t0 is not None:
            telemetry.dequeue_getmsg_batch(t0, self.ctx.config, [f for part in fetches.values() for f in part], wanted)

    def _pass_on(self, partition: int, fetches: list[FetchEntry], wanted: dict[tuple[int, int], Record | None]) -> None:
        out: list[bytes] = []
        missing = 0
        new_tuple = tuple.__new__  # DeliverItem(...) goes through a Python-level __new__: twice the cost
        for f in fetches:
            items = []
            for item in f.items:
                rec = wanted[(item.src_partition, item.src_offset)]
                if rec is None:
                    kind = MISSING
                    missing += 1
                elif item.flags & _ROLL:
                    kind = ROLL
                elif item.cancel_partition >= 0 and self._confirmed(rec, wanted[(item.cancel_partition, item.cancel_offset)]):
                    kind = CANCELLED
                else:
                    if item.cancel_partition >= 0:
                        self.ctx.metrics.inc("cancel_missed")  # id-hash collision: not the same message
                    kind = DELIVER
                # The record carries its own trace headers: DeliverItem.traceparent stays unset.
                items.append(new_tuple(DeliverItem, (kind, item.fire_ms, item.enqueued_ms, rec, item.src_partition,
                                                     item.src_offset, None)))
            out.append(wire(self.deliver_q, DeliverEntry(f.shard, f.generation, f.slot_time, tuple(items))))
        if missing:
            self.logger.warning("source records gone from the log", records=missing, partition=partition)
        put_blocking(self.ctx, self.deliver_q, partition, out, self.logger.bind(shard=partition))

    @staticmethod
    def _confirmed(message: Record, marker: Record | None) -> bool:
        if marker is None:
            return False
        target = marker.header(H_CANCEL)
        return target is not None and target.decode("utf-8", "replace") == message_id_of(message)
