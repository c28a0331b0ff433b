"""Disaster recovery end to end: the volume is lost and rebuilt from Kafka.

The five production stage processes schedule 800 messages with delays spread over 2-70 s (those
past the 20 s roll window roll), 60 of them cancelled. Once part of them is delivered every stage
is stopped, the data directory deleted, ``timerwheel recover-from-kafka`` run, and the stages
started again on the rebuilt shards: what fell due while they were down is delivered at once,
the rest on time (rolled again where still far off). Counted by ``tw-id`` on the destination topics: nothing
lost, nothing delivered twice, nothing cancelled delivered, nothing early.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import STAGES, Collector, Pipeline, TimerProducer, make_report, now_ms

pytestmark = pytest.mark.e2e

MESSAGES = 800
CANCELS = 60
MIN_DELAY_MS, MAX_DELAY_MS = 2_000, 70_000


def recover(pipe: Pipeline, timeout_s: float = 60.0) -> tuple[dict[str, object], int]:
    """``timerwheel recover-from-kafka`` with the stages' settings: (its JSON report, its peak RSS
    in KiB). A refusal because the stopped stages' heartbeats have not lapsed yet (a few seconds)
    is retried; any other failure fails the test."""
    deadline = time.monotonic() + timeout_s
    out_path, err_path = pipe.workdir / "recover.out", pipe.workdir / "recover.err"
    while True:
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen([sys.executable, "-m", "timerwheel.cli", "recover-from-kafka"], env=pipe.env,
                                    cwd=pipe.workdir, stdout=out, stderr=err)
            _pid, status, usage = os.wait4(proc.pid, 0)  # waits, and gives the child's own peak RSS
            proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode == 0:
            return json.loads(out_path.read_text()), int(usage.ru_maxrss)
        refused = err_path.read_text(errors="replace").strip()
        assert "stages are still running" in refused and time.monotonic() < deadline, refused
        time.sleep(1)


def test_a_lost_volume_is_rebuilt_from_kafka_without_loss_or_duplicates(
        tmp_path: Path, kafka_bootstrap: str, redis_url: str) -> None:
    pipe = Pipeline(tmp_path, kafka_bootstrap, redis_url)
    dest_a, dest_b = pipe.new_dest("a", 2), pipe.new_dest("b", 1)
    rng = random.Random(16)
    with TimerProducer(pipe, seed=16) as producer, Collector(pipe, [dest_a, dest_b]) as collector:
        try:
            pipe.start_all()
            start = now_ms()
            sent = [producer.schedule(rng.choice((dest_a, dest_b)), start + rng.randint(MIN_DELAY_MS, MAX_DELAY_MS))
                    for _ in range(MESSAGES)]
            producer.flush()
            for m in rng.sample([m for m in sent if m.deliver_at_ms > start + 15_000], CANCELS):
                producer.cancel(m)
            producer.flush()
            expected = producer.expected()
            assert len(expected) == MESSAGES - CANCELS, "the producer's sends were not all acknowledged"
            # Part delivered: wait until a fifth is, then stop everything.
            deadline = time.monotonic() + 60
            while len(collector.delivered_ids() & set(expected)) < MESSAGES // 5 and time.monotonic() < deadline:
                time.sleep(0.2)
            codes = {name: pipe.stop(name) for name in STAGES}
            assert codes == dict.fromkeys(STAGES, 0), f"not stopped cleanly: {codes}\n{pipe.tails()}"
            shutil.rmtree(pipe.data_dir)  # the volume is lost
            t0 = time.monotonic()
            report, peak_kb = recover(pipe)
            took = time.monotonic() - t0
            print(f"FIGURE recover-from-kafka: {json.dumps(report)}; {took:.1f} s with retries; "
                  f"peak RSS {peak_kb / 1024:.0f} MiB", flush=True)
            # Nothing is delivered now: once the collector has read what the stopped stages
            # delivered last, it agrees with the recovery's count.
            deadline = time.monotonic() + 30
            while len(collector.delivered_ids() & set(expected)) < int(str(report["delivered"])) \
                    and time.monotonic() < deadline:
                time.sleep(0.2)
            before = collector.delivered_ids() & set(expected)
            assert MESSAGES // 5 <= len(before) < len(expected), f"{len(before)} delivered before the loss"
            assert report["delivered"] == len(before), (report, len(before))
            assert report["cancelled"] == CANCELS and report["dead_lettered"] == 0
            assert report["rescheduled"] == len(expected) - len(before)
            assert report["ids_held"] == MESSAGES

            pipe.start_all_missing()
            restarted = now_ms()
            missing = collector.wait_for(expected, MAX_DELAY_MS / 1000 + 60, pipe)
            time.sleep(3)  # a duplicate or a cancelled message would show by now
            rep = make_report("disaster recovery", producer, collector)
            with collector._lock:
                after = sorted(min(d.received_at_ms for d in collector.by_id[m]) - s.deliver_at_ms
                               for m, s in expected.items() if s.deliver_at_ms > restarted + 1_000
                               and m in collector.by_id)
            if after:
                print(f"FIGURE after the recovery, {len(after)} messages due after the restart: lateness by receive "
                      f"time p50 {after[len(after) // 2]} ms, max {after[-1]} ms", flush=True)
            assert not missing and not rep.lost, f"lost {len(rep.lost)}: {rep.lost[:10]}\n{pipe.tails()}"
            assert rep.duplicated == 0, f"delivered twice after the recovery\n{rep.line()}"
            assert not rep.cancelled_delivered and not rep.unexpected, rep.line()
            assert not rep.early and not rep.early_received, rep.line()
            pipe.stop_cleanly()
        finally:
            pipe.stop_all()
