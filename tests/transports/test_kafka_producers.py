"""What producers in the field write, read through the Kafka commit log on a real broker.

Records are written with librdkafka (confluent-kafka), a client nobody here wrote: every codec
Kafka has, and transactions (aborted and committed). The consumer must decode every batch,
never return an aborted record, and report positions past the offsets that hold no record for
it (transaction markers), so that enqueue-put does not take them for loss. A batch that cannot be
decoded sets only its own partition aside; ``append`` neither blocks on a topic that does not
exist nor waits for new topics one at a time.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Producer
from infra import RUN
from kafka import KafkaAdminClient, TopicPartition, codec
from timerwheel.records import OutRecord
from timerwheel.transports.kafka import consumers as kafka_consumers
from timerwheel.transports.kafka.codecs import KafkaCodecError, check_codecs
from timerwheel.transports.kafka.errors import KafkaLogError
from timerwheel.transports.kafka.log import KafkaCommitLog

CODECS = ("none", "gzip", "snappy", "lz4", "zstd")


@pytest.fixture(scope="module")
def log(kafka_bootstrap: str) -> Iterator[KafkaCommitLog]:
    commit_log = KafkaCommitLog(kafka_bootstrap, client_id="test-producers")
    yield commit_log
    commit_log.close()


def new_topic(log: KafkaCommitLog, partitions: int = 1) -> str:
    topic = f"t-{uuid.uuid4().hex[:10]}"
    assert log.ensure_topic(topic, partitions) == partitions
    return topic


def poll_all(consumer, until_position: dict[int, int], timeout_s: float = 30.0) -> list:  # type: ignore[no-untyped-def]
    got = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got += consumer.poll(1000, 0.2)
        if all(consumer.position(p) >= o for p, o in until_position.items()):
            break
    return got


def test_every_codec_is_decoded_and_positions_pass_transaction_markers(log: KafkaCommitLog,
                                                                       kafka_bootstrap: str) -> None:
    topic = new_topic(log)
    for name in CODECS:
        producer = Producer({"bootstrap.servers": kafka_bootstrap, "compression.type": name, "linger.ms": 20})
        for i in range(20):
            producer.produce(topic, value=f"{name}-{i}".encode() * 20, headers=[("codec", name.encode())], partition=0)
        assert producer.flush(30) == 0
    tx = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"tx-{topic}"})
    tx.init_transactions(30)
    tx.begin_transaction()
    for i in range(10):
        tx.produce(topic, value=f"aborted-{i}".encode(), partition=0)
    assert tx.flush(30) == 0  # on the broker, then aborted
    tx.abort_transaction(30)
    tx.begin_transaction()
    for i in range(10):
        tx.produce(topic, value=f"committed-{i}".encode(), partition=0)
    tx.commit_transaction(30)
    end = log.end_offsets(topic)[0]

    consumer = log.consumer(topic, {0: 0})
    try:
        got = poll_all(consumer, {0: end})
        assert consumer.position(0) == end, "the position must pass the trailing commit marker"
    finally:
        consumer.close()
    values = [r.value for r in got]
    expected = [f"{n}-{i}".encode() * 20 for n in CODECS for i in range(20)] + [f"committed-{i}".encode() for i in range(10)]
    assert values == expected
    # 100 plain + 10 aborted + abort marker + 10 committed + commit marker
    assert end == 122
    offsets = [r.offset for r in got]
    assert offsets[-10:] == list(range(111, 121)), "committed records follow the aborted ones and their marker"


def test_a_batch_that_cannot_be_decoded_sets_only_its_partition_aside(
        log: KafkaCommitLog, kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    topic = new_topic(log, partitions=2)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 20})
    for p in (0, 1):
        for i in range(10):
            producer.produce(topic, value=f"p{p}-{i}".encode() * 50, partition=p)
    assert producer.flush(30) == 0
    segment = _segment_of(topic, 0)
    data = bytearray(segment.read_bytes())
    data[-20] ^= 0xFF  # inside the last record's value: the batch CRC no longer matches
    segment.write_bytes(bytes(data))

    consumer = log.consumer(topic, {0: 0, 1: 0})
    try:
        got = poll_all(consumer, {1: 10}, timeout_s=30)
        assert sorted(r.value for r in got if r.partition == 1) == sorted(f"p1-{i}".encode() * 50 for i in range(10))
        assert not [r for r in got if r.partition == 0]
        aside = consumer.undecodable  # type: ignore[attr-defined]
        assert list(aside) == [0]
        assert aside[0].offset == 0 and "CorruptRecord" in aside[0].reason
        assert consumer.position(0) == 0
        # Partition 1 goes on while 0 stays aside.
        producer.produce(topic, value=b"later", partition=1)
        producer.flush(30)
        later = poll_all(consumer, {1: 11}, timeout_s=30)
        assert [r.value for r in later] == [b"later"]
        assert list(consumer.undecodable) == [0]  # type: ignore[attr-defined]
        # docs/operations.md's way out for a batch corrupt everywhere: move the partition's start past it.
        producer.produce(topic, value=b"after", partition=0)
        producer.flush(30)
        admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        try:
            admin.delete_records({TopicPartition(topic, 0): 10})
        finally:
            admin.close()
        monkeypatch.setattr(kafka_consumers, "UNDECODABLE_RETRY_S", 0.0)  # try it again now
        resumed = poll_all(consumer, {0: 11}, timeout_s=30)
        assert [r.value for r in resumed if r.partition == 0] == [b"after"]
        assert not consumer.undecodable  # type: ignore[attr-defined]
    finally:
        consumer.close()


def _segment_of(topic: str, partition: int) -> Path:
    found = sorted((RUN / "kafka" / "data" / f"{topic}-{partition}").glob("*.log"))
    assert found, f"no segment of {topic}-{partition} under {RUN / 'kafka' / 'data'}"
    return found[-1]


def test_append_writes_the_rest_and_returns_records_for_a_missing_topic(kafka_noauto_bootstrap: str) -> None:
    log = KafkaCommitLog(kafka_noauto_bootstrap, client_id="test-missing", metadata_wait_s=1.0)
    try:
        there = new_topic(log)
        missing = f"t-missing-{uuid.uuid4().hex[:8]}"
        records = [OutRecord(there, b"k", b"a", ()), OutRecord(missing, b"k", b"b", ()),
                   OutRecord(there, b"k", b"c", ())]
        with pytest.raises(KafkaLogError) as caught:
            log.append(records)
        exc = caught.value
        assert exc.missing == {1: missing}
        assert exc.written[0] is not None and exc.written[2] is not None and exc.written[1] is None
        assert log.partition_count(missing) is None and log.partition_count(there) == 1
        assert log.end_offsets(there) == {0: 2}
        # Found missing lately: not waited for again, whatever the metadata wait is.
        log.appender.metadata_wait_s = 30.0
        began = time.monotonic()
        with pytest.raises(KafkaLogError):
            log.append([OutRecord(missing, None, b"x", ())])
        assert time.monotonic() - began < 10, "a topic found missing is not waited for again at once"
    finally:
        log.close()


def test_new_topics_of_a_batch_are_looked_up_together(log: KafkaCommitLog) -> None:
    """300 new destinations (auto-created): kafka-python's ``send`` alone waits for each new
    topic's metadata in turn (minutes); here their metadata is asked for together before any
    send, so no send waits for a topic's metadata."""
    waits = log.appender.metadata_waits
    topics = [f"t-fan-{uuid.uuid4().hex[:10]}" for _ in range(300)]
    left = [OutRecord(t, None, b"v", ()) for t in topics]
    deadline = time.monotonic() + 120
    while left:  # a broker that creates 300 topics slowly (a loaded machine): the rest later,
        # as the stages' append_until_written does
        try:
            log.append(left)
            left = []
        except KafkaLogError as exc:
            left = [r for r, w in zip(left, exc.written, strict=True) if w is None]  # retry what did not land
            assert time.monotonic() < deadline, f"{len(left)} auto-created topics still unknown after 120 s"
            time.sleep(1)
    assert all(log.end_offsets(t) == {0: 1} for t in topics[:5] + topics[-5:])
    waited = log.appender.metadata_waits - waits
    assert waited == 0, f"{waited} sends waited for their topic's metadata one at a time"


