"""The Kafka commit log against a real single-node broker (scripts/kafka.sh)."""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Iterator

import kafka.errors as kafka_errors
import pytest
from infra import ServerControl
from kafka import KafkaAdminClient, KafkaProducer, TopicPartition
from kafka.partitioner.default import murmur2
from timerwheel.clock import SimulatedClock
from timerwheel.records import OutRecord
from timerwheel.transports.kafka import internals
from timerwheel.transports.kafka.errors import KafkaLogError
from timerwheel.transports.kafka.log import KafkaCommitLog
from timerwheel.transports.kafka.producer import keyed_partitions


@pytest.fixture(scope="module")
def log(kafka_bootstrap: str) -> Iterator[KafkaCommitLog]:
    commit_log = KafkaCommitLog(kafka_bootstrap, client_id="test-kafka")
    yield commit_log
    commit_log.close()


@pytest.fixture(scope="module")
def admin(kafka_bootstrap: str) -> Iterator[KafkaAdminClient]:
    client = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    yield client
    client.close()


def new_topic(log: KafkaCommitLog, partitions: int = 3) -> str:
    topic = f"t-{uuid.uuid4().hex[:10]}"
    assert log.ensure_topic(topic, partitions) == partitions
    return topic


def fill(log: KafkaCommitLog, topic: str, partition: int, n: int, size: int = 100) -> list[tuple[int, int]]:
    return log.append(
        [OutRecord(topic, b"k%d" % i, b"%06d" % i + b"x" * (size - 6), partition=partition) for i in range(n)]
    )


def test_append_then_read_round_trips_key_value_and_headers(log: KafkaCommitLog) -> None:
    topic = new_topic(log)
    records = [
        OutRecord(topic, b"key-1", b"value-1", (("tw-topic", b"dest"), ("tw-deliver-at", b"1700000000000"))),
        OutRecord(topic, None, b"no key", partition=2),
        OutRecord(topic, b"key-3", None, (("dup", b"1"), ("dup", b"2")), partition=1),
        OutRecord(topic, b"stamped", b"v", partition=0, timestamp_ms=1_600_000_000_000),
    ]
    written = log.append(records)
    assert len(written) == 4
    assert written[1][0] == 2 and written[2][0] == 1 and written[3][0] == 0
    got = log.read(topic, written)
    for out, rec, (partition, offset) in zip(records, got, written, strict=True):
        assert rec is not None
        assert (rec.topic, rec.partition, rec.offset) == (topic, partition, offset)
        assert (rec.key, rec.value, rec.headers) == (out.key, out.value, out.headers)
    assert got[2] is not None and got[2].header("dup") == b"2"
    assert got[3] is not None and got[3].timestamp_ms == 1_600_000_000_000
    assert got[0] is not None and abs(got[0].timestamp_ms - time.time() * 1000) < 60_000


def test_a_record_with_neither_key_nor_value_is_written_with_an_empty_value(log: KafkaCommitLog) -> None:
    topic = new_topic(log, partitions=1)
    [(p, o)] = log.append([OutRecord(topic, None, None, (("why", b"gone"),))])
    [rec] = log.read(topic, [(p, o)])
    assert rec is not None and rec.key is None and rec.value == b"" and rec.headers == (("why", b"gone"),)


def test_the_key_chooses_the_partition_when_none_is_given(log: KafkaCommitLog) -> None:
    topic = new_topic(log, partitions=4)
    written = log.append([OutRecord(topic, b"same-key", b"%d" % i) for i in range(10)])
    assert len({partition for partition, _ in written}) == 1
    assert [offset for _, offset in written] == list(range(10))  # in order, no gaps


