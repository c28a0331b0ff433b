"""timerwheel side by side with a peer: ``python -m bench peers``.

The peer is etf1/kafka-message-scheduler v0.0.9 (Go, confluent-kafka-go; one in-memory Go timer
per schedule of the current day, its state in its schedules topic), built by
``scripts/peers.sh path etf1`` from the Go module proxy and cached outside the work tree. Its
wire contract, from its source (``schedule/kafka/schedule.go``, ``runner/kafka/handler.go``): a
schedule is a record on the schedules topic whose key is the schedule's id (a key seen again
replaces it, an empty value deletes it), with headers ``scheduler-epoch`` (due time, in whole
seconds), ``scheduler-target-topic`` and ``scheduler-target-key``; when due it produces the value
and the original headers to the target topic, a tombstone to the schedules topic and a copy to a
history topic. It is run with ``LOG_LEVEL=warning`` (it logs each message at info) and
``partitioner: murmur2_random`` (its README: the partitioner of a Java or Python producer, so
that the tombstone lands on its schedule's partition), ``TZ=UTC`` (it plans the current day).

timerwheel is production mode: the five stage processes (``bench.bench_production.new_pipeline``),
on the same Kafka (``scripts/kafka.sh``) and with Redis (``scripts/redis.sh``). Each row runs each
system in turn on fresh topics with the same load generator (``bench.load``) and the same
consumer (``bench.receiver``): timerwheel, the baseline revision when ``TW_BENCH_BASELINE`` names
one, then etf1. Lateness by the destination record's Kafka timestamp and by the consumer's
receive time (and timerwheel's ``tw-delivered-at``).

Rows (``TW_BENCH_PEERS_ONLY``, a comma list; sizes from ``TW_BENCH_PEERS_*``; each row runs its
systems ``TW_BENCH_PEERS_ROUNDS`` (1) times, alternately; ``TW_BENCH_PEERS_SYSTEMS`` picks them):

timerwheel runs ``DEQUEUE_PUT`` (1) dequeue-put replicas (``dequeue-put#2``, ...): the stage that
appends the deliveries, which the operator's autoscaling scales out ahead of a scheduled spike.

* ``steady``: ``RATE`` (500) msg/s for ``SECONDS`` (60), delays 2-10 s, due on whole seconds.
* ``burst``: ``BURST`` (20,000) messages due in one second, written ``BURST_AHEAD_S`` (20) before.
* ``kill``: ``KILL_RATE`` (200) msg/s for ``KILL_SECONDS`` (40), delays 2-10 s, whole seconds;
  ``KILL_AT_S`` (15) into it kill -9 of the scheduler (timerwheel: all five stage processes at
  once, or each in turn 3 s apart with ``TW_BENCH_PEERS_KILL=each``), restarted ``KILL_DOWN_S`` (3)
  later: lost, duplicated, early, lateness.
* ``idle``: the system started and warmed up, no traffic for ``IDLE_SECONDS`` (15): CPU of its
  processes in % of a core (timerwheel: the five stage processes; Redis apart).
* ``pending``: RSS of the system's processes before and after ``PENDING`` (200,000) schedules due
  30 minutes ahead (at most to 23:50 UTC: etf1 keeps only the current day in memory), once all
  are taken in (timerwheel: in the TimerLogs; etf1: its planned counter): bytes per pending.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil
from kafka import KafkaAdminClient
from kafka.admin import NewTopic

from bench.baseline import CURRENT, Code, codes
from bench.bench_production import PARTITIONS, close, new_pipeline, servers
from bench.common import emit, say
from bench.lateness import WARM_UP_PREFIX, counts, describe, rounded, three_way
from bench.load import Etf1Wire, TimerwheelWire, Wire, fill, now_ms
from bench.receiver import Receiver
from bench.steady import steady

ROOT = Path(__file__).resolve().parent.parent
ROWS = ("steady", "burst", "kill", "idle", "pending")


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(f"TW_BENCH_PEERS_{name}", "") or default)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class System(Protocol):
    """One scheduler under test, started on fresh topics."""

    name: str
    kafka: str
    wire: Wire
    dest: str
    options: dict[str, Any]

    def processes(self) -> dict[str, int]:
        """Its processes' pids by name."""
        ...

    def tail(self) -> str: ...

    def close(self) -> None: ...

    def kill_groups(self, mode: str) -> list[list[str]]: ...

    def kill(self, names: list[str]) -> None: ...

    def restart(self, names: list[str]) -> None: ...

    def pending_taken_in(self) -> int:
        """Schedules taken in so far (counted from the system's start)."""
        ...

    def side_memory_kb(self) -> int:
        """Memory a system keeps outside its own processes (timerwheel: Redis), in KiB."""
        ...


