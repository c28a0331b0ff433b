"""Reconcile one TimerWheel: levels, not edges.

``ensure`` reads the spec and applies every manifest it implies (server-side apply: running it
again changes nothing, so kopf replaying an event or the timer calling it every interval is
safe). ``observe`` reads the stage workloads and scrapes the stages' ``/metrics`` into the
status. Neither raises on a bad spec or an unreachable pod: both end up in the status.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from timerwheel_operator import manifests
from timerwheel_operator.crd import SHARD_OWNERS, STAGES
from timerwheel_operator.kube import Cluster
from timerwheel_operator.metrics import MetricsParseError, Sample, parse_prometheus, shard_status
from timerwheel_operator.spec import HTTP_PORT, SpecError, Wheel, read, workload_name
from timerwheel_operator.status import (
    StageState,
    compute,
    invalid_spec_status,
    now_rfc3339,
    unobserved_status,
)


@dataclass(frozen=True, slots=True)
class Settings:
    """The operator's own settings (``main.settings_from_env``)."""

    image: str = "timerwheel:dev"
    pull_policy: str = "IfNotPresent"


@dataclass(frozen=True, slots=True)
class Applied:
    wheel: Wheel | None
    error: SpecError | None
    failures: dict[str, str]


def ensure(body: Mapping[str, Any], cluster: Cluster, settings: Settings) -> Applied:
    """Apply what the TimerWheel ``body`` implies. A bad spec applies nothing; an object the API
    server refuses is recorded in ``failures`` (kind/name -> reason) and the rest still applied."""
    try:
        wheel = read(body, settings.image, settings.pull_policy)
    except SpecError as exc:
        return Applied(None, exc, {})
    failures: dict[str, str] = {}
    for manifest in manifests.build_all(wheel, body):
        try:
            cluster.apply(manifest)
        except Exception as exc:  # an API refusal of one object must not stop the others
            reason = getattr(exc, "reason", None) or str(exc)
            failures[f"{manifest['kind']}/{manifest['metadata']['name']}"] = str(reason)[:300]
    return Applied(wheel, None, failures)


def _stage_states(wheel: Wheel, cluster: Cluster) -> dict[str, StageState]:
    out = {}
    for stage in STAGES:
        kind = "StatefulSet" if stage in SHARD_OWNERS else "Deployment"
        workload = cluster.get("apps/v1", kind, wheel.namespace, workload_name(wheel.name, stage))
        out[stage] = StageState.of(wheel.stage(stage).replicas, workload)
    return out


def scrape_all(wheel: Wheel, cluster: Cluster) -> tuple[dict[str, list[Sample]], dict[str, str]]:
    """``/metrics`` of every running pod of the shard-owning stages: (pod -> samples, pod -> error)."""
    samples: dict[str, list[Sample]] = {}
    errors: dict[str, str] = {}
    for stage in SHARD_OWNERS:
        for pod in cluster.pods(wheel.namespace, manifests.selector(wheel.name, stage)):
            name = str(pod.get("metadata", {}).get("name"))
            status = pod.get("status") or {}
            ip = status.get("podIP")
            if status.get("phase") != "Running" or not ip:
                continue
            try:
                samples[name] = parse_prometheus(cluster.scrape(ip, HTTP_PORT))
            except (OSError, MetricsParseError) as exc:
                errors[name] = str(exc)[:200]
    return samples, errors


def observe(body: Mapping[str, Any], applied: Applied, cluster: Cluster) -> dict[str, Any]:
    """The status to write (a merge patch of ``.status``)."""
    generation = int(body.get("metadata", {}).get("generation") or 0)
    previous = (body.get("status") or {}).get("conditions") or []
    now = now_rfc3339()
    if applied.error is not None or applied.wheel is None:
        return invalid_spec_status(generation, str(applied.error), previous, now)
    wheel = applied.wheel
    try:
        stages = _stage_states(wheel, cluster)
        samples, errors = scrape_all(wheel, cluster)
    except Exception as exc:  # the API server refused a read: say so, keep the last figures
        return unobserved_status(generation, f"cannot read the stage workloads or pods: {exc}"[:300], previous, now)
    shards = shard_status(samples, wheel.config.shards)
    return compute(generation, stages, shards, previous, now, errors, applied.failures)
