"""Commit-log records as every stage sees them, whatever the transport.

``Record`` is a NamedTuple rather than a frozen dataclass: one is built per message on the
hot path, and a NamedTuple is immutable at a quarter of the cost.
"""

from __future__ import annotations

from typing import NamedTuple

Headers = tuple[tuple[str, bytes], ...]


class Record(NamedTuple):
    """A record read from a commit log (Kafka or the local log)."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: Headers = ()

    def header(self, name: str) -> bytes | None:
        """Last value of header ``name`` (Kafka allows repeats; the last one wins)."""
        found = None
        for k, v in self.headers:
            if k == name:
                found = v
        return found

    @property
    def size(self) -> int:
        """Approximate serialized size: key, value and headers."""
        return (
            len(self.key or b"")
            + len(self.value or b"")
            + sum(len(k) + len(v) for k, v in self.headers)
        )


class OutRecord(NamedTuple):
    """A record to append. ``partition`` None lets the log choose (by key, as Kafka does)."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: Headers = ()
    partition: int | None = None
    timestamp_ms: int | None = None
