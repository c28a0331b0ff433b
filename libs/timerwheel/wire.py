"""The wire contract: ``tw-*`` headers on the timer topic, and what the service stamps.

Any Kafka client in any language schedules by setting these headers; this module is the
one place that reads them. ``parse_timer_record`` turns a timer-topic record into a
``TimerRequest`` or raises ``InvalidTimerMessage`` with the reason that goes into the
dead-letter record's ``tw-error`` header.

Ids: ``tw-id`` if present, else ``<partition>-<offset>`` of the record as first written.
A rolled record carries its resolved id in ``tw-id``, so the id never changes. The TimerLog
keeps a 64-bit hash of the id (``id_hash``); a cancel is confirmed on the full id.

Revisions (issue 31): a reschedule is one record that replaces a ticket: the message's content,
the same ``tw-id``, ``tw-revision`` = the ticket's + 1, ``tw-deliver-at`` = the new time and
``tw-replaces`` = the ticket's time. A message is ``(tw-id, tw-revision)`` (no header: revision 0);
the TimerLog's hash of revision ``r > 0`` is that of ``id + "\0" + r`` (``revision_id_hash``), so a
marker of one revision never touches another. A reschedule record is a **marker** of
``(id, revision - 1)`` due at ``tw-replaces``, as a cancel (``tw-cancel`` = id, ``tw-revision`` =
the revision it cancels) is; of a message's markers the first in its timer partition decides
(``tw-first-offset``, stamped on a marker's roll hops, keeps its producer's offset).
"""

from __future__ import annotations

import hashlib
import re
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from timerwheel.config import TimerConfig
from timerwheel.errors import InvalidTimerMessage
from timerwheel.records import Headers, Record

H_TOPIC = "tw-topic"
H_DELIVER_AT = "tw-deliver-at"
H_DELAY_MS = "tw-delay-ms"
H_DELAY_LEVEL = "tw-delay-level"
H_ID = "tw-id"
H_CANCEL = "tw-cancel"
H_PARTITION = "tw-partition"
H_ROLL = "tw-roll"
H_ENQUEUED_AT = "tw-enqueued-at"
H_DELIVERED_AT = "tw-delivered-at"
H_ERROR = "tw-error"
H_SOURCE = "tw-source"
#: When dequeue-put first found the destination of a due message missing (it holds it, then DLQ).
H_HELD_SINCE = "tw-held-since"
#: Issue 31: the revision of a message (absent: 0), the delivery time of the ticket a reschedule
#: replaces, and on a marker's roll hop the offset its producer's record got (which came first).
H_REVISION = "tw-revision"
H_REPLACES = "tw-replaces"
H_FIRST_OFFSET = "tw-first-offset"

#: Consumer retry (``timerwheel.retry``): how many times the record was handed back to its group
#: (absent or 0 on the first delivery), and where it was first read (topic, partition, offset).
H_RECONSUME_TIMES = "tw-reconsume-times"
H_ORIGIN_TOPIC = "tw-origin-topic"
H_ORIGIN_PARTITION = "tw-origin-partition"
H_ORIGIN_OFFSET = "tw-origin-offset"
RETRY_HEADERS = frozenset({H_RECONSUME_TIMES, H_ORIGIN_TOPIC, H_ORIGIN_PARTITION, H_ORIGIN_OFFSET})

#: Headers the producer sets to steer the timer; none of them reaches the destination.
CONTROL_HEADERS = frozenset({H_TOPIC, H_DELIVER_AT, H_DELAY_MS, H_DELAY_LEVEL, H_CANCEL, H_PARTITION,
                             H_REPLACES})
#: Headers the service stamps; a producer's own copies are replaced. (``tw-revision`` is set by the
#: producer of a reschedule and stamped on the delivered record when above 0.)
SERVICE_HEADERS = frozenset({H_ID, H_ROLL, H_ENQUEUED_AT, H_DELIVERED_AT, H_HELD_SINCE, H_REVISION,
                             H_FIRST_OFFSET})

MAX_ID_BYTES = 1024
_DECIMAL = re.compile(r"-?\d{1,20}")
#: Kafka's rule for topic names.
TOPIC_NAME = re.compile(r"[a-zA-Z0-9._-]{1,249}")
#: Latest accepted delivery time: the year 9999.
MAX_EPOCH_MS = 253_402_300_799_999


