"""The overview: per shard W, R, their lag, owners and epochs, input wait; the message rates; the
lateness histogram; what is due in the next minutes and hours.

Per shard, each figure comes from the stage that owns it, as the operator reads them
(``timerwheel_operator.metrics``): enqueue-put's ``write_ms`` (W), ``input_wait_ms`` and
``timerlog_bytes``, dequeue-get's ``read_ms`` (R) and ``in_flight``; when a shard was handed over
and two processes still show figures, the one with the highest ``owner_epoch`` is the owner.
Without metrics (a stage down, or none configured) W, R and the epochs are read from the shard's
checkpoints on the volume instead, and the row says so.

Rates are not in the metrics: they are the increase of the counters (``scheduled``,
``delivered``, ``cancelled``, ``dead_lettered``, summed over topics and processes) between
scrapes, per second. A process that restarted starts its counters again; its new count is taken
as the increase, never a negative one. The ``Sampler`` scrapes every ``interval_s`` from a thread
of its own and keeps the last ``keep`` rates for the chart, so a page never waits on a scrape.

What is due ahead is counted from the wheel (``Shard.count_range``: the slots' record counts,
read column-wise), per minute for the next hour and per hour for the next day, rolled hops and
cancel markers included, as the stages' ``due_peak_per_s`` (the operator's autoscaling input),
which is shown beside it.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from timerwheel.console.source import PREFIX, Installation, Sample, Scrape
from timerwheel.log import stage_logger
from timerwheel.runtime.runner import WHEEL_COUNT_EVERY_S, Every
from timerwheel.store import Shard

#: The counters whose rates the overview shows.
COUNTED = ("scheduled", "delivered", "cancelled", "dead_lettered")
#: Rates are taken over this window (or the samples there are, if fewer).
RATE_WINDOW_S = 30.0
#: Minutes and hours counted ahead.
MINUTES_AHEAD = 60
HOURS_AHEAD = 24
#: ... and counted again this often (168 wheel counts for two shards).
DUE_EVERY_S = 10.0

_WRITER = {"write_ms", "write_lag_ms", "input_wait_ms", "timerlog_bytes"}
_READER = {"read_ms", "read_lag_ms", "in_flight"}


@dataclass(slots=True)
class ShardRow:
    shard: int
    w_ms: int | None = None
    r_ms: int | None = None
    w_lag_ms: int | None = None
    r_lag_ms: int | None = None
    #: The enqueue-put process owning the shard (its endpoint) and its epoch.
    owner: str | None = None
    epoch: int | None = None
    #: The dequeue-get process reading the shard and its epoch.
    reader: str | None = None
    read_epoch: int | None = None
    input_wait_ms: int | None = None
    in_flight: int | None = None
    pending: int | None = None
    timerlog_bytes: int | None = None
    due_peak_60: float | None = None
    due_peak_300: float | None = None
    open_errors: list[str] = field(default_factory=list)
    #: "metrics", or "volume" when W and R come from the checkpoints.
    source: str = "metrics"


@dataclass(slots=True)
class Snapshot:
    at_ms: int
    shards: list[ShardRow]
    #: per second over the last RATE_WINDOW_S; None before two samples
    rates: dict[str, float | None]
    #: (epoch seconds, rates) of successive samples, oldest first: the chart
    rate_history: list[tuple[float, dict[str, float]]]
    #: (upper bound in ms, or inf; deliveries in that bucket), from the lateness histogram
    lateness: list[tuple[float, int]]
    lateness_p50_ms: float | None
    lateness_p99_ms: float | None
    early_records: float
    #: messages due in each minute from ``due_from_ms`` (MINUTES_AHEAD), and each hour (HOURS_AHEAD)
    due_from_ms: int
    due_minutes: list[int]
    due_hours: list[int]
    #: (target, address, error or None) of each endpoint scraped
    endpoints: list[tuple[str, str, str | None]]

    @property
    def due_next_hour(self) -> int:
        return sum(self.due_minutes)

    @property
    def due_next_day(self) -> int:
        return sum(self.due_hours)


def _int(value: float | None) -> int | None:
    if value is None or math.isnan(value) or math.isinf(value):
        return None
    return int(value)


def shard_rows(scrapes: Iterable[Scrape]) -> dict[int, ShardRow]:
    """Per shard, the owners' figures: for each (shard, stage) the endpoint with the highest epoch."""
    best: dict[tuple[int, str], tuple[int, str, dict[str, float]]] = {}
    pending: dict[int, float] = {}
    peaks: dict[tuple[int, str], float] = {}
    errors: dict[int, list[str]] = {}
    for scrape in scrapes:
        by_shard: dict[int, dict[str, float]] = {}
        epochs: dict[tuple[int, str], int] = {}
        for s in scrape.samples:
            raw = s.label("shard")
            if raw is None or not raw.isdigit() or not s.name.startswith(PREFIX):
                continue
            shard, name = int(raw), s.name[len(PREFIX):]
            if name == "owner_epoch":
                epochs[(shard, s.label("stage") or "")] = int(s.value)
            elif name == "pending":
                pending[shard] = max(pending.get(shard, 0.0), s.value)
            elif name == "due_peak_per_s":
                key = (shard, s.label("ahead_s") or "")
                peaks[key] = max(peaks.get(key, 0.0), s.value)
            elif name == "shard_open_failed" and s.value >= 1:
                errors.setdefault(shard, []).append(f"{s.label('stage')} at {scrape.address}: {s.label('error')}")
            elif name in _WRITER or name in _READER:
                by_shard.setdefault(shard, {})[name] = s.value
        for (shard, stage), epoch in epochs.items():
            if epoch > best.get((shard, stage), (-1, "", {}))[0]:
                wanted = _WRITER if stage == "enqueue-put" else _READER
                best[(shard, stage)] = (epoch, scrape.address,
                                        {k: v for k, v in by_shard.get(shard, {}).items() if k in wanted})
    rows: dict[int, ShardRow] = {}
    for shard in sorted({s for s, _ in best} | set(pending) | set(errors) | {s for s, _ in peaks}):
        row = rows[shard] = ShardRow(shard)
        if (shard, "enqueue-put") in best:
            row.epoch, row.owner, w = best[(shard, "enqueue-put")]
            row.w_ms, row.w_lag_ms = _int(w.get("write_ms")), _int(w.get("write_lag_ms"))
            row.input_wait_ms, row.timerlog_bytes = _int(w.get("input_wait_ms")), _int(w.get("timerlog_bytes"))
        if (shard, "dequeue-get") in best:
            row.read_epoch, row.reader, r = best[(shard, "dequeue-get")]
            row.r_ms, row.r_lag_ms, row.in_flight = _int(r.get("read_ms")), _int(r.get("read_lag_ms")), \
                _int(r.get("in_flight"))
        row.pending = _int(pending.get(shard))
        row.due_peak_60, row.due_peak_300 = peaks.get((shard, "60")), peaks.get((shard, "300"))
        row.open_errors = errors.get(shard, [])
    return rows


