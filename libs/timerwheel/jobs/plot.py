"""One line chart as a PNG, for the jobs' pictures (matplotlib, no display)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def line_chart(series: Sequence[tuple[str, Sequence[Any], Sequence[Any], str]], xlabel: str, ylabel: str,
               title: str, path: Path) -> None:
    """``series``: (label, x values, y values, line style) each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    for label, xs, ys, style in series:
        ax.plot(list(xs), list(ys), style, marker="o", markersize=3, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if series:
        ax.legend(fontsize="small")
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
