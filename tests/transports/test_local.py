"""LocalCommitLog: dense offsets under concurrent processes, torn tails, CRCs, batched reads,
consumers, retention and Kafka's partitioner."""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from timerwheel.clock import SimulatedClock
from timerwheel.errors import TimerwheelError
from timerwheel.records import OutRecord, Record
from timerwheel.transports.local.frames import CorruptLogRecordError
from timerwheel.transports.local.layout import InvalidTopicError
from timerwheel.transports.local.log import LocalCommitLog
from timerwheel.transports.partitioner import kafka_partition, kafka_partitions, murmur2


def _drain(log: LocalCommitLog, topic: str, offsets: dict[int, int] | None = None) -> list[Record]:
    consumer = log.consumer(
        topic, offsets if offsets is not None else dict.fromkeys(range(log.partitions(topic)), 0)
    )
    out: list[Record] = []
    while batch := consumer.poll(1000, 0.05):
        out += batch
    consumer.close()
    return out


def _segment_files(path: Path, topic: str, partition: int, ext: str) -> list[Path]:
    return sorted((path / topic / str(partition)).glob(f"*.{ext}"))


# -- several processes ------------------------------------------------------------------------

_WRITER = textwrap.dedent(
    """
    import json, sys
    from timerwheel.records import OutRecord
    from timerwheel.transports.local.log import LocalCommitLog

    directory, writer, batches = sys.argv[1], sys.argv[2], int(sys.argv[3])
    log = LocalCommitLog(directory, default_partitions=3, segment_bytes=4096)
    reported = []
    for b in range(batches):
        size = 1 + (b * 7) % 13
        records = [
            OutRecord("events", f"{writer}-{b}-{i}".encode(), f"{writer}:{b}:{i}".encode() * 3,
                      (("writer", writer.encode()),), partition=(i % 3) if b % 2 else None)
            for i in range(size)
        ]
        for r, (p, o) in zip(records, log.append(records)):
            reported.append([r.key.decode(), p, o])
    log.close()
    print(json.dumps(reported))
    """
)


def test_appends_from_several_processes_get_dense_offsets_and_each_record_once(tmp_path: Path) -> None:
    log = LocalCommitLog(tmp_path, default_partitions=3, segment_bytes=4096)
    log.ensure_topic("events", 3)
    consumer = log.consumer("events", {0: 0, 1: 0, 2: 0})
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(tmp_path), f"w{n}", "60"], stdout=subprocess.PIPE, text=True
        )
        for n in range(4)
    ]
    seen: list[Record] = []
    while any(w.poll() is None for w in writers):  # consume live while they write
        seen += consumer.poll(500, 0.01)
    reported = []
    for w in writers:
        out, _ = w.communicate(timeout=60)
        assert w.returncode == 0
        reported += json.loads(out)
    while batch := consumer.poll(1000, 0.05):
        seen += batch

    assert len(reported) == sum(4 * (1 + (b * 7) % 13) for b in range(60))
    ends = log.end_offsets("events")
    assert sum(ends.values()) == len(reported) == len(seen)
    by_partition: dict[int, list[int]] = {}
    for r in seen:
        by_partition.setdefault(r.partition, []).append(r.offset)
    for p, offsets in by_partition.items():
        assert offsets == list(range(ends[p])), f"partition {p} offsets are not dense and in order"
    assert sorted(r.key for r in seen if r.key) == sorted(k.encode() for k, _, _ in reported)
    # what each writer was told is where the record is
    found = log.read("events", [(p, o) for _, p, o in reported])
    assert [r.key if r else None for r in found] == [k.encode() for k, _, _ in reported]
    # one writer's records keep their order within a partition
    for n in range(4):
        for p in range(3):
            mine = [r for r in seen if r.partition == p and r.header("writer") == f"w{n}".encode()]
            order = [tuple(int(x) for x in (r.key or b"").decode().split("-")[1:]) for r in mine]
            assert order == sorted(order)
    assert len(_segment_files(tmp_path, "events", 0, "log")) > 1, "the test should cross segment rolls"
    log.close()


