"""Browse the pending timers and the dead letters a page at a time, with a cost bounded per page.

**Pending timers** are read from the shards as dequeue-get reads them, never by listing them all:
a page of ``limit`` messages from a cursor costs about ``limit`` TimerLog records, whatever the
shards hold (1 M pending: BENCHMARKS.md, "Console").

- *By time range* (``walk``): per shard, the wheel's non-empty slots from ``max(from, R)`` on
  (``Shard.next_nonempty`` skips empty slots column-wise), each slot's records read through its
  TimerLog chain, or column-wise for a dense slot; a shard stops once it has ``limit + 1``
  messages past the cursor. The shards' lists are merged by (fire time, shard, TimerLog
  position), which is also the cursor: the next page starts after the last message shown. A
  destination filter (``topic``) compares the records' topic hash on the way; as it may pass many
  records for a few matches, a page also stops after ``budget`` records read and says where it
  got to, so a selective filter costs several short pages, never one long one.
- *By message id* (``scan``): the TimerLog is read column-wise from its start (records before
  retention are gone) and the records with the id's hash kept; time is linear in the TimerLog's
  size (a few tens of ms per million records), and an id has at most a few records.

A message is listed in the slot it fires in: its own delivery time, or for a message due beyond
the roll window (2 days by default) its next roll hop, marked ``rolled`` (its delivery time is
read from its timer record). A cancel marker for it in the same slot (where a cancel lands) hides
it. A message being delivered at this moment may still be listed, as after a crash it would be
delivered again; messages and cancels not yet written by enqueue-put (behind ``W``) are not seen.
The timer records of a page (key, headers, value) are read from the commit log in one batch.

**Dead letters** are read from the dead-letter topic newest first, per partition, at most
``budget`` records a page; the cursor is the offset below which each partition was not yet read.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from timerwheel.config import RECORD_SIZE, TimerConfig
from timerwheel.errors import InvalidTimerMessage
from timerwheel.records import Record
from timerwheel.store import Flag, Shard
from timerwheel.store.format import records_from_array, valid_mask
from timerwheel.transports.base import CommitLog
from timerwheel.wire import (
    H_ERROR,
    H_ROLL,
    H_SOURCE,
    H_TOPIC,
    Ticket,
    TimerRules,
    id_hash,
    message_id_of,
    topic_hash,
)

_DELETE, _ROLL = int(Flag.DELETE), int(Flag.ROLL)
#: TimerLog records a page of pending timers reads at most (a selective destination filter).
WALK_BUDGET = 50_000
#: Dead-letter records a page reads at most.
DLQ_BUDGET = 5_000
#: Bytes of a value shown in a preview.
PREVIEW_BYTES = 200
_BIG = 1 << 62

Key = tuple[int, int, int]  # (fire ms, shard, TimerLog position)


def parse_cursor(text: str | None) -> Key | None:
    """``<fire ms>.<shard>.<position>`` -> the key after which a page starts; ValueError if not one."""
    if not text:
        return None
    parts = text.split(".")
    if len(parts) != 3 or not all(p.lstrip("-").isdigit() for p in parts):
        raise ValueError(f"not a cursor: {text!r} (expected <fire ms>.<shard>.<position>)")
    return int(parts[0]), int(parts[1]), int(parts[2])


def cursor_text(key: Key) -> str:
    return ".".join(str(k) for k in key)


@dataclass(slots=True)
class PendingItem:
    shard: int
    position: int
    #: When it fires: its delivery time, or its next roll hop (``rolled``).
    fire_ms: int
    rolled: bool
    #: Its timer record: partition and offset in the timer topic.
    partition: int
    offset: int
    message_id: str = ""
    topic: str = ""
    deliver_at_ms: int | None = None
    roll: int = 0
    key: bytes | None = None
    value: bytes | None = None
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    #: The timer record is gone from the timer topic (retention): it will be dead-lettered.
    missing: bool = False

    @property
    def ticket(self) -> str | None:
        if self.missing or self.deliver_at_ms is None:
            return None
        return str(Ticket(self.partition, self.deliver_at_ms, self.message_id))

    @property
    def cursor(self) -> str:
        return cursor_text((self.fire_ms, self.shard, self.position))


@dataclass(slots=True)
class PendingPage:
    items: list[PendingItem]
    #: Where the next page starts; None when the range holds no more.
    next_cursor: str | None
    #: TimerLog records read for this page.
    scanned: int
    #: "walk" (by time) or "scan" (by id)
    method: str


def _slot_records(shard: Shard, t: int, limit_pos: int) -> list[tuple[int, int, int, int, int, int]]:
    """(position, flags, deliver ms, topic hash, id hash, src partition/offset...) of one slot,
    oldest first: column-wise for a dense slot, else through its chain."""
    dense = shard.read_dense_slot(t, limit_pos)
    if dense is not None:
        positions, arr = dense
        flags = arr["magic"] & 0xFF
        cols = zip(positions.tolist(), flags.tolist(), arr["deliver_ms"].tolist(), arr["topic_hash"].tolist(),
                   arr["id_hash"].tolist(), arr["src_partition"].tolist(), arr["src_offset"].tolist(), strict=True)
        out = [(p, f, d, th, ih, sp * _BIG + so) for p, f, d, th, ih, sp, so in cols]
    else:
        out = [(pos, int(r.flags), r.deliver_ms, r.topic_hash, r.id_hash, r.src_partition * _BIG + r.src_offset)
               for pos, r in shard.read_slot(t, limit_pos)]
    out.sort()
    return out


def _next_slot(shard: Shard, t: int, end: int) -> int | None:
    """``shard.next_nonempty(t, end)`` in growing windows: its cost is the slots it looks at (up to
    a quarter million at once), so a page over sparse slots looks a few ticks ahead first."""
    window = 64 * shard.tick_ms
    while t < end:
        found = shard.next_nonempty(t, min(end, t + window))
        if found is not None:
            return found
        t = shard.slot_time(min(end, t + window))
        window = min(window * 8, (1 << 18) * shard.tick_ms)
    return None


def _walk_shard(shard_id: int, shard: Shard, from_ms: int, to_ms: int, after: Key | None, want_topic: int | None,
                want: int, budget: int) -> tuple[list[tuple[Key, int, int, bool]], Key, int]:
    """Up to ``want`` messages of one shard firing in [from_ms, to_ms) after ``after``: (key,
    src partition, src offset, rolled); the key up to which the shard is complete; records read."""
    enq = shard.load_enqueue_checkpoint()
    if enq is None:
        return [], (_BIG, _BIG, _BIG), 0
    shard.refresh(enq)  # a reader on another node: what the volume holds, not a stale cache
    deq = shard.load_dequeue_checkpoint()
    r_ms = deq.read_ms if deq is not None else enq.write_ms
    tick, span = shard.tick_ms, shard.slots * shard.tick_ms
    start = shard.slot_time(max(from_ms, r_ms, after[0] if after else from_ms))
    end = min(to_ms, shard.slot_time(r_ms) + span)
    hits: list[tuple[Key, int, int, bool]] = []
    scanned = 0
    t: int | None = start
    while t is not None and t < end:
        if len(hits) >= want or scanned >= budget:
            return hits, (t, -1, -1), scanned
        t = _next_slot(shard, t, end)
        if t is None:
            break
        records = _slot_records(shard, t, enq.flushed_pos)
        scanned += len(records)
        markers = {ih for _p, f, _d, _th, ih, _s in records if f & _DELETE}
        for pos, flags, deliver, th, ih, src in records:
            key = (deliver, shard_id, pos)
            if flags & _DELETE or ih in markers or not from_ms <= deliver < to_ms:
                continue
            if (want_topic is not None and th != want_topic) or (after is not None and key <= after):
                continue
            hits.append((key, src // _BIG, src % _BIG, bool(flags & _ROLL)))
        t += tick
    return hits, (_BIG, _BIG, _BIG), scanned


def _scan_shard(shard_id: int, shard: Shard, from_ms: int, to_ms: int, want_id: int,
                want_topic: int | None) -> tuple[list[tuple[Key, int, int, bool]], int]:
    """The records of one id (its hash) in the shard's TimerLog that fire in [from_ms, to_ms),
    from R on, without a cancel marker in their slot."""
    enq = shard.load_enqueue_checkpoint()
    if enq is None:
        return [], 0
    shard.refresh(enq)
    deq = shard.load_dequeue_checkpoint()
    r_slot = shard.slot_time(deq.read_ms if deq is not None else enq.write_ms)
    start = shard.log.start_pos
    positions: list[int] = []
    rows_list = []
    for first, arr in shard.log.iter_chunks(start, enq.flushed_pos):
        idx = np.flatnonzero(arr["id_hash"] == np.uint64(want_id))
        if idx.size:
            positions += (first + RECORD_SIZE * idx).tolist()
            rows_list.append(arr[idx])  # a copy (fancy indexing): the chunk's buffer is reused
    scanned = (enq.flushed_pos - start) // RECORD_SIZE
    if not rows_list:
        return [], scanned
    rows = np.concatenate(rows_list)
    ok = valid_mask(rows)
    records = records_from_array(rows[ok])
    kept = [p for p, good in zip(positions, ok.tolist(), strict=True) if good]
    slot = shard.slot_time
    cancelled = {slot(r.deliver_ms) for r in records if r.flags & _DELETE}
    hits = []
    for pos, r in zip(kept, records, strict=True):
        s = slot(r.deliver_ms)
        if r.flags & _DELETE or s in cancelled or s < r_slot or not from_ms <= r.deliver_ms < to_ms:
            continue
        if want_topic is not None and r.topic_hash != want_topic:
            continue
        hits.append(((r.deliver_ms, shard_id, pos), r.src_partition, r.src_offset, bool(r.flags & _ROLL)))
    return hits, scanned


def browse_pending(shards: Mapping[int, Shard], log: CommitLog, config: TimerConfig, from_ms: int, to_ms: int, *,
                   topic: str | None = None, message_id: str | None = None, limit: int = 50,
                   after: str | None = None, budget: int = WALK_BUDGET) -> PendingPage:
    """A page of pending messages firing in [from_ms, to_ms) (to ``topic``, with ``message_id``),
    in firing order, after the cursor ``after`` (see the module header)."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    cursor = parse_cursor(after)
    want_topic = topic_hash(topic) if topic else None
    hits: list[tuple[Key, int, int, bool]] = []
    scanned = 0
    bound: Key = (_BIG, _BIG, _BIG)
    if message_id:
        for shard_id, shard in sorted(shards.items()):
            found, n = _scan_shard(shard_id, shard, from_ms, to_ms, id_hash(message_id), want_topic)
            hits += [h for h in found if cursor is None or h[0] > cursor]
            scanned += n
        method = "scan"
    else:
        per_shard = max(1, budget // max(1, len(shards)))
        for shard_id, shard in sorted(shards.items()):
            found, complete_to, n = _walk_shard(shard_id, shard, from_ms, to_ms, cursor, want_topic, limit + 1,
                                                per_shard)
            hits += found
            bound = min(bound, complete_to)
            scanned += n
        method = "walk"
    hits.sort()
    safe = [h for h in hits if h[0] < bound]
    page = safe[:limit]
    if len(safe) > limit:
        next_key: Key | None = page[-1][0]
    elif bound[0] < _BIG:
        next_key = (bound[0] - 1, _BIG, _BIG)  # everything firing before the bound was seen
    else:
        next_key = None
    items = _fill([PendingItem(key[1], key[2], key[0], rolled, p, o) for key, p, o, rolled in page], log, config,
                  topic, message_id)
    return PendingPage(items, None if next_key is None else cursor_text(next_key), scanned, method)


def _fill(items: list[PendingItem], log: CommitLog, config: TimerConfig, topic: str | None,
          message_id: str | None) -> list[PendingItem]:
    """Each item with its timer record (one batch read), less those whose record names another
    destination or id than asked (a hash collision)."""
    if not items:
        return items
    rules = TimerRules(config)
    records = log.read(config.timer_topic, [(i.partition, i.offset) for i in items])
    for item, rec in zip(items, records, strict=True):
        if rec is None:
            item.missing = True
            continue
        item.message_id = message_id_of(rec)
        item.topic = (rec.header(H_TOPIC) or b"").decode("utf-8", "replace")
        try:
            item.deliver_at_ms = rules.delivery_time(rec, 0, check_max=False)
        except InvalidTimerMessage:
            item.deliver_at_ms = None
        raw_roll = rec.header(H_ROLL)
        item.roll = int(raw_roll) if raw_roll and raw_roll.isdigit() else 0
        item.key, item.value, item.headers = rec.key, rec.value, list(rec.headers)
    return [i for i in items if i.missing or ((not topic or i.topic == topic)
                                              and (not message_id or i.message_id == message_id))]


def find_pending(shards: Mapping[int, Shard], log: CommitLog, config: TimerConfig,
                 message_id: str) -> PendingItem | None:
    """The pending message with this id (its newest timer record), or None."""
    page = browse_pending(shards, log, config, 0, 1 << 62, message_id=message_id, limit=10)
    found = [i for i in page.items if i.message_id == message_id and not i.missing]
    return max(found, key=lambda i: (i.roll, i.offset), default=None)


# -- dead letters ----------------------------------------------------------------------------------


@dataclass(slots=True)
class DeadLetter:
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]

    def header(self, name: str) -> str:
        found = [v for k, v in self.headers if k == name]
        return found[-1].decode("utf-8", "replace") if found else ""

    @property
    def reason(self) -> str:
        return self.header(H_ERROR)

    @property
    def source(self) -> str:
        return self.header(H_SOURCE)

    @property
    def topic(self) -> str:
        return self.header(H_TOPIC)

    @property
    def kind(self) -> str:
        return reason_kind(self.reason)


