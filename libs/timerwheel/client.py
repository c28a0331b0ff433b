"""Schedule, cancel and reschedule timer messages over any CommitLog (Kafka or the local log).

    client = TimerClient(commit_log)
    ticket = client.schedule("orders", b"value", key=b"k", delay_ms=5_000)
    client.cancel(ticket)
    new_ticket = client.reschedule(ticket, deliver_at_ms=...)   # the same message, moved later

The client only sets the public ``tw-*`` headers (any Kafka producer can do the same). It
picks the timer partition from the message id, and the ticket remembers it: a cancel must
go to the same timer partition as its message, so that both land in the same shard.

``TimerClient(log, validate=True)`` checks each timer with the service's own rules
(``TimerRules``: destination allowed and legal, delay within ``max_delay_ms``, time in range)
and raises ``InvalidTimerMessage`` with the reason instead of writing a record the service
would only dead-letter; the ``timerwheel schedule`` command does.

``reschedule`` (issue 31) finds the message's timer record (reading its timer partition back from
the end) and appends **one record that replaces the ticket**: the same key, value, user headers
and ``tw-id``, ``tw-revision`` = the ticket's + 1, ``tw-deliver-at`` = the new time, ``tw-replaces``
= the ticket's time. It returns the new ticket (``tw2.<partition>.<time>.<revision>.<id>``). For
each ticket the first cancel or reschedule in its timer partition decides and later ones are void,
so exactly one of the old and the new message is delivered, under the same ``tw-id``. Only moves
to a later time (or the same): an earlier one is refused here and void at the service (cancel and
schedule a new message instead). What the client can see is void it refuses: the time passed, or
a cancel or reschedule of the ticket already after the message in the part of the partition
``find`` read. No transaction (before issue 31 a cancel and a new message went in one).
"""

from __future__ import annotations

import getpass
import itertools
import os
import re
import socket
import time
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry.trace import Span

from timerwheel import telemetry
from timerwheel.clock import Clock, SystemClock
from timerwheel.config import TimerConfig
from timerwheel.errors import InvalidTimerMessage, TimerwheelError
from timerwheel.records import Headers, OutRecord, Record
from timerwheel.transports.base import CommitLog
from timerwheel.wire import (
    H_CANCEL,
    H_DELAY_LEVEL,
    H_DELAY_MS,
    H_DELIVER_AT,
    H_ID,
    H_PARTITION,
    H_REPLACES,
    H_REVISION,
    H_TOPIC,
    Ticket,
    TimerRules,
    marker_target,
    record_revision,
    user_headers,
)

#: ``find`` reads a timer partition back from its end this many records at a time.
FIND_CHUNK = 5_000
#: ... and gives up when one chunk takes longer than this.
FIND_TIMEOUT_S = 60.0
_DEFAULT_ID = re.compile(r"(\d+)-(\d+)")


class RefusedTimer(InvalidTimerMessage):
    """A timer ``TimerClient(validate=True)`` refuses: the service would dead-letter it (``reason``,
    the service's own). ``index``: its place in the batch; ``message_id``: the id it was given,
    if any (a generated one is never shown: nobody has seen it)."""

    def __init__(self, reason: str, index: int, batch: int, message_id: str | None) -> None:
        super().__init__(reason)
        self.index = index
        self.message_id = message_id
        self._which = f"{message_id}: " if message_id else f"timer {index} of {batch}: " if batch > 1 else ""

    def __str__(self) -> str:
        return f"{self._which}refused, the service would dead-letter it: {self.reason}"


@dataclass(frozen=True, slots=True)
class Timer:
    """One message to schedule: give exactly one of delay_ms, deliver_at_ms, delay_level."""

    topic: str
    value: bytes | None
    key: bytes | None = None
    headers: Headers = ()
    delay_ms: int | None = None
    deliver_at_ms: int | None = None
    delay_level: int | None = None
    message_id: str | None = None
    #: Destination partition; by default the key decides, as Kafka does.
    partition: int | None = None