# -- crashes and corruption -------------------------------------------------------------------


def _records(n: int, topic: str = "t", partition: int = 0, tag: str = "r") -> list[OutRecord]:
    return [
        OutRecord(topic, f"{tag}{i}".encode(), f"value-{tag}{i}".encode() * 4, partition=partition)
        for i in range(n)
    ]


def test_torn_tail_is_ignored_by_readers_and_cut_by_the_next_writer(tmp_path: Path) -> None:
    log = LocalCommitLog(tmp_path)
    log.append(_records(5))
    reader = LocalCommitLog(tmp_path)  # opened before the crash, like a consumer in another process
    assert reader.end_offsets("t") == {0: 5}
    log_file = _segment_files(tmp_path, "t", 0, "log")[-1]
    idx_file = _segment_files(tmp_path, "t", 0, "idx")[-1]
    good_size = log_file.stat().st_size
    # a writer died after writing frames and half an index entry
    with open(log_file, "ab") as f:
        f.write(b"\x07" * 300)
    with open(idx_file, "ab") as f:
        f.write(struct.pack("<Q", good_size + 300)[:3])

    assert reader.end_offsets("t") == {0: 5}
    assert [r.offset for r in _drain(reader, "t")] == [0, 1, 2, 3, 4]
    assert reader.read("t", [(0, 5)]) == [None]

    assert log.append(_records(2, tag="after")) == [(0, 5), (0, 6)]
    assert idx_file.stat().st_size == 7 * 8
    assert [r.key for r in reader.read("t", [(0, 4), (0, 5), (0, 6)])] == [b"r4", b"after0", b"after1"]
    last_end = struct.unpack("<Q", idx_file.read_bytes()[-8:])[0] & ((1 << 63) - 1)
    assert log_file.stat().st_size == last_end  # the garbage is gone
    log.close()
    reader.close()


_ENDLESS_WRITER = textwrap.dedent(
    """
    import sys
    from timerwheel.records import OutRecord
    from timerwheel.transports.local.log import LocalCommitLog

    log = LocalCommitLog(sys.argv[1], segment_bytes=256 * 1024, fsync=False)
    n = 0
    while True:
        log.append([OutRecord("t", b"k%d" % i, b"v" * (n % 700), partition=0) for i in range(n, n + 300)])
        n += 300
        if n == 3000:
            print("running", flush=True)
    """
)


def test_a_writer_killed_mid_append_leaves_a_log_the_next_writer_continues_cleanly(tmp_path: Path) -> None:
    for _ in range(3):
        writer = subprocess.Popen(
            [sys.executable, "-c", _ENDLESS_WRITER, str(tmp_path)], stdout=subprocess.PIPE
        )
        assert writer.stdout is not None and writer.stdout.readline() == b"running\n"
        time.sleep(random.uniform(0.0, 0.2))
        writer.kill()
        writer.wait()
        log = LocalCommitLog(tmp_path, fsync=False)
        end = log.end_offsets("t")[0]
        records = _drain(log, "t")
        assert [r.offset for r in records] == list(range(end))
        assert log.append(_records(1, tag="after-crash")) == [(0, end)]
        assert [r.key for r in log.read("t", [(0, end)]) if r] == [b"after-crash0"]
        log.close()


def test_first_open_cuts_a_last_batch_torn_by_power_loss_at_its_first_damaged_record(tmp_path: Path) -> None:
    log = LocalCommitLog(tmp_path)
    log.append(_records(3, tag="a"))
    log.append(_records(3, tag="b"))
    log.close()
    # the last batch's second frame never reached the disk intact
    log_file = _segment_files(tmp_path, "t", 0, "log")[-1]
    data = bytearray(log_file.read_bytes())
    data[data.index(b"value-b1") + 2] ^= 0xFF
    log_file.write_bytes(bytes(data))

    reopened = LocalCommitLog(tmp_path)
    assert reopened.end_offsets("t") == {0: 4}
    assert [r.key for r in _drain(reopened, "t")] == [b"a0", b"a1", b"a2", b"b0"]
    assert reopened.append(_records(1, tag="c")) == [(0, 4)]
    reopened.close()