def fill_from_volume(rows: dict[int, ShardRow], shards: Mapping[int, Shard], now_ms: int, span_pending: bool) -> None:
    """W, R and the epochs the metrics did not give, from each shard's checkpoints; with
    ``span_pending`` the pending count too, from the wheel (R to R + the wheel's span)."""
    for shard_id, shard in shards.items():
        row = rows.setdefault(shard_id, ShardRow(shard_id))
        enq, deq = shard.load_enqueue_checkpoint(), shard.load_dequeue_checkpoint()
        if enq is not None and row.w_ms is None:
            row.w_ms, row.epoch, row.source = enq.write_ms, row.epoch or enq.epoch, "volume"
            row.w_lag_ms = now_ms - enq.write_ms
            row.timerlog_bytes = enq.flushed_pos - shard.log.start_pos
        if deq is not None and row.r_ms is None:
            row.r_ms, row.read_epoch, row.source = deq.read_ms, row.read_epoch or deq.epoch, "volume"
            row.r_lag_ms = now_ms - deq.read_ms
        if span_pending and row.pending is None and deq is not None:
            row.pending = shard.count_range(deq.read_ms, deq.read_ms + shard.slots * shard.tick_ms)


def due_ahead(shards: Mapping[int, Shard], now_ms: int) -> tuple[list[int], list[int]]:
    """Messages due in each of the next MINUTES_AHEAD minutes and HOURS_AHEAD hours, all shards."""
    minutes = [0] * MINUTES_AHEAD
    hours = [0] * HOURS_AHEAD
    for shard in shards.values():
        base = shard.slot_time(now_ms)  # buckets start at slot boundaries: no slot counts twice
        for i in range(MINUTES_AHEAD):
            minutes[i] += shard.count_range(base + i * 60_000, base + (i + 1) * 60_000)
        for i in range(HOURS_AHEAD):
            hours[i] += shard.count_range(base + i * 3_600_000, base + (i + 1) * 3_600_000)
    return minutes, hours


