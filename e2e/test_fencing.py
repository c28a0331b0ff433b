"""Fencing: an enqueue-put paused past its lease never writes again with its old epoch once another
took its shards; resumed, it rejoins the member set and the two balance the shards."""

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
        assert pipe.owns("enqueue-put#2") == 0, pipe.tails(["enqueue-put#2"])  # it has the leases, not the shards
        pipe.kill("enqueue-put", signal.SIGCONT)

        deadline = time.monotonic() + 15
        while len(events(pipe, "enqueue-put", "shard ownership lost, stopped writing")) < SHARDS:
            assert time.monotonic() < deadline, pipe.tails(["enqueue-put", "enqueue-put#2"])
            time.sleep(0.2)
        # The resumed process is a live member again: the two balance the shards between them
        # (rendezvous), so each shard is recovered by one of them, always with a greater epoch.
        resumed = time.monotonic()

        def recovered() -> dict[int, int]:
            got: dict[int, int] = {}
            for name in ("enqueue-put", "enqueue-put#2"):
                for e in events(pipe, name, "recovered"):
                    shard, epoch = int(str(e["shard"])), int(str(e["epoch"]))
                    if epoch > first_epochs[shard]:
                        got[shard] = max(got.get(shard, 0), epoch)
            return got

        deadline = resumed + 30
        while set(recovered()) != set(range(SHARDS)) or pipe.owns("enqueue-put") + pipe.owns("enqueue-put#2") < SHARDS:
            assert time.monotonic() < deadline, pipe.tails(["enqueue-put", "enqueue-put#2"])
            time.sleep(0.2)
        # Epochs never go back: a checkpoint with the paused owner's first epochs is never written again.
        seen = {s: pipe.checkpoint(s)["epoch"] for s in range(SHARDS)}
        for _ in range(20):
            for shard in range(SHARDS):
                epoch = pipe.checkpoint(shard)["epoch"]
                assert epoch >= seen[shard] and epoch > first_epochs[shard], (shard, epoch, seen)
                seen[shard] = epoch
            time.sleep(0.25)
        time.sleep(3)
        missing, rep = run.drain("fencing", timeout_s=60)
        assert not missing and not rep.lost, f"lost {len(rep.lost)}: {rep.lost[:20]}\n{pipe.tails()}"
        assert rep.duplicated == 0, rep.line()  # only the enqueue side was disturbed
        assert not rep.early and not rep.early_received, rep.line()
        for name in ("enqueue-put", "enqueue-put#2"):
            for line in events(pipe, name, "recovered"):
                assert line["corrupt"] == 0, line
        assert not [line for line in pipe.log_lines("dequeue-get") if "corrupt" in str(line.get("event"))]
        assert pipe.procs["enqueue-put"].alive(), "the fenced owner should rejoin as a member, not die"
        pipe.stop_cleanly()