def test_first_open_drops_index_entries_past_the_data_and_keeps_intact_ones_without_a_batch_end(
    tmp_path: Path,
) -> None:
    log = LocalCommitLog(tmp_path)
    log.append(_records(3, tag="a"))
    log.append(_records(4, tag="b"))
    log.close()
    idx_file = _segment_files(tmp_path, "t", 0, "idx")[-1]
    log_file = _segment_files(tmp_path, "t", 0, "log")[-1]
    idx_file.write_bytes(idx_file.read_bytes()[: 6 * 8])  # the batch-end entry of batch b was lost
    assert LocalCommitLog(tmp_path).end_offsets("t") == {0: 6}  # b0..b2 are intact: kept

    with open(log_file, "r+b") as f:  # the index reached the disk, the last frame did not
        f.truncate(log_file.stat().st_size - 10)
    reopened = LocalCommitLog(tmp_path)
    assert reopened.end_offsets("t") == {0: 5}
    assert reopened.append(_records(1, tag="c")) == [(0, 5)]
    assert [r.key for r in _drain(reopened, "t")][-2:] == [b"b1", b"c0"]
    reopened.close()


def test_crc_corruption_is_detected_on_read_and_poll(tmp_path: Path) -> None:
    log = LocalCommitLog(tmp_path)
    log.append(_records(5, tag="a"))
    log.append(_records(5, tag="b"))  # so the damage is not in the last batch
    log_file = _segment_files(tmp_path, "t", 0, "log")[-1]
    data = bytearray(log_file.read_bytes())
    spot = data.index(b"value-a2") + 3
    data[spot] ^= 0x01
    log_file.write_bytes(bytes(data))

    for reader in (log, LocalCommitLog(tmp_path)):
        assert [r.key for r in reader.read("t", [(0, 1), (0, 3)]) if r] == [b"a1", b"a3"]
        with pytest.raises(CorruptLogRecordError, match="offset 2: CRC mismatch"):
            reader.read("t", [(0, 2)])
        with pytest.raises(CorruptLogRecordError):
            _drain(reader, "t")
        reader.close()


# -- reading ----------------------------------------------------------------------------------


def test_batched_random_reads_return_each_position_in_input_order(tmp_path: Path) -> None:
    log = LocalCommitLog(tmp_path, default_partitions=2, segment_bytes=2000, fsync=False)
    written: dict[tuple[int, int], bytes] = {}
    for b in range(40):
        records = [
            OutRecord("t", f"k{b}-{i}".encode(), os.urandom(random.randrange(0, 300))) for i in range(25)
        ]
        for r, pos in zip(records, log.append(records), strict=True):
            written[pos] = r.value or b""
    assert len(_segment_files(tmp_path, "t", 0, "log")) > 5
    positions = list(written) * 2 + [(0, 10_000), (1, -1), (7, 0)]
    random.Random(7).shuffle(positions)
    for start in range(0, len(positions), 333):
        chunk = positions[start : start + 333]
        got = log.read("t", chunk)
        assert len(got) == len(chunk)
        for (p, o), record in zip(chunk, got, strict=True):
            if (p, o) in written:
                assert record is not None and (record.partition, record.offset, record.value) == (
                    p,
                    o,
                    written[(p, o)],
                )
            else:
                assert record is None
    log.close()


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.none() | st.binary(max_size=40),
            st.none() | st.binary(max_size=200),
            st.lists(st.tuples(st.text(max_size=10), st.binary(max_size=20)), max_size=3).map(tuple),
            st.none() | st.integers(min_value=0, max_value=2**62),
        ),
        min_size=1,
        max_size=30,
    )
)
def test_records_round_trip_with_none_keys_values_and_headers(
    tmp_path_factory: pytest.TempPathFactory,
    rows: list[tuple[bytes | None, bytes | None, tuple[tuple[str, bytes], ...], int | None]],
) -> None:
    clock = SimulatedClock()
    log = LocalCommitLog(tmp_path_factory.mktemp("rt"), default_partitions=2, fsync=False, clock=clock)
    records = [OutRecord("t", k, v, h, timestamp_ms=ts) for k, v, h, ts in rows]
    positions = log.append(records)
    for r, got in zip(records, log.read("t", positions), strict=True):
        assert got is not None
        assert (got.key, got.value, got.headers) == (r.key, r.value, r.headers)
        assert got.timestamp_ms == (clock.now_ms() if r.timestamp_ms is None else r.timestamp_ms)
    log.close()


