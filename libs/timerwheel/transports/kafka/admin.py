"""Topics through Kafka's admin API: describe, create, partition counts (cached for the callers
that ask per record), retention, and whether the broker creates topics on first use.

One ``KafkaAdminClient``, made on first use and guarded by a lock (a log is shared by a stage's
threads). A topic found missing is asked for again only every ``missing_recheck_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import kafka.errors as kafka_errors
from kafka import TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType

from timerwheel.log import stage_logger
from timerwheel.transports.kafka.clients import KafkaClients
from timerwheel.transports.kafka.errors import KafkaLogError, kafka_call

__all__ = ["Topics"]

_TOPIC_EXISTS = 36
_UNKNOWN_TOPIC = 3  # UNKNOWN_TOPIC_OR_PARTITION
#: The topic id a broker without topic ids reports.
_NO_TOPIC_ID = "00000000-0000-0000-0000-000000000000"


class Topics:
    """The topics of one cluster, as a ``KafkaCommitLog`` sees them."""

    def __init__(self, clients: KafkaClients, missing_recheck_s: float) -> None:
        self._clients = clients
        self._admin: Any = None
        self._lock = threading.Lock()
        #: A topic found missing is asked for again after this long (not on every call).
        self.missing_recheck_s = missing_recheck_s
        #: topic -> monotonic time it was last found missing.
        self.missing: dict[str, float] = {}
        #: topic -> partition count, for topics seen to exist (``partition_count``).
        self._counts: dict[str, int] = {}
        #: The broker's auto.create.topics.enable, once asked (``broker_auto_creates``).
        self._auto_create: bool | None = None

    def _client(self) -> Any:
        """Lock held."""
        if self._admin is None:
            self._admin = self._clients.admin()
        return self._admin

    def describe(self, topic: str) -> dict[str, Any] | None:
        """Kafka's description of ``topic`` (its partitions), or None if it does not exist."""
        with self._lock, kafka_call(f"describe topic {topic!r}"):
            found: list[dict[str, Any]] = self._client().describe_topics([topic])
        for t in found:
            if t["name"] == topic and t["error_code"] == 0:
                return t
        return None

    def cluster_id(self) -> str | None:
        """The cluster's id; None from a broker too old to tell, or one whose ACLs do not let this
        client describe the cluster."""
        with self._lock, kafka_call("describe the cluster"):
            try:
                found: dict[str, Any] = self._client().describe_cluster()
            except kafka_errors.ClusterAuthorizationFailedError:
                return None  # a client the ACLs do not let describe the cluster: the topic id still tells
        return found.get("cluster_id") or None

    def topic_id(self, topic: str) -> str | None:
        """The id of this incarnation of ``topic`` (a topic deleted and made again gets a new
        one); None if it does not exist, or the broker predates topic ids (Kafka 2.8)."""
        existing = self.describe(topic)
        raw = existing.get("topic_id") if existing is not None else None
        return None if raw is None or str(raw) == _NO_TOPIC_ID else str(raw)

    def existing(self, topics: Sequence[str]) -> set[str]:
        """Of ``topics``, those the broker knows (a new one may have no leader yet)."""
        with self._lock, kafka_call("describe new topics"):
            found = self._client().describe_topics(sorted(topics))
        # Any answer but "unknown topic" means it exists (a new one: no leader yet, code 5).
        return {t["name"] for t in found if t["error_code"] != _UNKNOWN_TOPIC}

    def ensure(self, topic: str, partitions: int, configs: Mapping[str, str] | None = None) -> int:
        """Create ``topic`` with ``partitions`` partitions (and topic ``configs``) if it is
        missing; return its partition count. An existing topic is left as it is."""
        existing = self.describe(topic)
        if existing is None:
            spec = {topic: {"num_partitions": partitions, "configs": dict(configs or {})}}
            with self._lock, kafka_call(f"create topic {topic!r}"):
                result = self._client().create_topics(spec, raise_errors=False, wait_for_metadata=True)
            for t in result["topics"]:
                if t["error_code"] not in (0, _TOPIC_EXISTS):
                    raise KafkaLogError(
                        f"create topic {topic!r} with {partitions} partitions failed: "
                        f"{t.get('error_message') or kafka_errors.for_code(t['error_code']).__name__}"
                    )
            existing = self.describe(topic)
            if existing is None:
                raise KafkaLogError(f"topic {topic!r} still unknown after it was created")
        self.missing.pop(topic, None)  # found missing before it was made here: not for missing_recheck_s more
        return len(existing["partitions"])

    def partitions(self, topic: str) -> int:
        """Partition count; a missing topic is created with the broker's default count, as the
        broker's auto-creation would."""
        existing = self.describe(topic)
        if existing is not None:
            return len(existing["partitions"])
        return self.ensure(topic, -1)

    def partition_count(self, topic: str) -> int | None:
        """Partition count of ``topic``, or None if it does not exist (never created here). A
        count is kept once seen; a topic found missing is asked for again after
        ``missing_recheck_s``, so that a stage may call this per record."""
        count = self._counts.get(topic)
        if count is not None:
            return count
        seen_missing = self.missing.get(topic)
        if seen_missing is not None and time.monotonic() - seen_missing < self.missing_recheck_s:
            return None
        existing = self.describe(topic)
        if existing is None:
            self.missing[topic] = time.monotonic()
            return None
        self.missing.pop(topic, None)
        count = self._counts[topic] = len(existing["partitions"])
        return count

    def topic_partitions(self, topic: str) -> list[TopicPartition]:
        existing = self.describe(topic)
        if existing is None:
            raise KafkaLogError(f"topic {topic!r} does not exist")
        return [TopicPartition(topic, p["partition_index"]) for p in existing["partitions"]]

    def retention_ms(self, topic: str) -> int | None:
        """The topic's effective ``retention.ms`` (its own or the broker default); None when
        unlimited (-1)."""
        resource = ConfigResource(ConfigResourceType.TOPIC, topic, ["retention.ms"])
        with self._lock, kafka_call(f"describe configs of topic {topic!r}"):
            found = self._client().describe_configs([resource], config_filter="all")
        entry = found.get("topic", {}).get(topic, {}).get("retention.ms")
        if entry is None or entry.get("value") is None:
            raise KafkaLogError(f"topic {topic!r}: the broker reported no retention.ms (does the topic exist?)")
        value = int(entry["value"])
        return None if value < 0 else value

    def broker_auto_creates(self) -> bool:
        """The broker's ``auto.create.topics.enable`` (asked once; True when it cannot be told)."""
        if self._auto_create is None:
            try:
                with self._lock, kafka_call("describe the broker's configuration"):
                    admin = self._client()
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

    def group_offset(self, group: str, tp: TopicPartition) -> int:
        """The offset consumer group ``group`` committed for ``tp``; 0 when it has none."""
        with self._lock, kafka_call(f"committed offset of group {group!r} for {tp.topic}/{tp.partition}"):
            found = self._client().list_group_offsets({group: [tp]})
        meta = found.get(group, {}).get(tp)
        return max(0, meta.offset) if meta is not None else 0

    def close(self) -> None:
        with self._lock:
            if self._admin is not None:
                self._admin.close()
                self._admin = None
