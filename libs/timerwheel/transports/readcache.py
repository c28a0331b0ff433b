"""ReadCache: records a commit log has already read, kept so that a later ``read`` of the same
positions is served from memory. Both commit logs use it (``LocalCommitLog`` and
``KafkaCommitLog``); it is dequeue-getmsg's hot path.

Why it pays: a message due a few seconds after it was produced is read twice, once by
enqueue-get when it is scheduled and once by dequeue-getmsg when its slot fires. Kept here
between the two, the second read costs a lookup in memory instead of a decode (and, for Kafka,
a fetch). What keeps it:

- the local log: the records its consumers poll from a followed topic (``follow``);
- Kafka: the records a ``read`` walks past without wanting them, and those the follower reads
  ahead from the timer topic's end.

What it guarantees:

- Records are kept a batch at a time: a *block* holds consecutive offsets of one partition of
  one topic (None where the batch had no record: a transaction marker, a record the reader
  wanted and served at once), so keeping a poll's batch is one step, not one per record.
- At most ``max_records`` records and ``max_bytes`` bytes, each record counted as its payload
  plus ``RECORD_OVERHEAD`` (the Python objects around it), so the bound is one of memory. Past
  either bound the oldest blocks go first; a block larger than the bounds on its own keeps its
  newest records that fit.
- A record served by ``take`` leaves the cache (a message is delivered once). Offsets never
  change in either log, so a kept record is never stale; a position that is not kept is
  simply read from the log.
- Thread-safe: a consumer or follower thread keeps while a reader takes.

``DEFAULT_MAX_RECORDS`` and ``DEFAULT_MAX_BYTES`` are the one set of defaults of both logs (the
embedded mode's local log keeps them); a production stage's Kafka log is bounded by
TW_READ_CACHE_BYTES instead (``KafkaCommitLog.from_config``). 0 for either turns the cache off.
Measured with the embedded mode's 100,000 messages due at once: at 64 MiB 66,500 of them are
served from the cache, at 32 MiB 33,000, and reading the others cost 0.15-0.24 s more CPU (three
runs each).
"""

from __future__ import annotations

import bisect
import operator
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from timerwheel.records import Record

__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_MAX_RECORDS", "RECORD_OVERHEAD", "ReadCache"]

#: Records kept at most.
DEFAULT_MAX_RECORDS = 100_000
#: Bytes kept at most, counting ``RECORD_OVERHEAD`` per record: a bound of memory.
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
#: Memory a kept record takes beyond its payload: the Record, its header tuples and the block's
#: slot (measured: ~970 bytes a record of 150 payload bytes).
RECORD_OVERHEAD = 800
#: A batch whose offsets jump by more than this is kept as several blocks (a compacted topic's
#: gaps would otherwise be slots of None).
_MAX_HOLE = 64
#: Blocks that may overlap the one found for an offset (a consumer that sought back, a reader
#: and a follower over the same offsets): they are looked in too, newest start first.
_LOOK_BACK = 4


class _Block:
    """Consecutive offsets ``first .. end-1`` of one partition of one topic; ``records[i]`` is
    offset ``first + i`` or None. ``live`` counts the records that are not None."""

    __slots__ = ("topic", "partition", "first", "end", "records", "size", "live")

    def __init__(self, topic: str, partition: int, first: int, records: list[Record | None], live: int,
                 size: int) -> None:
        self.topic = topic
        self.partition = partition
        self.first = first
        self.end = first + len(records)
        self.records = records
        #: Bytes each record of the block counts for (its share of the payload plus the overhead).
        self.size = size
        self.live = live


_FIRST = operator.attrgetter("first")


