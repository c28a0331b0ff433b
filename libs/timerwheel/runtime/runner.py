"""Running a stage: a loop that never dies on an error and stops promptly.

``StageRunner`` calls ``stage.step()`` until told to stop; an exception is logged (one line,
with the stage) and retried after a short backoff — nothing crashes a stage. The counters
``steps`` and ``work`` let the embedded runtime tell when the whole pipeline is idle.

An idle step waits: embedded, up to ``idle_s`` or until another stage of the process wakes it
(``StageContext.wake``); a stage in a process of its own (production) on blocking reads of its
inputs (``StageContext.wait_on_inputs``), so that an idle installation costs almost no CPU.
``Heartbeat`` tells the shared work queues that the process is alive; ``tune_interpreter`` sets
what a process of busy stage threads needs.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

from timerwheel.log import stage_logger
from timerwheel.stages.base import HEARTBEAT_EVERY_S, HEARTBEAT_TTL_MS, StageContext, Stopped
from timerwheel.transports.base import WorkQueue

#: Cyclic-GC thresholds while stages run; CPython's default is (700, 10, 10). Stages allocate
#: tuples by the million (records, headers, rows) and keep many alive for a while (the read
#: cache, queue entries): at 700 the collector ran about 3,000 times in a 100 k message run and
#: took a fifth of the pipeline's CPU, re-walking the same live records; at 50,000 still 7 %
#: (17 young collections of ~15 ms); at 200,000 two of ~50 ms. Records hold no cycles, so
#: collecting less often costs no memory worth counting.
GC_THRESHOLDS = (200_000, 50, 10)

#: The longest an idle stage of its own process waits on its inputs (``StageContext.wait_on_inputs``):
#: it wakes at once when one has something, so this only bounds how late it sees a stop.
WAIT_ON_INPUTS_S = 1.0

#: How often a runner samples its gauges (queue depths) ...
SAMPLE_EVERY_S = 1.0
#: ... and the wheel count from R (the ``pending`` gauge), which scans the wheel (110 MB for a
#: 2-day window at 100 ms).
WHEEL_COUNT_EVERY_S = 15.0


def tune_interpreter() -> None:
    """Process-wide settings for a process whose threads run stages: hand the GIL over every
    millisecond (several busy stage threads), and run the cyclic GC less often
    (``GC_THRESHOLDS``). A threshold the host application set higher is kept, and a disabled
    collector stays disabled."""
    sys.setswitchinterval(0.001)
    current = gc.get_threshold()
    if current[0] > 0:
        gc.set_threshold(*(max(mine, theirs) for mine, theirs in zip(GC_THRESHOLDS, current, strict=True)))


class Stage(Protocol):
    def step(self, timeout_s: float) -> int: ...

    def close(self) -> None: ...


#: How long a stopping runner waits for its gauge sampler's last sample (a wheel scan).
SAMPLER_JOIN_S = 30.0


class StageRunner:
    def __init__(self, name: str, stage: Stage, ctx: StageContext, idle_s: float = 0.005,
                 sample: Callable[[], None] | None = None) -> None:
        """``sample`` sets gauges; called every SAMPLE_EVERY_S from a thread of its own, so that
        a slow sample (a wheel scan) never holds up the stage."""
        self.sample = sample
        self.name = name
        self.stage = stage
        self.ctx = ctx
        self.idle_s = idle_s
        self.steps = 0
        self.work = 0
        self.errors = 0
        self.thread: threading.Thread | None = None
        self.log = stage_logger(name)

    def run(self) -> None:
        sampler = None
        if self.sample is not None:
            sampler = threading.Thread(target=self._sample, name=f"tw-{self.name}-gauges", daemon=True)
            sampler.start()
        try:
            self._loop()
        finally:
            # The sampler reads the shards the stage is about to close (close unmaps the wheel):
            # it must have finished its last sample first, or it reads unmapped memory (SIGSEGV).
            self.ctx.stop.set()
            if sampler is not None:
                sampler.join(SAMPLER_JOIN_S)
                if sampler.is_alive():
                    self.log.error("gauge sampler did not stop in time", timeout_s=SAMPLER_JOIN_S)

    def _loop(self) -> None:
        backoff = 0.01
        failing: tuple[str, str] | None = None  # the error of the failing streak, logged in full once
        repeats = 0
        while not self.ctx.stop.is_set():
            try:
                self.ctx.step_begins(self.name)
                self.work += self.stage.step(self.idle_s)
                backoff = 0.01
                if failing is not None:
                    self.log.info("step works again", after_failures=repeats + 1)
                failing, repeats = None, 0
            except Stopped:
                break
            except Exception as exc:  # noqa: BLE001 - a stage never dies; it logs and retries
                self.errors += 1
                self.ctx.metrics.inc("stage_errors", stage=self.name)
                seen = (type(exc).__name__, str(exc)[:200])
                if seen != failing:
                    self.log.error("step failed, retrying", exc=True, backoff_s=backoff)
                    failing, repeats = seen, 0
                else:
                    repeats += 1
                    if repeats in (1, 10, 100) or repeats % 1000 == 0:  # the traceback was logged above
                        self.log.error("step failed again, retrying", error=f"{seen[0]}: {seen[1]}",
                                       repeats=repeats, backoff_s=backoff)
                if self.ctx.stop.wait(backoff):
                    break
                backoff = min(backoff * 2, 2.0)
            self.steps += 1

    def _sample(self) -> None:
        assert self.sample is not None
        failing = False
        while not self.ctx.stop.wait(SAMPLE_EVERY_S):
            try:
                self.sample()
                failing = False
            except Exception as exc:  # noqa: BLE001 - a gauge is never worth a stage
                # with the traceback once per run of failures (it would repeat every second)
                self.log.warning("sampling gauges failed", exc=exc if not failing else False, error=repr(exc)[:200])
                failing = True

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name=f"tw-{self.name}", daemon=True)
        self.thread.start()

    def join(self, timeout_s: float = 10.0) -> None:
        if self.thread is not None:
            self.thread.join(timeout_s)
            if self.thread.is_alive():
                self.log.error("did not stop in time", timeout_s=timeout_s)

    def close(self) -> None:
        try:
            self.stage.close()
        except Exception:  # noqa: BLE001
            self.log.error("close failed", exc=True)


class Heartbeat:
    """Tells the work queues, from a thread of its own, that ``consumer`` is alive
    (``WorkQueue.heartbeat`` every HEARTBEAT_EVERY_S, valid for HEARTBEAT_TTL_MS): once a killed
    process's heartbeat lapses, the entries it held are claimed by the others within seconds.
    A thread, not the stage loop, so that a long batch does not make a live consumer look dead."""

    def __init__(self, queue: WorkQueue, consumer: str, stop: threading.Event) -> None:
        self.queue = queue
        self.consumer = consumer
        self.stop = stop
        self.log = stage_logger("heartbeat")
        self._failing = False
        self.thread = threading.Thread(target=self._run, name="tw-heartbeat", daemon=True)

    def beat(self) -> None:
        try:
            self.queue.heartbeat(self.consumer, HEARTBEAT_TTL_MS)
        except Exception as exc:  # noqa: BLE001 - the queue's own calls report the outage
            if not self._failing:
                self.log.warning("heartbeat failed", exc=exc, error=str(exc)[:200])
            self._failing = True
        else:
            if self._failing:
                self.log.info("heartbeat works again")
            self._failing = False

    def start(self) -> Heartbeat:
        self.beat()
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.wait(HEARTBEAT_EVERY_S):
            self.beat()

    def end(self) -> None:
        """The process stopped (its stage closed): say so at once, so that the entries it left
        pending are claimed by the others after DEAD_IDLE_MS instead of after HEARTBEAT_TTL_MS."""
        self.stop.set()
        self.thread.join(timeout=2 * HEARTBEAT_EVERY_S)
        try:
            self.queue.heartbeat(self.consumer, 0)
        except Exception as exc:  # noqa: BLE001 - its TTL lapses all the same
            self.log.warning("heartbeat not ended", exc=exc, error=str(exc)[:200])


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.002) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


class Every:
    """``due()`` is True at most once per ``seconds`` (and the first time)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._last = -float("inf")

    def due(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.seconds:
            return False
        self._last = now
        return True
