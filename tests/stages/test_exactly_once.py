"""dequeue-put's exactly-once release on real Kafka (issue 31): crash points injected one by one,
each delivering exactly once for a ``read_committed`` reader.

dequeue-put runs alone over in-process queues on a simulated clock (``test_release.PutRig``'s
shape), its destination, timer and progress topics on the session's Kafka. A crash is an
exception the stage does not catch (``Crash``), after which its object is abandoned, its open
transaction and unacknowledged entries left as a killed process leaves them; a second replica
claims the entries and releases them again.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_dequeue_put_checks import record
from timerwheel import SimulatedClock, TimerConfig
from timerwheel.errors import ConfigError
from timerwheel.records import Record
from timerwheel.runtime.wiring import shard_deliveries
from timerwheel.stages import base, dequeue_put
from timerwheel.stages.base import StageContext
from timerwheel.stages.codec import DELIVER, REDIRECT, ROLL, DeliverEntry, DeliverItem, DoneEntry
from timerwheel.stages.dequeue_put import DequeuePut
from timerwheel.store import DequeueCheckpoint, EnqueueCheckpoint, Shard
from timerwheel.store.layout import open_reader_if_exists, open_shard
from timerwheel.transports.kafka import transactions
from timerwheel.transports.kafka.log import KafkaCommitLog
from timerwheel.transports.local.log import LocalCommitLog
from timerwheel.transports.memory import MemoryWorkQueue

#: Times near now: Kafka's retention (7 days) would delete records stamped in 2023 (``START`` of
#: the other stage tests) at its next check, and the read-back would miss them.
START = int(time.time()) * 1000 - 3_600_000
SLOT = START + 1_000


class Crash(BaseException):
    """The process dies here: nothing of the stage catches it."""


class EoRig:
    """dequeue-put in exactly-once mode over in-process queues, its topics on Kafka (or, given
    one, on a local log: ``test_exactly_once_local``)."""

    def __init__(self, tmp_path: Path, clock: SimulatedClock, bootstrap: str,
                 log: KafkaCommitLog | LocalCommitLog | None = None) -> None:
        uid = uuid.uuid4().hex[:8]
        self.clock = clock
        self.dest = f"tw-eo-{uid}-dest"
        self.config = TimerConfig(data_dir=str(tmp_path), shards=1, fsync=False, lookahead_ms=1_000,
                                  timer_topic=f"tw-eo-{uid}", dlq_topic=f"tw-eo-{uid}-dlq",
                                  delivery_guarantee="exactly-once")
        self.log = KafkaCommitLog(bootstrap) if log is None else log
        for topic in (self.dest, self.config.timer_topic, self.config.dlq_topic):
            self.log.ensure_topic(topic, 1)
        self.deliveries = shard_deliveries(self.config, self.log)
        self.writer: Shard = open_shard(self.config, 0, writer=True)
        self.writer.save_enqueue_checkpoint(EnqueueCheckpoint(flushed_pos=self.writer.flush(), write_ms=SLOT + 10_000,
                                                              next_offsets={}, epoch=1))
        self.writer.save_dequeue_checkpoint(DequeueCheckpoint(read_ms=SLOT, epoch=1))
        self.deliver_q = MemoryWorkQueue("deliver", 1, 64, clock=clock)
        self.done_q = MemoryWorkQueue("done", 1, 64, clock=clock)
        self.stages: list[DequeuePut] = []

    def stage(self, consumer: str) -> DequeuePut:
        ctx = StageContext(self.config, self.clock, consumer=consumer)
        put = DequeuePut(ctx, self.log, self.deliver_q, self.done_q, [0], lambda s: open_reader_if_exists(self.config, s),
                         deliveries=self.deliveries)
        self.stages.append(put)
        return put

    def hand_over(self, *items: DeliverItem) -> None:
        self.deliver_q.put(0, [DeliverEntry(0, 1 << dequeue_put.GENERATION_BITS, SLOT, 0, items).encode()], 1.0)

    def committed(self, topic: str) -> list[Record]:
        """What a read_committed reader of ``topic`` sees."""
        return self.log.read_since(topic, 0, 0)

    def ids(self, topic: str) -> list[str]:
        return sorted((r.header("tw-id") or b"").decode() for r in self.committed(topic))

    def done(self) -> int:
        got = self.done_q.get(0, "get", 100, 0)
        return sum(n for _eid, payload in got for n in DoneEntry.decode(payload).counts.values())

    def take_over(self) -> DequeuePut:
        """A second replica claims what a crashed one held, and releases it."""
        second = self.stage("b")
        self.deliver_q.heartbeat("b", 600_000)
        self.clock.advance(base.DEAD_IDLE_MS)
        second.step(0)
        return second

    def close(self) -> None:
        for put in self.stages:
            put.close()
        self.writer.close()
        self.log.close()


def deliver(offset: int, due: int, dest: str) -> DeliverItem:
    return DeliverItem(DELIVER, SLOT, START - 60_000, record(offset, dest, due), 0, offset)


@pytest.fixture
def rig(tmp_path: Path, kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[EoRig]:
    monkeypatch.setattr(base, "CLAIM_EVERY_S", 0.0)
    r = EoRig(tmp_path, SimulatedClock(start_ms=SLOT + 50), kafka_bootstrap)
    yield r
    r.close()


def test_each_release_commits_with_its_progress_and_a_new_replica_reads_it_back(rig: EoRig) -> None:
    put = rig.stage("a")
    rig.hand_over(deliver(1, SLOT + 10, rig.dest), deliver(2, SLOT + 20, rig.dest))
    put.step(0)
    assert rig.ids(rig.dest) == ["m1", "m2"] and rig.done() == 2
    progress = rig.committed(rig.config.effective_progress_topic)
    assert len(progress) == 1  # one transaction: both records and one progress record
    # dequeue-get reads the slot again (its crash): the same records come back, and leave no copy
    rig.hand_over(deliver(1, SLOT + 10, rig.dest), deliver(2, SLOT + 20, rig.dest))
    again = rig.stage("c")
    again.step(0)
    assert rig.ids(rig.dest) == ["m1", "m2"] and rig.done() == 2
    assert again.ctx.metrics.counter("duplicates_dropped", shard=0) == 2


def test_a_crash_after_the_produce_before_the_commit_delivers_once(rig: EoRig, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash_before_commit(producer: Any, failure: list[BaseException]) -> None:
        producer.flush()  # the records are on the brokers, in the open transaction
        failure.append(Crash())

    put = rig.stage("a")
    rig.hand_over(deliver(1, SLOT + 10, rig.dest), deliver(2, SLOT + 20, rig.dest))
    with monkeypatch.context() as m:
        m.setattr(transactions, "_commit", crash_before_commit)
        with pytest.raises(Crash):
            put.step(0)
    assert rig.ids(rig.dest) == [] and rig.done() == 0
    rig.take_over()  # its init aborts the open transaction; the read-back finds nothing done
    assert rig.ids(rig.dest) == ["m1", "m2"] and rig.done() == 2


def test_a_crash_after_the_commit_before_the_acknowledgement_delivers_once(
        rig: EoRig, monkeypatch: pytest.MonkeyPatch) -> None:
    put = rig.stage("a")
    rig.hand_over(deliver(1, SLOT + 10, rig.dest), deliver(2, SLOT + 20, rig.dest))

    def crash(*_args: Any) -> None:
        raise Crash()

    with monkeypatch.context() as m:
        m.setattr(put, "_finish", crash)
        with pytest.raises(Crash):
            put.step(0)
    assert rig.ids(rig.dest) == ["m1", "m2"] and rig.done() == 0
    second = rig.take_over()  # the entry comes back; the read-back says both left already
    assert rig.ids(rig.dest) == ["m1", "m2"] and rig.done() == 2
    assert second.ctx.metrics.counter("duplicates_dropped", shard=0) == 2


@pytest.mark.parametrize("kind", [ROLL, REDIRECT])
@pytest.mark.parametrize("where", ["before-commit", "before-ack"])
def test_a_roll_hop_redone_after_a_crash_lands_once(rig: EoRig, monkeypatch: pytest.MonkeyPatch, where: str,
                                                   kind: int) -> None:
    """A roll hop, or a reschedule's redirect (issue 31: the message put back as its next revision,
    which carries the reschedule record), commits in the batch's transaction: once."""
    rec = record(7, rig.dest, SLOT + 50 * 86_400_000)
    if kind == REDIRECT:
        rec = rec._replace(headers=(*rec.headers, ("tw-revision", b"1"), ("tw-replaces", str(SLOT).encode())))
    hop = DeliverItem(kind, SLOT, START - 60_000, rec, 0, 7)
    put = rig.stage("a")
    rig.hand_over(hop)

    def crash_before_commit(producer: Any, failure: list[BaseException]) -> None:
        producer.flush()
        failure.append(Crash())

    def crash(*_args: Any) -> None:
        raise Crash()

    with monkeypatch.context() as m:
        if where == "before-commit":
            m.setattr(transactions, "_commit", crash_before_commit)
        else:
            m.setattr(put, "_finish", crash)
        with pytest.raises(Crash):
            put.step(0)
    rig.take_over()
    hops = rig.committed(rig.config.timer_topic)
    assert [(r.header("tw-id"), r.header("tw-roll")) for r in hops] == [(b"m7", b"1")]
    assert rig.done() == 1
    if kind == REDIRECT:
        assert hops[0].header("tw-revision") == b"1" and hops[0].header("tw-replaces") is None


