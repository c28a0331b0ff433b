"""Production mode: Kafka and Redis transports, each stage its own process.

``timerwheel stage NAME`` runs one stage, configured by ``TW_*`` environment variables (all
validated before anything starts; a bad one stops the process with one line naming it),
serving ``/healthz``, ``/readyz`` and ``/metrics`` on ``TW_HTTP_PORT``, stopping gracefully
on SIGTERM (the batch in hand is finished, enqueue-put publishes a final checkpoint).
``timerwheel run --kafka B --redis URL`` runs all five in one process on the same transports.

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
from timerwheel.health import HealthServer
from timerwheel.log import stage_logger
from timerwheel.metrics import registry_for
from timerwheel.runtime import (
    PENDING_EVERY_S,
    WAIT_ON_INPUTS_S,
    Every,
    Heartbeat,
    StageRunner,
    sample_gauges,
    tune_interpreter,
)
from timerwheel.stages import DequeueGet, DequeueGetMsg, DequeuePut, EnqueueGet, EnqueuePut, StageContext
from timerwheel.stages.base import Stopped
from timerwheel.stages.codec import CONSUMER_OF, Q_DELIVER, Q_DONE, Q_FETCH, Q_PUT
from timerwheel.stages.dequeue_get import STOP_DRAIN_S
from timerwheel.stages.ownership import Ownership
from timerwheel.store.deployment import DeploymentSettings, check_settings
from timerwheel.transports.base import WorkQueue

#: The timer topic must keep records this much longer than the roll window.
RETENTION_FACTOR = 1.5


def require_servers(cfg: TimerConfig) -> None:
    """Production mode needs both servers named: refused before any connection is tried."""
    if not cfg.kafka_bootstrap:
        raise ConfigError("TW_KAFKA_BOOTSTRAP", "must be set in production mode")
    if not cfg.redis_url:
        raise ConfigError("TW_REDIS_URL", "must be set in production mode")


def production_transports(cfg: TimerConfig) -> Any:
    """Kafka commit log, Redis work queues and Redis leases for ``cfg`` (with its TLS, SASL and
    Redis password settings, see ``timerwheel.security``)."""
    from timerwheel.embedded import Transports
    from timerwheel.security import redis_client
    from timerwheel.transports.kafka.log import KafkaCommitLog
    from timerwheel.transports.redisq import RedisLeaseStore, RedisWorkQueue

    require_servers(cfg)
    client = redis_client(cfg)
    queues: dict[str, WorkQueue] = {name: RedisWorkQueue(client, name, cfg.shards, cfg.queue_bound,
                                                         max_bytes=cfg.queue_bytes)
                                    for name in (Q_PUT, Q_FETCH, Q_DELIVER, Q_DONE)}
    return Transports(KafkaCommitLog.from_config(cfg), queues,
                      RedisLeaseStore(client))


def check_timer_topic(cfg: TimerConfig, commit_log: Any) -> int:
    """Create or check the timer and DLQ topics; refuse a timer topic that would lose rolled messages."""
    partitions = int(commit_log.ensure_topic(cfg.timer_topic, cfg.timer_partitions))
    commit_log.ensure_topic(cfg.dlq_topic, 1)
    retention = commit_log.topic_retention_ms(cfg.timer_topic)
    need = int(cfg.roll_window_ms * RETENTION_FACTOR)
    if retention is not None and 0 <= retention < need:
        raise TimerwheelError(
            f"timer topic {cfg.timer_topic!r} has retention.ms={retention}, below {RETENTION_FACTOR} x "
            f"TW_ROLL_WINDOW_MS ({need}): raise the topic's retention.ms to at least {need} or lower TW_ROLL_WINDOW_MS")
    return partitions


def checkpoint_offsets_of(cfg: TimerConfig) -> Callable[[int], dict[int, int]]:
    """enqueue-get's ``checkpoint_offsets``: a shard's next source offsets from its enqueue.ckpt,
    through a read-only view opened once the shard exists ({} until then)."""
    from timerwheel.store.layout import open_reader_if_exists

    views: dict[int, Any] = {}

    def checkpoint_offsets(shard: int) -> dict[int, int]:
        view = views.get(shard) or open_reader_if_exists(cfg, shard)
        if view is None:
            return {}
        views[shard] = view
        ckpt = view.load_enqueue_checkpoint()
        return dict(ckpt.next_offsets) if ckpt else {}

    return checkpoint_offsets


def build_stage(name: str, cfg: TimerConfig, ctx: StageContext, transports: Any) -> Any:
    from timerwheel.store.layout import open_reader_if_exists, open_shard

    shards = cfg.own_shards or tuple(range(cfg.shards))
    queues = transports.queues
    log = transports.commit_log
    if name == "enqueue-get":
        partitions = check_timer_topic(cfg, log)
        mine = [p for p in range(partitions) if p % cfg.replicas == cfg.replica_index]
        return EnqueueGet(ctx, log, queues[Q_PUT], mine, checkpoint_offsets_of(cfg))
    if name == "enqueue-put":
        check_timer_topic(cfg, log)
        return EnqueuePut(ctx, shards, lambda s: open_shard(cfg, s, writer=True), queues[Q_PUT],
                          Ownership(transports.leases, "enqueue-put", ctx.consumer, cfg.lease_ttl_ms,
                                    members=transports.leases),
                          input_ends=lambda: log.end_offsets(cfg.timer_topic))
    if name == "dequeue-get":
        return DequeueGet(ctx, shards, lambda s: open_reader_if_exists(cfg, s), queues[Q_FETCH], queues[Q_DONE],
                          Ownership(transports.leases, "dequeue-get", ctx.consumer, cfg.lease_ttl_ms,
                                    members=transports.leases), stop_drain_s=STOP_DRAIN_S)
    if name == "dequeue-getmsg":
        return DequeueGetMsg(ctx, log, queues[Q_FETCH], queues[Q_DELIVER], range(cfg.shards))
    if name == "dequeue-put":
        return DequeuePut(ctx, log, queues[Q_DELIVER], queues[Q_DONE], range(cfg.shards))
    raise ConfigError("stage", f"unknown stage {name!r}")


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
    server = None
    if cfg.http_port:
        try:
            server = HealthServer(cfg.http_port, metrics, live=lambda: not ctx.stop.is_set(),
                                  ready=lambda: _ready(running)).start()
        except OSError as exc:
            raise ConfigError("TW_HTTP_PORT", f"cannot serve on port {cfg.http_port}: {exc.strerror or exc}") from None
    try:
        built = _build_when_reachable(name, cfg, ctx)
        if built is None:
            raise _StopBeforeStart()
        transports, stage = built
        sources = {q: transports.queues[q] for q, consumer in CONSUMER_OF.items() if consumer == name}

        pending_every = Every(PENDING_EVERY_S)

        def sample() -> None:
            owned = dict(getattr(stage, "owned", None) or {}) if name == "dequeue-get" else {}
            shards = {sid: st.shard for sid, st in owned.items()}
            sample_gauges(metrics, cfg, sources, shards, bool(shards) and pending_every.due(),
                          now_ms=ctx.clock.now_ms() if shards else None)

        Heartbeat(next(iter(transports.queues.values())), ctx.consumer, ctx.stop).start()
        tracked = _Tracked(stage)
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


def _build_when_reachable(name: str, cfg: TimerConfig, ctx: StageContext) -> tuple[Any, Any] | None:
    """Transports and the stage, retried while Kafka or Redis is unreachable; None if stopped meanwhile.
    Refused credentials or an untrusted certificate are not retried: ``AccessError`` names the setting."""
    from timerwheel.security import check_redis_access
    from timerwheel.transports.kafka.access import check_kafka_access
    from timerwheel.transports.kafka.errors import KafkaLogError
    from timerwheel.transports.redisq import RedisTransportError

    log = stage_logger(name)
    attempts = 0
    while not ctx.stop.is_set():
        require_servers(cfg)
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


class _Tracked:
    """A stage that remembers whether its last step failed (``/readyz``)."""

    def __init__(self, stage: Any) -> None:
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


def run_all_in_one(cfg: TimerConfig) -> int:
    """All five stages in one process over Kafka and Redis (``timerwheel run --kafka --redis``)."""
    from timerwheel.embedded import EmbeddedTimerwheel
    from timerwheel.security import check_redis_access
    from timerwheel.transports.kafka.access import check_kafka_access

    stop = threading.Event()
    _stop_on_signals(stop)
    require_servers(cfg)
    check_kafka_access(cfg)
    check_redis_access(cfg)
    transports = production_transports(cfg)
    check_timer_topic(cfg, transports.commit_log)
    log = stage_logger("all-in-one")
    with EmbeddedTimerwheel(config=cfg, transports=transports) as tw:
        telemetry.configure_from_env(tw.metrics)
        server = None
        if cfg.http_port:
            server = HealthServer(cfg.http_port, tw.metrics, live=lambda: not stop.is_set(), ready=lambda: True).start()
        while not stop.wait(10.0):
            log.info("progress", delivered=tw.metrics.counter("delivered"), scheduled=tw.metrics.counter("scheduled"))
        if server is not None:
            server.close()
    return 0
