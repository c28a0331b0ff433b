"""dequeue-put releases each record at its own time (issue 30): held in a heap, never early by
its own clock, never before its shard's W passed it, one by one rather than a batch at its latest
record's time; a held entry stays unacknowledged, so a crash makes it late, never lost.

The first tests drive dequeue-put alone on a simulated clock, with W published by hand into a
real shard's enqueue.ckpt; the others step the five stages by hand (``test_late_input.Stages``)
with the wheel read ahead (TW_LOOKAHEAD_MS 1000).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from test_dequeue_put_checks import record
from test_late_input import START, Stages
from timerwheel import SimulatedClock, TimerConfig
from timerwheel.config import LOOKAHEAD_RECORDS_PER_S
from timerwheel.records import OutRecord, Record
from timerwheel.stages import base, dequeue_put, enqueue_get, enqueue_put
from timerwheel.stages.base import StageContext
from timerwheel.stages.codec import DELIVER, Q_DONE, Q_FETCH, Q_PUT, DeliverEntry, DeliverItem, DoneEntry
from timerwheel.stages.dequeue_get import GENERATION_BITS, DequeueGet
from timerwheel.stages.dequeue_put import DequeuePut
from timerwheel.stages.enqueue_put import EnqueuePut
from timerwheel.stages.ownership import Ownership
from timerwheel.store import RECORD_SIZE, DequeueCheckpoint, EnqueueCheckpoint, Shard
from timerwheel.store.layout import open_reader_if_exists, open_shard
from timerwheel.transports.local.log import LocalCommitLog
from timerwheel.transports.memory import MemoryWorkQueue

SLOT = START + 1_000


class PutRig:
    """dequeue-put over in-process queues timed by the simulated clock, and shard 0 whose W the
    test publishes (``publish``)."""

    def __init__(self, tmp_path: Path, clock: SimulatedClock) -> None:
        self.clock = clock
        self.config = TimerConfig(data_dir=str(tmp_path), shards=1, fsync=False, lookahead_ms=1_000)
        self.log = LocalCommitLog(tmp_path / "log", fsync=False, clock=clock)
        self.log.ensure_topic("dest", 1)
        self.writer: Shard = open_shard(self.config, 0, writer=True)
        self.deliver_q = MemoryWorkQueue("deliver", 1, 64, clock=clock)
        self.done_q = MemoryWorkQueue("done", 1, 64, clock=clock)
        self.stages: list[DequeuePut] = []
        self.publish(START)

    def stage(self, consumer: str, stop_drain_s: float = 0.0) -> DequeuePut:
        ctx = StageContext(self.config, self.clock, consumer=consumer)
        put = DequeuePut(ctx, self.log, self.deliver_q, self.done_q, [0], lambda s: open_reader_if_exists(self.config, s),
                         stop_drain_s=stop_drain_s)
        self.stages.append(put)
        return put

    def publish(self, write_ms: int) -> None:
        """W = ``write_ms``, as enqueue-put publishes it; dequeue-put's view is told at once."""
        self.writer.save_enqueue_checkpoint(EnqueueCheckpoint(flushed_pos=self.writer.flush(), write_ms=write_ms,
                                                              next_offsets={}, epoch=1))
        for put in self.stages:
            put.ctx.published_w[0] = put.ctx.published_w.get(0, 0) + 1

    def hand_over(self, *records: Record) -> None:
        """One deliver entry of ``records``, read from slot SLOT as dequeue-getmsg passes it on."""
        items = tuple(DeliverItem(DELIVER, SLOT, START - 60_000, r, 0, r.offset) for r in records)
        self.deliver_q.put(0, [DeliverEntry(0, 1, SLOT, 0, items).encode()], 1.0)

    def sent(self) -> dict[str, int]:
        """Message id -> tw-delivered-at of what reached ``dest``."""
        consumer = self.log.consumer("dest", {0: 0})
        try:
            return {(r.header("tw-id") or b"").decode(): int(r.header("tw-delivered-at") or 0)
                    for r in consumer.poll(1000, 0)}
        finally:
            consumer.close()

    def done(self) -> int:
        """Messages reported finished to dequeue-get so far."""
        got = self.done_q.get(0, "get", 100, 0)
        return sum(n for _eid, payload in got for n in DoneEntry.decode(payload).counts.values())

    def close(self) -> None:
        for put in self.stages:
            put.close()
        self.writer.close()
        self.log.close()


