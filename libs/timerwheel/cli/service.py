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

from timerwheel.cli.common import CliError, build_config, config_args
from timerwheel.client import Timer
from timerwheel.config import TimerConfig
from timerwheel.errors import ConfigError

if TYPE_CHECKING:
    from timerwheel.runtime.health import HealthServer

#: ``timerwheel.stages.STAGE_NAMES``, not imported here: parsing a command line needs no stage.
STAGE_NAMES = ("enqueue-get", "enqueue-put", "dequeue-get", "dequeue-getmsg", "dequeue-put")


def add_run(sub: Any) -> None:
    p = sub.add_parser("run", help="run all five stages in one process", description="Run all five stages in "
                       "one process until SIGINT / SIGTERM. TW_HTTP_PORT serves /healthz, /readyz, /metrics.")
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
        return run_all_in_one(build_config(args, kafka_bootstrap=args.kafka, redis_url=args.redis), production=True)
    cfg = build_config(args)
    data = Path(cfg.data_dir)
    if data.exists() and not data.is_dir():
        raise CliError(f"--data-dir: {data} is not a directory")

    def started(server: HealthServer | None) -> None:
        tw_cmd, where = _self_command(), shlex.quote(str(data.absolute()))
        sys.stderr.write(
            f"timerwheel (embedded) is running with data in {where}. From another terminal:\n"
            f"  {tw_cmd} schedule --data-dir {where} --topic orders --delay-ms 5s --value hello\n"
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
                       description="Run one stage as its own process, configured by TW_* variables only.")
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
    p = sub.add_parser("demo", help="schedule random timers in a temporary directory and watch them fire")
    p.add_argument("--count", type=int, default=3000, help="timers to schedule (default 3000)")
    p.add_argument("--max-delay-s", type=float, default=8.0, help="longest delay in seconds (default 8)")
    p.set_defaults(handler=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from timerwheel.runtime.embedded import EmbeddedTimerwheel

    if args.count < 1:
        raise CliError(f"--count: must be >= 1, got {args.count}")
    if args.max_delay_s <= 0:
        raise CliError(f"--max-delay-s: must be > 0, got {args.max_delay_s}")
    rng = random.Random()
    sys.stderr.write(
        f"demo: an embedded timerwheel in a temporary directory (2 shards, 100 ms ticks) schedules {args.count} "
        f"timers due in 0.2-{args.max_delay_s:g} s, cancels one in 20, and counts the deliveries as they come; "
        "then prints how late they were (JSON).\n")
    sys.stderr.flush()
    with tempfile.TemporaryDirectory(prefix="timerwheel-demo-") as tmp, \
            EmbeddedTimerwheel(tmp, tick_ms=100, roll_window_ms=60_000, shards=2, fsync=False) as tw:
        now = tw.clock.now_ms()
        timers = []
        for i in range(args.count):
            due = now + int(rng.uniform(0.2, args.max_delay_s) * 1000)
            timers.append(Timer("demo", f"message {i}".encode(), key=str(i).encode(), deliver_at_ms=due))
        tickets = tw.schedule_many(timers)
        cancelled = {t.message_id for t in tickets[:: max(1, args.count // 20)]}
        for t in tickets:
            if t.message_id in cancelled:
                tw.cancel(t)
        expected = args.count - len(cancelled)
        due_of = {t.message_id: t.deliver_at_ms for t in tickets}
        late: list[int] = []
        seen: set[str] = set()
        consumer = tw.commit_log.consumer("demo", {p: 0 for p in range(tw.commit_log.partitions("demo"))})
        deadline = time.monotonic() + args.max_delay_s + 30
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
