"""dequeue-put: records due now -> their destination, or back to the timer topic (roll).

Stateless. For each deliver entry: a DELIVER item is produced to its destination topic
with the user's key, value and headers, the control headers removed and ``tw-id``,
``tw-roll``, ``tw-enqueued-at``, ``tw-delivered-at`` stamped; a ROLL item goes back to the
timer topic's same partition (so it stays in its shard, where its cancel marker will go)
with an absolute ``tw-deliver-at`` and ``tw-roll`` + 1; a CANCELLED item is dropped and
counted; a MISSING one is dead-lettered. The append is retried until it succeeds — a due
message is never dropped — and only then are the entries acked and the slots' progress
reported to dequeue-get.

A destination topic that does not exist never holds back the others: the commit log does not
send its records (one bounded metadata wait per batch) and they are *held*: rolled back to the
timer topic like a roll hop, due again after a back-off that grows from 1 s to 1 min, with
``tw-held-since`` set when first held. Once held for ``TW_MISSING_TOPIC_HOLD_MS`` a record is
dead-lettered with the reason instead. A held record's slot counts as done (the record is
durable again in the timer topic), so ``R`` moves on.

Never early, whatever the clocks: ``W`` comes from enqueue-put's clock, and pods' clocks differ.
dequeue-put compares each record's delivery time with its own clock; a batch holding a record
not yet due waits until it is (at most ``EARLY_WAIT_MAX_S`` of real time; the delivery times are
stamped after the wait), and records still not due then go back to the timer topic with their
own time, like a roll. The allow-list holds at delivery too: a destination that
``TW_ALLOW_TOPICS`` no longer allows (tightened since the message was scheduled, or a forged
work-queue entry) is dead-lettered with the reason instead of delivered.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from timerwheel import telemetry
from timerwheel.log import stage_logger
from timerwheel.records import OutRecord, Record
from timerwheel.stages.base import (
    QueueStage,
    StageContext,
    Stopped,
    append_until_written,
    decoded,
    put_blocking,
)
from timerwheel.stages.codec import CANCELLED, DELIVER, MISSING, ROLL, DeliverEntry, DoneEntry, wire
from timerwheel.transports.base import CommitLog, WorkQueue
from timerwheel.wire import (
    H_DELIVERED_AT,
    H_ERROR,
    H_HELD_SINCE,
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
#: A held record (missing destination) is due again after half the time it has been held, within these.
HOLD_RETRY_MIN_MS = 1_000
HOLD_RETRY_MAX_MS = 60_000
#: A batch with a record not yet due by this process's clock waits this long for it at most.
EARLY_WAIT_MAX_S = 5.0


class DequeuePut(QueueStage):
    stage = STAGE

    def __init__(self, ctx: StageContext, commit_log: CommitLog, deliver_queue: WorkQueue, done_queue: WorkQueue,
                 partitions: Sequence[int]) -> None:
        super().__init__(ctx, deliver_queue, partitions)
        self.commit_log = commit_log
        self.deliver_q = deliver_queue
        self.done_q = done_queue
        self.logger = stage_logger(STAGE)
        self._partition_counts: dict[str, int] = {}

    def _partitions_of(self, topic: str) -> int | None:
        """The destination's partition count; None while it does not exist (never created here)."""
        n = self._partition_counts.get(topic)
        if n is None:
            n = self.commit_log.partition_count(topic)
            if n is not None:
                self._partition_counts[topic] = n
        return n

    def _not_early(self, out: list[OutRecord], sent_out: list[int], dues: list[int],
                   origins: dict[int, tuple[Record, dict[str, bytes], int, int]], delivered: dict[str, int],
                   rolled: dict[str, int], not_sent: set[int], now: int) -> int:
        """Some deliveries of this batch are not due by this process's clock: wait until they
        are, then stamp ``tw-delivered-at`` again; those still not due after EARLY_WAIT_MAX_S go
        back to the timer topic with their own time. Returns the delivery time now."""
        ctx = self.ctx
        latest = max(dues)
        early = sum(1 for t in dues if t > now)
        ctx.metrics.inc("early_records", early)
        self.logger.warning("records not due by this process's clock, waiting", records=early,
                            ahead_ms=latest - now)
        deadline = time.monotonic() + EARLY_WAIT_MAX_S
        while ctx.clock.now_ms() < latest and time.monotonic() < deadline:
            if ctx.stop.wait(min(0.05, max(0.001, (latest - ctx.clock.now_ms()) / 1000))):
                raise Stopped()
        now = ctx.clock.now_ms()
        stamp = (H_DELIVERED_AT, str(now).encode())
        cfg = ctx.config
        for k, i in enumerate(sent_out):
            rec, hdr, enqueued, _k = origins[i]
            if dues[k] > now:  # still not due: back to the timer topic, due at its own time
                not_sent.add(k)
                topic = out[i].topic
                delivered[topic] -= 1
                rolled[topic] = rolled.get(topic, 0) + 1
                raw_roll = hdr.get(H_ROLL)
                out[i] = OutRecord(cfg.timer_topic, rec.key, rec.value,
                                   rolled_headers(rec, message_id_of(rec, hdr), dues[k],
                                                  int(raw_roll) if raw_roll else 0, enqueued),
                                   partition=rec.partition)
            else:
                r = out[i]
                out[i] = r._replace(headers=tuple(stamp if h[0] == H_DELIVERED_AT else h for h in r.headers))
        return now

    def handle_batches(self, batches: dict[int, list[tuple[str, bytes]]]) -> None:
        """Every partition's entries in one produce-and-wait."""
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
        #: index in ``out`` of each delivery -> (record, its headers, enqueue time, index in sent_records)
        origins: dict[int, tuple[Record, dict[str, bytes], int, int]] = {}
        held: dict[str, int] = {}
        not_sent: set[int] = set()  # indexes in sent_records of the held ones: no lateness
        sent_out: list[int] = []  # index in ``out`` of each of sent_records

        def hold(i: int, topic: str) -> OutRecord:
            """The record to write instead of delivery ``i``, whose destination does not exist."""
            rec, hdr, enqueued, k = origins[i]
            not_sent.add(k)
            delivered[topic] -= 1
            since = int(hdr.get(H_HELD_SINCE) or now)
            waited = now - since
            if waited >= cfg.missing_topic_hold_ms:
                dead[topic] = dead.get(topic, 0) + 1
                reason = f"destination topic {topic!r} does not exist (held {waited} ms, TW_MISSING_TOPIC_HOLD_MS)"
                return OutRecord(cfg.dlq_topic, rec.key, rec.value, dead_letter_headers(rec, reason))
            held[topic] = held.get(topic, 0) + 1
            again = now + min(HOLD_RETRY_MAX_MS, max(HOLD_RETRY_MIN_MS, waited // 2))
            raw_roll = hdr.get(H_ROLL)
            headers = rolled_headers(rec, message_id_of(rec, hdr), again, int(raw_roll) if raw_roll else 0, enqueued,
                                     held_since_ms=since)
            return OutRecord(cfg.timer_topic, rec.key, rec.value, headers, partition=rec.partition)

        deliver_entries = [e for p, part in batches.items()
                           for e in decoded(ctx, self.deliver_q, p, part, DeliverEntry.decode, self.logger)]
        for entry in deliver_entries:
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
                    refused = rules.destination_error(topic) if raw_topic not in topics else ""
                    if refused:  # the allow-list holds at delivery too
                        reason = f"{refused} (checked at delivery)"
                        out.append(OutRecord(cfg.dlq_topic, rec.key, rec.value, dead_letter_headers(rec, reason)))
                        dead[topic] = dead.get(topic, 0) + 1
                        continue
                    raw_part = hdr.get(H_PARTITION)
                    dest_partition = int(raw_part) if raw_part else None
                    # A topic that does not exist yet is checked when it does (the append holds it).
                    if dest_partition is not None and dest_partition >= (self._partitions_of(topic) or dest_partition + 1):
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
                    origins[len(out)] = (rec, hdr, enqueued, len(sent_records))
                    sent_out.append(len(out))
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
        dues = rules.valid_delivery_times(sent_records, sent_headers) if sent_records else []
        if dues and max(dues) > now:
            now = self._not_early(out, sent_out, dues, origins, delivered, rolled, not_sent, now)
        append_until_written(ctx, self.commit_log, out, self.logger, on_missing=hold)
        ctx.processed(sum(len(r.value) for r in out if r.value))
        if held:
            self.logger.warning("destination topics missing, records held", topics=held)
        if not_sent:
            dues = [t for k, t in enumerate(dues) if k not in not_sent]
        # Report before ack: a crash in between redelivers the entries (a bounded duplicate)
        # instead of stalling the slot until dequeue-get re-sends it.
        for (shard, generation), counts in done.items():
            put_blocking(ctx, self.done_q, shard, [wire(self.done_q, DoneEntry(shard, generation, counts))],
                         self.logger.bind(shard=shard))
        for partition, part in batches.items():
            self.deliver_q.ack(partition, [eid for eid, _ in part])
        m = ctx.metrics
        if held:
            m.inc_many("held", "topic", held)
        delivered = {t: n for t, n in delivered.items() if n}
        if delivered:
            m.inc_many("delivered", "topic", delivered)
            m.observe_many("delivery_lateness_ms", [now - t for t in dues])
        if rolled:
            m.inc_many("rolled", "topic", rolled)
        if cancelled:
            m.inc_many("cancelled", "topic", cancelled)
        if dead:
            m.inc_many("dead_lettered", "topic", dead)
        if span is not None:
            telemetry.dequeue_put_batch(span, cfg, ctx.rules, deliver_entries, out, now,
                                        {"DELIVER": DELIVER, "ROLL": ROLL, "CANCELLED": CANCELLED})
