"""dequeue-get on another node than enqueue-put: two ``bindfs -o auto_cache`` mounts of one
directory (tests/mounts.py), no Kafka, no Redis.

The writer appends, flushes and publishes through mount A as enqueue-put does; the wheel is
msynced only every ``wheel_sync_records`` (the default), so through mount B it stays as it was
at the last msync, and files dequeue-get keeps open or mapped through B show old bytes. Every
record the published checkpoint covers must still be fetched, and R must never pass a slot whose
records dequeue-get could not see.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

from timerwheel import SimulatedClock, TimerConfig
from timerwheel.stages.base import StageContext
from timerwheel.stages.codec import DoneEntry, FetchEntry
from timerwheel.stages.dequeue_get import DequeueGet
from timerwheel.stages.ownership import Ownership
from timerwheel.store import DequeueCheckpoint, EnqueueCheckpoint, Flag, Shard, TimerRecord, shard_dir
from timerwheel.transports.memory import MemoryLeaseStore, MemoryWorkQueue
from two_mounts import TwoMounts

START = 1_700_000_000_000
TICK = 100
SEGMENT = 64 * 256  # small segments: records cross into new files while the reader holds old ones
# Slots read once W passes them (TW_LOOKAHEAD_MS 0): what a view shows is checked against what W
# publishes; the tails of slots read ahead are test_release's.
CFG = TimerConfig(tick_ms=TICK, roll_window_ms=20_000, shards=1, segment_bytes=SEGMENT, batch_size=50,
                  max_in_flight=100_000, queue_bound=100_000, lookahead_ms=0)


def open_at(root: Path, writer: bool) -> Shard:
    return Shard.open(shard_dir(root, 0), tick_ms=TICK, slots=CFG.wheel_slots, segment_bytes=SEGMENT, fsync=True,
                      writer=writer)


class Reader:
    """dequeue-get through mount B, with dequeue-put played by the test: every fetch item is
    recorded and reported done at once."""

    def __init__(self, root: Path) -> None:
        self.fetch_q = MemoryWorkQueue("fetch", 1, 100_000)
        self.done_q = MemoryWorkQueue("done", 1, 100_000)
        self.stage = DequeueGet(StageContext(CFG, SimulatedClock(START), consumer="b"), [0],
                                lambda s: open_at(root, writer=False), self.fetch_q, self.done_q,
                                Ownership(MemoryLeaseStore(), "dequeue-get", "b"))
        self.fetched: list[int] = []

    def run(self, steps: int = 50) -> None:
        """Step until dequeue-get has read and seen done every slot before the published W (or
        ``steps`` steps: a view that stays incomplete is not read)."""
        for _ in range(steps):
            self.stage.step(0.0)
            entries = self.fetch_q.get(0, "b", 100_000, 0)
            for _eid, payload in entries:
                entry = FetchEntry.decode(payload)
                self.fetched += [item[0] for item in entry.items]
                self.done_q.put(0, [DoneEntry(0, entry.generation, {entry.slot_time: len(entry.items)}).encode()], 1)
            self.fetch_q.ack(0, [eid for eid, _ in entries])
            if not entries and self.stage.caught_up():
                return
            time.sleep(0.01)

    def close(self) -> None:
        self.stage.close()


def rec(deliver_ms: int, offset: int) -> TimerRecord:
    return TimerRecord(int(Flag.NORMAL), START, deliver_ms, 0, offset, 100, 7, offset)


def test_dequeue_get_through_a_second_mount_fetches_every_published_record(mounts: TwoMounts) -> None:
    writer = open_at(mounts.a, writer=True)
    writer.save_dequeue_checkpoint(DequeueCheckpoint(read_ms=START, epoch=0))
    writer.save_enqueue_checkpoint(EnqueueCheckpoint(writer.flush(), START, {}, 1))
    reader = Reader(mounts.b)
    try:
        reader.run()  # the reader has opened, mapped and read the (empty) shard through mount B
        written: list[int] = []
        offset = 0
        for round_ in range(6):
            w = START + (round_ + 1) * 1_000
            # Records for this round's slots, and for slots of later rounds (already mapped and
            # cached through B by the time they are read), some in slots that had records before.
            batch = [rec(w - 1_000 + (i * 37) % 3_000, offset + i) for i in range(120)]
            offset += len(batch)
            written += writer.append(batch)
            if round_ == 3:
                writer.sync_wheel()  # the wheel file is durable up to here: the reader maps it again
            writer.save_enqueue_checkpoint(EnqueueCheckpoint(writer.flush(), w, {0: offset}, 1))
            reader.run()
        writer.save_enqueue_checkpoint(EnqueueCheckpoint(writer.flush(), START + 10_000, {0: offset}, 1))
        reader.run()
        missing = sorted(set(written) - set(reader.fetched))
        assert not missing, f"{len(missing)} of {len(written)} published records never fetched: {missing[:10]}"
        assert sorted(reader.fetched) == sorted(written), "a record was fetched twice"
        r = writer.load_dequeue_checkpoint()
        assert r is not None and r.read_ms == START + 10_000
    finally:
        reader.close()
        writer.close()


def test_a_wheel_another_process_keeps_mapped_hides_no_record_once_the_wheel_is_synced(mounts: TwoMounts) -> None:
    """dequeue-put maps the same wheel through mount B, and ``posix_fadvise(DONTNEED)`` cannot drop
    pages a process keeps mapped: dequeue-get's remapped view stayed as that process had faulted
    it in. Once the writer syncs the wheel (enqueue-put's recovery after a crash does), the
    reader's own index of the TimerLog starts at the new synced position and every record below
    it must come from the wheel, read past the cache. (The two-mount chaos run lost 74 of 2,899
    messages this way: the slots looked empty and R moved past them.)"""
    writer = open_at(mounts.a, writer=True)
    writer.save_dequeue_checkpoint(DequeueCheckpoint(read_ms=START, epoch=0))
    writer.save_enqueue_checkpoint(EnqueueCheckpoint(writer.flush(), START, {}, 1))
    fd = os.open(os.path.join(shard_dir(mounts.b, 0), "wheel"), os.O_RDONLY)
    held = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)  # "dequeue-put": every page faulted in, kept
    reader = Reader(mounts.b)
    try:
        assert sum(held[i] for i in range(0, len(held), mmap.PAGESIZE)) == sum(held[:1])  # all zero but the header's first byte
        reader.run()
        written = writer.append([rec(START + 2_000 + (i * 37) % 3_000, i) for i in range(120)])
        writer.sync_wheel()
        writer.save_enqueue_checkpoint(EnqueueCheckpoint(writer.flush(), START + 6_000, {0: 120}, 1))
        reader.run()
        missing = sorted(set(written) - set(reader.fetched))
        assert not missing, f"{len(missing)} of {len(written)} records hidden by stale wheel pages: {missing[:10]}"
        assert sorted(reader.fetched) == sorted(written)
    finally:
        reader.close()
        held.close()
        os.close(fd)
        writer.close()


def test_bytes_the_checkpoint_covers_but_this_node_cannot_see_yet_hold_r_back(mounts: TwoMounts) -> None:
    """The cross-check: a checkpoint names a flushed position past what mount B shows (here
    the bytes are simply not there yet, as on a node whose view lags). dequeue-get reads none
    of its slots and does not move R until they show; then it fetches them all."""
    writer = open_at(mounts.a, writer=True)
    writer.save_dequeue_checkpoint(DequeueCheckpoint(read_ms=START, epoch=0))
    first = writer.append([rec(START + 100 * i, i) for i in range(10)])
    writer.save_enqueue_checkpoint(EnqueueCheckpoint(writer.flush(), START + 500, {0: 10}, 1))
    reader = Reader(mounts.b)
    try:
        reader.run()
        assert sorted(reader.fetched) == first[:5]
        # Published: 20 more records, W at START + 3 s; only 10 of them reach the volume now.
        lagging = [rec(START + 1_000 + 100 * i, 10 + i) for i in range(20)]
        shown = writer.append(lagging[:10])
        flushed = writer.flush()
        writer.save_enqueue_checkpoint(EnqueueCheckpoint(flushed + 10 * 64, START + 3_000, {0: 30}, 1))
        reader.run(steps=5)
        r = writer.load_dequeue_checkpoint()
        assert r is not None and r.read_ms <= START + 500, f"R moved to {r.read_ms} over records it never saw"
        assert sorted(reader.fetched) == first[:5], "slots were read from a view short of the checkpoint"
        rest = writer.append(lagging[10:])
        assert writer.flush() == flushed + 10 * 64
        reader.run()
        assert sorted(reader.fetched) == sorted(first + shown + rest)
        r = writer.load_dequeue_checkpoint()
        assert r is not None and r.read_ms == START + 3_000
    finally:
        reader.close()
        writer.close()


def test_the_mounts_really_are_two_caches(mounts: TwoMounts) -> None:
    """The premise of this module, checked each run: through B a kept descriptor stays stale
    after a write and fsync through A."""
    (mounts.a / "probe").write_bytes(b"old!" * 1024)
    time.sleep(1.5)  # past the attribute cache, so B opens the file as it is now
    fd_b = os.open(mounts.b / "probe", os.O_RDONLY)
    try:
        assert os.pread(fd_b, 4, 0) == b"old!"
        fd_a = os.open(mounts.a / "probe", os.O_WRONLY)
        os.pwrite(fd_a, b"new!", 0)
        os.fsync(fd_a)
        os.close(fd_a)
        assert os.pread(fd_b, 4, 0) == b"old!", "mount B is not stale: these tests would prove nothing"
    finally:
        os.close(fd_b)


def test_inspect_through_a_second_mount_counts_what_the_writer_published(mounts: TwoMounts) -> None:
    """The status an operator reads (``timerwheel inspect``, the ``pending`` gauge) from another
    node counts the records the checkpoint publishes, not the wheel as that node cached it."""
    from timerwheel.runtime.inspect import inspect_shards

    writer = open_at(mounts.a, writer=True)
    writer.save_dequeue_checkpoint(DequeueCheckpoint(read_ms=START, epoch=0))
    writer.append([rec(START + 5_000, 0)])
    writer.save_enqueue_checkpoint(EnqueueCheckpoint(writer.sync_wheel(), START, {0: 1}, 1))
    reader = open_at(mounts.b, writer=False)
    try:
        assert inspect_shards(CFG, {0: reader}, START)["shards"][0]["pending"] == 1
        writer.append([rec(START + 5_000 + 100 * (i % 7), 1 + i) for i in range(40)])
        writer.save_enqueue_checkpoint(EnqueueCheckpoint(writer.flush(), START, {0: 41}, 1))
        status = inspect_shards(CFG, {0: reader}, START)["shards"][0]
        assert status["pending"] == 41 and status["flushed_pos"] == 41 * 64, status
    finally:
        reader.close()
        writer.close()
