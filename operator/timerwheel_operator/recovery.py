"""Checkpoint recovery and stall detection: the operator does what a human on call would.

**Recovery.** An owner that finds a shard's state needs ``timerwheel recover`` (a lost or unreadable
checkpoint) leaves it unstarted and reports ``shard_open_failed{error="RecoveryNeeded"}``. The
operator then runs a Job (``recovery_job``: same image, volume claim, ``TW_*`` ConfigMap and pod
defaults as the stages) running ``timerwheel recover --shard N``, records the outcome (the JSON
report from the pod's log, else the exit code) in ``status.shards[].recovery`` and as an Event.
The owner is not stopped: it already looks at a refused shard again every 2 s and starts it once
repaired, and it cannot race the tool. enqueue-put releases the shard's lease while it refuses
(``recover`` refuses with exit 3 while any lease is held) and cannot open it while ``recover``
holds the shard's writer lock; dequeue-get starts only once ``recovery_needed`` says the
checkpoints are readable, and ``recover`` writes the dequeue checkpoint last, after the wheel is
durable. Only errors ``recover`` repairs start a Job; other open errors stay ``ShardUnopenable``.

The Job goes through the operator's one Job state machine (``jobs``: followed while it runs, its
outcome read once when it ends, the next serial); this module decides what to do about it.
One recovery Job per TimerWheel at a time (so one per shard): ``recover`` takes the data
directory's lock, so a second Job beside it would fail with exit 3. A failed Job is not retried
at once: attempt n+1 waits ``BACKOFF_S * 2**(n-1)``; after ``spec.recovery.maxAttempts`` failures
in a row the TimerWheel is ``Degraded`` (``RecoveryFailed``) naming the shard and the Job's pod
log, and no Job runs for that shard until it opens again (a human ran ``recover``). After a Job
succeeded, none is started for the shard for ``SETTLE_S``: its owners need a moment to start it.

**Stalls.** A shard whose ``W`` or ``R`` stops moving while it should move is stalled
(``stalled``): ``W`` unchanged for ``stallAfterMs`` while ``now - W`` exceeds it and W is not
held back by ``R`` at the wheel's cap (then R is the one stuck); ``R`` unchanged for as long while
``now - R`` exceeds it, R is below W's slot (not waiting for W), messages are pending or in
flight, and the downstream stages have ready replicas (else they are what is stuck). The time of
the last change of each is kept in the status (``wAdvancedMs``, ``rAdvancedMs``), so a restarted
operator keeps counting. A stalled shard makes the TimerWheel ``Degraded`` (``ShardStalled``)
and its owner pod is deleted (restarted), at most once per ``stallAfterMs``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from timerwheel_operator.jobs import (
    FAILED,
    RUNNING,
    SUCCEEDED,
    JobView,
    Outcome,
    Recorded,
    error_line,
    next_serial,
    reports,
)
from timerwheel_operator.stage_metrics import ShardStatus

#: The label of a recovery Job naming the shard it repairs.
SHARD_LABEL = "timerwheel.io/shard"
#: The ``shard_open_failed`` error class that ``timerwheel recover`` repairs.
RECOVERY_NEEDED = "RecoveryNeeded"
#: Exit codes of ``timerwheel recover`` (timerwheel.store.repair, timerwheel.cli).
EXIT_MEANING = {0: "Repaired", 1: "RepairFailed", 2: "BadArgument", 3: "ShardInUse"}
BACKOFF_S = 15
SETTLE_S = 30
DEFAULT_MAX_ATTEMPTS = 3
DEFAULT_STALL_AFTER_MS = 60_000
#: A stall is never declared sooner than this: several ticks, the 1 s idle W publication and two
#: operator rounds (10 s each) must fit in it.
MIN_STALL_AFTER_MS = 30_000
#: The report's keys kept in the status (the whole report is in the Job's pod log).
REPORT_KEYS = ("status", "enqueue_checkpoint", "dequeue_checkpoint", "set_aside", "read_ms", "write_ms",
               "records", "truncated_bytes", "relinked", "repaired_slots", "may_deliver_twice", "seconds")


@dataclass(frozen=True, slots=True)
class RecoveryPolicy:
    """``spec.recovery``."""

    auto: bool = True
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    stall_after_ms: int = DEFAULT_STALL_AFTER_MS
    restart_stalled: bool = True

    @classmethod
    def of(cls, spec: Mapping[str, Any], tick_ms: int) -> RecoveryPolicy:
        own = spec.get("recovery") or {}
        stall = max(int(own.get("stallAfterMs", DEFAULT_STALL_AFTER_MS)), MIN_STALL_AFTER_MS, 10 * tick_ms + 1_000)
        return cls(bool(own.get("auto", True)), max(1, int(own.get("maxAttempts", DEFAULT_MAX_ATTEMPTS))), stall,
                   bool(own.get("restartStalled", True)))


def shard_of(job: JobView) -> int | None:
    """The shard a recovery Job repairs (its label); None for a Job without one."""
    try:
        return int(job.labels[SHARD_LABEL])
    except (KeyError, ValueError):
        return None


def recorded(record: Mapping[str, Any] | None) -> Recorded:
    """What a shard's ``recovery`` record says of its Jobs, for ``jobs.follow``."""
    record = record or {}
    return Recorded(int(record.get("serial") or 0), record.get("state") == RUNNING)


