"""EmbeddedTimerwheel as a whole: one per data directory, started and stopped, and what it tells
about its shards. What its stages do is tests/stages/ (most of it through this runtime)."""

from __future__ import annotations

from pathlib import Path

import pytest
from timerwheel import SimulatedClock, Timer
from timerwheel.errors import TimerwheelError
from timerwheel.runtime.embedded import EmbeddedTimerwheel

START = 1_700_000_000_000
SETTINGS = {"shards": 2, "tick_ms": 100, "roll_window_ms": 60_000, "fsync": False}


def test_one_runtime_per_data_directory_and_the_next_starts_once_it_is_closed(tmp_path: Path) -> None:
    first = EmbeddedTimerwheel(tmp_path, clock=SimulatedClock(START), **SETTINGS)
    try:
        with pytest.raises(TimerwheelError, match="in use by another timerwheel process"):
            EmbeddedTimerwheel(tmp_path, clock=SimulatedClock(START), **SETTINGS)
    finally:
        first.close()
    EmbeddedTimerwheel(tmp_path, clock=SimulatedClock(START), **SETTINGS).close()


def test_nothing_runs_before_start_and_a_restart_delivers_what_was_scheduled_before(tmp_path: Path) -> None:
    clock = SimulatedClock(START)
    tw = EmbeddedTimerwheel(tmp_path, clock=clock, start=False, **SETTINGS)
    assert tw.runners == [] and not (tmp_path / "shard-0000").exists()
    tw.close()  # a runtime never started closes as a no-op
    tw.start()
    tickets = tw.schedule_many([Timer("t", b"v", deliver_at_ms=START + 2_000, message_id=f"m{i}") for i in range(5)])
    tw.wait_idle()
    tw.close()
    with EmbeddedTimerwheel(tmp_path, clock=clock, **SETTINGS) as again:
        clock.set(START + 2_500)
        again.wait_idle()
        got = sorted((r.header("tw-id") or b"").decode() for r in again.read("t"))
    assert got == sorted(t.message_id for t in tickets)


def test_inspect_and_pending_show_what_the_wheel_holds_until_it_is_cancelled_or_delivered(tmp_path: Path) -> None:
    clock = SimulatedClock(START)
    with EmbeddedTimerwheel(tmp_path, clock=clock, **SETTINGS) as tw:
        keep = tw.schedule("t", b"v", deliver_at_ms=START + 5_000, message_id="keep")
        drop = tw.schedule("t", b"v", deliver_at_ms=START + 6_000, message_id="drop")
        tw.wait_idle()
        assert [t.message_id for t in tw.pending().timers] == ["keep", "drop"]
        shards = tw.inspect()["shards"]
        assert [s["shard"] for s in shards] == [0, 1] and sum(s["pending"] for s in shards) == 2
        assert all(s["R"] == s["W"] - s["W"] % 100 for s in shards), shards
        tw.cancel(drop)
        tw.wait_idle()
        assert [t.message_id for t in tw.pending().timers] == ["keep"]
        clock.set(START + 5_100)
        tw.wait_idle()
        assert tw.pending().count == 0 and [r.header("tw-id") for r in tw.read("t")] == [b"keep"]
    assert keep.deliver_at_ms == START + 5_000