def test_a_commit_of_unknown_outcome_is_decided_by_the_next_take(rig: EoRig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit is sent but its answer never comes (a broker gone at that moment): the producer
    is dropped, the next take's init decides the transaction and the read-back says what it did."""
    calls = []

    def answer_lost(producer: Any, failure: list[BaseException]) -> None:
        producer.commit_transaction()
        calls.append(1)
        if len(calls) == 1:
            failure.append(transactions.kafka_errors.KafkaTimeoutError("commit answer lost"))

    monkeypatch.setattr(transactions, "_commit", answer_lost)
    put = rig.stage("a")
    rig.hand_over(deliver(1, SLOT + 10, rig.dest))
    put.step(0)
    assert rig.ids(rig.dest) == ["m1"] and rig.done() == 1
    assert put.ctx.metrics.counter("duplicates_dropped", shard=0) == 1
    assert put.ctx.metrics.counter("delivery_takes", shard=0) == 2


def test_a_log_without_transactions_or_a_journal_refuses_exactly_once_in_one_line(tmp_path: Path) -> None:
    config = TimerConfig(data_dir=str(tmp_path), delivery_guarantee="exactly-once")
    with pytest.raises(ConfigError, match="^delivery_guarantee: exactly-once needs a log with transactions") as refused:
        shard_deliveries(config, object())
    assert "\n" not in str(refused.value)
    assert shard_deliveries(TimerConfig(data_dir=str(tmp_path)), LocalCommitLog(tmp_path / "log2", fsync=False)) is None


def test_a_replica_paused_in_its_commit_after_another_delivered_its_records_and_r_moved_on_adds_no_copy(
        rig: EoRig) -> None:
    """The zombie: "a" built its round and is paused before its commit; meanwhile "b" claims the
    entry, delivers it, reports it, and R passes its slot. Resumed, "a" is fenced, takes the shard
    again and must read the progress back from the slot of its records, not from R."""
    first = rig.stage("a")
    rig.hand_over(deliver(1, SLOT + 10, rig.dest))
    first.step(0)  # taken, its commit done for nothing yet: hand the next one over
    assert rig.ids(rig.dest) == ["m1"]
    rig.hand_over(deliver(2, SLOT + 20, rig.dest))
    assert first._eo is not None
    commit = first._eo.commit

    def paused(*args: Any, **kwargs: Any) -> set[int] | None:
        rig.take_over()  # "b": claims the entry "a" holds, delivers m2 and reports it
        assert rig.ids(rig.dest) == ["m1", "m2"]
        rig.writer.save_dequeue_checkpoint(DequeueCheckpoint(read_ms=SLOT + 100, epoch=1))  # R past the slot
        first._dequeue_ckpts.clear()
        return commit(*args, **kwargs)

    first._eo.commit = paused  # type: ignore[method-assign]
    first.step(0)
    assert rig.ids(rig.dest) == ["m1", "m2"]
    assert first.ctx.metrics.counter("duplicates_dropped", shard=0) == 1
