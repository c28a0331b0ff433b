"""The audit on Spark's Kubernetes scheduler (the chart's spark.kubernetes) at the size docs/spark.md
sizes it by: N timer records and their N deliveries, audited by the chart's audit CronJob on the
local cluster (scripts/k8s.sh) in each of a few layouts, one after the other on the same topics:
E executor pods of C cores and heap M each, or ``local[K]`` in the job's one pod.

    .venv/bin/python -m bench.bench_spark_k8s

Not in ``python -m bench`` (it needs the cluster). It fills the topics first, then takes the
machine's cluster lock (/tmp/tw-k8s.lock, as ``flock`` does) for the cluster part only. Size: ``TW_BENCH_SPARK_K8S_N``
(default 10,000,000 timer records). Layouts: ``TW_BENCH_SPARK_K8S_LAYOUTS``, comma-separated
``ExCxM`` (executors x cores x heap) or ``local[K]``; default ``2x1x2g,local[2]``. The job's pod
(the driver, or all the work with local[K]) has a heap of ``TW_BENCH_SPARK_K8S_DRIVER_MEMORY``
(default 1g on the Kubernetes scheduler, 4g on local[K]). The executors ask for 700m CPU each so
that two fit beside the driver on a 2-core node, and may use whole cores. Kafka: scripts/kafka.sh's
broker with a listener on the node address; the topics are filled by a local Spark session here
and deleted at the end. The cluster is taken down at the end if this started it (unless
``TW_KEEP_SERVERS=1``).

Each layout's figure line: the Job's time from creation to its end (pod start, JVM start, the
executors' start and the audit), records/s, the time to the first executor running, each pod's
peak RSS and peak cgroup usage (page cache included), and the load average (the machine is shared).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.bench_production import servers
from bench.bench_spark import fill
from bench.common import emit, say

ROOT = Path(__file__).resolve().parents[1]
#: deliveries due in the last HOURS hours: a few hourly rows per topic
HOURS = 4
PARTITIONS = 4  # the chart's default timerPartitions
LOCK = "/tmp/tw-k8s.lock"  # one per machine: every checkout takes it to use the cluster


def _layout(text: str, driver_memory: str | None) -> dict[str, Any]:
    """The spark values of a layout: ``ExCxM`` or ``local[K]``."""
    local = re.fullmatch(r"local\[(\d+)\]", text)
    heap = driver_memory or ("4g" if local else "1g")
    gib = float(heap[:-1]) / (1024 if heap.endswith("m") else 1)
    values: dict[str, Any] = {
        "driverMemory": heap,
        "resources": {"requests": {"cpu": "100m", "memory": f"{int((gib + 0.5) * 1024)}Mi"},
                      "limits": {"memory": f"{int((gib + 1.5) * 1024)}Mi"}},
        "audit": {"enabled": True, "schedule": "0 0 1 1 *", "graceMs": 60_000},
    }
    if local:
        return {**values, "master": text, "kubernetes": {"enabled": False}}
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+[mg])", text)
    if not match:
        sys.exit(f"bench spark-k8s: layout {text!r} is neither ExCxM (e.g. 2x1x2g) nor local[K]")
    instances, cores, memory = int(match[1]), int(match[2]), match[3]
    return {**values, "kubernetes": {
        "enabled": True, "executors": {"instances": instances, "cores": cores, "memory": memory},
        "conf": {"spark.kubernetes.executor.request.cores": "700m"}}}


def _fill(kafka: str, n: int, timer: str, dest: str, now: int) -> None:
    """N timer records (each its own id, due in the last HOURS hours) and a delivery of each."""
    from kafka.admin import KafkaAdminClient, NewTopic
    from timerwheel.config import TimerConfig
    from timerwheel.jobs.spark import session

    admin = KafkaAdminClient(bootstrap_servers=kafka)
    admin.create_topics([NewTopic(t, PARTITIONS, 1) for t in (timer, dest)])
    admin.close()
    spark = session("local[*]", app="timerwheel-bench-fill")
    t0 = time.perf_counter()
    fill(spark, TimerConfig(kafka_bootstrap=kafka), n, timer, dest, now - HOURS * 3_600_000, HOURS * 3_600_000)
    say(f"filled {n:,} timer records and {n:,} deliveries in {time.perf_counter() - t0:.0f} s")
    spark.stop()  # the cores are the cluster's now


@contextlib.contextmanager
def _cluster_lock() -> Iterator[None]:
    """The machine's one cluster, held (as `flock /tmp/tw-k8s.lock`) only while this uses it."""
    with open(LOCK, "a") as f:
        say(f"waiting for {LOCK}")
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def main() -> None:
    sys.path[:0] = [str(ROOT / "e2e"), str(ROOT / "tests")]
    from k8s_cluster import UP_TIMEOUT_S, Cluster, k8s_script, read_env
    from kafka.admin import KafkaAdminClient
    from spark_release import external_kafka, spark_release

    n = int(os.environ.get("TW_BENCH_SPARK_K8S_N", "10000000"))
    layouts = [s.strip() for s in os.environ.get("TW_BENCH_SPARK_K8S_LAYOUTS", "2x1x2g,local[2]").split(",")]
    driver_memory = os.environ.get("TW_BENCH_SPARK_K8S_DRIVER_MEMORY") or None
    values = {text: _layout(text, driver_memory) for text in layouts}
    kafka, _ = servers(("kafka",))
    tag = uuid.uuid4().hex[:8]
    timer, dest = f"bench-k8s-timer-{tag}", f"bench-k8s-dest-{tag}"
    now = int(time.time() * 1000)
    work = Path(tempfile.mkdtemp(prefix="bench-spark-k8s-"))
    try:
        say(f"filling {n:,} timer records and {n:,} deliveries")
        _fill(kafka, n, timer, dest, now)
        with _cluster_lock():
            was_running = k8s_script("status", timeout_s=60).returncode == 0
            try:
                for verb in ("up", "load-image"):
                    done = k8s_script(verb, timeout_s=UP_TIMEOUT_S)
                    if done.returncode != 0:
                        sys.exit(f"bench spark-k8s: scripts/k8s.sh {verb} failed:\n{done.stderr[-3000:]}")
                env = read_env()
                cluster = Cluster(env["KUBECONFIG"], env["TW_KUBECTL"], env["TW_K8S_HOST_IP"], env["TW_K8S_IMAGE"])
                spec = {"timerTopic": timer, "dlqTopic": f"bench-k8s-dlq-{tag}", "timerPartitions": PARTITIONS,
                        "allowTopics": ["bench-k8s-dest-.*"], "kafka": {"bootstrap": external_kafka(cluster.host_ip)}}
                with spark_release(cluster, "spark-bench", "twb") as rel:
                    for i, (text, spark) in enumerate(values.items()):
                        _audit(rel, n, text, spark, spec, f"audit-{i}", work)
            finally:
                if not was_running and os.environ.get("TW_KEEP_SERVERS", "") not in ("1", "true", "yes"):
                    k8s_script("down", timeout_s=300)
    finally:
        admin = KafkaAdminClient(bootstrap_servers=kafka)
        admin.delete_topics([t for t in (timer, dest) if t in admin.list_topics()])
        admin.close()


