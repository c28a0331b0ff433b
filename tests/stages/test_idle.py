"""An idle installation costs almost nothing (issue 13).

The five stages run as in production: each with a context of its own (no in-process wake
reaches another stage, as between processes) and ``wait_on_inputs``, over real Redis work
queues and leases; the commit log is the local one. Idle, each stage wakes a few times a second
at most (counted: the runners' steps), yet a message scheduled while idle is delivered in the
tick it is due, on the simulated clock, without waiting for the idle W publication.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from timerwheel import SimulatedClock
from timerwheel.client import TimerClient
from timerwheel.clock import Clock, SystemClock
from timerwheel.config import TimerConfig
from timerwheel.metrics import Metrics
from timerwheel.runtime.runner import WAIT_ON_INPUTS_S, StageRunner, wait_until
from timerwheel.runtime.wiring import checkpoint_offsets_of
from timerwheel.stages import DequeueGet, DequeueGetMsg, DequeuePut, EnqueueGet, EnqueuePut, StageContext
from timerwheel.stages import enqueue_put as enqueue_put_module
from timerwheel.stages.codec import Q_DELIVER, Q_DONE, Q_FETCH, Q_PUT
from timerwheel.stages.ownership import Ownership
from timerwheel.store.layout import open_reader_if_exists, open_shard
from timerwheel.transports.local.log import LocalCommitLog
from timerwheel.transports.redisq import RedisLeaseStore, RedisWorkQueue

START = 1_700_000_000_000
TICK_MS = 100
#: A Redis database of this file's own: the queues' keys are the production ones.
DB = 11
#: Wake-ups per second an idle stage may make: its idle waits (1 s; dequeue-get one tick, as it
#: looks for a new W once a tick) with room to spare. Polling, as before issue 13, made 200.
MAX_WAKES_PER_S = {"enqueue-get": 3.0, "enqueue-put": 3.0, "dequeue-get": 1000 / TICK_MS + 2,
                   "dequeue-getmsg": 3.0, "dequeue-put": 3.0}
WINDOW_S = 3.0


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    parts = urlsplit(redis_url)
    c = redis.Redis.from_url(urlunsplit(parts._replace(path=f"/{DB}")))
    _clear(c)
    yield c
    _clear(c)
    c.close()


def _clear(c: redis.Redis) -> None:
    keys = list(c.scan_iter(match="tw:*", count=1000))
    if keys:
        c.delete(*keys)


class Installation:
    """The five production stages, each in a StageRunner with a context of its own."""

    def __init__(self, root: Path, client: redis.Redis, clock: Clock) -> None:
        self.config = cfg = TimerConfig(data_dir=str(root / "data"), tick_ms=TICK_MS, shards=2, timer_partitions=2,
                                        fsync=False)
        self.clock = clock
        self.log = LocalCommitLog(root / "log", default_partitions=1, fsync=False, clock=clock)
        self.log.ensure_topic(cfg.timer_topic, cfg.timer_partitions)
        self.log.ensure_topic(cfg.dlq_topic, 1)
        self.log.ensure_topic("dest", 1)
        queues = {name: RedisWorkQueue(client, name, cfg.shards, cfg.queue_bound)
                  for name in (Q_PUT, Q_FETCH, Q_DELIVER, Q_DONE)}
        leases = RedisLeaseStore(client)
        shards = range(cfg.shards)
        builders: dict[str, Callable[[StageContext], Any]] = {
            "enqueue-put": lambda ctx: EnqueuePut(ctx, shards, lambda s: open_shard(cfg, s, writer=True), queues[Q_PUT],
                                                  Ownership(leases, "enqueue-put", ctx.consumer, cfg.lease_ttl_ms),
                                                  input_ends=lambda: self.log.end_offsets(cfg.timer_topic)),
            "enqueue-get": lambda ctx: EnqueueGet(ctx, self.log, queues[Q_PUT], range(cfg.timer_partitions),
                                                  checkpoint_offsets_of(cfg)),
            "dequeue-get": lambda ctx: DequeueGet(ctx, shards, lambda s: open_reader_if_exists(cfg, s), queues[Q_FETCH],
                                                  queues[Q_DONE],
                                                  Ownership(leases, "dequeue-get", ctx.consumer, cfg.lease_ttl_ms)),
            "dequeue-getmsg": lambda ctx: DequeueGetMsg(ctx, self.log, queues[Q_FETCH], queues[Q_DELIVER], shards),
            "dequeue-put": lambda ctx: DequeuePut(ctx, self.log, queues[Q_DELIVER], queues[Q_DONE], shards,
                                                  lambda s: open_reader_if_exists(cfg, s)),
        }
        self.stages: dict[str, Any] = {}
        self.runners: dict[str, StageRunner] = {}
        for name, build in builders.items():
            ctx = StageContext(cfg, clock, Metrics(), consumer=f"{name}-idle-test", wait_on_inputs=True)
            self.stages[name] = stage = build(ctx)
            self.runners[name] = StageRunner(name, stage, ctx, idle_s=WAIT_ON_INPUTS_S)

    def start(self) -> None:
        for runner in self.runners.values():
            runner.start()
        owners = (self.stages["enqueue-put"], self.stages["dequeue-get"])
        assert wait_until(lambda: all(len(s.owned) == self.config.shards for s in owners)
                          and all(r.steps > 0 for r in self.runners.values()), 60, 0.05), "the stages did not start"

    def steps(self) -> dict[str, int]:
        return {name: r.steps for name, r in self.runners.items()}

    def write_ms(self) -> list[int]:
        """W of each shard as published (enqueue.ckpt)."""
        out = []
        for s in range(self.config.shards):
            view = open_reader_if_exists(self.config, s)
            assert view is not None
            ckpt = view.load_enqueue_checkpoint()
            view.close()
            assert ckpt is not None
            out.append(ckpt.write_ms)
        return out

    def close(self) -> None:
        for r in self.runners.values():
            r.ctx.stop.set()
        for r in self.runners.values():
            r.join()
            r.close()
        self.log.close()


@pytest.fixture
def install(tmp_path: Path, client: redis.Redis) -> Iterator[Callable[[Clock], Installation]]:
    made: list[Installation] = []

    def make(clock: Clock) -> Installation:
        inst = Installation(tmp_path, client, clock)
        made.append(inst)
        inst.start()
        return inst

    yield make
    for inst in made:
        inst.close()


def test_idle_stages_wake_a_few_times_a_second_and_w_still_moves(install: Callable[[Clock], Installation]) -> None:
    inst = install(SystemClock())
    before, w_before = inst.steps(), inst.write_ms()
    started = time.monotonic()
    time.sleep(WINDOW_S)  # the window the wake-ups are counted over, not a wait for a condition
    after, elapsed = inst.steps(), time.monotonic() - started
    rates = {name: (after[name] - before[name]) / elapsed for name in after}
    too_often = {name: round(rate, 1) for name, rate in rates.items() if rate > MAX_WAKES_PER_S[name]}
    assert not too_often, f"idle stages woke more often than allowed (per second): {too_often}"
    assert all(after[name] > before[name] for name in after), f"a stage stopped stepping: {before} -> {after}"
    assert all(a > b for a, b in zip(inst.write_ms(), w_before, strict=True)), "W did not move while idle"
    assert all(r.errors == 0 for r in inst.runners.values())


def test_a_message_scheduled_while_idle_is_delivered_in_its_tick(install: Callable[[Clock], Installation],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the slot holding the message may move W: the idle publication never comes.
    monkeypatch.setattr(enqueue_put_module, "IDLE_PUBLISH_S", 3600.0)
    clock = SimulatedClock(START)
    inst = install(clock)
    due = clock.now_ms() + 2_000
    TimerClient(inst.log, inst.config, clock).schedule("dest", b"v", deliver_at_ms=due)
    put = inst.stages["enqueue-put"]
    assert wait_until(lambda: sum(sum(st.next_offsets.values()) for st in list(put.owned.values())) == 1, 30, 0.02), \
        "the message did not reach the TimerLog"
    clock.set(due + TICK_MS)  # the end of its slot, and held there
    consumer = inst.log.consumer("dest", {0: 0})
    got: list[Any] = []
    assert wait_until(lambda: bool(got.extend(consumer.poll(10, 0)) or got), 30, 0.02), \
        f"not delivered while the clock stood at the end of its slot: {inst.steps()}"
    consumer.close()
    delivered_at = int(got[0].header("tw-delivered-at") or 0)
    assert due <= delivered_at <= due + TICK_MS


def test_a_message_due_mid_slot_is_delivered_without_waiting_for_the_slot_end(
        install: Callable[[Clock], Installation], monkeypatch: pytest.MonkeyPatch) -> None:
    # Neither the idle publication nor the slot's end comes: only W's steps inside the slot holding the message.
    monkeypatch.setattr(enqueue_put_module, "IDLE_PUBLISH_S", 3600.0)
    clock = SimulatedClock(START)
    inst = install(clock)
    due = clock.now_ms() + 2_050
    client = TimerClient(inst.log, inst.config, clock)
    client.schedule("dest", b"early", deliver_at_ms=due - 100)  # its slot ending publishes W into the next one
    client.schedule("dest", b"mid", deliver_at_ms=due)
    put = inst.stages["enqueue-put"]
    assert wait_until(lambda: sum(sum(st.next_offsets.values()) for st in list(put.owned.values())) == 2, 30, 0.02), \
        "the messages did not reach the TimerLog"
    clock.set(due - 20)
    assert wait_until(lambda: max(inst.write_ms()) == due - 20, 30, 0.02), "W not published past the early slot"
    step = enqueue_put_module.PUBLISH_STEP_MS
    clock.set(due + 2 * step)  # held there, mid-slot
    consumer = inst.log.consumer("dest", {0: 0})
    got: dict[bytes, int] = {}

    def mid_delivered() -> bool:
        got.update((r.value, int(r.header("tw-delivered-at") or 0)) for r in consumer.poll(10, 0))
        return b"mid" in got

    assert wait_until(mid_delivered, 30, 0.02), f"not delivered while the clock stood mid-slot: W {inst.write_ms()}"
    consumer.close()
    assert due <= got[b"mid"] <= due + 2 * step
