"""Production-mode benchmarks (issue 4): the five stages as separate processes on real Kafka and Redis.

* ``production.throughput``: N timer messages already due, written to the timer topic before the
  pipeline runs; messages/s from the moment enqueue-get starts consuming to the last delivery,
  beside a plain kafka-python consume-then-produce pass-through of the same records (same client,
  acks=all, measured in the same run). The ratio is the figure.
* ``production.lateness``: a steady rate (default 500 msg/s) for S seconds (default 60), tick
  100 ms, delays 2-10 s, due on whole seconds (a burst each second) and then uniform
  (``TW_BENCH_DUE``): lateness three ways (``bench.lateness``: ``tw-delivered-at``, the
  destination record's Kafka timestamp, the receive time of a consumer in a process of its own),
  p50 / p99 / max and early of each, lost and duplicated; ``sustained`` says whether it kept up; each stage process's CPU.
  With ``TW_BENCH_BASELINE`` the baseline revision's run follows the current code's for each
  due mode. Then the current code with ``TW_CANCEL_LEAD_MS=500`` (``TW_BENCH_PROD_LEAD_MS``; 0
  skips it), whole seconds (``production.lateness.lead``).
* ``production.burst``: N messages (default 200,000) due in the same second: time to drain,
  messages/s, and the peak RSS (VmHWM) of each stage process.
* ``production.large_burst`` (issue 16): 500, 1,500 and 5,000 records of 800 KB due in the same
  second (``TW_BENCH_LARGE_BURSTS``) with the byte bounds' defaults, and 500 with byte bounds far
  above the burst (``TW_BENCH_LARGE_UNBOUNDED``; as before the bounds: keep it small, it grows
  linearly): drain messages/s, peak RSS of each stage process, peak Redis ``used_memory``.
  ``TW_BENCH_LARGE_SETTINGS`` (``batch_bytes=8388608,queue_bytes=...``) sets settings of both.
* ``production.compressed``: the throughput run three times in a row, with the timer topic's
  batches written uncompressed, lz4 and zstd (as producers in the field write them): messages/s of
  each and the ratio of each codec to uncompressed.
* ``production.shared_volume``: throughput (as above) and lateness at the lateness rate for
  ``TW_BENCH_SHARED_SECONDS`` (30), each with the data directory as a plain directory, through
  one ``bindfs -o auto_cache`` mount for every stage, and with the enqueue stages on one mount
  and the dequeue stages on another (two page caches: two nodes of an NFS volume), in one run.
* ``production.sasl_ssl``: the throughput run twice in a row on one broker started with a SASL_SSL
  listener beside its plaintext one (``TW_KAFKA_INSTANCE=secure TW_KAFKA_SASL_SSL=true
  scripts/kafka.sh up``): plaintext Kafka and Redis, then every connection secured (Kafka over
  SASL_SSL with SCRAM-SHA-512, Redis over TLS with a password, ``TW_REDIS_TLS``): messages/s of
  each and the ratio secured / plaintext.
* ``production.idle``: the five stages with no traffic for ``TW_BENCH_IDLE_SECONDS`` (30): CPU
  of each stage process and of Redis in % of a core (psutil cpu_times deltas; issue 13), then, on
  the same pipeline, lateness p50 / p99 at ``TW_BENCH_IDLE_RATE`` (200) msg/s for as long, delays
  1-5 s (``production.idle.lateness``): idling must not cost a due message its tick.
* ``production.guarantee`` (issue 31): ``TW_DELIVERY_GUARANTEE`` at-least-once against
  exactly-once, alternately in one run, ``TW_BENCH_GUARANTEE_ROUNDS`` (2) rounds of each: the
  throughput (as above, without the pass-through) with the clock stopped by a consumer reading
  ``read_committed`` that has read every record (``wait_consumed``), then the lateness at the
  lateness rate for ``TW_BENCH_GUARANTEE_SECONDS`` (30), whole seconds (the receiver reads
  ``read_committed`` always); medians, the ratios exactly-once / at-least-once, lost and
  duplicated, and the failed delivery transactions the stage logs show.
* ``production.brokers`` (issue 31): both guarantees on one broker and on a three-broker cluster
  (``TW_KAFKA_INSTANCE=bench-cluster3 TW_KAFKA_BROKERS=3 scripts/kafka.sh``, started and stopped
  here), throughput and lateness as ``production.guarantee``, ``TW_BENCH_BROKERS_ROUNDS`` (1)
  rounds: the cost of replication 3 against one broker.
* ``production.slot_reads``: dequeue-getmsg's read pattern alone: a producer at the lateness rate
  with delays 1-5 s, and every 100 ms a ``KafkaCommitLog.read`` of the positions due in the slot
  that just closed: read time p50 / p90 and how far behind the reader ends, with the cache of
  records read in passing and without it (``read_cache_records=0``), side by side.

Sizes: ``TW_BENCH_PROD_N`` (throughput, default 20,000), ``TW_BENCH_PROD_RATE`` (500),
``TW_BENCH_PROD_SECONDS`` (60), ``TW_BENCH_DELAYS_MS`` (lateness, ``2000,10000``: the shortest and
longest delay), ``TW_BENCH_PROD_BURST`` (200,000), ``TW_BENCH_DUE`` (comma list of
whole_second, uniform). ``TW_BENCH_PROD_ONLY``: comma list of throughput, compressed, sasl_ssl,
lateness, burst, large_burst, idle, slot_reads, shared_volume, guarantee, brokers, or ``all``; by default
throughput, lateness, burst, idle, guarantee and brokers (``DEFAULT_ONLY``). ``TW_BENCH_BASELINE=<git
rev>``: throughput, lateness, burst and idle run that revision's stage processes too, alternately
with the current code (``bench.baseline``), each row labelled ``code``. Kafka and Redis: ``TW_KAFKA_BOOTSTRAP`` /
``TW_REDIS_URL``, else the servers of ``scripts/kafka.sh up`` / ``scripts/redis.sh up``. Shards:
2, timer partitions: 4. One production benchmark at a time per Redis server: each run numbers its
Redis databases from 1.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from bench.baseline import CURRENT, Code, codes
from bench.common import emit, percentile, say
from bench.lateness import DELAYS_MS, DUE_MODES
from bench.load import TimerwheelWire
from bench.steady import keeps_up, steady

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "e2e"))

sys.path.insert(0, str(ROOT / "tests"))

from harness import STAGES, PeakSampler, Pipeline, now_ms  # noqa: E402 - the e2e harness runs the processes
from two_mounts import TwoMounts, two_mounts  # noqa: E402 - two bindfs mounts: two nodes on one machine

PARTITIONS = 4
VALUE = b"x" * 100


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, "") or default)


def servers(names: tuple[str, ...] = ("kafka", "redis")) -> tuple[str, str]:
    """(Kafka bootstrap, Redis URL): from the environment, else the script-managed servers."""
    kafka, redis_url = os.environ.get("TW_KAFKA_BOOTSTRAP", ""), os.environ.get("TW_REDIS_URL", "")
    for name, value in (("kafka", kafka), ("redis", redis_url)):
        if not value and name in names:
            subprocess.run([str(ROOT / "scripts" / f"{name}.sh"), "up"], check=True, cwd=ROOT, timeout=900)
    env: dict[str, str] = {}
    for name in ("kafka", "redis"):
        path = ROOT / ".run" / f"{name}.env"
        if path.exists():
            for line in path.read_text().splitlines():
                key, _, value = line.partition("=")
                env[key.strip()] = value.strip()
    return kafka or env.get("TW_KAFKA_BOOTSTRAP", ""), redis_url or env.get("TW_REDIS_URL", "")


def secure_servers() -> tuple[dict[str, str], dict[str, str]]:
    """The ``.env`` settings of the broker with a SASL_SSL listener and of the Redis requiring TLS
    and a password, started by the scripts (as the tests' ``secure_kafka`` / ``secure_redis``)."""
    out = []
    for name, env in (("kafka", {"TW_KAFKA_INSTANCE": "secure", "TW_KAFKA_SASL_SSL": "true"}),
                      ("redis", {"TW_REDIS_INSTANCE": "secure", "TW_REDIS_TLS": "true"})):
        subprocess.run([str(ROOT / "scripts" / f"{name}.sh"), "up"], check=True, cwd=ROOT, timeout=900,
                       env={**os.environ, **env})
        settings: dict[str, str] = {}
        for line in (ROOT / ".run" / f"{name}-secure.env").read_text().splitlines():
            key, _, value = line.partition("=")
            settings[key.strip()] = value.strip()
        out.append(settings)
    return out[0], out[1]


def _producer(kafka: str, compression: str | None = None, options: dict[str, Any] | None = None) -> KafkaProducer:
    return KafkaProducer(bootstrap_servers=kafka, acks="all", linger_ms=5, batch_size=256 * 1024,
                         compression_type=compression, **(options or {}))


def fill(kafka: str, topic: str, dest: str, n: int, deliver_at: int, compression: str | None = None,
         options: dict[str, Any] | None = None, value: bytes = VALUE) -> float:
    """Write n timer records due at ``deliver_at`` across the timer partitions; returns seconds."""
    producer = _producer(kafka, compression, options)
    t0 = time.perf_counter()
    due = str(deliver_at).encode()
    for i in range(n):
        producer.send(topic, key=b"%d" % i, value=value, partition=i % PARTITIONS,
                      headers=[("tw-topic", dest.encode()), ("tw-deliver-at", due), ("tw-id", b"m%d" % i)])
    producer.flush()
    elapsed = time.perf_counter() - t0
    producer.close()
    return elapsed


def end_total(consumer: KafkaConsumer, topic: str) -> int:
    tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
    return sum(consumer.end_offsets(tps).values()) if tps else 0


def wait_delivered(consumer: KafkaConsumer, topic: str, n: int, timeout_s: float) -> float | None:
    """Block until ``topic`` holds n records; the time.monotonic() it did, None on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if end_total(consumer, topic) >= n:
            return time.monotonic()
        time.sleep(0.05)
    return None


def pass_through(kafka: str, source: str, n: int, options: dict[str, Any] | None = None) -> float:
    """Consume n records of ``source`` and produce each to a new topic, as the pipeline's clients do
    (kafka-python, acks=all, idempotent); messages/s from the first poll to the last ack."""
    dest = f"{source}-copy"
    consumer = KafkaConsumer(bootstrap_servers=kafka, group_id=None, enable_auto_commit=False,
                             auto_offset_reset="earliest", max_poll_records=2000, **(options or {}))
    tps = [TopicPartition(source, p) for p in range(PARTITIONS)]
    consumer.assign(tps)
    consumer.seek_to_beginning(*tps)
    producer = KafkaProducer(bootstrap_servers=kafka, acks="all", enable_idempotence=True, linger_ms=5,
                             batch_size=512 * 1024, **(options or {}))
    moved = 0
    t0 = time.perf_counter()
    while moved < n:
        for recs in consumer.poll(timeout_ms=200, max_records=2000).values():
            for r in recs:
                producer.send(dest, key=r.key, value=r.value, headers=list(r.headers or ()))
            moved += len(recs)
    producer.flush()
    elapsed = time.perf_counter() - t0
    producer.close()
    consumer.close()
    return n / elapsed


def new_pipeline(kafka: str, redis_url: str, mounts: TwoMounts | None = None,
                 tw_env: dict[str, str] | None = None, code: Code = CURRENT, **settings: Any) -> Pipeline:
    """The five stage processes of one benchmark run, not started yet. Every stage process a
    benchmark starts comes from here: ``code`` says whose timerwheel they run (the current
    checkout, or a baseline revision's ``libs/`` through PYTHONPATH: ``bench.baseline``)."""
    work = Path(tempfile.mkdtemp(prefix="tw-bench-prod-")) if mounts is None else mounts.base.parent.parent
    settings.setdefault("fsync", "true")
    settings.setdefault("roll_window_ms", 3_600_000)
    settings.setdefault("wheel_span_ms", 2 * int(settings["roll_window_ms"]))
    settings.setdefault("batch_size", 500)
    settings.setdefault("max_in_flight", 20_000)
    settings.setdefault("lease_ttl_ms", 10_000)
    settings.setdefault("timer_partitions", PARTITIONS)
    pipe = Pipeline(work, kafka, redis_url, mounts=mounts, tw_env=tw_env, **settings)
    pipe.env.update(code.env(pipe.env))
    pipe.env["TW_LOG_LEVEL"] = "WARNING"
    return pipe


#: What dequeue-put logs (a warning) each time an exactly-once delivery transaction fails.
TRANSACTION_FAILED = "delivery transaction failed"


def exactly_once_counts(pipe: Pipeline) -> dict[str, int]:
    """``transaction_failures``: how many times the stage logs say a delivery transaction failed;
    ``progress_offsets``: the end offsets of the pipeline's progress topic, summed (its progress
    records and their transactions' commit markers: 0, no topic, at least once)."""
    failures = sum(path.read_text(errors="replace").count(TRANSACTION_FAILED) for path in pipe.log_dir.glob("*.log"))
    topic, offsets = f"{pipe.timer_topic}_progress", 0
    if topic in pipe.admin.list_topics():  # asked first: a consumer's metadata request would create it
        consumer = KafkaConsumer(bootstrap_servers=pipe.kafka, group_id=None, **pipe.kafka_options)
        try:
            tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
            offsets = sum(consumer.end_offsets(tps).values())
        finally:
            consumer.close()
    return {"transaction_failures": failures, "progress_offsets": offsets}


def close(pipe: Pipeline) -> None:
    pipe.stop_all()
    if pipe.mounts is None:
        shutil.rmtree(pipe.workdir, ignore_errors=True)


@contextmanager
def layout(name: str) -> Iterator[TwoMounts | None]:
    """The data directory as ``name`` says: ``local`` (a plain directory), ``one-mount`` (every
    stage through one ``bindfs -o auto_cache`` mount of it) or ``two-mounts`` (the enqueue stages
    through one mount, the dequeue stages through another: two page caches, as two nodes of an
    NFS volume)."""
    if name == "local":
        yield None
        return
    work = Path(tempfile.mkdtemp(prefix="tw-bench-prod-"))
    try:
        with two_mounts(work / "volume") as mounts:
            yield mounts if name == "two-mounts" else TwoMounts(mounts.base, mounts.a, mounts.a)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def wait_consumed(consumer: KafkaConsumer, n: int, timeout_s: float, keys: set[bytes]) -> tuple[float | None, int]:
    """Poll the topics ``consumer`` is assigned until it has read n distinct keys (added to
    ``keys``): (the time.monotonic() it did or None on timeout, records read). What a reader of
    the destination gets, unlike ``wait_delivered``: a transaction's records count once committed,
    and its commit markers, which take offsets too, not at all."""
    deadline, records = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline:
        for recs in consumer.poll(timeout_ms=100, max_records=10_000).values():
            records += len(recs)
            keys.update(r.key for r in recs)
        if len(keys) >= n:
            return time.monotonic(), records
    return None, records


def throughput(kafka: str, redis_url: str, n: int, mounts: TwoMounts | None = None,
               bench_name: str = "production.throughput", compression: str | None = None, baseline: bool = True,
               tw_env: dict[str, str] | None = None, figure: bool = True, code: Code = CURRENT,
               settings: dict[str, Any] | None = None, read_committed: bool = False,
               report: dict[str, Any] | None = None, **labels: Any) -> tuple[float, float | None]:
    """The pipeline's messages/s for n due records (written with ``compression``) and, with
    ``baseline``, the pass-through's (its figure emitted unless ``figure`` is false). ``mounts``:
    the data directory's layout; ``tw_env``: security settings of every client; ``settings``:
    the stages' own (``new_pipeline``). ``read_committed``: the clock stops when a consumer of the
    destination reading ``read_committed`` has read n distinct records (``wait_consumed``: a reader
    of exactly-once deliveries), not when the topic's end offsets add up to n; ``report`` then
    gets the records read (``records``, duplicates included, and 2 s more after the last),
    ``lost`` and ``duplicated``, and ``exactly_once_counts``."""
    pipe = new_pipeline(kafka, redis_url, mounts, tw_env, code, **(settings or {}))
    dest = pipe.dest("tp")
    reader: dict[str, Any] = {"enable_auto_commit": False, "auto_offset_reset": "earliest", "fetch_max_wait_ms": 100,
                              "isolation_level": "read_committed"} if read_committed else {}
    consumer = KafkaConsumer(bootstrap_servers=kafka, group_id=None, **reader, **pipe.kafka_options)
    try:
        pipe.create_timer_topic()
        pipe.create_topic(dest, PARTITIONS)
        if read_committed:
            tps = [TopicPartition(dest, p) for p in range(PARTITIONS)]
            consumer.assign(tps)
            consumer.seek_to_beginning(*tps)
        fill_s = fill(kafka, pipe.timer_topic, dest, n, now_ms(), compression, pipe.kafka_options)
        say(f"throughput: {n:,} due records ({compression or 'uncompressed'}) written to the timer topic "
            f"in {fill_s:.1f} s")
        for name in ("enqueue-put", "dequeue-get", "dequeue-getmsg", "dequeue-put"):
            pipe.start(name, wait_ready=False)
        for name in ("enqueue-put", "dequeue-get", "dequeue-getmsg", "dequeue-put"):
            pipe.wait_ready(name, 120)
        pipe.start("enqueue-get", wait_ready=False)
        while not pipe.ready("enqueue-get"):  # ready = its first poll is done: the clock starts
            assert pipe.procs["enqueue-get"].alive(), pipe.tails(["enqueue-get"])
            time.sleep(0.01)
        t0 = time.monotonic()
        if read_committed:
            keys: set[bytes] = set()
            t1, records = wait_consumed(consumer, n, 600, keys)
        else:
            t1 = wait_delivered(consumer, dest, n, 600)
        if t1 is None:
            raise RuntimeError(f"throughput: not all {n} delivered within 600 s\n{pipe.tails()}")
        rate = n / (t1 - t0)
        if read_committed and report is not None:
            _t, more = wait_consumed(consumer, n + 1, 2.0, keys)  # duplicates coming late
            report.update(records=records + more, lost=n - len(keys), duplicated=records + more - len(keys),
                          seconds=round(t1 - t0, 2), **exactly_once_counts(pipe))
        if not baseline:
            say(f"five-process pipeline, timer topic {compression or 'uncompressed'}: {rate:,.0f} msg/s")
            return rate, None
        base = pass_through(kafka, pipe.timer_topic, n, pipe.kafka_options)
        say(f"five-process pipeline {rate:,.0f} msg/s; kafka-python pass-through {base:,.0f} msg/s")
        if not figure:
            return rate, base
        emit(bench_name, rate, "messages/s", messages=n, seconds=round(t1 - t0, 2),
             passthrough_per_s=round(base), ratio=round(rate / base, 3), shards=2, timer_partitions=PARTITIONS,
             code=code.name, **labels)
        return rate, base
    finally:
        consumer.close()
        close(pipe)


def compressed(kafka: str, redis_url: str, n: int) -> None:
    """Throughput with the timer topic uncompressed, lz4 and zstd, one after the other in this run."""
    rates = {codec: throughput(kafka, redis_url, n, compression=None if codec == "none" else codec, baseline=False)[0]
             for codec in ("none", "lz4", "zstd")}
    say("timer topic compressed: " + ", ".join(f"{c} {r:,.0f} msg/s" for c, r in rates.items()))
    emit("production.compressed", rates["lz4"], "messages/s", messages=n, uncompressed_per_s=round(rates["none"]),
         lz4_per_s=round(rates["lz4"]), zstd_per_s=round(rates["zstd"]),
         lz4_ratio=round(rates["lz4"] / rates["none"], 3), zstd_ratio=round(rates["zstd"] / rates["none"], 3))


#: Runs of each kind in ``production.sasl_ssl``.
SASL_SSL_ROUNDS = 3


def sasl_ssl(redis_url: str, n: int) -> None:
    """Throughput with plaintext connections, then with every connection secured, on one broker."""
    kafka, redis = secure_servers()
    secured_env = {
        "TW_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "TW_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "TW_KAFKA_SASL_USERNAME": kafka["TW_KAFKA_SASL_SSL_USERNAME"],
        "TW_KAFKA_SASL_PASSWORD_FILE": kafka["TW_KAFKA_SASL_SSL_PASSWORD_FILE"],
        "TW_KAFKA_SSL_CAFILE": kafka["TW_KAFKA_SASL_SSL_CAFILE"],
        "TW_REDIS_PASSWORD_FILE": redis["TW_REDIS_PASSWORD_FILE"], "TW_REDIS_SSL_CAFILE": redis["TW_REDIS_SSL_CAFILE"],
    }
    # Alternated, median of each: on a shared machine one run's noise exceeds the difference. The
    # kafka-python pass-through of each run (one process, no Redis) shows the clients' TLS cost alone.
    runs: dict[str, list[tuple[float, float]]] = {"plaintext": [], "secured": []}
    for _ in range(SASL_SSL_ROUNDS):
        for kind, bootstrap, url, env in (("plaintext", kafka["TW_KAFKA_BOOTSTRAP"], redis_url, None),
                                          ("secured", kafka["TW_KAFKA_SASL_SSL_BOOTSTRAP"], redis["TW_REDIS_URL"],
                                           secured_env)):
            rate, base = throughput(bootstrap, url, n, tw_env=env, figure=False)
            runs[kind].append((rate, base or 0.0))

    def median(kind: str, i: int) -> float:
        values = sorted(r[i] for r in runs[kind])
        return values[len(values) // 2]

    plain, secured = median("plaintext", 0), median("secured", 0)
    say(f"pipeline: plaintext {plain:,.0f} msg/s, SASL_SSL (SCRAM-SHA-512) + Redis TLS {secured:,.0f} msg/s; "
        f"pass-through: plaintext {median('plaintext', 1):,.0f}, SASL_SSL {median('secured', 1):,.0f} msg/s "
        f"(medians of {SASL_SSL_ROUNDS} alternated runs each)")
    emit("production.sasl_ssl", secured, "messages/s", messages=n, plaintext_per_s=round(plain),
         ratio=round(secured / plain, 3), passthrough_plaintext_per_s=round(median("plaintext", 1)),
         passthrough_sasl_ssl_per_s=round(median("secured", 1)),
         passthrough_ratio=round(median("secured", 1) / median("plaintext", 1), 3), rounds=SASL_SSL_ROUNDS,
         runs={k: [[round(a), round(b)] for a, b in v] for k, v in runs.items()},
         kafka="SASL_SSL SCRAM-SHA-512", redis="rediss:// + password")


def _lateness_run(kafka: str, redis_url: str, rate: int, seconds: float, mounts: TwoMounts | None = None,
                  lead_ms: int = 0, due_mode: str = "whole_second", code: Code = CURRENT,
                  settings: dict[str, Any] | None = None, delays_ms: tuple[int, int] = DELAYS_MS) -> dict[str, Any]:
    """A fresh pipeline of ``code``, ``rate`` msg/s for ``seconds`` through it (``bench.steady``,
    whose consumer reads ``read_committed``); ``settings``: more of the stages' own. The result
    has ``exactly_once_counts`` too, and ``cpu``: each stage process's CPU over the run, in % of a core."""
    pipe = new_pipeline(kafka, redis_url, mounts, code=code, tick_ms=100, batch_size=200, max_in_flight=5_000,
                        cancel_lead_ms=lead_ms, **(settings or {}))
    dest = pipe.dest("late")
    try:
        pipe.create_timer_topic()
        pipe.create_topic(dest, PARTITIONS)
        pipe.start_all(120)
        meter = CpuMeter({name: psutil.Process(pipe.procs[name].pid) for name in STAGES})
        result = steady(kafka, TimerwheelWire(pipe.timer_topic, dest, PARTITIONS), dest, rate, seconds, due_mode,
                        delays_ms=delays_ms, options=pipe.kafka_options)
        return {**result, **exactly_once_counts(pipe), "cpu": meter.percent(1)}
    finally:
        close(pipe)


def emit_lateness(bench_name: str, result: dict[str, Any], **extra: Any) -> None:
    """One lateness figure: the value is the p99 by the destination record's Kafka timestamp;
    ``ways`` has p50 / p99 / max / early of each reading (``bench.lateness``)."""
    ways = result["lateness"]
    emit(bench_name, ways["timestamp"]["p99"], "ms", p50=ways["timestamp"]["p50"], max=ways["timestamp"]["max"],
         early=ways["timestamp"]["early"], ways=ways, due=result["due"], scheduled=result["expected"],
         delivered=result["delivered"], lost=result["lost"], duplicated=result["duplicated"],
         not_delivered_in_time=result["behind"], sustained=keeps_up(result), rate_per_s=result["rate_per_s"],
         seconds=result["seconds"], delays_ms=result["delays_ms"], tick_ms=100, **extra)


#: The cancel lead measured beside the default (0: strict) in ``production.lateness``.
LEAD_MS = 500


def lateness(kafka: str, redis_url: str, rate: int, seconds: float, modes: list[str], lead_ms: int,
             delays_ms: tuple[int, int] = DELAYS_MS) -> None:
    """Each due mode, each code (the current one, then the baseline: alternately), then the
    current code with ``TW_CANCEL_LEAD_MS=lead_ms`` (0: not run), whole-second due times."""
    for mode in modes:
        for code in codes():
            result = _lateness_run(kafka, redis_url, rate, seconds, due_mode=mode, code=code, delays_ms=delays_ms)
            say(f"lateness, {code.name}, due {mode}, {rate} msg/s for {seconds:.0f} s, delays {delays_ms[0]}-"
                f"{delays_ms[1]} ms: {result['summary']}; "
                f"lost {result['lost']}, duplicated {result['duplicated']}; CPU, % of a core: {result['cpu']}")
            emit_lateness("production.lateness.p99", result, code=code.name, cpu=result["cpu"])
    if lead_ms:
        lead = _lateness_run(kafka, redis_url, rate, seconds, lead_ms=lead_ms)
        say(f"lateness with TW_CANCEL_LEAD_MS={lead_ms}: {lead['summary']}")
        emit_lateness("production.lateness.lead.p99", lead, cancel_lead_ms=lead_ms, code=CURRENT.name)


def _redis_process(redis_url: str) -> psutil.Process | None:
    """The redis-server of ``redis_url`` if it runs on this machine (matched by its port), else None."""
    port = urlsplit(redis_url).port
    for proc in psutil.process_iter(["name", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or ())
        if "redis-server" in (proc.info["name"] or "") + cmdline and f":{port}" in cmdline:
            return proc
    return None


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


class CpuMeter:
    """The CPU of some processes from its making on, in % of one core (psutil cpu_times deltas)."""

    def __init__(self, procs: dict[str, psutil.Process]) -> None:
        self.procs = procs
        self.before = {name: _cpu_s(p) for name, p in procs.items()}
        self.started = time.monotonic()
        self.elapsed = 0.0

    def percent(self, digits: int) -> dict[str, float]:
        """Each process's CPU since, rounded to ``digits``; ``elapsed`` is then the seconds measured."""
        self.elapsed = time.monotonic() - self.started
        return {name: round(100 * (_cpu_s(p) - self.before[name]) / self.elapsed, digits)
                for name, p in self.procs.items()}


def idle(kafka: str, redis_url: str, seconds: float, rate: int, code: Code = CURRENT) -> None:
    """CPU of an idle installation, per stage process and Redis, then lateness on the same pipeline."""
    pipe = new_pipeline(kafka, redis_url, code=code, tick_ms=100, batch_size=200, max_in_flight=5_000)
    dest = pipe.dest("idle")
    try:
        pipe.create_timer_topic()
        pipe.create_topic(dest, PARTITIONS)
        pipe.start_all(120)
        procs = {name: psutil.Process(pipe.procs[name].pid) for name in STAGES}
        server = _redis_process(redis_url)
        if server is not None:
            procs["redis"] = server
        time.sleep(5)  # settle: the stages' first steps, the leases, the groups
        meter = CpuMeter(procs)
        time.sleep(seconds)  # the measured window: nothing is sent
        cpu = meter.percent(2)
        elapsed = meter.elapsed
        total = round(sum(cpu.values()), 2)
        say(f"idle CPU over {elapsed:.0f} s, % of a core: {cpu}, total {total}")
        emit("production.idle.cpu", total, "% of a core", per_process=cpu, seconds=round(elapsed),
             redis_measured=server is not None, tick_ms=100, code=code.name)
        result = steady(kafka, TimerwheelWire(pipe.timer_topic, dest, PARTITIONS), dest, rate, seconds,
                        "whole_second", options=pipe.kafka_options)
        say(f"lateness after idling, at {rate} msg/s: {result['summary']}")
        emit_lateness("production.idle.lateness.p99", result, code=code.name)
    finally:
        close(pipe)


def _due_burst(kafka: str, pipe: Pipeline, consumer: KafkaConsumer, dest: str, n: int, due: int, what: str,
               value: bytes = VALUE) -> tuple[float, float, int, float]:
    """Write n records due at ``due``, wait until they are in the TimerLogs and then until they
    are delivered: (seconds to produce, to enqueue, ms left before due when enqueued, to drain)."""
    t0 = time.monotonic()
    fill_s = fill(kafka, pipe.timer_topic, dest, n, due, value=value)
    while sum(sum(pipe.checkpoint(s)["next_offsets"].values()) for s in range(2)) < n:
        time.sleep(0.2)
    enqueue_s = time.monotonic() - t0
    left_ms = due - now_ms()
    say(f"{what}: {n:,} records produced in {fill_s:.1f} s, in the TimerLogs after {enqueue_s:.1f} s, "
        f"{left_ms / 1000:.1f} s before they are due")
    if left_ms > 0:
        time.sleep(left_ms / 1000)
    start = time.monotonic()
    t1 = wait_delivered(consumer, dest, n, 1800)
    if t1 is None:
        raise RuntimeError(f"{what}: not all {n} delivered within 1800 s\n{pipe.tails()}")
    return fill_s, enqueue_s, left_ms, t1 - start


@contextmanager
def _burst_pipeline(kafka: str, redis_url: str, name: str, code: Code = CURRENT,
                    **settings: Any) -> Iterator[tuple[Pipeline, str, KafkaConsumer]]:
    """The five stages running, a destination topic ``name`` and a consumer to count it."""
    pipe = new_pipeline(kafka, redis_url, code=code, queue_bound=64, batch_size=500, max_in_flight=20_000,
                        **settings)
    dest = pipe.dest(name)
    consumer = KafkaConsumer(bootstrap_servers=kafka, group_id=None)
    try:
        pipe.create_timer_topic()
        pipe.create_topic(dest, PARTITIONS)
        pipe.start_all(120)
        yield pipe, dest, consumer
    finally:
        consumer.close()
        close(pipe)


def burst(kafka: str, redis_url: str, n: int, code: Code = CURRENT) -> None:
    with _burst_pipeline(kafka, redis_url, "burst", code) as (pipe, dest, consumer):
        # Due far enough ahead that every record is in the TimerLog when the second comes.
        due = now_ms() + 10_000 + n // 5  # the enqueue side took ~6,000 msg/s here; due_late_s says if not
        _fill_s, enqueue_s, left_ms, drain = _due_burst(kafka, pipe, consumer, dest, n, due, "burst")
        rss = {name: round(pipe.vm_hwm_kb(name) / 1024, 1) for name in STAGES}
        say(f"burst drained in {drain:.1f} s ({n / drain:,.0f} msg/s); peak RSS MiB {rss}")
        emit("production.burst", n / drain, "messages/s", messages=n, drain_s=round(drain, 2),
             enqueue_s=round(enqueue_s, 2), enqueue_per_s=round(n / enqueue_s), due_late_s=round(max(0, -left_ms) / 1000, 1),
             peak_rss_mb=rss, code=code.name)


#: ``production.large_burst``: the record value, and byte bounds far above any burst (what the
#: pipeline did before TW_QUEUE_BYTES, TW_BATCH_BYTES and TW_READ_CACHE_BYTES: entry counts only).
LARGE_VALUE = b"L" * 800_000
UNBOUNDED = {"queue_bytes": 2**40, "batch_bytes": 2**40, "read_cache_bytes": 2**40}


def large_burst(kafka: str, redis_url: str, n: int, variant: str) -> None:
    """n records of 800 KB due in the same second (issue 16): drain messages/s, the peak RSS of
    each stage process (VmHWM) and the peak of Redis ``used_memory`` (sampled every 20 ms).
    ``variant``: "defaults" (the byte bounds' defaults) or "unbounded" (``UNBOUNDED``)."""
    settings: dict[str, Any] = dict(UNBOUNDED) if variant == "unbounded" else {}
    for pair in filter(None, os.environ.get("TW_BENCH_LARGE_SETTINGS", "").split(",")):  # e.g. batch_bytes=8388608
        key, _, value = pair.partition("=")
        settings[key.strip()] = value.strip()
    with _burst_pipeline(kafka, redis_url, "large", **settings) as (pipe, dest, consumer):
        with PeakSampler(pipe) as sampler:
            fill_s, enqueue_s, left_ms, drain = _due_burst(kafka, pipe, consumer, dest, n, now_ms() + 10_000 + n * 20,
                                                           f"large burst ({variant})", LARGE_VALUE)
            sampled = sampler.take()
        rss = {name: round(pipe.vm_hwm_kb(name) / 1024, 1) for name in STAGES}
        say(f"large burst ({variant}): {n:,} x 800 KB produced in {fill_s:.1f} s, drained in {drain:.1f} s "
            f"({n / drain:,.1f} msg/s); peak RSS MiB {rss}; Redis used_memory peak {sampled['redis']} MiB")
        emit("production.large_burst", n / drain, "messages/s", messages=n, value_bytes=len(LARGE_VALUE),
             variant=variant, drain_s=round(drain, 2), enqueue_s=round(enqueue_s, 2),
             due_late_s=round(max(0, -left_ms) / 1000, 1), peak_rss_mb=rss, redis_used_memory_peak_mb=sampled["redis"])


def _slot_reads(kafka: str, rate: int, seconds: float, cache: int) -> dict[str, Any]:
    from timerwheel.records import OutRecord
    from timerwheel.transports.kafka.log import KafkaCommitLog

    writer, reader = KafkaCommitLog(kafka, client_id="bench-w"), KafkaCommitLog(kafka, read_cache_records=cache)
    topic = f"bench-reads-{random.randrange(1 << 30):x}"
    writer.ensure_topic(topic, PARTITIONS)
    due: list[tuple[int, int, int]] = []  # (deliver_at, partition, offset)
    lock, stop = threading.Lock(), threading.Event()
    rng = random.Random(3)

    def produce() -> None:
        sent, t0 = 0, time.monotonic()
        while not stop.is_set():
            k = int((time.monotonic() - t0) * rate) - sent
            if k > 0:
                at = [now_ms() + rng.randint(1_000, 5_000) for _ in range(k)]
                pos = writer.append([OutRecord(topic, None, VALUE, (("h", b"v"),), partition=rng.randrange(PARTITIONS))
                                     for _ in range(k)])
                with lock:
                    due.extend((a, p, o) for a, (p, o) in zip(at, pos, strict=True))
                sent += k
            time.sleep(0.005)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
        time.sleep(6)  # the first slots due
        slot = now_ms() // 100 * 100 - 100
        took: list[float] = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            while now_ms() < slot + 100:
                time.sleep(0.002)
            with lock:
                wanted = [(p, o) for a, p, o in due if slot <= a < slot + 100]
            t0 = time.perf_counter()
            got = reader.read(topic, wanted)
            took.append((time.perf_counter() - t0) * 1000)
            if not all(got):
                raise RuntimeError("slot reads: a record that exists read as missing")
            slot += 100
        behind = now_ms() - slot
    finally:
        stop.set()
        thread.join(5)
        writer.close()
        reader.close()
    took.sort()
    return {"p50": round(percentile(took, 0.5), 1), "p90": round(percentile(took, 0.9), 1),
            "slots": len(took), "behind_ms": max(0, behind)}


def slot_reads(kafka: str, rate: int, seconds: float) -> None:
    on = _slot_reads(kafka, rate, seconds, 50_000)
    off = _slot_reads(kafka, rate, seconds, 0)
    say(f"slot reads at {rate} msg/s, delays 1-5 s: with the read cache p50 {on['p50']} ms "
        f"(behind {on['behind_ms']} ms at the end), without p50 {off['p50']} ms (behind {off['behind_ms']} ms)")
    emit("production.slot_reads.p50", on["p50"], "ms", p90=on["p90"], behind_ms=on["behind_ms"], slots=on["slots"],
         uncached_p50=off["p50"], uncached_p90=off["p90"], uncached_behind_ms=off["behind_ms"],
         uncached_slots=off["slots"], ratio=round(off["p50"] / max(on["p50"], 0.1), 1), rate_per_s=rate,
         seconds=seconds)


def shared_volume(kafka: str, redis_url: str, n: int, rate: int, seconds: float) -> None:
    """Throughput and lateness with the data directory seen from two nodes (``layout``), beside
    one mount and a plain directory, in the same run, one after the other."""
    layouts = ("local", "one-mount", "two-mounts")
    for name in layouts:
        for code in codes():
            with layout(name) as mounts:
                throughput(kafka, redis_url, n, mounts, "production.shared_volume.throughput", layout=name, code=code)
    for name in layouts:
        for code in codes():
            with layout(name) as mounts:
                result = _lateness_run(kafka, redis_url, rate, seconds, mounts, code=code)
            say(f"lateness, {name}, {code.name}: {result['summary']}")
            emit_lateness("production.shared_volume.lateness.p99", result, layout=name, code=code.name)


#: ``production.guarantee``: the two delivery guarantees, in the order each round runs them.
GUARANTEES = ("at-least-once", "exactly-once")


def guarantee(kafka: str, redis_url: str, n: int, rate: int, seconds: float, rounds: int) -> None:
    """``TW_DELIVERY_GUARANTEE`` at-least-once against exactly-once (issue 31), alternately in one
    run, ``rounds`` rounds: each round the throughput of each (n due at once, the clock stopped
    by a ``read_committed`` reader in both), then the lateness of each (``rate`` msg/s for
    ``seconds``, whole seconds, ``bench.steady``'s consumer reads ``read_committed``); medians."""
    tp: dict[str, list[float]] = {g: [] for g in GUARANTEES}
    tp_reports: dict[str, list[dict[str, Any]]] = {g: [] for g in GUARANTEES}
    late: dict[str, list[dict[str, Any]]] = {g: [] for g in GUARANTEES}
    for i in range(rounds):
        for g in GUARANTEES:
            report: dict[str, Any] = {}
            tp[g].append(throughput(kafka, redis_url, n, settings={"delivery_guarantee": g}, read_committed=True,
                                    baseline=False, report=report)[0])
            tp_reports[g].append(report)
            say(f"guarantee round {i + 1}, {g}: throughput {tp[g][-1]:,.0f} msg/s ({report['records']:,} records "
                f"read for {n:,}: lost {report['lost']}, duplicated {report['duplicated']}; "
                f"{report['transaction_failures']} failed delivery transactions, progress topic at "
                f"{report['progress_offsets']:,})")
        for g in GUARANTEES:
            result = _lateness_run(kafka, redis_url, rate, seconds, settings={"delivery_guarantee": g})
            late[g].append(result)
            say(f"guarantee round {i + 1}, {g}: lateness {result['summary']}; lost {result['lost']}, duplicated "
                f"{result['duplicated']}, early {result['lateness']['timestamp']['early']}; "
                f"{result['transaction_failures']} failed delivery transactions, progress topic at "
                f"{result['progress_offsets']:,}")

    def p(g: str, q: str) -> float:  # the median over the rounds of the Kafka timestamp's p50 / p99
        values = [r["lateness"]["timestamp"][q] for r in late[g] if r["lateness"]["timestamp"][q] is not None]
        return float(statistics.median(values)) if values else float("nan")

    def total(g: str, key: str) -> int:
        return sum(int(r[key]) for r in late[g])

    alo, eos = (float(statistics.median(tp[g])) for g in GUARANTEES)
    for g in GUARANTEES:
        say(f"{g}: throughput {statistics.median(tp[g]):,.0f} msg/s (runs {', '.join(f'{r:,.0f}' for r in tp[g])}); "
            f"lateness p50 / p99 {p(g, 'p50'):,.0f} / {p(g, 'p99'):,.0f} ms; lost {total(g, 'lost')}, duplicated "
            f"{total(g, 'duplicated')} of {total(g, 'expected'):,} (lateness runs), "
            f"{sum(r['lost'] for r in tp_reports[g])} and {sum(r['duplicated'] for r in tp_reports[g])} of "
            f"{n * rounds:,} (throughput runs); failed delivery transactions "
            f"{sum(r['transaction_failures'] for r in [*tp_reports[g], *late[g]])} (medians of {rounds})")
    per_guarantee = {g: {"throughput_runs": [round(r) for r in tp[g]],
                         "throughput_lost": sum(r["lost"] for r in tp_reports[g]),
                         "throughput_duplicated": sum(r["duplicated"] for r in tp_reports[g]),
                         "transaction_failures": sum(r["transaction_failures"] for r in [*tp_reports[g], *late[g]]),
                         "progress_offsets": [r["progress_offsets"] for r in [*tp_reports[g], *late[g]]],
                         "lateness_runs": [r["lateness"] for r in late[g]],
                         "scheduled": total(g, "expected"), "delivered": total(g, "delivered"),
                         "lost": total(g, "lost"), "duplicated": total(g, "duplicated"),
                         "early": sum(r["lateness"]["timestamp"]["early"] for r in late[g]),
                         "sustained": all(keeps_up(r) for r in late[g])} for g in GUARANTEES}
    emit("production.guarantee.throughput", eos, "messages/s", at_least_once_per_s=round(alo),
         ratio=round(eos / alo, 3), messages=n, rounds=rounds, read_committed=True,
         runs={g: per_guarantee[g]["throughput_runs"] for g in GUARANTEES},
         lost={g: per_guarantee[g]["throughput_lost"] for g in GUARANTEES},
         duplicated={g: per_guarantee[g]["throughput_duplicated"] for g in GUARANTEES})
    emit("production.guarantee.lateness.p99", p("exactly-once", "p99"), "ms", p50=p("exactly-once", "p50"),
         at_least_once_p50=p("at-least-once", "p50"), at_least_once_p99=p("at-least-once", "p99"),
         ratio=round(p("exactly-once", "p99") / max(p("at-least-once", "p99"), 1.0), 3), rounds=rounds,
         rate_per_s=rate, seconds=seconds, due="whole_second", tick_ms=100, read_committed=True,
         guarantees=per_guarantee)


#: ``production.brokers``: the three-broker cluster's ``scripts/kafka.sh`` instance (its own
#: ports and data, apart from the tests' ``cluster3``).
CLUSTER3 = {"TW_KAFKA_INSTANCE": "bench-cluster3", "TW_KAFKA_BROKERS": "3"}


@contextmanager
def three_brokers() -> Iterator[str]:
    """A KRaft cluster of three brokers (replication 3, min ISR 2, the transaction state log
    replicated), its internal topics made; stopped again on the way out unless it ran before."""
    from infra import prime_internal_topics  # tests/infra.py: the tests' kafka_cluster3 does the same

    env = {**os.environ, **CLUSTER3}
    script = str(ROOT / "scripts" / "kafka.sh")
    was_running = subprocess.run([script, "status"], cwd=ROOT, env=env, capture_output=True, timeout=60,
                                 check=False).returncode == 0
    subprocess.run([script, "up"], cwd=ROOT, env=env, check=True, timeout=900, stdout=subprocess.DEVNULL)
    settings = dict(line.split("=", 1) for line in (ROOT / ".run" / "kafka-bench-cluster3.env").read_text().splitlines()
                    if "=" in line)
    bootstrap = settings["TW_KAFKA_BOOTSTRAP"].strip()
    try:
        prime_internal_topics(bootstrap)
        yield bootstrap
    finally:
        if not was_running:
            subprocess.run([script, "down"], cwd=ROOT, env=env, timeout=300, check=False, stdout=subprocess.DEVNULL)


def brokers(kafka: str, redis_url: str, n: int, rate: int, seconds: float, rounds: int) -> None:
    """The cost of a three-broker cluster against one (issue 31), in both guarantees: each round
    the throughput (``n`` due at once, counted ``read_committed``) and the lateness (``rate``
    msg/s for ``seconds``, whole seconds) of each guarantee on one broker, then on three
    (replication 3); medians over ``rounds``, and the ratios three / one."""
    runs: dict[tuple[str, str], dict[str, list[float]]] = {}
    with three_brokers() as kafka3:
        clusters = (("one broker", kafka, 1), ("three brokers", kafka3, 3))
        for i in range(rounds):
            for name, bootstrap, replication in clusters:
                for g in GUARANTEES:
                    settings = {"delivery_guarantee": g, "replication": replication}
                    row = runs.setdefault((name, g), {"throughput": [], "p50": [], "p99": [], "lost": [],
                                                      "duplicated": []})
                    report: dict[str, Any] = {}
                    row["throughput"].append(throughput(bootstrap, redis_url, n, settings=settings, read_committed=True,
                                                        baseline=False, report=report)[0])
                    result = _lateness_run(bootstrap, redis_url, rate, seconds, settings=settings)
                    row["p50"].append(result["lateness"]["timestamp"]["p50"])
                    row["p99"].append(result["lateness"]["timestamp"]["p99"])
                    row["lost"].append(report["lost"] + result["lost"])
                    row["duplicated"].append(report["duplicated"] + result["duplicated"])
                    say(f"brokers round {i + 1}, {name}, {g}: throughput {row['throughput'][-1]:,.0f} msg/s; "
                        f"lateness {result['summary']}; lost {row['lost'][-1]}, duplicated {row['duplicated'][-1]}")

    def median(name: str, g: str, key: str) -> float:
        values = [v for v in runs[(name, g)][key] if v is not None]
        return float(statistics.median(values)) if values else float("nan")

    for g in GUARANTEES:
        one, three = (median(c, g, "throughput") for c in ("one broker", "three brokers"))
        emit("production.brokers.throughput", three, "messages/s", guarantee=g, one_broker_per_s=round(one),
             ratio=round(three / one, 3), messages=n, rounds=rounds, read_committed=True,
             runs={c: [round(x) for x in runs[(c, g)]["throughput"]] for c in ("one broker", "three brokers")})
        emit("production.brokers.lateness.p99", median("three brokers", g, "p99"), "ms", guarantee=g,
             p50=median("three brokers", g, "p50"), one_broker_p50=median("one broker", g, "p50"),
             one_broker_p99=median("one broker", g, "p99"),
             ratio=round(median("three brokers", g, "p99") / max(median("one broker", g, "p99"), 1.0), 3),
             rate_per_s=rate, seconds=seconds, rounds=rounds,
             lost={c: sum(runs[(c, g)]["lost"]) for c in ("one broker", "three brokers")},
             duplicated={c: sum(runs[(c, g)]["duplicated"]) for c in ("one broker", "three brokers")})


#: What ``python -m bench production`` runs unless ``TW_BENCH_PROD_ONLY`` says otherwise
#: (``all``: every one); the others are long and measure what changes seldom.
DEFAULT_ONLY = ("throughput", "lateness", "burst", "idle", "guarantee", "brokers")
ALL_ONLY = ("throughput", "compressed", "sasl_ssl", "lateness", "burst", "large_burst", "idle", "slot_reads",
            "shared_volume", "guarantee", "brokers")


def selected(value: str) -> set[str]:
    """The benchmarks ``TW_BENCH_PROD_ONLY`` names (comma list; empty: the default set; ``all``)."""
    names = {x.strip() for x in value.split(",") if x.strip()} or set(DEFAULT_ONLY)
    if "all" in names:
        return set(ALL_ONLY)
    unknown = names - set(ALL_ONLY)
    if unknown:
        raise SystemExit(f"TW_BENCH_PROD_ONLY: unknown {', '.join(sorted(unknown))} (choose from all, "
                         f"{', '.join(ALL_ONLY)})")
    return names


def bench_delays(raw: str) -> tuple[int, int]:
    """``TW_BENCH_DELAYS_MS``: ``min,max`` in ms (empty: ``DELAYS_MS``)."""
    if not raw.strip():
        return DELAYS_MS
    try:
        low, high = (int(x) for x in raw.split(","))
    except ValueError:
        raise SystemExit(f"TW_BENCH_DELAYS_MS: {raw!r} is not two whole numbers of ms, min,max") from None
    if not 0 < low <= high:
        raise SystemExit(f"TW_BENCH_DELAYS_MS: {raw!r} needs 0 < min <= max")
    return low, high


def due_modes(value: str) -> list[str]:
    modes = [x.strip() for x in value.split(",") if x.strip()] or list(DUE_MODES)
    unknown = [m for m in modes if m not in DUE_MODES]
    if unknown:
        raise SystemExit(f"TW_BENCH_DUE: unknown {', '.join(unknown)} (choose from {', '.join(DUE_MODES)})")
    return modes


def main() -> None:
    only = selected(os.environ.get("TW_BENCH_PROD_ONLY", ""))
    kafka, redis_url = servers(("redis",) if only == {"sasl_ssl"} else ("kafka", "redis"))
    if "throughput" in only:
        for code in codes():
            throughput(kafka, redis_url, _env_int("TW_BENCH_PROD_N", 20_000), code=code)
    if "compressed" in only:
        compressed(kafka, redis_url, _env_int("TW_BENCH_PROD_N", 20_000))
    if "sasl_ssl" in only:
        sasl_ssl(redis_url, _env_int("TW_BENCH_PROD_N", 20_000))
    if "lateness" in only:
        lateness(kafka, redis_url, _env_int("TW_BENCH_PROD_RATE", 500), float(_env_int("TW_BENCH_PROD_SECONDS", 60)),
                 due_modes(os.environ.get("TW_BENCH_DUE", "")), int(os.environ.get("TW_BENCH_PROD_LEAD_MS", LEAD_MS)),
                 bench_delays(os.environ.get("TW_BENCH_DELAYS_MS", "")))
    if "burst" in only:
        for code in codes():
            burst(kafka, redis_url, _env_int("TW_BENCH_PROD_BURST", 200_000), code=code)
    if "large_burst" in only:
        for n in (int(x) for x in os.environ.get("TW_BENCH_LARGE_BURSTS", "500,1500,5000").split(",") if x):
            large_burst(kafka, redis_url, n, "defaults")
        for n in (int(x) for x in os.environ.get("TW_BENCH_LARGE_UNBOUNDED", "500").split(",") if x):
            large_burst(kafka, redis_url, n, "unbounded")
    if "idle" in only:
        for code in codes():
            idle(kafka, redis_url, float(_env_int("TW_BENCH_IDLE_SECONDS", 30)), _env_int("TW_BENCH_IDLE_RATE", 200),
                 code=code)
    if "slot_reads" in only:
        slot_reads(kafka, _env_int("TW_BENCH_PROD_RATE", 500), 20.0)
    if "shared_volume" in only:
        shared_volume(kafka, redis_url, _env_int("TW_BENCH_PROD_N", 20_000), _env_int("TW_BENCH_PROD_RATE", 500),
                      float(_env_int("TW_BENCH_SHARED_SECONDS", 30)))
    if "guarantee" in only:
        guarantee(kafka, redis_url, _env_int("TW_BENCH_PROD_N", 20_000), _env_int("TW_BENCH_PROD_RATE", 500),
                  float(_env_int("TW_BENCH_GUARANTEE_SECONDS", 30)), _env_int("TW_BENCH_GUARANTEE_ROUNDS", 2))
    if "brokers" in only:
        brokers(kafka, redis_url, _env_int("TW_BENCH_PROD_N", 20_000), _env_int("TW_BENCH_PROD_RATE", 500),
                float(_env_int("TW_BENCH_GUARANTEE_SECONDS", 30)), _env_int("TW_BENCH_BROKERS_ROUNDS", 1))


if __name__ == "__main__":
    main()
