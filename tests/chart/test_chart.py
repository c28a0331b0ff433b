"""The Helm chart, offline: `helm lint`, `helm template` of the default and the full values, every
rendered manifest valid against Kubernetes 1.34's schemas (kubernetes-validate --strict), the
TimerWheel it makes accepted by the CRD's schema and rules, secure pod defaults, labels, the
CRD kept on uninstall, values.schema.json generated and refusing bad values by name, the
`helm test` Job. helm comes from scripts/helm.sh (built with Go on first use): if it cannot be
built these tests fail, saying what is missing."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from k8s_helpers import api_server_errors
from timerwheel_operator.crd import crd
from timerwheel_operator.spec import read
from timerwheel_operator.values_schema import values_schema

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "timerwheel"
FULL = Path(__file__).with_name("full-values.yaml")
KUBE_VERSION = "1.34.4"  # scripts/k8s.sh's cluster
SCHEMA_VERSION = "1.34.0"


@pytest.fixture(scope="session")
def helm() -> str:
    try:
        out = subprocess.run([str(ROOT / "scripts" / "helm.sh"), "path"], capture_output=True, text=True,
                             timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.fail(f"scripts/helm.sh path could not run: {exc}")
    if out.returncode != 0:
        pytest.fail(f"helm is missing and scripts/helm.sh could not build it (needs Go and the Go module proxy):\n"
                    f"{out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()[-1]


def run(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def template(helm: str, *args: str, release: str = "tw") -> list[dict[str, Any]]:
    out = run(helm, "template", release, str(CHART), "--namespace", "timers", "--include-crds",
              "--kube-version", KUBE_VERSION, *args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


VALUE_SETS = {"default": (), "full": ("-f", str(FULL)), "never": ("--set", "image.pullPolicy=Never",
                                                                 "--set", "image.tag=dev")}


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_helm_lint_is_clean(helm: str, values: tuple[str, ...]) -> None:
    out = run(helm, "lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION, *values)
    assert out.returncode == 0 and "0 chart(s) failed" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_every_rendered_manifest_is_valid(helm: str, values: tuple[str, ...]) -> None:
    docs = template(helm, *values)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("CustomResourceDefinition") == 1 and kinds.count("TimerWheel") == 1, kinds
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "CustomResourceDefinition":
            assert doc == crd(), "the chart's CRD is not the generated one"
        elif doc["kind"] == "TimerWheel":
            assert api_server_errors(doc["spec"]) == [], where
            read(doc, "unused")  # and the operator accepts it (raises SpecError naming a field)
        else:
            try:
                kubernetes_validate.validate(doc, SCHEMA_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{where}: {exc.message} at {list(exc.path)}")


def pod_specs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{d['kind']}/{d['metadata']['name']}": d["spec"]["template"]["spec"]
            for d in docs if d["kind"] in ("Deployment", "Job")}


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_pods_have_secure_defaults(helm: str, values: tuple[str, ...]) -> None:
    specs = pod_specs(template(helm, *values))
    assert len(specs) == 2, specs.keys()  # the operator and the helm test Job
    for where, spec in specs.items():
        assert spec["enableServiceLinks"] is False, where
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where


def test_the_operator_runs_once_with_the_chosen_image(helm: str) -> None:
    docs = template(helm, *VALUE_SETS["never"])
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "timerwheel:dev" and c["imagePullPolicy"] == "Never"
    assert c["command"] == ["timerwheel-operator"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["TIMERWHEEL_IMAGE"] == "timerwheel:dev" and env["TIMERWHEEL_IMAGE_PULL_POLICY"] == "Never"
    assert env["TIMERWHEEL_WATCH_NAMESPACE"] == "timers"
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    (wheel,) = [d for d in docs if d["kind"] == "TimerWheel"]
    assert wheel["metadata"]["name"] == "tw"
    assert wheel["spec"]["image"] == {"repository": "timerwheel", "tag": "dev", "pullPolicy": "Never"}


def test_rbac_is_namespaced_unless_cluster_wide(helm: str) -> None:
    kinds = {d["kind"] for d in template(helm)}
    assert {"Role", "RoleBinding"} <= kinds
    assert not {"ClusterRole", "ClusterRoleBinding"} & kinds  # one namespace: nothing cluster-scoped
    full = template(helm, *VALUE_SETS["full"])
    roles = [d for d in full if d["kind"] == "ClusterRole"]
    main = next(r for r in roles if r["metadata"]["name"] == "timerwheel-full-operator")
    resources = {res for rule in main["rules"] for res in rule["resources"]}
    assert {"timerwheels", "timerwheels/status", "statefulsets", "deployments", "poddisruptionbudgets"} <= resources
    assert {"jobs", "pods/log"} <= resources  # recovery Jobs and their reports
    verbs = {v for rule in main["rules"] for v in rule["verbs"]}
    assert "*" not in verbs
    # a Pending claim's Events are read (what its provisioner said); Events are never deleted
    events = [rule["verbs"] for rule in main["rules"] if "events" in rule["resources"]]
    assert events == [["create", "patch", "get", "list"]], events
    # garbage collection deletes what the operator made; it deletes only a stalled shard's owner pod
    deleting = [rule["resources"] for rule in main["rules"] if "delete" in rule["verbs"]]
    assert deleting == [["pods"]], deleting
    (dep,) = [d for d in full if d["kind"] == "Deployment"]
    env = {e["name"]: e["value"] for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TIMERWHEEL_WATCH_NAMESPACE"] == ""


def test_every_object_has_the_recommended_labels(helm: str) -> None:
    for doc in template(helm, *VALUE_SETS["full"]):
        labels = doc["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/name"), doc["kind"]
        assert labels.get("app.kubernetes.io/component"), doc["kind"]
        if doc["kind"] != "CustomResourceDefinition":
            assert labels["app.kubernetes.io/instance"] == "tw" and labels["app.kubernetes.io/managed-by"] == "Helm"


def test_the_crd_is_kept_on_uninstall(helm: str) -> None:
    # Helm installs crds/ before the templates and never deletes or upgrades what it holds.
    assert (CHART / "crds" / "timerwheels.timerwheel.io.yaml").exists()
    assert not any(d["kind"] == "CustomResourceDefinition" for d in
                   [d for d in yaml.safe_load_all(run(helm, "template", "tw", str(CHART),
                                                      "--kube-version", KUBE_VERSION).stdout) if d])
    out = run(helm, "show", "crds", str(CHART))
    assert yaml.safe_load(out.stdout) == crd()


def test_the_values_schema_is_the_generated_one() -> None:
    assert json.loads((CHART / "values.schema.json").read_text()) == values_schema(), (
        "charts/timerwheel/values.schema.json is stale: run `timerwheel-operator values-schema`")


@pytest.mark.parametrize(("setting", "named"), [
    ("timerwheel.spec.tickMs=7", "at '/timerwheel/spec/tickMs'"),
    ("timerwheel.spec.shards=0", "at '/timerwheel/spec/shards'"),
    ("timerwheel.spec.shard=2", "at '/timerwheel/spec': additional properties 'shard' not allowed"),
    ("timerwheel.spec.timerTopic=bad topic", "at '/timerwheel/spec/timerTopic'"),
    ("timerwheel.spec.storage.accessModes[0]=Sometimes", "at '/timerwheel/spec/storage/accessModes/0'"),
    ("timerwheel.spec.stages.enqueueGet.replicas=2", "at '/timerwheel/spec/stages/enqueueGet/replicas'"),
    ("timerwheel.name=Bad_Name", "at '/timerwheel/name'"),
    ("image.pullPolicy=Sometimes", "at '/image/pullPolicy'"),
    ("operator.replicas=2", "at '/operator': additional properties 'replicas' not allowed"),
    ("operator.logLevel=LOUD", "at '/operator/logLevel'"),
    ("tests.delayMs=-1", "at '/tests/delayMs'"),
    ("surprise=1", "additional properties 'surprise' not allowed"),
])
def test_bad_values_are_refused_naming_the_field(helm: str, setting: str, named: str) -> None:
    out = run(helm, "template", "tw", str(CHART), "--kube-version", KUBE_VERSION, "--set", setting)
    assert out.returncode != 0, f"--set {setting} was accepted"
    assert "values don't meet the specifications of the schema" in out.stderr, out.stderr
    assert named in out.stderr, out.stderr


def test_the_helm_test_job_schedules_through_kafka_and_waits(helm: str) -> None:
    docs = template(helm, "-f", str(FULL))
    (job,) = [d for d in docs if d["kind"] == "Job"]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "test"
    # `helm uninstall` never deletes hooks: a test that passed is deleted by helm at once, a failed
    # one is kept for its log until the next `helm test` or its TTL
    assert job["metadata"]["annotations"]["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
    assert job["spec"]["ttlSecondsAfterFinished"] > 0
    (c,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["BOOTSTRAP"] == "10.0.0.5:9092,10.0.0.6:9092" and env["TIMER_TOPIC"] == "timers"
    assert env["TOPIC"] == "helm-test-orders" and env["DELAY_MS"] == "1000"
    script = c["command"][-1]
    compile(script, "helm-test", "exec")  # the embedded script is valid Python
    for header in ("tw-topic", "tw-delay-ms", "tw-id"):
        assert f'("{header}"' in script
    assert job["spec"]["backoffLimit"] == 0
    assert not [d for d in template(helm, "--set", "tests.enabled=false") if d["kind"] == "Job"]


def notes(helm: str, tmp_path: Path, *args: str) -> str:
    """What `helm install` prints (NOTES.txt), rendered offline: `helm template` of a copy of the
    chart with a template that holds the notes."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "zz-notes.yaml").write_text('notes: {{ include "timerwheel.notes" . | toJson }}\n')
    out = run(helm, "template", "tw", str(chart), "--namespace", "timers", "--kube-version", KUBE_VERSION,
              "--show-only", "templates/zz-notes.yaml", *args)
    assert out.returncode == 0, out.stderr
    text: str = yaml.safe_load(out.stdout)["notes"]
    return text