def test_consumer_reads_partitions_in_offset_order_seeks_and_waits(tmp_path: Path) -> None:
    log = LocalCommitLog(tmp_path, default_partitions=3)
    for p in range(3):
        log.append(_records(10, partition=p, tag=f"p{p}-"))
    consumer = log.consumer("t", {0: 0, 1: 4, 2: 10})
    got = []
    while batch := consumer.poll(7, 0.01):
        assert len(batch) <= 7
        got += batch
    assert [(r.partition, r.offset) for r in got if r.partition == 0] == [(0, i) for i in range(10)]
    assert [(r.partition, r.offset) for r in got if r.partition == 1] == [(1, i) for i in range(4, 10)]
    assert consumer.position(0) == 10 and consumer.position(1) == 10 and consumer.position(2) == 10

    consumer.seek(1, 2)
    assert consumer.position(1) == 2
    assert [(r.partition, r.offset) for r in consumer.poll(100, 0.01)] == [(1, i) for i in range(2, 10)]
    with pytest.raises(ValueError, match="not assigned partition 5"):
        consumer.seek(5, 0)

    started = time.monotonic()
    assert consumer.poll(10, 0.1) == []
    assert 0.09 <= time.monotonic() - started < 2.0

    threading.Timer(0.05, lambda: log.append(_records(1, partition=2, tag="late"))).start()
    started = time.monotonic()
    late = consumer.poll(10, 5.0)
    assert [(r.partition, r.offset, r.key) for r in late] == [(2, 10, b"late0")]
    assert time.monotonic() - started < 2.0
    consumer.close()
    log.close()


def test_consumer_polls_take_turns_so_a_busy_partition_does_not_starve_the_others(tmp_path: Path) -> None:
    log = LocalCommitLog(tmp_path, default_partitions=2, fsync=False)
    log.append(_records(100, partition=0, tag="busy") + _records(5, partition=1, tag="quiet"))
    consumer = log.consumer("t", {0: 0, 1: 0})
    partitions = [{r.partition for r in consumer.poll(10, 0.01)} for _ in range(2)]
    assert 1 in partitions[0] | partitions[1]
    log.close()


def test_consumer_sees_records_appended_by_another_log_instance_across_a_roll(tmp_path: Path) -> None:
    writer = LocalCommitLog(tmp_path, segment_bytes=500)
    reader = LocalCommitLog(tmp_path, segment_bytes=500)
    consumer = reader.consumer("t", {0: 0})
    got: list[Record] = []
    for b in range(10):
        writer.append(_records(3, tag=f"b{b}-"))
        got += consumer.poll(100, 0.5)
    assert [r.offset for r in got] == list(range(30))
    assert len(_segment_files(tmp_path, "t", 0, "log")) >= 3
    writer.close()
    reader.close()


# -- topics, partitioner, timestamps ----------------------------------------------------------


