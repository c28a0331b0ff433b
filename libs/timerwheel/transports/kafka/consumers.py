"""Consumers of Kafka topics: ``KafkaConsumerAdapter`` (``Consumer``: assigned partitions from
offsets the caller owns, enqueue-get's input) and ``KafkaGroupConsumer`` (``GroupConsumer``: a
member of a consumer group, ``timerwheel.retry``'s input); ``to_record`` turns kafka-python's
records into timerwheel's.

What they guarantee:

- Every consumer reads ``read_committed``: aborted records are never returned, and a consumer
  reports its *position* (the next offset to read, past transaction markers and aborted or
  compacted records), not "last offset + 1", so that a caller can tell a gap it skipped on
  purpose from records lost on the way.
- ``KafkaConsumerAdapter`` commits nothing to a group unless ``monitor_group`` asks for it, and
  then only so that standard lag tools can see progress; resumption uses the caller's
  checkpoints. ``KafkaGroupConsumer`` is a real group member instead: Kafka assigns its
  partitions and it commits what it is told to.
- A batch that cannot be decoded (corruption, a codec added to Kafka later) stops only its own
  partition: the consumer sets it aside, reports it in ``undecodable`` with its offset and the
  reason (``ReportsUndecodable``), retries it every ``UNDECODABLE_RETRY_S`` (longer after each
  failure) from the same offset, and goes on reading the others.
- A consumer fetches batched while records flow and in long polls while its caller waits
  (``clients.BATCHED_FETCH`` / ``LONG_POLL_FETCH``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from typing import Any

import kafka.errors as kafka_errors
from kafka import TopicPartition
from kafka.structs import OffsetAndMetadata

from timerwheel.log import stage_logger
from timerwheel.records import Record
from timerwheel.transports.base import Undecodable
from timerwheel.transports.kafka import internals
from timerwheel.transports.kafka.clients import BATCHED_FETCH, LONG_POLL_FETCH
from timerwheel.transports.kafka.errors import UNDECODABLE, KafkaLogError, refusal

__all__ = ["UNDECODABLE_RETRY_S", "KafkaConsumerAdapter", "KafkaGroupConsumer", "to_record"]

#: A partition set aside for a batch it could not decode is tried again this often.
UNDECODABLE_RETRY_S = 30.0


def to_record(rec: Any) -> Record:
    """timerwheel's ``Record`` of a kafka-python ``ConsumerRecord``."""
    return Record(
        topic=rec.topic,
        partition=rec.partition,
        offset=rec.offset,
        timestamp_ms=rec.timestamp,
        key=rec.key,
        value=rec.value,
        headers=tuple((k, bytes(v) if v is not None else b"") for k, v in rec.headers or ()),
    )


class KafkaConsumerAdapter:
    """``Consumer`` over some partitions of one topic, positioned by the caller.

    ``position`` is Kafka's own fetch position: past transaction markers and aborted records too,
    so a caller sees such offsets as skipped, not lost. A batch that cannot be decoded sets its
    partition aside (``undecodable``) and the others go on; the set-aside partition is retried
    from the same offset with a new consumer, so nothing of the failed fetch is kept."""

    def __init__(self, make_consumer: Callable[[], Any], topic: str, offsets: Mapping[int, int],
                 monitor_group: str | None) -> None:
        self._make_consumer = make_consumer
        self._topic = topic
        self._monitor_group = monitor_group
        self._positions: dict[int, int] = dict(offsets)
        self._tps = {p: TopicPartition(topic, p) for p in offsets}
        #: partition -> why it is set aside (a batch it cannot decode).
        self.undecodable: dict[int, Undecodable] = {}
        #: Set-aside partitions being tried again; one that reads past its offset decodes again.
        self._retrying: dict[int, Undecodable] = {}
        self._consumer: Any = None
        #: The consumer fetches in long polls: the last poll had a timeout.
        self._waiting = False
        self._assign()

    def _assign(self) -> None:
        """(Re)build the consumer over the partitions not set aside, at their positions."""
        if self._consumer is None:
            self._consumer = self._make_consumer()
        active = [p for p in self._positions if p not in self.undecodable]
        self._consumer.assign([self._tps[p] for p in active])
        for p in active:
            self._consumer.seek(self._tps[p], self._positions[p])

    def poll(self, max_records: int, timeout_s: float) -> list[Record]:
        if self.undecodable:
            self._retry_undecodable()
        consumer = self._consumer
        waiting = timeout_s > 0
        if waiting != self._waiting:
            internals.set_fetch_wait(consumer, LONG_POLL_FETCH if waiting else BATCHED_FETCH)
            self._waiting = waiting
        try:
            batches = consumer.poll(timeout_ms=max(0, int(timeout_s * 1000)), max_records=max_records)
        except UNDECODABLE as exc:
            self._set_aside(exc)
            return []
        except kafka_errors.KafkaError as exc:
            raise KafkaLogError(f"poll of topic {self._topic!r} failed: {exc}") from exc
        out: list[Record] = []
        for tp in sorted(batches, key=lambda tp: tp.partition):
            out.extend(to_record(r) for r in batches[tp])
        positions = self._positions
        for p in positions:
            if p not in self.undecodable:
                at = self._fetch_position(p)
                if at is not None:
                    positions[p] = at
        for p, u in list(self._retrying.items()):
            if positions[p] > u.offset:
                del self._retrying[p]
                stage_logger("kafka").info("partition decodes again", topic=self._topic, partition=p,
                                           offset=u.offset, tries=u.tries)
        return out

    def _fetch_position(self, partition: int) -> int | None:
        """The consumer's next offset to read for ``partition``, without waiting on the network
        (kafka-python's public ``position``: ~20 us a partition here, as it checks every assigned
        position on each call; reading its subscription state directly took 0.2 us)."""
        try:
            at = self._consumer.position(self._tps[partition], timeout_ms=0)
        except kafka_errors.KafkaError:
            return None
        return None if at is None else int(at)

    def _set_aside(self, exc: BaseException) -> None:
        """The batch being decoded failed: set its partition aside and go on with the others."""
        tp = internals.failing_partition(self._consumer)
        active = [p for p in self._positions if p not in self.undecodable]
        if tp is None and len(active) == 1:
            tp = self._tps[active[0]]
        if tp is None or tp.partition not in self._positions:
            raise KafkaLogError(f"poll of topic {self._topic!r} failed: {exc}") from exc
        p = tp.partition
        at = self._fetch_position(p)
        if at is not None:
            self._positions[p] = at
        reason = refusal(exc)
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
        self._consumer.seek(self._tps[partition], offset)

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
        offsets = {self._tps[p]: OffsetAndMetadata(o, "", -1) for p, o in self._positions.items()
                   if p not in self.undecodable}
        with suppress(kafka_errors.KafkaError):
            self._consumer.commit_async(offsets=offsets)

    def close(self) -> None:
        self._consumer.close(autocommit=False)


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
        return [to_record(r) for tp in sorted(batches) for r in batches[tp]]

    def assignment(self) -> set[tuple[str, int]]:
        """The ``(topic, partition)`` pairs Kafka has assigned to this member now."""
        return {(tp.topic, tp.partition) for tp in self._consumer.assignment()}

    def commit(self, offsets: Mapping[tuple[str, int], int]) -> None:
        try:
            self._consumer.commit({TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in offsets.items()})
        except kafka_errors.KafkaError as exc:
            raise KafkaLogError(f"commit of group {self.group!r} failed: {exc}") from exc

    def close(self) -> None:
        self._consumer.close(autocommit=False)
