"""The chart's console and monitoring, offline: the console Deployment (off by default) is valid,
secure, reads the operator's settings and the data claim read-only and runs the CLI's own
command; the PodMonitor and PrometheusRule appear only with the Prometheus Operator's API, select
exactly the stage pods the operator makes, and every alert links a runbook section that exists;
`promtool check rules` passes; the dashboards are the generated ones and read only declared
metrics; bad values are refused by name."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from test_chart import CHART, KUBE_VERSION, ROOT, SCHEMA_VERSION, helm, run, template
from timerwheel.cli import make_parser
from timerwheel.config import known_env_var
from timerwheel.metrics import COUNTERS, GAUGES, HISTOGRAMS
from timerwheel_operator.manifests import labels as stage_labels
from timerwheel_operator.manifests import wheel_pods
from timerwheel_operator.monitoring import DASHBOARDS, dashboard_json, families

__all__ = ["helm"]

VALUES = Path(__file__).with_name("console-values.yaml")
API = ("--api-versions", "monitoring.coreos.com/v1/PodMonitor", "--api-versions",
       "monitoring.coreos.com/v1/PrometheusRule")
STAGES = ("enqueue-get", "enqueue-put", "dequeue-get", "dequeue-getmsg", "dequeue-put")


def _one(docs: list[dict[str, Any]], kind: str, component: str | None = None) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and (component is None or d["metadata"]["labels"].get(
        "app.kubernetes.io/component") == component)]
    return doc


def test_by_default_no_console_and_no_prometheus_objects_but_the_dashboards(helm: str) -> None:
    docs = template(helm)
    kinds = [d["kind"] for d in docs]
    assert "PodMonitor" not in kinds and "PrometheusRule" not in kinds
    assert not [d for d in docs if d["metadata"]["labels"].get("app.kubernetes.io/component") == "console"]
    boards = [d for d in docs if d["kind"] == "ConfigMap" and "dashboard" in d["metadata"]["name"]]
    assert len(boards) == len(DASHBOARDS) and all(b["metadata"]["labels"]["grafana_dashboard"] == "1" for b in boards)
    assert not [d for d in template(helm, "--set", "monitoring.dashboards.enabled=false")
                if d["kind"] == "ConfigMap" and "dashboard" in d["metadata"]["name"]]


def test_the_console_deployment_is_valid_secure_and_reads_the_installation_read_only(helm: str) -> None:
    docs = template(helm, "-f", str(VALUES), *API)
    dep, svc = _one(docs, "Deployment", "console"), _one(docs, "Service", "console")
    for doc in (dep, svc):
        kubernetes_validate.validate(doc, SCHEMA_VERSION, strict=True)
    pod = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 1 and pod["enableServiceLinks"] is False
    assert pod["automountServiceAccountToken"] is False and pod["securityContext"]["runAsNonRoot"] is True
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"]["drop"] == ["ALL"]
    assert c["image"] == "timerwheel:dev" and c["envFrom"] == [{"configMapRef": {"name": "timerwheel-orders-settings"}}]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert all(known_env_var(k) for k in env if k.startswith("TW_")), env
    assert env["TW_CONSOLE_METRICS"].split(",") == [f"timerwheel-orders-{s}.timers.svc:8080" for s in STAGES]
    assert env["TW_CONSOLE_ACTION_TOKEN_FILE"] == "/etc/timerwheel/console/token" and env["TW_CONSOLE_PORT"] == "8091"
    args = make_parser().parse_args(c["command"][1:] + c["args"])  # the CLI's own flags
    assert args.command == "console" and args.host == "0.0.0.0" and args.sample_every == 5.0
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["data"]["readOnly"] is True and mounts["data"]["mountPath"] == "/data"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["data"]["persistentVolumeClaim"] == {"claimName": "timers-nfs", "readOnly": True}
    assert volumes["action-token"]["secret"]["secretName"] == "tw-console"
    assert volumes["kafka-secret"]["secret"]["secretName"] == "kafka-client"
    assert mounts["kafka-secret"]["mountPath"] == "/etc/timerwheel/kafka"  # where the operator's settings point
    assert svc["spec"]["ports"][0]["port"] == 8091
    assert "Secret" not in {d["kind"] for d in docs}  # the token stays in the user's Secret


def test_on_a_one_node_claim_the_console_goes_to_the_stage_pods_node(helm: str) -> None:
    """ReadWriteOnce (the chart's default): the console mounts the claim, so it must run where the
    operator keeps every stage pod; on a ReadWriteMany claim, or with console.affinity, it does not."""
    def affinity(*sets: str) -> dict[str, object] | None:
        docs = template(helm, "-f", str(VALUES), *API, *(a for s in sets for a in ("--set", s)))
        return _one(docs, "Deployment", "console")["spec"]["template"]["spec"].get("affinity")

    one_node = affinity("timerwheel.spec.storage.accessModes={ReadWriteOnce}")
    assert one_node == {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
        "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "timerwheel", "app.kubernetes.io/instance": "orders",
                                          "app.kubernetes.io/managed-by": "timerwheel-operator"}},
        "topologyKey": "kubernetes.io/hostname"}]}}
    assert one_node["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]["labelSelector"][
        "matchLabels"] == wheel_pods("orders")  # the operator's own term for its pods
    assert affinity("timerwheel.spec.storage.accessModes={ReadWriteMany}") is None
    mine = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}}
    assert affinity("timerwheel.spec.storage.accessModes={ReadWriteOnce}",
                    "console.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
                    ".nodeSelectorTerms[0].matchExpressions[0].key=zone",
                    "console.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
                    ".nodeSelectorTerms[0].matchExpressions[0].operator=In",
                    "console.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
                    ".nodeSelectorTerms[0].matchExpressions[0].values={a}") == mine


def test_the_console_needs_the_chart_s_timerwheel(helm: str) -> None:
    out = run(helm, "template", "tw", str(CHART), "--kube-version", KUBE_VERSION, "--set", "console.enabled=true",
              "--set", "timerwheel.create=false")
    assert out.returncode != 0 and "console.enabled needs timerwheel.create" in out.stderr


def test_the_pod_monitor_selects_exactly_the_stage_pods_the_operator_makes(helm: str) -> None:
    docs = template(helm, "-f", str(VALUES), *API)
    pm = _one(docs, "PodMonitor")
    sel = pm["spec"]["selector"]
    (expr,) = sel["matchExpressions"]
    for stage in STAGES:
        pod_labels = stage_labels("orders", stage)
        assert all(pod_labels.get(k) == v for k, v in sel["matchLabels"].items()), stage
        assert pod_labels[expr["key"]] in expr["values"]
    assert not set(stage_labels("other", "enqueue-put").items()) >= set(sel["matchLabels"].items())
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert ep["port"] == "http" and ep["path"] == "/metrics" and ep["interval"] == "30s"
    targets = {r["targetLabel"] for r in ep["relabelings"]}
    assert targets == {"timerwheel", "component"}  # never "stage": the stages' series have their own
    assert pm["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def _rules(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rule = _one(docs, "PrometheusRule")
    return [r for g in rule["spec"]["groups"] for r in g["rules"]]


def test_every_alert_has_a_runbook_section_and_reads_declared_metrics(helm: str) -> None:
    rules = _rules(template(helm, "-f", str(VALUES), *API))
    runbook = (ROOT / "docs" / "runbook.md").read_text()
    sections = {h.lower() for h in re.findall(r"^## (\w+)$", runbook, re.M)}
    alerts = {r["alert"] for r in rules}
    assert len(alerts) == 8 and {a.lower() for a in alerts} == sections
    declared = set(COUNTERS) | set(GAUGES) | set(HISTOGRAMS)
    for r in rules:
        assert r["annotations"]["runbook_url"].endswith("docs/runbook.md#" + r["alert"].lower())
        named = set(re.findall(r"\btimerwheel_([a-z_]+?)(?:_total|_bucket)?\{", r["expr"]))
        assert named and named <= declared, (r["alert"], named - declared)
        assert 'namespace="timers", timerwheel="orders"' in r["expr"]
    by_name = {r["alert"]: r for r in rules}
    assert by_name["TimerwheelStageStalled"]["for"] == "30s" and "[90s:15s]" in by_name["TimerwheelStageStalled"]["expr"]
    assert "< 3" in by_name["TimerwheelShardUnowned"]["expr"]  # the TimerWheel's shards


@pytest.fixture(scope="session")
def promtool() -> str:
    out = subprocess.run([str(ROOT / "scripts" / "prometheus.sh"), "path"], capture_output=True, text=True,
                         timeout=3600, check=False)
    if out.returncode != 0:
        pytest.fail(f"scripts/prometheus.sh could not build promtool (needs Go and the Go module proxy):\n"
                    f"{out.stderr[-2000:]}", pytrace=False)
    return out.stdout.split()[-1]


@pytest.mark.parametrize("values", [(), ("-f", str(VALUES))], ids=["default", "console-values"])
def test_promtool_checks_the_rules(helm: str, promtool: str, values: tuple[str, ...], tmp_path: Path) -> None:
    rule = _one(template(helm, *values, *API), "PrometheusRule")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 8 rules found" in out.stdout, out.stdout


def test_the_dashboards_are_the_generated_ones_and_read_declared_metrics(helm: str) -> None:
    declared = set(COUNTERS) | set(GAUGES) | set(HISTOGRAMS)
    boards = {d["metadata"]["name"]: d for d in template(helm) if d["kind"] == "ConfigMap"
              and "dashboard" in d["metadata"]["name"]}
    for d in DASHBOARDS:
        path = CHART / "dashboards" / f"{d.uid}.json"
        assert json.loads(path.read_text()) == dashboard_json(d), (
            f"{path} is stale: run `timerwheel-operator dashboards charts/timerwheel/dashboards`")
        (cm,) = [cm for name, cm in boards.items() if name.endswith(d.uid)]
        assert json.loads(cm["data"][f"{d.uid}.json"]) == dashboard_json(d)
        for p in d.panels:
            assert families(p.expr) and families(p.expr) <= declared, (p.title, families(p.expr) - declared)


@pytest.mark.parametrize(("setting", "named"), [
    ("console.port=80", "at '/console/port'"),
    ("console.bogus=1", "at '/console': additional properties 'bogus' not allowed"),
    ("console.actionToken.secretName=Bad_Name", "at '/console/actionToken/secretName'"),
    ("monitoring.prometheusRule.alerts.stageStalled.for=soon", "at '/monitoring/prometheusRule/alerts/stageStalled/for'"),
    ("monitoring.podMonitor.interval=15", "at '/monitoring/podMonitor/interval'"),
    ("monitoring.prometheusRule.alerts.readTimeBehind.lagMs=-1",
     "at '/monitoring/prometheusRule/alerts/readTimeBehind/lagMs'"),
])
def test_bad_console_and_monitoring_values_are_refused_naming_the_field(helm: str, setting: str, named: str) -> None:
    out = run(helm, "template", "tw", str(CHART), "--kube-version", KUBE_VERSION, "--set", setting)
    assert out.returncode != 0, f"--set {setting} was accepted"
    assert named in out.stderr, out.stderr


@pytest.fixture(scope="session")
def operator_crds() -> dict[str, Any]:
    """kind -> the Prometheus Operator's own CRD (its Go module's files, scripts/prometheus.sh crds)."""
    out = subprocess.run([str(ROOT / "scripts" / "prometheus.sh"), "crds"], capture_output=True, text=True,
                         timeout=600, check=False)
    if out.returncode != 0:
        pytest.fail(f"scripts/prometheus.sh crds failed:\n{out.stderr[-2000:]}", pytrace=False)
    found = {}
    for name in ("podmonitors", "prometheusrules"):
        crd = yaml.safe_load((Path(out.stdout.strip()) / f"monitoring.coreos.com_{name}.yaml").read_text())
        found[crd["spec"]["names"]["kind"]] = crd
    return found


@pytest.mark.parametrize("values", [(), ("-f", str(VALUES))], ids=["default", "console-values"])
def test_the_pod_monitor_and_rule_are_valid_for_the_prometheus_operator_s_crds(
        helm: str, operator_crds: dict[str, Any], values: tuple[str, ...]) -> None:
    import jsonschema

    for doc in template(helm, *values, *API):
        crd = operator_crds.get(doc["kind"])
        if crd is None:
            continue
        (version,) = [v for v in crd["spec"]["versions"] if v["name"] == doc["apiVersion"].split("/")[1]]
        schema = version["schema"]["openAPIV3Schema"]
        errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in jsonschema.Draft7Validator(schema).iter_errors(doc)]
        assert not errors, (doc["kind"], errors)
        assert _pruned(schema, doc, "") == [], (doc["kind"], "the API server would drop these fields")


def _pruned(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    """The fields of ``value`` a structural schema does not know (the API server prunes them)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    out = []
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, sub in value.items():
            if props is not None and key in props:
                out += _pruned(props[key], sub, f"{path}.{key}")
            elif isinstance(extra, dict):
                out += _pruned(extra, sub, f"{path}.{key}")
            elif path != ".metadata":  # the API server's own schema of metadata is not in the CRD
                out.append(f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, sub in enumerate(value):
            out += _pruned(schema["items"], sub, f"{path}[{i}]")
    return out
