"""Exactly-once delivery with real stage processes (issue 31): a zombie dequeue-put.

Two dequeue-put replicas under a steady load in exactly-once mode, read ``read_committed``. One
is stopped (SIGSTOP) while it holds and commits records, long enough for its heartbeat to lapse
and the other replica to claim its entries and take its shards (``init_transactions`` fences its
producers and aborts the transaction it left open); then it is resumed. Its next commit is
fenced, it takes the shard again and reads back what the other delivered: nothing is delivered
twice, nothing is lost, and the destinations' last stable offset moved on while it was stopped
(the other's deliveries were read meanwhile).
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
        print(rep.line(), flush=True)
        assert not missing and not rep.lost, f"lost {rep.lost[:10]}\n{pipe.tails(['dequeue-put', 'dequeue-put#2'])}"
        assert rep.duplicated == 0, rep.line()
        assert not rep.early, rep.early[:10]
        resumed = [line for line in pipe.log_lines("dequeue-put")
                   if line.get("event") == "delivery transaction failed, retrying"]
        assert resumed, "the resumed replica was never refused a commit: it was not fenced"
        taken_by_other = [line for line in pipe.log_lines("dequeue-put#2")
                          if str(line.get("event", "")).startswith("shard deliveries taken")]
        assert taken_by_other, "the other replica never took a shard's deliveries"
        print(f"stopped for {time.monotonic() - stopped_at:.0f} s; fenced commits of the resumed replica: "
              f"{len(resumed)}; takes by the other: {len(taken_by_other)}", flush=True)
        pipe.stop_cleanly()