def test_topics_are_created_once_with_their_partition_count(tmp_path: Path) -> None:
    log = LocalCommitLog(tmp_path, default_partitions=2)
    assert log.ensure_topic("orders", 6) == 6
    assert log.ensure_topic("orders", 9) == 6
    assert log.partitions("auto") == 2
    other = LocalCommitLog(tmp_path, default_partitions=5)
    assert other.partitions("orders") == 6 and other.partitions("auto") == 2
    assert other.end_offsets("orders") == dict.fromkeys(range(6), 0)
    for bad in ("../escape", "", "a/b", "x" * 250, "..", "sp ace"):
        with pytest.raises(InvalidTopicError):
            log.partitions(bad)
    with pytest.raises(ValueError, match="no partition 6"):
        log.append([OutRecord("orders", None, b"v", partition=6)])
    assert log.end_offsets("orders") == dict.fromkeys(range(6), 0)
    log.close()
    other.close()


def _java_murmur2(data: bytes) -> int:
    """Utils.murmur2 of the Kafka Java client, transcribed with Java's signed 32-bit ints."""

    def i32(x: int) -> int:
        x &= 0xFFFFFFFF
        return x - (1 << 32) if x >= 1 << 31 else x

    def ushr(x: int, n: int) -> int:  # Java's >>>
        return (x & 0xFFFFFFFF) >> n

    length = len(data)
    m, r = 0x5BD1E995, 24
    h = i32(i32(0x9747B28C) ^ length)
    for i in range(length // 4):
        i4 = i * 4
        k = i32(data[i4] + (data[i4 + 1] << 8) + (data[i4 + 2] << 16) + (data[i4 + 3] << 24))
        k = i32(k * m)
        k ^= ushr(k, r)
        k = i32(i32(k) * m)
        h = i32(h * m)
        h = i32(h ^ k)
    rest = length % 4
    if rest == 3:
        h = i32(h ^ (data[(length & ~3) + 2] << 16))
    if rest >= 2:
        h = i32(h ^ (data[(length & ~3) + 1] << 8))
    if rest >= 1:
        h = i32(h ^ data[length & ~3])
        h = i32(h * m)
    h = i32(h ^ ushr(h, 13))
    h = i32(h * m)
    h = i32(h ^ ushr(h, 15))
    return h


def test_partitioner_matches_kafka_murmur2_known_values() -> None:
    # From the Kafka Java client's UtilsTest.testMurmur2.
    known = {
        b"21": -973932308,
        b"foobar": -790332482,
        b"a-little-bit-long-string": -985981536,
        b"a-little-bit-longer-string": -1486304829,
        b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
        b"abc": 479470107,
    }
    for key, expected in known.items():
        assert _java_murmur2(key) == expected
        assert murmur2(key) == expected
    # kafka-python's DefaultPartitioner test, checked there against the Java client (1000 partitions)
    for key, partition in {
        b"": 681,
        b"a": 524,
        b"ab": 434,
        b"abc": 107,
        b"123456789": 566,
        b"\x00 ": 742,
    }.items():
        assert kafka_partition(key, 1000) == partition


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.integers(min_value=1, max_value=1000))
def test_partitioner_agrees_with_the_java_transcription(key: bytes, partitions: int) -> None:
    assert murmur2(key) == _java_murmur2(key)
    assert kafka_partition(key, partitions) == (_java_murmur2(key) & 0x7FFFFFFF) % partitions


@settings(max_examples=30, deadline=None)
@given(st.lists(st.binary(min_size=0, max_size=4).map(lambda b: b * 3), min_size=1, max_size=120))
def test_batched_partitioner_agrees_with_the_single_one(keys: list[bytes]) -> None:
    keys = keys + [b"same-length-key-%02d" % i for i in range(40)]  # a group big enough for numpy
    assert kafka_partitions(keys, 12) == [kafka_partition(k, 12) for k in keys]


