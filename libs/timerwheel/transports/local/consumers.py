"""Consumers of the local log: ``LocalConsumer`` (``Consumer``: some partitions of one topic from
offsets the caller owns) and ``LocalGroupConsumer`` (``GroupConsumer``: the one member of a
consumer group, its offsets in a file beside the topics).

A consumer of a followed topic keeps what it reads in the log's ``ReadCache``, a poll's batch at
a time, so that ``LocalCommitLog.read`` serves those records from memory. Waiting for records is
real time whatever the log's Clock: a simulated clock must not stall a poll.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from timerwheel.errors import TimerwheelError
from timerwheel.files import atomic_write
from timerwheel.records import Record
from timerwheel.transports.local.layout import FORMAT_VERSION, GROUPS_DIR, check_name

if TYPE_CHECKING:
    from timerwheel.transports.local.log import LocalCommitLog

__all__ = ["LocalConsumer", "LocalGroupConsumer"]

_IDLE_SLEEP_S = 0.002


class LocalConsumer:
    """Consumer of some partitions of one LocalCommitLog topic; one thread at a time."""

    def __init__(self, log: LocalCommitLog, topic: str, offsets: Mapping[int, int], *, keep: bool = True) -> None:
        for p, o in offsets.items():
            if o < 0:
                raise ValueError(f"consumer of {topic!r}: offset for partition {p} must be >= 0, got {o}")
        self.topic = topic
        self._parts = {p: log.partition_log(topic, p) for p in offsets}
        self._log = log  # a followed topic's reads are kept in its read cache
        self._positions = dict(offsets)
        self._order = sorted(offsets)
        self._turn = 0
        self._closed = False
        #: Keep what is read of a followed topic (``LocalCommitLog.consumer``'s ``keep``).
        self._keep = keep

    def poll(self, max_records: int, timeout_s: float) -> list[Record]:
        # Waiting is real time whatever the Clock: a simulated clock must not stall a poll.
        deadline = time.monotonic() + timeout_s
        while not self._closed and max_records > 0 and self._order:
            records = self._fetch(max_records)
            if records:
                return records
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            time.sleep(min(_IDLE_SLEEP_S, remaining))
        return []

    def _fetch(self, max_records: int) -> list[Record]:
        out: list[Record] = []
        cache = self._log.read_cache if self._keep and self.topic in self._log.followed else None
        n = len(self._order)
        for k in range(n):  # start one partition further each poll, so none starves
            p = self._order[(self._turn + k) % n]
            while len(out) < max_records:
                records, self._positions[p], frame_bytes = self._parts[p].read_from(
                    self._positions[p], max_records - len(out))
                if not records:
                    break
                if cache is not None:
                    cache.keep(self.topic, p, records, frame_bytes)
                out += records
        self._turn = (self._turn + 1) % n
        return out

    def seek(self, partition: int, offset: int) -> None:
        if partition not in self._positions:
            raise ValueError(f"consumer of {self.topic!r} is not assigned partition {partition}")
        if offset < 0:
            raise ValueError(f"seek {self.topic!r}/{partition}: offset must be >= 0, got {offset}")
        self._positions[partition] = offset

    def position(self, partition: int) -> int:
        if partition not in self._positions:
            raise ValueError(f"consumer of {self.topic!r} is not assigned partition {partition}")
        return self._positions[partition]

    def close(self) -> None:
        self._closed = True


class LocalGroupConsumer:
    """``GroupConsumer`` on the local log: a group has one member at a time (it holds
    ``<GROUPS_DIR>/<group>.lock``; a second is refused, a killed one lets go at once) that reads
    every partition of its topics. ``commit`` replaces ``<group>.json`` atomically
    (``{"format": 1, "offsets": {topic: {partition: next offset}}}``); a new group starts at the
    earliest offsets."""

    def __init__(self, log: LocalCommitLog, group: str, topics: Sequence[str]) -> None:
        check_name("group", group)
        self.group = group
        directory = log.directory / GROUPS_DIR
        directory.mkdir(exist_ok=True)
        self._path = directory / f"{group}.json"
        self._fsync = log.fsync
        self._lock_fd = os.open(directory / f"{group}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise TimerwheelError(f"consumer group {group!r} of {log.directory} has a member already "
                                  "(the local log allows one per group)") from None
        try:
            saved = json.loads(self._path.read_text())["offsets"] if self._path.exists() else {}
            self._committed: dict[str, dict[str, int]] = {t: dict(saved.get(t, {})) for t in saved}
            self._consumers = [
                log.consumer(t, {p: max(int(self._committed.get(t, {}).get(str(p), 0)), start)
                                 for p, start in log.start_offsets(t).items()})
                for t in dict.fromkeys(topics)
            ]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            os.close(self._lock_fd)
            raise TimerwheelError(f"consumer group {group!r}: cannot read {self._path}: {exc}") from None
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._turn = 0

    def poll(self, max_records: int, timeout_s: float) -> list[Record]:
        deadline = time.monotonic() + timeout_s
        n = len(self._consumers)
        while True:
            out: list[Record] = []
            for k in range(n):  # a different topic first each time, so none starves
                if len(out) < max_records:
                    out += self._consumers[(self._turn + k) % n].poll(max_records - len(out), 0.0)
            self._turn = (self._turn + 1) % max(n, 1)
            remaining = deadline - time.monotonic()
            if out or remaining <= 0:
                return out
            time.sleep(min(_IDLE_SLEEP_S, remaining))

    def commit(self, offsets: Mapping[tuple[str, int], int]) -> None:
        for (topic, partition), offset in offsets.items():
            self._committed.setdefault(topic, {})[str(partition)] = offset
        body = json.dumps({"format": FORMAT_VERSION, "offsets": self._committed}, sort_keys=True).encode()
        try:
            atomic_write(str(self._path), body, fsync=self._fsync)
        except OSError as exc:
            raise TimerwheelError(f"commit of group {self.group!r} to {self._path} failed: {exc}") from exc

    def close(self) -> None:
        for consumer in self._consumers:
            consumer.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1
