"""Five stage processes on real Kafka and Redis deliver what plain Kafka producers scheduled.

Producers are kafka-python with the wire-contract headers, as a user of another language would
write them. Random delays up to 50 s over a 20 s roll window (so many messages roll once or
twice), cancels (some of rolled messages), every kind of bad input to the dead-letter topic.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from harness import Collector, Pipeline, Scheduled, TimerProducer, make_report, now_ms
from infra import sasl_ssl_env
from two_mounts import two_mounts

pytestmark = pytest.mark.e2e

ROLL_WINDOW_MS = 20_000
#: How long after its send a record may reach enqueue-put and still be sure to roll (see the check).
ROLL_MARGIN_MS = 8_000
MAX_DELAY_S = 50


def bad_inputs(pipe: Pipeline) -> dict[str, tuple[list[tuple[str, bytes]], str]]:
    """The cases of tests/stages/test_bad_input.py, and a few more: key -> (headers, reason)."""
    t = pipe.dest("a").encode()
    return {
        "no-topic": ([("tw-delay-ms", b"5")], "missing tw-topic"),
        "no-time": ([("tw-topic", t)], "no delivery time"),
        "two-times": ([("tw-topic", t), ("tw-delay-ms", b"5"), ("tw-delay-level", b"1")], "more than one delivery time"),
        "bad-time": ([("tw-topic", t), ("tw-deliver-at", b"tomorrow")], "unparsable tw-deliver-at"),
        "negative": ([("tw-topic", t), ("tw-delay-ms", b"-1")], "negative tw-delay-ms"),
        "overflow": ([("tw-topic", t), ("tw-deliver-at", b"18446744073709551616")], "out of range"),
        "too-far": ([("tw-topic", t), ("tw-delay-ms", str(401 * 86_400_000).encode())], "exceeds max_delay_ms"),
        "level": ([("tw-topic", t), ("tw-delay-level", b"99")], "unknown tw-delay-level 99"),
        "internal": ([("tw-topic", b"__consumer_offsets"), ("tw-delay-ms", b"5")], "not allowed by allow_topics"),
        "denied": ([("tw-topic", b"secret"), ("tw-delay-ms", b"5")], "not allowed by allow_topics"),
        "bad-name": ([("tw-topic", b"no/slashes"), ("tw-delay-ms", b"5")], "invalid destination topic name"),
        "loop": ([("tw-topic", pipe.timer_topic.encode()), ("tw-delay-ms", b"5")], "destination is the timer topic"),
        "bad-partition": ([("tw-topic", t), ("tw-delay-ms", b"5"), ("tw-partition", b"x")], "unparsable tw-partition"),
        "empty-cancel": ([("tw-cancel", b""), ("tw-deliver-at", b"5")], "tw-cancel must be a message id"),
        "long-id": ([("tw-topic", t), ("tw-delay-ms", b"5"), ("tw-id", b"i" * 2000)], "tw-id must be 1..1024 bytes"),
    }


def test_random_delays_cancels_rolls_and_bad_input_over_kafka_and_redis(
    tmp_path: Path, kafka_bootstrap: str, redis_url: str
) -> None:
    check_correctness(Pipeline(tmp_path, kafka_bootstrap, redis_url, roll_window_ms=ROLL_WINDOW_MS,
                               max_record_bytes=4096))


def test_the_same_with_enqueue_and_dequeue_stages_on_two_nodes_of_a_shared_volume(
    tmp_path: Path, kafka_bootstrap: str, redis_url: str
) -> None:
    """The enqueue stages write the data directory through one ``bindfs -o auto_cache`` mount,
    the dequeue stages read it through another: two page caches, as two nodes of a
    ReadWriteMany volume (NFS) have. Nothing may be lost, early or leak a cancel."""
    with two_mounts(tmp_path / "volume") as mounts:
        check_correctness(Pipeline(tmp_path, kafka_bootstrap, redis_url, mounts=mounts,
                                   roll_window_ms=ROLL_WINDOW_MS, max_record_bytes=4096))


def test_the_same_over_sasl_ssl_and_redis_over_tls_with_a_password(
    tmp_path: Path, secure_kafka: dict[str, str], secure_redis: dict[str, str]
) -> None:
    """Every connection over SASL_SSL (SCRAM-SHA-512, the locally made CA) and TLS to a Redis
    that requires a password: the stages' and the harness's own producer and collector."""
    kafka = sasl_ssl_env(secure_kafka)
    redis_settings = {k: secure_redis[k] for k in ("TW_REDIS_PASSWORD_FILE", "TW_REDIS_SSL_CAFILE")}
    pipe = Pipeline(tmp_path, kafka["TW_KAFKA_BOOTSTRAP"], secure_redis["TW_REDIS_URL"],
                    tw_env={**kafka, **redis_settings}, roll_window_ms=ROLL_WINDOW_MS, max_record_bytes=4096)
    assert pipe.kafka_options["security_protocol"] == "SASL_SSL" and pipe.redis_url.startswith("rediss://")
    check_correctness(pipe)


def check_correctness(pipe: Pipeline) -> None:
    dest_a, dest_b, dest_one = pipe.dest("a"), pipe.dest("b"), pipe.dest("one")
    pipe.create_topic(dest_a, 2)
    pipe.create_topic(dest_b, 3)
    pipe.create_topic(dest_one, 1)
    with (
        pipe.running(),
        TimerProducer(pipe, seed=3) as producer,
        Collector(pipe, [dest_a, dest_b, dest_one]) as collector,
        Collector(pipe, [pipe.dlq_topic]) as dlq,
    ):
        rng = random.Random(3)
        start = now_ms()
        plain: list[Scheduled] = []
        # Absolute times at millisecond precision, 0..50 s ahead (many roll once or twice), and
        # some already in the past (delivered at once).
        for i in range(1_200):
            topic = dest_a if i % 2 else dest_b
            plain.append(producer.schedule(topic, start + rng.randint(0, MAX_DELAY_S * 1000),
                                           headers=[("trace", f"t{i}".encode()), ("tw-extra", b"kept")]))
        for _ in range(50):
            producer.schedule(dest_a, start - rng.randint(1, 30_000))
        relative = [producer.schedule(dest_b, delay_ms=rng.randint(0, 30_000)) for _ in range(100)]
        levels = [producer.schedule(dest_a, delay_level=lv) for lv in [(1, 1_000), (2, 5_000), (3, 10_000)] * 20]
        pinned = [producer.schedule(dest_b, start + rng.randint(1_000, 15_000), partition=p % 4,
                                    headers=[("tw-partition", b"2")]) for p in range(40)]
        # Cancels sent at once, long before the targets are due, some of them rolled messages.
        targets = [m for m in plain if m.deliver_at_ms - start >= 5_000]
        cancelled = rng.sample(targets, 150)
        for m in cancelled:
            producer.cancel(m)
        # Dead-lettered at delivery: the destination has one partition.
        out_of_range = producer.schedule(dest_one, start + 2_000, headers=[("tw-partition", b"5")])
        cases = bad_inputs(pipe)
        for i, (name, (headers, _reason)) in enumerate(cases.items()):
            producer.send_raw(headers, name.encode(), b"payload", partition=i % 4)
        producer.send_raw([("tw-topic", dest_a.encode()), ("tw-delay-ms", b"5")], b"oversized", b"x" * 8192)
        producer.flush()
        expected = producer.expected()
        assert len(expected) == 1_200 + 50 + 100 + 60 + 40 + 1 - 150, "the producer's sends were not all acknowledged"
        expected.pop(out_of_range.message_id)
        producer.messages.pop(out_of_range.message_id)

        missing = collector.wait_for(expected, MAX_DELAY_S + 60, pipe)
        time.sleep(3)  # anything cancelled or duplicated would show up by now
        rep = make_report("correctness", producer, collector)
        assert not missing and not rep.lost, f"lost {len(rep.lost)}: {rep.lost[:20]}\n{pipe.tails()}"
        assert rep.duplicated == 0, f"{rep.duplicated} duplicates without any crash\n{pipe.tails()}"
        assert not rep.early, f"delivered early: {rep.early[:10]}"
        assert not rep.early_received, f"received before their time: {rep.early_received[:10]}"
        assert not rep.cancelled_delivered, f"cancelled yet delivered: {rep.cancelled_delivered[:10]}"
        assert not rep.unexpected, f"delivered ids nobody scheduled: {rep.unexpected[:10]}"
        # Lateness is reported; only a backlog fails the test (a loaded CI machine may be slow).
        assert rep.lateness_ms["p50"] <= 2_000, f"the pipeline fell behind\n{rep.line()}"

        # What arrives is the user's record, control headers replaced by the service's.
        for i, m in enumerate(plain):
            if m.message_id in producer.cancelled:
                continue
            (d,) = collector.by_id[m.message_id]
            assert d.topic == m.topic and d.key == m.message_id.encode() and d.value == f"value-{m.message_id}".encode()
            assert d.headers["trace"] == f"t{i}".encode() and d.headers["tw-extra"] == b"kept"
            assert not {"tw-topic", "tw-deliver-at", "tw-delay-ms", "tw-cancel"} & set(d.headers)
            # From its own send, not from the loop's start: on a loaded machine the sends take
            # seconds, and a message sent late is less far ahead of W than its time from start says.
            # A record reaches enqueue-put some time after its send (seconds on a loaded machine),
            # and rolls only if it is still a roll window ahead of the clock then: ROLL_MARGIN_MS.
            rolls, delay = int(d.headers["tw-roll"]), m.deliver_at_ms - m.sent_ms
            if delay >= ROLL_WINDOW_MS + ROLL_MARGIN_MS:
                assert rolls >= 1, f"{m} was not rolled"
            elif delay < ROLL_WINDOW_MS - 2_000:
                assert rolls == 0, f"{m} was rolled {rolls} times"
            assert int(d.headers["tw-enqueued-at"]) >= start - 1_000
        assert max(int(collector.by_id[m.message_id][0].headers["tw-roll"]) for m in plain
                   if m.message_id not in producer.cancelled) == 2
        for m in relative + levels:
            assert collector.by_id[m.message_id][0].topic == m.topic
        assert {collector.by_id[m.message_id][0].partition for m in pinned} == {2}

        # Every bad record is in the DLQ with its reason, none twice; the pipeline kept delivering.
        wanted_dead = len(cases) + 2
        deadline = time.monotonic() + 30
        while len(dlq.records) < wanted_dead and time.monotonic() < deadline:
            time.sleep(0.2)
        dead = {d.key: d for d in dlq.records if d.key is not None}
        keys = [d.key for d in dlq.records if d.key is not None]
        assert len(keys) == len(set(keys)), f"dead-lettered twice: {sorted(keys)}"
        for name, (_headers, reason) in cases.items():
            d = dead.get(name.encode())
            assert d is not None, f"bad input {name!r} not in the DLQ; DLQ holds {sorted(dead)}"
            assert reason in d.headers["tw-error"].decode(), (name, d.headers["tw-error"])
            assert d.value == b"payload"
            assert d.headers["tw-source"].decode().startswith(f"{pipe.timer_topic}/")
        assert b"exceeds max_record_bytes 4096" in dead[b"oversized"].headers["tw-error"]
        assert b"tw-partition 5 out of range" in dead[out_of_range.message_id.encode()].headers["tw-error"]
        assert len(dlq.records) == wanted_dead, [d.key for d in dlq.records]
        pipe.stop_cleanly()
