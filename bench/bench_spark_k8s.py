"""The audit on Spark's Kubernetes scheduler (the chart's spark.kubernetes) at the size docs/spark.md
sizes it by: N timer records and their N deliveries, audited by the chart's audit CronJob on the
local cluster (scripts/k8s.sh) in each of a few layouts, one after the other on the same topics:
E executor pods of C cores and heap M each, or ``local[K]`` in the job's one pod.

    flock /tmp/tw-k8s.lock .venv/bin/python -m bench spark-k8s

Not in ``python -m bench`` (it needs the cluster, and its lock). Size: ``TW_BENCH_SPARK_K8S_N``
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

import json
import os
import re
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.bench_production import servers
from bench.common import emit, say

ROOT = Path(__file__).resolve().parents[1]
#: deliveries due in the last HOURS hours: a few hourly rows per topic
HOURS = 4
PARTITIONS = 4  # the chart's default timerPartitions


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
    from pyspark.sql import functions as F
    from timerwheel.config import TimerConfig
    from timerwheel.jobs.spark import session, write_topic

    admin = KafkaAdminClient(bootstrap_servers=kafka)
    admin.create_topics([NewTopic(t, PARTITIONS, 1) for t in (timer, dest)])
    admin.close()
    spark = session("local[*]", app="timerwheel-bench-fill")
    kcfg = TimerConfig(kafka_bootstrap=kafka)

    def h(k: str, v: Any) -> Any:
        return F.struct(F.lit(k).alias("key"), v.cast("string").cast("binary").alias("value"))

    ids = spark.range(n).select(F.concat(F.lit("m"), F.col("id")).alias("mid"), F.col("id"))
    deliver = F.lit(now - HOURS * 3_600_000) + F.col("id") % (HOURS * 3_600_000)
    t0 = time.perf_counter()
    write_topic(ids.select(F.col("mid").cast("binary").alias("key"), F.lit(b"x" * 100).alias("value"),
                           F.array(h("tw-topic", F.lit(dest)), h("tw-deliver-at", deliver), h("tw-id", F.col("mid")))
                           .alias("headers")), kcfg, timer)
    write_topic(ids.select(F.col("mid").cast("binary").alias("key"), F.lit(b"x" * 100).alias("value"),
                           F.array(h("tw-id", F.col("mid")), h("tw-delivered-at", deliver + F.col("id") % 500))
                           .alias("headers")), kcfg, dest)
    say(f"filled {n:,} timer records and {n:,} deliveries in {time.perf_counter() - t0:.0f} s")
    spark.stop()  # the cores are the cluster's now


def main() -> None:
    sys.path[:0] = [str(ROOT / "e2e"), str(ROOT / "tests")]
    from k8s_cluster import UP_TIMEOUT_S, Cluster, k8s_script, read_env
    from spark_release import external_kafka, spark_release

    n = int(os.environ.get("TW_BENCH_SPARK_K8S_N", "10000000"))
    layouts = [s.strip() for s in os.environ.get("TW_BENCH_SPARK_K8S_LAYOUTS", "2x1x2g,local[2]").split(",")]
    driver_memory = os.environ.get("TW_BENCH_SPARK_K8S_DRIVER_MEMORY") or None
    values = {text: _layout(text, driver_memory) for text in layouts}
    was_running = k8s_script("status", timeout_s=60).returncode == 0
    for verb in ("up", "load-image"):
        done = k8s_script(verb, timeout_s=UP_TIMEOUT_S)
        if done.returncode != 0:
            sys.exit(f"bench spark-k8s: scripts/k8s.sh {verb} failed:\n{done.stderr[-3000:]}")
    env = read_env()
    cluster = Cluster(env["KUBECONFIG"], env["TW_KUBECTL"], env["TW_K8S_HOST_IP"], env["TW_K8S_IMAGE"])
    kafka_pods = external_kafka(cluster.host_ip)
    kafka, _ = servers(("kafka",))
    tag = uuid.uuid4().hex[:8]
    timer, dest = f"bench-k8s-timer-{tag}", f"bench-k8s-dest-{tag}"
    now = int(time.time() * 1000)
    say(f"filling {n:,} timer records and {n:,} deliveries")
    _fill(kafka, n, timer, dest, now)
    spec = {"timerTopic": timer, "dlqTopic": f"bench-k8s-dlq-{tag}", "timerPartitions": PARTITIONS,
            "allowTopics": ["bench-k8s-dest-.*"], "kafka": {"bootstrap": kafka_pods}}
    work = Path(tempfile.mkdtemp(prefix="bench-spark-k8s-"))
    try:
        with spark_release(cluster, "spark-bench", "twb") as rel:
            for i, (text, spark) in enumerate(values.items()):
                say(f"audit on {text}")
                rel.install(spec, spark, work)
                run = rel.run_job("spark-audit", f"audit-{i}", timeout_s=7200)
                if not run.succeeded:
                    sys.exit(f"bench spark-k8s: the audit on {text} failed:\n{run.driver_log[-3000:]}\n"
                             f"{rel.diagnosis(run.name)}")
                total = json.loads((rel.volume_dir / "audit" / "latest" / "summary.json").read_text())["total"]
                if (total["scheduled"], total["delivered"], total["lost"], total["duplicated"]) != (n, n, 0, 0):
                    sys.exit(f"bench spark-k8s: the audit on {text} counted {total}, not {n} scheduled and delivered")

                def mib(peaks: dict[str, int], run: Any = run) -> dict[str, int]:
                    return {("executor-" + name.rsplit("-", 1)[-1] if name in run.executors else "driver"):
                            round(b / 2**20) for name, b in sorted(peaks.items())}

                emit("spark_k8s_audit", 2 * n / run.seconds, "records/s", layout=text, records=2 * n,
                     wall_s=round(run.seconds, 1), executors=len(run.executors),
                     first_executor_running_s=(round(run.first_executor_running_s, 1)
                                               if run.first_executor_running_s is not None else None),
                     peak_rss_mib=mib(run.peak_rss), peak_cgroup_mib=mib(run.peak_memory),
                     driver_memory=spark["driverMemory"], load_average=[round(x, 1) for x in os.getloadavg()])
                rel.kubectl("delete", "job", run.name, "--wait=true", check=False, timeout=180)
    finally:
        from kafka.admin import KafkaAdminClient

        admin = KafkaAdminClient(bootstrap_servers=kafka)
        admin.delete_topics([timer, dest])
        admin.close()
        if not was_running and os.environ.get("TW_KEEP_SERVERS", "") not in ("1", "true", "yes"):
            k8s_script("down", timeout_s=300)
