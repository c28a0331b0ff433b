"""Browse the pending timers and the dead letters a page at a time, with a cost bounded per page.

**Pending timers** are read from the shards as dequeue-get reads them, never by listing them all:
a page of ``limit`` messages from a cursor costs about ``limit`` TimerLog records, whatever the
shards hold (1 M pending: BENCHMARKS.md, "Console").

- *By time range* (``walk``): per shard, the wheel's non-empty slots from ``max(from, R)`` on
  (``Shard.next_nonempty``, column-wise, looking a few ticks ahead first), each slot's records
  read through its TimerLog chain, or column-wise for a dense slot; a shard stops once it has
  ``limit + 1`` messages past the cursor, or after ``budget`` records (a slot of a burst), and says
  where it got to. The shards' lists are merged by (fire time, shard, TimerLog position), which is
  also the cursor: the next page starts after the last message shown.
- *By destination or id* (``scan``): each shard's TimerLog is kept in memory as the few columns
  a filter reads (``Columns``: topic hash, id hash, fire time, flags; 21 bytes a record), caught up
  with what was flushed since the last page; the records with the destination's topic hash or the
  id's hash are found by comparing a contiguous column (a few ms per million records), and the
  first ``limit + 1`` past the cursor read back from the TimerLog, checked.

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
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from timerwheel.config import TimerConfig
from timerwheel.errors import CorruptRecordError, InvalidTimerMessage
from timerwheel.records import Record
from timerwheel.store import Flag, Shard
from timerwheel.store.format import RECORD_SIZE, RecordArray
from timerwheel.store.timerlog import CHUNK_RECORDS
from timerwheel.store.wheel import SLOT_MAGIC
from timerwheel.transports.base import CommitLog
from timerwheel.wire import (
    H_ERROR,
    H_SOURCE,
    H_TOPIC,
    Ticket,
    TimerRules,
    message_id_of,
    moved_messages,
    record_revision,
    record_roll,
    revision_hashes,
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
    #: Its revision (``tw-revision``: 0 unless rescheduled), what its ticket names.
    revision: int = 0
    key: bytes | None = None
    value: bytes | None = None
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    #: The timer record is gone from the timer topic (retention): it will be dead-lettered.
    missing: bool = False

    @property
    def ticket(self) -> str | None:
        if self.missing or self.deliver_at_ms is None:
            return None
        return str(Ticket(self.partition, self.deliver_at_ms, self.message_id, self.revision))


@dataclass(slots=True)
class PendingPage:
    items: list[PendingItem]
    #: Where the next page starts; None when the range holds no more.
    next_cursor: str | None
    #: TimerLog records read for this page.
    scanned: int
    #: "walk" (by time) or "scan" (by id)
    method: str


#: Mixes a record's slot into its id hash: a cancel marker hides the messages of its id in its slot.
_SLOT_MIX = np.uint64(0x9E3779B97F4A7C15)

Hit = tuple[Key, int, int, bool]  # (key, src partition, src offset, rolled)


class _Want:
    """What a page asks of each record: the range, R, the filters and the cursor."""

    def __init__(self, from_ms: int, to_ms: int, topic: int | None, message_id: npt.NDArray[np.uint64] | None,
                 after: Key | None, tick_ms: int) -> None:
        self.from_ms, self.to_ms, self.topic, self.message_id, self.after = from_ms, to_ms, topic, message_id, after
        self.tick_ms = tick_ms

    def candidates(self, shard_id: int, positions: npt.NDArray[np.int64], arr: RecordArray,
                   r_slot: int) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
        """(mask of the messages asked for, their cancel keys, the cancel markers' keys)."""
        deliver = arr["deliver_ms"]
        slot = deliver - deliver % self.tick_ms
        flags = arr["magic"] & 0xFF
        delete = (flags & _DELETE) != 0
        keys = arr["id_hash"] ^ (slot.astype(np.uint64) * _SLOT_MIX)
        m = ~delete & (flags != 0) & (deliver >= self.from_ms) & (deliver < self.to_ms) & (slot >= r_slot)
        if self.topic is not None:
            m &= arr["topic_hash"] == np.uint32(self.topic)
        if self.message_id is not None:
            m &= np.isin(arr["id_hash"], self.message_id)
        if self.after is not None:
            d0, s0, p0 = self.after
            m &= (deliver > d0) | ((deliver == d0) & ((shard_id > s0) | ((shard_id == s0) & (positions > p0))))
        return m, keys, keys[delete]


def _first(shard_id: int, positions: npt.NDArray[np.int64], arr: RecordArray, want: int) -> list[Hit]:
    """The first ``want`` of these (checked) records by (fire time, position), as hits."""
    order = np.lexsort((positions, arr["deliver_ms"]))[: want]
    arr, positions = arr[order], positions[order]
    return [((int(d), shard_id, int(p)), int(sp), int(so), bool(f & _ROLL))
            for d, p, sp, so, f in zip(arr["deliver_ms"].tolist(), positions.tolist(), arr["src_partition"].tolist(),
                                       arr["src_offset"].tolist(), (arr["magic"] & 0xFF).tolist(), strict=True)]


def _bounds(shard: Shard) -> tuple[int, int, int] | None:
    """(flushed position, R's slot, W) of a shard as its checkpoints publish them; None before any."""
    enq = shard.load_enqueue_checkpoint()
    if enq is None:
        return None
    shard.refresh(enq)  # a reader on another node: what the volume holds, not a stale cache
    deq = shard.load_dequeue_checkpoint()
    return enq.flushed_pos, shard.slot_time(deq.read_ms if deq is not None else enq.write_ms), enq.write_ms


def _nonempty(shard: Shard, t: int, end: int) -> list[int]:
    """The times of the non-empty slots in [t, end) as this view knows them (the wheel's rows,
    read column-wise, and the reader's tail index), in order."""
    tick = shard.tick_ms
    times = t + tick * np.arange(max(0, -((t - end) // tick)), dtype=np.int64)
    rows = shard.wheel.rows((times // tick) % shard.slots)
    found = times[(rows["magic"] == SLOT_MAGIC) & (rows["slot_time"] == times) & (rows["num"] > 0)]
    if shard.tail is not None:
        in_tail, _head, _first, num = shard.tail.merged(t, end)
        found = np.union1d(found, in_tail[num > 0])
    return [int(x) for x in found]


def _slot_hits(shard_id: int, shard: Shard, t: int, flushed: int, r_slot: int, want: _Want,
               count: int) -> tuple[list[Hit], int]:
    """The first ``count`` messages of one slot that match (a cancel marker in the slot hides its
    id's messages), and the records read: the slot's column-wise pieces, joined."""
    pieces = list(shard.read_slot(t, flushed))  # checked records: read_slot skips the others
    if not pieces:
        return [], 0
    positions = np.concatenate([p for p, _a in pieces])
    arr = np.concatenate([a for _p, a in pieces])
    m, keys, markers = want.candidates(shard_id, positions, arr, r_slot)
    if markers.size:
        m &= ~np.isin(keys, markers)
    idx = np.flatnonzero(m)
    return _first(shard_id, positions[idx], arr[idx], count), len(arr)


def _walk_shard(shard_id: int, shard: Shard, want: _Want, count: int, budget: int) -> tuple[list[Hit], Key, int]:
    """Up to ``count`` messages of one shard, slot by slot from the range's start: the hits, the
    key up to which the shard is complete, and the TimerLog records read."""
    bounds = _bounds(shard)
    if bounds is None:
        return [], (_BIG, _BIG, _BIG), 0
    flushed, r_slot, _w = bounds
    tick = shard.tick_ms
    t = shard.slot_time(max(want.from_ms, r_slot, want.after[0] if want.after else want.from_ms))
    end = min(want.to_ms, r_slot + shard.slots * tick)
    hits: list[Hit] = []
    scanned = 0
    window = 64 * tick  # a few ticks at a time while they hold messages; growing over empty stretches
    while t < end:
        upto = min(end, t + window)
        slots = _nonempty(shard, t, upto)
        for slot in slots:
            if len(hits) >= count or scanned >= budget:
                return hits, (slot, -1, -1), scanned
            found, n = _slot_hits(shard_id, shard, slot, flushed, r_slot, want, count - len(hits))
            hits += found
            scanned += n
        t, window = upto, 64 * tick if slots else min(window * 8, (1 << 18) * tick)
    return hits, (_BIG, _BIG, _BIG), scanned


class Columns:
    """One shard's TimerLog as the columns a filter by destination or id reads, in memory: topic
    hash, id hash, fire time and flags, 21 bytes a record (1 M records: 21 MB). Each ``update``
    reads only what was flushed since the last (below the published flushed position a TimerLog
    never changes) and forgets what retention deleted, so a filtered page compares a few
    contiguous columns instead of reading the whole TimerLog."""

    __slots__ = ("chunks", "end")

    def __init__(self) -> None:
        #: (first position, topic hashes, id hashes, fire times, flags), in TimerLog order
        self.chunks: list[tuple[int, npt.NDArray[np.uint32], npt.NDArray[np.uint64], npt.NDArray[np.int64],
                                npt.NDArray[np.uint8]]] = []
        self.end = 0

    def update(self, shard: Shard, flushed: int) -> int:
        """Catch up with the TimerLog up to ``flushed``; returns the records read."""
        start = shard.log.start_pos
        if flushed < self.end or self.end < start:  # a log cut back, or replaced: read it again
            self.chunks, self.end = [], start
        self.chunks = [c for c in self.chunks if c[0] + RECORD_SIZE * len(c[1]) > start]
        read = 0
        for first, arr in shard.log.iter_chunks(max(self.end, start), flushed):
            part = (first, arr["topic_hash"].copy(), arr["id_hash"].copy(), arr["deliver_ms"].copy(),
                    (arr["magic"] & 0xFF).astype(np.uint8))
            read += len(arr)
            last = self.chunks[-1] if self.chunks else None
            if last is not None and len(last[1]) + len(arr) <= 2 * CHUNK_RECORDS:  # small reads join the last chunk
                self.chunks[-1] = (last[0], np.concatenate((last[1], part[1])), np.concatenate((last[2], part[2])),
                                   np.concatenate((last[3], part[3])), np.concatenate((last[4], part[4])))
            else:
                self.chunks.append(part)
        self.end = flushed
        return read

    def select(self, shard_id: int, want: _Want, r_slot: int, start_pos: int) -> tuple[
            npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """(fire times, positions) of the records that match ``want``, from R on, in the range,
        past the cursor, without a cancel marker of their id in their slot."""
        tick = want.tick_ms
        fires, positions, keys, marks = [], [], [], []
        for first, topic, ident, fire, flags in self.chunks:
            slot_of = fire - fire % tick
            marked = np.flatnonzero(flags & _DELETE)
            if marked.size:
                marks.append(ident[marked] ^ (slot_of[marked].astype(np.uint64) * _SLOT_MIX))
            if want.message_id is not None:
                idx = np.flatnonzero(np.isin(ident, want.message_id))
            else:
                idx = np.flatnonzero(topic == np.uint32(want.topic or 0))
            if not idx.size:
                continue
            pos = first + RECORD_SIZE * idx.astype(np.int64)
            d, f, slot = fire[idx], flags[idx], slot_of[idx]
            m = ((f & _DELETE) == 0) & (f != 0) & (d >= want.from_ms) & (d < want.to_ms) & (slot >= r_slot)
            m &= pos >= start_pos
            if want.topic is not None and want.message_id is not None:
                m &= topic[idx] == np.uint32(want.topic)
            if want.after is not None:
                d0, s0, p0 = want.after
                m &= (d > d0) | ((d == d0) & ((shard_id > s0) | ((shard_id == s0) & (pos > p0))))
            fires.append(d[m])
            positions.append(pos[m])
            keys.append(ident[idx][m] ^ (slot[m].astype(np.uint64) * _SLOT_MIX))
        if not fires:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        fire_all, pos_all, key_all = np.concatenate(fires), np.concatenate(positions), np.concatenate(keys)
        if marks:
            live = ~np.isin(key_all, np.concatenate(marks))
            fire_all, pos_all = fire_all[live], pos_all[live]
        return fire_all, pos_all

    def marker_positions(self, hashes: npt.NDArray[np.uint64], r_slot: int, start_pos: int,
                         tick: int) -> npt.NDArray[np.int64]:
        """The TimerLog positions of the cancel markers (cancels and reschedules) with one of these
        id hashes, in slots from R on."""
        out = []
        for first, _topic, ident, fire, flags in self.chunks:
            idx = np.flatnonzero(((flags & (_DELETE | _ROLL)) == _DELETE) & np.isin(ident, hashes))
            if idx.size:
                pos = first + RECORD_SIZE * idx.astype(np.int64)
                slot = fire[idx] - fire[idx] % tick
                out.append(pos[(slot >= r_slot) & (pos >= start_pos)])
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def _scan_shard(shard_id: int, shard: Shard, want: _Want, count: int, columns: Columns) -> tuple[list[Hit], int]:
    """The first ``count`` messages of one shard with the id or destination asked for, from the
    shard's ``Columns`` (caught up first); and the TimerLog records read for it."""
    bounds = _bounds(shard)
    if bounds is None:
        return [], 0
    flushed, r_slot, _w = bounds
    read = columns.update(shard, flushed)
    fires, positions = columns.select(shard_id, want, r_slot, shard.log.start_pos)
    if len(fires) > 4 * count:  # the first ``count`` by fire time without sorting every match
        cut = np.partition(fires, count - 1)[count - 1]
        near = np.flatnonzero(fires <= cut)
        fires, positions = fires[near], positions[near]
    hits: list[Hit] = []
    for k in np.lexsort((positions, fires)).tolist():
        if len(hits) >= count:
            break
        pos = int(positions[k])
        try:
            r = shard.log.read(pos)  # checked: a record torn or corrupt on the volume is left out
        except CorruptRecordError:
            continue
        hits.append(((r.deliver_ms, shard_id, pos), r.src_partition, r.src_offset, bool(r.flags & _ROLL)))
    return hits, read


def browse_pending(shards: Mapping[int, Shard], log: CommitLog, config: TimerConfig, from_ms: int, to_ms: int, *,
                   topic: str | None = None, message_id: str | None = None, limit: int = 50,
                   after: str | None = None, budget: int = WALK_BUDGET,
                   columns: MutableMapping[int, Columns] | None = None) -> PendingPage:
    """A page of pending messages firing in [from_ms, to_ms) (to ``topic``, with ``message_id``),
    in firing order, after the cursor ``after`` (see the module header). ``columns``: each shard's
    ``Columns``, kept by the caller between pages (made here if missing)."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    cursor = parse_cursor(after)
    tick = next(iter(shards.values())).tick_ms if shards else config.tick_ms
    want = _Want(from_ms, to_ms, topic_hash(topic) if topic else None,
                 np.array(revision_hashes(message_id), dtype=np.uint64) if message_id else None, cursor, tick)
    hits: list[Hit] = []
    scanned = 0
    bound: Key = (_BIG, _BIG, _BIG)
    if message_id or topic:
        for shard_id, shard in sorted(shards.items()):
            kept = columns if columns is not None else {}
            found, n = _scan_shard(shard_id, shard, want, limit + 1, kept.setdefault(shard_id, Columns()))
            hits += found
            scanned += n
        method = "scan"
    else:
        per_shard = max(1, budget // max(1, len(shards)))
        for shard_id, shard in sorted(shards.items()):
            found, complete_to, n = _walk_shard(shard_id, shard, want, limit + 1, per_shard)
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
        else:
            _describe(item, rec, rules)
    return [i for i in items if i.missing or ((not topic or i.topic == topic)
                                              and (not message_id or i.message_id == message_id))]


def _describe(item: PendingItem, rec: Record, rules: TimerRules) -> None:
    """``item``'s fields from its timer record."""
    item.message_id = message_id_of(rec)
    item.topic = (rec.header(H_TOPIC) or b"").decode("utf-8", "replace")
    try:
        item.deliver_at_ms = rules.delivery_time(rec, 0, check_max=False)
    except InvalidTimerMessage:
        item.deliver_at_ms = None
    item.roll = record_roll(rec)
    item.revision = record_revision(rec)
    item.key, item.value, item.headers = rec.key, rec.value, list(rec.headers)


def find_pending(shards: Mapping[int, Shard], log: CommitLog, config: TimerConfig, message_id: str,
                 columns: MutableMapping[int, Columns] | None = None) -> PendingItem | None:
    """The pending message with this id (its newest revision and timer record), or None. A message
    a reschedule moved is found before dequeue-getmsg writes its new revision back (at the old
    time): as the reschedule record, due at its new time (``wire.moved_messages``)."""
    kept = columns if columns is not None else {}
    page = browse_pending(shards, log, config, 0, 1 << 62, message_id=message_id, limit=10, columns=kept)
    found = [i for i in page.items if i.message_id == message_id and not i.missing]
    found += _moved_items(shards, log, config, message_id, kept)
    return max(found, key=lambda i: (i.revision, i.roll, i.offset), default=None)


def _moved_items(shards: Mapping[int, Shard], log: CommitLog, config: TimerConfig, message_id: str,
                 columns: MutableMapping[int, Columns]) -> list[PendingItem]:
    """The moved messages of this id that no marker decides again (their reschedule records), from
    the markers of its revisions in each shard's slots from R on (``Columns``, caught up by
    ``browse_pending`` just before)."""
    hashes = np.array(revision_hashes(message_id), dtype=np.uint64)
    rules = TimerRules(config)
    out: list[PendingItem] = []
    for shard_id, shard in sorted(shards.items()):
        bounds, cols = _bounds(shard), columns.get(shard_id)
        if bounds is None or cols is None:
            continue
        places = []
        for pos in cols.marker_positions(hashes, bounds[1], shard.log.start_pos, shard.tick_ms).tolist():
            try:
                r = shard.log.read(pos)
            except CorruptRecordError:
                continue
            places.append((r.src_partition, r.src_offset))
        records = [r for r in log.read(config.timer_topic, places) if r is not None] if places else []
        for (mid, _revision), rec in moved_messages(records):
            if mid == message_id:
                item = PendingItem(shard_id, -1, 0, False, rec.partition, rec.offset)
                _describe(item, rec, rules)
                item.fire_ms = item.deliver_at_ms or 0
                out.append(item)
    return out


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

