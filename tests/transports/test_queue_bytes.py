"""TW_QUEUE_BYTES: a work queue's producer waits while a partition holds that many bytes, in
the in-process queue and in Redis (the stream's MEMORY USAGE)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from timerwheel.errors import QueueFullError
from timerwheel.transports.base import WorkQueue
from timerwheel.transports.memory import MemoryWorkQueue
from timerwheel.transports.redisq import RedisWorkQueue

ENTRY = b"x" * 60_000
MAX_BYTES = 100_000


@pytest.fixture(params=["memory", "redis"])
def queue(request: pytest.FixtureRequest) -> Iterator[WorkQueue]:
    if request.param == "memory":
        yield MemoryWorkQueue("bytes", 1, 100, max_bytes=MAX_BYTES)
        return
    client = redis.Redis.from_url(request.getfixturevalue("redis_url"))
    q = RedisWorkQueue(client, f"bytes-{uuid.uuid4().hex[:8]}", 1, 100, max_bytes=MAX_BYTES)
    yield q
    client.delete(q.key(0))
    client.close()


def test_a_producer_waits_while_the_partition_holds_max_bytes(queue: WorkQueue) -> None:
    queue.put(0, [ENTRY], 0.1)
    queue.put(0, [ENTRY], 0.1)  # 60 KB held, below the 100 KB: admitted whole
    with pytest.raises(QueueFullError, match="bytes"):
        queue.put(0, [ENTRY], 0.1)  # 120 KB held: waits, though 2 entries are far below the bound of 100
    assert queue.depth(0) == 2
    (entry_id, _payload), = queue.get(0, "c", 1, 0)
    queue.ack(0, [entry_id])
    queue.put(0, [ENTRY], 0.1)  # room again once an entry is acked
    assert queue.depth(0) == 2


def test_without_max_bytes_only_the_entry_bound_holds() -> None:
    q = MemoryWorkQueue("entries", 1, 3)
    q.put(0, [ENTRY] * 3, 0.1)
    with pytest.raises(QueueFullError):
        q.put(0, [ENTRY], 0.1)
