"""Suite-wide fixtures: the real Kafka and Redis servers (see infra.py)."""

from infra import (
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
