"""Disaster recovery from Kafka (``timerwheel recover-from-kafka``): the pending set computed from
the timer, dead-letter and destination topics, the copies, the fresh shards at the timer topic's
end, and the refusals. The whole loop with the stage processes is e2e/test_disaster_recovery.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
from timerwheel.config import TimerConfig
from timerwheel.records import OutRecord, Record
from timerwheel.runtime.disaster import KafkaRecoveryRefused, Outcomes, recover_from_kafka, recovered_record
from timerwheel.store.deployment import Source, load_source
from timerwheel.store.layout import open_shard
from timerwheel.transports.kafka.log import KafkaCommitLog
from timerwheel.wire import TimerRules, default_id

T0 = 1_700_000_000_000
CFG = TimerConfig(timer_topic="tt", dlq_topic="dlq", allow_topics=("orders.*",))


def timer(partition: int, offset: int, mid: str | None, *, at: int = T0 + 5_000, topic: str = "orders",
          extra: tuple[tuple[str, bytes], ...] = (), ts: int = T0) -> Record:
    headers: tuple[tuple[str, bytes], ...] = (("tw-topic", topic.encode()), ("tw-deliver-at", str(at).encode()))
    if mid is not None:
        headers += (("tw-id", mid.encode()),)
    return Record("tt", partition, offset, ts, b"k", b"v", headers + extra)


def cancel(partition: int, offset: int, target: str) -> Record:
    return Record("tt", partition, offset, T0, b"k", None, (("tw-cancel", target.encode()),
                                                             ("tw-deliver-at", str(T0 + 5_000).encode())))


def delivered(topic: str, mid: str) -> Record:
    return Record(topic, 0, 0, T0, b"k", b"v", (("tw-id", mid.encode()),))


def test_each_id_is_judged_by_its_latest_record_and_what_the_topics_say() -> None:
    found = Outcomes(TimerRules(CFG), "dlq", "tt")
    for r in [
        timer(0, 0, "done"), timer(0, 1, "waiting"), timer(0, 2, "called-off"), cancel(0, 3, "called-off"),
        timer(1, 0, "rolled"), timer(1, 5, "rolled", extra=(("tw-roll", b"1"),)),  # a hop: the latest
        timer(1, 1, "bad", topic="__secret"),  # not allowed: enqueue-get dead-lettered it
        timer(1, 2, "dead"), timer(1, 3, None),  # no tw-id: <partition>-<offset>
        timer(0, 9, "late-cancelled-but-delivered"), cancel(0, 10, "late-cancelled-but-delivered"),
    ]:
        found.add_timer_record(r)
    found.add_destination_record(delivered("orders", "done"))
    found.add_destination_record(delivered("orders", "late-cancelled-but-delivered"))
    found.add_destination_record(delivered("orders", "someone-elses"))  # not a candidate: not held
    found.add_dead_letter(Record("dlq", 0, 0, T0, None, b"", (("tw-id", b"dead"), ("tw-error", b"held too long"))))
    found.add_dead_letter(Record("dlq", 0, 1, T0, None, b"", (("tw-source", b"other/1/3"),)))  # not our topic
    assert found.scanned == 11 and len(found.latest) == 8
    assert found.delivered == {"done", "late-cancelled-but-delivered"}
    assert {mid: found.outcome(mid) for mid in found.latest} == {
        "done": "delivered", "waiting": "rescheduled", "called-off": "cancelled", "rolled": "rescheduled",
        "bad": "dead_lettered", "dead": "dead_lettered", default_id(1, 3): "rescheduled",
        "late-cancelled-but-delivered": "delivered"}
    assert [(mid, e.partition, e.offset) for mid, e in found.to_reschedule()] == [
        ("waiting", 0, 1), (default_id(1, 3), 1, 3), ("rolled", 1, 5)]
    assert found.counts() == {"delivered": 2, "cancelled": 1, "dead_lettered": 2, "rescheduled": 3}
    assert found.destinations() == ["orders"]  # not for invalid or cancelled ids


def test_a_dead_letter_without_id_names_its_timer_record_by_source() -> None:
    found = Outcomes(TimerRules(CFG), "dlq", "tt")
    found.add_timer_record(timer(2, 7, None))
    found.add_dead_letter(Record("dlq", 0, 0, T0, None, b"", (("tw-source", b"tt/2/7"),)))
    assert found.outcome(default_id(2, 7)) == "dead_lettered"


def test_a_copy_is_absolute_keeps_its_id_and_what_the_hop_carried() -> None:
    rec = Record("tt", 3, 40, T0, b"key", b"value", (
        ("tw-topic", b"orders"), ("tw-delay-ms", b"5000"), ("tw-roll", b"2"), ("traceparent", b"00-ab-cd-01"),
        ("user", b"u")))
    copy = recovered_record(rec, default_id(3, 40), TimerRules(CFG).delivery_time(rec, 0, check_max=False))
    assert copy == OutRecord("tt", b"key", b"value", (
        ("tw-topic", b"orders"), ("tw-roll", b"2"), ("traceparent", b"00-ab-cd-01"), ("user", b"u"),
        ("tw-enqueued-at", str(T0).encode()), ("tw-deliver-at", str(T0 + 5_000).encode()),
        ("tw-id", b"3-40")), partition=3)


def resched(partition: int, offset: int, mid: str, revision: int, at: int, replaces: int,
            first: int | None = None) -> Record:
    extra: tuple[tuple[str, bytes], ...] = (("tw-revision", str(revision).encode()),
                                            ("tw-replaces", str(replaces).encode()))
    if first is not None:  # a roll hop of the reschedule's marker
        extra += (("tw-first-offset", str(first).encode()), ("tw-roll", b"1"))
    return timer(partition, offset, mid, at=at, extra=extra)


def test_a_reschedule_is_a_move_and_the_first_cancel_or_reschedule_of_a_revision_decides() -> None:
    """Issue 31: a reschedule record moves the id to its next revision (not a new timer); of two
    markers of one revision the first by its producer's offset decides, even when the later one's
    roll hop comes first in the partition; the copy of a winning reschedule is a plain message."""
    found = Outcomes(TimerRules(CFG), "dlq", "tt")
    at, t2, t3 = T0 + 5_000, T0 + 9_000, T0 + 12_000
    for r in [
        timer(0, 0, "moved", at=at), resched(0, 1, "moved", 1, t2, at),
        resched(0, 2, "moved", 1, t3, at),  # void: the same ticket again
        cancel(0, 3, "moved"),  # void: a cancel of the old ticket after its reschedule
        timer(0, 4, "revived", at=at), cancel(0, 5, "revived"), resched(0, 6, "revived", 1, t2, at),
        timer(0, 7, "put-back", at=at), resched(0, 8, "put-back", 1, t2, at),
        timer(0, 9, "put-back", at=t2, extra=(("tw-revision", b"1"), ("tw-roll", b"1"))),  # dequeue-put's
        timer(0, 10, "rolled-first", at=at), resched(0, 20, "rolled-first", 1, t3, at, first=12),
        resched(0, 21, "rolled-first", 1, t2, at, first=11),  # the first: its hop just came later
    ]:
        found.add_timer_record(r)
    assert {mid: found.outcome(mid) for mid in found.latest} == {
        "moved": "rescheduled", "revived": "cancelled", "put-back": "rescheduled", "rolled-first": "rescheduled"}
    assert [(mid, e.offset) for mid, e in found.to_reschedule()] == [
        ("moved", 1), ("put-back", 9), ("rolled-first", 21)]
    rec = resched(0, 1, "moved", 1, t2, at)
    copy = recovered_record(rec, "moved", TimerRules(CFG).delivery_time(rec, 0, check_max=False))
    hdr = dict(copy.headers)
    assert "tw-replaces" not in hdr and hdr["tw-revision"] == b"1" and hdr["tw-deliver-at"] == str(t2).encode()


# -- against the real Kafka and Redis -------------------------------------------------------------


@pytest.fixture
def servers(kafka_bootstrap: str, redis_url: str) -> tuple[KafkaCommitLog, redis.Redis]:
    log = KafkaCommitLog(kafka_bootstrap)
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield log, client  # type: ignore[misc]
    log.close()
    client.close()


def test_recovery_reschedules_the_pending_after_the_end_into_fresh_shards(
        tmp_path: Path, servers: tuple[KafkaCommitLog, redis.Redis]) -> None:
    log, client = servers
    uid = uuid.uuid4().hex[:8]
    cfg = TimerConfig(data_dir=str(tmp_path / "data"), shards=2, timer_topic=f"dr-timer-{uid}",
                      dlq_topic=f"dr-dlq-{uid}", allow_topics=(f"dr-dest-{uid}",), fsync=False)
    dest = f"dr-dest-{uid}"
    log.ensure_topic(cfg.timer_topic, 3)
    log.ensure_topic(dest, 1)

    def rec(mid: str, partition: int, *extra: tuple[str, bytes]) -> OutRecord:
        return OutRecord(cfg.timer_topic, mid.encode(), b"v-" + mid.encode(),
                         (("tw-topic", dest.encode()), ("tw-deliver-at", str(T0 + 60_000).encode()),
                          ("tw-id", mid.encode()), *extra), partition=partition)

    log.append([rec(f"m{i}", i % 3) for i in range(9)])
    log.append([OutRecord(cfg.timer_topic, b"m1", None, (("tw-cancel", b"m1"),
                                                         ("tw-deliver-at", str(T0 + 60_000).encode())), partition=1),
                rec("m2", 2, ("tw-roll", b"1"))])  # m2 rolled once
    log.append([OutRecord(dest, None, b"v", (("tw-id", b"m0"),))])  # m0 delivered
    client.xadd("tw:q:deliver:0", {"d": b"an entry of the lost shards"})
    ends_before = log.end_offsets(cfg.timer_topic)

    report = recover_from_kafka(cfg, log, client, clock=lambda: T0)

    assert (report.scanned, report.delivered, report.cancelled, report.dead_lettered, report.rescheduled) == \
        (11, 1, 1, 0, 7)
    assert report.start_offsets == ends_before and report.ids_held == 9
    assert client.exists("tw:q:deliver:0") == 0
    consumer = log.consumer(cfg.timer_topic, ends_before)
    copies: list[Record] = []
    deadline = time.monotonic() + 30
    while len(copies) < 7 and time.monotonic() < deadline:
        copies += consumer.poll(100, 0.5)
    consumer.close()
    by_id = {r.header("tw-id"): r for r in copies}
    assert sorted(by_id) == [f"m{i}".encode() for i in range(2, 9)]
    assert by_id[b"m2"].header("tw-roll") == b"1" and by_id[b"m2"].partition == 2
    assert all(r.header("tw-deliver-at") == str(T0 + 60_000).encode() and r.partition == int(r.key[1:]) % 3
               for r in copies)
    for shard_id in range(2):
        shard = open_shard(cfg, shard_id, writer=False)
        enq, deq = shard.load_enqueue_checkpoint(), shard.load_dequeue_checkpoint()
        assert enq is not None and deq is not None
        assert enq.next_offsets == {p: o for p, o in ends_before.items() if p % 2 == shard_id}
        assert (enq.write_ms, enq.flushed_pos, deq.read_ms) == (T0, 0, T0)
        shard.close()
    # the fresh shards' offsets are this topic's: a start on another incarnation is refused
    assert load_source(cfg.data_dir) == Source(log.cluster_id(), log.topic_id(cfg.timer_topic))

    with pytest.raises(KafkaRecoveryRefused, match="holds shards"):
        recover_from_kafka(cfg, log, client)


def test_recovery_refuses_while_a_stage_runs_in_one_line(
        tmp_path: Path, kafka_bootstrap: str, redis_url: str, servers: tuple[KafkaCommitLog, redis.Redis]) -> None:
    _log, client = servers
    client.set("tw:alive:dequeue-put-host-1-abc", b"1", px=60_000)
    client.set("tw:lease:{enqueue-put:0}:owner", b"enqueue-put-host-2-def:4", px=60_000)
    done = subprocess.run([sys.executable, "-m", "timerwheel.cli", "recover-from-kafka", "--kafka", kafka_bootstrap,
                           "--redis", redis_url, "--data-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert "stages are still running (dequeue-put-host-1-abc, enqueue-put:0 by enqueue-put-host-2-def:4)" in lines[0]
    assert done.stdout == "" and not list(tmp_path.iterdir())


def test_dry_run_reports_and_writes_nothing(
        tmp_path: Path, kafka_bootstrap: str, redis_url: str, servers: tuple[KafkaCommitLog, redis.Redis]) -> None:
    log, _client = servers
    uid = uuid.uuid4().hex[:8]
    timer_topic = f"dr-timer-{uid}"
    log.ensure_topic(timer_topic, 1)
    log.append([OutRecord(timer_topic, None, b"v", (("tw-topic", b"x"), ("tw-deliver-at", b"1")))])
    done = subprocess.run([sys.executable, "-m", "timerwheel.cli", "recover-from-kafka", "--kafka", kafka_bootstrap,
                           "--redis", redis_url, "--data-dir", str(tmp_path / "d"), "--timer-topic", timer_topic,
                           "--dlq-topic", f"dr-dlq-{uid}", "--dry-run"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert {k: report[k] for k in ("scanned", "delivered", "cancelled", "dead_lettered", "rescheduled", "dry_run")} == \
        {"scanned": 1, "delivered": 0, "cancelled": 0, "dead_lettered": 0, "rescheduled": 1, "dry_run": True}
    assert not (tmp_path / "d").exists() and log.end_offsets(timer_topic) == {0: 1}
