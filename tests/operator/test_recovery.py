"""Checkpoint recovery and stall detection by the operator: the decisions as plain functions, the
recovery Job as rendered, and whole reconcile rounds against a fake cluster (levels, not edges)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from k8s_helpers import wheel_body
from test_reconcile import SETTINGS, FakeCluster
from timerwheel.exposition import render
from timerwheel.metrics import Metrics
from timerwheel_operator import manifests
from timerwheel_operator import reconcile as rec
from timerwheel_operator import recovery as rcv
from timerwheel_operator.jobs import JobView, Outcome, reports
from timerwheel_operator.spec import read
from timerwheel_operator.stage_metrics import ShardStatus

NOW = 1_700_000_000_000
POLICY = rcv.RecoveryPolicy()
REPORT = {"command": "recover", "shard": 0, "status": "repaired", "enqueue_checkpoint": "kept",
          "dequeue_checkpoint": "rebuilt", "set_aside": [], "read_ms": NOW - 60_000, "write_ms": NOW,
          "records": 120, "truncated_bytes": 0, "relinked": 0, "repaired_slots": 0, "may_deliver_twice": 17,
          "notes": [], "seconds": 0.2}


def unopenable(shard: int = 0, error: str = rcv.RECOVERY_NEEDED) -> ShardStatus:
    return ShardStatus(shard, open_errors=[f"enqueue-put enqueue-put-0: {error}"])


def job(name: str, phase: str = "Running") -> JobView:
    return JobView(name, int(name.rsplit("-", 1)[1]), phase, {rcv.SHARD_LABEL: "0"})


# --- the Job as rendered --------------------------------------------------------------------------

def test_the_recovery_job_runs_recover_on_the_stages_volume_with_their_settings_and_pod_defaults() -> None:
    body = wheel_body(redis={"secretRef": {"name": "redis-cred"}})
    wheel = read(body, "timerwheel:dev", "Never")
    jm = manifests.recovery_job(wheel, 3, 2, body)
    stage_pod = manifests.pod_template(wheel, "enqueue-put")["spec"]
    assert (jm["apiVersion"], jm["kind"], jm["metadata"]["name"]) == ("batch/v1", "Job", "timerwheel-orders-recover-3-2")
    assert jm["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"]
    assert jm["metadata"]["labels"]["timerwheel.io/shard"] == "3"
    assert jm["metadata"]["labels"]["app.kubernetes.io/component"] == "recovery"
    spec = jm["spec"]
    assert spec["backoffLimit"] == 0 and spec["activeDeadlineSeconds"] > 0 and spec["ttlSecondsAfterFinished"] > 0
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["timerwheel", "recover", "--shard", "3", "--data-dir", "/data"]
    assert c["image"] == "timerwheel:dev" and c["imagePullPolicy"] == "Never"
    assert c["envFrom"] == [{"configMapRef": {"name": "timerwheel-orders-settings"}}]
    assert {"name": "TW_REDIS_URL", "valueFrom": {"secretKeyRef": {"name": "redis-cred", "key": "url"}}} in c["env"]
    assert c["volumeMounts"] == stage_pod["containers"][0]["volumeMounts"]
    assert c["securityContext"] == stage_pod["containers"][0]["securityContext"]
    assert c["securityContext"]["readOnlyRootFilesystem"] and c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"] == stage_pod["securityContext"] and pod["restartPolicy"] == "Never"
    assert pod["volumes"] == stage_pod["volumes"]
    assert pod["automountServiceAccountToken"] is False and pod["serviceAccountName"] == "timerwheel-orders"
    assert spec["template"]["metadata"]["labels"]["timerwheel.io/attempt"] == "2"


def test_the_recovery_job_is_valid_for_kubernetes() -> None:
    import kubernetes_validate

    wheel = read(wheel_body(), "timerwheel:dev")
    kubernetes_validate.validate(manifests.recovery_job(wheel, 0, 1, wheel_body()), "1.34", strict=True)


# --- the decisions --------------------------------------------------------------------------------

def test_a_shard_needing_recovery_starts_a_job_and_one_needing_something_else_does_not() -> None:
    step = rcv.decide(unopenable(), None, None, None, POLICY, False, NOW)
    assert step.start_job and step.record is not None and step.record["serial"] == 1
    assert step.event is not None and step.event[0] == "RecoveryStarted"
    other = rcv.decide(unopenable(error="PermissionError"), None, None, None, POLICY, False, NOW)
    assert not other.start_job and other.event is None
    off = rcv.decide(unopenable(), None, None, None, rcv.RecoveryPolicy(auto=False), False, NOW)
    assert not off.start_job


def test_one_job_at_a_time_a_running_job_is_followed_not_repeated() -> None:
    running = rcv.decide(unopenable(), {"serial": 1, "state": "Running"}, job("x-recover-0-1"), None, POLICY, True, NOW)
    assert not running.start_job and running.record is not None and running.record["state"] == "Running"
    other_shard_busy = rcv.decide(unopenable(), None, None, None, POLICY, True, NOW)
    assert not other_shard_busy.start_job


def test_a_finished_job_is_recorded_with_its_report_and_an_event() -> None:
    log = '{"level": "info", "msg": "recovered"}\n' + json.dumps(REPORT, indent=2) + "\n"
    view = job("x-recover-0-1", "Succeeded")
    finished = Outcome(0, log, "x-recover-0-1-abcde")
    step = rcv.decide(unopenable(), {"serial": 1, "state": "Running", "job": view.name}, view, finished, POLICY,
                      False, NOW)
    assert step.record is not None and step.record["state"] == "Succeeded" and step.record["attempts"] == 0
    assert step.record["report"]["may_deliver_twice"] == 17 and step.record["reason"] == "Repaired"
    assert step.event is not None and step.event[0] == "RecoverySucceeded" and not step.event[2]
    # the owners have not picked it up yet: no second Job while they settle
    again = rcv.decide(unopenable(), step.record, view, None, POLICY, False, NOW + 5_000)
    assert not again.start_job


def test_a_failed_job_backs_off_then_retries_then_gives_up() -> None:
    record: dict[str, Any] = {"serial": 1, "state": "Running", "job": "x-recover-0-1", "attempts": 0}
    t = NOW
    for attempt in range(1, POLICY.max_attempts + 1):
        view = job(f"x-recover-0-{record['serial']}", "Failed")
        finished = Outcome(3, "timerwheel: error: shard 0 is owned by enqueue-put 'p' (lease epoch 4)\n",
                           f"{view.name}-pod")
        failed = rcv.result(view, finished)
        assert failed["reason"] == "ShardInUse" and "lease epoch 4" in failed["message"]
        step = rcv.decide(unopenable(), record, view, finished, POLICY, False, t)
        assert step.event is not None and step.event[0] == "RecoveryFailed" and step.event[2]
        assert f"kubectl logs {view.name}-pod" in step.event[1]
        record = dict(step.record or {})
        assert record["attempts"] == attempt
        if attempt == POLICY.max_attempts:
            assert record["state"] == "GaveUp"
            break
        backoff_ms = rcv.BACKOFF_S * 1000 * 2 ** (attempt - 1)
        early = rcv.decide(unopenable(), record, view, None, POLICY, False, t + backoff_ms - 1_000)
        assert not early.start_job  # no hot loop
        later = rcv.decide(unopenable(), record, view, None, POLICY, False, t + backoff_ms)
        assert later.start_job and later.record is not None and later.record["serial"] == record["serial"] + 1
        record = {**later.record, "state": "Running", "job": f"x-recover-0-{later.record['serial']}"}
        t += backoff_ms
    gave_up = rcv.decide(unopenable(), record, job(f"x-recover-0-{record['serial']}", "Failed"), None, POLICY, False,
                         t + 3_600_000)
    assert not gave_up.start_job
    opened = rcv.decide(ShardStatus(0, owner="enqueue-put-0"), record, None, None, POLICY, False, t + 3_600_000)
    assert opened.record is not None and opened.record["state"] == "Resolved" and opened.record["attempts"] == 0


def test_the_report_is_found_among_log_lines_and_a_log_without_one_gives_none() -> None:
    log = '{"ts": 1, "msg": "x"}\n' + json.dumps(REPORT, indent=2) + '\n{"ts": 2}\n'
    assert reports(log) == [REPORT]
    assert rcv.result(job("x-recover-0-1", "Succeeded"), Outcome(0, log, "p"))["report"]["records"] == 120
    assert reports("timerwheel: error: no shard at /data/shard-0009\n") == []
    failed = rcv.result(job("x-recover-0-1", "Failed"), Outcome(1, "a\ntimerwheel: error: boom\n", "p"))
    assert failed["message"] == "timerwheel: error: boom" and failed["reason"] == "RepairFailed"


# --- stalls ---------------------------------------------------------------------------------------

CAP = 1_000_000
TICK = 100


def owned(**kw: Any) -> ShardStatus:
    base: dict[str, Any] = {"owner": "enqueue-put-0", "reader": "dequeue-get-0", "write_ms": NOW - 200_000,
                            "read_ms": NOW - 300_000, "pending": 5}
    base.update(kw)
    return ShardStatus(0, **base)


def test_a_frozen_w_or_r_with_work_due_is_a_stall_and_the_conservative_cases_are_not() -> None:
    limit = POLICY.stall_after_ms
    old = NOW - limit
    stalls = rcv.stalled(owned(), old, old, POLICY, NOW, CAP, TICK, True)
    assert [(s.which, s.pod) for s in stalls] == [("W", "enqueue-put-0"), ("R", "dequeue-get-0")]
    # moved within the limit
    assert rcv.stalled(owned(), old + 1, old + 1, POLICY, NOW, CAP, TICK, True) == []
    # W held back by R at the wheel's cap: R's stall, not W's
    capped = owned(write_ms=NOW - 300_000 + CAP - TICK)
    assert [s.which for s in rcv.stalled(capped, old, old, POLICY, NOW, CAP, TICK, True)] == ["R"]
    # nothing pending or in flight: R is not stalled
    assert [s.which for s in rcv.stalled(owned(pending=0, in_flight=0), old, old, POLICY, NOW, CAP, TICK, True)] == ["W"]
    # R waiting for W (R at W's slot)
    at_w = owned(read_ms=NOW - 200_000)
    assert [s.which for s in rcv.stalled(at_w, old, old, POLICY, NOW, CAP, TICK, True)] == ["W"]
    # the downstream stages have no ready replica: they are what is stuck
    assert [s.which for s in rcv.stalled(owned(), old, old, POLICY, NOW, CAP, TICK, False)] == ["W"]
    # W held back for its input (enqueue-get down, Kafka away): restarting enqueue-put would not help
    waiting = owned(pending=0, in_flight=0, input_wait_ms=limit + 5_000)
    assert rcv.stalled(waiting, old, old, POLICY, NOW, CAP, TICK, True) == []
    # a recent W or R (idle W publication keeps W near now)
    fresh = owned(write_ms=NOW - 1_000, read_ms=NOW - 1_000)
    assert rcv.stalled(fresh, old, old, POLICY, NOW, CAP, TICK, True) == []


def test_the_stall_threshold_is_never_shorter_than_the_floor() -> None:
    assert rcv.RecoveryPolicy.of({"recovery": {"stallAfterMs": 1_000}}, 100).stall_after_ms == rcv.MIN_STALL_AFTER_MS
    assert rcv.RecoveryPolicy.of({"recovery": {"stallAfterMs": 30_000}}, 10_000).stall_after_ms == 101_000
    assert rcv.RecoveryPolicy.of({}, 100).stall_after_ms == rcv.DEFAULT_STALL_AFTER_MS


def test_advanced_keeps_the_time_of_the_last_change() -> None:
    assert rcv.advanced({"W": 5, "wAdvancedMs": 100}, "W", 5, NOW) == 100
    assert rcv.advanced({"W": 5, "wAdvancedMs": 100}, "W", 6, NOW) == NOW
    assert rcv.advanced({}, "R", 6, NOW) == NOW
    assert rcv.advanced({"R": 6, "rAdvancedMs": 100}, "R", None, NOW) is None


# --- whole rounds against a fake cluster ------------------------------------------------------------

class JobCluster(FakeCluster):
    """FakeCluster whose Jobs can be finished, with a recovery pod per finished Job and its log."""

    def __init__(self) -> None:
        super().__init__()
        self.logs: dict[str, str] = {}
        self.exit_codes: dict[str, int] = {}

    def finish(self, name: str, ok: bool, log: str, exit_code: int) -> None:
        obj = self.objects[("Job", name)]
        obj["status"] = {"conditions": [{"type": "Complete" if ok else "Failed", "status": "True"}]}
        self.logs[f"{name}-pod"] = log
        self.exit_codes[name] = exit_code

    def pods(self, namespace: str, selector: Mapping[str, str]) -> list[dict[str, Any]]:
        if "job-name" in selector:
            name = selector["job-name"]
            if name not in self.exit_codes:
                return []
            return [{"metadata": {"name": f"{name}-pod"}, "status": {"phase": "Succeeded", "containerStatuses": [
                {"state": {"terminated": {"exitCode": self.exit_codes[name]}}}]}}]
        return super().pods(namespace, selector)

    def pod_log(self, namespace: str, name: str) -> str:
        return self.logs[name]


def serving(shard_errors: Mapping[int, str] | None = None, write_ms: int = NOW, read_ms: int = NOW,
            shards: int = 2) -> dict[str, str]:
    """The stage pods' metrics: both own every shard but those in ``shard_errors`` (shard -> the
    error they report for it)."""
    out = {}
    for ip, stage in (("10.1.0.1", "enqueue-put"), ("10.1.0.2", "dequeue-get")):
        m = Metrics()
        for shard in range(shards):
            if shard in (shard_errors or {}):
                continue
            m.set("owner_epoch", 1, shard=shard, stage=stage)
            m.set("write_ms" if stage == "enqueue-put" else "read_ms",
                  write_ms if stage == "enqueue-put" else read_ms, shard=shard)
            m.set("pending", 3, shard=shard)
        for shard, error in (shard_errors or {}).items():
            m.set("shard_open_failed", 1, shard=shard, stage=stage, error=error)
        out[ip] = render(m)
    return out


def round_(body: dict[str, Any], cluster: FakeCluster, now_ms: int) -> tuple[rec.Applied, dict[str, Any]]:
    applied, status = rec.reconcile(body, cluster, SETTINGS, now_ms)
    body["status"] = status
    return applied, status


def conditions(status: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_a_round_runs_the_job_follows_it_and_records_the_outcome() -> None:
    cluster = JobCluster()
    body = wheel_body(shards=2)
    cluster.metrics = serving({1: rcv.RECOVERY_NEEDED})
    applied, status = round_(body, cluster, NOW)
    jobs = [n for k, n in cluster.objects if k == "Job"]
    assert jobs == ["timerwheel-orders-recover-1-1"]
    assert conditions(status)["Recovering"] == ("True", "RecoveryJob")
    assert conditions(status)["Ready"][0] == "False"
    assert status["shards"][1]["recovery"]["state"] == "Running"
    assert [e.reason for e in applied.events] == ["RecoveryStarted"]

    # the next round, the Job still running: nothing new
    applied, status = round_(body, cluster, NOW + 10_000)
    assert [n for k, n in cluster.objects if k == "Job"] == jobs and applied.events == []

    cluster.finish(jobs[0], True, json.dumps({**REPORT, "shard": 1}, indent=2) + "\n", 0)
    applied, status = round_(body, cluster, NOW + 20_000)
    record = status["shards"][1]["recovery"]
    assert record["state"] == "Succeeded" and record["report"]["may_deliver_twice"] == 17
    assert record["pod"] == f"{jobs[0]}-pod" and record["exitCode"] == 0
    assert [e.reason for e in applied.events] == ["RecoverySucceeded"]

    # the owners start it: Ready again, the outcome stays in the status, no Event repeated
    cluster.metrics = serving()
    applied, status = round_(body, cluster, NOW + 30_000)
    assert conditions(status)["Recovering"][0] == "False" and applied.events == []
    assert status["shards"][1]["recovery"]["state"] == "Succeeded"
    assert conditions(status)["Degraded"] == ("False", "AsExpected")


def test_failed_jobs_end_in_degraded_recovery_failed_naming_the_shard_and_the_log() -> None:
    cluster = JobCluster()
    body = wheel_body()
    cluster.metrics = serving({0: rcv.RECOVERY_NEEDED}, shards=1)
    t = NOW
    for _ in range(POLICY.max_attempts):
        round_(body, cluster, t)
        name = body["status"]["shards"][0]["recovery"]["job"]
        cluster.finish(name, False, "timerwheel: error: TimerLog segment 3 unreadable\n", 1)
        t += 10_000
        _, status = round_(body, cluster, t)
        t += 3_600_000  # past any backoff
    assert len([k for k in cluster.objects if k[0] == "Job"]) == POLICY.max_attempts
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "RecoveryFailed"
    assert "shard 0" in degraded["message"] and "kubectl logs timerwheel-orders-recover-0-3-pod" in degraded["message"]
    round_(body, cluster, t)
    assert len([k for k in cluster.objects if k[0] == "Job"]) == POLICY.max_attempts  # given up: no more


def test_a_stalled_shard_is_degraded_and_its_owner_restarted_once() -> None:
    cluster = JobCluster()
    body = wheel_body()
    frozen_w, frozen_r = NOW - 400_000, NOW - 500_000
    cluster.metrics = serving(write_ms=frozen_w, read_ms=frozen_r, shards=1)
    _, status = round_(body, cluster, NOW)
    assert conditions(status)["Degraded"][0] == "False" and cluster.deleted == []
    assert status["shards"][0]["wAdvancedMs"] == NOW
    later = NOW + POLICY.stall_after_ms
    applied, status = round_(body, cluster, later)
    assert conditions(status)["Degraded"] == ("True", "ShardStalled")
    assert "shard 0 (W unchanged" in next(c["message"] for c in status["conditions"] if c["type"] == "Degraded")
    assert cluster.deleted == ["enqueue-put-0", "dequeue-get-0"]  # W frozen, and R below it with messages pending
    assert {e.reason for e in applied.events} == {"ShardStalled"}
    round_(body, cluster, later + 10_000)
    assert cluster.deleted == ["enqueue-put-0", "dequeue-get-0"]  # not again within stallAfterMs
    cluster.metrics = serving(write_ms=later + 20_000, read_ms=later + 20_000, shards=1)
    _, status = round_(body, cluster, later + 20_000)
    assert conditions(status)["Degraded"][0] == "False"


def test_a_finished_job_whose_start_was_never_recorded_is_recorded_not_run_again() -> None:
    cluster = JobCluster()
    body = wheel_body()
    cluster.metrics = serving({0: rcv.RECOVERY_NEEDED}, shards=1)
    round_(body, cluster, NOW)
    (name,) = [n for k, n in cluster.objects if k == "Job"]
    cluster.finish(name, True, json.dumps(REPORT, indent=2) + "\n", 0)
    body["status"]["shards"][0].pop("recovery")  # that round's status was never written
    applied, status = round_(body, cluster, NOW + 10_000)
    assert [n for k, n in cluster.objects if k == "Job"] == [name]
    record = status["shards"][0]["recovery"]
    assert (record["job"], record["state"], record["serial"]) == (name, "Succeeded", 1)
    assert [e.reason for e in applied.events] == ["RecoverySucceeded"]
    applied, status = round_(body, cluster, NOW + 20_000)
    assert applied.events == [] and [n for k, n in cluster.objects if k == "Job"] == [name]
