"""Producers in the field, against the stage processes on real Kafka and Redis.

The wire contract is for every Kafka client: timer records here are written by clients nobody
here wrote — librdkafka (confluent-kafka) in every codec Kafka has, and inside transactions;
Kafka's own Java console producer with compression and headers — and by kafka-python after
them. Then brokers as they are run in production: one that never creates a topic on first use,
with messages for destinations that do not exist among messages for ones that do.

Every check counts what a consumer of the destination topics saw: each expected message
delivered once and not before its time, no aborted record delivered, every other destination
flowing while one is missing.
"""

from __future__ import annotations

import hashlib
import random
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Producer
from harness import ALL_IN_ONE, ROOT, Collector, Delivery, Pipeline, TimerProducer, now_ms

pytestmark = pytest.mark.e2e

CODECS = ("none", "gzip", "snappy", "lz4", "zstd")
#: Kafka's own console producer writes these (a JVM start each).
CONSOLE_CODECS = ("lz4", "zstd")
DELAY_MS = (3_000, 8_000)

#: message id -> delivery time (epoch ms)
Expected = dict[str, int]


def timer_headers(dest: str, deliver_at: int, mid: str) -> list[tuple[str, bytes]]:
    return [("tw-topic", dest.encode()), ("tw-deliver-at", str(deliver_at).encode()), ("tw-id", mid.encode())]


def write_librdkafka(producer: Producer, pipe: Pipeline, dest: str, n: int, rng: random.Random,
                     label: str, delay_ms: tuple[int, int] = DELAY_MS) -> Expected:
    """``n`` timer records for ``dest`` through librdkafka, on random timer partitions."""
    out: Expected = {}
    partitions = int(str(pipe.settings["timer_partitions"]))
    for i in range(n):
        mid = f"{label}-{i}-{uuid.uuid4().hex[:6]}"
        at = now_ms() + rng.randint(*delay_ms)
        producer.produce(pipe.timer_topic, key=mid.encode(), value=f"value-{mid}".encode(),
                         headers=timer_headers(dest, at, mid), partition=rng.randrange(partitions))
        out[mid] = at
    return out


def kafka_libs() -> Path:
    """The broker jars scripts/kafka.sh fetched (its cache key: the pom's hash)."""
    pom = ROOT / "scripts" / "kafka" / "pom.xml"
    libs = ROOT / ".cache" / "kafka" / hashlib.sha256(pom.read_bytes()).hexdigest()[:12] / "libs"
    assert (libs / ".complete").exists(), f"no Kafka jars in {libs}: scripts/kafka.sh up fetches them"
    return libs


def write_console(pipe: Pipeline, dest: str, n: int, codec: str, rng: random.Random) -> Expected:
    """``n`` timer records through Kafka's own ``kafka-console-producer`` (headers parsed from
    each input line, the batch compressed with ``codec``)."""
    out: Expected = {}
    lines = []
    for i in range(n):
        mid = f"console-{codec}-{i}-{uuid.uuid4().hex[:6]}"
        at = now_ms() + rng.randint(*DELAY_MS) + 5_000  # the JVM takes a few seconds to start
        lines.append(f"tw-topic:{dest},tw-deliver-at:{at},tw-id:{mid}\tvalue-{mid}")
        out[mid] = at
    done = subprocess.run(
        ["java", "-Xmx256m", "-cp", f"{kafka_libs()}/*", "org.apache.kafka.tools.ConsoleProducer",
         "--bootstrap-server", pipe.kafka, "--topic", pipe.timer_topic, "--compression-codec", codec,
         "--property", "parse.headers=true", "--sync"],
        input="\n".join(lines) + "\n", text=True, capture_output=True, timeout=120, check=False)
    assert done.returncode == 0, f"kafka-console-producer failed ({done.returncode}): {done.stderr[-2000:]}"
    return out


def check_delivered(collector: Collector, expected: Expected, pipe: Pipeline, timeout_s: float) -> None:
    """Every expected id delivered once, none before its time, nothing else on the topics."""
    missing = collector.wait_for(expected, timeout_s, pipe)
    assert not missing, f"{len(missing)} of {len(expected)} never delivered, e.g. {sorted(missing)[:5]}\n{pipe.tails()}"
    with collector._lock:
        by_id = {m: list(d) for m, d in collector.by_id.items()}
    duplicated = {m: len(d) for m, d in by_id.items() if m in expected and len(d) > 1}
    early = {m: (expected[m], d[0].delivered_at_ms, min(x.received_at_ms for x in d)) for m, d in by_id.items()
             if m in expected and min(d[0].delivered_at_ms, *(x.received_at_ms for x in d)) < expected[m]}
    assert not duplicated, f"delivered more than once: {duplicated}"
    assert not early, f"delivered before their time (due, delivered, received): {early}"


