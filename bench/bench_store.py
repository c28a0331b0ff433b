"""Store benchmarks: append, reading slot chains, recovery (figures, never pass/fail).

Each benchmark says what it measured (stderr) and, last, prints one JSON line (``bench.common.emit``)
such as ``{"bench": "store.recovery", "value": 1234567, "unit": "records/s", ...}``.

Setting: tick 100 ms, a wheel for a 2-day roll window (3,456,000 slots, 4-day span), 64 MiB
segments, delays log-uniform from 100 ms to 2 days (many short, some long: every batch touches
slots all over the wheel). Data lives in a temp dir under /tmp, deleted afterwards. Recovery runs
in a child process so that its peak RSS (VmHWM) is its own.

``python -m bench store`` runs them; ``python -m bench.bench_store --quick`` runs smaller sizes.
``TW_BENCH_STORE_ONLY`` (a comma list of append, read, burst, recovery, rebuild) runs some only;
``TW_BENCH_REBUILD_RECORDS`` (a comma list, default 200000,1000000) sets the rebuild sizes.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
from timerwheel.store import EnqueueCheckpoint, Flag, Shard, TimerRecord, records_array
from timerwheel.store.checkpoint import save_enqueue

from bench.common import emit, say

TICK_MS = 100
SLOTS = 3_456_000
SEGMENT_BYTES = 64 * 1024 * 1024
MAX_DELAY_MS = 2 * 86_400_000
NOW_MS = 1_700_000_000_000
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _delays(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.exp(rng.uniform(np.log(100), np.log(MAX_DELAY_MS), n)).astype(np.int64)


def _records(rng: np.random.Generator, n: int, start_offset: int = 0) -> list[TimerRecord]:
    deliver = (NOW_MS + _delays(rng, n)).tolist()
    ids = rng.integers(0, 2**63, n).tolist()
    return [
        TimerRecord(Flag.NORMAL, NOW_MS, deliver[i], i % 8, start_offset + i, 512, 7, ids[i])
        for i in range(n)
    ]


def _open(directory: str, **kw: Any) -> Shard:
    return Shard.open(directory, tick_ms=TICK_MS, slots=SLOTS, segment_bytes=SEGMENT_BYTES, **kw)


def bench_append(tmp: str, total: int, batch: int = 1000, wheel_sync_records: int | None = None) -> None:
    """Shard.append + Shard.flush (one fdatasync of the TimerLog) per batch of ``batch`` records.

    Two passes of ``total`` records: the first on a fresh wheel (each 4 KiB page of the wheel file is
    touched for the first time: page faults, block allocation), the second as a running shard sees it.
    The TimerRecords are built before the clock starts.
    """
    rng = np.random.default_rng(1)
    directory = os.path.join(tmp, "append")
    kw = {} if wheel_sync_records is None else {"wheel_sync_records": wheel_sync_records}
    shard = _open(directory, fsync=True, **kw)
    passes = []
    for n_pass in range(2):
        batches = [_records(rng, batch, (n_pass * total) + k * batch) for k in range(total // batch)]
        flush_s = []
        started = time.perf_counter()
        for records in batches:
            shard.append(records)
            t = time.perf_counter()
            shard.flush()
            flush_s.append(time.perf_counter() - t)
        passes.append((time.perf_counter() - started, flush_s))
    shard.close()
    shutil.rmtree(directory)
    (cold_s, _), (seconds, flush_s) = passes
    rate = total / seconds
    name = "store.append" if wheel_sync_records is None else "store.append_wheel_msync_every_flush"
    say(f"{name}: {total} records in batches of {batch}, one flush each: {seconds:.2f} s, {rate:,.0f} records/s "
          f"(fresh wheel: {total / cold_s:,.0f} records/s), flush p50 {np.median(flush_s) * 1e3:.2f} ms, "
          f"p99 {np.percentile(flush_s, 99) * 1e3:.2f} ms")
    emit(name, round(rate), "records/s", records=total, batch=batch, fresh_wheel_records_per_s=round(total / cold_s),
         flush_p50_ms=round(float(np.median(flush_s)) * 1e3, 3),
         flush_p99_ms=round(float(np.percentile(flush_s, 99)) * 1e3, 3))


def bench_read_chains(tmp: str, slots_used: int, per_slot: int) -> None:
    """read_slot over every used slot, following prev_pos links (one pread + CRC per record),
    its records given column-wise."""
    rng = np.random.default_rng(2)
    directory = os.path.join(tmp, "read")
    shard = _open(directory, fsync=False)
    total = slots_used * per_slot
    slot_times = NOW_MS + TICK_MS * rng.permutation(slots_used)
    deliver = np.repeat(slot_times, per_slot)
    rng.shuffle(deliver)
    for c0 in range(0, total, 65536):
        d = deliver[c0 : c0 + 65536]
        shard.append_array(records_array(flags=1, enqueue_ms=NOW_MS, deliver_ms=d, src_partition=0,
                                         src_offset=np.arange(c0, c0 + len(d)), src_size=100, topic_hash=1, id_hash=2))
        shard.flush()
    started = time.perf_counter()
    read = 0
    for t in slot_times.tolist():
        for positions, _records in shard.read_slot(t):
            read += len(positions)
    seconds = time.perf_counter() - started
    shard.close()
    shutil.rmtree(directory)
    assert read == total, (read, total)
    rate = read / seconds
    say(f"store.read_slot: {read} records in {slots_used} chains of {per_slot}: {seconds:.2f} s, {rate:,.0f} records/s")
    emit("store.read_slot", round(rate), "records/s", records=read, chains=slots_used)


def bench_read_burst(tmp: str, burst: int, others: int) -> None:
    """read_slot of one slot holding ``burst`` records due at one instant, written among ``others``
    records of other slots (PITFALLS: 500k messages due in one second). A dense slot is read by a
    vectorised scan of its stretch of the TimerLog rather than a pread per link."""
    rng = np.random.default_rng(4)
    directory = os.path.join(tmp, "burst")
    shard = _open(directory, fsync=False)
    total = burst + others
    deliver = np.full(total, NOW_MS + 60_000, dtype=np.int64)
    deliver[rng.permutation(total)[:others]] = NOW_MS + _delays(rng, others)
    for c0 in range(0, total, 65536):
        d = deliver[c0 : c0 + 65536]
        shard.append_array(records_array(flags=1, enqueue_ms=NOW_MS, deliver_ms=d, src_partition=0,
                                         src_offset=np.arange(c0, c0 + len(d)), src_size=100, topic_hash=1, id_hash=2))
        shard.flush()
    started = time.perf_counter()
    read = sum(len(positions) for positions, _records in shard.read_slot(NOW_MS + 60_000))
    seconds = time.perf_counter() - started
    shard.close()
    shutil.rmtree(directory)
    rate = read / seconds
    say(f"store.read_slot_burst: one slot of {read:,} records among {others:,} others: {seconds:.2f} s, "
          f"{rate:,.0f} records/s")
    emit("store.read_slot_burst", round(rate), "records/s", records=read, other_records=others)


def _build_log(directory: str, total: int) -> None:
    """A TimerLog of ``total`` linked records, as enqueue-put would write them (fsync off to save time)."""
    rng = np.random.default_rng(3)
    shard = _open(directory, fsync=False, wheel_sync_records=1 << 62)
    chunk = 65536
    for c0 in range(0, total, chunk):
        n = min(chunk, total - c0)
        enqueue = NOW_MS + (np.arange(c0, c0 + n, dtype=np.int64) // 10)  # 10,000 records/s of traffic
        shard.append_array(records_array(
            flags=1, enqueue_ms=enqueue, deliver_ms=enqueue + _delays(rng, n), src_partition=np.arange(n) % 16,
            src_offset=np.arange(c0, c0 + n) // 16, src_size=512, topic_hash=7, id_hash=rng.integers(0, 2**63, n)))
        shard.flush()
    shard.close()


def _peak_rss_kb() -> int:
    """Peak RSS of this process image: VmHWM (ru_maxrss would include the forking parent's, kept over exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _recover_child(directory: str) -> None:
    """Child process: open the shard as the writer (runs recovery), print figures as JSON."""
    before = _peak_rss_kb()
    started = time.perf_counter()
    shard = _open(directory, fsync=True)
    seconds = time.perf_counter() - started
    report = shard.recovery
    assert report is not None
    peak = _peak_rss_kb()
    shard.close()
    print(json.dumps({"open_seconds": seconds, "recovery_seconds": report.seconds,
                      "records": report.records_checked, "relinked": report.relinked,
                      "rss_before_kb": before, "peak_rss_kb": peak}))


def bench_recovery(tmp: str, total: int) -> None:
    """Recovery of a ``total``-record TimerLog from a checkpoint at its start, wheel rebuilt from nothing."""
    directory = os.path.join(tmp, f"recover-{total}")
    t = time.perf_counter()
    _build_log(directory, total)
    built = time.perf_counter() - t
    # Worst case: the wheel is gone too, so every record is checked and linked again.
    os.unlink(os.path.join(directory, "wheel"))
    save_enqueue(os.path.join(directory, "enqueue.ckpt"),
                            EnqueueCheckpoint(flushed_pos=0, write_ms=NOW_MS, next_offsets={}, epoch=1))
    subprocess.run(["sync"], check=False)
    out = subprocess.run([sys.executable, "-m", "bench.bench_store", "--recover-child", directory],
                         cwd=REPO, check=True, capture_output=True, text=True)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    shutil.rmtree(directory)
    rate = figures["records"] / figures["recovery_seconds"]
    say(f"store.recovery: {figures['records']:,} records ({total * 64 / 2**20:,.0f} MiB, built in {built:.1f} s) "
          f"checked and re-linked in {figures['recovery_seconds']:.2f} s = {rate:,.0f} records/s; "
          f"peak RSS {figures['peak_rss_kb'] / 1024:.0f} MiB (after imports {figures['rss_before_kb'] / 1024:.0f} MiB)")
    name = "store.recovery" if total >= 10_000_000 else f"store.recovery_{total // 1_000_000}m"
    emit(name, round(rate), "records/s", records=figures["records"], relinked=figures["relinked"],
         seconds=round(figures["recovery_seconds"], 3), peak_rss_mb=round(figures["peak_rss_kb"] / 1024, 1),
         rss_after_imports_mb=round(figures["rss_before_kb"] / 1024, 1), wheel_slots=SLOTS)


#: The steps of the rebuild benchmark, run in turn on one shard: the settings each runs with.
REBUILD_STEPS: dict[str, dict[str, int]] = {
    "rebuild": {"tick_ms": TICK_MS, "roll_window_ms": MAX_DELAY_MS},  # as built: rebuild-wheel
    "window": {"tick_ms": TICK_MS, "roll_window_ms": 3 * 86_400_000},  # --change-window, the same tick
    "tick": {"tick_ms": 2 * TICK_MS, "roll_window_ms": 3 * 86_400_000},  # --change-window, a new tick
}


def _build_data_dir(data: str, total: int) -> None:
    """A data directory of one shard as enqueue-put leaves it: the deployment file, ``total``
    linked records (``_build_log``), both checkpoints (R and W at the first record's enqueue time)."""
    from timerwheel.config import TimerConfig
    from timerwheel.store.checkpoint import DequeueCheckpoint, save_dequeue
    from timerwheel.store.deployment import DeploymentSettings, check_settings
    from timerwheel.store.layout import shard_dir

    config = TimerConfig(data_dir=data, tick_ms=TICK_MS, roll_window_ms=MAX_DELAY_MS, segment_bytes=SEGMENT_BYTES)
    assert config.wheel_slots == SLOTS
    check_settings(data, DeploymentSettings.of(config), fsync=False)
    directory = shard_dir(data, 0)
    _build_log(directory, total)
    end = sum(os.path.getsize(os.path.join(directory, "timerlog", n)) for n in os.listdir(os.path.join(directory, "timerlog")))
    save_enqueue(os.path.join(directory, "enqueue.ckpt"),
                 EnqueueCheckpoint(flushed_pos=end, write_ms=NOW_MS, next_offsets={}, epoch=1), fsync=False)
    save_dequeue(os.path.join(directory, "dequeue.ckpt"), DequeueCheckpoint(read_ms=NOW_MS, epoch=1), fsync=False)


def _rebuild_child(data: str, step: str) -> None:
    """Child process: one step of REBUILD_STEPS on shard 0 of ``data``, as ``timerwheel
    rebuild-wheel`` runs it (fsync on); figures as JSON. The tool's imports come before the clock."""
    from timerwheel.config import TimerConfig
    from timerwheel.store import repair

    config = TimerConfig(data_dir=data, segment_bytes=SEGMENT_BYTES, **REBUILD_STEPS[step])
    started = time.perf_counter()
    report = repair.rebuild_wheel(config, 0) if step == "rebuild" else repair.change_window(config, 0)
    seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "records": report["records"], "rechained": report.get("rechained", 0),
                      "segments_rewritten": report.get("segments_rewritten", 0), "peak_rss_kb": _peak_rss_kb()}))


