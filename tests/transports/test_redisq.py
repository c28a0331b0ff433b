"""Redis Streams work queues and Redis leases, against a real redis-server."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from infra import ServerControl
from timerwheel.errors import QueueFullError
from timerwheel.transports.redisq import RedisLeaseStore, RedisTransportError, RedisWorkQueue


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@pytest.fixture
def flushable(client: redis.Redis, redis_control: ServerControl) -> redis.Redis:
    """``client``, for a test that runs FLUSHALL: only on the server the tests started themselves
    (scripts/redis.sh), never on one that ``TW_REDIS_URL`` names, whose data may be someone's."""
    if not redis_control.managed:
        pytest.fail(f"refused: this test runs FLUSHALL, and Redis at {redis_control.address} (TW_REDIS_URL) was "
                    f"not started by the tests; unset TW_REDIS_URL to let them start their own", pytrace=False)
    return client


def queue(client: redis.Redis, partitions: int = 2, bound: int = 100) -> RedisWorkQueue:
    return RedisWorkQueue(client, f"t-{uuid.uuid4().hex[:8]}", partitions, bound)


# -- work queue -------------------------------------------------------------------------------


def test_get_hands_out_entries_in_order_once_and_ack_removes_them(client: redis.Redis) -> None:
    q = queue(client)
    q.put(1, [b"a", b"b", b"c"], timeout_s=1)
    first = q.get(1, "c1", max_entries=2, timeout_s=1)
    assert [payload for _, payload in first] == [b"a", b"b"]
    assert [payload for _, payload in q.get(1, "c2", 10, 0.05)] == [b"c"]
    assert q.get(1, "c2", 10, 0.05) == []
    assert q.get(0, "c1", 10, 0.05) == []  # partitions are separate streams
    assert q.depth(1) == 3  # pending entries still count
    assert set(q.pending(1).values()) == {"c1", "c2"}
    q.ack(1, [entry_id for entry_id, _ in first])
    assert q.depth(1) == 1
    assert list(q.pending(1).values()) == ["c2"]


def test_get_many_takes_every_partitions_entries_in_one_call(client: redis.Redis) -> None:
    q = queue(client, partitions=3)
    q.put(0, [b"a0", b"b0"], timeout_s=1)
    q.put(2, [b"a2"], timeout_s=1)
    got = q.get_many([0, 1, 2], "c", max_entries=1, timeout_s=0)
    assert {p: [payload for _, payload in entries] for p, entries in got.items()} == {0: [b"a0"], 2: [b"a2"]}
    assert set(q.pending(0).values()) == {"c"}
    assert q.get_many([0, 1, 2], "c", 10, 0)[0][0][1] == b"b0"
    assert q.get_many([0, 1, 2], "c", 10, 0) == {}


def test_get_many_blocks_until_an_entry_of_any_partition_arrives(client: redis.Redis) -> None:
    q = queue(client, partitions=2)
    late = threading.Timer(0.2, lambda: q.put(1, [b"late"], timeout_s=1))
    late.start()
    got = q.get_many([0, 1], "c", 10, timeout_s=30)
    late.join()  # its put may still read its answer: the client closes after the test
    assert {p: [payload for _, payload in entries] for p, entries in got.items()} == {1: [b"late"]}


def test_get_many_recreates_a_vanished_group(client: redis.Redis) -> None:
    q = queue(client, partitions=2)
    q.put(1, [b"x"], timeout_s=1)
    assert q.get_many([0, 1], "c", 10, 0)
    client.delete(q.key(0), q.key(1))  # as after FLUSHALL
    q.put(0, [b"y"], timeout_s=1)
    assert [payload for _, payload in q.get_many([0, 1], "c", 10, 0)[0]] == [b"y"]


def test_binary_payloads_survive_untouched(client: redis.Redis) -> None:
    q = queue(client)
    payloads = [bytes(range(256)), b"", b"\x00\xff" * 5000]
    q.put(0, payloads, timeout_s=1)
    assert [p for _, p in q.get(0, "c", 10, 1)] == payloads


def test_get_waits_at_most_its_timeout(client: redis.Redis) -> None:
    q = queue(client)
    started = time.monotonic()
    assert q.get(0, "c", 10, timeout_s=0.3) == []
    assert 0.25 <= time.monotonic() - started < 1.5
    started = time.monotonic()
    assert q.get(0, "c", 10, timeout_s=0) == []
    assert time.monotonic() - started < 0.5


