"""Small helpers of the Spark job tests: unique topic names and a kafka-python producer."""

from __future__ import annotations

import uuid
from typing import Any

from kafka import KafkaProducer


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


class Writer:
    """Writes records with chosen timestamps and headers; ``send`` returns (partition, offset)."""

    def __init__(self, bootstrap: str) -> None:
        self.producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)

    def send(self, topic: str, headers: list[tuple[str, bytes]], timestamp_ms: int, value: bytes = b"v",
             key: bytes | None = None, partition: int | None = 0) -> tuple[int, int]:
        meta: Any = self.producer.send(topic, key=key, value=value, headers=headers, timestamp_ms=timestamp_ms,
                                       partition=partition).get(timeout=60)
        return meta.partition, meta.offset

    def close(self) -> None:
        self.producer.flush()
        self.producer.close()