def first_message(text: str) -> dict[str, str]:
    """The flags of the `timerwheel schedule` command the notes print."""
    command = text.split("timerwheel schedule", 1)[1].split("\n\n", 1)[0].replace("\\\n", " ")
    words = command.split()
    return {w: words[i + 1] for i, w in enumerate(words) if w.startswith("--") and i + 1 < len(words)}


@pytest.mark.parametrize(("values", "topic"), [
    ((), "timerwheel-helm-test"),
    (("--set", "timerwheel.spec.timerTopic=timers", "--set", "timerwheel.spec.allowTopics[0]=e2e-dest-x-.*",
      "--set", "tests.topic=e2e-dest-x-helm-test"), "e2e-dest-x-helm-test"),
    (("-f", str(FULL)), "billing"),  # tests.topic is not allowed there: the plain name in the list is
])
def test_the_first_message_the_notes_print_goes_where_the_values_allow(helm: str, tmp_path: Path,
                                                                       values: tuple[str, ...], topic: str) -> None:
    text = notes(helm, tmp_path, *values)
    assert "tw-topic" in text and "tw-delay-ms" in text and "--for=condition=Ready" in text and "helm test" in text
    (wheel,) = [d for d in template(helm, *values) if d["kind"] == "TimerWheel"]
    spec = wheel["spec"]
    flags = first_message(text)
    # the timer topic the TimerWheel reads, a destination its allow-list allows (checked with the
    # stages' own rule), the Kafka it uses
    assert flags["--timer-topic"] == spec.get("timerTopic", "__timer") and flags["--topic"] == topic
    assert flags["--kafka"] == spec["kafka"]["bootstrap"]
    assert any(re.fullmatch(p, flags["--topic"]) for p in spec.get("allowTopics", ["(?!__).+"]))
    assert f'--topic {topic} --follow' in text  # and where to read it


