"""The production work queues and shard leases: Redis Streams and keys.

``RedisWorkQueue`` — one stream per (queue, partition), key ``tw:q:{name}:{partition}``, read
through one consumer group. An entry lives in the stream from ``put`` until ``ack``, which
XACKs and XDELs it in one transaction, so ``XLEN`` is exactly "waiting plus pending": that is
both ``depth`` and the bound ``put`` waits on (RIP-43's bounded BlockingQueue, as flow control).
The bound check and the XADDs run in one Lua script, so concurrent producers cannot overshoot
together; a batch is admitted whole while the partition holds fewer than ``bound`` entries and,
with ``max_bytes``, fewer bytes than that (the stream's MEMORY USAGE: large record bodies in the
deliver queue are bounded in bytes, not only in entries; TW_QUEUE_BYTES).
``get`` is XREADGROUP with a bounded BLOCK, ``get_many`` one XREADGROUP over several partitions'
streams (an idle stage blocks there), ``claim_stale`` is XAUTOCLAIM.

Consumers say they are alive with ``heartbeat``: a key ``tw:alive:{consumer}`` with a TTL
(every stage process refreshes it from a thread of its own, so a long batch does not lapse it).
``claim_stale(..., dead_idle_ms=D)`` also claims, after ``D``, the entries pending with a consumer
whose key is gone (a killed process: its entries move on in seconds instead of waiting out
``idle_ms``, which stays long so that a live but slow consumer is not robbed), and removes that
consumer from the group once nothing is pending with it.

Redis is a transport, not a store (ARCHITECTURE.md, section 4): after FLUSHALL or a restart the
streams and groups are gone. Every call that meets NOGROUP recreates the group (MKSTREAM, from
id 0, so whatever is still in the stream is delivered again) and retries; the stages rebuild the
lost entries from the TimerLog, the checkpoints and Kafka.

``RedisLeaseStore`` — shard ownership with fencing epochs, the same rules as the memory and file
stores. Per (role, shard), under one hash tag (Redis Cluster safe): an epoch counter, an owner
key ``"owner:epoch"`` with the TTL, and the grant (the same value, no TTL). ``acquire`` succeeds
only while the owner key is absent (free, released or expired), INCRs the counter and sets both.
``renew`` succeeds while (owner, epoch) is still the grant, even after the TTL lapsed if nobody
acquired since (lost means expired *and* taken), and ``release`` clears both; all three are Lua
scripts, atomic in Redis.

Members (``MemberStore``, shard balancing): a sorted set per role, ``{prefix}:members:{role}``,
member -> the Redis server's time (ms) at which its beat lapses; the server's clock, so pods'
clocks need not agree. ``beat`` adds or renews, drops the lapsed and lists the rest in one script.

Epochs after FLUSHALL: the counter is lost with everything else. ``acquire(..., floor=N)`` grants
an epoch greater than ``N``; callers pass the epoch recorded in their shard checkpoint
(``enqueue.ckpt`` / ``dequeue.ckpt`` hold the owner epoch), so epochs stay monotonic across a
Redis wipe. Until then ``current_epoch`` reads 0, which no live owner holds: writers that
compare it with their own epoch stop, as they should.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import redis

from timerwheel.errors import QueueFullError, TimerwheelError

__all__ = ["RedisLeaseStore", "RedisTransportError", "RedisWorkQueue", "running_processes"]

T = TypeVar("T")

_FIELD = b"d"

# KEYS[1] stream; ARGV[1] bound, ARGV[2] max_bytes (0: none), ARGV[3..] payloads. Returns -1
# when admitted, else {entries, bytes} held. The bytes are MEMORY USAGE of the stream, every node
# counted (SAMPLES 0: one pass over the stream's nodes, no copy of the entries); an acked entry
# leaves it with XDEL (a large entry fills a node of its own, freed at once).
_PUT_IF_ROOM = """
local n = redis.call('XLEN', KEYS[1])
if n >= tonumber(ARGV[1]) then return {n, -1} end
local limit = tonumber(ARGV[2])
if limit > 0 and n > 0 then
  local held = redis.call('MEMORY', 'USAGE', KEYS[1], 'SAMPLES', '0') or 0
  if held >= limit then return {n, held} end
