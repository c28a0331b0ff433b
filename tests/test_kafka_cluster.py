"""The three-broker Kafka cluster of the failover tests (``kafka_cluster3`` in tests/infra.py,
``TW_KAFKA_BROKERS=3`` in scripts/kafka.sh): replicated as configured, and still serving writes
with acks=all, transactional ones included, once the leader of a partition is killed."""

from __future__ import annotations

import time
import uuid

from infra import KafkaCluster
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType, NewTopic


def _read_all(bootstrap: str, topic: str, count: int, timeout_s: float = 60) -> list[bytes]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                             isolation_level="read_committed", auto_offset_reset="earliest")
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        got: list[bytes] = []
        deadline = time.monotonic() + timeout_s
        while len(got) < count and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                got += [r.value for r in records]
        return got
    finally:
        consumer.close(autocommit=False)


def test_a_killed_leader_leaves_two_in_sync_replicas_that_take_acks_all_and_transactions(
    kafka_cluster3: KafkaCluster,
) -> None:
    cluster = kafka_cluster3
    topic = f"cluster3-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=cluster.bootstrap, client_id="tw-test-cluster3")
    try:
        admin.create_topics([NewTopic(topic, 1, -1)])  # the brokers' defaults: replication 3, min ISR 2
        cluster.wait_in_sync(topic)
        # The broker asked answers with no configs for a topic it does not know yet (kafka-python
        # does not raise on the result's error): asked again until it does, at most 30 s.
        deadline = time.monotonic() + 30
        while True:
            configs = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)], config_filter="all")
            if configs.get("topic", {}).get(topic) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        internal = admin.describe_topics(["__transaction_state", "__consumer_offsets"])
    finally:
        admin.close()
    assert configs["topic"][topic]["min.insync.replicas"]["value"] == "2", configs
    for t in internal:
        assert {len(p["replica_nodes"]) for p in t["partitions"]} == {3}, t
    cluster.wait_in_sync(topic)
    (part,) = cluster.partitions(topic)
    assert sorted(part["replica_nodes"]) == [1, 2, 3], part
    leader = part["leader_id"]

    cluster.kill(leader)
    try:
        producer = KafkaProducer(bootstrap_servers=cluster.bootstrap, acks="all", retries=100,
                                 request_timeout_ms=10_000, delivery_timeout_ms=60_000)
        try:
            for i in range(20):
                producer.send(topic, f"plain-{i}".encode()).get(timeout=60)
        finally:
            producer.close(timeout=10)
        tx = KafkaProducer(bootstrap_servers=cluster.bootstrap, transactional_id=f"tw-test-{topic}",
                           request_timeout_ms=10_000)
        try:
            tx.init_transactions()
            tx.begin_transaction()
            for i in range(5):
                tx.send(topic, f"tx-{i}".encode())
            tx.commit_transaction()
        finally:
            tx.close(timeout=10)
        assert _read_all(cluster.bootstrap, topic, 25) == [f"plain-{i}".encode() for i in range(20)] + \
            [f"tx-{i}".encode() for i in range(5)]
        (after,) = cluster.partitions(topic)
        assert after["leader_id"] not in (leader, -1), after
        assert sorted(after["isr_nodes"]) == sorted({1, 2, 3} - {leader}), after  # fenced out of the ISR
    finally:
        cluster.start(leader)
    cluster.wait_in_sync(topic)  # whole again for the next test
