"""The commands of a producer and a consumer: ``schedule``, ``cancel``, ``reschedule``, ``consume``.

Each talks to the service through its commit log (the data directory's, or Kafka with ``--kafka``)
with ``TimerClient``, which checks a timer with the service's own rules."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from timerwheel.cli.common import CliError, build_config, client_args, commit_log, duration
from timerwheel.client import TimerClient
from timerwheel.config import TimerConfig
from timerwheel.errors import InvalidTimerMessage
from timerwheel.log import stage_logger
from timerwheel.records import Record
from timerwheel.wire import Ticket


def _when_args(p: argparse.ArgumentParser) -> None:
    when = p.add_mutually_exclusive_group(required=True)
    when.add_argument("--delay-ms", type=duration, help="delay from now, e.g. 5000, 5s, 2h")
    when.add_argument("--deliver-at", type=int, help="absolute delivery time, epoch milliseconds")
    when.add_argument("--delay-level", type=int, help="RocketMQ delay level 1..N ($TW_DELAY_LEVELS)")


def add_schedule(sub: Any) -> None:
    p = sub.add_parser("schedule", help="schedule one timer message; prints its ticket",
                       description="Schedule one timer message and print its ticket. It is checked first with "
                       "the service's rules (TW_ALLOW_TOPICS, TW_MAX_DELAY_MS, ...): what the service would "
                       "dead-letter is refused with the reason.")
    client_args(p, create=True)
    p.add_argument("--topic", required=True, help="destination topic")
    _when_args(p)
    p.add_argument("--value", default="", help="record value (UTF-8)")
    p.add_argument("--key", help="record key (UTF-8)")
    p.add_argument("--id", dest="message_id", help="message id (default: generated)")
    p.add_argument("--header", action="append", default=[], metavar="K=V", help="user header, repeatable")
    p.set_defaults(handler=cmd_schedule)


def cmd_schedule(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    headers = []
    for h in args.header:
        if "=" not in h:
            raise CliError(f"--header: expected K=V, got {h!r}")
        k, v = h.split("=", 1)
        headers.append((k, v.encode()))
    _check_level(cfg, args.delay_level)
    client = TimerClient(commit_log(cfg, args.kafka, args), cfg, validate=True)
    return _print_ticket("schedule", lambda: client.schedule(
        args.topic, args.value.encode(), key=args.key.encode() if args.key else None, headers=tuple(headers),
        delay_ms=args.delay_ms, deliver_at_ms=args.deliver_at, delay_level=args.delay_level,
        message_id=args.message_id))


def add_cancel(sub: Any) -> None:
    p = sub.add_parser("cancel", help="cancel a scheduled message by its ticket",
                       description="Cancel a scheduled message. Exits 1 if its delivery time has passed (the "
                       "cancel is sent, but the message was most likely delivered already).")
    client_args(p, create=True)
    p.add_argument("ticket", help="the ticket schedule printed (tw1.<partition>.<deliver_at>.<id>)")
    p.set_defaults(handler=cmd_cancel)


def cmd_cancel(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    ticket = _ticket(args.ticket)
    client = TimerClient(commit_log(cfg, args.kafka, args), cfg)
    client.cancel(ticket)
    now = client.clock.now_ms()
    if ticket.deliver_at_ms <= now:
        sys.stderr.write(f"timerwheel: error: cancel sent for {ticket.message_id}, but its delivery time "
                         f"{ticket.deliver_at_ms} passed {now - ticket.deliver_at_ms} ms ago: the message was most "
                         "likely delivered already, and the cancel can no longer take effect\n")
        return 1
    print(f"cancel sent for {ticket.message_id}")
    return 0


def add_reschedule(sub: Any) -> None:
    p = sub.add_parser("reschedule", help="cancel a message and schedule it again; prints the new ticket",
                       description="Cancel the ticket's message and schedule the same record again at a new "
                       "time, both in one append (one Kafka transaction with --kafka); prints the new ticket.")
    client_args(p)
    p.add_argument("ticket", help="the ticket schedule printed")
    _when_args(p)
    p.add_argument("--id", dest="message_id", help="message id of the new timer (default: generated)")
    p.set_defaults(handler=cmd_reschedule)


def cmd_reschedule(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    ticket = _ticket(args.ticket)
    _check_level(cfg, args.delay_level)
    client = TimerClient(commit_log(cfg, args.kafka, args), cfg, validate=True)
    return _print_ticket("reschedule", lambda: client.reschedule(
        ticket, delay_ms=args.delay_ms, deliver_at_ms=args.deliver_at, delay_level=args.delay_level,
        message_id=args.message_id))


def add_consume(sub: Any) -> None:
    p = sub.add_parser("consume", help="print a topic's records as JSON lines")
    client_args(p, create=True)
    p.add_argument("--topic", required=True, help="topic to read from its start")
    p.add_argument("--follow", action="store_true", help="keep waiting for new records")
    p.set_defaults(handler=cmd_consume)


def cmd_consume(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    log = commit_log(cfg, args.kafka, args)
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


def _print_ticket(command: str, schedule: Callable[[], Ticket]) -> int:
    """Print the ticket ``schedule`` returns; a timer the service's rules refuse is one line, exit 2."""
    try:
        ticket = schedule()
    except (ValueError, InvalidTimerMessage) as exc:
        raise CliError(f"{command}: {exc}") from None
    print(ticket)
    return 0


def _check_level(cfg: TimerConfig, level: int | None) -> None:
    if level is not None and not 1 <= level <= len(cfg.delay_levels_ms):
        raise CliError(f"--delay-level: must be 1..{len(cfg.delay_levels_ms)} (TW_DELAY_LEVELS), got {level}")


def _ticket(text: str) -> Ticket:
    try:
        return Ticket.parse(text)
    except ValueError as exc:
        raise CliError(f"ticket: {exc}") from None


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


def _record_json(r: Record) -> str:
    def text(b: bytes | None) -> str | None:
        return None if b is None else b.decode("utf-8", "replace")

    return json.dumps({"topic": r.topic, "partition": r.partition, "offset": r.offset, "timestamp": r.timestamp_ms,
                       "key": text(r.key), "value": text(r.value), "headers": {k: text(v) for k, v in r.headers}})
