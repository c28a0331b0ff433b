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

Readers use them where a stale view would be taken for a fact (checkpoints, the wheel header,
the TimerLog tail up to the published flushed position), and cached reads elsewhere, checked
against what these established. Only on a file system another node can write, though: on a
local one (ext4, xfs, tmpfs, overlay, ...) this node's page cache is the only copy, a cached
read is always fresh, and an uncached one costs a disk read (measured: ~1 ms per 4 KiB read
with O_DIRECT against ~60 us for a checkpoint read through the cache). ``is_shared`` tells the
two apart by the file system type in /proc/self/mountinfo; a type it does not know counts as
shared (the safe side).
"""

from __future__ import annotations

import errno
import functools
import mmap
import os

#: O_DIRECT wants offsets, lengths and buffers aligned to the logical block size; a page is safe.
ALIGN = 4096
#: File systems only this node writes: its page cache is coherent with what they hold.
LOCAL_FS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "ramfs", "overlay", "zfs", "f2fs", "jfs",
                      "bcachefs", "reiserfs", "squashfs", "iso9660", "vfat", "exfat"})


@functools.lru_cache(maxsize=64)
def _fs_type(dev: int) -> str | None:
    """The type of the file system of device ``dev`` (st_dev), from /proc/self/mountinfo."""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and fields[2] == want and "-" in fields:
                    return fields[fields.index("-") + 1]
    except OSError:
        return None
    return None


def shared_dev(dev: int) -> bool:
    """True unless device ``dev`` holds a local file system (see LOCAL_FS)."""
    return _fs_type(dev) not in LOCAL_FS


@functools.lru_cache(maxsize=1024)
def _shared_dir(directory: str) -> bool:
    return shared_dev(os.stat(directory).st_dev)


def is_shared(path: str) -> bool:
    """Whether another node may write the file system holding ``path`` (an existing file or
    directory's parent): then reads that must be fresh go past the page cache."""
    return _shared_dir(os.path.dirname(os.path.abspath(path)) or "/")


def _aligned(offset: int, length: int) -> tuple[int, int]:
    start = offset - offset % ALIGN
    return start, -(-(offset + length - start) // ALIGN) * ALIGN


def pread_fresh(path: str, offset: int, length: int) -> bytes:
    """Up to ``length`` bytes of ``path`` at ``offset`` as the file system holds them now (short
    at the end of the file). FileNotFoundError if there is no such file. Opens the file: for
    files replaced by rename (checkpoints); see ``DirectFile`` for the others."""
    if length <= 0:
        return b""
    if not is_shared(path):
        return _pread(path, offset, length, drop=False)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return _pread(path, offset, length, drop=True)
    try:
        start, size = _aligned(offset, length)
        buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
        try:
            try:
                got = os.preadv(fd, [buf], start)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                return _pread(path, offset, length, drop=True)
            lo = offset - start
            return bytes(buf[lo : max(lo, min(got, lo + length))])
        finally:
            buf.close()
    finally:
        os.close(fd)


class DirectFile:
    """A file kept open for fresh reads (``pread``), for files that are appended to or written
    in place rather than replaced (TimerLog segments, the wheel header).

    Kept open, not re-opened per read: a re-open through a FUSE ``auto_cache`` mount drops the
    whole file's cached pages whenever its time stamp moved, the writer's too when it writes
    through the same mount (measured: lateness p99 went from ~0.6 s to 5 s with every stage on
    one bindfs mount). An ``O_DIRECT`` read on a kept descriptor reads fresh bytes; past the size
    the client remembers it comes back short until an ``fstat`` refreshes that size, so a short
    read is retried once after one."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.shared = is_shared(path)
        self.direct = False
        if self.shared:
            try:
                self._fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                self.direct = True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        if not self.direct:
            self._fd = os.open(path, os.O_RDONLY)

    def pread(self, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes at ``offset`` as the file system holds them now."""
        if length <= 0:
            return b""
        if not self.direct:
            if self.shared:
                os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_DONTNEED)
            return _pread_fd(self._fd, offset, length)
        start, size = _aligned(offset, length)
        buf = mmap.mmap(-1, size)
        try:
            lo = offset - start
            got = os.preadv(self._fd, [buf], start)
            if got < lo + length:
                os.fstat(self._fd)  # refreshes the size a FUSE / NFS client remembers
                got = os.preadv(self._fd, [buf], start)
            return bytes(buf[lo : max(lo, min(got, lo + length))])
        finally:
            buf.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _pread_fd(fd: int, offset: int, length: int) -> bytes:
    out = bytearray()
    while len(out) < length:
        chunk = os.pread(fd, length - len(out), offset + len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def _pread(path: str, offset: int, length: int, drop: bool) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        if drop:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        return _pread_fd(fd, offset, length)
    finally:
        os.close(fd)


def read_fresh(path: str, limit: int = 1 << 24) -> bytes:
    """The whole (small) file ``path`` as the file system holds it now."""
    size = ALIGN
    while True:
        data = pread_fresh(path, 0, size)
        if len(data) < size:
            return data
        if size >= limit:
            raise ValueError(f"{path} is larger than {limit} bytes")
        size *= 4


def drop_cached(fd: int, offset: int = 0, length: int = 0) -> None:
    """Forget this node's clean cached pages of a range (0 length: to the end), so the next
    cached read or mapping fault fetches them again. Pages mapped by a process stay. Nothing
    to do on a local file system (the cache is the truth there)."""
    if shared_dev(os.fstat(fd).st_dev):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
