"""The data directory's layout: where each shard lives, finding and opening shards, the lock.

::

    <data dir>/
        timerwheel.json      the deployment file (store/deployment.py): what every shard was made with
        .lock                held by an embedded timerwheel for its life (DataDirLock)
        log/                 the embedded mode's local commit log (transports/local)
        shard-0000/          one shard: TimerLog segments, wheel, checkpoints (store/shard.py, FORMAT.md)
        shard-0001/
        ...

This module is the only place that spells ``shard-NNNN``.
"""

from __future__ import annotations

import fcntl
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from timerwheel.errors import TimerwheelError
from timerwheel.files import FILE_MODE

if TYPE_CHECKING:
    from timerwheel.config import TimerConfig
    from timerwheel.store.shard import Shard

#: A shard's directory name: ``shard-`` and its number in four digits.
_SHARD_DIR = re.compile(r"shard-(\d{4})$")
LOCK_FILE = ".lock"


def shard_dir(data_dir: str | os.PathLike[str], shard: int) -> str:
    """The directory of shard number ``shard`` under ``data_dir``."""
    return os.path.join(os.fspath(data_dir), f"shard-{shard:04d}")


def shard_number(directory: str | os.PathLike[str]) -> int | None:
    """The number of the shard whose directory is ``directory``, or None if it is not a shard's."""
    m = _SHARD_DIR.match(os.path.basename(os.path.abspath(os.fspath(directory))))
    return int(m.group(1)) if m else None


def found_shards(data_dir: str | os.PathLike[str]) -> list[int]:
    """The numbers of the shard directories in ``data_dir``, in order ([] if it does not exist)."""
    try:
        names = os.listdir(data_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(m.group(1)) for n in names if (m := _SHARD_DIR.match(n))
                  and os.path.isdir(os.path.join(data_dir, n)))


def holds_shards(data_dir: str | os.PathLike[str]) -> bool:
    """``data_dir`` holds at least one shard directory."""
    return bool(found_shards(data_dir))


def recovery_command(directory: str | os.PathLike[str]) -> str:
    """The command that repairs the shard in ``directory`` (a shard directory of a data directory)."""
    path = os.path.abspath(os.fspath(directory))
    number = shard_number(path)
    return f"timerwheel recover --shard {-1 if number is None else number} --data-dir {os.path.dirname(path)}"


def open_shard(config: TimerConfig, shard: int, writer: bool) -> Shard:
    """Open a shard as its writer (creating it with ``config``'s tick, wheel and segment size, or
    refusing one made with others; running crash recovery) or as a read-only view, which takes
    the settings the shard was made with (``open_found_shard``: a shard's meta.json is the
    authority for its tick, FORMAT.md)."""
    from timerwheel.store.shard import Shard

    if not writer:
        return open_found_shard(config.data_dir, shard, fsync=config.fsync)
    return Shard.open(shard_dir(config.data_dir, shard), tick_ms=config.tick_ms, slots=config.wheel_slots,
                      segment_bytes=config.segment_bytes, fsync=config.fsync, writer=True)


def open_reader_if_exists(config: TimerConfig, shard: int) -> Shard | None:
    """A read-only view of the shard, or None until its writer has created it."""
    from timerwheel.store.shard import WHEEL_FILE

    if not os.path.exists(os.path.join(shard_dir(config.data_dir, shard), WHEEL_FILE)):
        return None
    return open_shard(config, shard, writer=False)


def open_found_shard(data_dir: str | os.PathLike[str], shard: int, *, fsync: bool = False) -> Shard:
    """A read-only view of a shard with the settings it was written with (its meta.json)."""
    from timerwheel.store.shard import Shard, stored_settings

    directory = shard_dir(data_dir, shard)
    tick_ms, slots, segment_bytes = stored_settings(directory)
    return Shard.open(directory, tick_ms=tick_ms, slots=slots, segment_bytes=segment_bytes, fsync=fsync, writer=False)


def open_found_shards(data_dir: str | os.PathLike[str], shards: Iterable[int]) -> dict[int, Shard]:
    """``open_found_shard`` of each of ``shards``; if one fails, those opened are closed again."""
    opened: dict[int, Shard] = {}
    try:
        for s in shards:
            opened[s] = open_found_shard(data_dir, s)
    except BaseException:
        for shard in opened.values():
            shard.close()
        raise
    return opened


class DataDirLock:
    """An exclusive lock on the data directory for the life of the process: a second embedded
    timerwheel (or a repair) on the same directory is refused, and a killed one releases it at once."""

    def __init__(self, data_dir: str | os.PathLike[str]) -> None:
        self.path = Path(data_dir) / LOCK_FILE
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise TimerwheelError(
                f"data directory {os.fspath(data_dir)} is in use by another timerwheel process (pid {holder})") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
