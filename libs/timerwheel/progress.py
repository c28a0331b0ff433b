"""Exactly-once delivery's progress records (design precision-and-exactly-once.md 7.1, issue 31).

Not wired yet: the building block of dequeue-put's transactional release (``TW_DELIVERY_GUARANTEE=
exactly-once``). The owner of shard ``s`` commits each release batch in one Kafka transaction with
one **progress record** on partition ``s`` of the progress topic: what the batch finished *with
output* (a delivery, a roll hop, a hold, a dead letter), slot by slot, each record named by its
source position in the timer topic (``partition << 40 | offset``). The source position, not the
TimerLog position, names a record: a recovery that lost a TimerLog tail writes the records Kafka
hands over again at new positions, with the same source positions, and a roll hop is a new source
record of its own.

A new owner, after ``init_transactions`` (which fences every older producer of the shard's
transactional id), reads ``R`` and then the shard's progress partition, ``read_committed``, from
the first record whose timestamp is at least ``R - READ_BACK_MARGIN_MS`` to its end: what it finds
for slots at or after ``R`` is ``Finished``, and a record found there finishes without output
(it was delivered, exactly once, by a committed transaction). Why the time works: a record leaves
at or after its due time by the releasing clock, which also stamps its progress record, so the
progress of every slot at or after ``R`` has a timestamp at or after ``R``; the margin covers a
progress topic with ``LogAppendTime`` (the broker's clock).

Wire format (msgpack, the version first so that a later one can be told apart)::

    [1, shard, lease epoch, [[slot time, [source position, ...]], ...]]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import msgpack

from timerwheel.records import OutRecord

PROGRESS_VERSION = 1
#: How far before R the read-back starts, by record timestamp (a broker clock ahead of ours).
READ_BACK_MARGIN_MS = 60_000
#: A source position is ``partition << OFFSET_BITS | offset`` (Kafka offsets stay far below 2^40).
OFFSET_BITS = 40
OFFSET_MASK = (1 << OFFSET_BITS) - 1


def source_position(partition: int, offset: int) -> int:
    """The one int that names a timer record: its partition and offset in the timer topic."""
    if partition < 0 or not 0 <= offset <= OFFSET_MASK:
        raise ValueError(f"no source position for partition {partition}, offset {offset}")
    return partition << OFFSET_BITS | offset


def source_of(position: int) -> tuple[int, int]:
    """(partition, offset) of a source position."""
    return position >> OFFSET_BITS, position & OFFSET_MASK


@dataclass(frozen=True, slots=True)
class Progress:
    """One committed batch's progress record: shard, the owner's lease epoch, and per slot time the
    source positions the batch finished with output."""

    shard: int
    epoch: int
    finished: Mapping[int, Sequence[int]]

    def encode(self) -> bytes:
        body = [PROGRESS_VERSION, self.shard, self.epoch,
                [[slot, list(positions)] for slot, positions in sorted(self.finished.items())]]
        return cast(bytes, msgpack.packb(body, use_bin_type=True))

    def record(self, topic: str, now_ms: int) -> OutRecord:
        """This progress record for partition ``shard`` of the progress ``topic``, stamped
        ``now_ms`` (the release time: the read-back finds it by that timestamp)."""
        return OutRecord(topic, None, self.encode(), (), partition=self.shard, timestamp_ms=now_ms)

    @classmethod
    def decode(cls, data: bytes) -> Progress:
        """The record ``data`` holds; ValueError naming what is wrong with it."""
        try:
            body: Any = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=False)
        except Exception as exc:  # noqa: BLE001 - msgpack raises several kinds for bad bytes
            raise ValueError(f"progress record: not msgpack ({exc})") from exc
        if not isinstance(body, list) or not body or body[0] != PROGRESS_VERSION:
            version = body[0] if isinstance(body, list) and body else body
            raise ValueError(f"progress record: version {version!r}, expected [{PROGRESS_VERSION}, ...]")
        if len(body) != 4 or not all(_is_int(x) for x in body[1:3]) or not isinstance(body[3], list):
            raise ValueError("progress record: expected [version, shard, epoch, [[slot, [position, ...]], ...]]")
        finished: dict[int, tuple[int, ...]] = {}
        for pair in body[3]:
            if (not isinstance(pair, list) or len(pair) != 2 or not _is_int(pair[0]) or not isinstance(pair[1], list)
                    or not all(_is_int(p) and p >= 0 for p in pair[1])):
                raise ValueError(f"progress record: a slot entry is not [slot, [position, ...]]: {pair!r:.80}")
            finished[pair[0]] = finished.get(pair[0], ()) + tuple(pair[1])
        return cls(body[1], body[2], finished)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class Finished:
    """A shard owner's finished set: the source positions, per slot time at or after ``R``, that
    committed progress records name (read back at take-over, then its own commits added)."""

    def __init__(self, shard: int, since: int = 0) -> None:
        self.shard = shard
        #: The set holds every committed position of the slots at or after this time (its
        #: read-back's ``R``, or where ``forget_before`` cut it): a record of an older slot cannot
        #: be told from it, and calls for a read-back from there (``stages.exactly_once``).
        self.since = since
        self._by_slot: dict[int, set[int]] = {}

    def add(self, progress: Progress, read_ms: int = 0) -> None:
        """What ``progress`` names for slots at or after ``read_ms`` (a record of another shard is
        refused: the progress partition is the shard's own)."""
        if progress.shard != self.shard:
            raise ValueError(f"progress of shard {progress.shard} in shard {self.shard}'s partition")
        for slot, positions in progress.finished.items():
            if slot >= read_ms:
                self._by_slot.setdefault(slot, set()).update(positions)

    def holds(self, slot: int, partition: int, offset: int) -> bool:
        """A committed transaction already finished this record with output."""
        return self.holds_position(slot, source_position(partition, offset))

    def holds_position(self, slot: int, position: int) -> bool:
        """``holds`` for a source position."""
        positions = self._by_slot.get(slot)
        return positions is not None and position in positions

    def forget_before(self, read_ms: int) -> int:
        """Drop the slots before ``R`` (never read again); returns how many positions went."""
        self.since = max(self.since, read_ms)
        old = [slot for slot in self._by_slot if slot < read_ms]
        return sum(len(self._by_slot.pop(slot)) for slot in old)

    def __len__(self) -> int:
        return sum(map(len, self._by_slot.values()))

    @classmethod
    def read_back(cls, shard: int, values: Iterable[bytes | None], read_ms: int) -> Finished:
        """The finished set from the values of the shard's progress records, read from
        ``R - READ_BACK_MARGIN_MS`` to the partition's end (``read_committed``). A record that
        cannot be decoded is an error: skipping it could deliver its records twice."""
        finished = cls(shard, read_ms)
        for value in values:
            if value is None:
                raise ValueError(f"progress record of shard {shard} without a value")
            finished.add(Progress.decode(value), read_ms)
        return finished
