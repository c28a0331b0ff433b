"""The commands of a producer and a consumer: ``schedule``, ``cancel``, ``reschedule``, ``consume``.

Each talks to the service through its commit log (the data directory's, or Kafka with ``--kafka``)
with ``TimerClient``, which checks a timer with the service's own rules. Where the shards can be
read (a data directory that holds them), ``cancel`` and ``reschedule`` also look the message up
among the pending ones (``timerwheel.pending``) and say whether it was still pending."""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from timerwheel.cli.common import (
    TIME_FORMS,
    CliError,
    build_config,
    client_args,
    commit_log,
    described,
    duration,
    epoch_ms,
    hidden_alias,
    iso,
    span,
)
from timerwheel.client import RefusedTimer, Timer, TimerClient
from timerwheel.config import DURATION_FORMS, TimerConfig
from timerwheel.errors import InvalidTimerMessage
from timerwheel.log import stage_logger
from timerwheel.pending import PendingTimer
from timerwheel.records import Record
from timerwheel.wire import (
    H_DELAY_LEVEL,
    H_DELAY_MS,
    H_DELIVER_AT,
    H_DELIVERED_AT,
    H_ENQUEUED_AT,
    H_HELD_SINCE,
    H_ID,
    H_TOPIC,
    Ticket,
)

#: Lines of ``schedule --lines`` written per append.
LINES_BATCH = 1_000
#: How long ``cancel`` and ``reschedule`` wait for the service to have read the timer topic up to
#: where it ended when they looked, before they say whether a message is pending.
CATCH_UP_S = 5.0
#: ``consume`` without --follow gives up when it cannot reach the end offsets for this long.
CONSUME_STALL_S = 30.0
#: The service's words in a refusal -> the flag or variable a user of the command line sets.
_USER_WORDS = {H_DELAY_MS: "--delay", H_DELIVER_AT: "--deliver-at", H_DELAY_LEVEL: "--delay-level", H_ID: "--id",
               H_TOPIC: "--topic", "max_delay_ms": "TW_MAX_DELAY_MS", "allow_topics": "TW_ALLOW_TOPICS",
               "max_record_bytes": "TW_MAX_RECORD_BYTES"}
#: Headers that hold an epoch-ms time (shown as ISO 8601 by ``consume --iso``).
_TIME_HEADERS = frozenset({H_DELIVER_AT, H_ENQUEUED_AT, H_DELIVERED_AT, H_HELD_SINCE})


def _when_args(p: argparse.ArgumentParser) -> None:
    when = p.add_mutually_exclusive_group(required=True)
    when.add_argument("--delay", dest="delay_ms", type=duration, metavar="DURATION",
                      help=f"delay from now: {DURATION_FORMS}")
    hidden_alias(when, "--delay-ms", dest="delay_ms", type=duration)
    when.add_argument("--deliver-at", type=epoch_ms, metavar="TIME", help=f"delivery time: {TIME_FORMS}")
    when.add_argument("--delay-level", type=int, metavar="N", help="RocketMQ delay level 1..N ($TW_DELAY_LEVELS)")


