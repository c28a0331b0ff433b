"""The wiring both modes share: the transports, and each stage built from the configuration.

A process of either mode makes its ``Transports`` (``local_transports``: the embedded mode's local
commit log, in-process queues and leases; ``production_transports``: Kafka, Redis queues and Redis
leases) and builds its stages with ``build_stage``, which opens the shards through
``store.layout``. The embedded runtime builds all five (``sole``: the only replica of each); a
stage process builds its one, as one replica among others.
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, overload

from timerwheel.clock import Clock, SystemClock
from timerwheel.config import TimerConfig
from timerwheel.errors import ConfigError, SourceMismatchError, TimerwheelError
from timerwheel.stages import DequeueGet, DequeueGetMsg, DequeuePut, EnqueueGet, EnqueuePut, StageContext
from timerwheel.stages.codec import Q_DELIVER, Q_DONE, Q_FETCH, Q_PUT
from timerwheel.stages.dequeue_get import STOP_DRAIN_S
from timerwheel.stages.exactly_once import Deliveries
from timerwheel.stages.ownership import Ownership
from timerwheel.stages.published import TORN_READ_PATIENCE_S
from timerwheel.store import checkpoint
from timerwheel.store.checkpoint import CorruptCheckpointError
from timerwheel.store.deployment import SETTINGS_FILE, Source, load_deployment, store_source
from timerwheel.store.layout import found_shards, open_reader_if_exists, open_shard, shard_dir
from timerwheel.store.shard import ENQUEUE_CKPT
from timerwheel.transports.base import CommitLog, LeaseStore, MemberStore, WorkQueue

#: The work queues between the stages (stages.codec).
QUEUES = (Q_PUT, Q_FETCH, Q_DELIVER, Q_DONE)
#: The timer topic must keep records this much longer than the roll window.
RETENTION_FACTOR = 1.5

Stage = EnqueueGet | EnqueuePut | DequeueGet | DequeueGetMsg | DequeuePut


class Leases(LeaseStore, MemberStore, Protocol):
    """The shards' leases and the member set of their owners' replicas: one store holds both."""


@dataclass
class Transports:
    """What a process's stages talk through: the commit log, the work queues by name, the leases."""

    commit_log: CommitLog
    queues: dict[str, WorkQueue]
    leases: Leases


def local_transports(config: TimerConfig, clock: Clock) -> Transports:
    """The embedded default: a LocalCommitLog in the data directory, in-process queues, file leases."""
    from timerwheel.transports.local.log import LocalCommitLog
    from timerwheel.transports.memory import MemoryLeaseStore, MemoryWorkQueue

    log = LocalCommitLog(Path(config.data_dir) / "log", default_partitions=1, fsync=config.fsync, clock=clock)
    queues: dict[str, WorkQueue] = {
        name: MemoryWorkQueue(name, config.shards, config.queue_bound, max_bytes=config.queue_bytes)
        for name in QUEUES
    }
    # The process holds the data directory's lock (see DataDirLock), so shard leases only need
    # to live in this process; checkpoint epochs keep them growing across restarts.
    return Transports(log, queues, MemoryLeaseStore(SystemClock()))


def require_servers(cfg: TimerConfig) -> None:
    """Production mode needs both servers named: refused before any connection is tried."""
    if not cfg.kafka_bootstrap:
        raise ConfigError("TW_KAFKA_BOOTSTRAP", "must be set in production mode")
    if not cfg.redis_url:
        raise ConfigError("TW_REDIS_URL", "must be set in production mode")


def production_transports(cfg: TimerConfig) -> Transports:
    """Kafka commit log, Redis work queues and Redis leases for ``cfg`` (with its TLS, SASL and
    Redis password settings, see ``timerwheel.security``)."""
    from timerwheel.security import redis_client
    from timerwheel.transports.kafka.log import KafkaCommitLog
    from timerwheel.transports.redisq import RedisLeaseStore, RedisWorkQueue

    require_servers(cfg)
    client = redis_client(cfg)
    queues: dict[str, WorkQueue] = {name: RedisWorkQueue(client, name, cfg.shards, cfg.queue_bound,
                                                         max_bytes=cfg.queue_bytes)
                                    for name in QUEUES}
    return Transports(KafkaCommitLog.from_config(cfg), queues, RedisLeaseStore(client))


