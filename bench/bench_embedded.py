"""Embedded-mode benchmarks (issue 3).

* ``embedded.throughput``: N timer messages all due at once, simulated clock: messages/s from
  the engine's start to the last delivery, beside a plain LocalCommitLog read-then-write
  pass-through of the same records measured in the same run (the ratio is the figure), and
  beside the earlier sessions' baseline (records with one small header) for comparison; the
  median of three rounds.
* ``embedded.burst``: 1,000,000 messages due in the same tick: drain time and peak RSS
  (bounded by the queue bounds, not by the burst).
* ``embedded.lateness``: real clock, 1,000 messages/s (``TW_BENCH_EMBEDDED_RATE``) for 60 s
  (``TW_BENCH_SECONDS``), tick 100 ms, delays 2-10 s, due on whole seconds and uniform
  (``TW_BENCH_DUE``): lateness three ways (``bench.lateness``: ``tw-delivered-at``, the local
  log's record timestamp, the receive time of a consumer thread polling the destination),
  p50 / p99 / max and early of each. Each run in a process of its own; with
  ``TW_BENCH_BASELINE`` the baseline revision's runs alternate with the current code's.
* ``embedded.idle``: ``timerwheel run --embedded`` (the default settings, as ``make run``) with no
  traffic for ``TW_BENCH_IDLE_SECONDS`` (30): its CPU time from ``/proc`` (psutil, as
  ``production.idle``), in % of one core; with ``TW_BENCH_BASELINE`` alternately with the
  baseline's.

* ``embedded.exactly_once``: ``embedded.throughput``'s pipeline (N messages due at once, simulated
  clock, 2 shards) at least once and exactly once (the journal, issue 31) in alternate rounds, with
  ``TW_BENCH_FSYNC`` (0 or 1, default 0) for the data directory: the medians and their ratio.

``TW_BENCH_EMBEDDED_ONLY`` (a comma list of throughput, burst, lateness, idle, exactly-once) runs
some of them; exactly-once runs only when named.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from timerwheel import SimulatedClock, Timer, TimerClient, TimerConfig
from timerwheel.records import OutRecord
from timerwheel.runtime.embedded import EmbeddedTimerwheel
from timerwheel.transports.local.log import LocalCommitLog

from bench.baseline import Code, codes
from bench.common import emit, peak_rss_mb, say
from bench.lateness import DELAYS_MS, DUE_MODES, Arrival, counts, describe, due_time, rounded, three_way

START = 1_700_000_000_000


def fill(tw: EmbeddedTimerwheel, n: int, deliver_at: int) -> None:
    batch = 5_000
    for i in range(0, n, batch):
        tw.schedule_many([Timer("dest", b"x" * 100, key=str(j).encode(), deliver_at_ms=deliver_at)
                          for j in range(i, min(n, i + batch))])


def fill_timer_topic(log: LocalCommitLog, config: TimerConfig, clock: SimulatedClock, n: int) -> None:
    """n timer records as a producer writes them (100-byte value, a key, three tw-* headers), all
    due at START + 100."""
    client = TimerClient(log, config, clock)
    for i in range(0, n, 5_000):
        client.schedule_many([Timer("dest", b"x" * 100, key=str(j).encode(), deliver_at_ms=START + 100)
                              for j in range(i, min(n, i + 5_000))])


def _move(log: LocalCommitLog, topic: str, partitions: int, n: int, batch: int) -> float:
    """Read n records of ``topic`` and write them unchanged to another topic, in batches:
    records/s. Closes ``log``."""
    consumer = log.consumer(topic, dict.fromkeys(range(partitions), 0))
    t0 = time.perf_counter()
    moved = 0
    while moved < n:
        records = consumer.poll(batch, 0.1)
        log.append([OutRecord("dst", r.key, r.value, r.headers) for r in records])
        moved += len(records)
    elapsed = time.perf_counter() - t0
    consumer.close()
    log.close()
    return n / elapsed


def pass_through(directory: Path, config: TimerConfig, n: int) -> float:
    """The same n timer records read from the timer topic and written unchanged to another
    topic, in batches of ``batch_size``: what the pipeline's commit-log work would cost alone."""
    clock = SimulatedClock(START)
    log = LocalCommitLog(directory, fsync=False, clock=clock)
    log.ensure_topic(config.timer_topic, config.timer_partitions)
    fill_timer_topic(log, config, clock, n)
    return _move(log, config.timer_topic, config.timer_partitions, n, config.batch_size)


