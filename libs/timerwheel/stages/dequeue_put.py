"""dequeue-put: records due now -> their destination, or back to the timer topic (roll).

Stateless. For each deliver entry: a DELIVER item is produced to its destination topic
with the user's key, value and headers, the control headers removed and ``tw-id``,
``tw-roll``, ``tw-enqueued-at``, ``tw-delivered-at`` stamped; a ROLL item goes back to the
timer topic's same partition (so it stays in its shard, where its cancel marker will go)
with an absolute ``tw-deliver-at`` and ``tw-roll`` + 1; a CANCELLED item is dropped and
counted; a MISSING one is dead-lettered. The append is retried until it succeeds — a due
message is never dropped — and only then are the entries acked and the slots' progress
reported to dequeue-get.
"""

from __future__ import annotations

from collections.abc import Sequence

from timerwheel import telemetry
from timerwheel.log import stage_logger
from timerwheel.records import OutRecord, Record
from timerwheel.stages.base import QueueStage, StageContext, append_until_written, put_blocking
from timerwheel.stages.codec import CANCELLED, DELIVER, MISSING, ROLL, DeliverEntry, DoneEntry, wire
from timerwheel.transports.base import CommitLog, WorkQueue
from timerwheel.wire import (
    H_ERROR,
    H_PARTITION,
    H_ROLL,
    H_SOURCE,
    H_TOPIC,
    dead_letter_headers,
    delivered_headers,
    message_id_of,
    rolled_headers,
)

STAGE = "dequeue-put"


class DequeuePut(QueueStage):
    stage = STAGE

    def __init__(self, ctx: StageContext, commit_log: CommitLog, deliver_queue: WorkQueue, done_queue: WorkQueue,
                 partitions: Sequence[int]) -> None:
        super().__init__(ctx, deliver_queue, partitions)
        self.log = commit_log
        self.deliver_q = deliver_queue
        self.done_q = done_queue
        self.logger = stage_logger(STAGE)
        self._partition_counts: dict[str, int] = {}

    def _partitions_of(self, topic: str) -> int:
        n = self._partition_counts.get(topic)
        if n is None:
            n = self._partition_counts[topic] = self.log.partitions(topic)
        return n

    def handle_batches(self, batches: dict[int, list[tuple[str, bytes]]]) -> None:
        """Every partition's entries in one produce-and-wait."""
        entries = [e for part in batches.values() for e in part]
        ctx = self.ctx
        cfg = ctx.config
        now = ctx.clock.now_ms()
        span = telemetry.dequeue_put_start()
        trace_headers = telemetry.inject(span) if span is not None else ()
        out: list[OutRecord] = []
        delivered: dict[str, int] = {}
        rolled: dict[str, int] = {}
        cancelled: dict[str, int] = {}
        dead: dict[str, int] = {}
        sent_records: list[Record] = []  # for the lateness, computed per batch
        sent_headers: list[dict[str, bytes]] = []
        now_text = str(now).encode()
        done: dict[tuple[int, int], dict[int, int]] = {}
        rules = ctx.rules
        topics = rules.known_topics
        texts: dict[int, bytes] = {}  # enqueue time -> its text: records produced together share it
        new_tuple = tuple.__new__
        for _eid, payload in entries:
            entry = DeliverEntry.decode(payload)
            counts = done.setdefault((entry.shard, entry.generation), {})
            counts[entry.slot_time] = counts.get(entry.slot_time, 0) + len(entry.items)
            for kind, _fire, enqueued, rec, src_partition, src_offset, _tp in entry.items:
                if rec is None or kind == MISSING:
                    reason = f"source record {cfg.timer_topic}/{src_partition}/{src_offset} is gone from the log"
                    out.append(OutRecord(cfg.dlq_topic, None, None, (
                        (H_ERROR, reason.encode()),
                        (H_SOURCE, f"{cfg.timer_topic}/{src_partition}/{src_offset}".encode()))))
                    dead["-"] = dead.get("-", 0) + 1
                    continue
                hdr = dict(rec.headers)  # one pass; the last of repeated headers wins, as Record.header
                raw_topic = hdr.get(H_TOPIC)
                topic = (topics.get(raw_topic) or raw_topic.decode("utf-8", "replace")) if raw_topic else "-"
                if kind == DELIVER:
                    raw_part = hdr.get(H_PARTITION)
                    dest_partition = int(raw_part) if raw_part else None
                    if dest_partition is not None and dest_partition >= self._partitions_of(topic):
                        reason = f"tw-partition {dest_partition} out of range for {topic!r}"
                        out.append(OutRecord(cfg.dlq_topic, rec.key, rec.value, dead_letter_headers(rec, reason)))
                        dead[topic] = dead.get(topic, 0) + 1
                        continue
                    enqueued_text = texts.get(enqueued)
                    if enqueued_text is None:
                        enqueued_text = texts[enqueued] = str(enqueued).encode()
                    headers = delivered_headers(rec, hdr, enqueued_text, now_text)
                    if trace_headers:
                        headers = telemetry.replace_trace_headers(headers, trace_headers)
                    # OutRecord(...) goes through a Python-level __new__: twice the cost
                    out.append(new_tuple(OutRecord, (topic, rec.key, rec.value, headers, dest_partition, None)))
                    delivered[topic] = delivered.get(topic, 0) + 1
                    sent_records.append(rec)
                    sent_headers.append(hdr)
                elif kind == CANCELLED:
                    cancelled[topic] = cancelled.get(topic, 0) + 1
                else:
                    assert kind == ROLL
                    deliver_ms = rules.delivery_time(rec, now, check_max=False, headers=hdr)
                    raw_roll = hdr.get(H_ROLL)
                    headers = rolled_headers(rec, message_id_of(rec, hdr), deliver_ms, int(raw_roll) if raw_roll else 0,
                                             enqueued)
                    if trace_headers:
                        headers = telemetry.replace_trace_headers(headers, trace_headers)
                    out.append(OutRecord(cfg.timer_topic, rec.key, rec.value, headers, partition=rec.partition))
                    rolled[topic] = rolled.get(topic, 0) + 1
        append_until_written(ctx, self.log, out, self.logger)
        # Report before ack: a crash in between redelivers the entries (a bounded duplicate)
        # instead of stalling the slot until dequeue-get re-sends it.
        for (shard, generation), counts in done.items():
            put_blocking(ctx, self.done_q, shard, [wire(self.done_q, DoneEntry(shard, generation, counts))],
                         self.logger.bind(shard=shard))
        for partition, part in batches.items():
            self.deliver_q.ack(partition, [eid for eid, _ in part])
        m = ctx.metrics
        if delivered:
            m.inc_many("delivered", "topic", delivered)
            m.observe_many("delivery_lateness_ms",
                           [now - t for t in rules.valid_delivery_times(sent_records, sent_headers)])
        if rolled:
            m.inc_many("rolled", "topic", rolled)
        if cancelled:
            m.inc_many("cancelled", "topic", cancelled)
        if dead:
            m.inc_many("dead_lettered", "topic", dead)
        if span is not None:
            telemetry.dequeue_put_batch(span, cfg, ctx.rules, [DeliverEntry.decode(p) for _, p in entries], out, now,
                                        {"DELIVER": DELIVER, "ROLL": ROLL, "CANCELLED": CANCELLED})
