"""dequeue-get reads a slot column-wise: the fetch items and the markers it finds must be exactly
those the rule gives record by record (``expected_items`` below, the oracle), cancels and id-hash
collisions and copies of one message (same id hash and delivery time) included, whether the slot
is small (read once) or large (streamed in pieces)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from timerwheel.stages import dequeue_get
from timerwheel.stages.codec import FetchItem
from timerwheel.stages.dequeue_get import open_slot
from timerwheel.store import Flag, Shard, TimerRecord
from timerwheel.store import shard as shard_module
from timerwheel.store.shard import SlotPiece

SLOT = 10_000


def expected_items(shard: Shard, slot_time: int) -> tuple[list[FetchItem], dict[int, list[tuple[int, int]]], set[int]]:
    """The slot's fetch items, markers and matched markers, one record at a time from the whole
    TimerLog: every cancel marker (DELETE, not ROLL) is collected, newest first per id hash; every
    other record is an item, a message (not a roll hop) carrying all the markers of its id hash."""
    records = [(pos, r) for pos, r in reversed(list(shard.log.iter_range(0, shard.log.end_pos)))
               if r.deliver_ms - r.deliver_ms % shard.tick_ms == slot_time]
    markers: dict[int, list[tuple[int, int]]] = {}
    for _pos, r in records:
        if r.flags & (Flag.DELETE | Flag.ROLL) == Flag.DELETE:
            markers.setdefault(r.id_hash, []).append((r.src_partition, r.src_offset))
    items, matched = [], set()
    first: dict[tuple[int, int], tuple[int, int]] = {}
    for pos, r in records:
        if r.flags & (Flag.DELETE | Flag.ROLL) == Flag.DELETE:
            continue
        ref = markers.get(r.id_hash) if not r.flags & Flag.ROLL else None
        if ref is not None:
            matched.add(r.id_hash)
        same_as = None
        if not r.flags & Flag.ROLL:  # a copy: the same id hash and delivery time as an earlier message
            src = first.setdefault((r.id_hash, r.deliver_ms), (r.src_partition, r.src_offset))
            same_as = src if src != (r.src_partition, r.src_offset) else None
        items.append(FetchItem(pos, r.flags, r.src_partition, r.src_offset, r.deliver_ms, r.enqueue_ms,
                               tuple(ref or ()), same_as))
    return items, markers, matched


@pytest.mark.parametrize("small_slot", [10**9, 100], ids=["read-once", "streamed"])
@pytest.mark.parametrize("dense_slot_min", [1, 10**9], ids=["by-a-scan", "by-links"])
def test_column_wise_items_equal_record_wise_items(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   small_slot: int, dense_slot_min: int) -> None:
    monkeypatch.setattr(dequeue_get, "SMALL_SLOT", small_slot)
    monkeypatch.setattr(dequeue_get, "ITEMS_AT_ONCE", 97)
    monkeypatch.setattr(shard_module, "SLOT_PIECE_RECORDS", 256)
    rng = random.Random(7)
    shard = Shard.open(tmp_path / "s", tick_ms=100, slots=256, segment_bytes=64 * 1024, fsync=False, writer=True)
    shard.dense_slot_min = dense_slot_min
    try:
        records = []
        for i in range(3_000):
            kind = rng.random()
            flags = Flag.DELETE if kind < 0.05 else Flag.ROLL if kind < 0.1 else Flag.ROLL | Flag.DELETE if kind < 0.12 \
                else Flag.NORMAL
            # Few distinct id hashes: markers match messages, rolled records and each other.
            records.append(TimerRecord(int(flags), 1_000 + i, SLOT + rng.choice((0, 0, 0, 100)), rng.randrange(3), i,
                                       100 + i, 7, rng.randrange(400)))
        shard.append(records)
        reader = open_slot(shard, SLOT, shard.flush())
        items = list(reader.items)
        sizes = list(reader.sizes)

        expected, markers, matched = expected_items(shard, SLOT)
        assert items == expected
        assert sizes == [100 + item.src_offset for item in expected]
        assert reader.markers == markers and markers
        assert reader.matched == matched and matched
        assert any(len(item.cancels) > 1 for item in items)  # colliding markers all carried
        assert any(item.flags & Flag.ROLL for item in items)
        assert any(item.same_as for item in items)  # copies referenced
        assert all(type(item) is FetchItem for item in itertools.islice(items, 50))
    finally:
        shard.close()


def test_a_large_slot_is_streamed_in_pieces_not_held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot past SMALL_SLOT is read a piece at a time as its items are taken: what is read ahead
    of the items taken stays within a piece, whatever the slot's size."""
    monkeypatch.setattr(dequeue_get, "SMALL_SLOT", 100)
    monkeypatch.setattr(shard_module, "SLOT_PIECE_RECORDS", 500)
    shard = Shard.open(tmp_path / "s", tick_ms=100, slots=256, segment_bytes=64 * 4096, fsync=False, writer=True)
    pieces: list[int] = []  # the records of each piece read, in turn
    read_slot = shard.read_slot

    def counting(slot_time: int, limit_pos: int | None = None, since_pos: int = 0, *,
                 damage_raises: bool = False) -> Iterator[SlotPiece]:
        for piece in read_slot(slot_time, limit_pos, since_pos, damage_raises=damage_raises):
            pieces.append(len(piece[0]))
            yield piece

    monkeypatch.setattr(shard, "read_slot", counting)
    try:
        shard.append([TimerRecord(int(Flag.NORMAL), 1, SLOT, 0, i, 10, 7, i) for i in range(10_000)])
        reader = open_slot(shard, SLOT, shard.flush())
        assert sum(pieces) == 10_000 and max(pieces) <= 500  # the markers' pass: once, a piece at a time
        del pieces[:]
        first = list(itertools.islice(reader.items, 600))
        assert [item.src_offset for item in first] == list(range(9_999, 9_399, -1))
        assert sum(pieces) < 600 + 500  # read so far: the items taken and at most a piece ahead
        assert sum(1 for _ in reader.items) == 9_400
        assert sum(pieces) == 10_000 and max(pieces) <= 500
    finally:
        shard.close()
