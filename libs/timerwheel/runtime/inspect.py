"""What a process can tell about its shards: ``timerwheel inspect`` and the sampled gauges.

Each figure is read from a shard's own view (its checkpoints and wheel), in the shard's own ticks
(``Shard.tick_ms``, from its meta.json: FORMAT.md, "Which copy of the tick is the authority").
The wheel count from R over the wheel's span is shown as ``pending`` by ``inspect`` and by the
``pending`` gauge: every record there, cancel markers and roll hops included, not the pending
messages that ``timerwheel pending`` lists (``timerwheel.pending``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from timerwheel.config import TimerConfig
from timerwheel.metrics import Metrics
from timerwheel.store import Shard
from timerwheel.transports.base import WorkQueue

#: ``due_peak_per_s``: the busiest stretch of this length ahead, over each of these horizons
#: (the operator's autoscaling reads them, ``timerwheel_operator.autoscale``).
LOAD_BUCKET_MS = 10_000
LOAD_HORIZONS_S = (60, 300)


def wheel_count(shard: Shard, read_ms: int) -> int:
    """Records in the slots from ``read_ms`` (R) over the shard's wheel span."""
    return shard.count_range(read_ms, read_ms + shard.slots * shard.tick_ms)


def inspect_shards(config: TimerConfig, shards: Mapping[int, Shard], now_ms: int,
                   queue_depths: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """Per shard: W, R, their lag behind now, the wheel count from R, TimerLog size, load ahead."""
    out: dict[str, Any] = {"now_ms": now_ms, "tick_ms": config.tick_ms, "shards": []}
    for shard_id, shard in sorted(shards.items()):
        out["tick_ms"] = shard.tick_ms  # the shard's own, as written
        enq = shard.load_enqueue_checkpoint()
        deq = shard.load_dequeue_checkpoint()
        if enq is not None:
            shard.refresh(enq)  # a reader on another node: what the volume holds, not its cache
        w = enq.write_ms if enq else None
        r = deq.read_ms if deq else None
        info: dict[str, Any] = {
            "shard": shard_id,
            "W": w,
            "R": r,
            "W_lag_ms": None if w is None else now_ms - w,
            "R_lag_ms": None if r is None else now_ms - r,
            "pending": wheel_count(shard, r) if r is not None else 0,
            "timerlog_bytes": (enq.flushed_pos - shard.log.start_pos) if enq else 0,
            "flushed_pos": enq.flushed_pos if enq else 0,
            "load_ahead": {
                label: shard.count_range(now_ms, now_ms + ms)
                for label, ms in (("1s", 1000), ("1m", 60_000), ("1h", 3_600_000))
            },
        }
        out["shards"].append(info)
    if queue_depths is not None:
        out["queues"] = queue_depths
    return out


def due_peak_per_s(shard: Shard, now_ms: int, horizon_s: int) -> float:
    """Messages per second of the busiest LOAD_BUCKET_MS in [now, now + horizon): the rate the
    dequeue stages must sustain when it comes due (rolled hops and cancel markers included)."""
    counts = [shard.count_range(t, t + LOAD_BUCKET_MS) for t in range(now_ms, now_ms + horizon_s * 1000, LOAD_BUCKET_MS)]
    return max(counts, default=0) * 1000 / LOAD_BUCKET_MS


def sample_gauges(metrics: Metrics, queues: Mapping[str, WorkQueue], shards: Mapping[int, Shard], *,
                  count_wheel: bool = True, now_ms: int | None = None) -> None:
    """``queue_depth`` per queue and partition; with ``now_ms``, ``due_peak_per_s`` per shard and
    horizon (``ahead_s``); with ``count_wheel``, the gauge ``pending`` per shard (``wheel_count``
    from its R: a scan of the wheel, so sampled less often)."""
    for name, q in queues.items():
        for p in range(q.partitions):
            metrics.set("queue_depth", q.depth(p), queue=name, partition=p)
    if now_ms is not None:
        for shard_id, shard in shards.items():
            for horizon in LOAD_HORIZONS_S:
                metrics.set("due_peak_per_s", due_peak_per_s(shard, now_ms, horizon), shard=shard_id, ahead_s=horizon)
    if not count_wheel:
        return
    for shard_id, shard in shards.items():
        deq = shard.load_dequeue_checkpoint()
        if deq is not None:
            metrics.set("pending", wheel_count(shard, deq.read_ms), shard=shard_id)