def counter_sums(scrape: Scrape) -> dict[str, float]:
    """The counted families of one endpoint, summed over their labels."""
    out = dict.fromkeys(COUNTED, 0.0)
    names = {f"{PREFIX}{k}_total": k for k in COUNTED}
    for s in scrape.samples:
        kind = names.get(s.name)
        if kind is not None:
            out[kind] += s.value
    return out


def lateness(scrapes: Iterable[Scrape]) -> tuple[list[tuple[float, int]], float | None, float | None, float]:
    """The lateness histogram summed over the endpoints: (upper bound, count in the bucket), the
    p50 and p99 estimated as Prometheus' histogram_quantile does, and ``early_records``."""
    cumulative: dict[float, float] = {}
    early = 0.0
    for scrape in scrapes:
        for s in scrape.samples:
            if s.name == f"{PREFIX}delivery_lateness_ms_bucket":
                le = float(s.label("le") or "inf")
                cumulative[le] = cumulative.get(le, 0.0) + s.value
            elif s.name == f"{PREFIX}early_records_total":
                early += s.value
    bounds = sorted(cumulative)
    buckets, below = [], 0.0
    for b in bounds:
        buckets.append((b, int(cumulative[b] - below)))
        below = cumulative[b]
    return buckets, _quantile(0.5, bounds, cumulative), _quantile(0.99, bounds, cumulative), early