def add_schedule(sub: Any) -> None:
    p = sub.add_parser("schedule", help="schedule a timer message (or one per line of stdin); prints its ticket",
                       **described(
                           "Schedule one timer message and print its ticket (what cancel and reschedule take). It "
                           "is checked first with the service's rules (TW_ALLOW_TOPICS, TW_MAX_DELAY_MS, ...): what "
                           "the service would dead-letter is refused with the reason, and nothing is written.\n\n"
                           "--lines schedules one message per line of standard input, as kafka-console-producer and "
                           "kcat -P do: the line (without its newline) is the value, or with --key-separator SEP "
                           "the line is KEY SEP VALUE (split at the first SEP); every message gets the same "
                           "--delay / --deliver-at / --delay-level, --header and --topic; one ticket is printed per "
                           "line, in order. Lines are bytes, written as they arrive (batches of what is there).",
                           "timerwheel schedule --data-dir ./data --topic orders --delay 5s --value hello",
                           "timerwheel schedule --data-dir ./data --topic orders --deliver-at 2026-12-24T18:00:00Z "
                           "--key k1 --value @invoice.pdf",
                           "printf 'k1\\thello\\nk2\\tworld\\n' | timerwheel schedule --data-dir ./data --topic orders "
                           "--delay 1h30m --lines --key-separator '\\t'"))
    client_args(p, create=True)
    p.add_argument("--topic", required=True, help="destination topic")
    _when_args(p)
    p.add_argument("--value", default="", metavar="TEXT|@FILE|-",
                   help="the record's value: TEXT (UTF-8), @FILE (the file's bytes), - (standard input's bytes)")
    p.add_argument("--key", help="the record's key (UTF-8)")
    p.add_argument("--id", dest="message_id", help="message id (default: generated)")
    p.add_argument("--header", action="append", default=[], metavar="K=V", help="user header, repeatable")
    p.add_argument("--lines", action="store_true", help="one message per line of standard input (see above)")
    p.add_argument("--key-separator", metavar="SEP", help="with --lines: each line is KEY SEP VALUE ('\\t' is a tab)")
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
    if args.lines:
        given = [flag for flag, value in (("--value", args.value), ("--key", args.key), ("--id", args.message_id))
                 if value]
        if given:
            raise CliError(f"{given[0]}: not with --lines (each line is a message's value, and its key with "
                           "--key-separator; ids are generated)")
    elif args.key_separator is not None:
        raise CliError("--key-separator: only with --lines")
    value = b"" if args.lines else _value(args.value)
    _warn_if_past(args.deliver_at)
    log = commit_log(cfg, args.kafka, args)
    _warn_if_unread(log, cfg, args.kafka)
    client = TimerClient(log, cfg, validate=True)

    def timer(key: bytes | None, value: bytes) -> Timer:
        return Timer(args.topic, value, key, tuple(headers), args.delay_ms, args.deliver_at, args.delay_level)

    if args.lines:
        return _schedule_lines(client, args, timer)
    return _print_ticket(args, lambda: client.schedule_many([Timer(
        args.topic, value, args.key.encode() if args.key else None, tuple(headers), args.delay_ms, args.deliver_at,
        args.delay_level, args.message_id)])[0])


def _value(text: str) -> bytes:
    """``--value``: text, ``@FILE`` or ``-`` (standard input), as bytes."""
    if text == "-":
        return sys.stdin.buffer.read()
    if text.startswith("@"):
        try:
            return Path(text[1:]).read_bytes()
        except OSError as exc:
            raise CliError(f"--value: cannot read {text[1:]!r}: {exc.strerror or exc}") from None
    return text.encode()


def _schedule_lines(client: TimerClient, args: argparse.Namespace,
                    timer: Callable[[bytes | None, bytes], Timer]) -> int:
    """``schedule --lines``: a message per line of standard input, written as the lines arrive.
    A bad line stops it: every line before it is scheduled (its ticket printed), none after."""
    sep = None if args.key_separator is None else args.key_separator.replace("\\t", "\t").encode()
    if sep == b"":
        raise CliError("--key-separator: must not be empty")
    def send(timers: list[Timer], last: int) -> None:
        """Schedule ``timers``, the lines up to line ``last``."""
        first = last - len(timers) + 1
        for i in range(0, len(timers), LINES_BATCH):
            batch = timers[i:i + LINES_BATCH]
            try:
                tickets = client.schedule_many(batch)
            except RefusedTimer as exc:
                tickets = client.schedule_many(batch[:exc.index]) if exc.index else []
                _print_tickets(tickets)
                raise CliError(f"standard input line {first + i + exc.index}: refused, the service would dead-letter "
                               f"it: {_user_words(exc.reason)} (the lines before it are scheduled, their tickets "
                               "printed)") from None
            _print_tickets(tickets)

    number = 0
    for lines in _stdin_lines():
        timers: list[Timer] = []
        for line in lines:
            number += 1
            key = None
            if sep is not None:
                if sep not in line:
                    send(timers, number - 1)
                    raise CliError(f"standard input line {number}: no --key-separator {sep.decode()!r} in it "
                                   "(the lines before it are scheduled, their tickets printed)")
                key, _, line = line.partition(sep)
            timers.append(timer(key, line))
        send(timers, number)
    return 0


