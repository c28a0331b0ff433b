"""dequeue-get reads a dense slot column-wise: the fetch items and the markers it finds must be
exactly those of the record-at-a-time path, cancels and id-hash collisions included."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

from timerwheel.stages.dequeue_get import DequeueGet, SlotReader
from timerwheel.store import Flag, Shard, TimerRecord

SLOT = 10_000


def test_column_wise_items_equal_record_wise_items(tmp_path: Path) -> None:
    rng = random.Random(7)
    shard = Shard.open(tmp_path / "s", tick_ms=100, slots=256, segment_bytes=64 * 1024, fsync=False, writer=True)
    try:
        records = []
        for i in range(3_000):
            kind = rng.random()
            flags = Flag.DELETE if kind < 0.05 else Flag.ROLL if kind < 0.1 else Flag.ROLL | Flag.DELETE if kind < 0.12 \
                else Flag.NORMAL
            # Few distinct id hashes: markers match messages, rolled records and each other.
            records.append(TimerRecord(int(flags), 1_000 + i, SLOT + rng.choice((0, 0, 0, 100)), rng.randrange(3), i,
                                       100, 7, rng.randrange(400)))
        shard.append(records)
        shard.flush()
        dense = shard.read_dense_slot(SLOT)
        assert dense is not None
        by_columns = SlotReader(SLOT, {}, iter(()))
        items = DequeueGet._items_of(*dense, by_columns)

        by_records = SlotReader(SLOT, {}, iter(()))
        slot_records = list(shard.read_slot(SLOT))
        for _pos, rec in slot_records:  # as DequeueGet._open collects them
            if rec.flags & (Flag.DELETE | Flag.ROLL) == Flag.DELETE:
                by_records.markers.setdefault(rec.id_hash, (rec.src_partition, rec.src_offset))
        expected = list(DequeueGet._items(iter(slot_records), by_records))

        assert items == expected
        assert by_columns.markers == by_records.markers and by_columns.markers
        assert by_columns.matched == by_records.matched and by_columns.matched
        assert any(item.cancel_partition >= 0 for item in items)
        assert any(item.flags & Flag.ROLL for item in items)
        assert all(type(item) is type(expected[0]) for item in itertools.islice(items, 50))
    finally:
        shard.close()
