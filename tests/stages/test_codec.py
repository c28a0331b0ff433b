"""Work-queue entries round-trip, with their trace context."""

from __future__ import annotations

import msgpack
from timerwheel.stages.codec import FetchEntry, FetchItem, PutEntry, PutRequest

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_a_put_entry_round_trips_with_its_trace_context() -> None:
    requests = (PutRequest(10, 120, 1_000, 2_000, False, 7, 9, TP, "vendor=v1"),
                PutRequest(11, 80, 1_001, 2_001, True, 0, 9), PutRequest(12, 80, 1_001, 2_001, False, 0, 9, TP))
    entry = PutEntry.of(3, 10, 13, requests)
    assert entry.rows == [(10, 120, 1_000, 2_000, False, 7, 9), (11, 80, 1_001, 2_001, True, 0, 9),
                          (12, 80, 1_001, 2_001, False, 0, 9)]
    assert entry.traces == ((0, TP, "vendor=v1"), (2, TP, None))
    decoded = PutEntry.decode(entry.encode())
    assert decoded == entry
    assert decoded.requests == requests


def test_a_fetch_entry_carries_dequeue_gets_context_and_without_it_keeps_five_elements() -> None:
    items = (FetchItem(0, 1, 2, 30, 5_000, 4_000), FetchItem(64, 1, 2, 31, 5_000, 4_000, ((2, 40), (3, 41))))
    traced = FetchEntry(1, 7, 5_000, 6_400, items, TP)
    assert FetchEntry.decode(traced.encode()) == traced
    untraced = FetchEntry(1, 7, 5_000, 6_400, items)
    assert untraced.encode() == msgpack.packb([1, 7, 5_000, 6_400, [list(i) for i in items]])  # the 5-element form
    assert FetchEntry.decode(untraced.encode()) == untraced
    assert FetchEntry.decode(untraced.encode()).traceparent is None