def result(job: JobView, outcome: Outcome) -> dict[str, Any]:
    """The ``recovery`` record of a finished Job: its report (the JSON ``timerwheel recover``
    prints) when it succeeded, else the reason its exit code means and its error line."""
    record: dict[str, Any] = {"job": job.name, "state": job.phase}
    if outcome.pod:
        record["pod"] = outcome.pod
    if outcome.exit_code is not None:
        record["exitCode"] = outcome.exit_code
    found = reports(outcome.log) if job.phase == SUCCEEDED else []
    report = found[-1] if found else None
    if report is not None:
        record["report"] = {k: report[k] for k in REPORT_KEYS if k in report}
        record["reason"] = "Repaired" if report.get("status") == "repaired" else "Consistent"
        record["message"] = (f"timerwheel recover: {report.get('status')}, dequeue checkpoint "
                             f"{report.get('dequeue_checkpoint')}, may deliver {report.get('may_deliver_twice', 0)} "
                             "messages twice")
    elif job.phase == SUCCEEDED:
        record["reason"], record["message"] = "Repaired", "the Job succeeded; no report in its log"
    else:
        code = outcome.exit_code
        record["reason"] = EXIT_MEANING.get(code, "JobFailed") if code is not None else "JobFailed"
        record["message"] = error_line(outcome.log) or "the Job failed without a log (deadline, or the pod was deleted)"
    return record


def needs_recovery(st: ShardStatus) -> bool:
    return any(err.endswith(": " + RECOVERY_NEEDED) for err in st.open_errors)


@dataclass(frozen=True, slots=True)
class RecoveryStep:
    """What to do about one shard's recovery this round."""

    start_job: bool = False
    #: the shard's ``recovery`` record to keep in the status (None: none)
    record: Mapping[str, Any] | None = None
    #: an Event: (reason, message, warning)
    event: tuple[str, str, bool] | None = None


