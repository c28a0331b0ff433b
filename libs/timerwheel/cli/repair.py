"""The commands that repair or rebuild shards, every stage that owns them stopped: ``recover`` and
``rebuild-wheel`` (one shard, ``store.repair``), ``recover-from-kafka`` (every shard of a lost
volume, ``runtime.disaster``) and ``rebase`` (fresh shards on the timer topic now read,
``runtime.rebase``). Each prints one JSON report; the exit codes are the CLI's."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from timerwheel.cli.common import (
    DEFAULTS,
    CliError,
    build_config,
    commit_log,
    config_args,
    data_dir_arg,
    described,
    duration,
    hidden_alias,
    with_stored_settings,
)
from timerwheel.config import TimerConfig
from timerwheel.errors import ConfigError

#: rebuild-wheel's window flags -> (TimerConfig field, TW_* variable, what it sets). A duration's
#: flag carries no unit (``--roll-window 2d``); the former spellings ``--roll-window-ms`` and
#: ``--wheel-span-ms`` are still accepted (``WINDOW_ALIASES``).
WINDOW_FLAGS = {"--tick-ms": ("tick_ms", "TW_TICK_MS", "tick (ms)"),
                "--roll-window": ("roll_window_ms", "TW_ROLL_WINDOW_MS", "roll window (2d, 12h, ms)"),
                "--wheel-span": ("wheel_span_ms", "TW_WHEEL_SPAN_MS", "wheel span (4d, ms; 0: twice the roll window)")}
WINDOW_ALIASES = {"--roll-window-ms": "--roll-window", "--wheel-span-ms": "--wheel-span"}


def _shard_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shard", type=int, required=True, help="the shard number")
    data_dir_arg(p)


def add_recover(sub: Any) -> None:
    p = sub.add_parser("recover", help="repair a stopped shard; JSON report",
                       **described(
                           "Validate and repair a stopped shard: cut a torn TimerLog tail, re-link the wheel, rebuild "
                           "a lost or unreadable checkpoint (choosing R so that nothing is lost); prints a JSON report "
                           "with may_deliver_twice. Exit 0 repaired or fine, 1 failed, 2 bad argument, 3 the shard is "
                           "owned by a live process.",
                           "timerwheel recover --shard 0 --data-dir ./data"))
    _shard_args(p)
    p.set_defaults(handler=cmd_recover)


def cmd_recover(args: argparse.Namespace) -> int:
    from timerwheel.store.repair import repair_shard

    cfg = build_config(args)
    _check_shard_args(cfg, args)
    print(json.dumps(repair_shard(cfg, args.shard), indent=2))
    return 0


def add_rebuild_wheel(sub: Any) -> None:
    p = sub.add_parser("rebuild-wheel", help="rebuild a stopped shard's wheel from its TimerLog; JSON report",
                       **described(
                           "Rebuild a stopped shard's wheel file from its TimerLog; prints a JSON report. With "
                           "--change-window, with another tick, roll window or wheel span (every shard, stages "
                           "stopped). Exit codes as for recover.",
                           "timerwheel rebuild-wheel --shard 0 --data-dir ./data",
                           "timerwheel rebuild-wheel --shard 0 --data-dir ./data --change-window --roll-window 4d"))
    _shard_args(p)
    p.add_argument("--change-window", action="store_true",
                   help="rebuild with the tick, roll window and wheel span given here (or by TW_TICK_MS, "
                        "TW_ROLL_WINDOW_MS, TW_WHEEL_SPAN_MS) and store them in the data directory's "
                        "timerwheel.json; run it for every shard, with every stage stopped. Without it, "
                        "other values than the stored ones are refused")
    p.add_argument("--check", action="store_true",
                   help="with --change-window: only check that the new window holds every record "
                        "ahead of R, and change nothing (exit 2 naming TW_WHEEL_SPAN_MS if not); the "
                        "operator checks every shard before it rebuilds any")
    for flag, (_field, _var, what) in WINDOW_FLAGS.items():
        p.add_argument(flag, type=duration, help=f"new {what} (with --change-window)")
    for old, flag in WINDOW_ALIASES.items():
        hidden_alias(p, old, dest=flag[2:].replace("-", "_"), type=duration)
    p.set_defaults(handler=cmd_rebuild_wheel)


def cmd_rebuild_wheel(args: argparse.Namespace) -> int:
    from timerwheel.store.deployment import DeploymentSettings, refuse_other_window
    from timerwheel.store.repair import change_window, rebuild_wheel

    window = {field: getattr(args, flag[2:].replace("-", "_")) for flag, (field, _var, _what) in WINDOW_FLAGS.items()
              if getattr(args, flag[2:].replace("-", "_"), None) is not None}
    cfg = _window_config(args, window)
    _check_shard_args(cfg, args)
    if args.change_window:
        report = change_window(cfg, args.shard, check_only=args.check)
    elif args.check:
        raise CliError("--check: only with --change-window")
    else:
        asked = {field for field, var, _what in WINDOW_FLAGS.values() if field in window or var in os.environ}
        refuse_other_window(cfg.data_dir, DeploymentSettings.of(cfg), asked,
                            {field: f"{flag} ({var})" for flag, (field, var, _what) in WINDOW_FLAGS.items()})
        report = rebuild_wheel(cfg, args.shard)
    print(json.dumps(report, indent=2))
    return 0


def _check_shard_args(cfg: TimerConfig, args: argparse.Namespace) -> None:
    if args.shard < 0:
        raise CliError(f"--shard: must be >= 0, got {args.shard}")
    if not Path(cfg.data_dir).is_dir():
        raise CliError(f"--data-dir: {cfg.data_dir} is not a directory")


def _window_config(args: argparse.Namespace, window: dict[str, int]) -> TimerConfig:
    """rebuild-wheel's settings: TW_* with the window flags over them; a bad value names its flag."""
    overrides: dict[str, Any] = dict(window)
    if args.data_dir is not None:
        overrides["data_dir"] = args.data_dir
    try:
        return TimerConfig.from_env(os.environ, **overrides)
    except ConfigError as exc:
        flag = next((f for f, (field, _var, _what) in WINDOW_FLAGS.items() if field == exc.field and field in window),
                    None)
        if flag is None and exc.field == "data_dir" and args.data_dir is not None:
            flag = "--data-dir"
        raise CliError(f"{flag}: {str(exc).split(': ', 1)[1]}" if flag else str(exc)) from None