def ensure_topics(cfg: TimerConfig, commit_log: CommitLog) -> int:
    """Create the timer and dead-letter topics if they are missing; the timer topic's partitions."""
    partitions = commit_log.ensure_topic(cfg.timer_topic, cfg.timer_partitions)
    commit_log.ensure_topic(cfg.dlq_topic, 1)
    return partitions


def shard_deliveries(cfg: TimerConfig, commit_log: Any) -> Callable[[int], Deliveries] | None:
    """Exactly-once (TW_DELIVERY_GUARANTEE): what makes a shard's transactional releases, its
    progress topic made (one partition per shard) or checked; None at least once. Kafka's
    transactions (``KafkaCommitLog``) or the local log's journal (``LocalCommitLog``, embedded);
    refused on a log with neither."""
    if cfg.delivery_guarantee != "exactly-once":
        return None
    if not hasattr(commit_log, "shard_deliveries"):
        raise ConfigError("delivery_guarantee", f"exactly-once needs a log with transactions or a journal, "
                                                f"not {type(commit_log).__name__}")
    topic = cfg.effective_progress_topic
    partitions = commit_log.ensure_topic(topic, cfg.shards)
    if partitions < cfg.shards:
        raise ConfigError("progress_topic", f"{topic!r} has {partitions} partitions, fewer than TW_SHARDS "
                                            f"({cfg.shards}): one per shard is needed")

    def deliveries(shard: int) -> Deliveries:
        made: Deliveries = commit_log.shard_deliveries(cfg.transactional_id_prefix, topic, shard,
                                                       timeout_ms=cfg.transaction_timeout_ms)
        return made

    return deliveries


def check_timer_topic(cfg: TimerConfig, commit_log: Any) -> int:
    """``ensure_topics`` on Kafka, refusing a timer topic that would lose rolled messages."""
    partitions = ensure_topics(cfg, commit_log)
    retention = commit_log.topic_retention_ms(cfg.timer_topic)
    need = int(cfg.roll_window_ms * RETENTION_FACTOR)
    if retention is not None and 0 <= retention < need:
        raise TimerwheelError(
            f"timer topic {cfg.timer_topic!r} has retention.ms={retention}, below {RETENTION_FACTOR} x "
            f"TW_ROLL_WINDOW_MS ({need}): raise the topic's retention.ms to at least {need} or lower TW_ROLL_WINDOW_MS")
    return partitions


def check_source(cfg: TimerConfig, commit_log: CommitLog, *, adopt: bool, production: bool) -> Source:
    """Refuse shards written from another source than ``commit_log``'s timer topic; the source.

    The shards' checkpointed offsets and TimerLog positions point into one incarnation of the
    timer topic: read against another (another cluster, the topic deleted and made again, a
    volume kept across ``make down``), enqueue-get would resume past records it never read and
    dequeue-getmsg would fetch other records at those positions. So a start is refused
    (``SourceMismatchError``, one line naming both values and ``timerwheel rebase``) when the
    deployment file records another cluster id or timer topic id, or when an enqueue checkpoint
    resumes a partition beyond its end (caught also where no source is recorded yet). With
    ``adopt`` (the stages that write the deployment file, once it is written) the source is
    recorded when none is, when no shard exists yet, or to fill in an id the log could not tell
    before."""
    current = Source(commit_log.cluster_id(), commit_log.topic_id(cfg.timer_topic))
    deployment = load_deployment(cfg.data_dir)  # one read: another node may replace the file meanwhile
    stored = deployment[1] if deployment is not None else None
    shards = found_shards(cfg.data_dir)
    if shards:
        wrong = stored.differences(current) if stored is not None else []
        if wrong:
            raise SourceMismatchError(
                f"data directory {cfg.data_dir} holds shards written from another "
                f"{'Kafka cluster or timer topic' if production else 'local commit log'} ({'; '.join(wrong)}; see "
                f"{SETTINGS_FILE}): {_rebase_advice(cfg, production)}")
        beyond = offsets_beyond_end(cfg, commit_log)
        if beyond:
            raise SourceMismatchError(
                f"data directory {cfg.data_dir} holds shards whose checkpoints are beyond the end of timer topic "
                f"{cfg.timer_topic!r} ({'; '.join(beyond[:4])}{'; ...' if len(beyond) > 4 else ''}): it is not the "
                f"topic they were written from (made again, or another cluster's): {_rebase_advice(cfg, production)}")
    if adopt and deployment is not None and stored != current:
        if shards and stored is not None:  # the same source: keep what was known, add what is
            current = Source(current.cluster_id or stored.cluster_id, current.timer_topic_id or stored.timer_topic_id)
        if current != stored:
            store_source(cfg.data_dir, current, fsync=cfg.fsync, settings=deployment[0])
    return current


