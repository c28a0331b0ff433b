"""enqueue-get: timer topic -> validated requests -> the shard's put queue.

Stateless. Reads timer-topic partitions from the offsets the shards' enqueue checkpoints
own (clamped to what the log still holds), validates and normalises each record
(``TimerRules``), dead-letters the invalid ones with ``tw-error``, and sends one
``PutEntry`` per partition and batch to the put queue of shard ``partition % shards``.

Every offset reaches enqueue-put, valid or not, so the checkpoint can advance past
dead-lettered records. An entry covers ``[from, next)`` where ``from`` is where the last entry of
its partition ended and ``next`` the consumer's position after the poll: offsets that hold no
record for us (transaction markers, aborted records — the timer topic is read
``read_committed`` — compacted or deleted records) lie inside an entry, never between two, so
enqueue-put's continuity check never takes them for loss. A poll that only moved the position
(a transaction's commit marker) sends an entry with no rows. Entries lost in transit (Redis
flushed) show up as a checkpoint that stays behind our read position while the put queue is
empty; we then rewind to the checkpoint. Rewinding is always safe: enqueue-put skips offsets it
has.

Dead letters go once per invalid record where the commit log can (``DeadLetterLog``, Kafka): a
restart reads records again from the checkpoint, and each timer partition's dead letters are
written in a transaction that also moves a consumer group's offset past them
(``transports.kafka.transactions``), so those already written are skipped. A failed transaction
is retried until it commits (the batch waits, as for any failed write): late, never twice, never
lost. The local log does the same through its journal (``LocalCommitLog.dead_letter_once``:
the dead letters and a done-offset record in one ``append_atomic``).

A destination that does not exist when the message is scheduled is scheduled anyway
(``TW_MISSING_TOPIC=hold``: it may be created before the message is due; dequeue-put holds it
for a bounded time then) or dead-lettered at once (``dlq``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from timerwheel import telemetry
from timerwheel.errors import InvalidTimerMessage
from timerwheel.log import stage_logger
from timerwheel.records import OutRecord, Record
from timerwheel.stages.base import RetryWait, StageContext, append_until_written, put_blocking, refused_record
from timerwheel.stages.codec import PutEntry, PutRow, wire
from timerwheel.transports.base import CommitLog, Consumer, DeadLetterLog, ReportsUndecodable, WorkQueue
from timerwheel.wire import H_TOPIC, dead_letter_headers, id_hash, revision_id_hash, topic_hash

STAGE = "enqueue-get"
REWIND_CHECK_S = 2.0
#: Embedded on the system clock (``StageContext.frugal`` without ``wait_on_inputs``): once nothing
#: came for this long, an idle poll of the local log for other processes' appends waits at least
#: QUIET_POLL_S instead of the runner's 10 ms. A wake-up costs about 0.1-0.2 ms of CPU on these
#: machines whatever it does (measured: a bare 10 ms sleep 73 us, an idle poll 190 us), so the poll
#: rate is most of the idle cost; what this process schedules still wakes it at once, and a
#: record another process appends to a quiet installation is read up to QUIET_POLL_S later.
QUIET_AFTER_S = 2.0
QUIET_POLL_S = 0.05


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
        self.commit_log = commit_log
        self.queue = put_queue
        self.partitions = list(partitions)
        self.checkpoint_offsets = checkpoint_offsets
        self.logger = stage_logger(STAGE)
        #: destination -> its hash in the TimerLog (destinations are few).
        self._topic_hashes: dict[str, int] = {}
        resume = self.resume_offsets()
        self.consumer: Consumer = commit_log.consumer(ctx.config.timer_topic, resume)
        #: The consumer reports undecodable batches (Kafka's): asked once, a Protocol isinstance
        #: costs more than an idle poll of the local log (measured: ~30 of ~45 us).
        self._reports: ReportsUndecodable | None = (
            self.consumer if isinstance(self.consumer, ReportsUndecodable) else None)
        #: The log writes dead letters once each (Kafka's, the local log's); None: at least once through ``append``.
        self._once: DeadLetterLog | None = commit_log if isinstance(commit_log, DeadLetterLog) else None
        #: partition -> where the last entry sent for it ended (the next entry starts there).
        self._reported = dict(resume)
        self._suspects: dict[int, int] = {}
        #: partition -> the checkpoint offset it was last rewound to.
        self._rewound: dict[int, int] = {}
        self._last_check = time.monotonic()
        #: partition -> offset of a batch the consumer cannot decode, as last reported.
        self._undecodable: dict[int, int] = {}
        #: The last poll found nothing (the next one may wait, see ``StageContext.wait_on_inputs``).
        self._idle = False
        #: When a poll last found something (time.monotonic()): see QUIET_AFTER_S.
        self._active_at = time.monotonic()

    def shard_of(self, partition: int) -> int:
        return partition % self.ctx.config.shards

    def resume_offsets(self) -> dict[int, int]:
        starts = self.commit_log.start_offsets(self.ctx.config.timer_topic)
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
        wait = self.ctx.wait_on_inputs
        # Waiting on the poll (a Kafka long poll) when the last one found nothing; the rewind
        # check stays due every REWIND_CHECK_S.
        block = min(timeout_s, REWIND_CHECK_S / 2) if wait and self._idle else 0
        records = self.consumer.poll(self.ctx.config.batch_size, block)
        consumer = self.consumer
        reported = self._reported
        positions = {p: consumer.position(p) for p in self.partitions}
        moved = {p: at for p, at in positions.items() if at != reported.get(p)}
        self._idle = not (records or moved)
        if not self._idle:
            self._active_at = time.monotonic()
            self.handle(records, moved)
        elif not wait:
            quiet = self.ctx.frugal and time.monotonic() - self._active_at >= QUIET_AFTER_S
            self.ctx.idle_wait(STAGE, max(timeout_s, QUIET_POLL_S) if quiet else timeout_s)
        self._report_undecodable()
        self._maybe_rewind()
        return len(records)

    def handle(self, records: Sequence[Record], positions: dict[int, int] | None = None) -> None:
        """Validate ``records``, dead-letter the invalid ones, and send each partition's entry.

        ``positions`` (partition -> the consumer's next offset) ends each partition's entry; a
        partition there without records gets an entry with no rows (its position moved over
        offsets that hold no record for us). Without it, an entry ends after its last record."""
        ctx = self.ctx
        t0 = telemetry.batch_start()
        now = ctx.clock.now_ms()
        parse = ctx.rules.parse
        #: (source partition, source offset, dead letter, its destination for the metric)
        dead: list[tuple[int, int, OutRecord, str]] = []
        scheduled: dict[str, int] = {}
        cancels = reschedules = 0
        #: partition -> [first offset, last offset, rows, traces]
        batches: dict[int, list[Any]] = {}
        topic_hashes = self._topic_hashes
        batch: list[Any]
        rows: list[PutRow]
        partition = -1  # no record has it: the first record sets batch and rows
        missing = self._missing if ctx.config.missing_topic == "dlq" else None
        for r in records:
            if r.partition != partition:  # a poll returns each partition's records together, in offset order
                partition = r.partition
                batch = batches.get(partition) or batches.setdefault(partition, [r.offset, r.offset, [], []])
                rows = batch[2]
            batch[1] = r.offset
            hdr = dict(r.headers)
            try:
                deliver, cancel, message_id, topic, roll, enqueued, _p, _o, size, revision, replaces = parse(r, now, hdr)
                if missing is not None and not cancel and roll == 0 and replaces is None and missing(topic):
                    raise InvalidTimerMessage(f"destination topic {topic!r} does not exist (TW_MISSING_TOPIC=dlq)")
            except InvalidTimerMessage as exc:
                raw = hdr.get(H_TOPIC)
                dead.append((r.partition, r.offset,
                             OutRecord(ctx.config.dlq_topic, r.key, r.value, dead_letter_headers(r, exc.reason)),
                             raw.decode("utf-8", "replace") if raw else "-"))
                continue
            if replaces is not None:
                # A reschedule: a marker of (id, revision - 1) at the replaced time; where that
                # message leaves, the first marker of it decides (design 6.2 "Later").
                if deliver < replaces:
                    self._void(r, message_id, revision, deliver, replaces)
                    continue
                row = (r.offset, size, enqueued, replaces, True, 0, revision_id_hash(message_id, revision - 1))
                reschedules += 1
            else:
                row = (r.offset, size, enqueued, deliver, cancel, topic_hashes.get(topic) or self._topic_hash(topic),
                       id_hash(message_id) if not revision else revision_id_hash(message_id, revision))
            if cancel:
                cancels += 1
            elif roll == 0 and replaces is None:
                scheduled[topic] = scheduled.get(topic, 0) + 1
            tp = hdr.get("traceparent")
            if tp:
                ts = hdr.get("tracestate")
                batch[3].append((len(rows), tp.decode("ascii", "replace"), ts.decode("ascii", "replace") if ts else None))
            rows.append(row)
        if dead:
            skipped = self._dead_letter(dead)
            reasons: dict[str, int] = {}
            for p, offset, _, label in dead:
                if (p, offset) not in skipped:
                    reasons[label] = reasons.get(label, 0) + 1
            ctx.metrics.inc_many("dead_lettered", "topic", reasons)
            self.logger.info("dead-lettered", records=len(dead) - len(skipped))
        by_shard: dict[int, list[bytes]] = {}
        reported = self._reported
        ends = dict(positions or {})
        for p, (lo, last, p_rows, traces) in batches.items():
            end = max(ends.pop(p, last + 1), last + 1)
            entry = PutEntry(p, min(reported.get(p, lo), lo), end, p_rows, tuple(traces))
            by_shard.setdefault(self.shard_of(p), []).append(wire(self.queue, entry))
            reported[p] = end
        for p, end in ends.items():  # moved with no record: markers, aborted or compacted records
            start = reported.get(p, end)
            if end > start:
                by_shard.setdefault(self.shard_of(p), []).append(wire(self.queue, PutEntry(p, start, end, [])))
            reported[p] = end
        for shard, entries in by_shard.items():
            put_blocking(ctx, self.queue, shard, entries, self.logger.bind(shard=shard))
        ctx.processed(sum(len(r.value) for r in records if r.value))
        if scheduled:
            ctx.metrics.inc_many("scheduled", "topic", scheduled)
        if cancels:
            ctx.metrics.inc("cancel_requests", cancels)
        if reschedules:
            ctx.metrics.inc("reschedule_requests", reschedules)
        if t0 is not None:
            telemetry.enqueue_get_batch(t0, ctx.config, records, [d[2] for d in dead])

    def _dead_letter(self, dead: Sequence[tuple[int, int, OutRecord, str]]) -> set[tuple[int, int]]:
        """Write the dead letters before the entries that cover their offsets are sent (once the
        checkpoint passes an offset, it is not read again); returns the (partition, offset) of
        those written before (a restart read them again)."""
        once = self._once
        if once is None:
            append_until_written(self.ctx, self.commit_log, [d[2] for d in dead], self.logger)
            return set()
        skipped: set[tuple[int, int]] = set()
        by_partition: dict[int, list[tuple[int, OutRecord]]] = {}
        for p, offset, record, _ in dead:
            by_partition.setdefault(p, []).append((offset, record))
        prefix, topic = self.ctx.config.transactional_id_prefix, self.ctx.config.timer_topic
        for p, letters in by_partition.items():
            retry = RetryWait(self.ctx, self.logger, "dead-letter transaction failed, retrying", "dead_letter_retries",
                              partition=p)
            while True:
                try:
                    written = once.dead_letter_once(prefix, topic, p, letters)
                    break
                except Exception as exc:  # noqa: BLE001 - any transport failure is retried, never dropped
                    refused = getattr(exc, "refused", None)
                    if refused:  # too large with its value: the dead letter without it, written now
                        letters = [(o, refused_record(r, refused[i], self.ctx.config.dlq_topic) if i in refused else r)
                                   for i, (o, r) in enumerate(letters)]
                        self.ctx.metrics.inc("refused_records", len(refused))
                        self.logger.error("dead letter refused by the log, written without its value", partition=p,
                                          records=len(refused), reason=next(iter(refused.values())))
                        continue
                    retry.after(exc, partition=p, records=len(letters))
            if written < len(letters):  # the lowest offsets: below the group's committed offset
                skipped.update((p, o) for o, _ in letters[:len(letters) - written])
                self.logger.info("dead letters written before, skipped", partition=p, skipped=len(letters) - written)
        return skipped

    def _void(self, record: Record, message_id: str, revision: int, deliver: int, replaces: int) -> None:
        """A reschedule to a time before the ticket's: void (this build applies moves to a later
        time only; the client refuses earlier ones). Its offset is passed on with no row."""
        self.ctx.metrics.inc("reschedules_void")
        self.logger.warning("reschedule void: an earlier time; cancel the ticket and schedule a new message",
                            id=message_id, revision=revision - 1, replaces=replaces, deliver_at=deliver,
                            partition=record.partition, offset=record.offset)

    def _missing(self, topic: str) -> bool:
        """The destination does not exist (the commit log caches the answer)."""
        return self.commit_log.partition_count(topic) is None

    def _topic_hash(self, topic: str) -> int:
        """The destination's hash in the TimerLog (0 for a cancel), cached: destinations are few."""
        th = self._topic_hashes.get(topic)
        if th is None:
            if len(self._topic_hashes) > 10_000:
                self._topic_hashes.clear()
            th = self._topic_hashes[topic] = topic_hash(topic) if topic else 0
        return th

    def _report_undecodable(self) -> None:
        """Metrics of partitions whose next batch cannot be decoded (the consumer logs each once)."""
        if self._reports is None:
            return
        found = self._reports.undecodable
        if not found and not self._undecodable:
            return
        now = {p: u.offset for p, u in found.items()}
        if now == self._undecodable:
            return
        for p, offset in now.items():
            if self._undecodable.get(p) != offset:
                self.ctx.metrics.inc("undecodable_batches", partition=p)
            self.ctx.metrics.set("undecodable_offset", offset, partition=p)
        for p in self._undecodable.keys() - now.keys():
            self.ctx.metrics.set("undecodable_offset", -1, partition=p)
        self.ctx.metrics.set("undecodable_partitions", len(now))
        self._undecodable = now

    def _maybe_rewind(self) -> None:
        """Seek back to the checkpoint of a partition whose entries were lost in transit."""
        now = time.monotonic()
        if now - self._last_check < REWIND_CHECK_S:
            return
        self._last_check = now
        suspects: dict[int, int] = {}
        for shard in {self.shard_of(p) for p in self.partitions}:
            # A checkpoint that does not move while the queue still holds entries may be an
            # enqueue-put that is slow or down (rewinding re-sends what the queue holds), or one
            # that skips our entries after a gap (a torn TimerLog tail made it resume below what
            # we sent): under load its queue never empties, so waiting for that would stop the
            # partition, and W with it, until the load stops. So each checkpoint value is
            # rewound to once whatever the queue holds, and again only once the queue is empty.
            busy = self.queue.depth(shard) != 0
            offsets = self.checkpoint_offsets(shard)
            for p in self.partitions:
                if self.shard_of(p) != shard:
                    continue
                ckpt = offsets.get(p, 0)
                if ckpt < self.consumer.position(p) and not (busy and self._rewound.get(p) == ckpt):
                    suspects[p] = ckpt
        for p, ckpt in suspects.items():
            if self._suspects.get(p) == ckpt:
                self.logger.warning("entries lost in transit, rewinding to checkpoint", partition=p,
                                    offset=ckpt, position=self.consumer.position(p))
                self.ctx.metrics.inc("rewinds", partition=p)
                self.consumer.seek(p, ckpt)
                self._reported[p] = ckpt
                self._rewound[p] = ckpt
        self._suspects = suspects

    def caught_up(self) -> bool:
        ends = self.commit_log.end_offsets(self.ctx.config.timer_topic)
        return all(self.consumer.position(p) >= ends.get(p, 0) for p in self.partitions)

    def close(self) -> None:
        self.consumer.close()
