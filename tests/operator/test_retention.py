"""The timer topic's retention.ms on a real broker (the tests' Kafka): read through the admin API,
raised to 1.5 x the roll window when managed, never lowered; refused when not managed."""

from __future__ import annotations

import uuid

import pytest
from kafka import KafkaAdminClient
from kafka.admin import NewTopic
from timerwheel_operator import retention
from timerwheel_operator.retention import KafkaAdmin, TopicMissing, keep, refusal


@pytest.fixture
def topic(kafka_bootstrap: str) -> str:
    name = f"tw-retention-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        admin.create_topics([NewTopic(name, 1, 1, topic_configs={"retention.ms": "60000"})])
    finally:
        admin.close()
    return name


def test_a_managed_retention_is_raised_to_one_and_a_half_windows_and_never_lowered(kafka_bootstrap: str,
                                                                                 topic: str) -> None:
    admin = KafkaAdmin()
    assert admin.retention_ms(kafka_bootstrap, topic) == 60_000
    check = keep(admin, kafka_bootstrap, topic, roll_window_ms=100_000, manage=True, now_ms=1)
    assert check.state == "Raised" and check.found_ms == 150_000, check
    assert admin.retention_ms(kafka_bootstrap, topic) == 150_000
    again = keep(admin, kafka_bootstrap, topic, roll_window_ms=10_000, manage=True, now_ms=2)
    assert again.state == "Ok" and admin.retention_ms(kafka_bootstrap, topic) == 150_000  # not lowered
    assert refusal(again, 10_000) is None
    status = again.to_status()
    assert status["retentionMs"] == 150_000 and status["neededMs"] == 15_000


def test_an_unmanaged_retention_too_low_refuses_the_window_naming_found_and_needed(kafka_bootstrap: str,
                                                                                 topic: str) -> None:
    admin = KafkaAdmin()
    check = keep(admin, kafka_bootstrap, topic, roll_window_ms=100_000, manage=False, now_ms=1)
    assert check.state == "TooLow" and check.found_ms == 60_000
    why = refusal(check, 100_000)
    assert why is not None and why.startswith("retention.ms") and "60000" in why and "150000" in why, why
    assert admin.retention_ms(kafka_bootstrap, topic) == 60_000  # left alone


def test_a_missing_topic_or_an_unreachable_broker_is_unknown_not_a_crash(kafka_bootstrap: str) -> None:
    admin = KafkaAdmin(timeout_ms=2_000, attempts=2)
    with pytest.raises(TopicMissing):
        admin.retention_ms(kafka_bootstrap, f"tw-missing-{uuid.uuid4().hex[:8]}")
    check = keep(admin, kafka_bootstrap, f"tw-missing-{uuid.uuid4().hex[:8]}", 1_000, True, 1)
    assert check.state == "Unknown" and "does not exist" in check.message
    assert refusal(check, 1_000) is not None


def test_describe_configs_is_retried_while_the_broker_is_not_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    from kafka.errors import NodeNotReadyError

    calls = []

    class Flaky:
        def describe_configs(self, resources: object, config_filter: str) -> dict[str, object]:
            calls.append(1)
            if len(calls) < 3:
                raise NodeNotReadyError("fresh broker")
            return {"topic": {"t": {"retention.ms": {"value": "-1"}}}}

    admin = KafkaAdmin(attempts=4)
    monkeypatch.setattr(admin, "_client", lambda bootstrap: Flaky())
    monkeypatch.setattr(retention.time, "sleep", lambda s: None)
    assert admin.retention_ms("b:9092", "t") is None and len(calls) == 3
