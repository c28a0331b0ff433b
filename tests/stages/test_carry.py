"""A dequeue-get owner that lets its shard go hands over its read-ahead (``ReadAhead`` in
dequeue.ckpt): the next owner reads only the new records of the open slots, so what dequeue-put's
watch released from them while ``W`` stood still is not delivered twice (CI's image-change roll
repeated 24 of 1,142 messages this way: enqueue-put rolled beside dequeue-get).

The five stages stepped by hand on a simulated clock (``test_late_input.Stages``), the wheel read
ahead (TW_LOOKAHEAD_MS 1000); enqueue-put is not stepped while the owners change, so ``W`` stands
still, and dequeue-put's watch releases what was read ahead at its time.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_late_input import START, Stages
from test_release import advance, next_owner
from timerwheel.stages import watch
from timerwheel.stages.dequeue_get import CARRY_MAX
from timerwheel.store import CarriedSlot, CorruptCheckpointError, DequeueCheckpoint, ReadAhead, Shard
from timerwheel.store import checkpoint as ckpt_file
from timerwheel.wire import Ticket


@pytest.fixture
def stages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Stages]:
    monkeypatch.setattr(watch, "OBSERVE_S", 0.0)  # an observation at every look: the clock is simulated
    s = Stages(tmp_path, lookahead_ms=1_000)
    yield s
    s.close()


def _without_w(s: Stages, to_ms: int) -> None:
    """Step every stage but enqueue-put (W stands still) until ``to_ms``."""
    while s.clock.now_ms() < to_ms:
        s.clock.advance(10)
        for stage in (s.get, s.dget, s.getmsg, s.dput):
            stage.step(0)


def test_what_the_watch_released_while_w_stood_still_is_not_read_again_by_thenext_owner(stages: Stages) -> None:
    first = stages.client.schedule("dest", b"a", deliver_at_ms=START + 2_010)
    copied = stages.client.schedule("dest", b"c", deliver_at_ms=START + 2_030, message_id="copied")
    stages.run()
    advance(stages, START + 1_100)
    assert stages.dput.holding(0) == 1  # slot 2_000 read ahead: both held (one entry)
    _without_w(stages, START + 2_100)  # W stands still; the watch releases both at their time
    assert sorted(stages.delivered()) == sorted([first.message_id, copied.message_id])
    left = stages.dget
    st = left.owned[0]
    assert not st.in_flight and START + 2_000 in st.open
    left.close()
    saved = st.shard.load_dequeue_checkpoint()
    assert saved is not None and saved.carry is not None
    assert START + 2_000 in [c.slot_ms for c in saved.carry.slots]
    assert saved.read_ms <= START + 2_000  # R never passes an open slot

    # Written into the open slot after the hand-over: a new message, and a copy of one delivered
    # (a roll hop done twice): the next owner reads them as its tail, with what the first read saw.
    late = stages.client.schedule("dest", b"late", deliver_at_ms=START + 2_150)
    stages.client.schedule("dest", b"c", deliver_at_ms=START + 2_030, message_id="copied")
    nxt = next_owner(stages)
    assert START + 2_000 in nxt.owned[0].open
    advance(stages, START + 2_600)
    delivered = stages.delivered()
    assert sorted(delivered) == sorted([first.message_id, copied.message_id, late.message_id])  # none twice
    assert stages.ctx.metrics.counter("read_ahead_carried", shard=0) >= 1
    assert stages.ctx.metrics.counter("copies_dropped", topic="dest") == 1
    assert START + 2_000 not in nxt.owned[0].open  # final once W passed it: R moves on
    saved = nxt.owned[0].shard.load_dequeue_checkpoint()
    assert saved is not None and saved.read_ms > START + 2_000 and saved.carry is None


def test_a_cancel_read_by_the_owner_that_left_still_cancels_a_message_written_after(stages: Stages) -> None:
    """The carried markers: a cancel read in the first read of a slot matches a message that
    comes in the slot's tail, read by the next owner."""
    kept = stages.client.schedule("dest", b"k", deliver_at_ms=START + 2_010)
    stages.client.cancel(Ticket(0, START + 2_040, "doomed"))  # its cancel first
    stages.run()
    advance(stages, START + 1_100)
    _without_w(stages, START + 1_500)
    stages.dget.close()
    stages.client.schedule("dest", b"d", deliver_at_ms=START + 2_040, message_id="doomed", partition=0)
    next_owner(stages)
    advance(stages, START + 2_600)
    assert stages.delivered() == [kept.message_id]
    assert stages.ctx.metrics.counter("cancelled", topic="dest") == 1


