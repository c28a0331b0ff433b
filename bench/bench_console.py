"""The console's pages with many pending timers on the shards (issue 33: under 200 ms at 1 M).

An embedded timerwheel (real clock, 2 shards, tick 100 ms, the default 2-day roll window) is given
``TW_BENCH_CONSOLE_TIMERS`` (default 1,000,000) timers due 10 minutes to 24 hours ahead, a tenth
of them 3 to 30 days ahead (rolled), 1 % to a rare destination; then it is stopped and
``timerwheel console`` serves its data directory (the local commit log, read-only shards, the
sampler running every 2 s) in a process of its own. Each page is fetched over HTTP
``TW_BENCH_CONSOLE_ROUNDS`` times (default 30) after one warm-up, from this process:

* ``console.overview``: ``/`` (the sampler's last snapshot rendered)
* ``console.pending``: ``/pending`` (the next hour, 50 a page)
* ``console.pending_deep``: ``/pending?from=now+12h&after=...`` (a page half a day ahead, by cursor)
* ``console.pending_topic``: ``/pending?topic=rare&to=now+1d`` (a destination filter, 1 % of them)
* ``console.pending_id``: ``/pending?id=...&to=now+30d`` (by id: a scan of the whole TimerLog)

Figures: p50, p99 and max of the client's time to the full response, in ms.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import httpx2 as httpx
from timerwheel import Timer
from timerwheel.runtime.embedded import EmbeddedTimerwheel

from bench.common import emit, percentile, say

DAY = 86_400_000


def fill(data: Path, n: int, seed: int = 33) -> str:
    """n pending timers in ``data``; returns the id of one of them."""
    rng = random.Random(seed)
    probe = f"bench-{n // 2}"
    with EmbeddedTimerwheel(data, shards=2, tick_ms=100, fsync=False) as tw:
        now = int(time.time() * 1000)
        batch = 10_000
        for i in range(0, n, batch):
            timers = []
            for j in range(i, min(n, i + batch)):
                delay = rng.randint(3 * DAY, 30 * DAY) if rng.random() < 0.1 else rng.randint(600000, DAY)
                topic = "rare" if rng.random() < 0.01 else f"orders-{j % 8}"
                timers.append(Timer(topic, b"x" * 100, key=str(j).encode(), deliver_at_ms=now + delay,
                                    message_id=f"bench-{j}"))
            tw.schedule_many(timers)
        tw.wait_idle(timeout_s=900)
        pending = sum(s["pending"] for s in tw.inspect()["shards"])
        say(f"{pending:,} pending in the wheels ({n:,} scheduled)")
    return probe


def timed(client: httpx.Client, path: str, rounds: int) -> list[float]:
    client.get(path).raise_for_status()  # warm-up
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        r = client.get(path)
        out.append((time.perf_counter() - t0) * 1000)
        r.raise_for_status()
    return sorted(out)


def main() -> None:
    n = int(os.environ.get("TW_BENCH_CONSOLE_TIMERS", "1000000"))
    rounds = int(os.environ.get("TW_BENCH_CONSOLE_ROUNDS", "30"))
    work = Path(tempfile.mkdtemp(prefix="tw-bench-console-"))
    try:
        t0 = time.monotonic()
        probe = fill(work / "data", n)
        say(f"filled in {time.monotonic() - t0:.0f} s")
        with socket_port() as port:
            env = {k: v for k, v in os.environ.items() if not k.startswith("TW_") or k.startswith("TW_BENCH_")}
            proc = subprocess.Popen([sys.executable, "-m", "timerwheel.cli", "console", "--data-dir",
                                     str(work / "data"), "--port", str(port)], env=env)
            try:
                base = f"http://127.0.0.1:{port}"
                with httpx.Client(base_url=base, timeout=60) as client:
                    deadline = time.monotonic() + 60
                    while True:
                        try:
                            if client.get("/healthz").status_code == 200:
                                break
                        except httpx.TransportError:
                            pass
                        if time.monotonic() > deadline or proc.poll() is not None:
                            raise RuntimeError("the console did not start")
                        time.sleep(0.2)
                    client.get("/")  # the first snapshot
                    time.sleep(3)
                    deep = client.get("/pending?from=now%2B12h&to=now%2B1d").text
                    cursor = deep.split('id="next"')[0].rsplit("after=", 1)[-1].split('"')[0].replace("&amp;", "&")
                    pages = {
                        "overview": "/",
                        "pending": "/pending",
                        "pending_deep": f"/pending?from=now%2B12h&to=now%2B1d&after={quote(cursor)}",
                        "pending_topic": "/pending?topic=rare&to=now%2B1d",
                        "pending_id": f"/pending?id={quote(probe)}&to=now%2B30d",
                    }
                    for name, path in pages.items():
                        ms = timed(client, path, rounds)
                        emit(f"console.{name}", percentile(ms, 0.5), "ms", p99_ms=round(percentile(ms, 0.99), 1),
                             max_ms=round(ms[-1], 1), timers=n, rounds=rounds, path=path)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
    finally:
        shutil.rmtree(work, ignore_errors=True)


class socket_port:  # noqa: N801 - a context manager read as a phrase
    """A free TCP port on 127.0.0.1 (bound to 0, closed on entry)."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    main()
