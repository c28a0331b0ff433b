"""Counters, gauges and the lateness histogram that every stage updates.

A plain, thread-safe registry with no dependency but numpy, so the pure core stays pure; it knows
nothing of who reads it. Exporters read it: ``/metrics`` through prometheus_client
(``timerwheel.exposition``, which imports this module and is imported only by who serves it:
prometheus_client brings http and email modules that a producer's ``import timerwheel`` does not
need), OTLP (``timerwheel.telemetry.export_metrics``); ``timerwheel inspect`` shows the same figures.
Stages add per batch (``inc_many``), never allocate per message on the hot path.

Every family is declared below (``COUNTERS``, ``GAUGES``, ``HISTOGRAMS``, with its help text):
the exporters enumerate these, so a figure recorded under an undeclared name would reach
``/metrics`` but not OTLP (tests/test_telemetry.py refuses that).

Label values are bounded. A label taken from untrusted input (the ``topic`` of a timer record,
whatever a producer wrote) would let any producer grow the registry, and every scrape, without
end. ``LabelBound`` keeps at most ``cap`` distinct values that its ``accept`` approves (for
``topic``: legal, allowed destinations, ``TW_METRICS_TOPIC_LABELS_MAX``, 100 by default) and
records every other value as ``other``.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from timerwheel.config import TimerConfig

LabelKey = tuple[tuple[str, str], ...]

#: Delivery lateness buckets in milliseconds.
LATENESS_BUCKETS_MS = (5, 10, 25, 50, 100, 150, 200, 300, 500, 1000, 2500, 5000, 10000, 60000)
#: Batches of at least this many values are bucketed with numpy.
_NUMPY_FROM = 64

#: Every counter the stages record: name -> help text (``/metrics`` shows it as ``timerwheel_<name>_total``).
COUNTERS: dict[str, str] = {
    "scheduled": "timer messages scheduled, per destination topic",
    "delivered": "messages delivered to their destination, per topic",
    "cancelled": "messages cancelled before delivery, per topic",
    "rolled": "roll hops written back to the timer topic, per destination topic",
    "dead_lettered": "records sent to the dead-letter topic, per destination topic",
    "held": "due messages held because their destination topic does not exist, per topic",
    "refused_records": "records the commit log refused for good (too large, invalid topic), dead-lettered",
    "cancel_requests": "cancel records read from the timer topic",
    "cancel_missed": "cancel markers that named another message (an id-hash collision)",
    "reschedule_requests": "reschedule records read from the timer topic",
    "redirected": "messages a reschedule moved to a later time (put back on the timer topic as the next revision), per topic",
    "reschedules_void": "reschedules without effect: an earlier time, or another cancel or reschedule of the ticket came first",
    "copies_dropped": "copies of a message met in its slot (a roll hop done twice) finished without output, per topic",
    "stale_dropped": "held records of an older dequeue-get owner's entries finished without output (its successor reads them again), per topic",
    "copies_missed": "records taken for a copy of another in their slot that named another message (an id-hash collision)",
    "append_retries": "writes to the commit log retried",
    "dead_letter_retries": "enqueue-get's dead-letter transactions retried, per timer partition",
    "delivery_transaction_retries": "exactly-once: dequeue-put's delivery transactions retried (after a take), per shard",
    "delivery_takes": "exactly-once: takes of a shard's deliveries by dequeue-put (init_transactions, which fences "
                      "every other producer of the shard's id, and the progress read back), per shard",
    "duplicates_dropped": "exactly-once: records dequeue-put finished without output because a committed "
                          "transaction had released them already, per shard",
    "queue_full_waits": "waits of a work-queue producer on a full queue (back-pressure)",
    "stage_errors": "failed stage steps, retried, per stage",
    "timerlog_records": "TimerLog records written, per shard",
    "late_marker_copies": "Cancel markers copied into the slot of W with a message written after its delivery time (a close reschedule written back late: issue 31), per shard",
    "resends": "stalled slots re-sent by dequeue-get",
    "read_ahead_carried": "open slots a dequeue-get owner took over from the one that let the shard go",
    "rewinds": "timer partitions enqueue-get re-read after entries were lost in transit",
    "put_gaps": "gaps enqueue-put found in its put queue (entries lost in transit)",
    "fenced": "shard ownerships lost (lease lapsed or taken)",
    "source_records_lost": "timer records gone from Kafka before a checkpoint passed them",
    "stale_views": "reads of a shard whose published view was not yet visible on this node",
    "damaged_views": "reads of a slot that met a TimerLog record its published checkpoint calls flushed cut off or "
                     "invalid (records lost after publication): its records wait for the writer's recovery, per shard",
    "undecodable_batches": "timer-topic batches that could not be decoded, per partition",
    "dead_entries": "work-queue entries that could not be decoded, moved to the dead-entry stream",
    "early_records": "deliveries handed to dequeue-put further ahead of their time than the look-ahead "
                     "explains (TW_LOOKAHEAD_MS, a burst's longer one: its clock behind "
                     "the others'), held until due",
    "handovers": "shards handed over to the replica that ranks first for them, per shard and stage",
    "input_end_failures": "requests for the timer topic's end offsets that failed (W waits meanwhile)",
    "released_by_watch": "held records that passed dequeue-put's gate by its watch of the timer partitions, before W "
                         "passed their time (delivered, or dropped for a cancel met), per shard",
    "watch_failures": "observations or reads of dequeue-put's watch that failed (the W gate holds meanwhile), per shard",
}
#: Every gauge: name -> help text.
GAUGES: dict[str, str] = {
    "write_lag_ms": "now - W, per shard",
    "read_lag_ms": "now - R, per shard",
    "write_ms": "the write watermark W, per shard",
    "input_wait_ms": "how long W has been held back waiting for timer records not yet written, per shard",
    "read_ms": "the read time R, per shard",
    "in_flight": "messages sent by dequeue-get and not yet delivered, per shard",
    "timerlog_bytes": "TimerLog size, per shard",
    "owner_epoch": "epoch of this process's ownership of a shard, per shard and stage",
    "pending": "messages in the wheel from R to R + span, per shard (sampled every 15 s)",
    "queue_depth": "entries in a work queue partition",
    "undecodable_offset": "offset of the batch that could not be decoded, per timer partition",
    "undecodable_partitions": "timer partitions set aside for an undecodable batch",
    "owned_shards": "shards this replica owns, per stage (readiness does not say)",
    "shard_open_failed": "1 while the owner cannot open a shard, per shard, stage and error class",
    "due_peak_per_s": "messages per second of the busiest 10 s due within ahead_s, per shard",
}
#: Every histogram: name -> help text.
HISTOGRAMS: dict[str, str] = {
    "delivery_lateness_ms": "delivery time - due time of delivered messages, ms",
}

#: The label value that stands for every value a ``LabelBound`` does not keep.
OTHER = "other"


class LabelBound:
    """At most ``cap`` distinct values of one label, each approved by ``accept``; any other value
    is recorded as ``OTHER``. The first ``cap`` approved values seen keep their own label for the
    life of the process (a series never changes its name midway). Not thread-safe on its own:
    ``Metrics`` calls it under its lock."""

    __slots__ = ("accept", "cap", "kept")

    def __init__(self, accept: Callable[[str], bool], cap: int) -> None:
        self.accept = accept
        self.cap = cap
        self.kept: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self.kept:
            return value
        if len(self.kept) < self.cap and value != OTHER and self.accept(value):
            self.kept.add(value)
            return value
        return OTHER


def _legal_topic(value: str) -> bool:
    from timerwheel.wire import TOPIC_NAME  # wire imports config; this module stays importable alone

    return TOPIC_NAME.fullmatch(value) is not None and value not in (".", "..")


def default_bounds(cap: int = 100) -> dict[str, LabelBound]:
    """The bounds of a registry made without a configuration: ``topic`` keeps legal topic names."""
    return {"topic": LabelBound(_legal_topic, cap)}


def registry_for(config: TimerConfig) -> Metrics:
    """The registry of a process configured by ``config``: a ``topic`` label only for a legal
    destination that ``TW_ALLOW_TOPICS`` allows (not the timer or dead-letter topic), at most
    ``TW_METRICS_TOPIC_LABELS_MAX`` of them."""
    from timerwheel.wire import TimerRules

    rules = TimerRules(config)
    return Metrics({"topic": LabelBound(lambda t: not rules.destination_error(t) and rules.topic_allowed(t),
                                        config.metrics_topic_labels_max)})


def _key(labels: Mapping[str, object]) -> LabelKey:
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


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
    def __init__(self, bounds: Mapping[str, LabelBound] | None = None) -> None:
        """``bounds``: label name -> its bound (default: ``default_bounds()``, the ``topic`` label)."""
        self._lock = threading.Lock()
        self.bounds = dict(default_bounds() if bounds is None else bounds)
        self.counters: dict[str, dict[LabelKey, float]] = {}
        self.gauges: dict[str, dict[LabelKey, float]] = {}
        self.histograms: dict[str, dict[LabelKey, Histogram]] = {}

    def _bounded(self, labels: Mapping[str, object]) -> LabelKey:
        """The series key of ``labels``, bounded labels mapped (call under the lock)."""
        key = _key(labels)
        if not self.bounds or not any(k in self.bounds for k, _ in key):
            return key
        return tuple((k, self.bounds[k](v) if k in self.bounds else v) for k, v in key)

    def inc(self, name: str, amount: float = 1, **labels: object) -> None:
        with self._lock:
            key = self._bounded(labels)
            series = self.counters.setdefault(name, {})
            series[key] = series.get(key, 0) + amount

    def inc_many(self, name: str, label: str, amounts: Mapping[str, int]) -> None:
        """Add ``amounts[value]`` to the series ``{label: value}`` for each value (one lock)."""
        bound = self.bounds.get(label)
        with self._lock:
            series = self.counters.setdefault(name, {})
            for value, n in amounts.items():
                key = ((label, value if bound is None else bound(value)),)
                series[key] = series.get(key, 0) + n

    def set(self, name: str, value: float, **labels: object) -> None:
        with self._lock:
            key = self._bounded(labels)
            self.gauges.setdefault(name, {})[key] = value

    def observe_many(self, name: str, values: Iterable[float], **labels: object) -> None:
        with self._lock:
            key = self._bounded(labels)
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

    def histogram_snapshot(self, name: str) -> dict[LabelKey, tuple[tuple[float, ...], list[int], float, int]]:
        """A copy of one histogram family: labels -> (bounds, counts per bucket, sum, count)."""
        with self._lock:
            return {k: (h.bounds, list(h.counts), h.total, h.count) for k, h in self.histograms.get(name, {}).items()}

    def families(self) -> tuple[list[str], list[str], list[str]]:
        """Names of the counter, gauge and histogram families recorded so far."""
        with self._lock:
            return sorted(self.counters), sorted(self.gauges), sorted(self.histograms)
