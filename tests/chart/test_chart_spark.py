"""The chart's optional Spark jobs, offline: off by default; on, the audit CronJob and the
bulk-schedule Job render valid Kubernetes 1.34 manifests running the CLI's own commands in the
Spark image, with the secure pod defaults and a writable /tmp; bad values are refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from test_chart import CHART, KUBE_VERSION, SCHEMA_VERSION, helm, run, template
from timerwheel.cli import make_parser
from timerwheel_operator.spec import KAFKA_SECRET_DIR, kafka_env

__all__ = ["helm"]

SPARK = Path(__file__).with_name("spark-values.yaml")


def _jobs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for d in docs:
        if d["kind"] == "CronJob":
            out["audit"] = d["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        elif d["kind"] == "Job" and d["metadata"]["labels"]["app.kubernetes.io/component"] == "spark-bulk":
            out["bulk"] = d["spec"]["template"]["spec"]
    return out


def test_spark_jobs_are_off_by_default(helm: str) -> None:
    assert _jobs(template(helm)) == {}


def test_spark_jobs_render_valid_manifests_running_the_cli(helm: str) -> None:
    docs = template(helm, "-f", str(SPARK))
    for d in docs:
        if d["kind"] in ("CronJob", "Job"):
            kubernetes_validate.validate(d, SCHEMA_VERSION, strict=True)
    jobs = _jobs(docs)
    assert set(jobs) == {"audit", "bulk"}
    cron = next(d for d in docs if d["kind"] == "CronJob")
    assert cron["spec"]["schedule"] == "*/30 * * * *"
    for name, pod in jobs.items():
        (c,) = pod["containers"]
        assert c["image"] == "registry.example.com/timerwheel-spark:dev"
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
        assert {"name": "data", "persistentVolumeClaim": {"claimName": "timers-reports"}} in pod["volumes"]
        args = make_parser().parse_args(c["args"])  # the CLI accepts exactly what the pod runs
        assert args.kafka == "kafka:9092" and args.master == "local[2]"
        if name == "audit":
            assert (args.command, args.topics, args.grace_ms) == ("audit", "orders,billing", 120_000)
        else:
            assert (args.command, args.input, args.format, args.rejects) == (
                "bulk-schedule", "/data/in/rows.csv", "csv", "/data/in/rejects")


@pytest.mark.parametrize(("setting", "named"), [
    ("spark.bulk.format=xml", "at '/spark/bulk/format'"),
    ("spark.audit.topics=bad topic", "at '/spark/audit/topics'"),
    ("spark.audit.graceMs=-1", "at '/spark/audit/graceMs'"),
    ("spark.replicas=2", "at '/spark': additional properties 'replicas' not allowed"),
])
def test_bad_spark_values_are_refused_naming_the_field(helm: str, setting: str, named: str) -> None:
    out = run(helm, "template", "tw", str(CHART), "--kube-version", KUBE_VERSION, "--set", setting)
    assert out.returncode != 0
    assert named in out.stderr, out.stderr


SECURE_KAFKA = {"bootstrap": "kafka-0.kafka:9096", "secretName": "kafka-client", "securityProtocol": "SASL_SSL",
                "saslMechanism": "SCRAM-SHA-512", "saslUsername": "timerwheel", "saslPasswordKey": "password",
                "caKey": "ca.crt", "certKey": "tls.crt", "keyKey": "tls.key", "checkHostname": False}


@pytest.mark.parametrize("kafka", [SECURE_KAFKA, {"bootstrap": "kafka:9092"},
                                   {"bootstrap": "k:9093", "securityProtocol": "SSL", "checkHostname": True}],
                         ids=["sasl-ssl", "plaintext", "ssl"])
def test_spark_jobs_reach_kafka_as_the_stages_do(helm: str, kafka: dict[str, Any]) -> None:
    """The Spark pods get spec.kafka as the operator gives it to the stages (spec.kafka_env) and
    the Secret at the same mount; the TimerWheel carries the same spec.kafka."""
    docs = template(helm, "-f", str(SPARK), "--set-json", f"timerwheel.spec.kafka={json.dumps(kafka)}")
    (wheel,) = [d for d in docs if d["kind"] == "TimerWheel"]
    assert wheel["spec"]["kafka"] == {"manageRetention": True, **kafka}  # the chart's default kept
    for name, pod in _jobs(docs).items():
        kubernetes_validate.validate(next(d for d in docs if d["kind"] in ("CronJob", "Job")), SCHEMA_VERSION,
                                     strict=True)
        (c,) = pod["containers"]
        env = {e["name"]: e["value"] for e in c["env"] if e["name"].startswith("TW_KAFKA_")}
        assert env == kafka_env(kafka), name
        mount = {"name": "kafka-secret", "mountPath": KAFKA_SECRET_DIR, "readOnly": True}
        volume = {"name": "kafka-secret", "secret": {"secretName": "kafka-client"}}
        secret = "secretName" in kafka
        assert (mount in c["volumeMounts"], volume in pod["volumes"]) == (secret, secret), name
        assert make_parser().parse_args(c["args"]).kafka == kafka["bootstrap"]
