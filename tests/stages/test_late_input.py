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
from timerwheel.stages.watch import Watch
from timerwheel.store.layout import open_reader_if_exists, open_shard

START = 1_700_000_000_000
TICK_MS = 100


class Stages:
    """The five stages over one in-process installation; ``ends`` may be replaced (a failing Kafka)."""

    def __init__(self, root: Path, watermark: bool = True, roll_window_ms: int = 2 * 86_400_000,
                 lead_ms: int = 0, lookahead_ms: int = -1) -> None:
        self.config = cfg = TimerConfig(data_dir=str(root), tick_ms=TICK_MS, shards=1, timer_partitions=2,
                                        roll_window_ms=roll_window_ms, wheel_span_ms=4 * roll_window_ms, fsync=False,
                                        cancel_lead_ms=lead_ms, lookahead_ms=lookahead_ms)
        self.clock = SimulatedClock(START)
        t = local_transports(cfg, self.clock)
        self.log, q = t.commit_log, t.queues
        self.queues, self.leases = q, t.leases
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
        self.dput = DequeuePut(ctx, self.log, q[Q_DELIVER], q[Q_DONE], [0], lambda s: open_reader_if_exists(cfg, s))
        self.client = TimerClient(self.log, cfg, self.clock)
        # dequeue-put's watch asks the log itself: it sees the same ends, and fails with them.
        self.log.high_watermarks = self._high_watermarks  # type: ignore[method-assign]

    def timer_topic_ends(self) -> dict[int, int]:
        if self.ends_fail:
            raise ConnectionError("broker unreachable")
        return {p: e + self.ends_ahead for p, e in self.log.end_offsets(self.config.timer_topic).items()}

    def _high_watermarks(self, topic: str) -> dict[int, int]:
        return self.timer_topic_ends() if topic == self.config.timer_topic else self.log.end_offsets(topic)

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


@pytest.mark.parametrize("watch", [True, False], ids=["watch", "w-only"])
def test_a_cancel_read_late_still_cancels(stages: Stages, monkeypatch: pytest.MonkeyPatch, watch: bool) -> None:
    """enqueue-get stops reading before a cancel: W waits for the input. dequeue-put's watch reads
    the timer topic itself: the message not cancelled leaves on time, the cancelled one never;
    without the watch (``w-only``) both wait for W, and only the one not cancelled leaves."""
    if not watch:
        monkeypatch.setattr(Watch, "granted", lambda *_args, **_kw: None)
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
    assert stages.delivered() == ([kept.message_id] if watch else [])
    assert stages.ctx.metrics.gauge("input_wait_ms", shard=0) == 2_500
    stages.run()
    assert stages.delivered() == [kept.message_id]  # only the one not cancelled, once
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
        s.run(rounds=20)  # W catches up with the clock in steps of c - tick (466 ms) past R
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


# -- W capped by R: no roll hop comes back after its delivery time ------------------------------

#: A roll window of 3 s: c = 3000 / 3 - 0 - 100 = 900 ms, so W stays below R + 800 ms.
WINDOW_MS = 3_000


def _rolled_with_a_cancel(s: Stages) -> tuple[str, str]:
    """Two messages due at START + 4000, rolled (to START + 3000, a third of the window before),
    and a cancel of one sent 2 s before it is due while dequeue-get does not run. Returns the
    ids (kept, cancelled)."""
    s.run()
    kept = s.client.schedule("dest", b"kept", deliver_at_ms=START + 4_000)
    doomed = s.client.schedule("dest", b"doomed", deliver_at_ms=START + 4_000)
    _enqueue_only(s)
    assert s.ctx.metrics.counter("rolled", topic="dest") == 0  # rolled by enqueue-put, not yet hopped
    s.clock.set(START + 2_000)
    s.client.cancel(doomed)
    _enqueue_only(s)
    return kept.message_id, doomed.message_id


def _enqueue_only(s: Stages, rounds: int = 3) -> None:
    """Step enqueue-get and enqueue-put only: dequeue-get lags."""
    for _ in range(rounds):
        s.get.step(0)
        s.put.step(0)


def _r(s: Stages) -> int:
    dq = s.put.owned[0].shard.load_dequeue_checkpoint()
    assert dq is not None
    return dq.read_ms


def test_a_lagging_dequeue_get_never_lets_a_rolled_message_miss_its_cancel(tmp_path: Path) -> None:
    """dequeue-get stopped for twice the roll window: W stays below R + c - tick, so the roll
    hop, read late, is still written into the slot of its delivery time, where its cancel is.
    (Capped by the wheel's room alone, W ran to the clock, the hop went into the slot of W after
    its cancel's slot had been read, and the cancelled message was delivered.)"""
    s = Stages(tmp_path, roll_window_ms=WINDOW_MS)
    try:
        kept, _doomed = _rolled_with_a_cancel(s)
        st = s.put.owned[0]
        cap = WINDOW_MS // 3 - s.config.lookahead_max_ms - 2 * TICK_MS  # c - tick
        assert st.w_cap_ms == cap
        s.clock.set(START + 6_000)
        _enqueue_only(s)
        assert st.write_ms == _r(s) + cap  # not the clock: dequeue-get is 6 s behind
        for _ in range(40):
            s.run(rounds=1)
            assert st.write_ms <= _r(s) + st.w_cap_ms
        assert s.ctx.metrics.counter("rolled", topic="dest") == 2  # both hopped back ...
        s.clock.set(START + 8_000)  # (past the slot of the clock, where a hop read late would be)
        s.run(rounds=20)
        assert s.delivered() == [kept]  # ... into their own slot: the cancel met its target
        assert s.ctx.metrics.counter("cancelled", topic="dest") == 1
    finally:
        s.close()


def test_an_observation_taken_before_a_roll_hop_never_carries_w_past_the_hop(tmp_path: Path) -> None:
    """An observation of the timer topic's ends taken before a roll hop was written there, and
    counted once R had moved past the hop's roll slot (enqueue-get slow to read the hop), grants
    no more than the R it knew + c - tick: W stays below the hop's delivery time until the hop
    is written. (Granting the observation's own time, W passed it, and the hop missed its cancel.)"""
    s = Stages(tmp_path, roll_window_ms=WINDOW_MS)
    try:
        kept, _doomed = _rolled_with_a_cancel(s)
        st = s.put.owned[0]
        s.clock.set(START + 6_000)
        ends = s.log.end_offsets(s.config.timer_topic)
        for _ in range(40):  # enqueue-get holds the hops back once they are in the timer topic
            if s.log.end_offsets(s.config.timer_topic) == ends:
                s.get.step(0)
            for stage in (s.put, s.dget, s.getmsg, s.dput):
                stage.step(0)
        assert s.log.end_offsets(s.config.timer_topic) != ends  # the hops were written ...
        assert _r(s) > START + 3_000  # ... and R moved past their roll slot
        assert st.write_ms < START + 4_000  # the observation from before the hops grants no more
        s.clock.set(START + 8_000)  # past the slot of the clock, where a hop written late would be
        s.run(rounds=20)
        assert s.delivered() == [kept]
        assert s.ctx.metrics.counter("cancelled", topic="dest") == 1
    finally:
        s.close()