def bench_rebuild(tmp: str, total: int) -> None:
    """``rebuild-wheel`` of a ``total``-record shard, then ``--change-window`` to a 3-day roll window
    (the same tick: a bigger wheel, no link changes), then to a 200 ms tick (new slots: links
    rewritten). Each step in its own process; the TimerLog is in the page cache (just written)."""
    data = os.path.join(tmp, f"rebuild-{total}")
    _build_data_dir(data, total)
    subprocess.run(["sync"], check=False)
    for step in REBUILD_STEPS:
        out = subprocess.run([sys.executable, "-m", "bench.bench_store", "--rebuild-child", data, step],
                             cwd=REPO, check=True, capture_output=True, text=True)
        figures = json.loads(out.stdout.strip().splitlines()[-1])
        rate = figures["records"] / figures["seconds"]
        load = os.getloadavg()[0]
        say(f"store.rebuild_{step}: {figures['records']:,} records in {figures['seconds']:.3f} s = {rate:,.0f} records/s "
            f"({figures['rechained']:,} relinked, {figures['segments_rewritten']} segments rewritten); "
            f"peak RSS {figures['peak_rss_kb'] / 1024:.0f} MiB; load average {load:.2f}")
        emit(f"store.rebuild_{step}", round(rate), "records/s", records=figures["records"],
             seconds=round(figures["seconds"], 3), rechained=figures["rechained"],
             segments_rewritten=figures["segments_rewritten"], peak_rss_mb=round(figures["peak_rss_kb"] / 1024, 1),
             load_average=round(load, 2))
    shutil.rmtree(data)