# -- timerwheel ----------------------------------------------------------------------------------

STAGE_ORDER = ("enqueue-put", "enqueue-get", "dequeue-get", "dequeue-getmsg", "dequeue-put")


class Timerwheel:
    def __init__(self, kafka: str, redis_url: str, code: Code) -> None:
        replicas = _env_int("DEQUEUE_PUT", 1)
        self.name = "timerwheel" if code == CURRENT else f"timerwheel ({code.name})"
        if replicas > 1:
            self.name += f" x{replicas} dequeue-put"
        #: The stage processes, in start order: the five, then the further dequeue-put replicas.
        self.stages = (*STAGE_ORDER, *(f"dequeue-put#{i}" for i in range(2, replicas + 1)))
        self.kafka = kafka
        self.pipe = new_pipeline(kafka, redis_url, code=code, tick_ms=100, batch_size=200)  # max_in_flight: 20,000
        self.dest = self.pipe.dest("peers")
        try:
            self.pipe.create_timer_topic()
            self.pipe.create_topic(self.dest, PARTITIONS)
            self.pipe.start_all(120)
            for name in self.stages[len(STAGE_ORDER):]:
                self.pipe.start(name, timeout_s=120)
        except BaseException:
            close(self.pipe)
            raise
        self.wire: Wire = TimerwheelWire(self.pipe.timer_topic, self.dest, PARTITIONS)
        self.options = self.pipe.kafka_options

    def processes(self) -> dict[str, int]:
        return {name: self.pipe.procs[name].pid for name in self.stages}

    def tail(self) -> str:
        return str(self.pipe.tails())

    def kill_groups(self, mode: str) -> list[list[str]]:
        return [[name] for name in self.stages] if mode == "each" else [list(self.stages)]

    def kill(self, names: list[str]) -> None:
        for name in names:
            os.kill(self.pipe.procs[name].pid, signal.SIGKILL)
        for name in names:
            self.pipe.kill(name)  # reaps it (SIGKILL again to a dead process, then wait)

    def restart(self, names: list[str]) -> None:
        for name in self.stages:  # enqueue-put first: it opens the shards the others read
            if name in names:
                self.pipe.start(name, wait_ready=False)

    def pending_taken_in(self) -> int:
        return sum(sum(self.pipe.checkpoint(s)["next_offsets"].values()) for s in range(2))

    def side_memory_kb(self) -> int:
        """Redis's ``used_memory``: the queues between the stages."""
        return int(self.pipe.redis.info("memory")["used_memory"]) // 1024

    def close(self) -> None:
        close(self.pipe)


# -- etf1/kafka-message-scheduler ----------------------------------------------------------------


def etf1_binary() -> str:
    done = subprocess.run([str(ROOT / "scripts" / "peers.sh"), "path", "etf1"], capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"scripts/peers.sh path etf1 failed:\n{done.stderr}")
    return str(done.stdout).strip().splitlines()[-1]


