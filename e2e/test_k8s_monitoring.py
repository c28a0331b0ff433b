"""The chart's monitoring on the real local cluster, proven on a real Prometheus:

    the Prometheus Operator's CRDs applied (PodMonitor, PrometheusRule: its Go module's own files)
      -> helm install renders the PodMonitor and the PrometheusRule (shortened `for:` and window)
      -> promtool checks the rules of the PrometheusRule read back from the API server
      -> one Prometheus (built from the Go module proxy by scripts/prometheus.sh) scrapes the stage
         pods with the scrape configuration that PodMonitor stands for (kubernetes_sd, the same
         relabelling the Prometheus Operator generates) and evaluates those rules
      -> under a load with cancels and a dead letter, every dashboard panel's query returns data
      -> dequeue-get's loop stopped (ptrace, as test_k8s_day2's stall test): TimerwheelStageStalled
         fires through Prometheus' API; the loop released, it resolves

Figures (``FIGURE`` lines, never asserted): seconds from the stall to firing, and from the
release to resolving.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import LoadRun, tail
from infra import free_port
from k8s_cluster import ROOT, write_values
from test_k8s_day2 import _answers, _running, _stage_pid, frozen_stage
from test_k8s_helm import NAMESPACE, RELEASE, WHEEL, Release, release  # noqa: F401 - the fixture
from timerwheel_operator.monitoring import DASHBOARDS

pytestmark = [pytest.mark.k8s, pytest.mark.e2e]

SCRAPE_S = 5
STALL_WINDOW = "30s"
STALL_FOR = "10s"
CRDS = ("monitoring.coreos.com_podmonitors.yaml", "monitoring.coreos.com_prometheusrules.yaml")


def _script_lines(*args: str, timeout: float = 3600) -> list[str]:
    done = subprocess.run([str(ROOT / "scripts" / "prometheus.sh"), *args], capture_output=True, text=True,
                          timeout=timeout, check=False)
    if done.returncode != 0:
        pytest.fail(f"scripts/prometheus.sh {' '.join(args)} failed:\n{done.stderr[-2000:]}", pytrace=False)
    return done.stdout.split()


def _label(name: str) -> str:
    """A Kubernetes label key as Prometheus' service discovery names it."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def scrape_config(pm: dict[str, Any], kubeconfig: str) -> dict[str, Any]:
    """The scrape configuration the Prometheus Operator generates for a PodMonitor's first
    endpoint (its selector as keep rules, its port, path and interval, the namespace / pod /
    container / job / endpoint labels, then the PodMonitor's own relabelings)."""
    spec, meta = pm["spec"], pm["metadata"]
    (ep,) = spec["podMetricsEndpoints"]
    relabel: list[dict[str, Any]] = []
    for key, value in spec["selector"].get("matchLabels", {}).items():
        relabel.append({"action": "keep", "source_labels": [f"__meta_kubernetes_pod_label_{_label(key)}",
                                                            f"__meta_kubernetes_pod_labelpresent_{_label(key)}"],
                        "regex": f"({re.escape(value)});true"})
    for expr in spec["selector"].get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        relabel.append({"action": "keep", "source_labels": [f"__meta_kubernetes_pod_label_{_label(expr['key'])}",
                                                            f"__meta_kubernetes_pod_labelpresent_{_label(expr['key'])}"],
                        "regex": f"({'|'.join(re.escape(v) for v in expr['values'])});true"})
    relabel += [
        {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": ep["port"]},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"target_label": "job", "replacement": f"{meta['namespace']}/{meta['name']}"},
        {"target_label": "endpoint", "replacement": ep["port"]},
    ]
    names = {"sourceLabels": "source_labels", "targetLabel": "target_label", "separator": "separator",
             "regex": "regex", "replacement": "replacement", "action": "action", "modulus": "modulus"}
    relabel += [{names[k]: v for k, v in r.items()} for r in ep.get("relabelings", [])]
    return {
        "job_name": f"podMonitor/{meta['namespace']}/{meta['name']}/0",
        "honor_labels": False,
        "scrape_interval": ep.get("interval", "30s"),
        "metrics_path": ep.get("path", "/metrics"),
        "kubernetes_sd_configs": [{"role": "pod", "kubeconfig_file": kubeconfig,
                                   "namespaces": {"names": spec["namespaceSelector"]["matchNames"]}}],
        "relabel_configs": relabel,
    }


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def get(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.get("/api/v1/query", query=expr)["result"]
        return result

    def alerts(self, name: str) -> list[dict[str, Any]]:
        return [a for a in self.get("/api/v1/alerts")["alerts"] if a["labels"].get("alertname") == name]


@dataclass
class Monitored:
    rel: Release
    prometheus: Prometheus
    rules: Path
    promtool: str


def _wait(what: str, ok: Callable[[], bool], timeout_s: float, diagnosis: Callable[[], str]) -> float:
    t0 = time.monotonic()
    while not ok():
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"{what}: not within {timeout_s:.0f} s\n{diagnosis()}", pytrace=False)
        time.sleep(1)
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def monitored(release: Release, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Monitored]:  # noqa: F811
    rel = release
    work = tmp_path_factory.mktemp("monitoring")
    prometheus_bin, promtool = _script_lines("path")
    (crd_dir,) = _script_lines("crds", timeout=600)
    for name in CRDS:  # server-side: the CRDs are too large for the last-applied annotation
        rel.k8s.kubectl("apply", "--server-side", "-f", str(Path(crd_dir) / name))
    try:
        rel.k8s.kubectl("wait", "--for=condition=Established", "crd/podmonitors.monitoring.coreos.com",
                        "crd/prometheusrules.monitoring.coreos.com", "--timeout=60s")
        values = json.loads(json.dumps(rel.values))
        values["timerwheel"]["spec"]["recovery"] = {"restartStalled": False}  # the alert, not the operator
        values["console"] = {"enabled": True}  # read-only: its pod is checked too
        values["monitoring"] = {
            "podMonitor": {"interval": f"{SCRAPE_S}s"},
            "prometheusRule": {"alerts": {"stageStalled": {"for": STALL_FOR, "window": STALL_WINDOW}}},
        }
        path = work / "values.yaml"
        write_values(path, values)
        done = rel.helm("install", RELEASE, str(ROOT / "charts" / "timerwheel"), "-n", NAMESPACE,
                        "--create-namespace", "-f", str(path), "--wait", "--timeout", "300s")
        assert done.returncode == 0, done.stderr + rel.diagnosis()
        waited = rel.kubectl("wait", f"timerwheel/{WHEEL}", "--for=condition=Ready", "--timeout=300s",
                             check=False, timeout=330)
        assert waited.returncode == 0, waited.stderr + rel.diagnosis()
        # What the API server holds, not what helm printed.
        (pm,) = rel.get("podmonitors")["items"]
        (rule,) = rel.get("prometheusrules")["items"]
        rules = work / "rules.yaml"
        rules.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
        config = work / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
            "rule_files": [str(rules)],
            "scrape_configs": [scrape_config(pm, rel.k8s.kubeconfig)],
        }))
        checked = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True,
                                 timeout=120)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        port = free_port()
        log = work / "prometheus.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen([prometheus_bin, f"--config.file={config}", f"--storage.tsdb.path={work / 'tsdb'}",
                                     f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        prom = Prometheus(f"http://127.0.0.1:{port}", proc, log)
        try:
            def ready() -> bool:
                assert proc.poll() is None, f"prometheus exited {proc.returncode}:\n{tail(log)}"
                try:
                    with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as resp:
                        return resp.status == 200
                except OSError:
                    return False

            _wait("Prometheus ready", ready, 120, lambda: tail(log))
            yield Monitored(rel, prom, rules, promtool)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    finally:
        if rel.helm("status", RELEASE, "-n", NAMESPACE).returncode == 0:
            rel.helm("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "120s")
        for name in ("podmonitors", "prometheusrules"):  # the other modules' installs render none
            rel.k8s.kubectl("delete", "crd", f"{name}.monitoring.coreos.com", "--wait=true", check=False)


def test_promtool_checks_the_rules_the_api_server_holds(monitored: Monitored) -> None:
    out = subprocess.run([monitored.promtool, "check", "rules", str(monitored.rules)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "SUCCESS: 8 rules found" in out.stdout, out.stdout + out.stderr
    loaded = monitored.prometheus.get("/api/v1/rules")["groups"]
    assert sum(len(g["rules"]) for g in loaded) == 8


def test_prometheus_scrapes_every_stage_pod_through_the_pod_monitor(monitored: Monitored) -> None:
    prom = monitored.prometheus

    def all_up() -> bool:
        found = prom.query(f'up{{namespace="{NAMESPACE}", timerwheel="{WHEEL}"}} == 1')
        return {r["metric"].get("component") for r in found} == {
            "enqueue-get", "enqueue-put", "dequeue-get", "dequeue-getmsg", "dequeue-put"}

    _wait("every stage pod scraped", all_up, 120, lambda: json.dumps(prom.get("/api/v1/targets"))[-3000:])


def test_every_dashboard_panel_s_query_returns_data(monitored: Monitored) -> None:
    rel, prom = monitored.rel, monitored.prometheus
    dest = rel.pipe.new_dest("monitoring", 2)
    panels = [(d.title, p.title, p.expr.replace("$namespace", NAMESPACE).replace("$timerwheel", WHEEL)
               .replace("$__rate_interval", "1m")) for d in DASHBOARDS for p in d.panels]
    with LoadRun(rel.pipe, dest, seed=33, rate=10, min_delay_ms=1_000, max_delay_ms=6_000,
                 cancel_fraction=0.2) as run:
        run.producer.send_raw([("tw-deliver-at", b"1")], b"k", b"no destination")  # a dead letter
        empty: list[str] = []

        def all_answer() -> bool:
            empty[:] = [f"{board} / {title}: {expr}" for board, title, expr in panels if not prom.query(expr)]
            return not empty

        took = _wait("every panel's query answering", all_answer, 240, lambda: "no data: " + "; ".join(empty))
        print(f"FIGURE every one of {len(panels)} dashboard panels returned data {took:.0f} s into the load",
              flush=True)
        missing, rep = run.drain("monitoring load", timeout_s=120)
    assert not missing and rep.lost == [] and rep.early == [], rep.line()


def test_the_console_pod_serves_the_shards_from_its_read_only_claim(monitored: Monitored) -> None:
    """The chart's console (read-only) beside the stages: ready, and its pages answer from the data
    claim mounted read-only (this cluster has no DNS, so its scrapes of the stages' Services fail
    and W, R and the epochs come from the shards' checkpoints, as the page says)."""
    rel = monitored.rel

    def pod() -> dict[str, Any] | None:
        return rel.ready_pod("console")

    _wait("the console pod ready", lambda: pod() is not None, 180, rel.diagnosis)
    console = pod()
    assert console is not None
    ip = console["status"]["podIP"]
    # The first page waits for the first scrape: without DNS each name fails only after the
    # resolver's timeouts (its search list, tens of seconds).
    with urllib.request.urlopen(f"http://{ip}:8090/", timeout=180) as resp:
        page = resp.read().decode()
    assert page.count('class="shard"') == 2, page[-3000:]
    with urllib.request.urlopen(f"http://{ip}:8090/pending?to=now%2B1d", timeout=30) as resp:
        assert resp.status == 200
    top = rel.kubectl("exec", console["metadata"]["name"], "--", "timerwheel", "top", "--once", "--metrics", "",
                      timeout=120)
    assert "W lag" in top.stdout and "due: next minute" in top.stdout, top.stdout + top.stderr


def test_a_stalled_stage_fires_its_alert_and_it_resolves_after_recovery(monitored: Monitored) -> None:
    rel, prom = monitored.rel, monitored.prometheus
    name = "TimerwheelStageStalled"
    assert not [a for a in prom.alerts(name) if a["state"] == "firing"], prom.alerts(name)
    (reader,) = _running(rel, "dequeue-get")
    ip, pid = reader["status"]["podIP"], _stage_pid("dequeue-get")
    with frozen_stage(ip, pid):  # its metrics must keep coming
        firing = _wait(f"{name} firing", lambda: any(a["state"] == "firing" for a in prom.alerts(name)), 240,
                       lambda: json.dumps(prom.alerts(name)) + rel.diagnosis())
        alert = next(a for a in prom.alerts(name) if a["state"] == "firing")
        assert alert["labels"]["timerwheel"] == WHEEL and alert["annotations"]["runbook_url"].endswith(
            "#timerwheelstagestalled"), alert
        assert _answers(ip), "the stalled pod stopped answering: the alert came from a dead scrape"
    resolved = _wait(f"{name} resolved", lambda: not prom.alerts(name), 240,
                     lambda: json.dumps(prom.alerts(name)) + rel.diagnosis())
    print(f"FIGURE {name} (window {STALL_WINDOW}, for {STALL_FOR}, scrape and evaluation every {SCRAPE_S} s): "
          f"firing {firing:.0f} s after dequeue-get's loop stopped, resolved {resolved:.0f} s after it ran again",
          flush=True)
