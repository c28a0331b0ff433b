"""What the command modules share: the parser class, the common flags, settings from flags and
``TW_*`` variables (a bad value named by the flag the user typed), and where a client command
finds the service (its data directory's local commit log, or Kafka)."""

from __future__ import annotations

import argparse
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from timerwheel.config import DAY_MS, TimerConfig, parse_duration_ms
from timerwheel.errors import ConfigError, TimerwheelError

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
    """A flag's duration: ``5000`` (ms), ``250ms``, ``1.5s``, ``1h30m``, ``2w``."""
    try:
        return parse_duration_ms(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


#: What a time may look like, for error messages and help.
TIME_FORMS = "epoch ms (1700000000000), now, now+5m, now-1h, +1h30m, or ISO 8601 (2026-11-27T18:00:00Z; UTC if no zone)"


def epoch_ms(text: str) -> int:
    """A flag's time: epoch milliseconds, ``now``, ``now+DURATION`` / ``+DURATION`` /
    ``now-DURATION``, or ISO 8601 (UTC if no zone). One parser for every time flag."""
    from datetime import UTC, datetime

    t = text.strip()
    if t.lstrip("-").isdigit():
        return int(t)
    if t.startswith("now") or t.startswith("+"):
        rest = t[3:] if t.startswith("now") else t
        now = int(time.time() * 1000)
        if not rest:
            return now
        if rest[0] not in "+-":
            raise argparse.ArgumentTypeError(f"expected {TIME_FORMS}, got {text!r}")
        try:
            return now + (-1 if rest[0] == "-" else 1) * parse_duration_ms(rest[1:])
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{exc} (in {text!r})") from None
    try:
        when = datetime.fromisoformat(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {TIME_FORMS}, got {text!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


def iso(ms: int) -> str:
    """Epoch milliseconds as ISO 8601 in UTC, to the millisecond (the ``--iso`` outputs)."""
    from datetime import UTC, datetime

    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def span(ms: int) -> str:
    """A length of time for people: ``850 ms``, ``12.5 s``, ``5 min``, ``3.2 h``, ``2.1 d``."""
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("min", 60_000), ("s", 1000)):
        if abs(ms) >= size:
            return f"{ms / size:.3g} {unit}"
    return f"{ms} ms"


def join_dash_values(argv: Sequence[str]) -> list[str]:
    """``--delay -5s`` as ``--delay=-5s``: argparse takes a value that starts with ``-`` and is not
    a plain number for an option, and would say "expected one argument" instead of letting the
    flag's parser refuse a negative delay with its reason. No flag of ours looks like ``-5s``."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and re.match(r"-\.?\d", arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def hidden_alias(p: Any, old: str, **kwargs: Any) -> None:
    """Accept ``old``, a flag's former spelling, without showing it: scripts, the chart and the
    operator's Jobs call the command line, a public interface, so a renamed flag keeps working."""
    p.add_argument(old, help=argparse.SUPPRESS, **kwargs)


def described(description: str, *examples: str) -> dict[str, Any]:
    """``sub.add_parser(name, help=..., **described(...))``: the command's description (paragraphs
    split at blank lines, wrapped) and its examples, kept as written."""
    import textwrap

    text = "\n\n".join(textwrap.fill(" ".join(par.split()), 100) for par in description.split("\n\n"))
    return {"description": text, "epilog": "examples:\n" + "\n".join(f"  {e}" for e in examples),
            "formatter_class": argparse.RawDescriptionHelpFormatter}


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


#: A setting the data directory stores (timerwheel.json) -> the flag and the variable that ask for it.
STORED_AS = {"shards": ("--shards", "TW_SHARDS"), "tick_ms": ("--tick-ms", "TW_TICK_MS"),
             "roll_window_ms": ("--roll-window", "TW_ROLL_WINDOW_MS"), "wheel_span_ms": (None, "TW_WHEEL_SPAN_MS"),
             "timer_topic": ("--timer-topic", "TW_TIMER_TOPIC")}


def with_stored_settings(cfg: TimerConfig, args: argparse.Namespace) -> TimerConfig:
    """``cfg`` with the data directory's stored settings (timerwheel.json) wherever neither a flag
    nor a ``TW_*`` variable asked for one; one asked for that differs is refused, naming it."""
    from timerwheel.store.deployment import SETTINGS_FILE, DeploymentSettings, load_settings

    stored = load_settings(cfg.data_dir)
    if stored is None:
        return cfg

    def asked_by(field: str) -> str | None:
        """The flag or variable that asks for ``field``, if one does."""
        flag, var = STORED_AS[field]
        if flag is not None and getattr(args, _dest(flag), None) is not None:
            return flag
        return var if var in os.environ else None

    def asked(field: str) -> bool:
        return asked_by(field) is not None

    # the span follows the roll window when only the window is asked for (a span of 0: twice it)
    adopt = {f: getattr(stored, f) for f in STORED_AS if not asked(f)
             and not (f == "wheel_span_ms" and asked("roll_window_ms"))}
    try:
        cfg = cfg.replace(**adopt)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    wanted = DeploymentSettings.of(cfg)
    for field in STORED_AS:
        mine, theirs = getattr(wanted, field), getattr(stored, field)
        if mine != theirs:
            how = ("the shard count never changes" if field == "shards" else "the timer topic never changes"
                   if field == "timer_topic" else "to change it: `timerwheel rebuild-wheel --change-window` for every "
                   "shard, stages stopped")
            name = asked_by(field) or asked_by("roll_window_ms") or STORED_AS[field][1]
            raise CliError(f"{name}: stored {theirs!r}, requested {mine!r}: the data directory {cfg.data_dir} was made "
                           f"with {theirs!r} ({SETTINGS_FILE}); leave {name} out to use it ({how})")
    return cfg


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def data_dir(cfg: TimerConfig, args: argparse.Namespace) -> Path:
    """The data directory a client command uses: one a timerwheel service has run on (it holds the
    stored settings, timerwheel.json, or shards), else nothing would ever read what is written
    there. ``--create-data-dir`` makes a new one: a directory that does not exist, or is empty."""
    from timerwheel.store.deployment import SETTINGS_FILE
    from timerwheel.store.layout import holds_shards

    d = Path(cfg.data_dir)
    if d.exists() and not d.is_dir():
        raise CliError(f"--data-dir: {d} is not a directory")
    if (d / SETTINGS_FILE).exists() or holds_shards(d):
        return d
    create = getattr(args, "create_data_dir", False)
    start = f"start one with `timerwheel run --data-dir {d}`"
    if not d.exists():
        if not create:
            raise CliError(f"--data-dir: {d} does not exist: no timerwheel service reads it ({start}, or pass "
                           "--create-data-dir)")
        d.mkdir(parents=True)
        return d
    new = {p.name for p in d.iterdir()} <= {"log"}  # empty, or the log an earlier --create-data-dir made
    if create and new:
        return d
    raise CliError(f"--data-dir: {d} holds no {SETTINGS_FILE}: no timerwheel service has run on it, so nothing would "
                   f"read what is written there ({start}" + (", or pass --create-data-dir" if new else "") + ")")


def commit_log(cfg: TimerConfig, kafka: str | None, args: argparse.Namespace | None = None) -> Any:
    """Kafka at ``kafka`` (its access checked first), else the data directory's local commit log
    (with ``args``: the directory checked as a client command's, ``data_dir``)."""
    if kafka:
        from timerwheel.transports.kafka.access import check_kafka_access, kafka_unreachable
        from timerwheel.transports.kafka.log import KafkaCommitLog

        unreachable = kafka_unreachable(kafka)
        if unreachable is not None:  # said at once, not after kafka-python's 30 s bootstrap timeout
            raise TimerwheelError(f"cannot reach Kafka at {kafka} ({unreachable}): is it running, and is --kafka its "
                                  "address?")
        check_kafka_access(cfg, kafka)
        return KafkaCommitLog.from_config(cfg, kafka)
    from timerwheel.transports.local.log import LocalCommitLog

    data = data_dir(cfg, args) if args is not None else Path(cfg.data_dir)
    return LocalCommitLog(data / "log", default_partitions=1, fsync=cfg.fsync)
