"""Shared by the benchmarks: the JSON figure line, percentiles, peak RSS."""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any


def emit(bench: str, value: float, unit: str, **extra: Any) -> None:
    """Print one figure as the JSON line that closes a benchmark, with the machine's 1- and
    5-minute load averages at that moment (this machine is shared: a figure means little without)."""
    line = {"bench": bench, "value": round(value, 3) if isinstance(value, float) else value, "unit": unit, **extra,
            "load_average": [round(x, 1) for x in os.getloadavg()[:2]]}
    print(json.dumps(line), flush=True)


def say(text: str) -> None:
    print(f"# {text}", file=sys.stderr, flush=True)


def percentile(sorted_values: list[int] | list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return float(sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))])


def peak_rss_mb() -> float:
    """This process's own peak RSS (VmHWM; ru_maxrss of a child also counts its parent's peak)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
