"""Random reads of Kafka records by (partition, offset): dequeue-getmsg's hot path.

What it guarantees:

- Positions are served from the read cache first (``ReadCache``: records read before, by an
  earlier ``read`` or the follower); the rest are grouped per partition, one reused consumer is
  assigned to them, seeks to the lowest wanted offset of each and polls every partition in the
  same fetch requests, jumping forward (seek) over gaps longer than ``read_gap`` records.
- ``None`` means the record is gone for good: before the log start (retention,
  delete-records), beyond the end, or an offset the log skips (compaction, transaction
  markers). A record that exists but cannot be fetched in time (broker down) raises
  ``KafkaLogError`` instead: never ``None``, which would send a live message to the dead-letter
  topic.
- Records a read walks past without wanting them go into the read cache. Messages due close
  together were produced close together: at 1,000 msg/s with delays of 0.2-5 s, each slot's
  wanted offsets are spread thinly over the last five seconds of the log, so without this every
  slot decoded those seconds again (~50 records walked per record wanted, more than a core).

Why these sizes: random reads are bound by kafka-python decoding every record it walks past
(~20 us each, more without the crc32c package): a fetch starts at the batch holding the wanted
offset, and the consumer decodes up to the offset and as far as a poll takes. So: small fetches,
small polls (records polled but not wanted are decoded for nothing), and a seek over any gap
longer than ``read_gap`` records (default 50, about what one seek costs). Measured on 2 cores
with crc32c: contiguous runs ~21-24k records/s, 500 positions scattered over 4 x 50k offsets
~300/s. crc32c (a dependency) makes the batch CRC check native; without it the pure-Python CRC
took half of every read: 8 random positions over 4 x 1k offsets 240 ms -> 62 ms a call, 500 of
them 580 ms -> 125 ms, and the five-process pipeline could not keep up with 60 msg/s without it.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from kafka import TopicPartition

from timerwheel.records import Record
from timerwheel.transports.kafka.clients import FETCH_MAX_BYTES, KafkaClients
from timerwheel.transports.kafka.consumers import to_record
from timerwheel.transports.kafka.errors import KafkaLogError, kafka_call
from timerwheel.transports.readcache import ReadCache

__all__ = ["Reader"]

#: The partition fetch of reads of small records.
READ_FETCH_BYTES = 64 * 1024
_READ_POLL_RECORDS = 200


class Reader:
    """The random reads of one ``KafkaCommitLog`` (and its offset lookups, on the same consumer)."""

    def __init__(self, clients: KafkaClients, cache: ReadCache, *, read_timeout_s: float, read_gap: int) -> None:
        self._clients = clients
        self.cache = cache
        self._read_timeout_s = read_timeout_s
        self._read_gap = read_gap
        #: Reads that went to the broker (some position was not in the cache): tests, inspection.
        self.fetches = 0
        self._reader: Any = None
        #: The reader of large records, made when needed (``fetch_bytes``).
        self._large_reader: Any = None
        #: Mean value bytes of the records the last read fetched: with large records, a 64 KiB
        #: partition fetch returns one record per round trip; they are read in fetches of TW_BATCH_BYTES.
        self._record_bytes = 0
        #: Per partition: (log start, end) last seen; refreshed when a wanted offset lies at or
        #: past the cached end. A start that moved since is caught by the fetch itself.
        self._bounds: dict[TopicPartition, tuple[int, int]] = {}
        self._lock = threading.Lock()
        #: The ``read_uncommitted`` consumer of ``high_watermarks`` (made on first use) and its lock.
        self._hw_reader: Any = None
        self._hw_lock = threading.Lock()

    @property
    def fetch_bytes(self) -> int:
        """The partition fetch size of the next read: 64 KiB, or TW_BATCH_BYTES once the records
        read were larger than that."""
        if self._record_bytes > READ_FETCH_BYTES:
            return min(FETCH_MAX_BYTES, self._clients.fetch_bytes)
        return READ_FETCH_BYTES

    def _consumer(self) -> Any:
        """The consumer for the next read. Lock held."""
        if self._record_bytes > READ_FETCH_BYTES:
            if self._large_reader is None:
                self._large_reader = self._new_reader("reader-large", self.fetch_bytes)
            return self._large_reader
        return self._small_reader()

    def _small_reader(self) -> Any:
        """Lock held."""
        if self._reader is None:
            self._reader = self._new_reader("reader", READ_FETCH_BYTES)
        return self._reader

    def _new_reader(self, suffix: str, partition_fetch_bytes: int) -> Any:
        return self._clients.consumer(suffix, max_partition_fetch_bytes=partition_fetch_bytes,
                                      enable_incremental_fetch_sessions=False,  # each read is a new set of positions
                                      retry_backoff_ms=20)

    def list_offsets(self, tps: list[TopicPartition], beginning: bool) -> dict[TopicPartition, int]:
        """Each partition's log start (``beginning``) or end offset."""
        with self._lock:
            return self._list_offsets(tps, beginning)

    def _list_offsets(self, tps: list[TopicPartition], beginning: bool) -> dict[TopicPartition, int]:
        """Lock held."""
        reader = self._small_reader()
        timeout_ms = self._clients.request_timeout_ms
        with kafka_call("list offsets"):
            if beginning:
                result: dict[TopicPartition, int] = reader.beginning_offsets(tps, timeout_ms=timeout_ms)
            else:
                result = reader.end_offsets(tps, timeout_ms=timeout_ms)
        return result

    def high_watermarks(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        """Each partition's high watermark: ListOffsets sent at ``read_uncommitted`` (kafka-python
        asks at its consumer's isolation level), from a consumer of its own that never fetches,
        under a lock of its own (enqueue-put asks from a thread while nothing else reads)."""
        with self._hw_lock:
            if self._hw_reader is None:
                self._hw_reader = self._clients.consumer("high-watermarks", isolation_level="read_uncommitted")
            with kafka_call("list high watermarks"):
                result: dict[TopicPartition, int] = self._hw_reader.end_offsets(
                    tps, timeout_ms=self._clients.request_timeout_ms)
            return result

    def read(self, topic: str, positions: Sequence[tuple[int, int]]) -> list[Record | None]:
        hits = self.cache.take(topic, positions)
        if len(hits) == len(positions):
            return [hits[pos] for pos in positions]
        wanted: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
        out: list[Record | None] = [None] * len(positions)
        for i, pos in enumerate(positions):
            kept = hits.get(pos)
            if kept is not None:
                out[i] = kept
            elif pos[1] >= 0:
                wanted[pos[0]][pos[1]].append(i)
        if wanted:
            with self._lock:
                self.fetches += 1
                self._fetch(topic, wanted, out)
        return out

    def _fetch(self, topic: str, wanted: dict[int, dict[int, list[int]]], out: list[Record | None]) -> None:
        """Fetch the ``wanted`` offsets (partition -> offset -> indexes in ``out``). Lock held."""
        reader = self._consumer()
        tps = {p: TopicPartition(topic, p) for p in wanted}
        unknown = [tp for tp in tps.values() if tp not in self._bounds]
        if unknown:
            starts = self._list_offsets(unknown, beginning=True)
            ends = self._list_offsets(unknown, beginning=False)
            for tp in unknown:
                self._bounds[tp] = (starts[tp], ends[tp])
        # A wanted offset at or past the cached end: only the end is asked again (one round trip
        # per read in a steady flow; a start that moved meanwhile is caught by the fetch itself).
        behind = [tp for p, tp in tps.items() if max(wanted[p]) >= self._bounds[tp][1]]
        if behind:
            ends = self._list_offsets(behind, beginning=False)
            for tp in behind:
                self._bounds[tp] = (self._bounds[tp][0], ends[tp])

        # Offsets outside [start, end) are gone (or not written yet): they stay None.
        pending: dict[TopicPartition, list[int]] = {}
        for p, by_offset in wanted.items():
            tp = tps[p]
            start, end = self._bounds[tp]
            inside = sorted(o for o in by_offset if start <= o < end)
            if inside:
                pending[tp] = inside
        if not pending:
            return

        keep = self.cache.enabled
        with kafka_call(f"read from topic {topic!r}"):
            # Assignment, not pause/resume, narrows the fetches to what is still wanted: data
            # parked for paused partitions delays their next fetch in kafka-python.
            reader.assign(list(pending))
            for tp, offsets in pending.items():
                reader.seek(tp, offsets[0])
            deadline = time.monotonic() + self._read_timeout_s
            cursor = {tp: 0 for tp in pending}  # index of the lowest offset still wanted
            while pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    left = sum(len(o) - cursor[tp] for tp, o in pending.items())
                    raise KafkaLogError(
                        f"read from topic {topic!r}: {left} records in range not fetched within "
                        f"{self._read_timeout_s}s (partitions {sorted(tp.partition for tp in pending)})"
                    )
                batches = reader.poll(timeout_ms=int(min(remaining, 0.5) * 1000), max_records=_READ_POLL_RECORDS)
                finished = False
                for tp in list(pending):
                    offsets = pending[tp]
                    index = wanted[tp.partition]
                    recs = batches.get(tp)
                    if recs:
                        passing: list[Record] = []
                        for rec in recs:
                            if rec.offset in index:
                                record = to_record(rec)
                                for i in index[rec.offset]:
                                    out[i] = record
                            elif keep:
                                passing.append(to_record(rec))
                        if passing:
                            self.cache.keep(topic, tp.partition, passing, sum(r.size for r in passing))
                        after = recs[-1].offset + 1
                    else:
                        # No records, yet the position may have moved past control batches.
                        after = reader.position(tp, timeout_ms=0) or 0
                    # Everything below the next fetch position has been seen or never will be:
                    # a gap (compaction, markers) or a jump to the log start after retention.
                    k = cursor[tp]
                    while k < len(offsets) and offsets[k] < after:
                        k += 1
                    cursor[tp] = k
                    if k == len(offsets):
                        del pending[tp]
                        finished = True
                    elif offsets[k] - after > self._read_gap:
                        reader.seek(tp, offsets[k])
                if finished and pending:
                    reader.assign(list(pending))
        sizes = [len(r.value or b"") for r in out if r is not None]
        if sizes:
            self._record_bytes = sum(sizes) // len(sizes)

    def close(self) -> None:
        with self._lock, self._hw_lock:
            for reader in (self._reader, self._large_reader, self._hw_reader):
                if reader is not None:
                    reader.close(autocommit=False)
            self._reader = self._large_reader = self._hw_reader = None
