"""The commands that run the service: ``run`` (all five stages in one process), ``stage`` (one
stage, production mode) and ``demo``. The processes themselves are ``runtime.process``.

The runtime is imported by the command that runs it, as in every command module: a client
command such as ``schedule`` starts without loading the stages."""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from timerwheel.cli.common import (
    CliError,
    build_config,
    config_args,
    described,
    duration,
    hidden_alias,
    with_stored_settings,
)
from timerwheel.client import Timer
from timerwheel.config import TimerConfig
from timerwheel.errors import ConfigError

if TYPE_CHECKING:
    from timerwheel.runtime.health import HealthServer

#: ``timerwheel.stages.STAGE_NAMES``, not imported here: parsing a command line needs no stage.
STAGE_NAMES = ("enqueue-get", "enqueue-put", "dequeue-get", "dequeue-getmsg", "dequeue-put")


def add_run(sub: Any) -> None:
    p = sub.add_parser("run", help="run all five stages in one process",
                       **described(
                           "Run all five stages in one process until SIGINT / SIGTERM: embedded (the default) on the "
                           "data directory's local commit log and in-process queues, or with --kafka and --redis on "
                           "the production transports. TW_HTTP_PORT serves /healthz, /readyz, /metrics.\n\n"
                           "A data directory that was run before keeps its stored settings (timerwheel.json: shard "
                           "count, tick, roll window, timer topic): they are used unless a flag or TW_* variable asks "
                           "for another value, which is refused.",
                           "timerwheel run --embedded --data-dir ./data",
                           "timerwheel run --data-dir ./data --shards 4 --tick-ms 10",
                           "timerwheel run --kafka localhost:9092 --redis redis://localhost:6379/0 --data-dir ./data-prod"))
    p.add_argument("--embedded", action="store_true", help="local commit log and in-process queues (default)")
    p.add_argument("--kafka", metavar="BOOTSTRAP", help="Kafka bootstrap servers (production transports, with --redis)")
    p.add_argument("--redis", metavar="URL", help="Redis URL (production transports, with --kafka)")
    config_args(p)
    p.set_defaults(handler=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    from timerwheel.runtime.process import run_all_in_one

    if args.kafka or args.redis:
        if not (args.kafka and args.redis):
            raise CliError("--kafka and --redis go together")
        cfg = with_stored_settings(build_config(args, kafka_bootstrap=args.kafka, redis_url=args.redis), args)
        return run_all_in_one(cfg, production=True)
    cfg = build_config(args)
    data = Path(cfg.data_dir)
    if data.exists() and not data.is_dir():
        raise CliError(f"--data-dir: {data} is not a directory")
    cfg = with_stored_settings(cfg, args)

    def started(server: HealthServer | None) -> None:
        tw_cmd, where = _self_command(), shlex.quote(str(data.absolute()))
        sys.stderr.write(
            f"timerwheel (embedded) is running with data in {where}. From another terminal:\n"
            f"  {tw_cmd} schedule --data-dir {where} --topic orders --delay 5s --value hello\n"
            f"  {tw_cmd} consume  --data-dir {where} --topic orders --follow\n"
            f"  {tw_cmd} inspect  --data-dir {where}\n"
            + (f"Health and metrics: http://127.0.0.1:{server.port}/metrics (/healthz, /readyz).\n" if server else "")
            + "Stop with Ctrl-C.\n")

    return run_all_in_one(cfg, production=False, started=started)


def _self_command() -> str:
    """How to call this very ``timerwheel`` from a new terminal: its name if PATH finds it, else its path."""
    script = Path(sys.executable).parent / "timerwheel"
    on_path = shutil.which("timerwheel")
    if on_path and script.exists() and Path(on_path).resolve() == script.resolve():
        return "timerwheel"
    if script.exists():
        return shlex.quote(str(script.absolute()))
    return f"{shlex.quote(sys.executable)} -m timerwheel.cli"


def add_stage(sub: Any) -> None:
    p = sub.add_parser("stage", help="run one stage as its own process (production mode, see README)",
                       **described(
                           "Run one stage as its own process until SIGTERM, configured by TW_* variables only (the "
                           "README lists them all).\n\n"
                           "Needs: TW_KAFKA_BOOTSTRAP and TW_REDIS_URL; TW_DATA_DIR, the volume every stage of the "
                           "deployment shares (the shards: enqueue-put writes them, dequeue-get reads them). The same "
                           "on every stage of one deployment: TW_SHARDS, TW_TICK_MS, TW_ROLL_WINDOW_MS, "
                           "TW_WHEEL_SPAN_MS, TW_TIMER_TOPIC, TW_DLQ_TOPIC (a start with other values than the data "
                           "directory's stored ones is refused). Often set: TW_HTTP_PORT (/healthz, /readyz, "
                           "/metrics), TW_KAFKA_SECURITY_PROTOCOL and the other TW_KAFKA_* / TW_REDIS_* access "
                           "settings, TW_ALLOW_TOPICS, TW_OWN_SHARDS, TW_REPLICAS and TW_REPLICA_INDEX "
                           "(enqueue-get replicas).",
                           "TW_KAFKA_BOOTSTRAP=localhost:9092 TW_REDIS_URL=redis://localhost:6379/0 "
                           "TW_DATA_DIR=./data-prod TW_SHARDS=2 timerwheel stage enqueue-get"))
    p.add_argument("name", choices=list(STAGE_NAMES), help="the stage to run")
    p.set_defaults(handler=cmd_stage)


def cmd_stage(args: argparse.Namespace) -> int:
    from timerwheel.runtime.process import run_stage

    try:
        cfg = TimerConfig.from_env(os.environ)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    return run_stage(args.name, cfg)


def add_demo(sub: Any) -> None:
    p = sub.add_parser("demo", help="schedule random timers in a temporary directory and watch them fire",
                       **described(
                           "An embedded timerwheel in a temporary directory (2 shards, 100 ms ticks) schedules "
                           "--count timers due within --max-delay, cancels one in 20, shows the deliveries as they "
                           "come, then prints how late they were (JSON).",
                           "timerwheel demo", "timerwheel demo --count 10000 --max-delay 20s"))
    p.add_argument("--count", type=int, default=3000, help="timers to schedule (default 3000)")
    p.add_argument("--max-delay", dest="max_delay_ms", type=duration, default=8_000, metavar="DURATION",
                   help="longest delay (default 8s)")
    hidden_alias(p, "--max-delay-s", type=float)
    p.set_defaults(handler=cmd_demo)


#: ``demo`` cancels one timer in this many.
CANCEL_ONE_IN = 20


def cmd_demo(args: argparse.Namespace) -> int:
    from timerwheel.runtime.embedded import EmbeddedTimerwheel

    max_delay_ms = args.max_delay_ms if args.max_delay_s is None else int(args.max_delay_s * 1000)
    if args.count < 1:
        raise CliError(f"--count: must be >= 1, got {args.count}")
    if max_delay_ms <= 200:
        raise CliError(f"--max-delay: must be over 200 ms (the shortest delay), got {max_delay_ms} ms")
    rng = random.Random()
    sys.stderr.write(
        f"demo: an embedded timerwheel in a temporary directory (2 shards, 100 ms ticks) schedules {args.count} "
        f"timers due in 0.2-{max_delay_ms / 1000:g} s, cancels one in {CANCEL_ONE_IN}, and counts the deliveries as "
        "they come; then prints how late they were (JSON).\n")
    sys.stderr.flush()
    with tempfile.TemporaryDirectory(prefix="timerwheel-demo-") as tmp, \
            EmbeddedTimerwheel(tmp, tick_ms=100, roll_window_ms=60_000, shards=2, fsync=False) as tw:
        now = tw.clock.now_ms()
        timers = []
        for i in range(args.count):
            due = now + int(rng.uniform(200, max_delay_ms))
            timers.append(Timer("demo", f"message {i}".encode(), key=str(i).encode(), deliver_at_ms=due))
        tickets = tw.schedule_many(timers)
        cancelled = {t.message_id for t in tickets[::CANCEL_ONE_IN]}
        for t in tickets:
            if t.message_id in cancelled:
                tw.cancel(t)
        expected = args.count - len(cancelled)
        due_of = {t.message_id: t.deliver_at_ms for t in tickets}
        late: list[int] = []
        seen: set[str] = set()
        consumer = tw.commit_log.consumer("demo", {p: 0 for p in range(tw.commit_log.partitions("demo"))})
        deadline = time.monotonic() + max_delay_ms / 1000 + 30
        while len(seen) < expected and time.monotonic() < deadline:
            for r in consumer.poll(5000, 0.1):
                mid = (r.header("tw-id") or b"").decode()
                seen.add(mid)
                late.append(int(r.header("tw-delivered-at") or b"0") - due_of[mid])
            bar = int(40 * len(seen) / expected)
            sys.stderr.write(f"\r[{'#' * bar}{'.' * (40 - bar)}] {len(seen)}/{expected} delivered")
            sys.stderr.flush()
        consumer.close()
        sys.stderr.write("\n")
        late.sort()
        if not late:
            print("nothing was delivered")
            return 1

        def pct(q: float) -> int:
            return late[min(len(late) - 1, int(q * len(late)))]

        print(json.dumps({"scheduled": args.count, "cancelled": len(cancelled), "delivered": len(late),
                          "early": sum(1 for x in late if x < 0), "lateness_ms": {
                              "p50": pct(0.5), "p99": pct(0.99), "max": late[-1]}}))
    return 0
