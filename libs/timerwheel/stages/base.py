"""What every stage shares: its context, and the two waits that must never hang or drop.

``put_blocking`` is the flow control: a full queue blocks the producer, with a timeout
that is retried until the stage is told to stop. ``append_until_written`` retries a
commit-log append with backoff until it succeeds (a due message is never dropped;
PITFALLS: "dropped after 3 put retries"), surfacing the stall in metrics and logs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from timerwheel.clock import Clock
from timerwheel.config import TimerConfig
from timerwheel.errors import QueueFullError
from timerwheel.log import StageLogger, stage_logger
from timerwheel.metrics import Metrics
from timerwheel.records import OutRecord
from timerwheel.stages.codec import CONSUMER_OF
from timerwheel.transports.base import CommitLog, WorkQueue, entry_bytes
from timerwheel.wire import H_ERROR, H_ID, H_SOURCE, TimerRules

T = TypeVar("T")


class Stopped(Exception):
    """The stage was asked to stop while waiting; the batch in hand stays unacked."""


@dataclass
class StageContext:
    config: TimerConfig
    clock: Clock
    metrics: Metrics = field(default_factory=Metrics)
    stop: threading.Event = field(default_factory=threading.Event)
    #: Consumer name in work-queue groups; unique per process.
    consumer: str = "embedded"
    #: The stages run in processes of their own (production), so no in-process wake reaches
    #: them: an idle stage waits on blocking reads of its inputs (one XREADGROUP BLOCK over its
    #: partitions, a Kafka long poll) for up to the runner's idle timeout instead of polling.
    #: enqueue-put then publishes an unchanged W at most every IDLE_PUBLISH_S, at once when a
    #: slot that holds records becomes readable.
    wait_on_inputs: bool = False
    #: An idle installation does only what is due (always with ``wait_on_inputs``; the embedded
    #: runtime on the system clock): enqueue-put publishes an unchanged W at most every
    #: IDLE_PUBLISH_S (at once when a slot that holds records becomes readable), and an idle
    #: enqueue-put or dequeue-get waits (``idle_wait``, ended early by ``wake``) until its next
    #: deadline rather than for the runner's idle timeout. Off on a simulated clock: time moves
    #: when a test says so, and W follows it at once.
    frugal: bool = False
    #: Called every ``release_every`` bytes of records handled (``processed``); stage processes
    #: give freed memory back with it (``timerwheel.heap.release``).
    release: Callable[[], None] | None = None
    release_every: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        self.frugal = self.frugal or self.wait_on_inputs
        self.rules = TimerRules(self.config)
        self._activity = threading.Condition()
        self._wakes: dict[str, int] = {}
        self._idle: dict[str, int] = {}
        #: stage -> its wake count when its current step began (``step_begins``).
        self._begun: dict[str, int] = {}
        #: Bumped by a shard's enqueue-put when it publishes a new W (see ``published``).
        self.published_w: dict[int, int] = {}
        self._handled = 0

    def processed(self, nbytes: int) -> None:
        """A stage handled ``nbytes`` of records (read, produced): every ``release_every``
        bytes, ``release`` runs (a burst of large bodies must not stay in the heap)."""
        if self.release is None:
            return
        self._handled += nbytes
        if self._handled >= self.release_every:
            self._handled = 0
            self.release()

    def wake(self, *stages: str) -> None:
        """Wake these stages of this process if idle: there is new work for them. No names: all."""
        with self._activity:
            for stage in stages or tuple(self._wakes):
                self._wakes[stage] = self._wakes.get(stage, 0) + 1
            self._activity.notify_all()

    def step_begins(self, stage: str) -> None:
        """``stage`` begins a step: a wake from now on ends its next ``idle_wait`` at once, also one
        that comes after the step found nothing to do and before the wait begins (else that wake
        would be lost, and the work wait for the whole idle timeout)."""
        with self._activity:
            self._begun[stage] = self._wakes.setdefault(stage, 0)

    def idle_wait(self, stage: str, seconds: float) -> None:
        """Sleep up to ``seconds`` when ``stage`` had nothing to do; a wake for it (since its step
        began, see ``step_begins``) ends the wait."""
        if self.stop.is_set():
            return
        with self._activity:
            current = self._wakes.setdefault(stage, 0)
            seen = self._idle[stage] = self._begun.pop(stage, current)
            try:
                self._activity.wait_for(lambda: self._wakes[stage] != seen or self.stop.is_set(), seconds)
            finally:
                self._idle.pop(stage, None)

    def quiescent(self, stages: list[str]) -> bool:
        """True if every one of ``stages`` is idle-waiting and nothing woke it since it began."""
        with self._activity:
            return all(self._idle.get(s, -1) == self._wakes.get(s) for s in stages)


def put_blocking(ctx: StageContext, queue: WorkQueue, partition: int, entries: Sequence[bytes], log: StageLogger) -> None:
    waited = 0
    while True:
        try:
            queue.put(partition, entries, ctx.config.queue_put_timeout_s)
            ctx.wake(CONSUMER_OF[queue.name])
            return
        except QueueFullError:
            waited += 1
            ctx.metrics.inc("queue_full_waits", queue=queue.name)
            if waited == 1 or waited % 12 == 0:
                log.warning("queue full, producer waiting", queue=queue.name, partition=partition, waits=waited)
        if ctx.stop.is_set():
            raise Stopped()


#: Redis ends a blocked read's timeout on its own clock (``hz`` 10: up to 100 ms late, measured).
BLOCK_SLACK_S = 0.1


def get_by(ctx: StageContext, queue: WorkQueue, partitions: Sequence[int], max_entries: int,
           wait_s: float) -> dict[int, list[tuple[str, bytes]]]:
    """``queue.get_many``, waiting at most ``wait_s`` and returning by then: a wait that must end
    on time (the end of a due slot) blocks in Redis BLOCK_SLACK_S shorter, and a wait shorter
    than that sleeps here and then looks without blocking."""
    consumer = ctx.consumer
    if wait_s > BLOCK_SLACK_S:
        return queue.get_many(partitions, consumer, max_entries, wait_s - BLOCK_SLACK_S)
    if wait_s > 0 and ctx.stop.wait(wait_s):
        return {}
    return queue.get_many(partitions, consumer, max_entries, 0)


#: ``on_missing(index, topic)``: what to write instead of ``records[index]``, whose topic does not exist.
OnMissing = Callable[[int, str], OutRecord]


def decoded(ctx: StageContext, queue: WorkQueue, partition: int, entries: Sequence[tuple[str, bytes]],
            decode: Callable[[bytes], T], log: StageLogger) -> list[T]:
    """The entries decoded. One that cannot be decoded (corrupt, forged, of an unknown form) is
    moved to the queue's dead-entry stream (``bury``), counted in ``dead_entries`` and logged
    once with its id: retried, it would fail the stage's every step for good."""
    out: list[T] = []
    bad: list[tuple[str, bytes, str]] = []
    first: Exception | None = None
    for entry_id, payload in entries:
        try:
            out.append(decode(payload))
        except Exception as exc:  # noqa: BLE001 - whatever the bytes, they must not stall the stage
            bad.append((entry_id, payload, f"{type(exc).__name__}: {exc}"[:300]))
            first = first or exc
    if bad:
        queue.bury(partition, bad)
        ctx.metrics.inc("dead_entries", len(bad), queue=queue.name)
        log.error("work-queue entries cannot be decoded, moved aside", exc=first or False, queue=queue.name,
                  partition=partition, entries=[b[0] for b in bad], reason=bad[0][2])
    return out


