"""Reschedule keeps one message (issue 31, design precision-and-exactly-once.md 6.1-6.2).

A reschedule is one record that replaces a ticket: the same ``tw-id``, the next ``tw-revision``,
``tw-replaces`` = the ticket's time. For each ticket the first cancel or reschedule in its timer
partition decides; exactly one of the old and the new message is delivered, with the same id.
Moves to a later time only: an earlier one is refused by the client and void at the service.
Tests run the embedded pipeline on a simulated clock (and one writes to Kafka).
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from timerwheel import EmbeddedTimerwheel, SimulatedClock, Ticket, TimerClient, TimerConfig, TimerwheelError
from timerwheel.records import OutRecord, Record
from timerwheel.transports.kafka.log import KafkaCommitLog

START = 1_700_000_000_000


def _run_to(tw: EmbeddedTimerwheel, clock: SimulatedClock, until_ms: int, step_ms: int = 500) -> None:
    """Move the clock to ``until_ms`` a step at a time, the pipeline idle after each."""
    tw.wait_idle()
    while clock.now_ms() < until_ms:
        clock.advance(min(step_ms, until_ms - clock.now_ms()))
        tw.wait_idle()


def _tw(tmp_path: Path, clock: SimulatedClock) -> EmbeddedTimerwheel:
    return EmbeddedTimerwheel(tmp_path, clock=clock, tick_ms=100, roll_window_ms=10_000, shards=2, fsync=False)


def _scheduled(tw: EmbeddedTimerwheel) -> tuple[Ticket, Record]:
    """A message due in 5 s, written into the wheel, and its timer record (for a reschedule past
    the client's own check, as a client that did not look, or raced, writes it)."""
    old = tw.schedule("orders", b"v", delay_ms=5_000)
    tw.wait_idle()
    original = tw.client.find(old)
    assert original is not None
    return old, original


def _delivered(tw: EmbeddedTimerwheel) -> list[tuple[bytes | None, bytes | None, bytes | None]]:
    return [(r.value, r.header("tw-id"), r.header("tw-revision")) for r in tw.read("orders")]


def test_reschedule_later_delivers_once_at_the_new_time_with_the_same_id(tmp_path: Path) -> None:
    clock = SimulatedClock(start_ms=START)
    with _tw(tmp_path, clock) as tw:
        old = tw.schedule("orders", b"payload", key=b"k", headers=(("trace", b"abc"),), delay_ms=5_000)
        tw.wait_idle()
        new = tw.reschedule(str(old), deliver_at_ms=START + 12_000)  # a tw1 ticket's text still works
        assert (new.message_id, new.revision, new.deliver_at_ms) == (old.message_id, 1, START + 12_000)
        assert str(new) == f"tw2.{old.partition}.{START + 12_000}.1.{old.message_id}"
        assert Ticket.parse(str(new)) == new and Ticket.parse(str(old)).revision == 0
        written = [r for r in tw.read("__timer") if r.header("tw-replaces")]
        assert len(written) == 1, "one record, no cancel beside it"
        assert written[0].header("tw-revision") == b"1" and written[0].header("tw-id") == old.message_id.encode()
        _run_to(tw, clock, START + 11_000)
        assert _delivered(tw) == [], "delivered at the old time"
        _run_to(tw, clock, START + 14_000)
        (moved,) = tw.read("orders")
        assert moved.header("tw-id") == old.message_id.encode() and moved.header("tw-revision") == b"1"
        assert moved.key == b"k" and moved.header("trace") == b"abc" and moved.header("tw-replaces") is None
        assert int(moved.header("tw-delivered-at") or b"0") >= START + 12_000
        assert tw.metrics.counter("redirected", topic="orders") == 1
        assert tw.metrics.counter("reschedules_void") == 0


def test_rescheduling_the_same_ticket_twice_moves_the_message_once(tmp_path: Path) -> None:
    clock = SimulatedClock(start_ms=START)
    with _tw(tmp_path, clock) as tw:
        old, original = _scheduled(tw)
        first = tw.reschedule(old, deliver_at_ms=START + 8_000)
        with pytest.raises(TimerwheelError, match="rescheduled already"):  # the client sees the first
            tw.reschedule(old, deliver_at_ms=START + 9_000)
        second = tw.client.reschedule(old, deliver_at_ms=START + 9_000, original=original)
        assert first.revision == second.revision == 1
        _run_to(tw, clock, START + 12_000)
        (got,) = tw.read("orders")
        assert got.header("tw-revision") == b"1" and got.header("tw-id") == old.message_id.encode()
        assert START + 8_000 <= int(got.header("tw-delivered-at") or b"0") < START + 9_000, "the first did not win"
        assert tw.metrics.counter("reschedules_void") == 1


@pytest.mark.parametrize("then", ["cancel", "reschedule"])
def test_a_close_move_written_back_late_still_meets_what_its_new_ticket_decided(tmp_path: Path, then: str) -> None:
    """A message moved 300 ms later, its new ticket then cancelled (or moved again), all written
    long before its time; the clock then jumps past both times at once (a pipeline that lags): the
    new revision is written back after its own time, into the slot of W, and its cancel or second
    move, in the slot of its time, must still decide it (enqueue-put copies a late message's
    markers along: ``late_marker_copies``)."""
    clock = SimulatedClock(start_ms=START)
    with _tw(tmp_path, clock) as tw:
        old, _original = _scheduled(tw)
        new = tw.reschedule(old, deliver_at_ms=old.deliver_at_ms + 300)
        if then == "cancel":
            tw.cancel(new)
        else:
            again = tw.reschedule(new, deliver_at_ms=old.deliver_at_ms + 4_000)
        tw.wait_idle()
        clock.advance(old.deliver_at_ms + 2_000 - clock.now_ms())  # one jump: past both times
        tw.wait_idle()
        if then == "cancel":
            _run_to(tw, clock, START + 15_000)
            assert _delivered(tw) == [], "delivered: the cancel of its new ticket missed"
        else:
            assert _delivered(tw) == [], "the first move was delivered: its second move missed"
            _run_to(tw, clock, START + 15_000)
            (got,) = tw.read("orders")
            assert got.header("tw-revision") == b"2" and got.header("tw-id") == old.message_id.encode()
            assert int(got.header("tw-delivered-at") or b"0") >= again.deliver_at_ms
        assert tw.metrics.counter("late_marker_copies", shard=old.partition % 2) >= 1


def test_a_cancelled_ticket_is_not_revived_by_a_reschedule(tmp_path: Path) -> None:
    clock = SimulatedClock(start_ms=START)
    with _tw(tmp_path, clock) as tw:
        old, original = _scheduled(tw)
        tw.cancel(old)
        with pytest.raises(TimerwheelError, match="cancelled already"):
            tw.reschedule(old, deliver_at_ms=START + 8_000)
        tw.client.reschedule(old, deliver_at_ms=START + 8_000, original=original)  # past the client's check
        _run_to(tw, clock, START + 12_000)
        assert _delivered(tw) == []
        assert tw.metrics.counter("reschedules_void") == 1


def test_cancelling_the_old_ticket_after_a_reschedule_does_nothing_and_the_new_ticket_cancels(
        tmp_path: Path) -> None:
    clock = SimulatedClock(start_ms=START)
    with _tw(tmp_path, clock) as tw:
        kept = tw.schedule("orders", b"kept", delay_ms=5_000)
        gone = tw.schedule("orders", b"gone", delay_ms=5_000)
        tw.wait_idle()
        kept2 = tw.reschedule(kept, deliver_at_ms=START + 8_000)
        tw.cancel(kept)  # void: the reschedule came first
        gone2 = tw.reschedule(gone, deliver_at_ms=START + 8_000)
        tw.cancel(gone2)  # the new ticket: a cancel of revision 1
        _run_to(tw, clock, START + 12_000)
        assert _delivered(tw) == [(b"kept", kept2.message_id.encode(), b"1")]
        assert tw.metrics.counter("cancelled", topic="orders") == 1


def test_reschedule_of_a_rolled_ticket_moves_it(tmp_path: Path) -> None:
    clock = SimulatedClock(start_ms=START)
    with _tw(tmp_path, clock) as tw:  # roll window 10 s
        far = tw.schedule("orders", b"far", delay_ms=30_000)
        tw.wait_idle()
        _run_to(tw, clock, START + 2_000)
        moved = tw.reschedule(far, deliver_at_ms=START + 45_000)  # rolled itself: its marker rolls too
        again = tw.reschedule(moved, deliver_at_ms=START + 50_000)  # and the new ticket moves on
        _run_to(tw, clock, START + 44_000)
        assert _delivered(tw) == []
        assert tw.metrics.counter("rolled", topic="orders") >= 2
        _run_to(tw, clock, START + 52_000)
        (got,) = tw.read("orders")
        assert (got.value, got.header("tw-id"), got.header("tw-revision")) == (b"far", far.message_id.encode(), b"2")
        assert again.revision == 2 and int(got.header("tw-delivered-at") or b"0") >= START + 50_000


def test_a_reschedule_to_an_earlier_time_is_refused_and_void(tmp_path: Path) -> None:
    """This build moves messages later only (design 6.2's "Earlier" path is not built): the client
    refuses an earlier time, and the service takes a record that asks for one as void."""
    clock = SimulatedClock(start_ms=START)
    with _tw(tmp_path, clock) as tw:
        old = tw.schedule("orders", b"v", delay_ms=8_000)
        tw.wait_idle()
        with pytest.raises(TimerwheelError, match="cancel .* and schedule a new message"):
            tw.reschedule(old, deliver_at_ms=START + 3_000)
        tw.commit_log.append([OutRecord("__timer", None, b"v", (
            ("tw-topic", b"orders"), ("tw-id", old.message_id.encode()), ("tw-revision", b"1"),
            ("tw-deliver-at", str(START + 3_000).encode()), ("tw-replaces", str(old.deliver_at_ms).encode())),
            partition=old.partition)])
        _run_to(tw, clock, START + 7_000)
        assert _delivered(tw) == []
        _run_to(tw, clock, START + 9_000)
        assert _delivered(tw) == [(b"v", old.message_id.encode(), None)], "the message kept its time"
        assert tw.metrics.counter("reschedules_void") == 1


@pytest.mark.parametrize(("headers", "reason"), [
    ((("tw-cancel", b"m1"), ("tw-replaces", b"1700000005000"), ("tw-revision", b"1")), "tw-cancel and tw-replaces"),
    ((("tw-topic", b"orders"), ("tw-replaces", b"1700000005000"), ("tw-revision", b"1")), "tw-replaces without tw-id"),
    ((("tw-topic", b"orders"), ("tw-id", b"m1"), ("tw-replaces", b"1700000005000")), "tw-revision 0"),
    ((("tw-topic", b"orders"), ("tw-id", b"m1"), ("tw-replaces", b"1700000005000"), ("tw-revision", b"0")),
     "tw-revision 0"),
    ((("tw-topic", b"orders"), ("tw-id", b"m1"), ("tw-replaces", b"soon"), ("tw-revision", b"1")),
     "unparsable tw-replaces"),
])
def test_invalid_reschedule_records_are_dead_lettered_with_the_reason(
        tmp_path: Path, headers: tuple[tuple[str, bytes], ...], reason: str) -> None:
    clock = SimulatedClock(start_ms=START)
    with _tw(tmp_path, clock) as tw:
        at = (("tw-deliver-at", str(START + 9_000).encode()),)
        tw.commit_log.append([OutRecord("__timer", b"k", b"v", headers + at, partition=0)])
        _run_to(tw, clock, START + 1_000)
        (dead,) = tw.read("__timer_dlq")
        assert reason in (dead.header("tw-error") or b"").decode()


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
    assert out.stdout.startswith("tw2.")
    assert (new.partition, new.message_id, new.revision) == (old.partition, old.message_id, 1)
    assert new.deliver_at_ms > old.deliver_at_ms


def test_reschedule_on_kafka_writes_one_record_without_a_transaction(kafka_bootstrap: str) -> None:
    topic = f"tw-resched-{uuid.uuid4().hex[:8]}"
    cfg = TimerConfig(timer_topic=topic, timer_partitions=2)
    log = KafkaCommitLog(kafka_bootstrap)
    try:
        client = TimerClient(log, cfg)
        old = client.schedule("orders", b"payload", key=b"k", delay_ms=60_000)
        new = client.reschedule(old, delay_ms=120_000)
        assert (new.message_id, new.revision) == (old.message_id, 1)
        ends = log.high_watermarks(topic)
        consumer = log.consumer(topic, log.start_offsets(topic))  # read_committed
        records: list[Record] = []
        try:
            while len(records) < 2:
                batch = consumer.poll(100, 5.0)
                assert batch, f"only {len(records)} records"
                records.extend(batch)
        finally:
            consumer.close()
        first, moved = sorted((r for r in records if r.partition == old.partition), key=lambda r: r.offset)
        assert moved.offset == first.offset + 1 and ends[old.partition] == moved.offset + 1, "no transaction marker"
        assert moved.header("tw-id") == old.message_id.encode() and moved.value == b"payload" and moved.key == b"k"
        assert moved.header("tw-revision") == b"1"
        assert moved.header("tw-replaces") == str(old.deliver_at_ms).encode()
        assert moved.header("tw-deliver-at") == str(new.deliver_at_ms).encode()
    finally:
        log.close()


def test_a_reschedule_that_reaches_a_message_already_read_ahead_moves_it(tmp_path: Path) -> None:
    """The slot was read (TW_LOOKAHEAD_MS ahead) and the message is held in dequeue-put: the
    release's look at the slot's tail (or the watch) finds the reschedule and decides there."""
    clock = SimulatedClock(start_ms=START)
    with _tw(tmp_path, clock) as tw:
        old = tw.schedule("orders", b"v", delay_ms=5_000)
        other = tw.schedule("orders", b"w", delay_ms=5_000)
        _run_to(tw, clock, START + 4_600)
        assert tw.metrics.counter("delivered", topic="orders") == 0
        new = tw.reschedule(old, deliver_at_ms=START + 8_000)
        tw.cancel(other)
        tw.cancel(old)  # void: after the reschedule
        _run_to(tw, clock, START + 7_500)
        assert _delivered(tw) == []
        _run_to(tw, clock, START + 9_000)
        assert _delivered(tw) == [(b"v", new.message_id.encode(), b"1")]


def test_deliver_now_delivers_a_copy_of_the_next_revision_now_and_never_the_old_message(tmp_path: Path) -> None:
    """``TimerClient.deliver_now`` (the console's button): a copy due now and a cancel of the
    ticket; the old message never leaves, the ticket cannot be moved or delivered now again."""
    clock = SimulatedClock(start_ms=START)
    with _tw(tmp_path, clock) as tw:
        old, _original = _scheduled(tw)
        copy = tw.client.deliver_now(old)
        assert (copy.message_id, copy.revision, copy.deliver_at_ms) == (old.message_id, 1, START)
        written = [r for r in tw.read("__timer") if r.offset > _original.offset and r.partition == old.partition]
        assert [(r.header("tw-cancel"), r.header("tw-revision")) for r in written] == [
            (None, b"1"), (old.message_id.encode(), None)], "the copy first, then the cancel of the ticket"
        assert written[0].header("tw-replaces") is None
        with pytest.raises(TimerwheelError, match="cancelled already"):
            tw.client.deliver_now(old)
        with pytest.raises(TimerwheelError, match="cancelled already"):
            tw.reschedule(old, deliver_at_ms=START + 8_000)
        _run_to(tw, clock, START + 1_000)
        assert _delivered(tw) == [(b"v", old.message_id.encode(), b"1")]
        _run_to(tw, clock, START + 8_000)
        assert _delivered(tw) == [(b"v", old.message_id.encode(), b"1")], "the old message left too"
