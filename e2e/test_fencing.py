"""Fencing: an enqueue-put paused past its lease never writes again once another took its shards."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from harness import LoadRun, Pipeline

pytestmark = pytest.mark.e2e

LEASE_TTL_MS = 2_000
SHARDS = 2


def events(pipe: Pipeline, name: str, event: str) -> list[dict[str, object]]:
    return [line for line in pipe.log_lines(name) if line.get("event") == event]


def test_a_paused_owner_is_fenced_and_its_successor_owns_the_shards(
    tmp_path: Path, kafka_bootstrap: str, redis_url: str
) -> None:
    pipe = Pipeline(tmp_path, kafka_bootstrap, redis_url, shards=SHARDS, lease_ttl_ms=LEASE_TTL_MS)
    dest = pipe.new_dest("load", 2)
    with pipe.running(), LoadRun(pipe, dest, seed=5, rate=50, min_delay_ms=500, max_delay_ms=15_000) as run:
        time.sleep(4)
        first_epochs = {int(str(e["shard"])): int(str(e["epoch"])) for e in events(pipe, "enqueue-put", "recovered")}
        pipe.kill("enqueue-put", signal.SIGSTOP)  # paused mid-work, holding its leases and writer locks
        time.sleep(LEASE_TTL_MS / 1000 + 1.5)
        pipe.start("enqueue-put#2", wait_ready=False)
        # The successor takes the leases (the paused owner is fenced by them) but waits for the
        # writer locks the paused process still holds: it writes nothing yet.
        deadline = time.monotonic() + 30
        while len(events(pipe, "enqueue-put#2", "shard still locked by its previous owner, waiting")) < SHARDS:
            assert time.monotonic() < deadline and pipe.procs["enqueue-put#2"].alive(), pipe.tails(["enqueue-put#2"])
            time.sleep(0.2)
        time.sleep(1)
        assert not pipe.ready("enqueue-put#2"), pipe.tails(["enqueue-put#2"])
        pipe.kill("enqueue-put", signal.SIGCONT)
        pipe.wait_ready("enqueue-put#2", 30)

        deadline = time.monotonic() + 15
        while len(events(pipe, "enqueue-put", "shard ownership lost, stopped writing")) < SHARDS:
            assert time.monotonic() < deadline, pipe.tails(["enqueue-put", "enqueue-put#2"])
            time.sleep(0.2)
        assert not pipe.ready("enqueue-put"), "the fenced owner still reports ready"
        # Ready means owning a shard: the successor may still be recovering the other one.
        deadline = time.monotonic() + 30
        while len({e["shard"] for e in events(pipe, "enqueue-put#2", "recovered")}) < SHARDS:
            assert time.monotonic() < deadline, pipe.tails(["enqueue-put", "enqueue-put#2"])
            time.sleep(0.2)
        second_epochs = {int(str(e["shard"])): int(str(e["epoch"])) for e in events(pipe, "enqueue-put#2", "recovered")}
        assert set(second_epochs) == set(range(SHARDS)), pipe.tails(["enqueue-put#2"])
        assert all(second_epochs[s] > first_epochs[s] for s in range(SHARDS)), (first_epochs, second_epochs)
        # From now on every checkpoint is the successor's: the fenced process, still running,
        # never publishes again (a save with its older epoch is refused, and it holds no lease).
        for _ in range(20):
            for shard in range(SHARDS):
                assert pipe.checkpoint(shard)["epoch"] == second_epochs[shard], pipe.tails(["enqueue-put"])
            time.sleep(0.25)
        time.sleep(3)
        missing, rep = run.drain("fencing", timeout_s=60)
        assert not missing and not rep.lost, f"lost {len(rep.lost)}: {rep.lost[:20]}\n{pipe.tails()}"
        assert rep.duplicated == 0, rep.line()  # only the enqueue side was disturbed
        assert not rep.early and not rep.early_received, rep.line()
        for line in events(pipe, "enqueue-put#2", "recovered"):
            assert line["corrupt"] == 0, line
        assert not [line for line in pipe.log_lines("dequeue-get") if "corrupt" in str(line.get("event"))]
        assert all(pipe.checkpoint(s)["epoch"] == second_epochs[s] for s in range(SHARDS))
        assert pipe.procs["enqueue-put"].alive(), "the fenced owner should wait as a standby, not die"
        pipe.stop_cleanly()
