"""Kafka transactions: one transactional producer per id, and enqueue-get's dead letters in them.

``TransactionalProducer`` holds the producer of one ``transactional.id``. Made on first use, it
calls ``init_transactions()``, which bumps the id's producer epoch: Kafka aborts a transaction a
crashed or paused predecessor left open and fences that producer (its next send or commit raises
``ProducerFencedError``). ``run`` writes records (and, with ``offsets``, a consumer group's
offsets) in one transaction: all of them or none. Its commit runs in a helper thread joined with a
timeout, because kafka-python 3's ``commit_transaction()`` waits without one: with the broker down
at the commit it stayed blocked for good (docs/design/precision-and-exactly-once.md, 7.1). A
commit that does not answer in time has an unknown outcome: the producer is dropped (its thread
left blocked) and the caller learns it from the ``KafkaLogError``'s ``unknown_outcome``; the next
``run`` makes a producer with the same id, whose ``init_transactions`` ends the pending
transaction one way or the other before anything else is written.

``DeadLetters`` is enqueue-get's exactly-once dead-lettering (issue 31; design 7.1, E3 and E4).
For each timer partition with an invalid record, a producer with id ``<prefix>-dlq-<partition>``;
after its init, the committed offset of consumer group ``<prefix>-dlq`` for that partition says
which invalid records were dead-lettered already (those below it) and are skipped; the others go
in one transaction with the group's offset moved past the last of them. So a restart from an
older checkpoint, a crash between the sends and the commit (aborted by the next init), a commit
of unknown outcome (the group offset read again after the next init) and a zombie enqueue-get
(fenced per partition by the next one's init) each leave every invalid record in the dead-letter
topic once, for a ``read_committed`` reader. A producer idle for ``IDLE_CLOSE_S`` is closed:
dead letters are rare.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from typing import Any

import kafka.errors as kafka_errors
from kafka import OffsetAndMetadata, TopicPartition

from timerwheel.progress import READ_BACK_MARGIN_MS, Finished, Progress
from timerwheel.records import OutRecord, Record
from timerwheel.transports.kafka import internals
from timerwheel.transports.kafka.admin import Topics
from timerwheel.transports.kafka.clients import KafkaClients, send_record
from timerwheel.transports.kafka.errors import REFUSED, KafkaLogError, kafka_call, refusal

__all__ = ["DEAD_LETTER_TRANSACTION_TIMEOUT_MS", "DELIVERY_TRANSACTION_TIMEOUT_MS", "DeadLetters", "ShardDeliveries",
           "TransactionalProducer"]

#: The dead-letter transactions' timeout (also how long a commit is waited for): a crashed
#: enqueue-get's open transaction holds the dead-letter topic's last stable offset this long at
#: most, or until the next enqueue-get's init.
DEAD_LETTER_TRANSACTION_TIMEOUT_MS = 10_000
#: A partition's dead-letter producer unused this long is closed.
IDLE_CLOSE_S = 60.0


class TransactionalProducer:
    """The producer of one ``transactional.id``: made and initialised on first use, dropped after
    any failure (the next ``run`` makes it again, and its init fences whatever is left)."""

    def __init__(self, clients: KafkaClients, transactional_id: str, *, timeout_ms: int,
                 commit_wait_s: float | None = None, compression: str | None = None,
                 max_request_size: int = 1024 * 1024) -> None:
        """``timeout_ms`` is the transaction timeout, and how long a commit is waited for unless
        ``commit_wait_s`` says otherwise."""
        self._clients = clients
        self.transactional_id = transactional_id
        self.timeout_ms = timeout_ms
        self.commit_wait_s = timeout_ms / 1000 if commit_wait_s is None else commit_wait_s
        self._compression = compression
        self._max_request_size = max_request_size
        self._producer: Any = None
        #: time.monotonic() of the last ``run``.
        self.used_at = time.monotonic()

    def init(self) -> bool:
        """Make the producer and ``init_transactions()`` if not done yet: from here on no older
        producer of this id can commit. True when it did (a new producer epoch)."""
        if self._producer is not None:
            return False
        producer = self._clients.producer(
            "tx-producer", transactional_id=self.transactional_id, transaction_timeout_ms=self.timeout_ms,
            compression_type=self._compression, max_request_size=self._max_request_size)
        try:
            with kafka_call(f"init transactional producer {self.transactional_id!r}"):
                producer.init_transactions()
        except KafkaLogError:
            internals.force_close(producer, 0)
            raise
        self._producer = producer
        return True

    def run(self, records: Sequence[OutRecord], offsets: Mapping[TopicPartition, int] | None = None,
            group: str | None = None) -> list[tuple[int, int]]:
        """Write ``records`` (and ``offsets`` for ``group``) in one transaction; their positions.
        On failure nothing was written, or (``KafkaLogError.unknown_outcome``) the commit did not
        answer in time and the next ``init`` decides. Records Kafka refuses for good (too large)
        are named in ``KafkaLogError.refused`` and nothing is written."""
        self.init()
        producer = self._producer
        self.used_at = time.monotonic()
        what = f"transaction of {len(records)} records under {self.transactional_id!r}"
        try:
            producer.begin_transaction()
            futures = []
            refused: dict[int, str] = {}
            for i, r in enumerate(records):
                try:
                    futures.append(send_record(producer, r, r.timestamp_ms))
                except REFUSED as exc:
                    refused[i] = refusal(exc)
            if refused:  # none of them is written: the caller replaces the refused ones and calls again
                raise KafkaLogError(f"{what}: {len(refused)} records refused, first: {next(iter(refused.values()))}",
                                    refused=refused)
            if offsets:
                producer.send_offsets_to_transaction(
                    {tp: OffsetAndMetadata(o, "", -1) for tp, o in offsets.items()}, group)
            failure: list[BaseException] = []
            committer = threading.Thread(target=_commit, args=(producer, failure), daemon=True,
                                         name=f"commit-{self.transactional_id}")
            committer.start()
            committer.join(self.commit_wait_s)
            if committer.is_alive():
                self.drop()
                raise KafkaLogError(f"{what}: commit not answered within {self.commit_wait_s:g} s (outcome unknown)",
                                    unknown_outcome=True)
            if failure:
                raise failure[0]
            return [(md.partition, md.offset) for md in (f.get(timeout=self.timeout_ms / 1000) for f in futures)]
        except (kafka_errors.KafkaError, KafkaLogError) as exc:
            with suppress(kafka_errors.KafkaError):
                producer.abort_transaction()
            self.drop()  # fenced, or in a state it may not leave: a new one next time
            if isinstance(exc, KafkaLogError):
                raise
            raise KafkaLogError(f"{what} failed: {exc}") from None

    def drop(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            internals.force_close(producer, 0)

    def close(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            internals.force_close(producer, 5)


def _commit(producer: Any, failure: list[BaseException]) -> None:
    try:
        producer.commit_transaction()
    except kafka_errors.KafkaError as exc:
        failure.append(exc)


class DeadLetters:
    """enqueue-get's dead letters, once per invalid record (module header)."""

    def __init__(self, clients: KafkaClients, topics: Topics, *, compression: str | None,
                 max_request_size: int) -> None:
        self._clients = clients
        self._topics = topics
        self._compression = compression
        self._max_request_size = max_request_size
        #: transactional id -> its producer.
        self._producers: dict[str, TransactionalProducer] = {}
        #: transactional id -> the group's committed offset for its partition, as of our last commit
        #: (or read after the producer's init).
        self._done: dict[str, int] = {}
        self._lock = threading.Lock()

    def write(self, prefix: str, source_topic: str, partition: int,
              letters: Sequence[tuple[int, OutRecord]]) -> int:
        """Dead-letter ``letters`` ((source offset, dead letter), offsets ascending) of one timer
        partition: those at or above group ``<prefix>-dlq``'s committed offset, with the offset
        moved past the last, in one transaction. Returns how many were written (the rest had been
        already). Raises ``KafkaLogError`` when it could not: call again, nothing is duplicated."""
        with self._lock:
            self._close_idle()
            tx_id = f"{prefix}-dlq-{partition}"
            producer = self._producers.get(tx_id)
            if producer is None:
                producer = self._producers[tx_id] = TransactionalProducer(
                    self._clients, tx_id, timeout_ms=DEAD_LETTER_TRANSACTION_TIMEOUT_MS,
                    compression=self._compression, max_request_size=self._max_request_size)
            group = f"{prefix}-dlq"
            tp = TopicPartition(source_topic, partition)
            # Read after every init: a commit of unknown outcome, or another enqueue-get's, is decided
            # by then. Between two of our own commits nothing else can commit under this id.
            if producer.init() or tx_id not in self._done:
                self._done[tx_id] = self._topics.group_offset(group, tp)
            done = self._done[tx_id]
            todo = [(o, r) for o, r in letters if o >= done]
            if not todo:
                return 0
            try:
                producer.run([r for _, r in todo], {tp: todo[-1][0] + 1}, group)
            except KafkaLogError:
                self._done.pop(tx_id, None)
                raise
            self._done[tx_id] = todo[-1][0] + 1
            return len(todo)

    def _close_idle(self) -> None:
        now = time.monotonic()
        for tx_id, producer in list(self._producers.items()):
            if now - producer.used_at >= IDLE_CLOSE_S:
                producer.close()
                del self._producers[tx_id]
                self._done.pop(tx_id, None)

    def close(self) -> None:
        with self._lock:
            for producer in self._producers.values():
                producer.close()
            self._producers.clear()
            self._done.clear()