@pytest.fixture
def clock() -> SimulatedClock:
    return SimulatedClock(start_ms=START)


@pytest.fixture
def rig(tmp_path: Path, clock: SimulatedClock) -> Iterator[PutRig]:
    r = PutRig(tmp_path, clock)
    yield r
    r.close()


def test_never_early_by_its_own_clock_and_each_record_at_its_own_time(rig: PutRig, clock: SimulatedClock) -> None:
    put = rig.stage("a")
    rig.publish(START + 3_600_000)  # W far ahead (enqueue-put's clock ahead of ours): only our clock gates
    rig.hand_over(record(1, "dest", SLOT + 10), record(2, "dest", SLOT + 50), record(3, "dest", SLOT + 90))
    put.step(0)
    assert rig.sent() == {} and rig.deliver_q.depth(0) == 1  # held, unacknowledged
    seen: dict[str, int] = {}
    while clock.now_ms() < SLOT + 200:
        put.step(0)
        for mid, at in rig.sent().items():
            seen.setdefault(mid, clock.now_ms())
            assert at >= {"m1": SLOT + 10, "m2": SLOT + 50, "m3": SLOT + 90}[mid], f"{mid} early"
        clock.advance(5)
    # each at its own time (not held for the batch's latest), stamped at release
    assert rig.sent() == {"m1": SLOT + 10, "m2": SLOT + 50, "m3": SLOT + 90} == seen
    assert rig.deliver_q.depth(0) == 0 and rig.done() == 3  # acked once all three were out


def test_a_record_at_the_start_of_a_slot_leaves_once_w_passes_it(rig: PutRig, clock: SimulatedClock) -> None:
    put = rig.stage("a")
    rig.hand_over(record(1, "dest", SLOT))
    clock.set(SLOT + 30)
    rig.publish(SLOT)  # W at the record's time: a cancel due then may not be written yet
    put.step(0)
    assert rig.sent() == {} and rig.done() == 0
    clock.set(SLOT + 40)
    rig.publish(SLOT + 1)
    put.step(0)
    assert rig.sent() == {"m1": SLOT + 40}  # at W, not at the slot's end (SLOT + 100)
    assert rig.done() == 1


def test_a_crash_while_records_are_held_loses_none(rig: PutRig, clock: SimulatedClock,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "CLAIM_EVERY_S", 0.0)
    first = rig.stage("a")
    rig.hand_over(record(1, "dest", SLOT + 10), record(2, "dest", SLOT + 20))
    first.step(0)
    assert rig.sent() == {} and rig.deliver_q.pending(0) != {}  # held by "a", unacknowledged
    # "a" dies holding them (never steps again, never said it lives): "b" claims them ...
    second = rig.stage("b")
    second.deliver_q.heartbeat("b", 60_000)
    clock.advance(base.DEAD_IDLE_MS)
    second.step(0)
    assert set(rig.deliver_q.pending(0).values()) == {"b"}
    assert rig.sent() == {}  # ... and holds them for their time in turn
    clock.set(SLOT + 50)
    rig.publish(SLOT + 50)
    second.step(0)
    assert rig.sent() == {"m1": SLOT + 50, "m2": SLOT + 50}  # late, not lost
    assert rig.deliver_q.depth(0) == 0 and rig.done() == 2


@pytest.mark.parametrize("drain_s", [5.0, 0.0])
def test_a_stopping_replica_releases_what_it_holds_at_its_time_before_it_leaves(
        rig: PutRig, clock: SimulatedClock, monkeypatch: pytest.MonkeyPatch, drain_s: float) -> None:
    """SIGTERM (a rolling update): ``close`` takes nothing new and releases the held records as
    their time comes, reports and acks them, so no held entry is left for another replica (whose
    dequeue-get owner may read their slots again meanwhile). Without a drain they stay pending."""
    put = rig.stage("a", stop_drain_s=drain_s)
    rig.publish(SLOT + 1_000)
    rig.hand_over(record(1, "dest", SLOT + 10), record(2, "dest", SLOT + 300))
    put.step(0)
    assert rig.sent() == {} and rig.deliver_q.pending(0) != {}
    monkeypatch.setattr(time, "sleep", lambda s: clock.advance(max(1, int(s * 1000))))  # the drain's waits
    rig.stages.remove(put)
    put.close()
    if drain_s:
        # each at its own time (W passed them; the drain's last waits before it are 1 ms steps)
        assert rig.sent() == {"m1": SLOT + 10, "m2": SLOT + 300}
        assert rig.deliver_q.depth(0) == 0 and rig.done() == 2
    else:
        assert rig.sent() == {} and set(rig.deliver_q.pending(0).values()) == {"a"}


