"""TimerLog: positions, segments, durability-related repairs at open, truncation, retention."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from timerwheel.errors import CorruptRecordError, FormatMismatchError, TimerwheelError
from timerwheel.store import TimerLog
from timerwheel.store.format import pack_records, seal

from .conftest import rec

SEG = 64 * 4  # four records per segment


def segment_files(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".tlog"))


def test_append_returns_byte_positions_and_records_read_back(tmp_path: Path) -> None:
    log = TimerLog(tmp_path, SEG, fsync=True)
    batch = [rec(1000 + i) for i in range(3)]
    assert log.append(batch) == 0
    assert log.append([rec(5)]) == 192
    assert (log.start_pos, log.end_pos) == (0, 256)
    assert [log.read(p) for p in (0, 64, 128)] == batch
    assert log.flush() == 256 == log.flushed_pos
    log.close()


def test_a_flush_with_nothing_appended_since_the_last_syncs_nothing(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """enqueue-put publishes W often without new records: each publication's flush is then free."""
    synced: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: synced.append(fd) or real(fd))
    log = TimerLog(tmp_path, SEG, fsync=True)
    log.append([rec(1), rec(2), rec(3), rec(4), rec(5)])  # two segments
    assert log.flush() == 320 and len(synced) == 2
    assert log.flush() == 320 and len(synced) == 2
    log.append([rec(6)])
    assert log.flush() == 384 and len(synced) == 3  # the last segment only
    log.close()


def test_records_span_segments_named_by_their_base_position(tmp_path: Path) -> None:
    log = TimerLog(tmp_path, SEG)
    batch = [rec(i) for i in range(10)]
    log.append(batch)
    assert segment_files(tmp_path) == [f"{b:020d}.tlog" for b in (0, 256, 512)]
    assert [r for _, r in log.iter_range(0, 640)] == batch
    assert [p for p, _ in log.iter_range(128, 448)] == [128, 192, 256, 320, 384]
    log.close()
    reopened = TimerLog(tmp_path, SEG)
    assert reopened.end_pos == 640 and reopened.read(576) == batch[9]
    reopened.close()


def test_reopen_cuts_a_partial_trailing_record(tmp_path: Path) -> None:
    log = TimerLog(tmp_path, SEG)
    log.append([rec(1), rec(2)])
    log.close()
    with open(tmp_path / f"{0:020d}.tlog", "ab") as f:
        f.write(b"\x01" * 20)  # a torn write of a third record
    reopened = TimerLog(tmp_path, SEG)
    assert (reopened.end_pos, reopened.trimmed_bytes) == (128, 20)
    assert os.path.getsize(tmp_path / f"{0:020d}.tlog") == 128
    reopened.close()


def test_a_short_segment_before_the_last_is_padded_so_it_reads_corrupt(tmp_path: Path) -> None:
    log = TimerLog(tmp_path, SEG)
    batch = [rec(i) for i in range(6)]
    log.append(batch)
    log.close()
    os.truncate(tmp_path / f"{0:020d}.tlog", 128)  # its last two records never reached the disk
    reopened = TimerLog(tmp_path, SEG)
    assert reopened.end_pos == 384
    assert reopened.read(64) == batch[1]
    with pytest.raises(CorruptRecordError) as raised:
        reopened.read(128)
    assert raised.value.position == 128
    assert reopened.read(256) == batch[4]
    reopened.close()


def test_truncate_removes_later_segments_and_the_end_survives_a_reopen(tmp_path: Path) -> None:
    log = TimerLog(tmp_path, SEG, fsync=True)
    log.append([rec(i) for i in range(10)])
    log.truncate(320)
    assert log.end_pos == 320 and segment_files(tmp_path) == [f"{0:020d}.tlog", f"{256:020d}.tlog"]
    assert log.append([rec(99)]) == 320
    log.truncate(256)  # exactly a segment boundary: an empty segment keeps the position
    log.close()
    reopened = TimerLog(tmp_path, SEG)
    assert reopened.end_pos == 256
    assert reopened.append([rec(7)]) == 256
    with pytest.raises(ValueError, match="cannot truncate"):
        reopened.truncate(1024)
    reopened.close()


def test_delete_before_removes_only_segments_lying_entirely_before_the_position(tmp_path: Path) -> None:
    log = TimerLog(tmp_path, SEG)
    log.append([rec(i) for i in range(10)])  # segments 0, 256, 512
    assert log.delete_before(255) == 0
    assert log.delete_before(300) == 1
    assert log.start_pos == 256
    assert log.delete_before(10_000) == 1  # the last segment is always kept
    assert segment_files(tmp_path) == [f"{512:020d}.tlog"]
    assert (log.start_pos, log.end_pos) == (512, 640)
    with pytest.raises(IndexError):
        log.read(0)
    log.close()
    reopened = TimerLog(tmp_path, SEG)
    assert (reopened.start_pos, reopened.end_pos) == (512, 640)
    reopened.close()


