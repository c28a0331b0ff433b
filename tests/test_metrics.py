"""The lateness histogram buckets a large batch with numpy exactly as one value at a time."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from timerwheel.metrics import _NUMPY_FROM, LATENESS_BUCKETS_MS, Histogram, Metrics

#: Bucket bounds themselves and their neighbours: bisect_left puts a value equal to a bound in that bound's bucket.
EDGES = sorted({b + d for b in LATENESS_BUCKETS_MS for d in (-1, 0, 1)})


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(EDGES), st.integers(-1_000, 200_000)), min_size=_NUMPY_FROM, max_size=400))
def test_a_large_batch_fills_the_same_buckets_as_one_value_at_a_time(values: list[int]) -> None:
    batch, single = Histogram(LATENESS_BUCKETS_MS), Histogram(LATENESS_BUCKETS_MS)
    batch.observe_many(values)
    for v in values:
        single.observe_many([v])  # below _NUMPY_FROM: the loop
    assert batch.counts == single.counts
    assert (batch.count, batch.total, batch.maximum) == (single.count, single.total, single.maximum)


def test_batches_add_up() -> None:
    m = Metrics()
    m.observe_many("lateness", [5] * 100)
    m.observe_many("lateness", [6, 70_000])
    hist = m.histograms["lateness"][()]
    assert hist.count == 102 and hist.maximum == 70_000 and hist.total == 500 + 6 + 70_000
    assert hist.counts[0] == 100 and hist.counts[1] == 1 and hist.counts[-1] == 1


def test_prometheus_values_are_exact() -> None:
    m = Metrics()
    m.set("write_ms", 1_700_000_000_123, shard=0)
    m.set("ratio", 0.125)
    text = m.render_prometheus()
    assert 'timerwheel_write_ms{shard="0"} 1700000000123\n' in text
    assert "timerwheel_ratio 0.125\n" in text
