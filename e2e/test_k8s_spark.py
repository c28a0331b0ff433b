"""The chart's Spark jobs on Spark's own Kubernetes scheduler (spark.kubernetes), on the real
local cluster (scripts/k8s.sh):

    the five stages as processes on this machine, Kafka with a listener on the node address:
    a short run with cancels, a few messages due 20 minutes ahead, one delivery written twice
    -> helm install: no TimerWheel (the stages are this test's), spark.kubernetes with two
       executors of 1 core and 512m, the audit CronJob, spark.dataClaim a hostPath volume of this
       machine
    -> a Job from the audit CronJob: its pod is Spark's driver and starts two executor pods of the
       Spark image, owned by it, which read the topics through the node address and run the tasks
       -> summary.json equals what the test produced and consumed (audit_truth), the duplicated
       list the executors wrote to the claim names the copied delivery
    -> the Job deleted: its driver pod goes, and the executor pods with it (their owner)

Kept short for CI: 126 messages, executors of 100m CPU requested and 512m of heap, the audit only
(the forecast CronJob runs on the same driver, executor pod template and RBAC; its Job on two
executors took another 200 s here, so it is checked offline, tests/chart/test_chart_spark.py).
Figures (the Job's time, the pods' peak memory) are printed as ``FIGURE`` lines, never asserted.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from audit_truth import audit_summary
from harness import Collector, Pipeline, TimerProducer, now_ms
from k8s_cluster import Cluster
from kafka import KafkaProducer
from spark_release import EXECUTOR, JobRun, SparkRelease, external_kafka, spark_release
from test_spark_jobs import caught_up

pytestmark = [pytest.mark.k8s, pytest.mark.e2e]

NAMESPACE = "spark-jobs"
RELEASE = "tws"
GRACE_MS = 30_000
EXECUTORS = 2
AHEAD_MS = 20 * 60_000  # messages still pending at the audit's now
SPARK = {
    "resources": {"requests": {"cpu": "100m", "memory": "768Mi"}, "limits": {"memory": "1536Mi"}},
    "kubernetes": {
        "enabled": True,
        "executors": {"instances": EXECUTORS, "cores": 1, "memory": "512m"},
        # fits beside everything else on the two cores; the executor pods stay after the
        # application (Completed) so the test can read who ran what
        "conf": {"spark.kubernetes.executor.request.cores": "100m",
                 "spark.kubernetes.executor.deleteOnTermination": "false"},
    },
    "audit": {"enabled": True, "schedule": "0 0 1 1 *", "graceMs": GRACE_MS},
}


def _copy(pipe: Pipeline, topic: str, d: Any) -> None:
    """``d`` written again to its topic, as a producer's retry writes it: a second copy."""
    producer = KafkaProducer(bootstrap_servers=pipe.kafka, **pipe.kafka_options)
    try:
        producer.send(topic, key=d.key, value=d.value, headers=list(d.headers.items()),
                      partition=d.partition).get(timeout=30)
    finally:
        producer.close()


def _ran_on_executors(rel: SparkRelease, run: JobRun) -> dict[str, int]:
    """The tasks each executor pod ran (its log), after checking it is the driver's: same image,
    owned by the driver's pod."""
    driver = run.driver["metadata"]["name"]
    tasks = {}
    for name, pod in run.executors.items():
        owners = [(o["kind"], o["name"]) for o in pod["metadata"].get("ownerReferences", [])]
        assert owners == [("Pod", driver)], (name, owners)
        (c,) = pod["spec"]["containers"]
        assert (c["image"], c["args"]) == ("timerwheel-spark:dev", ["executor"]), (name, c)
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True, name  # the chart's pod template
        tasks[name] = rel.executor_log(name).count("Running task ")
    return tasks


def _figure(what: str, run: JobRun) -> None:
    def mib(peaks: dict[str, int]) -> dict[str, int]:
        return {n.rsplit("-", 1)[-1] if n in run.executors else "driver": round(b / 2**20) for n, b in peaks.items()}

    print(f"FIGURE {what}: done {run.seconds:.1f} s after the Job was created, first executor running after "
          f"{run.first_executor_running_s or float('nan'):.1f} s; peak RSS (MiB) {mib(run.peak_rss)}, peak cgroup "
          f"usage with page cache {mib(run.peak_memory)}", flush=True)