def test_get_returns_as_soon_as_an_entry_arrives(client: redis.Redis) -> None:
    q = queue(client)
    threading.Timer(0.2, lambda: q.put(0, [b"late"], timeout_s=1)).start()
    started = time.monotonic()
    got = q.get(0, "c", 10, timeout_s=5)
    assert [p for _, p in got] == [b"late"]
    assert time.monotonic() - started < 2


def test_put_blocks_at_the_bound_and_raises_queue_full_after_its_timeout(client: redis.Redis) -> None:
    q = queue(client, bound=3)
    q.put(0, [b"1", b"2"], timeout_s=1)
    q.put(0, [b"3", b"4"], timeout_s=1)  # 2 < 3: admitted whole, past the bound
    assert q.depth(0) == 4
    started = time.monotonic()
    with pytest.raises(QueueFullError, match="partition 0 still held 4 entries"):
        q.put(0, [b"5"], timeout_s=0.3)
    assert 0.25 <= time.monotonic() - started < 2
    assert q.depth(0) == 4  # nothing of the refused batch went in
    q.put(1, [b"other"], timeout_s=0.1)  # the bound is per partition


def test_a_blocked_put_goes_through_once_entries_are_acked(client: redis.Redis) -> None:
    q = queue(client, bound=2)
    q.put(0, [b"1", b"2"], timeout_s=1)
    got = q.get(0, "c", 10, 1)  # pending entries still hold the bound
    threading.Timer(0.3, lambda: q.ack(0, [entry_id for entry_id, _ in got])).start()
    started = time.monotonic()
    q.put(0, [b"3"], timeout_s=5)
    assert time.monotonic() - started >= 0.25
    assert [p for _, p in q.get(0, "c", 10, 1)] == [b"3"]


def test_claim_stale_gives_a_dead_consumers_entries_to_another(client: redis.Redis) -> None:
    q = queue(client)
    q.put(0, [b"a", b"b", b"c"], timeout_s=1)
    taken = q.get(0, "dies", 2, 1)
    assert q.claim_stale(0, "rescuer", idle_ms=60_000, max_entries=10) == []  # not idle long enough
    time.sleep(0.15)
    claimed = q.claim_stale(0, "rescuer", idle_ms=100, max_entries=10)
    assert claimed == taken
    assert set(q.pending(0).values()) == {"rescuer"}
    q.ack(0, [entry_id for entry_id, _ in claimed])
    assert [p for _, p in q.get(0, "rescuer", 10, 1)] == [b"c"]


def test_a_touched_entry_is_not_stale_and_a_touch_never_takes_one_back(client: redis.Redis) -> None:
    q = queue(client)
    q.put(0, [b"a", b"b"], timeout_s=1)
    (held,), (other,) = q.get(0, "holder", 1, 1), q.get(0, "other", 1, 1)
    time.sleep(0.15)
    assert q.touch(0, "holder", [held[0], other[0], "1-1"]) == [other[0], "1-1"]  # not its own: left alone
    assert q.claim_stale(0, "thief", idle_ms=100, max_entries=10) == [other]  # idle: taken
    assert q.pending(0) == {held[0]: "holder", other[0]: "thief"}  # touched: kept


def test_entries_of_a_consumer_whose_heartbeat_lapsed_are_claimed_early(client: redis.Redis) -> None:
    q = queue(client)
    q.put(0, [b"a", b"b", b"c"], timeout_s=1)
    q.heartbeat("killed", ttl_ms=300)
    q.heartbeat("slow", ttl_ms=60_000)
    killed = q.get(0, "killed", 2, 1)
    slow = q.get(0, "slow", 1, 1)
    time.sleep(0.1)
    # Both still alive: nothing moves before idle_ms.
    assert q.claim_stale(0, "r", idle_ms=60_000, max_entries=10, dead_idle_ms=50) == []
    time.sleep(0.4)  # "killed"'s heartbeat has lapsed, "slow"'s has not
    assert q.claim_stale(0, "r", idle_ms=60_000, max_entries=10, dead_idle_ms=50) == killed
    pending = q.pending(0)
    assert sorted(pending.values()) == ["r", "r", "slow"]
    # The dead consumer held nothing more, so it left the group; the live one stays.
    names = {c["name"].decode() for c in client.xinfo_consumers(q.key(0), q.group)}
    assert "killed" not in names and "slow" in names
    assert [p for _, p in slow] == [b"c"]
    # Without dead_idle_ms, the old rule only.
    assert q.claim_stale(0, "r2", idle_ms=60_000, max_entries=10) == []