def test_the_notes_name_the_pull_secrets_and_say_when_no_destination_can_be_checked(helm: str,
                                                                                   tmp_path: Path) -> None:
    text = notes(helm, tmp_path, "--set", "imagePullSecrets[0].name=regcred", "--set",
                 "timerwheel.spec.allowTopics[0]=orders\\..*")
    assert text.count('--overrides=\'{"spec":{"imagePullSecrets":[{"name":"regcred"}]}}\'') == 2
    assert first_message(text)["--topic"] == "DESTINATION" and "none of its patterns could be" in text


def test_image_pull_secrets_reach_the_operator_the_stages_and_the_operator_s_jobs(helm: str) -> None:
    from timerwheel_operator.manifests import build_all, recovery_job, window_job

    docs = template(helm, "--set", "imagePullSecrets[0].name=regcred")
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    assert dep["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    env = {e["name"]: e["value"] for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TIMERWHEEL_IMAGE_PULL_SECRETS"] == "regcred"
    (wheel_doc,) = [d for d in docs if d["kind"] == "TimerWheel"]
    assert wheel_doc["spec"]["image"]["pullSecrets"] == [{"name": "regcred"}]
    body = {**wheel_doc, "metadata": {**wheel_doc["metadata"], "uid": "u", "generation": 1}}
    wheel = read(body, "unused")
    pods = [m["spec"]["template"]["spec"] for m in build_all(wheel, body) if m["kind"] in ("Deployment", "StatefulSet")]
    pods += [recovery_job(wheel, 0, 1, body)["spec"]["template"]["spec"],
             window_job(wheel, 1, {}, "100/1000/0", body)["spec"]["template"]["spec"]]
    assert len(pods) == 7 and all(p["imagePullSecrets"] == [{"name": "regcred"}] for p in pods)
    # none set: none anywhere
    docs = template(helm)
    assert "pullSecrets" not in next(d for d in docs if d["kind"] == "TimerWheel")["spec"]["image"]


