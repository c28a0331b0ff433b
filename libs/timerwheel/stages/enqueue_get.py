"""enqueue-get: timer topic -> validated requests -> the shard's put queue.

Stateless. Reads timer-topic partitions from the offsets the shards' enqueue checkpoints
own (clamped to what the log still holds), validates and normalises each record
(``TimerRules``), dead-letters the invalid ones with ``tw-error``, and sends one
``PutEntry`` per partition and batch to the put queue of shard ``partition % shards``.

Every record's offset reaches enqueue-put, valid or not, so the checkpoint can advance
past dead-lettered records. Entries lost in transit (Redis flushed) show up as a
checkpoint that stays behind our read position while the put queue is empty; we then
rewind to the checkpoint. Rewinding is always safe: enqueue-put skips offsets it has.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from timerwheel import telemetry
from timerwheel.errors import InvalidTimerMessage
from timerwheel.log import stage_logger
from timerwheel.records import OutRecord, Record
from timerwheel.stages.base import StageContext, append_until_written, put_blocking
from timerwheel.stages.codec import PutEntry, PutRow, wire
from timerwheel.transports.base import CommitLog, Consumer, WorkQueue
from timerwheel.wire import H_TOPIC, dead_letter_headers, id_hash, topic_hash

STAGE = "enqueue-get"
REWIND_CHECK_S = 2.0


class EnqueueGet:
    def __init__(
        self,
        ctx: StageContext,
        commit_log: CommitLog,
        put_queue: WorkQueue,
        partitions: Sequence[int],
        checkpoint_offsets: Callable[[int], dict[int, int]],
    ) -> None:
        """``checkpoint_offsets(shard)`` returns the shard's next source offset per partition."""
        self.ctx = ctx
        self.log = commit_log
        self.queue = put_queue
        self.partitions = list(partitions)
        self.checkpoint_offsets = checkpoint_offsets
        self.logger = stage_logger(STAGE)
        #: destination -> its hash in the TimerLog (destinations are few).
        self._topic_hashes: dict[str, int] = {}
        self.consumer: Consumer = commit_log.consumer(ctx.config.timer_topic, self.resume_offsets())
        self._suspects: dict[int, int] = {}
        self._last_check = time.monotonic()

    def shard_of(self, partition: int) -> int:
        return partition % self.ctx.config.shards

    def resume_offsets(self) -> dict[int, int]:
        starts = self.log.start_offsets(self.ctx.config.timer_topic)
        out: dict[int, int] = {}
        for p in self.partitions:
            ckpt = self.checkpoint_offsets(self.shard_of(p)).get(p, 0)
            start = starts.get(p, 0)
            if ckpt < start:
                self.logger.warning("resume offset below log start, clamped", partition=p, offset=ckpt, start=start)
                self.ctx.metrics.inc("source_records_lost", partition=p)
            out[p] = max(ckpt, start)
        self.logger.info("resume", offsets={str(k): v for k, v in out.items()})
        return out

    def step(self, timeout_s: float) -> int:
        """Read one batch and hand it on; returns the number of records read."""
        records = self.consumer.poll(self.ctx.config.batch_size, 0)
        if records:
            self.handle(records)
        else:
            self.ctx.idle_wait(STAGE, timeout_s)
        self._maybe_rewind()
        return len(records)

    def handle(self, records: Sequence[Record]) -> None:
        ctx = self.ctx
        t0 = telemetry.batch_start()
        now = ctx.clock.now_ms()
        parse, common = ctx.rules.parse, ctx.rules.common
        dead: list[OutRecord] = []
        reasons: dict[str, int] = {}
        scheduled: dict[str, int] = {}
        cancels = 0
        #: partition -> [first offset, last offset, rows, traces]
        batches: dict[int, list[Any]] = {}
        topic_hashes = self._topic_hashes
        batch: list[Any]
        rows: list[PutRow]
        partition = -1  # no record has it: the first record sets batch and rows
        for r in records:
            if r.partition != partition:  # a poll returns each partition's records together, in offset order
                partition = r.partition
                batch = batches.get(partition) or batches.setdefault(partition, [r.offset, r.offset, [], []])
                rows = batch[2]
            batch[1] = r.offset
            hdr = dict(r.headers)
            found = common(r, hdr, now)
            if found is not None:  # most records: no TimerRequest
                deliver, topic, message_id, size = found
                row = (r.offset, size, r.timestamp_ms, deliver, False, topic_hashes.get(topic) or self._topic_hash(topic),
                       id_hash(message_id))
                scheduled[topic] = scheduled.get(topic, 0) + 1
            else:
                try:
                    req = parse(r, now, hdr)
                except InvalidTimerMessage as exc:
                    dead.append(OutRecord(ctx.config.dlq_topic, r.key, r.value, dead_letter_headers(r, exc.reason)))
                    raw = hdr.get(H_TOPIC)
                    label = raw.decode("utf-8", "replace") if raw else "-"
                    reasons[label] = reasons.get(label, 0) + 1
                    continue
                row = (r.offset, req.src_size, req.enqueued_ms, req.deliver_ms, req.cancel, self._topic_hash(req.topic),
                       id_hash(req.message_id))
                if req.cancel:
                    cancels += 1
                elif req.roll == 0:
                    scheduled[req.topic] = scheduled.get(req.topic, 0) + 1
            tp = hdr.get("traceparent")
            if tp:
                ts = hdr.get("tracestate")
                batch[3].append((len(rows), tp.decode("ascii", "replace"), ts.decode("ascii", "replace") if ts else None))
            rows.append(row)
        if dead:
            append_until_written(ctx, self.log, dead, self.logger)
            ctx.metrics.inc_many("dead_lettered", "topic", reasons)
            self.logger.info("dead-lettered", records=len(dead))
        by_shard: dict[int, list[bytes]] = {}
        for p, (lo, last, p_rows, traces) in batches.items():
            entry = PutEntry(p, lo, last + 1, p_rows, tuple(traces))
            by_shard.setdefault(self.shard_of(p), []).append(wire(self.queue, entry))
        for shard, entries in by_shard.items():
            put_blocking(ctx, self.queue, shard, entries, self.logger.bind(shard=shard))
        if scheduled:
            ctx.metrics.inc_many("scheduled", "topic", scheduled)
        if cancels:
            ctx.metrics.inc("cancel_requests", cancels)
        if t0 is not None:
            telemetry.enqueue_get_batch(t0, ctx.config, records, dead)

    def _topic_hash(self, topic: str) -> int:
        """The destination's hash in the TimerLog (0 for a cancel), cached: destinations are few."""
        th = self._topic_hashes.get(topic)
        if th is None:
            if len(self._topic_hashes) > 10_000:
                self._topic_hashes.clear()
            th = self._topic_hashes[topic] = topic_hash(topic) if topic else 0
        return th

    def _maybe_rewind(self) -> None:
        """Seek back to the checkpoint of a partition whose entries were lost in transit."""
        now = time.monotonic()
        if now - self._last_check < REWIND_CHECK_S:
            return
        self._last_check = now
        suspects: dict[int, int] = {}
        for shard in {self.shard_of(p) for p in self.partitions}:
            if self.queue.depth(shard) != 0:
                continue
            offsets = self.checkpoint_offsets(shard)
            for p in self.partitions:
                if self.shard_of(p) != shard:
                    continue
                ckpt = offsets.get(p, 0)
                if ckpt < self.consumer.position(p):
                    suspects[p] = ckpt
        for p, ckpt in suspects.items():
            if self._suspects.get(p) == ckpt:
                self.logger.warning("entries lost in transit, rewinding to checkpoint", partition=p,
                                    offset=ckpt, position=self.consumer.position(p))
                self.ctx.metrics.inc("rewinds", partition=p)
                self.consumer.seek(p, ckpt)
        self._suspects = suspects

    def caught_up(self) -> bool:
        ends = self.log.end_offsets(self.ctx.config.timer_topic)
        return all(self.consumer.position(p) >= ends.get(p, 0) for p in self.partitions)

    def close(self) -> None:
        self.consumer.close()
