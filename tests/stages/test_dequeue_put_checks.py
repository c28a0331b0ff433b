"""dequeue-put checks each record once more, at delivery, against its own clock and settings.

W comes from enqueue-put's clock; a dequeue-put whose clock is behind must still never deliver
early. And the allow-list is re-checked: tightened since a message was scheduled, or a forged
work-queue entry, a denied destination is dead-lettered, never delivered.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from timerwheel import SimulatedClock, TimerConfig
from timerwheel.records import Record
from timerwheel.stages import dequeue_put
from timerwheel.stages.base import StageContext
from timerwheel.stages.codec import DELIVER, DeliverEntry, DeliverItem
from timerwheel.stages.dequeue_put import DequeuePut
from timerwheel.store import EnqueueCheckpoint
from timerwheel.store.layout import open_reader_if_exists, open_shard
from timerwheel.transports.local.log import LocalCommitLog
from timerwheel.transports.memory import MemoryWorkQueue

START = 1_700_000_000_000


def record(offset: int, dest: str, due: int) -> Record:
    return Record("__timer", 0, offset, START - 60_000, b"k", b"v",
                  (("tw-topic", dest.encode()), ("tw-deliver-at", str(due).encode()), ("tw-id", f"m{offset}".encode())))


def shard_with_w(config: TimerConfig, write_ms: int) -> None:
    """Shard 0 with an empty TimerLog and W = ``write_ms`` published (dequeue-put's release gate)."""
    with open_shard(config, 0, writer=True) as shard:
        shard.save_enqueue_checkpoint(EnqueueCheckpoint(flushed_pos=shard.flush(), write_ms=write_ms,
                                                        next_offsets={}, epoch=1))


class Rig:
    def __init__(self, tmp_path: Path, clock: SimulatedClock, **settings: object) -> None:
        self.config = TimerConfig(data_dir=str(tmp_path), shards=1, fsync=False, **settings)  # type: ignore[arg-type]
        self.ctx = StageContext(self.config, clock)
        self.log = LocalCommitLog(tmp_path / "log", fsync=False, clock=clock)
        self.deliver_q = MemoryWorkQueue("deliver", 1, 64)
        self.done_q = MemoryWorkQueue("done", 1, 64)
        shard_with_w(self.config, START + 3_600_000)  # W is no gate here: these tests are about the clock
        self.stage = DequeuePut(self.ctx, self.log, self.deliver_q, self.done_q, [0],
                                lambda s: open_reader_if_exists(self.config, s))

    def deliver(self, *records: Record) -> None:
        items = tuple(DeliverItem(DELIVER, START, START - 60_000, r, 0, r.offset) for r in records)
        self.deliver_q.put(0, [DeliverEntry(0, 1, START, 0, items).encode()], 1.0)
        self.stage.step(0)

    def read(self, topic: str) -> list[Record]:
        consumer = self.log.consumer(topic, {0: 0})
        try:
            return consumer.poll(1000, 0)
        finally:
            consumer.close()


@pytest.fixture
def clock() -> SimulatedClock:
    return SimulatedClock(start_ms=START)


@pytest.fixture
def rig(tmp_path: Path, clock: SimulatedClock) -> Iterator[Rig]:
    r = Rig(tmp_path, clock, allow_topics=("dest-.*",), lookahead_ms=0)
    yield r
    r.log.close()


def test_a_record_not_due_by_this_clock_waits_for_it(rig: Rig, clock: SimulatedClock) -> None:
    due = START + 300  # enqueue-put's clock ran ahead: the slot was read 300 ms early for us
    threading.Timer(0.2, lambda: clock.advance(300)).start()
    rig.deliver(record(1, "dest-a", due))
    assert rig.read("dest-a") == []  # held, not sent early
    deadline = time.monotonic() + 10
    while not rig.read("dest-a") and time.monotonic() < deadline:
        rig.stage.step(0.01)
    [got] = rig.read("dest-a")
    assert int(got.header("tw-delivered-at") or 0) >= due
    assert rig.ctx.metrics.counter("early_records") == 1


def test_a_record_far_ahead_of_this_clock_goes_back_with_its_own_time(
        rig: Rig, clock: SimulatedClock, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dequeue_put, "EARLY_WAIT_MAX_S", 0.1)
    due = START + 60_000  # a minute ahead of this clock: not waited for
    began = time.monotonic()
    rig.deliver(record(1, "dest-a", due), record(2, "dest-a", START - 5))
    assert time.monotonic() - began < 5
    delivered = rig.read("dest-a")
    assert [r.header("tw-id") for r in delivered] == [b"m2"]
    assert int(delivered[0].header("tw-delivered-at") or 0) >= START - 5
    [back] = rig.read(rig.config.timer_topic)
    assert back.header("tw-id") == b"m1" and back.header("tw-deliver-at") == str(due).encode()
    assert back.header("tw-roll") == b"1" and back.header("tw-topic") == b"dest-a"


def test_the_allow_list_is_checked_again_at_delivery(rig: Rig) -> None:
    rig.deliver(record(1, "dest-a", START - 10), record(2, "secret", START - 10), record(3, "__consumer_offsets", START))
    assert [r.header("tw-id") for r in rig.read("dest-a")] == [b"m1"]
    dead = rig.read(rig.config.dlq_topic)
    assert {r.header("tw-id"): r.header("tw-error") for r in dead} == {
        b"m2": b"destination 'secret' not allowed by allow_topics (checked at delivery)",
        b"m3": b"destination '__consumer_offsets' not allowed by allow_topics (checked at delivery)",
    }
    assert rig.read("secret") == []
    assert rig.done_q.depth(0) == 1  # the slot's three messages are done: R moves on