def test_a_consumer_that_stopped_says_so_and_its_entries_move_on_without_its_ttl(client: redis.Redis) -> None:
    q = queue(client)
    q.put(0, [b"a"], timeout_s=1)
    q.heartbeat("stopping", ttl_ms=60_000)
    left = q.get(0, "stopping", 1, 1)
    time.sleep(0.1)
    assert q.claim_stale(0, "r", idle_ms=60_000, max_entries=10, dead_idle_ms=50) == []  # alive
    q.heartbeat("stopping", ttl_ms=0)  # Heartbeat.end: the process stopped
    assert q.claim_stale(0, "r", idle_ms=60_000, max_entries=10, dead_idle_ms=50) == left


def test_claim_stale_respects_max_entries_across_a_long_pending_list(client: redis.Redis) -> None:
    q = queue(client, bound=1000)
    q.put(0, [b"%d" % i for i in range(300)], timeout_s=1)
    q.get(0, "dies", 300, 1)
    time.sleep(0.05)
    first = q.claim_stale(0, "r", idle_ms=10, max_entries=250)
    assert len(first) == 250
    assert [p for _, p in first] == [b"%d" % i for i in range(250)]


def test_the_queue_keeps_working_after_flushall(flushable: redis.Redis) -> None:
    client = flushable
    q = queue(client)
    q.put(0, [b"lost"], timeout_s=1)
    q.get(0, "c", 10, 1)
    client.flushall()
    assert q.depth(0) == 0
    assert q.get(0, "c", 10, 0.05) == []  # NOGROUP: group recreated
    q.put(0, [b"after"], timeout_s=1)
    got = q.get(0, "c", 10, 1)
    assert [p for _, p in got] == [b"after"]
    q.ack(0, [entry_id for entry_id, _ in got])
    assert q.depth(0) == 0
    # A put first, then the consumer: the group is created from id 0 and sees the entry.
    client.flushall()
    q.put(1, [b"first"], timeout_s=1)
    assert [p for _, p in q.get(1, "c", 10, 1)] == [b"first"]
    client.flushall()
    assert q.claim_stale(1, "c", idle_ms=0, max_entries=10) == []


def test_the_queue_keeps_working_after_a_redis_restart(
    client: redis.Redis, redis_control: ServerControl
) -> None:
    q = queue(client)
    q.put(0, [b"before"], timeout_s=1)
    redis_control.restart()  # no persistence: Redis comes back empty
    deadline = time.monotonic() + 10
    while True:
        try:
            q.put(0, [b"after"], timeout_s=1)
            break
        except RedisTransportError:  # the client may see the dropped connection once
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    assert [p for _, p in q.get(0, "c", 10, 1)] == [b"after"]


def test_partitions_are_checked(client: redis.Redis) -> None:
    q = queue(client, partitions=2)
    with pytest.raises(ValueError, match="partition must be 0..1, got 2"):
        q.put(2, [b"x"], timeout_s=0.1)
    with pytest.raises(ValueError, match="must not decode responses"):
        RedisWorkQueue(redis.Redis.from_url("redis://127.0.0.1:1/0", decode_responses=True), "q", 1, 1)


def test_an_unreachable_redis_raises_a_transport_error() -> None:
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2, retry=None)
    q = RedisWorkQueue(dead, "q", 1, 10)
    with pytest.raises(RedisTransportError, match="put to queue 'q' partition 0"):
        q.put(0, [b"x"], timeout_s=0.1)


# -- leases -----------------------------------------------------------------------------------


def test_acquire_grants_growing_epochs_and_refuses_while_held(client: redis.Redis) -> None:
    leases = RedisLeaseStore(client, prefix=f"t-{uuid.uuid4().hex[:8]}")
    e1 = leases.acquire("enqueue-put", 0, "a", ttl_ms=10_000)
    assert e1 == 1
    assert leases.acquire("enqueue-put", 0, "b", ttl_ms=10_000) is None
    assert leases.acquire("enqueue-put", 0, "a", ttl_ms=10_000) is None  # held, even by itself
    assert leases.acquire("enqueue-put", 1, "b", ttl_ms=10_000) == 1  # shards are separate
    assert leases.acquire("dequeue-get", 0, "b", ttl_ms=10_000) == 1  # roles are separate
    assert leases.holder("enqueue-put", 0) == ("a", 1)
    assert leases.renew("enqueue-put", 0, "a", 1, ttl_ms=10_000)
    leases.release("enqueue-put", 0, "a", 1)
    assert leases.holder("enqueue-put", 0) is None
    assert not leases.renew("enqueue-put", 0, "a", 1, ttl_ms=10_000)  # released is gone
    assert leases.acquire("enqueue-put", 0, "b", ttl_ms=10_000) == 2
    assert leases.current_epoch("enqueue-put", 0) == 2


