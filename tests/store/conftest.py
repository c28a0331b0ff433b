"""Fixtures for the store tests: record factory and shard opener (closed after each test)."""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from timerwheel.store import Flag, Shard, TimerRecord
from timerwheel.store.format import records_from_array

_ids = itertools.count(1)


def rec(deliver_ms: int, *, flags: int = Flag.NORMAL, src_partition: int = 0, src_offset: int | None = None,
        enqueue_ms: int = 0, src_size: int = 100, topic_hash: int = 7, id_hash: int | None = None) -> TimerRecord:
    n = next(_ids)
    return TimerRecord(flags, enqueue_ms, deliver_ms, src_partition, n if src_offset is None else src_offset,
                       src_size, topic_hash, n if id_hash is None else id_hash)


OpenShard = Callable[..., Shard]


def slot_records(shard: Shard, slot_time: int, limit: int | None = None) -> list[tuple[int, TimerRecord]]:
    """(position, record) of the slot's records, newest first, as ``Shard.read_slot`` gives them column-wise."""
    return [(pos, record) for positions, records in shard.read_slot(slot_time, limit)
            for pos, record in zip(positions.tolist(), records_from_array(records), strict=True)]


def segment_path(shard: Shard, pos: int) -> Path:
    """The TimerLog segment file holding position ``pos``."""
    base = pos - pos % shard.log.segment_bytes
    return Path(shard.log.directory) / f"{base:020d}.tlog"


def flip_bit(shard: Shard, pos: int, byte: int = 33, bit: int = 4) -> None:
    """Flip one bit of the record at ``pos`` on disk (bit rot in the middle of a segment)."""
    with open(segment_path(shard, pos), "r+b") as f:
        f.seek(pos % shard.log.segment_bytes + byte)
        value = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([value ^ (1 << bit)]))


@pytest.fixture
def open_shard(tmp_path: Path) -> Iterator[OpenShard]:
    opened: list[Shard] = []

    def _open(name: str = "shard-0000", *, tick_ms: int = 100, slots: int = 64, segment_bytes: int = 64 * 16,
              fsync: bool = False, writer: bool = True, **kw: Any) -> Shard:
        shard = Shard.open(tmp_path / name, tick_ms=tick_ms, slots=slots, segment_bytes=segment_bytes,
                           fsync=fsync, writer=writer, **kw)
        opened.append(shard)
        return shard

    yield _open
    for shard in reversed(opened):
        shard.close()


def crash_copy(shard: Shard, dest: Path) -> Path:
    """The shard directory as a crash would leave it now: files as the OS holds them, no flush."""
    shutil.copytree(shard.directory, dest)
    return dest


def reopen(directory: Path, shard: Shard, **kw: Any) -> Shard:
    """Open ``directory`` as the writer with ``shard``'s settings (runs recovery)."""
    return Shard.open(directory, tick_ms=shard.tick_ms, slots=shard.slots, segment_bytes=shard.log.segment_bytes,
                      fsync=False, **kw)