_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
_NUMBER = re.compile(r"\d+")


def reason_kind(reason: str) -> str:
    """A dead letter's reason with its particulars (quoted names, numbers) left out: the kind of
    failure, for grouping ("destination topic '…' does not exist (held N ms, ...)")."""
    return _NUMBER.sub("N", _QUOTED.sub("'…'", reason)) or "(no reason)"


def matches(d: DeadLetter, reason: str | None, source: str | None) -> bool:
    """``reason``: the kind (exactly) or a part of the reason; ``source``: a part of tw-source or
    of the destination (tw-topic)."""
    if reason and reason != d.kind and reason.lower() not in d.reason.lower():
        return False
    return not source or source in d.source or source in d.topic


@dataclass(slots=True)
class DeadLetterPage:
    items: list[DeadLetter]
    #: partition -> the offset below which it was not read yet; None: all read
    next_cursor: dict[int, int] | None
    scanned: int
    #: reason kinds among the records read for this page
    kinds: Counter[str]
    total: int


def parse_partitions(text: str | None) -> dict[int, int] | None:
    """``p:o,p:o`` -> {p: o}; ValueError if not one."""
    if not text:
        return None
    out = {}
    for part in text.split(","):
        p, sep, o = part.partition(":")
        if not sep or not p.isdigit() or not o.isdigit():
            raise ValueError(f"not a dead-letter cursor: {text!r} (expected partition:offset,...)")
        out[int(p)] = int(o)
    return out


