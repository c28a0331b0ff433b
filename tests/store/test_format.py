"""The 64-byte TimerLog record: layout, packing, CRC, detection of damage."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from timerwheel.errors import CorruptRecordError
from timerwheel.store import FORMAT_VERSION, RECORD_DTYPE, RECORD_SIZE, RECORD_STRUCT, Flag, TimerRecord
from timerwheel.store.format import (
    CRC_BLOCK_ROWS,
    MAGIC_BASE,
    as_bytes,
    crc32_rows,
    pack_records,
    seal,
    unpack_record,
    valid_mask,
    why_invalid,
)

from .conftest import rec

DOCUMENTED_OFFSETS = {
    "size": 0, "prev_pos": 4, "magic": 12, "enqueue_ms": 16, "deliver_ms": 24, "src_partition": 32,
    "src_offset": 36, "src_size": 44, "topic_hash": 48, "id_hash": 52, "crc32": 60,
}


def sealed(records: list[TimerRecord]) -> np.ndarray:
    arr = pack_records(records)
    seal(arr)
    return arr


def test_record_layout_matches_the_documented_offsets() -> None:
    assert RECORD_SIZE == RECORD_STRUCT.size == RECORD_DTYPE.itemsize == 64
    assert RECORD_DTYPE.fields is not None
    assert {name: RECORD_DTYPE.fields[name][1] for name in DOCUMENTED_OFFSETS} == DOCUMENTED_OFFSETS
    assert RECORD_DTYPE["deliver_ms"].byteorder in "<="  # little-endian on every host


records = st.builds(
    TimerRecord,
    flags=st.sampled_from([Flag.NORMAL, Flag.ROLL, Flag.DELETE, Flag.ROLL | Flag.DELETE, Flag.NORMAL | Flag.ROLL]),
    enqueue_ms=st.integers(0, 2**62),
    deliver_ms=st.integers(-(2**62), 2**62),
    src_partition=st.integers(0, 2**32 - 1),
    src_offset=st.integers(-(2**63), 2**63 - 1),
    src_size=st.integers(0, 2**32 - 1),
    topic_hash=st.integers(0, 2**32 - 1),
    id_hash=st.integers(0, 2**64 - 1),
    prev_pos=st.integers(-1, 2**40).map(lambda p: p if p < 0 else p * 64),
)


@settings(max_examples=50, deadline=None)
@given(st.lists(records, min_size=1, max_size=20))
def test_packed_records_unpack_to_the_same_values(batch: list[TimerRecord]) -> None:
    data = sealed(batch).tobytes()
    assert [unpack_record(data, i * 64, i * 64) for i in range(len(batch))] == batch


@settings(max_examples=50, deadline=None)
@given(st.binary(min_size=64, max_size=64 * 40).map(lambda b: b[: len(b) // 64 * 64]))
def test_vectorised_crc_equals_zlib_crc32_of_the_first_60_bytes(data: bytes) -> None:
    rows = np.frombuffer(data, dtype=np.uint8).reshape(-1, 64)
    expected = [zlib.crc32(data[i : i + 60]) for i in range(0, len(data), 64)]
    assert crc32_rows(rows).tolist() == expected


def test_vectorised_crc_is_right_across_its_blocks_of_rows() -> None:
    """crc32_rows works through its rows a block at a time: rows on both sides of each block edge."""
    n = 2 * CRC_BLOCK_ROWS + 5
    data = np.random.default_rng(7).integers(0, 256, n * 64, dtype=np.uint8).tobytes()
    rows = np.frombuffer(data, dtype=np.uint8).reshape(-1, 64)
    expected = [zlib.crc32(data[i : i + 60]) for i in range(0, len(data), 64)]
    assert crc32_rows(rows).tolist() == expected
    assert crc32_rows(rows[CRC_BLOCK_ROWS - 3 :]).tolist() == expected[CRC_BLOCK_ROWS - 3 :]


def test_magic_holds_the_constant_the_version_and_the_flags() -> None:
    arr = sealed([rec(1000, flags=Flag.ROLL | Flag.DELETE)])
    assert int(arr["magic"][0]) == 0x5457_0000 | FORMAT_VERSION << 8 | 6 == MAGIC_BASE | 6
    assert unpack_record(arr.tobytes(), 0).flags == Flag.ROLL | Flag.DELETE


def test_every_single_bit_flip_is_detected() -> None:
    good = sealed([rec(123_456, src_offset=99)]).tobytes()
    for bit in range(RECORD_SIZE * 8):
        damaged = bytearray(good)
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptRecordError) as raised:
            unpack_record(bytes(damaged), 640)
        assert raised.value.position == 640
        arr = np.frombuffer(bytes(damaged), dtype=RECORD_DTYPE)
        assert not valid_mask(arr)[0], f"bit {bit} flipped but the record still checks"


def test_a_zeroed_or_short_record_is_invalid_with_a_reason() -> None:
    assert why_invalid(bytes(64)) == "size field 0, expected 64"
    assert valid_mask(np.zeros(3, dtype=RECORD_DTYPE)).tolist() == [False, False, False]
    with pytest.raises(CorruptRecordError, match="short record"):
        unpack_record(bytes(10), 0)


def test_a_crc_mismatch_names_both_values() -> None:
    data = bytearray(sealed([rec(5)]).tobytes())
    data[30] ^= 0xFF
    reason = why_invalid(bytes(data))
    assert reason is not None and reason.startswith("CRC mismatch: stored 0x")


def test_another_format_version_is_named() -> None:
    arr = sealed([rec(5)])
    arr["magic"] = (0x5457 << 16) | (FORMAT_VERSION + 1) << 8 | 1
    arr["crc32"] = crc32_rows(as_bytes(arr))
    assert why_invalid(arr.tobytes()) == f"format version {FORMAT_VERSION + 1}, expected {FORMAT_VERSION}"


@pytest.mark.parametrize("flags", [0, 8, 9, -1])
def test_flags_must_be_a_combination_of_flag(flags: int) -> None:
    with pytest.raises(ValueError, match="flags"):
        pack_records([rec(1, flags=flags)])


@pytest.mark.parametrize("field", ["src_partition", "src_size", "topic_hash", "id_hash"])
def test_an_unsigned_field_out_of_range_is_refused(field: str) -> None:
    values = {"src_partition": 0, "src_size": 0, "topic_hash": 0, "id_hash": 0}
    values[field] = -1
    record = TimerRecord(Flag.NORMAL, 0, 0, values["src_partition"], 0, values["src_size"], values["topic_hash"],
                         values["id_hash"])
    with pytest.raises(ValueError, match=field):
        pack_records([record])
