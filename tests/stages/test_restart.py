"""Restarts and crashes lose nothing; a message is delivered again only from the window the
design allows.

After a stop or a crash, dequeue-get reads the slots from ``R`` on again, so the messages that
were already delivered but lie in a slot ``R`` had not passed may be delivered again: that, and
nothing else, is the at-least-once window. At each stop the tests read what was delivered and
where ``R`` stood, and check that every extra copy of a message comes from a stop whose window
held it (a stop can double a message's copies in flight: a roll hop done again is a second
hop, and each hop delivers).
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from scenario import by_id, step_through
from timerwheel import SimulatedClock, Timer, TimerConfig
from timerwheel.runtime.embedded import EmbeddedTimerwheel
from timerwheel.store.layout import open_shard
from timerwheel.transports.local.log import LocalCommitLog
from timerwheel.wire import id_hash

TICK = 100
SHARDS = 2
#: Longer than every delay of the graceful test: no message rolls there (see the SIGKILL test).
ROLL_WINDOW_MS = 300_000


def delivered_ids(data: Path) -> list[str]:
    """The tw-id of every record delivered to ``t`` so far (read from the log itself)."""
    log = LocalCommitLog(data / "log", fsync=False)
    try:
        out: list[str] = []
        for p in range(log.partitions("t")):
            consumer = log.consumer("t", {p: 0})
            while batch := consumer.poll(10_000, 0):
                out += [(r.header("tw-id") or b"").decode() for r in batch]
            consumer.close()
        return out
    finally:
        log.close()


def rereadable(data: Path, shard_of: dict[str, int], window: collections.Counter[str], roll_window_ms: int) -> None:
    """Count in ``window`` each message that, at this stop, has a TimerLog record in a slot that
    dequeue-get may have read and ``R`` has not passed: read again after the restart, it may be
    delivered — or, for a roll hop, rolled — again. dequeue-get reads slots up to
    ``lookahead_max_ms`` + a tick past ``W`` (read ahead), and dequeue-put's watch may deliver what it
    read before ``W`` passes it: the window is ``[R, W + lookahead + tick)``. (A record's slot is
    its fire time: a roll slot, or the slot of W for a message written when already due.)"""
    config = TimerConfig(data_dir=str(data), shards=SHARDS, tick_ms=TICK, roll_window_ms=roll_window_ms, fsync=False)
    for s in range(SHARDS):
        # As the writer, which runs the recovery the next start runs too: after a kill, the
        # TimerLog may hold records past the checkpoint, and they are read again as well.
        shard = open_shard(config, s, writer=True)
        try:
            dq, eq = shard.load_dequeue_checkpoint(), shard.load_enqueue_checkpoint()
            read_ms = dq.read_ms if dq else 0
            horizon = (eq.write_ms if eq else 0) + config.lookahead_max_ms + TICK
            unread: set[int] = set()  # id hashes with a record in a slot of [R, W + lookahead + tick)
            for _first, arr in shard.log.iter_chunks(shard.log.start_pos, shard.flush()):
                slot = arr["deliver_ms"].astype("int64")
                slot -= slot % TICK
                unread.update(arr["id_hash"][(slot >= read_ms) & (slot < horizon)].tolist())
        finally:
            shard.close()
        for m, shard_id in shard_of.items():
            if shard_id == s and id_hash(m) in unread:
                window[m] += 1


def check_duplicates(delivered: dict[str, list[object]], window: collections.Counter[str]) -> int:
    """Each stop that left a message in the window may have doubled its copies in flight (a
    roll hop done again is a second hop, and each hop delivers): at most 2^w - 1 extra copies."""
    extra = {m: len(copies) - 1 for m, copies in delivered.items() if len(copies) > 1}
    outside = {m: (n, window[m]) for m, n in extra.items() if n > 2 ** window[m] - 1}
    assert not outside, f"delivered again from outside the window (extra copies, stops that left it in the window): {outside}"
    return sum(extra.values())


def test_graceful_stops_and_restarts_under_load_lose_nothing(
    tmp_path: Path, clock: SimulatedClock
) -> None:
    """close() mid-flight (SIGTERM's path), eight times; abrupt kills are the test below."""
    data = tmp_path / "data"
    rng = random.Random(11)
    settings = dict(tick_ms=TICK, roll_window_ms=ROLL_WINDOW_MS, shards=SHARDS, fsync=False, max_in_flight=1_000,
                    batch_size=100)
    due: dict[str, int] = {}
    shard_of: dict[str, int] = {}
    window: collections.Counter[str] = collections.Counter()
    start = clock.now_ms()
    end = start + 5 * 60_000
    for _round in range(8):
        tw = EmbeddedTimerwheel(data, clock=clock, **settings)
        try:
            timers = [Timer("t", b"v", delay_ms=rng.randint(0, 4 * 60_000)) for _ in range(500)]
            for t in tw.schedule_many(timers):
                due[t.message_id] = t.deliver_at_ms
                shard_of[t.message_id] = t.partition % SHARDS
            # run a random stretch of simulated time, then stop (gracefully) mid-flight
            for _ in range(rng.randint(1, 30)):
                clock.advance(rng.choice([TICK, 1_000, 7_000]))
                time.sleep(rng.random() * 0.01)
        finally:
            tw.close()
        rereadable(data, shard_of, window, ROLL_WINDOW_MS)
    tw = EmbeddedTimerwheel(data, clock=clock, **settings)
    try:
        step_through(tw, clock, list(due.values()), max(end, max(due.values())) + 2 * TICK)
        delivered = by_id(tw.read("t"))
    finally:
        tw.close()
    assert set(delivered) == set(due), f"lost {len(set(due) - set(delivered))}"
    assert len(due) == 8 * 500
    check_duplicates(delivered, window)


CHILD = r"""
import json, sys, time
from timerwheel import SimulatedClock, Timer
from timerwheel.runtime.embedded import EmbeddedTimerwheel
data, seed = sys.argv[1], int(sys.argv[2])
state = json.load(open(data + ".clock")) if __import__("os").path.exists(data + ".clock") else {"now": 1_700_000_000_000}
clock = SimulatedClock(state["now"])
tw = EmbeddedTimerwheel(data, clock=clock, tick_ms=100, roll_window_ms=60_000, shards=2, fsync=False,
                        max_in_flight=1_000, batch_size=100)
import random
rng = random.Random(seed)
now = clock.now_ms()
tickets = tw.schedule_many([Timer("t", b"v", deliver_at_ms=now + rng.randint(0, 120_000)) for _ in range(300)])
with open(data + f".scheduled.{seed}", "w") as f:
    json.dump({t.message_id: [t.deliver_at_ms, t.partition] for t in tickets}, f)
print("scheduled", flush=True)
while True:
    now = clock.advance(rng.choice([100, 500, 2_000]))
    with open(data + ".clock.tmp", "w") as f:
        json.dump({"now": now}, f)
    __import__("os").replace(data + ".clock.tmp", data + ".clock")
    time.sleep(0.003)
"""


def test_sigkill_at_random_moments_loses_nothing(tmp_path: Path) -> None:
    data = tmp_path / "data"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    rng = random.Random(5)
    due: dict[str, int] = {}
    shard_of: dict[str, int] = {}
    window: collections.Counter[str] = collections.Counter()
    for seed in range(12):
        proc = subprocess.Popen([sys.executable, str(script), str(data), str(seed)], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, env={**os.environ, "TW_LOG_LEVEL": "WARNING"})
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == b"scheduled", "child failed to start"
        time.sleep(rng.uniform(0.05, 0.6))
        assert proc.poll() is None, f"child {seed} exited on its own ({proc.returncode}) before the kill"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
        for m, (at, partition) in json.loads(Path(f"{data}.scheduled.{seed}").read_text()).items():
            due[m], shard_of[m] = at, partition % SHARDS
        rereadable(data, shard_of, window, 60_000)
    # The truth is also the timer topic itself: every first-hop record in it was scheduled.
    timer_log = LocalCommitLog(data / "log")
    in_topic = {}
    for p in range(timer_log.partitions("__timer")):
        consumer = timer_log.consumer("__timer", {p: 0})
        while batch := consumer.poll(10_000, 0):
            for r in batch:
                if r.header("tw-roll") is None and r.header("tw-id") is not None:
                    in_topic[r.header("tw-id").decode()] = int(r.header("tw-deliver-at") or b"0")
        consumer.close()
    timer_log.close()
    assert in_topic == due and len(due) == 12 * 300
    now = json.loads(Path(f"{data}.clock").read_text())["now"]
    clock = SimulatedClock(now)
    tw = EmbeddedTimerwheel(data, clock=clock, tick_ms=100, roll_window_ms=60_000, shards=SHARDS, fsync=False,
                            max_in_flight=1_000, batch_size=100)
    try:
        step_through(tw, clock, list(due.values()), max(due.values()) + 2 * TICK)
        delivered = by_id(tw.read("t"))
    finally:
        tw.close()
    assert set(delivered) == set(due), f"lost {len(set(due) - set(delivered))} of {len(due)}"
    check_duplicates(delivered, window)
