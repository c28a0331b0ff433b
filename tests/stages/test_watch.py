"""dequeue-put's watch (``stages.watch``): a record leaves once its shard's timer partitions are
read up to their ends as asked after its time, while ``W`` still lags; a cancel met there drops
it; R too far behind, or an input checkpoint that went back, hold it until the watch can tell.

dequeue-put alone on a simulated clock (``test_release.PutRig``), the timer topic in the local
log, ``W`` and R published by hand.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_dequeue_put_checks import record
from test_release import SLOT, START, PutRig
from timerwheel import SimulatedClock, TimerConfig
from timerwheel.records import OutRecord, Record
from timerwheel.stages import dequeue_put, watch
from timerwheel.stages.base import StageContext
from timerwheel.stages.codec import DELIVER, DeliverEntry, DeliverItem
from timerwheel.stages.dequeue_put import DequeuePut
from timerwheel.stages.enqueue_put import w_cap_ms
from timerwheel.stages.watch import Watch
from timerwheel.store import DequeueCheckpoint, EnqueueCheckpoint, Flag, TimerRecord
from timerwheel.store.layout import open_reader_if_exists, open_shard
from timerwheel.transports.kafka.log import KafkaCommitLog
from timerwheel.transports.local.log import LocalCommitLog
from timerwheel.transports.memory import MemoryWorkQueue
from timerwheel.wire import id_hash


class WatchRig(PutRig):
    """``PutRig`` with the timer topic (one partition) and R saved."""

    def __init__(self, tmp_path: Path, clock: SimulatedClock) -> None:
        super().__init__(tmp_path, clock)
        self.timer = self.config.timer_topic
        self.log.ensure_topic(self.timer, 1)
        self.set_r(START)

    def set_r(self, read_ms: int) -> None:
        self.writer.save_dequeue_checkpoint(DequeueCheckpoint(read_ms=read_ms, epoch=0))

    def publish_input(self, write_ms: int, next_offset: int, epoch: int = 1) -> None:
        """W = ``write_ms`` with the TimerLog holding the timer partition's input below ``next_offset``."""
        self.writer.save_enqueue_checkpoint(EnqueueCheckpoint(flushed_pos=self.writer.flush(), write_ms=write_ms,
                                                              next_offsets={0: next_offset}, epoch=epoch))
        for put in self.stages:
            put.ctx.published_w[0] = put.ctx.published_w.get(0, 0) + 1

    def timer_records(self, n: int) -> int:
        """``n`` scheduled messages appended to the timer topic (due far ahead); its end."""
        self.log.append([OutRecord(self.timer, b"k", b"v", (("tw-topic", b"dest"), ("tw-delay-ms", b"3600000")),
                                   partition=0)] * n)
        return self.log.end_offsets(self.timer)[0]

    def cancel(self, message_id: str, due: int) -> int:
        """A cancel of ``message_id`` appended to the timer topic; its offset."""
        ((_p, offset),) = self.log.append([OutRecord(self.timer, message_id.encode(), None, (
            ("tw-cancel", message_id.encode()), ("tw-deliver-at", str(due).encode())), partition=0)])
        return offset


@pytest.fixture
def clock() -> SimulatedClock:
    return SimulatedClock(start_ms=START)


@pytest.fixture
def rig(tmp_path: Path, clock: SimulatedClock, monkeypatch: pytest.MonkeyPatch) -> Iterator[WatchRig]:
    monkeypatch.setattr(watch, "OBSERVE_S", 0.0)  # observe at every look: the simulated clock moves, not time
    r = WatchRig(tmp_path, clock)
    yield r
    r.close()


DUE = {"m1": SLOT + 10, "m2": SLOT + 40, "m3": SLOT + 15}


def _step_until(rig: WatchRig, until_ms: int) -> dict[str, int]:
    """Step the stage every 1 ms of the simulated clock up to ``until_ms``; what was sent, never early."""
    (put,) = rig.stages
    while rig.clock.now_ms() <= until_ms:
        put.step(0)
        for mid, at in rig.sent().items():
            assert at > DUE[mid], f"{mid} released at or before its time"
        rig.clock.advance(1)
    return rig.sent()