def test_a_readonly_log_reads_what_the_writer_appends_later_and_cannot_write(tmp_path: Path) -> None:
    writer = TimerLog(tmp_path, SEG)
    reader = TimerLog(tmp_path, SEG, readonly=True)
    batch = [rec(i) for i in range(6)]
    writer.append(batch)
    assert reader.end_pos == 384 and reader.read(320) == batch[5]
    with pytest.raises(TimerwheelError, match="read-only"):
        reader.append([rec(1)])
    reader.close()
    writer.close()


def test_iter_range_yields_good_records_then_raises_at_a_corrupt_one(tmp_path: Path) -> None:
    log = TimerLog(tmp_path, SEG)
    batch = [rec(i) for i in range(3)]
    log.append(batch)
    with open(tmp_path / f"{0:020d}.tlog", "r+b") as f:
        f.seek(64 + 30)
        f.write(b"\xff")
    got = []
    with pytest.raises(CorruptRecordError) as raised:
        for item in log.iter_range(0, 192):
            got.append(item)
    assert got == [(0, batch[0])] and raised.value.position == 64
    log.close()


def test_positions_must_be_aligned_and_held(tmp_path: Path) -> None:
    log = TimerLog(tmp_path, SEG)
    log.append([rec(1)])
    with pytest.raises(ValueError, match="multiple of 64"):
        log.read(10)
    with pytest.raises(IndexError):
        log.read(64)
    with pytest.raises(IndexError):
        log.read(SEG * 5)
    log.close()


def test_a_segment_written_with_another_segment_size_is_refused(tmp_path: Path) -> None:
    log = TimerLog(tmp_path, SEG)
    log.append([rec(i) for i in range(6)])
    log.close()
    with pytest.raises(FormatMismatchError, match="segment_bytes=128"):
        TimerLog(tmp_path, 128)


def test_a_gap_between_segments_is_refused(tmp_path: Path) -> None:
    log = TimerLog(tmp_path, SEG)
    log.append([rec(i) for i in range(10)])
    log.close()
    os.unlink(tmp_path / f"{256:020d}.tlog")
    with pytest.raises(TimerwheelError, match="gap"):
        TimerLog(tmp_path, SEG)


def test_scan_back_yields_a_slots_records_newest_first_and_reports_bad_ones(tmp_path: Path) -> None:
    log = TimerLog(tmp_path, SEG)
    log.append([rec(1000), rec(1150), rec(1050), rec(2000), rec(1099), rec(1000)])
    with open(tmp_path / f"{256:020d}.tlog", "r+b") as f:  # the record at 256 (fires at 1099)
        f.write(b"\0" * 4)
    found = [(pos, r.deliver_ms if r else None, why is not None) for pos, r, why in log.scan_back(0, 384, 1000, 100)]
    assert found == [(320, 1000, False), (256, None, True), (128, 1050, False), (0, 1000, False)]
    assert [pos for pos, _, _ in log.scan_back(64, 256, 1000, 100)] == [128]
    log.close()


def test_append_packed_refuses_a_partial_record(tmp_path: Path) -> None:
    log = TimerLog(tmp_path, SEG)
    arr = pack_records([rec(1)])
    seal(arr)
    with pytest.raises(ValueError, match="whole number"):
        log.append_packed(arr.tobytes()[:50])
    assert log.append_packed(arr) == 0
    log.close()


def test_read_segment_gives_a_segment_whole_with_its_torn_tail_as_the_file_holds_it(tmp_path: Path) -> None:
    writer = TimerLog(tmp_path, SEG)
    writer.append([rec(i) for i in range(6)])
    writer.flush()
    writer.close()
    with open(tmp_path / f"{256:020d}.tlog", "ab") as f:
        f.write(b"torn")  # a partial record at the end: a reader must not cut it
    log = TimerLog(tmp_path, SEG, readonly=True)
    buf = bytearray(SEG)
    assert log.segment_bases() == [0, 256]
    records, data = log.read_segment(0, buf)
    assert [int(t) for t in records["deliver_ms"]] == [0, 1, 2, 3] and len(data) == SEG
    records, data = log.read_segment(256, buf)
    assert [int(t) for t in records["deliver_ms"]] == [4, 5] and bytes(data[-4:]) == b"torn" and len(data) == 132
    records["deliver_ms"][0] = 99  # the records are a writable view of the bytes returned
    assert int.from_bytes(bytes(data[24:32]), "little") == 99
    with pytest.raises(ValueError, match="not a segment's base"):
        log.read_segment(64, buf)
    log.close()
