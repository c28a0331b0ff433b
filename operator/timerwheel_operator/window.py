"""A change of ``tickMs``, ``rollWindowMs`` or ``wheelSpanMs``: pause, rebuild, resume.

Every shard's wheel and the data directory's deployment file were made with the window; a stage
started with another refuses. So the operator changes it as a human would, one level at a time
(each round compares what is with what the spec asks; nothing depends on having seen an edge):

1. **Check.** The timer topic must keep records 1.5 x the new roll window (``retention``): raised
   by the operator with ``spec.kafka.manageRetention``, else the change is refused
   (``WindowChangeRefused`` naming ``retention.ms``, the value found and the value needed) and the
   old window keeps running: the ConfigMap keeps the old ``TW_*`` values, the stages run on.
2. **Pause** (``Pausing``): enqueue-put and dequeue-get go to 0 replicas with the old settings;
   they hand their shards over on SIGTERM (their last checkpoint written, leases released). The
   other stages keep running: what is in flight is delivered, new timer records wait in Kafka.
3. **Rebuild** (``Rebuilding``), once no owner pod is left: a Job (the stages' image, volume claim
   and settings, the new window in its env) runs ``timerwheel rebuild-wheel --shard N
   --change-window`` for every shard, then stores the window in the deployment file. Its name
   carries a serial and its annotation the window it builds, so a restarted operator finds it
   (the operator's one Job state machine, ``jobs``, follows it as it does the recovery Jobs).
4. **Resume** (``Resuming``): the ConfigMap gets the new values, which rolls every stage (the
   settings hash), and the owners come back to their replicas. ``WindowRolling`` turns False
   (``WindowRolled``) once the TimerWheel is Ready, with the figures in ``status.window``.

A Job whose checks refuse the new window (``rebuild-wheel --change-window --check`` of every shard
runs before any shard changes: a span too small for the records ahead) changed nothing: the
owners come back with the old window and the change is refused (``WindowChangeRefused`` naming
``spec.wheelSpanMs``) until the spec changes again. Any other failed Job (exit 3, a shard still
owned: tried again; anything else) leaves the stages
paused, ``Degraded`` with reason ``WindowRollFailed`` and the Job's last log line: no stage may run
on a wheel whose window it does not know. Which window the shards have is then unknown, so any
later spec (the new window, or the old one back) is rebuilt again by a new Job once the spec's
generation changes. The state lives in ``status.window`` (``current``: the window the shards were
built with; ``target``, ``phase``, the Job, the times) and in the Jobs themselves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from timerwheel_operator import retention as ret
from timerwheel_operator.jobs import (
    RUNNING,
    SUCCEEDED,
    JobView,
    Outcome,
    Recorded,
    error_line,
    next_serial,
    reports,
)
from timerwheel_operator.spec import in_spec_words

#: The component label of the window Jobs and their pods.
COMPONENT = "window"
#: Job exit code of a shard still owned by a live process (timerwheel.cli.EXIT_IN_USE): tried again.
EXIT_IN_USE = 3
#: Job exit code when ``rebuild-wheel --change-window --check`` refused a shard (exit 2, e.g. a span
#: too small for the records ahead): every shard is checked before any is changed, so the old
#: window runs on and the change is refused, naming the field (``manifests.window_job``).
EXIT_REFUSED_UNCHANGED = 12
MAX_IN_USE_RETRIES = 5
#: The spec fields of the window, with their TW_* variable.
FIELDS = {"tickMs": "TW_TICK_MS", "rollWindowMs": "TW_ROLL_WINDOW_MS", "wheelSpanMs": "TW_WHEEL_SPAN_MS"}
ROLLING = ("Pausing", "Rebuilding", "Resuming")


@dataclass(frozen=True, slots=True)
class Window:
    tick_ms: int
    roll_window_ms: int
    #: as given: 0 means twice the roll window
    wheel_span_ms: int

    @property
    def span(self) -> int:
        return self.wheel_span_ms or 2 * self.roll_window_ms

    def same(self, other: Window | None) -> bool:
        return other is not None and (self.tick_ms, self.roll_window_ms, self.span) == (
            other.tick_ms, other.roll_window_ms, other.span)

    def to_spec(self) -> dict[str, int]:
        return {"tickMs": self.tick_ms, "rollWindowMs": self.roll_window_ms, "wheelSpanMs": self.wheel_span_ms}

    def env(self) -> dict[str, str]:
        return {var: str(v) for var, v in zip(FIELDS.values(), self.to_spec().values(), strict=True)}

    def text(self) -> str:
        return f"tickMs {self.tick_ms}, rollWindowMs {self.roll_window_ms}, wheelSpanMs {self.span}"

    def annotation(self) -> str:
        return f"{self.tick_ms}/{self.roll_window_ms}/{self.wheel_span_ms}"

    @classmethod
    def of_annotation(cls, text: str | None) -> Window | None:
        try:
            tick, roll, span = (int(x) for x in str(text).split("/"))
        except ValueError:
            return None
        return cls(tick, roll, span)

    @classmethod
    def of_spec(cls, spec: Mapping[str, Any] | None) -> Window | None:
        if not spec:
            return None
        try:
            return cls(int(spec["tickMs"]), int(spec["rollWindowMs"]), int(spec.get("wheelSpanMs") or 0))
        except (KeyError, TypeError, ValueError):
            return None

    @classmethod
    def of_env(cls, env: Mapping[str, Any] | None) -> Window | None:
        if not env:
            return None
        try:
            return cls(int(env["TW_TICK_MS"]), int(env["TW_ROLL_WINDOW_MS"]), int(env.get("TW_WHEEL_SPAN_MS") or 0))
        except (KeyError, TypeError, ValueError):
            return None


#: The annotation of a window Job naming the window it builds (``Window.annotation``).
WINDOW_ANNOTATION = "timerwheel.io/window"


def target_of(job: JobView) -> Window | None:
    """The window a window Job builds (its annotation); None for a Job without one."""
    return Window.of_annotation(job.annotations.get(WINDOW_ANNOTATION))


def recorded(status: Mapping[str, Any] | None) -> Recorded:
    """What ``status.window`` says of the window Jobs, for ``jobs.follow``."""
    status = status or {}
    return Recorded(int(status.get("serial") or 0), status.get("phase") == "Rebuilding")


def summary(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What the status keeps of the Job's reports: records, seconds, records/s, shards."""
    records = sum(int(r.get("records") or 0) for r in reports)
    seconds = round(sum(float(r.get("seconds") or 0) for r in reports), 3)
    return {"shards": len(reports), "records": records, "seconds": seconds,
            "recordsPerSecond": round(records / seconds, 1) if seconds > 0 else 0.0,
            "mayDeliverTwice": sum(int(r.get("may_deliver_twice") or 0) for r in reports)}


