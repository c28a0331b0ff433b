"""The source of a data directory's shards (issue 32, "a silent loss"): which cluster and which
incarnation of the timer topic their offsets point into. A start against another one, or with a
checkpoint beyond a partition's end, is refused in one line naming both and ``timerwheel rebase``;
a data directory from before the source was recorded is adopted; ``rebase`` starts afresh."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from kafka import KafkaAdminClient
from timerwheel.cli import main
from timerwheel.config import TimerConfig
from timerwheel.errors import SourceMismatchError
from timerwheel.records import OutRecord
from timerwheel.runtime.disaster import make_shards
from timerwheel.runtime.embedded import EmbeddedTimerwheel
from timerwheel.runtime.wiring import check_source
from timerwheel.store.deployment import (
    SETTINGS_FILE,
    DeploymentSettings,
    Source,
    check_settings,
    load_source,
    store_source,
    store_window,
)
from timerwheel.store.layout import found_shards, open_shard
from timerwheel.transports.kafka.log import KafkaCommitLog
from timerwheel.transports.local.log import LocalCommitLog

T0 = 1_700_000_000_000


@pytest.fixture
def kafka(kafka_bootstrap: str) -> Iterator[KafkaCommitLog]:
    log = KafkaCommitLog(kafka_bootstrap)
    yield log
    log.close()


def _config(tmp_path: Path, name: str = "src") -> TimerConfig:
    uid = uuid.uuid4().hex[:8]
    return TimerConfig(data_dir=str(tmp_path / "data"), shards=2, timer_topic=f"{name}-timer-{uid}",
                       dlq_topic=f"{name}-dlq-{uid}", timer_partitions=2, fsync=False)


def _written_from(cfg: TimerConfig, log: KafkaCommitLog, records: int) -> dict[int, int]:
    """Shards that have read ``records`` timer records of each partition, as enqueue-put leaves them."""
    log.ensure_topic(cfg.timer_topic, 2)
    log.append([OutRecord(cfg.timer_topic, None, b"v", (("tw-topic", b"x"), ("tw-deliver-at", str(T0).encode())),
                          partition=p) for p in (0, 1) for _ in range(records)])
    ends = log.end_offsets(cfg.timer_topic)
    check_settings(cfg.data_dir, DeploymentSettings.of(cfg), fsync=False)
    make_shards(cfg, ends, T0)
    return ends


def _make_again(bootstrap: str, log: KafkaCommitLog, topic: str) -> str:
    """Delete ``topic`` and make it again (empty): its new id."""
    old = log.topic_id(topic)
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.delete_topics([topic])
    finally:
        admin.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            log.ensure_topic(topic, 2)
        except Exception:  # noqa: BLE001 - still being deleted
            time.sleep(0.2)
            continue
        new = log.topic_id(topic)
        if new is not None and new != old:
            return new
        time.sleep(0.2)
    raise AssertionError(f"{topic} was not made again within 60 s")


def test_kafka_tells_its_cluster_id_and_a_new_topic_id_for_a_topic_made_again(
        kafka: KafkaCommitLog, kafka_bootstrap: str) -> None:
    topic = f"src-ids-{uuid.uuid4().hex[:8]}"
    kafka.ensure_topic(topic, 1)
    first = kafka.topic_id(topic)
    assert first and kafka.cluster_id() and kafka.cluster_id() == KafkaCommitLog(kafka_bootstrap).cluster_id()
    assert _make_again(kafka_bootstrap, kafka, topic) != first
    assert kafka.topic_id(f"src-none-{uuid.uuid4().hex[:8]}") is None


def test_the_local_log_has_ids_and_gives_one_to_a_topic_made_before_them(tmp_path: Path) -> None:
    log = LocalCommitLog(tmp_path / "log")
    log.ensure_topic("t", 1)
    assert log.topic_id("t") and log.topic_id("t") == LocalCommitLog(tmp_path / "log").topic_id("t")
    assert log.cluster_id() == LocalCommitLog(tmp_path / "log").cluster_id()
    assert log.topic_id("never-made") is None and not (tmp_path / "log" / "never-made").exists()
    legacy = tmp_path / "log" / "old" / "topic.json"
    legacy.parent.mkdir()
    (legacy.parent / "0").mkdir()
    legacy.write_text(json.dumps({"format": 1, "partitions": 1}))
    given = log.topic_id("old")
    assert given and json.loads(legacy.read_text()) == {"format": 1, "partitions": 1, "id": given}
    before = log.cluster_id()
    shutil.rmtree(tmp_path / "log")
    assert LocalCommitLog(tmp_path / "log").cluster_id() != before


def test_the_source_is_recorded_from_the_one_read_of_the_deployment_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On two mounts of one volume, both nodes record the source at once: a second open of the file
    while the other node replaces it can find it missing (a failed e2e start, "deployment file ...
    does not exist"; or, with the source read apart from the settings, a start that skipped recording
    it). ``check_source`` reads the file once and records the source beside the settings it read."""
    from timerwheel.store import deployment

    cfg = _config(tmp_path)
    log = LocalCommitLog(tmp_path / "log")
    log.ensure_topic(cfg.timer_topic, 2)
    check_settings(cfg.data_dir, DeploymentSettings.of(cfg), fsync=False)
    opens = []
    first_read = deployment._load

    def once(data_dir: str) -> object:  # the name missing at any second open
        opens.append(data_dir)
        return first_read(data_dir) if len(opens) == 1 else None

    monkeypatch.setattr(deployment, "_load", once)
    current = check_source(cfg, log, adopt=True, production=False)
    monkeypatch.undo()
    assert len(opens) == 1, "check_source opened the deployment file more than once"
    assert load_source(cfg.data_dir) == current and current.timer_topic_id


