"""Lateness measured three ways, and the due times the load generators give their messages.

A message's lateness is the time it reached its destination minus the time it was due, and
"reached" has three readings, from the service's word to what a user sees:

* ``delivered_at``: the service's own stamp (timerwheel's ``tw-delivered-at``, written in
  dequeue-put before the produce; a peer has none);
* ``timestamp``: the destination record's timestamp (Kafka's CreateTime, set by the service's
  producer; the local log's record timestamp in embedded mode);
* ``received``: the wall time at which a consumer polling the destination continuously got the
  record back: where a user sees it.

Each way gives p50 / p99 / max over the messages it saw and the count delivered early (< 0).
A message delivered twice counts once, by its first copy (the earliest receipt).

Due times come in two shapes: ``whole_second`` (every message due on a whole second, so each
second's messages fall due as one burst: what a peer that schedules in seconds can be given) and
``uniform`` (spread over the millisecond).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from bench.common import percentile

#: The three readings, in the order they are reported.
WAYS = ("delivered_at", "timestamp", "received")
#: The due-time shapes the load generators give their messages.
DUE_MODES = ("whole_second", "uniform")
#: Delays of the steady runs (issue 30's figures): 2-10 s.
DELAYS_MS = (2_000, 10_000)
#: Ids of messages sent to see a system deliver before it is measured: never counted.
WARM_UP_PREFIX = "warm-"


@dataclass(frozen=True, slots=True)
class Arrival:
    """One record seen at a destination: when by each reading (None: that reading is absent)."""

    message_id: str
    delivered_at_ms: int | None
    timestamp_ms: int | None
    received_ms: int


@dataclass(frozen=True, slots=True)
class Stats:
    """Lateness of one reading over ``n`` messages, in ms."""

    n: int
    p50: float
    p99: float
    max: float
    early: int

    def as_dict(self) -> dict[str, Any]:
        return {"n": self.n, "p50": self.p50, "p99": self.p99, "max": self.max, "early": self.early}


def stats(values: Iterable[int] | Iterable[float]) -> Stats:
    ordered = sorted(values)
    return Stats(len(ordered), percentile(ordered, 0.5), percentile(ordered, 0.99),
                 float(ordered[-1]) if ordered else float("nan"), sum(1 for v in ordered if v < 0))


def first_arrivals(arrivals: Iterable[Arrival]) -> dict[str, Arrival]:
    """The first copy of each message by receive time (a duplicate does not count twice)."""
    first: dict[str, Arrival] = {}
    for a in arrivals:
        seen = first.get(a.message_id)
        if seen is None or a.received_ms < seen.received_ms:
            first[a.message_id] = a
    return first


def three_way(due_ms: Mapping[str, int], arrivals: Iterable[Arrival]) -> dict[str, Stats]:
    """Lateness by each of ``WAYS`` of the messages in ``due_ms`` that arrived (others are ignored:
    ``counts`` tells lost and duplicated). A reading absent from every arrival gives n = 0."""
    first = first_arrivals(a for a in arrivals if a.message_id in due_ms)
    late: dict[str, list[int]] = {way: [] for way in WAYS}
    for mid, a in first.items():
        due = due_ms[mid]
        if a.delivered_at_ms is not None:
            late["delivered_at"].append(a.delivered_at_ms - due)
        if a.timestamp_ms is not None:
            late["timestamp"].append(a.timestamp_ms - due)
        late["received"].append(a.received_ms - due)
    return {way: stats(values) for way, values in late.items()}


def counts(expected: Iterable[str], arrivals: Iterable[Arrival]) -> dict[str, int]:
    """Of the ``expected`` ids: how many arrived, how many never did (lost), how many extra copies
    arrived (duplicated), and arrivals of ids not expected (unexpected). Warm-up messages
    (``WARM_UP_PREFIX``) are not counted at all."""
    wanted = set(expected)
    copies: dict[str, int] = {}
    for a in arrivals:
        if a.message_id.startswith(WARM_UP_PREFIX):
            continue
        copies[a.message_id] = copies.get(a.message_id, 0) + 1
    return {"expected": len(wanted), "delivered": sum(1 for m in wanted if m in copies),
            "lost": sum(1 for m in wanted if m not in copies),
            "duplicated": sum(n - 1 for m, n in copies.items() if m in wanted),
            "unexpected": sum(n for m, n in copies.items() if m not in wanted)}


def longest_gap_ms(arrivals: Iterable[Arrival]) -> int:
    """The longest stretch between two consecutive receipts (first copies): how long a system
    delivered nothing while messages fell due every second (a kill's outage)."""
    times = sorted({a.received_ms for a in first_arrivals(a for a in arrivals
                                                          if not a.message_id.startswith(WARM_UP_PREFIX)).values()})
    return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0)


def due_time(now_ms: int, delay_ms: int, mode: str) -> int:
    """When a message sent at ``now_ms`` with ``delay_ms`` is due: ``uniform`` at now + delay,
    ``whole_second`` at the first whole second at or after it."""
    at = now_ms + delay_ms
    if mode == "uniform":
        return at
    if mode == "whole_second":
        return math.ceil(at / 1000) * 1000
    raise ValueError(f"due mode must be one of {', '.join(DUE_MODES)}, got {mode!r}")


def rounded(result: Mapping[str, Stats]) -> dict[str, dict[str, Any]]:
    """``three_way``'s result as plain numbers, for the JSON figure line."""
    return {way: {k: (round(v, 1) if isinstance(v, float) and not math.isnan(v) else (None if isinstance(v, float)
                                                                                     else v))
                  for k, v in s.as_dict().items()}
            for way, s in result.items()}


def describe(result: Mapping[str, Stats]) -> str:
    """One line: p50 / p99 / max and early of each reading that has values."""
    parts = [f"{way} p50 {s.p50:.0f} / p99 {s.p99:.0f} / max {s.max:.0f} ms, {s.early} early of {s.n}"
             for way, s in result.items() if s.n]
    return "; ".join(parts) or "nothing arrived"
