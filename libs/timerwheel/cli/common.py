"""What the command modules share: the parser class, the common flags, settings from flags and
``TW_*`` variables (a bad value named by the flag the user typed), and where a client command
finds the service (its data directory's local commit log, or Kafka)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any, NoReturn

from timerwheel.config import DAY_MS, TimerConfig, parse_duration_ms
from timerwheel.errors import ConfigError

#: TimerConfig field -> command-line flag, so a config error names the flag the user typed.
FLAG_OF = {
    "data_dir": "--data-dir", "shards": "--shards", "tick_ms": "--tick-ms", "roll_window_ms": "--roll-window",
    "max_delay_ms": "--max-delay", "timer_topic": "--timer-topic", "dlq_topic": "--dlq-topic",
    "allow_topics": "--allow-topics", "timer_partitions": "--timer-partitions",
}

#: The settings a command shows as defaults.
DEFAULTS = TimerConfig()


class CliError(Exception):
    """A bad argument: one line, exit 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        command = self.prog.split(" ", 1)[1] + ": " if " " in self.prog else ""
        self.exit(2, f"timerwheel: error: {command}{message}\n")


def duration(text: str) -> int:
    """A flag's duration: ``5000``, ``5s``, ``2h``, ``2d``."""
    try:
        return parse_duration_ms(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def epoch_ms(text: str) -> int:
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


def config_args(p: argparse.ArgumentParser) -> None:
    """The service's settings (``run``); each overrides its ``TW_*`` variable."""
    d = DEFAULTS
    p.add_argument("--data-dir", help=f"data directory: shards and the local commit log (default $TW_DATA_DIR or {d.data_dir})")
    p.add_argument("--shards", type=int, help=f"number of shards (default $TW_SHARDS or {d.shards})")
    p.add_argument("--tick-ms", type=int, help=f"wheel tick: 10, 100, 200, 500 or 1000 (default $TW_TICK_MS or {d.tick_ms})")
    p.add_argument("--roll-window", type=duration,
                   help=f"roll window, e.g. 2d, 12h, 86400000 (default $TW_ROLL_WINDOW_MS or {d.roll_window_ms // DAY_MS}d)")
    p.add_argument("--max-delay", type=duration,
                   help=f"longest accepted delay, e.g. 400d (default $TW_MAX_DELAY_MS or {d.max_delay_ms // DAY_MS}d)")
    p.add_argument("--timer-topic", help=f"the timer topic (default $TW_TIMER_TOPIC or {d.timer_topic})")
    p.add_argument("--dlq-topic", help=f"the dead-letter topic (default $TW_DLQ_TOPIC or {d.dlq_topic})")
    p.add_argument("--allow-topics", help="comma-separated regexes of allowed destinations (default $TW_ALLOW_TOPICS: any)")
    p.add_argument("--timer-partitions", type=int,
                   help=f"partitions of the timer topic when it is created (default $TW_TIMER_PARTITIONS or {d.timer_partitions})")


def client_args(p: argparse.ArgumentParser, *, create: bool = False, kafka: bool = True) -> None:
    """Where a client command finds the service: its data directory, or Kafka."""
    p.add_argument("--data-dir", help=f"the running service's data directory (default $TW_DATA_DIR or "
                                      f"{DEFAULTS.data_dir}); its commit log is <data dir>/log")
    if create:
        p.add_argument("--create-data-dir", action="store_true",
                       help="create the data directory if it does not exist (else refused: no service reads it)")
    if kafka:
        p.add_argument("--kafka", metavar="BOOTSTRAP", help="use Kafka at BOOTSTRAP (host:port,...) instead of the local log")
    p.add_argument("--timer-topic", help=f"the timer topic (default $TW_TIMER_TOPIC or {DEFAULTS.timer_topic})")


def data_dir_arg(p: argparse.ArgumentParser) -> None:
    """``--data-dir`` of a command that reads the shards."""
    p.add_argument("--data-dir", help=f"data directory (default $TW_DATA_DIR or {DEFAULTS.data_dir})")


def build_config(args: argparse.Namespace, **extra: Any) -> TimerConfig:
    """The ``TW_*`` settings with the flags of ``FLAG_OF`` and ``extra`` over them."""
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


def data_dir(cfg: TimerConfig, args: argparse.Namespace) -> Path:
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


def commit_log(cfg: TimerConfig, kafka: str | None, args: argparse.Namespace | None = None) -> Any:
    """Kafka at ``kafka`` (its access checked first), else the data directory's local commit log
    (with ``args``: the directory checked as a client command's, ``data_dir``)."""
    if kafka:
        from timerwheel.security import check_kafka_access
        from timerwheel.transports.kafka import KafkaCommitLog

        check_kafka_access(cfg, kafka)
        return KafkaCommitLog.from_config(cfg, kafka)
    from timerwheel.transports.local import LocalCommitLog

    data = data_dir(cfg, args) if args is not None else Path(cfg.data_dir)
    return LocalCommitLog(data / "log", default_partitions=1, fsync=cfg.fsync)
