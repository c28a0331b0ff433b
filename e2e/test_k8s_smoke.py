"""Smoke tests on the real local Kubernetes cluster (scripts/k8s.sh): the node, the timerwheel
image in a pod with the secure defaults the chart uses, a volume claim shared by two pods, and pods
reaching the host's Kafka and Redis through the node's address."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from k8s_cluster import ROOT, Cluster

pytestmark = [pytest.mark.k8s, pytest.mark.e2e]

KUBE_VERSION = "v1.34.4"
LABEL = "app.kubernetes.io/part-of=tw-k8s-smoke"
#: What the chart's pods get: the image must run under it.
SECURE = {
    "runAsNonRoot": True,
    "readOnlyRootFilesystem": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def pod(k8s: Cluster, name: str, script: str, volumes: list[dict[str, Any]] | None = None,
        mounts: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "tw-k8s-smoke"}},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "main",
                "image": k8s.image,
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", script],
                "securityContext": SECURE,
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *(mounts or [])],
            }],
            "volumes": [{"name": "tmp", "emptyDir": {}}, *(volumes or [])],
        },
    }


@pytest.fixture(autouse=True)
def _clean(k8s: Cluster) -> Iterator[None]:
    yield
    k8s.kubectl("delete", "pod,pvc", "-l", LABEL, "--grace-period=1", "--wait=true", "--timeout=60s", check=False)
    k8s.kubectl("delete", "pv", "-l", LABEL, "--wait=false", check=False)


def test_node_is_ready_and_runs_the_pinned_version(k8s: Cluster) -> None:
    nodes = k8s.get("nodes")["items"]
    assert len(nodes) == 1
    ready = {c["type"]: c["status"] for c in nodes[0]["status"]["conditions"]}
    assert ready.get("Ready") == "True", nodes[0]["status"]["conditions"]
    assert nodes[0]["status"]["nodeInfo"]["kubeletVersion"] == KUBE_VERSION
    version = json.loads(k8s.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == KUBE_VERSION
    assert version["clientVersion"]["gitVersion"] == KUBE_VERSION
    # pods can be created: the default ServiceAccount exists
    k8s.get("serviceaccount", "default")


def _dockerfile() -> dict[str, Any]:
    """USER, ENV, ENTRYPOINT, WORKDIR and EXPOSE of services/Dockerfile, read without scripts/image.py."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "services" / "Dockerfile").read_text())
    out: dict[str, Any] = {"env": {}, "expose": []}
    for line in text.splitlines():
        word, _, args = line.strip().partition(" ")
        if word == "USER":
            out["user"] = args.strip()
        elif word == "ENV":
            out["env"].update(dict(w.split("=", 1) for w in shlex.split(args)))
        elif word == "ENTRYPOINT":
            out["entrypoint"] = json.loads(args)
        elif word == "WORKDIR":
            out["workdir"] = args.strip()
        elif word == "EXPOSE":
            out["expose"] += [f"{p}/tcp" for p in args.split()]
    return out


def test_local_image_has_the_dockerfile_config(k8s: Cluster) -> None:
    """The image loaded into the cluster carries what `docker build` would record."""
    built = subprocess.run([sys.executable, str(ROOT / "scripts" / "image.py"), "build", "--tag", k8s.image],
                           capture_output=True, text=True, timeout=1800, check=False)
    assert built.returncode == 0, built.stderr
    inspect = subprocess.run(["skopeo", "inspect", "--config", f"docker-archive:{built.stdout.strip()}"],
                             capture_output=True, text=True, timeout=120, check=True)
    config = json.loads(inspect.stdout)["config"]
    want = _dockerfile()
    assert config["User"] == want["user"]
    assert config["Entrypoint"] == want["entrypoint"]
    assert config["WorkingDir"] == want["workdir"]
    assert sorted(config.get("ExposedPorts", {})) == sorted(want["expose"])
    env = dict(e.split("=", 1) for e in config["Env"])
    for key, value in want["env"].items():
        assert env.get(key) == value, key


def test_image_runs_non_root_on_a_read_only_root(k8s: Cluster) -> None:
    script = r"""
echo "uid=$(id -u)"
timerwheel --help >/dev/null && echo help-ok
for s in enqueue-put enqueue-get dequeue-get dequeue-getmsg dequeue-put; do
  test -x /app/services/$s/entrypoint.sh && echo "entry-$s"
done
if touch /app/probe 2>/dev/null || touch /probe 2>/dev/null; then echo root-writable; else echo root-read-only; fi
touch /tmp/probe && echo tmp-writable
python3 -c 'import importlib.metadata as m, json; print("DISTS " + json.dumps(sorted(d.metadata["Name"] for d in m.distributions())))'
"""
    k8s.apply(pod(k8s, "tw-image", script))
    phases = k8s.wait_pods_done("tw-image")
    out = k8s.logs("tw-image")
    assert phases["tw-image"] == "Succeeded", out
    lines = out.splitlines()
    assert "uid=10001" in lines
    assert "help-ok" in lines
    assert "root-read-only" in lines and "tmp-writable" in lines
    for s in ("enqueue-put", "enqueue-get", "dequeue-get", "dequeue-getmsg", "dequeue-put"):
        assert f"entry-{s}" in lines
    norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
    dists = {norm(n) for n in json.loads(next(x for x in lines if x.startswith("DISTS "))[6:])}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # the project, its dependencies and those of the operator extra (when pyproject has it)
    wanted = ["timerwheel", *project["dependencies"], *project.get("optional-dependencies", {}).get("operator", [])]
    missing = [r for r in wanted if norm(re.match(r"[A-Za-z0-9._-]+", r).group()) not in dists]  # type: ignore[union-attr]
    assert not missing, f"not installed in the image: {missing}"
    assert "pytest" not in dists  # the dev extra stays out


