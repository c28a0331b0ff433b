"""In-process work queues and leases for the embedded mode, plus file leases across processes.

``MemoryWorkQueue`` is the embedded stand-in for a Redis Stream with one consumer group per
partition. Each partition keeps entries *waiting* (put, not yet handed out) and *pending*
(handed to a consumer by ``get`` or ``claim_stale``, not yet acked). The bound counts both:
``put`` blocks while ``waiting + pending >= bound`` (or, with ``max_bytes``, while their
``entry_bytes`` sum to that much: TW_QUEUE_BYTES), so a slow or dead consumer holds its
producer back until its entries are acked or claimed — the flow control of RIP-43's bounded
queues, across the whole hand-off and not only the buffer. A ``put`` of a batch is all or
nothing: it waits for room below the bound, then adds the whole batch (which may pass the
bound by up to ``len(entries) - 1``), so a timed-out ``put`` retried whole duplicates nothing.
Every wait has a timeout and ``close`` wakes all waiters: nothing hangs on shutdown.

``MemoryLeaseStore`` and ``FileLeaseStore`` grant shard ownership with fencing epochs. They
share one rule (``_Lease``): ``acquire`` succeeds when nobody holds the lease or the holder's
ttl ran out, and always grants a new epoch, one more than any before, even to the same owner
(it fences that owner's earlier incarnation), and above ``floor``, the epoch the caller
found in the shard's checkpoint, so epochs grow even if the store lost its state; ``renew`` succeeds while ``(owner, epoch)`` is
still the grant, even after the ttl ran out if nobody acquired since (as the protocol says:
lost means expired *and* taken), so a simulated clock's jumps do not churn owners. The file
store keeps each lease in its own small JSON file, replaced atomically under an ``flock`` on a
companion lock file, so the epoch survives restarts and two processes on one data dir cannot
both own a shard.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from timerwheel.clock import Clock, SystemClock
from timerwheel.errors import QueueFullError, TimerwheelError
from timerwheel.files import FILE_MODE
from timerwheel.transports.base import entry_bytes


class QueueClosedError(TimerwheelError):
    """A put into a work queue that was closed."""


class _MonotonicClock:
    """Real elapsed time for pending-entry ages: a wall-clock step must not make entries stale."""

    def now_ms(self) -> int:
        return time.monotonic_ns() // 1_000_000

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


@dataclass(slots=True)
class _Pending:
    payload: bytes
    consumer: str
    since_ms: int


#: How often ``MemoryWorkQueue.get_many`` looks again while it waits on several partitions.
_MANY_SLICE_S = 0.005


class _QueuePartition:
    __slots__ = ("lock", "not_empty", "not_full", "waiting", "pending", "next_id", "dead", "sizes", "nbytes")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.not_empty = threading.Condition(self.lock)
        self.not_full = threading.Condition(self.lock)
        self.waiting: deque[tuple[str, bytes]] = deque()
        # Insertion order is (re)delivery order, so the stalest entries come first.
        self.pending: dict[str, _Pending] = {}
        self.next_id = 0
        #: Entries moved aside (``bury``): (entry id, payload, reason).
        self.dead: list[tuple[str, bytes, str]] = []
        #: Bytes of each entry not yet acked that has any (``entry_bytes``), and their sum.
        self.sizes: dict[str, int] = {}
        self.nbytes = 0


class MemoryWorkQueue:
    """A WorkQueue in one process (see the module header). ``clock`` times pending entries for
    ``claim_stale``; by default real monotonic time, since idleness is about live consumers."""

    #: Entries stay Python objects: the stages skip encoding for this queue (codec.wire).
    in_process = True

    def __init__(self, name: str, partitions: int, bound: int, *, clock: Clock | None = None,
                 max_bytes: int = 0) -> None:
        if partitions < 1:
            raise ValueError(f"MemoryWorkQueue {name!r}: partitions must be >= 1, got {partitions}")
        if bound < 1:
            raise ValueError(f"MemoryWorkQueue {name!r}: bound must be >= 1, got {bound}")
        self.name = name
        self.partitions = partitions
        self.bound = bound
        #: ``put`` also waits while the partition holds this many bytes of entries (0: no byte bound).
        self.max_bytes = max_bytes
        self._clock: Clock = clock or _MonotonicClock()
        self._parts = [_QueuePartition() for _ in range(partitions)]
        #: consumer -> until when its last heartbeat says it is alive.
        self._alive_until: dict[str, int] = {}
        self._closed = False

    def _part(self, partition: int) -> _QueuePartition:
        if not 0 <= partition < self.partitions:
            raise ValueError(
                f"work queue {self.name!r} has {self.partitions} partitions, no partition {partition}"
            )
        return self._parts[partition]

    def put(self, partition: int, entries: Sequence[bytes], timeout_s: float) -> None:
        qp = self._part(partition)
        if not entries:
            return
        deadline = time.monotonic() + timeout_s
        with qp.lock:
            while True:
                if self._closed:
                    raise QueueClosedError(f"work queue {self.name!r} is closed")
                depth = len(qp.waiting) + len(qp.pending)
                if depth < self.bound and (not self.max_bytes or qp.nbytes < self.max_bytes):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise QueueFullError(
                        f"work queue {self.name!r} partition {partition} still holds {depth} entries "
                        f"(bound {self.bound}), {qp.nbytes} bytes (max {self.max_bytes}) after {timeout_s}s"
                    )
                qp.not_full.wait(remaining)
            for payload in entries:
                entry_id = f"{partition}-{qp.next_id}"
                qp.waiting.append((entry_id, payload))
                qp.next_id += 1
                size = entry_bytes(payload)
                if size:
                    qp.sizes[entry_id] = size
                    qp.nbytes += size
            qp.not_empty.notify_all()

    def get(
        self, partition: int, consumer: str, max_entries: int, timeout_s: float
    ) -> list[tuple[str, bytes]]:
        qp = self._part(partition)
        deadline = time.monotonic() + timeout_s
        with qp.lock:
            while not qp.waiting:
                remaining = deadline - time.monotonic()
                if self._closed or remaining <= 0:
                    return []
                qp.not_empty.wait(remaining)
            now = self._clock.now_ms()
            out = []
            for _ in range(min(max_entries, len(qp.waiting))):
                entry_id, payload = qp.waiting.popleft()
                qp.pending[entry_id] = _Pending(payload, consumer, now)
                out.append((entry_id, payload))
            return out

    def get_many(self, partitions: Sequence[int], consumer: str, max_entries: int,
                 timeout_s: float) -> dict[int, list[tuple[str, bytes]]]:
        """``get`` of each partition. Waiting on several partitions looks again every
        ``_MANY_SLICE_S``: the embedded stages do not wait here (in-process wakes end their waits)."""
        if len(partitions) == 1:
            got = self.get(partitions[0], consumer, max_entries, timeout_s)
            return {partitions[0]: got} if got else {}
        deadline = time.monotonic() + timeout_s
        while True:
            out = {}
            for p in partitions:
                got = self.get(p, consumer, max_entries, 0)
                if got:
                    out[p] = got
            left = deadline - time.monotonic()
            if out or left <= 0 or self._closed or not partitions:
                return out
            self.get(partitions[0], consumer, 0, min(left, _MANY_SLICE_S))  # waits for an entry, takes none

    def ack(self, partition: int, entry_ids: Sequence[str]) -> None:
        qp = self._part(partition)
        with qp.lock:
            removed = sum(qp.pending.pop(entry_id, None) is not None for entry_id in entry_ids)
            if qp.sizes:
                qp.nbytes -= sum(qp.sizes.pop(entry_id, 0) for entry_id in entry_ids)
            if removed:
                qp.not_full.notify_all()

    def bury(self, partition: int, entries: Sequence[tuple[str, bytes, str]]) -> None:
        qp = self._part(partition)
        with qp.lock:
            for entry_id, payload, reason in entries:
                qp.pending.pop(entry_id, None)
                qp.nbytes -= qp.sizes.pop(entry_id, 0)
                qp.dead.append((entry_id, payload, reason))
            qp.not_full.notify_all()

    def dead_entries(self, partition: int) -> list[tuple[str, bytes, str]]:
        """What ``bury`` moved aside (tests and inspection)."""
        qp = self._part(partition)
        with qp.lock:
            return list(qp.dead)

    def claim_stale(
        self, partition: int, consumer: str, idle_ms: int, max_entries: int, dead_idle_ms: int | None = None
    ) -> list[tuple[str, bytes]]:
        qp = self._part(partition)
        with qp.lock:
            now = self._clock.now_ms()
            stale: list[str] = []
            for entry_id, entry in qp.pending.items():
                if len(stale) >= max_entries:
                    break
                idle = now - entry.since_ms
                if idle >= idle_ms or (
                    dead_idle_ms is not None and idle >= dead_idle_ms and entry.consumer != consumer
                    and self._alive_until.get(entry.consumer, 0) <= now  # never said it lives, or lapsed
                ):
                    stale.append(entry_id)
                elif dead_idle_ms is None:
                    break  # oldest first: the rest are younger
            out = []
            for entry_id in stale:
                entry = qp.pending.pop(entry_id)
                qp.pending[entry_id] = _Pending(entry.payload, consumer, now)
                out.append((entry_id, entry.payload))
            return out

    def heartbeat(self, consumer: str, ttl_ms: int) -> None:
        self._alive_until[consumer] = self._clock.now_ms() + ttl_ms

    def touch(self, partition: int, consumer: str, entry_ids: Sequence[str]) -> list[str]:
        qp = self._part(partition)
        gone = []
        with qp.lock:
            now = self._clock.now_ms()
            for entry_id in entry_ids:
                entry = qp.pending.get(entry_id)
                if entry is None or entry.consumer != consumer:
                    gone.append(entry_id)
                else:  # to the end: insertion order is staleness order (claim_stale)
                    del qp.pending[entry_id]
                    qp.pending[entry_id] = _Pending(entry.payload, consumer, now)
        return gone

    def depth(self, partition: int) -> int:
        qp = self._part(partition)
        with qp.lock:
            return len(qp.waiting) + len(qp.pending)

    def pending(self, partition: int) -> dict[str, str]:
        """Entry id -> consumer of the entries handed out and not yet acked (for tests and metrics)."""
        qp = self._part(partition)
        with qp.lock:
            return {entry_id: entry.consumer for entry_id, entry in qp.pending.items()}

    def close(self) -> None:
        self._closed = True
        for qp in self._parts:
            with qp.lock:
                qp.not_empty.notify_all()
                qp.not_full.notify_all()


# -- leases ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Lease:
    """One (role, shard) lease; ``owner`` None when released. The rule both stores share."""

    epoch: int = 0
    owner: str | None = None
    expires_ms: int = 0

    def acquire(self, owner: str, now_ms: int, ttl_ms: int, floor: int) -> _Lease | None:
        if self.owner is not None and self.expires_ms > now_ms:
            return None
        return _Lease(max(self.epoch, floor) + 1, owner, now_ms + ttl_ms)

    def holds(self, owner: str, epoch: int) -> bool:
        return self.owner == owner and self.epoch == epoch

    def renew(self, owner: str, epoch: int, now_ms: int, ttl_ms: int) -> _Lease | None:
        return replace(self, expires_ms=now_ms + ttl_ms) if self.holds(owner, epoch) else None

    def release(self, owner: str, epoch: int) -> _Lease | None:
        return _Lease(self.epoch) if self.holds(owner, epoch) else None


def _check_ttl(ttl_ms: int) -> None:
    if ttl_ms <= 0:
        raise ValueError(f"lease ttl_ms must be > 0, got {ttl_ms}")


class MemoryLeaseStore:
    """A LeaseStore in one process; ttl measured on ``clock`` (see the module header)."""

    def __init__(self, clock: Clock | None = None) -> None:
        self._clock: Clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._leases: dict[tuple[str, int], _Lease] = {}
        self._members: dict[str, dict[str, int]] = {}

    def beat(self, role: str, member: str, ttl_ms: int) -> list[str]:
        """``member`` of ``role`` is alive for ``ttl_ms``; returns the live members (MemberStore)."""
        _check_ttl(ttl_ms)
        with self._lock:
            now = self._clock.now_ms()
            live = {m: until for m, until in self._members.get(role, {}).items() if until > now}
            live[member] = now + ttl_ms
            self._members[role] = live
            return sorted(live)

    def leave(self, role: str, member: str) -> None:
        with self._lock:
            self._members.get(role, {}).pop(member, None)

    def acquire(self, role: str, shard: int, owner: str, ttl_ms: int, floor: int = 0) -> int | None:
        _check_ttl(ttl_ms)
        with self._lock:
            lease = self._leases.get((role, shard), _Lease()).acquire(
                owner, self._clock.now_ms(), ttl_ms, floor
            )
            if lease is None:
                return None
            self._leases[(role, shard)] = lease
            return lease.epoch

    def renew(self, role: str, shard: int, owner: str, epoch: int, ttl_ms: int) -> bool:
        _check_ttl(ttl_ms)
        with self._lock:
            lease = self._leases.get((role, shard), _Lease()).renew(
                owner, epoch, self._clock.now_ms(), ttl_ms
            )
            if lease is None:
                return False
            self._leases[(role, shard)] = lease
            return True

    def release(self, role: str, shard: int, owner: str, epoch: int) -> None:
        with self._lock:
            lease = self._leases.get((role, shard), _Lease()).release(owner, epoch)
            if lease is not None:
                self._leases[(role, shard)] = lease

    def current_epoch(self, role: str, shard: int) -> int:
        with self._lock:
            return self._leases.get((role, shard), _Lease()).epoch


_ROLE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


class FileLeaseStore:
    """A LeaseStore shared by the processes of one machine: ``<directory>/<role>.<shard>.lease``
    (JSON: epoch, owner, expires_ms), replaced atomically while ``<role>.<shard>.lock`` is
    flocked. Use a wall clock (SystemClock): every process must read the same time."""

    def __init__(self, directory: str | os.PathLike[str], clock: Clock | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._clock: Clock = clock or SystemClock()

    def _stem(self, role: str, shard: int) -> str:
        if not _ROLE.fullmatch(role):
            raise ValueError(f"lease role {role!r}: use 1..100 of [A-Za-z0-9_.-], starting alphanumeric")
        if shard < 0:
            raise ValueError(f"lease shard must be >= 0, got {shard}")
        return f"{role}.{shard:04d}"

    @contextlib.contextmanager
    def _locked(self, role: str, shard: int) -> Iterator[Path]:
        # A fresh open file per call: flock then also excludes other threads of this process.
        stem = self._stem(role, shard)
        fd = os.open(self.directory / f"{stem}.lock", os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield self.directory / f"{stem}.lease"
        finally:
            os.close(fd)  # releases the flock

    @staticmethod
    def _load(path: Path) -> _Lease:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return _Lease()
        return _Lease(int(data["epoch"]), data["owner"], int(data["expires_ms"]))

    def _store(self, path: Path, lease: _Lease) -> None:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "w") as f:
            json.dump({"epoch": lease.epoch, "owner": lease.owner, "expires_ms": lease.expires_ms}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def acquire(self, role: str, shard: int, owner: str, ttl_ms: int, floor: int = 0) -> int | None:
        _check_ttl(ttl_ms)
        with self._locked(role, shard) as path:
            lease = self._load(path).acquire(owner, self._clock.now_ms(), ttl_ms, floor)
            if lease is None:
                return None
            self._store(path, lease)
            return lease.epoch

    def renew(self, role: str, shard: int, owner: str, epoch: int, ttl_ms: int) -> bool:
        _check_ttl(ttl_ms)
        with self._locked(role, shard) as path:
            lease = self._load(path).renew(owner, epoch, self._clock.now_ms(), ttl_ms)
            if lease is None:
                return False
            self._store(path, lease)
            return True

    def release(self, role: str, shard: int, owner: str, epoch: int) -> None:
        with self._locked(role, shard) as path:
            lease = self._load(path).release(owner, epoch)
            if lease is not None:
                self._store(path, lease)

    def current_epoch(self, role: str, shard: int) -> int:
        with self._locked(role, shard) as path:
            return self._load(path).epoch
