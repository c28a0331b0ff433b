"""``/metrics``: the registry (``timerwheel.metrics.Metrics``) in Prometheus' text format.

A custom prometheus_client ``Collector`` reads the registry at scrape time, so the stages keep
their one lock-cheap registry and prometheus_client does what is easy to get wrong by hand:
label values escaped (``\\``, ``"``, new lines), numbers printed exactly (a float's shortest
round-trip form: W = ``1.700000000123e+12`` is that very millisecond), ``# HELP`` and
``# TYPE`` lines. Names and types are those of the registry: counter ``x`` is the family
``timerwheel_x`` of type counter with the sample ``timerwheel_x_total``; gauge ``x`` is
``timerwheel_x``; histogram ``x`` has ``timerwheel_x_bucket{le=...}``, ``_sum`` and ``_count``.
Label values are bounded where they are recorded (``metrics.LabelBound``), not here.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from timerwheel.metrics import COUNTERS, GAUGES, HISTOGRAMS, Metrics

PREFIX = "timerwheel_"


class RegistryCollector(Collector):
    """Every family of one ``Metrics`` registry, read at each scrape."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        counters, gauges, histograms = m.families()
        for name in counters:
            family = Metric(PREFIX + name, COUNTERS.get(name, name), "counter")
            for labels, value in sorted(m.snapshot("counters", name).items()):
                family.add_sample(f"{PREFIX}{name}_total", dict(labels), value)
            yield family
        for name in gauges:
            family = Metric(PREFIX + name, GAUGES.get(name, name), "gauge")
            for labels, value in sorted(m.snapshot("gauges", name).items()):
                family.add_sample(PREFIX + name, dict(labels), value)
            yield family
        for name in histograms:
            family = Metric(PREFIX + name, HISTOGRAMS.get(name, name), "histogram")
            for labels, (bounds, counts, total, count) in sorted(m.histogram_snapshot(name).items()):
                running = 0
                for bound, n in zip(bounds, counts, strict=False):
                    running += n
                    family.add_sample(f"{PREFIX}{name}_bucket", {**dict(labels), "le": repr(float(bound))}, running)
                family.add_sample(f"{PREFIX}{name}_bucket", {**dict(labels), "le": "+Inf"}, running + counts[-1])
                family.add_sample(f"{PREFIX}{name}_sum", dict(labels), total)
                family.add_sample(f"{PREFIX}{name}_count", dict(labels), count)
            yield family


def registry_of(metrics: Metrics) -> CollectorRegistry:
    """A prometheus_client registry holding only ``metrics`` (no process or platform collectors:
    their names are not ours, and the operator parses what we serve)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RegistryCollector(metrics))
    return registry


def render(metrics: Metrics) -> str:
    """``metrics`` in Prometheus' text exposition format (what ``/metrics`` serves)."""
    return generate_latest(registry_of(metrics)).decode()
