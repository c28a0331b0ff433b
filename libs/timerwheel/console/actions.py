"""The console's write actions, each a record of the public wire contract (README "The wire
contract"), written through ``TimerClient`` as any producer would write it:

- **cancel**: a ``tw-cancel`` record with the message's ``tw-deliver-at``, to its timer partition;
- **reschedule**: ``TimerClient.reschedule`` (one record that replaces the ticket: the same id,
  the next revision), to a later time only;
- **deliver now**: ``TimerClient.deliver_now``: a copy of the message due now (the same id, the next
  revision) and a cancel of the ticket, appended together;
- **redrive** a dead letter: a new timer record built from it: its destination, key, value and
  user headers, its id (``tw-id``, else the id the service gave it), due at its old delivery time
  or now if that has passed. What the service would dead-letter again (a destination the
  allow-list refuses, a destination that does not exist with ``TW_MISSING_TOPIC=dlq``, ...) is
  refused here with the reason and not written.

Each returns an ``Outcome`` saying what was written; a refusal raises ``ActionRefused`` with one
line saying why, which the page shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from timerwheel.client import Timer, TimerClient, default_client_id
from timerwheel.console.browse import DeadLetter, PendingItem, find_pending
from timerwheel.console.source import Installation
from timerwheel.errors import InvalidTimerMessage, TimerwheelError
from timerwheel.records import Record
from timerwheel.wire import (
    H_DELIVER_AT,
    H_ERROR,
    H_ID,
    H_PARTITION,
    H_SOURCE,
    H_TOPIC,
    Ticket,
    TimerRules,
    user_headers,
)

#: Dead letters one redrive by filter schedules at most.
REDRIVE_MAX = 10_000
#: Timer records per append when redriving many.
REDRIVE_BATCH = 500


class ActionRefused(TimerwheelError):
    """An action the console will not carry out; the message says why."""


@dataclass(slots=True)
class Outcome:
    title: str
    detail: str
    ticket: str | None = None
    refused: list[str] = field(default_factory=list)


class Actions:
    def __init__(self, inst: Installation) -> None:
        self.inst = inst
        self._client: TimerClient | None = None

    @property
    def client(self) -> TimerClient:
        if self._client is None:
            # A client id of its own: a `timerwheel reschedule` run by the same user on this host
            # would otherwise fence the console's transactional producer (client.py's header).
            config = self.inst.config
            self._client = TimerClient(self.inst.commit_log, config, self.inst.clock,
                                       client_id=f"{default_client_id(config.timer_topic)}-console")
        return self._client

    def warm(self) -> None:
        """Connect what a write needs before the first one: the client (a reschedule writes one
        record since issue 31: no transactional producer to start)."""
        _ = self.client

    def _pending(self, message_id: str) -> PendingItem:
        message_id = message_id.strip()
        if not message_id:
            raise ActionRefused("no message id given")
        with self.inst.shards() as shards:
            item = find_pending(shards, self.inst.commit_log, self.inst.config, message_id, self.inst.columns())
        if item is None or item.deliver_at_ms is None:
            raise ActionRefused(f"no pending message with id {message_id!r}: it was delivered or cancelled, or "
                                "enqueue-put has not written it yet (W)")
        now = self.inst.now_ms()
        if item.deliver_at_ms <= now:
            raise ActionRefused(f"{message_id!r} was due {now - item.deliver_at_ms} ms ago: it is being delivered, "
                                "and a cancel can no longer meet it")
        return item

    def cancel(self, message_id: str) -> Outcome:
        item = self._pending(message_id)
        ticket = Ticket(item.partition, item.deliver_at_ms or 0, item.message_id, item.revision)
        self.client.cancel(ticket)
        return Outcome("Cancelled", f"a cancel record for {item.message_id!r} (due {item.deliver_at_ms}) was "
                                    f"written to partition {item.partition} of {self.inst.config.timer_topic!r}: "
                                    "the message will not be delivered", str(ticket))

    def reschedule(self, message_id: str, deliver_at_ms: int) -> Outcome:
        item = self._pending(message_id)
        now = self.inst.now_ms()
        if deliver_at_ms < now:
            raise ActionRefused(f"the new delivery time {deliver_at_ms} is {now - deliver_at_ms} ms in the past "
                                "(to deliver it at once, use deliver now)")
        return self._move(item, max(deliver_at_ms, now), "Rescheduled")

    def deliver_now(self, message_id: str) -> Outcome:
        item = self._pending(message_id)
        assert item.deliver_at_ms is not None
        ticket = Ticket(item.partition, item.deliver_at_ms, item.message_id, item.revision)
        try:  # the client finds the record and reads what decided the ticket since (nothing, or refused)
            new = self.client.deliver_now(ticket)
        except TimerwheelError as exc:
            raise ActionRefused(str(exc)) from None
        return Outcome("Delivered now", f"{item.message_id!r}: a copy due now (revision {new.revision}, the same id) "
                                        f"and a cancel of its delivery at {item.deliver_at_ms} were written to "
                                        f"partition {item.partition} of {self.inst.config.timer_topic!r}", str(new))

    def _original(self, item: PendingItem) -> Record:
        original = self.inst.commit_log.read(self.inst.config.timer_topic, [(item.partition, item.offset)])[0]
        if original is None:
            raise ActionRefused(f"the timer record of {item.message_id!r} is gone from the timer topic (retention)")
        return original

    def _move(self, item: PendingItem, deliver_at_ms: int, title: str) -> Outcome:
        assert item.deliver_at_ms is not None
        tick = self.inst.config.tick_ms
        if deliver_at_ms // tick == item.deliver_at_ms // tick:
            raise ActionRefused(f"{item.message_id!r} is due at {item.deliver_at_ms} already, in the same tick as "
                                f"{deliver_at_ms}: nothing to change")
        if deliver_at_ms < item.deliver_at_ms:
            raise ActionRefused(f"{item.message_id!r} is due at {item.deliver_at_ms}: a reschedule only moves a message "
                                "later (issue 31; an earlier one would be void). Use deliver now, or cancel it and "
                                "schedule a new message")
        original = self._original(item)
        ticket = Ticket(item.partition, item.deliver_at_ms, item.message_id, item.revision)
        new = self.client.reschedule(ticket, deliver_at_ms=deliver_at_ms, message_id=item.message_id,
                                     original=original)
        return Outcome(title, f"{item.message_id!r}: a reschedule record moving its delivery at {item.deliver_at_ms} "
                              f"to {deliver_at_ms} (revision {new.revision}, the same id) was written to partition "
                              f"{item.partition} of {self.inst.config.timer_topic!r}", str(new))

    def redrive(self, letters: Sequence[DeadLetter]) -> Outcome:
        """Schedule the dead letters again (see the module header); those the service would
        dead-letter again are refused, each with its reason, and the others written."""
        if not letters:
            raise ActionRefused("no dead letter matches: nothing to redrive")
        if len(letters) > REDRIVE_MAX:
            raise ActionRefused(f"{len(letters)} dead letters match, more than {REDRIVE_MAX} in one redrive: "
                                "narrow the filter")
        rules = TimerRules(self.inst.config)
        now = self.inst.now_ms()
        timers: list[Timer] = []
        refused: list[str] = []
        missing: dict[str, bool] = {}
        for d in letters:
            try:
                timer = redrive_timer(d, now, rules, self.inst.config.timer_topic)
            except InvalidTimerMessage as exc:
                refused.append(f"{d.partition}/{d.offset}: {exc}")
                continue
            if self.inst.config.missing_topic == "dlq":  # the service would dead-letter it at once
                if timer.topic not in missing:
                    missing[timer.topic] = self.inst.commit_log.partition_count(timer.topic) is None
                if missing[timer.topic]:
                    refused.append(f"{d.partition}/{d.offset}: destination topic {timer.topic!r} does not exist "
                                   "(TW_MISSING_TOPIC=dlq): create it, then redrive")
                    continue
            timers.append(timer)
        tickets = []
        for i in range(0, len(timers), REDRIVE_BATCH):
            tickets += self.client.schedule_many(timers[i:i + REDRIVE_BATCH])
        detail = (f"{len(tickets)} timer record(s) written to {self.inst.config.timer_topic!r}"
                  + (f"; {len(refused)} refused" if refused else ""))
        return Outcome("Redriven" if tickets else "Nothing redriven", detail,
                       str(tickets[0]) if len(tickets) == 1 else None, refused)


def redrive_timer(d: DeadLetter, now_ms: int, rules: TimerRules, timer_topic: str) -> Timer:
    """The timer a dead letter is scheduled again as; InvalidTimerMessage if the service would
    dead-letter it again."""
    topic = d.header(H_TOPIC)
    if not topic:
        raise InvalidTimerMessage("no tw-topic: the dead letter names no destination")
    raw_at = d.header(H_DELIVER_AT)
    deliver = max(int(raw_at), now_ms) if raw_at.isdigit() else now_ms
    message_id = d.header(H_ID) or _id_from_source(d.header(H_SOURCE)) or f"dlq-{d.partition}-{d.offset}"
    raw_part = d.header(H_PARTITION)
    headers = tuple((k, v) for k, v in user_headers(tuple(d.headers)) if k not in (H_ERROR, H_SOURCE))
    timer = Timer(topic, d.value, d.key, headers, deliver_at_ms=deliver, message_id=message_id,
                  partition=int(raw_part) if raw_part.isdigit() else None)
    check = Record(timer_topic, 0, 0, now_ms, d.key, d.value,
                   (*headers, (H_TOPIC, topic.encode()), (H_ID, message_id.encode()),
                    (H_DELIVER_AT, str(deliver).encode()),
                    *(((H_PARTITION, raw_part.encode()),) if raw_part.isdigit() else ())))
    rules.parse(check, now_ms)
    return timer


def _id_from_source(source: str) -> str | None:
    """The id the service gave a record without ``tw-id``: ``<partition>-<offset>`` of its timer record."""
    parts = source.rsplit("/", 2)
    if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
        return f"{parts[1]}-{parts[2]}"
    return None
