"""Chaos under a steady load: crashes, a Redis wipe, a broker restart, a torn TimerLog tail.

Each run reports scheduled, delivered, lost, duplicated and late (> 1 s). Nothing may be lost.
A sixth of the messages is cancelled 30 to 1,500 ms before it is due, through the disruptions
(among them a SIGSTOP of dequeue-get for half the roll window in the SIGKILL runs): no cancel
acknowledged before its target's delivery time may leak. The producer records when each cancel
was acknowledged (by its clock, once the broker's answer is in); a cancel acknowledged only at or
after its target's delivery time, or never, is not counted, since it may rightly miss. W waits
for the input (up to the timer partitions' high watermarks), so a cancel that enqueue-get reads
late still meets its target, and W stays within a third of the roll window of R (6.5 s here), so
a roll hop read late by a dequeue-get that falls behind on a loaded machine still comes back into
the slot of its delivery time, where its cancel is (issue 30: such leaks were counted apart
before). A leak fails the run; its message says which leaked cancels' targets had a roll hop
written after their delivery time (``late_hops``), the first thing to look at.

Duplicates are bounded, and the bound is computed from the run (``Ledger``):

* every dequeue-side disruption (a crash of dequeue-get, dequeue-getmsg or dequeue-put, a Redis
  wipe or restart, a broker restart) may re-deliver what was in flight: at most
  ``max_in_flight + batch_size`` messages per shard;
* a disruption that makes dequeue-get start over from ``R`` (its crash, or a lost lease after a
  Redis wipe) may also re-deliver what was already delivered in the slots from ``R`` on. ``R``
  only passes a slot once all of it is done, so while entries of a crashed stateless stage wait to
  be claimed (30 s), ``R`` lags and this is more than the in-flight window: the ledger counts the
  messages in those slots from ``R`` as read just before the disruption;
* a TimerLog record cut off after it was checkpointed may be delivered once more.

Invalid timer records (no ``tw-topic``) are sent through the disruptions of the SIGKILL and the
Redis/Kafka runs: the dead-letter topic, read ``read_committed``, must hold exactly them, each
once (issue 31: before enqueue-get's dead-letter transactions a restart dead-lettered again
everything after its checkpoint).
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import pytest
from harness import (
    DEQUEUE_SIDE,
    STAGES,
    Collector,
    LoadRun,
    Pipeline,
    TimerProducer,
    late_hops,
    leak_facts,
    make_report,
    now_ms,
)
from infra import ServerControl
from two_mounts import two_mounts

pytestmark = pytest.mark.e2e

SHARDS = 2
MAX_IN_FLIGHT = 200
BATCH_SIZE = 100
ROLL_WINDOW_MS = 20_000
CANCEL_FRACTION = 1 / 6
#: Each cancel is sent this many ms before its target is due, uniformly (issue 30: 30-1,500 ms).
CANCEL_BEFORE_MS = (30, 1_500)
MIN_CANCELS_IN_TIME = 50
#: dequeue-get is paused (SIGSTOP) this long once: more than a third of the roll window.
STOPPED_S = 10
#: A dead consumer's work-queue entries are claimed after 30 s idle, checked every 1000 steps.
RECLAIM_S = 60


class InvalidRecords:
    """Invalid timer records sent during a run, and the dead-letter topic read ``read_committed``."""

    def __init__(self, pipe: Pipeline, run: LoadRun) -> None:
        self.producer = run.producer
        self.collector = Collector(pipe, [pipe.dlq_topic], read_committed=True)
        self.sent = 0
        #: Keys of the records the broker acknowledged (a send that failed may still have landed).
        self.acked: set[bytes] = set()
        self._lock = threading.Lock()

    def send(self, count: int = 10) -> None:
        for _ in range(count):
            key = f"invalid-{self.sent}".encode()
            future = self.producer.send_raw([("tw-id", key)], key, b"invalid", self.sent % self.producer.partitions)
            self.sent += 1
            future.add_callback(lambda _md, k=key: self._acked(k))

    def _acked(self, key: bytes) -> None:
        with self._lock:
            self.acked.add(key)

    def check(self, name: str, timeout_s: float = 60) -> None:
        """Every acknowledged invalid record dead-lettered, each once, and nothing else."""
        self.producer.flush()
        with self._lock:
            acked = set(self.acked)
        deadline = time.monotonic() + timeout_s
        while acked - {d.key for d in list(self.collector.records)} and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)  # late copies
        counts = Counter(d.key for d in list(self.collector.records))
        sent = {f"invalid-{i}".encode() for i in range(self.sent)}
        print(f"[{name}] invalid sent={self.sent} acknowledged={len(acked)} dead letters={sum(counts.values())}",
              flush=True)
        assert not acked - set(counts), f"not dead-lettered: {sorted(acked - set(counts))[:10]}"
        assert not {k: c for k, c in counts.items() if c > 1}, \
            f"dead-lettered twice or more: {[(k, c) for k, c in counts.items() if c > 1][:10]}"
        assert set(counts) <= sent, f"dead letters of other records: {sorted(set(counts) - sent, key=str)[:10]}"

    def close(self) -> None:
        self.collector.close()


def cut_timerlog_tails(pipe: Pipeline, cut: int = 32) -> int:
    """Cut ``cut`` bytes off the newest TimerLog segment of every shard: the last record torn in
    half, as a crash in the middle of a write would leave it. Returns the records damaged."""
    damaged = 0
    for shard in range(SHARDS):
        segments = sorted((pipe.shard_dir(shard) / "timerlog").glob("*.tlog"))
        if segments and segments[-1].stat().st_size >= 64:
            size = segments[-1].stat().st_size
            with open(segments[-1], "r+b") as f:
                f.truncate(size - cut)
            damaged += 1
    return damaged


class Ledger:
    """The disruptions of a run and the duplicates each may cause (see the module docstring)."""

    def __init__(self, pipe: Pipeline, producer: TimerProducer) -> None:
        self.pipe = pipe
        self.producer = producer
        self.events: list[tuple[int, str]] = []
        self.bound = 0

    def disrupt(self, label: str, dequeue_side: bool, rereads_from_r: bool) -> None:
        """Call just before the disruption: reads R now, while the disrupted stage still ran."""
        now = now_ms()
        reads = [self.pipe.checkpoint(s, "dequeue")["read_ms"] for s in range(SHARDS)]
        self.events.append((now, f"{label} (R lag {[now - r for r in reads]} ms)"))
        if dequeue_side:
            self.bound += SHARDS * (MAX_IN_FLIGHT + BATCH_SIZE)
        if rereads_from_r:
            self.bound += self.rereadable(reads, now)

    def rereadable(self, reads: list[int], at_ms: int) -> int:
        """Messages whose record may sit in a slot from R on that was already read: due between R
        and now in their shard, or rolled (a roll hop may be there)."""
        n = 0
        for m in list(self.producer.messages.values()):
            r = reads[m.partition % SHARDS]
            if m.sent_ms <= at_ms and m.deliver_at_ms >= r - 100 and (
                    m.deliver_at_ms <= at_ms + 1_000 or m.deliver_at_ms - m.sent_ms >= ROLL_WINDOW_MS):
                n += 1
        return n


def duplicates_after(collector: Collector, events: list[tuple[int, str]]) -> dict[str, int]:
    """Duplicates by the disruption that came last before each extra copy was delivered."""
    out: dict[str, int] = {}
    for copies in list(collector.by_id.values()):
        for d in sorted(copies, key=lambda c: c.delivered_at_ms)[1:]:
            label = "before any"
            for at, what in events:
                if at <= d.delivered_at_ms:
                    label = what
            out[label] = out.get(label, 0) + 1
    return out


def finish(pipe: Pipeline, run: LoadRun, name: str, ledger: Ledger, damaged: int, max_delay_ms: int,
           exactly_once: bool = False) -> None:
    """Drain the run and check it; ``exactly_once``: not one duplicate (the collector reads
    ``read_committed``)."""
    missing, rep = run.drain(name, max_delay_ms / 1000 + RECLAIM_S)
    bound = 0 if exactly_once else ledger.bound + damaged
    print(f"[{name}] disruptions={len(ledger.events)} records cut={damaged} duplicate bound={bound} "
          f"load sent={run.load.sent} send errors={run.load.errors}", flush=True)
    print(f"[{name}] duplicates by the disruption before them: {duplicates_after(run.collector, ledger.events)}",
          flush=True)
    in_time = run.producer.cancels_in_time()
    leaked = rep.cancelled_delivered
    print(f"[{name}] cancels sent={run.load.cancels} acknowledged before due={len(in_time)} "
          f"leaked={len(leaked)}", flush=True)
    assert not pipe.dead(), f"stages died: {pipe.dead()}\n{pipe.tails(pipe.dead())}"
    assert not missing and not rep.lost, (
        f"lost {len(rep.lost)} of {rep.scheduled}: {rep.lost[:20]}\n"
        f"{[run.producer.messages[m] for m in rep.lost[:5]]}\n{pipe.tails()}")
    assert rep.duplicated <= bound, f"{rep.duplicated} duplicates, more than the bound {bound}\n{rep.line()}"
    assert not rep.early, f"delivered early: {rep.early[:10]}"
    assert not rep.early_received, f"received before their time: {rep.early_received[:10]}"
    assert rep.scheduled >= run.load.rate * 30, f"the load only got {rep.scheduled} messages scheduled"
    # A broker restart holds acknowledgements back: a cancel acknowledged only after its target
    # was due may miss and is not counted; enough others must remain for the check to mean something.
    assert len(in_time) >= MIN_CANCELS_IN_TIME, f"only {len(in_time)} cancels acknowledged in time"
    assert not leaked, (
        f"{len(leaked)} of {len(in_time)} cancels acknowledged before their target's delivery "
        f"time leaked: {[(m, in_time[m].deliver_at_ms, run.producer.cancel_acked.get(m)) for m in leaked[:5]]}; "
        f"of them with a roll hop written after the delivery time (id -> its timestamp): "
        f"{late_hops(pipe, {m: in_time[m] for m in leaked})}\ndisruptions: {ledger.events}\n"
        f"{leak_facts(pipe, leaked[:5], SHARDS)}")


def test_sigkill_each_stage_in_turn_and_two_at_once_loses_nothing(
    tmp_path: Path, kafka_bootstrap: str, redis_url: str
) -> None:
    """SIGKILL every stage at a random moment and restart it; then two at once. enqueue-put's
    TimerLog gets its last record torn in half before enqueue-put restarts."""
    sigkill_each_stage(Pipeline(tmp_path, kafka_bootstrap, redis_url, shards=SHARDS, max_in_flight=MAX_IN_FLIGHT,
                                batch_size=BATCH_SIZE, roll_window_ms=ROLL_WINDOW_MS), "chaos-kill")


def test_the_same_with_enqueue_and_dequeue_stages_on_two_nodes_of_a_shared_volume(
    tmp_path: Path, kafka_bootstrap: str, redis_url: str
) -> None:
    """The enqueue stages through one ``bindfs -o auto_cache`` mount of the data directory, the
    dequeue stages through another (two page caches, as two nodes of an NFS volume)."""
    with two_mounts(tmp_path / "volume") as mounts:
        sigkill_each_stage(Pipeline(tmp_path, kafka_bootstrap, redis_url, mounts=mounts, shards=SHARDS,
                                    max_in_flight=MAX_IN_FLIGHT, batch_size=BATCH_SIZE,
                                    roll_window_ms=ROLL_WINDOW_MS), "chaos-kill-two-mounts")


def sigkill_each_stage(pipe: Pipeline, name: str) -> None:
    dest = pipe.new_dest("load", 2)
    rng = random.Random(17)
    damaged = 0
    with pipe.running(), LoadRun(pipe, dest, seed=17, rate=60, min_delay_ms=500, max_delay_ms=25_000,
                                   cancel_fraction=CANCEL_FRACTION, cancel_before_ms=CANCEL_BEFORE_MS) as run:
        ledger = Ledger(pipe, run.producer)
        invalid = InvalidRecords(pipe, run)
        rounds = [[s] for s in STAGES] + [rng.sample(STAGES, 2), rng.sample(STAGES, 2)]
        for victims in rounds:
            time.sleep(rng.uniform(2.0, 5.0))
            invalid.send()
            for victim in victims:  # not ``name``: the run's, which finish() prints
                ledger.disrupt(f"kill {victim}", victim in DEQUEUE_SIDE, victim == "dequeue-get")
                pipe.kill(victim, signal.SIGKILL)
            if "enqueue-put" in victims:
                damaged += cut_timerlog_tails(pipe)
            time.sleep(rng.uniform(0.2, 1.5))
            for victim in victims:
                pipe.start(victim, wait_ready=False)
            for victim in victims:
                pipe.wait_ready(victim)
        # dequeue-get paused for longer than a third of the roll window: W must stay within that
        # of R, so the roll hops it reads late still come back into their delivery time's slot.
        ledger.disrupt("stop dequeue-get", True, True)
        pipe.kill("dequeue-get", signal.SIGSTOP)
        time.sleep(STOPPED_S)
        pipe.kill("dequeue-get", signal.SIGCONT)
        time.sleep(3)
        finish(pipe, run, name, ledger, damaged, 25_000)
        invalid.check(name)
        invalid.close()
        recovered = [line for line in pipe.log_lines("enqueue-put") if line.get("event") == "recovered"]
        assert any(line["truncated_bytes"] > 0 for line in recovered), recovered
        pipe.stop_cleanly()


def test_redis_and_broker_restarts_lose_nothing_and_exactly_once_through_them_and_sigkills_duplicates_nothing(
    tmp_path: Path, kafka_bootstrap: str, redis_url: str, kafka_control: ServerControl, redis_control: ServerControl
) -> None:
    """Two pipelines side by side through the same Redis and broker disruptions (one run of them
    instead of two: the suite's time).

    At least once: Redis is a transport, not a store: after FLUSHALL or a restart (the script's
    Redis keeps nothing) the stages recreate their groups and the shard owners replay from their
    checkpoints. A Kafka broker restart is waited out. Duplicates within the ledger's bound.

    Exactly once (TW_DELIVERY_GUARANTEE, issue 31), read ``read_committed``: before those, every
    stage SIGKILLed in turn (enqueue-put's TimerLog tail torn meanwhile). 0 duplicates.

    Both: 0 lost, 0 early, no cancel acknowledged in time leaked (cancels and rolled messages are
    among the load), and the dead-letter topic exactly the invalid records, each once."""
    settings = {"shards": SHARDS, "max_in_flight": MAX_IN_FLIGHT, "batch_size": BATCH_SIZE,
                "roll_window_ms": ROLL_WINDOW_MS}
    alo = Pipeline(tmp_path / "at-least-once", kafka_bootstrap, redis_url, **settings)
    eo = Pipeline(tmp_path / "exactly-once", kafka_bootstrap, redis_url, delivery_guarantee="exactly-once", **settings)
    names = {alo: "chaos-redis-kafka", eo: "chaos-exactly-once"}
    rng = random.Random(31)
    damaged = 0
    with ExitStack() as stack:
        for pipe in (alo, eo):
            stack.enter_context(pipe.running())
        runs = {pipe: stack.enter_context(LoadRun(pipe, pipe.new_dest("load", 2), seed=seed, rate=60, min_delay_ms=500,
                                                  max_delay_ms=25_000, cancel_fraction=CANCEL_FRACTION,
                                                  cancel_before_ms=CANCEL_BEFORE_MS, read_committed=pipe is eo))
                for pipe, seed in ((alo, 23), (eo, 31))}
        ledgers = {pipe: Ledger(pipe, run.producer) for pipe, run in runs.items()}
        invalid = {pipe: InvalidRecords(pipe, run) for pipe, run in runs.items()}

        def disrupt(label: str, rereads_from_r: bool) -> None:
            for pipe in (alo, eo):
                invalid[pipe].send()
                ledgers[pipe].disrupt(label, True, rereads_from_r)

        for victim in STAGES:
            time.sleep(rng.uniform(1.5, 3.5))
            invalid[eo].send()
            ledgers[eo].disrupt(f"kill {victim}", victim in DEQUEUE_SIDE, victim == "dequeue-get")
            eo.kill(victim, signal.SIGKILL)
            if victim == "enqueue-put":
                damaged += cut_timerlog_tails(eo)
            time.sleep(rng.uniform(0.2, 1.0))
            eo.start(victim)
        disrupt("redis flushall", True)  # the shard owners lose their leases
        alo.redis.flushall()
        time.sleep(6)
        disrupt("redis restart", True)
        redis_control.restart()  # everything lost again, and connections refused meanwhile
        time.sleep(6)
        disrupt("kafka restart", False)
        kafka_control.restart()
        time.sleep(10)
        for pipe in (alo, eo):
            assert not pipe.dead(), pipe.tails(pipe.dead())
            for stage in STAGES:
                pipe.wait_ready(stage, 60)
        for run in runs.values():
            run.load.stop()  # both loads end together
        for pipe in (alo, eo):
            finish(pipe, runs[pipe], names[pipe], ledgers[pipe], damaged if pipe is eo else 0, 25_000,
                   exactly_once=pipe is eo)
            invalid[pipe].check(names[pipe])
            invalid[pipe].close()
        takes = [line for line in eo.log_lines("dequeue-put") if line.get("event", "").startswith("shard deliveries taken")]
        assert takes, "dequeue-put never took a shard's deliveries: exactly-once was not on"
        for pipe in (alo, eo):
            pipe.stop_cleanly()


def test_a_torn_timerlog_tail_is_read_again_from_kafka(tmp_path: Path, kafka_bootstrap: str, redis_url: str) -> None:
    """The last record of each shard's TimerLog, checkpointed as durable, torn in half while
    enqueue-put is down: the restarted owner cuts it off and reads its source again from Kafka."""
    pipe = Pipeline(tmp_path, kafka_bootstrap, redis_url, shards=SHARDS)
    dest = pipe.new_dest("torn", 2)
    with pipe.running(), TimerProducer(pipe, seed=29) as producer, Collector(pipe, [dest]) as collector:
        due = now_ms() + 12_000
        for i in range(200):
            producer.schedule(dest, due + i * 10)
        producer.flush()
        deadline = time.monotonic() + 20
        while sum(sum(pipe.checkpoint(s)["next_offsets"].values()) for s in range(SHARDS)) < 200:
            assert time.monotonic() < deadline, pipe.tails(["enqueue-get", "enqueue-put"])
            time.sleep(0.1)
        pipe.kill("enqueue-put", signal.SIGKILL)
        assert cut_timerlog_tails(pipe) == SHARDS
        pipe.start("enqueue-put")
        missing = collector.wait_for(producer.expected(), 40, pipe)
        time.sleep(1)
        rep = make_report("torn-tail", producer, collector)
        assert not missing and not rep.lost, f"lost {rep.lost}\n{pipe.tails(['enqueue-put'])}"
        assert rep.duplicated == 0, rep.line()
        assert len([e for e in pipe.log_lines("enqueue-put") if e.get("event") == "recovered"
                    and e["truncated_bytes"] == 32]) == SHARDS
        pipe.stop_cleanly()  # the restarted owner stops on SIGTERM like the others
