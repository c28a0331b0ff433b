"""How the operator reaches the TimerWheel's Kafka: with the stages' own TLS and SASL settings.

The stages read ``spec.kafka``'s Secret as files of its mount (``spec.KAFKA_SECRET_DIR``). The
operator has no such mount (one operator serves many TimerWheels), so ``access`` reads the Secret
through the API server (``get`` on secrets in the Role), writes each key the spec names into a
private directory of the operator's own (0700, files 0600, rewritten only when they change), and
turns the stages' settings pointed at those files into kafka-python options with the same code the
stages use (``timerwheel.security.kafka_client_options``).

Anything missing (the Secret, a key it names) raises ``AccessUnknown`` naming the spec field; the
retention check shows it as Unknown, and a window change that needs more retention is refused
with it.
"""

from __future__ import annotations

import base64
import binascii
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from timerwheel.config import TimerConfig
from timerwheel.errors import ConfigError
from timerwheel.files import atomic_write
from timerwheel.security import kafka_client_options

from timerwheel_operator.kube import Cluster
from timerwheel_operator.spec import KAFKA_SECRET_FILES, Wheel

#: Where the Secret's keys are written: /tmp is the operator pod's emptyDir.
SECRET_ROOT = os.path.join(tempfile.gettempdir(), "timerwheel-operator-kafka")


class AccessUnknown(Exception):
    """The Kafka settings cannot be made: the message names the spec field to fix."""


@dataclass(frozen=True, slots=True)
class Access:
    """A Kafka to reach: its bootstrap servers and kafka-python's security options (none: plain)."""

    bootstrap: str
    options: tuple[tuple[str, Any], ...] = ()
    #: the stages' settings as this process has them (None: plaintext, nothing to check)
    config: TimerConfig | None = None

    def client_options(self) -> dict[str, Any]:
        return dict(self.options)


def access(wheel: Wheel, cluster: Cluster, root: str = SECRET_ROOT) -> Access:
    """``wheel``'s Kafka as its stages reach it. Reads ``spec.kafka.secretName`` only when the
    spec names keys of it."""
    bootstrap = wheel.config.kafka_bootstrap or ""
    if wheel.config.kafka_security_protocol == "PLAINTEXT":
        return Access(bootstrap)
    env = dict(wheel.env)
    named = {var: os.path.basename(env[var]) for var in KAFKA_SECRET_FILES.values() if env.get(var)}
    if named:
        data = _secret_data(wheel, cluster)
        where = os.path.join(root, f"{wheel.namespace}.{wheel.name}")
        os.makedirs(where, mode=0o700, exist_ok=True)
        for var, key in named.items():
            if key not in data:
                field = next(f for f, v in KAFKA_SECRET_FILES.items() if v == var)
                raise AccessUnknown(f"spec.kafka.{field}: Secret {wheel.kafka_secret} has no key {key!r}")
            env[var] = _written(os.path.join(where, key), data[key])
    try:
        config = TimerConfig.from_env({**env, "TW_REDIS_URL": "redis://unused"})
    except ConfigError as exc:
        raise AccessUnknown(str(exc)) from None
    return Access(bootstrap, tuple(sorted(kafka_client_options(config).items())), config)


def _secret_data(wheel: Wheel, cluster: Cluster) -> dict[str, bytes]:
    try:
        secret = cluster.get("v1", "Secret", wheel.namespace, str(wheel.kafka_secret))
    except Exception as exc:  # noqa: BLE001 - RBAC, API server: said where the check is shown
        raise AccessUnknown(f"spec.kafka.secretName: cannot read Secret {wheel.kafka_secret}: "
                            f"{getattr(exc, 'reason', None) or exc}") from None
    if secret is None:
        raise AccessUnknown(f"spec.kafka.secretName: Secret {wheel.kafka_secret} does not exist in "
                            f"{wheel.namespace}")
    out = {}
    for key, value in (secret.get("data") or {}).items():
        try:
            out[key] = base64.b64decode(value or "", validate=True)
        except (binascii.Error, ValueError):
            raise AccessUnknown(f"spec.kafka.secretName: key {key!r} of Secret {wheel.kafka_secret} is not "
                                "base64") from None
    for key, value in (secret.get("stringData") or {}).items():
        out.setdefault(key, str(value).encode())
    return out


def _written(path: str, content: bytes) -> str:
    """``path`` holding ``content`` (mode 0600), written only when it holds something else."""
    try:
        with open(path, "rb") as f:
            if f.read() == content:
                return path
    except FileNotFoundError:
        pass
    atomic_write(path, content, fsync=False)
    os.chmod(path, 0o600)
    return path
