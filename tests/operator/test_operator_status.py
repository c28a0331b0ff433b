"""Conditions in Kubernetes' form from what the operator observes."""

from __future__ import annotations

from typing import Any

from timerwheel_operator.crd import STAGES
from timerwheel_operator.stage_metrics import ShardStatus
from timerwheel_operator.status import StageState, compute, invalid_spec_status

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z"


def rolled(n: int = 1) -> StageState:
    return StageState(desired=n, replicas=n, ready=n, updated=n)


def all_rolled() -> dict[str, StageState]:
    return {s: rolled() for s in STAGES}


def owned(shard: int) -> ShardStatus:
    return ShardStatus(shard, owner="put-0", reader="get-0", epoch=1, lag_ms=30 + shard)


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_ready_when_every_stage_is_ready_and_every_shard_owned() -> None:
    status = compute(7, all_rolled(), [owned(0), owned(1)], [], T0)
    c = conditions(status)
    assert (c["Ready"]["status"], c["Progressing"]["status"], c["Degraded"]["status"]) == ("True", "False", "False")
    assert all(x["observedGeneration"] == 7 and x["lastTransitionTime"] == T0 and x["reason"] for x in c.values())
    assert status["observedGeneration"] == 7 and status["readyStages"] == "5/5" and status["maxLagMs"] == 31
    assert status["shards"][1]["owner"] == "put-0"
    assert status["stages"]["dequeue-put"] == {"desired": 1, "replicas": 1, "readyReplicas": 1}


def test_a_stage_rolling_out_is_progressing_not_ready() -> None:
    stages = all_rolled() | {"dequeue-put": StageState(desired=2, replicas=2, ready=1, updated=2)}
    c = conditions(compute(1, stages, [owned(0)], [], T0))
    assert c["Ready"]["status"] == "False" and c["Ready"]["reason"] == "Progressing"
    assert c["Progressing"]["status"] == "True" and "dequeue-put (1/2 ready)" in c["Progressing"]["message"]
    missing = all_rolled() | {"enqueue-get": StageState(desired=1, exists=False)}
    assert conditions(compute(1, missing, [owned(0)], [], T0))["Progressing"]["status"] == "True"


def test_an_unowned_shard_is_recovering_then_degraded_after_the_grace() -> None:
    first = compute(1, all_rolled(), [owned(0), ShardStatus(1)], [], T0, {"put-1": "timed out"})
    c = conditions(first)
    assert (c["Recovering"]["status"], c["Recovering"]["reason"]) == ("True", "ShardsTakingOver")
    assert "1 (no enqueue-put owner)" in c["Recovering"]["message"] and "put-1: timed out" in c["Recovering"]["message"]
    assert c["Degraded"]["status"] == "False" and c["Ready"]["status"] == "False"
    assert c["Ready"]["reason"] == "Recovering"
    # still unowned a minute later: Degraded, naming the shard
    later = conditions(compute(1, all_rolled(), [owned(0), ShardStatus(1)], first["conditions"], T1))
    assert (later["Degraded"]["status"], later["Degraded"]["reason"]) == ("True", "ShardUnowned")
    assert "1 (no enqueue-put owner)" in later["Degraded"]["message"]
    assert later["Recovering"]["lastTransitionTime"] == T0
    # while an owner is still starting, that is progress, not recovery
    starting = all_rolled() | {"enqueue-put": StageState(desired=1, replicas=1, ready=0, updated=1)}
    c = conditions(compute(1, starting, [ShardStatus(0)], [], T0))
    assert (c["Degraded"]["status"], c["Recovering"]["status"]) == ("False", "False")


def test_a_shard_its_owner_cannot_open_is_degraded_at_once_naming_it() -> None:
    broken = ShardStatus(1, open_errors=["enqueue-put put-1: OSError"])
    c = conditions(compute(1, all_rolled(), [owned(0), broken], [], T0))
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "ShardUnopenable")
    assert "shard 1 (enqueue-put put-1: OSError)" in c["Degraded"]["message"]
    assert c["Ready"]["status"] == "False"


def test_scaling_names_the_stages_until_they_have_their_replicas() -> None:
    stages = all_rolled() | {"dequeue-put": StageState(desired=3, replicas=1, ready=1, updated=1),
                             "enqueue-put": StageState(desired=1, replicas=2, ready=2, updated=2)}
    c = conditions(compute(4, stages, [owned(0)], [], T0))
    assert (c["Scaling"]["status"], c["Scaling"]["reason"]) == ("True", "ScalingUp")
    assert "dequeue-put 1 -> 3 (1 ready)" in c["Scaling"]["message"] and "enqueue-put 2 -> 1" in c["Scaling"]["message"]
    down = all_rolled() | {"dequeue-put": StageState(desired=1, replicas=3, ready=3, updated=3)}
    assert conditions(compute(4, down, [owned(0)], [], T0))["Scaling"]["reason"] == "ScalingDown"
    done = conditions(compute(4, all_rolled(), [owned(0)], [], T0))
    assert (done["Scaling"]["status"], done["Scaling"]["observedGeneration"]) == ("False", 4)


def test_no_window_change_under_way_is_reported_as_spec() -> None:
    c = conditions(compute(1, all_rolled(), [owned(0)], [], T0))
    assert (c["WindowRolling"]["status"], c["WindowRolling"]["reason"]) == ("False", "AsSpec")


def test_a_refused_object_is_degraded() -> None:
    c = conditions(compute(1, all_rolled(), [owned(0)], [], T0, None, {"PersistentVolumeClaim/x": "Forbidden"}))
    assert c["Degraded"]["reason"] == "ApplyFailed" and "PersistentVolumeClaim/x: Forbidden" in c["Degraded"]["message"]
    assert c["Ready"]["status"] == "False"


def test_the_transition_time_moves_only_when_the_status_changes() -> None:
    first = compute(1, all_rolled(), [owned(0)], [], T0)["conditions"]
    again = conditions(compute(2, all_rolled(), [owned(0)], first, T1))
    assert again["Ready"]["lastTransitionTime"] == T0 and again["Ready"]["observedGeneration"] == 2
    stages = all_rolled() | {"dequeue-get": StageState(desired=1, exists=False)}
    changed = conditions(compute(2, stages, [owned(0)], first, T1))
    assert changed["Ready"]["lastTransitionTime"] == T1 and changed["Degraded"]["lastTransitionTime"] == T0


def test_an_invalid_spec_says_so_in_every_condition() -> None:
    c = conditions(invalid_spec_status(4, "spec.tickMs: must be one of ...", [], T0))
    assert c["Ready"]["status"] == "False" and c["Degraded"]["status"] == "True"
    assert all(x["reason"] == "InvalidSpec" and x["observedGeneration"] == 4 for x in c.values())
    assert c["Degraded"]["message"].startswith("spec.tickMs")
