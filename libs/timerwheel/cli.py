"""The ``timerwheel`` command.

    timerwheel run --embedded --data-dir D      serve until SIGINT / SIGTERM
    timerwheel schedule --data-dir D --topic T --delay-ms 5000 --value hello
    timerwheel cancel --data-dir D TICKET
    timerwheel consume --data-dir D --topic T [--follow]
    timerwheel inspect --data-dir D
    timerwheel demo

A bad argument or configuration value exits with status 2 and one line naming it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from timerwheel import telemetry
from timerwheel.client import Timer, TimerClient
from timerwheel.config import ENV_VARS, TimerConfig, parse_duration_ms
from timerwheel.errors import ConfigError, FormatMismatchError, TimerwheelError
from timerwheel.log import configure_logging, stage_logger
from timerwheel.records import Record

#: TimerConfig field -> command-line flag, so a config error names the flag the user typed.
FLAG_OF = {
    "data_dir": "--data-dir", "shards": "--shards", "tick_ms": "--tick-ms", "roll_window_ms": "--roll-window",
    "max_delay_ms": "--max-delay", "timer_topic": "--timer-topic", "dlq_topic": "--dlq-topic",
    "allow_topics": "--allow-topics", "timer_partitions": "--timer-partitions",
}


class CliError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _duration(text: str) -> int:
    try:
        return parse_duration_ms(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", help="data directory (default $TW_DATA_DIR or ./data)")
    p.add_argument("--shards", type=int)
    p.add_argument("--tick-ms", type=int)
    p.add_argument("--roll-window", type=_duration, help="e.g. 2d, 12h, 86400000")
    p.add_argument("--max-delay", type=_duration, help="e.g. 400d")
    p.add_argument("--timer-topic")
    p.add_argument("--dlq-topic")
    p.add_argument("--allow-topics", help="comma-separated regexes")
    p.add_argument("--timer-partitions", type=int)


def build_config(args: argparse.Namespace, **extra: Any) -> TimerConfig:
    overrides: dict[str, Any] = dict(extra)
    for name in FLAG_OF:
        attr = {"roll_window_ms": "roll_window", "max_delay_ms": "max_delay"}.get(name, name)
        value = getattr(args, attr, None)
        if value is not None:
            overrides[name] = tuple(p for p in value.split(",") if p) if name == "allow_topics" else value
    try:
        return TimerConfig.from_env(os.environ, **overrides)
    except ConfigError as exc:
        flag = FLAG_OF.get(exc.field) if exc.field in overrides else None
        raise CliError(f"{flag}: {str(exc).split(': ', 1)[1]}" if flag else str(exc)) from None


def make_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="timerwheel", description="Arbitrary-delay timer messages for Kafka.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    run = sub.add_parser("run", help="run all five stages in one process")
    run.add_argument("--embedded", action="store_true", help="local commit log and in-process queues (default)")
    run.add_argument("--kafka", help="Kafka bootstrap servers (production transports)")
    run.add_argument("--redis", help="Redis URL (production transports)")
    _config_args(run)

    sched = sub.add_parser("schedule", help="schedule one timer message")
    _config_args(sched)
    sched.add_argument("--kafka", help="schedule through Kafka instead of the local log")
    sched.add_argument("--topic", required=True, help="destination topic")
    when = sched.add_mutually_exclusive_group(required=True)
    when.add_argument("--delay-ms", type=_duration, help="delay, e.g. 5000, 5s, 2h")
    when.add_argument("--deliver-at", type=int, help="absolute epoch milliseconds")
    when.add_argument("--delay-level", type=int, help="RocketMQ delay level 1..N")
    sched.add_argument("--value", default="", help="record value (UTF-8)")
    sched.add_argument("--key", help="record key (UTF-8)")
    sched.add_argument("--id", dest="message_id", help="message id (default: generated)")
    sched.add_argument("--header", action="append", default=[], metavar="K=V", help="user header, repeatable")

    cancel = sub.add_parser("cancel", help="cancel a scheduled message by its ticket")
    _config_args(cancel)
    cancel.add_argument("--kafka")
    cancel.add_argument("ticket")

    consume = sub.add_parser("consume", help="print a topic's records as JSON lines")
    _config_args(consume)
    consume.add_argument("--kafka")
    consume.add_argument("--topic", required=True)
    consume.add_argument("--follow", action="store_true", help="keep waiting for new records")

    insp = sub.add_parser("inspect", help="per-shard W, R, pending, TimerLog size, load ahead (JSON)")
    _config_args(insp)

    demo = sub.add_parser("demo", help="schedule random timers in a temporary directory and watch them fire")
    demo.add_argument("--count", type=int, default=3000)
    demo.add_argument("--max-delay-s", type=float, default=8.0)

    stage = sub.add_parser("stage", help="run one stage as its own process (production mode, see README)")
    stage.add_argument("name", choices=["enqueue-get", "enqueue-put", "dequeue-get", "dequeue-getmsg", "dequeue-put"])
    return parser


def _local_client(cfg: TimerConfig) -> TimerClient:
    from timerwheel.transports.local import LocalCommitLog

    log_dir = Path(cfg.data_dir) / "log"
    return TimerClient(LocalCommitLog(log_dir, default_partitions=1, fsync=cfg.fsync), cfg)


def _commit_log(cfg: TimerConfig, kafka: str | None) -> Any:
    if kafka:
        from timerwheel.security import check_kafka_access
        from timerwheel.transports.kafka import KafkaCommitLog

        check_kafka_access(cfg, kafka)
        return KafkaCommitLog.from_config(cfg, kafka)
    from timerwheel.transports.local import LocalCommitLog

    return LocalCommitLog(Path(cfg.data_dir) / "log", default_partitions=1, fsync=cfg.fsync)


def _record_json(r: Record) -> str:
    def text(b: bytes | None) -> str | None:
        return None if b is None else b.decode("utf-8", "replace")

    return json.dumps({"topic": r.topic, "partition": r.partition, "offset": r.offset, "timestamp": r.timestamp_ms,
                       "key": text(r.key), "value": text(r.value), "headers": {k: text(v) for k, v in r.headers}})


def cmd_run(args: argparse.Namespace) -> int:
    if args.kafka or args.redis:
        if not (args.kafka and args.redis):
            raise CliError("--kafka and --redis go together")
        from timerwheel.production import run_all_in_one

        return run_all_in_one(build_config(args, kafka_bootstrap=args.kafka, redis_url=args.redis))
    from timerwheel.embedded import EmbeddedTimerwheel

    cfg = build_config(args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    log = stage_logger("cli")
    with EmbeddedTimerwheel(config=cfg) as tw:
        telemetry.configure_from_env(tw.metrics)
        sys.stderr.write(
            f"timerwheel (embedded) is running with data in {cfg.data_dir}. From another terminal:\n"
            f"  timerwheel schedule --data-dir {cfg.data_dir} --topic orders --delay-ms 5s --value hello\n"
            f"  timerwheel consume  --data-dir {cfg.data_dir} --topic orders --follow\n"
            f"  timerwheel inspect  --data-dir {cfg.data_dir}\n"
            "Stop with Ctrl-C.\n")
        while not stop.wait(10.0):
            m = tw.metrics
            log.info("progress", scheduled=m.counter("scheduled"), delivered=m.counter("delivered"),
                     rolled=m.counter("rolled"), cancelled=m.counter("cancelled"),
                     dead_lettered=m.counter("dead_lettered"))
    return 0


def cmd_schedule(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    headers = []
    for h in args.header:
        if "=" not in h:
            raise CliError(f"--header: expected K=V, got {h!r}")
        k, v = h.split("=", 1)
        headers.append((k, v.encode()))
    client = TimerClient(_commit_log(cfg, args.kafka), cfg)
    ticket = client.schedule(args.topic, args.value.encode(), key=args.key.encode() if args.key else None,
                             headers=tuple(headers), delay_ms=args.delay_ms, deliver_at_ms=args.deliver_at,
                             delay_level=args.delay_level, message_id=args.message_id)
    print(ticket)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from timerwheel.wire import Ticket

    cfg = build_config(args)
    try:
        ticket = Ticket.parse(args.ticket)
    except ValueError as exc:
        raise CliError(f"ticket: {exc}") from None
    TimerClient(_commit_log(cfg, args.kafka), cfg).cancel(ticket)
    print(f"cancel sent for {ticket.message_id}")
    return 0


def cmd_consume(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    log = _commit_log(cfg, args.kafka)
    consumer = log.consumer(args.topic, log.start_offsets(args.topic))
    try:
        while True:
            batch = consumer.poll(1000, 0.5 if args.follow else 0.2)
            for r in batch:
                print(_record_json(r), flush=True)
            if not batch and not args.follow:
                return 0
    except KeyboardInterrupt:
        return 0
    finally:
        consumer.close()


def cmd_inspect(args: argparse.Namespace) -> int:
    from timerwheel.clock import SystemClock
    from timerwheel.embedded import inspect_shards, open_shard, shard_dir

    cfg = build_config(args)
    if not shard_dir(cfg.data_dir, 0).exists():
        raise CliError(f"--data-dir: no timerwheel shards in {cfg.data_dir}")
    shards = {s: open_shard(cfg, s, writer=False) for s in range(cfg.shards) if shard_dir(cfg.data_dir, s).exists()}
    try:
        print(json.dumps(inspect_shards(cfg, shards, SystemClock().now_ms()), indent=2))
    finally:
        for shard in shards.values():
            shard.close()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from timerwheel.embedded import EmbeddedTimerwheel

    if args.count < 1:
        raise CliError(f"--count: must be >= 1, got {args.count}")
    if args.max_delay_s <= 0:
        raise CliError(f"--max-delay-s: must be > 0, got {args.max_delay_s}")
    rng = random.Random()
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


def main(argv: Sequence[str] | None = None) -> int:
    level = os.environ.get("TW_LOG_LEVEL", "") or "INFO"
    try:
        configure_logging(level)
    except ValueError:
        sys.stderr.write(f"timerwheel: error: TW_LOG_LEVEL: must be DEBUG, INFO, WARNING or ERROR, got {level!r}\n")
        return 2
    parser = make_parser()
    args = parser.parse_args(argv)
    telemetry.configure_from_env(stage=args.name if args.command == "stage" else None)
    handlers = {"run": cmd_run, "schedule": cmd_schedule, "cancel": cmd_cancel, "consume": cmd_consume,
                "inspect": cmd_inspect, "demo": cmd_demo, "stage": cmd_stage}
    try:
        return handlers[args.command](args)
    except (CliError, ConfigError, FormatMismatchError) as exc:
        sys.stderr.write(f"timerwheel: error: {exc}\n")
        return 2
    except TimerwheelError as exc:
        sys.stderr.write(f"timerwheel: error: {exc}\n")
        return 1


def cmd_stage(args: argparse.Namespace) -> int:
    from timerwheel.production import run_stage

    try:
        cfg = TimerConfig.from_env(os.environ)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    return run_stage(args.name, cfg)


__all__ = ["ENV_VARS", "main"]

if __name__ == "__main__":
    sys.exit(main())
