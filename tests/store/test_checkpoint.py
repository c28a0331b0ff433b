"""Checkpoints: round trips, atomic replacement, damage, version and epoch checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from timerwheel.errors import FencedError, FormatMismatchError
from timerwheel.files import atomic_write
from timerwheel.store import FORMAT_VERSION, CorruptCheckpointError, DequeueCheckpoint, EnqueueCheckpoint
from timerwheel.store import checkpoint as ckpt_module

from .conftest import OpenShard

ENQ = EnqueueCheckpoint(flushed_pos=6400, write_ms=1_700_000_000_000, next_offsets={0: 17, 3: 2}, epoch=4)


def test_enqueue_and_dequeue_checkpoints_round_trip(open_shard: OpenShard) -> None:
    shard = open_shard()
    assert shard.load_enqueue_checkpoint() is None and shard.load_dequeue_checkpoint() is None
    shard.save_enqueue_checkpoint(ENQ)
    shard.save_dequeue_checkpoint(DequeueCheckpoint(read_ms=1_700_000_000_100, epoch=2))
    assert shard.load_enqueue_checkpoint() == ENQ
    assert shard.load_dequeue_checkpoint() == DequeueCheckpoint(1_700_000_000_100, 2, FORMAT_VERSION)


def test_a_crash_between_temp_write_and_rename_leaves_the_old_checkpoint_readable(
    open_shard: OpenShard, monkeypatch: pytest.MonkeyPatch
) -> None:
    shard = open_shard()
    shard.save_enqueue_checkpoint(ENQ)

    def crash(src: str, dst: str) -> None:
        raise KeyboardInterrupt("killed between write and rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        shard.save_enqueue_checkpoint(EnqueueCheckpoint(9984, 1, {0: 99}, 4))
    monkeypatch.undo()
    assert shard.load_enqueue_checkpoint() == ENQ
    leftovers = [n for n in os.listdir(shard.directory) if ".tmp-" in n]
    assert leftovers, "the temp file the crash left behind"
    shard.close()
    reopened = open_shard()
    assert not [n for n in os.listdir(reopened.directory) if ".tmp-" in n]
    assert reopened.load_enqueue_checkpoint() == ENQ


def test_a_damaged_checkpoint_is_reported_not_trusted(open_shard: OpenShard) -> None:
    shard = open_shard()
    shard.save_enqueue_checkpoint(ENQ)
    path = Path(ckpt_module.epoch_file(os.path.join(shard.directory, "enqueue.ckpt"), ENQ.epoch))
    path.write_text(path.read_text().replace("6400", "6464"))
    with pytest.raises(CorruptCheckpointError, match="CRC"):
        shard.load_enqueue_checkpoint()
    path.write_text(path.read_text()[:20])
    with pytest.raises(CorruptCheckpointError, match="unreadable"):
        shard.load_enqueue_checkpoint()


def test_a_checkpoint_of_another_format_version_is_refused(open_shard: OpenShard) -> None:
    shard = open_shard()
    shard.save_dequeue_checkpoint(DequeueCheckpoint(read_ms=5, epoch=1, version=FORMAT_VERSION + 1))
    with pytest.raises(FormatMismatchError, match=f"format version {FORMAT_VERSION + 1}"):
        shard.load_dequeue_checkpoint()


def test_an_older_epoch_cannot_overwrite_a_newer_one(open_shard: OpenShard) -> None:
    shard = open_shard()
    shard.save_enqueue_checkpoint(ENQ)
    with pytest.raises(FencedError, match="epoch 4"):
        shard.save_enqueue_checkpoint(EnqueueCheckpoint(7040, 1, {}, epoch=3))
    shard.save_enqueue_checkpoint(EnqueueCheckpoint(7040, 1, {}, epoch=5))
    assert shard.load_enqueue_checkpoint() == EnqueueCheckpoint(7040, 1, {}, 5)


def test_a_newer_epoch_another_process_saved_is_seen_after_our_own_save(open_shard: OpenShard) -> None:
    """A newer epoch another process saved fences our next save, and readers take its file."""
    import subprocess
    import sys

    shard = open_shard()
    shard.save_enqueue_checkpoint(ENQ)  # epoch 4
    shard.save_enqueue_checkpoint(EnqueueCheckpoint(7040, 1, {}, epoch=4))  # our own file: no read needed
    path = os.path.join(shard.directory, "enqueue.ckpt")
    newer = "EnqueueCheckpoint(flushed_pos=7040, write_ms=2, next_offsets={}, epoch=9)"
    subprocess.run([sys.executable, "-c", "from timerwheel.store.checkpoint import EnqueueCheckpoint, save_enqueue;"
                    f"save_enqueue({path!r}, {newer}, fsync=False)"], check=True)
    with pytest.raises(FencedError, match="epoch 9"):
        shard.save_enqueue_checkpoint(EnqueueCheckpoint(7040, 3, {}, epoch=4))
    loaded = shard.load_enqueue_checkpoint()
    assert loaded is not None and loaded.epoch == 9 and loaded.write_ms == 2


def test_load_rereads_the_file_that_another_process_publishes(open_shard: OpenShard) -> None:
    writer = open_shard()
    reader = open_shard(writer=False)
    assert reader.load_enqueue_checkpoint() is None
    writer.save_enqueue_checkpoint(ENQ)
    assert reader.load_enqueue_checkpoint() == ENQ
    writer.save_enqueue_checkpoint(EnqueueCheckpoint(12_800, 2, {0: 30}, 4))
    loaded = reader.load_enqueue_checkpoint()
    assert loaded is not None and loaded.flushed_pos == 12_800


def test_the_file_is_versioned_json_with_a_crc_named_by_its_epoch(tmp_path: Path) -> None:
    path = str(tmp_path / "enqueue.ckpt")
    ckpt_module.save_enqueue(path, ENQ)
    assert os.listdir(tmp_path) == ["enqueue.00000000000000000004.ckpt"]
    body = json.loads(Path(ckpt_module.epoch_file(path, 4)).read_text())
    assert body["version"] == FORMAT_VERSION and body["kind"] == "enqueue" and isinstance(body["crc32"], int)
    assert body["next_offsets"] == {"0": 17, "3": 2}


def test_a_flushed_position_that_is_not_a_record_boundary_is_refused(open_shard: OpenShard) -> None:
    shard = open_shard()
    with pytest.raises(ValueError, match="not a TimerLog position"):
        shard.save_enqueue_checkpoint(EnqueueCheckpoint(100, 0, {}, 1))
    ckpt_module.save_enqueue(os.path.join(shard.directory, "enqueue.ckpt"), ENQ)
    path = Path(ckpt_module.epoch_file(os.path.join(shard.directory, "enqueue.ckpt"), ENQ.epoch))
    body = json.loads(path.read_text())
    body["flushed_pos"] = 100
    del body["crc32"]
    path.write_bytes(ckpt_module.encode("enqueue", {k: v for k, v in body.items() if k != "kind"}))
    with pytest.raises(CorruptCheckpointError, match="not a TimerLog position"):
        shard.load_enqueue_checkpoint()


def test_a_superseded_owner_s_late_save_is_never_what_readers_load(open_shard: OpenShard) -> None:
    """The older owner's save lands in its own file, raises FencedError, and readers keep the
    newer epoch's checkpoint."""
    shard = open_shard()
    path = os.path.join(shard.directory, "enqueue.ckpt")
    ckpt_module.save_enqueue(path, EnqueueCheckpoint(640, 1, {}, epoch=1))
    ckpt_module.save_enqueue(path, EnqueueCheckpoint(1280, 2, {}, epoch=2))
    assert not os.path.exists(ckpt_module.epoch_file(path, 1)), "the newer owner removes older files"
    # The old owner passed its check before the new owner saved, and writes now (the race).
    atomic_write(ckpt_module.epoch_file(path, 1),
                 ckpt_module.encode("enqueue", {"version": FORMAT_VERSION, "flushed_pos": 64,
                                                "write_ms": 9, "next_offsets": {}, "epoch": 1}))
    assert shard.load_enqueue_checkpoint() == EnqueueCheckpoint(1280, 2, {}, 2)
    with pytest.raises(FencedError, match="epoch 2"):
        ckpt_module.save_enqueue(path, EnqueueCheckpoint(64, 10, {}, epoch=1))
    assert shard.load_enqueue_checkpoint() == EnqueueCheckpoint(1280, 2, {}, 2)


