"""A TimerWheel's status from what is observed: the stage workloads and the stages' metrics.

Conditions follow Kubernetes' form (``metav1.Condition``): ``type``, ``status`` True / False /
Unknown, a CamelCase ``reason``, a ``message``, ``lastTransitionTime`` (moved only when the
status changes) and ``observedGeneration``.

- ``Ready``: every stage has its desired replicas ready and no shard lacks an owner.
- ``Progressing``: a stage workload is being created, rolled or scaled.
- ``Scaling``: a stage's replica count differs from the desired one (``ScalingUp`` /
  ``ScalingDown``, naming the stages and counts), until the workload has exactly the desired
  replicas, all ready.
- ``Recovering``: a recovery Job runs ``timerwheel recover`` on a shard (``RecoveryJob``, see
  ``recovery``); or, with every shard-owning stage rolled out, a shard has no enqueue-put or
  dequeue-get owner reporting it (``ShardsTakingOver``): its old owner let go or died and the
  next one is taking it (lease, recovery of the TimerLog). Normal for seconds after a scale, a
  rollout or a crash.
- ``Degraded``: the spec is invalid (``InvalidSpec``), the API server refused an object
  (``ApplyFailed``), Kubernetes cannot run the pods (``diagnosis``: ``ClaimPending``,
  ``ImagePullFailed``, ``CrashLooping``, ``PodConfigError``, ``Unschedulable``; ``Ready`` then
  names the same reason, and the operator posts it as a warning Event when ``Ready`` turns to
  it), an owner reports it cannot open a shard (``ShardUnopenable``: a torn
  checkpoint, a lost file, a failed recovery; the error's class, the pod's log has the rest)
  or a shard stayed without an owner for ``RECOVERY_GRACE_S`` (``ShardUnowned``:
  its owner cannot open it, or no replica runs); recovery Jobs failed ``maxAttempts`` times in a
  row on a shard still unopenable (``RecoveryFailed``, naming the shard and the Job's pod); a
  shard's W or R stopped advancing while it should (``ShardStalled``). In order of precedence:
  ApplyFailed, the diagnosis' reasons, RecoveryFailed, ShardStalled, ShardUnopenable, ShardUnowned.
- ``WindowRolling``: True while a change of tickMs, rollWindowMs or wheelSpanMs is rolled
  (``Pausing``, ``Rebuilding``, ``Resuming``; see ``window``), False otherwise (``AsSpec``,
  ``WindowRolled`` after one, ``WindowChangeRefused`` naming the setting, ``WindowRollFailed``;
  the last also makes the TimerWheel ``Degraded``). ``window.apply_to_status`` sets it over
  what ``compute`` says.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from timerwheel_operator.crd import DELIVERY_STAGES, SHARD_OWNERS, STAGES
from timerwheel_operator.diagnosis import Blocker, summary
from timerwheel_operator.recovery import Stall, stall_message
from timerwheel_operator.stage_metrics import ShardStatus

#: A shard without an owner this long after Recovering turned True is Degraded.
RECOVERY_GRACE_S = 60


@dataclass(slots=True)
class Care:
    """What the operator did and found about the shards this round (``reconcile.tend``)."""

    #: shard -> its ``recovery`` record
    recovery: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: shard -> (when W, when R last changed), operator's clock, ms
    advanced: dict[int, tuple[int | None, int | None]] = field(default_factory=dict)
    stalls: list[Stall] = field(default_factory=list)
    #: shard -> when its stalled owner pod was last deleted, ms
    restarted: dict[int, int] = field(default_factory=dict)

    def shard_fields(self, shard: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if shard in self.recovery:
            out["recovery"] = self.recovery[shard]
        w_since, r_since = self.advanced.get(shard, (None, None))
        if w_since is not None:
            out["wAdvancedMs"] = w_since
        if r_since is not None:
            out["rAdvancedMs"] = r_since
        if shard in self.restarted:
            out["restartedMs"] = self.restarted[shard]
        return out


@dataclass(frozen=True, slots=True)
class StageState:
    """One stage workload as observed (``exists`` False: not created yet)."""

    desired: int
    replicas: int = 0
    ready: int = 0
    updated: int = 0
    exists: bool = True
    current_generation: bool = True

    @classmethod
    def of(cls, desired: int, workload: Mapping[str, Any] | None) -> StageState:
        if workload is None:
            return cls(desired, exists=False)
        status = workload.get("status") or {}
        meta = workload.get("metadata") or {}
        return cls(
            desired=desired,
            replicas=int(status.get("replicas") or 0),
            ready=int(status.get("readyReplicas") or 0),
            updated=int(status.get("updatedReplicas") or 0),
            current_generation=int(status.get("observedGeneration") or 0) >= int(meta.get("generation") or 0),
        )

    @property
    def rolled_out(self) -> bool:
        return (self.exists and self.current_generation and self.ready >= self.desired
                and self.updated >= self.desired and self.replicas == self.desired)


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _seconds_between(earlier: str, later: str) -> float:
    fmt = "%Y-%m-%dT%H:%M:%SZ"
    return (dt.datetime.strptime(later, fmt) - dt.datetime.strptime(earlier, fmt)).total_seconds()


def window_condition(generation: int, previous: Sequence[Mapping[str, Any]], now: str) -> dict[str, Any]:
    """The default: no change of the window under way (``window`` says more when one is)."""
    return condition("WindowRolling", False, "AsSpec", "the shards run the spec's tickMs, rollWindowMs and "
                     "wheelSpanMs", generation, previous, now)


def scaling_condition(stages: Mapping[str, StageState], generation: int, previous: Sequence[Mapping[str, Any]],
                      now: str) -> dict[str, Any]:
    moving = [s for s in STAGES if stages[s].exists and (stages[s].replicas != stages[s].desired
                                                          or stages[s].ready < stages[s].desired)]
    if not moving:
        return condition("Scaling", False, "AtDesired", "every stage has its desired replicas", generation,
                         previous, now)
    up = any(stages[s].replicas < stages[s].desired or stages[s].ready < stages[s].desired for s in moving)
    text = ", ".join(f"{s} {stages[s].replicas} -> {stages[s].desired} ({stages[s].ready} ready)" for s in moving)
    return condition("Scaling", True, "ScalingUp" if up else "ScalingDown", text, generation, previous, now)


def condition(kind: str, ok: bool | None, reason: str, message: str, generation: int,
              previous: Sequence[Mapping[str, Any]], now: str) -> dict[str, Any]:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    before = next((c for c in previous if c.get("type") == kind), None)
    since = before.get("lastTransitionTime", now) if before and before.get("status") == status else now
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": since, "observedGeneration": generation}


def invalid_spec_status(generation: int, error: str, previous: Sequence[Mapping[str, Any]],
                        now: str) -> dict[str, Any]:
    return {
        "observedGeneration": generation,
        "conditions": [
            condition("Ready", False, "InvalidSpec", error, generation, previous, now),
            condition("Progressing", False, "InvalidSpec", "nothing is applied until the spec is fixed",
                      generation, previous, now),
            condition("Degraded", True, "InvalidSpec", error, generation, previous, now),
        ],
    }


def unobserved_status(generation: int, error: str, previous: Sequence[Mapping[str, Any]], now: str) -> dict[str, Any]:
    """What the operator could not read is Unknown, not False: the stages may be fine."""
    return {
        "observedGeneration": generation,
        "conditions": [condition(kind, None, "ObserveFailed", error, generation, previous, now)
                       for kind in ("Ready", "Progressing", "Degraded")],
    }


def compute(generation: int, stages: Mapping[str, StageState], shards: Sequence[ShardStatus],
            previous: Sequence[Mapping[str, Any]], now: str, scrape_errors: Mapping[str, str] | None = None,
            apply_failures: Mapping[str, str] | None = None, care: Care | None = None,
            blockers: Sequence[Blocker] = ()) -> dict[str, Any]:
    """The whole status (a merge patch of ``.status``) from what was observed; ``blockers``: what
    Kubernetes says stops the pods (``diagnosis.diagnose``)."""
    care = care or Care()
    blocked = summary(blockers)
    waiting = [s for s in STAGES if not stages[s].rolled_out]
    unowned = []
    for st in shards:
        if stages["enqueue-put"].desired > 0 and st.owner is None:
            unowned.append(f"{st.shard} (no enqueue-put owner)")
        if stages["dequeue-get"].desired > 0 and st.reader is None:
            unowned.append(f"{st.shard} (no dequeue-get owner)")
    progressing = bool(waiting)
    taking_over = bool(unowned) and not any(s in waiting for s in SHARD_OWNERS)
    note = "; ".join(f"{pod}: {err}" for pod, err in sorted((scrape_errors or {}).items()))
    jobs = [(n, r) for n, r in sorted(care.recovery.items()) if r.get("state") == "Running"]
    open_now = {st.shard for st in shards if st.open_errors}
    gave_up = [(n, r) for n, r in sorted(care.recovery.items()) if r.get("state") == "GaveUp" and n in open_now]
    if jobs:
        recovering = condition("Recovering", True, "RecoveryJob", "; ".join(
            f"shard {n}: Job {r.get('job')} runs timerwheel recover" for n, r in jobs), generation, previous, now)
    elif taking_over:
        recovering = condition("Recovering", True, "ShardsTakingOver", "shards without an owner: " + ", ".join(unowned)
                               + (f"; metrics unread from {note}" if note else ""), generation, previous, now)
    else:
        recovering = condition("Recovering", False, "AllShardsOwned", "every shard has its owners", generation,
                               previous, now)
    stuck = taking_over and _seconds_between(recovering["lastTransitionTime"], now) >= RECOVERY_GRACE_S
    unopenable = [f"shard {st.shard} ({'; '.join(st.open_errors)})" for st in shards if st.open_errors]
    degraded = (bool(apply_failures) or blocked is not None or stuck or bool(unopenable) or bool(gave_up)
                or bool(care.stalls))
    ready = not progressing and not degraded and not taking_over and not jobs
    if progressing:
        progress = condition("Progressing", True, "RollingOut", "waiting for " + ", ".join(
            f"{s} ({stages[s].ready}/{stages[s].desired} ready)" for s in waiting), generation, previous, now)
    else:
        progress = condition("Progressing", False, "RolledOut", "every stage has its replicas ready",
                             generation, previous, now)
    if apply_failures:
        failed = "; ".join(f"{k}: {v}" for k, v in sorted(apply_failures.items()))
        degrade = condition("Degraded", True, "ApplyFailed", f"the API server refused {failed}",
                            generation, previous, now)
    elif blocked is not None:
        degrade = condition("Degraded", True, *blocked, generation, previous, now)
    elif gave_up:
        degrade = condition("Degraded", True, "RecoveryFailed", "; ".join(
            f"shard {n}: timerwheel recover failed {r.get('attempts')} times, the last: {r.get('reason')}: "
            f"{r.get('message')} (read `kubectl logs {r.get('pod') or 'job/' + str(r.get('job'))}`; repair by hand "
            "as README 'Recovering a shard' says)" for n, r in gave_up), generation, previous, now)
    elif care.stalls:
        degrade = condition("Degraded", True, "ShardStalled", "stopped advancing while due: "
                            + stall_message(care.stalls), generation, previous, now)
    elif unopenable:
        degrade = condition("Degraded", True, "ShardUnopenable", "cannot be opened by its owner: " + ", ".join(
            unopenable) + " (see the pod's log: 'shard cannot be opened', or for RecoveryNeeded 'shard needs recovery' and "
            "the `timerwheel recover` command it names)", generation, previous, now)
    elif degraded:
        message = f"for {RECOVERY_GRACE_S} s or more, " + recovering["message"]
        degrade = condition("Degraded", True, "ShardUnowned", message, generation, previous, now)
    else:
        degrade = condition("Degraded", False, "AsExpected", "every shard has its owners", generation, previous, now)
    if ready:
        ready_c = condition("Ready", True, "AllStagesReady", "every stage is ready and every shard owned",
                            generation, previous, now)
    elif blocked is not None and not apply_failures:
        ready_c = condition("Ready", False, *blocked, generation, previous, now)
    elif degraded:
        ready_c = condition("Ready", False, "Degraded", degrade["message"], generation, previous, now)
    elif jobs:
        ready_c = condition("Ready", False, "Recovering", recovering["message"], generation, previous, now)
    elif progressing:
        ready_c = condition("Ready", False, "Progressing", progress["message"], generation, previous, now)
    else:
        ready_c = condition("Ready", False, "Recovering", recovering["message"], generation, previous, now)
    lags = [s.lag_ms for s in shards if s.lag_ms is not None]
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "conditions": [ready_c, progress, degrade, scaling_condition(stages, generation, previous, now), recovering,
                       window_condition(generation, previous, now)],
        "shards": [{**s.to_status(), **care.shard_fields(s.shard)} for s in shards],
        "stages": {s: {"desired": stages[s].desired, "replicas": stages[s].replicas,
                       "readyReplicas": stages[s].ready} for s in STAGES},
        "readyStages": f"{sum(1 for s in STAGES if stages[s].rolled_out)}/{len(STAGES)}",
    }
    if lags:
        status["maxLagMs"] = max(lags)
    status["deliveryReplicas"] = min(stages[s].replicas for s in DELIVERY_STAGES)
    return status
