"""Day two on the real local cluster (scripts/k8s.sh): the operator scales and upgrades the stages
under a steady load (a kafka-python producer in this test), and nothing is lost or early.

    helm install (2 shards) -> Ready
    -> under load: enqueue-put and dequeue-get 1 -> 2 (the shards spread over both pods),
       dequeue-getmsg and dequeue-put 1 -> 3; then all back to 1 with the operator pod deleted
       right after the change (its successor reconciles to the spec) -> lost 0, early 0,
       duplicates within DUPLICATE_BOUND
    -> under load: a new image tag (the same image, tagged again in containerd) rolls every
       stage -> lost 0, early 0
    -> under load: shard 1's dequeue checkpoint is lost while its owners are stopped; when they
       come back they refuse it (RecoveryNeeded), the operator runs a recovery Job (timerwheel
       recover --shard 1), the shard is served again and the TimerWheel Ready -> lost 0, early 0,
       duplicates at most the report's may_deliver_twice
    -> under load: rollWindowMs doubled: the operator pauses the shard owners, a Job rebuilds every
       wheel (timerwheel rebuild-wheel --change-window), the stages roll with the new settings and
       the TimerWheel is Ready again -> lost 0, early 0, duplicates within DUPLICATE_FRACTION
    -> kubectl scale timerwheel/tw --replicas=2: dequeue-getmsg and dequeue-put at 2, ready

Figures (printed as ``FIGURE`` lines, never asserted: the machine is shared): time from the scale
decision to the new replicas carrying load (owning shards / ready), scale-down time, rollout
time and lateness p99 through the rollout; for the window change the seconds paused, the time to
Ready and the rebuild's records/s.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from harness import LoadRun, Report, now_ms
from k8s_cluster import ROOT
from kafka.admin import ConfigResource, ConfigResourceType
from test_k8s_helm import NAMESPACE, RELEASE, STAGES, WHEEL, Release, release  # noqa: F401 - the fixture

pytestmark = [pytest.mark.k8s, pytest.mark.e2e]

#: Duplicates allowed per scaling round: a dequeue-get shard handed over after DRAIN_S with
#: messages still in flight has its slots read again by the next owner. With the clean hand-over
#: (drained first) there are none; a stage pod killed mid-batch can repeat its batch.
DUPLICATE_FRACTION = 0.02


@pytest.fixture(scope="module")
def installed(release: Release, tmp_path_factory: pytest.TempPathFactory) -> Release:  # noqa: F811
    values = tmp_path_factory.mktemp("day2") / "values.yaml"
    values.write_text(yaml.safe_dump(release.values))
    done = release.helm("install", RELEASE, str(ROOT / "charts" / "timerwheel"), "-n", NAMESPACE,
                        "--create-namespace", "-f", str(values), "--wait", "--timeout", "300s")
    assert done.returncode == 0, done.stderr + release.diagnosis()
    waited = release.kubectl("wait", f"timerwheel/{WHEEL}", "--for=condition=Ready", "--timeout=300s",
                             check=False, timeout=330)
    assert waited.returncode == 0, waited.stderr + release.diagnosis()
    return release


def _wait(what: str, ok: Callable[[], bool], rel: Release, timeout_s: float = 180) -> float:
    """Seconds until ``ok()``; fails naming ``what`` after ``timeout_s``."""
    t0 = time.monotonic()
    while not ok():
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"{what}: not within {timeout_s:.0f} s\n{rel.diagnosis()}", pytrace=False)
        time.sleep(0.5)
    return time.monotonic() - t0


def _patch(rel: Release, spec: dict[str, Any]) -> None:
    rel.kubectl("patch", "timerwheel", WHEEL, "--type=merge", "-p", json.dumps({"spec": spec}))


def _replicas(n_owners: int, n_stateless: int) -> dict[str, Any]:
    return {"stages": {"enqueuePut": {"replicas": n_owners}, "dequeueGet": {"replicas": n_owners},
                       "dequeueGetmsg": {"replicas": n_stateless}, "dequeuePut": {"replicas": n_stateless}}}


def _tw(rel: Release) -> dict[str, Any]:
    out: dict[str, Any] = rel.get("timerwheel", WHEEL)
    return out


def _shard_pods(rel: Release, key: str) -> set[str]:
    """The pods owning the shards (``owner``: enqueue-put, ``reader``: dequeue-get), all shards owned."""
    shards = _tw(rel)["status"].get("shards") or []
    pods = [s.get(key) for s in shards]
    return set() if None in pods or not pods else {str(p) for p in pods}


def _running(rel: Release, stage: str) -> list[dict[str, Any]]:
    return [p for p in rel.pods(stage) if not p["metadata"].get("deletionTimestamp")]


def _all_ready(rel: Release, stage: str, n: int, image: str | None = None) -> bool:
    pods = _running(rel, stage)
    if len(pods) != n:
        return False
    for p in pods:
        conds = {c["type"]: c["status"] for c in p["status"].get("conditions", [])}
        if conds.get("Ready") != "True":
            return False
        if image is not None and p["spec"]["containers"][0]["image"] != image:
            return False
    return True


def _ready_at_generation(rel: Release) -> bool:
    tw = _tw(rel)
    conds = {c["type"]: c for c in tw.get("status", {}).get("conditions", [])}
    ready = conds.get("Ready", {})
    return ready.get("status") == "True" and ready.get("observedGeneration") == tw["metadata"]["generation"]


def _check(rep: Report, missing: set[str], rel: Release) -> None:
    assert not missing and rep.lost == [] and rep.early == [], rep.line() + rel.diagnosis()
    assert rep.duplicated <= DUPLICATE_FRACTION * rep.scheduled, rep.line()
    assert rep.unexpected == [], rep.line()


def test_scaling_the_stages_under_load_loses_nothing_and_survives_the_operators_restart(
        installed: Release) -> None:
    rel = installed
    dest = rel.pipe.new_dest("day2-scale", 4)
    with LoadRun(rel.pipe, dest, seed=21, rate=50, min_delay_ms=2_000, max_delay_ms=10_000) as run:
        time.sleep(5)
        _patch(rel, _replicas(2, 3))
        spread = _wait("the shards spread over two enqueue-put and two dequeue-get pods",
                       lambda: len(_shard_pods(rel, "owner")) == 2 and len(_shard_pods(rel, "reader")) == 2, rel)
        stateless = _wait("three dequeue-getmsg and dequeue-put pods ready",
                          lambda: all(_all_ready(rel, s, 3) for s in ("dequeue-getmsg", "dequeue-put")), rel)
        print(f"FIGURE scale 1 -> 2 (shard owners): the shards carried by both pods {spread:.1f} s after the "
              f"change; stateless 1 -> 3 ready {spread + stateless:.1f} s after it", flush=True)
        events = [e["message"] for e in rel.get("events", "--field-selector",
                                                 f"involvedObject.name={WHEEL},reason=Scaled")["items"]]
        assert "enqueue-put: 1 -> 2 replicas (spec)" in events, events
        time.sleep(10)  # steady on two owners

        # Back to one, with the operator deleted right after the change: its successor (a new pod,
        # kopf's resume handler and the timer) makes the workloads match the spec.
        t0 = time.monotonic()
        _patch(rel, _replicas(1, 1))
        operator = rel.get("pods", "-l", "app.kubernetes.io/component=operator")["items"][0]["metadata"]["name"]
        rel.kubectl("delete", "pod", operator, "--wait=false")
        _wait("every stage back to one pod, the TimerWheel Ready at its generation",
              lambda: all(_all_ready(rel, s, 1) for s in STAGES) and _ready_at_generation(rel)
              and len(_shard_pods(rel, "owner")) == 1 and len(_shard_pods(rel, "reader")) == 1, rel, 240)
        down = time.monotonic() - t0
        print(f"FIGURE scale 2 -> 1 (and 3 -> 1) with the operator pod deleted: every stage at one pod and "
              f"the TimerWheel Ready {down:.1f} s after the change", flush=True)
        missing, rep = run.drain("k8s day-2 scaling", timeout_s=120)
    print(f"FIGURE day-2 scaling under 50 msg/s: {rep.line()}", flush=True)
    _check(rep, missing, rel)


def _containerd_socket() -> str:
    return f"/run/tw-k8s-{hashlib.sha256(str(ROOT).encode()).hexdigest()[:8]}/containerd.sock"


def test_a_new_image_rolls_every_stage_under_load_with_nothing_lost(installed: Release) -> None:
    rel = installed
    _patch(rel, _replicas(1, 1))  # whatever the test before left
    _wait("one pod per stage", lambda: all(_all_ready(rel, s, 1) for s in STAGES) and _ready_at_generation(rel), rel)
    tag = f"day2-{rel.pipe.uid}"
    done = subprocess.run(["ctr", "-a", _containerd_socket(), "-n", "k8s.io", "images", "tag", "--force",
                           "docker.io/library/timerwheel:dev", f"docker.io/library/timerwheel:{tag}"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, f"ctr images tag failed: {done.stderr}"
    dest = rel.pipe.new_dest("day2-image", 4)
    with LoadRun(rel.pipe, dest, seed=22, rate=50, min_delay_ms=2_000, max_delay_ms=10_000) as run:
        time.sleep(5)
        rolled_at = now_ms()
        _patch(rel, {"image": {"repository": "timerwheel", "tag": tag, "pullPolicy": "Never"}})
        took = _wait("every stage rolled to the new tag and the TimerWheel Ready",
                     lambda: all(_all_ready(rel, s, 1, f"timerwheel:{tag}") for s in STAGES)
                     and _ready_at_generation(rel) and len(_shard_pods(rel, "owner")) == 1, rel, 300)
        time.sleep(5)
        missing, rep = run.drain("k8s day-2 image change", timeout_s=120)
        late = _lateness_due_between(run, rolled_at, rolled_at + int(took * 1000))
    p99 = late[min(len(late) - 1, int(0.99 * len(late)))] if late else float("nan")
    print(f"FIGURE image change under 50 msg/s: every stage rolled and Ready in {took:.1f} s; lateness p99 of "
          f"the {len(late)} messages due meanwhile {p99} ms, max {max(late, default=0)} ms; {rep.line()}",
          flush=True)
    _check(rep, missing, rel)


def _lateness_due_between(run: LoadRun, start_ms: int, end_ms: int) -> list[int]:
    """Lateness (ms, first copy) of the delivered messages due within [start_ms, end_ms), sorted."""
    expected = run.producer.expected()
    with run.collector._lock:
        first = {k: v[0].delivered_at_ms for k, v in run.collector.by_id.items() if v}
    return sorted(first[m] - s.deliver_at_ms for m, s in expected.items()
                  if m in first and start_ms <= s.deliver_at_ms < end_ms)


def _condition(rel: Release, kind: str) -> dict[str, Any]:
    conds = {c["type"]: c for c in _tw(rel).get("status", {}).get("conditions", [])}
    return dict(conds.get(kind) or {})


def _recovery_jobs(rel: Release) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = rel.get("jobs", "-l", f"app.kubernetes.io/instance={WHEEL},"
                                          "app.kubernetes.io/component=recovery")["items"]
    return items


def test_recovery_of_a_lost_dequeue_checkpoint_runs_a_job_and_loses_nothing(installed: Release) -> None:
    rel = installed
    _patch(rel, _replicas(1, 1))  # whatever the test before left
    _wait("one pod per stage", lambda: all(_all_ready(rel, s, 1) for s in STAGES) and _ready_at_generation(rel), rel)
    shard_dir = rel.volume_dir / "shard-0001"
    dest = rel.pipe.new_dest("day2-recovery", 4)
    with LoadRun(rel.pipe, dest, seed=23, rate=50, min_delay_ms=2_000, max_delay_ms=10_000) as run:
        time.sleep(8)
        # A crash that loses the checkpoint: the owners stop (releasing the shard cleanly, so only
        # the lost file can cause duplicates), the file goes, the owners come back.
        _patch(rel, {"stages": {"enqueuePut": {"replicas": 0}, "dequeueGet": {"replicas": 0}}})
        _wait("the shard owners stopped", lambda: not _running(rel, "enqueue-put") and not _running(rel, "dequeue-get"),
              rel)
        lost_files = sorted(shard_dir.glob("dequeue*.ckpt"))
        assert lost_files, sorted(p.name for p in shard_dir.iterdir())
        for f in lost_files:
            f.unlink()
        corrupted = time.monotonic()
        _patch(rel, {"stages": {"enqueuePut": {"replicas": 1}, "dequeueGet": {"replicas": 1}}})
        seen: set[str] = set()

        def noting(ok: Callable[[], bool]) -> Callable[[], bool]:
            def check() -> bool:
                for kind in ("Degraded", "Recovering"):
                    c = _condition(rel, kind)
                    if c.get("status") == "True":
                        seen.add(f"{kind}/{c.get('reason')}")
                return ok()
            return check

        _wait("a recovery Job for shard 1", noting(
            lambda: any(j["metadata"]["labels"].get("timerwheel.io/shard") == "1" for j in _recovery_jobs(rel))), rel)
        job_seen = time.monotonic() - corrupted
        _wait("the recovery recorded as Succeeded in the status", noting(
            lambda: (_tw(rel)["status"]["shards"][1].get("recovery") or {}).get("state") == "Succeeded"), rel)
        assert "Recovering/RecoveryJob" in seen and "Degraded/ShardUnopenable" in seen, seen
        _wait("shard 1 served again and the TimerWheel Ready",
              lambda: _ready_at_generation(rel) and len(_shard_pods(rel, "reader")) == 1
              and not _tw(rel)["status"]["shards"][1].get("openError"), rel)
        to_ready = time.monotonic() - corrupted
        time.sleep(5)
        missing, rep = run.drain("k8s day-2 recovery", timeout_s=120)
    record = _tw(rel)["status"]["shards"][1]["recovery"]
    twice = int(record["report"]["may_deliver_twice"])
    (job,) = [j for j in _recovery_jobs(rel) if j["metadata"]["name"] == record["job"]]
    assert job["status"].get("succeeded") == 1, job["status"]
    assert record["report"]["dequeue_checkpoint"] == "rebuilt", record
    events = rel.get("events", "--field-selector", f"involvedObject.name={WHEEL}")["items"]
    reasons = {e["reason"] for e in events}
    assert {"RecoveryStarted", "RecoverySucceeded"} <= reasons, sorted(reasons)
    print(f"FIGURE recovery of a lost dequeue checkpoint under 50 msg/s: Job created {job_seen:.1f} s and the "
          f"TimerWheel Ready {to_ready:.1f} s after the file was lost (owners restarted meanwhile); recover took "
          f"{record['report'].get('seconds')} s, may_deliver_twice={twice}; {rep.line()}", flush=True)
    assert not missing and rep.lost == [] and rep.early == [], rep.line() + rel.diagnosis()
    assert rep.duplicated <= twice, f"{rep.duplicated} duplicates, the report allowed {twice}: {rep.line()}"
    assert rep.unexpected == [], rep.line()


def _owners_gone(rel: Release) -> bool:
    return not rel.pods("enqueue-put") and not rel.pods("dequeue-get")


def test_a_window_change_under_load_pauses_rebuilds_and_resumes_with_nothing_lost(installed: Release) -> None:
    """rollWindowMs doubled under 50 msg/s: the operator pauses the shard owners, a Job rebuilds
    every wheel (timerwheel rebuild-wheel --change-window), the stages roll with the new settings
    and the TimerWheel is Ready again; lost 0, early 0, duplicates within the bound."""
    rel = installed
    _patch(rel, _replicas(1, 1))  # whatever the test before left
    _wait("one pod per stage", lambda: all(_all_ready(rel, s, 1) for s in STAGES) and _ready_at_generation(rel), rel)
    old = int(_tw(rel)["spec"]["rollWindowMs"])
    new = 2 * old
    # Enough for the old window (1.5 x), too little for the new one: the operator raises it first.
    timer = ConfigResource(ConfigResourceType.TOPIC, rel.pipe.timer_topic, {"retention.ms": str(2 * old)})
    rel.pipe.admin.alter_configs([timer])
    dest = rel.pipe.new_dest("day2-window", 4)
    seen: set[str] = set()

    def noting(ok: Callable[[], bool]) -> Callable[[], bool]:
        def check() -> bool:
            c = _condition(rel, "WindowRolling")
            seen.add(f"{c.get('status')}/{c.get('reason')}")
            return ok()
        return check

    with LoadRun(rel.pipe, dest, seed=24, rate=50, min_delay_ms=2_000, max_delay_ms=10_000) as run:
        time.sleep(8)
        t0 = time.monotonic()
        _patch(rel, {"rollWindowMs": new})
        paused = _wait("the shard owners paused", noting(lambda: _owners_gone(rel)), rel)
        _wait("the rebuild Job done, the stages resumed", noting(
            lambda: (_tw(rel)["status"].get("window") or {}).get("phase") in ("Resuming", "Done")), rel, 300)
        resumed = time.monotonic() - t0
        _wait("the TimerWheel Ready at its generation with the new window", noting(
            lambda: _ready_at_generation(rel) and (_tw(rel)["status"].get("window") or {}).get("phase") == "Done"
            and len(_shard_pods(rel, "owner")) == 1 and len(_shard_pods(rel, "reader")) == 1), rel, 300)
        to_ready = time.monotonic() - t0
        time.sleep(5)
        missing, rep = run.drain("k8s day-2 window change", timeout_s=180)
    tw = _tw(rel)
    window = tw["status"]["window"]
    assert window["current"]["rollWindowMs"] == new and window["phase"] == "Done", window
    assert {"True/Pausing", "True/Rebuilding"} <= seen, seen
    settings = rel.get("configmap", f"timerwheel-{WHEEL}-settings")["data"]
    assert settings["TW_ROLL_WINDOW_MS"] == str(new), settings
    stored = json.loads((rel.volume_dir / "timerwheel.json").read_text())
    assert stored["roll_window_ms"] == new and stored["shards"] == 2, stored
    jobs = rel.get("jobs", "-l", f"app.kubernetes.io/instance={WHEEL},app.kubernetes.io/component=window")["items"]
    assert [j["status"].get("succeeded") for j in jobs if j["metadata"]["name"] == window["job"]] == [1], jobs
    reasons = {e["reason"] for e in rel.get("events", "--field-selector", f"involvedObject.name={WHEEL}")["items"]}
    assert {"WindowRolling", "WindowRebuilt", "WindowRolled"} <= reasons, sorted(reasons)
    retention = tw["status"].get("retention") or {}
    assert retention.get("state") in ("Raised", "Ok") and retention.get("neededMs") == new * 3 // 2, retention
    found = rel.pipe.admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, rel.pipe.timer_topic,
                                                            ["retention.ms"])], config_filter="all")
    assert int(found["topic"][rel.pipe.timer_topic]["retention.ms"]["value"]) >= new * 3 // 2, found
    report = window.get("report") or {}
    print(f"FIGURE window change (rollWindowMs {old} -> {new}) under 50 msg/s: owners gone {paused:.1f} s after the "
          f"change, resumed {resumed:.1f} s after it (status: owners paused {window.get('pausedSeconds')} s), "
          f"TimerWheel Ready {to_ready:.1f} s after it; rebuild {report.get('records')} records in "
          f"{report.get('seconds')} s ({report.get('recordsPerSecond')} records/s); timer topic retention "
          f"{retention.get('state')} {retention.get('retentionMs')} ms (needs {retention.get('neededMs')}); "
          f"{rep.line()}", flush=True)
    _check(rep, missing, rel)


def test_kubectl_scale_sets_both_delivery_stages(installed: Release) -> None:
    rel = installed
    # A stage's own replicas win over spec.deliveryReplicas: drop those the tests before set.
    _patch(rel, {"stages": {"dequeueGetmsg": {"replicas": None}, "dequeuePut": {"replicas": None}}})
    done = rel.kubectl("scale", f"timerwheel/{WHEEL}", "--replicas=2", check=False)
    assert done.returncode == 0, done.stderr
    took = _wait("two dequeue-getmsg and two dequeue-put pods ready, the TimerWheel Ready",
                 lambda: all(_all_ready(rel, s, 2) for s in ("dequeue-getmsg", "dequeue-put"))
                 and _ready_at_generation(rel), rel, 240)
    tw = _tw(rel)
    assert tw["spec"]["deliveryReplicas"] == 2 and tw["status"]["deliveryReplicas"] == 2, tw["status"]
    assert all(_all_ready(rel, s, 1) for s in ("enqueue-put", "dequeue-get")), "only the delivery stages scale"
    scale = json.loads(rel.kubectl("get", "--raw", f"/apis/timerwheel.io/v1alpha1/namespaces/{NAMESPACE}/"
                                   f"timerwheels/{WHEEL}/scale").stdout)
    assert scale["spec"]["replicas"] == 2 and scale["status"]["replicas"] == 2, scale
    print(f"FIGURE kubectl scale timerwheel --replicas=2: both delivery stages at 2 ready and the TimerWheel Ready "
          f"{took:.1f} s after it", flush=True)
    rel.kubectl("scale", f"timerwheel/{WHEEL}", "--replicas=1")