_BLAKE2B_8 = hashlib.blake2b(digest_size=8)
_U64_LE = struct.Struct("<Q").unpack


def id_hash(message_id: str) -> int:
    """64-bit hash of a message id, as stored in the TimerLog: its UTF-8 bytes' BLAKE2b with an
    8-byte digest, read little-endian. (A copy of an empty hasher, updated, is the same hash
    for half the cost of building one with ``digest_size``.)"""
    h = _BLAKE2B_8.copy()
    h.update(message_id.encode())
    return _U64_LE(h.digest())[0]  # type: ignore[no-any-return]


def revision_id_hash(message_id: str, revision: int) -> int:
    """The TimerLog's hash of revision ``revision`` of a message: ``id_hash`` of the id for
    revision 0 (as before revisions), of ``id + "\\0" + revision`` above."""
    return id_hash(message_id) if revision == 0 else id_hash(f"{message_id}\0{revision}")


def topic_hash(topic: str) -> int:
    return zlib.crc32(topic.encode())


def default_id(partition: int, offset: int) -> str:
    return f"{partition}-{offset}"


#: TimerRequest(...) goes through a Python-level __new__: for the short path, twice the cost.
_new_tuple = tuple.__new__


class TimerRequest(NamedTuple):
    """A valid timer record, normalised: what enqueue-put needs to write it (one per message:
    a NamedTuple, immutable and cheap)."""

    deliver_ms: int
    cancel: bool
    message_id: str
    topic: str  # destination ("" for a cancel)
    roll: int
    enqueued_ms: int
    src_partition: int
    src_offset: int
    src_size: int
    #: The message's revision (``tw-revision``; a cancel's: the revision it cancels).
    revision: int = 0
    #: A reschedule: the delivery time of the ticket it replaces (``tw-replaces``), else None.
    #: ``deliver_ms`` is then the new time, and the record a marker of ``(id, revision - 1)``.
    replaces: int | None = None


@dataclass(frozen=True, slots=True)
class Ticket:
    """What a producer needs to cancel or reschedule: the timer partition, the delivery time, the
    id and the revision (0 unless rescheduled).

    ``str(ticket)`` gives ``tw1.<partition>.<deliver_at>.<id>`` for revision 0 (as before
    revisions) and ``tw2.<partition>.<deliver_at>.<revision>.<id>`` above; ``Ticket.parse`` reads
    both (``tw1.`` as revision 0).
    """

    partition: int
    deliver_at_ms: int
    message_id: str
    revision: int = 0

    def __str__(self) -> str:
        if self.revision:
            return f"tw2.{self.partition}.{self.deliver_at_ms}.{self.revision}.{self.message_id}"
        return f"tw1.{self.partition}.{self.deliver_at_ms}.{self.message_id}"

    @classmethod
    def parse(cls, text: str) -> Ticket:
        if text.startswith("tw2."):
            parts = text.split(".", 4)
            if (len(parts) == 5 and parts[1].isdigit() and parts[2].lstrip("-").isdigit() and parts[3].isdigit()
                    and parts[4]):
                return cls(int(parts[1]), int(parts[2]), parts[4], int(parts[3]))
            raise ValueError(f"not a timerwheel ticket: {text!r} "
                             "(expected tw2.<partition>.<deliver_at>.<revision>.<id>)")
        parts = text.split(".", 3)
        if len(parts) != 4 or parts[0] != "tw1" or not parts[1].isdigit() or not parts[2].lstrip("-").isdigit():
            raise ValueError(f"not a timerwheel ticket: {text!r} (expected tw1.<partition>.<deliver_at>.<id> "
                             "or tw2.<partition>.<deliver_at>.<revision>.<id>)")
        return cls(int(parts[1]), int(parts[2]), parts[3])


