"""enqueue-get's dead letters exactly once on real Kafka (issue 31; design 7.1, E3, E4).

Each invalid timer record reaches the dead-letter topic once for a ``read_committed`` reader,
whether enqueue-get restarts from an older checkpoint, crashed between its sends and its commit,
or runs beside a zombie with the same transactional id.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from kafka import KafkaAdminClient, KafkaProducer, TopicPartition
from kafka.errors import KafkaError
from timerwheel import SimulatedClock, TimerConfig
from timerwheel.records import OutRecord, Record
from timerwheel.stages.base import StageContext
from timerwheel.stages.enqueue_get import EnqueueGet
from timerwheel.transports.kafka.errors import KafkaLogError
from timerwheel.transports.kafka.log import KafkaCommitLog
from timerwheel.transports.kafka.transactions import TransactionalProducer
from timerwheel.transports.memory import MemoryWorkQueue

START = 1_700_000_000_000


@pytest.fixture
def config() -> TimerConfig:
    uid = uuid.uuid4().hex[:8]
    return TimerConfig(timer_topic=f"tw-dl-{uid}", dlq_topic=f"tw-dl-{uid}-dlq", timer_partitions=2, shards=1)


@pytest.fixture
def log(kafka_bootstrap: str, config: TimerConfig) -> Iterator[KafkaCommitLog]:
    log = KafkaCommitLog(kafka_bootstrap)
    log.ensure_topic(config.timer_topic, 2)
    log.ensure_topic(config.dlq_topic, 1)
    yield log
    log.close()


def write_timer_records(log: KafkaCommitLog, config: TimerConfig, tag: str) -> set[str]:
    """Two invalid records (no ``tw-topic``) and one valid one per timer partition; the invalid
    ones' ``tw-source`` values (what their dead letters carry)."""
    records = []
    for p in (0, 1):
        records += [OutRecord(config.timer_topic, None, f"{tag}-bad-{p}-{i}".encode(), (("tw-id", b"x"),), partition=p)
                    for i in range(2)]
        records.append(OutRecord(config.timer_topic, None, b"ok", (("tw-topic", b"dest"),
                                 ("tw-deliver-at", str(START + 60_000).encode())), partition=p))
    written = log.append(records)
    return {f"{config.timer_topic}/{p}/{o}" for (p, o), r in zip(written, records, strict=True) if b"bad" in (r.value or b"")}


def run_enqueue_get(bootstrap: str, config: TimerConfig, **options: Any) -> float:
    """An enqueue-get that starts from offset 0 (an old checkpoint) and reads to the end
    (``options``: the ``KafkaCommitLog``'s); what it counted in ``dead_lettered``."""
    log = KafkaCommitLog(bootstrap, **options)
    ctx = StageContext(config, SimulatedClock(START))
    stage = EnqueueGet(ctx, log, MemoryWorkQueue("put", 1, 1000), [0, 1], lambda shard: {})
    stopper = threading.Timer(20, ctx.stop.set)  # a step retrying for ever raises Stopped then
    stopper.start()
    try:
        while not stage.caught_up():
            assert not ctx.stop.is_set(), "enqueue-get did not read the timer topic to its end"
            stage.step(0.2)
    finally:
        stopper.cancel()
        stage.close()
        log.close()
    return ctx.metrics.counter("dead_lettered")


def dead_letters(bootstrap: str, config: TimerConfig, records: list[Record] | None = None) -> Counter[str]:
    """``tw-source`` -> how many times a read_committed reader finds it in the dead-letter topic
    (the records into ``records`` when given)."""
    log = KafkaCommitLog(bootstrap)  # end offsets asked now, not cached
    consumer = log.consumer(config.dlq_topic, {0: 0})
    try:
        end = log.end_offsets(config.dlq_topic)[0]
        found: Counter[str] = Counter()
        deadline = time.monotonic() + 10
        while consumer.position(0) < end:
            assert time.monotonic() < deadline, "the dead-letter topic not read to its last stable offset"
            batch = consumer.poll(100, 0.5)
            found.update((r.header("tw-source") or b"").decode() for r in batch)
            if records is not None:
                records += batch
        return found
    finally:
        consumer.close()
        log.close()


def test_a_restart_from_an_older_checkpoint_dead_letters_nothing_twice(
        kafka_bootstrap: str, log: KafkaCommitLog, config: TimerConfig) -> None:
    first = write_timer_records(log, config, "a")
    assert run_enqueue_get(kafka_bootstrap, config) == 4
    assert dead_letters(kafka_bootstrap, config) == Counter(first)
    second = write_timer_records(log, config, "b")
    assert run_enqueue_get(kafka_bootstrap, config) == 4  # reads from 0 again: the first ones are skipped
    assert run_enqueue_get(kafka_bootstrap, config) == 0
    assert dead_letters(kafka_bootstrap, config) == Counter(first | second)


def test_a_crash_between_the_sends_and_the_commit_shows_nothing_and_the_next_run_writes_each_once(
        kafka_bootstrap: str, log: KafkaCommitLog, config: TimerConfig) -> None:
    sources = write_timer_records(log, config, "a")
    # An enqueue-get that sent partition 0's dead letters in its transaction and died before the commit.
    crashed = KafkaProducer(bootstrap_servers=kafka_bootstrap,
                            transactional_id=f"{config.transactional_id_prefix}-dlq-0")
    try:
        crashed.init_transactions()
        crashed.begin_transaction()
        for source in sorted(s for s in sources if "/0/" in s):
            crashed.send(config.dlq_topic, b"half", headers=[("tw-source", source.encode())], partition=0)
        crashed.flush()
        assert log.high_watermarks(config.dlq_topic)[0] > 0
        assert dead_letters(kafka_bootstrap, config) == Counter()
        run_enqueue_get(kafka_bootstrap, config)  # its init aborts the open transaction
        assert dead_letters(kafka_bootstrap, config) == Counter(sources)
        with pytest.raises(KafkaError):  # fenced: the crashed one cannot commit any more
            crashed.commit_transaction()
        assert dead_letters(kafka_bootstrap, config) == Counter(sources)
    finally:
        crashed.close(timeout=0)


