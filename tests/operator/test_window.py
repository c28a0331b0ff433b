"""A change of the wheel's window as the operator rolls it, on a fake cluster: pause the shard
owners, rebuild every wheel with a Job, resume with the new settings; levels not edges (a
restarted operator continues from the status and the Jobs), a failed Job leaves the owners
stopped and the TimerWheel Degraded, and a change the timer topic's retention cannot carry is
refused with the old window running. Also ``spec.deliveryReplicas`` (the scale subresource)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from k8s_helpers import wheel_body
from test_reconcile import SETTINGS, FakeCluster
from timerwheel.exposition import render
from timerwheel.metrics import Metrics
from timerwheel_operator import reconcile as rec
from timerwheel_operator import window as win
from timerwheel_operator.crd import STAGES
from timerwheel_operator.kafka_access import Access
from timerwheel_operator.retention import Check, TopicMissing

NOW = 1_700_000_000_000
REPORT = '{\n  "command": "rebuild-wheel",\n  "shard": %d,\n  "records": %d,\n  "seconds": 0.5\n}'


class Cluster(FakeCluster):
    """Pods follow the workloads' replicas; Jobs stay Running until ``finish``."""

    def __init__(self) -> None:
        super().__init__()
        self.logs: dict[str, str] = {}

    def pods(self, namespace: str, selector: Mapping[str, str]) -> list[dict[str, Any]]:
        if "job-name" in selector:
            job = selector["job-name"]
            return [{"metadata": {"name": f"{job}-pod"}, "status": {"phase": "Succeeded"}}] \
                if ("Job", job) in self.objects else []
        stage = selector["app.kubernetes.io/component"]
        kind = "StatefulSet" if stage in ("enqueue-put", "dequeue-get") else "Deployment"
        workload = self.objects.get((kind, f"timerwheel-orders-{stage}"))
        n = int(((workload or {}).get("spec") or {}).get("replicas") or 0)
        ip = f"10.1.0.{STAGES.index(stage)}"
        self.metrics[ip] = owners(stage)
        return [{"metadata": {"name": f"{stage}-{i}"}, "status": {"phase": "Running", "podIP": ip}} for i in range(n)]

    def pod_log(self, namespace: str, name: str) -> str:
        return self.logs.get(name.removesuffix("-pod"), "")

    def finish(self, name: str, ok: bool, log: str) -> None:
        job = self.objects[("Job", name)]
        job["status"] = {"conditions": [{"type": "Complete" if ok else "Failed", "status": "True"}]}
        self.logs[name] = log

    def env(self) -> dict[str, str]:
        return dict(self.objects[("ConfigMap", "timerwheel-orders-settings")]["data"])

    def replicas(self, stage: str) -> int:
        kind = "StatefulSet" if stage in ("enqueue-put", "dequeue-get") else "Deployment"
        return int(self.objects[(kind, f"timerwheel-orders-{stage}")]["spec"]["replicas"])

    def window_jobs(self) -> list[str]:
        return sorted(n for (k, n), o in self.objects.items()
                      if k == "Job" and o["metadata"]["labels"]["app.kubernetes.io/component"] == "window")


def owners(stage: str) -> str:
    """The metrics of a pod owning both shards."""
    m = Metrics()
    for shard in (0, 1):
        m.set("owner_epoch", 1, shard=shard, stage=stage)
        m.set("write_ms" if stage == "enqueue-put" else "read_ms", NOW, shard=shard)
    return render(m)


class Admin:
    def __init__(self, retention: int | None, fail_set: bool = False) -> None:
        self.retention, self.fail_set, self.set_to = retention, fail_set, None

    def retention_ms(self, kafka: Access, topic: str) -> int | None:
        if self.retention == -2:
            raise TopicMissing(topic)
        return self.retention

    def set_retention_ms(self, kafka: Access, topic: str, value: int) -> None:
        if self.fail_set:
            raise PermissionError("TOPIC_AUTHORIZATION_FAILED")
        self.set_to = self.retention = value


def run(body: dict[str, Any], cluster: Cluster, now: int, admin: Admin | None = None) -> tuple[dict[str, Any], list[str]]:
    """One round; the body as kopf would see it next (status merged), and the Events' reasons."""
    applied, status = rec.reconcile(body, cluster, SETTINGS, now, admin)
    after = copy.deepcopy(body)
    after["status"] = {**(body.get("status") or {}), **status}
    return after, [e.reason for e in applied.events]


