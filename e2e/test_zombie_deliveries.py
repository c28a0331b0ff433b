"""Exactly-once delivery with real stage processes (issue 31): a zombie dequeue-put.

Two dequeue-put replicas under a steady load in exactly-once mode, read ``read_committed``, each
owning one shard's deliveries by lease. One is stopped (SIGSTOP) while it holds and commits
records, long enough for its lease to lapse and the other replica to take its shard, claim its
entries and init the shard's transactional id (which fences its producer and aborts the
transaction it left open); then it is resumed. It finds its lease lost, or its next commit
fenced: nothing is delivered twice, nothing is lost, and the destinations' last stable offset
moved on while it was stopped (the other's deliveries were read meanwhile).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from harness import LoadRun, Pipeline


def test_a_stopped_dequeue_put_is_fenced_when_resumed_and_nothing_is_delivered_twice(
    tmp_path: Path, kafka_bootstrap: str, redis_url: str
) -> None:
    pipe = Pipeline(tmp_path, kafka_bootstrap, redis_url, shards=2, delivery_guarantee="exactly-once")
    dest = pipe.new_dest("zombie", 2)
    with pipe.running(), LoadRun(pipe, dest, seed=41, rate=60, min_delay_ms=300, max_delay_ms=6_000,
                                   read_committed=True) as run:
        pipe.start("dequeue-put#2")
        time.sleep(4)
        pipe.kill("dequeue-put", signal.SIGSTOP)
        stopped_at = time.monotonic()
        delivered_at_stop = len(run.collector.records)
        time.sleep(12)  # its heartbeat lapses (5 s); the other claims its entries and takes its shards
        assert len(run.collector.records) > delivered_at_stop + 100, \
            "nothing was delivered while the zombie was stopped: its open transaction held the partitions"
        pipe.kill("dequeue-put", signal.SIGCONT)
        time.sleep(6)
        missing, rep = run.drain("exactly-once-zombie", 40)
        assert not missing and not rep.lost, f"lost {rep.lost[:10]}\n{pipe.tails(['dequeue-put', 'dequeue-put#2'])}"
        assert rep.duplicated == 0, rep.line()
        assert not rep.early, rep.early[:10]
        def owned_by(name: str) -> set[int]:
            return {int(line["shard"]) for line in pipe.log_lines(name)
                    if line.get("event") == "owning shard's deliveries"}

        assert owned_by("dequeue-put") & owned_by("dequeue-put#2"), \
            f"the other replica never took the stopped one's shards: {owned_by('dequeue-put')} {owned_by('dequeue-put#2')}"
        fenced = [line for line in pipe.log_lines("dequeue-put")
                  if line.get("event") in ("delivery transaction failed, retrying",
                                           "shard ownership lost, stopped delivering")]
        assert fenced, "the resumed replica went on as the owner: neither its lease nor its producer was fenced"
        print(f"stopped for {time.monotonic() - stopped_at:.0f} s; the resumed replica: "
              f"{[(line['event'], line.get('shard')) for line in fenced][:4]}", flush=True)
        pipe.stop_cleanly()