def _quantile(q: float, bounds: list[float], cumulative: Mapping[float, float]) -> float | None:
    if not bounds or cumulative[bounds[-1]] <= 0:
        return None
    rank = q * cumulative[bounds[-1]]
    lower, below = 0.0, 0.0
    for b in bounds:
        if cumulative[b] >= rank:
            if math.isinf(b):
                return lower  # as histogram_quantile: the highest finite bound
            inside = cumulative[b] - below
            return lower + (b - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = b, cumulative[b]
    return lower


class Counters:
    """The increase of each counted family seen so far, over all endpoints, across their restarts."""

    def __init__(self) -> None:
        self.last: dict[str, dict[str, float]] = {}
        self.total = dict.fromkeys(COUNTED, 0.0)

    def add(self, scrapes: Iterable[Scrape]) -> dict[str, float]:
        for scrape in scrapes:
            if scrape.error is not None:
                continue
            now = counter_sums(scrape)
            before = self.last.get(scrape.address)
            if before is not None:
                for kind in COUNTED:
                    grew = now[kind] - before[kind]
                    self.total[kind] += grew if grew >= 0 else now[kind]  # restarted: counting again from 0
            self.last[scrape.address] = now
        return dict(self.total)


class Sampler:
    """Builds a ``Snapshot`` every ``interval_s`` from a thread of its own and keeps the last
    ``keep`` samples' totals for the rates and their chart."""

    def __init__(self, inst: Installation, interval_s: float = 2.0, keep: int = 150) -> None:
        self.inst = inst
        self.interval_s = interval_s
        self.counters = Counters()
        self.history: deque[tuple[float, dict[str, float]]] = deque(maxlen=keep)
        self._latest: Snapshot | None = None
        #: the wheel's pending count is a scan of the whole wheel: done every WHEEL_COUNT_EVERY_S
        self._pending_every = Every(WHEEL_COUNT_EVERY_S)
        self._pending: dict[int, int] = {}
        #: what is due ahead moves by the minute: counted every DUE_EVERY_S, not every sample
        self._due_every = Every(DUE_EVERY_S)
        self._due: tuple[int, list[int], list[int]] = (0, [], [])
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._first = threading.Event()
        self._thread: threading.Thread | None = None
        self.log = stage_logger("console")

    def sample(self) -> Snapshot:
        """Scrape, read the shards, and make the snapshot (also kept as ``latest``)."""
        inst = self.inst
        scrapes = inst.scrape()
        now = inst.now_ms()
        rows = shard_rows(scrapes)
        with inst.shards("sampler") as shards:
            fill_from_volume(rows, shards, now, span_pending=self._pending_every.due())
            if self._due_every.due() or not self._due[1]:
                self._due = (now, *due_ahead(shards, now))
            due_from, minutes, hours = self._due
            for shard_id, row in rows.items():  # between wheel scans: the last count
                if row.pending is None and shard_id in self._pending:
                    row.pending = self._pending[shard_id]
                elif row.pending is not None:
                    self._pending[shard_id] = row.pending
        buckets, p50, p99, early = lateness(scrapes)
        with self._lock:
            self.history.append((now / 1000, self.counters.add(scrapes)))
            rates = self._rates()
            hist = self._rate_history()
            snap = Snapshot(now, [rows[s] for s in sorted(rows)], rates, hist, buckets, p50, p99, early, due_from,
                            minutes, hours, [(s.target, s.address, s.error) for s in scrapes])
            self._latest = snap
        self._first.set()
        return snap

    def _rates(self) -> dict[str, float | None]:
        if len(self.history) < 2:
            return dict.fromkeys(COUNTED)
        t1, last = self.history[-1]
        t0, first = next(((t, c) for t, c in self.history if t1 - t <= RATE_WINDOW_S), self.history[-2])
        if t1 - t0 <= 0:
            t0, first = self.history[-2]
        dt = max(t1 - t0, 1e-3)
        return {k: (last[k] - first[k]) / dt for k in COUNTED}

    def _rate_history(self) -> list[tuple[float, dict[str, float]]]:
        points = list(self.history)
        return [(t1, {k: (c1[k] - c0[k]) / max(t1 - t0, 1e-3) for k in COUNTED})
                for (t0, c0), (t1, c1) in zip(points, points[1:], strict=False)]

    def latest(self) -> Snapshot:
        """The last snapshot; before the first one, the thread's first (or, with no thread, one
        made now)."""
        if self._thread is not None:
            self._first.wait(self.interval_s + 30)
        with self._lock:
            snap = self._latest
        return snap if snap is not None else self.sample()

    def start(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, name="tw-console-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        failing = False
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.sample()
                failing = False
            except Exception as exc:  # noqa: BLE001 - the console keeps its last snapshot
                self._first.set()  # a page waiting for the first one makes its own, and says why it fails
                if not failing:
                    self.log.warning("sampling failed", exc=exc, error=repr(exc)[:200])
                failing = True
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)


def rate_text(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}/s"


def age_text(ms: int | None) -> str:
    """A lag as people read it: 850 ms, 12.3 s, 4 min 5 s, 2 h 1 min."""
    if ms is None:
        return "-"
    sign, ms = ("-" if ms < 0 else ""), abs(ms)
    if ms < 1000:
        return f"{sign}{ms} ms"
    if ms < 60_000:
        return f"{sign}{ms / 1000:.1f} s"
    if ms < 3_600_000:
        return f"{sign}{ms // 60_000} min {ms % 60_000 // 1000} s"
    return f"{sign}{ms // 3_600_000} h {ms % 3_600_000 // 60_000} min"


__all__ = ["COUNTED", "Counters", "Sampler", "Sample", "ShardRow", "Snapshot", "age_text", "rate_text"]
