"""The reaches below kafka-python's public API (``transports.kafka.internals``) still do what they
are for on the installed kafka-python, against a real broker: an upgrade that moves them fails
here or where they are exercised already: ``failing_partition`` by test_kafka_producers'
undecodable batch (two partitions), ``has_metadata`` / ``ask_metadata`` by its missing and
fan-out topics, ``force_close`` by test_kafka's broker outage (no producer thread left behind)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from kafka import KafkaConsumer, TopicPartition
from timerwheel.transports.kafka import internals
from timerwheel.transports.kafka.clients import BATCHED_FETCH, LONG_POLL_FETCH
from timerwheel.transports.kafka.log import KafkaCommitLog


@pytest.fixture(scope="module")
def log(kafka_bootstrap: str) -> Iterator[KafkaCommitLog]:
    commit_log = KafkaCommitLog(kafka_bootstrap, client_id="test-internals")
    yield commit_log
    commit_log.close()


def test_a_running_consumer_switches_to_long_polls_while_idle(log: KafkaCommitLog, kafka_bootstrap: str) -> None:
    topic = f"t-{uuid.uuid4().hex[:10]}"
    log.ensure_topic(topic, 1)
    consumer = KafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=None, **BATCHED_FETCH)
    try:
        consumer.assign([TopicPartition(topic, 0)])
        consumer.seek(TopicPartition(topic, 0), 0)
        internals.set_fetch_wait(consumer, LONG_POLL_FETCH)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # nothing to read: the broker holds each fetch
            assert consumer.poll(timeout_ms=500) == {}
        held = consumer.metrics()["consumer-fetch-manager-metrics"]["fetch-latency-max"]
        # A fetch the broker held for fetch_max_wait_ms (500 ms), not BATCHED_FETCH's 20 ms.
        assert held >= 450, f"the longest fetch took {held} ms: the long-poll settings did not take"
    finally:
        consumer.close()
