"""The follower: a thread that reads a topic from its end into the read cache, so that a slot's
read finds its records in memory (``KafkaCommitLog.follow``; dequeue-getmsg follows the timer
topic).

A message due a few seconds after it was produced is then in memory when its slot fires, and
the slot's read makes no round trip to the broker. Following costs a decode per record, so the
follower judges itself every ``JUDGE_EVERY`` records it keeps: when the reads took fewer than
``MIN_HIT_RATIO`` as many records from the cache meanwhile (delays longer than the cache holds),
it pauses for ``PAUSE_S`` and then starts again from the end. A read-ahead is never worth a
stage: a failure is logged once and retried every ``RETRY_S``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from kafka import TopicPartition

from timerwheel.log import stage_logger
from timerwheel.transports.kafka import internals
from timerwheel.transports.kafka.clients import BATCHED_FETCH, LONG_POLL_FETCH, KafkaClients
from timerwheel.transports.kafka.consumers import to_record
from timerwheel.transports.readcache import ReadCache

__all__ = ["Follower"]


class Follower:
    """Reads every partition of ``topic`` from its end into ``cache``, in a thread of its own."""

    JUDGE_EVERY = 20_000
    MIN_HIT_RATIO = 0.25
    PAUSE_S = 120.0
    RETRY_S = 2.0

    def __init__(self, clients: KafkaClients, cache: ReadCache, topic: str,
                 partitions_of: Callable[[str], list[TopicPartition]]) -> None:
        self._clients = clients
        self._cache = cache
        self._partitions_of = partitions_of
        self.topic = topic
        #: Records kept since the last judgement, and times it paused itself.
        self.kept = 0
        self.paused = 0
        #: The cache's ``served`` at the last judgement.
        self._served_before = cache.served
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tw-follow-{topic}", daemon=True)
        self._failing = False

    @property
    def hits(self) -> int:
        """Records reads took from the cache since the last judgement."""
        return self._cache.served - self._served_before

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            consumer = None
            try:
                consumer = self._clients.consumer(f"follow-{self.topic}", **BATCHED_FETCH)
                tps = self._partitions_of(self.topic)
                consumer.assign(tps)
                consumer.seek_to_end(*tps)
                self._follow(consumer)
                self._failing = False
            except Exception as exc:  # noqa: BLE001 - a read-ahead is never worth a stage
                if not self._failing:
                    stage_logger("kafka").warning("read-ahead failed, retrying", topic=self.topic,
                                                  error=str(exc)[:200])
                self._failing = True
                self._stop.wait(self.RETRY_S)
            finally:
                if consumer is not None:
                    with suppress(Exception):
                        consumer.close(autocommit=False)

    def _follow(self, consumer: Any) -> None:
        """Until stopped, or until judged useless (then pause and return, to start from the end)."""
        self._judged()
        idle = False
        while not self._stop.is_set():
            internals.set_fetch_wait(consumer, LONG_POLL_FETCH if idle else BATCHED_FETCH)
            batches = consumer.poll(timeout_ms=1000 if idle else 200, max_records=2_000)
            idle = not batches
            for tp, recs in batches.items():
                records = [to_record(r) for r in recs]
                self.kept += self._cache.keep(self.topic, tp.partition, records, sum(r.size for r in records))
            if self.kept >= self.JUDGE_EVERY:
                if self.hits < self.MIN_HIT_RATIO * self.kept:
                    self.paused += 1
                    self._stop.wait(self.PAUSE_S)
                    return
                self._judged()

    def _judged(self) -> None:
        self.kept = 0
        self._served_before = self._cache.served
