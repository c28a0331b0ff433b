"""The Spark jobs over SASL_SSL: the broker of ``secure_kafka`` (tests/infra.py: a SASL_SSL
listener, a locally made CA, SCRAM and PLAIN users), reached with the stages' own ``TW_KAFKA_*``
settings, which the jobs give Spark's Kafka source and sink as ``kafka.``-prefixed options.

- ``bulk-schedule`` (SCRAM-SHA-512) writes the valid rows to the timer topic: read back over TLS.
- ``audit`` (PLAIN) then counts them against deliveries the test writes itself.
- A wrong password, or a CA that did not sign the broker's certificate: exit 2, one line naming
  the setting to fix, no traceback (the access check runs before Spark starts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from infra import sasl_ssl_env
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from timerwheel.config import TimerConfig
from timerwheel.security import kafka_client_options

pytestmark = pytest.mark.e2e

ROWS = 40
DELIVERED = 25  # the first DELIVERED ids get a delivery, one of them twice


def spark_job(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("TW_")}
    full.update({k: v for k, v in os.environ.items() if k.startswith("TW_SPARK_")})
    full.update(env)
    return subprocess.run([sys.executable, "-m", "timerwheel.cli", *args, "--kafka", env["TW_KAFKA_BOOTSTRAP"],
                           "--master", "local[2]"], env=full, cwd=cwd, capture_output=True, text=True,
                          timeout=600, check=False)


def one_line_naming(done: subprocess.CompletedProcess[str], setting: str) -> str:
    assert done.returncode == 2, f"exit {done.returncode}:\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr and "Exception" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"timerwheel: error: {setting}: "), done.stderr[-3000:]
    return lines[0]


@pytest.fixture
def secured(secure_kafka: dict[str, str]) -> dict[str, str]:
    """sasl_ssl_env with fresh timer, DLQ and destination topics (made over SASL_SSL)."""
    run = uuid.uuid4().hex[:8]
    env = {**sasl_ssl_env(secure_kafka), "TW_TIMER_TOPIC": f"sec-timer-{run}", "TW_DLQ_TOPIC": f"sec-dlq-{run}",
           "TW_ALLOW_TOPICS": f"sec-dest-{run}"}
    admin = KafkaAdminClient(bootstrap_servers=env["TW_KAFKA_BOOTSTRAP"],
                             **kafka_client_options(TimerConfig.from_env(env)))
    try:
        admin.create_topics([NewTopic(t, 2, 1) for t in (env["TW_TIMER_TOPIC"], env["TW_DLQ_TOPIC"],
                                                          f"sec-dest-{run}")])
    finally:
        admin.close()
    return env


def test_bulk_schedule_and_audit_work_over_sasl_ssl(tmp_path: Path, secured: dict[str, str]) -> None:
    pytest.importorskip("pyspark", reason="the Spark jobs need the .[spark] extra (make setup-spark)")
    import pyarrow as pa
    import pyarrow.parquet as pq

    dest = secured["TW_ALLOW_TOPICS"]
    options = kafka_client_options(TimerConfig.from_env(secured))
    now = int(time.time() * 1000)  # rows due in the past hour: valid, and lost unless delivered
    rows = [{"id": f"s{i}", "topic": dest, "key": b"k%d" % i, "value": b"v%d" % i,
             "deliver_at_ms": str(now - 3_600_000 + i * 1000)} for i in range(ROWS)]
    rows.append({"id": "bad", "topic": "__not-allowed", "key": b"k", "value": b"v", "deliver_at_ms": str(now)})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")

    done = spark_job(secured, tmp_path, "bulk-schedule", "--input", str(tmp_path / "rows.parquet"),
                     "--rejects", str(tmp_path / "rejects"))
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "read": ROWS + 1, "scheduled": ROWS, "already_scheduled": 0, "rejected": 1}

    consumer = KafkaConsumer(bootstrap_servers=secured["TW_KAFKA_BOOTSTRAP"], group_id=None,
                             enable_auto_commit=False, **options)
    try:
        tps = [TopicPartition(secured["TW_TIMER_TOPIC"], p) for p in (0, 1)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ids: list[str] = []
        for _ in range(60):
            for recs in consumer.poll(timeout_ms=500).values():
                ids += [dict(r.headers)["tw-id"].decode() for r in recs]
            if len(ids) >= ROWS:
                break
    finally:
        consumer.close(autocommit=False)
    assert sorted(ids) == sorted(f"s{i}" for i in range(ROWS))

    producer = KafkaProducer(bootstrap_servers=secured["TW_KAFKA_BOOTSTRAP"], acks="all", **options)
    try:
        for i in [*range(DELIVERED), 0]:  # s0 twice
            at = now - 3_600_000 + i * 1000 + 50
            producer.send(dest, b"v", headers=[("tw-id", f"s{i}".encode()), ("tw-delivered-at", str(at).encode())])
        producer.flush(30)
    finally:
        producer.close()

    plain = {**secured, "TW_KAFKA_SASL_MECHANISM": "PLAIN"}
    done = spark_job(plain, tmp_path, "audit", "--out", str(tmp_path / "audit"), "--now-ms", str(now),
                     "--grace-ms", "60000")
    assert done.returncode == 0, done.stderr[-4000:]
    total = json.loads((tmp_path / "audit" / "summary.json").read_text())["total"]
    assert {k: total[k] for k in ("scheduled", "delivered", "duplicated", "lost", "pending", "early")} == {
        "scheduled": ROWS, "delivered": DELIVERED, "duplicated": 1, "lost": ROWS - DELIVERED, "pending": 0,
        "early": 0}
    assert total["lateness_ms"]["max"] == 50


def test_a_wrong_password_stops_a_spark_job_with_one_line_naming_it(tmp_path: Path, secured: dict[str, str]) -> None:
    pytest.importorskip("pyspark", reason="the Spark jobs need the .[spark] extra (make setup-spark)")
    wrong = tmp_path / "wrong-password"
    wrong.write_text("not-the-password\n")
    for mechanism in ("SCRAM-SHA-512", "PLAIN"):
        env = {**secured, "TW_KAFKA_SASL_MECHANISM": mechanism, "TW_KAFKA_SASL_PASSWORD_FILE": str(wrong)}
        line = one_line_naming(spark_job(env, tmp_path, "audit", "--out", str(tmp_path / "audit")),
                               "TW_KAFKA_SASL_PASSWORD_FILE")
        assert "not-the-password" not in line
    assert not (tmp_path / "audit").exists()


def test_an_untrusted_certificate_stops_a_spark_job_with_one_line_naming_the_ca(
    tmp_path: Path, secured: dict[str, str]
) -> None:
    pytest.importorskip("pyspark", reason="the Spark jobs need the .[spark] extra (make setup-spark)")
    key, cert = tmp_path / "other-ca.key", tmp_path / "other-ca.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=not the test CA", "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    (tmp_path / "rows.parquet").write_bytes(b"")
    done = spark_job({**secured, "TW_KAFKA_SSL_CAFILE": str(cert)}, tmp_path, "bulk-schedule",
                     "--input", str(tmp_path / "rows.parquet"), "--rejects", str(tmp_path / "rejects"))
    one_line_naming(done, "TW_KAFKA_SSL_CAFILE")
