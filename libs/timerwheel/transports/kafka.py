"""The production commit log: Apache Kafka through kafka-python.

What it guarantees:

- ``append`` is durable when it returns: an idempotent producer with ``acks=all`` (no duplicates
  from the producer's own retries, order kept per partition). It waits for every record and
  raises ``KafkaLogError`` if any failed; the error's ``written`` list says which were acknowledged,
  so a caller can retry only the rest (RocketMQ #6984 retried whole batches and duplicated).
- ``read`` is dequeue-getmsg's hot path: positions are grouped per partition, one reused consumer
  is assigned to them, seeks to the lowest wanted offset of each and polls every partition in the
  same fetch requests, jumping forward (seek) over gaps longer than ``read_gap`` records. ``None``
  means the record is gone for good: before the log start (retention, delete-records), beyond the
  end, or an offset the log skips (compaction, transaction markers). A record that exists but
  cannot be fetched in time (broker down) raises ``KafkaLogError`` instead: never ``None``,
  which would send a live message to the dead-letter topic.
- Records a ``read`` walks past without wanting them are kept (``read_cache_records`` of them
  and ``read_cache_bytes`` at most, TW_READ_CACHE_BYTES, the oldest dropped first) and served to a later ``read`` without a fetch. Messages due close
  together were produced close together: at 1,000 msg/s with delays of 0.2-5 s, each slot's
  wanted offsets are spread thinly over the last five seconds of the log, so without this every
  slot decoded those seconds again (~50 records walked per record wanted, more than a core).
  A record served from here is dropped from it (a message is delivered once); offsets never
  change in Kafka, so a kept record is never stale.
- ``follow(topic)`` (dequeue-getmsg calls it for the timer topic) fills the same cache ahead of
  time from a thread of its own that consumes the topic from its end: a message due a few
  seconds after it was produced is then in memory when its slot fires, and the slot's read
  makes no round trip to the broker. The follower judges itself every 20,000 records it keeps
  and pauses for two minutes when the reads took fewer than a quarter of them (delays longer
  than the cache holds), so long delays do not pay a second decode per record for nothing.
- Consumers from ``consumer`` read assigned partitions from offsets the caller owns (its
  checkpoints); nothing is committed to a group unless ``monitor_group`` asks for it, and then
  only so that standard lag tools can see progress. ``group_consumer`` (``timerwheel.retry``) is
  a real group member instead: Kafka assigns its partitions and it commits what it is told to.
- Every client reconnects on its own after a broker restart; calls made while the broker is away
  raise ``KafkaLogError`` after their timeout and the stages retry.
- Producers in the field compress (gzip, snappy, lz4, zstd) and write in transactions. Every
  codec is decodable (``check_codecs`` refuses to build a log otherwise, naming the library), and
  every consumer reads ``read_committed``: aborted records are never returned, and the offsets
  that hold no record for the reader (transaction markers, aborted or compacted records) are
  skipped. A consumer reports its *position* (the next offset to read), not "last offset + 1",
  so that a caller can tell a gap it skipped on purpose from records lost on the way.
- A batch that cannot be decoded (corruption, a codec added to Kafka later) stops only its own
  partition: the consumer pauses it, reports it in ``undecodable`` with its offset and the
  reason, retries it every ``UNDECODABLE_RETRY_S``, and goes on reading the others.
- ``append`` never blocks on a destination that does not exist: the metadata of every new topic
  of a batch is asked for in one round trip (a fan-out to hundreds of new topics costs one
  wait, not one per topic), and records whose topic is still unknown after ``metadata_wait_s``
  are not sent: they come back in ``KafkaLogError.missing`` for the caller to hold or
  dead-letter, while the batch's other records are written.

The clients are created lazily and each is guarded by its own lock: one ``KafkaCommitLog`` may
be shared by a stage's threads.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import kafka.errors as kafka_errors
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType

from timerwheel.clock import Clock
from timerwheel.config import KAFKA_COMPRESSIONS as COMPRESSIONS
from timerwheel.config import TimerConfig
from timerwheel.errors import AccessError, TimerwheelError
from timerwheel.log import stage_logger
from timerwheel.records import OutRecord, Record

__all__ = ["KafkaCommitLog", "KafkaConsumerAdapter", "KafkaGroupConsumer", "KafkaLogError"]

_TOPIC_EXISTS = 36
_UNKNOWN_TOPIC = 3  # UNKNOWN_TOPIC_OR_PARTITION
#: The topic id a broker without topic ids reports.
_NO_TOPIC_ID = "00000000-0000-0000-0000-000000000000"

# Random reads are bound by kafka-python decoding every record it walks past (~20 us each, more
# without the crc32c package): a fetch starts at the batch holding the wanted offset, and the
# consumer decodes up to the offset and as far as a poll takes. So: small fetches, small polls
# (records polled but not wanted are decoded for nothing), and a seek over any gap longer than
# ``read_gap`` records (default 50, about what one seek costs). Measured on 2 cores with crc32c:
# contiguous runs ~21-24k records/s, 500 positions scattered over 4 x 50k offsets ~300/s.
# crc32c (a dependency) makes the batch CRC check native; without it the pure-Python CRC took half
# of every read: 8 random positions over 4 x 1k offsets 240 ms -> 62 ms a call, 500 of them
# 580 ms -> 125 ms, and the five-process pipeline could not keep up with 60 msg/s without it.
#: Errors that refuse one record for good: retrying it cannot succeed. (``ValueError`` and
#: ``TypeError`` are kafka-python's for a record it cannot encode.)
_REFUSED = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordListTooLargeError,
    kafka_errors.InvalidTopicError,
    kafka_errors.InvalidRecordError,
    kafka_errors.UnsupportedForMessageFormatError,
    ValueError,
    TypeError,
)

#: Consumers that follow a topic fetch in batches: a fetch answered per record arriving costs
#: the broker more CPU than anything else at a steady rate; 20 ms is well inside a tick.
_BATCHED_FETCH = {"fetch_min_bytes": 64 * 1024, "fetch_max_wait_ms": 20}
#: ... but an idle consumer would then fetch 50 times a second for nothing: while its caller
#: waits on the poll, the broker holds the fetch until the first record arrives (answered at
#: once, so no record waits) or ``fetch_max_wait_ms`` passes.
_LONG_POLL_FETCH = {"fetch_min_bytes": 1, "fetch_max_wait_ms": 500}


def _fetch_mode(consumer: Any, waiting: bool) -> None:
    """Fetch batched (``_BATCHED_FETCH``) while records flow, long polls (``_LONG_POLL_FETCH``)
    while idle. kafka-python's fetcher reads these settings for each fetch it sends."""
    config = getattr(getattr(consumer, "_fetcher", None), "config", None)
    if isinstance(config, dict):
        config.update(_LONG_POLL_FETCH if waiting else _BATCHED_FETCH)

