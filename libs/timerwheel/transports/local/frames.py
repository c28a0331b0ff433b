"""The local log's record frames: how one record is encoded in a segment's ``.log`` file.

A frame is::

    crc u32 | offset i64 | body: msgpack array [timestamp_ms, key, value, [[name, value], ...]]

(every integer little endian). ``crc`` is CRC-32 of the body (key and value are msgpack bin or
nil, header names str). ``offset`` is outside the CRC but compared with the offset the index
says, so a misplaced or corrupt frame is detected either way. msgpack because its C codec is
several times faster than packing the fields with ``struct`` in Python, and this is the embedded
pipeline's hot path.
"""

from __future__ import annotations

import struct
import threading
import zlib
from collections.abc import Sequence

import msgpack

from timerwheel.errors import CorruptRecordError, TimerwheelError
from timerwheel.records import OutRecord, Record

__all__ = ["PREFIX", "CorruptLogRecordError", "decode", "decode_run", "encode_bodies"]

PREFIX = struct.Struct("<Iq")  # crc, offset


class CorruptLogRecordError(CorruptRecordError):
    """A commit-log frame failed its CRC or offset check. ``position`` is the record's offset."""

    def __init__(self, topic: str, partition: int, offset: int, message: str) -> None:
        TimerwheelError.__init__(self, f"corrupt record in {topic}/{partition} at offset {offset}: {message}")
        self.position = offset
        self.topic = topic
        self.partition = partition



_packers = threading.local()


def encode_bodies(records: Sequence[OutRecord], now_ms: int) -> list[tuple[int, bytes]]:
    """Everything of each frame but ``crc | offset`` (the offset is known only under the lock)."""
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True, autoreset=True)
    crc32, pack = zlib.crc32, packer.pack
    out = []
    for r in records:
        ts = now_ms if r.timestamp_ms is None else r.timestamp_ms
        body: bytes = pack((ts, r.key, r.value, r.headers))
        out.append((crc32(body), body))
    return out


_new_record = tuple.__new__  # Record(...) goes through a Python-level __new__: twice the cost


def decode_run(blob: bytes, ends: list[int], topic: str, partition: int, offset: int) -> list[Record]:
    """The consecutive frames ending at ``ends`` in ``blob`` (the first at 0), offsets from
    ``offset`` on: ``decode`` inlined, the embedded pipeline's hottest loop."""
    unpack_prefix, prefix, crc32, unpackb = PREFIX.unpack_from, PREFIX.size, zlib.crc32, msgpack.unpackb
    view = memoryview(blob)
    out = []
    pos = 0
    for end in ends:
        if end - pos > prefix:
            crc, stored = unpack_prefix(blob, pos)
            body = view[pos + prefix : end]
            if stored == offset and crc32(body) == crc:
                try:
                    ts, key, value, headers = unpackb(body, use_list=False)
                except (ValueError, TypeError, msgpack.UnpackException):
                    pass
                else:
                    out.append(_new_record(Record, (topic, partition, offset, ts, key, value, headers)))
                    pos = end
                    offset += 1
                    continue
        out.append(decode(blob, pos, end, topic, partition, offset))  # raises, naming what is wrong
        pos = end
        offset += 1
    return out


def decode(blob: bytes, pos: int, end: int, topic: str, partition: int, offset: int) -> Record:
    """The frame at ``blob[pos:end]``, checked against its CRC and the offset the index gave."""
    if end - pos <= PREFIX.size:
        raise CorruptLogRecordError(topic, partition, offset, f"frame of {end - pos} bytes is too short")
    crc, stored_offset = PREFIX.unpack_from(blob, pos)
    if stored_offset != offset:
        raise CorruptLogRecordError(topic, partition, offset, f"frame says offset {stored_offset}")
    body = memoryview(blob)[pos + PREFIX.size : end]
    if zlib.crc32(body) != crc:
        raise CorruptLogRecordError(topic, partition, offset, "CRC mismatch")
    try:
        timestamp_ms, key, value, headers = msgpack.unpackb(body, use_list=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:  # only a writer bug gets past the CRC
        raise CorruptLogRecordError(topic, partition, offset, f"undecodable body: {e}") from e
    return Record(topic, partition, offset, timestamp_ms, key, value, headers)