def _audit(rel: Any, n: int, text: str, spark: dict[str, Any], spec: dict[str, Any], job: str, work: Path) -> None:
    """The audit CronJob's Job on layout ``text``: checked (every record scheduled and delivered
    once) and its figure line printed."""
    say(f"audit on {text}")
    rel.install(spec, spark, work)
    run = rel.run_job("spark-audit", job, timeout_s=7200)
    if not run.succeeded:
        sys.exit(f"bench spark-k8s: the audit on {text} failed:\n{run.driver_log[-3000:]}\n{rel.diagnosis(job)}")
    total = json.loads((rel.volume_dir / "audit" / "latest" / "summary.json").read_text())["total"]
    if (total["scheduled"], total["delivered"], total["lost"], total["duplicated"]) != (n, n, 0, 0):
        sys.exit(f"bench spark-k8s: the audit on {text} counted {total}, not {n} scheduled and delivered")

    def mib(peaks: dict[str, int]) -> dict[str, int]:
        return {("executor-" + name.rsplit("-", 1)[-1] if name in run.executors else "driver"): round(b / 2**20)
                for name, b in sorted(peaks.items())}

    first = run.first_executor_running_s
    emit("spark_k8s_audit", 2 * n / run.seconds, "records/s", layout=text, records=2 * n,
         wall_s=round(run.seconds, 1), executors=len(run.executors),
         first_executor_running_s=None if first is None else round(first, 1),
         peak_rss_mib=mib(run.peak_rss), peak_cgroup_mib=mib(run.peak_memory), driver_memory=spark["driverMemory"],
         load_average=[round(x, 1) for x in os.getloadavg()])
    rel.kubectl("delete", "job", job, "--wait=true", check=False, timeout=180)

if __name__ == "__main__":
    main()
