"""Rolling (design §5): a message and its cancel marker always end in the same final slot.

enqueue-put applies the roll rule to a batch at once (``roll_targets``); ``fire_time`` below is
the rule written for one record, as the design states it: the oracle the batch form must match."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from timerwheel.stages.codec import PutRow
from timerwheel.stages.enqueue_put import roll_targets, timerlog_records
from timerwheel.store import Flag

DAY = 86_400_000
TICK = 100


def fire_time(deliver_ms: int, write_ms: int, roll_window_ms: int, base_ms: int | None = None) -> tuple[int, bool]:
    """Time whose slot a record is written to, given ``W`` (``write_ms``) and what rolling is
    relative to (``base_ms``, W unless held back for the input), and whether it is a roll hop."""
    base = write_ms if base_ms is None else base_ms
    if deliver_ms - base >= roll_window_ms:
        beyond = deliver_ms - (base + roll_window_ms)
        if beyond < roll_window_ms // 3:
            return base + roll_window_ms // 2, True
        return base + roll_window_ms, True
    return max(deliver_ms, write_ms), False


def rolled_to(deliver_ms: int, write_ms: int, roll_window_ms: int) -> tuple[int, bool]:
    """``roll_targets`` of one record, as enqueue-put computes it."""
    fire, rolled = roll_targets(np.array([deliver_ms], dtype=np.int64), write_ms, write_ms, roll_window_ms)
    return int(fire[0]), bool(rolled[0])


def hops(deliver: int, write_ms: int, window: int, lags: list[int]) -> list[tuple[int, bool]]:
    """Follow a record through its roll hops; each hop is re-enqueued some lag after it fires."""
    path = []
    i = 0
    while True:
        fire, rolled = rolled_to(deliver, write_ms, window)
        path.append((fire, rolled))
        if not rolled:
            return path
        write_ms = fire - fire % TICK + TICK + lags[i % len(lags)]
        i += 1


@settings(max_examples=400, deadline=None)
@given(
    deliver=st.integers(0, 400 * DAY),
    msg_w=st.integers(0, 2 * DAY),
    cancel_w=st.integers(0, 2 * DAY),
    window=st.sampled_from([DAY // 2, DAY, 2 * DAY]),
    lags=st.lists(st.integers(0, 60_000), min_size=1, max_size=5),
)
def test_message_and_cancel_marker_meet_in_the_slot_of_the_delivery_time(
    deliver: int, msg_w: int, cancel_w: int, window: int, lags: list[int]
) -> None:
    start = 0
    msg = hops(deliver, start + msg_w, window, lags)
    cancel = hops(deliver, start + min(cancel_w, deliver), window, lags[::-1])
    final_msg, final_cancel = msg[-1][0], cancel[-1][0]
    if deliver >= start + msg_w:
        assert final_msg == deliver
    if deliver >= start + min(cancel_w, deliver):
        assert final_cancel == deliver
    # Every roll hop fires inside the window and leaves at least window/3 before delivery.
    for fire, rolled in msg[:-1]:
        assert rolled and deliver - fire >= window // 3 - 1


def test_roll_count_for_a_year_with_a_one_day_window() -> None:
    path = hops(365 * DAY, 0, DAY, [0])
    assert len(path) - 1 == 364  # one hop a day until the last day is inside the window


def test_already_due_goes_to_the_slot_of_w() -> None:
    assert rolled_to(1_000, 5_000, DAY) == (5_000, False)


def test_remaining_under_a_third_rolls_to_half_the_window() -> None:
    assert rolled_to(DAY + DAY // 4, 0, DAY) == (DAY // 2, True)
    assert rolled_to(DAY + DAY // 2, 0, DAY) == (DAY, True)


def _near_the_edges(base: int, write_ms: int, window: int) -> st.SearchStrategy[int]:
    """Delivery times anywhere, or within a few ms of where the rule changes its answer."""
    edges = [write_ms, base + window, base + window + window // 3]
    return st.one_of(st.integers(0, 400 * DAY), st.builds(lambda e, d: max(0, e + d), st.sampled_from(edges),
                                                         st.integers(-2, 2)))


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    write_ms=st.integers(0, 2 * DAY),
    held_back=st.integers(0, DAY),
    window=st.sampled_from([DAY // 2, DAY, 2 * DAY, 3 * TICK * 10 + 10]),
)
def test_the_batch_roll_rule_is_the_rule_of_each_record(data: st.DataObject, write_ms: int, held_back: int,
                                                         window: int) -> None:
    """``roll_targets`` of a batch is ``fire_time`` of each record, with W held back for the
    input (rolling then relative to the W the clock alone gives) or not."""
    base = write_ms + data.draw(st.sampled_from([0, held_back]))
    deliver = data.draw(st.lists(_near_the_edges(base, write_ms, window), min_size=1, max_size=50))
    fire, rolled = roll_targets(np.array(deliver, dtype=np.int64), write_ms, base, window)
    assert [(int(f), bool(r)) for f, r in zip(fire, rolled, strict=True)] == [
        fire_time(d, write_ms, window, base) for d in deliver]


@settings(max_examples=200, deadline=None)
@given(
    deliver=st.lists(st.integers(0, 400 * DAY), min_size=1, max_size=50),
    write_ms=st.integers(0, 2 * DAY),
    window=st.sampled_from([DAY // 2, DAY, 2 * DAY]),
)
def test_vectorised_batch_matches_fire_time(deliver: list[int], write_ms: int, window: int) -> None:
    """enqueue-put builds a batch's records column-wise; each must fire where fire_time says."""
    rows: list[PutRow] = [(i, 10, 5, d, bool(i % 2), 7, 2**63 + i) for i, d in enumerate(deliver)]
    arr = timerlog_records(np.full(len(rows), 1, dtype=np.uint64), rows, write_ms, write_ms, window)
    for i, d in enumerate(deliver):
        fire, rolled = fire_time(d, write_ms, window)
        assert int(arr["deliver_ms"][i]) == fire
        flags = int(arr["magic"][i]) & 0xFF
        assert bool(flags & Flag.ROLL) == rolled and bool(flags & Flag.DELETE) == bool(i % 2)
        assert int(arr["id_hash"][i]) == 2**63 + i and int(arr["src_offset"][i]) == i
        assert int(arr["src_partition"][i]) == 1 and int(arr["enqueue_ms"][i]) == 5
