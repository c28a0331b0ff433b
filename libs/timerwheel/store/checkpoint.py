"""Checkpoints: the small state files through which a shard's owners publish their progress.

``enqueue.ckpt`` (written only by the shard's enqueue-put owner) holds the TimerLog flushed
position, the write watermark W, the next source offset per timer-topic partition and the owner
epoch. ``dequeue.ckpt`` (only the dequeue-get owner) holds the read time R and the owner epoch.

Format: one JSON object, UTF-8, with ``kind``, ``version`` (FORMAT_VERSION), the fields, and
``crc32``: the zlib CRC-32 of the same object without ``crc32``, serialised with sorted keys and no
spaces. Written atomically (temp file, fsync, rename, directory fsync): a crash leaves the old
file or the new one, never a mix. Loading re-reads the file every time (other processes publish
through it) and checks kind, CRC and version.

A save never moves a file back to an older owner: if the file holds a newer epoch than the one
being saved, the save raises FencedError (a cheap guard; the operator's epochs are the fence).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import zlib
from dataclasses import dataclass
from typing import Any

from timerwheel.config import RECORD_SIZE
from timerwheel.errors import FencedError, FormatMismatchError, TimerwheelError
from timerwheel.files import atomic_write
from timerwheel.store.format import FORMAT_VERSION

log = logging.getLogger(__name__)


class CorruptCheckpointError(TimerwheelError):
    """A checkpoint file exists but cannot be read (bad JSON, CRC or field)."""


@dataclass(frozen=True, slots=True)
class EnqueueCheckpoint:
    """enqueue-put's progress: TimerLog flushed to ``flushed_pos``, W = ``write_ms``."""

    flushed_pos: int
    write_ms: int
    next_offsets: dict[int, int]
    epoch: int
    version: int = FORMAT_VERSION


@dataclass(frozen=True, slots=True)
class DequeueCheckpoint:
    """dequeue-get's progress: every slot before R = ``read_ms`` is delivered."""

    read_ms: int
    epoch: int
    version: int = FORMAT_VERSION


def _encode(kind: str, body: dict[str, Any]) -> bytes:
    body = {"kind": kind, **body}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return json.dumps({**body, "crc32": zlib.crc32(canonical.encode())}, sort_keys=True).encode() + b"\n"


def _decode(path: str, kind: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise ValueError("not a JSON object")
        crc = body.pop("crc32")
    except (ValueError, KeyError) as exc:
        raise CorruptCheckpointError(f"checkpoint {path} is unreadable: {exc}") from None
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    if crc != zlib.crc32(canonical.encode()):
        raise CorruptCheckpointError(f"checkpoint {path} fails its CRC")
    if body.get("kind") != kind:
        raise CorruptCheckpointError(f"checkpoint {path} is a {body.get('kind')!r} checkpoint, expected {kind!r}")
    if body.get("version") != FORMAT_VERSION:
        raise FormatMismatchError(
            f"checkpoint {path} has format version {body.get('version')}, this build reads version {FORMAT_VERSION}"
        )
    return body


def _int(path: str, body: dict[str, Any], name: str) -> int:
    value = body.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise CorruptCheckpointError(f"checkpoint {path}: field {name} is {value!r}, expected an integer")
    return value


#: What a writer remembers of its own saves: path -> (the identity of the file it last saved
#: there, the epoch it saved). While the file is still that one (no other owner replaced it),
#: the epoch check needs no read.
SaveMemo = dict[str, tuple[tuple[int, int, int, int], int]]


def _identity(path: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


def _save(path: str, data: bytes, epoch: int, fsync: bool, memo: SaveMemo | None) -> None:
    atomic_write(path, data, fsync)
    if memo is not None:
        identity = _identity(path)
        if identity is not None:
            memo[path] = (identity, epoch)


def _check_epoch(path: str, kind: str, epoch: int, memo: SaveMemo | None) -> None:
    mine = memo.get(path) if memo is not None else None
    if mine is not None and mine[0] == _identity(path):
        if mine[1] > epoch:
            raise FencedError(f"{kind} checkpoint {path} holds epoch {mine[1]}, newer than this owner's epoch {epoch}")
        return  # the file is still the one this writer saved: no other owner wrote since
    try:
        body = _decode(path, kind)
    except TimerwheelError as exc:
        log.warning("replacing an unreadable %s checkpoint: %s", kind, exc)
        return
    if body is not None and isinstance(body.get("epoch"), int) and body["epoch"] > epoch:
        raise FencedError(f"{kind} checkpoint {path} holds epoch {body['epoch']}, newer than this owner's epoch {epoch}")


def save_enqueue(path: str, ckpt: EnqueueCheckpoint, fsync: bool = True, memo: SaveMemo | None = None) -> None:
    """Save ``ckpt`` atomically; ``memo`` (one per writer) spares re-reading a file it saved itself."""
    if ckpt.flushed_pos < 0 or ckpt.flushed_pos % RECORD_SIZE:
        raise ValueError(f"enqueue checkpoint flushed_pos {ckpt.flushed_pos} is not a TimerLog position")
    _check_epoch(path, "enqueue", ckpt.epoch, memo)
    body = {
        "version": ckpt.version,
        "flushed_pos": ckpt.flushed_pos,
        "write_ms": ckpt.write_ms,
        "next_offsets": {str(p): o for p, o in sorted(ckpt.next_offsets.items())},
        "epoch": ckpt.epoch,
    }
    _save(path, _encode("enqueue", body), ckpt.epoch, fsync, memo)


def load_enqueue(path: str) -> EnqueueCheckpoint | None:
    body = _decode(path, "enqueue")
    if body is None:
        return None
    offsets = body.get("next_offsets")
    if not isinstance(offsets, dict):
        raise CorruptCheckpointError(f"checkpoint {path}: next_offsets is {offsets!r}, expected an object")
    try:
        next_offsets = {int(p): int(o) for p, o in offsets.items()}
    except (TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"checkpoint {path}: bad next_offsets: {exc}") from None
    flushed_pos = _int(path, body, "flushed_pos")
    if flushed_pos < 0 or flushed_pos % RECORD_SIZE:
        raise CorruptCheckpointError(f"checkpoint {path}: flushed_pos {flushed_pos} is not a TimerLog position")
    return EnqueueCheckpoint(
        flushed_pos=flushed_pos,
        write_ms=_int(path, body, "write_ms"),
        next_offsets=next_offsets,
        epoch=_int(path, body, "epoch"),
        version=_int(path, body, "version"),
    )


def save_dequeue(path: str, ckpt: DequeueCheckpoint, fsync: bool = True, memo: SaveMemo | None = None) -> None:
    _check_epoch(path, "dequeue", ckpt.epoch, memo)
    body = {"version": ckpt.version, "read_ms": ckpt.read_ms, "epoch": ckpt.epoch}
    _save(path, _encode("dequeue", body), ckpt.epoch, fsync, memo)


def load_dequeue(path: str) -> DequeueCheckpoint | None:
    body = _decode(path, "dequeue")
    if body is None:
        return None
    return DequeueCheckpoint(
        read_ms=_int(path, body, "read_ms"), epoch=_int(path, body, "epoch"), version=_int(path, body, "version")
    )


def remove_stale_temps(directory: str, names: tuple[str, ...]) -> None:
    """Delete temp files a crash left between write and rename, for the files named (their owner only)."""
    for name in os.listdir(directory):
        if ".tmp-" in name and name.split(".tmp-", 1)[0] in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
