"""``due_peak_per_s``: the busiest 10 s due within each horizon, read from the wheel, so the
operator sees a spike before it comes due."""

from __future__ import annotations

from pathlib import Path

from timerwheel import SimulatedClock, TimerConfig
from timerwheel.metrics import Metrics
from timerwheel.runtime.inspect import due_peak_per_s, sample_gauges
from timerwheel.stages.base import StageContext
from timerwheel.stages.codec import PutEntry, PutRequest
from timerwheel.stages.enqueue_put import EnqueuePut
from timerwheel.stages.ownership import Ownership
from timerwheel.store.layout import open_shard
from timerwheel.transports.memory import MemoryLeaseStore, MemoryWorkQueue

NOW = 1_700_000_000_000


def test_the_busiest_ten_seconds_ahead_per_horizon(tmp_path: Path) -> None:
    clock = SimulatedClock(NOW)
    config = TimerConfig(data_dir=str(tmp_path), shards=1, fsync=False)
    queue = MemoryWorkQueue("put", 1, 64)
    put = EnqueuePut(StageContext(config, clock), [0], lambda s: open_shard(config, s, writer=True), queue,
                     Ownership(MemoryLeaseStore(clock), "enqueue-put", "me", 10_000))
    try:
        due = [NOW + 25_000] * 50 + [NOW + 41_000] * 5 + [NOW + 200_000] * 120 + [NOW + 400_000] * 999
        queue.put(0, [PutEntry.of(0, 0, len(due), [PutRequest(o, 100, NOW, t, False, 7, o)
                                                    for o, t in enumerate(due)])], 1.0)
        put.step(0)
        shard = put.owned[0].shard
        assert due_peak_per_s(shard, NOW, 60) == 5.0  # 50 in one stretch of 10 s
        assert due_peak_per_s(shard, NOW, 300) == 12.0  # the 120 at +200 s; the 999 lie beyond
        metrics = Metrics()
        sample_gauges(metrics, {}, {0: shard}, count_wheel=False, now_ms=NOW)
        assert metrics.gauge("due_peak_per_s", shard=0, ahead_s=60) == 5.0
        assert metrics.gauge("due_peak_per_s", shard=0, ahead_s=300) == 12.0
        assert metrics.gauge("pending", shard=0) is None, "the wheel is counted only when asked"
        sample_gauges(metrics, {}, {0: shard})
        assert metrics.gauge("pending", shard=0) == len(due), "every record from R over the wheel's span"
        clock.set(NOW + 300_000)
        assert due_peak_per_s(shard, NOW + 300_000, 60) == 0.0
    finally:
        put.close()
