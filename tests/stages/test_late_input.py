"""W waits for the shard's input: a cancel the timer topic took before its target was due
cancels it, however late enqueue-get reads it (issue 16: a chaos run leaked 33 of 1,360
cancels, each reaching the wheel after its target's slot had been read).

The five stages are stepped by hand on a simulated clock, so enqueue-get can be held back
while the clock and the other four stages go on, as when its pod is down or rebalancing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from timerwheel import SimulatedClock, TimerConfig
from timerwheel.client import TimerClient
from timerwheel.records import OutRecord
from timerwheel.runtime.wiring import local_transports
from timerwheel.stages import DequeueGet, DequeueGetMsg, DequeuePut, EnqueueGet, EnqueuePut, StageContext
from timerwheel.stages.codec import Q_DELIVER, Q_DONE, Q_FETCH, Q_PUT
from timerwheel.stages.ownership import Ownership
from timerwheel.store.layout import open_reader_if_exists, open_shard

START = 1_700_000_000_000
TICK_MS = 100


class Stages:
    """The five stages over one in-process installation; ``ends`` may be replaced (a failing Kafka)."""

    def __init__(self, root: Path, watermark: bool = True, roll_window_ms: int = 2 * 86_400_000,
                 lead_ms: int = 0) -> None:
        self.config = cfg = TimerConfig(data_dir=str(root), tick_ms=TICK_MS, shards=1, timer_partitions=2,
                                        roll_window_ms=roll_window_ms, wheel_span_ms=4 * roll_window_ms, fsync=False,
                                        cancel_lead_ms=lead_ms)
        self.clock = SimulatedClock(START)
        t = local_transports(cfg, self.clock)
        self.log, q = t.commit_log, t.queues
        self.log.ensure_topic(cfg.timer_topic, cfg.timer_partitions)
        self.log.ensure_topic(cfg.dlq_topic, 1)
        self.log.ensure_topic("dest", 1)
        self.ctx = ctx = StageContext(cfg, self.clock, consumer="me")
        self.ends_fail = False
        #: Added to the timer topic's real ends: records the topic acknowledged that nobody can read yet.
        self.ends_ahead = 0
        self.put = EnqueuePut(ctx, [0], lambda s: open_shard(cfg, s, writer=True), q[Q_PUT],
                              Ownership(t.leases, "enqueue-put", "me", cfg.lease_ttl_ms),
                              input_ends=self.timer_topic_ends if watermark else None)
        reader = open_shard(cfg, 0, writer=False)

        def offsets(_shard: int) -> dict[int, int]:
            ckpt = reader.load_enqueue_checkpoint()
            return dict(ckpt.next_offsets) if ckpt else {}

        self.get = EnqueueGet(ctx, self.log, q[Q_PUT], range(cfg.timer_partitions), offsets)
        self.dget = DequeueGet(ctx, [0], lambda s: open_reader_if_exists(cfg, s), q[Q_FETCH], q[Q_DONE],
                               Ownership(t.leases, "dequeue-get", "me", cfg.lease_ttl_ms))
        self.getmsg = DequeueGetMsg(ctx, self.log, q[Q_FETCH], q[Q_DELIVER], [0])
        self.dput = DequeuePut(ctx, self.log, q[Q_DELIVER], q[Q_DONE], [0])
        self.client = TimerClient(self.log, cfg, self.clock)

    def timer_topic_ends(self) -> dict[int, int]:
        if self.ends_fail:
            raise ConnectionError("broker unreachable")
        return {p: e + self.ends_ahead for p, e in self.log.end_offsets(self.config.timer_topic).items()}

    def run(self, enqueue_get: bool = True, rounds: int = 6) -> None:
        """Step the stages in pipeline order; enqueue-get only if ``enqueue_get``."""
        for _ in range(rounds):
            if enqueue_get:
                self.get.step(0)
            for stage in (self.put, self.dget, self.getmsg, self.dput):
                stage.step(0)

    def delivered(self) -> list[str]:
        ids = []
        for r in self.log.consumer("dest", {0: 0}).poll(10_000, 0):
            raw = r.header("tw-id")
            assert raw is not None
            ids.append(raw.decode())
        return ids

    def close(self) -> None:
        for stage in (self.get, self.put, self.dget, self.getmsg, self.dput):
            stage.close()
        self.log.close()


@pytest.fixture
def stages(tmp_path: Path) -> Iterator[Stages]:
    s = Stages(tmp_path)
    yield s
    s.close()


def test_a_cancel_read_late_still_cancels(stages: Stages) -> None:
    kept = stages.client.schedule("dest", b"kept", deliver_at_ms=START + 1_000)
    doomed = stages.client.schedule("dest", b"doomed", deliver_at_ms=START + 1_000)
    stages.run()
    assert stages.put.owned[0].write_ms == START
    stages.clock.advance(500)
    stages.run()
    st = stages.put.owned[0]
    assert st.write_ms == START + 500
    stages.client.cancel(doomed)  # before it is due, by the service's clock ...
    stages.clock.advance(2_500)
    stages.run(enqueue_get=False)  # ... but enqueue-get does not read it until long after
    assert st.write_ms == START + 500  # W waits for the input, not for the clock
    assert stages.delivered() == []
    assert stages.ctx.metrics.gauge("input_wait_ms", shard=0) == 2_500
    stages.run()
    assert stages.delivered() == [kept.message_id]  # late, and only the one not cancelled
    assert st.write_ms == START + 3_000
    assert stages.ctx.metrics.counter("cancelled", topic="dest") == 1
    assert stages.ctx.metrics.gauge("input_wait_ms", shard=0) == 0


def test_without_the_watermark_the_late_cancel_misses(tmp_path: Path) -> None:
    """The same steps with W following the clock alone (as before): the cancel is too late.
    This is what the test above guards against."""
    s = Stages(tmp_path, watermark=False)
    try:
        doomed = s.client.schedule("dest", b"doomed", deliver_at_ms=START + 1_000)
        s.run()
        s.clock.advance(500)
        s.client.cancel(doomed)
        s.clock.advance(2_500)
        s.run(enqueue_get=False)
        s.run()
        assert s.delivered() == [doomed.message_id]
    finally:
        s.close()


def test_w_follows_the_clock_when_the_input_is_caught_up(stages: Stages) -> None:
    stages.run()
    for step in range(1, 6):
        stages.clock.advance(TICK_MS)
        stages.run(rounds=1)
        assert stages.put.owned[0].write_ms == START + step * TICK_MS


def test_w_waits_while_the_end_offsets_cannot_be_read(stages: Stages) -> None:
    stages.client.schedule("dest", b"x", deliver_at_ms=START + 200)
    stages.run()
    stages.ends_fail = True
    stages.clock.advance(1_000)
    stages.run()
    assert stages.put.owned[0].write_ms == START  # no proof the input is complete: no delivery
    assert stages.delivered() == []
    assert stages.ctx.metrics.counter("input_end_failures") >= 1
    stages.ends_fail = False
    stages.run()
    assert stages.put.owned[0].write_ms == START + 1_000
    assert len(stages.delivered()) == 1


def test_rolling_is_relative_to_the_clock_not_to_a_w_held_back(tmp_path: Path) -> None:
    """W held back for its input must not make messages due soon roll: their hops would be read
    only once W caught up, after they were due, and could no longer meet their cancels. (Rolling
    is relative to now as long as R leaves room: span - window - tick past R, here 5.9 s.)"""
    s = Stages(tmp_path, roll_window_ms=2_000)
    try:
        s.run()
        s.ends_ahead = 1  # a record acknowledged, not yet readable: W waits at START
        s.clock.advance(3_000)
        m = s.client.schedule("dest", b"soon", deliver_at_ms=START + 4_500)  # 4.5 s past W, 1.5 s from now
        s.run()
        assert s.put.owned[0].write_ms == START
        assert s.ctx.metrics.counter("timerlog_records", shard=0) == 1
        slot = s.put.owned[0].shard.slot_time(START + 4_500)
        assert s.put.owned[0].shard.next_nonempty(START, START + 10_000) == slot  # its own slot, not a roll slot
        s.ends_ahead = 0  # the record comes: one more on each partition (invalid: dead-lettered)
        s.log.append([OutRecord(s.config.timer_topic, None, b"x", (), partition=p) for p in (0, 1)])
        s.clock.set(START + 4_600)
        s.run()
        assert s.delivered() == [m.message_id]
        assert s.ctx.metrics.counter("rolled", topic="dest") == 0
    finally:
        s.close()


def test_a_failed_request_never_pairs_a_new_time_with_old_ends(stages: Stages) -> None:
    """Found by the chaos run's broker restart: a failed request re-stamped the last ends with
    the time of the failure, and W ran on with the clock over records appended since."""
    doomed = stages.client.schedule("dest", b"doomed", deliver_at_ms=START + 1_000)
    stages.run()
    stages.clock.advance(500)
    stages.run()  # observed: the topic's ends at START + 500
    assert stages.put.owned[0].write_ms == START + 500
    stages.client.cancel(doomed)  # appended, never read: enqueue-get is held back below
    stages.ends_fail = True
    for _ in range(3):
        stages.clock.advance(1_000)
        stages.run(enqueue_get=False)
    assert stages.put.owned[0].write_ms == START + 500
    stages.ends_fail = False
    stages.run(enqueue_get=False)
    assert stages.put.owned[0].write_ms == START + 500  # the cancel is now seen as not yet written
    stages.run()
    assert stages.delivered() == []
    assert stages.ctx.metrics.counter("cancelled", topic="dest") == 1


# -- TW_CANCEL_LEAD_MS: W may run that far past the complete input -------------------------------


def test_with_a_lead_w_runs_at_most_the_lead_past_the_input(tmp_path: Path) -> None:
    s = Stages(tmp_path, lead_ms=300)
    try:
        s.run()
        s.client.schedule("dest", b"unread", deliver_at_ms=START + 60_000)  # in the topic, not yet read
        s.clock.advance(2_000)
        s.run(enqueue_get=False)
        st = s.put.owned[0]
        assert st.input_ms == START and st.write_ms == START + 300  # not the clock's START + 2000
        s.run()
        assert st.write_ms == START + 2_000
    finally:
        s.close()


def test_a_cancel_acknowledged_the_lead_before_due_still_cancels(tmp_path: Path) -> None:
    s = Stages(tmp_path, lead_ms=300)
    try:
        doomed = s.client.schedule("dest", b"doomed", deliver_at_ms=START + 1_000)
        s.run()
        s.clock.advance(700)
        s.run()
        s.client.cancel(doomed)  # exactly the lead before it is due, then read late
        s.clock.advance(2_000)
        s.run(enqueue_get=False)
        assert s.put.owned[0].write_ms == START + 1_000  # input complete to START + 700, + 300
        s.run()
        assert s.delivered() == []
        assert s.ctx.metrics.counter("cancelled", topic="dest") == 1
    finally:
        s.close()


def test_a_cancel_later_than_the_lead_and_read_late_may_miss(tmp_path: Path) -> None:
    """What the lead gives up: a cancel acknowledged 100 ms before due (under the 300 ms lead),
    read late, reaches the wheel after its target's slot was read."""
    s = Stages(tmp_path, lead_ms=300)
    try:
        doomed = s.client.schedule("dest", b"doomed", deliver_at_ms=START + 1_000)
        s.run()
        s.clock.advance(900)
        s.run()
        s.client.cancel(doomed)
        s.clock.advance(2_000)
        s.run(enqueue_get=False)
        s.run()
        assert s.delivered() == [doomed.message_id]
    finally:
        s.close()


def test_a_restarted_owner_counts_its_input_complete_only_to_w_less_the_lead(tmp_path: Path) -> None:
    """W was checkpointed up to the lead past the complete input; the next owner must not take
    that W for complete input, or it would run on another lead (2 x 300 ms past it)."""
    s = Stages(tmp_path, lead_ms=300)
    try:
        s.run()
        s.client.schedule("dest", b"unread", deliver_at_ms=START + 60_000)  # in the topic, not yet read
        s.clock.advance(2_000)
        s.run(enqueue_get=False)
        assert s.put.owned[0].write_ms == START + 300
        s.put.close()
        s.put = EnqueuePut(s.ctx, [0], lambda i: open_shard(s.config, i, writer=True), s.put.queue,
                           Ownership(local_transports(s.config, s.clock).leases, "enqueue-put", "next", s.config.lease_ttl_ms),
                           input_ends=s.timer_topic_ends)
        s.put.step(0)
        st = s.put.owned[0]
        assert st.input_ms == START
        assert st.write_ms == START + 300
    finally:
        s.close()
