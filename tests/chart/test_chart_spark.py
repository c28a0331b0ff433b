"""The chart's optional Spark jobs, offline: off by default; on, the audit and forecast CronJobs
and the bulk-schedule Job render valid Kubernetes 1.34 manifests running the CLI's own commands in
the Spark image, with the secure pod defaults and a writable /tmp; bad values are refused by name.
On Spark's Kubernetes scheduler (spark.kubernetes) each job's pod is the driver: its ServiceAccount
may only manage pods, its spark-defaults.conf names the image, the executors and their pod
template, and the executors get the driver's volumes and security context."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from test_chart import CHART, KUBE_VERSION, SCHEMA_VERSION, helm, run, template
from timerwheel.cli import make_parser
from timerwheel_operator.spec import KAFKA_SECRET_DIR, kafka_env

__all__ = ["helm"]

SPARK = Path(__file__).with_name("spark-values.yaml")
SPARK_K8S = Path(__file__).with_name("spark-k8s-values.yaml")


def _jobs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for d in docs:
        component = d["metadata"].get("labels", {}).get("app.kubernetes.io/component", "")
        if d["kind"] == "CronJob":
            out[component.removeprefix("spark-")] = d["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        elif d["kind"] == "Job" and component == "spark-bulk":
            out["bulk"] = d["spec"]["template"]["spec"]
    return out


def test_spark_jobs_are_off_by_default(helm: str) -> None:
    assert _jobs(template(helm)) == {}


@pytest.mark.parametrize("values", [
    ("--set", "spark.kubernetes.enabled=true"),  # on Spark's scheduler, but no job enabled
    ("-f", str(SPARK)),
    ("-f", str(SPARK), "-f", str(SPARK_K8S)),
], ids=["off", "local", "kubernetes"])
def test_helm_lint_is_clean_with_the_spark_jobs(helm: str, values: tuple[str, ...]) -> None:
    out = run(helm, "lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION, *values)
    assert out.returncode == 0 and "0 chart(s) failed" in out.stdout, out.stdout + out.stderr


def test_spark_jobs_render_valid_manifests_running_the_cli(helm: str) -> None:
    docs = template(helm, "-f", str(SPARK))
    for d in docs:
        if d["kind"] in ("CronJob", "Job"):
            kubernetes_validate.validate(d, SCHEMA_VERSION, strict=True)
    jobs = _jobs(docs)
    assert set(jobs) == {"audit", "bulk", "forecast"}
    schedules = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d["spec"]["schedule"]
                 for d in docs if d["kind"] == "CronJob"}
    assert schedules == {"spark-audit": "*/30 * * * *", "spark-forecast": "5 */6 * * *"}
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
        assert pod["automountServiceAccountToken"] is False  # local[*]: nothing to ask the API server
        # named: an upgrade from spark.kubernetes would leave the Spark one in the deprecated alias
        assert pod["serviceAccountName"] == "default"
        assert {"name": "TW_SPARK_DRIVER_MEMORY", "value": "2g"} in c["env"]
        assert "SPARK_CONF_DIR" not in {e["name"] for e in c["env"]}
        if name == "audit":
            assert (args.command, args.topics, args.grace_ms) == ("audit", "orders,billing", 120_000)
        elif name == "forecast":
            assert (args.command, args.out, args.hours) == ("forecast", "/data/forecast/latest", 48)
        else:
            assert (args.command, args.input, args.format, args.rejects) == (
                "bulk-schedule", "/data/in/rows.csv", "csv", "/data/in/rejects")


@pytest.mark.parametrize(("setting", "named"), [
    ("spark.bulk.format=xml", "at '/spark/bulk/format'"),
    ("spark.audit.topics=bad topic", "at '/spark/audit/topics'"),
    ("spark.audit.graceMs=-1", "at '/spark/audit/graceMs'"),
    ("spark.replicas=2", "at '/spark': additional properties 'replicas' not allowed"),
    ("spark.forecast.hours=0", "at '/spark/forecast/hours'"),
    ("spark.kubernetes.executors.instances=0", "at '/spark/kubernetes/executors/instances'"),
    ("spark.driverMemory=2GiB", "at '/spark/driverMemory'"),
    ("spark.kubernetes.executors.memory=2 GB", "at '/spark/kubernetes/executors/memory'"),
    ("spark.kubernetes.executors.memoryOverhead=lots", "at '/spark/kubernetes/executors/memoryOverhead'"),
    ("spark.kubernetes.driverPort=80", "at '/spark/kubernetes/driverPort'"),
    ("spark.kubernetes.apiServer=kubernetes.default", "at '/spark/kubernetes/apiServer'"),
    # (helm 3.22 gives a wrong location for a bad key, but names the key and the pattern)
    ("spark.kubernetes.conf.executor\\.memory=2g", "invalid propertyName 'executor.memory'"),
    ("spark.kubernetes.conf.spark\\.app\\.name=a\nspark.master=local", "at '/spark/kubernetes/conf/spark.app.name'"),
    ("spark.kubernetes.executor.cores=2", "at '/spark/kubernetes': additional properties 'executor' not allowed"),
])
def test_bad_spark_values_are_refused_naming_the_field(helm: str, setting: str, named: str) -> None:
    out = run(helm, "template", "tw", str(CHART), "--kube-version", KUBE_VERSION, "--set", setting)
    assert out.returncode != 0, f"--set {setting} was accepted"
    # one line of the schema's errors, naming the field
    (line,) = [line for line in out.stderr.splitlines() if line.startswith("- ")]
    assert named in line, out.stderr


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


def _spark_defaults(text: str) -> dict[str, str]:
    """spark-defaults.conf as Spark reads it (java.util.Properties: the last of a key wins)."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition(" ")
            out[key] = value.strip()
    return out


