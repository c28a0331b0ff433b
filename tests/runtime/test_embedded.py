"""EmbeddedTimerwheel as a whole: one per data directory, started and stopped, and what it tells
about its shards. What its stages do is tests/stages/ (most of it through this runtime)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from timerwheel import SimulatedClock, Timer
from timerwheel.errors import TimerwheelError
from timerwheel.runtime.embedded import EXTERNAL_POLL_S, EmbeddedTimerwheel
from timerwheel.store import Shard

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


def test_an_idle_runtime_on_the_system_clock_does_only_what_is_due(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 32: idle, the embedded runtime cost ~8 % of a core: five threads stepping 200 times a
    second and W and R checkpointed every tick. Now an idle stage waits for a wake or its next
    deadline (enqueue-get still looks for other processes' appends every EXTERNAL_POLL_S), and
    an unchanged W is published once a second; the figure is in BENCHMARKS.md (embedded.idle).
    A message scheduled meanwhile is still delivered in its tick."""
    saves: list[str] = []
    for kind in ("enqueue", "dequeue"):
        save = getattr(Shard, f"save_{kind}_checkpoint")
        monkeypatch.setattr(Shard, f"save_{kind}_checkpoint",
                            lambda self, ckpt, _save=save, _kind=kind: (saves.append(_kind), _save(self, ckpt))[1])
    with EmbeddedTimerwheel(tmp_path, **SETTINGS) as tw:  # type: ignore[arg-type]
        time.sleep(0.5)  # started: the first checkpoints written
        steps, saved = {r.name: r.steps for r in tw.runners}, len(saves)
        time.sleep(2.0)
        stepped = {r.name: r.steps - steps[r.name] for r in tw.runners}
        assert stepped["enqueue-get"] <= 2.0 / EXTERNAL_POLL_S + 20, stepped
        assert sum(n for name, n in stepped.items() if name != "enqueue-get") <= 60, stepped  # was ~1,600
        assert len(saves) - saved <= 12, f"W and R checkpointed every tick while idle: {saves[saved:]}"  # was ~80
        ticket = tw.schedule("t", b"v", delay_ms=300)
        deadline = time.monotonic() + 10
        while not tw.read("t") and time.monotonic() < deadline:
            time.sleep(0.01)
        [record] = tw.read("t")
        assert int(record.header("tw-delivered-at") or 0) >= ticket.deliver_at_ms
