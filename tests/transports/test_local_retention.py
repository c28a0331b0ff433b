"""The embedded commit log does not grow for ever: whole segments older than the retention go,
as Kafka's ``retention.ms`` (at least 1.5 x the roll window: a rolled message is re-read)."""

from __future__ import annotations

from pathlib import Path

import pytest
from timerwheel import SimulatedClock, TimerConfig
from timerwheel.config import DAY_MS
from timerwheel.errors import ConfigError
from timerwheel.records import OutRecord
from timerwheel.runtime.embedded import EmbeddedTimerwheel
from timerwheel.runtime.wiring import Transports
from timerwheel.stages.codec import Q_DELIVER, Q_DONE, Q_FETCH, Q_PUT
from timerwheel.transports.local.log import LocalCommitLog
from timerwheel.transports.memory import MemoryLeaseStore, MemoryWorkQueue

START = 1_700_000_000_000
HOUR = 3_600_000


def test_segments_older_than_the_retention_are_deleted_whole(tmp_path: Path) -> None:
    clock = SimulatedClock(START)
    log = LocalCommitLog(tmp_path, fsync=False, clock=clock, segment_bytes=4096)
    try:
        for _hour in range(10):  # one batch an hour; a batch stays in one segment (4 KiB: one each)
            log.append([OutRecord("t", None, b"x" * 200, ()) for _ in range(60)])
            clock.advance(HOUR)
        assert len(list((tmp_path / "t" / "0").glob("*.log"))) == 10
        # Now is START + 10 h: keeping 4 h deletes the segments of hours 0-5, whose newest
        # record is older than START + 6 h, and keeps hours 6-9.
        assert log.expire(clock.now_ms(), 4 * HOUR) == 6
        assert log.start_offsets("t") == {0: 360}
        kept = log.consumer("t", {0: 360}).poll(10_000, 0)
        assert len(kept) == 240 and min(r.timestamp_ms for r in kept) == START + 6 * HOUR
        assert log.end_offsets("t") == {0: 600}
        bases = sorted(int(f.stem) for f in (tmp_path / "t" / "0").glob("*.log"))
        assert bases[:4] == [360, 420, 480, 540] and bases[4:] in ([], [600])  # (600: an empty tail)
        assert log.expire(clock.now_ms(), 4 * HOUR) == 0  # nothing more to delete
    finally:
        log.close()


def test_the_embedded_runtime_applies_the_retention(tmp_path: Path) -> None:
    clock = SimulatedClock(START)
    log = LocalCommitLog(tmp_path / "log", fsync=False, clock=clock, segment_bytes=4096)
    queues = {n: MemoryWorkQueue(n, 1, 64) for n in (Q_PUT, Q_FETCH, Q_DELIVER, Q_DONE)}
    with EmbeddedTimerwheel(tmp_path / "data", clock=clock, fsync=False, roll_window_ms=HOUR,
                            log_retention_ms=2 * HOUR,
                            transports=Transports(log, queues, MemoryLeaseStore(clock))) as tw:
        for _ in range(3):
            log.append([OutRecord("dest-x", None, b"y" * 200, ()) for _ in range(60)])
            clock.advance(HOUR)
        assert tw.enforce_retention() > 0
        assert log.start_offsets("dest-x")[0] > 0


def test_retention_below_one_and_a_half_roll_windows_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"log_retention_ms: must be at least 1.5 x roll_window_ms"):
        TimerConfig(roll_window_ms=2 * DAY_MS, log_retention_ms=2 * DAY_MS)
    assert TimerConfig(roll_window_ms=2 * DAY_MS).effective_log_retention_ms == 7 * DAY_MS
    assert TimerConfig(roll_window_ms=10 * DAY_MS).effective_log_retention_ms == 15 * DAY_MS
    with pytest.raises(ConfigError, match="TW_LOG_RETENTION_MS"):
        TimerConfig.from_env({"TW_LOG_RETENTION_MS": "1h"})
