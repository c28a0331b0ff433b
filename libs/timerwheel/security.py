"""Secured connections: the one place that turns ``TimerConfig`` into Kafka and Redis client options.

- ``kafka_client_options(cfg)``: the kafka-python keyword arguments (TLS, SASL) every Kafka
  client timerwheel makes takes (``KafkaCommitLog._common``: stages, ``TimerClient``, CLI).
- ``kafka_java_properties(cfg)``: the same settings as Kafka Java client properties
  (``security.protocol``, ``sasl.jaas.config``, ``ssl.truststore.*``); ``spark_kafka_options``
  prefixes them with ``kafka.`` for Spark's Kafka source and sink.
- ``redis_client(cfg)``: redis-py on ``TW_REDIS_URL`` with the password and CA.

A wrong password or a certificate that is not trusted is not an outage: retrying cannot help.
So before a stage starts, ``check_redis_access`` pings Redis and
``timerwheel.transports.kafka.access.check_kafka_access`` asks a Kafka broker; a refusal raises
``AccessError`` naming the setting to fix (``tls_refusal`` for a failed TLS handshake with
either), a server that cannot be reached returns quietly (the caller waits for it as before).
Secrets never reach a message.
"""

from __future__ import annotations

import ssl
from typing import Any

from timerwheel.config import TimerConfig
from timerwheel.errors import AccessError

__all__ = ["check_redis_access", "kafka_client_options", "kafka_java_properties", "redis_client",
           "spark_kafka_options", "tls_refusal"]


def kafka_client_options(cfg: TimerConfig) -> dict[str, Any]:
    """kafka-python options for ``cfg``'s security settings (none for PLAINTEXT)."""
    protocol = cfg.kafka_security_protocol
    if protocol == "PLAINTEXT":
        return {}
    out: dict[str, Any] = {"security_protocol": protocol}
    if protocol in ("SSL", "SASL_SSL"):
        out["ssl_check_hostname"] = cfg.kafka_ssl_check_hostname
        if cfg.kafka_ssl_cafile:
            out["ssl_cafile"] = cfg.kafka_ssl_cafile
        if cfg.kafka_ssl_certfile:
            out["ssl_certfile"] = cfg.kafka_ssl_certfile
        if cfg.kafka_ssl_keyfile:
            out["ssl_keyfile"] = cfg.kafka_ssl_keyfile
    if protocol.startswith("SASL_"):
        out.update(sasl_mechanism=cfg.kafka_sasl_mechanism, sasl_plain_username=cfg.kafka_sasl_username,
                   sasl_plain_password=cfg.kafka_password())
    return out


def _jaas_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


_LOGIN_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}


def kafka_java_properties(cfg: TimerConfig) -> dict[str, str]:
    """The Kafka Java client properties for ``cfg``'s security settings. PEM files are given as
    Kafka reads them (``ssl.truststore.type=PEM``; the client certificate and key inline)."""
    protocol = cfg.kafka_security_protocol
    props = {"security.protocol": protocol}
    if protocol in ("SSL", "SASL_SSL"):
        props["ssl.endpoint.identification.algorithm"] = "https" if cfg.kafka_ssl_check_hostname else ""
        if cfg.kafka_ssl_cafile:
            props["ssl.truststore.type"] = "PEM"
            props["ssl.truststore.location"] = cfg.kafka_ssl_cafile
        if cfg.kafka_ssl_certfile:
            with open(cfg.kafka_ssl_certfile, encoding="ascii") as f:
                chain = f.read()
            key = chain
            if cfg.kafka_ssl_keyfile:
                with open(cfg.kafka_ssl_keyfile, encoding="ascii") as f:
                    key = f.read()
            props["ssl.keystore.type"] = "PEM"
            props["ssl.keystore.certificate.chain"] = _pem_blocks(chain, "CERTIFICATE")
            props["ssl.keystore.key"] = _pem_blocks(key, "PRIVATE KEY")
    if protocol.startswith("SASL_"):
        props["sasl.mechanism"] = cfg.kafka_sasl_mechanism
        props["sasl.jaas.config"] = (f"{_LOGIN_MODULES[cfg.kafka_sasl_mechanism]} required "
                                     f"username={_jaas_quote(cfg.kafka_sasl_username)} "
                                     f"password={_jaas_quote(cfg.kafka_password())};")
    return props


