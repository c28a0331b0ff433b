"""Real Kafka and Redis for the test suites (tests/ and e2e/ both import these fixtures).

``kafka_bootstrap`` and ``redis_url`` use ``TW_KAFKA_BOOTSTRAP`` / ``TW_REDIS_URL`` when set;
otherwise they run ``scripts/kafka.sh up`` / ``scripts/redis.sh up`` once per session (the first
Kafka start on a fresh machine fetches the broker with Maven: a few minutes) and read the address
from ``.run/*.env``. A server that cannot be started FAILS the test with the reason: a suite
that silently skips its real-server tests proves nothing. Servers this session started are
stopped at its end (keep them for the next run with ``TW_KEEP_SERVERS=1``).

``kafka_control`` / ``redis_control`` stop, start and restart the script-managed servers for
chaos tests; against servers named by the environment they skip, as they cannot restart those.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / ".run"

#: Ports ``free_port`` hands out: under the kernel's ephemeral range (32768 by default) and under
#: Kubernetes' NodePorts (30000-32767), which kube-proxy redirects on this node's addresses too.
_PORTS = range(20_000, 30_000)


def _unused_ports() -> Iterator[int]:
    """Each port of ``_PORTS`` below the ephemeral range once, in a random order."""
    low = min(_ephemeral_low(), _PORTS.stop)
    yield from random.sample(range(_PORTS.start, low), k=low - _PORTS.start)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


_ports = _unused_ports()


def free_port() -> int:
    """A port nothing listens on, for a server a test starts, never handed out before in this run.

    Not a port bound to 0: that comes from the ephemeral range, and between closing it and the
    server's bind any outgoing connection (the stages' own Kafka and Redis clients, starting
    meanwhile) may take it as its local port. A stage then refused TW_HTTP_PORT with "Address
    already in use" (one run of the suite in ~680 tests). Below that range only explicit binds
    take ports."""
    for port in _ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise AssertionError(f"no free port left in {_PORTS.start}-{min(_ephemeral_low(), _PORTS.stop) - 1}")


#: The first Kafka start downloads the broker; later ones take seconds.
_UP_TIMEOUT_S = 900


def _script(name: str, verb: str, timeout_s: float = 300, env: dict[str, str] | None = None,
            args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ROOT / "scripts" / f"{name}.sh"), verb, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        env={**os.environ, **(env or {})},
    )


def _read_env(name: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (RUN / f"{name}.env").read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


class ServerControl:
    """Stop / start / restart one script-managed server (``scripts/NAME.sh``)."""

    def __init__(self, name: str, address: str, managed: bool) -> None:
        self.name = name
        self.address = address
        self.managed = managed

    def _run(self, verb: str) -> None:
        if not self.managed:
            pytest.skip(f"{self.name} at {self.address} comes from the environment; only a server "
                        f"started by scripts/{self.name}.sh can be {verb}ed")
        done = _script(self.name, verb, timeout_s=_UP_TIMEOUT_S)
        if done.returncode != 0:
            pytest.fail(f"scripts/{self.name}.sh {verb} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}",
                        pytrace=False)

    def stop(self) -> None:
        self._run("stop")

    def start(self) -> None:
        self._run("start")

    def restart(self) -> None:
        self._run("restart")


def _server(name: str, env_var: str, what: str) -> Iterator[ServerControl]:
    given = os.environ.get(env_var, "").strip()
    managed_env = RUN / f"{name}.env"
    if given:
        # The variable may name the script-managed server itself (`. .run/kafka.env`).
        managed = managed_env.exists() and _read_env(name).get(env_var) == given
        yield ServerControl(name, given, managed)
        return
    was_running = _script(name, "status", timeout_s=60).returncode == 0
    try:
        done = _script(name, "up", timeout_s=_UP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} did not start within {_UP_TIMEOUT_S}s (scripts/{name}.sh up); "
                    f"set {env_var} to use a running server", pytrace=False)
    if done.returncode != 0 or not managed_env.exists():
        pytest.fail(
            f"{what} could not be started by scripts/{name}.sh up (exit {done.returncode}); "
            f"set {env_var} to use a running server.\n{done.stderr.strip()[-3000:]}",
            pytrace=False,
        )
    address = _read_env(name).get(env_var, "")
    if not address:
        pytest.fail(f"scripts/{name}.sh up wrote no {env_var} into {managed_env}", pytrace=False)
    try:
        yield ServerControl(name, address, managed=True)
    finally:
        if not was_running and os.environ.get("TW_KEEP_SERVERS", "") not in ("1", "true", "yes"):
            _script(name, "down", timeout_s=120)


@pytest.fixture(scope="session")
def kafka_control() -> Iterator[ServerControl]:
    yield from _server("kafka", "TW_KAFKA_BOOTSTRAP", "Kafka")


@pytest.fixture(scope="session")
def redis_control() -> Iterator[ServerControl]:
    yield from _server("redis", "TW_REDIS_URL", "Redis")


@pytest.fixture(scope="session")
def kafka_bootstrap(kafka_control: ServerControl) -> str:
    """``host:port`` of a running Kafka broker."""
    return kafka_control.address


@pytest.fixture(scope="session")
def redis_url(redis_control: ServerControl) -> str:
    """``redis://host:port/db`` of a running Redis server."""
    return redis_control.address


