"""Counters, gauges and the lateness histogram that every stage updates.

A plain, thread-safe registry with no dependency but numpy, so the pure core stays pure. Exporters
(Prometheus text on ``/metrics``, OTLP) read it; ``timerwheel inspect`` shows the same figures.
Stages add per batch (``inc_many``), never allocate per message on the hot path.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Mapping

import numpy as np

LabelKey = tuple[tuple[str, str], ...]

#: Delivery lateness buckets in milliseconds.
LATENESS_BUCKETS_MS = (5, 10, 25, 50, 100, 150, 200, 300, 500, 1000, 2500, 5000, 10000, 60000)
#: Batches of at least this many values are bucketed with numpy.
_NUMPY_FROM = 64


def _key(labels: Mapping[str, object]) -> LabelKey:
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


def _number(value: float) -> str:
    """A sample value exactly: ``:g`` would keep 6 digits (W = 1.7e+12 ms, off by minutes)."""
    if float(value).is_integer() and abs(value) < 2**63:
        return str(int(value))
    return repr(float(value))


class Histogram:
    __slots__ = ("bounds", "counts", "total", "count", "maximum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.count = 0
        self.maximum = 0.0

    def observe_many(self, values: Iterable[float]) -> None:
        if isinstance(values, list) and len(values) >= _NUMPY_FROM:
            self._observe_array(np.asarray(values, dtype=np.float64))
            return
        for v in values:
            self.counts[bisect.bisect_left(self.bounds, v)] += 1
            self.total += v
            self.count += 1
            if v > self.maximum:
                self.maximum = v

    def _observe_array(self, values: np.ndarray) -> None:
        """``observe_many`` of a large batch (a delivery batch's lateness) in a few numpy calls:
        the same buckets as ``bisect_left``."""
        buckets = np.bincount(np.searchsorted(self.bounds, values, side="left"), minlength=len(self.counts))
        for i, n in enumerate(buckets.tolist()):
            self.counts[i] += n
        self.total += float(values.sum())
        self.count += len(values)
        self.maximum = max(self.maximum, float(values.max()))


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters: dict[str, dict[LabelKey, float]] = {}
        self.gauges: dict[str, dict[LabelKey, float]] = {}
        self.histograms: dict[str, dict[LabelKey, Histogram]] = {}

    def inc(self, name: str, amount: float = 1, **labels: object) -> None:
        key = _key(labels)
        with self._lock:
            series = self.counters.setdefault(name, {})
            series[key] = series.get(key, 0) + amount

    def inc_many(self, name: str, label: str, amounts: Mapping[str, int]) -> None:
        """Add ``amounts[value]`` to the series ``{label: value}`` for each value (one lock)."""
        with self._lock:
            series = self.counters.setdefault(name, {})
            for value, n in amounts.items():
                key = ((label, value),)
                series[key] = series.get(key, 0) + n

    def set(self, name: str, value: float, **labels: object) -> None:
        key = _key(labels)
        with self._lock:
            self.gauges.setdefault(name, {})[key] = value

    def observe_many(self, name: str, values: Iterable[float], **labels: object) -> None:
        key = _key(labels)
        with self._lock:
            series = self.histograms.setdefault(name, {})
            hist = series.get(key)
            if hist is None:
                hist = series[key] = Histogram(LATENESS_BUCKETS_MS)
            hist.observe_many(values)

    def counter(self, name: str, **labels: object) -> float:
        """Value of one counter series (0 if absent); with no labels, the sum of all series."""
        with self._lock:
            series = self.counters.get(name, {})
            if labels:
                return series.get(_key(labels), 0)
            return sum(series.values())

    def gauge(self, name: str, **labels: object) -> float | None:
        with self._lock:
            return self.gauges.get(name, {}).get(_key(labels))

    def snapshot(self, kind: str, name: str) -> dict[LabelKey, float]:
        """A copy of one counter (``kind="counters"``) or gauge (``"gauges"``) family."""
        with self._lock:
            family = self.counters if kind == "counters" else self.gauges
            return dict(family.get(name, {}))

    def render_prometheus(self) -> str:
        """The registry in Prometheus' text exposition format."""
        lines: list[str] = []

        def fmt(labels: LabelKey, extra: tuple[tuple[str, str], ...] = ()) -> str:
            allp = labels + extra
            if not allp:
                return ""
            return "{" + ",".join(f'{k}="{v}"' for k, v in allp) + "}"

        with self._lock:
            for name, series in sorted(self.counters.items()):
                lines.append(f"# TYPE timerwheel_{name}_total counter")
                for labels, value in sorted(series.items()):
                    lines.append(f"timerwheel_{name}_total{fmt(labels)} {_number(value)}")
            for name, series in sorted(self.gauges.items()):
                lines.append(f"# TYPE timerwheel_{name} gauge")
                for labels, value in sorted(series.items()):
                    lines.append(f"timerwheel_{name}{fmt(labels)} {_number(value)}")
            for name, hseries in sorted(self.histograms.items()):
                lines.append(f"# TYPE timerwheel_{name} histogram")
                for labels, hist in sorted(hseries.items()):
                    running = 0
                    for bound, n in zip(hist.bounds, hist.counts, strict=False):
                        running += n
                        lines.append(f"timerwheel_{name}_bucket{fmt(labels, (('le', f'{bound:g}'),))} {running}")
                    running += hist.counts[-1]
                    lines.append(f"timerwheel_{name}_bucket{fmt(labels, (('le', '+Inf'),))} {running}")
                    lines.append(f"timerwheel_{name}_sum{fmt(labels)} {_number(hist.total)}")
                    lines.append(f"timerwheel_{name}_count{fmt(labels)} {hist.count}")
        return "\n".join(lines) + "\n"