def test_a_live_replica_keeps_the_entries_it_holds(rig: PutRig, clock: SimulatedClock,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """W stands still for longer than CLAIM_IDLE_MS (enqueue-put down): the held entry stays with
    the replica that holds it; another live one does not take it for a stuck consumer's."""
    monkeypatch.setattr(base, "CLAIM_EVERY_S", 0.0)
    monkeypatch.setattr(dequeue_put, "TOUCH_EVERY_S", 0.0)
    monkeypatch.setattr(dequeue_put, "TOUCH_AFTER_S", 0.0)
    holder, other = rig.stage("a"), rig.stage("b")
    rig.hand_over(record(1, "dest", SLOT + 10))
    rig.deliver_q.heartbeat("a", 600_000)  # both alive (a stage process's Heartbeat thread)
    rig.deliver_q.heartbeat("b", 600_000)
    holder.step(0)
    for _ in range(8):
        clock.advance(base.CLAIM_IDLE_MS // 4)
        for put in (other, holder):  # the other looks first: were the entry idle, it would take it
            put.step(0)
    assert set(rig.deliver_q.pending(0).values()) == {"a"}
    rig.publish(clock.now_ms())
    holder.step(0)
    other.step(0)
    assert list(rig.sent()) == ["m1"] and rig.done() == 1


@pytest.mark.parametrize("fails", ["report", "ack"])
def test_a_report_or_ack_that_fails_is_retried_and_the_entry_finished_once(
        rig: PutRig, clock: SimulatedClock, monkeypatch: pytest.MonkeyPatch, fails: str) -> None:
    """Redis gone for a moment after the delivery: the step fails, the next one reports the entry
    done (once) and acknowledges it. Before, the entry stayed held and touched for good, its slot
    never done, R and W (capped by R) stood still until dequeue-get re-sent it (STALL_S)."""
    put = rig.stage("a")
    rig.hand_over(record(1, "dest", SLOT + 10))
    clock.set(SLOT + 20)
    rig.publish(SLOT + 20)
    queue = rig.done_q if fails == "report" else rig.deliver_q
    method = "put" if fails == "report" else "ack"
    real = getattr(queue, method)
    calls = []

    def once(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args)
        if len(calls) == 1:
            raise ConnectionError("Redis gone")
        return real(*args, **kwargs)

    monkeypatch.setattr(queue, method, once)
    with pytest.raises(ConnectionError):
        put.step(0)
    assert rig.sent() == {"m1": SLOT + 20}  # delivered before the failure
    put.step(0)
    assert rig.done() == 1 and rig.deliver_q.depth(0) == 0  # reported once, acknowledged
    assert put.holding(0) == 0
    put.step(0)
    assert rig.done() == 0 and rig.sent() == {"m1": SLOT + 20}  # nothing twice


def test_held_records_of_an_older_dequeue_get_owner_are_dropped_not_delivered(
        rig: PutRig, clock: SimulatedClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dequeue-get restarted (or replaced) reads the slots again from R under a new epoch, and
    sends again what its predecessor's entries carry: those entries, held by dequeue-put for their
    time or claimed from a dead dequeue-put, are dropped rather than delivered beside the new ones
    (a kill -9 of every stage delivered about a second of read-ahead twice)."""
    monkeypatch.setattr(dequeue_put, "OWNER_EPOCH_EVERY_S", 0.0, raising=False)
    put = rig.stage("a")
    old_gen, new_gen = 1 << GENERATION_BITS, 2 << GENERATION_BITS
    rig.writer.save_dequeue_checkpoint(DequeueCheckpoint(read_ms=SLOT, epoch=1))
    items = tuple(DeliverItem(DELIVER, SLOT, START - 60_000, r, 0, r.offset)
                  for r in (record(1, "dest", SLOT + 10), record(2, "dest", SLOT + 20)))
    rig.deliver_q.put(0, [DeliverEntry(0, old_gen, SLOT, 0, items).encode()], 1.0)
    put.step(0)  # held for their time
    rig.writer.save_dequeue_checkpoint(DequeueCheckpoint(read_ms=SLOT, epoch=2))  # a new owner
    rig.deliver_q.put(0, [DeliverEntry(0, new_gen, SLOT, 0, items).encode()], 1.0)  # ... reads them again
    clock.set(SLOT + 50)
    rig.publish(SLOT + 50)
    for _ in range(3):
        put.step(0)
    assert rig.sent() == {"m1": SLOT + 50, "m2": SLOT + 50}
    out = rig.log.consumer("dest", {0: 0})
    assert len(out.poll(1000, 0)) == 2  # once each (before: twice)
    out.close()
    assert put.ctx.metrics.counter("stale_dropped", topic="dest") == 2
    assert rig.deliver_q.depth(0) == 0  # both entries finished and acknowledged


# -- the five stages, read ahead ------------------------------------------------------------

@pytest.fixture
def stages(tmp_path: Path) -> Iterator[Stages]:
    s = Stages(tmp_path, lookahead_ms=1_000)
    yield s
    s.close()


def next_owner(s: Stages, name: str = "next") -> DequeueGet:
    """A new dequeue-get replica (another consumer name) in place of ``s.dget``."""
    cfg = s.config
    s.dget = DequeueGet(s.ctx, [0], lambda shard: open_reader_if_exists(cfg, shard), s.queues[Q_FETCH],
                        s.queues[Q_DONE], Ownership(s.leases, "dequeue-get", name, cfg.lease_ttl_ms))
    return s.dget


def advance(s: Stages, to_ms: int, step_ms: int = 10) -> None:
    while s.clock.now_ms() < to_ms:
        s.clock.advance(min(step_ms, to_ms - s.clock.now_ms()))
        s.run(rounds=2)


def test_a_cancel_after_the_read_ahead_drops_the_held_message(stages: Stages) -> None:
    kept = stages.client.schedule("dest", b"kept", deliver_at_ms=START + 2_010)
    doomed = stages.client.schedule("dest", b"doomed", deliver_at_ms=START + 2_020)
    stages.run()
    advance(stages, START + 1_100)
    assert stages.dput.holding(0) == 1  # slot 2_000 read ahead: both held by dequeue-put
    stages.client.cancel(doomed)  # its marker goes into the slot's tail, past where it was read
    advance(stages, START + 2_200)
    assert stages.delivered() == [kept.message_id]
    assert stages.ctx.metrics.counter("cancelled", topic="dest") == 1
    assert stages.ctx.metrics.counter("cancel_missed") == 0


def test_a_failed_look_for_cancel_markers_holds_the_records_again(stages: Stages,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in a chaos run (a broker restart on a loaded machine): confirming a marker on the
    full id reads its source record from the timer topic; when that read failed, the records the
    release had taken off the heap were gone from it, their entry never finished, and what it
    held kept dequeue-get's in-flight window full: nothing more was delivered."""
    kept = stages.client.schedule("dest", b"kept", deliver_at_ms=START + 2_010)
    doomed = stages.client.schedule("dest", b"doomed", deliver_at_ms=START + 2_020)
    stages.run()
    advance(stages, START + 1_100)
    stages.client.cancel(doomed)  # in the slot's tail: dequeue-put confirms it at release
    advance(stages, START + 2_000)
    read = stages.log.read
    failed: list[int] = []

    def read_failing_once(topic: str, positions: Sequence[tuple[int, int]]) -> list[Record | None]:
        if not failed:
            failed.append(len(positions))
            raise ConnectionError("the broker is restarting")
        return read(topic, positions)

    monkeypatch.setattr(stages.log, "read", read_failing_once)
    with pytest.raises(ConnectionError):  # the step fails; the stage's loop retries it
        advance(stages, START + 2_100)
    advance(stages, START + 2_200)
    assert failed == [1]
    assert stages.delivered() == [kept.message_id]
    assert stages.ctx.metrics.counter("cancelled", topic="dest") == 1
    assert stages.dput.holding(0) == 0  # the entry finished


def test_a_short_delay_into_an_open_slot_is_delivered(stages: Stages) -> None:
    stages.run()
    advance(stages, START + 1_000)
    assert START + 1_500 in stages.dget.owned[0].open  # read ahead while empty
    short = stages.client.schedule("dest", b"short", deliver_at_ms=START + 1_550)
    advance(stages, START + 1_100)
    assert stages.dput.holding(0) == 1  # read from the open slot's tail, held for its time
    advance(stages, START + 1_700)
    assert stages.delivered() == [short.message_id]
    raw = stages.log.consumer("dest", {0: 0}).poll(10, 0)[0].header("tw-delivered-at")
    assert int(raw or 0) >= START + 1_550


def test_a_record_due_mid_slot_leaves_within_a_publish_step_of_its_time(stages: Stages) -> None:
    """While its slot holds records, W is published every PUBLISH_STEP_MS it moves, not only once
    its slot changes: a record due mid-slot no longer waits for the slot's end (issue 30)."""
    due = START + 2_035
    msg = stages.client.schedule("dest", b"mid", deliver_at_ms=due)
    stages.run()
    advance(stages, due + enqueue_put.PUBLISH_STEP_MS, step_ms=5)
    assert stages.delivered() == [msg.message_id]
    raw = stages.log.consumer("dest", {0: 0}).poll(10, 0)[0].header("tw-delivered-at")
    assert due <= int(raw or 0) <= due + enqueue_put.PUBLISH_STEP_MS


def test_r_never_passes_an_open_slot(stages: Stages) -> None:
    m = stages.client.schedule("dest", b"m", deliver_at_ms=START + 1_010)
    stages.run()
    advance(stages, START + 1_050)
    # W moves within the slot with new input (enqueue-put publishes W = now with each batch)
    stages.client.schedule("dest", b"later", deliver_at_ms=START + 60_000)
    deadline = time.monotonic() + 10  # dequeue-put sees the new W within CKPT_POLL_S
    while not stages.delivered() and time.monotonic() < deadline:
        stages.run(rounds=1)
    assert stages.delivered() == [m.message_id]  # finished while its slot is still open
    stages.run()  # dequeue-get counts it done
    dg = stages.dget.owned[0]
    assert not dg.in_flight
    assert START + 1_000 in dg.open
    assert stages.dget.owned[0].shard.load_dequeue_checkpoint().read_ms <= START + 1_000  # type: ignore[union-attr]
    advance(stages, START + 1_200)
    assert START + 1_000 not in dg.open  # final once W passed its end: R moves past it
    assert stages.dget.owned[0].shard.load_dequeue_checkpoint().read_ms > START + 1_000  # type: ignore[union-attr]


@pytest.mark.parametrize("lookahead_ms", [0, 1_000])
def test_two_cancels_whose_id_hashes_collide_both_cancel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         lookahead_ms: int) -> None:
    import timerwheel.stages.enqueue_get as eg
    from timerwheel import wire

    monkeypatch.setattr(eg, "id_hash", lambda message_id: 42)
    monkeypatch.setattr(wire, "id_hash", lambda message_id: 42)
    s = Stages(tmp_path, lookahead_ms=lookahead_ms)
    try:
        a = s.client.schedule("dest", b"a", deliver_at_ms=START + 2_010, message_id="a")
        b = s.client.schedule("dest", b"b", deliver_at_ms=START + 2_020, message_id="b")
        kept = s.client.schedule("dest", b"c", deliver_at_ms=START + 2_030, message_id="c")
        s.client.cancel(a)
        s.client.cancel(b)
        s.run()
        advance(s, START + 2_300, 50)
        assert s.delivered() == [kept.message_id]
        assert s.ctx.metrics.counter("cancelled", topic="dest") == 2
    finally:
        s.close()


# ------------------------------------------------------------------ copies (issue 31, design 2.5)

def _timer_records(s: Stages) -> list[Record]:
    out: list[Record] = []
    for p in range(s.config.timer_partitions):
        out += s.log.consumer(s.config.timer_topic, {p: 0}).poll(10_000, 0)
    return out


def test_a_roll_hop_written_twice_delivers_once(tmp_path: Path) -> None:
    """A hop done again (dequeue-put crashed between its write and its acknowledgement, or a
    dequeue-get re-read its roll slot from R) is a second timer record with the same id and
    delivery time: both land in the slot of that time, and one is delivered."""
    s = Stages(tmp_path, roll_window_ms=3_000)
    try:
        m = s.client.schedule("dest", b"far", deliver_at_ms=START + 5_050)
        s.run()
        hops: list[Record] = []
        while not hops:
            assert s.clock.now_ms() < START + 4_500, "no roll hop written"
            advance(s, s.clock.now_ms() + 100)
            hops = [r for r in _timer_records(s) if r.header("tw-roll")]
        hop = hops[0]
        assert int(hop.header("tw-deliver-at") or 0) == START + 5_050
        s.log.append([OutRecord(s.config.timer_topic, hop.key, hop.value, hop.headers, partition=hop.partition)])
        advance(s, START + 5_400)
        assert s.delivered() == [m.message_id]
        assert s.ctx.metrics.counter("copies_dropped", topic="dest") == 1
    finally:
        s.close()


def test_a_copy_written_into_a_slot_after_its_read_ahead_is_dropped(stages: Stages) -> None:
    first = stages.client.schedule("dest", b"m", deliver_at_ms=START + 2_010, message_id="same")
    stages.run()
    advance(stages, START + 1_100)
    assert stages.dput.holding(0) == 1  # slot 2_000 read ahead, the message held
    stages.client.schedule("dest", b"m", deliver_at_ms=START + 2_010, message_id="same")  # into its tail
    other = stages.client.schedule("dest", b"m", deliver_at_ms=START + 2_020, message_id="same")  # another time
    advance(stages, START + 2_200)
    assert sorted(stages.delivered()) == sorted([first.message_id, other.message_id])
    assert stages.ctx.metrics.counter("copies_dropped", topic="dest") == 1


def test_two_messages_whose_id_hashes_collide_at_one_time_are_both_delivered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import timerwheel.stages.enqueue_get as eg
    from timerwheel import wire

    monkeypatch.setattr(eg, "id_hash", lambda message_id: 42)
    monkeypatch.setattr(wire, "id_hash", lambda message_id: 42)
    s = Stages(tmp_path)
    try:
        a = s.client.schedule("dest", b"a", deliver_at_ms=START + 2_010, message_id="a")
        b = s.client.schedule("dest", b"b", deliver_at_ms=START + 2_010, message_id="b")
        s.run()
        advance(s, START + 2_300, 50)
        assert sorted(s.delivered()) == sorted([a.message_id, b.message_id])
        assert s.ctx.metrics.counter("copies_missed") == 1
        assert s.ctx.metrics.counter("copies_dropped", topic="dest") == 0
    finally:
        s.close()


def test_what_a_dequeue_get_that_left_had_sent_is_not_released_before_its_successor_reads_it(
        stages: Stages, monkeypatch: pytest.MonkeyPatch) -> None:
    """A StatefulSet's rolling update: the dequeue-get pod stops (its drain cut short, messages in
    flight) and its successor starts seconds later. dequeue-put must not release meanwhile what
    the one that left had sent: the successor reads those slots again from R and sends them anew
    (the code before delivered them twice)."""
    monkeypatch.setattr(dequeue_put, "OWNER_EPOCH_EVERY_S", 0.0)
    msg = stages.client.schedule("dest", b"m", deliver_at_ms=START + 2_010)
    stages.run()
    advance(stages, START + 1_100)
    assert stages.dput.holding(0) == 1  # read ahead, held
    left = stages.dget
    epoch = left.owned[0].epoch
    left.close()  # stop_drain_s 0: the drain cut short
    while stages.clock.now_ms() < START + 2_300:  # no dequeue-get for a while
        stages.clock.advance(10)
        for stage in (stages.get, stages.put, stages.getmsg, stages.dput):
            stage.step(0)
    assert stages.delivered() == []  # dropped, not released
    assert stages.ctx.metrics.counter("stale_dropped", topic="dest") == 1
    next_owner(stages)
    advance(stages, START + 2_500)
    assert stages.dget.owned[0].epoch > epoch + 1
    assert stages.delivered() == [msg.message_id]  # once


def _segment(s: Stages) -> Path:
    (segment,) = sorted((Path(s.config.data_dir) / "shard-0000" / "timerlog").glob("*.tlog"))
    return segment


def test_a_cancel_written_after_a_recovery_that_lost_checkpointed_records_still_cancels(
        stages: Stages, monkeypatch: pytest.MonkeyPatch) -> None:
    """The TimerLog's last record, checkpointed as durable, is lost while enqueue-put is down (the
    chaos test tears it). The restarted owner resumes from the records left and Kafka hands the lost
    one over again; what it writes first must not go to a position dequeue-get had read up to
    already: a cancel there was behind the slot's read and dequeue-put's look from its read
    position, so the held message it cancels was delivered (the code before)."""
    monkeypatch.setattr(enqueue_get, "REWIND_CHECK_S", 0.0)  # enqueue-get looks for a checkpoint behind it at each step
    stages.run()
    advance(stages, START + 1_000)
    assert START + 2_000 in stages.dget.owned[0].open  # read ahead while empty
    doomed = stages.client.schedule("dest", b"doomed", deliver_at_ms=START + 2_020, message_id="doomed-0")
    for stage in (stages.get, stages.put):
        stage.step(0)
    lost = stages.client.schedule("dest", b"lost", deliver_at_ms=START + 60_000, message_id="lost-4")
    assert doomed.partition != lost.partition  # the lost record's partition is read again after the cancel's
    for stage in (stages.get, stages.put):
        stage.step(0)
    advance(stages, START + 1_100)  # the open slot's tail read up to past the lost record
    assert stages.dput.holding(0) == 1
    stages.put.close()  # its checkpoint names the lost record as durable
    segment = _segment(stages)
    with open(segment, "r+b") as f:
        f.truncate(segment.stat().st_size - RECORD_SIZE)
    cfg = stages.config
    stages.put = EnqueuePut(stages.ctx, [0], lambda s: open_shard(cfg, s, writer=True), stages.queues[Q_PUT],
                            Ownership(stages.leases, "enqueue-put", "next", cfg.lease_ttl_ms),
                            input_ends=stages.timer_topic_ends)
    stages.client.cancel(doomed)
    advance(stages, START + 2_200)
    assert stages.delivered() == []
    assert stages.ctx.metrics.counter("cancelled", topic="dest") == 1
    stages.put.close()
    again = open_shard(cfg, 0, writer=True)  # the positions left unused are never checked again
    assert again.recovery is not None and (again.recovery.corrupt_count, again.recovery.truncated_bytes) == (0, 0)
    again.close()


def test_a_burst_is_read_ahead_early_enough_to_be_held_before_its_time(stages: Stages) -> None:
    """A slot of many records is read earlier than TW_LOOKAHEAD_MS: as long ahead as they take to
    move at LOOKAHEAD_RECORDS_PER_S (3,000 records: 1.2 s), so that dequeue-put holds them all
    before they are due rather than from a second before on. A lone record is read a second
    ahead, as before. (Read a second ahead, a burst of 20,000 reached dequeue-put after its time.)"""
    n = 3_000
    burst = [stages.client.schedule("dest", b"b", deliver_at_ms=START + 3_000) for _ in range(n)]
    lone = stages.client.schedule("dest", b"lone", deliver_at_ms=START + 9_000)
    stages.run()
    st = stages.dget.owned[0]
    assert stages.config.effective_lookahead_ms == 1_000
    assert n * 1_000 // LOOKAHEAD_RECORDS_PER_S == 1_200
    advance(stages, START + 1_750)  # 1.25 s before the burst: not yet
    assert st.messages_in_flight() == 0
    advance(stages, START + 1_850)  # 1.15 s before it: all read, fetched and held
    assert st.messages_in_flight() == n
    assert stages.dput.holding(0) > 0
    assert stages.delivered() == []
    advance(stages, START + 3_100)
    assert sorted(stages.delivered()) == sorted(t.message_id for t in burst)
    for r in stages.log.consumer("dest", {0: 0}).poll(10_000, 0):
        assert int(r.header("tw-delivered-at") or 0) >= START + 3_000  # never early
    advance(stages, START + 7_900)  # the lone record: read a second ahead, as before
    assert st.messages_in_flight() == 0
    advance(stages, START + 8_100)
    assert st.messages_in_flight() == 1
    advance(stages, START + 9_100)
    assert stages.delivered()[-1] == lone.message_id