def test_the_default_claim_binds_anywhere_and_keeps_the_pods_on_its_node(helm: str) -> None:
    from timerwheel_operator.manifests import build_all

    (wheel_doc,) = [d for d in template(helm) if d["kind"] == "TimerWheel"]
    assert wheel_doc["spec"]["storage"]["accessModes"] == ["ReadWriteOnce"]
    body = {**wheel_doc, "metadata": {**wheel_doc["metadata"], "uid": "u", "generation": 1}}
    for m in build_all(read(body, "unused"), body):
        if m["kind"] in ("Deployment", "StatefulSet"):
            assert m["spec"]["template"]["spec"]["affinity"]["podAffinity"], m["metadata"]["name"]


def test_helm_sh_says_what_is_missing_when_it_cannot_build(tmp_path: Path) -> None:
    out = subprocess.run([str(ROOT / "scripts" / "helm.sh"), "path"], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TW_CACHE_DIR": str(tmp_path / "cache"),
                              "GO": str(tmp_path / "no-go")})
    assert out.returncode != 0 and out.stdout == ""
    assert "Go is missing" in out.stderr and "helm v3.22.0" in out.stderr
    assert not (tmp_path / "cache" / "bin").exists() or not any((tmp_path / "cache" / "bin").iterdir())


def test_the_image_carries_the_operator() -> None:
    # The chart runs `timerwheel-operator` from the stages' image: the package must be in it.
    dockerfile = (ROOT / "services" / "Dockerfile").read_text()
    assert "COPY operator ./operator" in dockerfile
