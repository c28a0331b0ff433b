"""``timerwheel run`` (embedded) with ``TW_DELIVERY_GUARANTEE=exactly-once``: SIGKILLed while it
delivers and started again, it delivers every message once (design 7.1 "Embedded")."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from timerwheel import Timer, TimerConfig
from timerwheel.client import TimerClient
from timerwheel.transports.local.log import LocalCommitLog

ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("TW_")}, "TW_LOG_LEVEL": "WARNING",
       "TW_DELIVERY_GUARANTEE": "exactly-once", "TW_SHARDS": "2", "TW_TICK_MS": "100"}
MESSAGES = 600


def start(data: Path) -> subprocess.Popen[str]:
    server = subprocess.Popen([sys.executable, "-m", "timerwheel.cli", "run", "--embedded", "--data-dir", str(data)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 60
    while not list((data / "shard-0001").glob("enqueue.*.ckpt")):
        assert server.poll() is None, server.stderr.read() if server.stderr else ""
        assert time.monotonic() < deadline, "timerwheel run did not start"
        time.sleep(0.05)
    return server


def delivered(data: Path) -> collections.Counter[str]:
    log = LocalCommitLog(data / "log", fsync=False)
    try:
        return collections.Counter((r.header("tw-id") or b"").decode() for p in range(log.partitions("orders"))
                                   for r in log.read_since("orders", p, 0))
    finally:
        log.close()


def test_run_in_exactly_once_killed_mid_delivery_and_restarted_delivers_each_message_once(tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = start(data)
    try:
        log = LocalCommitLog(data / "log")
        client = TimerClient(log, TimerConfig(data_dir=str(data), shards=2))
        now = int(time.time() * 1000)
        # Due over 1-7 s from now, in bursts: the kills below land while batches are released.
        tickets = client.schedule_many([Timer("orders", b"v", deliver_at_ms=now + 1_000 + (i % 60) * 100)
                                        for i in range(MESSAGES)])
        log.close()
        ids = {t.message_id for t in tickets}
        kills = 0
        deadline = time.monotonic() + 120
        while kills < 3:
            assert time.monotonic() < deadline, "the kills did not happen"
            if sum(delivered(data).values()) > 0 and server.poll() is None:  # delivering: kill it
                time.sleep(0.2 * kills)
                server.send_signal(signal.SIGKILL)
                assert server.wait(30) == -signal.SIGKILL
                kills += 1
                server = start(data)
            else:
                time.sleep(0.05)
        while set(delivered(data)) != ids:
            assert time.monotonic() < deadline, f"{len(ids - set(delivered(data)))} not delivered"
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            time.sleep(0.2)
        time.sleep(1.0)  # a second copy, if any, would come now
        got = delivered(data)
        assert set(got) == ids and {m: n for m, n in got.items() if n > 1} == {}, "delivered twice"
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0
