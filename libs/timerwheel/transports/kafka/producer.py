"""Appending to Kafka: durable, in order, without blocking on destinations that do not exist.

What it guarantees:

- ``append`` is durable when it returns: an idempotent producer with ``acks=all`` (no duplicates
  from the producer's own retries, order kept per partition). It waits for every record and
  raises ``KafkaLogError`` if any failed; the error's ``written`` list says which were
  acknowledged, so a caller can retry only the rest (RocketMQ #6984 retried whole batches and
  duplicated). ``refused`` names the records Kafka refuses for good (too large, an invalid topic).
- ``append`` never blocks on a destination that does not exist: the metadata of every new topic
  of a batch is asked for in one round trip (a fan-out to hundreds of new topics costs one
  wait, not one per topic), and records whose topic is still unknown after ``metadata_wait_s``
  are not sent: they come back in ``KafkaLogError.missing`` for the caller to hold or
  dead-letter, while the batch's other records are written. Records for topics the producer
  knows go first, so a new topic's wait costs only its own records.
- A producer that stalls (seen after a broker restart: records held until the delivery timeout,
  or for good) is replaced: records not acknowledged within ``stall_timeout_s`` are failed and
  the caller retries them. A record reported failed may still have been written (a lost ack),
  so a retry may duplicate it, never lose it.
- ``append_atomic`` writes records in one transaction (a transactional producer of its own):
  a ``read_committed`` reader, every stage, sees all of them or none. Its transactional id is
  the caller's, stable across restarts (``TimerClient``: one per client id), and its transaction
  timeout short (``ATOMIC_TRANSACTION_TIMEOUT_MS``): while a transaction is open on a timer
  partition, enqueue-put's ``W`` waits for it to end (a cancel behind it must not be passed), so
  a client that crashes in the middle holds ``W`` back only until the broker aborts it (the
  timeout plus the broker's abort sweep, ``transaction.abort.timed.out.transaction.cleanup.
  interval.ms``, 10 s by default), and not at all once it restarts: ``init_transactions`` under
  the same id aborts the open transaction at once and fences the crashed producer. (A random id,
  as before, left it open for the 60 s default, its restart unable to end it.) The transaction
  itself is ``transactions.TransactionalProducer``'s, as are enqueue-get's dead letters.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from contextlib import suppress
from typing import Any

import kafka.errors as kafka_errors

from timerwheel.clock import Clock
from timerwheel.records import OutRecord
from timerwheel.transports.kafka import internals
from timerwheel.transports.kafka.admin import Topics
from timerwheel.transports.kafka.clients import KafkaClients, send_record
from timerwheel.transports.kafka.errors import REFUSED, KafkaLogError, refusal
from timerwheel.transports.kafka.transactions import TransactionalProducer
from timerwheel.transports.partitioner import kafka_partitions

__all__ = ["ATOMIC_TRANSACTION_TIMEOUT_MS", "Appender"]

#: ``append_atomic``'s transaction timeout: a transaction of two records takes tens of ms; one
#: left open by a crash holds the timer partition's W (see the module header) this long at most,
#: plus the broker's abort sweep.
ATOMIC_TRANSACTION_TIMEOUT_MS = 5_000


def keyed_partitions(producer: Any, records: Sequence[OutRecord], indexes: Sequence[int],
                     unready: set[str]) -> dict[int, int]:
    """Index -> partition of the records of ``indexes`` with a key and no partition, whose topic's
    partitions ``producer`` knows (not in ``unready``): where kafka-python's default partitioner
    would put each (the sorted partitions, ``toPositive(murmur2(key)) % n``), computed for the
    batch at once. kafka-python hashes a key in Python as it sends it: measured, 18 % of
    dequeue-put's ``send`` time releasing a burst of 20,000 keyed records."""
    by_topic: dict[str, list[int]] = {}
    for i in indexes:
        r = records[i]
        if r.key is not None and r.partition is None and r.topic not in unready:
            by_topic.setdefault(r.topic, []).append(i)
    out: dict[int, int] = {}
    for topic, idxs in by_topic.items():
        known = sorted(producer.partitions_for(topic) or ())
        if not known:
            continue  # kafka-python decides (and waits for the topic), as for any record
        picks = kafka_partitions([bytes(records[i].key or b"") for i in idxs], len(known))
        out.update(zip(idxs, (known[p] for p in picks), strict=True))
    return out