end
for i = 3, #ARGV do redis.call('XADD', KEYS[1], '*', 'd', ARGV[i]) end
return -1
"""

# KEYS[1] the stream; ARGV group, consumer, entry ids. Each entry still pending with the consumer is
# claimed by it again (XCLAIM resets its idle time; JUSTID leaves its delivery count); returns the
# ids it no longer has (acked, deleted, or another consumer's now): a touch never takes an entry back.
_TOUCH_OWN = """
local gone = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    table.insert(gone, ARGV[i])
  end
end
return gone
"""

# Per (role, shard): KEYS[1] owner key "owner:epoch" with the TTL, KEYS[2] epoch counter,
# KEYS[3] the grant "owner:epoch" without TTL (cleared by release), so that an owner whose TTL
# lapsed while nobody acquired can still renew, as the LeaseStore protocol (and the memory
# store) says: lost means expired *and* taken.

# ARGV owner, ttl_ms, floor.
_ACQUIRE = """
if redis.call('GET', KEYS[1]) then return false end
local epoch = tonumber(redis.call('GET', KEYS[2]) or '0')
local floor = tonumber(ARGV[3])
if epoch < floor then epoch = floor end
epoch = epoch + 1
local grant = ARGV[1] .. ':' .. string.format('%d', epoch)
redis.call('SET', KEYS[2], string.format('%d', epoch))
redis.call('SET', KEYS[1], grant, 'PX', ARGV[2])
redis.call('SET', KEYS[3], grant)
return epoch
"""

# ARGV owner:epoch, ttl_ms.
_RENEW = """
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not held and redis.call('GET', KEYS[3]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

# ARGV owner:epoch.
_RELEASE = """
if redis.call('GET', KEYS[3]) == ARGV[1] then redis.call('DEL', KEYS[3]) end
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""


# KEYS[1] the role's member set; ARGV member, ttl_ms. Returns the live members.
_BEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * 10)
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""


class RedisTransportError(TimerwheelError):
    """Redis could not be reached or refused a command. Retriable: the stages back off."""


@contextmanager
def _redis_call(what: str) -> Iterator[None]:
    try:
        yield
    except redis.RedisError as exc:
        raise RedisTransportError(f"{what}: {type(exc).__name__}: {exc}") from exc


def _is_nogroup(exc: redis.ResponseError) -> bool:
    return str(exc).startswith("NOGROUP")


def alive_key(consumer: str) -> str:
    return f"tw:alive:{consumer}"


def running_processes(client: redis.Redis, lease_prefix: str = "tw:lease") -> list[str]:
    """Who is running: every consumer whose heartbeat has not lapsed, and every live shard lease
    (``role/shard by owner:epoch``). Empty when every stage process has stopped (a killed one
    drops out once its heartbeat and leases lapse)."""
    with _redis_call("list running processes"):
        alive = sorted(_text(k)[len(alive_key("")):] for k in client.scan_iter(match=alive_key("*"), count=1000))
        owners = sorted(_text(k) for k in client.scan_iter(match=f"{lease_prefix}:*:owner", count=1000))
        held = [(key, client.get(key)) for key in owners]
    leases = [f"{key[len(lease_prefix) + 2:-len('}:owner')]} by {_text(value)}" for key, value in held
              if value is not None]
    return alive + leases


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _entries(raw: Any) -> list[tuple[str, bytes]]:
    """[(id, {field: value})] -> [(id, payload)], skipping entries deleted under us (None)."""
    out: list[tuple[str, bytes]] = []
    for entry_id, fields in raw or ():
        if not fields:
            continue
        payload = fields.get(_FIELD)
        if payload is None:
            payload = fields.get(_FIELD.decode(), b"")
        out.append((entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id), payload))
    return out


#: Entries a dead-entry stream keeps (the oldest are trimmed).
DEAD_ENTRIES_KEPT = 10_000


class RedisWorkQueue:
    """``WorkQueue`` on Redis Streams. See the module docstring.

    ``client`` must return bytes (``decode_responses=False``, the default). ``get`` never
    blocks in Redis longer than ``max_block_s`` per call (kept under the client's socket
    timeout), looping until ``timeout_s`` instead.
    """

    #: Entries are bytes in Redis, shared by processes (``WorkQueue.in_process``).
    in_process = False

    def __init__(
        self,
        client: redis.Redis,
        name: str,
        partitions: int,
        bound: int,
        group: str = "tw",
        *,
        max_block_s: float = 2.0,
        max_bytes: int = 0,
    ) -> None:
        if partitions < 1:
            raise ValueError(f"RedisWorkQueue {name!r}: partitions must be >= 1, got {partitions}")
        if bound < 1:
            raise ValueError(f"RedisWorkQueue {name!r}: bound must be >= 1, got {bound}")
        kwargs = client.connection_pool.connection_kwargs
        if kwargs.get("decode_responses"):
            raise ValueError(f"RedisWorkQueue {name!r}: the client must not decode responses (payloads are bytes)")
        socket_timeout = kwargs.get("socket_timeout")
        if isinstance(socket_timeout, int | float) and socket_timeout > 0:
            max_block_s = min(max_block_s, socket_timeout * 0.8)
        self.client = client
        self.name = name
        self.partitions = partitions
        self.bound = bound
        #: ``put`` also waits while the partition's stream holds this many bytes (0: no byte bound).
        self.max_bytes = max_bytes
        self.group = group
        self._max_block_ms = max(1, int(max_block_s * 1000))
        self._put_script = client.register_script(_PUT_IF_ROOM)
        self._touch_script = client.register_script(_TOUCH_OWN)
        self._ready: set[int] = set()

    def key(self, partition: int) -> str:
        return f"tw:q:{self.name}:{partition}"

    def _check(self, partition: int) -> str:
        if not 0 <= partition < self.partitions:
            raise ValueError(f"queue {self.name!r}: partition must be 0..{self.partitions - 1}, got {partition}")
        return self.key(partition)

    def _ensure_group(self, partition: int) -> None:
        try:
            self.client.xgroup_create(self.key(partition), self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._ready.add(partition)

    def _grouped(self, partition: int, call: Callable[[], T]) -> T:
        """Run ``call`` with the partition's group in place; recreate it once if it vanished."""
        if partition not in self._ready:
            self._ensure_group(partition)
        try:
            return call()
        except redis.ResponseError as exc:
            if not _is_nogroup(exc):
                raise
        self._ensure_group(partition)
        return call()

    def put(self, partition: int, entries: Sequence[bytes], timeout_s: float) -> None:
        key = self._check(partition)
        if not entries:
            return
        deadline = time.monotonic() + timeout_s
        pause = 0.002
        with _redis_call(f"put to queue {self.name!r} partition {partition}"):
            while True:
                held = self._put_script(keys=[key], args=[self.bound, self.max_bytes, *entries])
                if held == -1:
                    return
                if time.monotonic() >= deadline:
                    raise QueueFullError(
                        f"queue {self.name!r} partition {partition} still held {held[0]} entries "
                        f"(bound {self.bound}), {max(0, int(held[1]))} bytes (max {self.max_bytes}) after {timeout_s}s"
                    )
                time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(pause * 2, 0.05)

    def get(self, partition: int, consumer: str, max_entries: int, timeout_s: float) -> list[tuple[str, bytes]]:
        key = self._check(partition)
        deadline = time.monotonic() + timeout_s
        with _redis_call(f"get from queue {self.name!r} partition {partition}"):
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                block = min(self._max_block_ms, left_ms) if left_ms >= 1 else None

                def read(block: int | None = block) -> Any:
                    return self.client.xreadgroup(
                        self.group, consumer, {key: ">"}, count=max_entries, block=block
                    )

                raw = self._grouped(partition, read)
                if isinstance(raw, dict):  # RESP3: {key: [entries]}
                    raw = [(k, v[0] if v and isinstance(v[0], list) else v) for k, v in raw.items()]
                got = _entries(raw[0][1]) if raw else []
                if got or block is None or time.monotonic() >= deadline:
                    return got

    def get_many(self, partitions: Sequence[int], consumer: str, max_entries: int,
                 timeout_s: float) -> dict[int, list[tuple[str, bytes]]]:
        """One XREADGROUP over the partitions' streams, BLOCKing up to ``timeout_s`` (in calls of
        at most ``max_block_s``): an idle stage costs Redis one call per timeout, not one per
        partition and poll."""
        if not partitions:
            return {}
        keys = {self._check(p): p for p in partitions}
        streams: Any = dict.fromkeys(keys, ">")
        deadline = time.monotonic() + timeout_s
        with _redis_call(f"get from queue {self.name!r} partitions {list(partitions)}"):
            for p in partitions:
                if p not in self._ready:
                    self._ensure_group(p)
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                block = min(self._max_block_ms, left_ms) if left_ms >= 1 else None
                raw: Any
                try:
                    raw = self.client.xreadgroup(self.group, consumer, streams, count=max_entries, block=block)
                except redis.ResponseError as exc:
                    if not _is_nogroup(exc):
                        raise
                    for p in partitions:  # a stream or its group vanished (FLUSHALL): recreate them all
                        self._ensure_group(p)
                    raw = self.client.xreadgroup(self.group, consumer, streams, count=max_entries, block=block)
                if isinstance(raw, dict):  # RESP3: {key: [entries]}
                    raw = [(k, v[0] if v and isinstance(v[0], list) else v) for k, v in raw.items()]
                out: dict[int, list[tuple[str, bytes]]] = {}
                for key, entries in raw or ():
                    got = _entries(entries)
                    if got:
                        out[keys[_text(key)]] = got
                if out or block is None or time.monotonic() >= deadline:
                    return out

    def ack(self, partition: int, entry_ids: Sequence[str]) -> None:
        key = self._check(partition)
        if not entry_ids:
            return
        with _redis_call(f"ack on queue {self.name!r} partition {partition}"):
            # One transaction: an entry is never acked yet left counting against the bound.
            pipe = self.client.pipeline(transaction=True)
            pipe.xack(key, self.group, *entry_ids)
            pipe.xdel(key, *entry_ids)
            pipe.execute()

    def clear(self, partition: int) -> int:
        """Delete the partition's stream, its entries and its group (recreated on next use);
        the dead-entry stream stays. Returns the entries that were in it."""
        key = self._check(partition)
        with _redis_call(f"clear queue {self.name!r} partition {partition}"):
            pipe = self.client.pipeline(transaction=True)
            pipe.xlen(key)
            pipe.delete(key)
            n, _ = pipe.execute()
        self._ready.discard(partition)
        return int(n)

    def dead_key(self, partition: int) -> str:
        """The stream that ``bury`` moves undecodable entries to (at most DEAD_ENTRIES_KEPT)."""
        return f"{self.key(partition)}:dead"

    def bury(self, partition: int, entries: Sequence[tuple[str, bytes, str]]) -> None:
        key = self._check(partition)
        if not entries:
            return
        with _redis_call(f"bury on queue {self.name!r} partition {partition}"):
            pipe = self.client.pipeline(transaction=True)
            for entry_id, payload, reason in entries:
                pipe.xadd(self.dead_key(partition), {"id": entry_id, "payload": payload, "reason": reason},
                          maxlen=DEAD_ENTRIES_KEPT, approximate=True)
            ids = [entry_id for entry_id, _, _ in entries]
            pipe.xack(key, self.group, *ids)
            pipe.xdel(key, *ids)
            pipe.execute()

    def dead_entries(self, partition: int) -> list[tuple[str, bytes, str]]:
        """What ``bury`` moved aside, oldest first (tests and inspection)."""
        with _redis_call(f"read dead entries of queue {self.name!r} partition {partition}"):
            rows: Any = self.client.xrange(self.dead_key(partition))
        return [(bytes(f[b"id"]).decode(), bytes(f[b"payload"]), bytes(f[b"reason"]).decode()) for _sid, f in rows]

    def heartbeat(self, consumer: str, ttl_ms: int) -> None:
        with _redis_call(f"heartbeat of {consumer!r}"):
            if ttl_ms > 0:
                self.client.set(alive_key(consumer), b"1", px=ttl_ms)
            else:
                self.client.delete(alive_key(consumer))

    def touch(self, partition: int, consumer: str, entry_ids: Sequence[str]) -> list[str]:
        key = self._check(partition)
        if not entry_ids:
            return []
        with _redis_call(f"touch on queue {self.name!r} partition {partition}"):
            gone = self._touch_script(keys=[key], args=[self.group, consumer, *entry_ids])
        return [_text(g) for g in gone or ()]

    def _claim_dead(self, partition: int, consumer: str, dead_idle_ms: int, max_entries: int) -> list[tuple[str, bytes]]:
        key = self.key(partition)
        summary = self._grouped(partition, lambda: self.client.xpending(key, self.group))
        others = [c for c in summary.get("consumers") or () if _text(c["name"]) != consumer and int(c["pending"]) > 0]
        if not others:
            return []
        out: list[tuple[str, bytes]] = []
        for c in others:
            name = _text(c["name"])
            if self.client.exists(alive_key(name)):
                continue
            rows = self.client.xpending_range(key, self.group, min="-", max="+", count=max_entries - len(out),
                                              consumername=name, idle=dead_idle_ms)
            ids: list[Any] = [r["message_id"] for r in rows]
            if ids:
                out.extend(_entries(self.client.xclaim(key, self.group, consumer, dead_idle_ms, ids)))
            if len(ids) == int(c["pending"]):
                # Nothing left with it (what was deleted under us is dropped by XCLAIM): forget it.
                self.client.xgroup_delconsumer(key, self.group, name)
            if len(out) >= max_entries:
                break
        return out

    def claim_stale(self, partition: int, consumer: str, idle_ms: int, max_entries: int,
                    dead_idle_ms: int | None = None) -> list[tuple[str, bytes]]:
        key = self._check(partition)
        out: list[tuple[str, bytes]] = []
        start = "0-0"
        with _redis_call(f"claim_stale on queue {self.name!r} partition {partition}"):
            if dead_idle_ms is not None:
                out = self._claim_dead(partition, consumer, dead_idle_ms, max_entries)
            while len(out) < max_entries:

                def claim(start: str = start) -> Any:
                    return self.client.xautoclaim(
                        key, self.group, consumer, idle_ms, start, count=max_entries - len(out)
                    )

                reply = self._grouped(partition, claim)
                out.extend(_entries(reply[1]))
                nxt = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
                if nxt == "0-0":
                    break
                start = nxt
        return out

    def depth(self, partition: int) -> int:
        key = self._check(partition)
        with _redis_call(f"depth of queue {self.name!r} partition {partition}"):
            return int(self.client.xlen(key))

    def pending(self, partition: int, limit: int = 10_000) -> dict[str, str]:
        """Entry id -> consumer of the entries handed out and not yet acked (tests, metrics)."""
        key = self._check(partition)
        with _redis_call(f"pending of queue {self.name!r} partition {partition}"):
            try:
                rows = self.client.xpending_range(key, self.group, min="-", max="+", count=limit)
            except redis.ResponseError as exc:
                if _is_nogroup(exc):
                    return {}
                raise
        out: dict[str, str] = {}
        for row in rows:
            entry_id, consumer = row["message_id"], row["consumer"]
            out[entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)] = (
                consumer.decode() if isinstance(consumer, bytes) else str(consumer)
            )
        return out

    def close(self) -> None:
        """The client belongs to the caller; nothing to release here."""