def cond(body: Mapping[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in body["status"]["conditions"] if c["type"] == kind)


def change(body: dict[str, Any], **spec: Any) -> dict[str, Any]:
    out = copy.deepcopy(body)
    out["spec"].update(spec)
    out["metadata"]["generation"] += 1
    return out


def installed(cluster: Cluster, admin: Admin | None = None) -> dict[str, Any]:
    body = wheel_body(shards=2, tickMs=100, rollWindowMs=10_000)
    body, _ = run(body, cluster, NOW, admin)
    assert cluster.env()["TW_ROLL_WINDOW_MS"] == "10000" and cluster.replicas("enqueue-put") == 1
    return body


def test_a_window_change_pauses_rebuilds_with_a_job_and_resumes_with_the_new_settings() -> None:
    cluster = Cluster()
    body = change(installed(cluster), rollWindowMs=20_000)
    body, events = run(body, cluster, NOW + 1_000)
    # paused: the owners at 0 with the old settings; nothing rebuilt while an owner may write
    assert cluster.replicas("enqueue-put") == 0 and cluster.replicas("dequeue-get") == 0
    assert cluster.replicas("dequeue-put") == 1 and cluster.env()["TW_ROLL_WINDOW_MS"] == "10000"
    assert cluster.window_jobs() == [] and "WindowRolling" in events
    rolling = cond(body, "WindowRolling")
    assert (rolling["status"], rolling["reason"], rolling["observedGeneration"]) == ("True", "Pausing", 4)
    assert cond(body, "Ready")["status"] == "False" and cond(body, "Ready")["reason"] == "WindowRolling"

    body, _ = run(body, cluster, NOW + 2_000)  # the owner pods are gone now: the Job starts
    (job,) = cluster.window_jobs()
    manifest = cluster.objects[("Job", job)]
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    assert "--change-window" in container["command"][-1] and "-lt 2 " in container["command"][-1]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TW_ROLL_WINDOW_MS"] == "20000" and env["TW_TICK_MS"] == "100"
    assert manifest["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == \
        "timerwheel-orders-data"
    assert body["status"]["window"]["phase"] == "Rebuilding" and cond(body, "WindowRolling")["reason"] == "Rebuilding"

    body, _ = run(body, cluster, NOW + 3_000)  # still running: nothing more, still paused
    assert cluster.window_jobs() == [job] and cluster.replicas("enqueue-put") == 0

    cluster.finish(job, True, "\n".join([REPORT % (0, 300), '{"level": "info"}', REPORT % (1, 100)]))
    body, events = run(body, cluster, NOW + 4_000)
    assert cluster.env()["TW_ROLL_WINDOW_MS"] == "20000" and cluster.env()["TW_WHEEL_SPAN_MS"] == "0"
    assert cluster.replicas("enqueue-put") == 1 and cluster.replicas("dequeue-get") == 1
    window = body["status"]["window"]
    assert window["phase"] == "Resuming" and window["current"]["rollWindowMs"] == 20_000, window
    assert window["report"] == {"shards": 2, "records": 400, "seconds": 1.0, "recordsPerSecond": 400.0,
                                "mayDeliverTwice": 0}
    assert "WindowRebuilt" in events

    body, events = run(body, cluster, NOW + 5_000)  # the fake's stages are ready at once
    window = body["status"]["window"]
    assert window["phase"] == "Done" and window["pausedSeconds"] == 3.0, window
    assert (cond(body, "WindowRolling")["status"], cond(body, "WindowRolling")["reason"]) == ("False", "WindowRolled")
    assert cond(body, "Ready")["status"] == "True" and "WindowRolled" in events
    again, events = run(body, cluster, NOW + 6_000)  # a level: nothing more happens
    assert cluster.window_jobs() == [job] and events == [] and again["status"]["window"]["phase"] == "Done"


def test_a_restarted_operator_finds_the_running_job_and_starts_no_second_one() -> None:
    cluster = Cluster()
    body = change(installed(cluster), tickMs=1000)
    paused, _ = run(body, cluster, NOW + 1_000)
    rebuilding, _ = run(paused, cluster, NOW + 2_000)
    (job,) = cluster.window_jobs()
    # The status of the round that started the Job was never written: the successor sees "Pausing".
    again, _ = run(paused, cluster, NOW + 3_000)
    assert cluster.window_jobs() == [job] and again["status"]["window"]["job"] == job
    assert cluster.replicas("enqueue-put") == 0
    cluster.finish(job, True, REPORT % (0, 10))
    done, _ = run(again, cluster, NOW + 4_000)
    assert cluster.env()["TW_TICK_MS"] == "1000" and done["status"]["window"]["phase"] == "Resuming"


def test_a_failed_job_keeps_the_owners_stopped_and_degrades_with_its_last_line() -> None:
    cluster = Cluster()
    body = change(installed(cluster), rollWindowMs=2_000)
    body, _ = run(body, cluster, NOW + 1_000)
    body, _ = run(body, cluster, NOW + 2_000)
    (job,) = cluster.window_jobs()
    line = "timerwheel: error: TW_WHEEL_SPAN_MS: a span of 4000 ms cannot hold shard 0: ... nothing was changed"
    cluster.finish(job, False, '{"level": "info"}\n' + line)
    body, events = run(body, cluster, NOW + 3_000)
    degraded = cond(body, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "WindowRollFailed") and line in degraded["message"]
    assert cond(body, "Ready")["status"] == "False" and "WindowRollFailed" in events
    assert cluster.replicas("enqueue-put") == 0 and cluster.env()["TW_ROLL_WINDOW_MS"] == "10000"
    for i in range(3):  # stays so, round after round, and no new Job
        body, _ = run(body, cluster, NOW + 4_000 + i)
    assert cluster.window_jobs() == [job] and cluster.replicas("dequeue-get") == 0
    assert cond(body, "Degraded")["reason"] == "WindowRollFailed"

    # The spec back to the old window: the shards' window is unknown now, so it is rebuilt too.
    body = change(body, rollWindowMs=10_000)
    body, _ = run(body, cluster, NOW + 10_000)
    body, _ = run(body, cluster, NOW + 10_500)
    assert body["status"]["window"]["phase"] == "Rebuilding" and len(cluster.window_jobs()) == 2
    second = cluster.window_jobs()[-1]
    cluster.finish(second, True, REPORT % (0, 1))
    body, _ = run(body, cluster, NOW + 11_000)
    body, _ = run(body, cluster, NOW + 12_000)
    assert body["status"]["window"]["phase"] == "Done" and cond(body, "Degraded")["status"] == "False"
    assert cluster.replicas("enqueue-put") == 1


def test_a_job_refused_for_a_shard_still_owned_is_tried_again() -> None:
    cluster = Cluster()
    body = change(installed(cluster), rollWindowMs=20_000)
    body, _ = run(body, cluster, NOW + 1_000)
    body, _ = run(body, cluster, NOW + 2_000)
    (job,) = cluster.window_jobs()
    cluster.objects[("Job", job)]["status"] = {"conditions": [{"type": "Failed", "status": "True"}]}
    cluster.logs[job] = "timerwheel: error: shard 0 is owned by enqueue-put 'x' (lease epoch 3 ...)"
    cluster.pods = _exit_code(cluster.pods, 3)  # type: ignore[method-assign]
    body, events = run(body, cluster, NOW + 3_000)
    assert body["status"]["window"]["phase"] == "Pausing" and "WindowRollRetry" in events
    body, _ = run(body, cluster, NOW + 4_000)
    assert len(cluster.window_jobs()) == 2 and cond(body, "Degraded")["status"] == "False"


def test_a_span_refused_by_the_jobs_check_resumes_the_old_window_and_refuses_naming_the_field() -> None:
    """The Job checks every shard before it changes any (exit 12 from its check loop): nothing
    changed, so the owners come back with the old window and the change stays refused, naming
    spec.wheelSpanMs, until the spec changes again."""
    cluster = Cluster()
    body = change(installed(cluster), rollWindowMs=2_000)
    body, _ = run(body, cluster, NOW + 1_000)
    body, _ = run(body, cluster, NOW + 2_000)
    (job,) = cluster.window_jobs()
    script = cluster.objects[("Job", job)]["spec"]["template"]["spec"]["containers"][0]["command"][2]
    assert script.index("--check") < script.index("--change-window; s=")  # every check before any rebuild
    line = ("timerwheel: error: TW_WHEEL_SPAN_MS: a span of 4000 ms cannot hold shard 1: its records fire from "
            "R=100 to 9000, so the span must exceed 8900 ms; nothing was changed")
    cluster.pods = _exit_code(cluster.pods, win.EXIT_REFUSED_UNCHANGED)  # type: ignore[method-assign]
    cluster.finish(job, False, line)
    body, events = run(body, cluster, NOW + 3_000)
    rolling = cond(body, "WindowRolling")
    assert (rolling["status"], rolling["reason"]) == ("False", "WindowChangeRefused"), rolling
    assert "spec.wheelSpanMs: a span of 4000 ms" in rolling["message"] and "rollWindowMs 10000" in rolling["message"]
    assert "WindowChangeRefused" in events and cond(body, "Degraded")["status"] == "False"
    assert cluster.replicas("enqueue-put") == 1 and cluster.replicas("dequeue-get") == 1
    assert cluster.env()["TW_ROLL_WINDOW_MS"] == "10000"
    assert body["status"]["window"]["current"]["rollWindowMs"] == 10_000
    for i in range(3):  # stays refused, the owners running, no new Job, no new Event
        body, events = run(body, cluster, NOW + 4_000 + i)
        assert events == [] and cond(body, "WindowRolling")["reason"] == "WindowChangeRefused"
    assert cluster.window_jobs() == [job] and cluster.replicas("enqueue-put") == 1

    body = change(body, rollWindowMs=2_000, wheelSpanMs=20_000)  # a span that holds them
    body, _ = run(body, cluster, NOW + 10_000)
    body, _ = run(body, cluster, NOW + 10_500)
    assert body["status"]["window"]["phase"] == "Rebuilding" and len(cluster.window_jobs()) == 2


def _exit_code(pods: Any, code: int) -> Any:
    def with_code(namespace: str, selector: Mapping[str, str]) -> list[dict[str, Any]]:
        found = pods(namespace, selector)
        if "job-name" in selector:
            for p in found:
                p["status"]["containerStatuses"] = [{"state": {"terminated": {"exitCode": code}}}]
        return list(found)
    return with_code


def test_too_little_retention_unmanaged_refuses_the_change_and_the_old_window_runs() -> None:
    cluster = Cluster()
    admin = Admin(retention=20_000)
    body = installed(cluster, admin)
    body["spec"]["kafka"]["manageRetention"] = False
    body = change(body, rollWindowMs=20_000)
    body, events = run(body, cluster, NOW + 1_000, admin)
    rolling = cond(body, "WindowRolling")
    assert (rolling["status"], rolling["reason"]) == ("False", "WindowChangeRefused")
    assert rolling["message"].startswith("retention.ms") and "20000" in rolling["message"] \
        and "30000" in rolling["message"], rolling["message"]
    assert "WindowChangeRefused" in events and admin.set_to is None
    assert cluster.replicas("enqueue-put") == 1 and cluster.env()["TW_ROLL_WINDOW_MS"] == "10000"
    assert body["status"]["retention"]["state"] == "TooLow" and body["status"]["retention"]["neededMs"] == 30_000
    assert cond(body, "Ready")["status"] == "True"  # the old window keeps running
    body, events = run(body, cluster, NOW + 2_000, admin)
    assert events == []  # said once
    admin.retention = 40_000  # raised by hand: the change goes ahead
    body, _ = run(body, cluster, NOW + 3_000, admin)
    assert body["status"]["window"]["phase"] == "Pausing" and cluster.replicas("enqueue-put") == 0


def test_managed_retention_is_raised_before_the_change_and_a_refused_raise_refuses_it() -> None:
    cluster = Cluster()
    admin = Admin(retention=20_000)
    body = change(installed(cluster, admin), rollWindowMs=20_000)
    body, _ = run(body, cluster, NOW + 1_000, admin)
    assert admin.set_to == 30_000 and body["status"]["retention"]["state"] == "Raised"
    assert body["status"]["window"]["phase"] == "Pausing"

    cluster = Cluster()
    admin = Admin(retention=20_000, fail_set=True)
    body = change(installed(cluster, admin), rollWindowMs=20_000)
    body, _ = run(body, cluster, NOW + 1_000, admin)
    assert cond(body, "WindowRolling")["reason"] == "WindowChangeRefused"
    assert "TOPIC_AUTHORIZATION_FAILED" in cond(body, "WindowRolling")["message"]


def test_an_unreadable_retention_refuses_only_a_longer_window() -> None:
    refused = win.decide(win.Window(100, 20_000, 0), win.Window(100, 10_000, 0), win.Window(100, 10_000, 0), None,
                         None, None, Check("t", 30_000, True, "Unknown", message="no route"), True, 1, NOW)
    assert refused.condition[1] == "WindowChangeRefused" and "no route" in refused.condition[2]
    shorter = win.decide(win.Window(100, 5_000, 0), win.Window(100, 10_000, 0), win.Window(100, 10_000, 0), None,
                         None, None, Check("t", 7_500, True, "Unknown", message="no route"), True, 1, NOW)
    assert shorter.pause and shorter.status["phase"] == "Pausing"


def test_a_missing_timer_topic_is_shown_unknown_and_the_round_goes_on() -> None:
    cluster = Cluster()
    body = installed(cluster, Admin(retention=-2))
    assert body["status"]["retention"]["state"] == "Unknown" and cond(body, "Ready")["status"] == "True"


def test_delivery_replicas_scale_both_delivery_stages_unless_a_stage_sets_its_own() -> None:
    cluster = Cluster()
    body = wheel_body(deliveryReplicas=3)
    body, _ = run(body, cluster, NOW)
    assert cluster.replicas("dequeue-getmsg") == 3 and cluster.replicas("dequeue-put") == 3
    assert cluster.replicas("enqueue-put") == 1 and body["status"]["deliveryReplicas"] == 3
    assert "dequeue-getmsg" in body["status"]["deliverySelector"]
    body = change(body, stages={"dequeuePut": {"replicas": 2}})
    body, _ = run(body, cluster, NOW + 1)
    assert cluster.replicas("dequeue-getmsg") == 3 and cluster.replicas("dequeue-put") == 2
    assert body["status"]["deliveryReplicas"] == 2


def test_a_finished_job_whose_start_was_never_recorded_is_adopted_not_run_again() -> None:
    cluster = Cluster()
    body = change(installed(cluster), rollWindowMs=20_000)
    paused, _ = run(body, cluster, NOW + 1_000)
    run(paused, cluster, NOW + 2_000)
    (job,) = cluster.window_jobs()
    cluster.finish(job, True, REPORT % (0, 10))
    # The status of the round that started the Job was never written: its successor sees Pausing
    # and a Job that already finished. The shards have the new window: no second rebuild.
    done, events = run(paused, cluster, NOW + 3_000)
    assert cluster.window_jobs() == [job] and "WindowRebuilt" in events
    assert done["status"]["window"]["phase"] == "Resuming" and done["status"]["window"]["serial"] == 1
    assert cluster.env()["TW_ROLL_WINDOW_MS"] == "20000"
    again, events = run(done, cluster, NOW + 4_000)
    assert "WindowRebuilt" not in events and again["status"]["window"]["phase"] == "Done"


def test_the_next_change_never_records_the_last_change_s_job_again() -> None:
    cluster = Cluster()
    body = change(installed(cluster), rollWindowMs=20_000)
    for t in range(1, 6):
        if t == 3:
            (job,) = cluster.window_jobs()
            cluster.finish(job, True, REPORT % (0, 10))
        body, _ = run(body, cluster, NOW + t * 1_000)
    assert body["status"]["window"]["phase"] == "Done"
    body = change(body, rollWindowMs=40_000)
    body, events = run(body, cluster, NOW + 10_000)
    assert body["status"]["window"]["phase"] == "Pausing" and "WindowRebuilt" not in events and "WindowRolling" in events
    assert cluster.env()["TW_ROLL_WINDOW_MS"] == "20000" and cluster.replicas("enqueue-put") == 0
    body, _ = run(body, cluster, NOW + 11_000)
    assert body["status"]["window"]["phase"] == "Rebuilding" and len(cluster.window_jobs()) == 2