def test_a_zombie_is_fenced_by_the_next_init_and_writes_nothing(
        kafka_bootstrap: str, log: KafkaCommitLog, config: TimerConfig) -> None:
    clients = log._clients  # noqa: SLF001 - the test builds the log's own producers
    tx_id = f"{config.transactional_id_prefix}-dlq-1"
    letter = OutRecord(config.dlq_topic, None, b"zombie", (("tw-source", b"zombie"),), partition=0)
    zombie = TransactionalProducer(clients, tx_id, timeout_ms=10_000)
    successor = TransactionalProducer(clients, tx_id, timeout_ms=10_000)
    try:
        zombie.init()
        successor.init()
        with pytest.raises(KafkaLogError):
            zombie.run([letter])
        successor.run([OutRecord(config.dlq_topic, None, b"ok", (("tw-source", b"successor"),), partition=0)])
        assert dead_letters(kafka_bootstrap, config) == Counter(["successor"])
    finally:
        zombie.close()
        successor.close()


def test_a_commit_of_unknown_outcome_is_decided_by_the_next_init_and_written_once(
        kafka_bootstrap: str, log: KafkaCommitLog, config: TimerConfig) -> None:
    """A commit not waited for (kafka-python's can block for good): whether it committed or not,
    the next writer's init and its read of the group's offset write each dead letter once."""
    prefix = config.transactional_id_prefix
    letters = [(o, OutRecord(config.dlq_topic, None, b"bad", (("tw-source", f"src/{o}".encode()),), partition=0))
               for o in (3, 5)]
    hasty = TransactionalProducer(log._clients, f"{prefix}-dlq-0", timeout_ms=10_000,  # noqa: SLF001
                                  commit_wait_s=0)
    try:
        with pytest.raises(KafkaLogError) as failed:
            hasty.run([r for _, r in letters], {TopicPartition(config.timer_topic, 0): 6}, f"{prefix}-dlq")
        assert failed.value.unknown_outcome
    finally:
        hasty.close()
    written = log.dead_letter_once(prefix, config.timer_topic, 0, letters)
    assert dead_letters(kafka_bootstrap, config) == Counter(["src/3", "src/5"])
    assert log.dead_letter_once(prefix, config.timer_topic, 0, letters) == 0
    assert written in (0, 2)  # 0: the first commit had gone through


def test_a_dead_letter_too_large_for_the_producer_goes_without_its_value_once(
        kafka_bootstrap: str, log: KafkaCommitLog, config: TimerConfig) -> None:
    """Kafka refuses it for good: written without its value (as ``append_until_written`` does),
    not retried for ever, and enqueue-get goes on."""
    sources = write_timer_records(log, config, "a")
    [(p, o)] = log.append([OutRecord(config.timer_topic, b"big", b"x" * 100_000, (("tw-id", b"big"),), partition=1)])
    run_enqueue_get(kafka_bootstrap, config, max_request_size=64 * 1024)
    run_enqueue_get(kafka_bootstrap, config, max_request_size=64 * 1024)
    got: list[Record] = []
    big = f"{config.timer_topic}/{p}/{o}"
    assert dead_letters(kafka_bootstrap, config, got) == Counter(sources | {big})
    [letter] = [r for r in got if r.header("tw-source") == big.encode()]
    assert letter.key == b"big" and letter.value == b"" and b"MessageSizeTooLarge" in (letter.header("tw-error") or b"")


def test_a_timer_topic_made_again_has_its_invalid_records_dead_lettered_from_offset_0(
        kafka_bootstrap: str, log: KafkaCommitLog, config: TimerConfig) -> None:
    """A timer topic deleted and made again (then ``timerwheel rebase``) starts at offset 0, below
    the dead-letter group's committed offsets: the broker deletes a group's offsets with their
    topic, so the new topic's invalid records are dead-lettered (none skipped as done), once."""
    group = f"{config.transactional_id_prefix}-dlq"
    write_timer_records(log, config, "old")
    assert run_enqueue_get(kafka_bootstrap, config) == 4
    before = log.topics.topic_id(config.timer_topic)
    assert log.topics.group_offset(group, TopicPartition(config.timer_topic, 0)) == 2
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        admin.delete_topics([config.timer_topic])
        deadline = time.monotonic() + 30
        while True:  # deleted in the background: made again once it is gone
            try:
                log.ensure_topic(config.timer_topic, 2)
                if log.topics.topic_id(config.timer_topic) not in (None, before):
                    break
            except KafkaLogError:
                pass
            assert time.monotonic() < deadline, "the timer topic was not made again"
            time.sleep(0.2)
    finally:
        admin.close()
    assert log.topics.group_offset(group, TopicPartition(config.timer_topic, 0)) == 0  # gone with the topic
    write_timer_records(log, config, "new")  # at the offsets the old ones had
    assert run_enqueue_get(kafka_bootstrap, config) == 4
    assert log.topics.group_offset(group, TopicPartition(config.timer_topic, 0)) == 2
    assert run_enqueue_get(kafka_bootstrap, config) == 0  # and once
    got: list[Record] = []
    dead_letters(kafka_bootstrap, config, got)
    assert Counter(r.value for r in got) == Counter(f"{tag}-bad-{p}-{i}".encode()
                                                    for tag in ("old", "new") for p in (0, 1) for i in range(2))