def _decimal(name: str, raw: bytes) -> int:
    if raw.isdigit() and len(raw) <= 20:  # the common case, without a regex
        value = int(raw)
    else:
        text = raw.decode("ascii", "replace").strip()
        if not _DECIMAL.fullmatch(text):
            raise InvalidTimerMessage(f"unparsable {name}: {text[:40]!r}")
        value = int(text)
    if value < 0:
        raise InvalidTimerMessage(f"negative {name}: {value}")
    if value > MAX_EPOCH_MS:
        raise InvalidTimerMessage(f"{name} out of range: {value}")
    return value


class TimerRules:
    """Validation and normalisation of timer records: one place for every limit."""

    def __init__(self, config: TimerConfig) -> None:
        self.config = config
        self._allow = [re.compile(p) for p in config.allow_topics]
        #: destination -> why it is refused ("" if allowed); destinations are few, checks are regexes.
        self._verdicts: dict[str, str] = {}
        #: raw tw-topic header -> the allowed destination it names (decoded once); read-only
        #: outside this class.
        self.known_topics: dict[bytes, str] = {}

    def destination_error(self, topic: str) -> str:
        """Why ``topic`` cannot be a destination, or "" if it can."""
        verdict = self._verdicts.get(topic)
        if verdict is None:
            if not TOPIC_NAME.fullmatch(topic) or topic in (".", ".."):
                verdict = f"invalid destination topic name {topic[:60]!r}"
            elif topic == self.config.timer_topic:
                verdict = f"destination is the timer topic {topic!r}"
            elif not self.topic_allowed(topic):
                verdict = f"destination {topic!r} not allowed by allow_topics"
            else:
                verdict = ""
            if len(self._verdicts) > 10_000:
                self._verdicts.clear()
            self._verdicts[topic] = verdict
        return verdict

    def topic_allowed(self, topic: str) -> bool:
        if topic in (self.config.timer_topic, self.config.dlq_topic):
            return False
        return any(p.fullmatch(topic) for p in self._allow)

    def delivery_time(self, record: Record, now_ms: int, check_max: bool = True,
                      headers: dict[str, bytes] | None = None) -> int:
        """The record's delivery time; ``headers`` may pass ``dict(record.headers)`` already built."""
        hdr = headers if headers is not None else dict(record.headers)
        at = hdr.get(H_DELIVER_AT)
        delay = hdr.get(H_DELAY_MS)
        level = hdr.get(H_DELAY_LEVEL)
        if at is not None and delay is None and level is None:  # the common case first
            deliver = _decimal(H_DELIVER_AT, at)
        else:
            given = [h for h, v in ((H_DELIVER_AT, at), (H_DELAY_MS, delay), (H_DELAY_LEVEL, level)) if v is not None]
            if not given:
                raise InvalidTimerMessage(f"no delivery time: set one of {H_DELIVER_AT}, {H_DELAY_MS}, {H_DELAY_LEVEL}")
            if len(given) > 1:
                raise InvalidTimerMessage(f"more than one delivery time: {', '.join(given)}")
            if delay is not None:
                deliver = record.timestamp_ms + _decimal(H_DELAY_MS, delay)
            else:
                assert level is not None
                n = _decimal(H_DELAY_LEVEL, level)
                levels = self.config.delay_levels_ms
                if not 1 <= n <= len(levels):
                    raise InvalidTimerMessage(f"unknown {H_DELAY_LEVEL} {n} (levels are 1..{len(levels)})")
                deliver = record.timestamp_ms + levels[n - 1]
            if deliver > MAX_EPOCH_MS:
                raise InvalidTimerMessage(f"delivery time out of range: {deliver}")
        if check_max and deliver - now_ms > self.config.max_delay_ms:
            raise InvalidTimerMessage(
                f"delay of {deliver - now_ms} ms exceeds max_delay_ms {self.config.max_delay_ms}"
            )
        return deliver

    def valid_delivery_times(self, records: Sequence[Record], headers: Sequence[dict[str, bytes]]) -> list[int]:
        """``delivery_time`` of records that passed ``parse`` (``headers``: their header dicts,
        aligned), for a batch: an absolute ``tw-deliver-at`` is then the only time header, so it
        is read without the checks, all of them in one C-level pass when every record has one."""
        ats = [h.get(H_DELIVER_AT) for h in headers]
        if None not in ats:
            return list(map(int, ats))  # type: ignore[arg-type]  # no None, checked above
        return [int(at) if at is not None else self.delivery_time(r, 0, check_max=False, headers=h)
                for r, h, at in zip(records, headers, ats, strict=True)]

    def parse(self, record: Record, now_ms: int, headers: dict[str, bytes] | None = None,
              size: int | None = None) -> TimerRequest:
        """Validate a timer-topic record; raise InvalidTimerMessage(reason) if it cannot be scheduled.

        ``headers`` may pass ``dict(record.headers)`` already built (the last of repeated headers
        wins, as ``Record.header``); everything reads that dict. ``size`` stands for the record's
        size (``Record.size``) when ``record`` comes without its key, value or user headers: the
        Spark jobs keep those in Spark.

        enqueue-get calls this for every record: its hottest code. The common record (an absolute
        ``tw-deliver-at``, a destination allowed once already, none of the other control headers)
        passes the checks in a few steps and is built without a Python-level constructor; any
        other goes through every check in turn, each with its reason."""
        hdr = dict(record.headers) if headers is None else headers
        if size is None:  # Record.size, inlined: the hot path
            key, value = record.key, record.value
            size = (len(key) if key else 0) + (len(value) if value else 0)
            for k, v in record.headers:
                size += len(k) + len(v)
        cfg = self.config
        topic = self.known_topics.get(hdr.get(H_TOPIC))  # type: ignore[arg-type]  # None finds nothing
        at = hdr.get(H_DELIVER_AT)
        if topic is not None and at is not None and at.isdigit() and len(at) <= 20 and _FULL_PARSE.isdisjoint(hdr):
            deliver = int(at)
            raw_id = hdr.get(H_ID)
            if (size <= cfg.max_record_bytes and deliver <= MAX_EPOCH_MS and deliver - now_ms <= cfg.max_delay_ms
                    and (raw_id is None or 0 < len(raw_id) <= MAX_ID_BYTES)):
                message_id = (default_id(record.partition, record.offset) if raw_id is None
                              else raw_id.decode("utf-8", "replace"))
                return _new_tuple(TimerRequest, (deliver, False, message_id, topic, 0, record.timestamp_ms,
                                                 record.partition, record.offset, size, 0, None))
        # Every check in turn, each with its reason (the common record never gets here).
        if size > cfg.max_record_bytes:
            raise InvalidTimerMessage(f"record of {size} bytes exceeds max_record_bytes {cfg.max_record_bytes}")
        deliver = self.delivery_time(record, now_ms, headers=hdr)
        raw_roll = hdr.get(H_ROLL)
        roll = _decimal(H_ROLL, raw_roll) if raw_roll is not None else 0
        raw_enq = hdr.get(H_ENQUEUED_AT)
        enqueued = _decimal(H_ENQUEUED_AT, raw_enq) if raw_enq is not None else record.timestamp_ms
        raw_part = hdr.get(H_PARTITION)
        if raw_part is not None:
            _decimal(H_PARTITION, raw_part)
        raw_rev = hdr.get(H_REVISION)
        revision = _decimal(H_REVISION, raw_rev) if raw_rev is not None else 0
        raw_replaces = hdr.get(H_REPLACES)
        replaces = _decimal(H_REPLACES, raw_replaces) if raw_replaces is not None else None
        if H_FIRST_OFFSET in hdr:
            _decimal(H_FIRST_OFFSET, hdr[H_FIRST_OFFSET])
        cancel = hdr.get(H_CANCEL)
        if cancel is not None:
            if replaces is not None:
                raise InvalidTimerMessage(f"{H_CANCEL} and {H_REPLACES} together: a record cancels or reschedules")
            target = cancel.decode("utf-8", "replace")
            if not target or len(cancel) > MAX_ID_BYTES:
                raise InvalidTimerMessage(f"{H_CANCEL} must be a message id of 1..{MAX_ID_BYTES} bytes")
            return TimerRequest(deliver, True, target, "", roll, enqueued, record.partition, record.offset, size,
                                revision)
        if replaces is not None:
            if not hdr.get(H_ID):
                raise InvalidTimerMessage(f"{H_REPLACES} without {H_ID}: a reschedule names the message it moves")
            if revision == 0:
                raise InvalidTimerMessage(f"{H_REPLACES} with {H_REVISION} 0 (or none): a reschedule's revision "
                                          "is the ticket's + 1")
        raw_topic = hdr.get(H_TOPIC)
        if not raw_topic:
            raise InvalidTimerMessage(f"missing {H_TOPIC}")
        topic = self.known_topics.get(raw_topic)
        if topic is None:
            topic = raw_topic.decode("utf-8", "replace")
            refused = self.destination_error(topic)
            if refused:
                raise InvalidTimerMessage(refused)
            if len(self.known_topics) > 10_000:
                self.known_topics.clear()
            self.known_topics[raw_topic] = topic  # only allowed destinations are remembered
        raw_id = hdr.get(H_ID)
        if raw_id is not None and (not raw_id or len(raw_id) > MAX_ID_BYTES):
            raise InvalidTimerMessage(f"{H_ID} must be 1..{MAX_ID_BYTES} bytes")
        message_id = raw_id.decode("utf-8", "replace") if raw_id else default_id(record.partition, record.offset)
        return TimerRequest(deliver, False, message_id, topic, roll, enqueued, record.partition, record.offset, size,
                            revision, replaces)