def test_keyed_records_go_where_kafka_pythons_own_partitioner_puts_them(log: KafkaCommitLog) -> None:
    """The appender gives kafka-python the partitions of a batch's keyed records, computed at once
    (``producer.keyed_partitions``): each the one kafka-python's default partitioner (the Java
    client's murmur2) picks. A record with a partition keeps it; one without a key still goes out."""
    topic = new_topic(log, partitions=5)
    keys = [b"k-%d" % i for i in range(300)] + [uuid.uuid4().bytes for _ in range(100)] + [b"", b"a-much-longer-key" * 7]
    written = log.append([OutRecord(topic, k, b"v") for k in keys]
                         + [OutRecord(topic, b"pinned", b"v", partition=3), OutRecord(topic, None, b"keyless")])
    assert len(written) == len(keys) + 2
    assert [p for p, _ in written[:len(keys)]] == [(murmur2(k) & 0x7FFFFFFF) % 5 for k in keys]
    assert len({p for p, _ in written[:len(keys)]}) == 5
    assert written[len(keys)][0] == 3


def test_keyed_partitions_are_picked_only_for_keyed_records_of_known_topics() -> None:
    """Pure logic: a record with a partition, without a key, or for a topic whose metadata is not
    there yet is left to kafka-python; the others map through the topic's sorted partitions."""

    class Producer:
        def partitions_for(self, topic: str) -> set[int]:
            return {"a": {0, 1, 2}, "b": set()}.get(topic, {7})

    recs = [OutRecord("a", b"x", b""), OutRecord("a", b"y", b"", partition=1), OutRecord("a", None, b"v"),
            OutRecord("b", b"x", b""), OutRecord("new", b"x", b""), OutRecord("c", b"x", b"")]
    got = keyed_partitions(Producer(), recs, range(len(recs)), unready={"new"})
    assert got == {0: (murmur2(b"x") & 0x7FFFFFFF) % 3, 5: 7}


def test_a_clock_stamps_records_without_a_timestamp(kafka_bootstrap: str) -> None:
    # A day ago, not further: Kafka's retention (7 days) deletes older records at its next check.
    start = int(time.time()) * 1000 - 86_400_000
    clock = SimulatedClock(start_ms=start)
    with_clock = KafkaCommitLog(kafka_bootstrap, clock=clock)
    try:
        topic = new_topic(with_clock, partitions=1)
        written = with_clock.append([OutRecord(topic, None, b"v")])
        (rec,) = with_clock.read(topic, written)
        assert rec is not None and rec.timestamp_ms == start
    finally:
        with_clock.close()


def test_batched_random_reads_across_partitions_keep_the_request_order(log: KafkaCommitLog) -> None:
    topic = new_topic(log, partitions=3)
    written = []
    for p in range(3):
        written += fill(log, topic, p, 400)
    rng = random.Random(7)
    wanted = rng.sample(written, 300) + written[:5]  # repeats are fine
    got = log.read(topic, wanted)
    for (partition, offset), rec in zip(wanted, got, strict=True):
        assert rec is not None and (rec.partition, rec.offset) == (partition, offset)
        assert rec.value is not None and rec.value[:6] == b"%06d" % offset


def test_reads_jump_over_large_gaps_within_a_partition(kafka_bootstrap: str) -> None:
    sparse = KafkaCommitLog(kafka_bootstrap, read_gap=50)
    try:
        topic = new_topic(sparse, partitions=1)
        fill(sparse, topic, 0, 3000)
        wanted = [(0, 2999), (0, 0), (0, 1500), (0, 1501), (0, 10)]
        got = sparse.read(topic, wanted)
        assert [r.offset if r else None for r in got] == [2999, 0, 1500, 1501, 10]
    finally:
        sparse.close()


def test_offsets_before_the_log_start_or_past_the_end_read_as_none(
    log: KafkaCommitLog, admin: KafkaAdminClient
) -> None:
    topic = new_topic(log, partitions=2)
    fill(log, topic, 0, 50)
    fill(log, topic, 1, 5)
    admin.delete_records({TopicPartition(topic, 0): 20})  # as retention would
    assert log.start_offsets(topic) == {0: 20, 1: 0}
    assert log.end_offsets(topic) == {0: 50, 1: 5}
    got = log.read(topic, [(0, 5), (0, 19), (0, 20), (0, 49), (0, 50), (1, 4), (1, 5), (1, 10_000), (0, -1)])
    assert [r.offset if r else None for r in got] == [None, None, 20, 49, None, 4, None, None, None]
    # Records appended after a read are seen by the next one (the cached end is refreshed).
    fill(log, topic, 1, 3)
    assert [r.offset if r else None for r in log.read(topic, [(1, 5), (1, 7)])] == [5, 7]