class RetryWait:
    """The wait before the next attempt of a write that is retried until it succeeds, never dropped:
    50 ms doubling up to 2 s, each failure counted in ``metric`` (with ``labels``), the first of a
    run logged with its traceback and the next ones in one short line; ``Stopped`` once the stage
    stops."""

    def __init__(self, ctx: StageContext, log: StageLogger, event: str, metric: str, **labels: object) -> None:
        self.ctx, self.log, self.event, self.metric, self.labels = ctx, log, event, metric, labels
        self.backoff = 0.05
        self.attempts = 0

    def after(self, exc: Exception, **fields: object) -> None:
        """Count and log the failure ``exc``, then wait."""
        self.attempts += 1
        self.ctx.metrics.inc(self.metric, 1, **self.labels)
        self.log.warning(self.event, exc=exc if self.attempts == 1 else False, attempt=self.attempts,
                         error=repr(exc)[:200], **fields)
        if self.ctx.stop.wait(self.backoff):
            raise Stopped() from exc
        self.backoff = min(self.backoff * 2, 2.0)


def append_until_written(ctx: StageContext, commit_log: CommitLog, records: Sequence[OutRecord],
                         log: StageLogger, on_missing: OnMissing | None = None) -> list[tuple[int, int]]:
    """Append ``records``, retrying until every one is written; returns their positions.

    A failure that says which records did land (``exc.written``, aligned with the attempt) is
    retried for the others only: retrying a whole batch would duplicate what landed. A record
    the log refuses for good (``exc.refused``: too large, an invalid topic) is replaced by a
    dead letter naming the reason, so that it cannot stall its stage. A record whose topic does
    not exist (``exc.missing``) is replaced by what ``on_missing`` returns (dequeue-put holds it
    or dead-letters it); without ``on_missing`` it is retried like any failure."""
    if not records:
        return []
    todo = list(records)
    result: list[tuple[int, int] | None] = [None] * len(todo)
    left = list(range(len(todo)))
    retry = RetryWait(ctx, log, "append failed, retrying", "append_retries")
    quick = 0  # retries in a row without a wait (replacements only)
    while True:
        try:
            written = commit_log.append([todo[i] for i in left])
            for i, pos in zip(left, written, strict=True):
                result[i] = pos
            ctx.wake("enqueue-get")
            return [pos for pos in result if pos is not None]
        except Exception as exc:  # noqa: BLE001 - any transport failure is retried, never dropped
            landed = getattr(exc, "written", None) or []
            if len(landed) == len(left):
                for i, pos in zip(left, landed, strict=True):
                    result[i] = pos
            replaced: set[int] = set()
            for k, reason in (getattr(exc, "refused", None) or {}).items():
                i = left[k]
                todo[i] = refused_record(todo[i], reason, ctx.config.dlq_topic)
                replaced.add(i)
                ctx.metrics.inc("refused_records")
                log.error("record refused by the log, dead-lettered", topic=records[i].topic, reason=reason)
            if on_missing is not None:
                for k, topic in (getattr(exc, "missing", None) or {}).items():
                    i = left[k]
                    todo[i] = on_missing(i, topic)
                    replaced.add(i)
            left = [i for i in left if result[i] is None]
            if replaced.issuperset(left) and quick < 2:
                quick += 1  # nothing failed but what was replaced: write the replacements now
                continue
            quick = 0
            retry.after(exc, records=len(left))