def _k8s(helm: str, *args: str) -> tuple[list[dict[str, Any]], dict[str, str], dict[str, Any]]:
    """(the documents, spark-defaults.conf, the executors' pod template) on Spark's scheduler."""
    docs = template(helm, "-f", str(SPARK), "-f", str(SPARK_K8S), *args)
    (conf_map,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "tw-timerwheel-spark"]
    conf = _spark_defaults(conf_map["data"]["spark-defaults.conf"])
    template_file = conf["spark.kubernetes.executor.podTemplateFile"]
    assert template_file.startswith("/etc/timerwheel/spark/")
    return docs, conf, yaml.safe_load(conf_map["data"][template_file.rsplit("/", 1)[1]])


def _env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def test_on_kubernetes_each_job_pod_is_the_driver_of_its_executors(helm: str) -> None:
    docs, conf, _ = _k8s(helm)
    for d in docs:
        if d["kind"] not in ("CustomResourceDefinition", "TimerWheel"):
            kubernetes_validate.validate(d, SCHEMA_VERSION, strict=True)
    jobs = _jobs(docs)
    assert set(jobs) == {"audit", "bulk", "forecast"}
    for name, pod in jobs.items():
        (c,) = pod["containers"]
        assert make_parser().parse_args(c["args"]).master == "k8s://https://10.0.0.1:6443", name
        assert pod["serviceAccountName"] == "timers-spark" and pod["automountServiceAccountToken"] is True
        env = _env(c)
        assert env["SPARK_DRIVER_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["SPARK_DRIVER_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        # Kubernetes expands $(VAR) of the variables above; PySpark hands the rest to spark-submit
        assert shlex.split(env["PYSPARK_SUBMIT_ARGS"]) == [
            "--conf", "spark.kubernetes.driver.pod.name=$(SPARK_DRIVER_POD_NAME)",
            "--conf", "spark.driver.host=$(SPARK_DRIVER_HOST)", "pyspark-shell"]
        assert env["TW_SPARK_SHUFFLE_PARTITIONS"] == str(2 * 6 * 3)
        assert {p["containerPort"] for p in c["ports"]} == {17078, 17079}
        assert {"name": "spark-conf", "mountPath": env["SPARK_CONF_DIR"], "readOnly": True} in c["volumeMounts"]
        assert {"name": "spark-conf", "configMap": {"name": "tw-timerwheel-spark"}} in pod["volumes"]
    assert conf["spark.kubernetes.namespace"] == "timers"
    assert conf["spark.kubernetes.container.image"] == "registry.example.com/timerwheel-spark:dev"
    assert conf["spark.kubernetes.container.image.pullPolicy"] == "Always"
    assert conf["spark.kubernetes.container.image.pullSecrets"] == "registry-a,registry-b"
    assert (conf["spark.executor.cores"], conf["spark.executor.memory"], conf["spark.executor.memoryOverhead"]) == (
        "3", "3g", "1g")
    assert (conf["spark.driver.port"], conf["spark.driver.blockManager.port"]) == ("17078", "17079")
    assert conf["spark.kubernetes.executor.disableConfigMap"] == "true"
    # spark.kubernetes.conf: added, and winning over the chart's own lines
    assert conf["spark.kubernetes.node.selector.pool"] == "batch"
    assert conf["spark.kubernetes.executor.request.cores"] == "2500m"
    assert conf["spark.executor.instances"] == "8"


def test_the_driver_may_manage_pods_of_its_namespace_and_nothing_else(helm: str) -> None:
    docs, _, _ = _k8s(helm)
    (sa,) = [d for d in docs if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "timers-spark"]
    assert sa["automountServiceAccountToken"] is False  # mounted in the drivers' pods only
    (role,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "timers-spark"]
    assert role["metadata"]["namespace"] == "timers"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["create", "get", "list", "watch", "delete", "deletecollection"]}]
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding" and d["metadata"]["name"] == "timers-spark"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "timers-spark"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "timers-spark", "namespace": "timers"}]
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")
                and "spark" in d["metadata"]["name"]]
    # a ServiceAccount of the user's: bound, not made
    docs = template(helm, "-f", str(SPARK), "-f", str(SPARK_K8S), "--set", "spark.kubernetes.serviceAccount.create=false")
    assert not [d for d in docs if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "timers-spark"]
    assert [d for d in docs if d["kind"] == "RoleBinding" and d["metadata"]["name"] == "timers-spark"]


