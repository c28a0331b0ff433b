"""Operator-managed autoscaling of the dequeue stages (dequeue-getmsg, dequeue-put): a pure
decision from the load ahead and the work-queue depths to a replica count.

The load ahead is known before it arrives: the wheel holds every message due in the coming
minutes. dequeue-get exports per shard ``due_peak_per_s`` (the busiest 10-second stretch of the
next 60 s or 300 s, in messages per second); summed over the shards it is the rate the dequeue
stages must sustain once that stretch comes due. So the operator scales up *before* a spike:
as soon as it enters the lead time (``lookAheadMs``), not when the queues are already full.
The queue depth adds the backlog in hand: what waits in the stage's input queue, to be drained
within ``DRAIN_TARGET_S``.

    need   = max(peak rate ahead, depth / DRAIN_TARGET_S) / messagesPerSecondPerReplica
    up     = ceil(need / UP_UTILISATION)      taken at once when above the current count
    down   = ceil(need / DOWN_UTILISATION)    taken only when below the current count and the
                                               last change is at least scaleDownDelayMs old

The band between the two utilisations and the delay are the hysteresis: a load that hovers at
one boundary does not flap the replica count, and a spike's replicas stay until it has passed
(its messages leave the look-ahead window only once due). Both results are clamped to
[minReplicas, maxReplicas]. The function keeps no state: the last change's time and count live
in the TimerWheel's status, so a restarted operator decides the same (levels, not edges).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: The stages the operator may autoscale, with their spec key under ``spec.autoscale``.
AUTOSCALED = {"dequeue-getmsg": "dequeueGetmsg", "dequeue-put": "dequeuePut"}
#: The horizons over which dequeue-get exports ``due_peak_per_s`` (``ahead_s`` label).
HORIZONS_S = (60, 300)
DRAIN_TARGET_S = 10.0
UP_UTILISATION = 0.8
DOWN_UTILISATION = 0.5


@dataclass(frozen=True, slots=True)
class AutoscalePolicy:
    """``spec.autoscale`` for one stage."""

    min_replicas: int = 1
    max_replicas: int = 4
    lead_ms: int = 60_000
    per_replica_per_s: float = 2_000.0
    scale_down_delay_ms: int = 120_000

    def horizon_s(self) -> int:
        """The narrowest exported horizon covering the lead time (the widest if none does)."""
        return next((h for h in HORIZONS_S if h * 1000 >= self.lead_ms), HORIZONS_S[-1])


@dataclass(frozen=True, slots=True)
class Load:
    """What the stages report: the peak due rate within the lead time (messages/s, all shards)
    and the entries waiting in the stage's input work queue (all partitions)."""

    peak_per_s: float
    queue_depth: int


@dataclass(frozen=True, slots=True)
class Decision:
    replicas: int
    reason: str  # ScaleUp, ScaleDown, Steady, HoldDown (a lower count waits for the delay)
    message: str

    @property
    def changed(self) -> bool:
        return self.reason in ("ScaleUp", "ScaleDown")


def _clamp(n: int, policy: AutoscalePolicy) -> int:
    return max(policy.min_replicas, min(policy.max_replicas, n))


def decide(policy: AutoscalePolicy, current: int, load: Load, now_ms: int, last_change_ms: int | None) -> Decision:
    """The replica count for one stage now. ``current``: the count the operator set last (or
    the workload's); ``last_change_ms``: when it changed (None: never, no delay applies)."""
    rate = max(load.peak_per_s, load.queue_depth / DRAIN_TARGET_S)
    need = rate / policy.per_replica_per_s
    up = _clamp(math.ceil(need / UP_UTILISATION - 1e-9), policy)
    down = _clamp(math.ceil(need / DOWN_UTILISATION - 1e-9), policy)
    figures = f"peak {load.peak_per_s:.0f}/s ahead, queue depth {load.queue_depth}, " \
              f"{policy.per_replica_per_s:.0f}/s per replica"
    if current < policy.min_replicas or current > policy.max_replicas:
        target = _clamp(current, policy)
        return Decision(target, "ScaleUp" if target > current else "ScaleDown",
                        f"{current} -> {target}: outside [{policy.min_replicas}, {policy.max_replicas}]")
    if up > current:
        return Decision(up, "ScaleUp", f"{current} -> {up}: {figures}")
    if down < current:
        waited = None if last_change_ms is None else now_ms - last_change_ms
        if waited is None or waited >= policy.scale_down_delay_ms:
            return Decision(down, "ScaleDown", f"{current} -> {down}: {figures}")
        return Decision(current, "HoldDown", f"{current} kept for {(policy.scale_down_delay_ms - waited) // 1000} s "
                                             f"more before {down}: {figures}")
    return Decision(current, "Steady", f"{current}: {figures}")
