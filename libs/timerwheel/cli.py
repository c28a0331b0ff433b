"""The ``timerwheel`` command.

    timerwheel run --embedded --data-dir D      serve until SIGINT / SIGTERM
    timerwheel schedule --data-dir D --topic T --delay-ms 5000 --value hello
    timerwheel cancel --data-dir D TICKET
    timerwheel reschedule --data-dir D TICKET --delay-ms 10s
    timerwheel consume --data-dir D --topic T [--follow]
    timerwheel inspect --data-dir D
    timerwheel pending --data-dir D [--from T1] [--to T2] [--topic X] [--id ID] [--limit N]
    timerwheel recover --shard N --data-dir D   repair a stopped shard (JSON report)
    timerwheel rebuild-wheel --shard N --data-dir D
    timerwheel demo

A bad argument or configuration value exits with status 2 and one line naming it; every error
line starts ``timerwheel: error:``. Client commands (schedule, cancel, reschedule, consume,
inspect, pending) take only their own flags; the service's settings come from the same ``TW_*``
variables the service reads (``schedule`` checks a timer with the service's rules).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
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
from timerwheel.config import DAY_MS, ENV_VARS, TimerConfig, parse_duration_ms
from timerwheel.errors import (
    AccessError,
    ConfigError,
    FormatMismatchError,
    InvalidTimerMessage,
    ShardInUseError,
    TimerwheelError,
)
from timerwheel.log import configure_logging, stage_logger
from timerwheel.records import Record

#: TimerConfig field -> command-line flag, so a config error names the flag the user typed.
FLAG_OF = {
    "data_dir": "--data-dir", "shards": "--shards", "tick_ms": "--tick-ms", "roll_window_ms": "--roll-window",
    "max_delay_ms": "--max-delay", "timer_topic": "--timer-topic", "dlq_topic": "--dlq-topic",
    "allow_topics": "--allow-topics", "timer_partitions": "--timer-partitions",
}


#: rebuild-wheel's window flags -> (TimerConfig field, TW_* variable).
WINDOW_FLAGS = {"--tick-ms": "tick (ms)", "--roll-window-ms": "roll window (ms or 2d, 12h)",
                "--wheel-span-ms": "wheel span (ms or 4d; 0: twice the roll window)"}
_WINDOW_FIELD = {"--tick-ms": ("tick_ms", "TW_TICK_MS"), "--roll-window-ms": ("roll_window_ms", "TW_ROLL_WINDOW_MS"),
                 "--wheel-span-ms": ("wheel_span_ms", "TW_WHEEL_SPAN_MS")}


class CliError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        command = self.prog.split(" ", 1)[1] + ": " if " " in self.prog else ""
        self.exit(2, f"timerwheel: error: {command}{message}\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("timerwheel")
    except PackageNotFoundError:
        return "unknown"


def _duration(text: str) -> int:
    try:
        return parse_duration_ms(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_DEFAULTS = TimerConfig()


def _config_args(p: argparse.ArgumentParser) -> None:
    """The service's settings (``run``); each overrides its ``TW_*`` variable."""
    d = _DEFAULTS
    p.add_argument("--data-dir", help=f"data directory: shards and the local commit log (default $TW_DATA_DIR or {d.data_dir})")
    p.add_argument("--shards", type=int, help=f"number of shards (default $TW_SHARDS or {d.shards})")
    p.add_argument("--tick-ms", type=int, help=f"wheel tick: 10, 100, 200, 500 or 1000 (default $TW_TICK_MS or {d.tick_ms})")
    p.add_argument("--roll-window", type=_duration,
                   help=f"roll window, e.g. 2d, 12h, 86400000 (default $TW_ROLL_WINDOW_MS or {d.roll_window_ms // DAY_MS}d)")
    p.add_argument("--max-delay", type=_duration,
                   help=f"longest accepted delay, e.g. 400d (default $TW_MAX_DELAY_MS or {d.max_delay_ms // DAY_MS}d)")
    p.add_argument("--timer-topic", help=f"the timer topic (default $TW_TIMER_TOPIC or {d.timer_topic})")
    p.add_argument("--dlq-topic", help=f"the dead-letter topic (default $TW_DLQ_TOPIC or {d.dlq_topic})")
    p.add_argument("--allow-topics", help="comma-separated regexes of allowed destinations (default $TW_ALLOW_TOPICS: any)")
    p.add_argument("--timer-partitions", type=int,
                   help=f"partitions of the timer topic when it is created (default $TW_TIMER_PARTITIONS or {d.timer_partitions})")