def add_recover_from_kafka(sub: Any) -> None:
    p = sub.add_parser("recover-from-kafka", help="rebuild the shards of a lost volume from Kafka (JSON report)",
                       **described(
                           "Disaster recovery: compute the pending set from the timer, dead-letter and destination "
                           "topics and schedule it again into fresh shards that start at the timer topic's end. Every "
                           "stage must be stopped; the data directory must hold no shard. Prints scanned, delivered, "
                           "cancelled, dead_lettered, rescheduled.",
                           "timerwheel recover-from-kafka --kafka localhost:9092 --redis redis://localhost:6379/0 "
                           "--data-dir ./data-prod --dry-run"))
    p.add_argument("--kafka", metavar="BOOTSTRAP", help="Kafka bootstrap servers (default $TW_KAFKA_BOOTSTRAP)")
    p.add_argument("--redis", metavar="URL", help="Redis URL of the stages (default $TW_REDIS_URL): checked for "
                                                  "running stages, its work queues cleared")
    p.add_argument("--dry-run", action="store_true", help="compute and report only; write nothing")
    config_args(p)
    p.set_defaults(handler=cmd_recover_from_kafka)


def cmd_recover_from_kafka(args: argparse.Namespace) -> int:
    from timerwheel.runtime.disaster import recover_from_kafka
    from timerwheel.runtime.wiring import require_servers
    from timerwheel.security import redis_client

    servers = {k: v for k, v in (("kafka_bootstrap", args.kafka), ("redis_url", args.redis)) if v}
    cfg = build_config(args, **servers)
    try:
        require_servers(cfg)
    except ConfigError as exc:
        flag = {"TW_KAFKA_BOOTSTRAP": "--kafka", "TW_REDIS_URL": "--redis"}.get(exc.field, exc.field)
        raise CliError(f"{flag} (or {exc.field}) must be set") from None
    log = commit_log(cfg, cfg.kafka_bootstrap)
    client = redis_client(cfg)
    try:
        report = recover_from_kafka(cfg, log, client, dry_run=args.dry_run)
    finally:
        log.close()
        client.close()
    print(json.dumps(report.as_json()))
    return 0


def add_rebase(sub: Any) -> None:
    p = sub.add_parser("rebase", help="start a data directory afresh on the timer topic it now reads (JSON report)",
                       **described(
                           "After a start refused shards written from another Kafka cluster, another incarnation of "
                           "the timer topic (deleted and made again) or another local log: set the old shards aside "
                           "(moved into set-aside-<time>/ in the data directory) and make fresh ones that read the "
                           "timer topic from its start.\n\n"
                           "The messages still pending in the old shards are NOT delivered (their timer records are "
                           "not in this topic; pending_records counts them); every record this topic holds is "
                           "scheduled, so one that another timerwheel already delivered from it is delivered again "
                           "(to move to a mirrored cluster use recover-from-kafka, which skips what the destinations "
                           "hold). Every stage must be stopped. The settings are the data directory's own.",
                           "timerwheel rebase --data-dir ./data",
                           "timerwheel rebase --data-dir ./data-prod --kafka localhost:9092 --redis "
                           "redis://localhost:6379/0 --dry-run"))
    data_dir_arg(p)
    p.add_argument("--kafka", metavar="BOOTSTRAP", help="the stages' Kafka (else the data directory's local log: the "
                                                        "embedded mode)")
    p.add_argument("--redis", metavar="URL", help="with --kafka: the stages' Redis (default $TW_REDIS_URL), checked "
                                                  "for running stages, its work queues cleared")
    p.add_argument("--timer-topic", help=f"the timer topic (default: the data directory's, else $TW_TIMER_TOPIC or "
                                         f"{DEFAULTS.timer_topic})")
    p.add_argument("--dry-run", action="store_true", help="report what would be set aside; change nothing")
    p.set_defaults(handler=cmd_rebase)


def cmd_rebase(args: argparse.Namespace) -> int:
    from timerwheel.runtime.rebase import NothingToRebase, rebase
    from timerwheel.security import redis_client

    servers = {"kafka_bootstrap": args.kafka} if args.kafka else {}
    if args.redis:
        servers["redis_url"] = args.redis
    cfg = build_config(args, **servers)
    if not Path(cfg.data_dir).is_dir():
        raise CliError(f"--data-dir: {cfg.data_dir} is not a directory")
    cfg = with_stored_settings(cfg, args)
    if args.kafka and not cfg.redis_url:
        raise CliError("--redis (or TW_REDIS_URL) must be set with --kafka: the stages must be stopped, and their "
                       "work queues are cleared")
    log = commit_log(cfg, args.kafka)
    client = redis_client(cfg) if args.kafka else None
    try:
        report = rebase(cfg, log, client, dry_run=args.dry_run)
    except NothingToRebase as exc:
        raise CliError(str(exc)) from None
    finally:
        log.close()
        if client is not None:
            client.close()
    print(json.dumps(report.as_json(), indent=2))
    return 0