def refused_record(record: OutRecord, reason: str, dlq_topic: str) -> OutRecord:
    """The dead letter for a record the log refuses: its key, its message id and where it was
    going, the reason — not its value (often the very reason)."""
    keep = (H_ID, H_SOURCE, H_ERROR) if record.topic == dlq_topic else (H_ID, H_SOURCE)
    headers = [(k, v[:1000]) for k, v in record.headers if k in keep]  # a refused dead letter keeps its reason
    headers.append((H_ERROR, f"{record.topic!r} refused the record: {reason}".encode()))  # the last one wins
    key = record.key if record.key is not None and len(record.key) <= 1024 else None
    return OutRecord(dlq_topic, key, b"", tuple(headers))


class Unopenable:
    """The shards a shard-owning stage cannot start: ``shard_open_failed{shard, stage, error}`` is 1
    while it fails, 0 once it opened. The operator reads it and marks the TimerWheel Degraded
    naming the shard. Two kinds:

    * ``report``: the shard cannot be opened (``error``: the exception's class; the message is
      logged once per shard and error) and is tried again;
    * ``refuse``: its state needs ``timerwheel recover`` (a lost or corrupt checkpoint; ``error``
      RECOVERY_NEEDED), logged once per reason as "shard needs recovery"; ``refused`` holds why.
    """

    def __init__(self, ctx: StageContext, stage: str, logger: StageLogger) -> None:
        self.ctx = ctx
        self.stage = stage
        self.logger = logger
        self.failing: dict[int, str] = {}
        #: Shards left unstarted because their state needs ``timerwheel recover``: shard -> why.
        self.refused: dict[int, str] = {}

    def report(self, shard: int, exc: BaseException) -> None:
        error = type(exc).__name__
        if self._fail(shard, error):
            self.logger.error("shard cannot be opened, retrying", shard=shard, error=f"{error}: {exc}"[:500])

    def refuse(self, shard: int, why: str) -> None:
        self._fail(shard, RECOVERY_NEEDED)
        if self.refused.get(shard) != why:
            self.refused[shard] = why
            stage_logger(self.stage, shard).error("shard needs recovery", reason=why)

    def clear(self, shard: int) -> None:
        self.refused.pop(shard, None)
        error = self.failing.pop(shard, None)
        if error is not None:
            self.ctx.metrics.set("shard_open_failed", 0, shard=shard, stage=self.stage, error=error)

    def _fail(self, shard: int, error: str) -> bool:
        """Mark the shard failing with ``error``; True if that is new for it."""
        new = self.failing.get(shard) != error
        if new:
            self.clear(shard)
            self.failing[shard] = error
        self.ctx.metrics.set("shard_open_failed", 1, shard=shard, stage=self.stage, error=error)
        return new


