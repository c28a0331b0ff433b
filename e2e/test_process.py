"""The process surface of a stage: configuration errors, probes, SIGTERM, the retention check,
and ``timerwheel run --kafka --redis`` (all five stages in one process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from harness import (
    STAGES,
    Collector,
    LoadRun,
    Pipeline,
    TimerProducer,
    free_port,
    is_ready,
    make_report,
    now_ms,
    tail,
)
from timerwheel.store.format import RECORD_SIZE

pytestmark = pytest.mark.e2e

BAD_VALUES = [
    ("TW_SHARDS", "two"),
    ("TW_SHARDS", "0"),
    ("TW_TICK_MS", "7"),
    ("TW_ROLL_WINDOW_MS", "soon"),
    ("TW_MAX_DELAY_MS", "0"),
    ("TW_ALLOW_TOPICS", "orders-(unclosed"),
    ("TW_HTTP_PORT", "99999"),
    ("TW_LEASE_TTL_MS", "10"),
    ("TW_FSYNC", "maybe"),
    ("TW_DLQ_TOPIC", "__timer"),
    ("TW_KAFKA_BOOTSTRAP", ""),
    ("TW_REDIS_URL", ""),
    ("TW_LOG_LEVEL", "chatty"),
]


@pytest.mark.parametrize(("var", "value"), BAD_VALUES, ids=[f"{v}={x or 'unset'}" for v, x in BAD_VALUES])
def test_a_bad_setting_stops_the_stage_with_one_line_naming_it(
    tmp_path: Path, var: str, value: str, kafka_bootstrap: str, redis_url: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TW_")}
    env.update({"TW_KAFKA_BOOTSTRAP": kafka_bootstrap, "TW_REDIS_URL": redis_url, "TW_DATA_DIR": str(tmp_path)})
    env[var] = value
    done = subprocess.run([sys.executable, "-m", "timerwheel.cli", "stage", "dequeue-put"], env=env,
                          capture_output=True, text=True, timeout=60)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert len(lines) == 1 and var in lines[0], done.stderr


def test_each_stage_answers_its_probes_and_stops_on_sigterm(
    tmp_path: Path, kafka_bootstrap: str, redis_url: str
) -> None:
    pipe = Pipeline(tmp_path, kafka_bootstrap, redis_url)
    dest = pipe.new_dest("a", 1)
    try:
        # Live at once; ready once it runs, owning a shard or not (readiness is not ownership: a
        # one-replica rollout would deadlock); it owns none until enqueue-put creates the shards.
        pipe.start("dequeue-get", wait_ready=False)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if pipe.http("dequeue-get", "/healthz")[0] == 200:
                    break
            except OSError:
                time.sleep(0.1)
        assert pipe.http("dequeue-get", "/healthz") == (200, "ok\n"), tail(pipe.procs["dequeue-get"].log_path)
        deadline = time.monotonic() + 30
        while not pipe.ready("dequeue-get"):
            assert time.monotonic() < deadline, tail(pipe.procs["dequeue-get"].log_path)
            time.sleep(0.1)
        assert pipe.owns("dequeue-get") == 0
        pipe.start_all_missing()
        assert pipe.http("dequeue-get", "/readyz") == (200, "ready\n")
        deadline = time.monotonic() + 30
        while (pipe.owns("enqueue-put"), pipe.owns("dequeue-get")) != (2, 2):  # the one replica owns both
            assert time.monotonic() < deadline, pipe.tails()
            time.sleep(0.1)

        with TimerProducer(pipe) as producer, Collector(pipe, [dest]) as collector:
            sent = [producer.schedule(dest, now_ms() + 500) for _ in range(20)]
            producer.flush()
            assert not collector.wait_for([m.message_id for m in sent], 30, pipe), pipe.tails()
            rep = make_report("probes", producer, collector)
            assert (rep.scheduled, rep.delivered, rep.lost, rep.duplicated, rep.early + rep.early_received, rep.unexpected) == \
                (20, 20, [], 0, [], []), rep.line()
        for name in STAGES:
            code, body = pipe.http(name, "/healthz")
            assert (code, body) == (200, "ok\n"), name
            assert pipe.http(name, "/readyz")[0] == 200, name
            code, body = pipe.http(name, "/metrics")
            assert code == 200 and "# TYPE timerwheel_" in body, (name, body[:300])
            assert pipe.http(name, "/nothing")[0] == 404
        assert "timerwheel_delivered_total" in pipe.http("dequeue-put", "/metrics")[1]
        assert "timerwheel_scheduled_total" in pipe.http("enqueue-get", "/metrics")[1]
        assert "timerwheel_timerlog_records_total" in pipe.http("enqueue-put", "/metrics")[1]

        for name in STAGES:
            started = time.monotonic()
            code = pipe.stop(name, timeout_s=15)
            took = time.monotonic() - started
            assert code == 0, f"{name} exited with {code} on SIGTERM\n{tail(pipe.procs[name].log_path)}"
            assert took < 8, f"{name} took {took:.1f} s to stop"
            assert '"event":"stopped"' in tail(pipe.procs[name].log_path, 5), name
        # enqueue-put published a final checkpoint with every record it wrote: the 20 messages,
        # one 64-byte TimerLog record each, across the two shards (fresh TimerLogs start at 0).
        ckpts = [pipe.checkpoint(shard) for shard in range(2)]
        assert sum(c["flushed_pos"] for c in ckpts) == 20 * RECORD_SIZE, ckpts
        assert all(c["epoch"] >= 1 for c in ckpts), ckpts
    finally:
        pipe.stop_all()


#: Duplicates a rolling update may cause, of the messages scheduled: the code before dequeue-put
#: drained on SIGTERM delivered 3.7 % twice (54 of 1461), 0 since.
ROLLING_DUPLICATE_FRACTION = 0.01


def test_a_rolling_update_of_every_stage_under_load_loses_nothing_and_repeats_almost_nothing(
    tmp_path: Path, kafka_bootstrap: str, redis_url: str
) -> None:
    """As a Deployment rolls (maxSurge 1, maxUnavailable 0): a new process of each stage is ready
    before the old one gets SIGTERM, all five stages at once, under 50 msg/s. The old dequeue-put
    releases what it holds at its time before it leaves and its heartbeat ends at once, so the old
    dequeue-get's drain settles and its successor does not read again what was delivered."""
    pipe = Pipeline(tmp_path, kafka_bootstrap, redis_url, shards=2)
    dest = pipe.new_dest("rolling", 4)
    failed: list[str] = []

    def roll(name: str) -> None:
        try:
            pipe.start(f"{name}#2")
            pipe.stop(name)
        except AssertionError as exc:
            failed.append(f"{name}: {exc}")

    with pipe.running(), LoadRun(pipe, dest, seed=31, rate=50, min_delay_ms=1_000, max_delay_ms=5_000) as run:
        time.sleep(4)
        threads = [threading.Thread(target=roll, args=(name,)) for name in STAGES]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failed, failed
        time.sleep(3)
        missing, rep = run.drain("rolling update", 60)
        stopped = {name: pipe.procs[name].popen.returncode for name in STAGES}  # type: ignore[union-attr]
    print(rep.line(), flush=True)
    assert stopped == dict.fromkeys(STAGES, 0), stopped
    assert not missing and not rep.lost and not rep.early, rep.line()
    assert rep.duplicated <= ROLLING_DUPLICATE_FRACTION * rep.scheduled, rep.line()
    drained = [e for e in pipe.log_lines("dequeue-put") if e.get("event") == "drained on stop"]
    assert drained and drained[-1]["held"] == 0, drained