def test_a_record_leaves_just_after_its_time_while_w_lags(rig: WatchRig, clock: SimulatedClock) -> None:
    put = rig.stage("a")
    end = rig.timer_records(3)
    rig.publish_input(START, end - 1)  # W far behind; the TimerLog lacks the input's last record
    rig.hand_over(record(1, "dest", SLOT + 10), record(2, "dest", SLOT + 40))
    put.step(0)
    assert _step_until(rig, SLOT + 9) == {}
    # Each at the first look after its time (an observation at t0 > t), not when W passes it.
    assert _step_until(rig, SLOT + 60) == {"m1": SLOT + 11, "m2": SLOT + 41}
    assert rig.done() == 2 and rig.deliver_q.depth(0) == 0
    assert put.ctx.metrics.counter("released_by_watch", shard=0) == 2


def test_a_record_waiting_for_the_watch_is_looked_at_again_as_soon_as_the_watch_may_grant_it(
        rig: WatchRig, clock: SimulatedClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record due just after an observation waits for the next one (``OBSERVE_S`` after it), not
    for a fixed poll of the checkpoint (``CKPT_POLL_S``): the step's wait for new entries ends then."""
    monkeypatch.setattr(watch, "OBSERVE_S", 0.004)  # below CKPT_POLL_S (10 ms)
    mono = [100.0]
    monkeypatch.setattr(watch, "time", SimpleNamespace(monotonic=lambda: mono[0]))  # the watch's own pace
    put = rig.stage("a")
    end = rig.timer_records(3)
    rig.publish_input(START, end - 1)  # W far behind
    rig.hand_over(record(1, "dest", SLOT + 10), record(2, "dest", SLOT + 12))
    put.step(0)
    clock.set(SLOT + 11)
    put.step(0)  # m1 leaves by an observation at SLOT + 11
    clock.set(SLOT + 13)
    mono[0] += 0.001
    put.step(0)  # m2 is due; the last observation is too recent to ask another
    assert rig.sent() == {"m1": SLOT + 11}
    assert put._wait_s() == pytest.approx(0.003)
    mono[0] += 0.003
    assert put._wait_s() == 0
    put.step(0)
    assert rig.sent() == {"m1": SLOT + 11, "m2": SLOT + 13}


def _m1_left_by_the_watch(rig: WatchRig, clock: SimulatedClock,
                          monkeypatch: pytest.MonkeyPatch) -> tuple[DequeuePut, list[float]]:
    """The stage with m1 released by the watch at SLOT + 11 (its consumer reads from there on) and
    m2 held for SLOT + 50; the watch's monotonic clock, moved by hand."""
    mono = [100.0]
    monkeypatch.setattr(watch, "time", SimpleNamespace(monotonic=lambda: mono[0]))
    put = rig.stage("a")
    rig.publish_input(START, rig.timer_records(1))
    rig.hand_over(record(1, "dest", SLOT + 10), record(2, "dest", SLOT + 50))
    clock.set(SLOT + 11)
    put.step(0)
    assert rig.sent() == {"m1": SLOT + 11}
    return put, mono


def test_the_watch_reads_on_shortly_before_a_record_is_due(rig: WatchRig, clock: SimulatedClock,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """READ_ON_MS before the first held record's time the watch reads what arrived (a cancel here),
    so that the look at its time has only the last moments to read; not earlier, and only for a
    consumer idle that long."""
    put, mono = _m1_left_by_the_watch(rig, clock, monkeypatch)
    rig.cancel("m9", SLOT + 60)
    mono[0] += 1.0
    clock.set(SLOT + 50 - dequeue_put.READ_ON_MS - 1)
    put.step(0)
    assert not put._watch.cancelled(0, "m9")  # not yet
    clock.set(SLOT + 50 - dequeue_put.READ_ON_MS)
    put.step(0)
    assert put._watch.cancelled(0, "m9")  # read on, before m2's time
    assert rig.sent() == {"m1": SLOT + 11}


def test_the_read_on_reads_from_the_newest_checkpointed_input_not_from_where_the_watch_left_off(
        rig: WatchRig, clock: SimulatedClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer idle since long ago (a burst written ahead, taken into the TimerLog since) moves up
    to the newest checkpoint's input offsets before it reads on: what is below them (a cancel here)
    is in the TimerLog, and reading it again took 29 ms past a burst's time in the peers' row."""
    put, mono = _m1_left_by_the_watch(rig, clock, monkeypatch)
    rig.cancel("m8", SLOT + 60)
    rig.publish_input(START, rig.timer_records(5))  # taken into the TimerLog while the watch was idle
    rig.cancel("m9", SLOT + 60)
    mono[0] += 1.0
    clock.set(SLOT + 50 - dequeue_put.READ_ON_MS)
    put.step(0)
    assert put._watch.cancelled(0, "m9"), "the read-on did not read what arrived above the checkpoint"
    assert not put._watch.cancelled(0, "m8"), "the read-on read again what the TimerLog holds"
    assert rig.sent() == {"m1": SLOT + 11}


@pytest.mark.parametrize("lead", [0, 50])
def test_the_loose_mode_takes_the_look_before_the_records_time_and_they_leave_at_it(
        rig: WatchRig, clock: SimulatedClock, lead: int) -> None:
    """``TW_CANCEL_LEAD_MS`` = N: an observation taken up to N ms before a record's time grants it
    (``Watch.look_ahead``, READ_ON_MS before the time), so it leaves at its time, without a look at
    the timer topic at it; a cancel acknowledged after that look may miss, the trade the setting
    documents. Strict (0): each leaves at the first look after its time, and the cancel wins."""
    rig.config = dataclasses.replace(rig.config, cancel_lead_ms=lead)
    put = rig.stage("a")
    end = rig.timer_records(3)
    rig.publish_input(START, end - 1)  # W far behind: only the watch releases them
    rig.hand_over(record(1, "dest", SLOT + 10), record(2, "dest", SLOT + 60), record(3, "dest", SLOT + 62))
    sent: dict[str, int] = {}
    while clock.now_ms() <= SLOT + 70:
        if clock.now_ms() == SLOT + 45:
            rig.cancel("m3", SLOT + 62)  # after the look READ_ON_MS before m2's time, before m3's
        put.step(0)
        sent = rig.sent()
        assert all(at >= due for mid, at in sent.items() for due in [{"m1": 10, "m2": 60, "m3": 62}[mid] + SLOT])
        clock.advance(1)
    if lead:
        assert sent == {"m1": SLOT + 10, "m2": SLOT + 60, "m3": SLOT + 62}
    else:
        assert sent == {"m1": SLOT + 11, "m2": SLOT + 61}
    assert rig.done() == 3


def test_a_cancel_above_the_checkpointed_input_drops_the_held_record(rig: WatchRig, clock: SimulatedClock) -> None:
    put = rig.stage("a")
    end = rig.timer_records(2)
    rig.publish_input(START, end)
    rig.hand_over(record(1, "dest", SLOT + 10), record(2, "dest", SLOT + 40))
    put.step(0)
    clock.set(SLOT + 5)
    rig.cancel("m1", SLOT + 10)  # acknowledged before m1's time; enqueue-put has not written it yet
    assert _step_until(rig, SLOT + 60) == {"m2": SLOT + 41}
    assert rig.done() == 2  # m1 finished as cancelled


def test_the_watch_grants_no_more_than_r_plus_the_cap(rig: WatchRig, clock: SimulatedClock) -> None:
    """A roll hop due at ``t`` is in Kafka only once R passed its roll slot: with ``t`` at R + the
    cap, the record waits for R (or W), as enqueue-put's W would."""
    put = rig.stage("a")
    rig.publish_input(START, rig.timer_records(1))
    rig.set_r(SLOT + 10 - w_cap_ms(rig.config, rig.writer))
    rig.hand_over(record(1, "dest", SLOT + 10))
    put.step(0)
    assert _step_until(rig, SLOT + 30) == {}
    rig.set_r(SLOT + 11 - w_cap_ms(rig.config, rig.writer))
    assert _step_until(rig, SLOT + 31) == {"m1": SLOT + 31}


def test_an_input_checkpoint_that_went_back_is_read_again_from_there(rig: WatchRig, clock: SimulatedClock) -> None:
    """A recovery that lost records re-reads them from Kafka: the checkpoint's input offsets go
    back; what the watch granted before no longer holds, and a cancel among the re-read records
    still wins over a record handed over late."""
    put = rig.stage("a")
    rig.timer_records(2)
    cancel_at = rig.cancel("m1", SLOT + 10)
    end = rig.timer_records(2)
    rig.publish_input(START, end)  # the watch starts past the cancel: the TimerLog holds it ...
    rig.hand_over(record(3, "dest", SLOT + 15))
    put.step(0)
    assert _step_until(rig, SLOT + 16) == {"m3": SLOT + 16}  # granted up to SLOT + 16
    rig.publish_input(START, cancel_at)  # ... until a recovery loses it
    rig.hand_over(record(1, "dest", SLOT + 10))  # read late (dequeue-get re-read its slot)
    assert _step_until(rig, SLOT + 30) == {"m3": SLOT + 16}
    assert rig.done() == 2  # m1 cancelled by the cancel the watch read again


def test_on_kafka_a_record_leaves_by_the_watch_and_a_cancel_it_read_wins(
        tmp_path: Path, clock: SimulatedClock, kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same over the session's Kafka: the watch's consumer (read_committed, its own fetches)
    and the high watermarks it asks. W stays behind; m1 leaves after its time, m2's cancel, above
    the checkpoint's input offsets, drops it."""
    monkeypatch.setattr(watch, "OBSERVE_S", 0.0)
    uid = uuid.uuid4().hex[:8]
    cfg = TimerConfig(data_dir=str(tmp_path / "data"), shards=1, fsync=False, lookahead_ms=1_000,
                      timer_topic=f"tw-watch-{uid}", dlq_topic=f"tw-watch-{uid}-dlq")
    dest = f"tw-watch-dest-{uid}"
    log = KafkaCommitLog(kafka_bootstrap)
    log.ensure_topic(cfg.timer_topic, 1)
    log.ensure_topic(dest, 1)
    writer = open_shard(cfg, 0, writer=True)
    deliver_q = MemoryWorkQueue("deliver", 1, 64, clock=clock)
    done_q = MemoryWorkQueue("done", 1, 64, clock=clock)
    put = DequeuePut(StageContext(cfg, clock, consumer="a"), log, deliver_q, done_q, [0],
                     lambda s: open_reader_if_exists(cfg, s))
    try:
        timer = [OutRecord(cfg.timer_topic, b"k", b"v", (("tw-topic", dest.encode()), ("tw-delay-ms", b"3600000")),
                           partition=0)] * 3
        end = log.append(timer)[-1][1] + 1
        writer.save_dequeue_checkpoint(DequeueCheckpoint(read_ms=START, epoch=0))
        writer.save_enqueue_checkpoint(EnqueueCheckpoint(flushed_pos=writer.flush(), write_ms=START,
                                                         next_offsets={0: end}, epoch=1))
        items = tuple(DeliverItem(DELIVER, SLOT, START - 60_000, record(i, dest, SLOT + 10), 0, i) for i in (1, 2))
        deliver_q.put(0, [DeliverEntry(0, 1, SLOT, 0, items).encode()], 1.0)
        put.step(0)
        log.append([OutRecord(cfg.timer_topic, b"m2", None, (("tw-cancel", b"m2"),
                                                              ("tw-deliver-at", str(SLOT + 10).encode())), partition=0)])
        clock.set(SLOT + 11)
        deadline = time.monotonic() + 20
        while done_q.depth(0) == 0:
            assert time.monotonic() < deadline, "nothing released within 20 s while the watch could tell"
            put.step(0)
            time.sleep(0.005)
        consumer = log.consumer(dest, {0: 0})
        got: list[Record] = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got += consumer.poll(10, 0.5)
        got += consumer.poll(10, 0.5)
        consumer.close()
        assert [(r.header("tw-id"), r.header("tw-delivered-at")) for r in got] == [(b"m1", str(SLOT + 11).encode())]
        assert put.ctx.metrics.counter("released_by_watch", shard=0) == 2  # m2 released, then dropped
        assert put.ctx.metrics.counter("cancelled", topic=dest) == 1
    finally:
        put.close()
        writer.close()
        log.close()


def test_a_cancel_cut_from_the_timerlog_after_its_checkpoint_still_wins(rig: WatchRig, clock: SimulatedClock) -> None:
    """A torn or lost TimerLog tail takes a checkpointed cancel marker with it (e2e chaos: a cut after
    a kill of enqueue-put). Until enqueue-put's recovery publishes offsets that go back before it,
    the published checkpoint says the TimerLog holds the cancel, and neither the slot's tail nor the
    watch (which reads from those offsets) would find it: the record waits, then the watch, read
    again from the recovery's offsets, cancels it."""
    put = rig.stage("a")
    rig.timer_records(2)  # m0 and m1 (the record handed over below is m1)
    cancel_at = rig.cancel("m1", SLOT + 10)
    rig.writer.append([TimerRecord(int(Flag.DELETE), START, SLOT + 10, 0, cancel_at, 10, 0, id_hash("m1"))])
    end = rig.timer_records(1)
    rig.publish_input(START, end)
    rig.hand_over(record(1, "dest", SLOT + 10), record(2, "dest", SLOT + 40))
    put.step(0)
    segment = max((Path(rig.config.data_dir) / "shard-0000" / "timerlog").glob("*.tlog"))
    with open(segment, "r+b") as f:  # the marker, the TimerLog's last record, torn in half
        f.truncate(segment.stat().st_size - 32)
    assert _step_until(rig, SLOT + 30) == {}
    # enqueue-put's recovery: the torn record cut, the positions up to the old end skipped, the
    # input offsets back to after the newest record still held.
    rig.writer.close()
    rig.writer = open_shard(rig.config, 0, writer=True)
    rig.writer.skip_to(rig.writer.flush() + 64)
    rig.publish_input(START, cancel_at, epoch=2)
    assert _step_until(rig, SLOT + 60) == {"m2": SLOT + 41}
    assert rig.done() == 2  # m1 finished as cancelled


class CountingLog(LocalCommitLog):
    """The local log, counting the high-watermark requests made of it."""

    asked = 0

    def high_watermarks(self, topic: str) -> dict[int, int]:
        self.asked += 1
        return super().high_watermarks(topic)


def test_one_request_for_the_ends_serves_every_shard_whose_records_wait(tmp_path: Path, clock: SimulatedClock) -> None:
    """Records of two shards due at once: the first shard's look asks the ends of every timer
    partition for both (each shard's R read before), the second's reaches them without asking."""
    cfg = TimerConfig(data_dir=str(tmp_path / "data"), shards=2, fsync=False, lookahead_ms=1_000)
    log = CountingLog(tmp_path / "log", fsync=False, clock=clock)
    log.ensure_topic(cfg.timer_topic, 2)
    writers = [open_shard(cfg, s, writer=True) for s in (0, 1)]
    seen = Watch(StageContext(cfg, clock, consumer="a"), log)
    try:
        ckpts = []
        for s, writer in enumerate(writers):
            log.append([OutRecord(cfg.timer_topic, b"k", b"v", (("tw-topic", b"dest"), ("tw-delay-ms", b"3600000")),
                                  partition=s)] * 3)
            writer.save_dequeue_checkpoint(DequeueCheckpoint(read_ms=START, epoch=0))
            ckpts.append(EnqueueCheckpoint(flushed_pos=writer.flush(), write_ms=START, next_offsets={s: 1}, epoch=1))
        for s in (0, 1):  # each shard's first look makes its consumer
            seen.want({s})
            assert seen.granted(s, writers[s], ckpts[s], SLOT) == clock.now_ms()
        asked = log.asked
        clock.set(SLOT + 11)
        time.sleep(watch.OBSERVE_S)
        seen.want({0, 1})
        assert seen.granted(0, writers[0], ckpts[0], SLOT + 10) == SLOT + 11
        assert seen.granted(1, writers[1], ckpts[1], SLOT + 10) == SLOT + 11
        assert log.asked == asked + 1
        seen.want({1})  # shard 1 alone next: its own request
        clock.set(SLOT + 20)
        time.sleep(watch.OBSERVE_S)
        assert seen.granted(1, writers[1], ckpts[1], SLOT + 19) == SLOT + 20
        assert log.asked == asked + 2
    finally:
        seen.close()
        for writer in writers:
            writer.close()
        log.close()
