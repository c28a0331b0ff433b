"""The wiring both modes share: a stage built for the sole process (embedded, ``timerwheel run``)
owns and reads everything; one built as a replica (``timerwheel stage``) its share; the timer
topic's retention check; enqueue-get's checkpointed offsets."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from timerwheel import SimulatedClock, TimerConfig
from timerwheel.errors import TimerwheelError
from timerwheel.runtime.wiring import (
    Transports,
    build_stage,
    check_timer_topic,
    checkpoint_offsets_of,
    local_transports,
)
from timerwheel.stages import StageContext
from timerwheel.store.checkpoint import EnqueueCheckpoint
from timerwheel.store.layout import open_shard
from timerwheel.transports.local.log import LocalCommitLog

NOW = 1_700_000_000_000


class RetainingLog(LocalCommitLog):
    """The local log, saying what retention its topics have (Kafka's ``topic_retention_ms``)."""

    retention_ms: int | None = None

    def topic_retention_ms(self, topic: str) -> int | None:
        return self.retention_ms


@pytest.fixture
def wired(tmp_path: Path) -> Iterator[tuple[TimerConfig, Transports]]:
    cfg = TimerConfig(data_dir=str(tmp_path), shards=2, timer_partitions=4, fsync=False)
    transports = local_transports(cfg, SimulatedClock(NOW))
    transports.commit_log.close()
    transports.commit_log = RetainingLog(tmp_path / "log", default_partitions=1, fsync=False)
    yield cfg, transports
    transports.commit_log.close()


def test_enqueue_get_reads_every_timer_partition_alone_and_its_share_as_a_replica(
        wired: tuple[TimerConfig, Transports]) -> None:
    cfg, transports = wired
    ctx = StageContext(cfg, SimulatedClock(NOW))
    assert build_stage("enqueue-get", cfg, ctx, transports, sole=True).partitions == [0, 1, 2, 3]
    second_of_two = cfg.replace(replicas=2, replica_index=1)
    assert build_stage("enqueue-get", second_of_two, ctx, transports).partitions == [1, 3]


def test_enqueue_put_owns_every_shard_alone_and_only_its_own_shards_as_a_replica(
        wired: tuple[TimerConfig, Transports]) -> None:
    cfg, transports = wired
    for config, sole, owned in ((cfg.replace(own_shards=(1,)), True, [0, 1]), (cfg.replace(own_shards=(1,)), False, [1])):
        stage = build_stage("enqueue-put", config, StageContext(config, SimulatedClock(NOW), consumer="me"),
                            transports, sole=sole)
        try:
            stage.step(0.0)
            assert sorted(stage.owned) == owned, sole
        finally:
            stage.close()


def test_a_timer_topic_that_would_lose_rolled_messages_is_refused(wired: tuple[TimerConfig, Transports]) -> None:
    cfg, transports = wired
    log = transports.commit_log
    assert isinstance(log, RetainingLog)
    need = int(cfg.roll_window_ms * 1.5)
    for retention in (None, need, 10 * need):
        log.retention_ms = retention
        assert check_timer_topic(cfg, log) == 4
    log.retention_ms = need - 1
    with pytest.raises(TimerwheelError, match=f"retention.ms={need - 1}, below 1.5 x TW_ROLL_WINDOW_MS \\({need}\\)"):
        check_timer_topic(cfg, log)
    assert log.partition_count(cfg.dlq_topic) == 1, "the dead-letter topic is made with the timer topic"


def test_checkpoint_offsets_are_the_shards_published_next_offsets(tmp_path: Path) -> None:
    cfg = TimerConfig(data_dir=str(tmp_path), shards=2, fsync=False)
    offsets = checkpoint_offsets_of(cfg)
    assert offsets(1) == {}, "no shard yet"
    shard = open_shard(cfg, 1, writer=True)
    try:
        assert offsets(1) == {}, "a shard without a checkpoint"
        shard.save_enqueue_checkpoint(EnqueueCheckpoint(flushed_pos=0, write_ms=NOW, next_offsets={1: 7, 3: 2}, epoch=1))
        assert offsets(1) == {1: 7, 3: 2} and offsets(0) == {}
        shard.save_enqueue_checkpoint(EnqueueCheckpoint(flushed_pos=0, write_ms=NOW, next_offsets={1: 9, 3: 2}, epoch=1))
        assert offsets(1) == {1: 9, 3: 2}
    finally:
        shard.close()