def test_a_lapsed_owner_is_fenced_once_another_acquires(client: redis.Redis) -> None:
    leases = RedisLeaseStore(client, prefix=f"t-{uuid.uuid4().hex[:8]}")
    old = leases.acquire("dequeue-get", 3, "old", ttl_ms=100)
    assert old is not None
    time.sleep(0.2)
    new = leases.acquire("dequeue-get", 3, "new", ttl_ms=10_000)
    assert new is not None and new > old
    assert not leases.renew("dequeue-get", 3, "old", old, ttl_ms=10_000)
    leases.release("dequeue-get", 3, "old", old)  # a stale release does not free the new owner
    assert leases.holder("dequeue-get", 3) == ("new", new)
    assert leases.current_epoch("dequeue-get", 3) == new
    assert leases.renew("dequeue-get", 3, "new", new, ttl_ms=10_000)


def test_a_lapsed_lease_nobody_took_can_still_be_renewed(client: redis.Redis) -> None:
    # The LeaseStore protocol (and the memory store): lost means expired *and* taken.
    leases = RedisLeaseStore(client, prefix=f"t-{uuid.uuid4().hex[:8]}")
    epoch = leases.acquire("enqueue-put", 0, "a", ttl_ms=100)
    assert epoch is not None
    time.sleep(0.2)
    assert leases.holder("enqueue-put", 0) is None
    assert leases.renew("enqueue-put", 0, "a", epoch, ttl_ms=10_000)
    assert leases.holder("enqueue-put", 0) == ("a", epoch)
    assert leases.acquire("enqueue-put", 0, "b", ttl_ms=10_000) is None


def test_epochs_stay_monotonic_after_flushall_through_the_floor(flushable: redis.Redis) -> None:
    client = flushable
    leases = RedisLeaseStore(client)
    for _ in range(3):
        epoch = leases.acquire("enqueue-put", 7, "a", ttl_ms=10_000)
        assert epoch is not None
        leases.release("enqueue-put", 7, "a", epoch)
    assert leases.current_epoch("enqueue-put", 7) == 3
    owned = leases.acquire("enqueue-put", 7, "a", ttl_ms=10_000)
    assert owned == 4
    client.flushall()
    assert leases.current_epoch("enqueue-put", 7) == 0  # no live owner holds 0: writers stop
    assert not leases.renew("enqueue-put", 7, "a", owned, ttl_ms=10_000)
    # The new owner passes the epoch from the shard's checkpoint as the floor.
    assert leases.acquire("enqueue-put", 7, "b", ttl_ms=10_000, floor=owned) == owned + 1
    assert leases.current_epoch("enqueue-put", 7) == owned + 1
    # A floor below the counter changes nothing.
    leases.release("enqueue-put", 7, "b", owned + 1)
    assert leases.acquire("enqueue-put", 7, "b", ttl_ms=10_000, floor=1) == owned + 2


def test_owner_names_may_contain_colons(client: redis.Redis) -> None:
    leases = RedisLeaseStore(client, prefix=f"t-{uuid.uuid4().hex[:8]}")
    epoch = leases.acquire("r", 0, "pod:10.0.0.1:8080", ttl_ms=10_000)
    assert epoch == 1
    assert leases.holder("r", 0) == ("pod:10.0.0.1:8080", 1)
    assert leases.renew("r", 0, "pod:10.0.0.1:8080", 1, ttl_ms=10_000)
    assert not leases.renew("r", 0, "pod:10.0.0.1", 1, ttl_ms=10_000)


# -- members (shard balancing) -------------------------------------------------------------------


def test_members_are_listed_while_their_beat_lasts_and_leave_at_once(client: redis.Redis) -> None:
    members = RedisLeaseStore(client, prefix=f"t-{uuid.uuid4().hex[:8]}")
    assert members.beat("enqueue-put", "pod-a", ttl_ms=10_000) == ["pod-a"]
    assert members.beat("enqueue-put", "pod-b", ttl_ms=150) == ["pod-a", "pod-b"]
    assert members.beat("dequeue-get", "pod-c", ttl_ms=10_000) == ["pod-c"]  # roles are separate
    time.sleep(0.3)
    assert members.beat("enqueue-put", "pod-a", ttl_ms=10_000) == ["pod-a"]  # pod-b's beat lapsed
    members.beat("enqueue-put", "pod-b", ttl_ms=10_000)
    members.leave("enqueue-put", "pod-b")
    assert members.beat("enqueue-put", "pod-a", ttl_ms=10_000) == ["pod-a"]