#: The second broker of ``kafka_noauto_bootstrap``: ``scripts/kafka.sh`` with these variables.
NOAUTO_ENV = {"TW_KAFKA_INSTANCE": "noauto", "TW_KAFKA_AUTO_CREATE": "false"}


@pytest.fixture(scope="session")
def kafka_noauto_bootstrap() -> Iterator[str]:
    """``host:port`` of a second broker that never creates a topic on first use (the default of
    managed Kafka services): ``TW_KAFKA_INSTANCE=noauto TW_KAFKA_AUTO_CREATE=false
    scripts/kafka.sh up``, stopped at the end of the session like the first."""
    for settings in _instance("kafka", NOAUTO_ENV, "kafka-noauto", ("TW_KAFKA_BOOTSTRAP",)):
        yield settings["TW_KAFKA_BOOTSTRAP"]


#: The broker with a SASL_SSL listener beside its plaintext one (``secure_kafka``).
SECURE_KAFKA_ENV = {"TW_KAFKA_INSTANCE": "secure", "TW_KAFKA_SASL_SSL": "true"}
#: The redis-server that accepts only TLS and requires a password (``secure_redis``).
SECURE_REDIS_ENV = {"TW_REDIS_INSTANCE": "secure", "TW_REDIS_TLS": "true"}