def _client_args(p: argparse.ArgumentParser, *, create: bool = False, kafka: bool = True) -> None:
    """Where a client command finds the service: its data directory, or Kafka."""
    p.add_argument("--data-dir", help=f"the running service's data directory (default $TW_DATA_DIR or "
                                      f"{_DEFAULTS.data_dir}); its commit log is <data dir>/log")
    if create:
        p.add_argument("--create-data-dir", action="store_true",
                       help="create the data directory if it does not exist (else refused: no service reads it)")
    if kafka:
        p.add_argument("--kafka", metavar="BOOTSTRAP", help="use Kafka at BOOTSTRAP (host:port,...) instead of the local log")
    p.add_argument("--timer-topic", help=f"the timer topic (default $TW_TIMER_TOPIC or {_DEFAULTS.timer_topic})")


def _when_args(p: argparse.ArgumentParser) -> None:
    when = p.add_mutually_exclusive_group(required=True)
    when.add_argument("--delay-ms", type=_duration, help="delay from now, e.g. 5000, 5s, 2h")
    when.add_argument("--deliver-at", type=int, help="absolute delivery time, epoch milliseconds")
    when.add_argument("--delay-level", type=int, help="RocketMQ delay level 1..N ($TW_DELAY_LEVELS)")


def _time(text: str) -> int:
    """Epoch milliseconds, ``now``, ``now+DURATION`` / ``+DURATION`` / ``now-DURATION``, or ISO 8601 (UTC if no zone)."""
    from datetime import UTC, datetime

    t = text.strip()
    if t.lstrip("-").isdigit():
        return int(t)
    if t.startswith("now") or t.startswith("+"):
        rest = t[3:] if t.startswith("now") else t
        now = int(time.time() * 1000)
        if not rest:
            return now
        sign = -1 if rest[0] == "-" else 1
        try:
            return now + sign * parse_duration_ms(rest.lstrip("+-"))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    try:
        when = datetime.fromisoformat(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected epoch ms, now[+-DURATION] or ISO 8601, got {text!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


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
    parser.add_argument("--version", action="version", version=f"timerwheel {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")

    run = sub.add_parser("run", help="run all five stages in one process", description="Run all five stages in "
                         "one process until SIGINT / SIGTERM. TW_HTTP_PORT serves /healthz, /readyz, /metrics.")
    run.add_argument("--embedded", action="store_true", help="local commit log and in-process queues (default)")
    run.add_argument("--kafka", metavar="BOOTSTRAP", help="Kafka bootstrap servers (production transports, with --redis)")
    run.add_argument("--redis", metavar="URL", help="Redis URL (production transports, with --kafka)")
    _config_args(run)

    sched = sub.add_parser("schedule", help="schedule one timer message; prints its ticket",
                           description="Schedule one timer message and print its ticket. It is checked first with "
                           "the service's rules (TW_ALLOW_TOPICS, TW_MAX_DELAY_MS, ...): what the service would "
                           "dead-letter is refused with the reason.")
    _client_args(sched, create=True)
    sched.add_argument("--topic", required=True, help="destination topic")
    _when_args(sched)
    sched.add_argument("--value", default="", help="record value (UTF-8)")
    sched.add_argument("--key", help="record key (UTF-8)")
    sched.add_argument("--id", dest="message_id", help="message id (default: generated)")
    sched.add_argument("--header", action="append", default=[], metavar="K=V", help="user header, repeatable")

    cancel = sub.add_parser("cancel", help="cancel a scheduled message by its ticket",
                            description="Cancel a scheduled message. Exits 1 if its delivery time has passed (the "
                            "cancel is sent, but the message was most likely delivered already).")
    _client_args(cancel, create=True)
    cancel.add_argument("ticket", help="the ticket schedule printed (tw1.<partition>.<deliver_at>.<id>)")

    resched = sub.add_parser("reschedule", help="cancel a message and schedule it again; prints the new ticket",
                             description="Cancel the ticket's message and schedule the same record again at a new "
                             "time, both in one append (one Kafka transaction with --kafka); prints the new ticket.")
    _client_args(resched)
    resched.add_argument("ticket", help="the ticket schedule printed")
    _when_args(resched)
    resched.add_argument("--id", dest="message_id", help="message id of the new timer (default: generated)")

    consume = sub.add_parser("consume", help="print a topic's records as JSON lines")
    _client_args(consume, create=True)
    consume.add_argument("--topic", required=True, help="topic to read from its start")
    consume.add_argument("--follow", action="store_true", help="keep waiting for new records")

    insp = sub.add_parser("inspect", help="per-shard W, R, pending, TimerLog size, load ahead (JSON)")
    insp.add_argument("--data-dir", help=f"data directory (default $TW_DATA_DIR or {_DEFAULTS.data_dir})")
    insp.add_argument("--shards", type=int, help="show shards 0..N-1 (default: the count in the data directory's "
                      "timerwheel.json, else every shard-NNNN directory found)")

    pend = sub.add_parser("pending", help="list scheduled, not yet delivered messages of a time range (JSON)",
                          description="List the scheduled, not yet delivered messages due in [--from, --to): id, "
                          "topic, delivery time, roll count, read from the shards' TimerLog slots; the count of "
                          "all, the first --limit by delivery time. Times: epoch ms, now, now+5m, +1h, or ISO 8601.")
    _client_args(pend)
    pend.add_argument("--shards", type=int, help="read shards 0..N-1 (default: the count in the data directory's "
                      "timerwheel.json, else every shard-NNNN directory found)")
    pend.add_argument("--from", dest="from_ms", type=_time, default=0, help="earliest delivery time (default: any)")
    pend.add_argument("--to", dest="to_ms", type=_time, default=None, help="delivery time bound, exclusive (default: any)")
    pend.add_argument("--topic", help="only messages for this destination topic")
    pend.add_argument("--id", dest="message_id", help="only the message with this id")
    pend.add_argument("--limit", type=int, default=100, help="list at most N (default 100; the count covers all)")

    for name, short, text in (
            ("recover", "repair a stopped shard; JSON report", "Validate and repair a stopped shard: cut a torn TimerLog tail, re-link the wheel, rebuild a "
                        "lost or unreadable checkpoint (choosing R so that nothing is lost); prints a JSON report "
                        "with may_deliver_twice. Exit 0 repaired or fine, 1 failed, 2 bad argument, 3 the shard "
                        "is owned by a live process."),
            ("rebuild-wheel", "rebuild a stopped shard's wheel from its TimerLog; JSON report", "Rebuild a stopped shard's wheel file from its TimerLog; prints a JSON report. "
                              "Exit codes as for recover.")):
        rp = sub.add_parser(name, help=short, description=text)
        rp.add_argument("--shard", type=int, required=True, help="the shard number")
        rp.add_argument("--data-dir", help=f"data directory (default $TW_DATA_DIR or {_DEFAULTS.data_dir})")
        if name == "rebuild-wheel":
            rp.add_argument("--change-window", action="store_true",
                            help="rebuild with the tick, roll window and wheel span given here (or by TW_TICK_MS, "
                                 "TW_ROLL_WINDOW_MS, TW_WHEEL_SPAN_MS) and store them in the data directory's "
                                 "timerwheel.json; run it for every shard, with every stage stopped. Without it, "
                                 "other values than the stored ones are refused")
            rp.add_argument("--check", action="store_true",
                            help="with --change-window: only check that the new window holds every record "
                                 "ahead of R, and change nothing (exit 2 naming TW_WHEEL_SPAN_MS if not); the "
                                 "operator checks every shard before it rebuilds any")
            for flag, what in WINDOW_FLAGS.items():
                rp.add_argument(flag, type=_duration, help=f"new {what} (with --change-window)")

    demo = sub.add_parser("demo", help="schedule random timers in a temporary directory and watch them fire")
    demo.add_argument("--count", type=int, default=3000, help="timers to schedule (default 3000)")
    demo.add_argument("--max-delay-s", type=float, default=8.0, help="longest delay in seconds (default 8)")

    stage = sub.add_parser("stage", help="run one stage as its own process (production mode, see README)",
                           description="Run one stage as its own process, configured by TW_* variables only.")
    stage.add_argument("name", choices=["enqueue-get", "enqueue-put", "dequeue-get", "dequeue-getmsg", "dequeue-put"],
                       help="the stage to run")

    dr = sub.add_parser("recover-from-kafka", help="rebuild the shards of a lost volume from Kafka (JSON report)",
                        description="Disaster recovery: compute the pending set from the timer, dead-letter and "
                                    "destination topics and schedule it again into fresh shards that start at the "
                                    "timer topic's end. Every stage must be stopped; the data directory must hold "
                                    "no shard. Prints scanned, delivered, cancelled, dead_lettered, rescheduled.")
    dr.add_argument("--kafka", metavar="BOOTSTRAP", help="Kafka bootstrap servers (default $TW_KAFKA_BOOTSTRAP)")
    dr.add_argument("--redis", metavar="URL", help="Redis URL of the stages (default $TW_REDIS_URL): checked for "
                                                   "running stages, its work queues cleared")
    dr.add_argument("--dry-run", action="store_true", help="compute and report only; write nothing")
    _config_args(dr)
    _spark_args(sub)
    return parser


def _spark_args(sub: Any) -> None:
    """The Spark jobs (timerwheel.jobs; the .[spark] extra): audit, bulk-schedule, forecast."""
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--kafka", metavar="BOOTSTRAP", required=True, help="Kafka bootstrap servers (host:port,...)")
        p.add_argument("--timer-topic", help=f"the timer topic (default $TW_TIMER_TOPIC or {_DEFAULTS.timer_topic})")
        p.add_argument("--master", default="local[*]", help="Spark master (default local[*])")

    audit = sub.add_parser("audit", help="Spark: join what was scheduled with what was delivered; summary.json and lists")
    common(audit)
    audit.add_argument("--out", required=True, metavar="DIR", help="output directory (summary.json, Parquet, PNG)")
    audit.add_argument("--dlq-topic", help=f"the dead-letter topic (default $TW_DLQ_TOPIC or {_DEFAULTS.dlq_topic})")
    audit.add_argument("--topics", help="comma-separated destination topics (default: every one the timer topic names)")
    audit.add_argument("--grace-ms", type=_duration, default=60_000, help="a message due longer ago than this and "
                       "not delivered is lost, else pending (default 60000)")
    audit.add_argument("--now-ms", type=_time, help="the audit's now (default: the current time)")
    bulk = sub.add_parser("bulk-schedule", help="Spark: schedule the rows of a Parquet / CSV / JSON file")
    common(bulk)
    bulk.add_argument("--input", required=True, metavar="PATH", help="rows: id, topic, key, value, "
                      "deliver_at_ms | delay_ms [, partition, headers]")
    bulk.add_argument("--format", choices=["parquet", "csv", "json"], default="parquet", help="(default parquet)")
    bulk.add_argument("--rejects", required=True, metavar="DIR", help="invalid rows go here (Parquet, with reason)")
    fc = sub.add_parser("forecast", help="Spark: messages due per minute ahead, per topic and shard")
    common(fc)
    fc.add_argument("--out", required=True, metavar="DIR", help="output directory (Parquet, PNG, peak.json)")
    fc.add_argument("--hours", type=int, default=24, help="hours ahead (default 24)")
    fc.add_argument("--shards", type=int, help="shards (default $TW_SHARDS or 1)")
    fc.add_argument("--now-ms", type=_time, help="the forecast's now (default: the current time)")


def cmd_spark_job(args: argparse.Namespace) -> int:
    """audit, bulk-schedule and forecast: the config as the service builds it, then the job."""
    try:
        import pyspark  # noqa: F401
    except ImportError:
        raise CliError(f"{args.command} needs PySpark: pip install 'timerwheel[spark]' (make setup-spark)") from None
    from timerwheel.jobs import spark as sp

    extra: dict[str, Any] = {"kafka_bootstrap": args.kafka}
    if getattr(args, "shards", None) is not None:
        extra["shards"] = args.shards
    # TLS and SASL from the same TW_KAFKA_* settings as the stages (timerwheel.security)
    cfg = build_config(args, **extra)
    try:
        if args.command == "audit":
            from timerwheel.jobs import audit

            topics = [t for t in args.topics.split(",") if t] if args.topics else None
            summary = audit.main(args.out, cfg, topics, args.grace_ms, args.now_ms, args.master)
            print(json.dumps(summary["total"], sort_keys=True))
        elif args.command == "bulk-schedule":
            from timerwheel.jobs import bulk

            print(json.dumps(bulk.main(args.input, args.format, args.rejects, cfg, args.master)))
        else:
            from timerwheel.jobs import forecast

            print(json.dumps(forecast.main(args.out, cfg, args.hours, args.now_ms, args.master)))
    except (sp.KafkaUnreachable, AccessError) as exc:  # a wrong password is the user's to fix: exit 2
        raise CliError(str(exc)) from None
    return 0


def _data_dir(cfg: TimerConfig, args: argparse.Namespace) -> Path:
    """The data directory a client command uses: it must exist (``--create-data-dir`` creates it)."""
    d = Path(cfg.data_dir)
    if d.exists() and not d.is_dir():
        raise CliError(f"--data-dir: {d} is not a directory")
    if not d.exists():
        if not getattr(args, "create_data_dir", False):
            raise CliError(f"--data-dir: {d} does not exist: no timerwheel service reads it (start one with "
                           f"`timerwheel run --data-dir {d}`, or pass --create-data-dir)")
        d.mkdir(parents=True)
    return d


def _self_command() -> str:
    """How to call this very ``timerwheel`` from a new terminal: its name if PATH finds it, else its path."""
    script = Path(sys.executable).parent / "timerwheel"
    on_path = shutil.which("timerwheel")
    if on_path and script.exists() and Path(on_path).resolve() == script.resolve():
        return "timerwheel"
    if script.exists():
        return shlex.quote(str(script.absolute()))
    return f"{shlex.quote(sys.executable)} -m timerwheel.cli"


def _local_client(cfg: TimerConfig) -> TimerClient:
    from timerwheel.transports.local.log import LocalCommitLog

    log_dir = Path(cfg.data_dir) / "log"
    return TimerClient(LocalCommitLog(log_dir, default_partitions=1, fsync=cfg.fsync), cfg)


def _commit_log(cfg: TimerConfig, kafka: str | None, args: argparse.Namespace | None = None) -> Any:
    if kafka:
        from timerwheel.transports.kafka.access import check_kafka_access
        from timerwheel.transports.kafka.log import KafkaCommitLog

        check_kafka_access(cfg, kafka)
        return KafkaCommitLog.from_config(cfg, kafka)
    from timerwheel.transports.local.log import LocalCommitLog

    data = _data_dir(cfg, args) if args is not None else Path(cfg.data_dir)
    return LocalCommitLog(data / "log", default_partitions=1, fsync=cfg.fsync)


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
    from timerwheel.health import HealthServer

    cfg = build_config(args)
    data = Path(cfg.data_dir)
    if data.exists() and not data.is_dir():
        raise CliError(f"--data-dir: {data} is not a directory")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    log = stage_logger("cli")
    with EmbeddedTimerwheel(config=cfg) as tw:
        telemetry.configure_from_env(tw.metrics)
        server = None
        if cfg.http_port:
            try:
                server = HealthServer(cfg.http_port, tw.metrics, live=lambda: not stop.is_set(),
                                      ready=lambda: not stop.is_set()).start()
            except OSError as exc:
                raise ConfigError("TW_HTTP_PORT", f"cannot serve on port {cfg.http_port}: {exc.strerror or exc}") from None
        tw_cmd, where = _self_command(), shlex.quote(str(data.absolute()))
        sys.stderr.write(
            f"timerwheel (embedded) is running with data in {where}. From another terminal:\n"
            f"  {tw_cmd} schedule --data-dir {where} --topic orders --delay-ms 5s --value hello\n"
            f"  {tw_cmd} consume  --data-dir {where} --topic orders --follow\n"
            f"  {tw_cmd} inspect  --data-dir {where}\n"
            + (f"Health and metrics: http://127.0.0.1:{server.port}/metrics (/healthz, /readyz).\n" if server else "")
            + "Stop with Ctrl-C.\n")
        try:
            while not stop.wait(10.0):
                m = tw.metrics
                log.info("progress", scheduled=m.counter("scheduled"), delivered=m.counter("delivered"),
                         rolled=m.counter("rolled"), cancelled=m.counter("cancelled"),
                         dead_lettered=m.counter("dead_lettered"))
        finally:
            if server is not None:
                server.close()
    return 0


def cmd_schedule(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    headers = []
    for h in args.header:
        if "=" not in h:
            raise CliError(f"--header: expected K=V, got {h!r}")
        k, v = h.split("=", 1)
        headers.append((k, v.encode()))
    _check_level(cfg, args.delay_level)
    client = TimerClient(_commit_log(cfg, args.kafka, args), cfg, validate=True)
    try:
        ticket = client.schedule(args.topic, args.value.encode(), key=args.key.encode() if args.key else None,
                                 headers=tuple(headers), delay_ms=args.delay_ms, deliver_at_ms=args.deliver_at,
                                 delay_level=args.delay_level, message_id=args.message_id)
    except (ValueError, InvalidTimerMessage) as exc:
        raise CliError(f"schedule: {exc}") from None
    print(ticket)
    return 0


def _check_level(cfg: TimerConfig, level: int | None) -> None:
    if level is not None and not 1 <= level <= len(cfg.delay_levels_ms):
        raise CliError(f"--delay-level: must be 1..{len(cfg.delay_levels_ms)} (TW_DELAY_LEVELS), got {level}")


def _ticket(text: str) -> Any:
    from timerwheel.wire import Ticket

    try:
        return Ticket.parse(text)
    except ValueError as exc:
        raise CliError(f"ticket: {exc}") from None


def cmd_reschedule(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    ticket = _ticket(args.ticket)
    _check_level(cfg, args.delay_level)
    client = TimerClient(_commit_log(cfg, args.kafka, args), cfg, validate=True)
    try:
        new = client.reschedule(ticket, delay_ms=args.delay_ms, deliver_at_ms=args.deliver_at,
                                delay_level=args.delay_level, message_id=args.message_id)
    except (ValueError, InvalidTimerMessage) as exc:
        raise CliError(f"reschedule: {exc}") from None
    print(new)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    ticket = _ticket(args.ticket)
    client = TimerClient(_commit_log(cfg, args.kafka, args), cfg)
    client.cancel(ticket)
    now = client.clock.now_ms()
    if ticket.deliver_at_ms <= now:
        sys.stderr.write(f"timerwheel: error: cancel sent for {ticket.message_id}, but its delivery time "
                         f"{ticket.deliver_at_ms} passed {now - ticket.deliver_at_ms} ms ago: the message was most "
                         "likely delivered already, and the cancel can no longer take effect\n")
        return 1
    print(f"cancel sent for {ticket.message_id}")
    return 0


def cmd_consume(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    log = _commit_log(cfg, args.kafka, args)
    if args.follow and not _wait_for_topic(log, args.topic):
        return 0
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


def _wait_for_topic(log: Any, topic: str) -> bool:
    """``consume --follow`` of a destination nothing was delivered to yet: on Kafka the topic is
    made by the first delivery, so wait for it (the local log makes it on first use). False if
    interrupted (Ctrl-C) while waiting."""
    if log.partition_count(topic) is not None:
        return True
    stage_logger("cli").info("waiting for the topic to exist (it is made by the first delivery)", topic=topic)
    try:
        while log.partition_count(topic) is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        return False
    return True


def cmd_inspect(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from timerwheel.clock import SystemClock
    from timerwheel.embedded import inspect_shards
    from timerwheel.store.deployment import load_settings

    cfg = build_config(args)
    shards = _open_shards(cfg, args.shards)
    try:
        report = inspect_shards(cfg, shards, SystemClock().now_ms())
        stored = load_settings(cfg.data_dir)
        if stored is not None:
            report["settings"] = asdict(stored)
        print(json.dumps(report, indent=2))
    finally:
        for shard in shards.values():
            shard.close()
    return 0


def _open_shards(cfg: TimerConfig, count: int | None) -> dict[int, Any]:
    """Read-only views of shards 0..count-1: by default the data directory's shard count (its
    deployment file ``timerwheel.json``), else every ``shard-NNNN`` directory found."""
    from timerwheel.store.deployment import load_settings
    from timerwheel.store.layout import found_shards, open_found_shard

    found = found_shards(cfg.data_dir)
    if not found:
        raise CliError(f"--data-dir: no timerwheel shards in {cfg.data_dir}")
    if count is None:
        stored = load_settings(cfg.data_dir)
        count = stored.shards if stored is not None else None
    wanted = found if count is None else [s for s in range(count) if s in found]
    shards: dict[int, Any] = {}
    try:
        for s in wanted:
            shards[s] = open_found_shard(cfg.data_dir, s)
    except BaseException:
        for shard in shards.values():
            shard.close()
        raise
    return shards


def cmd_pending(args: argparse.Namespace) -> int:
    from timerwheel.clock import SystemClock
    from timerwheel.pending import pending_timers
    from timerwheel.wire import MAX_EPOCH_MS

    cfg = build_config(args)
    if args.limit < 0:
        raise CliError(f"--limit: must be >= 0, got {args.limit}")
    _data_dir(cfg, args)
    shards = _open_shards(cfg, args.shards)
    log = _commit_log(cfg, args.kafka)
    try:
        found = pending_timers(log, shards, cfg, args.from_ms, MAX_EPOCH_MS + 1 if args.to_ms is None else args.to_ms,
                               now_ms=SystemClock().now_ms(), topic=args.topic, message_id=args.message_id,
                               limit=args.limit)
    finally:
        log.close()
        for shard in shards.values():
            shard.close()
    print(json.dumps({"count": found.count, "shown": len(found.timers), "timers": [
        {"id": t.message_id, "topic": t.topic, "deliver_at_ms": t.deliver_at_ms, "roll": t.roll, "shard": t.shard}
        for t in found.timers]}, indent=2))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from timerwheel.embedded import EmbeddedTimerwheel

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
    handlers = {"run": cmd_run, "schedule": cmd_schedule, "cancel": cmd_cancel, "reschedule": cmd_reschedule,
                "consume": cmd_consume, "inspect": cmd_inspect, "pending": cmd_pending, "demo": cmd_demo,
                "stage": cmd_stage, "recover": cmd_repair, "rebuild-wheel": cmd_repair,
                "recover-from-kafka": cmd_recover_from_kafka,
                "audit": cmd_spark_job, "bulk-schedule": cmd_spark_job, "forecast": cmd_spark_job}
    try:
        return handlers[args.command](args)
    except (CliError, ConfigError, FormatMismatchError) as exc:
        sys.stderr.write(f"timerwheel: error: {exc}\n")
        return 2
    except ShardInUseError as exc:
        sys.stderr.write(f"timerwheel: error: {exc}\n")
        return 3
    except (TimerwheelError, OSError) as exc:
        sys.stderr.write(f"timerwheel: error: {exc}\n")
        return 1
    except Exception:  # a bug: one JSON line with the whole traceback, here where it ends the command
        stage_logger(args.name if args.command == "stage" else args.command).error("command failed", exc=True)
        return 1


def cmd_repair(args: argparse.Namespace) -> int:
    """``recover`` / ``rebuild-wheel``: one stopped shard, one JSON report (timerwheel.repair)."""
    from timerwheel.repair import change_window, rebuild_wheel, recover_shard

    window = {field: getattr(args, flag[2:].replace("-", "_")) for flag, (field, _var) in _WINDOW_FIELD.items()
              if getattr(args, flag[2:].replace("-", "_"), None) is not None}
    cfg = _window_config(args, window) if args.command == "rebuild-wheel" else build_config(args)
    if args.shard < 0:
        raise CliError(f"--shard: must be >= 0, got {args.shard}")
    if not Path(cfg.data_dir).is_dir():
        raise CliError(f"--data-dir: {cfg.data_dir} is not a directory")
    if args.command == "recover":
        report = recover_shard(cfg, args.shard)
    elif getattr(args, "change_window", False):
        report = change_window(cfg, args.shard, check_only=args.check)
    elif getattr(args, "check", False):
        raise CliError("--check: only with --change-window")
    else:
        asked = {field for flag, (field, var) in _WINDOW_FIELD.items() if field in window or var in os.environ}
        _refuse_other_window(cfg, asked)
        report = rebuild_wheel(cfg, args.shard)
    print(json.dumps(report, indent=2))
    return 0


def _window_config(args: argparse.Namespace, window: dict[str, int]) -> TimerConfig:
    """rebuild-wheel's settings: TW_* with the window flags over them; a bad value names its flag."""
    overrides: dict[str, Any] = dict(window)
    if args.data_dir is not None:
        overrides["data_dir"] = args.data_dir
    try:
        return TimerConfig.from_env(os.environ, **overrides)
    except ConfigError as exc:
        flag = next((f for f, (field, _var) in _WINDOW_FIELD.items() if field == exc.field and field in window), None)
        if flag is None and exc.field == "data_dir" and args.data_dir is not None:
            flag = "--data-dir"
        raise CliError(f"{flag}: {str(exc).split(': ', 1)[1]}" if flag else str(exc)) from None


def _refuse_other_window(cfg: TimerConfig, asked: set[str]) -> None:
    """Without --change-window, a tick, roll window or span given that differs from the stored
    one is refused as a stage's start refuses it (exit 2), pointing to --change-window."""
    from timerwheel.store.deployment import DeploymentSettings, load_settings

    stored = load_settings(cfg.data_dir)
    if stored is None or not asked:
        return
    wanted = DeploymentSettings.of(cfg)
    names = {"tick_ms": ("TW_TICK_MS", "--tick-ms"), "roll_window_ms": ("TW_ROLL_WINDOW_MS", "--roll-window-ms"),
             "wheel_span_ms": ("TW_WHEEL_SPAN_MS", "--wheel-span-ms")}
    wrong = [f"{names[n][1]} ({names[n][0]}): stored {getattr(stored, n)}, requested {getattr(wanted, n)}"
             for n in names if (n in asked or (n == "wheel_span_ms" and "roll_window_ms" in asked))
             and getattr(stored, n) != getattr(wanted, n)]
    if wrong:
        raise FormatMismatchError(f"data directory {cfg.data_dir} was made with other settings ({'; '.join(wrong)}; "
                                  "see timerwheel.json): add --change-window to rebuild every shard's wheel with "
                                  "the new values (stages stopped), or give the stored ones")


def cmd_stage(args: argparse.Namespace) -> int:
    from timerwheel.production import run_stage

    try:
        cfg = TimerConfig.from_env(os.environ)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    return run_stage(args.name, cfg)


def cmd_recover_from_kafka(args: argparse.Namespace) -> int:
    from timerwheel.disaster import recover_from_kafka
    from timerwheel.production import require_servers
    from timerwheel.security import redis_client

    servers = {k: v for k, v in (("kafka_bootstrap", args.kafka), ("redis_url", args.redis)) if v}
    cfg = build_config(args, **servers)
    try:
        require_servers(cfg)
    except ConfigError as exc:
        flag = {"TW_KAFKA_BOOTSTRAP": "--kafka", "TW_REDIS_URL": "--redis"}.get(exc.field, exc.field)
        raise CliError(f"{flag} (or {exc.field}) must be set") from None
    log = _commit_log(cfg, cfg.kafka_bootstrap)
    client = redis_client(cfg)
    try:
        report = recover_from_kafka(cfg, log, client, dry_run=args.dry_run)
    finally:
        log.close()
        client.close()
    print(json.dumps(report.as_json()))
    return 0


__all__ = ["ENV_VARS", "main"]

if __name__ == "__main__":
    sys.exit(main())
