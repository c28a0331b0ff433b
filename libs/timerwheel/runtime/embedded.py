"""The embedded runtime: all five stages in one process, no Kafka and no Redis.

``EmbeddedTimerwheel`` wires the stages over a ``LocalCommitLog`` (segment files in the data
directory, safe for several processes) and in-process bounded queues, each stage in its own
thread. It stops cleanly (every stage finishes its batch; enqueue-put publishes a final
checkpoint) and restarts from the same data directory; a crash at any point loses nothing
and re-delivers only what was delivered from slots at or after ``R`` (bounded by the
queues and ``max_in_flight``, which keep ``R`` close behind).

    with EmbeddedTimerwheel(data_dir, clock=clock, tick_ms=100, shards=2) as tw:
        ticket = tw.schedule("orders", b"value", key=b"k", delay_ms=5_000)
        tw.cancel(ticket)
        clock.advance(6_000); tw.wait_idle()
        delivered = tw.read("orders")
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

from timerwheel.client import Timer, TimerClient
from timerwheel.clock import Clock, SimulatedClock, SystemClock
from timerwheel.config import TimerConfig
from timerwheel.errors import ShardNeedsRecoveryError, TimerwheelError
from timerwheel.log import stage_logger
from timerwheel.metrics import registry_for
from timerwheel.pending import PendingTimers, pending_timers
from timerwheel.records import Headers, Record
from timerwheel.runtime.inspect import inspect_shards, sample_gauges
from timerwheel.runtime.runner import WHEEL_COUNT_EVERY_S, Every, Heartbeat, StageRunner, tune_interpreter
from timerwheel.runtime.wiring import (
    Stage,
    Transports,
    build_stage,
    check_source,
    ensure_topics,
    local_transports,
    shard_deliveries,
)
from timerwheel.stages import STAGE_NAMES, StageContext
from timerwheel.stages.codec import Q_DELIVER
from timerwheel.store.deployment import DeploymentSettings, check_settings
from timerwheel.store.layout import DataDirLock, open_shard
from timerwheel.transports.base import ExpiringLog
from timerwheel.wire import MAX_EPOCH_MS, Ticket

#: How often the embedded runtime applies the local commit log's retention (seconds).
RETENTION_EVERY_S = 60.0
#: How often an idle enqueue-get looks for timer records another process appended (``timerwheel
#: schedule``, a ``TimerClient`` on the same data directory): what this process schedules wakes it
#: at once. A look reads each timer partition's end (a few syscalls). After 2 s with nothing,
#: every 50 ms (``enqueue_get.QUIET_POLL_S``).
EXTERNAL_POLL_S = 0.01
#: How long any other idle stage waits for a wake at most: each is woken by what gives it work
#: (a put into its queue, a new W, R moving), enqueue-put and dequeue-get wait less when
#: something falls due (``StageContext.frugal``).
WAKE_WAIT_S = 1.0
#: The idle wait of every stage on a simulated clock (what the runtime did on any clock before
#: issue 32: ~8 % of a core on an idle system clock, five threads waking 200 times a second).
SIMULATED_IDLE_S = 0.005


def idle_wait_s(stage: str, simulated: bool) -> float:
    """How long the runner of ``stage`` lets an idle step wait (see the constants above)."""
    if simulated:
        return SIMULATED_IDLE_S
    return EXTERNAL_POLL_S if stage == "enqueue-get" else WAKE_WAIT_S


class EmbeddedTimerwheel:
    def __init__(self, data_dir: str | os.PathLike[str] | None = None, *, clock: Clock | None = None,
                 config: TimerConfig | None = None, start: bool = True, transports: Transports | None = None,
                 **settings: Any) -> None:
        """``settings`` are TimerConfig fields (tick_ms=, roll_window_ms=, shards=, ...).
        ``transports`` default to the local commit log and in-process queues; production
        mode passes Kafka and Redis ones (``timerwheel run --kafka --redis``)."""
        self._transports = transports
        self._lock: DataDirLock | None = None
        base = config or TimerConfig()
        if data_dir is not None:
            settings["data_dir"] = str(data_dir)
        self.config = base.replace(**settings) if settings else base
        self.clock = clock or SystemClock()
        self.metrics = registry_for(self.config)
        self._wheel_count_every = Every(WHEEL_COUNT_EVERY_S)
        self._retention_every = Every(RETENTION_EVERY_S)
        self.log = stage_logger("embedded")
        self.runners: list[StageRunner] = []
        self._started = False
        if start:
            self.start()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._started:
            return
        try:
            self._start()
        except BaseException:
            self._release()
            raise

    def _start(self) -> None:
        cfg = self.config
        Path(cfg.data_dir).mkdir(parents=True, exist_ok=True)
        check_settings(cfg.data_dir, DeploymentSettings.of(cfg), fsync=cfg.fsync)
        tune_interpreter()  # five busy threads: the switch interval and the GC thresholds
        self._lock = None if self._transports else DataDirLock(cfg.data_dir)
        transports = self._transports or local_transports(cfg, self.clock)
        self.commit_log, self.queues = transports.commit_log, transports.queues
        partitions = ensure_topics(cfg, self.commit_log)
        shard_deliveries(cfg, self.commit_log)  # exactly-once: its progress topic made (or refused) before anything starts
        check_source(cfg, self.commit_log, adopt=True, production=self._transports is not None)
        self.client = TimerClient(self.commit_log, cfg, self.clock)
        owner = f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        # On the system clock the stages do only what is due (``StageContext.frugal``); on a
        # simulated one time moves when a test says so, and every stage follows it at once.
        simulated = isinstance(self.clock, SimulatedClock)
        self.ctx = StageContext(cfg, self.clock, self.metrics, consumer=owner, frugal=not simulated)
        ctx = self.ctx
        if isinstance(self.clock, SimulatedClock):
            self.clock.on_change(lambda: ctx.wake("enqueue-put"))
        self.enqueue_put = build_stage("enqueue-put", cfg, ctx, transports, sole=True)
        if len(self.enqueue_put.owned) != cfg.shards:
            refused = dict(self.enqueue_put.refused)
            self.enqueue_put.close()
            self._release()
            if refused:
                raise ShardNeedsRecoveryError("; ".join(f"shard {s}: {why}" for s, why in sorted(refused.items())))
            raise TimerwheelError(f"shards of {cfg.data_dir} are owned by another timerwheel process")
        self.readers = {s: open_shard(cfg, s, writer=False) for s in range(cfg.shards)}
        self.enqueue_get = build_stage("enqueue-get", cfg, ctx, transports, sole=True)
        self.dequeue_get = build_stage("dequeue-get", cfg, ctx, transports, sole=True)
        self.dequeue_getmsg = build_stage("dequeue-getmsg", cfg, ctx, transports, sole=True)
        self.dequeue_put = build_stage("dequeue-put", cfg, ctx, transports, sole=True)
        stages: dict[str, Stage] = {"enqueue-get": self.enqueue_get, "enqueue-put": self.enqueue_put, "dequeue-get": self.dequeue_get,
                  "dequeue-getmsg": self.dequeue_getmsg, "dequeue-put": self.dequeue_put}
        self.runners = [StageRunner(name, stages[name], ctx, idle_s=idle_wait_s(name, simulated),
                                    sample=self._sample if name == "dequeue-get" else None)
                        for name in STAGE_NAMES]
        if not all(q.in_process for q in self.queues.values()):
            Heartbeat(self.queues[Q_DELIVER], owner, ctx.stop).start()  # shared queues (run --redis)
        for r in self.runners:
            r.start()
        self._started = True
        self.log.info("started", data_dir=cfg.data_dir, shards=cfg.shards, tick_ms=cfg.tick_ms,
                      roll_window_ms=cfg.roll_window_ms, timer_partitions=partitions)

    def close(self) -> None:
        if not self._started:
            return
        self.ctx.stop.set()
        self.ctx.wake()
        for r in self.runners:
            r.join()
        for r in self.runners:
            r.close()
        for shard in self.readers.values():
            shard.close()
        self.commit_log.close()
        self._release()
        self._started = False
        self.log.info("stopped")

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> EmbeddedTimerwheel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- producing and consuming -----------------------------------------------------------
    def schedule(self, topic: str, value: bytes | None, *, key: bytes | None = None, headers: Headers = (),
                 delay_ms: int | None = None, deliver_at_ms: int | None = None, delay_level: int | None = None,
                 message_id: str | None = None, partition: int | None = None) -> Ticket:
        ticket = self.client.schedule(topic, value, key=key, headers=headers, delay_ms=delay_ms,
                                      deliver_at_ms=deliver_at_ms, delay_level=delay_level,
                                      message_id=message_id, partition=partition)
        self.ctx.wake("enqueue-get")
        return ticket

    def schedule_many(self, timers: list[Timer]) -> list[Ticket]:
        tickets = self.client.schedule_many(timers)
        self.ctx.wake("enqueue-get")
        return tickets

    def cancel(self, ticket: Ticket | str) -> None:
        self.client.cancel(ticket)
        self.ctx.wake("enqueue-get")

    def read(self, topic: str, offsets: dict[int, int] | None = None, max_records: int = 1_000_000) -> list[Record]:
        """Every record of ``topic`` from ``offsets`` (default: the start) to its current end."""
        ends = self.commit_log.end_offsets(topic)
        start = offsets or self.commit_log.start_offsets(topic)
        consumer = self.commit_log.consumer(topic, {p: start.get(p, 0) for p in ends})
        out: list[Record] = []
        try:
            while len(out) < max_records:
                batch = consumer.poll(10_000, 0.0)
                if not batch:
                    break
                out.extend(batch)
        finally:
            consumer.close()
        return out

    # -- waiting and inspecting ------------------------------------------------------------
    def idle(self) -> bool:
        """Nothing more to do at the current clock time: every queue empty but for the deliver
        entries dequeue-put holds for their time (read ahead, TW_LOOKAHEAD_MS), none of them due."""
        held = self.dequeue_put.holding
        return (
            self.enqueue_get.caught_up()
            and all(q.depth(p) == (held(p) if q is self.queues[Q_DELIVER] else 0)
                    for q in self.queues.values() for p in range(q.partitions))
            and self.enqueue_put.caught_up()
            and self.dequeue_get.caught_up()
            and self.dequeue_put.caught_up()
        )

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Block until every stage has finished all it can do at the current clock time:
        each stage thread waits for work and nothing woke it since, and the queues, the
        timer topic and both watermarks agree."""
        deadline = time.monotonic() + timeout_s
        stages = [r.name for r in self.runners]
        while time.monotonic() < deadline:
            if self.ctx.quiescent(stages) and self.idle() and self.ctx.quiescent(stages):
                return
            time.sleep(0.0005)
        raise TimeoutError(f"timerwheel did not become idle within {timeout_s} s: {self.inspect()}")

    def _sample(self) -> None:
        """Every second, from the gauge thread: gauges, and now and then the local log's retention."""
        self.sample_gauges(self._wheel_count_every.due())
        if self._retention_every.due():
            self.enforce_retention()

    def enforce_retention(self) -> int:
        """Delete the local commit log's segments past ``TW_LOG_RETENTION_MS``; returns how many."""
        if not isinstance(self.commit_log, ExpiringLog):  # Kafka keeps its own retention
            return 0
        deleted = self.commit_log.expire(self.clock.now_ms(), self.config.effective_log_retention_ms)
        if deleted:
            self.log.info("log retention", segments_deleted=deleted,
                          retention_ms=self.config.effective_log_retention_ms)
        return deleted

    def sample_gauges(self, count_wheel: bool = True) -> None:
        """Set the queue-depth gauges and (with ``count_wheel``) the ``pending`` gauges: dequeue-get's
        gauge thread calls this every second, counting the wheel every WHEEL_COUNT_EVERY_S."""
        sample_gauges(self.metrics, self.queues, self.readers, count_wheel=count_wheel)

    def pending(self, from_ms: int = 0, to_ms: int = MAX_EPOCH_MS, *, topic: str | None = None,
                message_id: str | None = None, limit: int = 100) -> PendingTimers:
        """The scheduled, not yet delivered messages due in [from_ms, to_ms) (``timerwheel.pending``)."""
        return pending_timers(self.commit_log, self.readers, self.config, from_ms, to_ms, now_ms=self.clock.now_ms(),
                              topic=topic, message_id=message_id, limit=limit)

    def reschedule(self, ticket: Ticket | str, *, delay_ms: int | None = None, deliver_at_ms: int | None = None,
                   delay_level: int | None = None, message_id: str | None = None) -> Ticket:
        """``TimerClient.reschedule``: one record that moves the ticket's message later; returns the new ticket."""
        new = self.client.reschedule(ticket, delay_ms=delay_ms, deliver_at_ms=deliver_at_ms,
                                     delay_level=delay_level, message_id=message_id)
        self.ctx.wake("enqueue-get")
        return new

    def inspect(self) -> dict[str, Any]:
        return inspect_shards(self.config, self.readers, self.clock.now_ms(),
                              {name: [q.depth(p) for p in range(q.partitions)] for name, q in self.queues.items()})