def test_a_log_start_that_moved_after_the_bounds_were_cached_reads_as_none(
    kafka_bootstrap: str, admin: KafkaAdminClient
) -> None:
    # Without the cache of records read in passing: with it, offset 3 (walked past by the first
    # read) would still be served after the deletion, which is right but not what is tested here.
    log = KafkaCommitLog(kafka_bootstrap, read_cache_records=0)
    try:
        topic = new_topic(log, partitions=1)
        fill(log, topic, 0, 30)
        assert log.read(topic, [(0, 1)])[0] is not None  # caches the bounds [0, 30)
        admin.delete_records({TopicPartition(topic, 0): 25})
        got = log.read(topic, [(0, 3), (0, 26)])
        assert [r.offset if r else None for r in got] == [None, 26]
    finally:
        log.close()


def test_records_walked_past_are_kept_and_served_without_a_fetch(kafka_bootstrap: str) -> None:
    cached = KafkaCommitLog(kafka_bootstrap, read_gap=50, read_cache_records=40)
    try:
        topic = new_topic(cached, partitions=1)
        fill(cached, topic, 0, 100)
        # Wanted offsets 10 apart: the read walks through the records between them, in order.
        first = cached.read(topic, [(0, o) for o in range(0, 100, 10)])
        assert [r.offset for r in first if r] == list(range(0, 100, 10))
        fetched = cached.reader.fetches  # reads that went to the broker
        # The newest 40 walked past are kept (81..89 among them); a position asked twice gets
        # the record twice.
        again = cached.read(topic, [(0, 85), (0, 81), (0, 85)])
        assert cached.reader.fetches == fetched
        assert [(r.offset, r.value[:6]) for r in again if r and r.value] == [
            (85, b"000085"), (81, b"000081"), (85, b"000085")]
        # A record served from the cache leaves it; the next read of it fetches again.
        assert [r.offset for r in cached.read(topic, [(0, 85)]) if r] == [85]
        assert cached.reader.fetches == fetched + 1
        # Offset 1 was walked past first, so it was dropped when the cache was full.
        assert [r.offset for r in cached.read(topic, [(0, 1)]) if r] == [1]
        assert cached.reader.fetches == fetched + 2
        assert 0 < cached.read_cache.records <= 40
    finally:
        cached.close()


def test_follow_reads_a_topic_ahead_into_the_cache(kafka_bootstrap: str) -> None:
    ahead = KafkaCommitLog(kafka_bootstrap, read_cache_records=1_000)
    try:
        topic = new_topic(ahead, partitions=2)
        fill(ahead, topic, 0, 10)  # before following: not read ahead
        ahead.follow(topic)
        follower = ahead.follower
        assert follower is not None
        deadline = time.monotonic() + 20
        while follower.kept < 1 and time.monotonic() < deadline:  # wait until it is at the end
            fill(ahead, topic, 1, 1)
            time.sleep(0.2)
        written = fill(ahead, topic, 0, 50) + fill(ahead, topic, 1, 50)
        while ahead.read_cache.records < follower.kept or follower.kept < 100:
            assert time.monotonic() < deadline, f"follower kept {follower.kept}"
            time.sleep(0.05)
        fetched = ahead.reader.fetches  # reads that went to the broker
        got = ahead.read(topic, written)
        assert ahead.reader.fetches == fetched and [(r.partition, r.offset) for r in got if r] == written
        assert follower.hits >= 100
        # Records written before following started are fetched as usual.
        assert [r.offset for r in ahead.read(topic, [(0, 3)]) if r] == [3] and ahead.reader.fetches == fetched + 1
    finally:
        ahead.close()
    assert ahead.follower is None


