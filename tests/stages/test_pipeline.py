"""The five stages end to end in embedded mode, on a simulated clock."""

from __future__ import annotations

import random
from collections.abc import Callable

from scenario import by_id, header, step_through
from test_rolling import hops
from timerwheel import SimulatedClock, Timer
from timerwheel.runtime.embedded import EmbeddedTimerwheel

DAY = 86_400_000
TICK = 100


def test_ten_thousand_random_delays_are_delivered_once_on_time_intact(
    make_tw: Callable[..., EmbeddedTimerwheel], clock: SimulatedClock
) -> None:
    tw = make_tw(shards=2)
    rng = random.Random(7)
    start = clock.now_ms()
    # Random delays at millisecond precision, drawn around 2,000 random slots so the clock needs
    # 2,000 steps rather than 10,000 (each step stops exactly where a slot may first fire).
    slots = [rng.randint(0, 10 * DAY) // TICK * TICK for _ in range(2_000)] + [0, 1_000]
    timers = []
    for i in range(10_000):
        delay = rng.choice(slots) + rng.randint(0, TICK - 1)
        timers.append(Timer("orders", f"value-{i}".encode(), key=f"k{i}".encode(),
                            headers=(("trace", f"t{i}".encode()), ("tw-extra", b"kept")), delay_ms=delay))
    tickets = tw.schedule_many(timers)
    due = {t.message_id: t.deliver_at_ms for t in tickets}
    step_through(tw, clock, list(due.values()), start + 10 * DAY + 2 * TICK)

    delivered = by_id(tw.read("orders"))
    assert set(delivered) == set(due), "every message delivered"
    dups = {k: len(v) for k, v in delivered.items() if len(v) > 1}
    assert not dups, f"delivered more than once: {list(dups.items())[:5]}"
    for i, (ticket, timer) in enumerate(zip(tickets, timers, strict=True)):
        (r,) = delivered[ticket.message_id]
        at = int(header(r, "tw-delivered-at"))
        assert at >= ticket.deliver_at_ms, f"message {i} early by {ticket.deliver_at_ms - at} ms"
        assert at - ticket.deliver_at_ms <= TICK, f"message {i} late by {at - ticket.deliver_at_ms} ms"
        assert r.key == timer.key and r.value == timer.value
        headers = dict(r.headers)
        assert headers["trace"] == f"t{i}".encode() and headers["tw-extra"] == b"kept"
        assert not {"tw-topic", "tw-delay-ms", "tw-deliver-at"} & set(headers)
        assert int(header(r, "tw-enqueued-at")) == start
    m = tw.metrics
    assert m.counter("delivered", topic="orders") == 10_000
    assert m.counter("scheduled", topic="orders") == 10_000
    assert m.counter("rolled") > 0


def test_one_year_delay_rolls_daily_and_arrives_on_time(
    make_tw: Callable[..., EmbeddedTimerwheel], clock: SimulatedClock
) -> None:
    tw = make_tw(roll_window_ms=DAY, max_delay_ms=400 * DAY)
    start = clock.now_ms()
    ticket = tw.schedule("yearly", b"happy new year", delay_ms=365 * DAY)
    tw.wait_idle()
    # Drive the clock to the moment each roll hop fires, as the design says it will, then to
    # the delivery time: if the service rolled differently, the roll count below would differ.
    path = hops(ticket.deliver_at_ms - start, 0, DAY, [0])
    for fire, _rolled in path:
        clock.set(start + fire - fire % TICK + TICK)
        tw.wait_idle()
    (r,) = tw.read("yearly")
    assert r.value == b"happy new year"
    at = int(header(r, "tw-delivered-at"))
    assert 0 <= at - ticket.deliver_at_ms <= TICK
    assert int(header(r, "tw-roll")) == len(path) - 1 == 364 == tw.metrics.counter("rolled")
    assert clock.now_ms() - start >= 365 * DAY


def test_cancel_before_due_is_never_delivered(make_tw: Callable[..., EmbeddedTimerwheel], clock: SimulatedClock) -> None:
    tw = make_tw()
    keep = tw.schedule("t", b"keep", delay_ms=5_000)
    drop = tw.schedule("t", b"drop", delay_ms=5_000)
    tw.cancel(str(drop))  # tickets round-trip through str()
    step_through(tw, clock, [keep.deliver_at_ms], clock.now_ms() + 10_000)
    assert [r.value for r in tw.read("t")] == [b"keep"]
    assert tw.metrics.counter("cancelled", topic="t") == 1


def test_cancel_reaches_a_rolled_message(make_tw: Callable[..., EmbeddedTimerwheel], clock: SimulatedClock) -> None:
    tw = make_tw(roll_window_ms=DAY)
    start = clock.now_ms()
    # Odd and even roll counts: 1.2 days rolls once, 2.5 days twice, 3.9 days three times.
    tickets = [tw.schedule("t", f"m{d}".encode(), delay_ms=int(d * DAY)) for d in (1.2, 2.5, 3.9)]
    controls = [tw.schedule("t", f"c{d}".encode(), delay_ms=int(d * DAY)) for d in (1.2, 2.5, 3.9)]
    tw.wait_idle()
    clock.advance(DAY // 3)  # the cancels arrive later, so they take their own roll paths
    tw.wait_idle()
    for t in tickets:
        tw.cancel(t)
    times = []
    t = start
    while t < start + 4 * DAY:
        t += DAY // 8
        times.append(t)
    step_through(tw, clock, times + [c.deliver_at_ms for c in controls], start + 4 * DAY + TICK)
    delivered = by_id(tw.read("t"))
    assert set(delivered) == {c.message_id for c in controls}
    assert sorted(int(header(v[0], "tw-roll")) for v in delivered.values()) == [1, 2, 3]
    assert tw.metrics.counter("cancelled", topic="t") == 3


def test_cancel_after_delivery_has_no_effect_and_is_counted(
    make_tw: Callable[..., EmbeddedTimerwheel], clock: SimulatedClock
) -> None:
    tw = make_tw()
    ticket = tw.schedule("t", b"v", delay_ms=1_000)
    step_through(tw, clock, [ticket.deliver_at_ms], clock.now_ms() + 2_000)
    tw.cancel(ticket)
    clock.advance(2 * TICK)
    tw.wait_idle()
    clock.advance(2 * TICK)
    tw.wait_idle()
    assert len(tw.read("t")) == 1
    assert tw.metrics.counter("cancel_missed") == 1
    assert tw.metrics.counter("cancelled") == 0


def test_a_hash_collision_never_cancels_another_message(
    make_tw: Callable[..., EmbeddedTimerwheel], clock: SimulatedClock, monkeypatch: object
) -> None:
    import timerwheel.stages.enqueue_get as eg
    import timerwheel.wire

    tw = make_tw()
    real = eg.id_hash
    # Every id collides, for every stage that hashes one: enqueue-get writing the TimerLog, and
    # dequeue-put matching a held message against markers written after it was read ahead.
    eg.id_hash = timerwheel.wire.id_hash = lambda message_id: 42  # type: ignore[assignment]
    try:
        a = tw.schedule("t", b"a", delay_ms=1_000, message_id="a")
        tw.schedule("t", b"b", delay_ms=1_000, message_id="b")
        tw.cancel(a)
        step_through(tw, clock, [a.deliver_at_ms], clock.now_ms() + 3_000)
    finally:
        eg.id_hash = timerwheel.wire.id_hash = real
    assert [r.value for r in tw.read("t")] == [b"b"]


def test_delay_levels_use_the_configured_table(make_tw: Callable[..., EmbeddedTimerwheel], clock: SimulatedClock) -> None:
    tw = make_tw(delay_levels_ms=(1_000, 3_000, 7_000))
    start = clock.now_ms()
    tickets = [tw.schedule("lv", str(n).encode(), delay_level=n) for n in (1, 2, 3)]
    assert [t.deliver_at_ms - start for t in tickets] == [1_000, 3_000, 7_000]
    step_through(tw, clock, [t.deliver_at_ms for t in tickets], start + 8_000)
    got = {r.value: int(header(r, "tw-delivered-at")) - start for r in tw.read("lv")}
    assert got.keys() == {b"1", b"2", b"3"}
    for n, ms in ((b"1", 1_000), (b"2", 3_000), (b"3", 7_000)):
        assert ms <= got[n] <= ms + TICK


def test_already_due_message_goes_out_one_tick_later_without_read_ahead(
    make_tw: Callable[..., EmbeddedTimerwheel], clock: SimulatedClock
) -> None:
    tw = make_tw(lookahead_ms=0)
    now = clock.now_ms()
    tw.schedule("t", b"past", deliver_at_ms=now - 60_000)
    tw.wait_idle()
    assert tw.read("t") == []
    clock.advance(TICK)
    tw.wait_idle()
    (r,) = tw.read("t")
    assert int(header(r, "tw-delivered-at")) - now <= TICK


def test_already_due_message_goes_out_at_once_read_ahead(
    make_tw: Callable[..., EmbeddedTimerwheel], clock: SimulatedClock
) -> None:
    tw = make_tw()  # TW_LOOKAHEAD_MS by default: the slot of W is read at once, W is past its time
    now = clock.now_ms()
    tw.schedule("t", b"past", deliver_at_ms=now - 60_000)
    tw.wait_idle()
    (r,) = tw.read("t")
    assert int(header(r, "tw-delivered-at")) == now
