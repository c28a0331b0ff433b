"""The commands that read the shards, changing nothing: ``inspect`` and ``pending`` (JSON).

Both open read-only views of the shards of a data directory (``store.layout``), with the
settings each shard was made with."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from timerwheel.cli.common import (
    TIME_FORMS,
    CliError,
    build_config,
    client_args,
    commit_log,
    data_dir,
    data_dir_arg,
    described,
    epoch_ms,
    iso,
)
from timerwheel.clock import SystemClock
from timerwheel.config import TimerConfig
from timerwheel.store import Shard
from timerwheel.store.layout import found_shards, open_found_shards
from timerwheel.wire import MAX_EPOCH_MS, Ticket


def add_inspect(sub: Any) -> None:
    p = sub.add_parser("inspect", help="per-shard W, R, pending, TimerLog size, load ahead (JSON)",
                       **described(
                           "Per shard: W (written up to) and R (read up to) and their lag behind now, the records in "
                           "the wheel from R (pending: cancel markers and roll hops included), the TimerLog's size, "
                           "the records due in the next second, minute and hour; and the data directory's stored "
                           "settings and source. Read-only: safe while the service runs.",
                           "timerwheel inspect --data-dir ./data",
                           "timerwheel inspect --data-dir ./data-prod --iso"))
    data_dir_arg(p)
    p.add_argument("--shards", type=int, help="show shards 0..N-1 (default: the count in the data directory's "
                   "timerwheel.json, else every shard-NNNN directory found)")
    p.add_argument("--iso", action="store_true", help="times as ISO 8601 (UTC) instead of epoch ms")
    p.set_defaults(handler=cmd_inspect)


def cmd_inspect(args: argparse.Namespace) -> int:
    from timerwheel.runtime.inspect import inspect_shards
    from timerwheel.store.deployment import load_deployment

    cfg = build_config(args)
    shards = _open_shards(cfg, args.shards)
    try:
        report = inspect_shards(cfg, shards, SystemClock().now_ms())
        deployment = load_deployment(cfg.data_dir)
        stored, source = deployment if deployment is not None else (None, None)
        if stored is not None:
            report["settings"] = asdict(stored)
        if source is not None:
            report["source"] = asdict(source)
        if args.iso:
            report["now"] = iso(report.pop("now_ms"))
            for shard in report["shards"]:
                shard.update({k: None if shard[k] is None else iso(shard[k]) for k in ("W", "R")})
        print(json.dumps(report, indent=2))
    finally:
        for shard in shards.values():
            shard.close()
    return 0


def add_pending(sub: Any) -> None:
    p = sub.add_parser("pending", help="list scheduled, not yet delivered messages of a time range (JSON)",
                       **described(
                           "List the scheduled, not yet delivered messages due in [--from, --to): id, ticket (what "
                           "cancel and reschedule take), topic, delivery time, roll count, read from the shards' "
                           f"TimerLog slots; the count of all, the first --limit by delivery time. Times: {TIME_FORMS}.",
                           "timerwheel pending --data-dir ./data --from now --to now+1h",
                           "timerwheel pending --data-dir ./data --id order-42 --iso"))
    client_args(p)
    p.add_argument("--shards", type=int, help="read shards 0..N-1 (default: the count in the data directory's "
                   "timerwheel.json, else every shard-NNNN directory found)")
    p.add_argument("--from", dest="from_ms", type=epoch_ms, default=0, help="earliest delivery time (default: any)")
    p.add_argument("--to", dest="to_ms", type=epoch_ms, default=None, help="delivery time bound, exclusive (default: any)")
    p.add_argument("--topic", help="only messages for this destination topic")
    p.add_argument("--id", dest="message_id", help="only the message with this id")
    p.add_argument("--limit", type=int, default=100, help="list at most N (default 100; the count covers all)")
    p.add_argument("--iso", action="store_true", help="delivery times as ISO 8601 (UTC) instead of epoch ms")
    p.set_defaults(handler=cmd_pending)


def cmd_pending(args: argparse.Namespace) -> int:
    from timerwheel.pending import pending_timers

    cfg = build_config(args)
    if args.limit < 0:
        raise CliError(f"--limit: must be >= 0, got {args.limit}")
    data_dir(cfg, args)
    shards = _open_shards(cfg, args.shards)
    log = commit_log(cfg, args.kafka)
    try:
        found = pending_timers(log, shards, cfg, args.from_ms, MAX_EPOCH_MS + 1 if args.to_ms is None else args.to_ms,
                               now_ms=SystemClock().now_ms(), topic=args.topic, message_id=args.message_id,
                               limit=args.limit)
    finally:
        log.close()
        for shard in shards.values():
            shard.close()
    when = "deliver_at" if args.iso else "deliver_at_ms"
    print(json.dumps({"count": found.count, "shown": len(found.timers), "timers": [
        {"id": t.message_id, "ticket": str(Ticket(t.partition, t.deliver_at_ms, t.message_id, t.revision)),
         "topic": t.topic, when: iso(t.deliver_at_ms) if args.iso else t.deliver_at_ms, "roll": t.roll,
         "revision": t.revision, "shard": t.shard}
        for t in found.timers]}, indent=2))
    return 0


def _open_shards(cfg: TimerConfig, count: int | None) -> dict[int, Shard]:
    """Read-only views of the shards to show (``deployment.shards_to_show``)."""
    from timerwheel.store.deployment import shards_to_show

    if not found_shards(cfg.data_dir):
        raise CliError(f"--data-dir: no timerwheel shards in {cfg.data_dir}")
    return open_found_shards(cfg.data_dir, shards_to_show(cfg.data_dir, count))
