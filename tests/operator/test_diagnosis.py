"""Why a TimerWheel's pods do not run, from what Kubernetes reports (pod and claim objects shaped
as the API server returns them), and how the status and the Events say it: Degraded and Ready name
the reason, an Event is posted when Degraded turns to it, once."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from k8s_helpers import wheel_body
from test_reconcile import SETTINGS, FakeCluster
from timerwheel_operator import diagnosis
from timerwheel_operator import reconcile as rec
from timerwheel_operator.crd import STAGES
from timerwheel_operator.status import StageState, compute

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
LONG_AGO = "2026-01-01T11:00:00Z"
JUST_NOW = "2026-01-01T11:59:55Z"


def pod(component: str, waiting: str | None = None, message: str = "", **more: Any) -> dict[str, Any]:
    state: dict[str, Any] = {"waiting": {"reason": waiting, "message": message}} if waiting else {"running": {}}
    status: dict[str, Any] = {"phase": "Pending" if waiting else "Running", "containerStatuses": [
        {"name": component, "image": "registry.example/timerwheel:0.1.0", "state": state,
         "restartCount": more.get("restarts", 0), "lastState": more.get("last", {})}]}
    if "conditions" in more:
        status = {"phase": "Pending", "conditions": more["conditions"]}
    return {"metadata": {"name": f"timerwheel-orders-{component}-0",
                         "labels": {"app.kubernetes.io/component": component}},
            "spec": {"containers": [{"name": component, "image": "registry.example/timerwheel:0.1.0"}]},
            "status": status}


def claim(phase: str, created: str = LONG_AGO, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "timerwheel-orders-data", "creationTimestamp": created},
            "spec": {"accessModes": ["ReadWriteMany"], **spec}, "status": {"phase": phase}}


PROVISIONING_FAILED = {"type": "Warning", "reason": "ProvisioningFailed",
                       "message": "failed to provision volume with StorageClass \"gp2\": invalid AccessModes "
                                  "[ReadWriteMany]: only AccessModes [ReadWriteOnce] are supported"}


def test_a_claim_pending_past_the_grace_is_named_with_what_the_provisioner_said() -> None:
    blockers = diagnosis.diagnose([], claim("Pending", storageClassName="gp2"), [PROVISIONING_FAILED], NOW)
    assert [b.reason for b in blockers] == ["ClaimPending"]
    text = blockers[0].message
    assert "timerwheel-orders-data is Pending" in text and "only AccessModes [ReadWriteOnce]" in text
    assert "ReadWriteMany from the storage class 'gp2'" in text and "spec.storage" in text
    assert diagnosis.diagnose([], claim("Pending", created=JUST_NOW), [], NOW) == []  # being provisioned
    assert diagnosis.diagnose([], claim("Bound"), [], NOW) == []


def test_image_pull_failures_crash_loops_config_errors_and_unschedulable_pods_are_named() -> None:
    pull = pod("dequeue-put", "ErrImagePull", 'failed to pull "registry.example/timerwheel:0.1.0": 401 Unauthorized')
    backoff = pod("enqueue-get", "ImagePullBackOff", "Back-off pulling image")
    crash = pod("enqueue-put", "CrashLoopBackOff", "back-off 20s restarting", restarts=3, last={"terminated": {
        "exitCode": 2, "message": '{"level": "info"}\ntimerwheel: error: TW_REDIS_URL: must start with redis://\n'}})
    config = pod("dequeue-get", "CreateContainerConfigError", 'secret "redis-auth" not found')
    unschedulable = pod("dequeue-getmsg", conditions=[{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "lastTransitionTime": LONG_AGO,
        "message": "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector."}])
    waiting = pod("dequeue-getmsg", conditions=[{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "lastTransitionTime": JUST_NOW}])
    healthy = pod("dequeue-put")
    # started again between two back-offs, not ready: still crash-looping (no flapping condition)
    again = pod("dequeue-put")
    again["status"]["containerStatuses"][0].update(restartCount=2, ready=False, lastState={"terminated": {
        "exitCode": 2, "message": "timerwheel: error: TW_REDIS_URL: must start with redis://"}})
    assert [b.reason for b in diagnosis.diagnose([again], None, [], NOW)] == ["CrashLooping"]
    again["status"]["containerStatuses"][0]["ready"] = True  # it came up after all
    assert diagnosis.diagnose([again], None, [], NOW) == []
    found = diagnosis.diagnose([healthy, unschedulable, waiting, config, crash, backoff, pull], None, [], NOW)
    assert [b.reason for b in found] == ["ImagePullFailed", "ImagePullFailed", "CrashLooping", "PodConfigError",
                                         "Unschedulable"]
    assert "cannot pull image registry.example/timerwheel:0.1.0 (ImagePullBackOff" in found[0].message
    assert "401 Unauthorized" in found[1].message and "imagePullSecrets" in found[1].message
    assert "restarted 3 times, last exit code 2: timerwheel: error: TW_REDIS_URL" in found[2].message
    assert 'secret "redis-auth" not found' in found[3].message
    assert "didn't match Pod's node affinity/selector" in found[4].message
    reason, message = diagnosis.summary(found) or ("", "")
    assert reason == "ImagePullFailed" and all(b.message in message for b in found)
    assert diagnosis.diagnose([healthy], claim("Bound"), [], NOW) == []
    gone = {**crash, "metadata": {**crash["metadata"], "deletionTimestamp": LONG_AGO}}
    assert diagnosis.diagnose([gone], None, [], NOW) == []


def test_a_blocker_degrades_and_names_why_the_timerwheel_is_not_ready() -> None:
    stages = {s: StageState(1, replicas=1, ready=0 if s == "dequeue-put" else 1, updated=1) for s in STAGES}
    blocker = diagnosis.Blocker("ImagePullFailed", "dequeue-put pod p cannot pull image x")
    status = compute(2, stages, [], [], "2026-01-01T12:00:00Z", blockers=[blocker])
    conds = {c["type"]: c for c in status["conditions"]}
    assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("True", "ImagePullFailed")
    assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("False", "ImagePullFailed")
    assert "cannot pull image x" in conds["Ready"]["message"]


class Blocked(FakeCluster):
    """A cluster whose dequeue-put pod cannot pull its image."""

    def __init__(self) -> None:
        super().__init__()
        self.pulling = True

    def pods(self, namespace: str, selector: Mapping[str, str]) -> list[dict[str, Any]]:
        if "app.kubernetes.io/component" not in selector:  # every pod of the TimerWheel
            return [pod("dequeue-put", "ErrImagePull", "not found")] if self.pulling else [pod("dequeue-put")]
        return super().pods(namespace, selector)


def test_the_event_is_posted_when_degraded_turns_to_a_blocker_once() -> None:
    cluster = Blocked()
    body = wheel_body()
    reasons = []
    for _ in range(3):
        applied, status = rec.reconcile(body, cluster, SETTINGS, 1_000)
        body["status"] = status
        reasons.append([(e.reason, e.warning) for e in applied.events])
    assert reasons == [[("ImagePullFailed", True)], [], []]
    degraded = next(c for c in body["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "ImagePullFailed" and "not found" in degraded["message"]
    cluster.pulling = False
    applied, status = rec.reconcile(body, cluster, SETTINGS, 2_000)
    assert applied.events == [] and next(c for c in status["conditions"] if c["type"] == "Degraded")["status"] == "False"
