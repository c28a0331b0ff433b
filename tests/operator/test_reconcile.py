"""Reconciling against a fake cluster: levels not edges, idempotent, never crashing on a bad
spec or a refused object; and the kopf handlers and settings as registered."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import pytest
from k8s_helpers import wheel_body
from timerwheel.exposition import render
from timerwheel.metrics import Metrics
from timerwheel_operator import reconcile as rec
from timerwheel_operator.crd import STAGES
from timerwheel_operator.main import OperatorConfigError, config_from_env

SETTINGS = rec.OperatorConfig(image="timerwheel:dev", pull_policy="Never")


class FakeCluster:
    """Applies into a dict; workloads report themselves rolled out; pods serve canned metrics."""

    def __init__(self, refuse: set[str] | None = None) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.applies = 0
        self.refuse = refuse or set()
        self.metrics: dict[str, str] = {}
        self.deleted: list[str] = []

    def apply(self, manifest: Mapping[str, Any]) -> None:
        self.applies += 1
        if manifest["kind"] in self.refuse:
            raise RuntimeError(f"{manifest['kind']} is forbidden")
        obj = copy.deepcopy(dict(manifest))
        if obj["kind"] in ("Deployment", "StatefulSet"):
            # Server-side apply without replicas leaves them as they are (the API's default: 1).
            before = self.objects.get((obj["kind"], obj["metadata"]["name"]), {}).get("spec", {})
            n = obj["spec"].setdefault("replicas", before.get("replicas", 1))
            obj["spec"]["external"] = "replicas" not in manifest["spec"]
            obj["metadata"]["generation"] = 1
            obj["status"] = {"replicas": n, "readyReplicas": n, "updatedReplicas": n, "observedGeneration": 1}
        self.objects[(obj["kind"], obj["metadata"]["name"])] = obj

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((kind, name))

    def pods(self, namespace: str, selector: Mapping[str, str]) -> list[dict[str, Any]]:
        stage = selector["app.kubernetes.io/component"]
        return [{"metadata": {"name": f"{stage}-0"}, "status": {"phase": "Running", "podIP": f"10.1.0.{i}"}}
                for i, s in enumerate(STAGES) if s == stage]

    def scrape(self, ip: str, port: int) -> str:
        if ip not in self.metrics:
            raise OSError(f"connection refused: {ip}:{port}")
        return self.metrics[ip]

    def jobs(self, namespace: str, selector: Mapping[str, str]) -> list[dict[str, Any]]:
        return [o for (kind, _), o in self.objects.items() if kind == "Job"]

    def pod_log(self, namespace: str, name: str) -> str:
        raise OSError(f"no pod {name}")

    def delete_pod(self, namespace: str, name: str) -> None:
        self.deleted.append(name)

    def events(self, namespace: str, kind: str, name: str) -> list[dict[str, Any]]:
        return []

    def patch_status(self, api_version: str, kind: str, namespace: str, name: str,
                     status: Mapping[str, Any]) -> None:
        obj = self.objects[(kind, name)]
        merged = {**(obj.get("status") or {}), **status}
        obj["status"] = {k: v for k, v in merged.items() if v is not None}


def owner_metrics(stage: str, epoch: int) -> str:
    m = Metrics()
    m.set("owner_epoch", epoch, shard=0, stage=stage)
    m.set("write_ms" if stage == "enqueue-put" else "read_ms", 1_700_000_000_000, shard=0)
    return render(m)


def test_ensure_applies_everything_and_again_changes_nothing() -> None:
    cluster = FakeCluster()
    body = wheel_body()
    first = rec.ensure(body, cluster, SETTINGS)
    snapshot = copy.deepcopy(cluster.objects)
    assert first.error is None and not first.failures
    assert len(snapshot) == 3 + 3 * len(STAGES)
    rec.ensure(body, cluster, SETTINGS)
    assert cluster.objects == snapshot and cluster.applies == 2 * len(snapshot)


def test_a_deleted_workload_comes_back_on_the_next_level_check() -> None:
    cluster = FakeCluster()
    rec.ensure(wheel_body(), cluster, SETTINGS)
    del cluster.objects[("Deployment", "timerwheel-orders-dequeue-put")]
    rec.ensure(wheel_body(), cluster, SETTINGS)
    assert ("Deployment", "timerwheel-orders-dequeue-put") in cluster.objects


def test_a_bad_spec_applies_nothing_and_is_reported() -> None:
    cluster = FakeCluster()
    body = wheel_body(tickMs=7)
    applied = rec.ensure(body, cluster, SETTINGS)
    assert cluster.applies == 0 and applied.error is not None and applied.error.field == "spec.tickMs"
    status = rec.observe(body, applied, cluster)
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec" and ready["message"].startswith("spec.tickMs")


def test_a_refused_object_is_reported_and_the_rest_applied() -> None:
    cluster = FakeCluster(refuse={"PersistentVolumeClaim"})
    applied = rec.ensure(wheel_body(), cluster, SETTINGS)
    assert list(applied.failures) == ["PersistentVolumeClaim/timerwheel-orders-data"]
    assert ("StatefulSet", "timerwheel-orders-enqueue-put") in cluster.objects
    degraded = next(c for c in rec.observe(wheel_body(), applied, cluster)["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "ApplyFailed"


def test_a_refused_read_makes_the_status_unknown_not_a_crash() -> None:
    class NoPods(FakeCluster):
        def pods(self, namespace: str, selector: Mapping[str, str]) -> list[dict[str, Any]]:
            raise RuntimeError("pods is forbidden")

    cluster = NoPods()
    applied = rec.ensure(wheel_body(), cluster, SETTINGS)
    status = rec.observe(wheel_body(), applied, cluster)
    assert {c["status"] for c in status["conditions"]} == {"Unknown"}
    assert all(c["reason"] == "ObserveFailed" and "pods is forbidden" in c["message"] for c in status["conditions"])


def test_status_is_read_from_the_stage_pods_metrics() -> None:
    cluster = FakeCluster()
    body = wheel_body()
    applied = rec.ensure(body, cluster, SETTINGS)
    status = rec.observe(body, applied, cluster)  # no metrics yet: shard 0 has no owner
    assert next(c for c in status["conditions"] if c["type"] == "Recovering")["reason"] == "ShardsTakingOver"
    cluster.metrics = {"10.1.0.1": owner_metrics("enqueue-put", 3), "10.1.0.2": owner_metrics("dequeue-get", 2)}
    status = rec.observe(body, applied, cluster)
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Ready": "True", "Progressing": "False", "Degraded": "False", "Scaling": "False", "Recovering": "False",
        "WindowRolling": "False"}
    assert status["shards"] == [{"shard": 0, "owner": "enqueue-put-0", "reader": "dequeue-get-0", "epoch": 3,
                                 "W": 1_700_000_000_000, "R": 1_700_000_000_000}]
    assert status["observedGeneration"] == 3


def test_the_operator_s_configuration_is_validated() -> None:
    assert config_from_env({}) == rec.OperatorConfig("timerwheel:dev", "IfNotPresent")
    assert config_from_env({"TIMERWHEEL_IMAGE": "x:1", "TIMERWHEEL_IMAGE_PULL_POLICY": "Never"}).pull_policy == "Never"
    with pytest.raises(OperatorConfigError, match="^TIMERWHEEL_IMAGE_PULL_POLICY: "):
        config_from_env({"TIMERWHEEL_IMAGE_PULL_POLICY": "Sometimes"})
    assert config_from_env({"TIMERWHEEL_IMAGE_PULL_SECRETS": "regcred, other"}).pull_secrets == ("regcred", "other")
    with pytest.raises(OperatorConfigError, match="^TIMERWHEEL_IMAGE_PULL_SECRETS: 'Bad_Name' "):
        config_from_env({"TIMERWHEEL_IMAGE_PULL_SECRETS": "Bad_Name"})


def _reader_with_load(peak_60: float, epoch: int = 2) -> str:
    m = Metrics()
    m.set("owner_epoch", epoch, shard=0, stage="dequeue-get")
    m.set("read_ms", 1_700_000_000_000, shard=0)
    m.set("due_peak_per_s", peak_60, shard=0, ahead_s=60)
    m.set("due_peak_per_s", 0, shard=0, ahead_s=300)
    return render(m)


def _queue(queue: str, depth: int) -> str:
    m = Metrics()
    m.set("queue_depth", depth, queue=queue, partition=0)
    return render(m)


AUTO = {"enabled": True, "minReplicas": 1, "maxReplicas": 5, "messagesPerSecondPerReplica": 1000,
        "scaleDownDelayMs": 60_000, "dequeuePut": {"maxReplicas": 3}}


def test_autoscale_scales_the_dequeue_stages_ahead_of_the_load_and_records_each_decision() -> None:
    cluster = FakeCluster()
    body = wheel_body(autoscale=AUTO)
    rec.reconcile(body, cluster, SETTINGS, 1_000)
    cluster.metrics = {"10.1.0.1": owner_metrics("enqueue-put", 3), "10.1.0.2": _reader_with_load(3_000),
                       "10.1.0.3": _queue("fetch", 0), "10.1.0.4": _queue("deliver", 0)}
    applied, status = rec.reconcile(body, cluster, SETTINGS, 2_000)
    replicas = {s: cluster.objects[("Deployment", f"timerwheel-orders-{s}")]["spec"]["replicas"]
                for s in ("dequeue-getmsg", "dequeue-put")}
    assert replicas == {"dequeue-getmsg": 4, "dequeue-put": 3}  # 3,000/s at 80 % of 1,000/s; put's max is 3
    assert sorted(e.reason for e in applied.events) == ["Autoscaled", "Autoscaled"]
    assert any(e.message.startswith("dequeue-getmsg: 1 -> 4 replicas (autoscale: 1 -> 4: peak 3000/s")
               for e in applied.events)
    assert status["autoscale"]["dequeue-getmsg"] == {"replicas": 4, "reason": "ScaleUp", "lastChangeMs": 2_000,
                                                      "message": status["autoscale"]["dequeue-getmsg"]["message"]}
    assert status["stages"]["dequeue-getmsg"]["desired"] == 4
    # The spike is gone: the count is held for the delay, then lowered; each round is a level check.
    body["status"] = status
    cluster.metrics["10.1.0.2"] = _reader_with_load(0)
    applied, status = rec.reconcile(body, cluster, SETTINGS, 30_000)
    assert status["autoscale"]["dequeue-getmsg"]["reason"] == "HoldDown" and not applied.events
    body["status"] = status
    applied, status = rec.reconcile(body, cluster, SETTINGS, 62_000)
    assert cluster.objects[("Deployment", "timerwheel-orders-dequeue-getmsg")]["spec"]["replicas"] == 1
    assert status["autoscale"]["dequeue-getmsg"]["lastChangeMs"] == 62_000
    assert [e.message.split(" (")[0] for e in applied.events] == ["dequeue-getmsg: 4 -> 1 replicas",
                                                                  "dequeue-put: 3 -> 1 replicas"]


def test_a_spec_scale_is_an_event_once_and_an_external_stage_keeps_its_replicas() -> None:
    cluster = FakeCluster()
    rec.ensure(wheel_body(), cluster, SETTINGS)
    body = wheel_body(stages={"enqueuePut": {"replicas": 2}, "dequeuePut": {"replicasManagedBy": "external"}})
    applied = rec.ensure(body, cluster, SETTINGS)
    assert [(e.reason, e.message) for e in applied.events] == [("Scaled", "enqueue-put: 1 -> 2 replicas (spec)")]
    assert not rec.ensure(body, cluster, SETTINGS).events  # the workload has its count now: nothing new
    put = cluster.objects[("Deployment", "timerwheel-orders-dequeue-put")]
    assert put["spec"]["external"]  # the applied manifest leaves the replicas to the user's HPA
    autoscaled = rec.reconcile(wheel_body(autoscale=AUTO, stages={"dequeuePut": {"replicasManagedBy": "external"}}),
                               cluster, SETTINGS, 1_000)[1]
    assert set(autoscaled["autoscale"]) == {"dequeue-getmsg"}  # never fights the user's HPA