def raw_message_id(record: Record, headers: dict[str, bytes] | None = None) -> bytes:
    """``tw-id``, else the default id, as bytes; ``headers`` may pass ``dict(record.headers)`` already built."""
    raw = headers.get(H_ID) if headers is not None else record.header(H_ID)
    return raw or default_id(record.partition, record.offset).encode()


def message_id_of(record: Record, headers: dict[str, bytes] | None = None) -> str:
    """``raw_message_id`` decoded."""
    return raw_message_id(record, headers).decode("utf-8", "replace")


_NOT_DELIVERED = CONTROL_HEADERS | SERVICE_HEADERS
#: Control headers that take ``TimerRules.parse`` off its short path.
_FULL_PARSE = frozenset({H_DELAY_MS, H_DELAY_LEVEL, H_CANCEL, H_PARTITION, H_ROLL, H_ENQUEUED_AT, H_REVISION,
                         H_REPLACES, H_FIRST_OFFSET})


def revision_of(headers: dict[str, bytes]) -> int:
    """``tw-revision`` of a record that passed ``TimerRules.parse`` (absent: 0)."""
    raw = headers.get(H_REVISION)
    return int(raw) if raw else 0


def record_roll(record: Record) -> int:
    """``tw-roll`` of a timer record read back: how many times it was rolled (absent, or not a run
    of digits: 0)."""
    raw = record.header(H_ROLL)
    return int(raw) if raw and raw.isdigit() else 0


