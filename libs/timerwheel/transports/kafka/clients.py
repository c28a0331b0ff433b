"""How timerwheel makes its kafka-python clients: one set of connection settings (bootstrap,
timeouts, reconnect backoff, TLS and SASL from ``timerwheel.security``) and a factory for each
kind of client, consumers reading ``read_committed`` and never creating topics.

Every client reconnects on its own after a broker restart; a call made while the broker is away
raises ``KafkaLogError`` after its timeout (``kafka_call``) and the stages retry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

from timerwheel.records import OutRecord
from timerwheel.transports.kafka.errors import KafkaLogError, kafka_call

__all__ = ["BATCHED_FETCH", "LONG_POLL_FETCH", "KafkaClients", "send_record"]

#: Consumers that follow a topic fetch in batches: a fetch answered per record arriving costs
#: the broker more CPU than anything else at a steady rate; 20 ms is well inside a tick.
BATCHED_FETCH = {"fetch_min_bytes": 64 * 1024, "fetch_max_wait_ms": 20}
#: ... but an idle consumer would then fetch 50 times a second for nothing: while its caller
#: waits on the poll, the broker holds the fetch until the first record arrives (answered at
#: once, so no record waits) or ``fetch_max_wait_ms`` passes (``internals.set_fetch_wait``).
LONG_POLL_FETCH = {"fetch_min_bytes": 1, "fetch_max_wait_ms": 500}
#: A consumer's fetch is TW_BATCH_BYTES, at most this (more buys nothing, and Kafka's field is an int32).
FETCH_MAX_BYTES = 16 * 1024 * 1024


class KafkaClients:
    """The connection settings of one ``KafkaCommitLog`` and its client factories."""

    def __init__(self, bootstrap: str, client_id: str, request_timeout_s: float, fetch_bytes: int,
                 security: Mapping[str, Any] | None) -> None:
        self.bootstrap = bootstrap
        self.client_id = client_id
        self.request_timeout_ms = int(request_timeout_s * 1000)
        #: Kafka requires delivery.timeout.ms >= linger.ms + request.timeout.ms.
        self.delivery_timeout_ms = self.request_timeout_ms + 5000
        #: A consumer's fetch returns about this many bytes at most (TW_BATCH_BYTES): what a poll
        #: can hold in memory, whatever the record sizes.
        self.fetch_bytes = fetch_bytes
        #: kafka-python's TLS and SASL options (``timerwheel.security.kafka_client_options``).
        self._security = dict(security or {})
        self.closed = False

    def common(self) -> dict[str, Any]:
        """The settings every client takes."""
        return {
            "bootstrap_servers": self.bootstrap.split(","),
            "request_timeout_ms": self.request_timeout_ms,
            "reconnect_backoff_ms": 100,
            "reconnect_backoff_max_ms": 2000,
            "retry_backoff_ms": 100,
            "bootstrap_timeout_ms": self.request_timeout_ms,
            **self._security,
        }

    def check_open(self) -> None:
        if self.closed:
            raise KafkaLogError("KafkaCommitLog is closed")

    def consumer(self, suffix: str, **overrides: Any) -> Any:
        """A ``KafkaConsumer`` (no group unless ``group_id`` is given, nothing committed on its
        own, ``read_committed``) named ``<client_id>-<suffix>``."""
        self.check_open()
        config: dict[str, Any] = {
            "client_id": f"{self.client_id}-{suffix}",
            "group_id": None,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            "max_poll_records": 10_000,
            "fetch_max_wait_ms": 100,
            "max_partition_fetch_bytes": min(1024 * 1024, self.fetch_bytes),
            "fetch_max_bytes": min(FETCH_MAX_BYTES, self.fetch_bytes),
            "allow_auto_create_topics": False,
            # Transactions: aborted records are never returned, and a consumer stops at the last
            # stable offset (an open transaction's records wait until it ends).
            "isolation_level": "read_committed",
        }
        config.update(self.common())
        config.update(overrides)
        with kafka_call(f"connect consumer {config['client_id']!r}"):
            return KafkaConsumer(**config)

    def producer(self, suffix: str, **settings: Any) -> Any:
        """A ``KafkaProducer`` named ``<client_id>-<suffix>``: idempotent, ``acks=all``."""
        self.check_open()
        name = f"{self.client_id}-{suffix}"
        with kafka_call(f"connect producer {name!r}"):
            return KafkaProducer(client_id=name, acks="all", enable_idempotence=True,
                                 delivery_timeout_ms=self.delivery_timeout_ms,
                                 max_block_ms=self.request_timeout_ms, **settings, **self.common())

    def admin(self) -> Any:
        self.check_open()
        with kafka_call("connect the admin client"):
            return KafkaAdminClient(client_id=f"{self.client_id}-admin", **self.common())


def send_record(producer: Any, r: OutRecord, timestamp_ms: int | None, partition: int | None = None) -> Any:
    """``producer.send`` of ``r`` (its future): the one mapping of an ``OutRecord`` onto kafka-python's
    producer, plain (``producer.Appender``) or transactional (``transactions``). ``partition``, if
    given, stands for ``r.partition`` (the default partitioner's choice, computed by the caller)."""
    return producer.send(
        r.topic,
        # kafka-python refuses a record with neither key nor value (other clients allow it): such a
        # record (a dead letter for a vanished source, a producer's empty message) goes with an
        # empty value rather than stalling its stage.
        value=r.value if r.value is not None or r.key is not None else b"",
        key=r.key,
        headers=list(r.headers),
        partition=r.partition if partition is None else partition,
        timestamp_ms=timestamp_ms,
    )