def offsets_beyond_end(cfg: TimerConfig, commit_log: CommitLog) -> list[str]:
    """``shard S partition P resumes at O, the partition ends at E`` for each partition that an
    enqueue checkpoint of the data directory resumes beyond the timer topic's end."""
    # The checkpoints first, the ends then: a running enqueue-put checkpoints offsets the topic
    # had reached when it read them, and ends only grow (the other order refused a live volume).
    offsets_of = checkpoint_offsets_of(cfg)
    resumes = {shard: sorted(_patiently(offsets_of, shard).items()) for shard in found_shards(cfg.data_dir)}
    ends = commit_log.end_offsets(cfg.timer_topic)
    return [f"shard {shard} partition {p} resumes at {offset}, "
            + (f"the partition ends at {ends[p]}" if p in ends else "the topic has no such partition")
            for shard, offsets in resumes.items() for p, offset in offsets if offset > ends.get(p, -1)]


def _patiently(read: Callable[[int], dict[int, int]], shard: int) -> dict[int, int]:
    """``read(shard)``, read again while the checkpoint reads torn (another node's rename seen half on
    a shared volume), for at most TORN_READ_PATIENCE_S; then its error."""
    deadline = time.monotonic() + TORN_READ_PATIENCE_S
    while True:
        try:
            return read(shard)
        except CorruptCheckpointError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def _rebase_advice(cfg: TimerConfig, production: bool) -> str:
    command = f"timerwheel rebase --data-dir {shlex.quote(cfg.data_dir)}"
    if production:
        command += f" --kafka {cfg.kafka_bootstrap} --redis URL"
    elsewhere = "point TW_KAFKA_BOOTSTRAP back at the cluster they were written from, or " if production else ""
    return (f"{elsewhere}with every stage stopped run `{command}`: it sets these shards aside and schedules "
            f"{cfg.timer_topic!r} from its start; the messages still pending in the old shards are not delivered "
            "(their timer records are not in this topic), and records of this topic that another timerwheel already "
            "delivered are delivered again")


def checkpoint_offsets_of(cfg: TimerConfig) -> Callable[[int], dict[int, int]]:
    """enqueue-get's ``checkpoint_offsets``: a shard's next source offsets from its published
    enqueue checkpoint ({} while it has none), read without opening the shard."""
    found: checkpoint.LoadMemo = {}

    def checkpoint_offsets(shard: int) -> dict[int, int]:
        ckpt = checkpoint.load_enqueue(os.path.join(shard_dir(cfg.data_dir, shard), ENQUEUE_CKPT), found)
        return dict(ckpt.next_offsets) if ckpt else {}

    return checkpoint_offsets


@overload
def build_stage(name: Literal["enqueue-get"], cfg: TimerConfig, ctx: StageContext, transports: Transports, *,
                sole: bool = ...) -> EnqueueGet: ...
@overload
def build_stage(name: Literal["enqueue-put"], cfg: TimerConfig, ctx: StageContext, transports: Transports, *,
                sole: bool = ...) -> EnqueuePut: ...
