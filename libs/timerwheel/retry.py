"""Consumer retry with delay levels and a dead-letter topic, on timerwheel (RocketMQ 4.x's consumer retry).

    def handle(delivery: Delivery) -> None:
        ...                        # return: done; raise: the record comes back later, or goes to the DLQ
    with RetryConsumer(KafkaCommitLog("host:9092"), "billing", ["orders"], handle) as consumer:
        consumer.run()             # until consumer.stop(); or call consumer.poll_once() in a loop of yours

RocketMQ 4.x sends a message its consumer failed back to the broker with ``delayLevel = 3 +
reconsumeTimes``, into the consumer group's own retry topic (``%RETRY%<group>``), and after
``maxReconsumeTimes`` (16) failures into the group's dead-letter queue (``%DLQ%<group>``). This
module does the same on Kafka (or the embedded local log), with timerwheel as the delay:

- A member of ``group`` reads its topics and the group's retry topic (``<group>.retry``) together
  and hands each record to the handler as a ``Delivery``.
- A handler that raises hands the record back. Reconsumed fewer than ``max_reconsume_times``
  times, it is scheduled through timerwheel to ``<group>.retry`` with ``tw-delay-level`` =
  ``min(3 + reconsume_times, levels in the table)``, ``tw-reconsume-times`` one higher, and the
  origin of its first delivery (``tw-origin-topic``, ``tw-origin-partition``, ``tw-origin-offset``).
  Otherwise it goes to ``<group>.dlq`` with the same count and origin, ``tw-error`` (the
  exception's class and message) and ``tw-source`` (where it was read last).
- Only this group reads ``<group>.retry``: another group of the same topics never sees the retries
  (``%RETRY%`` and ``%DLQ%`` are not legal Kafka topic names, hence the suffixes).

What it guarantees, and why:

- Nothing is lost. A batch is what one poll returns (at most ``batch_size`` records); its offsets
  are committed only after every retry and dead letter of the batch is durably written (Kafka
  ``acks=all``, the local log's fsync). A write that fails is tried again, and no further record
  is read, until it succeeds. A consumer killed at any point leaves its batch uncommitted, and the
  group reads it again.
- Duplicates are bounded. After such a crash each record of the uncommitted batch may be handled
  once more, and one that failed may have been scheduled twice (both copies come back): a crash
  adds at most ``batch_size`` final outcomes (successful handlings or dead letters). The origin
  stays the same across every retry and copy: the key to drop a duplicate on.
- Bad input never stops it: any ``Exception`` of the handler is that record's failure, and retry
  headers that cannot be read are ignored (and logged): the record counts as a first delivery,
  and its next retry carries sound headers again. Retry headers on the group's own topics are
  ignored too (a record replayed from the DLQ starts again at 0).

Assumes that the timerwheel serving ``config.timer_topic`` has the same delay-level table
(``TW_DELAY_LEVELS``) and allows ``<group>.retry`` as a destination (``TW_ALLOW_TOPICS``; refused
here at construction when ``config`` does not).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from timerwheel.client import Timer, TimerClient
from timerwheel.clock import Clock
from timerwheel.config import TimerConfig
from timerwheel.errors import ConfigError, TimerwheelError
from timerwheel.log import stage_logger
from timerwheel.records import Headers, OutRecord, Record
from timerwheel.transports.base import GroupCommitLog
from timerwheel.wire import (
    TOPIC_NAME,
    RetryState,
    TimerRules,
    dead_letter_headers,
    handed_headers,
    retry_headers,
    retry_state,
)

__all__ = ["DEFAULT_MAX_RECONSUME_TIMES", "RETRY_BASE_LEVEL", "BatchResult", "Delivery", "RetryConsumer"]

#: The first retry's delay level; the n-th failure retries at ``RETRY_BASE_LEVEL + n - 1`` (RocketMQ's 3).
RETRY_BASE_LEVEL = 3
#: RocketMQ's ``maxReconsumeTimes``.
DEFAULT_MAX_RECONSUME_TIMES = 16
#: ``tw-error`` keeps this much of the exception's text.
_ERROR_CHARS = 500
#: Tries of a failed commit before the batch is left to be read again.
_COMMIT_TRIES = 3
_MAX_BACKOFF_S = 5.0


@dataclass(frozen=True, slots=True)
class Delivery:
    """One record handed to the handler. ``topic``, ``partition``, ``offset`` say where it was read
    (an original topic or the retry topic); ``origin_*`` where it was first read, the same for every
    retry and every duplicate. ``headers`` are the record's without the retry headers (and, on a
    retry, without the ``tw-id`` / ``tw-roll`` / ``tw-*-at`` stamps of its hop through timerwheel)."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: Headers
    #: How many times the record was handed back before (0 on its first delivery).
    reconsume_times: int
    origin_topic: str
    origin_partition: int
    origin_offset: int
    partition: int
    offset: int
    #: The record's timestamp (for a retry: when timerwheel delivered it).
    timestamp_ms: int

    @property
    def origin(self) -> tuple[str, int, int]:
        return self.origin_topic, self.origin_partition, self.origin_offset


