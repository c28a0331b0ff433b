"""The owner fence across nodes: an old and a new owner of a shard save checkpoints at the same
time through two ``bindfs -o auto_cache`` mounts of one directory (tests/mounts.py), as two
pods on two nodes of a ReadWriteMany volume would. File locks do not reach across NFS clients,
and each mount caches what it read; whatever the interleaving, once the newer epoch has
published, no reader on either node may load the older owner's checkpoint again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from timerwheel.errors import FencedError
from timerwheel.store.checkpoint import (
    DequeueCheckpoint,
    EnqueueCheckpoint,
    load_dequeue,
    load_enqueue,
    save_dequeue,
    save_enqueue,
)
from two_mounts import TwoMounts

OLD_SAVES = 600
NEW_SAVES = 200
Checkpoint = EnqueueCheckpoint | DequeueCheckpoint


def enqueue(i: int, epoch: int) -> EnqueueCheckpoint:
    return EnqueueCheckpoint(64 * i, i, {0: i}, epoch=epoch)


def dequeue(i: int, epoch: int) -> DequeueCheckpoint:
    return DequeueCheckpoint(read_ms=i, epoch=epoch)


KINDS = {
    "enqueue": (save_enqueue, load_enqueue, enqueue),
    "dequeue": (save_dequeue, load_dequeue, dequeue),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_an_old_and_a_new_owner_racing_through_two_mounts_never_publish_the_old_epoch_again(
    mounts: TwoMounts, kind: str
) -> None:
    save: Callable[[str, Any], None]
    save, load, make = KINDS[kind]  # type: ignore[assignment]
    old_path, new_path = str(mounts.a / f"{kind}.ckpt"), str(mounts.b / f"{kind}.ckpt")
    save(old_path, make(0, 1))
    seen: list[tuple[str, int, int]] = []  # (mount, epoch, write_ms) in the order loaded
    old_fenced: list[int] = []
    new_started = threading.Event()
    stop = threading.Event()

    def old_owner() -> None:
        """Epoch 1 on node A, paused past its lease and running on: saves as fast as it can."""
        for i in range(1, OLD_SAVES):
            if i == 20:
                new_started.set()
            try:
                save(old_path, make(i, 1))
            except FencedError:
                old_fenced.append(i)
                return

    def new_owner() -> None:
        """Epoch 2 on node B: took the shard over and publishes its own progress."""
        new_started.wait(30)
        for i in range(NEW_SAVES):
            save(new_path, make(1_000_000 + i, 2))

    def reader() -> None:
        while not stop.is_set():
            for name, path in (("a", old_path), ("b", new_path)):
                got = load(path)
                if got is not None:
                    seen.append((name, got.epoch, got.write_ms if kind == "enqueue" else got.read_ms))

    threads = [threading.Thread(target=f) for f in (old_owner, new_owner)]
    watcher = threading.Thread(target=reader)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stop.set()
    watcher.join(30)

    first_new = next((k for k, (_m, epoch, _w) in enumerate(seen) if epoch == 2), None)
    assert first_new is not None, "no reader ever saw the new owner's checkpoint"
    went_back = [s for s in seen[first_new:] if s[1] == 1]
    assert not went_back, f"after epoch 2 was published, readers loaded epoch 1 again {len(went_back)} times: " \
                          f"{went_back[:5]}"
    for path in (old_path, new_path):
        assert load(path) == make(1_000_000 + NEW_SAVES - 1, 2)
    assert old_fenced, "the old owner saved on after the new owner had published, and was never told"


