"""The local log's redo journal: ``LocalCommitLog.append_atomic`` writes a batch all or nothing.

A batch that spans partitions (exactly-once: a shard's deliveries, roll hops, holds and dead
letters with their progress record, design precision-and-exactly-once.md 7.1 "Embedded") is
written in three steps, under the journal's lock and then every partition's lock:

1. the journal: ``<log dir>/@journal``, each partition's records as encoded frame bodies with the
   offset the partition's tail had (read under its lock), behind a header with the payload's
   length and CRC-32; one ``fdatasync`` (the file is kept and emptied, not deleted, so no
   directory sync);
2. the partitions (``PartitionLog.write``), each ``fdatasync``'ed;
3. the journal emptied (not synced: a stale complete journal is re-applied as a no-op, below).

Recovery (``Journal.recover``, run when a log is opened, before each ``append_atomic`` and at an
exactly-once take): a torn journal (short, or its CRC does not match: the crash came in step 1)
is dropped, and nothing of its batch reached a partition. A complete one is re-applied: for each
partition, the records already at its named offset that equal the journal's (step 2 got that far)
stay, the rest are appended. So the batch ends up in its partitions once whatever step a crash
hit. The design said "truncating its partitions to the offsets it names"; as built nothing
complete is cut: a torn tail is cut by the partition's own recovery, and a record another process
(a client) appended after the crash keeps its place, the batch's remainder going after it.

The journal's lock (``@journal.lock``, a flock plus a thread lock) makes one writer or recoverer
at a time across processes, so a recoverer never reads a journal a live writer is still writing;
a killed writer's flock goes with it. Lock order: the journal's, then the partitions' (sorted).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgpack

from timerwheel.files import FILE_MODE, fsync_dir, pwrite_all

__all__ = ["JOURNAL_FILE", "Journal", "JournalEntry"]

JOURNAL_FILE = "@journal"
#: magic, CRC-32 of the payload, payload length.
HEADER = struct.Struct("<4sIQ")
MAGIC = b"TWJ1"

#: One partition's part of a batch: topic, partition, the offset its first record takes, and the
#: records' frame bodies (crc, body) as ``frames.encode_bodies`` made them.
JournalEntry = tuple[str, int, int, list[tuple[int, bytes]]]


class Journal:
    """The journal file of one log directory (module header)."""

    def __init__(self, directory: Path, *, fsync: bool) -> None:
        self.path = directory / JOURNAL_FILE
        self._lock_path = directory / f"{JOURNAL_FILE}.lock"
        self._fsync = fsync
        self._thread_lock = threading.Lock()
        self._fd: int | None = None
        self._lock_fd: int | None = None

    def pending(self) -> bool:
        """Something is in the journal (one stat): ``recover`` has work, or a live writer is in it."""
        try:
            return self.path.stat().st_size > 0
        except FileNotFoundError:
            return False

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The journal's lock, for one writer or recoverer in any thread of any process."""
        with self._thread_lock:
            if self._lock_fd is None:
                self._lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, FILE_MODE)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _file(self) -> int:
        if self._fd is None:
            created = not self.path.exists()
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, FILE_MODE)
            if created and self._fsync:
                fsync_dir(self.path.parent)
        return self._fd

    def write(self, entries: Sequence[JournalEntry]) -> None:
        """Step 1: the batch, complete and synced once this returns. Lock held."""
        payload = msgpack.packb([[t, p, o, [[crc, body] for crc, body in bodies]] for t, p, o, bodies in entries],
                                use_bin_type=True)
        fd = self._file()
        pwrite_all(fd, memoryview(HEADER.pack(MAGIC, zlib.crc32(payload), len(payload)) + payload), 0)
        os.ftruncate(fd, HEADER.size + len(payload))
        if self._fsync:
            os.fdatasync(fd)

    def read(self) -> list[JournalEntry] | None:
        """The complete journal's batch; None when empty or torn. Lock held."""
        raw = self.path.read_bytes() if self.path.exists() else b""
        if len(raw) < HEADER.size:
            return None
        magic, crc, size = HEADER.unpack_from(raw)
        payload = raw[HEADER.size:]
        if magic != MAGIC or size != len(payload) or zlib.crc32(payload) != crc:
            return None
        body: Any = msgpack.unpackb(payload, raw=False, use_list=True)
        return [(t, p, o, [(crc, bytes(b)) for crc, b in bodies]) for t, p, o, bodies in body]

    def clear(self) -> None:
        """Step 3 (and a torn journal dropped): emptied, not synced. Lock held."""
        os.ftruncate(self._file(), 0)

    def close(self) -> None:
        for fd in (self._fd, self._lock_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._lock_fd = None
