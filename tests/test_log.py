"""Error logs carry the whole traceback, once, where the error is handled: a stage whose step
fails the same way again and again logs the traceback on the first failure only."""

from __future__ import annotations

import io
import json
import sys
import threading
from collections.abc import Callable

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


def _broker_away() -> None:
    raise ConnectionError("broker away")


class Failing:
    """A stage whose step fails (``fail`` raises, deep inside) ``times`` times, then stops the runner."""

    def __init__(self, stop: threading.Event, times: int, fail: Callable[[], None] = _broker_away) -> None:
        self.stop, self.times, self.calls, self.fail = stop, times, 0, fail

    def step(self, timeout_s: float) -> int:
        self.calls += 1
        if self.calls > self.times:
            self.stop.set()
            return 0
        self.fail()
        return 1

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


def _parse_the_batch() -> None:
    raise KeyError("slot 17")


def test_an_error_in_a_stage_loop_is_logged_once_with_its_traceback_not_again_up_the_stack(
        monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The production wrapper (``_Tracked``: /readyz) sees the error on its way up and re-raises
    it; only the runner, which handles it, logs it: one line, with the whole traceback."""
    from timerwheel.production import _Tracked

    out = io.StringIO()
    configure_logging("INFO", out)
    ctx = StageContext(TimerConfig(), SimulatedClock(0))
    monkeypatch.setattr(ctx.stop, "wait", lambda timeout=None: ctx.stop.is_set())
    tracked = _Tracked(Failing(ctx.stop, 1, _parse_the_batch))
    StageRunner("dequeue-getmsg", tracked, ctx).run()
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    about = [x for x in lines if "slot 17" in json.dumps(x)]
    assert len(about) == 1, lines
    (line,) = about
    assert (line["level"], line["stage"], line["event"]) == ("error", "dequeue-getmsg", "step failed, retrying")
    assert line["error"] == "KeyError: 'slot 17'"
    assert "in _parse_the_batch" in line["traceback"] and "in step" in line["traceback"]
    assert [x["event"] for x in lines] == ["step failed, retrying", "step works again"]


def test_an_undecodable_entry_is_logged_once_with_the_decoders_traceback() -> None:
    from timerwheel.stages.base import decoded
    from timerwheel.transports.memory import MemoryWorkQueue

    out = io.StringIO()
    configure_logging("INFO", out)
    ctx = StageContext(TimerConfig(), SimulatedClock(0))
    queue = MemoryWorkQueue("fetch", 1, 8)

    def decode(payload: bytes) -> bytes:
        if payload.startswith(b"bad"):
            raise ValueError(f"cannot read {payload!r}")
        return payload

    got = decoded(ctx, queue, 0, [("1-0", b"good"), ("2-0", b"bad1"), ("3-0", b"bad2")], decode,
                  stage_logger("dequeue-getmsg"))
    assert got == [b"good"]
    (line,) = [json.loads(x) for x in out.getvalue().splitlines()]
    assert line["entries"] == ["2-0", "3-0"] and line["error"] == "ValueError: cannot read b'bad1'"
    assert "in decode" in line["traceback"]


class FlakyLog:
    """A commit log whose append fails ``times`` times, then writes."""

    def __init__(self, times: int) -> None:
        self.times = times

    def append(self, records: list[object]) -> list[tuple[int, int]]:
        if self.times:
            self.times -= 1
            raise ConnectionError("broker away")
        return [(0, i) for i in range(len(records))]


def test_a_retried_append_logs_its_traceback_on_the_first_failure_only() -> None:
    from timerwheel.records import OutRecord
    from timerwheel.stages.base import append_until_written

    out = io.StringIO()
    configure_logging("INFO", out)
    ctx = StageContext(TimerConfig(), SimulatedClock(0))
    written = append_until_written(ctx, FlakyLog(3), [OutRecord("orders", None, b"v", ())],  # type: ignore[arg-type]
                                   stage_logger("dequeue-put"))
    assert written == [(0, 0)]
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [x["attempt"] for x in lines] == [1, 2, 3]
    assert ["traceback" in x for x in lines] == [True, False, False]
    assert "ConnectionError: broker away" in lines[0]["traceback"]


def test_an_unexpected_error_ends_a_command_with_one_json_line_holding_its_traceback(
        monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    from timerwheel import cli

    def broken(_args: object) -> int:
        _parse_the_batch()
        return 0

    monkeypatch.setattr(cli, "cmd_inspect", broken)
    monkeypatch.setattr(cli, "configure_logging", lambda level: configure_logging(level, sys.stderr))
    assert cli.main(["inspect"]) == 1
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(lines) == 1, lines
    line = json.loads(lines[0])
    assert (line["level"], line["stage"], line["event"]) == ("error", "inspect", "command failed")
    assert line["error"] == "KeyError: 'slot 17'" and "in _parse_the_batch" in line["traceback"]
