"""Work-queue entries between the stages, encoded with msgpack.

Each entry carries a batch, so queue operations are per batch, not per message. Items are
NamedTuples (msgpack packs them as arrays, and they are cheap to build per message).

=========  ====================  =========================================================
queue      partition             entry
=========  ====================  =========================================================
put        shard                 PutEntry: one timer partition's offset range and its request rows
fetch      shard                 FetchEntry: TimerLog records of one slot to read and deliver, the
                                 TimerLog position the slot was read at, and dequeue-get's trace context
deliver    shard                 DeliverEntry: the same, with the original records attached
done       shard                 DoneEntry: per slot, how many messages dequeue-put finished
=========  ====================  =========================================================

The entries are internal (never a public interface): a queue is drained before an upgrade that
changes them, or its entries are moved aside as undecodable (``base.decoded``) and their slots
sent again by dequeue-get after ``STALL_S`` (late, never lost). Issue 30 added ``read_pos`` to
fetch and deliver entries and made a fetch item's cancel marker a list of candidates; issue 31 a
fetch item's ``same_as`` (read from entries without it as None) and the DUPLICATE and REDIRECT kinds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Union, cast

import msgpack

from timerwheel.records import Record
from timerwheel.transports.base import WorkQueue

Q_PUT = "put"
Q_FETCH = "fetch"
Q_DELIVER = "deliver"
Q_DONE = "done"
#: The stage that consumes each queue (woken when an entry is put).
CONSUMER_OF = {Q_PUT: "enqueue-put", Q_FETCH: "dequeue-getmsg", Q_DELIVER: "dequeue-put", Q_DONE: "dequeue-get"}


Entry = Union["PutEntry", "FetchEntry", "DeliverEntry", "DoneEntry"]


def wire(queue: WorkQueue, entry: Entry) -> bytes:
    """What to put into ``queue``: the entry's msgpack bytes, or, for an in-process queue
    (``in_process = True``), the entry object itself — no encoding, no copy. Every
    ``decode`` accepts both."""
    if queue.in_process:
        return cast(bytes, entry)
    return entry.encode()


def _pack(obj: Any) -> bytes:
    return cast(bytes, msgpack.packb(obj, use_bin_type=True))


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=False)


class PutRequest(NamedTuple):
    """One request as a record (tests, tracing); the entry itself holds plain rows."""

    src_offset: int
    src_size: int
    enqueued_ms: int
    deliver_ms: int
    cancel: bool
    topic_hash: int
    id_hash: int
    traceparent: str | None = None
    tracestate: str | None = None


#: A request as enqueue-put takes it: (src_offset, src_size, enqueued_ms, deliver_ms, cancel,
#: topic_hash, id_hash), the PutRequest fields without the trace context. A plain tuple, so
#: that enqueue-get builds one per message cheaply and enqueue-put makes a TimerLog batch of
#: many rows in one numpy call.
PutRow = tuple[int, int, int, int, bool, int, int]
PUT_ROW_FIELDS = 7


@dataclass(frozen=True, slots=True)
class PutEntry:
    """Timer records ``[from_offset, next_offset)`` of one partition; invalid ones already dead-lettered.

    ``rows`` are the valid records' requests in offset order; ``traces`` the trace context of
    those that carry one: (row index, traceparent, tracestate). Encoded as
    ``[partition, from, next, rows, traces]``."""

    src_partition: int
    from_offset: int
    next_offset: int
    rows: list[PutRow]
    traces: tuple[tuple[int, str, str | None], ...] = ()

    @classmethod
    def of(cls, src_partition: int, from_offset: int, next_offset: int, requests: Sequence[PutRequest]) -> PutEntry:
        """The entry of these requests (tests and tools; enqueue-get builds rows directly)."""
        traces = tuple((i, r.traceparent, r.tracestate) for i, r in enumerate(requests) if r.traceparent)
        return cls(src_partition, from_offset, next_offset, [tuple(r[:PUT_ROW_FIELDS]) for r in requests],  # type: ignore[misc]
                   traces)

    @property
    def requests(self) -> tuple[PutRequest, ...]:
        """The rows as PutRequests, with their trace context (tracing and tests only)."""
        ctx = {i: (tp, ts) for i, tp, ts in self.traces}
        return tuple(PutRequest(*row, *ctx.get(i, (None, None))) for i, row in enumerate(self.rows))

    def encode(self) -> bytes:
        return _pack([self.src_partition, self.from_offset, self.next_offset, self.rows, self.traces])

    @classmethod
    def decode(cls, data: bytes) -> PutEntry:
        if isinstance(data, cls):
            return data  # an in-process queue passes the entry itself
        p, lo, hi, rows, traces = _unpack(data)
        return cls(p, lo, hi, [tuple(r) for r in rows], tuple(tuple(t) for t in traces))


class FetchItem(NamedTuple):
    pos: int
    flags: int
    src_partition: int
    src_offset: int
    fire_ms: int
    enqueued_ms: int
    #: The cancel markers whose id hash matches, (source partition, offset) each, to be
    #: confirmed on the full id (two cancels whose ids collide both count); () if none.
    cancels: tuple[tuple[int, int], ...] = ()
    #: An earlier copy of the same message in the slot (same id hash and delivery time), its
    #: (source partition, offset): confirmed on the full id, this one finishes as a DUPLICATE
    #: (a roll hop done twice; design 2.5). None if none.
    same_as: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class FetchEntry:
    shard: int
    generation: int
    slot_time: int
    #: The TimerLog position the slot was read at (the published flushed position): every cancel
    #: marker of the slot below it was matched by dequeue-get; dequeue-put looks at or past it.
    read_pos: int
    items: tuple[FetchItem, ...]
    #: dequeue-get's span of this batch (the TimerLog holds no trace context); dequeue-getmsg
    #: links it. Packed only when set, so an entry without it keeps the 5-element form.
    traceparent: str | None = None

    def encode(self) -> bytes:
        if self.traceparent is None:
            return _pack([self.shard, self.generation, self.slot_time, self.read_pos, self.items])
        return _pack([self.shard, self.generation, self.slot_time, self.read_pos, self.items, self.traceparent])

    @classmethod
    def decode(cls, data: bytes) -> FetchEntry:
        if isinstance(data, cls):
            return data  # an in-process queue passes the entry itself
        shard, gen, slot, read_pos, items, *rest = _unpack(data)
        make = FetchItem._make
        for i in items:  # msgpack gives lists: the cancels as a tuple of pairs, as they were
            i[6] = tuple(map(tuple, i[6])) if i[6] else ()
            if len(i) == 7:
                i.append(None)  # an entry from before same_as
            elif i[7] is not None:
                i[7] = tuple(i[7])
        return cls(shard, gen, slot, read_pos, tuple(map(make, items)), rest[0] if rest else None)


#: What dequeue-put does with an item (DUPLICATE: another copy of the message in its slot is
#: delivered, this one finishes without output; REDIRECT: a reschedule of it came first, the
#: item's record is that reschedule record, put back on the timer topic as the next revision).
DELIVER, ROLL, CANCELLED, MISSING, DUPLICATE, REDIRECT = 0, 1, 2, 3, 4, 5


class DeliverItem(NamedTuple):
    kind: int
    fire_ms: int
    enqueued_ms: int
    record: Record | None  # None for MISSING
    src_partition: int
    src_offset: int
    #: Unused (the record's own headers carry its context); kept so that entries stay readable.
    traceparent: str | None = None


def _record_from(f: list[Any] | None) -> Record | None:
    if f is None:
        return None
    topic, p, o, ts, key, value, headers = f
    return Record(topic, p, o, ts, key, value, tuple(map(tuple, headers)))


@dataclass(frozen=True, slots=True)
class DeliverEntry:
    shard: int
    generation: int
    slot_time: int
    #: FetchEntry.read_pos: dequeue-put looks for cancel markers of the slot from here on.
    read_pos: int
    items: tuple[DeliverItem, ...]

    def encode(self) -> bytes:
        return _pack([self.shard, self.generation, self.slot_time, self.read_pos, self.items])

    @property
    def nbytes(self) -> int:
        """Bytes of the record values it carries (they dominate; headers are small): what an
        in-process queue counts (TW_QUEUE_BYTES)."""
        return sum(len(item.record.value or b"") for item in self.items if item.record is not None)

    @classmethod
    def decode(cls, data: bytes) -> DeliverEntry:
        if isinstance(data, cls):
            return data  # an in-process queue passes the entry itself
        shard, gen, slot, read_pos, items = _unpack(data)
        return cls(shard, gen, slot, read_pos, tuple(
            DeliverItem(k, fire, enq, _record_from(rec), sp, so, tp) for k, fire, enq, rec, sp, so, tp in items
        ))


@dataclass(frozen=True, slots=True)
class DoneEntry:
    shard: int
    generation: int
    #: slot_time -> messages finished in it
    counts: dict[int, int]

    def encode(self) -> bytes:
        return _pack([self.shard, self.generation, [[s, n] for s, n in self.counts.items()]])

    @classmethod
    def decode(cls, data: bytes) -> DoneEntry:
        if isinstance(data, cls):
            return data  # an in-process queue passes the entry itself
        shard, gen, counts = _unpack(data)
        return cls(shard, gen, {s: n for s, n in counts})