def record_revision(record: Record) -> int:
    """``tw-revision`` of a timer record read back (absent, or not a run of digits: 0)."""
    raw = record.header(H_REVISION)
    return int(raw) if raw and raw.isdigit() else 0


def marker_target(marker: Record) -> tuple[str, int] | None:
    """The ``(id, revision)`` a marker record stands against: a cancel's ``tw-cancel`` and
    ``tw-revision``; a reschedule's ``tw-id`` and ``tw-revision - 1``. None for a message."""
    hdr = dict(marker.headers)
    target = hdr.get(H_CANCEL)
    if target is not None:
        return target.decode("utf-8", "replace"), revision_of(hdr)
    if H_REPLACES in hdr:
        return message_id_of(marker, hdr), revision_of(hdr) - 1
    return None


#: Revisions a search by id looks for (``revision_hashes``): a message rescheduled more often is
#: listed by a search of its time range, not by its id.
SEARCHED_REVISIONS = 256


def revision_hashes(message_id: str) -> list[int]:
    """The TimerLog hashes of revisions 0 to ``SEARCHED_REVISIONS`` - 1 of a message: what a search
    of the shards by id compares (0.2 ms)."""
    return [revision_id_hash(message_id, r) for r in range(SEARCHED_REVISIONS)]


def deciders(markers: Iterable[Record]) -> dict[tuple[str, int], Record]:
    """Of marker records (cancels and reschedules), the one that decides each ``(id, revision)``
    they stand against: the first in its timer partition (``first_offset``; design 6.1)."""
    first: dict[tuple[str, int], Record] = {}
    for m in markers:
        target = marker_target(m)
        if target is not None and (target not in first or first_offset(m) < first_offset(first[target])):
            first[target] = m
    return first


