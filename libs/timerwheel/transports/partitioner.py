"""Kafka's default partitioner, bit for bit: the partition a keyed record goes to
(``toPositive(murmur2(key)) % partitions``). The local log spreads keyed records with it as Kafka
would; the Kafka appender gives kafka-python the partitions of a batch's keyed records computed
with it at once (``kafka.producer.Appender``), rather than kafka-python's murmur2 in Python, a
record at a time.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

__all__ = ["kafka_partition", "kafka_partitions", "murmur2"]

_M32 = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka's ``Utils.murmur2``: a signed 32-bit hash, bit for bit as the Java client computes it."""
    m = 0x5BD1E995
    length = len(data)
    h = (0x9747B28C ^ length) & _M32
    tail = length & ~3
    for (k,) in struct.iter_unpack("<I", data[:tail]):
        k = (k * m) & _M32
        k ^= k >> 24
        k = (k * m) & _M32
        h = ((h * m) & _M32) ^ k
    rest = length & 3
    if rest == 3:
        h ^= data[tail + 2] << 16
    if rest >= 2:
        h ^= data[tail + 1] << 8
    if rest >= 1:
        h = ((h ^ data[tail]) * m) & _M32
    h ^= h >> 13
    h = (h * m) & _M32
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def kafka_partition(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner gives a keyed record: toPositive(murmur2) % n."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def kafka_partitions(keys: Sequence[bytes], partitions: int) -> list[int]:
    """``kafka_partition`` of many keys: keys of one length are hashed together with numpy
    (uint32 arithmetic wraps as Java's int does), as murmur2 in Python costs microseconds a key."""
    out = [0] * len(keys)
    by_length: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        by_length.setdefault(len(key), []).append(i)
    m = np.uint32(0x5BD1E995)
    for length, idxs in by_length.items():
        if len(idxs) < 16:
            for i in idxs:
                out[i] = kafka_partition(keys[i], partitions)
            continue
        data = np.frombuffer(b"".join([keys[i] for i in idxs]), dtype=np.uint8).reshape(len(idxs), length)
        h = np.full(len(idxs), (0x9747B28C ^ length) & _M32, dtype=np.uint32)
        tail = length & ~3
        words = data[:, :tail].copy().view("<u4")
        for w in range(tail // 4):
            k = words[:, w] * m
            k ^= k >> np.uint32(24)
            k *= m
            h *= m
            h ^= k
        rest = length & 3
        if rest == 3:
            h ^= data[:, tail + 2].astype(np.uint32) << np.uint32(16)
        if rest >= 2:
            h ^= data[:, tail + 1].astype(np.uint32) << np.uint32(8)
        if rest >= 1:
            h ^= data[:, tail].astype(np.uint32)
            h *= m
        h ^= h >> np.uint32(13)
        h *= m
        h ^= h >> np.uint32(15)
        for i, p in zip(idxs, ((h & np.uint32(0x7FFFFFFF)) % np.uint32(partitions)).tolist(), strict=True):
            out[i] = p
    return out