def test_state_files_are_not_readable_by_the_world(open_shard: OpenShard) -> None:
    """Checkpoints, the wheel, meta.json, the lock and the TimerLog segments: mode 0640 at most."""
    from .conftest import rec

    old_umask = os.umask(0o002)  # a permissive umask must not widen what the store asks for
    try:
        shard = open_shard()
        shard.append([rec(1_000), rec(2_000)])
        shard.save_enqueue_checkpoint(EnqueueCheckpoint(shard.flush(), 1, {0: 3}, 1))
        shard.save_dequeue_checkpoint(DequeueCheckpoint(read_ms=0, epoch=1))
    finally:
        os.umask(old_umask)
    files = [p for p in Path(shard.directory).rglob("*") if p.is_file()]
    assert {p.suffix for p in files} >= {".ckpt", ".json", ".tlog", ".lock"}
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files if p.stat().st_mode & 0o007} == {}


def test_opening_the_writer_leaves_the_dequeue_owners_fresh_temp_and_removes_an_old_one(
    open_shard: OpenShard,
) -> None:
    """The dequeue checkpoint is dequeue-get's: enqueue-put's writer, opening the shard while
    dequeue-get is between writing its temp and renaming it, must not delete that temp (a CI run
    saw the rename fail with ENOENT and dequeue-get exit). One a crash left long ago goes."""
    from timerwheel.files import temp_path

    shard = open_shard()
    shard.close()
    target = os.path.join(shard.directory, "dequeue.00000000000000000002.ckpt")
    fresh, old = temp_path(target), temp_path(target)
    for path in (fresh, old):
        Path(path).write_bytes(b"{}")
    long_ago = os.stat(old).st_mtime - ckpt_module.FOREIGN_TEMP_GRACE_S - 1
    os.utime(old, (long_ago, long_ago))
    enqueue_temp = temp_path(os.path.join(shard.directory, "enqueue.ckpt"))
    Path(enqueue_temp).write_bytes(b"{}")
    reopened = open_shard()
    assert [n for n in os.listdir(reopened.directory) if ".tmp-" in n] == [os.path.basename(fresh)]
    os.replace(fresh, target)  # the dequeue owner's rename still works


def test_temp_file_names_differ_between_processes_that_share_a_pid(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """Every container's process is pid 1: a temp name must not be the pid alone, or two pods
    on two nodes writing the same checkpoint name through a shared volume would share a temp."""
    from timerwheel.files import temp_path

    monkeypatch.setattr(os, "getpid", lambda: 1)
    names = {temp_path(tmp_path / "dequeue.ckpt") for _ in range(50)}
    assert len(names) == 50
    assert all(n.startswith(f"{tmp_path / 'dequeue.ckpt'}.tmp-") and "-1-" in n for n in names)
