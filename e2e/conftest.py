"""End-to-end fixtures: the real Kafka and Redis servers, shared with tests/ (tests/infra.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from infra import (  # noqa: E402
    kafka_bootstrap,
    kafka_control,
    kafka_noauto_bootstrap,
    redis_control,
    redis_url,
    secure_kafka,
    secure_redis,
)

__all__ = ["kafka_bootstrap", "kafka_control", "kafka_noauto_bootstrap", "redis_control", "redis_url", "secure_kafka",
           "secure_redis"]