def no_loss_loops(pipe: Pipeline) -> None:
    """Transaction markers were never taken for lost entries (the old endless rewind)."""
    for name in pipe.procs:
        text = pipe.procs[name].log_path.read_text(errors="replace")
        for phrase in ("entries lost in transit", "entries after a gap"):
            assert phrase not in text, f"{name} logged {phrase!r}:\n{pipe.tails([name])}"


def test_every_codec_and_kafkas_console_producer_then_plain_records(
    tmp_path: Path, kafka_bootstrap: str, redis_url: str
) -> None:
    pipe = Pipeline(tmp_path, kafka_bootstrap, redis_url, kafka_compression="lz4")
    dest = pipe.new_dest("a", 2)
    rng = random.Random(11)
    expected: Expected = {}
    with pipe.running(), Collector(pipe, [dest]) as collector:
        for codec in CODECS:
            producer = Producer({"bootstrap.servers": kafka_bootstrap, "compression.type": codec, "linger.ms": 20})
            expected |= write_librdkafka(producer, pipe, dest, 40, rng, f"rdkafka-{codec}")
            assert producer.flush(60) == 0
        for codec in CONSOLE_CODECS:
            expected |= write_console(pipe, dest, 20, codec, rng)
        with TimerProducer(pipe, seed=5) as plain:  # kafka-python, uncompressed, after all of them
            for _ in range(40):
                plain.schedule(dest, now_ms() + rng.randint(*DELAY_MS))
            plain.flush()
            expected |= {m: s.deliver_at_ms for m, s in plain.expected().items()}
        assert len(expected) == 40 * len(CODECS) + 20 * len(CONSOLE_CODECS) + 40
        check_delivered(collector, expected, pipe, timeout_s=120)
        no_loss_loops(pipe)
        pipe.stop_cleanly()


@pytest.mark.parametrize("layout", ["five-processes", ALL_IN_ONE])
def test_aborted_transactions_are_never_delivered_committed_ones_are(
    tmp_path: Path, kafka_bootstrap: str, redis_url: str, layout: str
) -> None:
    pipe = Pipeline(tmp_path, kafka_bootstrap, redis_url)
    dest = pipe.new_dest("tx", 2)
    rng = random.Random(12)
    run = pipe.running() if layout == "five-processes" else _all_in_one(pipe)
    with run, Collector(pipe, [dest]) as collector:
        tx = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"e2e-tx-{pipe.uid}"})
        tx.init_transactions(60)
        tx.begin_transaction()
        aborted = write_librdkafka(tx, pipe, dest, 50, rng, "aborted")
        assert tx.flush(60) == 0  # on the broker, then aborted
        tx.abort_transaction(60)
        tx.begin_transaction()
        committed = write_librdkafka(tx, pipe, dest, 50, rng, "committed")
        tx.commit_transaction(60)
        plain_producer = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5})
        plain = write_librdkafka(plain_producer, pipe, dest, 50, rng, "plain")
        assert plain_producer.flush(60) == 0
        check_delivered(collector, committed | plain, pipe, timeout_s=120)
        # The aborted ones were due no later than the last committed one: give them 3 s more.
        wait = max(aborted.values()) + 3_000 - now_ms()
        if wait > 0:
            time.sleep(wait / 1000)
        leaked = aborted.keys() & collector.delivered_ids()
        assert not leaked, f"{len(leaked)} records of an aborted transaction were delivered"
        no_loss_loops(pipe)
        pipe.stop_cleanly()


def _all_in_one(pipe: Pipeline):  # type: ignore[no-untyped-def]
    from contextlib import contextmanager

    @contextmanager
    def running():  # type: ignore[no-untyped-def]
        try:
            pipe.start(ALL_IN_ONE, timeout_s=90)
            yield pipe
        finally:
            pipe.stop_all()

    return running()


HOLD_MS = 12_000


