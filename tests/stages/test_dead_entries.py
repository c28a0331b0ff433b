"""A work-queue entry that cannot be decoded is moved aside once, never retried for ever.

Before, the decode error failed the stage's step; the entry stayed pending, was claimed again
and failed again: one corrupt or forged entry stalled its queue partition for good. Now it goes
to the queue's dead-entry stream with the reason, counted in ``dead_entries``, and the entries
beside it are served.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from test_dequeue_put_checks import shard_with_w
from timerwheel import SimulatedClock, TimerConfig
from timerwheel.records import Record
from timerwheel.stages.base import StageContext
from timerwheel.stages.codec import DELIVER, DeliverEntry, DeliverItem, PutEntry, PutRequest
from timerwheel.stages.dequeue_put import DequeuePut
from timerwheel.stages.enqueue_put import EnqueuePut
from timerwheel.stages.ownership import Ownership
from timerwheel.store.layout import open_reader_if_exists, open_shard
from timerwheel.transports.local.log import LocalCommitLog
from timerwheel.transports.memory import MemoryLeaseStore, MemoryWorkQueue
from timerwheel.transports.redisq import RedisWorkQueue

START = 1_700_000_000_000
GARBAGE = b"\xc1 not msgpack \xff"


def deliver_entry(offset: int) -> bytes:
    rec = Record("__timer", 0, offset, START, b"k", b"v",
                 (("tw-topic", b"dest"), ("tw-deliver-at", str(START - 1).encode()), ("tw-id", f"m{offset}".encode())))
    return DeliverEntry(0, 1, START, 0, (DeliverItem(DELIVER, START, START, rec, 0, offset),)).encode()


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def test_dequeue_put_moves_an_undecodable_entry_aside_in_redis(tmp_path: Path, client: redis.Redis) -> None:
    clock = SimulatedClock(START)
    config = TimerConfig(data_dir=str(tmp_path), shards=1, fsync=False)
    ctx = StageContext(config, clock, consumer="me")
    log = LocalCommitLog(tmp_path / "log", fsync=False, clock=clock)
    name = f"deliver-{uuid.uuid4().hex[:8]}"
    deliver_q = RedisWorkQueue(client, name, 1, 64)
    done_q = MemoryWorkQueue("done", 1, 64)
    shard_with_w(config, START)
    stage = DequeuePut(ctx, log, deliver_q, done_q, [0], lambda s: open_reader_if_exists(config, s))
    try:
        deliver_q.put(0, [deliver_entry(1), GARBAGE, deliver_entry(2)], 1.0)
        stage.step(0)
        assert deliver_q.depth(0) == 0, "the garbage entry is not left pending"
        [(entry_id, payload, reason)] = deliver_q.dead_entries(0)
        assert payload == GARBAGE and reason and entry_id
        assert ctx.metrics.counter("dead_entries") == 1
        consumer = log.consumer("dest", {0: 0})
        assert [r.header("tw-id") for r in consumer.poll(10, 0)] == [b"m1", b"m2"]
        consumer.close()
        stage.step(0)  # nothing is retried
        assert ctx.metrics.counter("dead_entries") == 1 and ctx.metrics.counter("stage_errors") == 0
    finally:
        client.delete(deliver_q.key(0), deliver_q.dead_key(0))
        log.close()


def test_enqueue_put_moves_an_undecodable_entry_aside(tmp_path: Path) -> None:
    clock = SimulatedClock(START)
    config = TimerConfig(data_dir=str(tmp_path), shards=1, fsync=False)
    ctx = StageContext(config, clock)
    queue = MemoryWorkQueue("put", 1, 64)
    put = EnqueuePut(ctx, [0], lambda s: open_shard(config, s, writer=True), queue,
                     Ownership(MemoryLeaseStore(clock), "enqueue-put", "me", 10_000))
    try:
        good = PutEntry.of(0, 0, 2, [PutRequest(o, 10, START, START + 5_000, False, 7, o) for o in range(2)]).encode()
        queue.put(0, [good, GARBAGE], 1.0)
        put.step(0)
        assert put.owned[0].next_offsets == {0: 2}
        assert [p for _i, p, _r in queue.dead_entries(0)] == [GARBAGE]
        assert queue.depth(0) == 0
    finally:
        put.close()