def moved_messages(markers: Iterable[Record]) -> list[tuple[tuple[str, int], Record]]:
    """The messages reschedules moved and nothing here decides again: ``((id, new revision),
    the reschedule record)`` for each reschedule that decides its ticket (``deciders``) while no
    marker among ``markers`` stands against its new revision. Until the old ticket's time, when
    dequeue-getmsg writes the new revision back to the timer topic, the message is this record
    (due at its ``tw-deliver-at``) and the shards hold only its old revision and the marker."""
    first = deciders(markers)
    return [((mid, rev + 1), m) for (mid, rev), m in first.items()
            if m.header(H_CANCEL) is None and (mid, rev + 1) not in first]


def first_offset(marker: Record) -> int:
    """The offset a marker's producer's record got: ``tw-first-offset`` on a roll hop, else its own.
    Of two markers of one message in one timer partition, the lower came first."""
    raw = marker.header(H_FIRST_OFFSET)
    return int(raw) if raw else marker.offset


def user_headers(headers: Headers) -> list[tuple[str, bytes]]:
    return [(k, v) for k, v in headers if k not in _NOT_DELIVERED]


_ROLL_ZERO = (H_ROLL, b"0")


def delivered_headers(record: Record, headers: dict[str, bytes], enqueued_text: bytes, now_text: bytes) -> Headers:
    """Headers of the record delivered to its destination: user headers kept, control ones
    removed, ``tw-id``, ``tw-roll``, ``tw-enqueued-at`` and ``tw-delivered-at`` stamped.

    ``headers`` is ``dict(record.headers)``; the times come as their decimal text (``str(ms).encode()``,
    which dequeue-put makes once per batch for the delivery time)."""
    raw_roll = headers.get(H_ROLL)
    stamped: Headers = (
        (H_ID, raw_message_id(record, headers)),
        _ROLL_ZERO if not raw_roll else (H_ROLL, str(int(raw_roll)).encode()),
        (H_ENQUEUED_AT, enqueued_text),
        (H_DELIVERED_AT, now_text),
    )
    raw_rev = headers.get(H_REVISION)
    if raw_rev and int(raw_rev):  # a rescheduled message: which revision (the id stays)
        stamped = (*stamped, (H_REVISION, str(int(raw_rev)).encode()))
    if _NOT_DELIVERED.issuperset(headers):  # no user header: the common record
        return stamped
    return (*[h for h in record.headers if h[0] not in _NOT_DELIVERED], *stamped)


def rolled_headers(record: Record, message_id: str, deliver_ms: int, roll: int, enqueued_ms: int,
                   held_since_ms: int | None = None) -> Headers:
    """Headers of a rolled record written back to the timer topic: absolute time, roll + 1, same id.
    A record held for a missing destination is rolled the same way, with ``tw-held-since``.
    A marker (a cancel, or a reschedule: its ``tw-replaces`` kept, ``deliver_ms`` its new time)
    carries ``tw-first-offset``, its producer's offset, through every hop."""
    drop = {H_DELIVER_AT, H_DELAY_MS, H_DELAY_LEVEL, H_ROLL, H_ID, H_ENQUEUED_AT, H_HELD_SINCE, H_FIRST_OFFSET}
    out = [(k, v) for k, v in record.headers if k not in drop]
    out.append((H_DELIVER_AT, str(deliver_ms).encode()))
    out.append((H_ROLL, str(roll + 1).encode()))
    out.append((H_ENQUEUED_AT, str(enqueued_ms).encode()))
    if record.header(H_CANCEL) is None:
        out.append((H_ID, message_id.encode()))
    if record.header(H_CANCEL) is not None or record.header(H_REPLACES) is not None:
        out.append((H_FIRST_OFFSET, str(first_offset(record)).encode()))
    if held_since_ms is not None:
        out.append((H_HELD_SINCE, str(held_since_ms).encode()))
    return tuple(out)