class Etf1:
    """etf1/kafka-message-scheduler on its own schedules, target and history topics."""

    name = "etf1/kafka-message-scheduler"

    def __init__(self, kafka: str, binary: str) -> None:
        uid = os.urandom(4).hex()
        self.kafka, self.binary = kafka, binary
        self.schedules, self.dest, self.history = f"etf1-schedules-{uid}", f"etf1-dest-{uid}", f"etf1-history-{uid}"
        admin = KafkaAdminClient(bootstrap_servers=kafka, client_id=f"bench-etf1-{uid}")
        try:
            admin.create_topics([NewTopic(t, PARTITIONS, 1) for t in (self.schedules, self.dest, self.history)])
            deadline = time.monotonic() + 30
            while len([t for t in admin.describe_topics([self.schedules, self.dest, self.history])
                       if t["error_code"] == 0 and len(t["partitions"]) == PARTITIONS]) < 3:
                if time.monotonic() > deadline:
                    raise RuntimeError("etf1: its topics not visible 30 s after they were created")
                time.sleep(0.1)
        finally:
            admin.close()
        self.work = Path(tempfile.mkdtemp(prefix="tw-bench-etf1-"))
        config = self.work / "config.yaml"
        config.write_text("kafka.producer.configuration:\n    partitioner: murmur2_random\n")
        self.metrics_port = free_port()
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("TW_")},
                    "BOOTSTRAP_SERVERS": kafka, "SCHEDULES_TOPICS": self.schedules, "HISTORY_TOPIC": self.history,
                    "GROUP_ID": f"bench-etf1-{uid}", "CONFIGURATION_FILE": str(config), "LOG_LEVEL": "warning",
                    "METRICS_ADDR": f"127.0.0.1:{self.metrics_port}", "SERVER_ADDR": f"127.0.0.1:{free_port()}",
                    "TZ": "UTC"}
        self.wire: Wire = Etf1Wire(self.schedules, self.dest)
        self.options: dict[str, Any] = {}
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = (self.work / "etf1.log").open("ab")
        self._start()

    def _start(self) -> None:
        self.proc = subprocess.Popen([self.binary], cwd=self.work, env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def processes(self) -> dict[str, int]:
        assert self.proc is not None
        return {"scheduler": self.proc.pid}

    def kill_groups(self, mode: str) -> list[list[str]]:
        return [["scheduler"]]

    def kill(self, names: list[str]) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def restart(self, names: list[str]) -> None:
        self._start()

    def metric(self, kind: str) -> int:
        """``kafka_scheduler_event_total`` of one event type (0 before the first)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as resp:
                body = resp.read().decode()
        except OSError:
            return 0
        for line in body.splitlines():
            if line.startswith("kafka_scheduler_event_total{") and f'type="kafka_scheduler_{kind}_schedule"' in line:
                return int(float(line.rsplit(" ", 1)[1]))
        return 0

    def pending_taken_in(self) -> int:
        return self.metric("planned")

    def side_memory_kb(self) -> int:
        return 0

    def tail(self) -> str:
        return "\n".join((self.work / "etf1.log").read_text(errors="replace").splitlines()[-20:])

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        shutil.rmtree(self.work, ignore_errors=True)


# -- running a row -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Env:
    kafka: str
    redis_url: str
    etf1: str  # the binary


SYSTEMS = ("timerwheel", "etf1")


def systems(env: Env) -> list[Callable[[], System]]:
    """Openers of the systems ``TW_BENCH_PEERS_SYSTEMS`` names (default both), in the order each
    row runs them: timerwheel, its baseline (``TW_BENCH_BASELINE``), etf1."""
    names = [x.strip() for x in os.environ.get("TW_BENCH_PEERS_SYSTEMS", "").split(",") if x.strip()] or SYSTEMS
    unknown = [x for x in names if x not in SYSTEMS]
    if unknown:
        raise SystemExit(f"TW_BENCH_PEERS_SYSTEMS: unknown {', '.join(unknown)} (choose from {', '.join(SYSTEMS)})")
    out: list[Callable[[], System]] = []
    if "timerwheel" in names:
        out += [_timerwheel(env, code) for code in codes()]
    if "etf1" in names:
        out.append(lambda: Etf1(env.kafka, env.etf1))
    return out * _env_int("ROUNDS", 1)  # rounds alternate: timerwheel, etf1, timerwheel, etf1, ...


def _timerwheel(env: Env, code: Code) -> Callable[[], System]:
    return lambda: Timerwheel(env.kafka, env.redis_url, code)


@contextmanager
def opened(opener: Callable[[], System]) -> Iterator[System]:
    system = opener()
    try:
        warm_up(system)
        yield system
    finally:
        system.close()


def warm_up(system: System, timeout_s: float = 90.0) -> None:
    """One message due at the next whole second but one, waited for: the system reads, plans and
    delivers (etf1's consumer group is assigned; timerwheel's stages own their shards)."""
    with Receiver(system.kafka, [system.dest], system.options) as rx:
        fill(system.kafka, system.wire, 1, math.ceil(now_ms() / 1000) * 1000 + 2000, prefix=WARM_UP_PREFIX,
             options=system.options)
        if not rx.wait_for(1, timeout_s):
            raise RuntimeError(f"{system.name}: the warm-up message not delivered within {timeout_s:.0f} s\n"
                               f"{system.tail()}")


def emit_row(row: str, system: System, result: dict[str, Any], **extra: Any) -> None:
    ways = result["lateness"]
    emit(f"peers.{row}", ways["timestamp"]["p99"], "ms", system=system.name, p50=ways["timestamp"]["p50"],
         max=ways["timestamp"]["max"], received_p50=ways["received"]["p50"], received_p99=ways["received"]["p99"],
         received_max=ways["received"]["max"],
         **{k: v for k, v in result.items() if k not in ("summary",)}, **extra)


def row_steady(env: Env) -> None:
    rate, seconds = _env_int("RATE", 500), float(_env_int("SECONDS", 60))
    for opener in systems(env):
        with opened(opener) as system:
            result = steady(system.kafka, system.wire, system.dest, rate, seconds, "whole_second",
                            options=system.options)
        say(f"steady, {system.name}: {result['summary']}; lost {result['lost']}, duplicated {result['duplicated']}")
        emit_row("steady", system, result)


def row_burst(env: Env) -> None:
    n, ahead_s = _env_int("BURST", 20_000), _env_int("BURST_AHEAD_S", 20)
    for opener in systems(env):
        with opened(opener) as system, Receiver(system.kafka, [system.dest], system.options) as rx:
            due_ms = math.ceil(now_ms() / 1000) * 1000 + ahead_s * 1000
            t0 = time.monotonic()
            due = fill(system.kafka, system.wire, n, due_ms, options=system.options)
            fill_s = time.monotonic() - t0
            rx.wait_for(n, ahead_s + 300)
            rx.wait_quiet(2.0, 10.0)
            arrivals = rx.arrivals()
        result = three_way(due, arrivals)
        c = counts(due, arrivals)
        say(f"burst of {n:,} due in one second, {system.name}: {describe(result)}; {c}; written in {fill_s:.1f} s")
        emit_row("burst", system, {"lateness": rounded(result), **c, "messages": n, "written_s": round(fill_s, 1),
                                   "written_ahead_s": ahead_s})


def kill(system: System, names: list[str]) -> None:
    system.kill(names)
    say(f"kill -9 of {system.name}: {', '.join(names)}")


def restart(system: System, names: list[str]) -> None:
    system.restart(names)
    say(f"restarted {system.name}: {', '.join(names)}")


def row_kill(env: Env) -> None:
    rate, seconds = _env_int("KILL_RATE", 200), float(_env_int("KILL_SECONDS", 40))
    at_s, down_s = float(_env_int("KILL_AT_S", 15)), float(_env_int("KILL_DOWN_S", 3))
    mode = os.environ.get("TW_BENCH_PEERS_KILL", "all")
    if mode not in ("all", "each"):
        raise SystemExit(f"TW_BENCH_PEERS_KILL must be all or each, got {mode!r}")
    for opener in systems(env):
        with opened(opener) as system:
            events: list[tuple[float, Callable[[], None]]] = []
            for k, group in enumerate(system.kill_groups(mode)):
                events.append((at_s + 3 * k, functools.partial(kill, system, group)))
                events.append((at_s + 3 * k + down_s, functools.partial(restart, system, group)))
            result = steady(system.kafka, system.wire, system.dest, rate, seconds, "whole_second",
                            options=system.options, events=events, settle_s=60.0, prefix="k")
        say(f"kill -9 ({mode}) at {at_s:.0f} s, back {down_s:.0f} s later, {system.name}: lost {result['lost']}, "
            f"duplicated {result['duplicated']}; {result['summary']}")
        emit_row("kill", system, result, kill=mode, kill_at_s=at_s, down_s=down_s)


def _cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def _status_kb(pid: int, field: str) -> int:
    """A ``/proc/PID/status`` memory field in KiB (VmRSS: resident; RssAnon: its anonymous part,
    without the file pages a process maps, such as timerwheel's wheel and TimerLog)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    return 0


def _memory_kb(procs: dict[str, int]) -> dict[str, dict[str, int]]:
    return {name: {"rss": _status_kb(pid, "VmRSS"), "anon": _status_kb(pid, "RssAnon")} for name, pid in procs.items()}


def row_idle(env: Env) -> None:
    seconds = float(_env_int("IDLE_SECONDS", 15))
    for opener in systems(env):
        with opened(opener) as system:
            time.sleep(3)  # the warm-up's aftermath
            pids = list(system.processes().values())
            before, t0 = _cpu_s(pids), time.monotonic()
            time.sleep(seconds)
            cpu = 100 * (_cpu_s(pids) - before) / (time.monotonic() - t0)
        say(f"idle, {system.name}: {cpu:.2f} % of a core over {seconds:.0f} s ({len(pids)} processes)")
        emit("peers.idle", round(cpu, 2), "% of a core", system=system.name, processes=len(pids), seconds=seconds)


def pending_due_ms() -> int:
    """30 minutes ahead, but not past 23:50 UTC (etf1 keeps the current day only)."""
    now = now_ms()
    day_end = (now // 86_400_000 + 1) * 86_400_000
    return min(now + 1_800_000, day_end - 600_000) // 1000 * 1000


def row_pending(env: Env) -> None:
    n = _env_int("PENDING", 200_000)
    for opener in systems(env):
        with opened(opener) as system:
            time.sleep(3)
            procs = system.processes()
            idle = _memory_kb(procs)
            idle_side = system.side_memory_kb()
            due_ms = pending_due_ms()
            if due_ms - now_ms() < 300_000:
                say("pending: skipped, less than 10 minutes left of the UTC day (etf1 plans the current day only)")
                return
            base = system.pending_taken_in()
            t0 = time.monotonic()
            fill(system.kafka, system.wire, n, due_ms, prefix="p", options=system.options)
            while system.pending_taken_in() - base < n:
                if time.monotonic() - t0 > 600:
                    raise RuntimeError(f"pending, {system.name}: {system.pending_taken_in() - base} of {n} taken in "
                                       f"after 600 s")
                time.sleep(0.5)
            taken_s = time.monotonic() - t0
            time.sleep(2)
            pending = _memory_kb(procs)
            pending_side = system.side_memory_kb()

        def total(memory: dict[str, dict[str, int]], kind: str) -> int:
            return sum(m[kind] for m in memory.values())

        per_schedule = (total(pending, "rss") - total(idle, "rss")) * 1024 / n
        anon_per_schedule = (total(pending, "anon") - total(idle, "anon")) * 1024 / n
        side_per_schedule = (pending_side - idle_side) * 1024 / n
        say(f"pending, {system.name}: RSS {total(idle, 'rss') / 1024:.0f} MiB idle, "
            f"{total(pending, 'rss') / 1024:.0f} MiB with {n:,} pending ({per_schedule:,.0f} B each; anonymous "
            f"{anon_per_schedule:,.0f} B each; Redis {side_per_schedule:,.0f} B each), taken in in {taken_s:.1f} s")
        emit("peers.pending", round(per_schedule), "bytes of RSS per pending schedule", system=system.name,
             pending=n, anon_bytes_per_pending=round(anon_per_schedule), redis_bytes_per_pending=round(side_per_schedule),
             rss_idle_mb=round(total(idle, "rss") / 1024, 1), rss_pending_mb=round(total(pending, "rss") / 1024, 1),
             anon_idle_mb=round(total(idle, "anon") / 1024, 1), anon_pending_mb=round(total(pending, "anon") / 1024, 1),
             rss_pending_per_process_mb={k: round(v["rss"] / 1024, 1) for k, v in pending.items()},
             taken_in_s=round(taken_s, 1))


def main() -> None:
    names = [x.strip() for x in os.environ.get("TW_BENCH_PEERS_ONLY", "").split(",") if x.strip()] or list(ROWS)
    unknown = [x for x in names if x not in ROWS]
    if unknown:
        raise SystemExit(f"TW_BENCH_PEERS_ONLY: unknown {', '.join(unknown)} (choose from {', '.join(ROWS)})")
    kafka, redis_url = servers()
    env = Env(kafka, redis_url, etf1_binary())
    rows = {"steady": row_steady, "burst": row_burst, "kill": row_kill, "idle": row_idle, "pending": row_pending}
    for name in names:
        t0 = time.monotonic()
        rows[name](env)
        say(f"peers {name}: {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
