"""spec.kafka's TLS / SASL settings: the CRD refuses a bad combination naming the field, the
operator turns them into the stages' TW_KAFKA_* settings (secret keys as files of the Secret's
mount) that TimerConfig accepts, and a TimerWheel without them keeps its ConfigMap as it was."""

from __future__ import annotations

from typing import Any

import pytest
from k8s_helpers import api_server_errors, wheel_body
from timerwheel.config import TimerConfig
from timerwheel_operator.manifests import build_all, settings_hash
from timerwheel_operator.spec import KAFKA_SECRET_DIR, SpecError, kafka_env, read

SASL_SSL: dict[str, Any] = {
    "bootstrap": "kafka-0.kafka:9096", "secretName": "kafka-client", "securityProtocol": "SASL_SSL",
    "saslMechanism": "SCRAM-SHA-512", "saslUsername": "timerwheel", "saslPasswordKey": "password",
    "caKey": "ca.crt", "certKey": "tls.crt", "keyKey": "tls.key", "checkHostname": False,
}
REDIS = {"url": "redis://r:6379/0"}


def test_spec_kafka_becomes_the_stages_settings() -> None:
    assert kafka_env(SASL_SSL) == {
        "TW_KAFKA_BOOTSTRAP": "kafka-0.kafka:9096",
        "TW_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "TW_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "TW_KAFKA_SASL_USERNAME": "timerwheel",
        "TW_KAFKA_SSL_CHECK_HOSTNAME": "false",
        "TW_KAFKA_SASL_PASSWORD_FILE": f"{KAFKA_SECRET_DIR}/password",
        "TW_KAFKA_SSL_CAFILE": f"{KAFKA_SECRET_DIR}/ca.crt",
        "TW_KAFKA_SSL_CERTFILE": f"{KAFKA_SECRET_DIR}/tls.crt",
        "TW_KAFKA_SSL_KEYFILE": f"{KAFKA_SECRET_DIR}/tls.key",
    }
    assert kafka_env({"bootstrap": "k:9092"}) == {"TW_KAFKA_BOOTSTRAP": "k:9092"}


def test_the_stages_get_the_settings_and_the_secret_files(tmp_path: Any) -> None:
    body = wheel_body(kafka=SASL_SSL)
    manifests = build_all(read(body, "timerwheel:dev"), body)
    (cm,) = [m for m in manifests if m["kind"] == "ConfigMap"]
    env = cm["data"]
    assert {k: v for k, v in env.items() if k.startswith("TW_KAFKA_")} == kafka_env(SASL_SSL)
    assert "password" not in env.values()  # the secret itself never reaches the ConfigMap
    # what a stage reads: the same variables, the files where the Secret is mounted
    for key in ("password", "ca.crt", "tls.crt", "tls.key"):
        (tmp_path / key).write_text("x\n")
    here = {k: v.replace(KAFKA_SECRET_DIR, str(tmp_path)) for k, v in env.items()}
    cfg = TimerConfig.from_env({**here, "TW_REDIS_URL": "redis://x"})
    assert (cfg.kafka_security_protocol, cfg.kafka_sasl_username, cfg.kafka_ssl_check_hostname) == (
        "SASL_SSL", "timerwheel", False)
    for m in manifests:
        if m["kind"] in ("Deployment", "StatefulSet"):
            pod = m["spec"]["template"]["spec"]
            assert {"name": "kafka-secret", "secret": {"secretName": "kafka-client"}} in pod["volumes"]
            (c,) = pod["containers"]
            assert {"name": "kafka-secret", "mountPath": KAFKA_SECRET_DIR, "readOnly": True} in c["volumeMounts"]


def test_a_wheel_without_security_settings_keeps_its_settings() -> None:
    before = read(wheel_body(), "i")
    assert {k for k in before.env if k.startswith("TW_KAFKA_")} == {"TW_KAFKA_BOOTSTRAP"}
    assert settings_hash(before) == settings_hash(read(wheel_body(kafka={"bootstrap": "10.0.0.5:9092"}), "i"))
    assert settings_hash(before) != settings_hash(read(wheel_body(kafka={**SASL_SSL, "bootstrap": "10.0.0.5:9092"}),
                                                       "i"))


@pytest.mark.parametrize(("kafka", "field", "says"), [
    ({"securityProtocol": "SASL_SSL", "secretName": "s", "saslMechanism": "PLAIN", "saslUsername": "u"},
     "spec.kafka.saslPasswordKey", "must be set with SASL_SSL"),
    ({"securityProtocol": "SASL_SSL", "secretName": "s", "saslPasswordKey": "p", "saslUsername": "u"},
     "spec.kafka.saslMechanism", "must be one of"),
    ({"securityProtocol": "SSL", "secretName": "s", "keyKey": "k"}, "spec.kafka.keyKey", "needs spec.kafka.certKey"),
    ({"secretName": "s", "caKey": "ca"}, "spec.kafka.caKey", "but spec.kafka.securityProtocol is PLAINTEXT"),
    ({"securityProtocol": "SSL", "caKey": "ca"}, "spec.kafka.caKey", "secretName, which is not set"),
])
def test_a_bad_kafka_spec_is_named_by_the_operator(kafka: dict[str, Any], field: str, says: str) -> None:
    with pytest.raises(SpecError) as info:
        read(wheel_body(kafka={"bootstrap": "k:9092", **kafka}), "i")
    assert str(info.value).startswith(f"{field}: ") and says in str(info.value), str(info.value)


def test_the_crd_accepts_the_settings_and_refuses_bad_ones_naming_the_field() -> None:
    assert api_server_errors({"kafka": SASL_SSL, "redis": REDIS}) == []
    for kafka, named in [
        ({"securityProtocol": "TLS"}, "spec.kafka.securityProtocol"),
        ({"saslMechanism": "GSSAPI"}, "spec.kafka.saslMechanism"),
        ({"caKey": "ca.crt"}, "spec.kafka"),  # a key of no Secret
        ({"secretName": "s", "caKey": "a/b"}, "spec.kafka.caKey"),
        ({"checkHostname": "no"}, "spec.kafka.checkHostname"),
    ]:
        errors = api_server_errors({"kafka": {"bootstrap": "k:9092", **kafka}, "redis": REDIS})
        assert any(named in e for e in errors), (kafka, errors)