def test_a_pod_reaches_the_api_server_through_the_kubernetes_service(k8s: Cluster) -> None:
    """What the operator does in-cluster: the ServiceAccount token, the CA, KUBERNETES_SERVICE_HOST
    (the ClusterIP, routed by kube-proxy)."""
    script = r"""python3 - <<'PY'
import json, os, ssl, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
ctx = ssl.create_default_context(cafile=f"{sa}/ca.crt")
host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
req = urllib.request.Request(f"https://{host}:{port}/version",
                             headers={"Authorization": "Bearer " + open(f"{sa}/token").read()})
print("VERSION " + json.load(urllib.request.urlopen(req, context=ctx, timeout=20))["gitVersion"])
print("HOST " + host)
PY
"""
    k8s.apply(pod(k8s, "tw-api", script))
    phases = k8s.wait_pods_done("tw-api")
    out = k8s.logs("tw-api")
    assert phases["tw-api"] == "Succeeded", out
    assert f"VERSION {KUBE_VERSION}" in out.splitlines()
    assert "HOST 10.96.0.1" in out.splitlines()


def test_two_pods_share_a_volume_claim(k8s: Cluster) -> None:
    name = f"tw-shared-{uuid.uuid4().hex[:8]}"
    host_dir = ROOT / ".run" / "k8s" / "volumes" / name
    host_dir.mkdir(parents=True)
    os.chown(host_dir, 10001, 10001)  # the image's user writes there (hostPath ignores fsGroup)
    pv = {"apiVersion": "v1", "kind": "PersistentVolume",
          "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "tw-k8s-smoke"}},
          "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                   "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "tw-smoke",
                   "hostPath": {"path": str(host_dir), "type": "Directory"}}}
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
           "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "tw-k8s-smoke"}},
           "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "tw-smoke", "volumeName": name,
                    "resources": {"requests": {"storage": "1Gi"}}}}
    vol = [{"name": "shared", "persistentVolumeClaim": {"claimName": name}}]
    mnt = [{"name": "shared", "mountPath": "/data"}]
    # both run at once: each waits for the other's file
    writer = 'echo "from $(hostname)" > /data/msg.txt; for i in $(seq 120); do [ -f /data/ack ] && { cat /data/ack; exit 0; }; sleep 0.5; done; exit 1'
    reader = 'for i in $(seq 120); do [ -f /data/msg.txt ] && { cat /data/msg.txt; echo "ack from $(hostname)" > /data/ack; exit 0; }; sleep 0.5; done; exit 1'
    k8s.apply(pv, pvc, pod(k8s, "tw-writer", writer, vol, mnt), pod(k8s, "tw-reader", reader, vol, mnt))
    phases = k8s.wait_pods_done("tw-writer", "tw-reader")
    assert phases == {"tw-writer": "Succeeded", "tw-reader": "Succeeded"}, (k8s.logs("tw-writer"), k8s.logs("tw-reader"))
    assert k8s.get("pvc", name)["status"]["phase"] == "Bound"
    assert k8s.logs("tw-reader").strip() == "from tw-writer"
    assert k8s.logs("tw-writer").strip() == "ack from tw-reader"
    assert (host_dir / "msg.txt").read_text().strip() == "from tw-writer"


def _env_of(script: str, env: dict[str, str]) -> dict[str, str]:
    done = subprocess.run([str(ROOT / "scripts" / script), "up"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, check=False, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    out = subprocess.run([str(ROOT / "scripts" / script), "env"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_pods_reach_kafka_and_redis_on_the_host(k8s: Cluster, kafka_control: Any, redis_control: Any) -> None:
    if not (kafka_control.managed and redis_control.managed):
        pytest.skip("Kafka / Redis come from TW_KAFKA_BOOTSTRAP / TW_REDIS_URL: only the script-managed "
                    "servers can be asked to listen on the node's address")
    listen = {"TW_LISTEN_HOST": k8s.host_ip}
    redis_env = _env_of("redis.sh", listen)
    kafka_env = _env_of("kafka.sh", listen)
    assert redis_env["TW_REDIS_EXTERNAL_URL"].startswith(f"redis://{k8s.host_ip}:")
    assert kafka_env["TW_KAFKA_EXTERNAL_BOOTSTRAP"].startswith(f"{k8s.host_ip}:")
    token = uuid.uuid4().hex
    topic = f"tw-k8s-smoke-{token[:8]}"
    script = f"""python3 - <<'EOF'
import redis
from kafka import KafkaProducer
redis.Redis.from_url("{redis_env['TW_REDIS_EXTERNAL_URL']}").set("tw-k8s-smoke", "{token}")
p = KafkaProducer(bootstrap_servers="{kafka_env['TW_KAFKA_EXTERNAL_BOOTSTRAP']}")
p.send("{topic}", b"{token}").get(timeout=60)
p.close()
print("sent")
EOF
"""
    k8s.apply(pod(k8s, "tw-reach-host", script))
    phases = k8s.wait_pods_done("tw-reach-host")
    assert phases["tw-reach-host"] == "Succeeded", k8s.logs("tw-reach-host")
    import redis
    from kafka import KafkaConsumer

    assert redis.Redis.from_url(redis_env["TW_REDIS_URL"]).get("tw-k8s-smoke") == token.encode()
    consumer = KafkaConsumer(topic, bootstrap_servers=kafka_env["TW_KAFKA_BOOTSTRAP"], auto_offset_reset="earliest",
                             consumer_timeout_ms=30000)
    try:
        deadline = time.monotonic() + 30
        values = []
        for msg in consumer:
            values.append(msg.value)
            if token.encode() in values or time.monotonic() > deadline:
                break
    finally:
        consumer.close()
    assert token.encode() in values
