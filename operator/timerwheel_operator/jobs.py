"""The operator's Jobs, one state machine for both kinds: a shard's recovery Job (``recovery``,
``timerwheel recover --shard N``) and the window-change Job (``window``, ``timerwheel rebuild-wheel
--change-window`` of every shard).

A Job is one pod that Kubernetes never retries (``backoffLimit: 0``): the operator decides about
another attempt. Its name ends in a serial, also its label ``timerwheel.io/attempt``, and the
status keeps the serial of the last Job the operator started and whether it runs. From those two
levels alone, the Job as it is and the record of it, each round finds where a kind's Job stands:

    none --start--> Running --(Kubernetes)--> Succeeded | Failed --recorded--> done
                                                  the outcome: exit code, log

- **Running**: the newest Job runs. Follow it; start nothing (whatever the status says: a
  restarted operator finds a Job its predecessor started but never recorded).
- **Finished, not recorded** (``unrecorded``): the newest Job ended and the status still says it
  runs, or knows only older serials (the round that started it never wrote its status). Its
  outcome (``outcome``: the pod's exit code and log, the termination message standing in for a log
  that is gone) is read once and recorded by the kind's ``decide``.
- **Otherwise**: nothing runs and nothing is new. The kind decides whether to start the next Job
  (``next_serial``) and ``start`` applies it.

``follow`` does the reading for one kind in one round, per key (the shard; a single key for the
window). A Job writes its findings as indented JSON reports in its log (``reports``), and a failed
one its reason as ``timerwheel: error: ...`` (``error_line``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from timerwheel_operator.kube import Cluster

RUNNING, SUCCEEDED, FAILED = "Running", "Succeeded", "Failed"
#: The label holding a Job's serial (also the last part of its name).
ATTEMPT = "timerwheel.io/attempt"

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class JobView:
    """One of our Jobs as observed: ``phase`` Running, Succeeded or Failed."""

    name: str
    serial: int
    phase: str
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)

    @property
    def running(self) -> bool:
        return self.phase == RUNNING


def phase(job: Mapping[str, Any]) -> str:
    """Running, Succeeded or Failed, from the Job's conditions."""
    out = RUNNING
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("status") == "True" and cond.get("type") in ("Complete", "SuccessCriteriaMet"):
            out = SUCCEEDED
        elif cond.get("status") == "True" and cond.get("type") in ("Failed", "FailureTarget"):
            out = FAILED
    return out


def view(job: Mapping[str, Any]) -> JobView | None:
    """The Job as the state machine sees it; None for a Job without a readable serial."""
    meta = job.get("metadata") or {}
    labels = dict(meta.get("labels") or {})
    try:
        serial = int(labels[ATTEMPT])
    except (KeyError, ValueError):
        return None
    return JobView(str(meta.get("name")), serial, phase(job), labels, dict(meta.get("annotations") or {}))


@dataclass(frozen=True, slots=True)
class Recorded:
    """What the status keeps of a kind's Jobs (of one key): the serial of the last one the
    operator started, and whether the status says that one runs."""

    serial: int = 0
    running: bool = False


def unrecorded(job: JobView, recorded: Recorded) -> bool:
    """A finished Job whose end the status has not recorded: one it says runs, or one newer than
    any it knows of."""
    return not job.running and (job.serial > recorded.serial or (job.serial == recorded.serial and recorded.running))


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a finished Job ended: its pod's exit code (None: it never ran, or is gone), its log (the
    termination message when the log cannot be read) and the pod's name."""

    exit_code: int | None
    log: str
    pod: str | None


def outcome(cluster: Cluster, namespace: str, job_name: str) -> Outcome:
    """The outcome of the finished Job ``job_name``, read from its pod."""
    pods = cluster.pods(namespace, {"job-name": job_name})
    pod = pods[-1] if pods else None
    exit_code, message = None, ""
    for cs in ((pod or {}).get("status") or {}).get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or {}
        if term.get("exitCode") is not None:
            exit_code, message = int(term["exitCode"]), str(term.get("message") or "")
    if pod is None:
        return Outcome(exit_code, message, None)
    name = str(pod["metadata"]["name"])
    try:
        return Outcome(exit_code, cluster.pod_log(namespace, name), name)
    except Exception:  # noqa: BLE001 - the log may be gone: the termination message stands in
        return Outcome(exit_code, message, name)


@dataclass(slots=True)
class Found(Generic[K]):
    """One kind's Jobs as one round found them: per key the newest Job, and the outcome of each
    newest Job that finished unrecorded."""

    newest: dict[K, JobView] = field(default_factory=dict)
    finished: dict[K, Outcome] = field(default_factory=dict)

    @property
    def running(self) -> bool:
        return any(j.running for j in self.newest.values())


def follow(cluster: Cluster, namespace: str, selector: Mapping[str, str], key: Callable[[JobView], K | None],
           recorded: Callable[[K], Recorded]) -> Found[K]:
    """Read the Jobs of ``selector``: the newest per ``key`` (Jobs it gives None are not ours to
    follow) and the outcomes to record (``recorded``: the status's record of a key). Raises what
    listing the Jobs raises: no Job starts blind."""
    found: Found[K] = Found()
    for job in cluster.jobs(namespace, selector):
        seen = view(job)
        k = None if seen is None else key(seen)
        if seen is not None and k is not None and (k not in found.newest or seen.serial > found.newest[k].serial):
            found.newest[k] = seen
    for k, job_view in found.newest.items():
        if unrecorded(job_view, recorded(k)):
            found.finished[k] = outcome(cluster, namespace, job_view.name)
    return found


def next_serial(recorded_serial: int, newest: JobView | None) -> int:
    """The serial of the next Job: past any the status or the cluster knows."""
    return max(recorded_serial, newest.serial if newest else 0) + 1


def start(cluster: Cluster, manifest: Mapping[str, Any]) -> str | None:
    """Apply a Job: None once applied, else why the API server refused it (RBAC, quota), to be
    said in Degraded and tried again next round."""
    try:
        cluster.apply(manifest)
    except Exception as exc:  # noqa: BLE001 - a refusal is reported, never raised
        return str(getattr(exc, "reason", None) or exc)[:300]
    return None


def reports(log: str) -> list[dict[str, Any]]:
    """Every indented JSON report (a line ``{`` to a line ``}``) the Job's pod printed, among
    one-line JSON log records."""
    out, block = [], None
    for line in log.splitlines():
        if line == "{":
            block = [line]
        elif block is not None:
            block.append(line)
            if line == "}":
                try:
                    found = json.loads("\n".join(block))
                except json.JSONDecodeError:
                    found = None
                if isinstance(found, dict):
                    out.append(found)
                block = None
    return out


def error_line(log: str) -> str:
    """The ``timerwheel: error: ...`` line of a failed run, else the log's last line."""
    lines = [x for x in log.splitlines() if x.strip()]
    return next((x for x in reversed(lines) if x.startswith("timerwheel: error:")), lines[-1] if lines else "")[:300]
