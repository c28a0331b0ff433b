"""Small file helpers every state file of the store uses: atomic replace and directory fsync."""

from __future__ import annotations

import os


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a directory's entries (created, renamed, deleted files) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes, fsync: bool = True) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves either the old or the new file.

    Write a temp file next to it, fsync it, rename it over ``path``, fsync the directory. A crash
    before the rename leaves the old file (and a stray temp file, ignored by readers).
    """
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
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