@dataclass(slots=True)
class WindowStep:
    """What this round does about the window."""

    #: the window the ConfigMap and the stages get now
    run: Window
    #: pause the shard owners (0 replicas)
    pause: bool = False
    #: ``status.window``
    status: dict[str, Any] = field(default_factory=dict)
    #: WindowRolling condition: (status, reason, message)
    condition: tuple[bool, str, str] = (False, "Steady", "")
    #: Degraded: (reason, message)
    degraded: tuple[str, str] | None = None
    #: Events: (reason, message, warning)
    events: list[tuple[str, str, bool]] = field(default_factory=list)
    #: a Job to start: (serial, target)
    start_job: tuple[int, Window] | None = None
    #: the retention check of this round, for the status
    retention: ret.Check | None = None
    #: the stages were given the new window this round (Done is judged from the next one on)
    resumed_now: bool = False


def decide(desired: Window, current: Window | None, running: Window, previous: Mapping[str, Any] | None,
           newest: JobView | None, finished: Outcome | None, retention: ret.Check | None,
           owners_stopped: bool, generation: int, now_ms: int) -> WindowStep:
    """One round of the window's state (see the module header).

    ``current``: the window the shards have (None: unknown, after a failed Job); ``running``: the
    one the stages' ConfigMap holds (kept while the shards' is unknown); ``previous``:
    the last ``status.window``; ``newest``: the newest window Job; ``finished``: its outcome
    when it has finished unrecorded (``jobs.follow``); ``retention``: this round's check, for the desired
    roll window (None: not checked, e.g. no admin client configured)."""
    prev = dict(previous or {})
    phase = prev.get("phase")
    target = Window.of_spec(prev.get("target"))
    base = {k: v for k, v in prev.items() if k in ("serial", "attempts", "failedGeneration", "currentUnknown")}
    if current is not None:
        base["current"] = current.to_spec()
    old = current or running

    # A Job of ours that runs: wait for it, paused, whatever the spec says now.
    building = None if newest is None else target_of(newest)
    if newest is not None and newest.phase == RUNNING and building is not None:
        st = {**prev, **base, "phase": "Rebuilding", "target": building.to_spec(), "job": newest.name,
              "serial": max(int(prev.get("serial") or 0), newest.serial), "reason": "RebuildJob",
              "message": f"Job {newest.name} runs timerwheel rebuild-wheel --change-window ({building.text()})"}
        st.setdefault("startedMs", now_ms)
        return WindowStep(old, True, st, (True, "Rebuilding", st["message"]))

    # A Job finished that the status has not recorded yet.
    if newest is not None and building is not None and finished is not None:
        code, log = finished.exit_code, finished.log
        base["serial"] = max(int(prev.get("serial") or 0), newest.serial)  # recorded: never read again
        if newest.phase == SUCCEEDED:
            report = summary(reports(log))
            now_current = building
            base.pop("currentUnknown", None)
            st = {**base, "current": now_current.to_spec(), "target": now_current.to_spec(), "phase": "Resuming",
                  "job": newest.name, "serial": newest.serial, "attempts": 0, "report": report,
                  "startedMs": prev.get("startedMs", now_ms), "pausedMs": prev.get("pausedMs"),
                  "rebuiltMs": now_ms, "reason": "Resuming",
                  "message": f"rebuilt {report['records']} records in {report['seconds']} s "
                             f"({report['recordsPerSecond']} records/s); the stages roll with {now_current.text()}"}
            st = {k: v for k, v in st.items() if v is not None}
            return WindowStep(now_current, False, st, (True, "Resuming", st["message"]),
                              events=[("WindowRebuilt", f"Job {newest.name}: {st['message']}", False)], resumed_now=True)
        line = error_line(log) or f"the Job failed (exit code {code}) without a log line"
        if code == EXIT_REFUSED_UNCHANGED:
            # Every shard was checked before any changed: the old window runs on, as it was.
            refused = in_spec_words(line.removeprefix("timerwheel: error: "))
            st = {**base, "phase": "Refused", "target": building.to_spec(), "job": newest.name,
                  "failedGeneration": generation, "reason": "WindowChangeRefused", "message": refused,
                  "finishedMs": now_ms}
            st.pop("currentUnknown", None)
            text = f"{refused}; the shards keep running {old.text()}"
            return WindowStep(old, False, st, (False, "WindowChangeRefused", text),
                              events=[("WindowChangeRefused", text, True)])
        attempts = int(prev.get("attempts") or 0) + 1
        if code == EXIT_IN_USE and attempts < MAX_IN_USE_RETRIES:
            st = {**prev, **base, "phase": "Pausing", "attempts": attempts, "reason": "ShardStillOwned",
                  "message": f"Job {newest.name}: {line}; trying again"}
            return WindowStep(old, True, st, (True, "Pausing", st["message"]),
                              events=[("WindowRollRetry", st["message"], True)])
        st = {**{k: v for k, v in prev.items() if k not in ("current",)}, "serial": base["serial"], "phase": "Failed",
              "attempts": attempts, "failedGeneration": generation, "currentUnknown": True, "reason": "WindowRollFailed",
              "message": f"Job {newest.name} failed: {line}", "finishedMs": now_ms}
        st.pop("current", None)  # the shards may be half rebuilt: their window is unknown
        text = (f"{st['message']} (read `kubectl logs job/{newest.name}`); the shard owners stay stopped: change "
                "the spec again once the cause is fixed")
        return WindowStep(old, True, st, (False, "WindowRollFailed", text), degraded=("WindowRollFailed", text),
                          events=[("WindowRollFailed", text, True)])

    if phase == "Failed" and (target is None or target.same(desired)) and int(prev.get("failedGeneration") or 0) == generation:
        text = f"{prev.get('message')}; the shard owners stay stopped: change the spec again once the cause is fixed"
        return WindowStep(old, True, prev, (False, "WindowRollFailed", text), degraded=("WindowRollFailed", text))

    if desired.same(current):
        if phase == "Resuming":
            return WindowStep(desired, False, {**prev, **base}, (True, "Resuming", str(prev.get("message") or "")))
        st = {**{k: v for k, v in prev.items() if k not in ("phase", "reason", "message")}, **base}
        if phase in ("Refused", "Pausing"):
            st.pop("target", None)  # back to the window it runs: nothing to do
        st.update(phase=phase if phase == "Done" else "Steady", reason=prev.get("reason") if phase == "Done"
                  else "AsSpec", message=prev.get("message") if phase == "Done" else f"the shards run {desired.text()}")
        return WindowStep(desired, False, st, (False, "WindowRolled" if phase == "Done" else "AsSpec", str(st["message"])))

    # The spec asks for another window than the shards have.
    if (phase == "Refused" and prev.get("job") and target is not None and target.same(desired)
            and int(prev.get("failedGeneration") or 0) == generation):
        # refused by the Job's check (the records ahead): stays so until the spec changes again
        said = str(prev.get("message") or "")
        return WindowStep(old, False, {**prev, **base}, (False, "WindowChangeRefused",
                                                         f"{said}; the shards keep running {old.text()}"))
    if phase not in ("Pausing", "Rebuilding") or target is None or not target.same(desired):
        why = ret.refusal(retention, desired.roll_window_ms) if retention is not None else None
        # Known too low: refused. Unknown (not readable): refused only when more is needed.
        if why is not None and retention is not None and (
                retention.state == "TooLow" or current is None or desired.roll_window_ms > current.roll_window_ms):
            st = {**base, "phase": "Refused", "target": desired.to_spec(), "reason": "WindowChangeRefused",
                  "message": why}
            events = [] if phase == "Refused" and prev.get("message") == why else [("WindowChangeRefused", why, True)]
            return WindowStep(old, False, st, (False, "WindowChangeRefused", f"{why}; the shards keep running "
                                               f"{old.text()}"), events=events)
        st = {**base, "phase": "Pausing", "target": desired.to_spec(), "startedMs": now_ms, "reason": "Pausing",
              "message": f"{old.text() if current else 'an unknown window'} -> {desired.text()}: stopping "
                         "enqueue-put and dequeue-get"}
        return WindowStep(old, True, st, (True, "Pausing", st["message"]),
                          events=[("WindowRolling", st["message"], False)])

    st = {**prev, **base}
    if not owners_stopped:
        return WindowStep(old, True, st, (True, "Pausing", str(st.get("message") or "")))
    serial = next_serial(int(prev.get("serial") or 0), newest)
    st.update(phase="Rebuilding", serial=serial, reason="RebuildJob", message=f"starting a Job of timerwheel "
              f"rebuild-wheel --change-window ({desired.text()})")
    st.setdefault("pausedMs", now_ms)
    return WindowStep(old, True, st, (True, "Rebuilding", st["message"]), start_job=(serial, desired))


