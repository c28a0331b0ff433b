"""The one Job state machine of the recovery and the window-change Jobs: a Job's phase from its
conditions, which finished Job the status has not recorded (read once, never twice), the newest
per key, the outcome read from its pod, the next serial, and a refused start said, not raised."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from test_reconcile import FakeCluster
from timerwheel_operator import jobs
from timerwheel_operator.jobs import JobView, Recorded


def job(name: str, serial: int, *conds: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {jobs.ATTEMPT: str(serial), **labels}},
            "status": {"conditions": [{"type": c, "status": "True"} for c in conds]}}


def test_the_phase_comes_from_the_job_s_conditions() -> None:
    assert jobs.phase(job("a", 1)) == jobs.RUNNING
    assert jobs.phase(job("a", 1, "SuccessCriteriaMet", "Complete")) == jobs.SUCCEEDED
    assert jobs.phase(job("a", 1, "FailureTarget", "Failed")) == jobs.FAILED
    assert jobs.view({"metadata": {"name": "not ours", "labels": {}}}) is None
    seen = jobs.view(job("x-window-4", 4, "Complete"))
    assert seen is not None and (seen.name, seen.serial, seen.phase, seen.running) == ("x-window-4", 4, "Succeeded",
                                                                                       False)


def test_a_finished_job_is_recorded_once() -> None:
    done = JobView("x-1", 1, jobs.FAILED)
    assert jobs.unrecorded(done, Recorded(1, running=True))  # the status says it runs: read its end
    assert not jobs.unrecorded(done, Recorded(1, running=False))  # recorded already: never again
    assert not jobs.unrecorded(JobView("x-1", 1, jobs.RUNNING), Recorded(1, running=True))  # not finished
    # started by a round whose status was never written: the status knows an older serial only
    assert jobs.unrecorded(done, Recorded(0, running=False))
    # a Job older than the status's (its own Job gone with its TTL) is not news
    assert not jobs.unrecorded(done, Recorded(2, running=True))


class Jobs(FakeCluster):
    def __init__(self, listed: list[dict[str, Any]], pods: Mapping[str, dict[str, Any]], logs: Mapping[str, str]) -> None:
        super().__init__()
        self.listed, self.job_pods, self.logs = listed, pods, logs

    def jobs(self, namespace: str, selector: Mapping[str, str]) -> list[dict[str, Any]]:
        return self.listed

    def pods(self, namespace: str, selector: Mapping[str, str]) -> list[dict[str, Any]]:
        found = self.job_pods.get(selector.get("job-name", ""))
        return [found] if found else []

    def pod_log(self, namespace: str, name: str) -> str:
        if name not in self.logs:
            raise OSError("the pod's log is gone")
        return self.logs[name]


def _pod(name: str, code: int, message: str = "") -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"containerStatuses": [
        {"state": {"terminated": {"exitCode": code, "message": message}}}]}}


def test_follow_finds_the_newest_per_key_and_reads_only_unrecorded_ends() -> None:
    listed = [job("r-0-1", 1, "Failed", shard="0"), job("r-0-2", 2, "Complete", shard="0"),
              job("r-1-1", 1, "Failed", shard="1"), job("r-2-3", 3, shard="2"), job("stray", 9)]
    cluster = Jobs(listed, {"r-0-2": _pod("r-0-2-p", 0), "r-1-1": _pod("r-1-1-p", 1, "last words")},
                   {"r-0-2-p": "{\n\"records\": 5\n}\n"})
    recorded = {0: Recorded(2, True), 1: Recorded(1, False), 2: Recorded(3, True)}
    found = jobs.follow(cluster, "ns", {}, lambda j: int(j.labels["shard"]) if "shard" in j.labels else None,
                        lambda k: recorded[k])
    assert {k: v.name for k, v in found.newest.items()} == {0: "r-0-2", 1: "r-1-1", 2: "r-2-3"}
    assert found.running  # shard 2's Job runs
    assert list(found.finished) == [0]  # shard 1's end is recorded already, shard 2's Job runs
    assert found.finished[0] == jobs.Outcome(0, "{\n\"records\": 5\n}\n", "r-0-2-p")
    assert jobs.reports(found.finished[0].log) == [{"records": 5}]
    # a log that is gone: the termination message stands in; no pod at all: nothing to read
    assert jobs.outcome(cluster, "ns", "r-1-1") == jobs.Outcome(1, "last words", "r-1-1-p")
    assert jobs.outcome(cluster, "ns", "r-9-9") == jobs.Outcome(None, "", None)


def test_the_next_serial_is_past_any_known_and_a_refused_start_is_said() -> None:
    assert jobs.next_serial(0, None) == 1
    assert jobs.next_serial(2, JobView("x-5", 5, jobs.FAILED)) == 6
    assert jobs.next_serial(7, JobView("x-5", 5, jobs.FAILED)) == 8
    refusing = FakeCluster(refuse={"Job"})
    assert jobs.start(refusing, {"kind": "Job", "metadata": {"name": "x-1"}}) == "Job is forbidden"
    assert jobs.start(FakeCluster(), {"kind": "Job", "metadata": {"name": "x-1"}}) is None
    assert jobs.error_line("a\ntimerwheel: error: boom\nb\n") == "timerwheel: error: boom"
    assert jobs.error_line("a\nlast\n") == "last"