def partitions_text(cursor: Mapping[int, int]) -> str:
    return ",".join(f"{p}:{o}" for p, o in sorted(cursor.items()))


def _read_range(log: CommitLog, topic: str, partition: int, lo: int, hi: int) -> list[Record]:
    consumer = log.consumer(topic, {partition: lo})
    out: list[Record] = []
    try:
        while consumer.position(partition) < hi:
            batch = consumer.poll(min(hi - lo, 2_000), 1.0)
            if not batch:
                break
            out += [r for r in batch if r.partition == partition and r.offset < hi]
    finally:
        consumer.close()
    return out


def browse_dead_letters(log: CommitLog, config: TimerConfig, *, reason: str | None = None,
                        source: str | None = None, limit: int = 50, before: str | None = None,
                        budget: int = DLQ_BUDGET) -> DeadLetterPage:
    """A page of dead letters, newest first per partition (see the module header)."""
    topic = config.dlq_topic
    ends = log.end_offsets(topic)
    starts = log.start_offsets(topic)
    cursor = parse_partitions(before) or {}
    hi = {p: min(cursor.get(p, end), end) for p, end in ends.items()}
    items: list[DeadLetter] = []
    kinds: Counter[str] = Counter()
    scanned = 0
    chunk = 500
    for p in sorted(ends):
        lo_bound = starts.get(p, 0)
        while hi[p] > lo_bound and len(items) < limit and scanned < budget:
            lo = max(lo_bound, hi[p] - chunk)
            recs = sorted(_read_range(log, topic, p, lo, hi[p]), key=lambda r: -r.offset)
            if not recs:
                hi[p] = lo
                continue
            for r in recs:
                d = DeadLetter(r.partition, r.offset, r.timestamp_ms, r.key, r.value, list(r.headers))
                scanned += 1
                kinds[d.kind] += 1
                hi[p] = r.offset
                if matches(d, reason, source):
                    items.append(d)
                    if len(items) >= limit:
                        break
    done = all(hi[p] <= starts.get(p, 0) for p in ends)
    total = sum(ends[p] - starts.get(p, 0) for p in ends)
    return DeadLetterPage(items, None if done else hi, scanned, kinds, total)


def dead_letters(log: CommitLog, config: TimerConfig, *, reason: str | None, source: str | None,
                 at_most: int) -> list[DeadLetter]:
    """Every dead letter matching (at most ``at_most``, newest first): what a redrive by filter takes."""
    out: list[DeadLetter] = []
    before: str | None = None
    while len(out) < at_most:
        page = browse_dead_letters(log, config, reason=reason, source=source, limit=at_most - len(out),
                                   before=before, budget=50_000)
        out += page.items
        if page.next_cursor is None:
            break
        before = partitions_text(page.next_cursor)
    return out


def dead_letter_at(log: CommitLog, config: TimerConfig, partition: int, offset: int) -> DeadLetter | None:
    rec = log.read(config.dlq_topic, [(partition, offset)])[0]
    if rec is None:
        return None
    return DeadLetter(rec.partition, rec.offset, rec.timestamp_ms, rec.key, rec.value, list(rec.headers))


def preview(value: bytes | None, size: int = PREVIEW_BYTES) -> str:
    """The start of a value as text (undecodable bytes shown as \\x..), marked when cut."""
    if value is None:
        return "(null)"
    text = value[:size].decode("utf-8", "backslashreplace")
    return text + (f" … ({len(value):,} bytes)" if len(value) > size else "")

