from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from timerwheel import SimulatedClock
from timerwheel.runtime.embedded import EmbeddedTimerwheel

START = 1_700_000_000_000


@pytest.fixture
def clock() -> SimulatedClock:
    return SimulatedClock(start_ms=START)


@pytest.fixture
def make_tw(tmp_path: Path, clock: SimulatedClock) -> Iterator[Callable[..., EmbeddedTimerwheel]]:
    """Open an embedded timerwheel on tmp_path (fsync off: these tests kill no machines)."""
    opened: list[EmbeddedTimerwheel] = []

    def make(**settings: Any) -> EmbeddedTimerwheel:
        settings.setdefault("tick_ms", 100)
        settings.setdefault("roll_window_ms", 86_400_000)
        settings.setdefault("fsync", False)
        tw = EmbeddedTimerwheel(tmp_path / "data", clock=clock, **settings)
        opened.append(tw)
        return tw

    yield make
    for tw in opened:
        tw.close()
