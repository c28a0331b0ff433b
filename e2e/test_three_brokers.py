"""Broker failover under load on a three-broker KRaft cluster (issue 31's third test).

Two pipelines of five stage processes each, one at least once and one exactly once, run side by
side against ``kafka_cluster3`` (replication 3, min.insync.replicas 2, the transaction state log
replicated: ``TW_KAFKA_BROKERS=3 scripts/kafka.sh``). Under a steady load on both, the broker that leads the timer topic's first partition is killed (SIGKILL: no controlled
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
from contextlib import ExitStack
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


def test_partition_leaders_killed_under_load_lose_nothing_and_exactly_once_duplicates_nothing(
    tmp_path: Path, kafka_cluster3: KafkaCluster, redis_url: str
) -> None:
    """Both guarantees side by side, each a pipeline of its own (topics, Redis DB, data) on the same
    cluster under the same kills: the figures of the two compare within one run."""
    cluster = kafka_cluster3
    pipes = {g: Pipeline(tmp_path / g, cluster.bootstrap, redis_url, replication=3, shards=SHARDS,
                         max_in_flight=MAX_IN_FLIGHT, batch_size=BATCH_SIZE, delivery_guarantee=g)
             for g in ("at-least-once", "exactly-once")}
    dests = {g: pipe.new_dest("failover", 2) for g, pipe in pipes.items()}
    with ExitStack() as stack:
        runs = {}
        for g, pipe in pipes.items():
            stack.enter_context(pipe.running())
            runs[g] = stack.enter_context(LoadRun(pipe, dests[g], seed=31, rate=RATE, min_delay_ms=500,
                                                  max_delay_ms=8_000, read_committed=g == "exactly-once"))
        kills = []
        # the leader of the first timer partition, then of the first destination partition
        for topic in (pipes["at-least-once"].timer_topic, dests["exactly-once"]):
            time.sleep(5)
            for g, pipe in pipes.items():  # the broker killed before is back in every ISR
                cluster.wait_in_sync(pipe.timer_topic)
                cluster.wait_in_sync(dests[g])
            leader = cluster.partitions(topic)[0]["leader_id"]
            kills.append((topic, leader))
            cluster.kill(leader)
            time.sleep(DOWN_S)
            for pipe in pipes.values():
                assert not pipe.dead(), pipe.tails(pipe.dead())
            cluster.start(leader)
        for pipe in pipes.values():
            for name in STAGES:
                pipe.wait_ready(name, 60)
        for run in runs.values():
            run.load.stop()  # both loads end together
        reports = {g: run.drain(f"three brokers ({g})", timeout_s=90) for g, run in runs.items()}
        for g, (_missing, rep) in reports.items():
            print(f"FIGURE three brokers ({g}), leaders killed {kills} under {RATE} msg/s: {rep.line()}", flush=True)
        for g, (missing, rep) in reports.items():
            assert not missing, f"{g}: {len(missing)} lost: {sorted(missing)[:5]}; {rep.line()}"
            assert not rep.early, f"{g}: {rep.line()}"
            bound = 0 if g == "exactly-once" else len(kills) * SHARDS * (MAX_IN_FLIGHT + BATCH_SIZE)
            assert rep.duplicated <= bound, f"{g}: {rep.duplicated} duplicates over the bound {bound}: {rep.line()}"
        for pipe in pipes.values():
            pipe.stop_cleanly()