def test_a_timer_topic_retention_below_one_and_a_half_roll_windows_is_refused(
    tmp_path: Path, kafka_bootstrap: str, redis_url: str
) -> None:
    pipe = Pipeline(tmp_path, kafka_bootstrap, redis_url, roll_window_ms=20_000)
    pipe.create_timer_topic({"retention.ms": "25000"})  # needs 30000
    try:
        for name in ("enqueue-get", "enqueue-put"):
            proc = pipe.start(name, wait_ready=False)
            assert proc.popen is not None
            code = proc.popen.wait(60)
            log = tail(proc.log_path)
            assert code != 0, log
            assert "retention.ms=25000" in log and "TW_ROLL_WINDOW_MS" in log, log
            errors = [line for line in log.splitlines() if line.startswith("timerwheel: error")]
            assert len(errors) == 1, log
    finally:
        pipe.stop_all()


def test_run_with_kafka_and_redis_runs_all_five_stages_in_one_process(
    tmp_path: Path, kafka_bootstrap: str, redis_url: str
) -> None:
    pipe = Pipeline(tmp_path, kafka_bootstrap, redis_url)
    dest = pipe.new_dest("a", 2)
    port = free_port()
    env = dict(pipe.env, TW_HTTP_PORT=str(port))
    log_path = tmp_path / "logs" / "run.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "timerwheel.cli", "run", "--kafka", kafka_bootstrap,
                                 "--redis", pipe.redis_url, "--data-dir", str(tmp_path / "one")],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not is_ready(port):
            assert proc.poll() is None and time.monotonic() < deadline, tail(log_path)
            time.sleep(0.2)
        with TimerProducer(pipe) as producer, Collector(pipe, [dest]) as collector:
            sent = [producer.schedule(dest, now_ms() + i * 50) for i in range(100)]
            cancelled = sent[50]
            producer.cancel(cancelled)
            producer.flush()
            missing = collector.wait_for(producer.expected(), 30)
            time.sleep(1)
            rep = make_report("run-all-in-one", producer, collector)
            assert not missing and not rep.lost and not rep.duplicated, (rep.line(), tail(log_path))
            assert list((tmp_path / "one" / "shard-0000").glob("enqueue.*.ckpt"))  # the epoch-named checkpoint
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        pipe.stop_all()
    assert code == 0, tail(log_path)


def test_a_stage_waits_for_an_unreachable_broker_live_not_ready_and_stops_at_once(
    tmp_path: Path, kafka_bootstrap: str, redis_url: str
) -> None:
    pipe = Pipeline(tmp_path, kafka_bootstrap, redis_url)
    pipe.add("enqueue-get", TW_KAFKA_BOOTSTRAP=f"127.0.0.1:{free_port()}")  # nothing listens there
    try:
        pipe.start("enqueue-get", wait_ready=False)
        deadline = time.monotonic() + 30
        while True:
            try:
                if pipe.http("enqueue-get", "/healthz")[0] == 200:
                    break
            except OSError:
                assert time.monotonic() < deadline and pipe.procs["enqueue-get"].alive(), \
                    tail(pipe.procs["enqueue-get"].log_path)
                time.sleep(0.1)
        time.sleep(3)
        assert pipe.procs["enqueue-get"].alive(), tail(pipe.procs["enqueue-get"].log_path)
        assert pipe.http("enqueue-get", "/readyz")[0] == 503
        started = time.monotonic()
        assert pipe.stop("enqueue-get", timeout_s=15) == 0, tail(pipe.procs["enqueue-get"].log_path)
        assert time.monotonic() - started < 5
    finally:
        pipe.stop_all()