class ReadCache:
    """Records by (topic, partition, offset), kept a batch at a time; see the module header."""

    def __init__(self, max_records: int = DEFAULT_MAX_RECORDS, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_records < 0 or max_bytes < 0:
            raise ValueError(f"ReadCache: bounds must be >= 0, got {max_records} records, {max_bytes} bytes")
        self.max_records = max_records if max_bytes > 0 else 0
        self.max_bytes = max_bytes if max_records > 0 else 0
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # by id(), oldest first
        #: topic -> partition -> its blocks by first offset. A block that overlaps another holds
        #: its own copies; ``take`` looks in the one that starts last first (``_look_back``).
        self._by_topic: dict[str, dict[int, list[_Block]]] = {}
        #: Records and bytes held now.
        self.records = 0
        self.bytes = 0
        #: Records ``take`` has served since the cache was made (the follower judges itself by it).
        self.served = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """False when sized 0: nothing is ever kept."""
        return self.max_records > 0

    def keep(self, topic: str, partition: int, records: Sequence[Record], payload_bytes: int) -> int:
        """Keep ``records`` of one partition, in offset order (consecutive, or with gaps where the
        log holds no record for the reader); ``payload_bytes`` is what they hold together (their
        frames, or keys, values and headers). Returns how many are kept."""
        n = len(records)
        if not n or not self.max_records:
            return 0
        size = payload_bytes // n + RECORD_OVERHEAD
        first = records[0].offset
        with self._lock:
            if records[-1].offset - first + 1 == n:  # consecutive: one block as it is
                self._add(_Block(topic, partition, first, list(records), n, size))
            else:
                for block in _blocks_around_gaps(topic, partition, records, size):
                    self._add(block)
            self._evict()
        return n

    def _add(self, block: _Block) -> None:
        """Lock held."""
        if block.live > self.max_records or block.live * block.size > self.max_bytes:
            # Larger than the whole cache: its newest records that fit.
            fits = min(self.max_records, self.max_bytes // block.size)
            cut = 0
            over = block.live - fits
            while over > 0:
                if block.records[cut] is not None:
                    over -= 1
                cut += 1
            if cut == len(block.records):
                return
            block.records = block.records[cut:]
            block.first += cut
            block.live = fits
        self._blocks[id(block)] = block
        partitions = self._by_topic.get(block.topic)
        if partitions is None:
            partitions = self._by_topic[block.topic] = {}
        blocks = partitions.get(block.partition)
        if blocks is None:
            partitions[block.partition] = [block]
        elif blocks[-1].first > block.first:
            bisect.insort(blocks, block, key=_FIRST)
        else:
            blocks.append(block)
        self.records += block.live
        self.bytes += block.live * block.size

    def _evict(self) -> None:
        """Drop the oldest blocks past either bound. Lock held."""
        while self.records > self.max_records or self.bytes > self.max_bytes:
            self._drop(self._blocks.popitem(last=False)[1])

    def _drop(self, block: _Block) -> None:
        """Forget ``block`` (already out of ``_blocks``). Lock held."""
        self.records -= block.live
        self.bytes -= block.live * block.size
        block.live = 0
        partitions = self._by_topic[block.topic]
        blocks = partitions[block.partition]
        blocks.remove(block)
        if not blocks:
            del partitions[block.partition]
            if not partitions:
                del self._by_topic[block.topic]

    def take(self, topic: str, positions: Iterable[tuple[int, int]]) -> dict[tuple[int, int], Record]:
        """The kept records at ``positions`` ((partition, offset) of ``topic``), each removed from
        the cache; a position asked twice is in the answer once."""
        out: dict[tuple[int, int], Record] = {}
        with self._lock:
            partitions = self._by_topic.get(topic)
            if partitions is None:
                return out
            block: _Block | None = None  # the block of the last position: the next is most often in it
            for pos in positions:
                p, o = pos
                if (block is None or block.partition != p or not block.first <= o < block.end
                        or (rec := block.records[o - block.first]) is None):
                    if pos in out:
                        continue
                    blocks = partitions.get(p)
                    if not blocks:
                        continue
                    i = bisect.bisect_right(blocks, o, key=_FIRST) - 1
                    if i < 0:
                        continue
                    block = blocks[i]
                    if o >= block.end or (rec := block.records[o - block.first]) is None:
                        found = _look_back(blocks, i, o)
                        if found is None:
                            continue
                        block, rec = found
                out[pos] = rec
                block.records[o - block.first] = None
                block.live -= 1
                self.records -= 1
                self.bytes -= block.size
                if not block.live:
                    del self._blocks[id(block)]
                    self._drop(block)
                    block = None
            self.served += len(out)
        return out

    def positions(self, topic: str) -> list[tuple[int, int]]:
        """The (partition, offset) of ``topic`` held, oldest block first (tests, inspection)."""
        with self._lock:
            return [(b.partition, b.first + k) for b in self._blocks.values() if b.topic == topic
                    for k, r in enumerate(b.records) if r is not None]

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._by_topic.clear()
            self.records = self.bytes = 0


def _look_back(blocks: list[_Block], i: int, offset: int) -> tuple[_Block, Record] | None:
    """Of the ``_LOOK_BACK`` blocks before ``blocks[i]`` (that start before ``offset``), the one
    that starts last holding a record at ``offset``, and the record: an overlapping block's copy."""
    for k in range(i - 1, max(i - 1 - _LOOK_BACK, -1), -1):
        block = blocks[k]
        if offset < block.end:
            rec = block.records[offset - block.first]
            if rec is not None:
                return block, rec
    return None


def _blocks_around_gaps(topic: str, partition: int, records: Sequence[Record], size: int) -> list[_Block]:
    """``records`` (offset order, not consecutive) as blocks: split where a gap is longer than
    ``_MAX_HOLE``, None in the shorter gaps."""
    blocks = []
    run: list[Record | None] = []
    start = prev = records[0].offset
    live = 0
    for rec in records:
        gap = rec.offset - prev
        if run and gap > _MAX_HOLE:
            blocks.append(_Block(topic, partition, start, run, live, size))
            run, start, live = [], rec.offset, 0
        elif run and gap > 1:
            run.extend([None] * (gap - 1))
        run.append(rec)
        live += 1
        prev = rec.offset
    blocks.append(_Block(topic, partition, start, run, live, size))
    return blocks
