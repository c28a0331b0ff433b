"""Error logs carry the whole traceback, once, where the error is handled: a stage whose step
fails the same way again and again logs the traceback on the first failure only."""

from __future__ import annotations

import io
import json
import threading

from timerwheel import SimulatedClock, TimerConfig
from timerwheel.log import configure_logging, stage_logger
from timerwheel.runtime import StageRunner
from timerwheel.stages.base import StageContext


def _inner() -> None:
    raise ValueError("the bytes were bad")


def test_an_error_line_carries_the_whole_traceback_in_one_line() -> None:
    out = io.StringIO()
    configure_logging("INFO", out)
    try:
        _inner()
    except ValueError:
        stage_logger("enqueue-get", 2).error("step failed", exc=True)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    line = json.loads(lines[0])
    assert line["error"] == "ValueError: the bytes were bad"
    assert "Traceback (most recent call last)" in line["traceback"] and "in _inner" in line["traceback"]
    assert (line["stage"], line["shard"]) == ("enqueue-get", 2)


class Failing:
    def __init__(self, stop: threading.Event, times: int) -> None:
        self.stop, self.times, self.calls = stop, times, 0

    def step(self, timeout_s: float) -> int:
        self.calls += 1
        if self.calls > self.times:
            self.stop.set()
            return 0
        raise ConnectionError("broker away")

    def close(self) -> None:
        pass


def test_a_repeated_failure_logs_its_traceback_once(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    out = io.StringIO()
    configure_logging("INFO", out)
    ctx = StageContext(TimerConfig(), SimulatedClock(0))
    monkeypatch.setattr(ctx.stop, "wait", lambda timeout=None: ctx.stop.is_set())  # no real back-off
    stage = Failing(ctx.stop, 12)
    runner = StageRunner("dequeue-put", stage, ctx)
    runner.run()
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    failures = [x for x in lines if x["event"].startswith("step failed")]
    with_traceback = [x for x in failures if "traceback" in x]
    assert runner.errors == 12 and ctx.metrics.counter("stage_errors") == 12
    assert len(with_traceback) == 1 and "ConnectionError: broker away" in with_traceback[0]["traceback"]
    # Then a line at the 1st and 10th repeat, not one per failure.
    assert [x.get("repeats") for x in failures[1:]] == [1, 10]
