"""Offsets that hold no record for the reader are gaps enqueue-get skips on purpose, never loss.

A transactional producer leaves a marker after each transaction (and its aborted records, which
a ``read_committed`` consumer never returns); compaction removes records. The consumer's
position moves past them. enqueue-get's entries run from where the last one ended to that
position, so enqueue-put's continuity check sees no gap, its checkpoint reaches the position,
and enqueue-get never rewinds. (Before: an entry ended at "last offset + 1", the next started
past the marker, enqueue-put skipped it as "after a gap" and enqueue-get rewound for ever.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from timerwheel import SimulatedClock, TimerConfig
from timerwheel.records import OutRecord, Record
from timerwheel.stages import enqueue_get
from timerwheel.stages.base import StageContext
from timerwheel.stages.enqueue_get import EnqueueGet
from timerwheel.stages.enqueue_put import EnqueuePut
from timerwheel.stages.ownership import Ownership
from timerwheel.store import Shard
from timerwheel.store.layout import open_shard
from timerwheel.transports.memory import MemoryLeaseStore, MemoryWorkQueue

START = 1_700_000_000_000
TOPIC = "__timer"


def timer_record(offset: int) -> Record:
    return Record(TOPIC, 0, offset, START, f"k{offset}".encode(), b"v",
                  (("tw-topic", b"dest"), ("tw-deliver-at", str(START + 60_000).encode()), ("tw-id", f"m{offset}".encode())))


class ScriptedConsumer:
    """Each poll returns the next scripted (records, position after them), as a read_committed
    Kafka consumer does: the position may lie past the last record (markers, aborted records)."""

    def __init__(self, script: list[tuple[list[int], int]]) -> None:
        self.script = list(script)
        self.at = 0

    def poll(self, max_records: int, timeout_s: float) -> list[Record]:
        if not self.script:
            return []
        offsets, self.at = self.script.pop(0)
        return [timer_record(o) for o in offsets]

    def seek(self, partition: int, offset: int) -> None:
        raise AssertionError(f"enqueue-get rewound partition {partition} to {offset}: it took a gap for loss")

    def position(self, partition: int) -> int:
        return self.at

    def close(self) -> None:
        pass


class ScriptedLog:
    def __init__(self, consumer: ScriptedConsumer) -> None:
        self._consumer = consumer
        self.dead: list[OutRecord] = []

    def consumer(self, topic: str, offsets: Mapping[int, int]) -> ScriptedConsumer:
        return self._consumer

    def start_offsets(self, topic: str) -> dict[int, int]:
        return {0: 0}

    def end_offsets(self, topic: str) -> dict[int, int]:
        return {0: self._consumer.at}

    def partition_count(self, topic: str) -> int | None:
        return 1

    def append(self, records: Sequence[OutRecord]) -> list[tuple[int, int]]:
        self.dead += records
        return [(0, i) for i in range(len(records))]


def written_offsets(shard: Shard) -> list[int]:
    out: list[int] = []
    for _first, arr in shard.log.iter_chunks(shard.log.start_pos, shard.flush()):
        out += arr["src_offset"].tolist()
    return out


def test_markers_aborted_and_compacted_offsets_are_skipped_not_lost(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(enqueue_get, "REWIND_CHECK_S", 0.0)  # check for loss on every step
    clock = SimulatedClock(START)
    config = TimerConfig(data_dir=str(tmp_path), shards=1, timer_partitions=1, fsync=False)
    ctx = StageContext(config, clock)
    queue = MemoryWorkQueue("put", 1, 64)
    put = EnqueuePut(ctx, [0], lambda s: open_shard(config, s, writer=True), queue,
                     Ownership(MemoryLeaseStore(clock), "enqueue-put", "me", 10_000))
    script = [
        ([0, 1, 2], 4),      # a committed transaction: 0-2, its marker at 3
        ([], 8),             # an aborted one (4-6) and its marker (7): nothing returned, the position moves
        ([8, 9], 11),        # 8, 9 and a trailing marker at 10
        ([12, 15, 20], 21),  # compaction removed 11, 13, 14, 16-19
        ([], 21),
    ]
    consumer = ScriptedConsumer(script)
    get = EnqueueGet(ctx, ScriptedLog(consumer), queue, [0], put.shard_offsets)
    try:
        for _ in range(len(script) + 1):
            get.step(0)
            put.step(0)
        st = put.owned[0]
        assert written_offsets(st.shard) == [0, 1, 2, 8, 9, 12, 15, 20]
        assert st.next_offsets == {0: 21}, "the checkpoint reaches the consumer's position"
        assert ctx.metrics.counter("put_gaps") == 0
        assert ctx.metrics.counter("rewinds") == 0
        assert queue.depth(0) == 0
    finally:
        put.close()