_READ_FETCH_BYTES = 64 * 1024
#: A consumer's fetch is TW_BATCH_BYTES, at most this (more buys nothing, and Kafka's field is an int32).
_FETCH_MAX_BYTES = 16 * 1024 * 1024
_READ_POLL_RECORDS = 200


class KafkaLogError(TimerwheelError):
    """A Kafka call failed or timed out. Retriable: the stages back off and call again.

    For ``append``, ``written[i]`` is ``(partition, offset)`` for each record that did land and
    ``None`` for each that did not.
    """

    def __init__(self, message: str, written: list[tuple[int, int] | None] | None = None,
                 refused: dict[int, str] | None = None, missing: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.written = written or []
        #: index -> why Kafka refuses that record for good (too large, invalid topic): retrying
        #: it cannot help; the caller dead-letters it instead.
        self.refused = refused or {}
        #: index -> the destination topic of a record that was not sent because the topic does
        #: not exist (no metadata within ``metadata_wait_s``); the caller holds or dead-letters it.
        self.missing = missing or {}


class KafkaCodecError(TimerwheelError):
    """A Kafka compression codec cannot be decoded here: a library is missing."""


#: Kafka's codecs beyond gzip, the pip package kafka-python decodes each with, and its probe.
_CODEC_LIBRARIES = (("snappy", "python-snappy", "has_snappy"), ("lz4", "lz4", "has_lz4"),
                    ("zstd", "zstandard", "has_zstd"))


def check_codecs() -> None:
    """Raise ``KafkaCodecError`` naming each codec that kafka-python cannot decode here.

    A producer may compress with any of Kafka's codecs; without its library the first such batch
    fails every poll of its partition (``UnsupportedCodecError``), and everything behind it on
    that partition stalls. So a process that reads Kafka refuses to start instead."""
    from kafka import codec

    missing = [f"{name} (pip install {package})" for name, package, probe in _CODEC_LIBRARIES
               if not getattr(codec, probe)()]
    if missing:
        raise KafkaCodecError(f"Kafka compression codecs cannot be decoded, a library is missing: "
                              f"{', '.join(missing)}")


def _to_record(rec: Any) -> Record:
    return Record(
        topic=rec.topic,
        partition=rec.partition,
        offset=rec.offset,
        timestamp_ms=rec.timestamp,
        key=rec.key,
        value=rec.value,
        headers=tuple((k, bytes(v) if v is not None else b"") for k, v in rec.headers or ()),
    )


def _refusal(exc: BaseException) -> str:
    """Why Kafka refused a record, for its dead letter."""
    return f"{type(exc).__name__}: {exc}"[:300]


def _close_producer(producer: Any, timeout_s: float) -> None:
    """Close, dropping whatever could not be sent within the timeout (kafka-python's own close
    raises then, and leaves its I/O thread running)."""
    try:
        producer.close(timeout=timeout_s)
        return
    except kafka_errors.KafkaError:
        pass
    sender = getattr(producer, "_sender", None)
    if sender is not None:
        sender.force_close()  # fails the pending records' futures, stops the I/O thread
        sender.join(5)
    with suppress(kafka_errors.KafkaError):
        producer.close(timeout=0)


#: Errors of one batch that cannot be decoded: its partition is set aside, the others go on.
_UNDECODABLE = (kafka_errors.CorruptRecordError, kafka_errors.UnsupportedCodecError)
#: A partition set aside for a batch it could not decode is tried again this often.
UNDECODABLE_RETRY_S = 30.0


@dataclass
class Undecodable:
    """A partition whose next batch cannot be decoded: where, why, since when, tries so far."""

    partition: int
    offset: int
    reason: str
    since: float
    tries: int = 1


def _fetch_position(consumer: Any, tp: TopicPartition) -> int | None:
    """The consumer's next offset to read for ``tp`` without a network call (None if unknown).
    kafka-python keeps it in its subscription state; ``position()`` may block on the network."""
    state = consumer._subscription.assignment.get(tp)
    position = state.position if state is not None else None
    return None if position is None else int(position.offset)


def _failing_partition(consumer: Any) -> TopicPartition | None:
    """The partition whose records a failed ``poll`` was decoding (kafka-python's fetcher keeps the
    partition it is draining); None if it cannot be told."""
    part = getattr(getattr(consumer, "_fetcher", None), "_next_partition_records", None)
    tp = getattr(part, "topic_partition", None)
    return tp if isinstance(tp, TopicPartition) else None


class KafkaConsumerAdapter:
    """``Consumer`` over some partitions of one topic, positioned by the caller.

    ``position`` is Kafka's own fetch position: past transaction markers and aborted records too,
    so a caller sees such offsets as skipped, not lost. A batch that cannot be decoded sets its
    partition aside (``undecodable``) and the others go on; the set-aside partition is retried
    every ``UNDECODABLE_RETRY_S`` from the same offset (a new consumer, so nothing of the failed
    fetch is kept)."""

    def __init__(self, make_consumer: Callable[[], Any], topic: str, offsets: Mapping[int, int],
                 monitor_group: str | None) -> None:
        self._make_consumer = make_consumer
        self._topic = topic
        self._monitor_group = monitor_group
        self._positions: dict[int, int] = dict(offsets)
        #: partition -> why it is set aside (a batch it cannot decode).
        self.undecodable: dict[int, Undecodable] = {}
        #: Set-aside partitions being tried again; one that reads past its offset decodes again.
        self._retrying: dict[int, Undecodable] = {}
        self._consumer: Any = None
        #: The consumer fetches in long polls (``_fetch_mode``): the last poll had a timeout.
        self._waiting = False
        self._assign()

    def _assign(self) -> None:
        """(Re)build the consumer over the partitions not set aside, at their positions."""
        if self._consumer is None:
            self._consumer = self._make_consumer()
        active = [p for p in self._positions if p not in self.undecodable]
        self._consumer.assign([TopicPartition(self._topic, p) for p in active])
        for p in active:
            self._consumer.seek(TopicPartition(self._topic, p), self._positions[p])

    def poll(self, max_records: int, timeout_s: float) -> list[Record]:
        if self.undecodable:
            self._retry_undecodable()
        consumer = self._consumer
        waiting = timeout_s > 0
        if waiting != self._waiting:
            _fetch_mode(consumer, waiting)
            self._waiting = waiting
        try:
            batches = consumer.poll(timeout_ms=max(0, int(timeout_s * 1000)), max_records=max_records)
        except _UNDECODABLE as exc:
            self._set_aside(exc)
            return []
        except kafka_errors.KafkaError as exc:
            raise KafkaLogError(f"poll of topic {self._topic!r} failed: {exc}") from exc
        out: list[Record] = []
        for tp in sorted(batches, key=lambda tp: tp.partition):
            out.extend(_to_record(r) for r in batches[tp])
        positions = self._positions
        for p in positions:
            if p not in self.undecodable:
                at = _fetch_position(consumer, TopicPartition(self._topic, p))
                if at is not None:
                    positions[p] = at
        for p, u in list(self._retrying.items()):
            if positions[p] > u.offset:
                del self._retrying[p]
                stage_logger("kafka").info("partition decodes again", topic=self._topic, partition=p,
                                           offset=u.offset, tries=u.tries)
        return out

    def _set_aside(self, exc: BaseException) -> None:
        """The batch being decoded failed: set its partition aside and go on with the others."""
        tp = _failing_partition(self._consumer)
        active = [p for p in self._positions if p not in self.undecodable]
        if tp is None and len(active) == 1:
            tp = TopicPartition(self._topic, active[0])
        if tp is None or tp.partition not in self._positions:
            raise KafkaLogError(f"poll of topic {self._topic!r} failed: {exc}") from exc
        p = tp.partition
        at = _fetch_position(self._consumer, tp)
        if at is not None:
            self._positions[p] = at
        reason = f"{type(exc).__name__}: {exc}"[:300]
        before = self._retrying.pop(p, None)
        tries = before.tries + 1 if before is not None else 1
        if before is None:  # once: a retry that fails again is counted, not logged again
            stage_logger("kafka").error("batch cannot be decoded, partition set aside", exc=exc, topic=self._topic,
                                        partition=p, offset=self._positions[p], reason=reason,
                                        retry_s=UNDECODABLE_RETRY_S)
        self.undecodable[p] = Undecodable(p, self._positions[p], reason, time.monotonic(), tries)
        self._rebuild()

    def _retry_undecodable(self) -> None:
        now = time.monotonic()
        due = [u for u in self.undecodable.values() if now - u.since >= UNDECODABLE_RETRY_S * min(u.tries, 10)]
        if not due:
            return
        for u in due:  # a poll that fails again sets it aside again, one try more (the wait grows)
            self._retrying[self.undecodable.pop(u.partition).partition] = u
        self._rebuild()

    def _rebuild(self) -> None:
        old, self._consumer = self._consumer, None
        with suppress(Exception):
            old.close(autocommit=False)
        self._waiting = False  # a new consumer fetches batched
        self._assign()

    def seek(self, partition: int, offset: int) -> None:
        if partition not in self._positions:
            raise KeyError(f"partition {partition} of {self._topic!r} is not assigned to this consumer")
        self._positions[partition] = offset
        if partition in self.undecodable:
            self.undecodable[partition].offset = offset
            return
        self._consumer.seek(TopicPartition(self._topic, partition), offset)

    def position(self, partition: int) -> int:
        """The next offset to read: Kafka's fetch position after the last poll (or the last seek)."""
        if partition not in self._positions:
            raise KeyError(f"partition {partition} of {self._topic!r} is not assigned to this consumer")
        return self._positions[partition]

    def commit_positions(self) -> None:
        """Best effort: record the positions in ``monitor_group`` for lag dashboards. The caller's
        checkpoints stay the truth; a failed commit is ignored."""
        if self._monitor_group is None:
            return
        from kafka.structs import OffsetAndMetadata

        offsets = {
            TopicPartition(self._topic, p): OffsetAndMetadata(o, "", -1) for p, o in self._positions.items()
            if p not in self.undecodable
        }
        with suppress(kafka_errors.KafkaError):
            self._consumer.commit_async(offsets=offsets)

    def close(self) -> None:
        self._consumer.close(autocommit=False)


class KafkaCommitLog:
    """``CommitLog`` on a Kafka cluster. See the module docstring for the guarantees."""

    def __init__(
        self,
        bootstrap: str,
        *,
        client_id: str = "timerwheel",
        clock: Clock | None = None,
        request_timeout_s: float = 30.0,
        read_timeout_s: float = 15.0,
        read_gap: int = 50,
        read_cache_records: int = 50_000,
        read_cache_bytes: int = 32 * 1024 * 1024,
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
        if compression not in COMPRESSIONS:
            raise ValueError(f"KafkaCommitLog: compression must be one of {', '.join(COMPRESSIONS)}, got {compression!r}")
        check_codecs()
        self.bootstrap = bootstrap
        #: kafka-python's TLS and SASL options (``timerwheel.security.kafka_client_options``).
        self._security = dict(security or {})
        self._compression = None if compression == "none" else compression
        #: ``append`` waits this long, once per batch, for the metadata of topics it has not written yet.
        self._metadata_wait_s = metadata_wait_s
        #: ... and this long for a topic the broker says exists (auto-created, its leader not elected yet).
        self._creating_wait_s = creating_wait_s
        #: A topic found missing is asked for again after this long (not on every batch).
        self._missing_recheck_s = missing_topic_recheck_s
        #: topic -> monotonic time it was last found missing.
        self._missing: dict[str, float] = {}
        #: The broker's auto.create.topics.enable, once asked (``_broker_auto_creates``).
        self._auto_create: bool | None = None
        #: topic -> partition count, for topics seen to exist (``partition_count``).
        self._counts: dict[str, int] = {}
        self._client_id = client_id
        #: Stamps records whose ``timestamp_ms`` is None; without a clock Kafka's producer does.
        self._clock = clock
        self._request_timeout_ms = int(request_timeout_s * 1000)
        #: Kafka requires delivery.timeout.ms >= linger.ms + request.timeout.ms.
        self._delivery_timeout_ms = self._request_timeout_ms + 5000
        self._read_timeout_s = read_timeout_s
        #: ``append`` gives up on acknowledgements after this long and replaces the producer.
        self._stall_timeout_s = min(stall_timeout_s, self._delivery_timeout_ms / 1000 + 5)
        self._read_gap = read_gap
        self._read_cache_records = read_cache_records if read_cache_bytes > 0 else 0
        #: ... and at most this many bytes of them (``Record.size``): large bodies fill it by bytes.
        self._read_cache_bytes = read_cache_bytes
        self._passed_bytes = 0
        #: A consumer's fetch returns about this many bytes at most (TW_BATCH_BYTES): what a poll
        #: can hold in memory, whatever the record sizes.
        self._fetch_bytes = fetch_bytes
        #: (topic, partition, offset) -> a record ``read`` walked past: see the module docstring.
        self._passed: OrderedDict[tuple[str, int, int], Record] = OrderedDict()
        self._passed_lock = threading.Lock()  # short holds: the follower inserts while a read fetches
        self._follower: _Follower | None = None
        self._max_request_size = max_request_size
        self._producer: Any = None
        self._reader: Any = None
        #: The reader of large records (``_read_record_bytes`` above _READ_FETCH_BYTES), made when needed.
        self._large_reader: Any = None
        #: Mean value bytes of the records the last read fetched: with large records, a 64 KiB
        #: partition fetch returns one record per round trip; they are read in fetches of TW_BATCH_BYTES.
        self._read_record_bytes = 0
        self._admin: Any = None
        self._producer_lock = threading.Lock()
        self._reader_lock = threading.Lock()
        self._admin_lock = threading.Lock()
        #: Per partition of the reader: (log start, end) last seen; refreshed when a wanted offset
        #: lies at or past the cached end. A start that moved since is caught by the fetch itself.
        self._bounds: dict[TopicPartition, tuple[int, int]] = {}
        self._closed = False

    # -- clients -----------------------------------------------------------------------------

    def _common(self) -> dict[str, Any]:
        return {
            "bootstrap_servers": self.bootstrap.split(","),
            "request_timeout_ms": self._request_timeout_ms,
            "reconnect_backoff_ms": 100,
            "reconnect_backoff_max_ms": 2000,
            "retry_backoff_ms": 100,
            "bootstrap_timeout_ms": self._request_timeout_ms,
            **self._security,
        }

    @classmethod
    def from_config(cls, cfg: TimerConfig, bootstrap: str | None = None, **options: Any) -> KafkaCommitLog:
        """The commit log on ``cfg.kafka_bootstrap`` (or ``bootstrap``) with ``cfg``'s compression
        and security settings: how every part of timerwheel connects to Kafka."""
        from timerwheel.security import kafka_client_options

        options.setdefault("compression", cfg.kafka_compression)
        options.setdefault("read_cache_bytes", cfg.read_cache_bytes)
        options.setdefault("fetch_bytes", cfg.batch_bytes)
        return cls(bootstrap or cfg.kafka_bootstrap, security=kafka_client_options(cfg), **options)

    def _get_producer(self) -> Any:
        with self._producer_lock:
            if self._producer is None:
                self._check_open()
                with self._kafka_call("connect the producer"):
                    self._producer = self._make_producer()
            return self._producer

    def _make_producer(self) -> Any:
        return KafkaProducer(
            client_id=f"{self._client_id}-producer",
            acks="all",
            enable_idempotence=True,
            linger_ms=5,
            batch_size=512 * 1024,
            compression_type=self._compression,
            max_request_size=self._max_request_size,
            delivery_timeout_ms=self._delivery_timeout_ms,
            max_block_ms=self._request_timeout_ms,
            **self._common(),
        )

    def _new_consumer(self, suffix: str, **overrides: Any) -> Any:
        config: dict[str, Any] = {
            "client_id": f"{self._client_id}-{suffix}",
            "group_id": None,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            "max_poll_records": 10_000,
            "fetch_max_wait_ms": 100,
            "max_partition_fetch_bytes": min(1024 * 1024, self._fetch_bytes),
            "fetch_max_bytes": min(_FETCH_MAX_BYTES, self._fetch_bytes),
            "allow_auto_create_topics": False,
            # Transactions: aborted records are never returned, and a consumer stops at the last
            # stable offset (an open transaction's records wait until it ends).
            "isolation_level": "read_committed",
        }
        config.update(self._common())
        config.update(overrides)
        with self._kafka_call(f"connect consumer {config['client_id']!r}"):
            return KafkaConsumer(**config)

    def _get_reader(self) -> Any:
        if self._reader is None:
            self._check_open()
            self._reader = self._new_consumer(
                "reader",
                max_partition_fetch_bytes=_READ_FETCH_BYTES,
                enable_incremental_fetch_sessions=False,  # each read is a new set of positions
                retry_backoff_ms=20,
            )
        return self._reader

    def _get_large_reader(self) -> Any:
        if self._large_reader is None:
            self._check_open()
            self._large_reader = self._new_consumer(
                "reader-large",
                max_partition_fetch_bytes=min(_FETCH_MAX_BYTES, self._fetch_bytes),
                enable_incremental_fetch_sessions=False,
                retry_backoff_ms=20,
            )
        return self._large_reader

    def _get_admin(self) -> Any:
        if self._admin is None:
            self._check_open()
            with self._kafka_call("connect the admin client"):
                self._admin = KafkaAdminClient(client_id=f"{self._client_id}-admin", **self._common())
        return self._admin

    def _check_open(self) -> None:
        if self._closed:
            raise KafkaLogError("KafkaCommitLog is closed")

    @contextmanager
    def _kafka_call(self, what: str) -> Iterator[None]:
        try:
            yield
        except KafkaLogError:
            raise
        except kafka_errors.SaslAuthenticationFailedError as exc:
            raise AccessError("TW_KAFKA_SASL_PASSWORD", f"{what}: Kafka refused the SASL credentials: {exc}") from None
        except kafka_errors.KafkaError as exc:
            raise KafkaLogError(f"{what} failed: {exc}") from exc

    # -- topics ------------------------------------------------------------------------------

    def _describe(self, topic: str) -> dict[str, Any] | None:
        with self._admin_lock, self._kafka_call(f"describe topic {topic!r}"):
            found: list[dict[str, Any]] = self._get_admin().describe_topics([topic])
        for t in found:
            if t["name"] == topic and t["error_code"] == 0:
                return t
        return None

    def ensure_topic(self, topic: str, partitions: int, *, configs: Mapping[str, str] | None = None) -> int:
        """Create ``topic`` with ``partitions`` partitions (and topic ``configs`` such as
        ``retention.ms``) if it is missing; return its partition count. An existing topic is
        left as it is, whatever its count."""
        existing = self._describe(topic)
        if existing is None:
            spec = {topic: {"num_partitions": partitions, "configs": dict(configs or {})}}
            with self._admin_lock, self._kafka_call(f"create topic {topic!r}"):
                result = self._get_admin().create_topics(spec, raise_errors=False, wait_for_metadata=True)
            for t in result["topics"]:
                if t["error_code"] not in (0, _TOPIC_EXISTS):
                    raise KafkaLogError(
                        f"create topic {topic!r} with {partitions} partitions failed: "
                        f"{t.get('error_message') or kafka_errors.for_code(t['error_code']).__name__}"
                    )
            existing = self._describe(topic)
            if existing is None:
                raise KafkaLogError(f"topic {topic!r} still unknown after it was created")
        return len(existing["partitions"])

    def partitions(self, topic: str) -> int:
        """Partition count; a missing topic is created with the broker's default count, as the
        broker's auto-creation would."""
        existing = self._describe(topic)
        if existing is not None:
            return len(existing["partitions"])
        return self.ensure_topic(topic, -1)

    def partition_count(self, topic: str) -> int | None:
        """Partition count of ``topic``, or None if it does not exist (it is never created here).
        A count is kept once seen; a topic found missing is asked for again after
        ``missing_topic_recheck_s``, so that a stage may call this per record."""
        count = self._counts.get(topic)
        if count is not None:
            return count
        seen_missing = self._missing.get(topic)
        if seen_missing is not None and time.monotonic() - seen_missing < self._missing_recheck_s:
            return None
        existing = self._describe(topic)
        if existing is None:
            self._missing[topic] = time.monotonic()
            return None
        self._missing.pop(topic, None)
        count = self._counts[topic] = len(existing["partitions"])
        return count

    def topic_retention_ms(self, topic: str) -> int | None:
        """The topic's effective ``retention.ms`` (its own or the broker default); None when
        unlimited (-1). The service refuses to start when this is under roll window x 1.5."""
        resource = ConfigResource(ConfigResourceType.TOPIC, topic, ["retention.ms"])
        with self._admin_lock, self._kafka_call(f"describe configs of topic {topic!r}"):
            found = self._get_admin().describe_configs([resource], config_filter="all")
        entry = found.get("topic", {}).get(topic, {}).get("retention.ms")
        if entry is None or entry.get("value") is None:
            raise KafkaLogError(f"topic {topic!r}: the broker reported no retention.ms (does the topic exist?)")
        value = int(entry["value"])
        return None if value < 0 else value

    # -- identity: which cluster, which incarnation of a topic (the deployment file records both) --

    def cluster_id(self) -> str | None:
        """The cluster's id; None from a broker too old to tell, or one whose ACLs do not let this
        client describe the cluster."""
        with self._admin_lock, self._kafka_call("describe the cluster"):
            try:
                found: dict[str, Any] = self._get_admin().describe_cluster()
            except kafka_errors.ClusterAuthorizationFailedError:
                return None  # a client the ACLs do not let describe the cluster: the topic id still tells
        return found.get("cluster_id") or None

    def topic_id(self, topic: str) -> str | None:
        """The id of this incarnation of ``topic`` (a topic deleted and made again gets a new
        one); None if it does not exist, or the broker predates topic ids (Kafka 2.8)."""
        existing = self._describe(topic)
        raw = existing.get("topic_id") if existing is not None else None
        return None if raw is None or str(raw) == _NO_TOPIC_ID else str(raw)

    # -- offsets -----------------------------------------------------------------------------

    def _topic_partitions(self, topic: str) -> list[TopicPartition]:
        existing = self._describe(topic)
        if existing is None:
            raise KafkaLogError(f"topic {topic!r} does not exist")
        return [TopicPartition(topic, p["partition_index"]) for p in existing["partitions"]]

    def _list_offsets(self, tps: list[TopicPartition], beginning: bool) -> dict[TopicPartition, int]:
        reader = self._get_reader()
        with self._kafka_call("list offsets"):
            if beginning:
                result: dict[TopicPartition, int] = reader.beginning_offsets(tps, timeout_ms=self._request_timeout_ms)
            else:
                result = reader.end_offsets(tps, timeout_ms=self._request_timeout_ms)
        return result

    def end_offsets(self, topic: str) -> dict[int, int]:
        tps = self._topic_partitions(topic)
        with self._reader_lock:
            return {tp.partition: o for tp, o in self._list_offsets(tps, beginning=False).items()}

    def start_offsets(self, topic: str) -> dict[int, int]:
        tps = self._topic_partitions(topic)
        with self._reader_lock:
            return {tp.partition: o for tp, o in self._list_offsets(tps, beginning=True).items()}

    # -- append ------------------------------------------------------------------------------

    def append(self, records: Sequence[OutRecord]) -> list[tuple[int, int]]:
        if not records:
            return []
        producer = self._get_producer()
        futures: list[Any] = [None] * len(records)
        written: list[tuple[int, int] | None] = [None] * len(records)
        errors: list[str] = []
        refused: dict[int, str] = {}
        missing: dict[int, str] = {}
        # Records for topics the producer knows go first; a new topic's metadata is waited for
        # only after they are on their way, so it costs its own records the wait, not everyone's.
        known, new = self._split_by_metadata(producer, {r.topic for r in records})
        self._send(producer, records, [i for i, r in enumerate(records) if r.topic in known],
                   futures, errors, refused, missing)
        absent = self._await_metadata(producer, new) if new else set()
        self._send(producer, records, [i for i, r in enumerate(records) if r.topic in new and r.topic not in absent],
                   futures, errors, refused, missing)
        for i, r in enumerate(records):
            if r.topic not in known and (r.topic not in new or r.topic in absent):
                missing[i] = r.topic  # found missing before, or now: not sent
        # Wait at most ``stall_timeout_s`` for the acknowledgements. After a broker restart
        # kafka-python's producer was seen holding records until its delivery timeout (35 s),
        # while a new producer gets them through in seconds: records not acknowledged by then
        # are failed here (the producer is replaced below) and the caller retries them. A record
        # reported failed was not acknowledged; it may still have been written (a lost ack), so
        # retrying it may duplicate it, never lose it.
        deadline = time.monotonic() + self._stall_timeout_s
        with suppress(kafka_errors.KafkaError):  # the futures below say which records failed
            producer.flush(timeout=self._stall_timeout_s)
        for i, fut in enumerate(futures):
            if fut is None:
                continue
            if not fut.is_done and time.monotonic() >= deadline:
                errors.append(f"{records[i].topic}: not acknowledged within {self._stall_timeout_s:g}s")
                continue
            try:
                md = fut.get(timeout=max(0.1, deadline - time.monotonic()))
            except kafka_errors.KafkaError as exc:
                errors.append(f"{records[i].topic}: {exc}")
                if isinstance(exc, _REFUSED):
                    refused[i] = _refusal(exc)
                continue
            written[i] = (md.partition, md.offset)
        if errors:
            # After records expired or stalled (a broker restart), kafka-python's idempotent producer
            # can stay wedged: seen in e2e, every later record of the partition sat in its
            # accumulator for good. A new producer (new producer id) starts clean; what the old
            # one still held is failed here and retried by the caller.
            self._drop_producer(producer)
        if errors or missing:
            failed = sum(1 for w in written if w is None)
            why = errors[0] if errors else f"topic {next(iter(missing.values()))!r} does not exist"
            raise KafkaLogError(f"append: {failed} of {len(records)} records failed, first: {why}", written,
                                refused, missing)
        return [w for w in written if w is not None]

    def _send(self, producer: Any, records: Sequence[OutRecord], indexes: list[int], futures: list[Any],
              errors: list[str], refused: dict[int, str], missing: dict[int, str]) -> None:
        """``producer.send`` each of ``records[indexes]``, its future into ``futures``."""
        for i in indexes:
            r = records[i]
            ts = r.timestamp_ms
            if ts is None and self._clock is not None:
                ts = self._clock.now_ms()
            try:
                futures[i] = producer.send(
                    r.topic,
                    # kafka-python refuses a record with neither key nor value (other clients
                    # allow it): such a record (a dead letter for a vanished source, a producer's
                    # empty message) goes with an empty value rather than stalling its stage.
                    value=r.value if r.value is not None or r.key is not None else b"",
                    key=r.key,
                    headers=list(r.headers),
                    partition=r.partition,
                    timestamp_ms=ts,
                )
            except _REFUSED as exc:
                errors.append(f"{r.topic}: {exc}")
                refused[i] = _refusal(exc)
            except kafka_errors.KafkaTimeoutError:
                # Its metadata went away since it was looked up (a deleted topic): not sent, so
                # it is the caller's to hold like a missing topic.
                missing[i] = r.topic
                self._missing[r.topic] = time.monotonic()
            except kafka_errors.KafkaError as exc:
                errors.append(f"{r.topic}: {exc}")

    def _split_by_metadata(self, producer: Any, topics: set[str]) -> tuple[set[str], set[str]]:
        """(topics the producer has metadata for, new topics to wait for). Topics found missing
        before are in neither and are not waited for again: every ``missing_topic_recheck_s``
        their metadata is asked for without waiting, and they are known once it has arrived."""
        metadata = producer._metadata
        known = {t for t in topics if metadata.partitions_for_topic(t) is not None}
        for topic in known & self._missing.keys():
            del self._missing[topic]
        now = time.monotonic()
        new: set[str] = set()
        recheck = False
        for topic in topics - known:
            seen = self._missing.get(topic)
            if seen is None:
                new.add(topic)
            elif now - seen >= self._missing_recheck_s:
                self._missing[topic] = now
                producer._sender.add_topic(topic)
                recheck = True
        if recheck:
            metadata.request_update()
            producer._sender.wakeup()
        return known, new

    def _await_metadata(self, producer: Any, topics: set[str]) -> set[str]:
        """Of these new topics, those that do not exist: the rest have metadata now.

        kafka-python's ``send`` waits for a new topic's metadata on its own, up to
        ``max_block_ms`` per topic and one topic after the other: 300 new destinations cost
        minutes, and one that does not exist blocked the whole stage. Here every new topic is
        added to the producer's metadata at once and each refresh asks for all of them. On a
        broker that creates topics on first use, that creates them: they are waited for up to
        ``creating_wait_s``. On one that does not, a topic still unknown after
        ``metadata_wait_s`` is looked up with the admin client: one that exists (just created
        by someone) is waited for as well, the others are missing at once."""
        sender = producer._sender
        for topic in topics:
            sender.add_topic(topic)
        if self._broker_auto_creates():
            left = self._refresh_until(producer, set(topics), self._creating_wait_s)
        else:
            left = self._refresh_until(producer, set(topics), self._metadata_wait_s)
            if left:
                with self._admin_lock, self._kafka_call("describe new topics"):
                    found = self._get_admin().describe_topics(sorted(left))
                # Any answer but "unknown topic" means it exists (a new one: no leader yet, code 5).
                creating = {t["name"] for t in found if t["error_code"] != _UNKNOWN_TOPIC}
                left = (left - creating) | self._refresh_until(producer, creating, self._creating_wait_s)
        now = time.monotonic()
        for topic in left:
            self._missing[topic] = now
        return left

    def _broker_auto_creates(self) -> bool:
        """The broker's ``auto.create.topics.enable`` (asked once; True when it cannot be told)."""
        if self._auto_create is None:
            try:
                with self._admin_lock, self._kafka_call("describe the broker's configuration"):
                    admin = self._get_admin()
                    brokers = admin.describe_cluster().get("brokers") or []
                    node = str(brokers[0]["broker_id"]) if brokers else "0"
                    found = admin.describe_configs([ConfigResource(ConfigResourceType.BROKER, node,
                                                                   ["auto.create.topics.enable"])],
                                                   config_filter="all")
                entry = found.get("broker", {}).get(node, {}).get("auto.create.topics.enable") or {}
                self._auto_create = str(entry.get("value", "true")).lower() != "false"
            except (KafkaLogError, LookupError, TypeError, AttributeError) as exc:
                stage_logger("kafka").warning("cannot tell whether the broker creates topics; assuming it does",
                                              error=str(exc)[:200])
                self._auto_create = True
        return self._auto_create

    def _refresh_until(self, producer: Any, topics: set[str], wait_s: float) -> set[str]:
        """Ask for the metadata of ``topics`` until all have some or ``wait_s`` passed; the rest."""
        metadata = producer._metadata
        deadline = time.monotonic() + wait_s
        left = {t for t in topics if metadata.partitions_for_topic(t) is None}
        while left and time.monotonic() < deadline:
            answered = threading.Event()
            metadata.request_update().add_both(lambda *_, done=answered: done.set())
            producer._sender.wakeup()
            answered.wait(max(0.0, min(deadline - time.monotonic(), 1.0)))
            left = {t for t in left if metadata.partitions_for_topic(t) is None}
            if left:
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return left

    def _drop_producer(self, producer: Any) -> None:
        with self._producer_lock:
            if self._producer is producer:
                self._producer = None
        _close_producer(producer, 0)

    def append_atomic(self, records: Sequence[OutRecord]) -> list[tuple[int, int]]:
        """Append ``records`` in one Kafka transaction: a ``read_committed`` reader (every stage)
        sees all of them or none. A transactional producer of its own is made on first use; a
        failed transaction is aborted and raises ``KafkaLogError`` (nothing was written). An empty
        call only connects that producer (its first ``init_transactions`` takes a while)."""
        with self._producer_lock:
            producer = getattr(self, "_tx_producer", None)
            if producer is None:
                self._check_open()
                with self._kafka_call("connect the transactional producer"):
                    producer = KafkaProducer(
                        client_id=f"{self._client_id}-tx-producer", acks="all", enable_idempotence=True,
                        transactional_id=f"{self._client_id}-tx-{uuid.uuid4().hex}",
                        compression_type=self._compression, max_request_size=self._max_request_size,
                        delivery_timeout_ms=self._delivery_timeout_ms, max_block_ms=self._request_timeout_ms,
                        **self._common())
                    producer.init_transactions()
                self._tx_producer = producer
            if not records:
                return []
            try:
                producer.begin_transaction()
                futures = [producer.send(r.topic, value=r.value if r.value is not None or r.key is not None else b"",
                                         key=r.key, headers=list(r.headers), partition=r.partition,
                                         timestamp_ms=r.timestamp_ms) for r in records]
                producer.commit_transaction()
                written = [(md.partition, md.offset) for md in (f.get(timeout=self._stall_timeout_s) for f in futures)]
            except kafka_errors.KafkaError as exc:
                with suppress(kafka_errors.KafkaError):
                    producer.abort_transaction()
                raise KafkaLogError(f"append_atomic: transaction of {len(records)} records failed: {exc}") from None
            return written

    # -- random reads ------------------------------------------------------------------------

    def read(self, topic: str, positions: Sequence[tuple[int, int]]) -> list[Record | None]:
        out: list[Record | None] = [None] * len(positions)
        wanted: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
        for i, (partition, offset) in enumerate(positions):
            if offset >= 0:
                wanted[partition][offset].append(i)
        hits = 0
        with self._passed_lock:
            passed = self._passed
            if passed:
                for partition, by_offset in wanted.items():
                    for offset in [o for o in by_offset if (topic, partition, o) in passed]:
                        kept = passed.pop((topic, partition, offset))
                        self._passed_bytes -= kept.size
                        hits += 1
                        for i in by_offset.pop(offset):
                            out[i] = kept
                wanted = {p: by for p, by in wanted.items() if by}
        if hits and self._follower is not None:
            self._follower.hits += hits
        if wanted:
            with self._reader_lock:
                self._read_locked(topic, wanted, out)
        return out

    def _keep(self, records: Iterable[Record]) -> int:
        """Put records into the cache of records read in passing; the oldest go past the bound."""
        n = 0
        with self._passed_lock:
            passed = self._passed
            nbytes = self._passed_bytes
            for rec in records:
                old = passed.get(key := (rec.topic, rec.partition, rec.offset))
                if old is not None:
                    nbytes -= old.size
                passed[key] = rec
                nbytes += rec.size
                n += 1
            while passed and (len(passed) > self._read_cache_records or nbytes > self._read_cache_bytes):
                nbytes -= passed.popitem(last=False)[1].size
            self._passed_bytes = nbytes
        return n

    def follow(self, topic: str) -> None:
        """Read ``topic`` ahead from its end, in a thread of its own, into the cache that ``read``
        serves from (see the module docstring). Off again by itself while few of the records
        it keeps are asked for (long delays: they leave the cache before they are due)."""
        if self._read_cache_records <= 0 or self._follower is not None:
            return
        self._check_open()
        self._follower = _Follower(self, topic)
        self._follower.start()

    def _read_locked(self, topic: str, wanted: dict[int, dict[int, list[int]]], out: list[Record | None]) -> None:
        large = self._read_record_bytes > _READ_FETCH_BYTES
        reader = self._get_large_reader() if large else self._get_reader()
        tps = {p: TopicPartition(topic, p) for p in wanted}
        unknown = [tp for tp in tps.values() if tp not in self._bounds]
        if unknown:
            starts = self._list_offsets(unknown, beginning=True)
            ends = self._list_offsets(unknown, beginning=False)
            for tp in unknown:
                self._bounds[tp] = (starts[tp], ends[tp])
        # A wanted offset at or past the cached end: only the end is asked again (one round trip
        # per read in a steady flow; a start that moved meanwhile is caught by the fetch itself).
        behind = [tp for p, tp in tps.items() if max(wanted[p]) >= self._bounds[tp][1]]
        if behind:
            ends = self._list_offsets(behind, beginning=False)
            for tp in behind:
                self._bounds[tp] = (self._bounds[tp][0], ends[tp])

        # Offsets outside [start, end) are gone (or not written yet): they stay None.
        pending: dict[TopicPartition, list[int]] = {}
        for p, by_offset in wanted.items():
            tp = tps[p]
            start, end = self._bounds[tp]
            inside = sorted(o for o in by_offset if start <= o < end)
            if inside:
                pending[tp] = inside
        if not pending:
            return

        with self._kafka_call(f"read from topic {topic!r}"):
            # Assignment, not pause/resume, narrows the fetches to what is still wanted: data
            # parked for paused partitions delays their next fetch in kafka-python.
            reader.assign(list(pending))
            for tp, offsets in pending.items():
                reader.seek(tp, offsets[0])
            deadline = time.monotonic() + self._read_timeout_s
            cursor = {tp: 0 for tp in pending}  # index of the lowest offset still wanted
            while pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    left = sum(len(o) - cursor[tp] for tp, o in pending.items())
                    raise KafkaLogError(
                        f"read from topic {topic!r}: {left} records in range not fetched within "
                        f"{self._read_timeout_s}s (partitions {sorted(tp.partition for tp in pending)})"
                    )
                batches = reader.poll(
                    timeout_ms=int(min(remaining, 0.5) * 1000), max_records=_READ_POLL_RECORDS
                )
                finished = False
                for tp in list(pending):
                    offsets = pending[tp]
                    index = wanted[tp.partition]
                    recs = batches.get(tp)
                    if recs:
                        passing: list[Record] = []
                        for rec in recs:
                            if rec.offset in index:
                                record = _to_record(rec)
                                for i in index[rec.offset]:
                                    out[i] = record
                            elif self._read_cache_records > 0:
                                passing.append(_to_record(rec))
                        if passing:
                            self._keep(passing)
                        after = recs[-1].offset + 1
                    else:
                        # No records, yet the position may have moved past control batches.
                        after = reader.position(tp, timeout_ms=0) or 0
                    # Everything below the next fetch position has been seen or never will be:
                    # a gap (compaction, markers) or a jump to the log start after retention.
                    k = cursor[tp]
                    while k < len(offsets) and offsets[k] < after:
                        k += 1
                    cursor[tp] = k
                    if k == len(offsets):
                        del pending[tp]
                        finished = True
                    elif offsets[k] - after > self._read_gap:
                        reader.seek(tp, offsets[k])
                if finished and pending:
                    reader.assign(list(pending))
        sizes = [len(r.value or b"") for r in out if r is not None]
        if sizes:
            self._read_record_bytes = sum(sizes) // len(sizes)

    # -- consumers ---------------------------------------------------------------------------

    def consumer(
        self, topic: str, offsets: Mapping[int, int], *, monitor_group: str | None = None
    ) -> KafkaConsumerAdapter:
        """A consumer of ``topic`` at ``offsets``. With ``monitor_group``, ``commit_positions``
        records progress in that group for monitoring only; resumption uses the caller's
        checkpoints."""
        with self._kafka_call(f"consumer for topic {topic!r}"):
            return KafkaConsumerAdapter(
                lambda: self._new_consumer(f"consumer-{topic}", group_id=monitor_group, **_BATCHED_FETCH),
                topic, offsets, monitor_group)

    def group_consumer(self, group: str, topics: Sequence[str],
                       options: Mapping[str, object] | None = None) -> KafkaGroupConsumer:
        """A member of consumer group ``group`` subscribed to ``topics`` (``GroupConsumer``):
        offsets are committed only by ``commit``; ``options`` are more ``KafkaConsumer`` settings
        (``group_instance_id``, ``session_timeout_ms``, ``auto_offset_reset``, ...)."""
        self._check_open()
        settings: dict[str, Any] = {"group_id": group, **(options or {})}
        consumer = self._new_consumer(f"group-{group}", **settings)
        with self._kafka_call(f"subscribe group {group!r} to {', '.join(topics)}"):
            consumer.subscribe(list(topics))
        return KafkaGroupConsumer(consumer, group)

    def close(self) -> None:
        self._closed = True
        if self._follower is not None:
            self._follower.stop()
            self._follower = None
        with self._producer_lock:
            if self._producer is not None:
                _close_producer(self._producer, 5)
                self._producer = None
            if getattr(self, "_tx_producer", None) is not None:
                _close_producer(self._tx_producer, 5)
                self._tx_producer = None
        with self._reader_lock:
            for reader in (self._reader, self._large_reader):
                if reader is not None:
                    reader.close(autocommit=False)
            self._reader = self._large_reader = None
        with self._admin_lock:
            if self._admin is not None:
                self._admin.close()
                self._admin = None


class KafkaGroupConsumer:
    """``GroupConsumer`` over kafka-python's group membership: Kafka assigns the partitions and
    keeps the committed offsets; nothing is committed but what ``commit`` is given."""

    def __init__(self, consumer: Any, group: str) -> None:
        self._consumer = consumer
        self.group = group

    def poll(self, max_records: int, timeout_s: float) -> list[Record]:
        try:
            batches = self._consumer.poll(timeout_ms=max(0, int(timeout_s * 1000)), max_records=max_records)
        except kafka_errors.KafkaError as exc:
            raise KafkaLogError(f"poll of group {self.group!r} failed: {exc}") from exc
        return [_to_record(r) for tp in sorted(batches) for r in batches[tp]]

    def commit(self, offsets: Mapping[tuple[str, int], int]) -> None:
        from kafka.structs import OffsetAndMetadata

        try:
            self._consumer.commit({TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in offsets.items()})
        except kafka_errors.KafkaError as exc:
            raise KafkaLogError(f"commit of group {self.group!r} failed: {exc}") from exc

    def close(self) -> None:
        self._consumer.close(autocommit=False)


class _Follower:
    """``KafkaCommitLog.follow``: a consumer of every partition of a topic from its end whose
    records go into the log's read cache.

    Judged every ``JUDGE_EVERY`` records kept: if ``read`` served fewer than ``MIN_HIT_RATIO``
    as many records from the cache meanwhile, following costs a decode per record for nothing
    (the delays are longer than the cache holds): it pauses for ``PAUSE_S`` and then starts
    again from the end."""

    JUDGE_EVERY = 20_000
    MIN_HIT_RATIO = 0.25
    PAUSE_S = 120.0
    RETRY_S = 2.0

    def __init__(self, log: KafkaCommitLog, topic: str) -> None:
        self.log = log
        self.topic = topic
        self.hits = 0  # added to by read()
        self.kept = 0
        self.paused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tw-follow-{topic}", daemon=True)
        self._failing = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            consumer = None
            try:
                consumer = self.log._new_consumer(f"follow-{self.topic}", **_BATCHED_FETCH)
                tps = self.log._topic_partitions(self.topic)
                consumer.assign(tps)
                consumer.seek_to_end(*tps)
                self._follow(consumer)
                self._failing = False
            except Exception as exc:  # noqa: BLE001 - a read-ahead is never worth a stage
                if not self._failing:
                    stage_logger("kafka").warning("read-ahead failed, retrying", topic=self.topic,
                                                  error=str(exc)[:200])
                self._failing = True
                self._stop.wait(self.RETRY_S)
            finally:
                if consumer is not None:
                    with suppress(Exception):
                        consumer.close(autocommit=False)

    def _follow(self, consumer: Any) -> None:
        """Until stopped, or until judged useless (then pause and return, to start from the end)."""
        self.hits = self.kept = 0
        idle = False
        while not self._stop.is_set():
            _fetch_mode(consumer, idle)
            batches = consumer.poll(timeout_ms=1000 if idle else 200, max_records=2_000)
            idle = not batches
            for recs in batches.values():
                self.kept += self.log._keep(_to_record(r) for r in recs)
            if self.kept >= self.JUDGE_EVERY:
                if self.hits < self.MIN_HIT_RATIO * self.kept:
                    self.paused += 1
                    self._stop.wait(self.PAUSE_S)
                    return
                self.hits = self.kept = 0
