"""A timerwheel process: ``timerwheel stage NAME`` (one stage) and ``timerwheel run`` (all five).

``timerwheel stage NAME`` runs one stage on Kafka and Redis, configured by ``TW_*`` environment
variables (all validated before anything starts; a bad one stops the process with one line
naming it), serving ``/healthz``, ``/readyz`` and ``/metrics`` on ``TW_HTTP_PORT``, stopping
gracefully on SIGTERM (the batch in hand is finished, enqueue-put publishes a final checkpoint).
``timerwheel run`` runs all five in one process (``EmbeddedTimerwheel``): on the data directory's
local commit log, or with ``--kafka B --redis URL`` on the same transports as the stages.

Scaling: enqueue-put and dequeue-get own shards through Redis leases, balanced among their live
replicas by rendezvous hashing over a member set in Redis (``stages.ownership``; ``TW_OWN_SHARDS``
limits which shards a replica competes for; replicas beyond the shard count wait as hot
standbys); a stopping owner (SIGTERM) releases its shards, so the next one takes them at once;
enqueue-get replicas split the timer partitions (``TW_REPLICAS``, ``TW_REPLICA_INDEX``);
dequeue-getmsg and dequeue-put scale freely as consumers of the work-queue groups.
"""

from __future__ import annotations

import os
import secrets
import signal
import threading
from collections.abc import Callable
from typing import Any

from timerwheel import heap, telemetry
from timerwheel.clock import SystemClock
from timerwheel.config import TimerConfig
from timerwheel.errors import ConfigError, TimerwheelError
from timerwheel.log import stage_logger
from timerwheel.metrics import Metrics, registry_for
from timerwheel.runtime.embedded import EmbeddedTimerwheel
from timerwheel.runtime.health import HealthServer
from timerwheel.runtime.inspect import sample_gauges
from timerwheel.runtime.runner import (
    WAIT_ON_INPUTS_S,
    WHEEL_COUNT_EVERY_S,
    Every,
    Heartbeat,
    StageRunner,
    tune_interpreter,
)
from timerwheel.runtime.wiring import (
    Stage,
    Transports,
    build_stage,
    check_timer_topic,
    production_transports,
    require_servers,
)
from timerwheel.stages import DequeueGet, StageContext
from timerwheel.stages.base import Stopped
from timerwheel.stages.codec import CONSUMER_OF
from timerwheel.store.deployment import DeploymentSettings, check_settings

#: Seconds between two progress lines of ``timerwheel run``.
PROGRESS_EVERY_S = 10.0


def _stop_on_signals(stop: threading.Event) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())


def run_stage(name: str, cfg: TimerConfig) -> int:
    """Run one stage in this process until SIGTERM / SIGINT.

    ``/healthz`` answers from the start; ``/readyz`` once the stage runs and its last step did
    not fail: able to take work, whether or not it owns a shard yet (a shard-owning pod that had
    to own one to be ready would deadlock a one-replica rollout: the new pod cannot own the shard
    until the old one is gone). Ownership is the gauge ``owned_shards``, and each owned shard's
    ``owner_epoch``. On SIGTERM the stage finishes the batch in hand and releases its shards
    before it exits. While Kafka or Redis cannot be reached
    at start the stage waits for them (a pod restarted during a broker restart must not crash
    loop); settings that are wrong (retention, the data directory's format) stop it at once.
    """
    # Before anything connects: the stages that own or read shard state write the deployment file
    # on a first start; the stateless ones check it when it is there (their queue partitions
    # follow the shard count).
    check_settings(cfg.data_dir, DeploymentSettings.of(cfg), fsync=cfg.fsync,
                   create=name in ("enqueue-get", "enqueue-put", "dequeue-get"))
    log = stage_logger(name)
    metrics = registry_for(cfg)
    telemetry.configure_from_env(metrics, stage=name)
    # Unique per process start: a restarted container keeps its host name and often its pid, and
    # the entries its previous life held must be claimable (the old name's heartbeat lapses).
    ctx = StageContext(cfg, SystemClock(), metrics,
                       consumer=f"{name}-{os.uname().nodename}-{os.getpid()}-{secrets.token_hex(3)}",
                       wait_on_inputs=True)
    running: dict[str, Any] = {}

    def on_signal(*_: object) -> None:
        ctx.stop.set()
        if "runner" not in running:
            raise _StopBeforeStart()  # nothing in hand yet: leave a call waiting on Kafka or Redis

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    server = serve_http(cfg, metrics, live=lambda: not ctx.stop.is_set(), ready=lambda: _ready(running))
    try:
        built = _build_when_reachable(name, cfg, ctx)
        if built is None:
            raise _StopBeforeStart()
        transports, stage = built
        sources = {q: transports.queues[q] for q, consumer in CONSUMER_OF.items() if consumer == name}

        wheel_count_every = Every(WHEEL_COUNT_EVERY_S)

        def sample() -> None:
            owned = dict(stage.owned) if isinstance(stage, DequeueGet) else {}
            shards = {sid: st.shard for sid, st in owned.items()}
            sample_gauges(metrics, sources, shards, count_wheel=bool(shards) and wheel_count_every.due(),
                          now_ms=ctx.clock.now_ms() if shards else None)

        # Its own stop: it beats on while the stage drains on SIGTERM, and ends after (``end``).
        heartbeat = Heartbeat(next(iter(transports.queues.values())), ctx.consumer, threading.Event()).start()
        tracked = TrackedStage(stage)
        tune_interpreter()
        heap.tune_malloc()
        ctx.release = heap.release
        runner = StageRunner(name, tracked, ctx, idle_s=WAIT_ON_INPUTS_S, sample=sample)
        running.update(runner=runner, stage=stage, tracked=tracked)
        log.info("started", pid=os.getpid(), http_port=cfg.http_port, shards=cfg.shards)
        try:
            runner.run()
        finally:
            runner.close()
            heartbeat.end()
            transports.commit_log.close()
            log.info("stopped", steps=runner.steps, errors=runner.errors)
    except _StopBeforeStart:
        log.info("stopped before it started")  # as safe as a crash: every stage recovers from one
    finally:
        if server is not None:
            server.close()
    return 0