def default_client_id(timer_topic: str) -> str:
    """``<host>-<user>-<timer topic>``: the same for every run of a client on one machine, so a
    restarted client ends what its crashed predecessor left open (module header)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a container's uid without a passwd entry nor $USER
        user = str(os.getuid())
    return f"{socket.gethostname()}-{user}-{timer_topic}"


class TimerClient:
    def __init__(self, commit_log: CommitLog, config: TimerConfig | None = None, clock: Clock | None = None,
                 *, validate: bool = False, client_id: str | None = None) -> None:
        """``client_id`` names the client (``default_client_id`` by default); ``transactional_id``,
        derived from it, is kept for tools that ended a reschedule transaction left open by a
        build before issue 31 (``reschedule`` opens none now)."""
        self.log = commit_log
        self.config = config or TimerConfig()
        self.clock = clock or SystemClock()
        self.client_id = client_id or default_client_id(self.config.timer_topic)
        self.transactional_id = f"timerwheel-reschedule-{self.client_id}"
        self.rules = TimerRules(self.config) if validate else None
        self.partitions = commit_log.ensure_topic(self.config.timer_topic, self.config.timer_partitions)
        # Ids: a random 64-bit prefix per client and a counter (unique, and far cheaper than uuid4 each).
        self._id_prefix = uuid.uuid4().hex[:16]
        self._ids = itertools.count()

    def schedule(self, topic: str, value: bytes | None, *, key: bytes | None = None, headers: Headers = (),
                 delay_ms: int | None = None, deliver_at_ms: int | None = None, delay_level: int | None = None,
                 message_id: str | None = None, partition: int | None = None) -> Ticket:
        return self.schedule_many([Timer(topic, value, key, tuple(headers), delay_ms, deliver_at_ms, delay_level,
                                         message_id, partition)])[0]

    def schedule_many(self, timers: Sequence[Timer]) -> list[Ticket]:
        """Schedule a batch in one append; returns a ticket per timer, in order."""
        records, tickets, spans = self._timer_records(timers)
        self.log.append(records)
        for span in spans or ():
            span.end()
        return tickets

    def _timer_records(self, timers: Sequence[Timer], timer_partition: int | None = None
                       ) -> tuple[list[OutRecord], list[Ticket], list[Span] | None]:
        now = self.clock.now_ms()
        records: list[OutRecord] = []
        tickets: list[Ticket] = []
        spans: list[Span] | None = [] if telemetry.tracer() is not None else None
        fixed_partition = timer_partition
        for t in timers:
            timer_partition = fixed_partition
            given = sum(x is not None for x in (t.delay_ms, t.deliver_at_ms, t.delay_level))
            if given != 1:
                raise ValueError(f"{t.topic}: give exactly one of delay_ms, deliver_at_ms, delay_level")
            message_id = t.message_id or f"{self._id_prefix}-{next(self._ids)}"
            headers = [*t.headers, (H_TOPIC, t.topic.encode()), (H_ID, message_id.encode())]
            if t.delay_ms is not None:
                if t.delay_ms < 0:
                    raise ValueError(f"delay_ms must be >= 0, got {t.delay_ms}")
                deliver = now + t.delay_ms
                headers.append((H_DELAY_MS, str(t.delay_ms).encode()))
            elif t.deliver_at_ms is not None:
                deliver = t.deliver_at_ms
                headers.append((H_DELIVER_AT, str(t.deliver_at_ms).encode()))
            else:
                assert t.delay_level is not None
                levels = self.config.delay_levels_ms
                if not 1 <= t.delay_level <= len(levels):
                    raise ValueError(f"delay_level must be 1..{len(levels)}, got {t.delay_level}")
                deliver = now + levels[t.delay_level - 1]
                headers.append((H_DELAY_LEVEL, str(t.delay_level).encode()))
            if t.partition is not None:
                headers.append((H_PARTITION, str(t.partition).encode()))
            if timer_partition is None:
                timer_partition = zlib.crc32(message_id.encode()) % self.partitions
            if self.rules is not None:
                check = Record(self.config.timer_topic, timer_partition, 0, now, t.key, t.value, tuple(headers))
                try:
                    self.rules.parse(check, now)
                except InvalidTimerMessage as exc:
                    raise RefusedTimer(exc.reason, len(records), len(timers), t.message_id) from None
            if spans is not None:
                sent = telemetry.send_span(self.config.timer_topic, message_id, timer_partition, t.topic)
                if sent is not None:
                    spans.append(sent[0])
                    headers = [h for h in headers if h[0] not in telemetry.TRACE_HEADERS] + list(sent[1])
            records.append(OutRecord(self.config.timer_topic, t.key, t.value, tuple(headers),
                                     partition=timer_partition, timestamp_ms=now))
            tickets.append(Ticket(timer_partition, deliver, message_id))
        return records, tickets, spans

    def cancel(self, ticket: Ticket | str) -> None:
        self.cancel_many([ticket])

    def cancel_many(self, tickets: Sequence[Ticket | str]) -> None:
        records, spans = self._cancel_records(tickets)
        self.log.append(records)
        for span in spans:
            span.end()

    def _cancel_records(self, tickets: Sequence[Ticket | str]) -> tuple[list[OutRecord], list[Span]]:
        now = self.clock.now_ms()
        records = []
        spans: list[Span] = []
        tracing = telemetry.tracer() is not None
        for t in tickets:
            ticket = Ticket.parse(t) if isinstance(t, str) else t
            headers: Headers = ((H_CANCEL, ticket.message_id.encode()),
                                (H_DELIVER_AT, str(ticket.deliver_at_ms).encode()))
            if ticket.revision:  # a rescheduled message: the revision this cancel stands against
                headers += ((H_REVISION, str(ticket.revision).encode()),)
            if tracing:
                sent = telemetry.send_span(self.config.timer_topic, ticket.message_id, ticket.partition, None,
                                           cancel=True)
                if sent is not None:
                    spans.append(sent[0])
                    headers += sent[1]
            # Keyed by the target: Kafka's client refuses a record with neither key nor value.
            records.append(OutRecord(self.config.timer_topic, ticket.message_id.encode(), None, headers,
                                     partition=ticket.partition, timestamp_ms=now))
        return records, spans

    def find(self, ticket: Ticket | str, max_records: int = 10_000_000) -> Record | None:
        """The newest timer record of the ticket's message and revision (its first write, a rolled
        copy, or for a revision above 0 the reschedule record or its copies), read back from the
        end of its timer partition (at most ``max_records``), or None."""
        return self._find(ticket, max_records)[0]

    def _find(self, ticket: Ticket | str, max_records: int = 10_000_000) -> tuple[Record | None, list[Record]]:
        """``find``, and the cancels and reschedules of the ticket met after that record (in the
        chunks read: the newest ones)."""
        ticket = Ticket.parse(ticket) if isinstance(ticket, str) else ticket
        topic, p = self.config.timer_topic, ticket.partition
        want = ticket.message_id.encode()
        target = (ticket.message_id, ticket.revision)
        default = _DEFAULT_ID.fullmatch(ticket.message_id)
        if default and int(default.group(1)) == p and not ticket.revision:  # an id the service gave
            rec = self.log.read(topic, [(p, int(default.group(2)))])[0]
            if rec is not None and rec.header(H_ID) in (None, want) and rec.header(H_CANCEL) is None:
                return rec, []
        start = self.log.start_offsets(topic).get(p, 0)
        hi = self.log.end_offsets(topic).get(p, 0)
        deciders: list[Record] = []
        while hi > start and max_records > 0:
            lo = max(start, hi - FIND_CHUNK)
            found: Record | None = None
            consumer = self.log.consumer(topic, {p: lo})
            deadline = time.monotonic() + FIND_TIMEOUT_S
            try:
                while consumer.position(p) < hi:
                    if time.monotonic() > deadline:
                        raise TimerwheelError(f"find: reading partition {p} of {topic!r} from offset {lo} "
                                              f"did not reach {hi} within {FIND_TIMEOUT_S:g} s")
                    for r in consumer.poll(FIND_CHUNK, 1.0):
                        if r.offset >= hi:
                            continue
                        if marker_target(r) == target:
                            deciders.append(r)
                        elif r.header(H_ID) == want and r.header(H_CANCEL) is None and record_revision(r) == ticket.revision:
                            found = r
            finally:
                consumer.close()
            if found is not None:
                return found, [d for d in deciders if d.offset > found.offset]
            max_records -= hi - lo
            hi = lo
        return None, deciders

    def reschedule(self, ticket: Ticket | str, *, delay_ms: int | None = None, deliver_at_ms: int | None = None,
                   delay_level: int | None = None, message_id: str | None = None,
                   original: Record | None = None) -> Ticket:
        """Move the ticket's message to a later time (or the same): one record that replaces the
        ticket (module header); returns the new ticket, of the same id and the next revision.
        Refused (``TimerwheelError``, nothing written) when it would be void: the old delivery time
        passed, the new time is before it, or a cancel or reschedule of the ticket is in its timer
        partition already. ``message_id``: must be the ticket's, if given (the id stays).
        ``original``: the message's newest timer record when the caller has it already (the
        console reads it from the position the TimerLog names), instead of ``find``ing it (and the
        ticket's decisions after it: the service decides then)."""
        ticket = Ticket.parse(ticket) if isinstance(ticket, str) else ticket
        if message_id is not None and message_id != ticket.message_id:
            raise ValueError(f"reschedule keeps the message id {ticket.message_id!r}; got {message_id!r}")
        now = self.clock.now_ms()
        if ticket.deliver_at_ms <= now:
            raise TimerwheelError(f"reschedule: the delivery time of {ticket.message_id!r} passed "
                                  f"{now - ticket.deliver_at_ms} ms ago; the message was most likely delivered")
        given = sum(x is not None for x in (delay_ms, deliver_at_ms, delay_level))
        if given != 1:
            raise ValueError("reschedule: give exactly one of delay_ms, deliver_at_ms, delay_level")
        if delay_ms is not None:
            new_time = now + delay_ms
        elif deliver_at_ms is not None:
            new_time = deliver_at_ms
        else:
            assert delay_level is not None
            levels = self.config.delay_levels_ms
            if not 1 <= delay_level <= len(levels):
                raise ValueError(f"delay_level must be 1..{len(levels)}, got {delay_level}")
            new_time = now + levels[delay_level - 1]
        if new_time < ticket.deliver_at_ms:
            raise TimerwheelError(
                f"reschedule: {new_time} is before the ticket's time {ticket.deliver_at_ms}; a reschedule only "
                f"moves a message later (an earlier one is void): cancel {ticket} and schedule a new message")
        record, spans = self._next_revision(ticket, new_time, original, "reschedule")
        record = record._replace(headers=(*record.headers, (H_REPLACES, str(ticket.deliver_at_ms).encode())))
        self.log.append([record])
        for span in spans or ():
            span.end()
        return Ticket(ticket.partition, new_time, ticket.message_id, ticket.revision + 1)

    def deliver_now(self, ticket: Ticket | str, *, original: Record | None = None) -> Ticket:
        """Deliver the ticket's message now instead of at its time: a cancel of the ticket and a
        copy of the message due now (the same id, the next revision, no ``tw-replaces``), appended
        together to the ticket's timer partition, the copy first (a cancel written without its copy
        would lose the message; a copy without its cancel costs a duplicate of the same id);
        returns the copy's ticket. The cancel is the
        ticket's first decision, so the old message never leaves. Refused (``TimerwheelError``,
        nothing written) when its time passed or a cancel or reschedule of the ticket is in the
        partition already (the client reads it back). What it cannot see: a reschedule of the same
        ticket appended between that read and this append wins over the cancel, and both the
        copy and the moved message are delivered, under the same ``tw-id`` and revision."""
        ticket = Ticket.parse(ticket) if isinstance(ticket, str) else ticket
        now = self.clock.now_ms()
        if ticket.deliver_at_ms <= now:
            raise TimerwheelError(f"deliver now: the delivery time of {ticket.message_id!r} passed "
                                  f"{now - ticket.deliver_at_ms} ms ago; the message was most likely delivered")
        record, spans = self._next_revision(ticket, now, original, "deliver now")
        cancels, cancel_spans = self._cancel_records([ticket])
        self.log.append([record, *cancels])
        for span in [*cancel_spans, *(spans or ())]:
            span.end()
        return Ticket(ticket.partition, now, ticket.message_id, ticket.revision + 1)

    def _next_revision(self, ticket: Ticket, new_time: int, original: Record | None,
                       what: str) -> tuple[OutRecord, list[Span] | None]:
        """The ticket's message as a timer record of the next revision due ``new_time``, to the
        ticket's partition. Refused when the ticket was cancelled or rescheduled already."""
        deciders: list[Record] = []
        if original is None:
            original, deciders = self._find(ticket)
        if original is None:
            raise TimerwheelError(f"{what}: no timer record of {ticket.message_id!r} revision {ticket.revision} "
                                  f"in partition {ticket.partition} of {self.config.timer_topic!r}")
        if deciders:
            first = deciders[0]
            done = "cancelled" if first.header(H_CANCEL) is not None else "rescheduled"
            raise TimerwheelError(f"{what}: {ticket} was {done} already (offset {first.offset} of partition "
                                  f"{first.partition}); the first cancel or reschedule of a ticket decides")
        topic = (original.header(H_TOPIC) or b"").decode("utf-8", "replace")
        raw_partition = original.header(H_PARTITION)
        timer = Timer(topic, original.value, original.key, tuple(user_headers(original.headers)),
                      deliver_at_ms=new_time, message_id=ticket.message_id,
                      partition=int(raw_partition) if raw_partition and raw_partition.isdigit() else None)
        records, _tickets, spans = self._timer_records([timer], timer_partition=ticket.partition)
        record = records[0]
        return record._replace(headers=(*record.headers, (H_REVISION, str(ticket.revision + 1).encode()))), spans