class Appender:
    """The producers of one ``KafkaCommitLog``: made on first use, replaced when they stall."""

    def __init__(self, clients: KafkaClients, topics: Topics, *, clock: Clock | None, compression: str | None,
                 max_request_size: int, stall_timeout_s: float, metadata_wait_s: float,
                 creating_wait_s: float) -> None:
        self._clients = clients
        self._topics = topics
        #: Stamps records whose ``timestamp_ms`` is None; without a clock Kafka's producer does.
        self._clock = clock
        self._compression = compression
        self._max_request_size = max_request_size
        #: ``append`` gives up on acknowledgements after this long and replaces the producer.
        self.stall_timeout_s = min(stall_timeout_s, clients.delivery_timeout_ms / 1000 + 5)
        #: ``append`` waits this long, once per batch, for the metadata of topics it has not written yet.
        self.metadata_wait_s = metadata_wait_s
        #: ... and this long for a topic the broker says exists (auto-created, its leader not elected yet).
        self.creating_wait_s = creating_wait_s
        #: Topics a record was sent to before the producer had their metadata: kafka-python's
        #: ``send`` then waited for it, one topic after the other (tests; 0 in a healthy run).
        self.metadata_waits = 0
        self._producer: Any = None
        #: ``append_atomic``'s producer (of the last transactional id it was called with).
        self._tx: TransactionalProducer | None = None
        self._lock = threading.Lock()

    def _get_producer(self) -> Any:
        with self._lock:
            if self._producer is None:
                self._producer = self._clients.producer(
                    "producer", linger_ms=5, batch_size=512 * 1024, compression_type=self._compression,
                    max_request_size=self._max_request_size)
            return self._producer

    def append(self, records: Sequence[OutRecord]) -> list[tuple[int, int]]:
        if not records:
            return []
        producer = self._get_producer()
        futures: list[Any] = [None] * len(records)
        written: list[tuple[int, int] | None] = [None] * len(records)
        errors: list[str] = []
        refused: dict[int, str] = {}
        missing: dict[int, str] = {}
        known, new = self._split_by_metadata(producer, {r.topic for r in records})
        self._send(producer, records, [i for i, r in enumerate(records) if r.topic in known],
                   futures, errors, refused, missing)
        absent = self._await_metadata(producer, new) if new else set()
        self._send(producer, records, [i for i, r in enumerate(records) if r.topic in new and r.topic not in absent],
                   futures, errors, refused, missing)
        for i, r in enumerate(records):
            if r.topic not in known and (r.topic not in new or r.topic in absent):
                missing[i] = r.topic  # found missing before, or now: not sent
        # Wait at most ``stall_timeout_s`` for the acknowledgements (see the module header).
        deadline = time.monotonic() + self.stall_timeout_s
        with suppress(kafka_errors.KafkaError):  # the futures below say which records failed
            producer.flush(timeout=self.stall_timeout_s)
        for i, fut in enumerate(futures):
            if fut is None:
                continue
            if not fut.is_done and time.monotonic() >= deadline:
                errors.append(f"{records[i].topic}: not acknowledged within {self.stall_timeout_s:g}s")
                continue
            try:
                md = fut.get(timeout=max(0.1, deadline - time.monotonic()))
            except kafka_errors.KafkaError as exc:
                errors.append(f"{records[i].topic}: {exc}")
                if isinstance(exc, REFUSED):
                    refused[i] = refusal(exc)
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
        unready = {t for t in {records[i].topic for i in indexes} if not internals.has_metadata(producer, t)}
        self.metadata_waits += len(unready)
        chosen = keyed_partitions(producer, records, indexes, unready)
        for i in indexes:
            r = records[i]
            ts = r.timestamp_ms
            if ts is None and self._clock is not None:
                ts = self._clock.now_ms()
            try:
                futures[i] = send_record(producer, r, ts, chosen.get(i))
            except REFUSED as exc:
                errors.append(f"{r.topic}: {exc}")
                refused[i] = refusal(exc)
            except kafka_errors.KafkaTimeoutError:
                # Its metadata went away since it was looked up (a deleted topic): not sent, so
                # it is the caller's to hold like a missing topic.
                missing[i] = r.topic
                self._topics.missing[r.topic] = time.monotonic()
            except kafka_errors.KafkaError as exc:
                errors.append(f"{r.topic}: {exc}")

    def _split_by_metadata(self, producer: Any, topics: set[str]) -> tuple[set[str], set[str]]:
        """(topics the producer has metadata for, new topics to wait for). Topics found missing
        before are in neither and are not waited for again: every ``missing_recheck_s`` their
        metadata is asked for without waiting, and they are known once it has arrived."""
        missing = self._topics.missing
        known = {t for t in topics if internals.has_metadata(producer, t)}
        for topic in known & missing.keys():
            del missing[topic]
        now = time.monotonic()
        new: set[str] = set()
        recheck: list[str] = []
        for topic in topics - known:
            seen = missing.get(topic)
            if seen is None:
                new.add(topic)
            elif now - seen >= self._topics.missing_recheck_s:
                missing[topic] = now
                recheck.append(topic)
        if recheck:
            internals.ask_metadata(producer, recheck)
        return known, new

    def _await_metadata(self, producer: Any, topics: set[str]) -> set[str]:
        """Of these new topics, those that do not exist: the rest have metadata now.

        Every new topic is asked for at once (``internals.ask_metadata``). On a broker that
        creates topics on first use, that creates them: they are waited for up to
        ``creating_wait_s``. On one that does not, a topic still unknown after
        ``metadata_wait_s`` is looked up with the admin client: one that exists (just created
        by someone) is waited for as well, the others are missing at once."""
        if self._topics.broker_auto_creates():
            left = self._refresh_until(producer, set(topics), self.creating_wait_s)
        else:
            left = self._refresh_until(producer, set(topics), self.metadata_wait_s)
            if left:
                creating = self._topics.existing(sorted(left))
                left = (left - creating) | self._refresh_until(producer, creating, self.creating_wait_s)
        now = time.monotonic()
        for topic in left:
            self._topics.missing[topic] = now
        return left

    @staticmethod
    def _refresh_until(producer: Any, topics: set[str], wait_s: float) -> set[str]:
        """Ask for the metadata of ``topics`` until all have some or ``wait_s`` passed; the rest."""
        deadline = time.monotonic() + wait_s
        left = {t for t in topics if not internals.has_metadata(producer, t)}
        while left and time.monotonic() < deadline:
            answered = internals.ask_metadata(producer, left)
            answered.wait(max(0.0, min(deadline - time.monotonic(), 1.0)))
            left = {t for t in left if not internals.has_metadata(producer, t)}
            if left:
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return left

    def _drop_producer(self, producer: Any) -> None:
        with self._lock:
            if self._producer is producer:
                self._producer = None
        internals.force_close(producer, 0)

    def append_atomic(self, records: Sequence[OutRecord], transactional_id: str) -> list[tuple[int, int]]:
        """Append ``records`` in one Kafka transaction under ``transactional_id``; a failed
        transaction is aborted and raises ``KafkaLogError`` (nothing was written), and the producer
        is made again on the next call (after a fence by another producer with the same id, its
        ``init_transactions`` fences that one in turn). An empty call only connects the
        transactional producer (``init_transactions`` takes a while, and aborts a transaction a
        crashed producer with this id left open)."""
        with self._lock:
            tx = self._tx
            if tx is None or tx.transactional_id != transactional_id:
                if tx is not None:
                    tx.close()
                tx = self._tx = TransactionalProducer(
                    self._clients, transactional_id, timeout_ms=ATOMIC_TRANSACTION_TIMEOUT_MS,
                    compression=self._compression, max_request_size=self._max_request_size)
            tx.init()
            if not records:
                return []
            try:
                return tx.run(records)
            except KafkaLogError as exc:
                raise KafkaLogError(f"append_atomic: {exc}", unknown_outcome=exc.unknown_outcome) from None

    def close(self) -> None:
        with self._lock:
            if self._producer is not None:
                internals.force_close(self._producer, 5)
            if self._tx is not None:
                self._tx.close()
            self._producer, self._tx = None, None
