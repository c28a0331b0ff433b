"""Security settings: validated together at the edge, turned into client options in one place
(``timerwheel.security``), secrets never shown."""

from __future__ import annotations

from pathlib import Path

import pytest
from timerwheel.config import TimerConfig
from timerwheel.errors import ConfigError
from timerwheel.security import kafka_client_options, kafka_java_properties, spark_kafka_options

SASL = {"TW_KAFKA_BOOTSTRAP": "b:9096", "TW_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "TW_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512", "TW_KAFKA_SASL_USERNAME": "tw",
        "TW_KAFKA_SASL_PASSWORD": "s3cret"}


def refused(env: dict[str, str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        TimerConfig.from_env(env)
    return info.value


def test_sasl_without_a_username_is_refused_naming_it() -> None:
    assert refused({**SASL, "TW_KAFKA_SASL_USERNAME": ""}).field == "TW_KAFKA_SASL_USERNAME"


def test_sasl_needs_a_known_mechanism_and_a_password() -> None:
    assert refused({**SASL, "TW_KAFKA_SASL_MECHANISM": ""}).field == "TW_KAFKA_SASL_MECHANISM"
    assert refused({**SASL, "TW_KAFKA_SASL_MECHANISM": "GSSAPI"}).field == "TW_KAFKA_SASL_MECHANISM"
    assert refused({**SASL, "TW_KAFKA_SASL_PASSWORD": ""}).field == "TW_KAFKA_SASL_PASSWORD"


def test_an_unknown_protocol_is_refused() -> None:
    assert refused({**SASL, "TW_KAFKA_SECURITY_PROTOCOL": "TLS"}).field == "TW_KAFKA_SECURITY_PROTOCOL"


def test_a_secret_file_that_cannot_be_read_is_refused_naming_it(tmp_path: Path) -> None:
    gone = str(tmp_path / "nope")
    env = {**SASL, "TW_KAFKA_SASL_PASSWORD": "", "TW_KAFKA_SASL_PASSWORD_FILE": gone}
    err = refused(env)
    assert err.field == "TW_KAFKA_SASL_PASSWORD_FILE" and gone in str(err)
    assert refused({**SASL, "TW_KAFKA_SSL_CAFILE": gone}).field == "TW_KAFKA_SSL_CAFILE"
    assert refused({"TW_REDIS_URL": "redis://r:6379/0", "TW_REDIS_PASSWORD_FILE": gone}).field == "TW_REDIS_PASSWORD_FILE"
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert refused({**env, "TW_KAFKA_SASL_PASSWORD_FILE": str(empty)}).field == "TW_KAFKA_SASL_PASSWORD_FILE"


def test_a_password_and_a_password_file_together_are_refused(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("x\n")
    assert refused({**SASL, "TW_KAFKA_SASL_PASSWORD_FILE": str(secret)}).field == "TW_KAFKA_SASL_PASSWORD_FILE"
    assert refused({"TW_REDIS_URL": "redis://r/0", "TW_REDIS_PASSWORD": "a",
                    "TW_REDIS_PASSWORD_FILE": str(secret)}).field == "TW_REDIS_PASSWORD_FILE"


def test_settings_of_another_protocol_are_refused(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    plain = {"TW_KAFKA_BOOTSTRAP": "b:9092"}
    assert refused({**plain, "TW_KAFKA_SSL_CAFILE": str(ca)}).field == "TW_KAFKA_SSL_CAFILE"
    assert refused({**plain, "TW_KAFKA_SASL_USERNAME": "tw"}).field == "TW_KAFKA_SASL_USERNAME"
    assert refused({**SASL, "TW_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
                    "TW_KAFKA_SSL_CAFILE": str(ca)}).field == "TW_KAFKA_SSL_CAFILE"
    assert refused({**SASL, "TW_KAFKA_SSL_KEYFILE": str(ca)}).field == "TW_KAFKA_SSL_KEYFILE"
    assert refused({"TW_REDIS_URL": "redis://r/0", "TW_REDIS_SSL_CAFILE": str(ca)}).field == "TW_REDIS_SSL_CAFILE"
    assert refused({"TW_REDIS_URL": "http://r/0"}).field == "TW_REDIS_URL"
    assert refused({"TW_REDIS_URL": "rediss://:pw@r/0", "TW_REDIS_PASSWORD": "pw2"}).field == "TW_REDIS_PASSWORD"


def test_secrets_are_neither_in_the_repr_nor_in_errors() -> None:
    cfg = TimerConfig.from_env({**SASL, "TW_REDIS_URL": "rediss://r/0", "TW_REDIS_PASSWORD": "r3dis"})
    assert "s3cret" not in repr(cfg) and "r3dis" not in repr(cfg)
    assert "s3cret" not in str(refused({**SASL, "TW_KAFKA_SASL_USERNAME": ""}))


def test_plaintext_adds_no_client_options() -> None:
    cfg = TimerConfig(kafka_bootstrap="b:9092")
    assert kafka_client_options(cfg) == {}
    assert kafka_java_properties(cfg) == {"security.protocol": "PLAINTEXT"}


def test_kafka_python_options_read_the_password_file_at_each_connect(tmp_path: Path) -> None:
    secret, ca = tmp_path / "pw", tmp_path / "ca.pem"
    secret.write_text("first\n")
    ca.write_text("x")
    cfg = TimerConfig.from_env({**SASL, "TW_KAFKA_SASL_PASSWORD": "", "TW_KAFKA_SASL_PASSWORD_FILE": str(secret),
                                "TW_KAFKA_SSL_CAFILE": str(ca), "TW_KAFKA_SSL_CHECK_HOSTNAME": "false"})
    assert kafka_client_options(cfg) == {
        "security_protocol": "SASL_SSL", "ssl_check_hostname": False, "ssl_cafile": str(ca),
        "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "tw", "sasl_plain_password": "first"}
    secret.write_text("rotated")
    assert kafka_client_options(cfg)["sasl_plain_password"] == "rotated"


def test_java_properties_for_scram_over_tls_quote_the_jaas_values(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    cfg = TimerConfig.from_env({**SASL, "TW_KAFKA_SASL_PASSWORD": 'p"a\\ss', "TW_KAFKA_SSL_CAFILE": str(ca)})
    assert kafka_java_properties(cfg) == {
        "security.protocol": "SASL_SSL",
        "ssl.endpoint.identification.algorithm": "https",
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(ca),
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.jaas.config": 'org.apache.kafka.common.security.scram.ScramLoginModule required '
                            'username="tw" password="p\\"a\\\\ss";',
    }
    plain = TimerConfig.from_env({**SASL, "TW_KAFKA_SASL_MECHANISM": "PLAIN", "TW_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT"})
    assert kafka_java_properties(plain)["sasl.jaas.config"].startswith(
        "org.apache.kafka.common.security.plain.PlainLoginModule required ")
    assert "ssl.truststore.location" not in kafka_java_properties(plain)


def test_java_properties_give_a_client_certificate_and_key_inline(tmp_path: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("junk\n-----BEGIN CERTIFICATE-----\nAAA\n-----END CERTIFICATE-----\n")
    key.write_text("-----BEGIN PRIVATE KEY-----\nBBB\n-----END PRIVATE KEY-----\n")
    cfg = TimerConfig.from_env({"TW_KAFKA_BOOTSTRAP": "b:9093", "TW_KAFKA_SECURITY_PROTOCOL": "SSL",
                                "TW_KAFKA_SSL_CERTFILE": str(cert), "TW_KAFKA_SSL_KEYFILE": str(key)})
    props = kafka_java_properties(cfg)
    assert props["ssl.keystore.type"] == "PEM"
    assert props["ssl.keystore.certificate.chain"] == "-----BEGIN CERTIFICATE-----\nAAA\n-----END CERTIFICATE-----"
    assert props["ssl.keystore.key"] == "-----BEGIN PRIVATE KEY-----\nBBB\n-----END PRIVATE KEY-----"
    assert "sasl.jaas.config" not in props


def test_spark_options_are_the_java_properties_prefixed_with_kafka() -> None:
    cfg = TimerConfig.from_env(SASL)
    options = spark_kafka_options(cfg)
    assert options["kafka.bootstrap.servers"] == "b:9096"
    assert options["kafka.security.protocol"] == "SASL_SSL"
    assert set(options) == {"kafka.bootstrap.servers", *(f"kafka.{k}" for k in kafka_java_properties(cfg))}


def test_kafka_refusing_the_credentials_is_an_access_error_and_an_outage_stays_retriable() -> None:
    import kafka.errors as kafka_errors
    from timerwheel.errors import AccessError
    from timerwheel.transports.kafka.errors import KafkaLogError, kafka_call

    with pytest.raises(AccessError) as info, kafka_call("connect the producer"):
        raise kafka_errors.SaslAuthenticationFailedError("invalid credentials")
    assert info.value.setting == "TW_KAFKA_SASL_PASSWORD"
    with pytest.raises(KafkaLogError), kafka_call("connect the producer"):
        raise kafka_errors.KafkaTimeoutError("Unable to bootstrap")
