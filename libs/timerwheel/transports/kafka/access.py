"""The access check: before a stage starts, does Kafka accept this client's TLS and SASL
settings? A refusal names the setting to fix (``AccessError``); a broker that cannot be reached
returns quietly (the caller waits for it as before).

Why a check of its own: a wrong password or an untrusted certificate is not an outage (retrying
cannot help), and kafka-python's clients cannot tell it from one. Measured with kafka-python
3.0.12 against the test broker's SASL_SSL listener: a wrong SCRAM or PLAIN password, a CA that
did not sign the broker's certificate and TLS to the plaintext listener all end the same way,
``KafkaTimeoutError: Unable to bootstrap`` after ``bootstrap_timeout_ms`` (the bootstrap loop
retries every connection failure and keeps none of them).

So the check connects to the first bootstrap broker that answers itself, and lets kafka-python
do the talking: the TLS handshake with the configured CA (as kafka-python builds its context
from the same options), then ``ApiVersions`` and, for SASL, ``SaslHandshake`` and
``SaslAuthenticate`` with kafka-python's own request classes, framing (``KafkaProtocol``, a
sans-I/O parser) and SASL mechanisms (PLAIN, SCRAM); a refusal is told by kafka-python's error
type for the broker's error code. Nothing of the protocol is written here but moving its bytes
over the socket. Checked against kafka-python 3.0.0 and 3.0.12. Secrets never reach a message.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from typing import Any

import kafka.errors as kafka_errors
from kafka.net.sasl import get_sasl_mechanism
from kafka.protocol.metadata import ApiVersionsRequest
from kafka.protocol.parser import KafkaProtocol
from kafka.protocol.sasl import SaslAuthenticateRequest, SaslHandshakeRequest

from timerwheel.config import TimerConfig
from timerwheel.errors import AccessError
from timerwheel.security import kafka_client_options, tls_refusal

__all__ = ["check_kafka_access", "kafka_unreachable"]


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
                    raise tls_refusal("kafka", where, exc) from None
                except OSError:
                    continue
            broker = _Broker(sock)
            try:
                # TLS 1.3: a broker refuses a client certificate only after the handshake, so a
                # request is made in any case.
                broker.call(ApiVersionsRequest(version=0))
                if protocol.startswith("SASL_"):
                    _sasl_authenticate(broker, cfg, host)
            except ssl.SSLError as exc:
                raise tls_refusal("kafka", where, exc) from None
            except (OSError, EOFError, kafka_errors.KafkaProtocolError):
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


class _Broker:
    """Requests to one broker over a connected socket, encoded and decoded by kafka-python."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._protocol = KafkaProtocol(client_id="timerwheel-access-check")

    def call(self, request: Any) -> Any:
        """Send ``request`` and return its response."""
        self._protocol.send_request(request)
        self._sock.sendall(self._protocol.send_bytes())
        while True:
            data = self._sock.recv(65536)
            if not data:
                raise EOFError("connection closed")
            for _correlation_id, response in self._protocol.receive_bytes(data):
                return response


class _Refused(Exception):
    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting


def _sasl_authenticate(broker: _Broker, cfg: TimerConfig, host: str) -> None:
    """SaslHandshake v1 and SaslAuthenticate v1 with kafka-python's PLAIN / SCRAM mechanism.
    Raises ``_Refused`` naming the setting."""
    answer = broker.call(SaslHandshakeRequest(version=1, mechanism=cfg.kafka_sasl_mechanism))
    if answer.error_code != 0:
        offered = ", ".join(answer.mechanisms) or "none"
        raise _Refused("TW_KAFKA_SASL_MECHANISM", f"mechanism not enabled on the broker (it offers {offered})")
    mechanism = get_sasl_mechanism(cfg.kafka_sasl_mechanism)(host=host, **kafka_client_options(cfg))
    password = "TW_KAFKA_SASL_PASSWORD_FILE" if cfg.kafka_sasl_password_file else "TW_KAFKA_SASL_PASSWORD"
    while not mechanism.is_done():
        answer = broker.call(SaslAuthenticateRequest(version=1, auth_bytes=mechanism.auth_bytes()))
        if answer.error_code != 0:
            raise _Refused(password, answer.error_message or kafka_errors.for_code(answer.error_code).__name__)
        mechanism.receive(answer.auth_bytes)
    if not mechanism.is_authenticated():
        raise _Refused(password, "the broker's final SCRAM message did not verify")