def pass_through_one_header(directory: Path, n: int) -> float:
    """The baseline of the earlier sessions, for comparison: records of one partition with one
    small header instead of the timer records' three (lighter to decode and encode)."""
    log = LocalCommitLog(directory, fsync=False)
    log.ensure_topic("src", 1)
    for i in range(0, n, 5_000):
        log.append([OutRecord("src", str(j).encode(), b"x" * 100, (("h", b"v"),)) for j in range(i, min(n, i + 5_000))])
    return _move(log, "src", 1, n, 500)


def delivered_count(tw: EmbeddedTimerwheel, topic: str) -> int:
    return int(tw.metrics.counter("delivered", topic=topic))


def pipeline_rate(config: TimerConfig, n: int) -> tuple[float, float]:
    """The embedded pipeline delivering n messages all due at once: (messages/s, seconds)."""
    clock = SimulatedClock(START)
    # Fill the timer topic before the engine starts, so only the pipeline is timed.
    log = LocalCommitLog(Path(config.data_dir) / "log", fsync=False, clock=clock)
    fill_timer_topic(log, config, clock, n)
    log.close()
    clock.advance(1_000)
    t0 = time.perf_counter()
    tw = EmbeddedTimerwheel(config=config, clock=clock)
    while delivered_count(tw, "dest") < n:
        clock.advance(100)  # already due: each tick's slot fires as soon as it closes
        time.sleep(0.01)
    elapsed = time.perf_counter() - t0
    tw.close()
    return n / elapsed, elapsed


