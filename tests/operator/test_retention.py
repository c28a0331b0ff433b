"""The timer topic's retention.ms on a real broker (the tests' Kafka): read through the admin API,
raised to 1.5 x the roll window when managed, never lowered; refused when not managed."""

from __future__ import annotations

import base64
import uuid
from pathlib import Path

import pytest
from k8s_helpers import wheel_body
from kafka import KafkaAdminClient
from kafka.admin import NewTopic
from test_reconcile import FakeCluster
from timerwheel_operator import retention, spec
from timerwheel_operator.kafka_access import Access, access
from timerwheel_operator.retention import KafkaAdmin, TopicMissing, keep, refusal
from timerwheel_operator.spec import Wheel


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
    assert admin.retention_ms(Access(kafka_bootstrap), topic) == 60_000
    check = keep(admin, Access(kafka_bootstrap), topic, roll_window_ms=100_000, manage=True, now_ms=1)
    assert check.state == "Raised" and check.found_ms == 150_000, check
    assert admin.retention_ms(Access(kafka_bootstrap), topic) == 150_000
    again = keep(admin, Access(kafka_bootstrap), topic, roll_window_ms=10_000, manage=True, now_ms=2)
    assert again.state == "Ok" and admin.retention_ms(Access(kafka_bootstrap), topic) == 150_000  # not lowered
    assert refusal(again, 10_000) is None
    status = again.to_status()
    assert status["retentionMs"] == 150_000 and status["neededMs"] == 15_000


def test_an_unmanaged_retention_too_low_refuses_the_window_naming_found_and_needed(kafka_bootstrap: str,
                                                                                 topic: str) -> None:
    admin = KafkaAdmin()
    check = keep(admin, Access(kafka_bootstrap), topic, roll_window_ms=100_000, manage=False, now_ms=1)
    assert check.state == "TooLow" and check.found_ms == 60_000
    why = refusal(check, 100_000)
    assert why is not None and why.startswith("retention.ms") and "60000" in why and "150000" in why, why
    assert admin.retention_ms(Access(kafka_bootstrap), topic) == 60_000  # left alone


def test_a_missing_topic_or_an_unreachable_broker_is_unknown_not_a_crash(kafka_bootstrap: str) -> None:
    admin = KafkaAdmin(timeout_ms=2_000, attempts=2)
    with pytest.raises(TopicMissing):
        admin.retention_ms(Access(kafka_bootstrap), f"tw-missing-{uuid.uuid4().hex[:8]}")
    check = keep(admin, Access(kafka_bootstrap), f"tw-missing-{uuid.uuid4().hex[:8]}", 1_000, True, 1)
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
    monkeypatch.setattr(admin, "_client", lambda kafka: Flaky())
    monkeypatch.setattr(retention.time, "sleep", lambda s: None)
    assert admin.retention_ms(Access("b:9092"), "t") is None and len(calls) == 3


def _secured(kafka: dict[str, str], cluster: FakeCluster, password: bytes, with_ca: bool = True) -> Wheel:
    """A TimerWheel on ``secure_kafka``'s SASL_SSL listener, its password and CA in a Secret."""
    data = {"password": base64.b64encode(password).decode()}
    if with_ca:
        data["ca.crt"] = base64.b64encode(Path(kafka["TW_KAFKA_SASL_SSL_CAFILE"]).read_bytes()).decode()
    cluster.objects[("Secret", "kafka-creds")] = {"data": data}
    body = wheel_body(kafka={"bootstrap": kafka["TW_KAFKA_SASL_SSL_BOOTSTRAP"], "securityProtocol": "SASL_SSL",
                             "saslMechanism": "SCRAM-SHA-512", "saslUsername": kafka["TW_KAFKA_SASL_SSL_USERNAME"],
                             "secretName": "kafka-creds", "saslPasswordKey": "password", "caKey": "ca.crt"})
    return spec.read(body, "timerwheel:dev")


def test_the_retention_of_a_secured_kafka_is_kept_with_the_stages_secret(secure_kafka: dict[str, str],
                                                                         tmp_path: Path) -> None:
    """The operator reaches a SASL_SSL-only listener with the password and CA of spec.kafka's
    Secret; a changed Secret (a rotated or wrong password) replaces the client it had."""
    name = f"tw-retention-{uuid.uuid4().hex[:8]}"
    plain = KafkaAdminClient(bootstrap_servers=secure_kafka["TW_KAFKA_BOOTSTRAP"])
    try:
        plain.create_topics([NewTopic(name, 1, 1, topic_configs={"retention.ms": "60000"})])
    finally:
        plain.close()
    cluster = FakeCluster()
    password = Path(secure_kafka["TW_KAFKA_SASL_SSL_PASSWORD_FILE"]).read_bytes().strip()
    wheel = _secured(secure_kafka, cluster, password)
    admin = KafkaAdmin(timeout_ms=5_000, attempts=2)
    check = keep(admin, lambda: access(wheel, cluster, str(tmp_path)), name, 100_000, True, 1)
    assert check.state == "Raised" and check.found_ms == 150_000, check
    assert admin.retention_ms(access(wheel, cluster, str(tmp_path)), name) == 150_000
    where = tmp_path / "tw-test.orders"
    assert (where.stat().st_mode & 0o777) == 0o700
    assert sorted(p.name for p in where.iterdir()) == ["ca.crt", "password"]
    assert all((p.stat().st_mode & 0o777) == 0o600 for p in where.iterdir())

    wrong = _secured(secure_kafka, cluster, b"not-the-password")
    refused = keep(admin, lambda: access(wrong, cluster, str(tmp_path)), name, 200_000, True, 2)
    assert refused.state == "Unknown" and "spec.kafka.saslPasswordKey" in refused.message, refused
    assert "not-the-password" not in refused.message
    assert refusal(refused, 200_000) is not None


def test_a_secret_the_operator_cannot_use_is_unknown_naming_the_field(secure_kafka: dict[str, str],
                                                                      tmp_path: Path) -> None:
    cluster = FakeCluster()
    wheel = _secured(secure_kafka, cluster, b"x", with_ca=False)
    check = keep(KafkaAdmin(), lambda: access(wheel, cluster, str(tmp_path)), "t", 1_000, True, 1)
    assert check.state == "Unknown" and "spec.kafka.caKey" in check.message and "'ca.crt'" in check.message, check
    del cluster.objects[("Secret", "kafka-creds")]
    check = keep(KafkaAdmin(), lambda: access(wheel, cluster, str(tmp_path)), "t", 1_000, True, 1)
    assert check.state == "Unknown" and "spec.kafka.secretName" in check.message, check
    plaintext = spec.read(wheel_body(), "timerwheel:dev")
    assert access(plaintext, cluster, str(tmp_path)) == Access("10.0.0.5:9092")  # no Secret asked for