def test_a_missing_codec_library_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    check_codecs()  # everything is installed here
    monkeypatch.setattr(codec, "has_zstd", lambda: False)
    with pytest.raises(KafkaCodecError, match=r"zstd \(pip install zstandard\)"):
        check_codecs()
    with pytest.raises(KafkaCodecError, match="zstd"):
        KafkaCommitLog("127.0.0.1:9")


@pytest.mark.parametrize("compression", ["lz4", "zstd"])
def test_what_timerwheel_writes_is_compressed_as_configured(kafka_bootstrap: str, compression: str) -> None:
    log = KafkaCommitLog(kafka_bootstrap, client_id="test-compression", compression=compression)
    try:
        topic = new_topic(log)
        log.append([OutRecord(topic, b"k", b"v" * 1000, (("tw-id", b"m"),)) for _ in range(50)])
    finally:
        log.close()
    # The record batch header: baseOffset i64, length i32, leaderEpoch i32, magic i8, crc u32,
    # attributes i16 (bits 0-2: the codec; 3 lz4, 4 zstd).
    data = _segment_of(topic, 0).read_bytes()
    assert data, "nothing written"
    attributes = int.from_bytes(data[21:23], "big")
    assert attributes & 0x7 == {"lz4": 3, "zstd": 4}[compression]
