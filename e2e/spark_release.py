"""The chart's Spark jobs on the local cluster (scripts/k8s.sh), for e2e/test_k8s_spark.py and
``python -m bench.bench_spark_k8s``.

``spark_release`` loads the Spark image (``scripts/k8s.sh load-image spark``) and yields a
:class:`SparkRelease`: a namespace of its own, a hostPath volume bound to the claim the chart
mounts as ``spark.dataClaim`` (its directory on this machine holds what the jobs write under
/data), and helm. ``install`` installs the chart with no TimerWheel and no ``helm test`` Job (the
stages, if any, are the caller's) and the given ``spark`` values; ``run_job`` makes a Job from one
of its CronJobs (as ``kubectl create job --from`` does), waits for its end and says how long it
took, which pod was the driver and, on Spark's Kubernetes scheduler, which executor pods it
started and the peak memory of each pod. Everything is removed at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k8s_cluster import ROOT, SCRIPT, UP_TIMEOUT_S, Cluster, write_values

SPARK_IMAGE = {"repository": "timerwheel-spark", "tag": "dev", "pullPolicy": "Never"}
#: The labels Spark's Kubernetes scheduler puts on the pods it starts.
EXECUTOR = "spark-role=executor"
#: cgroup v1 (scripts/k8s.sh: kubelet with cgroupfs): a pod's memory cgroup by QoS class.
MEMORY_CGROUPS = Path("/sys/fs/cgroup/memory/kubepods")


class SparkError(AssertionError):
    """The cluster did not do what the release asked: a Job that failed or never finished."""


def helm_binary() -> str:
    out = subprocess.run([str(ROOT / "scripts" / "helm.sh"), "path"], capture_output=True, text=True, timeout=1800,
                         check=False)
    if out.returncode != 0:
        raise SparkError(f"scripts/helm.sh could not build helm (needs Go and the Go module proxy):\n{out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()[-1]


def load_spark_image() -> None:
    load = subprocess.run([str(SCRIPT), "load-image", "spark"], cwd=ROOT, capture_output=True, text=True,
                          timeout=UP_TIMEOUT_S, check=False)
    if load.returncode != 0:
        raise SparkError(f"the Spark image could not be loaded (scripts/k8s.sh load-image spark, exit "
                         f"{load.returncode}):\n{load.stderr.strip()[-3000:]}")


def external_kafka(host_ip: str) -> str:
    """The bootstrap of scripts/kafka.sh's broker on the node address the pods reach (it adds
    that listener, restarting the broker, if it lacks it)."""
    env = {**os.environ, "TW_LISTEN_HOST": host_ip}
    up = subprocess.run([str(ROOT / "scripts" / "kafka.sh"), "up"], cwd=ROOT, capture_output=True, text=True,
                        timeout=900, check=False, env=env)
    if up.returncode != 0:
        raise SparkError(f"scripts/kafka.sh up with TW_LISTEN_HOST={host_ip} failed:\n{up.stderr[-2000:]}")
    out = subprocess.run([str(ROOT / "scripts" / "kafka.sh"), "env"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)["TW_KAFKA_EXTERNAL_BOOTSTRAP"]


def _memory(pod: dict[str, Any]) -> tuple[int, int] | None:
    """(the pod's memory cgroup's peak usage, page cache included; its RSS now) in bytes, while
    its cgroup is there."""
    qos = pod.get("status", {}).get("qosClass", "").lower()
    cgroup = (MEMORY_CGROUPS if qos == "guaranteed" else MEMORY_CGROUPS / qos) / f"pod{pod['metadata']['uid']}"
    try:
        peak = int((cgroup / "memory.max_usage_in_bytes").read_text())
        stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines())
        return peak, int(stat["total_rss"])
    except (OSError, ValueError, KeyError):
        return None


@dataclass
class JobRun:
    """A Job run to its end: its status, how long it took from its creation, its driver pod and
    the executor pods the driver started (name -> pod as last seen), peak memory by pod name."""

    name: str
    succeeded: bool
    seconds: float
    driver: dict[str, Any]
    driver_log: str
    executors: dict[str, dict[str, Any]] = field(default_factory=dict)
    first_executor_running_s: float | None = None
    #: by pod name: the cgroup's peak usage (page cache included), the largest RSS sampled
    peak_memory: dict[str, int] = field(default_factory=dict)
    peak_rss: dict[str, int] = field(default_factory=dict)


@dataclass
class SparkRelease:
    k8s: Cluster
    helm_bin: str
    namespace: str
    release: str
    claim: str
    volume_dir: Path

    def kubectl(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.k8s.kubectl("-n", self.namespace, *args, **kw)

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def helm(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.helm_bin, "--kubeconfig", self.k8s.kubeconfig, *args], capture_output=True,
                              text=True, timeout=timeout, check=False)

    def install(self, spec: dict[str, Any], spark: dict[str, Any], workdir: Path) -> None:
        """``helm upgrade --install`` of the chart: no TimerWheel (``spec`` gives the Spark jobs
        the stages' settings: Kafka, the topics, the allow-list), no ``helm test`` Job, the
        operator's image as scripts/k8s.sh loads it, ``spark`` over the Spark image and the claim."""
        values = {"image": {"repository": "timerwheel", "tag": "dev", "pullPolicy": "Never"},
                  "timerwheel": {"create": False, "spec": spec}, "tests": {"enabled": False},
                  "spark": {"image": SPARK_IMAGE, "dataClaim": self.claim, **spark}}
        path = workdir / f"values-{self.release}.yaml"
        write_values(path, values)
        done = self.helm("upgrade", "--install", self.release, str(ROOT / "charts" / "timerwheel"),
                         "-n", self.namespace, "--create-namespace", "-f", str(path))
        if done.returncode != 0:
            raise SparkError(f"helm upgrade --install {self.release} failed:\n{done.stderr[-3000:]}")

    def cronjob(self, component: str) -> str:
        items = self.get("cronjob", "-l", f"app.kubernetes.io/component={component}")["items"]
        if len(items) != 1:
            raise SparkError(f"expected one CronJob of component {component}, found {len(items)}")
        return str(items[0]["metadata"]["name"])

    def pods(self, selector: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.get("pods", "-l", selector)["items"]
        return items

    def run_job(self, component: str, job: str, timeout_s: float = 900) -> JobRun:
        """A Job ``job`` from the CronJob of ``component`` (``spark-audit``, ``spark-forecast``),
        watched to its end (polled every second: pods, and their memory cgroups)."""
        self.kubectl("create", "job", job, f"--from=cronjob/{self.cronjob(component)}")
        t0 = time.monotonic()
        executors: dict[str, dict[str, Any]] = {}
        peaks: dict[str, int] = {}
        rss: dict[str, int] = {}
        first_running: float | None = None
        driver: dict[str, Any] = {}
        while True:
            status = self.get("job", job).get("status") or {}
            drivers = self.pods(f"job-name={job}")
            if drivers:  # the Job's pod (a second one only if the first failed: backoffLimit 1)
                driver = drivers[-1]
            mine = [p for p in self.pods(EXECUTOR) if driver and driver["metadata"]["name"] in
                    {o["name"] for o in p["metadata"].get("ownerReferences", [])}]
            for pod in mine:
                executors[pod["metadata"]["name"]] = pod
                if first_running is None and pod["status"].get("phase") == "Running":
                    first_running = time.monotonic() - t0
            for pod in ([driver] if driver else []) + mine:
                memory, name = _memory(pod), pod["metadata"]["name"]
                if memory is not None:
                    peaks[name] = max(memory[0], peaks.get(name, 0))
                    rss[name] = max(memory[1], rss.get(name, 0))
            if status.get("succeeded") or status.get("failed"):
                break
            if time.monotonic() - t0 > timeout_s:
                raise SparkError(f"Job {job} did not finish within {timeout_s:.0f} s\n{self.diagnosis(job)}")
            time.sleep(1)
        seconds = time.monotonic() - t0
        log = self.kubectl("logs", f"job/{job}", "--tail=200", check=False).stdout
        return JobRun(job, bool(status.get("succeeded")), seconds, driver, log, executors, first_running, peaks, rss)

    def diagnosis(self, job: str | None = None) -> str:
        out = [self.kubectl("get", "jobs,pods", "-o", "wide", check=False).stdout]
        if job:
            out.append(self.kubectl("describe", "job", job, check=False).stdout[-2000:])
            out.append("--- driver\n" + self.kubectl("logs", f"job/{job}", "--tail=40", check=False).stdout[-4000:])
        for pod in self.pods(EXECUTOR):
            name = pod["metadata"]["name"]
            out.append(f"--- {name}\n" + self.kubectl("logs", name, "--tail=20", check=False).stdout[-2500:])
        return "\n".join(out)

    def executor_log(self, name: str) -> str:
        return self.kubectl("logs", name, check=False).stdout


@contextlib.contextmanager
def spark_release(k8s: Cluster, namespace: str, release: str, volume_gib: int = 1) -> Iterator[SparkRelease]:
    """The release's place on the cluster: the Spark image loaded, the namespace, a hostPath
    volume pre-bound to the claim ``<release>-spark-data`` (its directory under .run/k8s/volumes,
    writable by the image's user), the claim itself; all removed at the end."""
    load_spark_image()
    name = f"tw-spark-{namespace}"
    volume_dir = ROOT / ".run" / "k8s" / "volumes" / name
    subprocess.run(["rm", "-rf", str(volume_dir)], check=True)
    volume_dir.mkdir(parents=True)
    os.chown(volume_dir, 10001, 10001)  # the image's user; fsGroup does not apply to hostPath
    claim = f"{release}-spark-data"
    size = f"{volume_gib}Gi"
    rel = SparkRelease(k8s, helm_binary(), namespace, release, claim, volume_dir)
    k8s.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
              {"apiVersion": "v1", "kind": "PersistentVolume",
               "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "tw-e2e"}},
               "spec": {"capacity": {"storage": size}, "accessModes": ["ReadWriteMany"],
                        "persistentVolumeReclaimPolicy": "Retain", "storageClassName": name,
                        "claimRef": {"namespace": namespace, "name": claim},
                        "hostPath": {"path": str(volume_dir), "type": "Directory"}}},
              {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
               "metadata": {"name": claim, "namespace": namespace},
               "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": name, "volumeName": name,
                        "resources": {"requests": {"storage": size}}}})
    try:
        yield rel
    finally:
        if rel.helm("status", release, "-n", namespace).returncode == 0:
            rel.helm("uninstall", release, "-n", namespace, "--wait", "--timeout", "120s")
        k8s.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=180s", check=False, timeout=240)
        k8s.kubectl("delete", "pv", name, "--wait=false", check=False)