def _print_tickets(tickets: list[Ticket]) -> None:
    sys.stdout.write("".join(f"{t}\n" for t in tickets))
    sys.stdout.flush()


def _stdin_lines() -> Iterator[list[bytes]]:
    """Standard input's lines (without their ``\\n`` or ``\\r\\n``) as they arrive: each read
    returns what is there, so typed lines go at once and a pipe goes in large batches."""
    fd = sys.stdin.fileno()
    rest = b""
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        *lines, rest = (rest + chunk).split(b"\n")
        if lines:
            yield [line.removesuffix(b"\r") for line in lines]
    if rest:
        yield [rest.removesuffix(b"\r")]


def _warn_if_unread(log: Any, cfg: TimerConfig, kafka: str | None) -> None:
    """On Kafka, a timer topic that does not exist yet is one no timerwheel reads: a stage makes
    its timer topic when it starts. The message is written (the topic made, as the service would
    make it) and waits there; say so, naming the setting, instead of leaving it unserved in silence."""
    if kafka and log.partition_count(cfg.timer_topic) is None:
        sys.stderr.write(f"timerwheel: warning: timer topic {cfg.timer_topic!r} does not exist on {kafka}, so no "
                         "timerwheel reads it yet (a timerwheel makes its timer topic when it starts): the message "
                         f"waits there until one started with TW_TIMER_TOPIC={cfg.timer_topic} (or --timer-topic) "
                         "runs; is --timer-topic the one your timerwheel reads?\n")


def _warn_if_past(deliver_at: int | None) -> None:
    if deliver_at is None:
        return
    ago = int(time.time() * 1000) - deliver_at
    if ago > 0:
        sys.stderr.write(f"timerwheel: warning: --deliver-at {iso(deliver_at)} is {span(ago)} in the past: the "
                         "message is delivered at once\n")


def add_cancel(sub: Any) -> None:
    p = sub.add_parser("cancel", help="cancel a scheduled message by its ticket (or --id); says if it was pending",
                       **described(
                           "Cancel a scheduled message: give the ticket schedule printed, or --id with the data "
                           "directory's shards (the ticket is then found among the pending messages). Where the "
                           "shards can be read, it says whether the message was still pending (waiting up to "
                           f"{CATCH_UP_S:g} s for the service to read the timer topic that far).\n\n"
                           "Exit 0: the cancel is sent and the message was pending (or that cannot be told here); "
                           "1: the cancel cannot take effect (the delivery time has passed, or the message is not "
                           "pending: no message has this id, or it was cancelled or rescheduled already).",
                           "timerwheel cancel --data-dir ./data tw1.2.1700000005000.5f3c8a1e2b7d9c4f-0",
                           "timerwheel cancel --data-dir ./data --id order-42"))
    client_args(p, create=True)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("ticket", nargs="?", help="the ticket schedule printed (tw1.<partition>.<deliver_at>.<id>)")
    which.add_argument("--id", dest="message_id", help="the message id, looked up among the pending messages")
    p.set_defaults(handler=cmd_cancel)


