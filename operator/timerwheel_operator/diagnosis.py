"""Why a TimerWheel's pods are not running, in Kubernetes' own words: what blocks its readiness
that no amount of waiting fixes, named so that a newcomer knows what to change.

From the TimerWheel's pods (the stages' and its Jobs') and its volume claim, in this order:

- ``ClaimPending``: the volume claim stayed ``Pending`` for ``GRACE_S`` (no volume offers its
  access modes, or its storage class does not exist or cannot provision). The message carries the
  claim's last warning Event (``ProvisioningFailed``: what the provisioner said) and what it asked.
- ``ImagePullFailed``: a container waits on its image (``ErrImagePull``, ``ImagePullBackOff``,
  ``InvalidImageName``, ``ErrImageNeverPull``): a tag no registry has, a registry the node cannot
  reach, a private one without ``imagePullSecrets``.
- ``CrashLooping``: a container restarts in back-off (``CrashLoopBackOff``, or started again after
  ``CRASHES`` failed runs and not ready yet), with its last exit code and its last log line (the
  stage containers end their log into the termination message).
- ``PodConfigError``: a container cannot be made (``CreateContainerConfigError``: a Secret or
  ConfigMap key it names is missing).
- ``Unschedulable``: a pod stayed unschedulable for ``GRACE_S`` (the scheduler's message: no node
  matches its nodeSelector, affinity or tolerations, or the volume's node is full).

A claim being provisioned or a pod waiting for a node is normal for seconds, hence the grace for
those two; the others are failures the moment Kubernetes reports them.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: How long a claim may stay Pending, or a pod unschedulable, before it counts as blocked.
GRACE_S = 30
PULL_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull", "RegistryUnavailable")
#: Restarts after which a container that is not ready and last failed counts as crash-looping
#: while it runs again (between back-offs).
CRASHES = 2
#: Reasons in the order their blocker names the TimerWheel's state.
ORDER = ("ClaimPending", "ImagePullFailed", "CrashLooping", "PodConfigError", "Unschedulable")


@dataclass(frozen=True, slots=True)
class Blocker:
    reason: str
    message: str


def _age_s(since: str | None, now: dt.datetime) -> float:
    if not since:
        return 0.0
    try:
        then = dt.datetime.strptime(since, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
    except ValueError:
        return 0.0
    return (now - then).total_seconds()


def claim_blocker(claim: Mapping[str, Any] | None, events: Sequence[Mapping[str, Any]], now: dt.datetime,
                  default_modes: Sequence[str]) -> Blocker | None:
    """The claim's blocker: Pending for GRACE_S, with its last warning Event's message."""
    if claim is None or (claim.get("status") or {}).get("phase") != "Pending":
        return None
    meta = claim.get("metadata") or {}
    if _age_s(str(meta.get("creationTimestamp") or ""), now) < GRACE_S:
        return None
    spec = claim.get("spec") or {}
    modes = ", ".join(spec.get("accessModes") or default_modes)
    klass = spec.get("storageClassName")
    warned = [e for e in events if e.get("type") == "Warning"]
    said = f"{warned[-1].get('reason')}: {warned[-1].get('message')}" if warned else "no volume bound to it yet"
    asked = f"{modes} from the storage class {klass!r}" if klass else f"{modes} from the cluster's default storage class"
    return Blocker("ClaimPending", f"volume claim {meta.get('name')} is Pending ({said}); it asks {asked}: "
                                   "set spec.storage (accessModes, storageClassName) to what the cluster offers, or "
                                   "existingClaim (docs/helm.md, Storage)"[:1000])


def _component(pod: Mapping[str, Any]) -> str:
    return str(((pod.get("metadata") or {}).get("labels") or {}).get("app.kubernetes.io/component") or "?")


def _restarting(status: Mapping[str, Any]) -> bool:
    """Between two back-offs of a crash loop (started again, not ready yet, the last run failed):
    still crash-looping, so the condition does not flap with every restart."""
    last = (status.get("lastState") or {}).get("terminated") or {}
    return (int(status.get("restartCount") or 0) >= CRASHES and not status.get("ready")
            and last.get("exitCode") not in (None, 0))


def pod_blockers(pod: Mapping[str, Any], now: dt.datetime) -> list[Blocker]:
    """What blocks one pod: its containers' waiting reasons, or the scheduler's refusal."""
    meta = pod.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return []
    who = f"{_component(pod)} pod {meta.get('name')}"
    status = pod.get("status") or {}
    out = []
    images = {c.get("name"): c.get("image") for c in (pod.get("spec") or {}).get("containers") or []}
    for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = str(waiting.get("reason") or "")
        message = str(waiting.get("message") or "").strip()
        if reason in PULL_REASONS:
            image = cs.get("image") or images.get(cs.get("name"))
            out.append(Blocker("ImagePullFailed", f"{who} cannot pull image {image} ({reason}"
                                                  f"{': ' + message if message else ''}); check image.repository, "
                                                  "image.tag and imagePullSecrets"))
        elif reason == "CrashLoopBackOff" or _restarting(cs):
            last = (cs.get("lastState") or {}).get("terminated") or {}
            lines = [x for x in str(last.get("message") or "").splitlines() if x.strip()]
            line = next((x for x in reversed(lines) if "error" in x.lower()), lines[-1] if lines else "")
            out.append(Blocker("CrashLooping", f"{who} keeps exiting (restarted {cs.get('restartCount', 0)} times, "
                                               f"last exit code {last.get('exitCode')}"
                                               f"{': ' + line.strip() if line else ''}); read `kubectl logs "
                                               f"{meta.get('name')} --previous`"))
        elif reason == "CreateContainerConfigError":
            out.append(Blocker("PodConfigError", f"{who} cannot start: {message or reason}"))
    for cond in status.get("conditions") or []:
        if (cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("reason") == "Unschedulable"
                and _age_s(str(cond.get("lastTransitionTime") or ""), now) >= GRACE_S):
            out.append(Blocker("Unschedulable", f"{who} cannot be scheduled: {cond.get('message') or 'no node fits'}"))
    return out


def diagnose(pods: Sequence[Mapping[str, Any]], claim: Mapping[str, Any] | None,
             claim_events: Sequence[Mapping[str, Any]], now: dt.datetime,
             default_modes: Sequence[str] = ("ReadWriteOnce",)) -> list[Blocker]:
    """Every blocker of a TimerWheel, the claim's first, each kind once per message, in ORDER."""
    found = [b for b in [claim_blocker(claim, claim_events, now, default_modes)] if b is not None]
    for pod in pods:
        found += pod_blockers(pod, now)
    unique = list(dict.fromkeys(found))
    return sorted(unique, key=lambda b: ORDER.index(b.reason))


def summary(blockers: Sequence[Blocker]) -> tuple[str, str] | None:
    """(reason, message) naming the first kind of blocker and every blocker's message; None: none."""
    if not blockers:
        return None
    return blockers[0].reason, "; ".join(b.message for b in blockers)[:2000]