def test_an_owner_leaving_with_messages_in_flight_carries_nothing(stages: Stages) -> None:
    """Held messages are dropped by dequeue-put (R saved under the next epoch): their slots are
    read again from R, whole, and delivered once."""
    msg = stages.client.schedule("dest", b"m", deliver_at_ms=START + 2_010)
    stages.run()
    advance(stages, START + 1_100)
    assert stages.dput.holding(0) == 1
    st = stages.dget.owned[0]
    stages.dget.close()
    saved = st.shard.load_dequeue_checkpoint()
    assert saved is not None and saved.carry is None and saved.epoch == st.epoch + 1
    next_owner(stages)
    advance(stages, START + 2_500)
    assert stages.delivered() == [msg.message_id]


@pytest.mark.parametrize("bad", ["tick", "position", "before R", "enqueue.ckpt unreadable"])
def test_a_read_ahead_that_no_longer_fits_the_shard_is_read_again_from_r(stages: Stages, bad: str) -> None:
    """A window change's rebuilt wheel (another tick), a TimerLog behind the carried read, a slot
    before R, an enqueue.ckpt that cannot be read as the shard is taken (its flushed position
    unknown): the next owner reads from R, as after a crash (at-least-once, never a loss)."""
    msg = stages.client.schedule("dest", b"m", deliver_at_ms=START + 2_010)
    stages.run()
    advance(stages, START + 1_100)
    _without_w(stages, START + 2_100)
    st = stages.dget.owned[0]
    stages.dget.close()
    saved = st.shard.load_dequeue_checkpoint()
    assert saved is not None and saved.carry is not None
    carry = saved.carry
    if bad == "tick":
        carry = ReadAhead(carry.tick_ms * 2, carry.cursor_ms, carry.slots)
    elif bad == "enqueue.ckpt unreadable":
        pass  # the carry as saved; the checkpoint fails as the next owner takes the shard
    else:
        c = carry.slots[0]
        slot_ms, read_pos = (c.slot_ms, 1 << 40) if bad == "position" else (saved.read_ms - 100, c.read_pos)
        carry = ReadAhead(carry.tick_ms, carry.cursor_ms, (CarriedSlot(slot_ms, read_pos, {}, frozenset(), {}),))
    st.shard.save_dequeue_checkpoint(DequeueCheckpoint(saved.read_ms, saved.epoch, carry=carry))
    with pytest.MonkeyPatch.context() as mp:
        if bad == "enqueue.ckpt unreadable":
            mp.setattr(Shard, "load_enqueue_checkpoint", _unreadable)
        nxt = next_owner(stages)
    assert nxt.owned[0].open == {} and nxt.owned[0].cursor == saved.read_ms
    advance(stages, START + 2_600)
    assert stages.delivered() == [msg.message_id] * 2  # read again: at-least-once, as after a crash


def _unreadable(_shard: Shard) -> None:
    raise CorruptCheckpointError("enqueue.ckpt fails its CRC")


def test_the_carry_stops_at_carry_max_and_the_rest_is_read_again(stages: Stages) -> None:
    stages.run()
    advance(stages, START + 1_100)
    st = stages.dget.owned[0]
    assert len(st.open) >= 2
    first, second = sorted(st.open)[:2]
    st.open[first].seen = {k: k for k in range(CARRY_MAX)}
    st.open[second].seen = {1: 1}
    carry = st.carry()
    assert carry is not None and [c.slot_ms for c in carry.slots] == [first] and carry.cursor_ms == second


def test_the_carry_survives_the_checkpoint_file(tmp_path: Path) -> None:
    carry = ReadAhead(100, 1_300, (
        CarriedSlot(1_000, 4_096, {2**64 - 1: [(1, 7), (0, 3)]}, frozenset({2**64 - 1}), {5: 1 << 40 | 9}),
        CarriedSlot(1_100, 8_192, {}, frozenset(), None)))
    path = str(tmp_path / "dequeue.ckpt")
    ckpt_file.save_dequeue(path, DequeueCheckpoint(1_000, 3, carry=carry), fsync=False)
    assert ckpt_file.load_dequeue(path) == DequeueCheckpoint(1_000, 3, carry=carry)
    ckpt_file.save_dequeue(path, DequeueCheckpoint(1_100, 4), fsync=False)  # any other save drops it
    assert ckpt_file.load_dequeue(path) == DequeueCheckpoint(1_100, 4)


def test_a_malformed_carry_is_named(tmp_path: Path) -> None:
    path = tmp_path / "dequeue.00000000000000000007.ckpt"
    path.write_bytes(ckpt_file.encode("dequeue", {"version": 1, "read_ms": 0, "epoch": 7,
                                                  "carry": {"tick_ms": 100, "cursor_ms": "x", "slots": []}}))
    with pytest.raises(CorruptCheckpointError, match="bad carry"):
        ckpt_file.load_dequeue(str(tmp_path / "dequeue.ckpt"))
