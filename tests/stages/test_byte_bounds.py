"""Memory bounded in bytes (TW_BATCH_BYTES, TW_QUEUE_BYTES): large records flow through the
stages in batches and queues bounded in bytes, not only in entries and records."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from timerwheel import SimulatedClock, Timer
from timerwheel.records import OutRecord, Record
from timerwheel.runtime.embedded import EmbeddedTimerwheel
from timerwheel.stages.codec import Q_DELIVER, Q_FETCH, FetchEntry

N = 60
VALUE = b"v" * 100_000
BATCH_BYTES = 256 * 1024
QUEUE_BYTES = 512 * 1024


def test_large_records_flow_in_batches_and_queues_bounded_in_bytes(
    make_tw: Callable[..., EmbeddedTimerwheel], clock: SimulatedClock
) -> None:
    tw = make_tw(shards=1, batch_bytes=BATCH_BYTES, queue_bytes=QUEUE_BYTES, read_cache_bytes=QUEUE_BYTES)
    fetch_items: list[int] = []
    read_bytes: list[int] = []
    produced_bytes: list[int] = []
    fetch_q, deliver_q, log = tw.queues[Q_FETCH], tw.queues[Q_DELIVER], tw.commit_log
    fetch_put, read, append = fetch_q.put, log.read, log.append

    def put(partition: int, entries: Sequence[Any], timeout_s: float) -> None:
        fetch_items.extend(len(FetchEntry.decode(e).items) for e in entries)
        fetch_put(partition, entries, timeout_s)

    def reading(topic: str, positions: Sequence[tuple[int, int]]) -> list[Record | None]:
        found = read(topic, positions)
        read_bytes.append(sum(r.size for r in found if r is not None))
        return found

    def appending(records: Sequence[OutRecord]) -> list[tuple[int, int]]:
        produced_bytes.append(sum(len(r.value or b"") for r in records if r.topic == "big"))
        return append(records)

    fetch_q.put, log.read, log.append = put, reading, appending  # type: ignore[method-assign]
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, deliver_q._parts[0].nbytes)  # type: ignore[attr-defined]
            stop.wait(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        tw.schedule_many([Timer("big", VALUE, deliver_at_ms=clock.now_ms() + 50) for _ in range(N)])
        # Not waited idle here: read ahead (TW_LOOKAHEAD_MS), the queues fill with records held for
        # their time and dequeue-getmsg waits for room until the clock moves.
        clock.advance(200)
        tw.wait_idle(120)
    finally:
        stop.set()
        sampler.join()
    assert tw.metrics.counter("delivered", topic="big") == N
    assert sum(tw.commit_log.end_offsets("big").values()) == N
    # A fetch entry stops at TW_BATCH_BYTES of source records: two of ~100 KB, not 500.
    assert sum(fetch_items) == N and max(fetch_items) == 2, fetch_items
    # dequeue-getmsg reads at most a batch's bytes at once. dequeue-put's first step knows no
    # entry size yet and takes what a partition holds (at most TW_QUEUE_BYTES and a put); from
    # then on a step stops at a batch's bytes, and its last entry may pass them by one entry.
    assert 0 < max(read_bytes) <= BATCH_BYTES, read_bytes
    produced = [b for b in produced_bytes if b]  # the others are the client's appends to the timer topic
    assert produced[0] <= QUEUE_BYTES + BATCH_BYTES, produced
    assert 0 < max(produced[1:]) <= 2 * BATCH_BYTES, produced
    # The deliver queue held at most TW_QUEUE_BYTES and one admitted put of a batch.
    assert 0 < peak <= QUEUE_BYTES + BATCH_BYTES, peak