def _pem_blocks(text: str, kind: str) -> str:
    """The PEM blocks of ``text`` whose label ends with ``kind`` (a file may hold key and chain)."""
    out, block = [], []
    for line in text.splitlines():
        if line.startswith("-----BEGIN ") and line.rstrip("-").endswith(kind):
            block = [line]
        elif block:
            block.append(line)
            if line.startswith("-----END "):
                out.append("\n".join(block))
                block = []
    return "\n".join(out)


def spark_kafka_options(cfg: TimerConfig) -> dict[str, str]:
    """``kafka.bootstrap.servers`` and the security properties, ``kafka.``-prefixed for Spark."""
    return {"kafka.bootstrap.servers": cfg.kafka_bootstrap,
            **{f"kafka.{k}": v for k, v in kafka_java_properties(cfg).items()}}


def redis_client(cfg: TimerConfig, url: str | None = None) -> Any:
    """redis-py on ``url`` (default ``cfg.redis_url``) with the password and CA of ``cfg``."""
    import redis

    options: dict[str, Any] = {}
    password = cfg.redis_secret()
    if password:
        options["password"] = password
    if cfg.redis_ssl_cafile:
        options["ssl_ca_certs"] = cfg.redis_ssl_cafile
    return redis.Redis.from_url(url or cfg.redis_url, **options)


# -- access checks -----------------------------------------------------------------------------

_CA_SETTING = {"kafka": "TW_KAFKA_SSL_CAFILE", "redis": "TW_REDIS_SSL_CAFILE"}
_HOSTNAME_MISMATCH = 62  # X509_V_ERR_HOSTNAME_MISMATCH


def tls_refusal(server: str, where: str, exc: ssl.SSLError) -> AccessError:
    """The setting to fix for a failed TLS handshake with ``where`` (``server``: kafka or redis)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        reason = exc.verify_message or exc.reason or str(exc)
        if exc.verify_code == _HOSTNAME_MISMATCH and server == "kafka":
            return AccessError("TW_KAFKA_SSL_CHECK_HOSTNAME",
                               f"the certificate of {where} does not name that host: {reason}")
        return AccessError(_CA_SETTING[server],
                           f"the certificate of {where} is not trusted ({reason}): give the CA that signed it")
    setting = "TW_KAFKA_SECURITY_PROTOCOL" if server == "kafka" else "TW_REDIS_URL"
    return AccessError(setting, f"TLS handshake with {where} failed ({exc.reason or exc}): "
                                f"is it a TLS listener, and does it accept this client's certificate?")


def check_redis_access(cfg: TimerConfig, timeout_s: float = 10.0) -> None:
    """Raise ``AccessError`` if Redis refuses the password or its certificate is not trusted;
    return if a PING answers or Redis cannot be reached (retried elsewhere)."""
    import redis

    client = redis_client(cfg)
    client.connection_pool.connection_kwargs.update(socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    where = f"Redis at {cfg.redis_url.split('@')[-1]}"
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        setting = "TW_REDIS_PASSWORD_FILE" if cfg.redis_password_file else "TW_REDIS_PASSWORD"
        raise AccessError(setting, f"{where} refused the password: {exc}") from None
    except redis.ConnectionError as exc:
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, ssl.SSLError):
            cause = cause.__cause__ or cause.__context__
        if isinstance(cause, ssl.SSLError):
            raise tls_refusal("redis", where, cause) from None
        if "ssl" in str(exc).lower() or "certificate" in str(exc).lower():
            raise AccessError("TW_REDIS_SSL_CAFILE", f"TLS with {where} failed: {exc}") from None
    except redis.ResponseError as exc:
        if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
            raise AccessError("TW_REDIS_PASSWORD", f"{where} refused the connection: {exc}") from None
        raise
    finally:
        client.close()