def throughput(n: int = 100_000, rounds: int = 3) -> None:
    """``rounds`` rounds of the pipeline and both pass-throughs, one after the other (this
    machine's noise moves every figure by up to 30 % from one minute to the next, so each
    ratio compares runs made seconds apart); the medians are the figures."""
    tmp = Path(tempfile.mkdtemp(prefix="tw-bench-"))
    rates, bases, lights, ratios, ratios_light, seconds = [], [], [], [], [], []
    try:
        for k in range(rounds):
            config = TimerConfig(data_dir=str(tmp / f"tw-{k}"), tick_ms=100, roll_window_ms=86_400_000, shards=2,
                                 fsync=False)
            rate, elapsed = pipeline_rate(config, n)
            base = pass_through(tmp / f"plain-{k}", config, n)
            light = pass_through_one_header(tmp / f"light-{k}", n)
            say(f"round {k + 1}: embedded pipeline {rate:,.0f} msg/s; plain LocalCommitLog pass-through of the same "
                f"records {base:,.0f} msg/s: ratio {rate / base:.3f} (of one-header records, the earlier "
                f"baseline: {light:,.0f} msg/s)")
            rates.append(rate)
            bases.append(base)
            lights.append(light)
            ratios.append(rate / base)
            ratios_light.append(rate / light)
            seconds.append(elapsed)
            for name in (f"tw-{k}", f"plain-{k}", f"light-{k}"):
                shutil.rmtree(tmp / name, ignore_errors=True)
        emit("embedded.throughput", statistics.median(rates), "messages/s", messages=n, rounds=rounds,
             passthrough_per_s=round(statistics.median(bases)), ratio=round(statistics.median(ratios), 3),
             ratio_min=round(min(ratios), 3), ratio_max=round(max(ratios), 3),
             passthrough_one_header_per_s=round(statistics.median(lights)),
             ratio_one_header=round(statistics.median(ratios_light), 3), seconds=round(statistics.median(seconds), 2))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def guarantees(n: int, rounds: int, fsync: bool) -> None:
    """``embedded.exactly_once``: the pipeline's rate at least once and exactly once, alternately."""
    tmp = Path(tempfile.mkdtemp(prefix="tw-bench-eo-"))
    rates: dict[str, list[float]] = {"at-least-once": [], "exactly-once": []}
    try:
        for k in range(rounds):
            for guarantee, got in rates.items():
                config = TimerConfig(data_dir=str(tmp / f"{guarantee}-{k}"), tick_ms=100, roll_window_ms=86_400_000,
                                     shards=2, fsync=fsync, delivery_guarantee=guarantee)
                rate, elapsed = pipeline_rate(config, n)
                got.append(rate)
                say(f"round {k + 1}: {guarantee}, fsync {fsync}: {rate:,.0f} msg/s ({elapsed:.2f} s for {n:,})")
                shutil.rmtree(tmp / f"{guarantee}-{k}", ignore_errors=True)
        alo, eo = (statistics.median(rates[g]) for g in ("at-least-once", "exactly-once"))
        emit("embedded.exactly_once", eo, "messages/s", messages=n, rounds=rounds, fsync=fsync,
             at_least_once_per_s=round(alo), ratio=round(eo / alo, 3))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def burst_child(n: int) -> None:
    """Runs in a child process so that its peak RSS is its own."""
    tmp = Path(tempfile.mkdtemp(prefix="tw-burst-"))
    try:
        clock = SimulatedClock(START)
        with EmbeddedTimerwheel(tmp, clock=clock, tick_ms=100, roll_window_ms=86_400_000, shards=2, fsync=False) as tw:
            t0 = time.perf_counter()
            fill(tw, n, START + 50)
            scheduled_s = time.perf_counter() - t0
            tw.wait_idle(600)
            clock.advance(200)
            t1 = time.perf_counter()
            while delivered_count(tw, "dest") < n:
                time.sleep(0.05)
            drain = time.perf_counter() - t1
        emit("embedded.burst", n / drain, "messages/s", messages=n, drain_s=round(drain, 2),
             enqueue_s=round(scheduled_s, 2), peak_rss_mb=round(peak_rss_mb(), 1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def lateness(rate: int, seconds: int, due_mode: str, code_name: str = "current",
             settings: dict[str, str] | None = None) -> None:
    """``rate`` msg/s for ``seconds``, delays 2-10 s shaped by ``due_mode``, on the system clock;
    a consumer thread of this process polls the destination continuously (a user of embedded
    mode reads in its own process): lateness by ``tw-delivered-at``, by the local log's record
    timestamp and by the time the consumer got the record. ``settings``: ``TW_*`` variables of
    the variant measured (``bench.baseline``)."""
    tmp = Path(tempfile.mkdtemp(prefix="tw-late-"))
    rng = random.Random(1)
    try:
        config = TimerConfig.from_env(settings or {})
        with EmbeddedTimerwheel(tmp, config=config, tick_ms=100, roll_window_ms=3_600_000, shards=2,
                                fsync=True) as tw:
            log = tw.commit_log
            consumer = log.consumer("late", dict.fromkeys(range(log.partitions("late")), 0))
            arrivals: list[Arrival] = []
            stop = threading.Event()

            def receive() -> None:
                while not stop.is_set():
                    records = consumer.poll(10_000, 0.1)
                    received = int(time.time() * 1000)
                    for r in records:
                        at = r.header("tw-delivered-at")
                        arrivals.append(Arrival((r.header("tw-id") or b"").decode(), int(at) if at else None,
                                                r.timestamp_ms, received))

            reader = threading.Thread(target=receive, name="bench-receiver", daemon=True)
            reader.start()
            due: dict[str, int] = {}
            t0 = time.monotonic()
            sent = 0
            while time.monotonic() - t0 < seconds:
                target = int((time.monotonic() - t0) * rate)
                if target > sent:
                    k = target - sent
                    at = [due_time(int(time.time() * 1000), rng.randint(*DELAYS_MS), due_mode) for _ in range(k)]
                    tickets = tw.schedule_many([Timer("late", b"x" * 100, deliver_at_ms=a) for a in at])
                    for t in tickets:
                        due[t.message_id] = t.deliver_at_ms
                    sent += k
                time.sleep(0.005)
            deadline = time.monotonic() + DELAYS_MS[1] / 1000 + 30
            while len(arrivals) < sent and time.monotonic() < deadline:
                time.sleep(0.05)
            stop.set()
            reader.join(5)
            consumer.close()
        result = three_way(due, arrivals)
        c = counts(due, arrivals)
        say(f"embedded lateness, {code_name}, due {due_mode}, {rate} msg/s for {seconds} s: {describe(result)}")
        ways = rounded(result)
        emit("embedded.lateness.p99", ways["timestamp"]["p99"], "ms", p50=ways["timestamp"]["p50"],
             max=ways["timestamp"]["max"], early=ways["timestamp"]["early"], ways=ways, due=due_mode,
             scheduled=sent, delivered=c["delivered"], lost=c["lost"], duplicated=c["duplicated"], tick_ms=100,
             rate_per_s=rate, seconds=seconds, delays_ms=list(DELAYS_MS), code=code_name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def idle(seconds: float, code: Code) -> float:
    """CPU of an idle ``timerwheel run --embedded`` of ``code``, in % of one core; emits
    ``embedded.idle.cpu``."""
    import psutil

    tmp = Path(tempfile.mkdtemp(prefix="tw-idle-"))
    proc = subprocess.Popen([sys.executable, "-m", "timerwheel.cli", "run", "--embedded", "--data-dir", str(tmp)],
                            env={**code.env(), "TW_LOG_LEVEL": "WARNING"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        time.sleep(5)  # settle: the shards made, the first checkpoints written
        process = psutil.Process(proc.pid)
        times = process.cpu_times()
        before, started = times.user + times.system, time.monotonic()
        time.sleep(seconds)  # the measured window: nothing is sent
        times = process.cpu_times()
        cpu = round(100 * (times.user + times.system - before) / (time.monotonic() - started), 2)
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"idle CPU of timerwheel run --embedded over {seconds:.0f} s: {cpu} % of a core")
    emit("embedded.idle.cpu", cpu, "% of a core", seconds=round(seconds), tick_ms=100, shards=1, code=code.name)
    return cpu


def lateness_runs(rate: int, seconds: int, modes: list[str]) -> None:
    """Each due mode, each code (current, then the baseline's: alternately), each in a process of
    its own whose PYTHONPATH says which timerwheel it imports (``bench.baseline``)."""
    root = Path(__file__).resolve().parent.parent
    for mode in modes:
        for code in codes():
            subprocess.run([sys.executable, "-c", f"from bench.bench_embedded import lateness; "
                            f"lateness({rate}, {seconds}, {mode!r}, {code.name!r}, {dict(code.settings)!r})"],
                           check=True, cwd=root, env=code.env())


def main() -> None:
    only = set(os.environ.get("TW_BENCH_EMBEDDED_ONLY", "throughput,burst,lateness,idle").split(","))
    if "throughput" in only:
        throughput(int(os.environ.get("TW_BENCH_MESSAGES", "100000")), int(os.environ.get("TW_BENCH_ROUNDS", "3")))
    if "burst" in only:
        n = int(os.environ.get("TW_BENCH_BURST", "1000000"))
        say(f"burst of {n:,} messages due in one tick (child process, for its own peak RSS)")
        subprocess.run([sys.executable, "-c", f"from bench.bench_embedded import burst_child; burst_child({n})"],
                       check=True, cwd=Path(__file__).resolve().parent.parent)
    if "lateness" in only:
        modes = [x.strip() for x in os.environ.get("TW_BENCH_DUE", "").split(",") if x.strip()] or list(DUE_MODES)
        lateness_runs(int(os.environ.get("TW_BENCH_EMBEDDED_RATE", "1000")),
                      int(os.environ.get("TW_BENCH_SECONDS", "60")), modes)
    if "exactly-once" in only:
        guarantees(int(os.environ.get("TW_BENCH_MESSAGES", "100000")), int(os.environ.get("TW_BENCH_ROUNDS", "3")),
                   os.environ.get("TW_BENCH_FSYNC", "0") == "1")
    if "idle" in only:
        for code in codes():
            idle(float(os.environ.get("TW_BENCH_IDLE_SECONDS", "30")), code)


if __name__ == "__main__":
    main()
