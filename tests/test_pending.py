"""Browse pending timers: ``pending`` against a model, on a simulated clock."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

from timerwheel import EmbeddedTimerwheel, SimulatedClock, SystemClock, Ticket

START = 1_700_000_000_000
TOPICS = ("t1", "t2")


def test_pending_matches_a_model_through_rolls_cancels_and_deliveries(tmp_path: Path) -> None:
    rng = random.Random(17)
    clock = SimulatedClock(start_ms=START)
    #: id -> (topic, delivery time) of every message scheduled and not cancelled
    model: dict[str, tuple[str, int]] = {}
    #: id -> its live ticket (its revision: what a reschedule moved it to)
    tickets: dict[str, Ticket] = {}
    delivered: set[str] = set()
    rolled_seen = moved_seen = False
    with EmbeddedTimerwheel(tmp_path, clock=clock, tick_ms=100, roll_window_ms=10_000, shards=2, fsync=False) as tw:
        for step in range(12):
            for _ in range(40):
                topic = rng.choice(TOPICS)
                ticket = tw.schedule(topic, b"v", delay_ms=rng.randrange(0, 45_000))
                if rng.random() < 0.15:
                    tw.cancel(ticket)
                else:
                    model[ticket.message_id] = (topic, ticket.deliver_at_ms)
                    tickets[ticket.message_id] = ticket
            # reschedules (issue 31): moved later, some moved again from their new ticket, some
            # again from the old one (void), some cancelled on their new ticket
            now = clock.now_ms()
            movable = sorted(m for m in model if m not in delivered and tickets[m].deliver_at_ms > now + 200)
            for mid in rng.sample(movable, min(8, len(movable))):
                old = tickets[mid]
                original = tw.client.find(old)
                # by more than a step of the clock: the new revision is written back before its
                # time (one written after it goes to the current slot, listed until that ends)
                new = tw.reschedule(old, deliver_at_ms=old.deliver_at_ms + rng.randrange(5_000, 30_000))
                tickets[mid] = new
                model[mid] = (model[mid][0], new.deliver_at_ms)
                kind = rng.random()
                if kind < 0.25:
                    # past the client's check, as a client that raced writes it
                    tw.client.reschedule(old, deliver_at_ms=old.deliver_at_ms + 50_000, original=original)
                elif kind < 0.4:
                    tw.cancel(new)
                    del model[mid]
            tw.wait_idle()  # written before the clock moves: a cancel written after its time is too late
            # To a tick's start: pending reads the wheel from R, which never passes the slot W is
            # in, so a message read ahead and delivered within the current tick is listed until
            # it ends (docs/cli.md); at a tick's start that slot holds nothing due yet.
            clock.advance(rng.randrange(3, 50) * 100)
            tw.wait_idle()
            now = clock.now_ms()
            for topic in TOPICS:
                for r in tw.read(topic):
                    mid = (r.header("tw-id") or b"").decode()
                    assert mid in model, f"step {step}: {mid} delivered but cancelled or unknown"
                    assert model[mid][1] <= now
                    delivered.add(mid)
            pending = {mid: v for mid, v in model.items() if mid not in delivered}
            for _ in range(4):
                lo = now + rng.randrange(-2_000, 30_000)
                hi = lo + rng.randrange(100, 40_000)
                topic = rng.choice((None, *TOPICS))
                want = {mid for mid, (t, at) in pending.items() if lo <= at < hi and topic in (None, t)}
                got = tw.pending(lo, hi, topic=topic, limit=10_000)
                assert got.count == len(want) == len(got.timers), f"step {step} [{lo}, {hi}) {topic}"
                assert {t.message_id for t in got.timers} == want
                for t in got.timers:
                    assert (t.topic, t.deliver_at_ms) == model[t.message_id]
                    assert t.revision == tickets[t.message_id].revision
                    rolled_seen |= t.roll > 0
                    moved_seen |= t.revision > 0
            everything = tw.pending()
            assert everything.count == len(pending)
            first = tw.pending(limit=5)
            assert first.count == len(pending)
            assert [t.deliver_at_ms for t in first.timers] == sorted(at for _t, at in pending.values())[:5]
            if pending:
                for mid in [next(iter(pending)), *[m for m in pending if tickets[m].revision][:3]]:
                    found = tw.pending(message_id=mid).timers
                    assert [(t.message_id, t.revision, t.deliver_at_ms) for t in found] == [
                        (mid, tickets[mid].revision, tickets[mid].deliver_at_ms)]
        assert rolled_seen, "no pending message was seen after a roll: the roll count is untested"
        assert moved_seen, "no rescheduled message was listed: revisions are untested"
        clock.advance(max(at for _t, at in model.values()) - clock.now_ms() + 1_000)
        tw.wait_idle()
        assert tw.pending().count == 0


def test_pending_command_reads_a_data_dir(tmp_path: Path) -> None:
    clock = SimulatedClock(start_ms=START)
    with EmbeddedTimerwheel(tmp_path, clock=clock, tick_ms=100, roll_window_ms=10_000, shards=3, fsync=False) as tw:
        tickets = [tw.schedule("orders", b"v", deliver_at_ms=START + 1_000 * (i + 1)) for i in range(30)]
        tw.schedule("audit", b"v", deliver_at_ms=START + 5_500)
        tw.cancel(tickets[0])
        tw.wait_idle()
    out = subprocess.run([sys.executable, "-m", "timerwheel.cli", "pending", "--data-dir", str(tmp_path),
                          "--from", str(START), "--to", str(START + 10_001), "--topic", "orders", "--limit", "3"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["count"] == 9 and report["shown"] == 3
    assert [t["id"] for t in report["timers"]] == [t.message_id for t in tickets[1:4]]
    assert all(isinstance(Ticket(0, t["deliver_at_ms"], t["id"]), Ticket) for t in report["timers"])


def test_pending_command_with_kafka_reads_the_timer_topic_there(tmp_path: Path, kafka_bootstrap: str) -> None:
    from timerwheel.runtime.wiring import Transports
    from timerwheel.stages.codec import Q_DELIVER, Q_DONE, Q_FETCH, Q_PUT
    from timerwheel.transports.kafka.log import KafkaCommitLog
    from timerwheel.transports.memory import MemoryLeaseStore, MemoryWorkQueue

    timer_topic = f"tw-pending-{uuid.uuid4().hex[:8]}"
    transports = Transports(KafkaCommitLog(kafka_bootstrap),
                            {q: MemoryWorkQueue(q, 1, 64) for q in (Q_PUT, Q_FETCH, Q_DELIVER, Q_DONE)},
                            MemoryLeaseStore(SystemClock()))
    with EmbeddedTimerwheel(tmp_path, tick_ms=100, roll_window_ms=10_000, shards=1, timer_partitions=1,
                            timer_topic=timer_topic, fsync=False, transports=transports) as tw:
        tickets = [tw.schedule("orders", b"v", delay_ms=3_600_000 + i) for i in range(3)]
        deadline = time.monotonic() + 60
        while tw.pending().count < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
    out = subprocess.run([sys.executable, "-m", "timerwheel.cli", "pending", "--data-dir", str(tmp_path),
                          "--kafka", kafka_bootstrap, "--timer-topic", timer_topic], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["count"] == 3
    assert [(t["id"], t["roll"]) for t in report["timers"]] == [(t.message_id, 0) for t in tickets]
