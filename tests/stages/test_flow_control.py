"""Flow control: a burst far larger than the queues is streamed through bounded queues."""

from __future__ import annotations

import threading
from collections.abc import Callable

from timerwheel import SimulatedClock, Timer
from timerwheel.runtime.embedded import EmbeddedTimerwheel

N = 1_000_000


def test_a_million_messages_due_in_one_tick_flow_through_bounded_queues(
    make_tw: Callable[..., EmbeddedTimerwheel], clock: SimulatedClock
) -> None:
    bound, batch, in_flight = 16, 500, 20_000
    tw = make_tw(shards=2, queue_bound=bound, batch_size=batch, max_in_flight=in_flight)
    due = clock.now_ms() + 50
    for _ in range(N // 10_000):
        tw.schedule_many([Timer("burst", b"x" * 16, deliver_at_ms=due) for _ in range(10_000)])
    peaks: dict[str, int] = {name: 0 for name in tw.queues}
    peak_in_flight = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak_in_flight
        while not stop.is_set():
            for name, q in tw.queues.items():
                peaks[name] = max(peaks[name], max(q.depth(p) for p in range(q.partitions)))
            flying = sum(st.messages_in_flight() for st in list(tw.dequeue_get.owned.values()))
            peak_in_flight = max(peak_in_flight, flying)
            stop.wait(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        # Not waited idle before the clock moves: read ahead (TW_LOOKAHEAD_MS), the queues fill with
        # records held for their time and the stages upstream wait for room until it does.
        clock.advance(200)
        tw.wait_idle(600)
    finally:
        stop.set()
        sampler.join()
    assert sum(tw.commit_log.end_offsets("burst").values()) == N
    assert tw.metrics.counter("delivered", topic="burst") == N
    # Nothing ever held more than the bounds: entries per queue partition, messages in flight.
    for name, peak in peaks.items():
        assert 0 < peak <= bound + 8, f"queue {name} peaked at {peak} entries (bound {bound})"
    assert 0 < peak_in_flight <= 2 * (in_flight + batch)  # two shards
