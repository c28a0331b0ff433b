"""Helpers for scenario tests on a simulated clock."""

from __future__ import annotations

from timerwheel import SimulatedClock
from timerwheel.records import Record
from timerwheel.runtime.embedded import EmbeddedTimerwheel


def step_through(tw: EmbeddedTimerwheel, clock: SimulatedClock, due_times: list[int], end_ms: int) -> None:
    """Advance the clock to the earliest moment each due slot may fire (slot + tick), in order,
    letting the pipeline go idle at each; then to ``end_ms``."""
    tick = tw.config.tick_ms
    tw.wait_idle()
    for t in sorted({d - d % tick + tick for d in due_times}):
        if t > clock.now_ms():
            clock.set(t)
            tw.wait_idle()
    if end_ms > clock.now_ms():
        clock.set(end_ms)
    tw.wait_idle()


def header(r: Record, name: str) -> str:
    raw = r.header(name)
    assert raw is not None, f"record {r.topic}/{r.partition}/{r.offset} has no {name}"
    return raw.decode()


def by_id(records: list[Record]) -> dict[str, list[Record]]:
    out: dict[str, list[Record]] = {}
    for r in records:
        out.setdefault(header(r, "tw-id"), []).append(r)
    return out
