"""Progress records of exactly-once delivery (issue 31, design 7.1): the wire format and the
finished set a new shard owner reads back."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st
from timerwheel.progress import (
    OFFSET_MASK,
    Finished,
    Progress,
    source_of,
    source_position,
)

positions = st.lists(st.integers(0, 1 << 50), max_size=20)


@given(st.integers(0, 4095), st.integers(0, 1 << 40), st.dictionaries(st.integers(0, 1 << 45), positions, max_size=8))
def test_a_progress_record_reads_back_as_written(shard: int, epoch: int, finished: dict[int, list[int]]) -> None:
    got = Progress.decode(Progress(shard, epoch, finished).encode())
    assert (got.shard, got.epoch) == (shard, epoch)
    assert {k: list(v) for k, v in got.finished.items()} == finished


@given(st.integers(0, 1 << 20), st.integers(0, OFFSET_MASK))
def test_a_source_position_names_one_partition_and_offset(partition: int, offset: int) -> None:
    assert source_of(source_position(partition, offset)) == (partition, offset)


def test_an_offset_past_40_bits_has_no_source_position() -> None:
    with pytest.raises(ValueError, match="offset"):
        source_position(0, OFFSET_MASK + 1)


@pytest.mark.parametrize(("body", "why"), [
    (b"\xc1", "not msgpack"),
    (msgpack.packb([2, 0, 0, []]), "version 2"),
    (msgpack.packb({"v": 1}), "version"),
    (msgpack.packb([1, 0, "e", []]), "expected"),
    (msgpack.packb([1, 0, 0, [[5]]]), "slot entry"),
    (msgpack.packb([1, 0, 0, [[5, [-1]]]]), "slot entry"),
    (msgpack.packb([1, 0, 0, [[True, [1]]]]), "slot entry"),
])
def test_a_record_that_is_not_progress_is_refused_with_why(body: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        Progress.decode(body)


def test_the_finished_set_holds_slots_from_r_and_forgets_them_as_r_moves() -> None:
    a, b = source_position(3, 10), source_position(1, 7)
    values = [Progress(2, 5, {1_000: [a]}).encode(), Progress(2, 6, {900: [b], 1_100: [b]}).encode()]
    done = Finished.read_back(2, values, read_ms=1_000)
    assert done.holds(1_000, 3, 10) and done.holds(1_100, 1, 7)
    assert not done.holds(900, 1, 7)  # before R: never read again, not kept
    assert not done.holds(1_000, 1, 7) and not done.holds(1_100, 3, 10)  # per slot
    assert len(done) == 2
    assert done.forget_before(1_050) == 1
    assert not done.holds(1_000, 3, 10) and done.holds(1_100, 1, 7)


def test_a_read_back_refuses_what_it_cannot_trust() -> None:
    with pytest.raises(ValueError, match="shard 1 in shard 2"):
        Finished.read_back(2, [Progress(1, 1, {0: [1]}).encode()], 0)
    with pytest.raises(ValueError, match="without a value"):
        Finished.read_back(2, [None], 0)
    with pytest.raises(ValueError, match="version"):
        Finished.read_back(2, [msgpack.packb([9])], 0)
