"""Uncached reads: the bytes another node published, not what this node's page cache remembers.

A shared volume (NFS, EFS, CephFS, Azure Files; ``bindfs -o auto_cache`` in the tests) gives each
node its own page cache. A file kept open or mapped may show old bytes after another node wrote
and fsynced it, and so may a re-open within the client's attribute cache time (measured with
bindfs: a re-open within its 1 s ``attr_timeout`` still read the old bytes, and a read past the
size the client remembers came back short). Two ways past the cache, both measured fresh:

* ``O_DIRECT``: the read goes to the file system (the NFS server, the FUSE daemon), whatever
  the client caches, including bytes past its remembered size;
* where ``O_DIRECT`` is refused (tmpfs): ``posix_fadvise(DONTNEED)`` on a fresh descriptor,
  which drops the clean cached pages of the range so the read fetches them again.

On a local disk both read the same bytes as a cached read (O_DIRECT writes back dirty pages of
the range first), only slower; so readers use them where a stale view would be taken for a
fact (checkpoints, the wheel header, the TimerLog tail up to the published flushed position),
and cached reads elsewhere, checked against what these established.
"""

from __future__ import annotations

import errno
import mmap
import os

#: O_DIRECT wants offsets, lengths and buffers aligned to the logical block size; a page is safe.
ALIGN = 4096


def _aligned(offset: int, length: int) -> tuple[int, int]:
    start = offset - offset % ALIGN
    return start, -(-(offset + length - start) // ALIGN) * ALIGN


def pread_fresh(path: str, offset: int, length: int) -> bytes:
    """Up to ``length`` bytes of ``path`` at ``offset`` as the file system holds them now (short
    at the end of the file). FileNotFoundError if there is no such file."""
    if length <= 0:
        return b""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return _pread_dropped(path, offset, length)
    try:
        start, size = _aligned(offset, length)
        buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
        try:
            try:
                got = os.preadv(fd, [buf], start)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                return _pread_dropped(path, offset, length)
            lo = offset - start
            return bytes(buf[lo : max(lo, min(got, lo + length))])
        finally:
            buf.close()
    finally:
        os.close(fd)


def _pread_dropped(path: str, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        out = bytearray()
        while len(out) < length:
            chunk = os.pread(fd, length - len(out), offset + len(out))
            if not chunk:
                break
            out += chunk
        return bytes(out)
    finally:
        os.close(fd)


def read_fresh(path: str, limit: int = 1 << 20) -> bytes:
    """The whole (small) file ``path`` as the file system holds it now."""
    data = pread_fresh(path, 0, limit)
    if len(data) == limit:
        raise ValueError(f"{path} is larger than {limit} bytes")
    return data


def drop_cached(fd: int, offset: int = 0, length: int = 0) -> None:
    """Forget this node's clean cached pages of a range (0 length: to the end), so the next
    cached read or mapping fault fetches them again. Pages mapped by a process stay."""
    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