def test_keyed_records_land_where_kafka_puts_them_and_unkeyed_ones_round_robin(tmp_path: Path) -> None:
    log = LocalCommitLog(tmp_path, default_partitions=7, fsync=False)
    keys = [f"user-{i}".encode() for i in range(100)]
    positions = log.append([OutRecord("t", k, b"v") for k in keys])
    assert [p for p, _ in positions] == [(_java_murmur2(k) & 0x7FFFFFFF) % 7 for k in keys]
    unkeyed = log.append([OutRecord("t", None, b"v") for _ in range(70)])
    counts = [sum(1 for p, _ in unkeyed if p == q) for q in range(7)]
    assert counts == [10] * 7
    log.close()


def test_offsets_are_returned_in_input_order_and_timestamps_come_from_the_clock(tmp_path: Path) -> None:
    clock = SimulatedClock(start_ms=1_800_000_000_000)
    log = LocalCommitLog(tmp_path, default_partitions=2, clock=clock)
    records = [
        OutRecord("a", None, b"1", partition=1),
        OutRecord("b", None, b"2", partition=0),
        OutRecord("a", None, b"3", partition=1, timestamp_ms=42),
        OutRecord("a", None, b"4", partition=0),
    ]
    assert log.append(records) == [(1, 0), (0, 0), (1, 1), (0, 0)]
    got = log.read("a", [(1, 0), (1, 1), (0, 0)])
    assert [(r.value, r.timestamp_ms) for r in got if r] == [
        (b"1", 1_800_000_000_000),
        (b"3", 42),
        (b"4", 1_800_000_000_000),
    ]
    assert log.append([]) == []
    log.close()
    with pytest.raises(TimerwheelError, match="closed"):
        log.append(records)


# -- retention --------------------------------------------------------------------------------


def test_delete_before_removes_whole_segments_and_reads_of_them_return_none(tmp_path: Path) -> None:
    log = LocalCommitLog(tmp_path, segment_bytes=200, fsync=False)
    for b in range(6):
        log.append(_records(4, tag=f"b{b}-"))  # one segment per batch: bases 0, 4, 8, ...
    reader = LocalCommitLog(tmp_path)
    assert reader.read("t", [(0, 1)])[0] is not None  # opens segment 0 in the other instance

    assert log.delete_before("t", 0, 10) == 8
    assert log.start_offsets("t") == {0: 8} and log.end_offsets("t") == {0: 24}
    assert log.read("t", [(0, 0), (0, 7), (0, 8), (0, 10)])[:2] == [None, None]
    assert [r.offset for r in log.read("t", [(0, 8), (0, 10)]) if r] == [8, 10]
    assert reader.read("t", [(0, 1), (0, 9)])[0] is None  # deleted under another instance's feet
    below_start = _drain(reader, "t", {0: 2})  # a consumer below the start moves up to it
    assert [r.offset for r in below_start][:2] == [8, 9]

    assert log.delete_before("t", 0, 100) == 24  # everything: the end offset survives
    assert log.start_offsets("t") == {0: 24} and log.end_offsets("t") == {0: 24}
    assert log.append(_records(1, tag="new")) == [(0, 24)]
    assert [p.name for p in _segment_files(tmp_path, "t", 0, "log")] == [f"{24:020d}.log"]
    log.close()
    reader.close()


# -- the read cache of followed topics --------------------------------------------------------


