"""``InputWatermark`` in the background (production): the stage's loop never waits for Kafka's
answer, an observation pairs the clock read *before* its request with the ends it got, and a
failed request never re-stamps older ends with a newer time (W would run on past its input).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from timerwheel import SimulatedClock, TimerConfig
from timerwheel.stages import StageContext
from timerwheel.stages.enqueue_put import InputWatermark, Observation

START = 1_700_000_000_000


class Ends:
    """The timer topic's end offsets as a test drives them: each request blocks until released."""

    def __init__(self, clock: SimulatedClock) -> None:
        self.clock = clock
        self.ends = {0: 5, 1: 7}
        self.fail = False
        self.gate = threading.Semaphore(0)
        self.requests = 0
        #: The clock moves on while a request is in flight (as a slow broker's answer does).
        self.advance_ms = 0

    def __call__(self) -> dict[int, int]:
        self.requests += 1
        assert self.gate.acquire(timeout=10), "the test never released the request"
        self.clock.advance(self.advance_ms)
        if self.fail:
            raise ConnectionError("broker unreachable")
        return dict(self.ends)


def _until(what: str, ok: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.005)


@pytest.fixture
def setup(tmp_path: object) -> Iterator[tuple[InputWatermark, Ends, StageContext]]:
    clock = SimulatedClock(START)
    ctx = StageContext(TimerConfig(data_dir=str(tmp_path), fsync=False), clock, consumer="me")
    ends = Ends(clock)
    wm = InputWatermark(ctx, ends, interval_s=0.0, background=True)
    yield wm, ends, ctx
    ends.gate.release(100)
    wm.close()


def test_observe_answers_at_once_while_the_request_is_in_flight(setup: tuple[InputWatermark, Ends, StageContext]) -> None:
    wm, ends, _ = setup
    assert wm.observe() is None  # nothing known yet, and no wait for the request just asked for
    _until("request", lambda: ends.requests == 1)
    assert wm.observe() is None  # the request is still blocked in Kafka: observe does not wait
    ends.advance_ms = 250
    ends.gate.release()
    _until("observation", lambda: wm.observe() is not None)
    # the time is the one read before the request (the ends hold at least what it acknowledged
    # by then), not the 250 ms later one of the answer
    assert wm.observe() == Observation(START, {}, {0: 5, 1: 7})


def test_a_failed_request_keeps_the_last_observation_with_its_own_time(
        setup: tuple[InputWatermark, Ends, StageContext], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="timerwheel")
    wm, ends, ctx = setup
    wm.observe()
    ends.gate.release()
    _until("observation", lambda: wm.observe() is not None)
    assert wm.observe() == Observation(START, {}, {0: 5, 1: 7})
    ends.fail = True
    ctx.clock.advance(1_000)  # type: ignore[attr-defined]
    for n in range(1, 4):
        wm.observe()
        ends.gate.release()
        _until("failure", lambda: ctx.metrics.counter("input_end_failures") == n)  # noqa: B023 - awaited here
    assert wm.observe() == Observation(START, {}, {0: 5, 1: 7})  # never (START + 1000, the old ends)
    assert ctx.metrics.counter("input_end_failures") == 3
    warned = [r for r in caplog.records if "end offsets unavailable" in r.getMessage()]
    assert len(warned) == 1  # one line a streak, not one a request
    ends.fail = False
    ends.ends = {0: 9, 1: 9}
    wm.observe()
    ends.gate.release()
    _until("new observation", lambda: wm.observe() == Observation(START + 1_000, {}, {0: 9, 1: 9}))
    assert any("available again" in r.getMessage() for r in caplog.records)


def test_no_request_unless_asked(setup: tuple[InputWatermark, Ends, StageContext]) -> None:
    """An idle W that needs no proof of its input costs no request."""
    wm, ends, _ = setup
    ends.gate.release(10)
    time.sleep(0.3)
    assert ends.requests == 0
    wm.observe()
    _until("request", lambda: ends.requests == 1)
    time.sleep(0.3)
    assert ends.requests == 1


def test_asked_soon_it_asks_again_before_its_interval(tmp_path: object) -> None:
    """While records wait for W, ``observe(soon=True)`` cuts the wait between requests to ``soon_s``."""
    clock = SimulatedClock(START)
    ctx = StageContext(TimerConfig(data_dir=str(tmp_path), fsync=False), clock, consumer="me")
    ends = Ends(clock)
    ends.gate.release(100)
    wm = InputWatermark(ctx, ends, interval_s=3600.0, background=True, soon_s=0.01)
    try:
        wm.observe()
        _until("first observation", lambda: wm.observe() is not None)
        time.sleep(0.3)
        assert ends.requests == 1  # asked, not soon: the next request waits for the interval
        wm.observe(soon=True)
        _until("request asked soon", lambda: ends.requests == 2)
    finally:
        wm.close()


def test_close_stops_the_thread(tmp_path: object) -> None:
    clock = SimulatedClock(START)
    ctx = StageContext(TimerConfig(data_dir=str(tmp_path), fsync=False), clock, consumer="me")
    before = set(threading.enumerate())
    wm = InputWatermark(ctx, Ends(clock), interval_s=0.0, background=True)
    started = [t for t in threading.enumerate() if t not in before and t.name == "tw-input-ends"]
    assert len(started) == 1 and started[0].is_alive()
    wm.close()
    assert not started[0].is_alive()


def test_an_observation_carries_the_r_known_before_its_time(tmp_path: object) -> None:
    """What an observation grants is capped at R + c - tick: the R must be one read before its
    ``t0`` (a newer R, moved by a roll hop acknowledged after ``t0``, would let W pass the hop)."""
    clock = SimulatedClock(START)
    ctx = StageContext(TimerConfig(data_dir=str(tmp_path), fsync=False), clock, consumer="me")
    known = {0: START - 500}
    ends = Ends(clock)
    ends.gate.release(10)

    def answer() -> dict[int, int]:
        known[0] = START  # R moved while the request was in flight
        return ends()

    wm = InputWatermark(ctx, answer, interval_s=0.0, read_ms=known.copy)
    try:
        assert wm.observe() == Observation(START, {0: START - 500}, {0: 5, 1: 7})
        assert wm.observe() == Observation(START, {0: START}, {0: 5, 1: 7})  # same time, R moved: asked again
        assert ends.requests == 2
        assert wm.observe() == Observation(START, {0: START}, {0: 5, 1: 7})
        assert ends.requests == 2  # same time, same R: the last answer
    finally:
        wm.close()