def decide(st: ShardStatus, previous: Mapping[str, Any] | None, newest: JobView | None, finished: Outcome | None,
           policy: RecoveryPolicy, other_job_running: bool, now_ms: int) -> RecoveryStep:
    """The recovery step of shard ``st``: ``previous`` its last record, ``newest`` its newest Job,
    ``finished`` that Job's outcome when it has finished unrecorded (``jobs.follow``)."""
    prev = dict(previous or {})
    attempts = int(prev.get("attempts", 0))
    if newest is not None and newest.running:
        record = {**prev, "job": newest.name, "serial": max(int(prev.get("serial") or 0), newest.serial),
                  "state": RUNNING, "reason": "RecoveryJob",
                  "message": f"Job {newest.name} runs timerwheel recover --shard {st.shard}"}
        record.setdefault("startedMs", now_ms)
        return RecoveryStep(record=record)
    if newest is not None and finished is not None:
        done = result(newest, finished)
        ok = done["state"] == SUCCEEDED
        attempts = 0 if ok else attempts + 1
        record = {**{k: v for k, v in prev.items() if k == "startedMs"}, **done,
                  "serial": max(int(prev.get("serial") or 0), newest.serial), "attempts": attempts,
                  "finishedMs": now_ms}
        if not ok and attempts >= policy.max_attempts:
            record["state"] = "GaveUp"
        reason = "RecoverySucceeded" if ok else "RecoveryFailed"
        text = f"shard {st.shard}: {done['message']} (Job {newest.name}"
        text += ")" if ok else (f", attempt {attempts} of {policy.max_attempts}; read `kubectl logs "
                                f"{done.get('pod') or 'job/' + newest.name}`)")
        return RecoveryStep(record=record, event=(reason, text, not ok))
    state = prev.get("state")
    if not needs_recovery(st) or not policy.auto:
        if state == "GaveUp" and st.owner is not None and not st.open_errors:
            # someone repaired it by hand: the next incident starts counting afresh
            prev.update(state="Resolved", attempts=0, reason="OpenedByOwner",
                        message="the shard's owners opened it after the failed attempts")
        return RecoveryStep(record=prev or None)
    last = int(prev.get("finishedMs", 0))
    if state == "GaveUp":
        return RecoveryStep(record=prev)
    if state == SUCCEEDED and now_ms - last < SETTLE_S * 1000:
        return RecoveryStep(record=prev)  # its owners start it within seconds; give them that time
    if state == FAILED and now_ms - last < BACKOFF_S * 1000 * 2 ** max(0, attempts - 1):
        return RecoveryStep(record=prev)
    if other_job_running:
        return RecoveryStep(record=prev or None)
    serial = next_serial(int(prev.get("serial", 0)), newest)
    record = {"attempts": attempts, "serial": serial, "state": "Starting", "reason": "RecoveryJob",
              "message": f"starting timerwheel recover --shard {st.shard} (attempt {attempts + 1} of "
                         f"{policy.max_attempts})", "startedMs": now_ms}
    return RecoveryStep(start_job=True, record=record,
                        event=("RecoveryStarted", f"shard {st.shard}: {', '.join(st.open_errors)}; running timerwheel "
                               f"recover --shard {st.shard} (attempt {attempts + 1} of {policy.max_attempts})", False))


@dataclass(frozen=True, slots=True)
class Stall:
    shard: int
    #: "W" (enqueue-put's) or "R" (dequeue-get's)
    which: str
    pod: str
    still_ms: int


def advanced(previous: Mapping[str, Any] | None, key: str, value: int | None, now_ms: int) -> int | None:
    """When ``value`` (the shard's W or R) was last seen to change: now if it differs from the
    previous status's, else the previous time; None while nobody reports it."""
    if value is None:
        return None
    prev = previous or {}
    since = prev.get(f"{key.lower()}AdvancedMs")
    if prev.get(key) != value or since is None:
        return now_ms
    return int(since)


def stalled(st: ShardStatus, w_since: int | None, r_since: int | None, policy: RecoveryPolicy, now_ms: int,
            cap_ms: int, tick_ms: int, downstream_ready: bool) -> list[Stall]:
    """The stalls of one shard (see the module header); ``cap_ms``: how far W may run ahead of R."""
    limit = policy.stall_after_ms
    out = []
    # W waiting for its input (``inputWaitMs``) is not the owner's stall: restarting it would not help.
    if (st.write_ms is not None and w_since is not None and st.owner is not None and now_ms - w_since >= limit
            and now_ms - st.write_ms >= limit and not st.input_wait_ms
            and not (st.read_ms is not None and st.write_ms >= st.read_ms + cap_ms - 2 * tick_ms)):
        out.append(Stall(st.shard, "W", st.owner, now_ms - w_since))
    if (st.read_ms is not None and r_since is not None and st.reader is not None and now_ms - r_since >= limit
            and now_ms - st.read_ms >= limit and downstream_ready
            and st.write_ms is not None and st.read_ms < st.write_ms - st.write_ms % tick_ms
            and ((st.pending or 0) > 0 or (st.in_flight or 0) > 0)):
        out.append(Stall(st.shard, "R", st.reader, now_ms - r_since))
    return out


def stall_message(stalls: Sequence[Stall]) -> str:
    return ", ".join(f"shard {s.shard} ({s.which} unchanged for {s.still_ms // 1000} s, owner {s.pod})" for s in stalls)
