"""The timerwheel command: real processes, real data directories."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ENV = {**os.environ, "TW_LOG_LEVEL": "WARNING"}


def tw(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "timerwheel.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["run", "--embedded", "--tick-ms", "7"], "--tick-ms"),
        (["run", "--embedded", "--shards", "x"], "--shards"),
        (["run", "--embedded", "--roll-window", "soon"], "--roll-window"),
        (["schedule", "--topic", "t"], "--delay"),
        (["schedule", "--topic", "t", "--delay-ms", "5", "--header", "novalue"], "--header"),
        (["cancel", "not-a-ticket"], "ticket"),
        (["demo", "--count", "0"], "--count"),
        (["frobnicate"], "frobnicate"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_naming_them(tmp_path: Path, args: list[str], names: str) -> None:
    result = tw(*args, "--data-dir", str(tmp_path)) if args[0] not in ("demo", "frobnicate") else tw(*args)
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert names in lines[0]


def test_bad_env_var_names_the_variable(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "timerwheel.cli", "stage", "enqueue-put"], capture_output=True,
                            text=True, timeout=30, env={**ENV, "TW_TICK_MS": "3"})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "timerwheel: error: TW_TICK_MS: must be one of 10, 100, 200, 500, 1000 ms, got 3"]


def test_schedule_in_one_process_reaches_run_in_another(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    server = subprocess.Popen([sys.executable, "-m", "timerwheel.cli", "run", "--embedded", "--data-dir", data],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 30
        while not list((Path(data) / "shard-0000").glob("enqueue.*.ckpt")):
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        kept = tw("schedule", "--data-dir", data, "--topic", "orders", "--delay-ms", "300ms", "--value", "hello",
                  "--key", "k1", "--header", "trace=abc")
        assert kept.returncode == 0, kept.stderr
        # 8 s: two CLI processes start before the cancel is written (1.7 s each on a loaded machine)
        dropped = tw("schedule", "--data-dir", data, "--topic", "orders", "--delay-ms", "8s", "--value", "bye")
        cancel = tw("cancel", "--data-dir", data, dropped.stdout.strip())
        assert cancel.returncode == 0, cancel.stderr
        records: list[dict[str, object]] = []
        while time.monotonic() < deadline and not records:
            out = tw("consume", "--data-dir", data, "--topic", "orders")
            records = [json.loads(line) for line in out.stdout.splitlines()]
            time.sleep(0.1)
        assert [r["value"] for r in records] == ["hello"]
        headers = records[0]["headers"]
        assert isinstance(headers, dict) and headers["trace"] == "abc" and "tw-delivered-at" in headers
        # The cancelled message's slot is delivered once R has passed it (R moves past a slot only
        # when all its messages are delivered): wait for that, not for a while.
        cancelled_at = int(dropped.stdout.strip().split(".")[2])
        info: dict[str, Any] = {}
        while time.monotonic() < deadline + 30:
            info = json.loads(tw("inspect", "--data-dir", data).stdout)
            if (info["shards"][0]["R"] or 0) > cancelled_at:
                break
            time.sleep(0.1)
        [shard] = info["shards"]
        assert shard["R"] > cancelled_at, f"R never passed the cancelled message's slot: {info}"
        out = tw("consume", "--data-dir", data, "--topic", "orders")
        assert [json.loads(line)["value"] for line in out.stdout.splitlines()] == ["hello"], "cancelled one came out"
        # inspect: two messages and one cancel marker written, nothing left pending, R <= W near now.
        assert shard["flushed_pos"] == shard["timerlog_bytes"] == 3 * 64, info
        assert shard["pending"] == 0 and shard["R"] <= shard["W"] <= info["now_ms"], info
        assert info["settings"]["shards"] == 1, info
        second = tw("run", "--embedded", "--data-dir", data, timeout=30)
        assert second.returncode == 1 and "in use by another timerwheel process" in second.stderr
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0


def test_demo_reports_lateness(tmp_path: Path) -> None:
    result = tw("demo", "--count", "300", "--max-delay-s", "2", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["delivered"] == 300 - summary["cancelled"]
    assert summary["early"] == 0
    first = result.stderr.lstrip("\r").splitlines()[0]
    assert first.startswith("demo: ") and "300 timers" in first, "demo says nothing before its progress bar"


def test_a_start_with_another_shard_count_exits_2_naming_stored_and_requested(tmp_path: Path) -> None:
    """Data made with one shard, started with two: refused before anything is written or read
    (the timer partitions would move between shards and old messages be delivered again)."""
    from timerwheel.runtime.embedded import EmbeddedTimerwheel

    data = tmp_path / "data"
    with EmbeddedTimerwheel(data, shards=1, tick_ms=100, roll_window_ms=60_000, fsync=False):
        pass
    before = sorted(p.name for p in data.iterdir())
    embedded = tw("run", "--embedded", "--data-dir", str(data), "--shards", "2", "--tick-ms", "100",
                  "--roll-window", "60000")
    stage = subprocess.run([sys.executable, "-m", "timerwheel.cli", "stage", "enqueue-put"], capture_output=True,
                           text=True, timeout=60, env={**ENV, "TW_DATA_DIR": str(data), "TW_SHARDS": "2",
                                                       "TW_TICK_MS": "100", "TW_ROLL_WINDOW_MS": "60000"})
    for result, named in ((embedded, "--shards"), (stage, "TW_SHARDS")):
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and f"{named}: stored 1, requested 2" in lines[0], result.stderr
    assert sorted(p.name for p in data.iterdir()) == before, "a refused start created files"


def test_inspect_shows_the_stored_shard_count_not_the_directories_found(tmp_path: Path) -> None:
    from timerwheel.runtime.embedded import EmbeddedTimerwheel

    data = tmp_path / "data"
    with EmbeddedTimerwheel(data, shards=2, tick_ms=100, roll_window_ms=60_000, fsync=False):
        pass
    (data / "shard-0007").mkdir()  # a stray directory, not a shard of this deployment
    info = json.loads(tw("inspect", "--data-dir", str(data)).stdout)
    assert [s["shard"] for s in info["shards"]] == [0, 1]
    assert info["settings"]["shards"] == 2 and info["settings"]["tick_ms"] == 100