#: A shard owner's delivery transactions' timeout (TW_TRANSACTION_TIMEOUT_MS's default): a crashed
#: owner's open transaction holds its destinations' last stable offsets this long at most, or
#: until the next owner's init.
DELIVERY_TRANSACTION_TIMEOUT_MS = 10_000


class ShardDeliveries:
    """Exactly-once releases of one shard (design 7.1; dequeue-put's ``stages.exactly_once``).

    ``take`` makes the producer of ``<prefix>-deliver-<shard>`` and runs ``init_transactions``
    (fencing every older owner's producer and ending its open transaction), then reads the shard's
    progress partition back from ``R - READ_BACK_MARGIN_MS``: the ``Finished`` set it returns names
    every record a committed transaction released. ``commit`` writes a batch's records and its
    progress record in one transaction. A commit of unknown outcome (``KafkaLogError.unknown_outcome``)
    or any failure calls for ``take`` again before anything else is written: the next init decides
    the open transaction, and the read-back tells what it did."""

    def __init__(self, clients: KafkaClients, read_since: Callable[[str, int, int], Sequence[Record]], prefix: str,
                 progress_topic: str, shard: int, *, timeout_ms: int = DELIVERY_TRANSACTION_TIMEOUT_MS,
                 compression: str | None = None, max_request_size: int = 1024 * 1024) -> None:
        """``read_since``: ``KafkaCommitLog.read_since`` (the read-back). Made by
        ``KafkaCommitLog.shard_deliveries``."""
        self._read_since = read_since
        self.shard = shard
        self.progress_topic = progress_topic
        self.producer = TransactionalProducer(clients, f"{prefix}-deliver-{shard}", timeout_ms=timeout_ms,
                                              compression=compression, max_request_size=max_request_size)
        #: False until ``take`` succeeded, and again after any failure of ``commit``.
        self.ready = False

    def take(self, read_ms: int) -> Finished:
        """Init (fence the others), then what committed progress records name from ``R`` on."""
        self.producer.drop()
        self.ready = False
        self.producer.init()
        since = max(0, read_ms - READ_BACK_MARGIN_MS)
        records = self._read_since(self.progress_topic, self.shard, since)
        finished = Finished.read_back(self.shard, [r.value for r in records], read_ms)
        self.ready = True
        return finished

    def commit(self, records: Sequence[OutRecord], progress: Progress, now_ms: int) -> list[tuple[int, int]]:
        """``records`` and ``progress`` (stamped ``now_ms``: the release time) in one transaction;
        the records' positions. ``KafkaLogError`` when nothing is known to be written: ``take``
        again before the next commit."""
        if not self.ready:
            raise KafkaLogError(f"deliveries of shard {self.shard}: take the shard (init, read back) first")
        mark = progress.record(self.progress_topic, now_ms)
        try:
            return self.producer.run([*records, mark])[: len(records)]
        except KafkaLogError:
            self.ready = False
            raise

    def close(self) -> None:
        self.producer.close()