@overload
def build_stage(name: Literal["dequeue-get"], cfg: TimerConfig, ctx: StageContext, transports: Transports, *,
                sole: bool = ...) -> DequeueGet: ...
@overload
def build_stage(name: Literal["dequeue-getmsg"], cfg: TimerConfig, ctx: StageContext, transports: Transports, *,
                sole: bool = ...) -> DequeueGetMsg: ...
@overload
def build_stage(name: Literal["dequeue-put"], cfg: TimerConfig, ctx: StageContext, transports: Transports, *,
                sole: bool = ...) -> DequeuePut: ...
@overload
def build_stage(name: str, cfg: TimerConfig, ctx: StageContext, transports: Transports, *,
                sole: bool = ...) -> Stage: ...
def build_stage(name: str, cfg: TimerConfig, ctx: StageContext, transports: Transports, *,
                sole: bool = False) -> Stage:
    """The stage ``name`` over ``transports``, its shards opened through ``store.layout``.

    ``sole``: this process runs every stage and is the only replica of each (the embedded
    runtime, ``timerwheel run``): it owns every shard from the start and reads every timer
    partition; its caller has made (and on Kafka checked) the topics and checked the source
    (``check_source``). Else the stage is one
    replica among others (``timerwheel stage``): the shard-owning stages balance ``TW_OWN_SHARDS``
    (default every shard) with the other replicas through the member set and dequeue-get drains
    its shards for their next owner when it stops; enqueue-get reads its share of the timer
    partitions (``TW_REPLICAS``, ``TW_REPLICA_INDEX``); the timer topic and the source of the
    shards (``check_source``) are checked first.
    """
    shards = tuple(range(cfg.shards)) if sole else cfg.own_shards or tuple(range(cfg.shards))
    queues, log = transports.queues, transports.commit_log
    members = None if sole else transports.leases
    if name in ("enqueue-get", "enqueue-put"):
        partitions = ensure_topics(cfg, log) if sole else check_timer_topic(cfg, log)
    if not sole and name in ("enqueue-get", "enqueue-put", "dequeue-getmsg"):  # they read the timer topic
        check_source(cfg, log, adopt=name != "dequeue-getmsg", production=True)
    if name == "enqueue-get":
        mine = range(partitions) if sole else [p for p in range(partitions) if p % cfg.replicas == cfg.replica_index]
        return EnqueueGet(ctx, log, queues[Q_PUT], mine, checkpoint_offsets_of(cfg))
    if name == "enqueue-put":
        return EnqueuePut(ctx, shards, lambda s: open_shard(cfg, s, writer=True), queues[Q_PUT],
                          Ownership(transports.leases, "enqueue-put", ctx.consumer, cfg.lease_ttl_ms, members=members),
                          input_ends=lambda: log.high_watermarks(cfg.timer_topic))
    if name == "dequeue-get":
        return DequeueGet(ctx, shards, lambda s: open_reader_if_exists(cfg, s), queues[Q_FETCH], queues[Q_DONE],
                          Ownership(transports.leases, "dequeue-get", ctx.consumer, cfg.lease_ttl_ms, members=members),
                          stop_drain_s=0.0 if sole else STOP_DRAIN_S)
    if name == "dequeue-getmsg":
        return DequeueGetMsg(ctx, log, queues[Q_FETCH], queues[Q_DELIVER], range(cfg.shards))
    if name == "dequeue-put":
        deliveries = shard_deliveries(cfg, log)
        return DequeuePut(ctx, log, queues[Q_DELIVER], queues[Q_DONE], range(cfg.shards),
                          lambda s: open_reader_if_exists(cfg, s), stop_drain_s=0.0 if sole else STOP_DRAIN_S,
                          deliveries=deliveries,
                          ownership=None if deliveries is None else Ownership(
                              transports.leases, "dequeue-put", ctx.consumer, cfg.lease_ttl_ms, members=members))
    raise ConfigError("stage", f"unknown stage {name!r}")
