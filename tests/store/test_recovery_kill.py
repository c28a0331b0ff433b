"""A real crash test: a child writer (crash_writer.py) is killed with SIGKILL at random moments,
sometimes during its own recovery; after each kill the shard is reopened and checked."""

from __future__ import annotations

import collections
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from timerwheel.store import Shard

from .conftest import slot_records
from .crash_writer import SETTINGS, fire_ms

KILLS = 22


def flushed_count(progress: Path) -> int:
    lines = progress.read_text().split("\n")[:-1] if progress.exists() else []  # a torn last line is not counted
    return int(lines[-1]) if lines else 0


def check(directory: Path, flushed: int) -> int:
    shard = Shard.open(directory, fsync=False, **SETTINGS)
    try:
        report = shard.recovery
        assert report is not None
        positions = {}
        for pos, record in shard.log.iter_range(shard.log.start_pos, shard.log.end_pos):
            assert record.src_offset not in positions, f"offset {record.src_offset} written twice"
            assert record.deliver_ms == fire_ms(record.src_offset)
            positions[record.src_offset] = pos
        written = len(positions)
        assert sorted(positions) == list(range(written)), "offsets have a gap"
        assert written >= flushed, f"{flushed} records were reported flushed, {written} survived"
        ckpt = shard.load_enqueue_checkpoint()
        assert max(ckpt.next_offsets[0] if ckpt else 0, report.max_src_offsets.get(0, -1) + 1) == written
        by_slot = collections.defaultdict(list)
        for k, pos in positions.items():
            by_slot[shard.slot_time(fire_ms(k))].append(pos)
        for slot_time, expected in by_slot.items():
            got = [pos for pos, _ in slot_records(shard, slot_time)]
            assert got == sorted(expected, reverse=True), f"slot {slot_time}"
            assert shard.wheel.get(slot_time).num == len(expected)
        assert shard.wheel.count_range(0, 2**62) == written
        return written
    finally:
        shard.close()


def test_a_writer_killed_at_random_moments_loses_and_repeats_nothing(tmp_path: Path) -> None:
    rng = random.Random(20240611)
    directory, progress = tmp_path / "shard-0000", tmp_path / "progress"
    script = Path(__file__).with_name("crash_writer.py")
    written = 0
    for kill in range(KILLS):
        child = subprocess.Popen([sys.executable, str(script), str(directory), str(progress), str(kill)],
                                 stdout=subprocess.PIPE, text=True)
        try:
            if kill % 5 != 4:  # most kills while writing; every fifth at any moment, even mid-recovery
                assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.02, 0.3))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        assert child.returncode == -signal.SIGKILL, "the writer died by itself"
        now = check(directory, flushed_count(progress))
        assert now >= written
        written = now
    assert written > 500, "the writer barely wrote anything"
    print(f"{written} records after {KILLS} kills")
