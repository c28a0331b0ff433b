"""Secured connections: the one place that turns ``TimerConfig`` into Kafka and Redis client options.

- ``kafka_client_options(cfg)``: the kafka-python keyword arguments (TLS, SASL) every Kafka
  client timerwheel makes takes (``KafkaCommitLog._common``: stages, ``TimerClient``, CLI).
- ``kafka_java_properties(cfg)``: the same settings as Kafka Java client properties
  (``security.protocol``, ``sasl.jaas.config``, ``ssl.truststore.*``); ``spark_kafka_options``
  prefixes them with ``kafka.`` for Spark's Kafka source and sink.
- ``redis_client(cfg)``: redis-py on ``TW_REDIS_URL`` with the password and CA.

A wrong password or a certificate that is not trusted is not an outage: retrying cannot help,
and kafka-python cannot tell it from one (the broker closes the connection; the client retries
until ``Unable to bootstrap``). So before a stage starts, ``check_kafka_access`` connects to a
bootstrap broker itself: the TLS handshake with the configured CA, then SASL (SaslHandshake,
SaslAuthenticate v1, the mechanism of kafka-python). A refusal raises ``AccessError`` naming
the setting to fix; a broker that cannot be reached returns quietly (the caller waits for it
as before). ``check_redis_access`` does the same with a PING. Secrets never reach a message.
"""

from __future__ import annotations

import socket
import ssl
import struct
from collections.abc import Iterator
from typing import Any

from timerwheel.config import TimerConfig
from timerwheel.errors import AccessError

__all__ = ["check_kafka_access", "check_redis_access", "kafka_client_options", "kafka_java_properties",
           "kafka_unreachable", "redis_client", "spark_kafka_options"]


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


def _tls_refusal(server: str, where: str, exc: ssl.SSLError) -> AccessError:
    """The setting to fix for a failed TLS handshake with ``where``."""
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


