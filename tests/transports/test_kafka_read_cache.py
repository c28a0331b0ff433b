"""TW_READ_CACHE_BYTES: the Kafka read cache keeps at most that many bytes of records, the
oldest dropped first (no broker is contacted: the clients are made lazily)."""

from __future__ import annotations

from timerwheel.records import Record
from timerwheel.transports.kafka.log import KafkaCommitLog
from timerwheel.transports.readcache import RECORD_OVERHEAD


def test_the_read_cache_drops_the_oldest_records_past_its_bytes() -> None:
    log = KafkaCommitLog("127.0.0.1:1", read_cache_bytes=250_000)
    try:
        records = [Record("t", 0, o, 0, None, b"v" * 100_000) for o in range(5)]
        log.read_cache.keep("t", 0, records, sum(r.size for r in records))
        assert log.read_cache.positions("t") == [(0, 3), (0, 4)]
        assert log.read_cache.bytes == 2 * (100_000 + RECORD_OVERHEAD)
        assert log.read("t", [(0, 4)]) == [records[4]]  # served from the cache, and dropped from it
        assert log.read_cache.bytes == 100_000 + RECORD_OVERHEAD
    finally:
        log.close()


def test_a_read_cache_of_zero_bytes_turns_the_read_ahead_off() -> None:
    log = KafkaCommitLog("127.0.0.1:1", read_cache_bytes=0)
    try:
        log.follow("t")
        assert log.follower is None
    finally:
        log.close()
