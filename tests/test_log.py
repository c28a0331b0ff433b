"""Error logs carry the whole traceback, once, where the error is handled (a stage loop's:
tests/runtime/test_runner.py; a command's: tests/cli/test_main.py)."""

from __future__ import annotations

import io
import json

from timerwheel import SimulatedClock, TimerConfig
from timerwheel.log import configure_logging, stage_logger
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
