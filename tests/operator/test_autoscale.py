"""The autoscale decision: up before a spike that enters the lead time, down only after the
delay and below a lower band (hysteresis), always within [min, max]."""

from __future__ import annotations

from timerwheel_operator.autoscale import AutoscalePolicy, Load, decide

POLICY = AutoscalePolicy(min_replicas=1, max_replicas=6, lead_ms=60_000, per_replica_per_s=1_000, scale_down_delay_ms=120_000)
NOW = 1_700_000_000_000


def test_a_spike_ahead_scales_up_at_once_before_it_is_due() -> None:
    d = decide(POLICY, 1, Load(peak_per_s=3_000, queue_depth=0), NOW, last_change_ms=NOW - 1_000)
    assert (d.replicas, d.reason) == (4, "ScaleUp")  # 3,000/s at 80 % of 1,000/s per replica
    assert "peak 3000/s" in d.message


def test_a_backlog_in_the_queue_scales_up_too() -> None:
    d = decide(POLICY, 1, Load(peak_per_s=0, queue_depth=20_000), NOW, None)
    assert (d.replicas, d.reason) == (3, "ScaleUp")  # 2,000/s to drain it in 10 s


def test_scale_down_waits_for_the_delay_after_the_last_change() -> None:
    quiet = Load(peak_per_s=100, queue_depth=0)
    held = decide(POLICY, 4, quiet, NOW, last_change_ms=NOW - 60_000)
    assert (held.replicas, held.reason) == (4, "HoldDown")
    assert "60 s more before 1" in held.message
    after = decide(POLICY, 4, quiet, NOW, last_change_ms=NOW - 120_000)
    assert (after.replicas, after.reason) == (1, "ScaleDown") and after.changed


def test_a_load_between_the_bands_keeps_the_count() -> None:
    # 2,500/s: up wants ceil(2.5 / 0.8) = 4, down ceil(2.5 / 0.5) = 5: with 4 or 5 replicas, no change.
    load = Load(peak_per_s=2_500, queue_depth=0)
    for current in (4, 5):
        d = decide(POLICY, current, load, NOW, None)
        assert (d.replicas, d.reason) == (current, "Steady"), current
    assert decide(POLICY, 3, load, NOW, None).replicas == 4
    assert decide(POLICY, 6, load, NOW, None).replicas == 5


def test_the_count_stays_within_min_and_max() -> None:
    assert decide(POLICY, 2, Load(1e9, 10**9), NOW, None).replicas == 6
    bounded = AutoscalePolicy(min_replicas=2, max_replicas=3)
    assert decide(bounded, 1, Load(0, 0), NOW, NOW).replicas == 2  # below min: raised at once
    d = decide(bounded, 5, Load(0, 0), NOW, NOW)
    assert (d.replicas, d.reason) == (3, "ScaleDown")  # above max: lowered at once, no delay


def test_the_horizon_read_is_the_narrowest_covering_the_lead_time() -> None:
    assert AutoscalePolicy(lead_ms=30_000).horizon_s() == 60
    assert AutoscalePolicy(lead_ms=60_000).horizon_s() == 60
    assert AutoscalePolicy(lead_ms=90_000).horizon_s() == 300
    assert AutoscalePolicy(lead_ms=3_600_000).horizon_s() == 300
