"""``timerwheel console`` and ``timerwheel top``: their flags, and what they run.

Both read the service's settings from the ``TW_*`` variables (the stages' ConfigMap on
Kubernetes) and take a flag for each of their own (the flag wins):

    TW_CONSOLE_METRICS            --metrics            stage endpoints host:port,... (/metrics)
    TW_CONSOLE_ACTION_TOKEN_FILE  --action-token-file  file holding the action token (console)
    TW_CONSOLE_HOST               --host               address to listen on (console; 127.0.0.1)
    TW_CONSOLE_PORT               --port               port to listen on (console; 8090)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from timerwheel.cli.common import described
from timerwheel.config import TimerConfig
from timerwheel.errors import ConfigError

DEFAULT_PORT = 8090


def add_parsers(sub: Any) -> None:
    """The two subcommands, on the ``timerwheel`` command's subparsers."""
    console = sub.add_parser("console", help="serve the web console (pending timers, dead letters, actions)",
                             **described("Serve the web console: the overview, pending timers, dead letters and "
                                         "(with an action token) cancel, reschedule, deliver now and redrive.",
                                         "timerwheel console --data-dir ./data-prod --kafka localhost:9092 "
                                         "--metrics localhost:9101,localhost:9102"))
    _common(console)
    console.set_defaults(handler=run_console)
    console.add_argument("--host", help="address to listen on (default $TW_CONSOLE_HOST or 127.0.0.1)")
    console.add_argument("--port", type=int, help=f"port (default $TW_CONSOLE_PORT or {DEFAULT_PORT})")
    console.add_argument("--action-token-file", help="file holding the action token that unlocks writes (default "
                                                     "$TW_CONSOLE_ACTION_TOKEN_FILE; none: read-only)")
    console.add_argument("--sample-every", type=float, default=2.0, help="seconds between scrapes (default 2)")
    top = sub.add_parser("top", help="the console's overview, live in the terminal",
                         **described("The overview (per shard W, R, lag, owners; rates; due ahead), refreshed.",
                                     "timerwheel top --data-dir ./data-prod --metrics localhost:9101 --once"))
    _common(top)
    top.set_defaults(handler=run_top)
    top.add_argument("--every", type=float, default=2.0, help="seconds between refreshes (default 2)")
    top.add_argument("--once", action="store_true", help="print one frame and exit")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", help="the data directory (the shards; mounted read-only is enough; default "
                                      "$TW_DATA_DIR)")
    p.add_argument("--kafka", metavar="BOOTSTRAP", help="Kafka (default $TW_KAFKA_BOOTSTRAP; none: the local log "
                                                        "in the data directory)")
    p.add_argument("--metrics", help="the stages' /metrics endpoints, host:port,... (a name with several addresses: "
                                     "each; default $TW_CONSOLE_METRICS)")


def _installation(args: argparse.Namespace) -> Any:
    from timerwheel.console.source import Installation

    overrides: dict[str, Any] = {}
    if args.data_dir:
        overrides["data_dir"] = args.data_dir
    if args.kafka:
        overrides["kafka_bootstrap"] = args.kafka
    cfg = TimerConfig.from_env(os.environ, **overrides)
    if not Path(cfg.data_dir).is_dir():
        raise ConfigError("--data-dir", f"{cfg.data_dir} is not a directory")
    raw = args.metrics if args.metrics is not None else os.environ.get("TW_CONSOLE_METRICS", "")
    return Installation(cfg, [t.strip() for t in raw.split(",") if t.strip()])


def run_console(args: argparse.Namespace) -> int:
    import uvicorn

    from timerwheel.console.app import create_app

    token_file = args.action_token_file or os.environ.get("TW_CONSOLE_ACTION_TOKEN_FILE", "")
    token = None
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError("--action-token-file", f"cannot be read: {exc.strerror}") from None
        if not token:
            raise ConfigError("--action-token-file", "the file is empty")
    host = args.host or os.environ.get("TW_CONSOLE_HOST") or "127.0.0.1"
    port_text = str(args.port) if args.port is not None else os.environ.get("TW_CONSOLE_PORT") or str(DEFAULT_PORT)
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError("--port", f"must be 1..65535, got {port_text!r}")
    if args.sample_every <= 0:
        raise ConfigError("--sample-every", f"must be > 0, got {args.sample_every}")
    inst = _installation(args)
    app = create_app(inst, action_token=token, sample_every_s=args.sample_every)
    sys.stderr.write(f"timerwheel console on http://{host}:{port_text}/ ("
                     f"{'actions need the token' if token else 'read-only'})\n")
    try:
        uvicorn.run(app, host=host, port=int(port_text), log_level="warning", access_log=False)
    finally:
        inst.close()
    return 0


def run_top(args: argparse.Namespace) -> int:
    from timerwheel.console.top import run

    if args.every <= 0:
        raise ConfigError("--every", f"must be > 0, got {args.every}")
    inst = _installation(args)
    try:
        run(inst, args.every, once=args.once)
    finally:
        inst.close()
    return 0
