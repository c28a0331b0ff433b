"""The Spark jobs (``timerwheel.jobs``; the ``.[spark]`` extra): ``audit``, ``bulk-schedule``,
``forecast``. Each builds the settings as the service does (TLS and SASL from the same
``TW_KAFKA_*`` variables as the stages, ``timerwheel.security``) and runs its job's ``main``."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from typing import Any

from timerwheel.cli.common import (
    DEFAULTS,
    TIME_FORMS,
    CliError,
    build_config,
    described,
    duration,
    epoch_ms,
    hidden_alias,
)
from timerwheel.config import TimerConfig
from timerwheel.errors import AccessError


def _common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kafka", metavar="BOOTSTRAP", required=True, help="Kafka bootstrap servers (host:port,...)")
    p.add_argument("--timer-topic", help=f"the timer topic (default $TW_TIMER_TOPIC or {DEFAULTS.timer_topic})")
    p.add_argument("--master", default="local[*]", help="Spark master (default local[*])")


def add_audit(sub: Any) -> None:
    p = sub.add_parser("audit", help="Spark: join what was scheduled with what was delivered; summary.json and lists",
                       **described(
                           "Read the timer topic, the dead-letter topic and the destinations with Spark and write "
                           "what was scheduled, delivered, lost, duplicated, cancelled yet delivered, and the "
                           "lateness (DIR/summary.json, Parquet lists, DIR/lateness.png). Needs the .[spark] extra "
                           "(make setup-spark) and Java 17.",
                           "timerwheel audit --kafka localhost:9092 --out ./audit --grace 5m"))
    _common_args(p)
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (summary.json, Parquet, PNG)")
    p.add_argument("--dlq-topic", help=f"the dead-letter topic (default $TW_DLQ_TOPIC or {DEFAULTS.dlq_topic})")
    p.add_argument("--topics", help="comma-separated destination topics (default: every one the timer topic names)")
    p.add_argument("--grace", dest="grace_ms", type=duration, default=60_000, metavar="DURATION",
                   help="a message due longer ago than this and not delivered is lost, else pending (default 1m)")
    hidden_alias(p, "--grace-ms", dest="grace_ms", type=duration)
    _now_arg(p, "the audit's now")
    p.set_defaults(handler=cmd_audit)


def cmd_audit(args: argparse.Namespace) -> int:
    cfg = _spark_config(args)
    from timerwheel.jobs import audit

    topics = [t for t in args.topics.split(",") if t] if args.topics else None
    with _user_errors():
        summary = audit.main(args.out, cfg, topics, args.grace_ms, args.now_ms, args.master)
    print(json.dumps(summary["total"], sort_keys=True))
    return 0


def add_bulk_schedule(sub: Any) -> None:
    p = sub.add_parser("bulk-schedule", help="Spark: schedule the rows of a Parquet / CSV / JSON file",
                       **described(
                           "Schedule every valid row of a file once (ids already on the timer topic are skipped, so "
                           "a re-run schedules nothing twice); invalid rows go to --rejects with the reason. Needs "
                           "the .[spark] extra (make setup-spark) and Java 17.",
                           "timerwheel bulk-schedule --kafka localhost:9092 --input rows.parquet --rejects ./rejects"))
    _common_args(p)
    p.add_argument("--input", required=True, metavar="PATH", help="rows: id, topic, key, value, "
                   "deliver_at_ms | delay_ms [, partition, headers]")
    p.add_argument("--format", choices=["parquet", "csv", "json"], default="parquet", help="(default parquet)")
    p.add_argument("--rejects", required=True, metavar="DIR", help="invalid rows go here (Parquet, with reason)")
    p.set_defaults(handler=cmd_bulk_schedule)


def cmd_bulk_schedule(args: argparse.Namespace) -> int:
    cfg = _spark_config(args)
    from timerwheel.jobs import bulk

    with _user_errors():
        print(json.dumps(bulk.main(args.input, args.format, args.rejects, cfg, args.master)))
    return 0


def add_forecast(sub: Any) -> None:
    p = sub.add_parser("forecast", help="Spark: messages due per minute ahead, per topic and shard",
                       **described(
                           "Count the messages scheduled, not cancelled and due in the next --hours per minute, "
                           "destination topic and shard (DIR/minutes/ Parquet, DIR/forecast.png, DIR/peak.json). "
                           "Needs the .[spark] extra (make setup-spark) and Java 17.",
                           "timerwheel forecast --kafka localhost:9092 --out ./forecast --hours 48"))
    _common_args(p)
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (Parquet, PNG, peak.json)")
    p.add_argument("--hours", type=int, default=24, help="hours ahead (default 24)")
    p.add_argument("--shards", type=int, help="shards (default $TW_SHARDS or 1)")
    _now_arg(p, "the forecast's now")
    p.set_defaults(handler=cmd_forecast)


def cmd_forecast(args: argparse.Namespace) -> int:
    extra = {"shards": args.shards} if args.shards is not None else {}
    cfg = _spark_config(args, **extra)
    from timerwheel.jobs import forecast

    with _user_errors():
        print(json.dumps(forecast.main(args.out, cfg, args.hours, args.now_ms, args.master)))
    return 0


def _now_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--now", dest="now_ms", type=epoch_ms, metavar="TIME", help=f"{what}: {TIME_FORMS} (default: "
                   "the current time)")
    hidden_alias(p, "--now-ms", dest="now_ms", type=epoch_ms)


def _spark_config(args: argparse.Namespace, **extra: Any) -> TimerConfig:
    """The job's settings, once PySpark is known to be there."""
    try:
        import pyspark  # noqa: F401
    except ImportError:
        raise CliError(f"{args.command} needs PySpark: pip install 'timerwheel[spark]' (make setup-spark)") from None
    return build_config(args, kafka_bootstrap=args.kafka, **extra)


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    """Kafka out of reach or refused credentials are the user's to fix: one line, exit 2."""
    from timerwheel.jobs.spark import KafkaUnreachable

    try:
        yield
    except (KafkaUnreachable, AccessError) as exc:
        raise CliError(str(exc)) from None
