"""Shard: layout, format checks, the writer lock, linking, reading chains, readers, retention."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from timerwheel.errors import FencedError, FormatMismatchError, TimerLogDamagedError, TimerwheelError
from timerwheel.store import EnqueueCheckpoint, Flag, Shard, Slot, records_array, shard_dir
from timerwheel.store import shard as shard_module

from .conftest import OpenShard, flip_bit, rec, slot_records

TICK = 100


def chain(shard: Shard, t: int, limit: int | None = None) -> list[int]:
    return [pos for pos, _ in slot_records(shard, t, limit)]


def test_open_creates_the_documented_layout(open_shard: OpenShard, tmp_path: Path) -> None:
    shard = open_shard()
    assert sorted(os.listdir(shard.directory)) == ["meta.json", "timerlog", "wheel", "writer.lock"]
    assert shard.recovery is not None and shard.recovery.records_checked == 0
    assert shard_dir(tmp_path, 3) == str(tmp_path / "shard-0003")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"tick_ms": 1000}, "tick_ms: stored 100, requested 1000"),
        ({"slots": 128}, "slots: stored 64, requested 128"),
        ({"segment_bytes": 2048}, "segment_bytes: stored 1024, requested 2048"),
    ],
)
def test_reopening_with_other_settings_names_stored_and_requested(
    open_shard: OpenShard, change: dict[str, int], named: str
) -> None:
    shard = open_shard()
    shard.append([rec(1000)])
    shard.close()
    for writer in (True, False):
        with pytest.raises(FormatMismatchError, match=named):
            open_shard(writer=writer, **change)


def test_a_shard_of_another_format_version_is_never_reformatted(open_shard: OpenShard) -> None:
    shard = open_shard()
    shard.close()
    meta = Path(shard.directory) / "meta.json"
    meta.write_text(meta.read_text().replace('"format_version": 1', '"format_version": 2'))
    with pytest.raises(FormatMismatchError, match="format_version: stored 2, requested 1"):
        open_shard()


def test_data_without_meta_is_refused(open_shard: OpenShard) -> None:
    shard = open_shard()
    shard.append([rec(1000)])
    shard.close()
    os.unlink(Path(shard.directory) / "meta.json")
    with pytest.raises(FormatMismatchError, match="no meta.json"):
        open_shard()


def test_a_second_writer_is_fenced_and_a_reader_needs_an_existing_shard(open_shard: OpenShard) -> None:
    with pytest.raises(TimerwheelError, match="no shard"):
        open_shard(writer=False)
    first = open_shard()
    with pytest.raises(FencedError, match="already open for writing"):
        open_shard()
    first.close()
    open_shard().close()


def test_append_links_each_record_to_its_slots_previous_last(open_shard: OpenShard) -> None:
    shard = open_shard()
    assert shard.append([rec(1010), rec(1120), rec(1099)]) == [0, 64, 128]
    assert shard.append([rec(1000, flags=Flag.DELETE)]) == [192]
    assert [shard.log.read(p).prev_pos for p in (0, 64, 128, 192)] == [-1, -1, 0, 128]
    assert chain(shard, 1000) == [192, 128, 0]
    assert chain(shard, 1150) == [64]
    slot = shard.wheel.get(1000)
    assert (slot.first_pos, slot.last_pos, slot.num) == (0, 192, 3)


def test_append_array_links_like_append(open_shard: OpenShard) -> None:
    shard = open_shard()
    first = shard.append_array(records_array(flags=1, enqueue_ms=0, deliver_ms=[1000, 1100, 1050], src_partition=0,
                                             src_offset=[1, 2, 3], src_size=10, topic_hash=1, id_hash=2))
    assert first == 0 and chain(shard, 1000) == [128, 0]
    assert shard.log.read(128).prev_pos == 0


def test_a_record_for_an_older_revolution_is_refused_and_nothing_is_written(open_shard: OpenShard) -> None:
    shard = open_shard(slots=8)
    shard.append([rec(1000 + 8 * TICK)])
    with pytest.raises(TimerwheelError, match="too small"):
        shard.append([rec(1500), rec(1000)])
    assert shard.log.end_pos == 64 and shard.wheel.get(1500).num == 0


def test_a_reader_sees_published_slots_but_never_past_the_published_flushed_position(open_shard: OpenShard) -> None:
    writer = open_shard()
    writer.append([rec(1000), rec(1000)])
    published = writer.flush()
    writer.save_enqueue_checkpoint(EnqueueCheckpoint(published, 900, {0: 2}, 1))
    writer.append([rec(1000), rec(1001)])
    writer.flush()  # on disk and in the wheel file, but not yet published by a checkpoint
    reader = open_shard(writer=False)
    assert chain(reader, 1000) == [64, 0]
    assert chain(reader, 1000, limit=192) == [128, 64, 0]
    assert chain(writer, 1000) == [192, 128, 64, 0]
    with pytest.raises(TimerwheelError, match="read-only"):
        reader.append([rec(1000)])


@pytest.mark.parametrize("dense_slot_min", [10**9, 1], ids=["by-links", "by-a-scan"])
def test_a_bit_flip_in_the_middle_of_a_segment_is_reported_and_its_neighbours_still_read(
    open_shard: OpenShard, caplog: pytest.LogCaptureFixture, dense_slot_min: int
) -> None:
    shard = open_shard(segment_bytes=64 * 64)
    shard.dense_slot_min = dense_slot_min
    positions = shard.append([rec(1000 + i % 3) for i in range(20)])
    shard.flush()
    victim = positions[10]
    flip_bit(shard, victim)
    with caplog.at_level(logging.ERROR):
        got = chain(shard, 1000)
    assert got == [p for p in reversed(positions) if p != victim]
    assert shard.corrupt_seen == 1
    assert f"position {victim}" in caplog.text


def test_a_chain_link_into_another_slot_is_treated_as_corrupt(open_shard: OpenShard) -> None:
    shard = open_shard()
    shard.append([rec(1000), rec(2000), rec(1000)])
    shard.flush()
    shard.wheel.overwrite(shard.wheel.index(1000), Slot(1000, 0, 64, 2, 0))
    assert chain(shard, 1000) == [0]  # the slot named a record of slot 2000: scanned instead
    assert shard.corrupt_seen == 1


def test_retention_deletes_only_segments_whose_records_all_fire_before_read_time(open_shard: OpenShard) -> None:
    shard = open_shard(segment_bytes=64 * 4)
    fire = [1000, 1100, 1000, 1200, 1300, 5000, 1000, 1000, 1400, 1400, 1400, 1400, 9000]
    shard.append([rec(t) for t in fire])  # segments 0: <=1200, 256: <=5000, 512: <=1400, 768: 9000
    assert shard.retain(10**9) == 0, "nothing is flushed yet"
    shard.flush()
    assert shard.retain(1200) == 0  # slot 1200 is not delivered before R = 1200
    assert shard.retain(1300) == 1 and shard.log.start_pos == 256
    assert shard.retain(5000) == 0
    assert shard.retain(5100) == 2 and shard.log.start_pos == 768  # the 512 segment goes with it
    assert shard.retain(10**9) == 0, "the last segment is kept"
    assert chain(shard, 9000) == [768]


def test_close_syncs_the_wheel_so_a_reopen_checks_nothing(open_shard: OpenShard) -> None:
    shard = open_shard()
    shard.append([rec(1000 + i) for i in range(5)])
    shard.save_enqueue_checkpoint(EnqueueCheckpoint(shard.flush(), 0, {0: 5}, 1))
    shard.close()
    reopened = open_shard()
    assert reopened.recovery is not None
    assert (reopened.recovery.checked_from, reopened.recovery.records_checked) == (320, 0)
    assert len(chain(reopened, 1000)) == 5


def test_flush_syncs_the_wheel_every_wheel_sync_records(open_shard: OpenShard) -> None:
    shard = open_shard(wheel_sync_records=10)
    shard.append([rec(1000)] * 6)
    shard.flush()
    assert shard.wheel.synced_pos == 0
    shard.append([rec(1000)] * 6)
    assert shard.flush() == 768 == shard.wheel.synced_pos


def test_a_dense_slot_read_by_a_scan_gives_what_its_links_give(open_shard: OpenShard) -> None:
    shard = open_shard(segment_bytes=64 * 128)
    fire = [1000 if i % 3 else 1000 + (i % 7) * TICK for i in range(600)]  # slot 1000 holds ~70%
    positions = shard.append([rec(t) for t in fire])
    shard.flush()
    flip_bit(shard, positions[301])  # in slot 1000
    flip_bit(shard, positions[303])  # in another slot, inside slot 1000's stretch
    results = {}
    for dense_slot_min in (10**9, 1):
        shard.dense_slot_min = dense_slot_min
        for limit in (None, positions[450]):
            results[dense_slot_min, limit] = slot_records(shard, 1000, limit)
    by_links = results[10**9, None]
    assert [p for p, _ in by_links] == [p for p, t in zip(positions, fire, strict=True)
                                        if t == 1000 and p != positions[301]][::-1]
    assert results[1, None] == by_links
    assert results[1, positions[450]] == results[10**9, positions[450]] == [
        (p, r) for p, r in by_links if p < positions[450]]


def test_read_slot_gives_the_slots_records_column_wise_by_a_scan_or_by_links(
    open_shard: OpenShard, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The records of slot 1000, newest first, whichever way it is read, cancel markers and roll
    hops included, in pieces of at most SLOT_PIECE_RECORDS."""
    monkeypatch.setattr(shard_module, "SLOT_PIECE_RECORDS", 64)
    shard = open_shard(segment_bytes=64 * 128)  # the slot's stretch crosses segments
    fire = [1000 if i % 3 else 1000 + (i % 7) * TICK for i in range(600)]
    flags = [Flag.DELETE if i % 50 == 0 else Flag.ROLL if i % 40 == 0 else Flag.NORMAL for i in range(600)]
    positions = shard.append([rec(t, flags=f) for t, f in zip(fire, flags, strict=True)])
    shard.flush()
    written = list(shard.log.iter_range(0, shard.log.end_pos))  # the oracle: every record, in log order
    for limit in (None, positions[450]):
        expected = [(p, r) for p, r in reversed(written) if r.deliver_ms == 1000 and (limit is None or p < limit)]
        assert any(r.flags == Flag.DELETE for _, r in expected) and any(r.flags == Flag.ROLL for _, r in expected)
        for dense_slot_min in (1, 10**9):
            shard.dense_slot_min = dense_slot_min
            pieces = list(shard.read_slot(1000, limit))
            assert all(0 < len(p) == len(r) <= 64 for p, r in pieces)
            assert slot_records(shard, 1000, limit) == expected
    sparse = open_shard("sparse")
    sparse.append([rec(1000 + (i % 20) * TICK) for i in range(400)])  # 1 in 20: not dense, read by links
    sparse.flush()
    assert [r.deliver_ms for _, r in slot_records(sparse, 1000)] == [1000] * 20