def cmd_cancel(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    ticket = None if args.ticket is None else _ticket(args.ticket)
    client = TimerClient(commit_log(cfg, args.kafka, args), cfg)
    index = _PendingIndex(cfg, client)
    if ticket is None:
        found = index.find(args.message_id)
        if index.unknown:
            raise CliError(f"--id: the pending messages cannot be read here ({index.unknown}): give the ticket")
        if found is None:
            sys.stderr.write(f"timerwheel: error: {args.message_id} is not pending (no message has this id, or it was "
                             "cancelled, rescheduled or delivered already): nothing was sent\n")
            return 1
        ticket = Ticket(found.partition, found.deliver_at_ms, found.message_id)
    else:
        _check_partition(ticket, client)
    now = client.clock.now_ms()
    if ticket.deliver_at_ms <= now:
        client.cancel(ticket)
        sys.stderr.write(f"timerwheel: error: cancel sent for {ticket.message_id}, but its delivery time "
                         f"{iso(ticket.deliver_at_ms)} passed {span(now - ticket.deliver_at_ms)} ago: the message "
                         "was most likely delivered already, and the cancel can no longer take effect\n")
        return 1
    pending = index.pending(ticket) if args.message_id is None else True
    client.cancel(ticket)
    if pending is None:
        print(f"cancel sent for {ticket.message_id} (due {iso(ticket.deliver_at_ms)}; whether it is still pending "
              f"is not known here: {index.unknown})")
        return 0
    if not pending:
        sys.stderr.write(f"timerwheel: error: cancel sent for {ticket.message_id}, but it is not pending (no message "
                         "has this id, or it was cancelled or rescheduled already): the cancel changes nothing\n")
        return 1
    print(f"cancel sent for {ticket.message_id}: it was pending, due {iso(ticket.deliver_at_ms)}; it will not be "
          "delivered")
    return 0


def add_reschedule(sub: Any) -> None:
    p = sub.add_parser("reschedule", help="move a message to a later time; prints the new ticket",
                       **described(
                           "Move the ticket's message to a later time: one record that replaces the ticket (the same "
                           "message id, the next revision); prints the new ticket (tw2.). The first cancel or "
                           "reschedule of a ticket decides, later ones are void. An earlier time is refused: cancel "
                           "and schedule a new message. Where the shards can be read, a message that is no longer "
                           "pending (cancelled, or rescheduled already: its ticket is spent) is refused, exit 1, and "
                           "nothing is written; else it says so on stderr when that cannot be told.",
                           "timerwheel reschedule --data-dir ./data tw1.2.1700000005000.5f3c8a1e2b7d9c4f-0 --delay 1h",
                           "timerwheel reschedule --data-dir ./data tw1.2.1700000005000.5f3c8a1e2b7d9c4f-0 "
                           "--deliver-at now+2d"))
    client_args(p)
    p.add_argument("ticket", help="the ticket schedule (or the last reschedule) printed")
    _when_args(p)
    p.set_defaults(handler=cmd_reschedule)


def cmd_reschedule(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    _check_level(cfg, args.delay_level)
    ticket = _ticket(args.ticket)
    client = TimerClient(commit_log(cfg, args.kafka, args), cfg, validate=True)
    _check_partition(ticket, client)
    if ticket.deliver_at_ms > client.clock.now_ms():  # else the client refuses it, saying why
        index = _PendingIndex(cfg, client)
        pending = index.pending(ticket)
        if pending is False:
            sys.stderr.write(f"timerwheel: error: reschedule: {ticket.message_id} is not pending (cancelled, or "
                             "rescheduled already: this ticket is spent; reschedule the ticket that reschedule "
                             "printed): nothing was written\n")
            return 1
        if pending is None:
            sys.stderr.write(f"timerwheel: note: whether {ticket.message_id} is still pending is not known here "
                             f"({index.unknown}): if it was cancelled or rescheduled already, the service takes "
                             "this reschedule as void\n")
    _warn_if_past(args.deliver_at)
    return _print_ticket(args, lambda: client.reschedule(
        ticket, delay_ms=args.delay_ms, deliver_at_ms=args.deliver_at, delay_level=args.delay_level))


class _PendingIndex:
    """The pending messages of the data directory's shards (``timerwheel.pending``), when they can
    be read from here and the service has read the timer topic up to where it ended when asked;
    else ``unknown`` says why not."""

    def __init__(self, cfg: TimerConfig, client: TimerClient) -> None:
        from timerwheel.store.layout import found_shards

        self.cfg, self.client = cfg, client
        self.unknown = "" if found_shards(cfg.data_dir) else f"the data directory {cfg.data_dir} holds no shards"

    def pending(self, ticket: Ticket) -> bool | None:
        """Whether the ticket's message is pending; None if that cannot be told (``unknown``)."""
        found = self._find(ticket.message_id, ticket.deliver_at_ms, ticket.deliver_at_ms + 1, ticket.partition)
        return None if self.unknown else found is not None and found.revision == ticket.revision

    def find(self, message_id: str) -> PendingTimer | None:
        """The pending message with this id, whenever it is due; None if none (or ``unknown``)."""
        from timerwheel.wire import MAX_EPOCH_MS

        return self._find(message_id, 0, MAX_EPOCH_MS + 1, None)

    def _find(self, message_id: str, from_ms: int, to_ms: int, partition: int | None) -> PendingTimer | None:
        from timerwheel.pending import pending_timers
        from timerwheel.store.deployment import shards_to_show
        from timerwheel.store.layout import open_found_shards

        if self.unknown or not self._caught_up(partition):
            return None
        shards = open_found_shards(self.cfg.data_dir, shards_to_show(self.cfg.data_dir))
        try:
            found = pending_timers(self.client.log, shards, self.cfg, from_ms, to_ms, now_ms=self.client.clock.now_ms(),
                                   message_id=message_id, limit=1)
        finally:
            for shard in shards.values():
                shard.close()
        return found.timers[0] if found.timers else None

    def _caught_up(self, partition: int | None) -> bool:
        """Wait until the shards have read the timer topic up to its end as of now (a message or a
        cancel written just before is then in them); False (``unknown`` set) if they do not."""
        from timerwheel.runtime.wiring import checkpoint_offsets_of

        cfg = self.cfg
        ends = self.client.log.end_offsets(cfg.timer_topic)
        wanted = {p: e for p, e in ends.items() if partition is None or p == partition}
        offsets_of = checkpoint_offsets_of(cfg)
        deadline = time.monotonic() + CATCH_UP_S
        while True:
            behind = sum(max(0, e - offsets_of(p % cfg.shards).get(p, 0)) for p, e in wanted.items())
            if not behind:
                return True
            if time.monotonic() > deadline:
                self.unknown = (f"the service has {behind} timer records left to read, {CATCH_UP_S:g} s after "
                                "asking: is it running?")
                return False
            time.sleep(0.05)


def add_consume(sub: Any) -> None:
    p = sub.add_parser("consume", help="print a topic's records as JSON lines (to its end, or --follow)",
                       **described(
                           "Print a topic's records from its start to its end as JSON lines, then exit (with "
                           "--follow: keep waiting for new ones). A key, value or header value that is not UTF-8 "
                           "is shown as {\"base64\": \"...\"}; --raw writes the values' bytes only, each followed "
                           "by a newline. A topic that does not exist is an error (a destination is made by its "
                           "first delivery: --follow waits for it).",
                           "timerwheel consume --data-dir ./data --topic orders",
                           "timerwheel consume --kafka localhost:9092 --topic orders --follow --iso",
                           "timerwheel consume --data-dir ./data --topic images --raw > images.bin"))
    client_args(p, create=True)
    p.add_argument("--topic", required=True, help="topic to read from its start")
    p.add_argument("--follow", action="store_true", help="keep waiting for new records")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--iso", action="store_true", help="times as ISO 8601 (UTC): the timestamp and the tw-* times")
    out.add_argument("--raw", action="store_true", help="write each value's bytes and a newline, nothing else")
    p.set_defaults(handler=cmd_consume)


def cmd_consume(args: argparse.Namespace) -> int:
    from timerwheel.transports.local.log import LocalCommitLog

    cfg = build_config(args)
    log = commit_log(cfg, args.kafka, args)
    # the local log makes a topic when asked for its partitions: ask it for the topic's id instead
    exists = log.topic_id(args.topic) is not None if isinstance(log, LocalCommitLog) else \
        log.partition_count(args.topic) is not None
    if not exists:
        if not args.follow:
            raise CliError(f"--topic: topic {args.topic!r} does not exist (a destination is made by its first "
                           "delivery; --follow waits for it)")
        if not _wait_for_topic(log, args.topic):
            return 0
    ends = None if args.follow else log.end_offsets(args.topic)
    consumer = log.consumer(args.topic, log.start_offsets(args.topic))
    write = _raw_value if args.raw else lambda r: print(_record_json(r, args.iso), flush=True)
    try:
        last_progress = time.monotonic()
        while True:
            batch = consumer.poll(1000, 0.5)
            for r in batch:
                write(r)
            if ends is None:
                continue
            left = {p: e for p, e in ends.items() if consumer.position(p) < e}
            if not left:
                return 0
            if batch:
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > CONSUME_STALL_S:
                raise CliError(f"--topic: reading {args.topic!r} made no progress for {CONSUME_STALL_S:g} s "
                               f"before its end offsets {left}")
    except KeyboardInterrupt:
        return 0
    finally:
        consumer.close()


def _print_ticket(args: argparse.Namespace, schedule: Callable[[], Ticket]) -> int:
    """Print the ticket ``schedule`` returns; a timer the service's rules refuse is one line, exit 2."""
    try:
        ticket = schedule()
    except RefusedTimer as exc:
        raise CliError(_refusal(args, exc)) from None
    except (ValueError, InvalidTimerMessage) as exc:
        raise CliError(f"{args.command}: {exc}") from None
    print(ticket)
    return 0


def _refusal(args: argparse.Namespace, exc: RefusedTimer) -> str:
    """The service's reason in the words of the command line: flags and ``TW_*`` variables, not
    wire headers or setting names, led by the flag the reason is about."""
    reason = _user_words(exc.reason)
    when = next((f for f, v in (("--delay", args.delay_ms), ("--deliver-at", args.deliver_at),
                                ("--delay-level", args.delay_level)) if v is not None), "--delay")
    flag = ("--topic" if "topic" in reason and "--delay" not in reason else "--id" if "--id" in reason
            else "--value" if "TW_MAX_RECORD_BYTES" in reason else when)
    return f"{flag}: refused, the service would dead-letter it: {reason}"


def _user_words(reason: str) -> str:
    return re.sub("|".join(map(re.escape, _USER_WORDS)), lambda m: _USER_WORDS[m.group(0)], reason)


def _check_level(cfg: TimerConfig, level: int | None) -> None:
    if level is not None and not 1 <= level <= len(cfg.delay_levels_ms):
        raise CliError(f"--delay-level: must be 1..{len(cfg.delay_levels_ms)} (TW_DELAY_LEVELS), got {level}")


def _ticket(text: str) -> Ticket:
    try:
        return Ticket.parse(text)
    except ValueError as exc:
        raise CliError(f"ticket: {exc}") from None


def _check_partition(ticket: Ticket, client: TimerClient) -> None:
    """A ticket naming a timer partition that does not exist: one line, not a traceback."""
    if ticket.partition >= client.partitions:
        raise CliError(f"ticket: partition {ticket.partition} does not exist: timer topic {client.config.timer_topic!r} "
                       f"has {client.partitions} partitions (a ticket of another timer topic or cluster?)")


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


def _bytes_json(b: bytes | None) -> str | dict[str, str] | None:
    """Text when it is UTF-8, else ``{"base64": ...}``: binary shown faithfully, never replaced."""
    if b is None:
        return None
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(b).decode("ascii")}


def _record_json(r: Record, iso_times: bool = False) -> str:
    def header(name: str, value: bytes) -> Any:
        if iso_times and name in _TIME_HEADERS and value.isdigit():
            return iso(int(value))
        return _bytes_json(value)

    return json.dumps({"topic": r.topic, "partition": r.partition, "offset": r.offset,
                       "timestamp": iso(r.timestamp_ms) if iso_times else r.timestamp_ms,
                       "key": _bytes_json(r.key), "value": _bytes_json(r.value),
                       "headers": {k: header(k, v) for k, v in r.headers}})


def _raw_value(r: Record) -> None:
    sys.stdout.buffer.write((r.value or b"") + b"\n")
    sys.stdout.buffer.flush()
