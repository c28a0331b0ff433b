"""Reconciling against a fake cluster: levels not edges, idempotent, never crashing on a bad
spec or a refused object; and the kopf handlers and settings as registered."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import kopf
import pytest
from k8s_helpers import wheel_body
from timerwheel.metrics import Metrics
from timerwheel_operator import reconcile as rec
from timerwheel_operator import runtime
from timerwheel_operator.crd import STAGES
from timerwheel_operator.main import SettingsError, settings_from_env

SETTINGS = rec.Settings(image="timerwheel:dev", pull_policy="Never")


class FakeCluster:
    """Applies into a dict; workloads report themselves rolled out; pods serve canned metrics."""

    def __init__(self, refuse: set[str] | None = None) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.applies = 0
        self.refuse = refuse or set()
        self.metrics: dict[str, str] = {}

    def apply(self, manifest: Mapping[str, Any]) -> None:
        self.applies += 1
        if manifest["kind"] in self.refuse:
            raise RuntimeError(f"{manifest['kind']} is forbidden")
        obj = copy.deepcopy(dict(manifest))
        if obj["kind"] in ("Deployment", "StatefulSet"):
            n = obj["spec"]["replicas"]
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


def owner_metrics(stage: str, epoch: int) -> str:
    m = Metrics()
    m.set("owner_epoch", epoch, shard=0, stage=stage)
    m.set("write_ms" if stage == "enqueue-put" else "read_ms", 1_700_000_000_000, shard=0)
    return m.render_prometheus()


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


def test_the_handlers_and_the_startup_hook_are_registered() -> None:
    import timerwheel_operator.main  # noqa: F401 - registers

    registry = kopf.get_default_registry()
    ids = {h.id for h in registry._spawning.get_all_handlers()} | {
        h.id for h in registry._changing.get_all_handlers()}
    assert any("spec_changed" in i for i in ids) and any(i.endswith("level") for i in ids)
    assert any("configure" in h.id for h in registry._activities.get_all_handlers())


def test_no_handler_puts_a_finalizer_on_a_timerwheel() -> None:
    """Else `helm uninstall`, which deletes the operator with the TimerWheel, leaves the
    TimerWheel (and its namespace) Terminating forever."""
    import timerwheel_operator.main  # noqa: F401 - registers

    registry = kopf.get_default_registry()
    handlers = [*registry._spawning.get_all_handlers(), *registry._changing.get_all_handlers()]
    assert any(h.id.endswith("level") for h in handlers)
    assert [h.id for h in handlers if h.requires_finalizer] == []


def test_the_spec_handler_writes_the_status_through_kopf_s_patch() -> None:
    from timerwheel_operator.handlers.timerwheel import spec_changed

    cluster = FakeCluster()
    runtime.install(cluster, SETTINGS)
    patch = kopf.Patch()
    spec_changed(body=kopf.Body(wheel_body()), patch=patch, logger=None)  # type: ignore[arg-type]
    assert patch["status"]["observedGeneration"] == 3
    assert ("ConfigMap", "timerwheel-orders-settings") in cluster.objects


def test_operator_settings_are_validated() -> None:
    assert settings_from_env({}) == rec.Settings("timerwheel:dev", "IfNotPresent")
    assert settings_from_env({"TIMERWHEEL_IMAGE": "x:1", "TIMERWHEEL_IMAGE_PULL_POLICY": "Never"}).pull_policy == "Never"
    with pytest.raises(SettingsError, match="^TIMERWHEEL_IMAGE_PULL_POLICY: "):
        settings_from_env({"TIMERWHEEL_IMAGE_PULL_POLICY": "Sometimes"})
