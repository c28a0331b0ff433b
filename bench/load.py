"""One load generator for timerwheel and its peers: the same rate, delays and due times, each
system's records written in its own wire contract.

* ``TimerwheelWire``: timerwheel's ``tw-topic`` / ``tw-deliver-at`` (ms) / ``tw-id`` headers on
  the timer topic, spread over its partitions;
* ``Etf1Wire``: etf1/kafka-message-scheduler's ``scheduler-target-topic`` /
  ``scheduler-epoch`` (seconds) / ``scheduler-target-key`` headers on its schedules topic, the
  record key the schedule's id (a key seen again replaces the schedule, so each is unique),
  partitioned by kafka-python's murmur2 as the scheduler's producer is told to (its tombstones
  must land on the schedule's partition).

Every record also carries ``bench-id`` (read back by ``bench.receiver``) and a 100-byte value.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from kafka import KafkaProducer

from bench.lateness import due_time
from bench.receiver import ID_HEADER

VALUE = b"x" * 100


def now_ms() -> int:
    return int(time.time() * 1000)


class Wire(Protocol):
    @property
    def topic(self) -> str:
        """The topic the system reads its schedules from."""
        ...

    def record(self, i: int, mid: str, due_ms: int) -> tuple[bytes, list[tuple[str, bytes]], int | None]:
        """(key, headers, partition or None for the producer's partitioner) of message ``i``."""
        ...


@dataclass(frozen=True, slots=True)
class TimerwheelWire:
    topic: str  # the timer topic
    dest: str
    partitions: int

    def record(self, i: int, mid: str, due_ms: int) -> tuple[bytes, list[tuple[str, bytes]], int | None]:
        m = mid.encode()
        return m, [("tw-topic", self.dest.encode()), ("tw-deliver-at", str(due_ms).encode()), ("tw-id", m),
                   (ID_HEADER, m)], i % self.partitions


@dataclass(frozen=True, slots=True)
class Etf1Wire:
    topic: str  # the schedules topic
    dest: str

    def record(self, i: int, mid: str, due_ms: int) -> tuple[bytes, list[tuple[str, bytes]], int | None]:
        if due_ms % 1000:
            raise ValueError(f"etf1 schedules in whole seconds: message {mid} is due at {due_ms} ms")
        m = mid.encode()
        return m, [("scheduler-epoch", str(due_ms // 1000).encode()), ("scheduler-target-topic", self.dest.encode()),
                   ("scheduler-target-key", m), (ID_HEADER, m)], None


def producer(kafka: str, options: dict[str, Any] | None = None) -> KafkaProducer:
    return KafkaProducer(bootstrap_servers=kafka, acks="all", linger_ms=5, batch_size=256 * 1024,
                         **(options or {}))


class Load:
    """Sends ``rate`` msg/s for ``seconds`` (in a thread: ``start``/``join``, or ``run`` in this
    one), each due ``delay`` ms after its send (drawn uniformly from ``delays_ms``) shaped by
    ``due_mode``; ``due`` maps each acknowledged id to its due time in ms."""

    def __init__(self, kafka: str, wire: Wire, rate: float, seconds: float, delays_ms: tuple[int, int],
                 due_mode: str, *, prefix: str = "m", seed: int = 1, options: dict[str, Any] | None = None) -> None:
        self.kafka, self.wire, self.rate, self.seconds = kafka, wire, rate, seconds
        self.delays_ms, self.due_mode, self.prefix, self.seed = delays_ms, due_mode, prefix, seed
        self.options = options
        self.due: dict[str, int] = {}
        self.sent = 0
        self.failed = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _ack(self, mid: str, due: int) -> Any:
        def ok(_md: object) -> None:
            with self._lock:
                self.due[mid] = due
        return ok

    def _failed(self, _exc: BaseException) -> None:
        with self._lock:
            self.failed += 1

    def run(self) -> None:
        prod = producer(self.kafka, self.options)
        rng = random.Random(self.seed)
        t0 = time.monotonic()
        try:
            while not self._stop.is_set():
                elapsed = time.monotonic() - t0
                if elapsed >= self.seconds:
                    break
                target = min(int(elapsed * self.rate) + 1, int(self.seconds * self.rate))
                while self.sent < target:
                    mid = f"{self.prefix}{self.sent}"
                    due = due_time(now_ms(), rng.randint(*self.delays_ms), self.due_mode)
                    key, headers, partition = self.wire.record(self.sent, mid, due)
                    future = prod.send(self.wire.topic, key=key, value=VALUE, headers=headers, partition=partition)
                    future.add_callback(self._ack(mid, due))
                    future.add_errback(self._failed)
                    self.sent += 1
                time.sleep(0.002)
            prod.flush(60)
        finally:
            prod.close(10)

    def start(self) -> Load:
        self._thread = threading.Thread(target=self.run, name="bench-load", daemon=True)
        self._thread.start()
        return self

    def join(self) -> None:
        assert self._thread is not None
        self._thread.join()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(90)


def fill(kafka: str, wire: Wire, n: int, due_ms: int, *, prefix: str = "b",
         options: dict[str, Any] | None = None) -> dict[str, int]:
    """n records all due at ``due_ms``, as fast as the producer goes; id -> due of each."""
    prod = producer(kafka, options)
    due: dict[str, int] = {}
    try:
        for i in range(n):
            mid = f"{prefix}{i}"
            key, headers, partition = wire.record(i, mid, due_ms)
            prod.send(wire.topic, key=key, value=VALUE, headers=headers, partition=partition)
            due[mid] = due_ms
        prod.flush(120)
    finally:
        prod.close(10)
    return due
