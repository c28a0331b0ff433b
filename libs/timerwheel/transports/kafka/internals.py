"""The one place that reaches below kafka-python's public API, and why each reach is needed.

Checked against kafka-python 3.0.12 (the tests run on it) and 3.0.0 (its source has every
attribute used here); pyproject pins ``>=3,<4``. ``tests/transports/test_kafka_internals.py`` and
test_kafka_producers fail when an upgrade moves any of these. Nothing here writes into
kafka-python but ``set_fetch_wait``; everything else in ``transports.kafka`` uses only the public
methods of ``KafkaConsumer``, ``KafkaProducer`` and ``KafkaAdminClient``.

``set_fetch_wait``: a consumer's ``fetch_min_bytes`` / ``fetch_max_wait_ms`` switched while it
runs. kafka-python fixes them at construction (the fetcher keeps its own copy of the
configuration, read for each fetch it sends); timerwheel wants batched fetches while records
flow (``BATCHED_FETCH``: a fetch answered per record arriving costs the broker more CPU than
anything else at a steady rate) and long polls while idle (``LONG_POLL_FETCH``). Measured
(kafka-python 3.0.12, a local broker, one consumer of an idle partition polled for 10 s, twice
each, on the shared 2-core machine): with the batched settings 5.6-6.8 % of a core in the
client (kafka-python's fetch-rate 10.6-10.8/s), with the long-poll settings 0.4-0.5 % (0.5/s).
Without the switch an idle stage pays the first figure for ever, or a busy one a fetch per
record.

``failing_partition``: the partition whose batch a failed ``poll`` was decoding. kafka-python
raises ``CorruptRecordError`` / ``UnsupportedCodecError`` without saying which partition (its
fetcher keeps it in ``_next_partition_records``); without it a consumer of several partitions
could only stall them all (``KafkaConsumerAdapter`` sets aside that one partition and reads the
others on).

``has_metadata`` / ``ask_metadata``: the producer's metadata asked for many new topics in one
request. ``KafkaProducer.send`` waits for a new topic's metadata on its own, up to
``max_block_ms``, one topic after the other (``partitions_for`` likewise); a topic that does not
exist blocks the caller that long. Measured (kafka-python 3.0.12, a local broker that creates
topics on first use, twice each): 50 new topics, one ``send`` each, 11.4-11.8 s through ``send``
alone; 0.8-0.95 s with their metadata asked for together first (``producer.Appender`` does that).

``force_close``: close a producer whose records cannot be sent. ``KafkaProducer.close(timeout)``
flushes first and raises ``KafkaTimeoutError`` when records are still unsent, before it stops
its I/O thread, which then runs for ever (seen in e2e after a broker restart: a wedged
idempotent producer is replaced, and each replaced one left a thread behind).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from contextlib import suppress
from typing import Any

import kafka.errors as kafka_errors
from kafka import TopicPartition

__all__ = ["ask_metadata", "failing_partition", "force_close", "has_metadata", "set_fetch_wait"]


def set_fetch_wait(consumer: Any, settings: Mapping[str, int]) -> None:
    """Set ``fetch_min_bytes`` and ``fetch_max_wait_ms`` of ``consumer`` for its next fetches."""
    unknown = set(settings) - {"fetch_min_bytes", "fetch_max_wait_ms"}
    if unknown:
        raise ValueError(f"set_fetch_wait: only fetch_min_bytes and fetch_max_wait_ms, got {sorted(unknown)}")
    consumer._fetcher.config.update(settings)


def failing_partition(consumer: Any) -> TopicPartition | None:
    """The partition whose records a failed ``poll`` was decoding; None if it cannot be told."""
    part = getattr(consumer._fetcher, "_next_partition_records", None)
    tp = getattr(part, "topic_partition", None)
    return tp if isinstance(tp, TopicPartition) else None


def has_metadata(producer: Any, topic: str) -> bool:
    """Whether ``producer`` knows ``topic``'s partitions (a ``send`` to it would not wait)."""
    return producer._metadata.partitions_for_topic(topic) is not None


def ask_metadata(producer: Any, topics: Iterable[str]) -> threading.Event:
    """Add ``topics`` to those ``producer`` asks metadata for and have its I/O thread ask now,
    for all of them in one request; the event is set when the answer has arrived."""
    sender = producer._sender
    for topic in topics:
        sender.add_topic(topic)
    answered = threading.Event()
    producer._metadata.request_update().add_both(lambda *_: answered.set())
    sender.wakeup()
    return answered


def force_close(producer: Any, timeout_s: float) -> None:
    """Close ``producer``, failing whatever it could not send within ``timeout_s`` (their futures
    raise) and stopping its I/O thread."""
    try:
        producer.close(timeout=timeout_s)
        return
    except kafka_errors.KafkaError:
        pass
    sender = producer._sender
    sender.force_close()  # fails the pending records' futures, stops the I/O thread
    sender.join(5)
    with suppress(kafka_errors.KafkaError):
        producer.close(timeout=0)
