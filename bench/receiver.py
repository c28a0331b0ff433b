"""A consumer of the destination topics in a process of its own: where a user sees a delivery.

It polls the destinations continuously (assigned every partition, from the start, reading
``read_committed`` as a reader of an exactly-once producer must; without transactions that is
every record as soon as it is acknowledged) and writes one
line per record: its ``bench-id``, its ``tw-delivered-at`` (if any), its Kafka timestamp and the
wall time at which the poll returned it. Its own process so that the load generator's sends and
the benchmark's bookkeeping never hold the interpreter while a record waits to be read.

    with Receiver(kafka, [dest]) as rx:     # ready: assigned and positioned
        ... send ...
        rx.wait_for(n, timeout_s=60)
        arrivals = rx.arrivals()             # list[bench.lateness.Arrival]; its file goes with the block
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.lateness import Arrival

#: The header every benchmark message carries, whatever the system's own wire contract.
ID_HEADER = "bench-id"


def _receive(kafka: str, topics: list[str], options: dict[str, Any], out_path: str, count: Any, ready: Any,
             stop: Any) -> None:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=kafka, group_id=None, enable_auto_commit=False,
                             auto_offset_reset="earliest", fetch_max_wait_ms=100, max_poll_records=10_000,
                             isolation_level="read_committed",
                             client_id="bench-receiver", **options)
    tps = []
    for topic in topics:
        parts = None
        deadline = time.monotonic() + 60
        while not parts and time.monotonic() < deadline:
            parts = consumer.partitions_for_topic(topic)
            if not parts:
                time.sleep(0.1)
        if not parts:
            raise RuntimeError(f"receiver: topic {topic} has no partitions 60 s after the start")
        tps += [TopicPartition(topic, p) for p in sorted(parts)]
    consumer.assign(tps)
    consumer.seek_to_beginning(*tps)
    for tp in tps:
        consumer.position(tp)  # resolve the start now, not on the first record
    ready.set()
    with open(out_path, "w") as out:
        while not stop.is_set():
            batches = consumer.poll(timeout_ms=100, max_records=10_000)
            received = int(time.time() * 1000)
            lines = []
            for recs in batches.values():
                for r in recs:
                    headers = dict(r.headers or ())
                    mid = bytes(headers.get(ID_HEADER, b"")).decode()
                    at = headers.get("tw-delivered-at")
                    lines.append(f"{mid}\t{int(at) if at else ''}\t{r.timestamp}\t{received}\n")
            if lines:
                out.writelines(lines)
                out.flush()
                with count.get_lock():
                    count.value += len(lines)
    consumer.close(autocommit=False)


class Receiver:
    """The consumer process; ``count`` is the records it has seen (duplicates included)."""

    def __init__(self, kafka: str, topics: Sequence[str], options: dict[str, Any] | None = None,
                 ready_timeout_s: float = 90.0) -> None:
        ctx = multiprocessing.get_context("spawn")  # the parent has threads (producers): no fork
        fd, self._path = tempfile.mkstemp(prefix="tw-bench-rx-", suffix=".tsv")
        os.close(fd)
        self._count = ctx.Value("q", 0)
        self._ready, self._stop = ctx.Event(), ctx.Event()
        self._proc = ctx.Process(target=_receive, name="bench-receiver", daemon=True,
                                 args=(kafka, list(topics), dict(options or {}), self._path, self._count,
                                       self._ready, self._stop))
        self._proc.start()
        deadline = time.monotonic() + ready_timeout_s
        while not self._ready.wait(0.2):
            if not self._proc.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"receiver of {list(topics)} not ready (exit code {self._proc.exitcode})")
        self._arrivals: list[Arrival] | None = None

    @property
    def count(self) -> int:
        return int(self._count.value)

    def wait_for(self, n: int, timeout_s: float) -> bool:
        """Until ``count`` >= n (True) or the timeout (False)."""
        deadline = time.monotonic() + timeout_s
        while self.count < n:
            if time.monotonic() > deadline or not self._proc.is_alive():
                return False
            time.sleep(0.05)
        return True

    def wait_quiet(self, quiet_s: float, timeout_s: float) -> None:
        """Until no record came for ``quiet_s`` (late copies, duplicates), at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        last, since = self.count, time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - since < quiet_s:
            time.sleep(0.1)
            if self.count != last:
                last, since = self.count, time.monotonic()

    def close(self) -> None:
        self._stop.set()
        self._proc.join(15)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    def arrivals(self) -> list[Arrival]:
        """Every record seen (stops the consumer first)."""
        if self._arrivals is None:
            self.close()
            out = []
            for line in Path(self._path).read_text().splitlines():
                mid, at, ts, received = line.split("\t")
                out.append(Arrival(mid, int(at) if at else None, int(ts), int(received)))
            Path(self._path).unlink(missing_ok=True)
            self._arrivals = out
        return self._arrivals

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        Path(self._path).unlink(missing_ok=True)  # read by ``arrivals`` inside the block, or never