def test_the_audit_on_two_executor_pods_equals_the_runs_own_counts(
    k8s: Cluster, kafka_control: Any, redis_control: Any, kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    if not kafka_control.managed:
        pytest.fail("the executor pods need Kafka on an address they reach: only the broker scripts/kafka.sh "
                    "starts can be asked to listen there (TW_LISTEN_HOST); unset TW_KAFKA_BOOTSTRAP", pytrace=False)
    kafka_pods = external_kafka(k8s.host_ip)
    pipe = Pipeline(tmp_path, kafka_bootstrap, redis_url, max_delay_ms=3_600_000)
    pipe.create_timer_topic()
    pipe.create_topic(pipe.dlq_topic, 1)
    dest_a, dest_b = pipe.new_dest("a", 2), pipe.new_dest("b", 3)
    # The Spark jobs judge the timer records with the stages' settings.
    spec = {"shards": int(str(pipe.settings["shards"])), "timerTopic": pipe.timer_topic, "dlqTopic": pipe.dlq_topic,
            "timerPartitions": int(str(pipe.settings["timer_partitions"])),
            "allowTopics": [str(pipe.settings["allow_topics"])], "maxDelayMs": 3_600_000,
            "kafka": {"bootstrap": kafka_pods}}

    with spark_release(k8s, NAMESPACE, RELEASE) as rel:
        rel.install(spec, SPARK, tmp_path)
        with pipe.running(), TimerProducer(pipe, seed=32) as producer, Collector(pipe, [dest_a, dest_b]) as collector:
            rng = random.Random(32)
            start = now_ms()
            first = [producer.schedule(dest_a if i % 2 else dest_b, start + rng.randint(1_000, 8_000))
                     for i in range(120)]
            later = [producer.schedule(dest_a if i % 2 else dest_b, start + AHEAD_MS + i * 60_000) for i in range(6)]
            for m in rng.sample([m for m in first if m.deliver_at_ms - start >= 5_000], 15) + later[:2]:
                producer.cancel(m)
            producer.flush()
            later_ids = {m.message_id for m in later}
            expected = {mid: m for mid, m in producer.expected().items() if mid not in later_ids}
            assert len(producer.messages) == 126, "the producer's sends were not all acknowledged"
            missing = collector.wait_for(expected, 90, pipe)
            assert not missing, f"{len(missing)} not delivered\n{pipe.tails()}"
            twice = next(iter(expected))
            _copy(pipe, expected[twice].topic, collector.by_id[twice][0])
            pipe.stop_cleanly()
            caught_up(pipe, collector)

        # The run's own counts, from what the test produced and what its collector consumed.
        sched = {mid: (m.topic, m.deliver_at_ms) for mid, m in producer.messages.items()}
        deliveries: dict[str, list[int]] = {}
        for d in collector.records:
            deliveries.setdefault(d.headers["tw-id"].decode(), []).append(d.delivered_at_ms)
        assert len(deliveries[twice]) == 2
        cancelled = set(producer.cancelled)

        audit = rel.run_job("spark-audit", "audit-now")
        assert audit.succeeded, audit.driver_log[-3000:] + rel.diagnosis("audit-now")
        _figure(f"the audit CronJob's Job on {EXECUTORS} executor pods ({len(sched)} messages)", audit)
        tasks = _ran_on_executors(rel, audit)
        assert len(tasks) == EXECUTORS and all(tasks.values()), tasks
        out = rel.volume_dir / "audit" / "latest"
        summary = json.loads((out / "summary.json").read_text())
        total, per_topic = audit_summary(sched, cancelled, deliveries, summary["now_ms"], GRACE_MS)
        # not vacuous: the run had each kind the audit counts
        assert (total["cancelled"], total["pending"]) == (17, 4) and total["duplicated"] >= 1, total
        assert summary["total"] == total, f"audit {summary['total']}\nrun   {total}"
        assert summary["topics"] == per_topic and set(per_topic) == {dest_a, dest_b}
        assert summary["dead_lettered"] == 0 and summary["bad_input"]["invalid_timer_records"] == 0
        # written by the executors, onto the claim the driver and they share
        assert set(pd.read_parquet(out / "duplicated")["id"]) == {m for m, c in deliveries.items() if len(c) > 1}

        # A finished Job's pods go with it (a CronJob keeps three): the executors with their driver.
        gone = set(audit.executors)
        assert gone <= {p["metadata"]["name"] for p in rel.pods(EXECUTOR)}, "executor pods gone before their Job"
        rel.kubectl("delete", "job", "audit-now", "--cascade=background")
        deadline = time.monotonic() + 120
        while gone & {p["metadata"]["name"] for p in rel.pods(EXECUTOR)}:
            assert time.monotonic() < deadline, rel.diagnosis()
            time.sleep(1)