def test_a_follower_whose_records_are_not_asked_for_pauses(kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from timerwheel.transports.kafka.follower import Follower

    monkeypatch.setattr(Follower, "JUDGE_EVERY", 50)
    ahead = KafkaCommitLog(kafka_bootstrap, read_cache_records=1_000)
    try:
        topic = new_topic(ahead, partitions=1)
        ahead.follow(topic)
        follower = ahead.follower
        assert follower is not None
        deadline = time.monotonic() + 20
        while follower.paused == 0:  # nobody reads: after 50 records kept it judges itself useless
            assert time.monotonic() < deadline, f"kept {follower.kept}, paused {follower.paused}"
            fill(ahead, topic, 0, 10)
            time.sleep(0.1)
    finally:
        ahead.close()


def test_a_consumer_reads_assigned_partitions_from_the_callers_offsets_and_seeks(log: KafkaCommitLog) -> None:
    topic = new_topic(log, partitions=3)
    for p in range(3):
        fill(log, topic, p, 10)
    consumer = log.consumer(topic, {0: 4, 2: 0})
    try:
        seen: list[tuple[int, int]] = []
        deadline = time.monotonic() + 10
        while len(seen) < 16 and time.monotonic() < deadline:
            seen += [(r.partition, r.offset) for r in consumer.poll(100, 0.5)]
        assert sorted(seen) == [(0, o) for o in range(4, 10)] + [(2, o) for o in range(10)]
        assert [o for p, o in seen if p == 2] == list(range(10))  # offset order per partition
        assert consumer.position(0) == 10 and consumer.position(2) == 10
        assert consumer.poll(100, 0.2) == []
        consumer.seek(2, 7)
        assert consumer.position(2) == 7
        again: list[int] = []
        deadline = time.monotonic() + 10
        while len(again) < 3 and time.monotonic() < deadline:
            again += [r.offset for r in consumer.poll(100, 0.5) if r.partition == 2]
        assert again == [7, 8, 9]
        with pytest.raises(KeyError):
            consumer.position(1)
    finally:
        consumer.close()


def test_ensure_topic_creates_once_and_reports_the_existing_count(log: KafkaCommitLog) -> None:
    topic = f"t-{uuid.uuid4().hex[:10]}"
    assert log.ensure_topic(topic, 5) == 5
    assert log.ensure_topic(topic, 2) == 5  # an existing topic is left alone
    assert log.partitions(topic) == 5
    auto = f"t-{uuid.uuid4().hex[:10]}"
    assert log.partitions(auto) == 1  # created with the broker default, as auto-creation does


def test_retention_is_read_from_the_topic_or_the_broker_default(log: KafkaCommitLog) -> None:
    three_days = 3 * 86_400_000
    topic = f"t-{uuid.uuid4().hex[:10]}"
    log.ensure_topic(topic, 1, configs={"retention.ms": str(three_days)})
    assert log.topic_retention_ms(topic) == three_days
    forever = f"t-{uuid.uuid4().hex[:10]}"
    log.ensure_topic(forever, 1, configs={"retention.ms": "-1"})
    assert log.topic_retention_ms(forever) is None
    default = new_topic(log, partitions=1)
    assert log.topic_retention_ms(default) == 168 * 3_600_000  # scripts/kafka.sh: log.retention.hours=168


def test_offsets_and_retention_of_a_missing_topic_raise(log: KafkaCommitLog) -> None:
    missing = f"missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(KafkaLogError, match="does not exist"):
        log.end_offsets(missing)
    with pytest.raises(KafkaLogError, match="does the topic exist"):
        log.topic_retention_ms(missing)


def test_a_failed_append_says_which_records_were_written(log: KafkaCommitLog) -> None:
    topic = new_topic(log, partitions=1)
    too_big = b"x" * (2 * 1024 * 1024)  # over the producer's max_request_size
    with pytest.raises(KafkaLogError, match="1 of 3 records failed") as failure:
        log.append([OutRecord(topic, None, b"a"), OutRecord(topic, None, too_big), OutRecord(topic, None, b"c")])
    assert failure.value.written == [(0, 0), None, (0, 1)]
    assert list(failure.value.refused) == [1] and "MessageSizeTooLarge" in failure.value.refused[1]


def test_append_until_written_dead_letters_a_refused_record_and_duplicates_nothing(log: KafkaCommitLog) -> None:
    from timerwheel import TimerConfig
    from timerwheel.log import stage_logger
    from timerwheel.metrics import Metrics
    from timerwheel.stages.base import StageContext, append_until_written

    topic, dlq = new_topic(log, partitions=1), new_topic(log, partitions=1)
    ctx = StageContext(TimerConfig(dlq_topic=dlq), SimulatedClock(), Metrics(), consumer="t")
    too_big = OutRecord(topic, b"k", b"x" * (2 * 1024 * 1024), (("tw-id", b"m-1"), ("user", b"u")))
    append_until_written(ctx, log, [OutRecord(topic, None, b"a"), too_big, OutRecord(topic, None, b"c")],
                         stage_logger("test"))
    # Each good record once (a whole-batch retry would have written "a" and "c" twice).
    assert [r.value for r in log.read(topic, [(0, 0), (0, 1), (0, 2)]) if r] == [b"a", b"c"]
    [dead] = log.read(dlq, [(0, 0)])
    assert dead is not None and dead.key == b"k" and dead.value == b""
    assert dict(dead.headers)["tw-id"] == b"m-1" and "user" not in dict(dead.headers)
    assert b"refused the record: MessageSizeTooLargeError" in dict(dead.headers)["tw-error"]
    assert ctx.metrics.counter("refused_records") == 1


def test_the_log_keeps_working_across_a_broker_restart(
    kafka_bootstrap: str, kafka_control: ServerControl
) -> None:
    commit_log = KafkaCommitLog(kafka_bootstrap, request_timeout_s=5, read_timeout_s=3)
    try:
        topic = new_topic(commit_log, partitions=2)
        before = fill(commit_log, topic, 0, 20)
        consumer = commit_log.consumer(topic, {0: 0})
        assert len(consumer.poll(100, 5)) == 20
        assert all(commit_log.read(topic, before))  # the reader is connected before the stop

        kafka_control.stop()
        # A record that exists but cannot be fetched is an error, never None (None would send
        # a live message to the dead-letter topic).
        with pytest.raises(KafkaLogError):
            commit_log.read(topic, before[:3])
        kafka_control.start()

        after: list[tuple[int, int]] = []
        deadline = time.monotonic() + 60
        while not after:  # the stages retry the same way
            try:
                after = fill(commit_log, topic, 0, 5)
            except KafkaLogError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert [o for _, o in after] == list(range(20, 25))
        got = commit_log.read(topic, before + after)
        assert [r.offset if r else None for r in got] == list(range(25))
        polled: list[int] = []
        deadline = time.monotonic() + 30
        while len(polled) < 5 and time.monotonic() < deadline:
            polled += [r.offset for r in consumer.poll(100, 1)]
        assert polled == list(range(20, 25))
        consumer.close()
    finally:
        commit_log.close()


def test_appends_work_again_after_records_in_flight_expired_during_a_broker_outage(
    kafka_bootstrap: str, kafka_control: ServerControl
) -> None:
    """Seen in e2e: records in flight when the broker went away expired, and kafka-python's
    idempotent producer then held every later record of the partition for good. The producer the
    log replaces then is closed with ``internals.force_close``: checked on a producer of its own
    during the outage, that it stops one whose records cannot be sent, I/O thread and all."""
    commit_log = KafkaCommitLog(kafka_bootstrap, request_timeout_s=4)

    topic = new_topic(commit_log, partitions=1)
    done: list[float] = []
    failures: list[str] = []
    stop = threading.Event()

    def keep_appending() -> None:
        while not stop.is_set():
            try:
                fill(commit_log, topic, 0, 50)
                done.append(time.monotonic())
            except KafkaLogError as exc:
                failures.append(str(exc))
                time.sleep(0.2)

    stuck_id = f"stuck-{uuid.uuid4().hex[:8]}"
    stuck = KafkaProducer(bootstrap_servers=kafka_bootstrap, client_id=stuck_id, acks="all",
                          delivery_timeout_ms=120_000)
    assert stuck.partitions_for(topic) == {0}  # its metadata known: a send goes to its accumulator

    def stuck_thread_alive() -> bool:
        return any(t.name == f"{stuck_id}-network-thread" and t.is_alive() for t in threading.enumerate())

    writer = threading.Thread(target=keep_appending, daemon=True)
    writer.start()
    try:
        time.sleep(1)
        kafka_control.stop()
        down = time.monotonic()
        unsent = stuck.send(topic, b"v")
        with pytest.raises(kafka_errors.KafkaTimeoutError):
            stuck.close(timeout=0.5)  # kafka-python's own close gives up before it stops its I/O thread
        assert stuck_thread_alive() and not unsent.is_done
        internals.force_close(stuck, 0.5)
        assert unsent.is_done and unsent.failed() and not stuck_thread_alive()
        time.sleep(max(0.0, 6 - (time.monotonic() - down)))  # past the delivery timeout: what was in flight expires
        kafka_control.start()
        back = time.monotonic()
        deadline = back + 60
        while not [t for t in done if t > back + 1] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert [t for t in done if t > back + 1], f"appends never went through again: {failures[-3:]}"
        assert failures, "nothing failed during the outage: the test did not test anything"
    finally:
        stop.set()
        writer.join(60)
        commit_log.close()


def test_large_records_are_read_with_fetches_of_batch_bytes(kafka_bootstrap: str) -> None:
    """With records larger than the 64 KiB partition fetch, a fetch returns one record per round
    trip: once a read has seen them, reads use a reader whose fetches take TW_BATCH_BYTES."""
    big = KafkaCommitLog(kafka_bootstrap, fetch_bytes=4 * 2**20, read_cache_bytes=0)
    try:
        topic = new_topic(big, partitions=1)
        written = [pos for _ in range(8) for pos in fill(big, topic, 0, 1, size=300_000)]
        assert big.reader.fetch_bytes == 64 * 1024
        first = big.read(topic, written[:2])
        assert big.reader.fetch_bytes == 4 * 2**20
        rest = big.read(topic, written[2:])
        for (_partition, offset), rec in zip(written, first + rest, strict=True):
            assert rec is not None and rec.offset == offset and rec.value is not None and len(rec.value) == 300_000
    finally:
        big.close()


def test_a_group_member_subscribed_to_topics_created_just_before_gets_their_partitions(log: KafkaCommitLog) -> None:
    """kafka-python 3.0.12: when the first metadata of a member's topics arrives after its first
    join, the member joins again; a ``poll`` that times out after the leader computed that second
    assignment but before the SyncGroup answer leaves it unapplied for good (the next poll sees
    nothing left to join). A RetryConsumer in CI polled with no partitions for minutes. Short polls
    hit that window nearly every time; the group consumer must not need a second join."""
    for _ in range(3):
        topics = [new_topic(log, 2), new_topic(log, 2)]
        consumer = log.group_consumer(f"g-{uuid.uuid4().hex[:10]}", topics)
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                consumer.poll(10, 0.0)
                if len(consumer.assignment()) == 4:
                    break
                time.sleep(0.001)
            assert consumer.assignment() == {(t, p) for t in topics for p in (0, 1)}
        finally:
            consumer.close()


def test_read_since_gives_the_committed_records_from_a_timestamp_to_the_end(log: KafkaCommitLog) -> None:
    """A new shard owner reads its progress back from ``R`` less a margin (``timerwheel.progress``):
    the records at or after a timestamp, up to the end as of the call, none of an aborted
    transaction."""
    topic = new_topic(log, 2)
    log.append([OutRecord(topic, None, f"v{t}".encode(), (), partition=1, timestamp_ms=t) for t in (1_000, 2_000)])
    producer = KafkaProducer(bootstrap_servers=log.bootstrap, transactional_id=f"tx-{uuid.uuid4().hex[:8]}")
    producer.init_transactions()
    producer.begin_transaction()
    producer.send(topic, b"aborted", partition=1, timestamp_ms=2_500).get(10)
    producer.abort_transaction()
    producer.close()
    log.append([OutRecord(topic, None, b"v3000", (), partition=1, timestamp_ms=3_000)])
    assert [r.value for r in log.read_since(topic, 1, 1_500)] == [b"v2000", b"v3000"]
    assert [r.value for r in log.read_since(topic, 1, 0)] == [b"v1000", b"v2000", b"v3000"]
    assert log.read_since(topic, 1, 3_001) == []
    assert log.read_since(topic, 0, 0) == []
