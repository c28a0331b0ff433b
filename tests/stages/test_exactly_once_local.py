"""dequeue-put's exactly-once release on the embedded mode's local log (issue 31, design 7.1
"Embedded"): ``test_exactly_once``'s crash points, the commit being ``append_atomic``'s journal.

The rig is ``test_exactly_once.EoRig`` over a ``LocalCommitLog``. A crash is an exception nothing
catches (``Crash``), raised at one of the journal's steps (``LocalCommitLog.journal_fault``) or
inside the journal's own write (a torn journal); the stage is abandoned there and a second
replica claims the entries and releases them again. The local log has no read_committed: what a
crash left half-written is whole again after the take (which finishes the journal), and that is
when the tests count.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import test_exactly_once
from test_dequeue_put_checks import record
from test_exactly_once import SLOT, START, Crash, EoRig, deliver
from timerwheel import SimulatedClock
from timerwheel.runtime.wiring import shard_deliveries
from timerwheel.stages import base
from timerwheel.stages.codec import ROLL, DeliverItem
from timerwheel.transports.local.deliveries import LocalShardDeliveries
from timerwheel.transports.local.journal import Journal
from timerwheel.transports.local.log import LocalCommitLog


@pytest.fixture
def rig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[EoRig]:
    monkeypatch.setattr(base, "CLAIM_EVERY_S", 0.0)
    r = EoRig(tmp_path, SimulatedClock(start_ms=SLOT + 50), "", log=LocalCommitLog(tmp_path / "log", fsync=False))
    yield r
    r.close()


def crash_at(log: Any, point: str) -> None:
    def fault(where: str) -> None:
        if where == point:
            raise Crash()

    log.journal_fault = fault


def torn_journal(_journal: Journal, _entries: Any) -> None:
    raise Crash()  # killed while the journal was written: the next take finds it torn, or empty


# test_exactly_once's tests that need no Kafka-only fault, run here on the local rig (pytest
# collects them in this module, with this module's ``rig``).
test_each_release_commits_with_its_progress_and_a_new_replica_reads_it_back = (
    test_exactly_once.test_each_release_commits_with_its_progress_and_a_new_replica_reads_it_back)
test_a_crash_after_the_commit_before_the_acknowledgement_delivers_once = (
    test_exactly_once.test_a_crash_after_the_commit_before_the_acknowledgement_delivers_once)
test_a_replica_paused_in_its_commit_after_another_delivered_its_records_and_r_moved_on_adds_no_copy = (
    test_exactly_once.test_a_replica_paused_in_its_commit_after_another_delivered_its_records_and_r_moved_on_adds_no_copy)


def test_wiring_gives_the_local_log_its_journal_deliveries(rig: EoRig) -> None:
    assert rig.deliveries is not None and isinstance(rig.deliveries(0), LocalShardDeliveries)
    assert rig.log.partitions(rig.config.effective_progress_topic) == rig.config.shards


@pytest.mark.parametrize("point", ["torn-journal", "journaled", "partition-written", "applied"])
def test_a_crash_inside_the_commit_delivers_once(rig: EoRig, monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    """Kafka's "after the produce, before the commit": here any step of the journal's."""
    put = rig.stage("a")
    rig.hand_over(deliver(1, SLOT + 10, rig.dest), deliver(2, SLOT + 20, rig.dest))
    with monkeypatch.context() as m:
        if point == "torn-journal":
            m.setattr(Journal, "write", torn_journal)
        else:
            crash_at(rig.log, point)
        with pytest.raises(Crash):
            put.step(0)
    rig.log.journal_fault = lambda where: None  # type: ignore[union-attr]
    assert rig.done() == 0
    second = rig.take_over()  # its take finishes (or drops) the journal, then reads the progress back
    assert rig.ids(rig.dest) == ["m1", "m2"] and rig.done() == 2
    assert len(rig.committed(rig.config.effective_progress_topic)) == 1
    dropped = second.ctx.metrics.counter("duplicates_dropped", shard=0)
    assert dropped == (0 if point == "torn-journal" else 2)


@pytest.mark.parametrize("where", ["torn-journal", "partition-written", "before-ack"])
def test_a_roll_hop_redone_after_a_crash_lands_once(rig: EoRig, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    hop = DeliverItem(ROLL, SLOT, START - 60_000, record(7, rig.dest, SLOT + 50 * 86_400_000), 0, 7)
    put = rig.stage("a")
    rig.hand_over(hop)

    def crash(*_args: Any) -> None:
        raise Crash()

    with monkeypatch.context() as m:
        if where == "torn-journal":
            m.setattr(Journal, "write", torn_journal)
        elif where == "partition-written":
            crash_at(rig.log, where)
        else:
            m.setattr(put, "_finish", crash)
        with pytest.raises(Crash):
            put.step(0)
    rig.log.journal_fault = lambda where: None  # type: ignore[union-attr]
    rig.take_over()
    hops = rig.committed(rig.config.timer_topic)
    assert [(r.header("tw-id"), r.header("tw-roll")) for r in hops] == [(b"m7", b"1")]
    assert rig.done() == 1


def test_the_progress_read_back_survives_a_reopened_log(rig: EoRig, tmp_path: Path) -> None:
    """A restart: a new log object on the same directory, a new stage, the same records handed
    over again (the in-process queues were lost; dequeue-get reads from R)."""
    put = rig.stage("a")
    rig.hand_over(deliver(1, SLOT + 10, rig.dest))
    put.step(0)
    put.close()
    rig.stages.remove(put)
    rig.log.close()
    rig.log = LocalCommitLog(tmp_path / "log", fsync=False)
    rig.deliveries = shard_deliveries(rig.config, rig.log)
    rig.hand_over(deliver(1, SLOT + 10, rig.dest), deliver(3, SLOT + 30, rig.dest))
    after = rig.stage("b")
    after.step(0)
    assert rig.ids(rig.dest) == ["m1", "m3"]
    assert after.ctx.metrics.counter("duplicates_dropped", shard=0) == 1
