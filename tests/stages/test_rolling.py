"""Rolling (design §5): a message and its cancel marker always end in the same final slot."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from timerwheel.stages.enqueue_put import fire_time

DAY = 86_400_000
TICK = 100


def hops(deliver: int, write_ms: int, window: int, lags: list[int]) -> list[tuple[int, bool]]:
    """Follow a record through its roll hops; each hop is re-enqueued some lag after it fires."""
    path = []
    i = 0
    while True:
        fire, rolled = fire_time(deliver, write_ms, window)
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
    assert fire_time(1_000, 5_000, DAY) == (5_000, False)


def test_remaining_under_a_third_rolls_to_half_the_window() -> None:
    assert fire_time(DAY + DAY // 4, 0, DAY) == (DAY // 2, True)
    assert fire_time(DAY + DAY // 2, 0, DAY) == (DAY, True)


@settings(max_examples=200, deadline=None)
@given(
    deliver=st.lists(st.integers(0, 400 * DAY), min_size=1, max_size=50),
    write_ms=st.integers(0, 2 * DAY),
    window=st.sampled_from([DAY // 2, DAY, 2 * DAY]),
)
def test_vectorised_batch_matches_fire_time(deliver: list[int], write_ms: int, window: int) -> None:
    """enqueue-put builds a batch's records column-wise; each must fire where fire_time says."""
    from types import SimpleNamespace

    from timerwheel.config import TimerConfig
    from timerwheel.stages.enqueue_put import EnqueuePut
    from timerwheel.store import Flag

    put = EnqueuePut.__new__(EnqueuePut)
    put.ctx = SimpleNamespace(config=TimerConfig(roll_window_ms=window))  # type: ignore[assignment]
    import numpy as np

    rows = [(i, 10, 5, d, bool(i % 2), 7, 2**63 + i) for i, d in enumerate(deliver)]
    arr = put._records(np.full(len(rows), 1, dtype=np.uint64), rows, write_ms, write_ms)
    for i, d in enumerate(deliver):
        fire, rolled = fire_time(d, write_ms, window)
        assert int(arr["deliver_ms"][i]) == fire
        flags = int(arr["magic"][i]) & 0xFF
        assert bool(flags & Flag.ROLL) == rolled and bool(flags & Flag.DELETE) == bool(i % 2)
        assert int(arr["id_hash"][i]) == 2**63 + i and int(arr["src_offset"][i]) == i
        assert int(arr["src_partition"][i]) == 1 and int(arr["enqueue_ms"][i]) == 5
