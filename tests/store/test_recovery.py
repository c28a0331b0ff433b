"""Recovery on open: torn tails, corrupt middles, re-linking exactly once, repairs, source offsets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from timerwheel.store import EnqueueCheckpoint, Shard

from .conftest import OpenShard, crash_copy, flip_bit, rec, reopen, segment_path, slot_records

TICK = 100


def chain(shard: Shard, t: int) -> list[int]:
    return [pos for pos, _ in slot_records(shard, t)]


def checkpoint(shard: Shard) -> int:
    """Flush with the wheel made durable too, then publish the position, as a writer would."""
    pos = shard.sync_wheel()
    shard.save_enqueue_checkpoint(EnqueueCheckpoint(pos, 0, {}, 1))
    return pos


def test_torn_tail_is_truncated_and_relinked(open_shard: OpenShard, tmp_path: Path) -> None:
    shard = open_shard(segment_bytes=64 * 8)
    shard.append([rec(1000 + (i % 2) * 100, src_offset=i) for i in range(6)])
    flushed = checkpoint(shard)
    shard.append([rec(1000 + (i % 2) * 100, src_offset=6 + i) for i in range(4)])  # written, never flushed
    crashed = crash_copy(shard, tmp_path / "crashed")
    last = crashed / "timerlog" / f"{512:020d}.tlog"
    with open(last, "ab") as f:
        f.write(b"\0" * 64 + b"\x07" * 30)  # a zeroed record and a torn one after the last good record
    recovered = reopen(crashed, shard)
    report = recovered.recovery
    assert report is not None
    assert (report.checked_from, report.end_pos) == (flushed, 640)
    assert (report.records_checked, report.truncated_bytes, report.relinked) == (5, 94, 4)
    assert report.corrupt == ()
    assert report.max_src_offsets == {0: 9}
    assert os.path.getsize(last) == 128
    assert chain(recovered, 1000) == [512, 384, 256, 128, 0]
    assert chain(recovered, 1100) == [576, 448, 320, 192, 64]
    assert recovered.append([rec(1000)]) == [640]
    assert recovered.log.read(640).prev_pos == 512
    recovered.close()


def test_a_corrupt_record_in_the_middle_is_reported_and_skipped(open_shard: OpenShard, tmp_path: Path) -> None:
    shard = open_shard()
    checkpoint(shard)
    positions = shard.append([rec(1000, src_offset=i) for i in range(8)])
    shard.flush()
    victim = positions[5]
    flip_bit(shard, victim)
    crashed = crash_copy(shard, tmp_path / "crashed")
    recovered = reopen(crashed, shard)
    report = recovered.recovery
    assert report is not None
    assert [pos for pos, _ in report.corrupt] == [victim] and report.corrupt_count == 1
    assert report.corrupt[0][1].startswith("CRC mismatch")
    assert report.truncated_bytes == 0 and report.end_pos == 512
    assert chain(recovered, 1000) == [p for p in reversed(positions) if p != victim]
    assert report.max_src_offsets == {0: 7}
    recovered.close()


@pytest.mark.parametrize("wheel_state", ["at the checkpoint", "published after it", "half and half"])
def test_records_past_the_checkpoint_are_relinked_exactly_once_whatever_the_wheel_holds(
    open_shard: OpenShard, tmp_path: Path, wheel_state: str
) -> None:
    shard = open_shard(slots=16)
    shard.append([rec(1000 + (i % 4) * TICK) for i in range(12)])
    shard.sync_wheel()
    flushed = checkpoint(shard)
    at_checkpoint = (Path(shard.directory) / "wheel").read_bytes()
    shard.append([rec(1000 + (i % 5) * TICK) for i in range(10)])
    shard.flush()
    crashed = crash_copy(shard, tmp_path / "crashed")
    published = (crashed / "wheel").read_bytes()
    if wheel_state == "at the checkpoint":
        (crashed / "wheel").write_bytes(at_checkpoint)
    elif wheel_state == "half and half":
        mixed = bytearray(published)
        for i in range(0, 16, 2):
            start = 64 + 32 * i
            mixed[start : start + 32] = at_checkpoint[start : start + 32]
        (crashed / "wheel").write_bytes(bytes(mixed))
    expected = {t: chain(shard, t) for t in range(1000, 1500, TICK)}
    recovered = reopen(crashed, shard)
    assert recovered.recovery is not None and recovered.recovery.checked_from == flushed
    for t, positions in expected.items():
        assert chain(recovered, t) == positions
        assert recovered.wheel.get(t).num == len(positions)
    recovered.close()


def test_a_wheel_slot_naming_a_position_past_the_end_is_repaired(open_shard: OpenShard, tmp_path: Path) -> None:
    shard = open_shard(segment_bytes=64 * 4)
    shard.append([rec(1000), rec(1100), rec(1000), rec(1100), rec(1000), rec(1200)])
    checkpoint(shard)
    shard.sync_wheel()
    crashed = crash_copy(shard, tmp_path / "crashed")
    os.unlink(crashed / "timerlog" / f"{256:020d}.tlog")  # the disk lost the last segment
    recovered = reopen(crashed, shard)
    report = recovered.recovery
    assert report is not None
    assert report.end_pos == 256 and report.repaired_slots == 2
    assert any("durable data is gone" in note for note in report.notes)
    assert chain(recovered, 1000) == [128, 0]
    assert chain(recovered, 1200) == [] and recovered.wheel.get(1200).num == 0
    assert recovered.wheel.get(1000).num == 2
    recovered.close()


def test_a_lost_wheel_is_rebuilt_from_the_timerlog(open_shard: OpenShard, tmp_path: Path) -> None:
    shard = open_shard(slots=16)
    shard.append([rec(1000 + (i * 7 % 9) * TICK, src_partition=i % 3, src_offset=i // 3) for i in range(40)])
    checkpoint(shard)
    expected = {t: chain(shard, t) for t in range(1000, 1900, TICK)}
    crashed = crash_copy(shard, tmp_path / "crashed")
    os.unlink(crashed / "wheel")
    recovered = reopen(crashed, shard)
    report = recovered.recovery
    assert report is not None
    assert (report.checked_from, report.records_checked, report.relinked) == (0, 40, 40)
    assert report.max_src_offsets == {0: 13, 1: 12, 2: 12}
    assert {t: chain(recovered, t) for t in expected} == expected
    recovered.close()


def test_recovering_twice_changes_nothing_the_second_time(open_shard: OpenShard, tmp_path: Path) -> None:
    shard = open_shard()
    checkpoint(shard)
    shard.append([rec(1000 + (i % 3) * TICK) for i in range(9)])
    shard.flush()
    crashed = crash_copy(shard, tmp_path / "crashed")
    first = reopen(crashed, shard)
    first_chains = {t: chain(first, t) for t in (1000, 1100, 1200)}
    first.close()
    second = reopen(crashed, shard)
    assert second.recovery is not None and second.recovery.relinked == 0
    assert {t: chain(second, t) for t in first_chains} == first_chains
    assert second.wheel.get(1000).num == 3
    second.close()


def test_a_short_segment_before_the_last_reads_as_a_corrupt_middle(open_shard: OpenShard, tmp_path: Path) -> None:
    shard = open_shard(segment_bytes=64 * 4)
    checkpoint(shard)
    shard.append([rec(1000) for _ in range(6)])
    crashed = crash_copy(shard, tmp_path / "crashed")
    os.truncate(crashed / "timerlog" / segment_path(shard, 0).name, 128)
    recovered = reopen(crashed, shard)
    report = recovered.recovery
    assert report is not None
    assert [pos for pos, _ in report.corrupt] == [128, 192]
    assert chain(recovered, 1000) == [320, 256, 64, 0]
    recovered.close()
