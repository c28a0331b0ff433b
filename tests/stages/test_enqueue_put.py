"""enqueue-put writes each source offset once: rows the shard already holds are skipped, a
partly new entry keeps only its new rows, and an entry after a gap waits for the rewind."""

from __future__ import annotations

from pathlib import Path

from timerwheel import SimulatedClock, TimerConfig
from timerwheel.stages.base import StageContext
from timerwheel.stages.codec import PutEntry, PutRequest
from timerwheel.stages.enqueue_put import EnqueuePut
from timerwheel.stages.ownership import Ownership
from timerwheel.store import Shard
from timerwheel.store.layout import open_shard
from timerwheel.transports.memory import MemoryLeaseStore, MemoryWorkQueue

START = 1_700_000_000_000


def _written(shard: Shard) -> list[tuple[int, int]]:
    """(source partition, source offset) of every TimerLog record, in log order."""
    out: list[tuple[int, int]] = []
    for _first, arr in shard.log.iter_chunks(shard.log.start_pos, shard.flush()):
        out += zip(arr["src_partition"].tolist(), arr["src_offset"].tolist(), strict=True)
    return out


def _entry(partition: int, offsets: range) -> PutEntry:
    return PutEntry.of(partition, offsets.start, offsets.stop, [
        PutRequest(o, 100, START, START + 5_000 + o, False, 7, 1_000 + o) for o in offsets])


def test_rows_already_written_are_skipped_and_a_gap_is_not_filled(tmp_path: Path) -> None:
    clock = SimulatedClock(START)
    config = TimerConfig(data_dir=str(tmp_path), shards=1, fsync=False)
    ctx = StageContext(config, clock)
    queue = MemoryWorkQueue("put", 1, 64)
    put = EnqueuePut(ctx, [0], lambda s: open_shard(config, s, writer=True), queue,
                     Ownership(MemoryLeaseStore(clock), "enqueue-put", "me", 10_000))
    try:
        queue.put(0, [_entry(0, range(0, 5)), _entry(0, range(3, 8)),  # overlaps: 3 and 4 again
                      _entry(0, range(10, 12)),  # after a gap (8, 9 lost in transit)
                      _entry(1, range(0, 2))], 1.0)
        put.step(0)
        st = put.owned[0]
        assert _written(st.shard) == [(0, o) for o in range(8)] + [(1, 0), (1, 1)]
        assert st.next_offsets == {0: 8, 1: 2}
        assert ctx.metrics.counter("put_gaps") == 1
        assert queue.depth(0) == 0  # all acked: the gap's entry comes again after the rewind
        queue.put(0, [_entry(0, range(8, 12))], 1.0)
        put.step(0)
        written = _written(st.shard)
        assert written[-4:] == [(0, o) for o in range(8, 12)] and len(written) == 14
    finally:
        put.close()
