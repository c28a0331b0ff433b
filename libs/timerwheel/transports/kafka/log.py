"""KafkaCommitLog: the production commit log, Apache Kafka through kafka-python.

A facade over the package's parts, each with its own guarantees in its header:

- ``producer.Appender``: ``append`` (durable, per-record outcome, never blocked by a missing
  destination) and ``append_atomic`` (one transaction: ``AtomicLog``);
- ``transactions.DeadLetters``: ``dead_letter_once`` (enqueue-get's dead letters in per-partition
  transactions: ``DeadLetterLog``);
- ``reader.Reader``: ``read`` by (partition, offset), dequeue-getmsg's hot path, served from the
  ``ReadCache`` first; ``follow`` (``FollowingLog``) adds a ``follower.Follower`` that reads the
  topic ahead into the same cache;
- ``consumers``: ``consumer`` (from the caller's offsets) and ``group_consumer`` (a group member);
- ``admin.Topics``: topics, partition counts, retention.

Every codec a producer may have used is decodable (``codecs.check_codecs`` refuses to build a log
otherwise, naming the library). The clients are created lazily and each is guarded by its own
lock: one ``KafkaCommitLog`` may be shared by a stage's threads.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from kafka import TopicPartition

from timerwheel.clock import Clock
from timerwheel.config import KAFKA_COMPRESSIONS, TimerConfig
from timerwheel.log import stage_logger
from timerwheel.records import OutRecord, Record
from timerwheel.transports.kafka.admin import Topics
from timerwheel.transports.kafka.clients import BATCHED_FETCH, KafkaClients
from timerwheel.transports.kafka.codecs import check_codecs
from timerwheel.transports.kafka.consumers import KafkaConsumerAdapter, KafkaGroupConsumer
from timerwheel.transports.kafka.errors import KafkaLogError, kafka_call
from timerwheel.transports.kafka.follower import Follower
from timerwheel.transports.kafka.producer import Appender
from timerwheel.transports.kafka.reader import Reader
from timerwheel.transports.kafka.transactions import (
    DELIVERY_TRANSACTION_TIMEOUT_MS,
    DeadLetters,
    ShardDeliveries,
)
from timerwheel.transports.readcache import DEFAULT_MAX_BYTES, DEFAULT_MAX_RECORDS, ReadCache

__all__ = ["KafkaCommitLog"]


class KafkaCommitLog:
    """``CommitLog`` on a Kafka cluster (also ``GroupCommitLog``, ``FollowingLog``, ``AtomicLog``,
    ``DeadLetterLog``).
    See the module header and those of its parts for the guarantees."""

    def __init__(
        self,
        bootstrap: str,
        *,
        client_id: str = "timerwheel",
        clock: Clock | None = None,
        request_timeout_s: float = 30.0,
        read_timeout_s: float = 15.0,
        read_gap: int = 50,
        read_cache_records: int = DEFAULT_MAX_RECORDS,
        read_cache_bytes: int = DEFAULT_MAX_BYTES,
        fetch_bytes: int = 4 * 1024 * 1024,
        max_request_size: int = 1024 * 1024,
        stall_timeout_s: float = 8.0,
        compression: str = "none",
        metadata_wait_s: float = 0.5,
        creating_wait_s: float = 15.0,
        missing_topic_recheck_s: float = 5.0,
        security: Mapping[str, Any] | None = None,
    ) -> None:
        if not bootstrap:
            raise ValueError("KafkaCommitLog: bootstrap must name at least one broker, got ''")
        if compression not in KAFKA_COMPRESSIONS:
            raise ValueError(f"KafkaCommitLog: compression must be one of {', '.join(KAFKA_COMPRESSIONS)}, "
                             f"got {compression!r}")
        check_codecs()
        self.bootstrap = bootstrap
        self._clients = KafkaClients(bootstrap, client_id, request_timeout_s, fetch_bytes, security)
        self.topics = Topics(self._clients, missing_topic_recheck_s)
        self.appender = Appender(self._clients, self.topics, clock=clock,
                                 compression=None if compression == "none" else compression,
                                 max_request_size=max_request_size, stall_timeout_s=stall_timeout_s,
                                 metadata_wait_s=metadata_wait_s, creating_wait_s=creating_wait_s)
        self.dead_letters = DeadLetters(self._clients, self.topics,
                                        compression=None if compression == "none" else compression,
                                        max_request_size=max_request_size)
        self._compression = None if compression == "none" else compression
        self._max_request_size = max_request_size
        #: Records read before (walked past by a read, or read ahead by the follower), for ``read``.
        self.read_cache = ReadCache(read_cache_records, read_cache_bytes)
        self.reader = Reader(self._clients, self.read_cache, read_timeout_s=read_timeout_s, read_gap=read_gap)
        #: The thread ``follow`` started (None until then, and once closed).
        self.follower: Follower | None = None

    @classmethod
    def from_config(cls, cfg: TimerConfig, bootstrap: str | None = None, **options: Any) -> KafkaCommitLog:
        """The commit log on ``cfg.kafka_bootstrap`` (or ``bootstrap``) with ``cfg``'s compression
        and security settings: how every part of timerwheel connects to Kafka."""
        from timerwheel.security import kafka_client_options

        options.setdefault("compression", cfg.kafka_compression)
        options.setdefault("read_cache_bytes", cfg.read_cache_bytes)
        options.setdefault("fetch_bytes", cfg.batch_bytes)
        return cls(bootstrap or cfg.kafka_bootstrap, security=kafka_client_options(cfg), **options)

    # -- topics ------------------------------------------------------------------------------

    def ensure_topic(self, topic: str, partitions: int, *, configs: Mapping[str, str] | None = None) -> int:
        """Create ``topic`` with ``partitions`` partitions (and topic ``configs`` such as
        ``retention.ms``) if it is missing; return its partition count. An existing topic is
        left as it is, whatever its count."""
        return self.topics.ensure(topic, partitions, configs)

    def partitions(self, topic: str) -> int:
        return self.topics.partitions(topic)

    def partition_count(self, topic: str) -> int | None:
        return self.topics.partition_count(topic)

    def topic_retention_ms(self, topic: str) -> int | None:
        """The topic's effective ``retention.ms``; None when unlimited. The service refuses to
        start when this is under roll window x 1.5."""
        return self.topics.retention_ms(topic)

    # -- identity: which cluster, which incarnation of a topic (the deployment file records both) --

    def cluster_id(self) -> str | None:
        return self.topics.cluster_id()

    def topic_id(self, topic: str) -> str | None:
        return self.topics.topic_id(topic)

    def end_offsets(self, topic: str) -> dict[int, int]:
        found = self.reader.list_offsets(self.topics.topic_partitions(topic), beginning=False)
        return {tp.partition: o for tp, o in found.items()}

    def high_watermarks(self, topic: str) -> dict[int, int]:
        """The high watermarks (ListOffsets at ``read_uncommitted``): above ``end_offsets`` while
        a transaction is open on a partition. enqueue-put's ``W`` waits for these."""
        found = self.reader.high_watermarks(self.topics.topic_partitions(topic))
        return {tp.partition: o for tp, o in found.items()}

    def start_offsets(self, topic: str) -> dict[int, int]:
        found = self.reader.list_offsets(self.topics.topic_partitions(topic), beginning=True)
        return {tp.partition: o for tp, o in found.items()}

    # -- writing and reading -----------------------------------------------------------------

    def append(self, records: Sequence[OutRecord]) -> list[tuple[int, int]]:
        return self.appender.append(records)

    def append_atomic(self, records: Sequence[OutRecord], transactional_id: str) -> list[tuple[int, int]]:
        """Append ``records`` in one Kafka transaction under ``transactional_id`` (a short
        transaction timeout: ``producer`` module header): a ``read_committed`` reader (every
        stage) sees all of them or none."""
        return self.appender.append_atomic(records, transactional_id)

    def dead_letter_once(self, prefix: str, source_topic: str, partition: int,
                         letters: Sequence[tuple[int, OutRecord]]) -> int:
        """enqueue-get's dead letters of one timer partition, once each (``transactions`` module header)."""
        return self.dead_letters.write(prefix, source_topic, partition, letters)

    def shard_deliveries(self, prefix: str, progress_topic: str, shard: int, *,
                         timeout_ms: int = DELIVERY_TRANSACTION_TIMEOUT_MS) -> ShardDeliveries:
        """Exactly-once releases of ``shard`` under ``<prefix>-deliver-<shard>``, their progress on
        ``progress_topic`` (``transactions.ShardDeliveries``)."""
        return ShardDeliveries(self._clients, lambda t, p, since: self.read_since(t, p, since), prefix, progress_topic,
                               shard, timeout_ms=timeout_ms, compression=self._compression,
                               max_request_size=self._max_request_size)

    def read(self, topic: str, positions: Sequence[tuple[int, int]]) -> list[Record | None]:
        return self.reader.read(topic, positions)

    def read_since(self, topic: str, partition: int, since_ms: int, *, timeout_s: float = 30.0) -> list[Record]:
        """The committed records of ``topic``'s ``partition`` from the first whose timestamp is at
        least ``since_ms`` (``offsets_for_times``) to the partition's end as of the call (its last
        stable offset: ``read_committed``). A new shard owner reads its progress back with it
        (``timerwheel.progress``). ``KafkaLogError`` if the end is not reached within ``timeout_s``."""
        tp = TopicPartition(topic, partition)
        with kafka_call(f"offsets of {topic!r} partition {partition} since {since_ms}"):
            probe = self._clients.consumer(f"since-{topic}")
            try:
                found = probe.offsets_for_times({tp: since_ms}, timeout_ms=self._clients.request_timeout_ms)
                end: int = probe.end_offsets([tp], timeout_ms=self._clients.request_timeout_ms)[tp]
            finally:
                probe.close(autocommit=False)
        at = found.get(tp)
        start = end if at is None else min(at.offset, end)
        out: list[Record] = []
        consumer = self.consumer(topic, {partition: start})
        deadline = time.monotonic() + timeout_s
        try:
            while consumer.position(partition) < end:
                if time.monotonic() > deadline:
                    raise KafkaLogError(f"reading {topic!r} partition {partition} from {start} did not reach "
                                        f"{end} within {timeout_s:g} s")
                out += [r for r in consumer.poll(10_000, 0.5) if r.offset < end]
        finally:
            consumer.close()
        return out

    def follow(self, topic: str) -> None:
        """Read ``topic`` ahead from its end, in a thread of its own, into the cache that ``read``
        serves from. Off again by itself while few of the records it keeps are asked for."""
        if not self.read_cache.enabled or self.follower is not None:
            return
        self._clients.check_open()
        self.follower = Follower(self._clients, self.read_cache, topic, self.topics.topic_partitions)
        self.follower.start()

    # -- consumers ---------------------------------------------------------------------------

    def consumer(self, topic: str, offsets: Mapping[int, int], *, keep: bool = True,
                 monitor_group: str | None = None) -> KafkaConsumerAdapter:
        """A consumer of ``topic`` at ``offsets``. With ``monitor_group``, ``commit_positions``
        records progress in that group for monitoring only; resumption uses the caller's
        checkpoints. ``keep`` is the Protocol's: a Kafka consumer never keeps what it reads."""
        with kafka_call(f"consumer for topic {topic!r}"):
            return KafkaConsumerAdapter(
                lambda: self._clients.consumer(f"consumer-{topic}", group_id=monitor_group, **BATCHED_FETCH),
                topic, offsets, monitor_group)

    def group_consumer(self, group: str, topics: Sequence[str],
                       options: Mapping[str, object] | None = None) -> KafkaGroupConsumer:
        """A member of consumer group ``group`` subscribed to ``topics`` (``GroupConsumer``):
        offsets are committed only by ``commit``; ``options`` are more ``KafkaConsumer`` settings
        (``group_instance_id``, ``session_timeout_ms``, ``auto_offset_reset``, ...)."""
        settings: dict[str, Any] = {"group_id": group, **(options or {})}
        consumer = self._clients.consumer(f"group-{group}", **settings)
        with kafka_call(f"subscribe group {group!r} to {', '.join(topics)}"):
            consumer.subscribe(list(topics))
            _await_partitions(consumer, group, topics)
        return KafkaGroupConsumer(consumer, group)

    def close(self) -> None:
        self._clients.closed = True
        if self.follower is not None:
            self.follower.stop()
            self.follower = None
        self.appender.close()
        self.dead_letters.close()
        self.reader.close()
        self.topics.close()


#: How long a new group member waits for its topics' partitions before its first join.
GROUP_METADATA_WAIT_S = 10.0


def _await_partitions(consumer: Any, group: str, topics: Sequence[str]) -> None:
    """Have the member's metadata hold every subscribed topic's partitions before its first poll.

    kafka-python 3.0.12 (the newest) joins again when a topic's first metadata arrives after the
    member joined (``need_rejoin``: the assignment's snapshot differs), and loses that second
    assignment when a ``poll`` times out between the leader computing it and the SyncGroup
    answer: the next poll finds nothing left to join, and the member holds no partitions until
    the group next rebalances. With the metadata in first, the first join is the only one. A
    topic still missing after ``GROUP_METADATA_WAIT_S`` (created later, or never) is logged and
    waited for by kafka-python itself."""
    deadline = time.monotonic() + GROUP_METADATA_WAIT_S
    missing = list(topics)
    while missing:
        missing = [t for t in missing if not consumer.partitions_for_topic(t)]
        if missing and time.monotonic() >= deadline:
            stage_logger("kafka").warning("a group's topics have no partitions yet; joining without them",
                                          group=group, topics=missing)
            return
        if missing:
            time.sleep(0.1)