@pytest.mark.parametrize("kafka", [SECURE_KAFKA, {"bootstrap": "kafka:9092"}], ids=["sasl-ssl", "plaintext"])
def test_executors_get_the_drivers_volumes_and_security_context(helm: str, kafka: dict[str, Any]) -> None:
    docs, conf, pod = _k8s(helm, "--set-json", f"timerwheel.spec.kafka={json.dumps(kafka)}")
    kubernetes_validate.validate(pod, SCHEMA_VERSION, strict=True)
    driver = _jobs(docs)["audit"]
    (c,) = pod["spec"]["containers"]
    (d,) = driver["containers"]
    assert c["name"] == conf["spark.kubernetes.executor.podTemplateContainerName"]
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "spark-executor"
    assert pod["spec"]["automountServiceAccountToken"] is False and pod["spec"]["enableServiceLinks"] is False
    assert pod["spec"]["securityContext"] == driver["securityContext"]
    assert c["securityContext"] == d["securityContext"] and c["securityContext"]["readOnlyRootFilesystem"] is True
    # the same claim (the audit's lists, the bulk input), /tmp and the Kafka Secret at the same paths
    assert c["volumeMounts"] == [m for m in d["volumeMounts"] if m["name"] != "spark-conf"]
    assert pod["spec"]["volumes"] == [v for v in driver["volumes"] if v["name"] != "spark-conf"]
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "timers-reports"}} in pod["spec"]["volumes"]
    assert ({"name": "kafka-secret", "secret": {"secretName": "kafka-client"}} in pod["spec"]["volumes"]) == (
        "secretName" in kafka)


def test_on_kubernetes_the_driver_finds_the_api_server_without_dns(helm: str) -> None:
    docs, _, _ = _k8s(helm, "--set", "spark.kubernetes.apiServer=")
    for pod in _jobs(docs).values():
        (c,) = pod["containers"]
        # variables Kubernetes puts in every pod (even with enableServiceLinks: false)
        assert make_parser().parse_args(c["args"]).master == \
            "k8s://https://$(KUBERNETES_SERVICE_HOST):$(KUBERNETES_SERVICE_PORT)"


def test_on_kubernetes_without_a_data_claim_the_chart_says_what_to_set(helm: str) -> None:
    out = run(helm, "template", "tw", str(CHART), "--kube-version", KUBE_VERSION, "-f", str(SPARK),
              "-f", str(SPARK_K8S), "--set", "spark.dataClaim=")
    assert out.returncode != 0
    assert "spark.kubernetes.enabled: set spark.dataClaim too" in out.stderr, out.stderr


def test_on_kubernetes_with_no_job_enabled_nothing_is_made(helm: str) -> None:
    docs = template(helm, "--set", "spark.kubernetes.enabled=true")
    assert not [d for d in docs if "spark" in d["metadata"]["name"]]