def _ssl_context(cfg: TimerConfig) -> ssl.SSLContext:
    """As kafka-python builds it from the same options."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = cfg.kafka_ssl_check_hostname
    if cfg.kafka_ssl_cafile:
        ctx.load_verify_locations(cfg.kafka_ssl_cafile)
    else:
        ctx.load_default_certs()
    if cfg.kafka_ssl_certfile:
        ctx.load_cert_chain(cfg.kafka_ssl_certfile, cfg.kafka_ssl_keyfile or None)
    return ctx


def check_kafka_access(cfg: TimerConfig, bootstrap: str | None = None, timeout_s: float = 10.0) -> None:
    """Raise ``AccessError`` if the first bootstrap broker that answers refuses this client's TLS
    or SASL settings; return if it accepts them or none answers (unreachable is retried elsewhere)."""
    protocol = cfg.kafka_security_protocol
    if protocol == "PLAINTEXT":
        return
    for server, host, port in _servers(bootstrap or cfg.kafka_bootstrap):
        try:
            raw = socket.create_connection((host, port), timeout=timeout_s)
        except OSError:
            continue
        where = f"Kafka at {server}"
        with raw:
            sock: socket.socket = raw
            if protocol in ("SSL", "SASL_SSL"):
                try:
                    sock = _ssl_context(cfg).wrap_socket(raw, server_hostname=host)
                except ssl.SSLError as exc:
                    raise _tls_refusal("kafka", where, exc) from None
                except OSError:
                    continue
            try:
                if protocol.startswith("SASL_"):
                    _sasl_authenticate(sock, cfg, host)
                else:  # TLS 1.3: a broker refuses a client certificate only after the handshake
                    _call(sock, iter(range(1, 10)), 18, 0, b"")  # ApiVersions
            except ssl.SSLError as exc:
                raise _tls_refusal("kafka", where, exc) from None
            except (OSError, EOFError, struct.error):
                continue
            except _Refused as exc:
                raise AccessError(exc.setting, f"{where} refused SASL {cfg.kafka_sasl_mechanism} for user "
                                               f"{cfg.kafka_sasl_username!r}: {exc}") from None
        return


def kafka_unreachable(bootstrap: str, timeout_s: float = 3.0) -> str | None:
    """Why no bootstrap server of ``bootstrap`` accepts a connection (``host:port: Connection
    refused; ...``), or None when one does. kafka-python tells only after its bootstrap timeout
    (30 s): a process says at once that it waits for a Kafka it cannot reach."""
    why = []
    for server, host, port in _servers(bootstrap):
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            return None
        except OSError as exc:
            why.append(f"{server}: {exc.strerror or exc}")
    return "; ".join(why) or f"no server in {bootstrap!r}"


def _servers(bootstrap: str) -> Iterator[tuple[str, str, int]]:
    """(``host:port`` as given, host, port) of each bootstrap server that names a port."""
    for server in bootstrap.split(","):
        host, _, port = server.strip().rpartition(":")
        if port.isdigit():
            yield server.strip(), host.strip("[]"), int(port)


class _Refused(Exception):
    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting


def _sasl_authenticate(sock: socket.socket, cfg: TimerConfig, host: str) -> None:
    """SaslHandshake v1 and SaslAuthenticate v1 (Kafka's protocol, non-flexible versions),
    with kafka-python's PLAIN / SCRAM mechanism. Raises ``_Refused`` naming the setting."""
    from kafka.net.sasl import get_sasl_mechanism

    correlation = iter(range(1, 1_000))

    def call(api_key: int, version: int, body: bytes) -> bytes:
        return _call(sock, correlation, api_key, version, body)

    mechanism_name = cfg.kafka_sasl_mechanism.encode()
    answer = call(17, 1, struct.pack(">h", len(mechanism_name)) + mechanism_name)
    error = struct.unpack(">h", answer[:2])[0]
    if error != 0:
        enabled = _strings(answer[2:])
        raise _Refused("TW_KAFKA_SASL_MECHANISM", f"mechanism not enabled on the broker (it offers "
                                                  f"{', '.join(enabled) or 'none'})")
    mechanism = get_sasl_mechanism(cfg.kafka_sasl_mechanism)(host=host, **kafka_client_options(cfg))
    while not mechanism.is_done():
        token = mechanism.auth_bytes()
        answer = call(36, 1, struct.pack(">i", len(token)) + token)
        error = struct.unpack(">h", answer[:2])[0]
        n = struct.unpack(">h", answer[2:4])[0]
        message = answer[4:4 + n].decode("utf-8", "replace") if n >= 0 else ""
        rest = answer[4 + max(n, 0):]
        if error != 0:
            password = "TW_KAFKA_SASL_PASSWORD_FILE" if cfg.kafka_sasl_password_file else "TW_KAFKA_SASL_PASSWORD"
            raise _Refused(password, message or f"error code {error}")
        size = struct.unpack(">i", rest[:4])[0]
        mechanism.receive(rest[4:4 + size] if size >= 0 else b"")
    if not mechanism.is_authenticated():
        raise _Refused("TW_KAFKA_SASL_PASSWORD", "the broker's final SCRAM message did not verify")


def _call(sock: socket.socket, correlation: Iterator[int], api_key: int, version: int, body: bytes) -> bytes:
    """One request with a v1 header (non-flexible), its response body."""
    cid = next(correlation)
    client_id = b"timerwheel-access-check"
    header = struct.pack(">hhih", api_key, version, cid, len(client_id)) + client_id
    payload = header + body
    sock.sendall(struct.pack(">i", len(payload)) + payload)
    size = struct.unpack(">i", _recv(sock, 4))[0]
    response = _recv(sock, size)
    if struct.unpack(">i", response[:4])[0] != cid:
        raise EOFError("unexpected correlation id")
    return response[4:]


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("connection closed")
        data += chunk
    return data


def _strings(data: bytes) -> list[str]:
    count = struct.unpack(">i", data[:4])[0]
    out, at = [], 4
    for _ in range(max(count, 0)):
        n = struct.unpack(">h", data[at:at + 2])[0]
        out.append(data[at + 2:at + 2 + n].decode("utf-8", "replace"))
        at += 2 + n
    return out


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
            raise _tls_refusal("redis", where, cause) from None
        if "ssl" in str(exc).lower() or "certificate" in str(exc).lower():
            raise AccessError("TW_REDIS_SSL_CAFILE", f"TLS with {where} failed: {exc}") from None
    except redis.ResponseError as exc:
        if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
            raise AccessError("TW_REDIS_PASSWORD", f"{where} refused the connection: {exc}") from None
        raise
    finally:
        client.close()
