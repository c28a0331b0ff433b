"""The ``timerwheel`` command: the parser and the dispatch; each command lives in the module of its group.

    timerwheel run --embedded --data-dir D      serve until SIGINT / SIGTERM          service.py
    timerwheel stage NAME                       one stage, production mode            service.py
    timerwheel demo                                                                   service.py
    timerwheel schedule --data-dir D --topic T --delay 5s --value hello              messages.py
    timerwheel cancel --data-dir D TICKET                                             messages.py
    timerwheel reschedule --data-dir D TICKET --delay 10s                             messages.py
    timerwheel consume --data-dir D --topic T [--follow]                              messages.py
    timerwheel inspect --data-dir D                                                   inspect.py
    timerwheel pending --data-dir D [--from T1] [--to T2] [--topic X] [--id ID] [--limit N]
    timerwheel recover --shard N --data-dir D   repair a stopped shard (JSON report)  repair.py
    timerwheel rebuild-wheel --shard N --data-dir D                                   repair.py
    timerwheel recover-from-kafka                                                     repair.py
    timerwheel rebase --data-dir D              fresh shards on the timer topic now read  repair.py
    timerwheel audit | bulk-schedule | forecast  the Spark jobs                       spark.py
    timerwheel console --data-dir D --metrics HOST:PORT,...   the web console       timerwheel.console.command
    timerwheel top --data-dir D --metrics HOST:PORT,...       its overview, live     timerwheel.console.command

A command is two functions in its module: ``add_<command>(sub)`` adds its parser (with
``common.described``: a description and examples, which ``--help`` shows) and sets its
``handler``, ``cmd_<command>(args)`` runs it and returns the exit code. It checks its flags and
calls the domain (``store``, ``runtime``, ``client``, ...), never re-implements a rule of it. A new
command goes into the module of its group (or a new module) and into ``make_parser``'s list.

A bad argument or configuration value exits with status 2 and one line naming it (the flag the
user typed, never a wire header); every error line starts ``timerwheel: error:``. A flag has one
spelling across commands, named for what it is (``--delay``, ``--roll-window``: durations and
times take units); a renamed one stays accepted as a hidden alias (``common.hidden_alias``). Client commands (schedule, cancel, reschedule, consume,
inspect, pending) take only their own flags; the service's settings come from the same ``TW_*``
variables the service reads (``schedule`` checks a timer with the service's rules).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from timerwheel import telemetry
from timerwheel.cli import inspect, messages, repair, service, spark
from timerwheel.cli.common import CliError, Parser, join_dash_values
from timerwheel.console import command as console_command
from timerwheel.errors import ConfigError, FormatMismatchError, ShardInUseError, TimerwheelError
from timerwheel.log import configure_logging, stage_logger

#: Exit codes of every command (stable: the operator's Jobs read those of ``recover`` and
#: ``rebuild-wheel``): done (a repair: the shard is consistent now), failed, a bad argument or
#: setting, refused because a live process owns the shard.
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_IN_USE = 0, 1, 2, 3


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("timerwheel")
    except PackageNotFoundError:
        return "unknown"


def make_parser() -> Parser:
    """Every command, in the order ``timerwheel --help`` lists them."""
    parser = Parser(prog="timerwheel", description="Arbitrary-delay timer messages for Kafka.")
    parser.add_argument("--version", action="version", version=f"timerwheel {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")
    for add in (service.add_run, messages.add_schedule, messages.add_cancel, messages.add_reschedule,
                messages.add_consume, inspect.add_inspect, inspect.add_pending, repair.add_recover,
                repair.add_rebuild_wheel, service.add_demo, service.add_stage, repair.add_recover_from_kafka,
                repair.add_rebase, spark.add_audit, spark.add_bulk_schedule, spark.add_forecast,
                console_command.add_parsers):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    level = os.environ.get("TW_LOG_LEVEL", "") or "INFO"
    try:
        configure_logging(level)
    except ValueError:
        sys.stderr.write(f"timerwheel: error: TW_LOG_LEVEL: must be DEBUG, INFO, WARNING or ERROR, got {level!r}\n")
        return EXIT_USAGE
    args = make_parser().parse_args(join_dash_values(sys.argv[1:] if argv is None else argv))
    stage = args.name if args.command == "stage" else None
    telemetry.configure_from_env(stage=stage)
    try:
        code: int = args.handler(args)
        return code
    except (CliError, ConfigError, FormatMismatchError) as exc:
        sys.stderr.write(f"timerwheel: error: {exc}\n")
        return EXIT_USAGE
    except ShardInUseError as exc:
        sys.stderr.write(f"timerwheel: error: {exc}\n")
        return EXIT_IN_USE
    except (TimerwheelError, OSError) as exc:
        sys.stderr.write(f"timerwheel: error: {exc}\n")
        return EXIT_FAILED
    except Exception:  # a bug: one JSON line with the whole traceback, here where it ends the command
        stage_logger(stage or args.command).error("command failed", exc=True)
        return EXIT_FAILED


__all__ = ["EXIT_FAILED", "EXIT_IN_USE", "EXIT_OK", "EXIT_USAGE", "main", "make_parser"]