def test_read_serves_a_followed_topics_records_from_what_its_consumers_read(tmp_path: Path) -> None:
    log = LocalCommitLog(tmp_path, default_partitions=2, fsync=False, read_cache_records=1_000)
    consumer = log.consumer("t", {0: 0, 1: 0})  # made before follow: it keeps all the same
    log.follow("t")
    positions = log.append([OutRecord("t", None, f"v{i}".encode(), partition=i % 2) for i in range(10)])
    log.append([OutRecord("other", None, b"x")])
    polled = consumer.poll(100, 0.5)
    assert len(polled) == 10
    by_pos = {(r.partition, r.offset): r for r in polled}
    got = log.read("t", [positions[3], positions[3], positions[8]])
    assert got[0] is by_pos[positions[3]] and got[1] is got[0]  # from memory, the very objects
    assert got[2] is by_pos[positions[8]]
    again = log.read("t", [positions[3]])[0]  # served once: now read from the file, equal
    assert again is not None and again is not got[0] and again == got[0]
    assert set(log.read_cache.positions("t")) == {p for p in positions if p not in (positions[3], positions[8])}
    assert log.read_cache.positions("other") == []  # only followed topics are kept
    log.close()


@pytest.mark.parametrize("bound", ["records", "bytes"])
def test_the_read_cache_keeps_the_newest_records_within_its_bounds(tmp_path: Path, bound: str) -> None:
    limits = {"read_cache_records": 5} if bound == "records" else {"read_cache_bytes": 5 * 960}
    log = LocalCommitLog(tmp_path, fsync=False, **limits)  # type: ignore[arg-type]
    log.follow("t")
    log.append([OutRecord("t", None, b"x" * 120) for _ in range(20)])
    consumer = log.consumer("t", {0: 0})
    while consumer.poll(3, 0):
        pass
    cache = log.read_cache
    kept = sorted(o for _p, o in cache.positions("t"))
    assert kept == list(range(20 - len(kept), 20)) and 3 <= len(kept) <= 5  # whole batches of 3 go
    assert cache.records == len(kept) and 0 < cache.bytes <= 5 * 960
    assert all(r is not None for r in log.read("t", [(0, o) for o in range(20)]))  # the rest from the file
    assert cache.positions("t") == [] and cache.records == 0 and cache.bytes == 0
    log.close()


def test_the_read_cache_finds_records_across_partitions_blocks_and_a_seek_back(tmp_path: Path) -> None:
    log = LocalCommitLog(tmp_path, default_partitions=2, fsync=False, read_cache_records=1_000)
    log.follow("t")
    log.append([OutRecord("t", None, f"{i}".encode(), partition=i % 2) for i in range(40)])
    consumer = log.consumer("t", {0: 0, 1: 0})
    polled = []
    while batch := consumer.poll(7, 0):  # blocks of up to 7 records, the partitions taking turns
        polled += batch
    consumer.seek(0, 5)
    polled_again = consumer.poll(4, 0)  # offsets 5..8 of partition 0 again: a block overlapping older ones
    assert [(r.partition, r.offset) for r in polled_again] == [(0, o) for o in range(5, 9)]
    cache = log.read_cache
    assert cache.records == 44
    wanted = [(1, 19), (0, 6), (0, 0), (1, 3), (0, 6), (0, 19), (1, 0), (0, 42), (2, 0), (0, 20)]
    got = log.read("t", wanted)
    by_pos = {(r.partition, r.offset): r for r in polled}
    assert got[0] is by_pos[(1, 19)] and got[2] is by_pos[(0, 0)] and got[5] is by_pos[(0, 19)]
    assert got[1] is polled_again[1] and got[4] is got[1]  # the newer block's record, once for both asks
    assert got[7] is None and got[8] is None and got[9] is None  # never written; no partition 2; past the end
    assert got[3] is by_pos[(1, 3)] and got[6] is by_pos[(1, 0)]
    assert cache.records == 44 - 6  # six distinct records served: they left
    held = cache.positions("t")
    assert held.count((0, 6)) == 1 and held.count((0, 5)) == 2  # the older block keeps its copy
    log.close()


def test_no_read_cache_when_it_is_sized_zero(tmp_path: Path) -> None:
    log = LocalCommitLog(tmp_path, fsync=False, read_cache_records=0)
    log.follow("t")
    assert not log.read_cache.enabled and log.followed == set()
    log.close()