def main() -> None:
    quick = "--quick" in sys.argv
    only = {name.strip() for name in os.environ.get("TW_BENCH_STORE_ONLY", "").split(",") if name.strip()}
    wanted = only or {"append", "read", "burst", "recovery", "rebuild"}
    tmp = tempfile.mkdtemp(prefix="tw-bench-store-", dir="/tmp")
    try:
        if "append" in wanted:
            bench_append(tmp, 100_000 if quick else 300_000)
            bench_append(tmp, 20_000 if quick else 50_000, wheel_sync_records=0)
        if "read" in wanted:
            bench_read_chains(tmp, 200 if quick else 1000, 100 if quick else 300)
        if "burst" in wanted:
            bench_read_burst(tmp, 100_000 if quick else 500_000, 25_000 if quick else 125_000)
        if "recovery" in wanted:
            bench_recovery(tmp, 1_000_000)
            if not quick:
                bench_recovery(tmp, 10_000_000)
        if "rebuild" in wanted:
            for total in os.environ.get("TW_BENCH_REBUILD_RECORDS", "200000,1000000").split(","):
                bench_rebuild(tmp, int(total))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--recover-child":
        _recover_child(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "--rebuild-child":
        _rebuild_child(sys.argv[2], sys.argv[3])
    else:
        main()
