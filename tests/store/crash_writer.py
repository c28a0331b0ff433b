"""A writer process for test_recovery_kill: appends, flushes and checkpoints as enqueue-put would,
until it is killed. Usage: crash_writer.py SHARD_DIR PROGRESS_FILE SEED

Record number k (its src_offset on partition 0) always fires at ``fire_ms(k)``, so the parent
can tell which slot each record belongs to. After each checkpoint the writer appends the next
offset to PROGRESS_FILE: every record below it was flushed (durable) before that line was written.
"""

from __future__ import annotations

import os
import random
import sys
import time

from timerwheel.store import EnqueueCheckpoint, Flag, Shard, TimerRecord

SETTINGS = {"tick_ms": 100, "slots": 100_000, "segment_bytes": 64 * 512, "wheel_sync_records": 700}
BASE_MS = 1_700_000_000_000


def fire_ms(k: int) -> int:
    return BASE_MS + (k * 7919 % 1500) * 100 + k % 100


def main() -> None:
    directory, progress, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = random.Random(seed)
    shard = Shard.open(directory, fsync=True, **SETTINGS)
    assert shard.recovery is not None
    ckpt = shard.load_enqueue_checkpoint()
    k = max(ckpt.next_offsets.get(0, 0) if ckpt else 0, shard.recovery.max_src_offsets.get(0, -1) + 1)
    out = os.open(progress, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    print("ready", flush=True)
    while True:
        n = rng.randint(1, 40)
        shard.append([TimerRecord(Flag.NORMAL, BASE_MS, fire_ms(i), 0, i, 100, 7, i) for i in range(k, k + n)])
        k += n
        if rng.random() < 0.5:
            pos = shard.flush()
            shard.save_enqueue_checkpoint(EnqueueCheckpoint(pos, BASE_MS, {0: k}, 1))
            os.write(out, f"{k}\n".encode())
        time.sleep(rng.random() * 0.002)


if __name__ == "__main__":
    main()
