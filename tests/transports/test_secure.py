"""Secured connections against real servers: a broker with a SASL_SSL listener (SCRAM-SHA-512
and PLAIN users, a locally made CA) and a redis-server that accepts only TLS with a password,
both started by the scripts (``secure_kafka``, ``secure_redis`` in infra.py).

A refused password or an untrusted certificate must stop a stage at once with one line naming
the setting: the stage runs as a subprocess, and a stage that retried instead would outlive
the timeout and fail the test."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from infra import sasl_ssl_env
from timerwheel.config import TimerConfig
from timerwheel.errors import AccessError
from timerwheel.records import OutRecord
from timerwheel.security import check_redis_access, redis_client
from timerwheel.transports.kafka.access import check_kafka_access
from timerwheel.transports.kafka.log import KafkaCommitLog
from timerwheel.transports.redisq import RedisLeaseStore, RedisWorkQueue

#: A stage that does not give up within this long is retrying a refusal: the test fails.
STAGE_TIMEOUT_S = 60


def other_ca(directory: Path) -> str:
    """A CA that signed nothing the servers present."""
    key, cert = directory / "other-ca.key", directory / "other-ca.pem"
    if not cert.exists():
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-subj", "/CN=not the test CA", "-keyout", str(key), "-out", str(cert)],
                       check=True, capture_output=True)
    return str(cert)


def redis_env(redis: dict[str, str]) -> dict[str, str]:
    return {k: redis[k] for k in ("TW_REDIS_URL", "TW_REDIS_PASSWORD_FILE", "TW_REDIS_SSL_CAFILE")}


@pytest.fixture(params=["SCRAM-SHA-512", "PLAIN"])
def sasl_log(request: pytest.FixtureRequest, secure_kafka: dict[str, str]) -> Iterator[KafkaCommitLog]:
    cfg = TimerConfig.from_env(sasl_ssl_env(secure_kafka, request.param))
    log = KafkaCommitLog.from_config(cfg, client_id=f"test-secure-{request.param}", request_timeout_s=10)
    yield log
    log.close()


def test_commit_log_appends_reads_and_consumes_over_sasl_ssl(sasl_log: KafkaCommitLog,
                                                             secure_kafka: dict[str, str]) -> None:
    assert sasl_log.bootstrap == secure_kafka["TW_KAFKA_SASL_SSL_BOOTSTRAP"]  # not the plaintext listener
    topic = f"secure-{uuid.uuid4().hex[:10]}"
    assert sasl_log.ensure_topic(topic, 2) == 2
    written = sasl_log.append([OutRecord(topic, b"k%d" % i, b"v%d" % i, partition=i % 2) for i in range(10)])
    assert len(written) == 10
    read = sasl_log.read(topic, written)
    assert [r.value for r in read if r is not None] == [b"v%d" % i for i in range(10)]
    consumer = sasl_log.consumer(topic, {0: 0, 1: 0})
    try:
        got: list[bytes] = []
        for _ in range(40):
            got += [r.value or b"" for r in consumer.poll(100, 0.25)]
            if len(got) == 10:
                break
    finally:
        consumer.close()
    assert sorted(got) == sorted(b"v%d" % i for i in range(10))


def test_the_access_check_accepts_both_users_and_refuses_a_wrong_password(secure_kafka: dict[str, str]) -> None:
    for mechanism in ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN"):
        check_kafka_access(TimerConfig.from_env(sasl_ssl_env(secure_kafka, mechanism)))
    wrong = {**sasl_ssl_env(secure_kafka, "PLAIN"), "TW_KAFKA_SASL_PASSWORD_FILE": "", "TW_KAFKA_SASL_PASSWORD": "no"}
    with pytest.raises(AccessError) as info:
        check_kafka_access(TimerConfig.from_env(wrong))
    assert info.value.setting == "TW_KAFKA_SASL_PASSWORD"
    # TLS to the plaintext listener: the protocol is what is wrong.
    with pytest.raises(AccessError) as info:
        check_kafka_access(TimerConfig.from_env({**sasl_ssl_env(secure_kafka),
                                                 "TW_KAFKA_BOOTSTRAP": secure_kafka["TW_KAFKA_BOOTSTRAP"]}))
    assert info.value.setting == "TW_KAFKA_SECURITY_PROTOCOL"


def run_stage(tmp_path: Path, env: dict[str, str], stage: str = "enqueue-get") -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("TW_")}
    run = uuid.uuid4().hex[:8]  # a data directory per run: it stores the timer topic it was made with
    full.update({"TW_DATA_DIR": str(tmp_path / f"data-{run}"), "TW_TIMER_TOPIC": f"secure-timer-{run}", **env})
    return subprocess.run([sys.executable, "-m", "timerwheel.cli", "stage", stage], capture_output=True, text=True,
                          env=full, timeout=STAGE_TIMEOUT_S, check=False)


def refused_with_one_line(done: subprocess.CompletedProcess[str], setting: str) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0, f"exit 0; stderr:\n{done.stderr[-2000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    naming = [line for line in lines if setting in line]
    assert len(naming) == 1 and naming[0].startswith(f"timerwheel: error: {setting}: "), done.stderr[-3000:]
    assert len(lines) <= 3, f"more than the error line:\n{done.stderr[-3000:]}"
    return naming[0]


def test_a_wrong_kafka_password_stops_a_stage_with_one_line_naming_it(
    tmp_path: Path, secure_kafka: dict[str, str], secure_redis: dict[str, str]
) -> None:
    wrong = tmp_path / "wrong-password"
    wrong.write_text("not-the-password\n")
    env = {**sasl_ssl_env(secure_kafka), "TW_KAFKA_SASL_PASSWORD_FILE": str(wrong), **redis_env(secure_redis)}
    line = refused_with_one_line(run_stage(tmp_path, env), "TW_KAFKA_SASL_PASSWORD_FILE")
    assert "not-the-password" not in line


def test_an_untrusted_kafka_certificate_stops_a_stage_with_one_line_naming_it(
    tmp_path: Path, secure_kafka: dict[str, str], secure_redis: dict[str, str]
) -> None:
    env = {**sasl_ssl_env(secure_kafka), "TW_KAFKA_SSL_CAFILE": other_ca(tmp_path), **redis_env(secure_redis)}
    line = refused_with_one_line(run_stage(tmp_path, env), "TW_KAFKA_SSL_CAFILE")
    assert "not trusted" in line


def test_redis_queues_and_leases_work_over_tls_with_a_password(secure_redis: dict[str, str]) -> None:
    assert secure_redis["TW_REDIS_URL"].startswith("rediss://")
    cfg = TimerConfig.from_env(redis_env(secure_redis))
    check_redis_access(cfg)
    client = redis_client(cfg)
    try:
        q = RedisWorkQueue(client, f"secure-{uuid.uuid4().hex[:8]}", 1, 10)
        q.put(0, [b"a", b"b"], timeout_s=1)
        got = q.get(0, "c", 10, 1)
        assert [p for _, p in got] == [b"a", b"b"]
        q.ack(0, [i for i, _ in got])
        leases = RedisLeaseStore(client, prefix=f"tw:lease:{uuid.uuid4().hex[:8]}")
        assert leases.acquire("enqueue-put", 0, "me", 5_000) == 1
    finally:
        client.close()


def test_a_wrong_redis_password_or_an_untrusted_redis_certificate_stops_a_stage(
    tmp_path: Path, secure_kafka: dict[str, str], secure_redis: dict[str, str]
) -> None:
    kafka = sasl_ssl_env(secure_kafka)
    wrong = {**redis_env(secure_redis), "TW_REDIS_PASSWORD_FILE": "", "TW_REDIS_PASSWORD": "not-it"}
    refused_with_one_line(run_stage(tmp_path, {**kafka, **wrong}), "TW_REDIS_PASSWORD")
    untrusted = {**redis_env(secure_redis), "TW_REDIS_SSL_CAFILE": other_ca(tmp_path)}
    refused_with_one_line(run_stage(tmp_path, {**kafka, **untrusted}), "TW_REDIS_SSL_CAFILE")


def test_the_cli_schedules_over_sasl_ssl(tmp_path: Path, secure_kafka: dict[str, str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TW_")}
    env.update(sasl_ssl_env(secure_kafka))
    timer_topic = f"secure-timer-{uuid.uuid4().hex[:8]}"
    done = subprocess.run([sys.executable, "-m", "timerwheel.cli", "schedule", "--kafka", env["TW_KAFKA_BOOTSTRAP"],
                           "--data-dir", str(tmp_path), "--timer-topic", timer_topic, "--topic", "orders",
                           "--delay-ms", "60000", "--value", "hello"],
                          capture_output=True, text=True, env=env, timeout=STAGE_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    log = KafkaCommitLog.from_config(TimerConfig.from_env(sasl_ssl_env(secure_kafka)))
    try:
        consumer = log.consumer(timer_topic, log.start_offsets(timer_topic))
        records = []
        for _ in range(40):
            records += consumer.poll(10, 0.25)
            if records:
                break
        consumer.close()
    finally:
        log.close()
    assert [r.value for r in records] == [b"hello"]
