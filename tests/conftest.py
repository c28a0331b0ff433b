"""Suite-wide fixtures: the real Kafka and Redis servers (see infra.py), and two mounts of one
directory for the shared-volume tests (see two_mounts.py)."""

from infra import (
    kafka_bootstrap,
    kafka_cluster3,
    kafka_control,
    kafka_noauto_bootstrap,
    redis_control,
    redis_url,
    secure_kafka,
    secure_redis,
)
from two_mounts import mounts

__all__ = ["kafka_bootstrap", "kafka_cluster3", "kafka_control", "kafka_noauto_bootstrap", "mounts", "redis_control", "redis_url",
           "secure_kafka", "secure_redis"]
