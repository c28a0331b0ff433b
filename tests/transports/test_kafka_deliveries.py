"""A shard owner's exactly-once releases on real Kafka (issue 31; design 7.1, E1 and E4): each
batch's records and its progress record commit together or not at all, a new owner fences the old
one and reads back what was committed, and a batch cut off before its commit leaves nothing a
``read_committed`` reader sees. Not wired into dequeue-put yet (``ShardDeliveries``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from kafka import KafkaProducer
from timerwheel.progress import Progress, source_position
from timerwheel.records import OutRecord
from timerwheel.transports.kafka.errors import KafkaLogError
from timerwheel.transports.kafka.log import KafkaCommitLog

#: Near now: Kafka's retention (7 days) deletes older records at its next check.
SLOT = int(time.time()) * 1000 - 3_600_000


@pytest.fixture
def log(kafka_bootstrap: str) -> Iterator[KafkaCommitLog]:
    log = KafkaCommitLog(kafka_bootstrap)
    yield log
    log.close()


@pytest.fixture
def names(log: KafkaCommitLog) -> tuple[str, str, str]:
    uid = uuid.uuid4().hex[:8]
    prefix, dest, progress = f"tw-eo-{uid}", f"tw-eo-{uid}-dest", f"tw-eo-{uid}_progress"
    log.ensure_topic(dest, 1)
    log.ensure_topic(progress, 2)
    return prefix, dest, progress


def _committed(log: KafkaCommitLog, topic: str) -> list[bytes | None]:
    return [r.value for r in log.read_since(topic, 0, 0)]


def test_a_new_owner_reads_back_what_the_old_one_committed_and_fences_it(
        log: KafkaCommitLog, names: tuple[str, str, str]) -> None:
    prefix, dest, progress = names
    old = log.shard_deliveries(prefix, progress, 1)
    assert len(old.take(SLOT)) == 0
    old.commit([OutRecord(dest, None, b"m1", (), partition=0)],
               Progress(1, 3, {SLOT: [source_position(1, 10)]}), SLOT + 5)
    new = log.shard_deliveries(prefix, progress, 1)
    finished = new.take(SLOT)
    assert finished.holds(SLOT, 1, 10) and len(finished) == 1
    with pytest.raises(KafkaLogError):  # the zombie: fenced by the new owner's init
        old.commit([OutRecord(dest, None, b"twice", (), partition=0)],
                   Progress(1, 3, {SLOT: [source_position(1, 10)]}), SLOT + 6)
    new.commit([OutRecord(dest, None, b"m2", (), partition=0)], Progress(1, 4, {SLOT: [source_position(1, 11)]}),
               SLOT + 7)
    assert _committed(log, dest) == [b"m1", b"m2"]
    assert log.shard_deliveries(prefix, progress, 1).take(SLOT).holds(SLOT, 1, 11)
    for d in (old, new):
        d.close()


def test_a_batch_cut_off_before_its_commit_is_neither_seen_nor_read_back(
        log: KafkaCommitLog, names: tuple[str, str, str]) -> None:
    """The owner crashes after its sends, before its commit: the next owner's init aborts the
    batch; a read_committed reader never sees it, and the read-back does not count it as done."""
    prefix, dest, progress = names
    crashed = KafkaProducer(bootstrap_servers=log.bootstrap, transactional_id=f"{prefix}-deliver-0")
    crashed.init_transactions()
    crashed.begin_transaction()
    crashed.send(dest, b"cut", partition=0).get(10)
    crashed.send(progress, Progress(0, 1, {SLOT: [source_position(0, 1)]}).encode(), partition=0).get(10)
    crashed.flush()
    successor = log.shard_deliveries(prefix, progress, 0)
    assert len(successor.take(SLOT)) == 0
    successor.commit([OutRecord(dest, None, b"once", (), partition=0)],
                     Progress(0, 2, {SLOT: [source_position(0, 1)]}), SLOT + 1)
    assert _committed(log, dest) == [b"once"]
    successor.close()
    crashed.close(timeout=0)


def test_a_commit_before_take_is_refused(log: KafkaCommitLog, names: tuple[str, str, str]) -> None:
    prefix, dest, progress = names
    d = log.shard_deliveries(prefix, progress, 0)
    with pytest.raises(KafkaLogError, match="take the shard"):
        d.commit([OutRecord(dest, None, b"x", (), partition=0)], Progress(0, 1, {}), SLOT)
    d.close()