def test_a_missing_destination_never_holds_back_the_others(
    tmp_path: Path, kafka_noauto_bootstrap: str, redis_url: str
) -> None:
    """On a broker that never creates topics on first use: messages for a topic created late
    are held and then delivered; those for a topic that never appears are dead-lettered after
    TW_MISSING_TOPIC_HOLD_MS; everything for an existing topic is delivered on time meanwhile."""
    pipe = Pipeline(tmp_path, kafka_noauto_bootstrap, redis_url, missing_topic_hold_ms=HOLD_MS)
    there = pipe.new_dest("there", 2)
    late, never = pipe.dest("late"), pipe.dest("never")
    rng = random.Random(13)
    with pipe.running(), Collector(pipe, [there]) as collector, Collector(pipe, [pipe.dlq_topic]) as dlq:
        producer = Producer({"bootstrap.servers": kafka_noauto_bootstrap, "linger.ms": 5})
        expected: Expected = {}
        to_late: Expected = {}
        to_never: Expected = {}
        for _ in range(6):  # interleaved, on the same partitions
            expected |= write_librdkafka(producer, pipe, there, 20, rng, "there")
            to_late |= write_librdkafka(producer, pipe, late, 5, rng, "late")
            to_never |= write_librdkafka(producer, pipe, never, 5, rng, "never")
        assert producer.flush(60) == 0
        check_delivered(collector, expected, pipe, timeout_s=60)
        lateness = [collector.by_id[m][0].delivered_at_ms - at for m, at in expected.items()]
        # Before: dequeue-put blocked on the missing topics' metadata and delivered none of these.
        assert max(lateness) < 5_000, f"deliveries waited behind the missing topics: max lateness {max(lateness)} ms"

        pipe.create_topic(late, 1)
        created_ms = now_ms()
        with Collector(pipe, [late]) as late_collector:
            check_delivered(late_collector, to_late, pipe, timeout_s=60)
            for m in to_late:
                first = late_collector.by_id[m][0]
                assert first.delivered_at_ms >= created_ms - 1_000, f"{m} delivered before its topic existed"
                assert int(first.headers["tw-roll"]) >= 1, f"{m} was not held: {first.headers}"

        dead = _wait_dead_letters(dlq, to_never, timeout_s=HOLD_MS / 1000 + 60)
        for m, letter in dead.items():
            reason = letter.headers.get("tw-error", b"").decode()
            assert f"destination topic {never!r} does not exist" in reason, reason
            assert letter.delivered_at_ms == 0  # a dead letter, not a delivery
            assert letter.headers.get("tw-id", b"").decode() == m
        assert not (to_never.keys() & collector.delivered_ids())
        pipe.stop_cleanly()  # SIGTERM honoured while records are held


def _wait_dead_letters(dlq: Collector, ids: Expected, timeout_s: float) -> dict[str, Delivery]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with dlq._lock:
            found = {m: d[0] for m, d in dlq.by_id.items() if m in ids}
        if len(found) == len(ids):
            return found
        time.sleep(0.2)
    raise AssertionError(f"{len(ids) - len(found)} of {len(ids)} messages for a missing topic not dead-lettered")


def test_policy_dlq_dead_letters_a_missing_destination_when_scheduled(
    tmp_path: Path, kafka_noauto_bootstrap: str, redis_url: str
) -> None:
    pipe = Pipeline(tmp_path, kafka_noauto_bootstrap, redis_url, missing_topic="dlq")
    there, missing = pipe.new_dest("there", 1), pipe.dest("missing")
    rng = random.Random(14)
    with _all_in_one(pipe), Collector(pipe, [there]) as collector, Collector(pipe, [pipe.dlq_topic]) as dlq:
        producer = Producer({"bootstrap.servers": kafka_noauto_bootstrap, "linger.ms": 5})
        expected = write_librdkafka(producer, pipe, there, 20, rng, "there")
        refused = write_librdkafka(producer, pipe, missing, 10, rng, "missing", delay_ms=(40_000, 50_000))
        assert producer.flush(60) == 0
        dead = _wait_dead_letters(dlq, refused, timeout_s=30)
        assert now_ms() < min(refused.values()), "dead-lettered when scheduled, not held until due"
        for letter in dead.values():
            assert "does not exist (TW_MISSING_TOPIC=dlq)" in letter.headers["tw-error"].decode()
        check_delivered(collector, expected, pipe, timeout_s=60)
        pipe.stop_cleanly()
