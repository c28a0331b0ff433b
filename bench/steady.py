"""A steady load through a running system, measured where a user sees it.

``steady`` sends ``rate`` msg/s for ``seconds`` in the system's wire contract (``bench.load``),
reads the destination with a consumer of its own process (``bench.receiver``), runs the
``events`` (a kill, a restart) at their times into the load, waits for the stragglers, and returns
the lateness three ways (``bench.lateness``) and the counts (lost, duplicated). The production
benchmarks and the peers comparison both measure with it, so their rows compare.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.lateness import DELAYS_MS, counts, describe, longest_gap_ms, rounded, three_way
from bench.load import Load, Wire
from bench.receiver import Receiver


def steady(kafka: str, wire: Wire, dest: str, rate: float, seconds: float, due_mode: str, *,
           delays_ms: tuple[int, int] = DELAYS_MS, options: dict[str, Any] | None = None,
           events: Sequence[tuple[float, Callable[[], None]]] = (), settle_s: float = 20.0,
           prefix: str = "m") -> dict[str, Any]:
    """The run's figures: ``lateness`` (three ways, rounded), the counts, ``behind`` (messages not
    delivered ``delays_ms[1] + settle_s`` after the last send), ``longest_gap_ms`` (the longest
    time without a receipt: an outage) and ``sent``."""
    with Receiver(kafka, [dest], options) as rx:
        load = Load(kafka, wire, rate, seconds, delays_ms, due_mode, prefix=prefix, options=options).start()
        t0 = time.monotonic()
        for at_s, action in sorted(events, key=lambda e: e[0]):
            time.sleep(max(0.0, t0 + at_s - time.monotonic()))
            action()
        load.join()
        expected = len(load.due)
        rx.wait_for(expected, delays_ms[1] / 1000 + settle_s)
        behind = max(0, expected - rx.count)
        rx.wait_quiet(2.0, 10.0)  # late copies and duplicates
        arrivals = rx.arrivals()
    result = three_way(load.due, arrivals)
    return {"lateness": rounded(result), "summary": describe(result), **counts(load.due, arrivals),
            "behind": behind, "longest_gap_ms": longest_gap_ms(arrivals), "sent": load.sent, "send_failed": load.failed, "rate_per_s": rate,
            "seconds": seconds, "delays_ms": list(delays_ms), "due": due_mode}


def keeps_up(result: dict[str, Any]) -> bool:
    """Sustained: everything delivered within the wait after the last send, and no backlog
    building up (p99 by the receive time under 3 s; a rate above what the system handles shows a
    lateness that grows through the run)."""
    p99 = result["lateness"]["received"]["p99"]
    return bool(result["behind"] == 0 and p99 is not None and p99 <= 3_000)
