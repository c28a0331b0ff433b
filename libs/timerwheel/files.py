"""Small file helpers every state file of the store uses: atomic replace and directory fsync.

State files (checkpoints, the wheel, meta and settings files, locks, TimerLog segments) are
created with ``FILE_MODE`` (0640: owner and group, never the world). A temp file's name carries
the host name, the pid and a random part (``temp_path``): in containers every process is pid 1,
and two pods on two nodes may share the volume.
"""

from __future__ import annotations

import os
import secrets
import socket

#: Mode of every file timerwheel creates on the data volume (before the umask).
FILE_MODE = 0o640


def temp_path(path: str | os.PathLike[str]) -> str:
    """A temp file next to ``path`` whose name no other process, on this host or another, uses:
    ``<path>.tmp-<host>-<pid>-<random>`` (``.tmp-`` is what stale-temp cleanup looks for)."""
    host = "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname())[:64] or "host"
    return f"{os.fspath(path)}.tmp-{host}-{os.getpid()}-{secrets.token_hex(4)}"


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a directory's entries (created, renamed, deleted files) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes | memoryview, fsync: bool = True) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves either the old or the new file.

    Write a temp file next to it, fsync it, rename it over ``path``, fsync the directory. A crash
    before the rename leaves the old file (and a stray temp file, ignored by readers).
    """
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if fsync:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """os.pwrite until every byte is written (a regular file may take a short write)."""
    while data:
        written = os.pwrite(fd, data, offset)
        data = data[written:]
        offset += written
