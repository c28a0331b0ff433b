"""The stage processes' native heap: freed record bodies go back to the system.

A burst of large records (800 KB values) passes through a stage as bytes objects of that size.
CPython hands them to glibc's malloc, and glibc keeps what is freed: its mmap threshold grows to
the largest block freed (up to 32 MiB), so after the first burst every body comes from an arena
instead of its own mapping, each thread gets an arena of its own (8 x cores of them), and an
arena gives memory back only from its top. Peak RSS then grows with the burst although the
stages hold a bounded number of bytes at once (TW_QUEUE_BYTES, TW_BATCH_BYTES,
TW_READ_CACHE_BYTES). ``tune_malloc`` fixes the mmap threshold (a body of 128 KiB or more gets
its own mapping, unmapped when freed), limits the arenas and lowers the trim threshold;
``release`` runs the cyclic GC (the stages raise its thresholds: large bodies held by unreached
cycles wait for it) and trims the heap. The stages call it every ``RELEASE_EVERY_BYTES`` of
records they handle (``StageContext.processed``).

Only stage processes (``timerwheel stage``, ``run --kafka``) tune the allocator: an application
that embeds timerwheel keeps its own. Without glibc (musl, macOS) both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

#: Handled records between two ``release`` calls.
RELEASE_EVERY_BYTES = 64 * 1024 * 1024

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

MMAP_THRESHOLD = 128 * 1024
TRIM_THRESHOLD = 1024 * 1024
ARENA_MAX = 2


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_LIBC = _libc()


def tune_malloc() -> bool:
    """Set glibc's thresholds and arena count for this process; False without glibc."""
    if _LIBC is None:
        return False
    ok = all(_LIBC.mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_ARENA_MAX, ARENA_MAX)))
    return ok


def release() -> None:
    """Collect unreachable cycles and give the heap's free memory back to the system."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