class RedisLeaseStore:
    """``LeaseStore`` on Redis. See the module docstring for epochs, TTLs and FLUSHALL."""

    def __init__(self, client: redis.Redis, prefix: str = "tw:lease") -> None:
        self.client = client
        self.prefix = prefix
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._beat = client.register_script(_BEAT)

    def _keys(self, role: str, shard: int) -> list[str]:
        """Owner key (TTL), epoch counter, grant; one hash tag, so one Redis Cluster slot."""
        base = f"{self.prefix}:{{{role}:{shard}}}"
        return [f"{base}:owner", f"{base}:epoch", f"{base}:grant"]

    def acquire(self, role: str, shard: int, owner: str, ttl_ms: int, floor: int = 0) -> int | None:
        """A new epoch, greater than every earlier one and than ``floor``; None while another
        owner holds the lease. Pass as ``floor`` the epoch in the shard's checkpoint, so the
        epoch stays monotonic even after Redis lost the counter."""
        if ttl_ms < 1:
            raise ValueError(f"lease {role}/{shard}: ttl_ms must be >= 1, got {ttl_ms}")
        with _redis_call(f"acquire lease {role}/{shard} for {owner!r}"):
            epoch = self._acquire(keys=self._keys(role, shard), args=[owner, ttl_ms, floor])
        return None if epoch is None else int(epoch)

    def renew(self, role: str, shard: int, owner: str, epoch: int, ttl_ms: int) -> bool:
        """True while (owner, epoch) is the latest grant, even if its TTL lapsed meanwhile;
        False once another owner acquired it, it was released, or Redis lost it."""
        if ttl_ms < 1:
            raise ValueError(f"lease {role}/{shard}: ttl_ms must be >= 1, got {ttl_ms}")
        with _redis_call(f"renew lease {role}/{shard} for {owner!r}"):
            return bool(self._renew(keys=self._keys(role, shard), args=[f"{owner}:{epoch}", ttl_ms]))

    def release(self, role: str, shard: int, owner: str, epoch: int) -> None:
        with _redis_call(f"release lease {role}/{shard} for {owner!r}"):
            self._release(keys=self._keys(role, shard), args=[f"{owner}:{epoch}"])

    def current_epoch(self, role: str, shard: int) -> int:
        with _redis_call(f"epoch of lease {role}/{shard}"):
            value = self.client.get(self._keys(role, shard)[1])
        return int(value) if value is not None else 0

    def beat(self, role: str, member: str, ttl_ms: int) -> list[str]:
        """``member`` of ``role`` is alive for ``ttl_ms``; returns the live members (MemberStore)."""
        if ttl_ms < 1:
            raise ValueError(f"members of {role}: ttl_ms must be >= 1, got {ttl_ms}")
        with _redis_call(f"member beat of {member!r} in {role}"):
            got = self._beat(keys=[f"{self.prefix}:members:{role}"], args=[member, ttl_ms])
        return sorted(m.decode() if isinstance(m, bytes) else str(m) for m in got)

    def leave(self, role: str, member: str) -> None:
        with _redis_call(f"leave of {member!r} from {role}"):
            self.client.zrem(f"{self.prefix}:members:{role}", member)

    def holder(self, role: str, shard: int) -> tuple[str, int] | None:
        """(owner, epoch) holding the lease now, or None: for status reports."""
        with _redis_call(f"holder of lease {role}/{shard}"):
            value = self.client.get(self._keys(role, shard)[0])
        if value is None:
            return None
        text = value.decode() if isinstance(value, bytes) else str(value)
        name, _, epoch = text.rpartition(":")
        return name, int(epoch)
