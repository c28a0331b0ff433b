"""The interfaces every stage is written against.

``CommitLog`` is the durable log (Kafka in production, ``LocalCommitLog`` embedded);
``GroupCommitLog`` adds consumer groups (``GroupConsumer``) for ``timerwheel.retry``.
``WorkQueue`` is a partitioned, bounded, at-least-once queue with acks (Redis Streams in
production, in-process queues embedded). ``LeaseStore`` grants shard ownership with a
monotonically increasing epoch (fencing); ``MemberStore`` lists the live replicas of a
shard-owning stage, among which the shards are balanced.

What only some transports can do is a capability of its own, a ``runtime_checkable`` protocol
that a caller asks for with ``isinstance``:

- ``FollowingLog``: ``follow(topic)`` keeps a topic's records in memory for ``read``
  (both commit logs, each its own way; dequeue-getmsg asks it for the timer topic);
- ``ExpiringLog``: ``expire`` deletes what is older than the retention (the local log; Kafka
  keeps its own ``retention.ms``);
- ``AtomicLog``: ``append_atomic`` writes records all or none (Kafka's transactions; the local
  log's journal, all or none after a crash; ``TimerClient.reschedule``, exactly-once releases);
- ``DeadLetterLog``: ``dead_letter_once`` writes a timer partition's dead letters exactly once
  across restarts, crashes and zombies (Kafka's transactions with a consumer group's offset; the
  local log's journal with a done-offset record; enqueue-get);
- ``ReportsUndecodable``: a consumer that sets aside a partition whose next batch cannot be
  decoded and says which in ``undecodable`` (Kafka's; enqueue-get reports them as metrics).

A work queue says whether it hands entries over inside this process (``WorkQueue.in_process``):
the stages then put entry objects into it without encoding them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from timerwheel.records import OutRecord, Record


class Consumer(Protocol):
    """Reads some partitions of one topic from offsets the caller owns (no group commits)."""

    def poll(self, max_records: int, timeout_s: float) -> list[Record]:
        """Up to ``max_records`` records, in offset order per partition; [] after the timeout."""
        ...

    def seek(self, partition: int, offset: int) -> None: ...

    def position(self, partition: int) -> int:
        """The next offset to read for ``partition``: past every offset ``poll`` has returned or
        skipped (transaction markers, aborted and compacted records). The records a caller has
        from ``[old position, new position)`` are all there are in that range."""
        ...

    def close(self) -> None: ...


class CommitLog(Protocol):
    def ensure_topic(self, topic: str, partitions: int) -> int:
        """Create ``topic`` if missing; return its partition count."""
        ...

    def partitions(self, topic: str) -> int:
        """Partition count of an existing topic (creating it with a default count if the log auto-creates)."""
        ...

    def partition_count(self, topic: str) -> int | None:
        """Partition count, or None if ``topic`` does not exist; never creates it (a log that
        creates topics on first write says so by never answering None)."""
        ...

    def append(self, records: Sequence[OutRecord]) -> list[tuple[int, int]]:
        """Append durably (Kafka: acks=all) and return ``(partition, offset)`` for each record,
        in order. Raises on failure: nothing is reported written that was not. The exception's
        ``written`` (aligned with ``records``) says which landed, ``refused`` which the log refuses
        for good, and ``missing`` which were not sent because their topic does not exist."""
        ...

    def read(self, topic: str, positions: Sequence[tuple[int, int]]) -> list[Record | None]:
        """Batched random reads by ``(partition, offset)``; ``None`` where the record is gone
        (deleted by retention or beyond the end)."""
        ...

    def consumer(self, topic: str, offsets: Mapping[int, int], *, keep: bool = True) -> Consumer:
        """A consumer of ``topic`` positioned at ``offsets`` (partition -> next offset). ``keep``:
        what it reads of a followed topic may be kept for a later ``read`` (the local log's read
        cache); False for a reader whose records nobody reads again (dequeue-put's watch)."""
        ...

    def end_offsets(self, topic: str) -> dict[int, int]:
        """Partition -> the end a reader of committed records reaches: on Kafka the last stable
        offset (below an open transaction's first record), elsewhere the offset the next
        appended record will get."""
        ...

    def high_watermarks(self, topic: str) -> dict[int, int]:
        """Partition -> the offset the next appended record will get, whether the records below
        it are committed or not (Kafka's high watermark, what a ``read_uncommitted`` reader
        reaches; the local log has no transactions: its ends). Every record the log acknowledged
        before the call lies below it, also one appended after another producer's transaction
        began on the partition, which ``end_offsets`` leaves out until the transaction ends."""
        ...

    def start_offsets(self, topic: str) -> dict[int, int]:
        """Partition -> oldest offset still held."""
        ...

    def cluster_id(self) -> str | None:
        """The id of the cluster (of the local log: its directory's), None if it cannot tell; a
        cluster or log made again has another."""
        ...

    def topic_id(self, topic: str) -> str | None:
        """The id of this incarnation of ``topic``, None if it does not exist or the log cannot
        tell; a topic deleted and made again has another. The offsets a data directory's shards
        checkpointed belong to one incarnation (``store.deployment.Source``)."""
        ...

    def close(self) -> None: ...


class GroupConsumer(Protocol):
    """Reads topics as a member of a consumer group: where it starts is what the group last
    committed (the earliest offset for a new group), not the caller's checkpoint."""

    def poll(self, max_records: int, timeout_s: float) -> list[Record]:
        """Up to ``max_records`` records of the group's topics (in offset order per partition);
        [] after the timeout."""
        ...

    def commit(self, offsets: Mapping[tuple[str, int], int]) -> None:
        """Record ``(topic, partition) -> next offset`` for the group, durably when it returns.
        Raises ``TimerwheelError`` when it could not (the records may then be read again)."""
        ...

    def close(self) -> None: ...


class GroupCommitLog(CommitLog, Protocol):
    """A commit log that also keeps consumer groups' offsets (Kafka's groups; a file per group
    beside the local log)."""

    def group_consumer(self, group: str, topics: Sequence[str],
                       options: Mapping[str, object] | None = None) -> GroupConsumer:
        """A member of ``group`` reading ``topics``; ``options`` are the transport's own settings
        (kafka-python's ``KafkaConsumer`` options for Kafka)."""
        ...


@runtime_checkable
class FollowingLog(Protocol):
    """A commit log that can keep a topic's records in memory for ``read`` (a ``ReadCache``)."""

    def follow(self, topic: str) -> None:
        """From now on, keep records of ``topic`` this log reads, so that ``read`` serves them
        from memory (a no-op when the log's read cache is sized 0)."""
        ...


@runtime_checkable
class ExpiringLog(Protocol):
    """A commit log that enforces a retention by time itself (Kafka's brokers do their own)."""

    def expire(self, now_ms: int, retention_ms: int) -> int:
        """Delete what is older than ``retention_ms`` at ``now_ms``; returns the segments deleted."""
        ...


@runtime_checkable
class AtomicLog(Protocol):
    """A commit log that can write several records all or none."""

    def append_atomic(self, records: Sequence[OutRecord], transactional_id: str) -> list[tuple[int, int]]:
        """As ``CommitLog.append``, in one transaction: a reader sees every record or none; on
        failure nothing was written. (The local log: all or none once a crash is recovered; a
        reader may see part of a batch while it is written.) ``transactional_id`` is the writer's, the same across its
        restarts: a writer that starts again with it ends what its crashed predecessor left open
        at once (Kafka aborts it) and fences it."""
        ...


@runtime_checkable
class DeadLetterLog(Protocol):
    """A commit log that writes enqueue-get's dead letters once per invalid record."""

    def dead_letter_once(self, prefix: str, source_topic: str, partition: int,
                         letters: Sequence[tuple[int, OutRecord]]) -> int:
        """Write ``letters`` ((source offset, dead letter), offsets ascending) of one partition of
        ``source_topic``, skipping those written before (under ``prefix``) by this or any earlier
        writer: all or none, in one transaction of the writer ``<prefix>-dlq-<partition>``, which
        fences earlier ones. Returns how many it wrote. On failure (``TimerwheelError``) call again
        with the same letters: none is ever written twice."""
        ...


@dataclass
class Undecodable:
    """A partition whose next batch cannot be decoded: where, why, since when (monotonic), tries so far."""

    partition: int
    offset: int
    reason: str
    since: float
    tries: int = 1


@runtime_checkable
class ReportsUndecodable(Protocol):
    """A consumer that sets aside a partition whose next batch cannot be decoded (corruption, a
    codec it lacks) and reads the others on."""

    @property
    def undecodable(self) -> Mapping[int, Undecodable]:
        """partition -> why it is set aside, for as long as it is."""
        ...


class WorkQueue(Protocol):
    """One named queue with ``partitions`` partitions (one per shard), each bounded.

    Entries are opaque bytes. ``get`` hands entries to one consumer; an entry stays pending
    until acked, and ``claim_stale`` gives entries pending longer than ``idle_ms`` (their
    consumer died, or is stuck) to another consumer. A consumer that says it is alive with
    ``heartbeat`` and then stops saying so is dead: its entries are claimable sooner, after
    ``dead_idle_ms``.

    ``in_process`` is True for a queue whose entries never leave this process: it takes any
    object as an entry (``stages.codec.wire`` then skips the encoding) and needs no heartbeats.
    """

    name: str
    partitions: int
    in_process: bool

    def put(self, partition: int, entries: Sequence[bytes], timeout_s: float) -> None:
        """Append; blocks while the partition holds ``bound`` entries or more, or ``max_bytes``
        bytes or more when set (TW_QUEUE_BYTES). Raises ``QueueFullError`` if it is still full
        after ``timeout_s``."""
        ...

    def get(self, partition: int, consumer: str, max_entries: int, timeout_s: float) -> list[tuple[str, bytes]]:
        """Up to ``max_entries`` new entries ``(entry_id, payload)``; [] after the timeout."""
        ...

    def get_many(self, partitions: Sequence[int], consumer: str, max_entries: int,
                 timeout_s: float) -> dict[int, list[tuple[str, bytes]]]:
        """New entries of several partitions at once, up to ``max_entries`` each, keyed by
        partition (only those with entries); waits up to ``timeout_s`` for the first entry of
        any of them (an idle stage blocks here instead of polling), {} after the timeout."""
        ...

    def ack(self, partition: int, entry_ids: Sequence[str]) -> None: ...

    def bury(self, partition: int, entries: Sequence[tuple[str, bytes, str]]) -> None:
        """Move entries ``(entry_id, payload, reason)`` that cannot be decoded aside, into the
        queue's dead-entry stream, and ack them: never retried, kept for inspection."""
        ...

    def claim_stale(self, partition: int, consumer: str, idle_ms: int, max_entries: int,
                    dead_idle_ms: int | None = None) -> list[tuple[str, bytes]]:
        """Entries delivered to some consumer but not acked for ``idle_ms``: now this consumer's.
        With ``dead_idle_ms``, also those pending that long with a consumer whose heartbeat lapsed."""
        ...

    def heartbeat(self, consumer: str, ttl_ms: int) -> None:
        """``consumer`` is alive for the next ``ttl_ms``; 0: not any more (a process that stopped:
        what it left pending is claimed after DEAD_IDLE_MS, not after its last TTL)."""
        ...

    def touch(self, partition: int, consumer: str, entry_ids: Sequence[str]) -> list[str]:
        """Reset the pending idle time of the entries still pending with ``consumer`` (a consumer that
        holds entries on purpose keeps them from ``claim_stale``); returns those it no longer has."""
        ...

    def depth(self, partition: int) -> int:
        """Entries not yet acked (waiting plus pending)."""
        ...

    def close(self) -> None: ...


def entry_bytes(payload: object) -> int:
    """Bytes a work-queue entry holds: its length, or an in-process entry object's ``nbytes``
    (the record bodies a deliver entry carries; 0 for entries that carry none)."""
    if isinstance(payload, bytes | bytearray | memoryview):
        return len(payload)
    return int(getattr(payload, "nbytes", 0))


class LeaseStore(Protocol):
    """Shard ownership with fencing epochs.

    ``acquire`` returns a new epoch strictly greater than any granted before for that
    (role, shard), or None while another live owner holds it. ``renew`` keeps it and returns
    False once the lease was lost (expired and taken). ``current_epoch`` lets a writer check,
    before a write, that it still holds the newest epoch.
    """

    def acquire(self, role: str, shard: int, owner: str, ttl_ms: int, floor: int = 0) -> int | None:
        """A new epoch > every earlier one and > ``floor`` (the epoch in the shard's checkpoint,
        so epochs keep growing even if the store lost its state), or None while held by another."""
        ...

    def renew(self, role: str, shard: int, owner: str, epoch: int, ttl_ms: int) -> bool: ...

    def release(self, role: str, shard: int, owner: str, epoch: int) -> None: ...

    def current_epoch(self, role: str, shard: int) -> int: ...


class MemberStore(Protocol):
    """The live replicas of a shard-owning stage (``role``), for balancing shards among them.

    ``beat`` says ``member`` is alive for the next ``ttl_ms`` and returns every member whose
    last beat has not lapsed (``member`` included); ``leave`` removes ``member`` at once.
    """

    def beat(self, role: str, member: str, ttl_ms: int) -> list[str]: ...

    def leave(self, role: str, member: str) -> None: ...
