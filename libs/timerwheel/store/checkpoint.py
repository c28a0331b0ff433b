"""Checkpoints: the small state files through which a shard's owners publish their progress.

``enqueue.ckpt`` (written only by the shard's enqueue-put owner) holds the TimerLog flushed
position, the write watermark W, the next source offset per timer-topic partition and the owner
epoch. ``dequeue.ckpt`` (only the dequeue-get owner) holds the read time R and the owner epoch,
and, written by an owner that let the shard go, its read-ahead (``carry``, ``ReadAhead``).

Format: one JSON object, UTF-8, with ``kind``, ``version`` (FORMAT_VERSION), the fields, and
``crc32``: the zlib CRC-32 of the same object without ``crc32``, serialised with sorted keys and no
spaces. Written atomically (temp file, fsync, rename, directory fsync): a crash leaves the old
file or the new one, never a mix. Loading re-reads the file every time (other processes publish
through it) and checks kind, CRC and version.

Each owner saves into a file named by its epoch (``enqueue.<epoch, 20 digits>.ckpt``) and readers
take the newest epoch's file: no save can replace a newer owner's checkpoint, even from another
node where file locks do not reach (``_save``). ``enqueue.ckpt`` is the checkpoint's name, never a
file. Loads read past this node's page cache (``fresh.read_fresh``): on a shared volume another
node's save is otherwise seen late, or cut at the size this node remembers.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import zlib
from dataclasses import dataclass
from typing import Any

from timerwheel.errors import FencedError, FormatMismatchError, TimerwheelError
from timerwheel.files import atomic_write
from timerwheel.store.format import FORMAT_VERSION, RECORD_SIZE
from timerwheel.store.fresh import read_fresh


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
class CarriedSlot:
    """A slot read ahead (open: records may still be written into it) whose every message sent is
    done: its records below ``read_pos`` are read, and what that read remembered (the cancel
    markers by id hash, those some message matched, the first copy of each message) so that its
    next records are read as the same owner would have."""

    slot_ms: int
    read_pos: int
    #: id hash -> [(source partition, offset)] of each cancel marker read in the slot.
    markers: dict[int, list[tuple[int, int]]]
    matched: frozenset[int]
    #: ``dequeue_get.Seen`` (None: too many messages to tell copies apart).
    seen: dict[int, int] | None


@dataclass(frozen=True, slots=True)
class ReadAhead:
    """What a dequeue-get owner that let a shard go had read ahead, for the next one: every slot
    in ``[R, cursor_ms)`` not in ``slots`` is delivered; ``slots`` are read up to their
    ``read_pos``. Valid only at ``tick_ms`` (a window change's rebuilt wheel drops it)."""

    tick_ms: int
    cursor_ms: int
    slots: tuple[CarriedSlot, ...]


@dataclass(frozen=True, slots=True)
class DequeueCheckpoint:
    """dequeue-get's progress: every slot before R = ``read_ms`` is delivered; ``carry``, what an
    owner that let the shard go had read ahead beyond R (None: read again from R)."""

    read_ms: int
    epoch: int
    version: int = FORMAT_VERSION
    carry: ReadAhead | None = None


def encode(kind: str, body: dict[str, Any]) -> bytes:
    """The bytes of a checkpoint file of ``kind`` holding the fields ``body`` (``kind`` and the CRC
    added), as the saves write them; no field is checked."""
    body = {"kind": kind, **body}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return json.dumps({**body, "crc32": zlib.crc32(canonical.encode())}, sort_keys=True).encode() + b"\n"


def _decode(path: str, kind: str) -> dict[str, Any]:
    """The fields of the checkpoint file ``path`` (FileNotFoundError if it is gone)."""
    raw = read_fresh(path)  # another node may have written it: not this node's cached copy
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


def epoch_file(path: str, epoch: int) -> str:
    """The file an owner of ``epoch`` saves the checkpoint ``path`` names: ``enqueue.ckpt`` ->
    ``enqueue.00000000000000000007.ckpt``."""
    head, name = os.path.split(path)
    stem = name[: -len(".ckpt")] if name.endswith(".ckpt") else name
    return os.path.join(head, f"{stem}.{epoch:020d}.ckpt")


def _epoch_files(path: str) -> list[tuple[int, str]]:
    """(epoch, file) of every epoch-named file of checkpoint ``path``, newest epoch first."""
    head, name = os.path.split(path)
    stem = name[: -len(".ckpt")] if name.endswith(".ckpt") else name
    pattern = re.compile(re.escape(stem) + r"\.(\d{20})\.ckpt$")
    try:
        names = os.listdir(head or ".")
    except FileNotFoundError:
        return []
    return sorted(((int(m.group(1)), os.path.join(head, n)) for n in names if (m := pattern.match(n))), reverse=True)


def published_file(path: str) -> str | None:
    """The file that holds checkpoint ``path`` now: the newest epoch's, or None."""
    named = _epoch_files(path)
    return named[0][1] if named else None


def highest_epoch(directory: str) -> int:
    """The highest owner epoch any checkpoint file in ``directory`` is named by (0 if none), a file
    set aside (``<file>.corrupt``) or a temp file left by a crash included."""
    named = (re.match(r"(?:enqueue|dequeue)\.(\d{20})\.ckpt", n) for n in os.listdir(directory))
    return max((int(m.group(1)) for m in named if m), default=0)


#: How long a reader keeps reading the checkpoint file it found before it lists the directory
#: again for a newer epoch's (``LoadMemo``).
LIST_EVERY_S = 1.0

#: One reader's memory of where each checkpoint was: path -> (the file, when it was listed).
LoadMemo = dict[str, tuple[str, float]]


def _load(path: str, kind: str, memo: LoadMemo | None = None) -> dict[str, Any] | None:
    """The newest epoch's checkpoint, read past this node's cache; a file removed between the
    listing and the read (its owner was superseded meanwhile) is looked up again.

    With a ``memo``, the file found is read again without a listing for LIST_EVERY_S: a listing
    and an open are each a round trip on NFS or FUSE, and readers poll every few milliseconds.
    A newer owner's file is then seen up to LIST_EVERY_S late (the reader sees no progress
    meanwhile, never an older epoch than it saw), or at once when it removed the file read."""
    if memo is not None:
        known = memo.get(path)
        if known is not None and time.monotonic() - known[1] < LIST_EVERY_S:
            try:
                return _decode(known[0], kind)
            except FileNotFoundError:
                pass
    for _attempt in range(5):
        named = _epoch_files(path)
        if not named:
            return None
        try:
            body = _decode(named[0][1], kind)
        except FileNotFoundError:
            continue
        if memo is not None:
            memo[path] = (named[0][1], time.monotonic())
        return body
    return None


def _save(path: str, kind: str, data: bytes, epoch: int, fsync: bool) -> None:
    """Write this owner's own file, then check no newer owner has one, then remove older ones.

    Each epoch writes only the file named by its epoch (one owner per epoch), so no save can
    replace another owner's checkpoint, whatever node it runs on and whenever it was paused:
    file locks do not reach across NFS clients, and reading the epoch before a rename leaves a
    window for the other owner. Readers take the newest epoch's file. The save of a superseded
    owner lands in a file no reader takes, and raises FencedError so that its owner stops. One
    directory listing per save: on NFS or FUSE each file-system call is a round trip.
    """
    mine = epoch_file(path, epoch)
    atomic_write(mine, data, fsync)
    found = _epoch_files(path)
    newer = [e for e, _f in found if e > epoch]
    if newer:
        # Our file is older than one already there: no reader takes it, its successor removes it.
        raise FencedError(f"{kind} checkpoint {path} holds epoch {max(newer)}, newer than this owner's epoch {epoch}")
    for e, old in found:
        if e < epoch:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(old)


def save_enqueue(path: str, ckpt: EnqueueCheckpoint, fsync: bool = True) -> None:
    """Save ``ckpt`` atomically in this epoch's file (``_save``)."""
    if ckpt.flushed_pos < 0 or ckpt.flushed_pos % RECORD_SIZE:
        raise ValueError(f"enqueue checkpoint flushed_pos {ckpt.flushed_pos} is not a TimerLog position")
    body = {
        "version": ckpt.version,
        "flushed_pos": ckpt.flushed_pos,
        "write_ms": ckpt.write_ms,
        "next_offsets": {str(p): o for p, o in sorted(ckpt.next_offsets.items())},
        "epoch": ckpt.epoch,
    }
    _save(path, "enqueue", encode("enqueue", body), ckpt.epoch, fsync)


def load_enqueue(path: str, memo: LoadMemo | None = None) -> EnqueueCheckpoint | None:
    """The published enqueue checkpoint (newest epoch), read fresh, or None (``memo``: see _load)."""
    body = _load(path, "enqueue", memo)
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


def save_dequeue(path: str, ckpt: DequeueCheckpoint, fsync: bool = True) -> None:
    """Save ``ckpt`` atomically in this epoch's file (``_save``)."""
    body: dict[str, Any] = {"version": ckpt.version, "read_ms": ckpt.read_ms, "epoch": ckpt.epoch}
    if ckpt.carry is not None:
        body["carry"] = _carry_body(ckpt.carry)
    _save(path, "dequeue", encode("dequeue", body), ckpt.epoch, fsync)


def _carry_body(carry: ReadAhead) -> dict[str, Any]:
    return {"tick_ms": carry.tick_ms, "cursor_ms": carry.cursor_ms, "slots": [
        {"slot_ms": c.slot_ms, "read_pos": c.read_pos,
         "markers": [[h, [list(ref) for ref in refs]] for h, refs in sorted(c.markers.items())],
         "matched": sorted(c.matched), "seen": None if c.seen is None else sorted(map(list, c.seen.items()))}
        for c in carry.slots]}


def _carry(path: str, body: Any) -> ReadAhead:
    """The ``carry`` field's value (CorruptCheckpointError naming what is wrong)."""
    def num(value: Any) -> int:
        if type(value) is not int:
            raise ValueError(f"{value!r} is not an integer")
        return value

    def pair(value: Any) -> tuple[int, int]:
        first, second = value
        return num(first), num(second)

    try:
        slots = tuple(CarriedSlot(
            slot_ms=num(c["slot_ms"]), read_pos=num(c["read_pos"]),
            markers={num(h): [pair(ref) for ref in refs] for h, refs in c["markers"]},
            matched=frozenset(map(num, c["matched"])),
            seen=None if c["seen"] is None else dict(map(pair, c["seen"])),
        ) for c in body["slots"])
        return ReadAhead(tick_ms=num(body["tick_ms"]), cursor_ms=num(body["cursor_ms"]), slots=slots)
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"checkpoint {path}: bad carry: {exc!r}") from None


