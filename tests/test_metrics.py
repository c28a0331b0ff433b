"""The registry: the lateness histogram buckets a large batch with numpy exactly as one value at
a time; /metrics prints numbers exactly and escapes labels; untrusted labels are bounded; every
figure the code records is declared (so the exporters enumerate it)."""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from timerwheel.config import TimerConfig
from timerwheel.exposition import render
from timerwheel.metrics import (
    _NUMPY_FROM,
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    LATENESS_BUCKETS_MS,
    OTHER,
    Histogram,
    Metrics,
    registry_for,
)
from timerwheel_operator.stage_metrics import parse_prometheus

ROOT = Path(__file__).resolve().parent.parent

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


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_prometheus_values_are_exact() -> None:
    m = Metrics()
    m.set("write_ms", 1_700_000_000_123, shard=0)
    m.set("read_ms", 2**53 - 1, shard=0)
    m.set("ratio", 0.125)
    got = samples(render(m))
    assert got[("timerwheel_write_ms", (("shard", "0"),))] == 1_700_000_000_123
    assert got[("timerwheel_read_ms", (("shard", "0"),))] == 2**53 - 1
    assert got[("timerwheel_ratio", ())] == 0.125


def test_label_values_are_escaped() -> None:
    m = Metrics()
    nasty = 'a"b\\c\nd} e="f'
    m.inc("stage_errors", 2, stage=nasty)
    text = render(m)
    assert samples(text)[("timerwheel_stage_errors_total", (("stage", nasty),))] == 2
    (sample,) = parse_prometheus(text)  # the operator's parser reads it too
    assert sample.label("stage") == nasty and sample.value == 2


def test_the_exposition_keeps_names_and_types() -> None:
    m = Metrics()
    m.inc("scheduled", 5, topic="orders")
    m.set("write_lag_ms", 7, shard=1)
    m.observe_many("delivery_lateness_ms", [3.0, 40.0])
    families = {f.name: f.type for f in text_string_to_metric_families(render(m))}
    assert families == {"timerwheel_scheduled": "counter", "timerwheel_write_lag_ms": "gauge",
                        "timerwheel_delivery_lateness_ms": "histogram"}
    got = samples(render(m))
    assert got[("timerwheel_scheduled_total", (("topic", "orders"),))] == 5
    assert got[("timerwheel_delivery_lateness_ms_bucket", (("le", "5.0"),))] == 1
    assert got[("timerwheel_delivery_lateness_ms_bucket", (("le", "+Inf"),))] == 2
    assert got[("timerwheel_delivery_lateness_ms_sum", ())] == 43


def test_a_topic_label_is_kept_only_for_a_legal_allowed_destination() -> None:
    m = registry_for(TimerConfig(allow_topics=("orders.*", "payments")), )
    m.inc_many("dead_lettered", "topic", {"orders-eu": 1, "__consumer_offsets": 2, "bad topic!": 3, "x" * 300: 4,
                                          "__timer": 5, "payments": 6, "": 7, OTHER: 8})
    m.inc("scheduled", 1, topic="secret-audit")
    assert m.snapshot("counters", "dead_lettered") == {(("topic", "orders-eu"),): 1, (("topic", "payments"),): 6,
                                                       (("topic", OTHER),): 2 + 3 + 4 + 5 + 7 + 8}
    assert m.snapshot("counters", "scheduled") == {(("topic", OTHER),): 1}


def test_past_the_cap_every_new_topic_is_other() -> None:
    m = registry_for(TimerConfig(metrics_topic_labels_max=3))
    for i in range(10):
        m.inc_many("delivered", "topic", {f"t{i}": 1})
    m.inc_many("delivered", "topic", {"t1": 5})  # a kept topic stays itself
    assert m.snapshot("counters", "delivered") == {(("topic", "t0"),): 1, (("topic", "t1"),): 6,
                                                   (("topic", "t2"),): 1, (("topic", OTHER),): 7}


def test_a_registry_without_configuration_still_bounds_topics() -> None:
    m = Metrics()
    m.inc("held", 1, topic="no\nway")
    for i in range(150):
        m.inc("held", 1, topic=f"t{i}")
    series = m.snapshot("counters", "held")
    assert len(series) == 101 and series[(("topic", OTHER),)] == 51


def test_every_figure_the_code_records_is_declared() -> None:
    """The exporters enumerate the declared families: an undeclared counter would reach /metrics
    but not OTLP."""
    calls = re.compile(r"\.(inc|inc_many|set|observe_many)\(\s*\"([a-z_]+)\"")
    found: dict[str, set[str]] = {}
    for path in (ROOT / "libs" / "timerwheel").rglob("*.py"):
        for kind, name in calls.findall(path.read_text()):
            found.setdefault(kind, set()).add(name)
    counters = found["inc"] | found["inc_many"]
    assert len(counters) > 15, f"the pattern found only {sorted(counters)}"
    assert counters - set(COUNTERS) == set(), "counters recorded but not in metrics.COUNTERS"
    assert found["set"] - set(GAUGES) == set(), "gauges recorded but not in metrics.GAUGES"
    assert found["observe_many"] - set(HISTOGRAMS) == set(), "histograms recorded but not in metrics.HISTOGRAMS"