def apply_to_status(status: dict[str, Any], step: WindowStep, generation: int, previous: Sequence[Mapping[str, Any]],
                    now: str, now_ms: int) -> list[tuple[str, str, bool]]:
    """Put the window's state into ``status`` (computed from the stages as usual): the
    ``WindowRolling`` condition, ``Ready`` False while rolling, ``Degraded`` when the Job failed,
    ``status.window``. A ``Resuming`` roll whose TimerWheel is Ready again is ``Done`` here; the
    Events that says are returned."""
    from timerwheel_operator.status import condition

    conds = {c["type"]: c for c in status.get("conditions") or []}
    events: list[tuple[str, str, bool]] = []
    st = dict(step.status)
    ok, reason, message = step.condition
    ready = conds.get("Ready", {}).get("status") == "True"
    if st.get("phase") == "Resuming" and ready and not step.resumed_now:
        started, resumed = int(st.get("startedMs") or now_ms), int(st.get("rebuiltMs") or now_ms)
        report = st.get("report") or {}
        st.update(phase="Done", reason="WindowRolled", doneMs=now_ms, pausedSeconds=round((resumed - started) / 1000, 1))
        now_window = Window.of_spec(st.get("current"))
        st["message"] = message = (
            f"{now_window.text() if now_window else 'the new window'}: owners paused "
            f"{st['pausedSeconds']} s, {report.get('records', 0)} records rebuilt at {report.get('recordsPerSecond', 0)} "
            f"records/s, Ready {round((now_ms - started) / 1000, 1)} s after the change")
        ok, reason = False, "WindowRolled"
        events.append(("WindowRolled", message, False))
    if st:
        status["window"] = st
    conds["WindowRolling"] = condition("WindowRolling", ok, reason, message or reason, generation, previous, now)
    if step.degraded is not None:
        conds["Degraded"] = condition("Degraded", True, step.degraded[0], step.degraded[1], generation, previous, now)
        conds["Ready"] = condition("Ready", False, "Degraded", step.degraded[1], generation, previous, now)
    elif st.get("phase") in ROLLING:
        conds["Ready"] = condition("Ready", False, "WindowRolling", message, generation, previous, now)
    status["conditions"] = [conds[k] for k in
                            ("Ready", "Progressing", "Degraded", "Scaling", "Recovering", "WindowRolling") if k in conds]
    return events
