"""Reschedule: cancel and schedule again, the two records written together."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from kafka import KafkaProducer
from timerwheel import EmbeddedTimerwheel, SimulatedClock, Ticket, TimerClient, TimerConfig, TimerwheelError
from timerwheel.records import Record
from timerwheel.transports.kafka.log import KafkaCommitLog

START = 1_700_000_000_000


def test_reschedule_delivers_at_the_new_time_only(tmp_path: Path) -> None:
    clock = SimulatedClock(start_ms=START)
    with EmbeddedTimerwheel(tmp_path, clock=clock, tick_ms=100, roll_window_ms=10_000, shards=2, fsync=False) as tw:
        old = tw.schedule("orders", b"payload", key=b"k", headers=(("trace", b"abc"),), delay_ms=5_000)
        far = tw.schedule("orders", b"far", delay_ms=30_000)  # rolled: the cancel must reach it too
        tw.wait_idle()
        new = tw.reschedule(old, deliver_at_ms=START + 12_000)
        new_far = tw.reschedule(far, delay_ms=2_000)
        assert new.message_id != old.message_id and new.deliver_at_ms == START + 12_000
        tw.wait_idle()  # written before the clock moves: a cancel written after its time is too late
        clock.advance(6_000)
        tw.wait_idle()
        assert [r.value for r in tw.read("orders")] == [b"far"], "the old time delivered, or the new far one missed"
        assert tw.read("orders")[0].header("tw-id") == new_far.message_id.encode()
        clock.advance(30_000)
        tw.wait_idle()
        got = tw.read("orders")
        assert [(r.value, r.header("tw-id")) for r in got] == [(b"far", new_far.message_id.encode()),
                                                               (b"payload", new.message_id.encode())]
        moved = got[1]
        assert moved.key == b"k" and moved.header("trace") == b"abc"
        assert int(moved.header("tw-delivered-at") or b"0") >= START + 12_000


def test_reschedule_after_the_delivery_time_is_refused(tmp_path: Path) -> None:
    clock = SimulatedClock(start_ms=START)
    with EmbeddedTimerwheel(tmp_path, clock=clock, tick_ms=100, roll_window_ms=10_000, fsync=False) as tw:
        old = tw.schedule("orders", b"v", delay_ms=1_000)
        clock.advance(2_000)
        tw.wait_idle()
        with pytest.raises(TimerwheelError, match="most likely delivered"):
            tw.reschedule(old, delay_ms=5_000)
        clock.advance(10_000)
        tw.wait_idle()
        assert len(tw.read("orders")) == 1


def test_reschedule_command_prints_the_new_ticket(tmp_path: Path) -> None:
    with EmbeddedTimerwheel(tmp_path, tick_ms=100, roll_window_ms=10_000, fsync=False) as tw:
        old = tw.schedule("orders", b"v", delay_ms=3_600_000)
    out = subprocess.run([sys.executable, "-m", "timerwheel.cli", "reschedule", "--data-dir", str(tmp_path),
                          str(old), "--delay-ms", "2h"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    new = Ticket.parse(out.stdout.strip())
    assert new.partition == old.partition and new.deliver_at_ms > old.deliver_at_ms


def test_reschedule_on_kafka_writes_cancel_and_new_record_in_one_committed_transaction(kafka_bootstrap: str) -> None:
    topic = f"tw-resched-{uuid.uuid4().hex[:8]}"
    cfg = TimerConfig(timer_topic=topic, timer_partitions=2)
    log = KafkaCommitLog(kafka_bootstrap)
    try:
        client = TimerClient(log, cfg)
        old = client.schedule("orders", b"payload", key=b"k", delay_ms=60_000)
        new = client.reschedule(old, delay_ms=120_000)
        fresh = KafkaCommitLog(kafka_bootstrap)  # end offsets not cached from before the transaction
        try:
            ends = fresh.end_offsets(topic)
        finally:
            fresh.close()
        consumer = log.consumer(topic, log.start_offsets(topic))  # read_committed
        records = []
        try:
            while len(records) < 3:
                batch = consumer.poll(100, 5.0)
                assert batch, f"only {len(records)} committed records"
                records.extend(batch)
        finally:
            consumer.close()
        part = [r for r in records if r.partition == old.partition]
        assert [r.offset for r in part] == sorted(r.offset for r in part)
        cancel, moved = part[1], part[2]
        assert cancel.header("tw-cancel") == old.message_id.encode()
        assert moved.header("tw-id") == new.message_id.encode() and moved.value == b"payload" and moved.key == b"k"
        # A transaction's commit marker takes an offset after its records: the two went in one.
        assert ends[old.partition] == moved.offset + 2 and moved.offset == cancel.offset + 1
    finally:
        log.close()


def test_a_client_id_names_a_stable_transaction_that_fences_and_is_fenced(kafka_bootstrap: str) -> None:
    """A reschedule's transactional id is the client's, the same in every run: a client starting
    again aborts at once what a crashed run left open (which held W of its shard back), and of two
    clients with one id the last to start fences the other, whose next reschedule fails (nothing
    written) and the one after works again."""
    uid = uuid.uuid4().hex[:8]
    topic = f"tw-resched-{uid}"
    cfg = TimerConfig(timer_topic=topic, timer_partitions=1)
    logs = [KafkaCommitLog(kafka_bootstrap) for _ in range(3)]
    crashed = KafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=f"timerwheel-reschedule-app-{uid}")
    try:
        first, second = (TimerClient(log, cfg, client_id=f"app-{uid}") for log in logs[:2])
        assert first.transactional_id == f"timerwheel-reschedule-app-{uid}" == second.transactional_id
        assert TimerClient(logs[2], cfg).client_id.endswith(f"-{topic}")  # host, user, timer topic
        # A run that crashed inside its transaction: open on the timer partition, the partition's
        # last stable offset held below it (W waits for such a transaction to end).
        crashed.init_transactions()
        crashed.begin_transaction()
        crashed.send(topic, b"half a reschedule", partition=0)
        crashed.flush()
        assert logs[2].end_offsets(topic)[0] < logs[2].high_watermarks(topic)[0]
        logs[0].append_atomic([], first.transactional_id)  # the client runs again: its producer starts ...
        assert logs[2].end_offsets(topic) == logs[2].high_watermarks(topic)  # ... and the transaction is over
        old = first.schedule("orders", b"payload", delay_ms=60_000)
        t1 = first.reschedule(old, delay_ms=120_000)
        t2 = second.reschedule(t1, delay_ms=180_000)  # fences first's producer
        with pytest.raises(TimerwheelError, match="append_atomic"):
            first.reschedule(t2, delay_ms=240_000)
        t3 = first.reschedule(t2, delay_ms=240_000)  # a new producer: fences second in turn
        consumer = logs[2].consumer(topic, {0: 0})  # read_committed
        try:
            got: list[Record] = []
            deadline = time.monotonic() + 10
            while consumer.position(0) < logs[2].high_watermarks(topic)[0]:
                assert time.monotonic() < deadline, "the timer partition not read to its end"
                got += consumer.poll(100, 0.5)
        finally:
            consumer.close()
        ids = [(r.header("tw-cancel") or b"").decode() or "+" + (r.header("tw-id") or b"").decode() for r in got]
        assert ids == ["+" + old.message_id, old.message_id, "+" + t1.message_id, t1.message_id,
                       "+" + t2.message_id, t2.message_id, "+" + t3.message_id]  # the fenced try wrote nothing
    finally:
        crashed.close(timeout=1)
        for log in logs:
            log.close()