def test_a_stage_refuses_shards_of_a_timer_topic_made_again_in_one_line(
        tmp_path: Path, kafka: KafkaCommitLog, kafka_bootstrap: str, redis_url: str) -> None:
    """The quick start rerun on a new broker with the same TW_DATA_DIR: enqueue-get resumed at the
    checkpointed offsets on the new, empty topic and never read what was written below them."""
    cfg = _config(tmp_path)
    _written_from(cfg, kafka, 3)
    old_id = kafka.topic_id(cfg.timer_topic)
    store_source(cfg.data_dir, Source(kafka.cluster_id(), old_id), fsync=False)
    new_id = _make_again(kafka_bootstrap, kafka, cfg.timer_topic)
    env = {**os.environ, "TW_KAFKA_BOOTSTRAP": kafka_bootstrap, "TW_REDIS_URL": redis_url,
           "TW_DATA_DIR": cfg.data_dir, "TW_SHARDS": "2", "TW_TIMER_TOPIC": cfg.timer_topic,
           "TW_DLQ_TOPIC": cfg.dlq_topic, "TW_TIMER_PARTITIONS": "2", "TW_LOG_LEVEL": "WARNING"}
    done = subprocess.run([sys.executable, "-m", "timerwheel.cli", "stage", "enqueue-get"], env=env,
                          capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("timerwheel: error: ")
    assert f"timer topic id stored {old_id}, found {new_id}" in lines[0]
    assert f"timerwheel rebase --data-dir {cfg.data_dir} --kafka {kafka_bootstrap}" in lines[0]
    assert "not delivered" in lines[0] and "delivered again" in lines[0]


def test_a_data_dir_from_before_the_source_is_refused_when_its_offsets_are_beyond_the_end(
        tmp_path: Path, kafka: KafkaCommitLog, kafka_bootstrap: str) -> None:
    cfg = _config(tmp_path)
    _written_from(cfg, kafka, 3)
    _make_again(kafka_bootstrap, kafka, cfg.timer_topic)
    kafka.append([OutRecord(cfg.timer_topic, None, b"new", partition=0)])  # one record: still below 3
    with pytest.raises(SourceMismatchError) as refused:
        check_source(cfg, kafka, adopt=True, production=True)
    text = str(refused.value)
    assert "shard 0 partition 0 resumes at 3, the partition ends at 1" in text
    assert "shard 1 partition 1 resumes at 3, the partition ends at 0" in text
    assert "timerwheel rebase" in text and "\n" not in text
    assert load_source(cfg.data_dir) is None, "a refused start recorded the new topic"


class _LiveOwner:
    """The commit log as a stage starting beside a running enqueue-put sees it: between the ends
    it is asked for and whatever it reads next, a record arrives and the shards checkpoint it."""

    def __init__(self, log: KafkaCommitLog, cfg: TimerConfig) -> None:
        self.log, self.cfg = log, cfg

    def __getattr__(self, name: str) -> object:
        return getattr(self.log, name)

    def end_offsets(self, topic: str) -> dict[int, int]:
        ends = self.log.end_offsets(topic)
        self.log.append([OutRecord(topic, None, b"v", partition=p) for p in (0, 1)])
        make_shards(self.cfg, self.log.end_offsets(topic), T0)
        return ends


def test_a_live_volume_whose_checkpoints_move_while_the_start_checks_them_is_not_refused(
        tmp_path: Path, kafka: KafkaCommitLog) -> None:
    """The checkpoints are read before the ends: the other order refused a stage (re)started
    beside a running enqueue-put whose checkpoint passed the ends read a moment before."""
    cfg = _config(tmp_path)
    _written_from(cfg, kafka, 3)
    check_source(cfg, _LiveOwner(kafka, cfg), adopt=False, production=True)  # type: ignore[arg-type]
    assert all(o == 4 for o in kafka.end_offsets(cfg.timer_topic).values())


def test_a_data_dir_from_before_the_source_is_adopted_and_then_held_to_it(
        tmp_path: Path, kafka: KafkaCommitLog, kafka_bootstrap: str) -> None:
    cfg = _config(tmp_path)
    _written_from(cfg, kafka, 2)
    assert load_source(cfg.data_dir) is None
    found = check_source(cfg, kafka, adopt=False, production=True)
    assert load_source(cfg.data_dir) is None, "a stage that does not write the deployment file recorded it"
    check_source(cfg, kafka, adopt=True, production=True)
    assert load_source(cfg.data_dir) == found == Source(kafka.cluster_id(), kafka.topic_id(cfg.timer_topic))
    settings = json.loads((Path(cfg.data_dir) / SETTINGS_FILE).read_text())
    assert settings["source"] == {"cluster_id": found.cluster_id, "timer_topic_id": found.timer_topic_id}
    # a new empty topic, whatever the offsets: the recorded id refuses it
    _make_again(kafka_bootstrap, kafka, cfg.timer_topic)
    kafka.append([OutRecord(cfg.timer_topic, None, b"new", partition=p) for p in (0, 1) for _ in range(5)])
    with pytest.raises(SourceMismatchError, match="timer topic id stored"):
        check_source(cfg, kafka, adopt=False, production=True)


def test_a_data_dir_without_shards_takes_the_new_topic_and_store_window_keeps_the_source(
        tmp_path: Path, kafka: KafkaCommitLog, kafka_bootstrap: str) -> None:
    cfg = _config(tmp_path)
    kafka.ensure_topic(cfg.timer_topic, 2)
    check_settings(cfg.data_dir, DeploymentSettings.of(cfg), fsync=False)
    store_source(cfg.data_dir, Source("another-cluster", "another-topic"), fsync=False)
    found = check_source(cfg, kafka, adopt=True, production=True)  # no shard: nothing to lose
    assert load_source(cfg.data_dir) == found and found.cluster_id == kafka.cluster_id()
    wider = cfg.replace(roll_window_ms=cfg.roll_window_ms * 2)
    store_window(cfg.data_dir, DeploymentSettings.of(wider), fsync=False)
    assert load_source(cfg.data_dir) == found


def test_rebase_sets_the_shards_aside_and_the_fresh_ones_read_the_topic_from_its_start(
        tmp_path: Path, kafka: KafkaCommitLog, kafka_bootstrap: str, redis_url: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config(tmp_path)
    _written_from(cfg, kafka, 3)
    store_source(cfg.data_dir, Source(kafka.cluster_id(), kafka.topic_id(cfg.timer_topic)), fsync=False)
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.xadd("tw:q:fetch:0", {"d": b"names a position of the old topic"})
    args = ["rebase", "--data-dir", cfg.data_dir, "--kafka", kafka_bootstrap, "--redis", redis_url]
    assert main(args) == 2, "rebase of shards written from this very topic would only lose them"
    assert "would only lose" in capsys.readouterr().err
    new_id = _make_again(kafka_bootstrap, kafka, cfg.timer_topic)
    kafka.append([OutRecord(cfg.timer_topic, None, b"written meanwhile", partition=1)])

    assert main([*args, "--dry-run"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert dry["dry_run"] and dry["set_aside"] is None and dry["shards"] == [0, 1]
    assert found_shards(cfg.data_dir) == [0, 1] and client.exists("tw:q:fetch:0")

    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"] == {"cluster_id": kafka.cluster_id(), "timer_topic_id": new_id}
    assert report["source_before"]["timer_topic_id"] != new_id
    assert report["start_offsets"] == {"0": 0, "1": 0} and report["shards"] == [0, 1]
    assert found_shards(report["set_aside"]) == [0, 1] and Path(report["set_aside"]).parent == Path(cfg.data_dir)
    assert client.exists("tw:q:fetch:0") == 0
    client.close()
    for shard_id in (0, 1):
        shard = open_shard(cfg, shard_id, writer=False)
        enq = shard.load_enqueue_checkpoint()
        shard.close()
        assert enq is not None and enq.next_offsets == {shard_id: 0}
    assert check_source(cfg, kafka, adopt=False, production=True) == load_source(cfg.data_dir)


def test_embedded_refuses_a_log_directory_made_again_and_rebase_starts_it_afresh(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    settings = {"tick_ms": 100, "roll_window_ms": 60_000, "shards": 2, "fsync": False}
    with EmbeddedTimerwheel(data, **settings) as tw:  # type: ignore[arg-type]
        for i in range(6):
            tw.schedule("orders", f"old {i}".encode(), delay_ms=3_600_000)
        _wait(lambda: sum(s["pending"] for s in tw.inspect()["shards"]) == 6)
    shutil.rmtree(data / "log")  # someone cleans up "just the log"
    with pytest.raises(SourceMismatchError) as refused:
        EmbeddedTimerwheel(data, **settings)  # type: ignore[arg-type]
    assert "another local commit log (cluster id stored" in str(refused.value)
    assert f"timerwheel rebase --data-dir {data}`" in str(refused.value)

    assert main(["rebase", "--data-dir", str(data)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pending_records"] == 6 and report["shards"] == [0, 1]
    with EmbeddedTimerwheel(data, **settings) as tw:  # type: ignore[arg-type]
        tw.schedule("orders", b"new", delay_ms=200)
        _wait(lambda: [r.value for r in tw.read("orders")] == [b"new"])


def _wait(condition: Callable[[], bool], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_shards_of_one_cluster_are_refused_on_another_naming_both_cluster_ids(
        tmp_path: Path, kafka: KafkaCommitLog, kafka_noauto_bootstrap: str) -> None:
    """The production quick start rerun after `make down; make kafka-up`: another cluster, the
    same TW_DATA_DIR. The checkpoints here are not beyond the new topic's end (it holds more
    records than they read): only the recorded cluster id tells."""
    cfg = _config(tmp_path)
    _written_from(cfg, kafka, 1)
    store_source(cfg.data_dir, Source(kafka.cluster_id(), kafka.topic_id(cfg.timer_topic)), fsync=False)
    other = KafkaCommitLog(kafka_noauto_bootstrap)
    try:
        other.ensure_topic(cfg.timer_topic, 2)
        other.append([OutRecord(cfg.timer_topic, None, b"v", partition=p) for p in (0, 1) for _ in range(3)])
        with pytest.raises(SourceMismatchError) as refused:
            check_source(cfg, other, adopt=True, production=True)
        assert f"cluster id stored {kafka.cluster_id()}, found {other.cluster_id()}" in str(refused.value)
        assert kafka.cluster_id() != other.cluster_id()
    finally:
        other.close()
