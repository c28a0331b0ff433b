"""Operator-managed autoscaling on the real local cluster (scripts/k8s.sh): a scheduled spike.

    helm install (2 shards) -> Ready -> spec.autoscale on (1..3 replicas, 60 s look-ahead,
    25 msg/s a replica, scale down 40 s after the last change)
    -> 1,500 messages due in one 10 s stretch 90 s from now (150 msg/s at its peak)
    -> the operator scales dequeue-getmsg and dequeue-put up *before* the stretch is due (the
       wheel's slot counts show it coming, ``due_peak_per_s``), and back down to 1 after it has
       passed, never while it is still ahead; each decision is an ``Autoscaled`` Event
    -> lost 0, early 0, duplicates within day two's bound

With this release's 10 s roll window the spike first comes through as 1,500 roll hops 10 s after
it was sent, work for the same two stages, and the slot counts show it so: the first scale-up
is for the hops (about 80 s before the spike is due), and the spike enters the 60 s look-ahead
20 s later. The scale-down delay (40 s) outlasts that gap, so the replicas stay up throughout.

Figures (``FIGURE`` lines, never asserted): how long before the spike the decision came, when the
new replicas were ready, when the stages were back at one.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from harness import Collector, TimerProducer, make_report, now_ms
from test_k8s_day2 import DUPLICATE_FRACTION, _patch, _wait, installed  # noqa: F401 - the fixture
from test_k8s_helm import WHEEL, Release, release  # noqa: F401 - the fixture

pytestmark = [pytest.mark.k8s, pytest.mark.e2e]

SPIKE = 1_500
SPIKE_LEAD_MS = 90_000
SPIKE_SPREAD_MS = 10_000
LOOK_AHEAD_MS = 60_000
PER_REPLICA = 25
MAX_REPLICAS = 3
SCALE_DOWN_DELAY_MS = 40_000
AUTOSCALED = ("dequeue-getmsg", "dequeue-put")


def _replicas(rel: Release, stage: str) -> tuple[int, int]:
    """(desired, ready) replicas of the stage's Deployment."""
    items: list[dict[str, Any]] = rel.get("deploy", "-l", f"app.kubernetes.io/component={stage}")["items"]
    assert len(items) == 1, [d["metadata"]["name"] for d in items]
    return int(items[0]["spec"].get("replicas", 1)), int(items[0].get("status", {}).get("readyReplicas", 0))


def test_a_scheduled_spike_is_scaled_for_before_it_is_due_and_scaled_down_after(installed: Release) -> None:  # noqa: F811
    rel = installed
    _patch(rel, {"autoscale": {"enabled": True, "minReplicas": 1, "maxReplicas": MAX_REPLICAS,
                               "lookAheadMs": LOOK_AHEAD_MS, "messagesPerSecondPerReplica": PER_REPLICA,
                               "scaleDownDelayMs": SCALE_DOWN_DELAY_MS}})
    _wait("the autoscaled stages at one replica with nothing ahead",
          lambda: all(_replicas(rel, s) == (1, 1) for s in AUTOSCALED), rel)
    dest = rel.pipe.new_dest("k8s-spike", 4)
    with TimerProducer(rel.pipe, seed=41) as producer, Collector(rel.pipe, [dest]) as collector:
        start = now_ms() + SPIKE_LEAD_MS
        for i in range(SPIKE):
            producer.schedule(dest, start + i * SPIKE_SPREAD_MS // SPIKE)
        producer.flush()
        end = start + SPIKE_SPREAD_MS
        up_at: dict[str, int] = {}
        ready_at: dict[str, int] = {}
        while now_ms() < end:
            for s in AUTOSCALED:
                desired, ready = _replicas(rel, s)
                if desired > 1 and s not in up_at:
                    up_at[s] = now_ms()
                if ready == MAX_REPLICAS and s not in ready_at:
                    ready_at[s] = now_ms()
                assert desired >= (2 if s in up_at else 1), f"{s} scaled down to {desired} before the spike passed"
            time.sleep(1)
        assert set(up_at) == set(AUTOSCALED), f"not scaled up before the spike was due: {up_at}\n{rel.diagnosis()}"
        for s in AUTOSCALED:
            print(f"FIGURE autoscale {s}: scaled up {(start - up_at[s]) / 1000:.1f} s before the spike was due "
                  f"(look-ahead {LOOK_AHEAD_MS / 1000:.0f} s); {MAX_REPLICAS} replicas ready "
                  f"{(start - ready_at[s]) / 1000 if s in ready_at else float('nan'):.1f} s before", flush=True)
        assert all(at < start for at in up_at.values()), up_at
        missing = collector.wait_for(producer.expected(), 120, rel.pipe)
        down = _wait("the autoscaled stages back at one replica after the spike",
                     lambda: all(_replicas(rel, s)[0] == 1 for s in AUTOSCALED), rel, 300)
        print(f"FIGURE autoscale: back at one replica {(now_ms() - end) / 1000:.1f} s after the spike's last "
              f"message was due ({down:.1f} s of waiting; scale-down delay {SCALE_DOWN_DELAY_MS / 1000:.0f} s)",
              flush=True)
        time.sleep(2)
        rep = make_report("k8s autoscale spike", producer, collector)
    print(f"FIGURE autoscale spike: {rep.line()}", flush=True)
    assert not missing and rep.lost == [] and rep.early == [] and rep.unexpected == [], rep.line()
    assert rep.scheduled == SPIKE, rep.line()
    assert rep.duplicated <= DUPLICATE_FRACTION * rep.scheduled, rep.line()
    events = [e["message"] for e in rel.get("events", "--field-selector",
                                             f"involvedObject.name={WHEEL},reason=Autoscaled")["items"]]
    for s in AUTOSCALED:
        assert any(m.startswith(f"{s}: 1 -> ") for m in events), events
        assert any(m.startswith(f"{s}: ") and " -> 1 " in m for m in events), events