#: Seconds between two attempts to start a stage while Kafka or Redis cannot be reached.
CONNECT_RETRY_S = 2.0


class _StopBeforeStart(BaseException):  # noqa: N818 - not an error: SIGTERM while starting
    """Raised by the signal handler while the stage is still starting."""


def _build_when_reachable(name: str, cfg: TimerConfig, ctx: StageContext) -> tuple[Transports, Stage] | None:
    """Transports and the stage, retried while Kafka or Redis is unreachable; None if stopped meanwhile.
    Refused credentials or an untrusted certificate are not retried: ``AccessError`` names the setting."""
    from timerwheel.security import check_redis_access
    from timerwheel.transports.kafka.access import check_kafka_access, kafka_unreachable
    from timerwheel.transports.kafka.errors import KafkaLogError
    from timerwheel.transports.redisq import RedisTransportError

    log = stage_logger(name)
    attempts = 0
    while not ctx.stop.is_set():
        require_servers(cfg)
        unreachable = kafka_unreachable(cfg.kafka_bootstrap)
        if unreachable is not None:  # said at once, not after kafka-python's 30 s bootstrap timeout
            attempts += 1
            if attempts in (1, 10) or attempts % 100 == 0:
                log.warning("cannot reach Kafka, waiting for it", bootstrap=cfg.kafka_bootstrap, error=unreachable,
                            attempt=attempts)
            ctx.stop.wait(CONNECT_RETRY_S)
            continue
        check_kafka_access(cfg)
        check_redis_access(cfg)
        transports = production_transports(cfg)
        try:
            return transports, build_stage(name, cfg, ctx, transports)
        except (KafkaLogError, RedisTransportError) as exc:
            transports.commit_log.close()
            attempts += 1
            log.warning("waiting for Kafka and Redis", attempt=attempts, error=str(exc)[:300])
            ctx.stop.wait(CONNECT_RETRY_S)
        except BaseException:
            transports.commit_log.close()
            raise
    return None


class TrackedStage:
    """A stage that remembers whether its last step failed (``/readyz``)."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self.failing = False

    def step(self, timeout_s: float) -> int:
        try:
            work = int(self.stage.step(timeout_s))
        except Stopped:
            raise
        except Exception:
            self.failing = True
            raise
        self.failing = False
        return work

    def close(self) -> None:
        self.stage.close()


def _ready(running: dict[str, Any]) -> bool:
    runner = running.get("runner")
    return runner is not None and runner.steps > 0 and not running["tracked"].failing


def serve_http(cfg: TimerConfig, metrics: Metrics, live: Callable[[], bool],
               ready: Callable[[], bool]) -> HealthServer | None:
    """``/healthz``, ``/readyz`` and ``/metrics`` on ``TW_HTTP_PORT`` (None when it is 0); a port that
    cannot be served is a ``ConfigError`` naming the variable."""
    if not cfg.http_port:
        return None
    try:
        return HealthServer(cfg.http_port, metrics, live=live, ready=ready).start()
    except OSError as exc:
        raise ConfigError("TW_HTTP_PORT", f"cannot serve on port {cfg.http_port}: {exc.strerror or exc}") from None


def run_all_in_one(cfg: TimerConfig, *, production: bool,
                   started: Callable[[HealthServer | None], None] = lambda _server: None) -> int:
    """All five stages in this process until SIGINT / SIGTERM (``timerwheel run``): on the data
    directory's local commit log and in-process queues, or (``production``) on Kafka and Redis.
    ``started`` is called once they run, with the HTTP server (``TW_HTTP_PORT``) if there is one;
    a progress line is logged every PROGRESS_EVERY_S."""
    from timerwheel.security import check_redis_access
    from timerwheel.transports.kafka.access import check_kafka_access, kafka_unreachable

    stop = threading.Event()
    _stop_on_signals(stop)
    transports = None
    if production:
        require_servers(cfg)
        unreachable = kafka_unreachable(cfg.kafka_bootstrap)
        if unreachable is not None:
            raise TimerwheelError(f"cannot reach Kafka at {cfg.kafka_bootstrap} ({unreachable}): is it running, and "
                                   "is --kafka / TW_KAFKA_BOOTSTRAP its address?")
        check_kafka_access(cfg)
        check_redis_access(cfg)
        transports = production_transports(cfg)
        check_timer_topic(cfg, transports.commit_log)
    log = stage_logger("all-in-one" if production else "embedded")
    with EmbeddedTimerwheel(config=cfg, transports=transports) as tw:
        telemetry.configure_from_env(tw.metrics)
        server = serve_http(cfg, tw.metrics, live=lambda: not stop.is_set(), ready=lambda: not stop.is_set())
        try:
            started(server)
            while not stop.wait(PROGRESS_EVERY_S):
                m = tw.metrics
                log.info("progress", scheduled=m.counter("scheduled"), delivered=m.counter("delivered"),
                         rolled=m.counter("rolled"), cancelled=m.counter("cancelled"),
                         dead_lettered=m.counter("dead_lettered"))
        finally:
            if server is not None:
                server.close()
    return 0
