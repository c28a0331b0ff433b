"""RetryConsumer on real Kafka through the five production stages: failures come back at their
delay levels to the failing group only, end in the group's DLQ after the maximum, and a consumer
killed between handling and committing loses nothing and duplicates at most one batch per kill."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness import Pipeline, tail
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from timerwheel import Delivery, KafkaCommitLog, RetryConsumer, TimerConfig
from timerwheel.config import parse_delay_levels
from timerwheel.records import Record
from timerwheel.transports.kafka.consumers import to_record

pytestmark = pytest.mark.e2e

#: Short levels, so that three retries take seconds: level 3 = 500 ms, level 4 = 1 s.
LEVELS = "100ms 200ms 500ms 1s 1500ms"
MAX_RECONSUME = 2
WORKER = Path(__file__).with_name("retry_worker.py")


@pytest.fixture(scope="module")
def pipe(tmp_path_factory: pytest.TempPathFactory, kafka_bootstrap: str, redis_url: str) -> Iterator[Pipeline]:
    """The five stage processes, shared by this module's tests (each uses topics of its own)."""
    pipeline = Pipeline(tmp_path_factory.mktemp("retry"), kafka_bootstrap, redis_url, delay_levels=LEVELS)
    with pipeline.running():
        yield pipeline
        assert not pipeline.dead(), pipeline.tails()


def send(pipe: Pipeline, topic: str, n: int, partitions: int) -> None:
    """Values m0..m<n-1>, spread over the partitions."""
    producer = KafkaProducer(bootstrap_servers=pipe.kafka, acks="all", **pipe.kafka_options)
    for i in range(n):
        producer.send(topic, key=f"k{i}".encode(), value=f"m{i}".encode(), partition=i % partitions)
    producer.flush(60)
    producer.close()


def read_all(pipe: Pipeline, topic: str) -> list[Record]:
    """Every record of ``topic`` up to its current end."""
    consumer = KafkaConsumer(bootstrap_servers=pipe.kafka, enable_auto_commit=False, **pipe.kafka_options)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        out: list[Record] = []
        deadline = time.monotonic() + 60
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            assert time.monotonic() < deadline, f"{topic}: not read to its end within 60 s"
            for recs in consumer.poll(timeout_ms=500).values():
                out += [to_record(r) for r in recs]
        return out
    finally:
        consumer.close()


