"""ReadCache, the one read cache of both commit logs: blocks of a batch, bounds of memory, a
record served once (pure logic: no server)."""

from __future__ import annotations

from pathlib import Path

from timerwheel.config import TimerConfig
from timerwheel.records import Record
from timerwheel.transports.kafka.log import KafkaCommitLog
from timerwheel.transports.local.log import LocalCommitLog
from timerwheel.transports.readcache import DEFAULT_MAX_BYTES, DEFAULT_MAX_RECORDS, RECORD_OVERHEAD, ReadCache


def records(first: int, n: int, partition: int = 0, topic: str = "t", size: int = 100) -> list[Record]:
    return [Record(topic, partition, o, 0, None, b"v" * size) for o in range(first, first + n)]


def keep(cache: ReadCache, recs: list[Record]) -> int:
    return cache.keep(recs[0].topic, recs[0].partition, recs, sum(r.size for r in recs))


def test_both_logs_keep_the_same_defaults_and_a_stage_takes_tw_read_cache_bytes(tmp_path: Path) -> None:
    local = LocalCommitLog(tmp_path, fsync=False)
    kafka = KafkaCommitLog("127.0.0.1:1")  # connects lazily: nothing is reached here
    staged = KafkaCommitLog.from_config(TimerConfig(kafka_bootstrap="127.0.0.1:1", read_cache_bytes=12345))
    try:
        for log in (local, kafka):
            assert (log.read_cache.max_records, log.read_cache.max_bytes) == (DEFAULT_MAX_RECORDS, DEFAULT_MAX_BYTES)
        assert staged.read_cache.max_bytes == 12345
    finally:
        for closing in (local, kafka, staged):
            closing.close()


def test_a_kept_record_is_served_once_and_a_position_asked_twice_is_answered_once() -> None:
    cache = ReadCache()
    kept = records(10, 5)
    assert keep(cache, kept) == 5
    got = cache.take("t", [(0, 12), (0, 12), (0, 9), (1, 12), (0, 15)])
    assert got == {(0, 12): kept[2]} and got[(0, 12)] is kept[2]
    assert cache.take("t", [(0, 12)]) == {}
    assert cache.records == 4 and cache.bytes == 4 * (100 + RECORD_OVERHEAD) and cache.served == 1
    assert cache.take("other", [(0, 11)]) == {}  # keyed by topic too


def test_the_oldest_blocks_go_first_past_either_bound() -> None:
    by_records = ReadCache(max_records=10)
    for first in range(0, 30, 5):
        keep(by_records, records(first, 5))
    assert by_records.positions("t") == [(0, o) for o in range(20, 30)]
    by_bytes = ReadCache(max_bytes=10 * (100 + RECORD_OVERHEAD) - 1)
    for first in range(0, 30, 5):
        keep(by_bytes, records(first, 5))
    assert by_bytes.positions("t") == [(0, o) for o in range(25, 30)]
    assert by_bytes.bytes == 5 * (100 + RECORD_OVERHEAD)


def test_a_block_larger_than_the_cache_keeps_its_newest_records() -> None:
    cache = ReadCache(max_bytes=3 * (1000 + RECORD_OVERHEAD))
    keep(cache, records(0, 10, size=1000))
    assert cache.positions("t") == [(0, 7), (0, 8), (0, 9)]
    assert cache.take("t", [(0, 6), (0, 7)]).keys() == {(0, 7)}
    huge = ReadCache(max_bytes=1000)
    assert keep(huge, records(0, 2, size=5000)) == 2 and huge.positions("t") == []


def test_a_batch_with_gaps_is_kept_and_found_around_them() -> None:
    cache = ReadCache()
    # A transaction marker at 3, the reader's wanted record at 5, a compacted stretch 8..999.
    kept = [r for r in records(0, 1010) if r.offset not in (3, 5) and not 8 <= r.offset < 1000]
    keep(cache, kept)
    assert cache.records == len(kept)
    got = cache.take("t", [(0, o) for o in (2, 3, 4, 5, 7, 8, 500, 1000, 1009)])
    assert sorted(o for _p, o in got) == [2, 4, 7, 1000, 1009]


def test_overlapping_blocks_serve_the_newest_start_first_and_the_older_copy_after() -> None:
    cache = ReadCache()
    old = records(0, 10)
    keep(cache, old)
    again = records(5, 3)  # a consumer that sought back and read 5..7 once more
    keep(cache, again)
    assert cache.take("t", [(0, 6)])[(0, 6)] is again[1]
    assert cache.take("t", [(0, 6)])[(0, 6)] is old[6]  # the older block still holds its copy
    assert cache.take("t", [(0, 9)])[(0, 9)] is old[9]  # past the newer block: found in the older
    assert cache.take("t", [(0, 6)]) == {}


def test_partitions_are_kept_apart_and_blocks_arrive_in_any_order() -> None:
    cache = ReadCache()
    keep(cache, records(100, 10, partition=1))
    keep(cache, records(0, 10, partition=0))
    keep(cache, records(50, 10, partition=1))  # a read behind the follower
    got = cache.take("t", [(1, 55), (0, 5), (1, 105), (1, 60), (0, 10)])
    assert set(got) == {(1, 55), (0, 5), (1, 105)}


def test_a_cache_sized_zero_keeps_nothing() -> None:
    for cache in (ReadCache(max_records=0), ReadCache(max_bytes=0)):
        assert not cache.enabled
        assert keep(cache, records(0, 3)) == 0 and cache.records == 0
