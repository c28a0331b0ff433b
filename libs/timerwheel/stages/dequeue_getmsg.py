"""dequeue-getmsg: fetch requests -> the original records, read in batches.

Stateless. Takes fetch entries from its queue partitions, reads every source record they
name (and the cancel markers and earlier copies they reference) from the timer topic in one
batched call grouped per partition, and passes each on to dequeue-put as DELIVER, ROLL,
CANCELLED (the full id of the message equals the marker's ``tw-cancel``), REDIRECT (the first
marker of the message is a reschedule: ``decider``), DUPLICATE (an
earlier copy of it in the slot has the same full id: design 2.5) or MISSING (the source record
is gone from the log: reported and dead-lettered, never retried forever — PITFALLS #7480).

Memory is bounded in bytes, whatever the record sizes: a step's entries are read in groups of
about TW_BATCH_BYTES of records (estimated from the last read's mean record size), each group
passed on before the next is read, and the deliver queue holds at most TW_QUEUE_BYTES per
partition (its ``put`` waits). The read-ahead keeps TW_READ_CACHE_BYTES at most.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Iterator, Sequence
from itertools import repeat
from typing import Any

from timerwheel import telemetry
from timerwheel.log import stage_logger
from timerwheel.records import Record
from timerwheel.stages.base import QueueStage, StageContext, decoded, put_blocking
from timerwheel.stages.codec import (
    CANCELLED,
    DELIVER,
    DUPLICATE,
    MISSING,
    REDIRECT,
    ROLL,
    DeliverEntry,
    DeliverItem,
    FetchEntry,
    FetchItem,
    wire,
)
from timerwheel.store import Flag
from timerwheel.transports.base import CommitLog, FollowingLog, WorkQueue
from timerwheel.wire import H_CANCEL, H_REVISION, first_offset, marker_target, message_id_of

STAGE = "dequeue-getmsg"
_ROLL = int(Flag.ROLL)
#: C-level getters of fetch-item fields: a fetch item's (src_partition, src_offset), ...
_POSITION = operator.itemgetter(FetchItem._fields.index("src_partition"), FetchItem._fields.index("src_offset"))
_FLAGS, _FIRE_MS, _ENQUEUED_MS, _SRC_PARTITION, _SRC_OFFSET, _CANCELS, _SAME_AS = (
    operator.itemgetter(FetchItem._fields.index(name))
    for name in ("flags", "fire_ms", "enqueued_ms", "src_partition", "src_offset", "cancels", "same_as"))
#: Every flags value with the ROLL bit.
_ROLLED = frozenset(f for f in range(2 * max(Flag)) if f & _ROLL)


class DequeueGetMsg(QueueStage):
    stage = STAGE

    def __init__(self, ctx: StageContext, commit_log: CommitLog, fetch_queue: WorkQueue, deliver_queue: WorkQueue,
                 partitions: Sequence[int]) -> None:
        super().__init__(ctx, fetch_queue, partitions)
        self.commit_log = commit_log
        self.fetch_q = fetch_queue
        self.deliver_q = deliver_queue
        self.logger = stage_logger(STAGE)
        #: Mean bytes of a record in the last read (0: none yet), to cut reads at TW_BATCH_BYTES.
        self._record_bytes = 0
        # Kafka: read the timer topic ahead, so that short delays find their records in memory.
        if isinstance(commit_log, FollowingLog):
            commit_log.follow(ctx.config.timer_topic)

    def handle_batches(self, batches: dict[int, list[tuple[str, bytes]]]) -> None:
        """The partitions' fetch entries served by one read of the commit log per TW_BATCH_BYTES
        of records (``_groups``): one read for a step of small records, several for large ones."""
        t0 = telemetry.batch_start()
        fetches = {p: decoded(self.ctx, self.fetch_q, p, entries, FetchEntry.decode, self.logger)
                   for p, entries in batches.items()}
        wanted: dict[tuple[int, int], Record | None] = {}
        for group in self._groups(fetches):
            self._serve(group, wanted if t0 is not None else None)
        for partition, entries in batches.items():
            self.fetch_q.ack(partition, [eid for eid, _ in entries])
        if t0 is not None:
            telemetry.dequeue_getmsg_batch(t0, self.ctx.config, [f for part in fetches.values() for f in part], wanted)

    def _groups(self, fetches: dict[int, list[FetchEntry]]) -> Iterator[dict[int, list[FetchEntry]]]:
        """The fetch entries cut into groups of about TW_BATCH_BYTES of records each, by the mean
        record size of the last read (``_record_bytes``; before any read, one entry is a group:
        dequeue-get cuts an entry at TW_BATCH_BYTES of source records). An entry larger than a
        group is split into entries of the same slot: dequeue-put adds up their counts."""
        budget = self.ctx.config.batch_bytes
        group: dict[int, list[FetchEntry]] = {}
        held = 0  # estimated bytes in ``group``
        for partition, part in fetches.items():
            for f in part:
                items = f.items
                while items:
                    mean = self._record_bytes  # read again each time: the last read updates it
                    room = (budget - held) // mean if mean else (0 if group else len(items))
                    if room <= 0 and group:
                        yield group
                        group, held = {}, 0
                        continue
                    n = max(1, room)
                    piece, items = items[:n], items[n:]
                    group.setdefault(partition, []).append(
                        f if len(piece) == len(f.items) else dataclasses.replace(f, items=piece))
                    held += len(piece) * mean if mean else budget
        if group:
            yield group

    def _serve(self, fetches: dict[int, list[FetchEntry]], wanted: dict[tuple[int, int], Record | None] | None) -> None:
        """One read of the commit log for ``fetches``, passed on to the deliver queue."""
        # The records in item order (a position may repeat: read returns it for each), and
        # separately the few cancel markers whose id hash matched and earlier copies referenced.
        positions = [pos for part in fetches.values() for f in part for pos in map(_POSITION, f.items)]
        markers = sorted({(p, o) for part in fetches.values() for f in part for i in f.items for p, o in i.cancels}
                         | {i.same_as for part in fetches.values() for f in part for i in f.items if i.same_as})
        found = self.commit_log.read(self.ctx.config.timer_topic, positions + markers)
        marker_records = dict(zip(markers, found[len(positions):], strict=True))
        sizes = [len(r.value or b"") for r in found[:len(positions)] if r is not None]  # the values dominate
        if sizes:
            self._record_bytes = max(1, sum(sizes) // len(sizes))
            self.ctx.processed(sum(sizes))
        start = 0
        for partition, part in fetches.items():
            start = self._pass_on(partition, part, found, start, marker_records)
        if wanted is not None:
            wanted.update(zip(positions, found, strict=False))
            wanted.update(marker_records)

    def _pass_on(self, partition: int, fetches: list[FetchEntry], found: list[Record | None], start: int,
                 markers: dict[tuple[int, int], Record | None]) -> int:
        """Deliver entries of ``fetches``, whose records are ``found[start:]`` in item order;
        returns where the next partition's records start.

        Each entry's items are built column by column in C (no Python step per item); their
        kinds too when every item is a plain delivery (the common entry: no record missing, no
        roll hop, no cancel marker to confirm), else item by item (``_kind``)."""
        out: list[bytes] = []
        missing = 0
        for f in fetches:
            end = start + len(f.items)
            records = found[start:end]
            items = f.items
            if (None in records or any(map(_CANCELS, items)) or any(map(_SAME_AS, items))
                    or not _ROLLED.isdisjoint(map(_FLAGS, items))):
                each = [self._kind(item, rec, markers) for item, rec in zip(items, records, strict=True)]
                missing += sum(k == MISSING for k, _ in each)
                kinds: Iterable[int] = [k for k, _ in each]
                # A REDIRECT carries the reschedule record that moves the message.
                records = [rec if k != REDIRECT else moved for (k, moved), rec in zip(each, records, strict=True)]
            else:
                kinds = repeat(DELIVER)
            # DeliverItem(...) goes through a Python-level __new__: tuple.__new__ in map is a C loop.
            # The record carries its own trace headers: DeliverItem.traceparent stays unset.
            delivered = tuple(map(tuple.__new__, repeat(DeliverItem), zip(
                kinds, map(_FIRE_MS, items), map(_ENQUEUED_MS, items), records, map(_SRC_PARTITION, items),
                map(_SRC_OFFSET, items), repeat(None))))
            start = end
            out.append(wire(self.deliver_q, DeliverEntry(f.shard, f.generation, f.slot_time, f.read_pos, delivered)))
        if missing:
            self.logger.warning("source records gone from the log", records=missing, partition=partition)
        put_blocking(self.ctx, self.deliver_q, partition, out, self.logger.bind(shard=partition))
        return start

    def _kind(self, item: FetchItem, record: Record | None, markers: dict[tuple[int, int], Record | None]
              ) -> tuple[int, Record | None]:
        """What dequeue-put does with ``item``, whose source record is ``record`` (None: gone from
        the log), and for a REDIRECT the reschedule record that moves it."""
        if record is None:
            return MISSING, None
        if item.flags & _ROLL:
            return ROLL, None
        if item.same_as is not None:
            first = markers[item.same_as]
            if first is not None and same_message(first, record):
                return DUPLICATE, None  # the first copy carries the message (and meets its cancels)
            self.ctx.metrics.inc("copies_missed")  # id-hash collision: another message
        if not item.cancels:
            return DELIVER, None
        found = [markers[ref] for ref in item.cancels]
        first_marker = decider(record, found)
        if first_marker is None:
            self.ctx.metrics.inc("cancel_missed")  # id-hash collision: not the same message
            return DELIVER, None
        void_reschedules(self.ctx, self.logger, record, found, first_marker)
        if first_marker.header(H_CANCEL) is None:  # a reschedule
            return REDIRECT, first_marker
        return CANCELLED, None


def _identity(message: Record) -> tuple[str, int]:
    raw = message.header(H_REVISION)
    return message_id_of(message), int(raw) if raw else 0


def same_message(a: Record, b: Record) -> bool:
    """Two timer records of one message: the same full id and revision (design 2.5)."""
    return _identity(a) == _identity(b)


def confirmed(message: Record, marker: Record | None) -> bool:
    """The ``marker`` (its source record, None if gone) stands against ``message``: a cancel whose
    ``tw-cancel`` and ``tw-revision`` are the message's full id and revision, or a reschedule of
    that revision (its ``tw-id``, and ``tw-revision`` one above). An id-hash match is only a
    candidate. dequeue-put asks the same of the markers it finds in a slot's tail."""
    return marker is not None and marker_target(marker) == _identity(message)


def decider(message: Record, markers: Iterable[Record | None]) -> Record | None:
    """Of the ``markers`` confirmed against ``message``, the one that decides its fate: the first
    in its timer partition (``first_offset``; design 6.1: the first cancel or reschedule of a
    ticket wins, later ones are void). None if none is confirmed."""
    mine = [m for m in markers if m is not None and confirmed(message, m)]
    return min(mine, key=first_offset) if mine else None


def void_reschedules(ctx: StageContext, logger: Any, message: Record, markers: Iterable[Record | None],
                     winner: Record) -> None:
    """Count and log the reschedules of ``message`` that lost to ``winner`` (``reschedules_void``)."""
    seen = {first_offset(winner)}
    for m in markers:
        if m is None or not confirmed(message, m) or m.header(H_CANCEL) is not None or first_offset(m) in seen:
            continue
        seen.add(first_offset(m))
        ctx.metrics.inc("reschedules_void")
        mid, rev = _identity(message)
        logger.info("reschedule void: another cancel or reschedule of the ticket came first", id=mid, revision=rev,
                    partition=m.partition, offset=first_offset(m), first=first_offset(winner))
