"""``timerwheel top``: the console's overview, live in a terminal.

Drawn with rich (``rich.live.Live`` on the alternate screen, redrawn every ``every_s``): a table
per shard (W, R, lag, owners and epochs, input wait, pending) and a line of rates and what is due
ahead, from the same ``Sampler`` the web console uses. rich does what is easy to get wrong by hand
(terminal width, colours only where the terminal has them, restoring the screen on Ctrl-C);
nothing here needs keyboard input, so a full TUI framework would only add weight. ``--once``
prints one frame without the alternate screen (for scripts and tests).
"""

from __future__ import annotations

import time

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from timerwheel.console.overview import COUNTED, Sampler, Snapshot, age_text, rate_text
from timerwheel.console.source import Installation


def _time(ms: int | None) -> str:
    if ms is None:
        return "-"
    return time.strftime("%H:%M:%S", time.localtime(ms / 1000)) + f".{ms % 1000:03d}"


def frame(snap: Snapshot) -> Group:
    """One screen of the overview."""
    table = Table(title=f"timerwheel  {time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(snap.at_ms / 1000))}",
                  expand=True)
    for col, justify in (("shard", "right"), ("W", "left"), ("W lag", "right"), ("R", "left"), ("R lag", "right"),
                         ("owner / epoch", "left"), ("reader / epoch", "left"), ("input wait", "right"),
                         ("in flight", "right"), ("pending", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for s in snap.shards:
        owner = Text(f"{s.owner} / {s.epoch}") if s.owner else Text("no owner", style="bold red")
        reader = Text(f"{s.reader} / {s.read_epoch}") if s.reader else Text("no reader", style="bold red")
        wait = Text(age_text(s.input_wait_ms), style="yellow" if s.input_wait_ms else "")
        table.add_row(str(s.shard), _time(s.w_ms), age_text(s.w_lag_ms), _time(s.r_ms), age_text(s.r_lag_ms),
                      owner, reader, wait, "-" if s.in_flight is None else f"{s.in_flight:,}",
                      "-" if s.pending is None else f"{s.pending:,}")
    rates = "   ".join(f"{k.replace('_', '-')} {rate_text(snap.rates[k])}" for k in COUNTED)
    due = (f"due: next minute {snap.due_minutes[0]:,}   next hour {snap.due_next_hour:,}   "
           f"next 24 h {snap.due_next_day:,}")
    late = ("lateness p50 " + ("-" if snap.lateness_p50_ms is None else f"{snap.lateness_p50_ms:.0f} ms")
            + "  p99 " + ("-" if snap.lateness_p99_ms is None else f"{snap.lateness_p99_ms:.0f} ms")
            + f"   early {snap.early_records:.0f}")
    down = [f"{address}: {error}" for _t, address, error in snap.endpoints if error]
    lines: list[Table | Text] = [table, Text(rates), Text(due), Text(late)]
    if down:
        lines.append(Text("unreachable: " + "; ".join(down), style="red"))
    return Group(*lines)


def run(inst: Installation, every_s: float, *, once: bool = False, console: Console | None = None) -> None:
    sampler = Sampler(inst, every_s)
    out = console or Console()
    if once:
        sampler.sample()
        time.sleep(min(every_s, 1.0))  # a second sample, for the rates
        out.print(frame(sampler.sample()))
        return
    with Live(frame(sampler.sample()), console=out, screen=True, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(every_s)
                live.update(frame(sampler.sample()), refresh=True)
        except KeyboardInterrupt:
            pass