def wait_for(done: Callable[[], bool], timeout_s: float, pipe: Pipeline) -> bool:
    """Wait until ``done()`` (True) or the timeout (False); fails at once if a stage died."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        assert not pipe.dead(), f"a stage died:\n{pipe.tails()}"
        time.sleep(0.2)
    return True


def test_failures_come_back_at_their_levels_to_the_failing_group_only_then_reach_its_dlq(pipe: Pipeline) -> None:
    topic = pipe.new_dest("orders", 2)
    group = pipe.dest("billing")  # <group>.retry is inside the pipeline's allow-list
    other = pipe.dest("audit")
    n = 40
    cfg = TimerConfig.from_env({k: v for k, v in pipe.env.items() if k.startswith("TW_")})
    levels = parse_delay_levels(LEVELS)
    calls: dict[str, list[tuple[float, Delivery]]] = {}
    seen: list[Delivery] = []
    lock = threading.Lock()

    def handle(d: Delivery) -> None:
        i = int((d.value or b"")[1:])
        with lock:
            calls.setdefault(f"m{i}", []).append((time.time(), d))
        if d.reconsume_times < i % 4:
            raise RuntimeError(f"m{i} fails at reconsume {d.reconsume_times}")

    log = KafkaCommitLog.from_config(cfg)
    billing = RetryConsumer(log, group, [topic], handle, config=cfg, max_reconsume_times=MAX_RECONSUME, batch_size=10)
    audit = RetryConsumer(log, other, [topic], seen.append, config=cfg, max_reconsume_times=MAX_RECONSUME)
    threads = [threading.Thread(target=c.run, args=(0.2,), daemon=True) for c in (billing, audit)]
    for t in threads:
        t.start()
    try:
        send(pipe, topic, n, 2)

        def finished() -> bool:
            with lock:
                handled = sum(1 for i in range(n) if len(calls.get(f"m{i}", [])) >= min(i % 4, MAX_RECONSUME) + 1)
            return handled == n and len(seen) >= n

        assert wait_for(finished, 120, pipe), f"not every record was handled to its end within 120 s\n{pipe.tails()}"
        time.sleep(2)  # a copy that should not exist has time to show
    finally:
        for c in (billing, audit):
            c.stop()
        for t in threads:
            t.join(30)
        billing.close()
        audit.close()
        log.close()
    for i in range(n):
        got = calls[f"m{i}"]
        assert [d.reconsume_times for _t, d in got] == list(range(min(i % 4, MAX_RECONSUME) + 1)), f"m{i}"
        origin = got[0][1].origin
        assert origin == (topic, i % 2, i // 2) and all(d.origin == origin for _t, d in got), f"m{i}"
        assert all(d.topic == f"{group}.retry" and d.key == f"k{i}".encode() for _t, d in got[1:]), f"m{i}"
        for (failed_at, _), (back_at, d) in zip(got, got[1:], strict=False):
            wait_ms = levels[2 + d.reconsume_times - 1]
            assert (back_at - failed_at) * 1000 >= wait_ms - 5, f"m{i}: retry {d.reconsume_times} came early"
    assert sorted((d.topic, d.reconsume_times, d.value) for d in seen) == \
        sorted((topic, 0, f"m{i}".encode()) for i in range(n)), "the other group saw only the originals, once"
    dead = read_all(pipe, f"{group}.dlq")
    assert sorted(r.value or b"" for r in dead) == sorted(f"m{i}".encode() for i in range(n) if i % 4 == 3)
    for r in dead:
        i = int((r.value or b"")[1:])
        assert r.header("tw-reconsume-times") == str(MAX_RECONSUME).encode()
        assert r.header("tw-error") == f"RuntimeError: m{i} fails at reconsume {MAX_RECONSUME}".encode()
        assert (r.header("tw-origin-topic"), r.header("tw-origin-offset")) == (topic.encode(), str(i // 2).encode())
    assert read_all(pipe, f"{other}.retry") == [] and read_all(pipe, f"{other}.dlq") == []


def test_a_consumer_killed_between_handling_and_committing_loses_nothing(pipe: Pipeline, tmp_path: Path) -> None:
    """Each kill leaves at most one batch uncommitted: each of its records may be handled again,
    and one that failed may have been scheduled twice. So duplicated outcomes (successes and dead
    letters of one record beyond the first) are at most BATCH per kill."""
    topic = pipe.new_dest("crash", 3)
    group = pipe.dest("crashgroup")
    n, batch, kills = 160, 8, 6
    send(pipe, topic, n, 3)
    outcomes = tmp_path / "outcomes"
    log_path = tmp_path / "worker.log"
    rng = random.Random(17)
    env = {**pipe.env, "PYTHONUNBUFFERED": "1"}

    def start(crash: str) -> subprocess.Popen[bytes]:
        with open(log_path, "ab") as out:
            out.write(f"=== worker, crash {crash} ===\n".encode())
            return subprocess.Popen([sys.executable, str(WORKER), group, topic, str(outcomes), str(batch),
                                     str(MAX_RECONSUME), crash], env=env, stdout=out, stderr=subprocess.STDOUT)

    # Every kind of point once, one more at random, in a random order; k-th time there at random.
    kinds = ["handling", "handled", "written", "commit", "committed"]
    kinds = rng.sample(kinds, len(kinds)) + [rng.choice(kinds)]
    assert len(kinds) == kills
    points: list[str] = []
    for point in kinds:
        k = rng.randint(1, batch if point in ("handling", "handled") else 2)
        points.append(f"{point}:{k}")
        worker = start(points[-1])
        try:
            code = worker.wait(90)
        except subprocess.TimeoutExpired:
            worker.kill()
            raise AssertionError(f"worker ({points[-1]}) did not reach its crash point:\n{tail(log_path)}") from None
        assert code == -signal.SIGKILL, f"worker ({points[-1]}) exited {code}:\n{tail(log_path)}"

    def lines() -> list[tuple[str, int]]:
        out = []
        for line in outcomes.read_text().splitlines() if outcomes.exists() else []:
            _origin, value, times = line.split()
            out.append((value, int(times)))
        return out

    def dead_letters() -> list[Record]:
        return read_all(pipe, f"{group}.dlq")

    want_ok = {f"m{i}" for i in range(n) if i % 4 != 3}
    want_dead = {f"m{i}" for i in range(n) if i % 4 == 3}
    worker = start("none")
    try:
        if wait_for(lambda: {v for v, _t in lines()} >= want_ok
                    and {(r.value or b"").decode() for r in dead_letters()} >= want_dead, 150, pipe):
            time.sleep(3)  # copies of retries scheduled twice are due within 1.5 s
    finally:
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(30)
    assert code == 0, f"the last worker did not stop cleanly:\n{tail(log_path)}"
    handled = lines()
    dead = [(r.value or b"").decode() for r in dead_letters()]
    lost = sorted((want_ok - {v for v, _t in handled}) | (want_dead - set(dead)), key=lambda v: int(v[1:]))
    assert not lost, f"lost after the kills {points}: {lost}\n{tail(log_path)}"
    assert {v for v, _t in handled} == want_ok and set(dead) == want_dead, "misrouted records"
    assert all(t == int(v[1:]) % 4 for v, t in handled), "a record succeeded at the wrong reconsume count"
    copies = Counter([v for v, _t in handled] + dead)
    duplicated = sum(c - 1 for c in copies.values())
    bound = batch * kills
    print(f"[retry crash] records={n} kills={kills} points={points} lost=0 duplicated={duplicated} bound={bound}",
          flush=True)
    assert duplicated <= bound < n
    assert os.path.getsize(outcomes) > 0
