"""TailIndex: a reader's own index of the TimerLog records its wheel view may not show yet.

Why: the writer publishes slot states into the mapped wheel file after each flush, but makes the
file itself durable (msync, then ``synced_pos`` in its header) only every ``wheel_sync_records``
records. On one node the reader maps the same pages and sees every publish at once. On a shared
volume seen from another node (NFS and the like: close-to-open consistency) the reader sees the
wheel only as of its last msync, and a slot written since may look empty; dequeue-get then
took it as empty and moved R past it, and its messages were lost for good.

What it holds: for the records of ``[start, end)`` of the TimerLog, where ``start`` is the wheel
header's ``synced_pos`` as read fresh by the reader and ``end`` the flushed position the reader
has read up to, per slot time: the newest position (the chain head: RIP-43 chains link records
newest first through ``prev_pos`` down to the slot's first, whose ``prev_pos`` is -1 or
precedes ``start``), the oldest position and the record count. With the wheel as it was at
``start`` (fresh after a re-read), that is every record of every slot below ``end``.

How it stays small and fast: only slot times, not records; records below a new ``start`` are the
wheel's again and their entries are dropped; entries are kept in a few sorted numpy runs merged
like a binary counter (each record is merged O(log n) times), so adding a batch costs about its
own size and a lookup a binary search per run.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from timerwheel.store.wheel import group_order

IntArray = npt.NDArray[np.int64]


class _Run:
    """Sorted unique slot times with their newest position, oldest position and count."""

    __slots__ = ("first", "head", "num", "slot")

    def __init__(self, slot: IntArray, head: IntArray, first: IntArray, num: IntArray) -> None:
        self.slot, self.head, self.first, self.num = slot, head, first, num

    @classmethod
    def of(cls, slot: IntArray, head: IntArray, first: IntArray, num: IntArray) -> _Run:
        """Group possibly repeated slot times (any order)."""
        order = group_order(slot) if len(slot) else np.zeros(0, dtype=np.int64)
        slot, head, first, num = slot[order], head[order], first[order], num[order]
        if not len(slot):
            return cls(slot, head, first, num)
        starts = np.flatnonzero(np.concatenate(([True], slot[1:] != slot[:-1])))
        return cls(slot[starts], np.maximum.reduceat(head, starts), np.minimum.reduceat(first, starts),
                   np.add.reduceat(num, starts))

    def __len__(self) -> int:
        return len(self.slot)


class TailIndex:
    """Per slot time, the records of TimerLog positions ``[start, end)``."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.end = start
        self._runs: list[_Run] = []

    def __len__(self) -> int:
        return sum(len(r) for r in self._runs)

    def add(self, slot_times: IntArray, positions: IntArray, end: int) -> None:
        """Index valid records (``positions`` ascending, below ``end``) and move ``end`` to ``end``."""
        self.end = end
        if not len(positions):
            return
        self._runs.append(_Run.of(slot_times, positions, positions, np.ones(len(positions), dtype=np.int64)))
        while len(self._runs) > 1 and len(self._runs[-1]) >= len(self._runs[-2]):
            b, a = self._runs.pop(), self._runs.pop()
            self._runs.append(_Run.of(np.concatenate((a.slot, b.slot)), np.concatenate((a.head, b.head)),
                                      np.concatenate((a.first, b.first)), np.concatenate((a.num, b.num))))

    def forget_below(self, start: int) -> None:
        """The wheel view now covers the records below ``start``: drop slots with none at or past it."""
        if start <= self.start:
            return
        self.start = start
        self.end = max(self.end, start)
        runs = []
        for run in self._runs:
            keep = run.head >= start
            if keep.any():
                runs.append(_Run(run.slot[keep], run.head[keep], run.first[keep], run.num[keep]))
        self._runs = runs

    def get(self, slot_time: int) -> tuple[int, int, int] | None:
        """(newest position, oldest position, count) of the slot's indexed records, or None."""
        head, first, num = -1, -1, 0
        for run in self._runs:
            k = int(np.searchsorted(run.slot, slot_time))
            if k < len(run.slot) and run.slot[k] == slot_time:
                head = max(head, int(run.head[k]))
                first = int(run.first[k]) if first < 0 else min(first, int(run.first[k]))
                num += int(run.num[k])
        return (head, first, num) if num else None

    def merged(self, from_ms: int, to_ms: int) -> tuple[IntArray, IntArray, IntArray, IntArray]:
        """(slot time, newest, oldest, count) of the indexed slots with from_ms <= t < to_ms."""
        parts = []
        for run in self._runs:
            lo, hi = np.searchsorted(run.slot, [from_ms, to_ms])
            parts.append((run.slot[lo:hi], run.head[lo:hi], run.first[lo:hi], run.num[lo:hi]))
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty, empty
        run = _Run.of(*(np.concatenate(column) for column in zip(*parts, strict=True)))
        return run.slot, run.head, run.first, run.num

    def next_slot(self, from_ms: int, to_ms: int) -> int | None:
        """The first indexed slot time t with from_ms <= t < to_ms, or None."""
        best: int | None = None
        for run in self._runs:
            k = int(np.searchsorted(run.slot, from_ms))
            if k < len(run.slot) and run.slot[k] < to_ms:
                t = int(run.slot[k])
                best = t if best is None else min(best, t)
        return best
