"""One interface for "now". No module calls ``time.time()`` directly; they take a Clock.

``SystemClock`` reads the wall clock. ``SimulatedClock`` only moves when a test or benchmark
advances it, so a one-year delay with dozens of rolls runs in seconds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int:
        """Milliseconds since the epoch."""
        ...

    def sleep(self, seconds: float) -> None:
        """Wait up to ``seconds`` of real time; a simulated clock returns early when moved."""
        ...


class SystemClock:
    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class SimulatedClock:
    """A clock that tests advance by hand. Thread-safe; never goes backwards."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._now = start_ms
        self._changed = threading.Condition()
        self._listeners: list[Callable[[], None]] = []

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` after every move of the clock (the embedded runtime wakes its stages)."""
        self._listeners.append(callback)

    def _moved(self) -> None:
        for callback in self._listeners:
            callback()

    def now_ms(self) -> int:
        return self._now

    def advance(self, ms: int) -> int:
        if ms < 0:
            raise ValueError(f"SimulatedClock.advance: ms must be >= 0, got {ms}")
        with self._changed:
            self._now += ms
            now = self._now
            self._changed.notify_all()
        self._moved()
        return now

    def set(self, now_ms: int) -> None:
        with self._changed:
            if now_ms < self._now:
                raise ValueError(f"SimulatedClock.set: {now_ms} is before now {self._now}")
            self._now = now_ms
            self._changed.notify_all()
        self._moved()

    def sleep(self, seconds: float) -> None:
        """Wait up to ``seconds`` of real time, returning early when the clock is moved."""
        with self._changed:
            self._changed.wait(seconds)
