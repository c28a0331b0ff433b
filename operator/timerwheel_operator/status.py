"""A TimerWheel's status from what is observed: the stage workloads and the stages' metrics.

Conditions follow Kubernetes' form (``metav1.Condition``): ``type``, ``status`` True / False /
Unknown, a CamelCase ``reason``, a ``message``, ``lastTransitionTime`` (moved only when the
status changes) and ``observedGeneration``.

- ``Ready``: every stage has its desired replicas ready and no shard lacks an owner.
- ``Progressing``: a stage workload is being created, rolled or scaled.
- ``Degraded``: the spec is invalid (``InvalidSpec``), the API server refused an object
  (``ApplyFailed``) or, with every stage rolled out, a shard has no enqueue-put or dequeue-get
  owner reporting it (``ShardUnowned``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from timerwheel_operator.crd import SHARD_OWNERS, STAGES
from timerwheel_operator.metrics import ShardStatus


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
            apply_failures: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The whole status (a merge patch of ``.status``) from what was observed."""
    waiting = [s for s in STAGES if not stages[s].rolled_out]
    unowned = []
    for st in shards:
        if stages["enqueue-put"].desired > 0 and st.owner is None:
            unowned.append(f"{st.shard} (no enqueue-put owner)")
        if stages["dequeue-get"].desired > 0 and st.reader is None:
            unowned.append(f"{st.shard} (no dequeue-get owner)")
    progressing = bool(waiting)
    degraded = bool(apply_failures) or (bool(unowned) and not any(s in waiting for s in SHARD_OWNERS))
    ready = not progressing and not degraded
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
    elif degraded:
        note = "; ".join(f"{pod}: {err}" for pod, err in sorted((scrape_errors or {}).items()))
        message = "shards without an owner: " + ", ".join(unowned) + (f"; metrics unread from {note}" if note else "")
        degrade = condition("Degraded", True, "ShardUnowned", message, generation, previous, now)
    else:
        degrade = condition("Degraded", False, "AsExpected", "every shard has its owners", generation, previous, now)
    if ready:
        ready_c = condition("Ready", True, "AllStagesReady", "every stage is ready and every shard owned",
                            generation, previous, now)
    else:
        ready_c = condition("Ready", False, "Degraded" if degraded else "Progressing",
                            degrade["message"] if degraded else progress["message"], generation, previous, now)
    lags = [s.lag_ms for s in shards if s.lag_ms is not None]
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "conditions": [ready_c, progress, degrade],
        "shards": [s.to_status() for s in shards],
        "stages": {s: {"desired": stages[s].desired, "replicas": stages[s].replicas,
                       "readyReplicas": stages[s].ready} for s in STAGES},
        "readyStages": f"{sum(1 for s in STAGES if stages[s].rolled_out)}/{len(STAGES)}",
    }
    if lags:
        status["maxLagMs"] = max(lags)
    return status
