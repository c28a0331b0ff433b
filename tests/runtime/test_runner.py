"""StageRunner: a stage's loop never dies of an error, logs it once with its traceback, and stops
promptly; Every, Heartbeat and the interpreter's settings."""

from __future__ import annotations

import gc
import io
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from timerwheel import SimulatedClock, TimerConfig
from timerwheel.log import configure_logging
from timerwheel.runtime.process import TrackedStage
from timerwheel.runtime.runner import GC_THRESHOLDS, Every, Heartbeat, StageRunner, tune_interpreter
from timerwheel.stages.base import HEARTBEAT_TTL_MS, StageContext
from timerwheel.transports.memory import MemoryWorkQueue


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


def test_a_repeated_failure_logs_its_traceback_once(monkeypatch: pytest.MonkeyPatch) -> None:
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
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage process's wrapper (``TrackedStage``: /readyz) sees the error on its way up and
    re-raises it; only the runner, which handles it, logs it: one line, with the whole traceback."""

    out = io.StringIO()
    configure_logging("INFO", out)
    ctx = StageContext(TimerConfig(), SimulatedClock(0))
    monkeypatch.setattr(ctx.stop, "wait", lambda timeout=None: ctx.stop.is_set())
    tracked = TrackedStage(Failing(ctx.stop, 1, _parse_the_batch))
    StageRunner("dequeue-getmsg", tracked, ctx).run()
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    about = [x for x in lines if "slot 17" in json.dumps(x)]
    assert len(about) == 1, lines
    (line,) = about
    assert (line["level"], line["stage"], line["event"]) == ("error", "dequeue-getmsg", "step failed, retrying")
    assert line["error"] == "KeyError: 'slot 17'"
    assert "in _parse_the_batch" in line["traceback"] and "in step" in line["traceback"]
    assert [x["event"] for x in lines] == ["step failed, retrying", "step works again"]


def test_the_tracked_stage_is_failing_from_a_failed_step_until_one_works() -> None:
    stop = threading.Event()
    tracked = TrackedStage(Failing(stop, 2))
    for _ in range(2):
        with pytest.raises(ConnectionError):
            tracked.step(0.0)
        assert tracked.failing
    assert tracked.step(0.0) == 0 and not tracked.failing


def test_a_stopped_runner_returns_at_once_and_start_runs_it_in_a_thread() -> None:
    ctx = StageContext(TimerConfig(), SimulatedClock(0))
    runner = StageRunner("dequeue-put", Failing(ctx.stop, 0), ctx)  # its first step stops it
    runner.start()
    runner.join(5.0)
    assert runner.thread is not None and not runner.thread.is_alive()
    assert (runner.steps, runner.errors) == (1, 0)


def test_every_is_due_the_first_time_then_once_per_period(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("timerwheel.runtime.runner.time.monotonic", lambda: now[0])
    every = Every(15.0)
    assert every.due() and not every.due()
    now[0] += 14.9
    assert not every.due()
    now[0] += 0.1
    assert every.due() and not every.due()


@pytest.fixture
def gc_and_switch() -> Iterator[None]:
    """The process-wide settings tune_interpreter changes, put back afterwards."""
    threshold, enabled, switch = gc.get_threshold(), gc.isenabled(), sys.getswitchinterval()
    yield
    gc.set_threshold(*threshold)
    (gc.enable if enabled else gc.disable)()
    sys.setswitchinterval(switch)


@pytest.mark.usefixtures("gc_and_switch")
def test_tune_interpreter_raises_the_gc_thresholds_but_keeps_higher_ones_and_a_disabled_collector() -> None:
    gc.set_threshold(700, 10, 10)
    tune_interpreter()
    assert gc.get_threshold() == GC_THRESHOLDS and sys.getswitchinterval() == pytest.approx(0.001)
    gc.set_threshold(10 * GC_THRESHOLDS[0], 5, 100)
    tune_interpreter()
    assert gc.get_threshold() == (10 * GC_THRESHOLDS[0], GC_THRESHOLDS[1], 100)
    gc.set_threshold(0)  # the collector disabled by threshold: it stays so
    tune_interpreter()
    assert gc.get_threshold()[0] == 0


class FlakyQueue(MemoryWorkQueue):
    """A work queue whose heartbeat fails while ``down`` is set."""

    def __init__(self) -> None:
        super().__init__("deliver", 1, 8)
        self.down = False
        self.beats: list[tuple[str, int]] = []

    def heartbeat(self, consumer: str, ttl_ms: int) -> None:
        if self.down:
            raise ConnectionError("redis away")
        self.beats.append((consumer, ttl_ms))


def test_a_heartbeat_that_fails_is_logged_once_and_once_more_when_it_works_again() -> None:
    out = io.StringIO()
    configure_logging("INFO", out)
    queue = FlakyQueue()
    beat = Heartbeat(queue, "me", threading.Event())
    beat.beat()
    queue.down = True
    beat.beat()
    beat.beat()
    queue.down = False
    beat.beat()
    assert queue.beats == [("me", HEARTBEAT_TTL_MS)] * 2
    assert [json.loads(x)["event"] for x in out.getvalue().splitlines()] == ["heartbeat failed", "heartbeat works again"]


def test_a_heartbeat_ended_on_stop_says_at_once_that_the_consumer_is_gone() -> None:
    queue = FlakyQueue()
    beat = Heartbeat(queue, "me", threading.Event()).start()
    beat.end()
    assert queue.beats == [("me", HEARTBEAT_TTL_MS), ("me", 0)] and not beat.thread.is_alive()


def test_run_returns_only_after_the_gauge_samplers_last_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage closes its shards (unmapping their wheels) once ``run`` returns: a sample still
    reading them then crashed the process (SIGSEGV on SIGTERM). ``run`` waits for the sampler."""
    import timerwheel.runtime.runner as runner_module

    monkeypatch.setattr(runner_module, "SAMPLE_EVERY_S", 0.001)
    ctx = StageContext(TimerConfig(), SimulatedClock())
    sampling, release, finished = threading.Event(), threading.Event(), threading.Event()

    def sample() -> None:
        sampling.set()
        release.wait(10)
        finished.set()

    class Idle:
        def step(self, timeout_s: float) -> int:
            if sampling.is_set():
                ctx.stop.set()  # stop while the sample is in progress
            return 0

        def close(self) -> None:
            pass

    done = threading.Event()
    thread = threading.Thread(target=lambda: (StageRunner("dequeue-get", Idle(), ctx, sample=sample).run(), done.set()))
    thread.start()
    assert sampling.wait(10)
    assert not done.wait(0.3), "run returned while its sampler was still reading"
    release.set()
    assert done.wait(10) and finished.is_set()
    thread.join()


def test_a_wake_after_a_step_looked_for_work_and_before_it_waits_ends_the_wait() -> None:
    """The queue stages of the embedded runtime wait up to a second for a wake: a put (and its
    wake) that came between the step's look at the queue and its wait used to be lost, and the
    entry waited for the whole second (lateness p99 1.1 s at 1,000 msg/s)."""
    ctx = StageContext(TimerConfig(), SimulatedClock(0))
    waits: list[float] = []

    class LooksThenWaits:
        def step(self, timeout_s: float) -> int:
            ctx.wake("dequeue-put")  # the put lands just after the look found the queue empty
            started = time.monotonic()
            ctx.idle_wait("dequeue-put", timeout_s)
            waits.append(time.monotonic() - started)
            ctx.stop.set()
            return 0

        def close(self) -> None:
            pass

    StageRunner("dequeue-put", LooksThenWaits(), ctx, idle_s=5.0).run()
    assert len(waits) == 1 and waits[0] < 2.5, f"the wake was lost: the step waited {waits} s"
