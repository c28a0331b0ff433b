"""In-process work queues and leases, and file leases shared by processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from timerwheel.clock import SimulatedClock
from timerwheel.errors import QueueFullError
from timerwheel.transports.memory import FileLeaseStore, MemoryLeaseStore, MemoryWorkQueue, QueueClosedError

# -- work queue -------------------------------------------------------------------------------


def test_get_hands_out_entries_in_order_once_and_keeps_them_pending_until_acked() -> None:
    q = MemoryWorkQueue("q", partitions=2, bound=10)
    q.put(1, [b"a", b"b", b"c"], timeout_s=1)
    first = q.get(1, "c1", max_entries=2, timeout_s=1)
    assert [payload for _, payload in first] == [b"a", b"b"]
    assert [payload for _, payload in q.get(1, "c2", 10, 0.01)] == [b"c"]
    assert q.get(1, "c2", 10, 0.01) == []
    assert q.get(0, "c1", 10, 0.01) == []  # partitions are separate
    assert q.depth(1) == 3
    assert set(q.pending(1).values()) == {"c1", "c2"}
    q.ack(1, [first[0][0], "no-such-id"])
    assert q.depth(1) == 2
    q.ack(1, [first[0][0]])  # acking twice is harmless
    assert q.depth(1) == 2
    assert len({entry_id for entry_id, _ in first}) == 2 and all(isinstance(i, str) for i, _ in first)


def test_put_blocks_at_the_bound_counting_pending_entries_and_times_out() -> None:
    q = MemoryWorkQueue("q", partitions=1, bound=3)
    q.put(0, [b"1", b"2", b"3"], timeout_s=1)
    taken = q.get(0, "c", 3, 0.01)  # handed out but not acked: still counts
    started = time.monotonic()
    with pytest.raises(QueueFullError, match="'q' partition 0 still holds 3 entries"):
        q.put(0, [b"4"], timeout_s=0.1)
    assert 0.09 <= time.monotonic() - started < 2.0
    assert q.depth(0) == 3

    threading.Timer(0.05, lambda: q.ack(0, [taken[0][0]])).start()
    started = time.monotonic()
    q.put(0, [b"4", b"5"], timeout_s=5)  # room for one: the batch goes in whole
    assert time.monotonic() - started < 2.0
    assert q.depth(0) == 4
    assert [p for _, p in q.get(0, "c", 10, 0.01)] == [b"4", b"5"]


def test_get_many_takes_entries_of_several_partitions_and_waits_for_the_first() -> None:
    q = MemoryWorkQueue("q", partitions=3, bound=10)
    q.put(0, [b"a"], 1)
    q.put(2, [b"b", b"c"], 1)
    got = q.get_many([0, 1, 2], "c", 1, 0)
    assert {p: [payload for _, payload in e] for p, e in got.items()} == {0: [b"a"], 2: [b"b"]}
    assert [payload for _, payload in q.get_many([0, 1, 2], "c", 10, 0)[2]] == [b"c"]
    late = threading.Timer(0.1, lambda: q.put(1, [b"late"], 1))
    late.start()
    got = q.get_many([0, 1, 2], "c", 10, 30)
    late.join()
    assert {p: [payload for _, payload in e] for p, e in got.items()} == {1: [b"late"]}
    assert q.get_many([0, 1, 2], "c", 10, 0.05) == {}


def test_get_waits_for_a_put_and_returns_empty_after_its_timeout() -> None:
    q = MemoryWorkQueue("q", partitions=1, bound=5)
    started = time.monotonic()
    assert q.get(0, "c", 5, 0.1) == []
    assert 0.09 <= time.monotonic() - started < 2.0
    threading.Timer(0.05, lambda: q.put(0, [b"x"], 1)).start()
    started = time.monotonic()
    assert [p for _, p in q.get(0, "c", 5, 5.0)] == [b"x"]
    assert time.monotonic() - started < 2.0


def test_a_touched_entry_is_not_stale_and_a_touch_never_takes_one_back() -> None:
    clock = SimulatedClock()
    q = MemoryWorkQueue("q", partitions=1, bound=10, clock=clock)
    q.put(0, [b"a", b"b"], 1)
    (held,), (other,) = q.get(0, "holder", 1, 0.01), q.get(0, "other", 1, 0.01)
    clock.advance(1500)
    assert q.touch(0, "holder", [held[0], other[0], "0-99"]) == [other[0], "0-99"]  # not its own: left alone
    assert q.claim_stale(0, "thief", idle_ms=1000, max_entries=10) == [other]  # idle: taken
    assert q.pending(0) == {held[0]: "holder", other[0]: "thief"}  # touched: kept


def test_claim_stale_redelivers_entries_of_a_dead_consumer_to_another() -> None:
    clock = SimulatedClock()
    q = MemoryWorkQueue("q", partitions=1, bound=10, clock=clock)
    q.put(0, [b"a", b"b"], 1)
    dead = q.get(0, "dead", 1, 0.01)
    clock.advance(500)
    alive = q.get(0, "alive", 1, 0.01)
    assert q.claim_stale(0, "rescuer", idle_ms=1000, max_entries=10) == []
    clock.advance(600)  # "a" idle 1100 ms, "b" 600 ms
    claimed = q.claim_stale(0, "rescuer", idle_ms=1000, max_entries=10)
    assert claimed == dead
    assert q.pending(0) == {dead[0][0]: "rescuer", alive[0][0]: "alive"}
    assert q.claim_stale(0, "other", idle_ms=1000, max_entries=10) == []  # the claim reset its idle time
    clock.advance(1000)
    assert [p for _, p in q.claim_stale(0, "other", idle_ms=1000, max_entries=1)] == [b"b"]  # stalest first
    q.ack(0, [dead[0][0]])
    assert q.depth(0) == 1


def test_entries_of_a_consumer_whose_heartbeat_lapsed_are_claimed_early() -> None:
    clock = SimulatedClock()
    q = MemoryWorkQueue("q", partitions=1, bound=10, clock=clock)
    q.put(0, [b"a", b"b"], 1)
    q.heartbeat("killed", ttl_ms=5_000)
    q.heartbeat("slow", ttl_ms=5_000)
    killed = q.get(0, "killed", 1, 0.01)
    slow = q.get(0, "slow", 1, 0.01)
    clock.advance(4_000)
    q.heartbeat("slow", ttl_ms=5_000)  # "slow" keeps beating, "killed" stopped at 0
    assert q.claim_stale(0, "r", idle_ms=30_000, max_entries=10, dead_idle_ms=1_000) == []  # not lapsed yet
    clock.advance(1_500)
    q.heartbeat("slow", ttl_ms=5_000)
    assert q.claim_stale(0, "r", idle_ms=30_000, max_entries=10, dead_idle_ms=1_000) == killed
    # A live consumer keeps its entry until idle_ms; without dead_idle_ms nothing changes.
    assert q.claim_stale(0, "r", idle_ms=30_000, max_entries=10, dead_idle_ms=1_000) == []
    clock.advance(30_000)
    assert q.claim_stale(0, "r2", idle_ms=30_000, max_entries=10) == slow + killed  # stalest first: "b" was not claimed since


def test_close_wakes_blocked_callers_and_refuses_puts() -> None:
    q = MemoryWorkQueue("q", partitions=1, bound=1)
    q.put(0, [b"x"], 1)
    errors: list[BaseException] = []
    results: list[object] = []

    def blocked_put() -> None:
        try:
            q.put(0, [b"y"], 30)
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion
            errors.append(e)

    q2 = MemoryWorkQueue("q2", partitions=1, bound=1)
    threads = [
        threading.Thread(target=blocked_put),
        threading.Thread(target=lambda: results.append(q2.get(0, "c", 1, 30))),
    ]
    for t in threads:
        t.start()
    time.sleep(0.05)
    started = time.monotonic()
    q.close()
    q2.close()
    for t in threads:
        t.join(5)
    assert time.monotonic() - started < 2.0
    assert len(errors) == 1 and isinstance(errors[0], QueueClosedError)
    assert results == [[]]


def test_concurrent_producers_and_consumers_deliver_every_entry_once() -> None:
    q = MemoryWorkQueue("q", partitions=2, bound=8)
    received: list[bytes] = []
    lock = threading.Lock()
    done = threading.Event()

    def produce(n: int) -> None:
        for i in range(200):
            q.put(i % 2, [f"{n}-{i}".encode()], 5)

    def consume(name: str) -> None:
        while not done.is_set() or any(q.depth(p) for p in range(2)):
            for p in range(2):
                got = q.get(p, name, 3, 0.01)
                with lock:
                    received.extend(payload for _, payload in got)
                q.ack(p, [i for i, _ in got])

    producers = [threading.Thread(target=produce, args=(n,)) for n in range(3)]
    consumers = [threading.Thread(target=consume, args=(f"c{n}",)) for n in range(2)]
    for t in producers + consumers:
        t.start()
    for t in producers:
        t.join(30)
    done.set()
    for t in consumers:
        t.join(30)
    assert sorted(received) == sorted(f"{n}-{i}".encode() for n in range(3) for i in range(200))


# -- leases -----------------------------------------------------------------------------------


@pytest.fixture(params=["memory", "file"])
def leases_and_clock(
    request: pytest.FixtureRequest, tmp_path: Path
) -> tuple[MemoryLeaseStore | FileLeaseStore, SimulatedClock]:
    clock = SimulatedClock()
    if request.param == "memory":
        return MemoryLeaseStore(clock), clock
    return FileLeaseStore(tmp_path / "leases", clock), clock


def test_lease_epochs_increase_and_a_lapsed_owner_cannot_renew(
    leases_and_clock: tuple[MemoryLeaseStore | FileLeaseStore, SimulatedClock],
) -> None:
    leases, clock = leases_and_clock
    assert leases.current_epoch("enqueue-put", 0) == 0
    first = leases.acquire("enqueue-put", 0, "a", ttl_ms=1000)
    assert first == 1
    assert leases.acquire("enqueue-put", 0, "b", ttl_ms=1000) is None  # held
    assert leases.acquire("enqueue-put", 1, "b", ttl_ms=1000) == 1  # another shard
    assert leases.acquire("dequeue-get", 0, "b", ttl_ms=1000) == 1  # another role
    clock.advance(900)
    assert leases.renew("enqueue-put", 0, "a", first, ttl_ms=1000)
    clock.advance(900)
    assert leases.acquire("enqueue-put", 0, "b", ttl_ms=1000) is None  # the renewal kept it
    clock.advance(200)  # lapsed
    second = leases.acquire("enqueue-put", 0, "b", ttl_ms=1000)
    assert second is not None and second > first
    assert not leases.renew("enqueue-put", 0, "a", first, ttl_ms=1000)
    assert leases.current_epoch("enqueue-put", 0) == second
    leases.release("enqueue-put", 0, "a", first)  # a stale release changes nothing
    assert leases.acquire("enqueue-put", 0, "c", ttl_ms=1000) is None

    leases.release("enqueue-put", 0, "b", second)
    assert not leases.renew("enqueue-put", 0, "b", second, ttl_ms=1000)
    third = leases.acquire("enqueue-put", 0, "c", ttl_ms=1000)
    assert third is not None and third > second
    assert leases.acquire("enqueue-put", 0, "c", ttl_ms=1000, floor=41) is None  # still held by c
    clock.advance(1000)
    assert leases.acquire("enqueue-put", 0, "d", ttl_ms=1000, floor=41) == 42  # above the checkpoint's epoch
    clock.advance(1000)
    assert leases.acquire("enqueue-put", 0, "d", ttl_ms=1000) == 43  # a restarted "d" fences its old self
    assert not leases.renew("enqueue-put", 0, "d", 42, ttl_ms=1000)
    assert leases.renew("enqueue-put", 0, "d", 43, ttl_ms=1000)


def test_a_lapsed_lease_nobody_took_can_still_be_renewed(
    leases_and_clock: tuple[MemoryLeaseStore | FileLeaseStore, SimulatedClock],
) -> None:
    leases, clock = leases_and_clock
    epoch = leases.acquire("r", 3, "a", ttl_ms=100)
    assert epoch is not None
    clock.advance(10_000)
    assert leases.renew("r", 3, "a", epoch, ttl_ms=100)
    assert leases.acquire("r", 3, "b", ttl_ms=100) is None


def test_file_lease_epochs_survive_a_new_store_instance(tmp_path: Path) -> None:
    clock = SimulatedClock()
    epoch = FileLeaseStore(tmp_path, clock).acquire("enqueue-put", 2, "a", 1000)
    again = FileLeaseStore(tmp_path, clock)
    assert again.current_epoch("enqueue-put", 2) == epoch
    assert again.acquire("enqueue-put", 2, "b", 1000) is None
    with pytest.raises(ValueError, match="lease role"):
        again.acquire("../x", 0, "a", 1000)


_CONTENDER = textwrap.dedent(
    """
    import sys, time
    from timerwheel.transports.memory import FileLeaseStore

    leases = FileLeaseStore(sys.argv[1])
    start = float(sys.argv[2])
    while time.time() < start:
        time.sleep(0.001)
    wins = []
    for shard in range(40):
        epoch = leases.acquire("enqueue-put", shard, sys.argv[3], ttl_ms=60_000)
        if epoch is not None:
            wins.append(f"{shard}:{epoch}")
    print(" ".join(wins))
    """
)


def test_processes_racing_for_file_leases_never_both_own_a_shard(tmp_path: Path) -> None:
    start = time.time() + 1.0
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CONTENDER, str(tmp_path), str(start), f"p{n}"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in range(4)
    ]
    wins: list[str] = []
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        wins += out.split()
    shards = [w.split(":")[0] for w in wins]
    assert sorted(shards, key=int) == [str(s) for s in range(40)]  # each shard won exactly once
    assert all(w.endswith(":1") for w in wins)
