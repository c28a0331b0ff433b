"""Browse pending timers: the scheduled, not yet delivered messages of a delivery-time range.

Read from the shards as dequeue-get reads them (read-only views, nothing is changed): for each
shard, the wheel's non-empty slots from ``R`` (slots before it are delivered) are walked through
their TimerLog chains. The TimerLog keeps hashes, so the messages' timer records are then read
from the commit log by (partition, offset), in batches, as dequeue-getmsg does, for their id,
destination, delivery time and roll count.

Which slots: a message fires in the slot of its delivery time (or of its write time ``W`` if it
came late) unless it rolls, and a rolled one fires earlier, at a roll slot, never later. So a
message due before ``to_ms`` sits in a slot before ``max(to_ms, W + tick)``; the walk stops there.
A message is left out when a cancel marker with its id hash is in the walked slots (RIP-43's
DELETE marker, in the slot of the delivery time, or rolled with the message). A reschedule is
such a marker of the old revision too: the markers that hide a message are read from the commit
log, and a reschedule that decides its ticket (``wire.moved_messages``) lists the message at its
new time, as its next revision, until dequeue-getmsg writes that revision back at the old time.
A search by id looks for the id's first ``SEARCHED_REVISIONS`` revisions. A message in a
slot at or after ``R`` that is being delivered at this moment is still listed (as after a crash
it would be delivered again). Cancels and messages not yet written by enqueue-put (``W`` lag)
are not seen.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from timerwheel.config import TimerConfig
from timerwheel.errors import InvalidTimerMessage
from timerwheel.records import Record
from timerwheel.store import Flag, Shard
from timerwheel.transports.base import CommitLog
from timerwheel.wire import (
    H_TOPIC,
    TimerRules,
    message_id_of,
    moved_messages,
    record_revision,
    record_roll,
    revision_hashes,
    revision_id_hash,
    topic_hash,
)

#: Timer records read from the commit log per call.
READ_BATCH = 2_000
_DELETE, _ROLL = int(Flag.DELETE), int(Flag.ROLL)


@dataclass(frozen=True, slots=True)
class PendingTimer:
    message_id: str
    topic: str
    deliver_at_ms: int
    #: Times the message has rolled so far (its timer record's ``tw-roll``).
    roll: int
    shard: int
    #: Its timer record in the timer topic (for a message moved by a reschedule not yet written
    #: back: the reschedule record).
    partition: int
    offset: int
    #: Its revision (``tw-revision``: 0 unless rescheduled), what its ticket names.
    revision: int = 0


@dataclass(frozen=True, slots=True)
class PendingTimers:
    #: How many pending messages match.
    count: int
    #: The first ``limit`` of them by delivery time.
    timers: list[PendingTimer] = field(default_factory=list)


def _candidates(shard: Shard, from_ms: int, to_ms: int, want_topic: int | None, want_ids: np.ndarray | None,
                markers: dict[int, list[tuple[int, int]]], earlier: list[np.ndarray]) -> Iterator[tuple[int, int, int]]:
    """(id hash, partition, offset) of the shard's messages that may be due in [from_ms, to_ms);
    the markers go into ``markers``: id hash -> their timer records' (partition, offset); the id
    hashes of the messages due before ``from_ms`` into ``earlier`` (a reschedule may move one
    into the range)."""
    enq = shard.load_enqueue_checkpoint()
    if enq is None:
        return
    deq = shard.load_dequeue_checkpoint()
    tick, span = shard.tick_ms, shard.wheel.slots * shard.tick_ms
    end_limit = enq.write_ms + tick
    start = shard.slot_time(deq.read_ms if deq else end_limit - span)
    end = min(start + span, max(to_ms, end_limit))
    t: int | None = start
    while t is not None and t < end:
        t = shard.wheel.next_nonempty(t, end)
        if t is None:
            break
        for _positions, records in shard.read_slot(t, enq.flushed_pos):
            flags = records["magic"] & 0xFF
            is_marker = (flags & _DELETE) != 0
            marks = records[is_marker]
            for h, p, o in zip(marks["id_hash"].tolist(), marks["src_partition"].tolist(),
                               marks["src_offset"].tolist(), strict=True):
                markers.setdefault(h, []).append((p, o))
            wanted = ~is_marker
            if want_topic is not None:
                wanted &= records["topic_hash"] == want_topic
            if want_ids is not None:
                wanted &= np.isin(records["id_hash"], want_ids)
            keep = wanted & (((flags & _ROLL) != 0) | (records["deliver_ms"] >= from_ms))
            earlier.append(records["id_hash"][wanted & ~keep])
            kept = records[keep]
            yield from zip(kept["id_hash"].tolist(), kept["src_partition"].tolist(), kept["src_offset"].tolist(),
                           strict=True)
        t += tick


def _read(commit_log: CommitLog, topic: str, places: list[tuple[int, int]]) -> Iterator[Record | None]:
    for i in range(0, len(places), READ_BATCH):
        yield from commit_log.read(topic, places[i:i + READ_BATCH])


def pending_timers(commit_log: CommitLog, shards: Mapping[int, Shard], config: TimerConfig, from_ms: int,
                   to_ms: int, *, now_ms: int, topic: str | None = None, message_id: str | None = None,
                   limit: int = 100) -> PendingTimers:
    """The pending messages due in [from_ms, to_ms) (of ``topic``, with ``message_id``): their
    count and the first ``limit`` by delivery time. ``shards`` are read-only views."""
    rules = TimerRules(config)
    want_topic = None if topic is None else topic_hash(topic)
    want_ids = None if message_id is None else np.array(revision_hashes(message_id), dtype=np.uint64)
    count = 0
    first: list[tuple[int, str, int, int, PendingTimer]] = []  # max-heap by (-deliver, id) of the first ``limit``
    for shard_id, shard in sorted(shards.items()):
        markers: dict[int, list[tuple[int, int]]] = {}
        earlier: list[np.ndarray] = []
        found = list(_candidates(shard, from_ms, to_ms, want_topic, want_ids, markers, earlier))
        hidden = {c[0] for c in found if c[0] in markers}
        if markers and earlier:
            hidden.update(np.intersect1d(np.concatenate(earlier), np.fromiter(markers, np.uint64)).tolist())
        latest: dict[str, PendingTimer] = {}
        live = [(p, o) for h, p, o in found if h not in markers]
        for rec in _read(commit_log, config.timer_topic, live):
            _offer(latest, _pending(rec, rules, shard_id, from_ms, to_ms, topic, message_id))
        # the markers that hide a message: a reschedule among them moves it (its next revision)
        for rec in _moved(commit_log, config.timer_topic, markers, hidden):
            _offer(latest, _pending(rec, rules, shard_id, from_ms, to_ms, topic, message_id))
        for timer in latest.values():
            count += 1
            if limit > 0:
                entry = (-timer.deliver_at_ms, timer.message_id, timer.partition, timer.offset, timer)
                if len(first) < limit:
                    heapq.heappush(first, entry)
                elif entry > first[0]:
                    heapq.heapreplace(first, entry)
    timers = sorted((e[4] for e in first), key=lambda x: (x.deliver_at_ms, x.message_id))
    return PendingTimers(count, timers)


def _moved(commit_log: CommitLog, timer_topic: str, markers: dict[int, list[tuple[int, int]]],
           hidden: set[int]) -> list[Record]:
    """The reschedule records that stand for a moved message (``wire.moved_messages``): the markers
    that hide a message are read, then those of the revisions they moved it to, and so on (a
    message moved twice before its first time came has two reschedules, of revisions 0 and 1)."""
    read: set[int] = set()
    records: list[Record] = []
    todo = hidden
    while todo:
        read |= todo
        records += [r for r in _read(commit_log, timer_topic, [pl for h in todo for pl in markers[h]]) if r is not None]
        todo = {h for (mid, rev), _r in moved_messages(records)
                if (h := revision_id_hash(mid, rev)) in markers and h not in read}
    return [rec for _target, rec in moved_messages(records)]


def _offer(latest: dict[str, PendingTimer], timer: PendingTimer | None) -> None:
    """Keep ``timer`` unless a newer revision of its message, or the same further rolled, is kept: a
    rolling message may be in two slots for a moment, a moved one in its old and new revision."""
    if timer is None:
        return
    known = latest.get(timer.message_id)
    if known is None or (known.revision, known.roll) < (timer.revision, timer.roll):
        latest[timer.message_id] = timer


def _pending(rec: Record | None, rules: TimerRules, shard_id: int, from_ms: int, to_ms: int, topic: str | None,
             message_id: str | None) -> PendingTimer | None:
    if rec is None:  # gone from the timer topic (retention): dequeue-getmsg will dead-letter it
        return None
    try:
        deliver = rules.delivery_time(rec, 0, check_max=False)
    except InvalidTimerMessage:
        return None
    if not from_ms <= deliver < to_ms:
        return None
    dest = (rec.header(H_TOPIC) or b"").decode("utf-8", "replace")
    mid = message_id_of(rec)
    if (topic is not None and dest != topic) or (message_id is not None and mid != message_id):
        return None
    return PendingTimer(mid, dest, deliver, record_roll(rec), shard_id, rec.partition, rec.offset,
                        record_revision(rec))
