"""Broker failover under load on a three-broker KRaft cluster (issue 31's third test).

The five stage processes run against ``kafka_cluster3`` (replication 3, min.insync.replicas 2,
the transaction state log replicated: ``TW_KAFKA_BROKERS=3 scripts/kafka.sh``). Under a steady
load, the broker that leads the timer topic's first partition is killed (SIGKILL: no controlled
shutdown; its partitions have no leader until the controller fences it, 6 s here) and started
again once the stages carried on without it; then the leader of the destination's first partition
is killed the same way. Nothing may be lost or early.

Duplicates: in at-least-once a write that Kafka does not acknowledge in time is sent again, so
each kill may repeat what dequeue-put had in flight, at most ``max_in_flight + batch_size`` per
shard (the bound of a dequeue-side disruption in ``e2e/test_chaos.py``). In exactly-once mode
(issue 31; the progress topic and the transaction state log replicated 3, min ISR 2), read
``read_committed``, there may be none. The count is printed as a FIGURE line.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from harness import STAGES, LoadRun, Pipeline
from infra import KafkaCluster

pytestmark = pytest.mark.e2e

SHARDS = 2
MAX_IN_FLIGHT = 200
BATCH_SIZE = 100
RATE = 60
#: How long a killed broker stays down: past the controller's fencing (6 s), so that its
#: partitions move to other leaders and the stages run on them.
DOWN_S = 10


@pytest.mark.parametrize("guarantee", ["at-least-once", "exactly-once"])
def test_a_partition_leader_killed_under_load_then_another_lose_nothing(
    tmp_path: Path, kafka_cluster3: KafkaCluster, redis_url: str, guarantee: str
) -> None:
    cluster = kafka_cluster3
    pipe = Pipeline(tmp_path, cluster.bootstrap, redis_url, replication=3, shards=SHARDS, max_in_flight=MAX_IN_FLIGHT,
                    batch_size=BATCH_SIZE, delivery_guarantee=guarantee)
    dest = pipe.new_dest("failover", 2)
    exactly_once = guarantee == "exactly-once"
    with pipe.running(), LoadRun(pipe, dest, seed=31, rate=RATE, min_delay_ms=500, max_delay_ms=8_000,
                                   read_committed=exactly_once) as run:
        kills = []
        for topic in (pipe.timer_topic, dest):
            time.sleep(5)
            cluster.wait_in_sync(topic)  # the broker killed before is back in every ISR
            leader = cluster.partitions(topic)[0]["leader_id"]
            kills.append((topic, leader))
            cluster.kill(leader)
            time.sleep(DOWN_S)
            assert not pipe.dead(), pipe.tails(pipe.dead())
            cluster.start(leader)
        for name in STAGES:
            pipe.wait_ready(name, 60)
        missing, rep = run.drain("three brokers", timeout_s=90)
        print(f"FIGURE three brokers ({guarantee}), leaders killed {kills} under {RATE} msg/s: {rep.line()}",
              flush=True)
        assert not missing, f"{len(missing)} lost: {sorted(missing)[:5]}; {rep.line()}"
        assert not rep.early, rep.line()
        bound = 0 if exactly_once else len(kills) * SHARDS * (MAX_IN_FLIGHT + BATCH_SIZE)
        assert rep.duplicated <= bound, f"{rep.duplicated} duplicates over the bound {bound}: {rep.line()}"
        pipe.stop_cleanly()