def redirected_headers(reschedule: Record, message_id: str, deliver_ms: int, enqueued_ms: int) -> Headers:
    """Headers of the message a winning reschedule record puts back on the timer topic: its
    revision due at its new time (``tw-replaces`` and ``tw-first-offset`` dropped: a message now,
    no longer a marker), as a roll hop."""
    drop = {H_REPLACES, H_FIRST_OFFSET}
    bare = Record(reschedule.topic, reschedule.partition, reschedule.offset, reschedule.timestamp_ms,
                  reschedule.key, reschedule.value, tuple(h for h in reschedule.headers if h[0] not in drop))
    raw_roll = reschedule.header(H_ROLL)
    return rolled_headers(bare, message_id, deliver_ms, int(raw_roll) if raw_roll else 0, enqueued_ms)


def dead_letter_headers(record: Record, reason: str) -> Headers:
    out = list(record.headers)
    out.append((H_ERROR, reason.encode()))
    out.append((H_SOURCE, f"{record.topic}/{record.partition}/{record.offset}".encode()))
    return tuple(out)


class RetryState(NamedTuple):
    """What the consumer-retry headers of a record say (``retry_state``)."""

    reconsume_times: int
    origin_topic: str
    origin_partition: int
    origin_offset: int
    #: Why the retry headers were ignored; "" when they were sound (or absent).
    malformed: str = ""


def retry_state(record: Record) -> RetryState:
    """The reconsume count and origin of ``record`` (``timerwheel.retry``). A record without retry
    headers is a first delivery: count 0, origin its own position. Headers that cannot be read are
    ignored as a whole (the record counts as a first delivery) and ``malformed`` says why, so that a
    consumer never stops on another's bookkeeping: its next retry carries sound headers again."""
    hdr = dict(record.headers)
    own = RetryState(0, record.topic, record.partition, record.offset)
    if RETRY_HEADERS.isdisjoint(hdr):
        return own
    origin = [hdr.get(h) for h in (H_ORIGIN_TOPIC, H_ORIGIN_PARTITION, H_ORIGIN_OFFSET)]
    try:
        times = _decimal(H_RECONSUME_TIMES, hdr.get(H_RECONSUME_TIMES, b"0"))
        if None in origin:
            if any(h is not None for h in origin):
                raise InvalidTimerMessage(f"{H_ORIGIN_TOPIC}, {H_ORIGIN_PARTITION} and {H_ORIGIN_OFFSET} "
                                          "go together; some are missing")
            return own._replace(reconsume_times=times)
        raw_topic, raw_partition, raw_offset = origin
        assert raw_topic is not None and raw_partition is not None and raw_offset is not None
        topic = raw_topic.decode("ascii", "replace")
        if not TOPIC_NAME.fullmatch(topic):
            raise InvalidTimerMessage(f"{H_ORIGIN_TOPIC} is not a topic name: {topic[:60]!r}")
        partition = _decimal(H_ORIGIN_PARTITION, raw_partition)
        offset = _decimal(H_ORIGIN_OFFSET, raw_offset)
    except InvalidTimerMessage as exc:
        return own._replace(malformed=exc.reason)
    return RetryState(times, topic, partition, offset)


def retry_headers(record: Record, reconsume_times: int, state: RetryState) -> Headers:
    """Headers of ``record`` handed back to its consumer group for the ``reconsume_times``-th
    time: its user headers (no control, service or earlier retry headers), the count and the origin."""
    kept = [h for h in record.headers if h[0] not in _NOT_DELIVERED and h[0] not in RETRY_HEADERS]
    return (*kept, (H_RECONSUME_TIMES, str(reconsume_times).encode()),
            (H_ORIGIN_TOPIC, state.origin_topic.encode()), (H_ORIGIN_PARTITION, str(state.origin_partition).encode()),
            (H_ORIGIN_OFFSET, str(state.origin_offset).encode()))


def handed_headers(record: Record, retried: bool) -> Headers:
    """The headers a consumer's handler sees: the record's without the retry headers, and, for a
    record that came back through timerwheel (``retried``), without that hop's service stamps."""
    drop = RETRY_HEADERS | SERVICE_HEADERS if retried else RETRY_HEADERS
    if drop.isdisjoint(k for k, _v in record.headers):
        return record.headers
    return tuple(h for h in record.headers if h[0] not in drop)