def load_dequeue(path: str, memo: LoadMemo | None = None) -> DequeueCheckpoint | None:
    """The published dequeue checkpoint (newest epoch), read fresh, or None (``memo``: see _load)."""
    body = _load(path, "dequeue", memo)
    if body is None:
        return None
    carry = body.get("carry")
    return DequeueCheckpoint(
        read_ms=_int(path, body, "read_ms"), epoch=_int(path, body, "epoch"), version=_int(path, body, "version"),
        carry=None if carry is None else _carry(path, carry),
    )


#: A temp file of a state file this process does not own is stale once it is this old: another
#: process (the dequeue owner beside enqueue-put's writer) holds one for milliseconds, between its
#: write and its rename, and deleting it there would fail that rename.
FOREIGN_TEMP_GRACE_S = 600.0


def remove_stale_temps(directory: str, names: tuple[str, ...], foreign: tuple[str, ...] = (),
                       grace_s: float = FOREIGN_TEMP_GRACE_S) -> None:
    """Delete temp files a crash left between write and rename: those of the files ``names`` (the
    caller owns them, so any temp of theirs is stale) and those of ``foreign`` (files another live
    process may be replacing right now) once older than ``grace_s``. A checkpoint name covers its
    epoch-named files too."""
    def stem(name: str) -> str:
        return name[: -len(".ckpt")] + "."

    def covers(target: str, group: tuple[str, ...]) -> bool:
        return target in group or (target.endswith(".ckpt") and target.startswith(
            tuple(stem(n) for n in group if n.endswith(".ckpt"))))

    now = time.time()
    for name in os.listdir(directory):
        if ".tmp-" not in name:
            continue
        target, path = name.split(".tmp-", 1)[0], os.path.join(directory, name)
        with contextlib.suppress(FileNotFoundError):
            if covers(target, names) or (covers(target, foreign) and now - os.stat(path).st_mtime > grace_s):
                os.unlink(path)