@dataclass(frozen=True, slots=True)
class BatchResult:
    """What one ``poll_once`` did."""

    records: int = 0
    succeeded: int = 0
    retried: int = 0
    dead_lettered: int = 0
    #: The batch's offsets were committed (False: it will be read again, by this group).
    committed: bool = False


def _reason(exc: BaseException) -> str:
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - an exception that cannot say what it is still fails its record
        message = "(its message cannot be read)"
    return (f"{name}: {message}" if message else name)[:_ERROR_CHARS]


class RetryConsumer:
    """A member of consumer group ``group`` that runs ``handler`` on every record of ``topics`` and
    retries failures through timerwheel (see the module header)."""

    def __init__(self, commit_log: GroupCommitLog, group: str, topics: Sequence[str],
                 handler: Callable[[Delivery], object], *, config: TimerConfig | None = None,
                 clock: Clock | None = None, max_reconsume_times: int = DEFAULT_MAX_RECONSUME_TIMES,
                 retry_topic: str | None = None, dlq_topic: str | None = None, batch_size: int = 100,
                 consumer_options: Mapping[str, Any] | None = None) -> None:
        """``commit_log``: ``KafkaCommitLog`` or ``LocalCommitLog``; what it writes (retries, dead
        letters) and where the group reads. ``config``: the timerwheel it schedules through (timer
        topic, delay levels, allowed destinations). ``consumer_options``: more settings of the
        group's consumer (kafka-python's, e.g. ``group_instance_id``, ``session_timeout_ms``)."""
        cfg = config or TimerConfig()
        retry_topic = retry_topic or f"{group}.retry"
        dlq_topic = dlq_topic or f"{group}.dlq"
        self._check(cfg, group, topics, retry_topic, dlq_topic, max_reconsume_times, batch_size)
        self.group = group
        self.topics = tuple(topics)
        self.retry_topic = retry_topic
        self.dlq_topic = dlq_topic
        self.handler = handler
        self.max_reconsume_times = max_reconsume_times
        self.batch_size = batch_size
        self.log = stage_logger("retry").bind(group=group)
        self.commit_log = commit_log
        self.client = TimerClient(commit_log, cfg, clock)
        self.levels = len(cfg.delay_levels_ms)
        # The retry and dead-letter topics get as many partitions as the widest topic read, so the
        # group spreads over its members as before.
        partitions = max((commit_log.partition_count(t) or 1 for t in self.topics), default=1)
        commit_log.ensure_topic(retry_topic, partitions)
        commit_log.ensure_topic(dlq_topic, partitions)
        self._stop = threading.Event()
        self._closed = False
        self._consumer = commit_log.group_consumer(group, [*self.topics, retry_topic], consumer_options)
        self.log.info("started", topics=list(self.topics), retry_topic=retry_topic, dlq_topic=dlq_topic,
                      max_reconsume_times=max_reconsume_times, batch_size=batch_size)

    @staticmethod
    def _check(cfg: TimerConfig, group: str, topics: Sequence[str], retry_topic: str, dlq_topic: str,
               max_reconsume_times: int, batch_size: int) -> None:
        def need(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ConfigError(name, message)

        need(bool(group) and TOPIC_NAME.fullmatch(group) is not None, "group",
             f"must be 1..243 of [A-Za-z0-9._-] (it names the topics <group>.retry and <group>.dlq), got {group!r}")
        need(isinstance(topics, Sequence) and not isinstance(topics, str) and len(topics) > 0, "topics",
             f"must name at least one topic, got {topics!r}")
        for name, topic in (("retry_topic", retry_topic), ("dlq_topic", dlq_topic), *(("topics", t) for t in topics)):
            need(TOPIC_NAME.fullmatch(topic) is not None and topic not in (".", ".."), name,
                 f"not a legal topic name: {topic!r}")
        need(retry_topic != dlq_topic, "dlq_topic", f"must differ from retry_topic {retry_topic!r}")
        need(not {retry_topic, dlq_topic} & set(topics), "topics",
             f"must not hold the group's own retry or dead-letter topic ({retry_topic}, {dlq_topic})")
        need(max_reconsume_times >= 0, "max_reconsume_times", f"must be >= 0, got {max_reconsume_times}")
        need(batch_size >= 1, "batch_size", f"must be >= 1, got {batch_size}")
        refused = TimerRules(cfg).destination_error(retry_topic)
        need(not refused, "retry_topic", f"timerwheel would not deliver to it: {refused}")

    # -- the loop ------------------------------------------------------------------------------

    def run(self, poll_timeout_s: float = 1.0) -> None:
        """Poll, handle and commit batch after batch until ``stop()``."""
        while not self._stop.is_set():
            self.poll_once(poll_timeout_s)

    def stop(self) -> None:
        """Make ``run`` return after the current batch (a batch whose writes are still being
        retried is left uncommitted, to be read again)."""
        self._stop.set()

    def poll_once(self, timeout_s: float = 1.0) -> BatchResult:
        """Read one batch, hand every record to the handler, write the retries and dead letters,
        then commit the batch's offsets."""
        try:
            records = self._consumer.poll(self.batch_size, timeout_s)
        except TimerwheelError as exc:
            self.log.warning("poll failed", error=str(exc))
            self._stop.wait(1.0)
            return BatchResult()
        if not records:
            return BatchResult()
        timers: list[Timer] = []
        dead: list[OutRecord] = []
        first_error = ""
        for record in records:
            state = self._state(record)
            delivery = Delivery(record.topic, record.key, record.value,
                                handed_headers(record, record.topic == self.retry_topic), state.reconsume_times,
                                state.origin_topic, state.origin_partition, state.origin_offset, record.partition,
                                record.offset, record.timestamp_ms)
            try:
                self.handler(delivery)
                continue
            except Exception as exc:  # noqa: BLE001 - whatever the handler raises is this record's failure
                reason = _reason(exc)
            first_error = first_error or reason
            if state.reconsume_times >= self.max_reconsume_times:
                dead.append(self._dead_letter(record, state, reason))
            else:
                timers.append(self._retry(record, state))
        if not self._write(timers, dead):
            return BatchResult(len(records), len(records) - len(timers) - len(dead), len(timers), len(dead), False)
        if timers or dead:
            self.log.info("handed back", records=len(records), retried=len(timers), dead_lettered=len(dead),
                          first_error=first_error)
        committed = self._commit(records)
        return BatchResult(len(records), len(records) - len(timers) - len(dead), len(timers), len(dead), committed)

    def _state(self, record: Record) -> RetryState:
        if record.topic != self.retry_topic:  # the group's own topics: always a first delivery
            return RetryState(0, record.topic, record.partition, record.offset)
        state = retry_state(record)
        if state.malformed:
            self.log.warning("malformed retry headers ignored", topic=record.topic, partition=record.partition,
                             offset=record.offset, reason=state.malformed)
        return state

    def _retry(self, record: Record, state: RetryState) -> Timer:
        times = state.reconsume_times + 1
        level = min(RETRY_BASE_LEVEL + state.reconsume_times, self.levels)
        # The same id for every copy of one retry: duplicates after a crash can be told apart.
        message_id = f"{self.group}/{state.origin_topic}/{state.origin_partition}/{state.origin_offset}/{times}"
        return Timer(self.retry_topic, record.value, record.key, retry_headers(record, times, state),
                     delay_level=level, message_id=message_id)

    def _dead_letter(self, record: Record, state: RetryState, reason: str) -> OutRecord:
        last = record._replace(headers=retry_headers(record, state.reconsume_times, state))
        self.log.warning("dead-lettered", origin_topic=state.origin_topic, origin_partition=state.origin_partition,
                         origin_offset=state.origin_offset, reconsume_times=state.reconsume_times, reason=reason)
        return OutRecord(self.dlq_topic, record.key, record.value, dead_letter_headers(last, reason))

    def _write(self, timers: list[Timer], dead: list[OutRecord]) -> bool:
        """Schedule the retries, then append the dead letters, each tried until it is durable;
        False if ``stop()`` came first (nothing is then committed)."""
        steps: list[tuple[str, int, Callable[[], object]]] = [
            ("retries", len(timers), lambda: self.client.schedule_many(timers)),
            ("dead letters", len(dead), lambda: self.commit_log.append(dead)),
        ]
        for what, count, write in steps:
            tries = 0
            while count:
                try:
                    write()
                    break
                except (TimerwheelError, OSError) as exc:
                    # A failed write may have landed in part: writing it again may duplicate, never lose.
                    tries += 1
                    self.log.error("write failed, trying again", what=what, records=count, tries=tries, error=str(exc))
                    if self._stop.wait(min(_MAX_BACKOFF_S, 0.1 * 2 ** tries)):
                        return False
        return True

    def _commit(self, records: Sequence[Record]) -> bool:
        offsets: dict[tuple[str, int], int] = {}
        for r in records:
            offsets[(r.topic, r.partition)] = max(offsets.get((r.topic, r.partition), 0), r.offset + 1)
        for tries in range(1, _COMMIT_TRIES + 1):
            try:
                self._consumer.commit(offsets)
                return True
            except TimerwheelError as exc:
                self.log.warning("commit failed", tries=tries, error=str(exc))
                if tries < _COMMIT_TRIES and self._stop.wait(min(_MAX_BACKOFF_S, 0.5 * tries)):
                    break
        self.log.error("batch not committed: it may be handled again", records=len(records))
        return False

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        """Leave the group (the commit log is the caller's to close)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._consumer.close()
        self.log.info("stopped")

    def __enter__(self) -> RetryConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
