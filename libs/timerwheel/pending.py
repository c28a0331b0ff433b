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
DELETE marker, in the slot of the delivery time, or rolled with the message). A message in a
slot at or after ``R`` that is being delivered at this moment is still listed (as after a crash
it would be delivered again). Cancels and messages not yet written by enqueue-put (``W`` lag)
are not seen.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from timerwheel.config import TimerConfig
from timerwheel.errors import InvalidTimerMessage
from timerwheel.records import Record
from timerwheel.store import Flag, Shard
from timerwheel.transports.base import CommitLog
from timerwheel.wire import H_ROLL, H_TOPIC, TimerRules, id_hash, message_id_of, topic_hash

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
    #: Its timer record in the timer topic.
    partition: int
    offset: int


@dataclass(frozen=True, slots=True)
class PendingTimers:
    #: How many pending messages match.
    count: int
    #: The first ``limit`` of them by delivery time.
    timers: list[PendingTimer] = field(default_factory=list)


def _candidates(shard: Shard, from_ms: int, to_ms: int, want_topic: int | None, want_id: int | None,
                markers: set[int]) -> Iterator[tuple[int, int, int]]:
    """(id hash, partition, offset) of the shard's messages that may be due in [from_ms, to_ms);
    the cancel markers' id hashes go into ``markers``."""
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
            markers.update(records["id_hash"][is_marker].tolist())
            keep = ~is_marker & (((flags & _ROLL) != 0) | (records["deliver_ms"] >= from_ms))
            if want_topic is not None:
                keep &= records["topic_hash"] == want_topic
            if want_id is not None:
                keep &= records["id_hash"] == want_id
            kept = records[keep]
            yield from zip(kept["id_hash"].tolist(), kept["src_partition"].tolist(), kept["src_offset"].tolist(),
                           strict=True)
        t += tick


def pending_timers(commit_log: CommitLog, shards: Mapping[int, Shard], config: TimerConfig, from_ms: int,
                   to_ms: int, *, now_ms: int, topic: str | None = None, message_id: str | None = None,
                   limit: int = 100) -> PendingTimers:
    """The pending messages due in [from_ms, to_ms) (of ``topic``, with ``message_id``): their
    count and the first ``limit`` by delivery time. ``shards`` are read-only views."""
    rules = TimerRules(config)
    want_topic = None if topic is None else topic_hash(topic)
    want_id = None if message_id is None else id_hash(message_id)
    count = 0
    first: list[tuple[int, str, int, int, PendingTimer]] = []  # max-heap by (-deliver, id) of the first ``limit``
    for shard_id, shard in sorted(shards.items()):
        markers: set[int] = set()
        found = list(_candidates(shard, from_ms, to_ms, want_topic, want_id, markers))
        found = [c for c in found if c[0] not in markers]
        latest: dict[str, PendingTimer] = {}  # a rolling message may be in two slots for a moment
        for i in range(0, len(found), READ_BATCH):
            batch = found[i:i + READ_BATCH]
            records = commit_log.read(config.timer_topic, [(p, o) for _h, p, o in batch])
            for rec in records:
                timer = _pending(rec, rules, shard_id, from_ms, to_ms, topic, message_id)
                if timer is not None and (timer.message_id not in latest
                                          or latest[timer.message_id].roll < timer.roll):
                    latest[timer.message_id] = timer
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
    raw_roll = rec.header(H_ROLL)
    roll = int(raw_roll) if raw_roll and raw_roll.isdigit() else 0
    return PendingTimer(mid, dest, deliver, roll, shard_id, rec.partition, rec.offset)
