"""TimerWheel: slot arithmetic, revolutions, pending vs published, ranges, chain and revise."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from timerwheel.errors import FormatMismatchError, TimerwheelError
from timerwheel.store import Slot, TimerWheel
from timerwheel.store.wheel import SLOT_MAGIC

TICK = 100


def wheel_at(tmp_path: Path, slots: int = 16, **kw: object) -> TimerWheel:
    return TimerWheel(tmp_path / "wheel", TICK, slots, **kw)  # type: ignore[arg-type]


def arr(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_slot_time_and_index(tmp_path: Path) -> None:
    w = wheel_at(tmp_path)
    assert w.slot_time(1_234) == 1_200 and w.index(1_234) == 12
    assert w.index(1_234 + 16 * TICK) == 12  # one revolution later: the same index
    assert w.slot_time(-1) == -100 and w.index(-1) == 15
    w.close()


def test_a_new_wheel_is_empty_and_has_synced_nothing(tmp_path: Path) -> None:
    w = wheel_at(tmp_path)
    assert w.created and w.synced_pos == 0
    assert w.get(12_345) == Slot(12_300, -1, -1, 0, 0)
    w.close()


def test_a_slot_reused_one_revolution_later_reads_empty_for_the_old_time(tmp_path: Path) -> None:
    w = wheel_at(tmp_path)
    w.put(500, 0, 64, 2)
    later = 500 + 16 * TICK
    assert w.get(500).num == 2 and w.get(later).num == 0
    w.put(later, 128, 128, 1)
    w.flush()
    assert w.get(500) == Slot(500, -1, -1, 0, 0)
    assert w.get(later) == Slot(later, 128, 128, 1, SLOT_MAGIC)
    w.close()


def test_put_is_visible_to_readers_once_published_and_durable_after_flush(tmp_path: Path) -> None:
    w = wheel_at(tmp_path)
    reader = wheel_at(tmp_path, readonly=True)
    w.put(300, 0, 0, 1)
    assert w.get(300).num == 1 and reader.get(300).num == 0
    w.publish()
    assert reader.get(300).num == 1
    w.flush(synced_pos=64)
    w.close()
    reopened = wheel_at(tmp_path)
    assert reopened.synced_pos == 64 and reopened.get(300) == Slot(300, 0, 0, 1, SLOT_MAGIC)
    with pytest.raises(TimerwheelError, match="read-only"):
        reader.put(300, 0, 0, 1)
    reader.close()
    reopened.close()


@pytest.mark.parametrize(("tick", "slots", "named"), [(1000, 16, "tick_ms: stored 100, requested 1000"),
                                                      (TICK, 32, "slots: stored 16, requested 32")])
def test_a_wheel_with_another_tick_or_size_is_refused_naming_both(tmp_path: Path, tick: int, slots: int,
                                                                  named: str) -> None:
    wheel_at(tmp_path).close()
    with pytest.raises(FormatMismatchError, match=named):
        TimerWheel(tmp_path / "wheel", tick, slots)


def test_chain_links_newest_first_within_and_across_batches(tmp_path: Path) -> None:
    w = wheel_at(tmp_path)
    prev, update = w.chain(arr(100, 200, 100, 100), arr(0, 64, 128, 192))
    assert prev.tolist() == [-1, -1, 0, 128]
    w.stage(update)
    assert w.get(100) == Slot(100, 0, 192, 3, SLOT_MAGIC)
    prev, update = w.chain(arr(200, 100), arr(256, 320))
    assert prev.tolist() == [64, 192]
    w.stage(update)
    assert (w.get(100).num, w.get(200).num) == (4, 2)
    w.close()


def test_chain_starts_a_new_revolution_afresh(tmp_path: Path) -> None:
    w = wheel_at(tmp_path)
    w.stage(w.chain(arr(100, 100), arr(0, 64))[1])
    later = 100 + 16 * TICK
    prev, update = w.chain(arr(later, later), arr(128, 192))
    assert prev.tolist() == [-1, 128]
    w.stage(update)
    assert w.get(later) == Slot(later, 128, 192, 2, SLOT_MAGIC) and w.get(100).num == 0
    w.close()


def test_chain_refuses_a_slot_older_than_the_revolution_the_wheel_holds(tmp_path: Path) -> None:
    w = wheel_at(tmp_path)
    later = 100 + 16 * TICK
    w.stage(w.chain(arr(later), arr(0))[1])
    with pytest.raises(TimerwheelError, match="too small"):
        w.chain(arr(100), arr(64))
    with pytest.raises(TimerwheelError, match="too small"):
        w.chain(arr(later + 16 * TICK, later), arr(64, 128))
    w.close()


def test_revise_is_idempotent_and_counts_each_record_once(tmp_path: Path) -> None:
    w = wheel_at(tmp_path)
    times, positions = arr(100, 200, 100, 100), arr(0, 64, 128, 192)
    assert w.revise(times, positions) == 4
    assert w.revise(times, positions) == 0
    assert w.revise(arr(100, 100), arr(192, 256)) == 1  # one already linked, one new
    assert w.get(100) == Slot(100, 0, 256, 4, SLOT_MAGIC) and w.get(200) == Slot(200, 64, 64, 1, SLOT_MAGIC)
    w.close()


def test_revise_keeps_only_the_newest_revolution_per_index(tmp_path: Path) -> None:
    w = wheel_at(tmp_path)
    later = 100 + 16 * TICK
    assert w.revise(arr(100, later, 100, later), arr(0, 64, 128, 192)) == 2
    assert w.get(later) == Slot(later, 64, 192, 2, SLOT_MAGIC) and w.get(100).num == 0
    assert w.revise(arr(100), arr(256)) == 0  # an older revolution never displaces a newer one
    assert w.get(later).num == 2
    w.close()


def test_referencing_finds_slots_naming_positions_past_an_end(tmp_path: Path) -> None:
    w = wheel_at(tmp_path)
    w.revise(arr(100, 200, 300, 300), arr(0, 64, 128, 640))
    assert w.referencing(640).tolist() == [3]
    assert w.referencing(100).tolist() == [3] and sorted(w.referencing(64).tolist()) == [2, 3]
    w.close()


slot_states = st.lists(
    st.tuples(st.integers(-40, 80), st.integers(1, 5), st.booleans()), max_size=30
)  # (slot number, messages, published?)


@settings(max_examples=80, deadline=None)
@given(slot_states, st.integers(-60, 100), st.integers(0, 120))
def test_count_range_and_next_nonempty_agree_with_a_plain_model(
    tmp_path_factory: pytest.TempPathFactory, states: list[tuple[int, int, bool]], start: int, length: int
) -> None:
    w = TimerWheel(tmp_path_factory.mktemp("w") / "wheel", TICK, 16)
    model: dict[int, tuple[int, int]] = {}  # index -> (slot time, messages): what a put leaves
    for number, num, published in states:
        t = number * TICK
        w.put(t, 0, 64 * num, num)
        model[w.index(t)] = (t, num)
        if published:
            w.publish()
    from_ms, to_ms = start * TICK + 37, start * TICK + 37 + length * 53
    first = w.slot_time(from_ms)
    in_range = [(t, num) for t, num in model.values() if first <= t < to_ms]
    assert w.count_range(from_ms, to_ms) == sum(num for _, num in in_range)
    assert w.next_nonempty(from_ms, to_ms) == min((t for t, _ in in_range), default=None)
    w.close()


def test_next_nonempty_skips_millions_of_empty_slots_quickly(tmp_path: Path) -> None:
    slots = 3_456_000
    w = TimerWheel(tmp_path / "wheel", TICK, slots, fsync=False)
    start = 10**12
    target = start + (slots - 10) * TICK
    w.put(target, 0, 0, 1)
    w.put(start - TICK, 64, 64, 5)  # before the range
    w.flush()
    began = time.perf_counter()
    assert w.next_nonempty(start, start + slots * TICK) == target
    assert w.next_nonempty(start, start + 10 * slots * TICK) == target  # wider than one revolution
    assert w.count_range(start - TICK, start + slots * TICK) == 6
    assert time.perf_counter() - began < 2.0
    assert w.next_nonempty(start, target) is None
    w.close()


def test_fresh_slots_read_as_the_mapping_does_and_only_change_when_cleared(tmp_path: Path) -> None:
    """``FreshSlots`` (a reader on a shared file system): slices across its blocks and arrays of
    indexes give the mapped rows; a block read stays as read until ``clear``; a long scan keeps
    none of the blocks it had to read."""
    from timerwheel.store.fresh import DirectFile
    from timerwheel.store.wheel import FRESH_BLOCK_SLOTS, FRESH_SCAN_KEEP_BLOCKS, FreshSlots

    slots = (FRESH_SCAN_KEEP_BLOCKS + 2) * FRESH_BLOCK_SLOTS + 17
    w = TimerWheel(tmp_path / "wheel", tick_ms=100, slots=slots)
    rng = np.random.default_rng(5)
    for i in rng.choice(slots, 500, replace=False).tolist():
        w.put(i * 100, i * 64, i * 64 + 64, 2)
    w.flush()
    direct = DirectFile(str(tmp_path / "wheel"))
    fresh = FreshSlots(direct, slots)
    try:
        for i0, i1 in [(0, 10), (FRESH_BLOCK_SLOTS - 3, FRESH_BLOCK_SLOTS + 3), (5, slots), (slots - 20, slots)]:
            assert fresh[i0:i1].tobytes() == w.rows(np.arange(i0, i1)).tobytes(), (i0, i1)
        idx = rng.integers(0, slots, 300)
        assert fresh[idx].tobytes() == w.rows(idx).tobytes()
        fresh.clear()
        before = fresh.row(7)
        fresh[0:slots]  # a long scan: read, not kept
        w.put(7 * 100, 1, 640, 9)
        w.put(2 * FRESH_BLOCK_SLOTS * 100 + 100, 1, 640, 9)
        w.flush()
        assert fresh.row(7) == before, "a kept block changed before clear()"
        assert fresh.row(2 * FRESH_BLOCK_SLOTS + 1)[3] == 9, "the scan kept a block it passed through"
        fresh.clear()
        assert fresh.row(7) == (700, 1, 640, 9, SLOT_MAGIC)
    finally:
        direct.close()
        w.close()