def test_a_corrupt_record_of_another_slot_inside_a_dense_slots_stretch_is_reported_and_skipped(
    open_shard: OpenShard
) -> None:
    shard = open_shard(segment_bytes=64 * 128)
    positions = shard.append([rec(1000 if i % 2 else 1100) for i in range(100)])
    shard.flush()
    flip_bit(shard, positions[50])  # a record of another slot, inside this one's stretch
    assert len(slot_records(shard, 1000)) == 50  # scanned: the bad record is reported, its slot's records read
    assert shard.corrupt_seen == 1
    shard.dense_slot_min = 10**9
    assert len(slot_records(shard, 1000)) == 50  # by its links, which do not pass the bad record
    assert shard.corrupt_seen == 1


@pytest.mark.parametrize("dense_slot_min", [10**9, 1], ids=["by-links", "by-a-scan"])
def test_a_reader_that_must_not_skip_waits_for_a_newer_epoch_when_published_records_are_cut(
        open_shard: OpenShard, monkeypatch: pytest.MonkeyPatch, dense_slot_min: int) -> None:
    """The TimerLog's newest record, published by a checkpoint, torn in half afterwards (a lost tail
    the writer's recovery has not published yet): ``damage_raises`` readers get TimerLogDamagedError
    rather than the slot without it, for DAMAGE_WAIT_S under the checkpoint's epoch, then the records
    left (a chain; the scan of a dense slot stops at the cut); other readers get them at once. A checkpoint of a newer epoch (a writer that
    recovered the shard, repairing its chains) starts the wait afresh for a link still damaged."""
    writer = open_shard(segment_bytes=64 * 1024)
    positions = writer.append([rec(1000) for _ in range(20)])
    published = writer.flush()
    reader = open_shard(writer=False, segment_bytes=64 * 1024)
    reader.dense_slot_min = dense_slot_min
    assert reader.refresh(EnqueueCheckpoint(published, 900, {0: 20}, 1))
    (segment,) = (Path(reader.directory) / "timerlog").glob("*.tlog")
    with open(segment, "r+b") as f:
        f.truncate(published - 32)
    with pytest.raises(TimerLogDamagedError, match=f"record at {positions[-1]} of slot 1000"):
        list(reader.read_slot(1000, published, damage_raises=True))
    if dense_slot_min == 1:  # the scan of what is left stops at the cut (IndexError): a step error, retried
        with pytest.raises(IndexError, match="ends at"):
            chain(reader, 1000, limit=published)
    else:
        left = positions[:-1][::-1]
        assert chain(reader, 1000, limit=published) == left
        monkeypatch.setattr(shard_module, "DAMAGE_WAIT_S", 0.0)  # met long enough: reported and skipped
        assert [int(p) for piece, _ in reader.read_slot(1000, published, damage_raises=True) for p in piece] == left
    monkeypatch.setattr(shard_module, "DAMAGE_WAIT_S", 60.0)
    assert reader.refresh(EnqueueCheckpoint(published, 900, {0: 19}, 2))  # a newer writer: looked at afresh
    with pytest.raises(TimerLogDamagedError):
        list(reader.read_slot(1000, published, damage_raises=True))
