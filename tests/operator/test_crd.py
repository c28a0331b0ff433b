"""The TimerWheel CRD: the chart ships the generated one, its schema is structural, its fields are
the stages' TW_* settings with config.py's limits, and the API server's checks (schema and CEL
rules, evaluated offline) refuse a bad spec naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from k8s_helpers import api_server_errors, crd_schema, structural_errors
from timerwheel.config import ALLOWED_TICKS_MS, ENV_VARS, TimerConfig
from timerwheel_operator.crd import MAX_NAME, crd, spec_schema
from timerwheel_operator.spec import SPEC_ENV

ROOT = Path(__file__).resolve().parents[2]
CHART_CRD = ROOT / "charts" / "timerwheel" / "crds" / "timerwheels.timerwheel.io.yaml"


def test_the_chart_ships_the_generated_crd() -> None:
    assert yaml.safe_load(CHART_CRD.read_text()) == crd(), (
        "charts/timerwheel/crds is stale: run `timerwheel-operator crd > " + str(CHART_CRD.relative_to(ROOT)) + "`")


def test_the_crd_schema_is_structural() -> None:
    assert structural_errors(crd_schema()) == []


def test_the_structural_check_catches_what_it_should() -> None:
    broken = {"type": "object", "properties": {
        "a": {"description": "no type"},
        "b": {"type": "object", "properties": {"x": {"type": "string"}}, "additionalProperties": {"type": "string"}},
        "c": {"type": "string", "anyOf": [{"type": "string", "default": "x"}]},
    }}
    errors = structural_errors(broken)
    assert any(e.startswith(".a: no type") for e in errors)
    assert any("properties and additionalProperties" in e for e in errors)
    assert any("type inside a junctor" in e for e in errors) and any("default inside" in e for e in errors)


def test_the_crd_has_a_status_subresource_and_printer_columns() -> None:
    version = crd()["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert {"Shards", "Tick", "Stages", "Lag", "Age"} <= set(columns)
    status = crd_schema()["properties"]["status"]["properties"]
    assert {"observedGeneration", "conditions", "shards", "stages"} <= set(status)
    assert {"owner", "epoch", "W", "R", "lagMs", "pending", "timerLogBytes"} <= set(
        status["shards"]["items"]["properties"])


def test_every_spec_setting_is_a_tw_variable_with_config_defaults() -> None:
    props = spec_schema()["properties"]
    defaults = TimerConfig()
    for field, (var, default) in SPEC_ENV.items():
        assert var in ENV_VARS, f"{field} maps to unknown {var}"
        assert props[field].get("default") == default, field
        attr = ENV_VARS[var][0]
        if field not in ("allowTopics", "delayLevels"):
            assert getattr(defaults, attr) == default, f"spec.{field} default differs from TimerConfig.{attr}"
    assert props["tickMs"]["enum"] == list(ALLOWED_TICKS_MS)


def test_the_default_spec_passes_every_check() -> None:
    assert api_server_errors({"kafka": {"bootstrap": "k:9092"}, "redis": {"url": "redis://r:6379/0"}}) == []


def test_placement_and_pull_secrets_pass_and_the_claim_defaults_to_one_node() -> None:
    spec = {**GOOD, "image": {"pullSecrets": [{"name": "regcred"}]},
            "pods": {"annotations": {"a": "b"}, "nodeSelector": {"pool": "timers"}, "priorityClassName": "",
                     "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
                     "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}}}
    assert api_server_errors(spec) == []
    storage = spec_schema()["properties"]["storage"]["properties"]
    # ReadWriteOnce binds on every cluster's default storage class (README: why the default changed)
    assert storage["accessModes"]["default"] == ["ReadWriteOnce"]
    assert crd_schema()["properties"]["spec"]["properties"]["pods"]["properties"]["affinity"][
        "x-kubernetes-preserve-unknown-fields"] is True


GOOD = {"kafka": {"bootstrap": "k:9092"}, "redis": {"url": "redis://r:6379/0"}}


@pytest.mark.parametrize(("change", "named"), [
    ({"tickMs": 7}, "spec.tickMs"),
    ({"shards": 0}, "spec.shards"),
    ({"rollWindowMs": 150}, "spec.rollWindowMs"),
    ({"tickMs": 1000, "rollWindowMs": 5000}, "spec.rollWindowMs"),
    ({"rollWindowMs": 100_000, "wheelSpanMs": 150_000}, "spec.wheelSpanMs"),
    ({"dlqTopic": "__timer"}, "spec.dlqTopic"),
    ({"timerTopic": "bad topic"}, "spec.timerTopic"),
    ({"allowTopics": ["a,b"]}, "spec.allowTopics"),
    ({"deliveryGuarantee": "twice"}, "spec.deliveryGuarantee"),
    ({"redis": {}}, "spec.redis"),
    ({"kafka": {}}, "spec.kafka"),
    ({"stages": {"enqueuePut": {"replicas": 2}}}, "spec.stages.enqueuePut.replicas"),
    ({"stages": {"enqueueGet": {"replicas": 3}}}, "spec.stages.enqueueGet.replicas"),
    ({"storage": {"accessModes": ["Sometimes"]}}, "spec.storage.accessModes"),
    ({"autoscale": {"minReplicas": 5, "maxReplicas": 2}}, "spec.autoscale.minReplicas"),
    ({"surprise": 1}, "spec"),  # unknown fields: pruned by the server, refused by kubectl --strict
    ({"pods": {"tolerations": [{"key": "k", "effect": "Sometimes"}]}}, "spec.pods.tolerations.0.effect"),
    ({"pods": {"priorityClassName": "Bad_Name"}}, "spec.pods.priorityClassName"),
    ({"pods": {"nodeSelector": {"pool": 3}}}, "spec.pods.nodeSelector.pool"),
    ({"image": {"pullSecrets": [{}]}}, "spec.image.pullSecrets.0"),
])
def test_a_bad_spec_is_refused_naming_the_field(change: dict[str, object], named: str) -> None:
    errors = api_server_errors({**GOOD, **change})
    assert errors, f"{change} was accepted"
    assert any(named in e for e in errors), errors


def test_the_shard_count_is_immutable() -> None:
    assert api_server_errors({**GOOD, "shards": 4}, old_spec={**GOOD, "shards": 4}) == []
    errors = api_server_errors({**GOOD, "shards": 8}, old_spec={**GOOD, "shards": 4})
    assert errors == [next(r["message"] for r in spec_schema()["properties"]["shards"]["x-kubernetes-validations"])]
    assert errors[0].startswith("spec.shards is immutable")


@pytest.mark.parametrize("field, old, new", [("tickMs", 100, 1000), ("rollWindowMs", 86_400_000, 3_600_000),
                                             ("wheelSpanMs", 0, 345_600_000)])
def test_a_change_of_the_wheel_window_is_accepted_the_operator_rolls_it(field: str, old: int, new: int) -> None:
    assert api_server_errors({**GOOD, field: new}, old_spec={**GOOD, field: old}) == []


def test_the_scale_subresource_sets_the_delivery_replicas() -> None:
    version = crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.deliveryReplicas",
                                                "statusReplicasPath": ".status.deliveryReplicas",
                                                "labelSelectorPath": ".status.deliverySelector"}
    props = spec_schema()["properties"]
    assert props["deliveryReplicas"]["default"] == 1
    # a per-stage count, when set, wins: so the delivery stages' own replicas have no default
    assert "default" not in props["stages"]["properties"]["dequeuePut"]["properties"]["replicas"]
    assert props["kafka"]["properties"]["manageRetention"]["default"] is True


def test_autoscale_bounds_per_stage_are_checked() -> None:
    assert api_server_errors({**GOOD, "autoscale": {"enabled": True, "dequeuePut": {"minReplicas": 2,
                                                                                    "maxReplicas": 8}}}) == []
    errors = api_server_errors({**GOOD, "autoscale": {"dequeueGetmsg": {"minReplicas": 5, "maxReplicas": 2}}})
    assert errors == ["minReplicas must not exceed maxReplicas"]


def test_the_name_rule_keeps_workload_names_short() -> None:
    rule = crd_schema()["x-kubernetes-validations"][0]
    assert str(MAX_NAME) in rule["rule"] and rule["message"].startswith("metadata.name")