def _instance(script: str, env: dict[str, str], env_name: str, keys: tuple[str, ...]) -> Iterator[dict[str, str]]:
    """A second, script-managed server started with ``env`` (session scope): the settings its
    ``.env`` holds. FAILS, saying what is missing, when it cannot be started."""
    command = " ".join(f"{k}={v}" for k, v in env.items()) + f" scripts/{script}.sh up"
    was_running = _script(script, "status", timeout_s=60, env=env).returncode == 0
    try:
        done = _script(script, "up", timeout_s=_UP_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{command} did not finish within {_UP_TIMEOUT_S}s", pytrace=False)
    env_file = RUN / f"{env_name}.env"
    if done.returncode != 0 or not env_file.exists():
        pytest.fail(f"{command} failed (exit {done.returncode}):\n{done.stderr.strip()[-3000:]}", pytrace=False)
    settings = _read_env(env_name)
    missing = [k for k in keys if not settings.get(k)]
    if missing:
        pytest.fail(f"{command} wrote no {', '.join(missing)} into {env_file}", pytrace=False)
    try:
        yield settings
    finally:
        if not was_running and os.environ.get("TW_KEEP_SERVERS", "") not in ("1", "true", "yes"):
            _script(script, "down", timeout_s=120, env=env)


@pytest.fixture(scope="session")
def secure_kafka() -> Iterator[dict[str, str]]:
    """A broker with a plaintext listener (``TW_KAFKA_BOOTSTRAP``) and a SASL_SSL one
    (``TW_KAFKA_SASL_SSL_BOOTSTRAP``, CA file, user, password file): scripts/kafka.sh with
    ``SECURE_KAFKA_ENV``."""
    yield from _instance("kafka", SECURE_KAFKA_ENV, "kafka-secure",
                         ("TW_KAFKA_BOOTSTRAP", "TW_KAFKA_SASL_SSL_BOOTSTRAP", "TW_KAFKA_SASL_SSL_CAFILE",
                          "TW_KAFKA_SASL_SSL_USERNAME", "TW_KAFKA_SASL_SSL_PASSWORD_FILE"))


@pytest.fixture(scope="session")
def secure_redis() -> Iterator[dict[str, str]]:
    """A redis-server requiring TLS and a password: ``TW_REDIS_URL`` (rediss://),
    ``TW_REDIS_PASSWORD_FILE``, ``TW_REDIS_SSL_CAFILE``."""
    yield from _instance("redis", SECURE_REDIS_ENV, "redis-secure",
                         ("TW_REDIS_URL", "TW_REDIS_PASSWORD_FILE", "TW_REDIS_SSL_CAFILE"))


def sasl_ssl_env(kafka: dict[str, str], mechanism: str = "SCRAM-SHA-512") -> dict[str, str]:
    """The ``TW_*`` settings of a client of ``secure_kafka``'s SASL_SSL listener."""
    return {
        "TW_KAFKA_BOOTSTRAP": kafka["TW_KAFKA_SASL_SSL_BOOTSTRAP"],
        "TW_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "TW_KAFKA_SASL_MECHANISM": mechanism,
        "TW_KAFKA_SASL_USERNAME": kafka["TW_KAFKA_SASL_SSL_USERNAME"],
        "TW_KAFKA_SASL_PASSWORD_FILE": kafka["TW_KAFKA_SASL_SSL_PASSWORD_FILE"],
        "TW_KAFKA_SSL_CAFILE": kafka["TW_KAFKA_SASL_SSL_CAFILE"],
    }


#: The three-broker KRaft cluster of ``kafka_cluster3``: scripts/kafka.sh with these variables.
CLUSTER3_ENV = {"TW_KAFKA_INSTANCE": "cluster3", "TW_KAFKA_BROKERS": "3"}


class KafkaCluster:
    """Three script-managed brokers (``kafka_cluster3``): replication factor 3 and min.insync.replicas
    2 for new topics, the offsets and the transaction state log. Broker ``i`` (1..3) is the one
    with node.id ``i``; ``kill``, ``stop``, ``start`` and ``restart`` act on it alone, through
    ``scripts/kafka.sh VERB i``, and ``start`` returns once it is registered and unfenced."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        #: Broker i's own address is ``addresses[i - 1]``.
        self.addresses = bootstrap.split(",")

    def _run(self, verb: str, broker: int) -> None:
        done = _script("kafka", verb, timeout_s=_UP_TIMEOUT_S, env=CLUSTER3_ENV, args=(str(broker),))
        if done.returncode != 0:
            pytest.fail(f"scripts/kafka.sh {verb} {broker} (cluster3) failed (exit {done.returncode}): "
                        f"{done.stderr.strip()[-2000:]}", pytrace=False)

    def kill(self, broker: int) -> None:
        """SIGKILL: no controlled shutdown, the partitions it led are leaderless until the
        controller fences it (6 s without a heartbeat) and elects others."""
        self._run("kill", broker)

    def stop(self, broker: int) -> None:
        self._run("stop", broker)

    def start(self, broker: int) -> None:
        self._run("start", broker)

    def restart(self, broker: int) -> None:
        self._run("restart", broker)

    def partitions(self, topic: str) -> list[dict[str, Any]]:
        """The topic's partitions as the cluster describes them (``leader_id``, ``replica_nodes``,
        ``isr_nodes``), by partition index."""
        from kafka import KafkaAdminClient

        admin = KafkaAdminClient(bootstrap_servers=self.bootstrap, client_id="tw-test-cluster3")
        try:
            (found,) = admin.describe_topics([topic])
        finally:
            admin.close()
        return sorted(found["partitions"], key=lambda p: int(p["partition_index"]))

    def wait_in_sync(self, topic: str, timeout_s: float = 120) -> None:
        """Until every partition of ``topic`` has a leader and all its replicas in sync: a broker
        started again has caught up, so killing another leaves min.insync.replicas; a topic just
        made is known to the cluster."""
        from kafka.errors import KafkaError

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                parts = self.partitions(topic)
            except KafkaError:  # a topic just made: the broker asked may not know it yet
                parts = []
            if parts and all(p["leader_id"] >= 0 and sorted(p["isr_nodes"]) == sorted(p["replica_nodes"])
                             for p in parts):
                return
            if time.monotonic() > deadline:
                pytest.fail(f"{topic} not fully in sync within {timeout_s:.0f} s: {parts}", pytrace=False)
            time.sleep(0.2)


def prime_internal_topics(bootstrap: str) -> None:
    """Make the consumer offsets and transaction state topics while all three brokers run: Kafka
    creates them at first use with replication factor 3, which it refuses with a broker down."""
    from kafka import KafkaAdminClient, KafkaProducer
    from kafka.errors import CoordinatorNotAvailableError

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="tw-test-cluster3")
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                admin.describe_groups(["tw-test-cluster3-prime"])  # finds (so makes) the group coordinator
                break
            except CoordinatorNotAvailableError:  # the offsets topic is being made
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    finally:
        admin.close()
    producer = KafkaProducer(bootstrap_servers=bootstrap, transactional_id="tw-test-cluster3-prime")
    try:
        producer.init_transactions()  # finds (so makes) the transaction coordinator
    finally:
        producer.close(timeout=10)


@pytest.fixture(scope="session")
def kafka_cluster3() -> Iterator[KafkaCluster]:
    """A KRaft cluster of three brokers, each broker and controller (``TW_KAFKA_INSTANCE=cluster3
    TW_KAFKA_BROKERS=3 scripts/kafka.sh up``), its internal topics made; started only for the
    tests that ask for it and stopped at the end of the session like the others."""
    for settings in _instance("kafka", CLUSTER3_ENV, "kafka-cluster3", ("TW_KAFKA_BOOTSTRAP",)):
        prime_internal_topics(settings["TW_KAFKA_BOOTSTRAP"])
        yield KafkaCluster(settings["TW_KAFKA_BOOTSTRAP"])
