"""The audit's figures computed in plain Python, as docs/spark.md defines them: the
truth ``timerwheel audit``'s summary.json must equal (tests/jobs/test_audit.py on records written
by hand, e2e/test_audit_of_a_run.py on what a real run produced and consumed)."""

from __future__ import annotations

import math
from typing import Any


def nearest_rank(values: list[int], q: float) -> int | None:
    if not values:
        return None
    s = sorted(values)
    return s[math.ceil(q * len(s)) - 1]


def audit_figures(sched: dict[str, tuple[str, int]], cancelled: set[str], deliveries: dict[str, list[int]],
                  now_ms: int, grace_ms: int) -> dict[str, Any]:
    """One group's figures: ``sched`` id -> (topic, deliver_ms), ``cancelled`` the ids a cancel
    named, ``deliveries`` id -> the ``tw-delivered-at`` of each copy seen on its topic."""
    late = [min(deliveries[i]) - d for i, (_, d) in sched.items() if i in deliveries]
    open_ = [d for i, (_, d) in sched.items() if i not in cancelled and i not in deliveries]
    return {
        "scheduled": len(sched),
        "cancelled": sum(1 for i in sched if i in cancelled),
        "delivered": sum(1 for i in sched if i in deliveries),
        "duplicated": sum(len(deliveries[i]) - 1 for i in sched if i in deliveries),
        "lost": sum(1 for d in open_ if d <= now_ms - grace_ms),
        "pending": sum(1 for d in open_ if d > now_ms - grace_ms),
        "cancelled_delivered": sum(1 for i in sched if i in cancelled and i in deliveries),
        "early": sum(1 for x in late if x < 0),
        "lateness_ms": {"p50": nearest_rank(late, 0.5), "p95": nearest_rank(late, 0.95),
                        "p99": nearest_rank(late, 0.99), "max": max(late) if late else None},
    }


def audit_summary(sched: dict[str, tuple[str, int]], cancelled: set[str], deliveries: dict[str, list[int]],
                  now_ms: int, grace_ms: int) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(total, per topic) as summary.json's ``total`` and ``topics``."""
    topics = sorted({t for t, _ in sched.values()})
    per_topic = {t: audit_figures({i: v for i, v in sched.items() if v[0] == t}, cancelled, deliveries, now_ms, grace_ms)
                 for t in topics}
    return audit_figures(sched, cancelled, deliveries, now_ms, grace_ms), per_topic
