"""Chaos under a steady load: crashes, a Redis wipe, a broker restart, a torn TimerLog tail.

Each run reports scheduled, delivered, lost, duplicated and late (> 1 s). Nothing may be lost.
Duplicates are bounded by the in-flight window: a dequeue-side disruption (a crash of
dequeue-get, dequeue-getmsg or dequeue-put, a Redis wipe, a broker restart) may re-deliver at
most ``max_in_flight`` messages per shard; a TimerLog record cut off after it was checkpointed
may be delivered once more when its source is re-read.
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest
from harness import (
    DEQUEUE_SIDE,
    STAGES,
    Collector,
    Pipeline,
    SteadyLoad,
    TimerProducer,
    make_report,
)
from infra import ServerControl

pytestmark = pytest.mark.e2e

SHARDS = 2
MAX_IN_FLIGHT = 200
#: A dead consumer's work-queue entries are claimed after 30 s idle, checked every 1000 steps.
RECLAIM_S = 60


def cut_timerlog_tails(pipe: Pipeline, cut: int = 32) -> int:
    """Cut ``cut`` bytes off the newest TimerLog segment of every shard: the last record torn in
    half, as a crash in the middle of a write would leave it. Returns the records damaged."""
    damaged = 0
    for shard in range(SHARDS):
        segments = sorted((pipe.shard_dir(shard) / "timerlog").glob("*.tlog"))
        if segments and segments[-1].stat().st_size >= 64:
            size = segments[-1].stat().st_size
            with open(segments[-1], "r+b") as f:
                f.truncate(size - cut)
            damaged += 1
    return damaged


def finish(pipe: Pipeline, producer: TimerProducer, collector: Collector, load: SteadyLoad, name: str,
           disruptions: int, damaged: int, max_delay_ms: int) -> None:
    load.stop()
    producer.flush()
    expected = producer.expected()
    missing = collector.wait_for(expected, max_delay_ms / 1000 + RECLAIM_S, pipe)
    time.sleep(2)
    rep = make_report(name, producer, collector)
    bound = disruptions * SHARDS * MAX_IN_FLIGHT + damaged
    print(f"[{name}] dequeue-side disruptions={disruptions} records cut={damaged} duplicate bound={bound} "
          f"load sent={load.sent} send errors={load.errors}", flush=True)
    assert not pipe.dead(), f"stages died: {pipe.dead()}\n{pipe.tails(pipe.dead())}"
    assert not missing and not rep.lost, (
        f"lost {len(rep.lost)} of {rep.scheduled}: {rep.lost[:20]}\n"
        f"{[expected[m] for m in rep.lost[:5]]}\n{pipe.tails()}")
    assert rep.duplicated <= bound, f"{rep.duplicated} duplicates, more than the bound {bound}\n{rep.line()}"
    assert not rep.early, f"delivered early: {rep.early[:10]}"
    assert rep.scheduled >= load.rate * 30, f"the load only got {rep.scheduled} messages scheduled"


def test_sigkill_each_stage_in_turn_and_two_at_once_loses_nothing(
    tmp_path: Path, kafka_bootstrap: str, redis_url: str
) -> None:
    """SIGKILL every stage at a random moment and restart it; then two at once. enqueue-put's
    TimerLog gets its last record torn in half before enqueue-put restarts."""
    pipe = Pipeline(tmp_path, kafka_bootstrap, redis_url, shards=SHARDS, max_in_flight=MAX_IN_FLIGHT)
    dest = pipe.dest("load")
    pipe.create_topic(dest, 2)
    rng = random.Random(17)
    disruptions = damaged = 0
    pipe.start_all()
    producer = TimerProducer(pipe, seed=17)
    collector = Collector(pipe, [dest])
    load = SteadyLoad(producer, dest, rate=60, min_delay_ms=500, max_delay_ms=25_000).start()
    try:
        rounds = [[s] for s in STAGES] + [rng.sample(STAGES, 2), rng.sample(STAGES, 2)]
        for victims in rounds:
            time.sleep(rng.uniform(2.0, 5.0))
            for name in victims:
                pipe.kill(name, signal.SIGKILL)
            if "enqueue-put" in victims:
                damaged += cut_timerlog_tails(pipe)
            disruptions += sum(1 for v in victims if v in DEQUEUE_SIDE)
            time.sleep(rng.uniform(0.2, 1.5))
            for name in victims:
                pipe.start(name, wait_ready=False)
            for name in victims:
                pipe.wait_ready(name)
        time.sleep(3)
        finish(pipe, producer, collector, load, "chaos-kill", disruptions, damaged, 25_000)
        recovered = [line for line in pipe.log_lines("enqueue-put") if line.get("event") == "recovered"]
        assert any(line["truncated_bytes"] > 0 for line in recovered), recovered
    finally:
        load.stop()
        collector.close()
        producer.close()
        pipe.stop_all()


def test_redis_flushall_a_redis_restart_and_a_broker_restart_mid_run_lose_nothing(
    tmp_path: Path, kafka_bootstrap: str, redis_url: str, kafka_control: ServerControl, redis_control: ServerControl
) -> None:
    """Redis is a transport, not a store: after FLUSHALL or a restart (the script's Redis keeps
    nothing) the stages recreate their groups and the shard owners replay from their checkpoints.
    A Kafka broker restart is waited out."""
    pipe = Pipeline(tmp_path, kafka_bootstrap, redis_url, shards=SHARDS, max_in_flight=MAX_IN_FLIGHT)
    dest = pipe.dest("load")
    pipe.create_topic(dest, 2)
    pipe.start_all()
    producer = TimerProducer(pipe, seed=23)
    collector = Collector(pipe, [dest])
    load = SteadyLoad(producer, dest, rate=60, min_delay_ms=500, max_delay_ms=25_000).start()
    try:
        time.sleep(6)
        pipe.redis.flushall()
        time.sleep(8)
        redis_control.restart()  # everything lost again, and connections refused meanwhile
        time.sleep(6)
        kafka_control.restart()
        time.sleep(10)
        assert not pipe.dead(), pipe.tails(pipe.dead())
        for name in STAGES:
            pipe.wait_ready(name, 60)
        finish(pipe, producer, collector, load, "chaos-redis-kafka", 3, 0, 25_000)
    finally:
        load.stop()
        collector.close()
        producer.close()
        pipe.stop_all()
