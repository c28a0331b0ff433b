"""The capabilities beyond CommitLog / WorkQueue: each transport says what it can, and the
stages ask with ``isinstance`` (no server: the Kafka log connects lazily)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from timerwheel.transports.base import AtomicLog, DeadLetterLog, ExpiringLog, FollowingLog, ReportsUndecodable
from timerwheel.transports.kafka.consumers import KafkaConsumerAdapter
from timerwheel.transports.kafka.log import KafkaCommitLog
from timerwheel.transports.local.log import LocalCommitLog
from timerwheel.transports.memory import MemoryWorkQueue
from timerwheel.transports.redisq import RedisWorkQueue


class _Assignable:
    """Just enough of a KafkaConsumer for the adapter to be made."""

    def assign(self, partitions: Any) -> None:
        pass

    def seek(self, partition: Any, offset: int) -> None:
        pass


def test_the_local_log_follows_expires_and_writes_all_or_nothing_through_its_journal(tmp_path: Path) -> None:
    log = LocalCommitLog(tmp_path, fsync=False)
    try:
        assert isinstance(log, FollowingLog) and isinstance(log, ExpiringLog)
        assert isinstance(log, AtomicLog) and isinstance(log, DeadLetterLog)
        assert not isinstance(log.consumer("t", {0: 0}), ReportsUndecodable)
    finally:
        log.close()


def test_the_kafka_log_follows_and_writes_transactions_but_leaves_retention_to_the_broker() -> None:
    log = KafkaCommitLog("127.0.0.1:1")
    try:
        assert isinstance(log, FollowingLog) and isinstance(log, AtomicLog)
        assert not isinstance(log, ExpiringLog)
    finally:
        log.close()
    assert isinstance(KafkaConsumerAdapter(_Assignable, "t", {0: 0}, None), ReportsUndecodable)


def test_only_the_in_process_queue_takes_entry_objects() -> None:
    assert MemoryWorkQueue("q", 1, 8).in_process is True
    assert RedisWorkQueue.in_process is False
