"""Schedule and cancel timer messages over any CommitLog (Kafka or the local log).

    client = TimerClient(commit_log)
    ticket = client.schedule("orders", b"value", key=b"k", delay_ms=5_000)
    client.cancel(ticket)

The client only sets the public ``tw-*`` headers (any Kafka producer can do the same). It
picks the timer partition from the message id, and the ticket remembers it: a cancel must
go to the same timer partition as its message, so that both land in the same shard.
"""

from __future__ import annotations

import itertools
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry.trace import Span

from timerwheel import telemetry
from timerwheel.clock import Clock, SystemClock
from timerwheel.config import TimerConfig
from timerwheel.records import Headers, OutRecord
from timerwheel.transports.base import CommitLog
from timerwheel.wire import (
    H_CANCEL,
    H_DELAY_LEVEL,
    H_DELAY_MS,
    H_DELIVER_AT,
    H_ID,
    H_PARTITION,
    H_TOPIC,
    Ticket,
)


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


class TimerClient:
    def __init__(self, commit_log: CommitLog, config: TimerConfig | None = None, clock: Clock | None = None) -> None:
        self.log = commit_log
        self.config = config or TimerConfig()
        self.clock = clock or SystemClock()
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
        now = self.clock.now_ms()
        records: list[OutRecord] = []
        tickets: list[Ticket] = []
        spans: list[Span] | None = [] if telemetry.tracer() is not None else None
        for t in timers:
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
            timer_partition = zlib.crc32(message_id.encode()) % self.partitions
            if spans is not None:
                sent = telemetry.send_span(self.config.timer_topic, message_id, timer_partition, t.topic)
                if sent is not None:
                    spans.append(sent[0])
                    headers = [h for h in headers if h[0] not in telemetry.TRACE_HEADERS] + list(sent[1])
            records.append(OutRecord(self.config.timer_topic, t.key, t.value, tuple(headers),
                                     partition=timer_partition, timestamp_ms=now))
            tickets.append(Ticket(timer_partition, deliver, message_id))
        self.log.append(records)
        for span in spans or ():
            span.end()
        return tickets

    def cancel(self, ticket: Ticket | str) -> None:
        self.cancel_many([ticket])

    def cancel_many(self, tickets: Sequence[Ticket | str]) -> None:
        now = self.clock.now_ms()
        records = []
        spans: list[Span] = []
        tracing = telemetry.tracer() is not None
        for t in tickets:
            ticket = Ticket.parse(t) if isinstance(t, str) else t
            headers: Headers = ((H_CANCEL, ticket.message_id.encode()),
                                (H_DELIVER_AT, str(ticket.deliver_at_ms).encode()))
            if tracing:
                sent = telemetry.send_span(self.config.timer_topic, ticket.message_id, ticket.partition, None,
                                           cancel=True)
                if sent is not None:
                    spans.append(sent[0])
                    headers += sent[1]
            # Keyed by the target: Kafka's client refuses a record with neither key nor value.
            records.append(OutRecord(self.config.timer_topic, ticket.message_id.encode(), None, headers,
                                     partition=ticket.partition, timestamp_ms=now))
        self.log.append(records)
        for span in spans:
            span.end()
