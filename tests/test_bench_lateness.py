"""The pure parts of the benchmarks' lateness: percentiles, the three readings, the counts and
the due-time shapes (``bench/lateness.py``)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: ``bench`` is no installed package

from bench.common import percentile  # noqa: E402
from bench.lateness import (  # noqa: E402
    WARM_UP_PREFIX,
    Arrival,
    counts,
    describe,
    due_time,
    longest_gap_ms,
    rounded,
    stats,
    three_way,
)


def test_percentile_is_the_nearest_rank_of_sorted_values() -> None:
    values = list(range(1, 101))  # 1..100
    assert percentile(values, 0.5) == 51
    assert percentile(values, 0.99) == 100
    assert percentile([7], 0.99) == 7
    assert math.isnan(percentile([], 0.5))


def test_stats_count_early_values_below_zero_only() -> None:
    s = stats([5, -1, 0, 30, -20])
    assert (s.n, s.p50, s.max, s.early) == (5, 0.0, 30.0, 2)


def test_three_way_measures_each_reading_against_the_due_time() -> None:
    due = {"a": 1_000, "b": 2_000}
    arrivals = [Arrival("a", 1_010, 1_030, 1_100), Arrival("b", 1_995, 2_004, 2_050)]
    result = three_way(due, arrivals)
    assert (result["delivered_at"].max, result["delivered_at"].early) == (10.0, 1)
    assert (result["timestamp"].p50, result["timestamp"].max, result["timestamp"].early) == (30.0, 30.0, 0)
    assert (result["received"].p50, result["received"].max) == (100.0, 100.0)


def test_three_way_counts_a_duplicate_once_by_its_first_receipt() -> None:
    due = {"a": 1_000}
    arrivals = [Arrival("a", 1_900, 1_950, 2_000), Arrival("a", 1_005, 1_010, 1_020)]
    result = three_way(due, arrivals)
    assert result["received"].n == 1
    assert result["received"].max == 20.0
    assert result["timestamp"].max == 10.0


def test_a_reading_a_system_does_not_give_is_empty_not_zero() -> None:
    result = three_way({"a": 1_000}, [Arrival("a", None, 1_040, 1_050)])
    assert result["delivered_at"].n == 0
    assert math.isnan(result["delivered_at"].p99)
    assert rounded(result)["delivered_at"]["p99"] is None
    assert "delivered_at" not in describe(result)
    assert rounded(result)["timestamp"] == {"n": 1, "p50": 40.0, "p99": 40.0, "max": 40.0, "early": 0}


def test_counts_lost_duplicated_and_unexpected_and_skip_the_warm_up() -> None:
    arrivals = [Arrival("a", None, 1, 1), Arrival("a", None, 2, 2), Arrival("a", None, 3, 3),
                Arrival("c", None, 1, 1), Arrival(f"{WARM_UP_PREFIX}0", None, 1, 1)]
    assert counts(["a", "b"], arrivals) == {"expected": 2, "delivered": 1, "lost": 1, "duplicated": 2,
                                            "unexpected": 1}


@pytest.mark.parametrize(("now", "delay", "mode", "want"), [
    (1_000_250, 2_000, "uniform", 1_002_250),
    (1_000_250, 2_000, "whole_second", 1_003_000),
    (1_000_000, 2_000, "whole_second", 1_002_000),  # already on a whole second: unchanged
    (1_000_001, 1_999, "whole_second", 1_002_000),
])
def test_due_time_shapes(now: int, delay: int, mode: str, want: int) -> None:
    assert due_time(now, delay, mode) == want


def test_due_time_refuses_an_unknown_mode_naming_it() -> None:
    with pytest.raises(ValueError, match="'hourly'"):
        due_time(0, 0, "hourly")


def test_longest_gap_is_between_consecutive_first_receipts() -> None:
    arrivals = [Arrival("a", None, 0, 1_000), Arrival("b", None, 0, 2_000), Arrival("c", None, 0, 9_500),
                Arrival("b", None, 0, 5_000),  # a duplicate: its first copy came at 2,000
                Arrival(f"{WARM_UP_PREFIX}0", None, 0, 0)]  # the warm-up does not open the run
    assert longest_gap_ms(arrivals) == 7_500
    assert longest_gap_ms([]) == 0
