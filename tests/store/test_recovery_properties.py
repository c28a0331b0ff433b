"""Property test: a shard against a plain in-memory model, through appends, flushes, checkpoints,
bit rot and simulated crashes, each followed by recovery.

A crash is simulated on a copy of the shard directory, made while the shard is open (so it holds
what the OS holds), then damaged the ways a crash may damage it:

- the TimerLog is cut at any byte offset at or past the last flush, and part of what remains
  past the flush may be zeroed (pages never written back);
- the wheel file is the one published, or the one last made durable (snapshot at its last sync),
  or slot by slot any state published since (pages written back in any order);
- the enqueue checkpoint may be the one before the last (a save that never happened).

After every recovery: each valid record that survived (everything flushed, and more) is
reachable from its own slot exactly once, chains run newest first, no record is reachable from a
wrong slot or a past revolution, the reported source offsets are the highest actually present, and
resuming from them writes nothing twice and skips nothing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from timerwheel.store import EnqueueCheckpoint, Flag, Shard, TimerRecord

from .conftest import slot_records

TICK = 10
SLOTS = 16
WINDOW = SLOTS // 2  # records go at most this many slots past W, so no stale revolution is written
SEGMENT = 64 * 8
PARTITIONS = (0, 1, 2)
#: The file the checkpoints of this test (all of epoch 1) are saved in.
CKPT_FILE = "enqueue.00000000000000000001.ckpt"


def fields(record: TimerRecord) -> tuple[int, ...]:
    return (record.flags, record.enqueue_ms, record.deliver_ms, record.src_partition, record.src_offset,
            record.src_size, record.topic_hash, record.id_hash)


def slot_of(record: TimerRecord) -> tuple[int, int]:
    """(wheel index, slot time) of a record."""
    return (record.deliver_ms // TICK) % SLOTS, record.deliver_ms - record.deliver_ms % TICK


class ShardAgainstModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="tw-store-model-"))
        self.generation = 0
        self.shard: Shard | None = None
        self.sync_every = 0
        self.dense_slot_min = 0
        self.records: dict[int, TimerRecord] = {}  # position -> record, what the TimerLog holds
        self.flipped: set[int] = set()  # positions whose bytes rotted after they were flushed
        self.garbage: set[int] = set()  # unreadable records a crash left in the middle of the log
        self.end = 0
        self.flushed = 0
        self.w_ms = 100_000
        self.next_offset = dict.fromkeys(PARTITIONS, 0)
        self.checkpoints: list[bytes] = []
        self.wheel_on_disk = b""  # the wheel file as last made durable (msync + synced_pos)
        self.wheel_published: list[bytes] = []  # the file after each flush since then
        self.slot_times_used: set[int] = set()

    # ------------------------------------------------------------ helpers

    def open(self, directory: Path) -> Shard:
        shard = Shard.open(directory, tick_ms=TICK, slots=SLOTS, segment_bytes=SEGMENT, fsync=False,
                           wheel_sync_records=self.sync_every)
        shard.dense_slot_min = self.dense_slot_min
        self.wheel_on_disk = (directory / "wheel").read_bytes()  # recovery left it durable
        self.wheel_published = []
        return shard

    @property
    def live(self) -> Shard:
        assert self.shard is not None
        return self.shard

    def runs(self) -> dict[int, tuple[int, list[int]]]:
        """Per wheel index: the live slot time and its records oldest first (the reset rule of append)."""
        runs: dict[int, tuple[int, list[int]]] = {}
        for pos in sorted(self.records):
            index, slot_time = slot_of(self.records[pos])
            current = runs.get(index)
            if current is None or current[0] < slot_time:
                runs[index] = (slot_time, [pos])
            else:
                assert current[0] == slot_time, "the generator never writes a stale revolution"
                current[1].append(pos)
        return runs

    def check_slot(self, slot_time: int, positions: list[int]) -> None:
        got = slot_records(self.live, slot_time)
        expected = [p for p in reversed(positions) if p not in self.flipped]
        assert [p for p, _ in got] == expected, f"slot {slot_time}"
        for pos, record in got:
            assert fields(record) == fields(self.records[pos])
            assert -1 <= record.prev_pos < pos
        num = self.live.wheel.get(slot_time).num
        assert len(expected) <= num <= len(positions), f"slot {slot_time} counts {num}"

    def check_everything(self) -> None:
        runs = self.runs()
        for slot_time, positions in runs.values():
            self.check_slot(slot_time, positions)
        live_times = {slot_time for slot_time, _ in runs.values()}
        for slot_time in self.slot_times_used - live_times:
            assert slot_records(self.live, slot_time) == [], f"past revolution {slot_time} still readable"
        linked = sum(len(p) for _, p in runs.values())
        valid = sum(1 for _, p in runs.values() for pos in p if pos not in self.flipped)
        assert valid <= self.live.wheel.count_range(-(10**9), 10**9) <= linked

    # ------------------------------------------------------------ rules

    @initialize(sync_every=st.sampled_from([0, 5, 10**9]), dense_slot_min=st.sampled_from([1, 10**9]))
    def start(self, sync_every: int, dense_slot_min: int) -> None:
        self.sync_every = sync_every
        self.dense_slot_min = dense_slot_min  # 1: read every dense enough slot by a scan
        self.shard = self.open(self.root / "g0")

    @rule(
        batch=st.lists(
            st.tuples(st.integers(0, WINDOW - 1), st.integers(0, TICK - 1), st.sampled_from(PARTITIONS),
                      st.sampled_from([Flag.NORMAL, Flag.DELETE, Flag.ROLL | Flag.DELETE])),
            min_size=1, max_size=12,
        )
    )
    def append(self, batch: list[tuple[int, int, int, int]]) -> None:
        records = []
        for ahead, jitter, partition, flags in batch:
            deliver = self.w_ms - self.w_ms % TICK + ahead * TICK + jitter
            offset = self.next_offset[partition]
            self.next_offset[partition] += 1
            records.append(TimerRecord(flags, self.w_ms, deliver, partition, offset, 100, 7, partition << 32 | offset))
            self.slot_times_used.add(deliver - deliver % TICK)
        positions = self.live.append(records)
        assert positions == [self.end + 64 * i for i in range(len(records))]
        self.records.update(zip(positions, records, strict=True))
        self.end += 64 * len(records)

    @rule(ticks=st.integers(0, 6))
    def advance_write_time(self, ticks: int) -> None:
        self.w_ms += ticks * TICK

    @rule()
    def flush(self) -> None:
        self.flushed = self.live.flush()
        assert self.flushed == self.end
        wheel = (Path(self.live.directory) / "wheel").read_bytes()
        if self.live.wheel.synced_pos == self.flushed:
            self.wheel_on_disk, self.wheel_published = wheel, []
        else:
            self.wheel_published.append(wheel)

    @rule()
    def sync_wheel(self) -> None:
        self.flushed = self.live.sync_wheel()
        self.wheel_on_disk, self.wheel_published = (Path(self.live.directory) / "wheel").read_bytes(), []

    @rule()
    def save_checkpoint(self) -> None:
        durable = [r for pos, r in self.records.items() if pos < self.flushed]
        next_offsets = {p: 1 + max((r.src_offset for r in durable if r.src_partition == p), default=-1)
                        for p in PARTITIONS}
        self.live.save_enqueue_checkpoint(EnqueueCheckpoint(self.flushed, self.w_ms, next_offsets, 1))
        self.checkpoints.append((Path(self.live.directory) / CKPT_FILE).read_bytes())

    @rule(data=st.data())
    def read_a_slot(self, data: st.DataObject) -> None:
        runs = self.runs()
        if runs:
            slot_time, positions = runs[data.draw(st.sampled_from(sorted(runs)))]
            self.check_slot(slot_time, positions)

    @rule(data=st.data())
    def rot_a_flushed_record(self, data: st.DataObject) -> None:
        # Only a record that is not the first of its run: which slot a rotten record belongs to is
        # unknowable, so a rotten first record could leave a past revolution in place, legitimately.
        # Never the last flushed record, so a valid one always follows (a rotten tail is cut instead).
        candidates = [pos for _, positions in self.runs().values() for pos in positions[1:]
                      if pos < self.flushed - 64 and pos not in self.flipped]
        if not candidates:
            return
        pos = data.draw(st.sampled_from(sorted(candidates)))
        byte = data.draw(st.integers(0, 63))
        path = Path(self.live.log.directory) / f"{pos - pos % SEGMENT:020d}.tlog"
        with open(path, "r+b") as f:
            f.seek(pos % SEGMENT + byte)
            value = f.read(1)[0]
            f.seek(-1, 1)
            f.write(bytes([value ^ (1 << data.draw(st.integers(0, 7)))]))
        self.flipped.add(pos)

    @rule(data=st.data())
    def crash_and_recover(self, data: st.DataObject) -> None:
        self.generation += 1
        crashed = self.root / f"g{self.generation}"
        shutil.copytree(self.live.directory, crashed)

        # The TimerLog: cut anywhere past the flush, maybe zero a stretch past the flush.
        cut_at = data.draw(st.integers(self.flushed, self.end), label="log cut at")
        log_dir = crashed / "timerlog"
        for name in os.listdir(log_dir):
            base = int(name.split(".")[0])
            if base >= cut_at:
                os.unlink(log_dir / name)
            else:
                os.truncate(log_dir / name, min(os.path.getsize(log_dir / name), cut_at - base))
        damaged: set[int] = set()  # records whose bytes the zeroing really changed
        if cut_at > self.flushed and data.draw(st.booleans(), label="zero a stretch"):
            lo = data.draw(st.integers(self.flushed, cut_at - 1))
            hi = data.draw(st.integers(lo + 1, cut_at))
            for pos in range(lo - lo % 64, hi, 64):
                path = log_dir / f"{pos - pos % SEGMENT:020d}.tlog"
                with open(path, "r+b") as f:
                    f.seek(pos % SEGMENT)
                    before = f.read(64)
                    start, stop = max(lo, pos) - pos, min(hi, pos + 64) - pos
                    after = before[:start] + bytes(stop - start) + before[stop:]
                    f.seek(pos % SEGMENT)
                    f.write(after[: len(before)])
                if after[: len(before)] != before:
                    damaged.add(pos)

        # The wheel: as published, as last made durable, or each slot as it was after any
        # flush since (pages written back in any order).
        wheel_choice = data.draw(st.sampled_from(["published", "durable", "mixed"]), label="wheel")
        versions = [self.wheel_on_disk, *self.wheel_published, (crashed / "wheel").read_bytes()]
        if wheel_choice == "durable":
            (crashed / "wheel").write_bytes(self.wheel_on_disk)
        elif wheel_choice == "mixed":
            picks = data.draw(st.lists(st.integers(0, len(versions) - 1), min_size=SLOTS, max_size=SLOTS))
            mixed = bytearray(self.wheel_on_disk)
            for i, version in enumerate(picks):
                mixed[64 + 32 * i : 96 + 32 * i] = versions[version][64 + 32 * i : 96 + 32 * i]
            (crashed / "wheel").write_bytes(bytes(mixed))

        # The checkpoint: maybe the previous one.
        if len(self.checkpoints) >= 2 and data.draw(st.booleans(), label="lose the last checkpoint"):
            (crashed / CKPT_FILE).write_bytes(self.checkpoints[-2])
            self.checkpoints.pop()

        self.live.close()
        self.shard = self.open(crashed)
        report = self.live.recovery
        assert report is not None

        # What the model says survived.
        survivors = {pos: r for pos, r in self.records.items() if pos + 64 <= cut_at}
        valid = [pos for pos in survivors if pos not in damaged and pos not in self.flipped]
        end = max(valid, default=-64) + 64
        assert report.end_pos == end == self.live.log.end_pos
        assert end >= self.flushed
        unreadable = {pos for pos in survivors if pos < end and pos in damaged}
        self.garbage = {pos for pos in self.garbage if pos < end} | unreadable
        expected_corrupt = {pos for pos in self.garbage | self.flipped if report.checked_from <= pos < end}
        assert {pos for pos, _ in report.corrupt} == expected_corrupt
        self.records = {pos: r for pos, r in survivors.items() if pos < end and pos not in damaged}
        self.flipped &= set(self.records)

        # Source offsets: the highest present, and resuming from them neither repeats nor skips.
        scanned = [r for pos, r in self.records.items() if pos >= report.checked_from and pos not in self.flipped]
        assert report.max_src_offsets == {
            p: max(r.src_offset for r in scanned if r.src_partition == p)
            for p in {r.src_partition for r in scanned}
        }
        ckpt = self.live.load_enqueue_checkpoint()
        for p in PARTITIONS:
            resume = max(ckpt.next_offsets.get(p, 0) if ckpt else 0, report.max_src_offsets.get(p, -1) + 1)
            offsets = [r.src_offset for pos, r in self.records.items() if r.src_partition == p]
            valid_offsets = [r.src_offset for pos, r in self.records.items()
                             if r.src_partition == p and pos not in self.flipped]
            assert resume >= max(valid_offsets, default=-1) + 1, "a record would be written twice"
            assert resume <= max(offsets, default=-1) + 1, "a record would be skipped"
            self.next_offset[p] = resume

        self.end = self.flushed = end
        self.check_everything()

    @invariant()
    def log_ends_where_the_model_ends(self) -> None:
        if self.shard is not None:
            assert self.live.log.end_pos == self.end

    def teardown(self) -> None:
        if self.shard is not None:
            self.live.close()
        shutil.rmtree(self.root, ignore_errors=True)


ShardAgainstModel.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_shard_agrees_with_the_model_through_crashes = ShardAgainstModel.TestCase