#: ``shard_open_failed``'s ``error`` for a shard that waits for ``timerwheel recover``.
RECOVERY_NEEDED = "RecoveryNeeded"


#: Entries pending this long are claimed by another consumer, even from a live one (stuck).
CLAIM_IDLE_MS = 30_000
#: ... and this long, from a consumer whose heartbeat lapsed (a dead process).
DEAD_IDLE_MS = 1_000
CLAIM_EVERY_S = 1.0
#: Stage processes say they are alive this often, for this long (WorkQueue.heartbeat).
HEARTBEAT_EVERY_S = 1.0
HEARTBEAT_TTL_MS = 5_000


class QueueStage:
    """A stateless stage that drains one queue's partitions: dequeue-getmsg and dequeue-put.

    ``step`` takes up to ``max_entries`` entries per partition, and every CLAIM_EVERY_S also the
    entries a dead consumer left pending (after DEAD_IDLE_MS once its heartbeat lapsed, after
    CLAIM_IDLE_MS in any case); subclasses ``handle_batches`` them and ack them. A step stops
    taking entries at TW_BATCH_BYTES of them (``entry_bytes``), and asks a partition for as many
    as the mean entry seen so far leaves room for: deliver entries of large records are taken one
    by one, small ones ``max_entries`` at a time. The partitions take turns in being first. A step
    that found nothing, when ``ctx.wait_on_inputs``, blocks on all partitions at once (one
    XREADGROUP BLOCK), each asked for its share of the byte budget.
    """

    stage = ""

    def __init__(self, ctx: StageContext, source: WorkQueue, partitions: Sequence[int], max_entries: int = 8) -> None:
        self.ctx = ctx
        self.source = source
        self.partitions = list(partitions)
        self.max_entries = max_entries
        self._claimed = time.monotonic()
        #: Mean bytes of the entries taken lately (0 before any: the first step takes max_entries).
        self._entry_bytes = 0
        self._first = 0  # the partition asked first in the next step

    def step(self, timeout_s: float) -> int:
        claim = time.monotonic() - self._claimed >= CLAIM_EVERY_S
        if claim:
            self._claimed = time.monotonic()
        consumer = self.ctx.consumer
        wait = self.ctx.wait_on_inputs
        batches: dict[int, list[tuple[str, bytes]]] = {}
        budget = self.ctx.config.batch_bytes
        taken = 0
        n = len(self.partitions)
        for k in range(n):
            p = self.partitions[(self._first + k) % n]
            want = max(1, min(self.max_entries, (budget - taken) // max(1, self._entry_bytes)))
            entries = self.source.get(p, consumer, want, 0)
            if claim:
                entries += self.source.claim_stale(p, consumer, CLAIM_IDLE_MS, want, DEAD_IDLE_MS)
            if entries:
                batches[p] = entries
                taken += self._count_bytes(entries)
                if taken >= budget:
                    self._first = (self._first + k + 1) % n
                    break
        if not batches and wait and not claim:
            # Idle: block (up to CLAIM_EVERY_S, so that a dead consumer's entries are still
            # claimed on time) on every partition at once, each asked for its share of the budget.
            want = max(1, min(self.max_entries, budget // n // max(1, self._entry_bytes)))
            batches = get_by(self.ctx, self.source, self.partitions, want, min(timeout_s, CLAIM_EVERY_S))
            for entries in batches.values():
                self._count_bytes(entries)
        if batches:
            self.handle_batches(batches)
        elif not wait:
            self.ctx.idle_wait(self.stage, timeout_s)
        return sum(map(len, batches.values()))

    def _count_bytes(self, entries: list[tuple[str, bytes]]) -> int:
        """The entries' bytes (``entry_bytes``), folded into the running mean entry size."""
        nbytes = sum(entry_bytes(payload) for _, payload in entries)
        mean = nbytes // len(entries)
        self._entry_bytes = (self._entry_bytes + mean) // 2 if self._entry_bytes else mean
        return nbytes

    def handle_batches(self, batches: dict[int, list[tuple[str, bytes]]]) -> None:
        """The entries taken from each partition in one step. One call for all of them, so that
        a stage can serve them with one round trip (one Kafka read, one produce-and-wait)."""
        raise NotImplementedError

    def close(self) -> None:
        pass
