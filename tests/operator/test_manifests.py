"""The operator's manifest builders: what one TimerWheel becomes, valid against Kubernetes 1.34's
schemas (kubernetes-validate --strict), with secure pods, probes, no service-link collisions and
settings the stages accept."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from k8s_helpers import wheel_body
from timerwheel.config import TimerConfig, kubernetes_service_var
from timerwheel_operator.crd import STAGES
from timerwheel_operator.manifests import build_all, settings_hash
from timerwheel_operator.spec import SpecError, read

K8S_VERSION = "1.34.0"


def built(**spec: Any) -> list[dict[str, Any]]:
    body = wheel_body(**spec)
    return build_all(read(body, "timerwheel:dev", "Never"), body)


def by_kind(manifests: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {m["metadata"]["name"]: m for m in manifests if m["kind"] == kind}


def pod_specs(manifests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {m["metadata"]["name"]: m["spec"]["template"]["spec"]
            for m in manifests if m["kind"] in ("Deployment", "StatefulSet")}


FULL: dict[str, Any] = {
    "shards": 4, "tickMs": 1000, "rollWindowMs": 3_600_000, "wheelSpanMs": 7_200_000,
    "kafka": {"bootstrap": "10.0.0.5:9092", "secretName": "kafka-client"},
    "redis": {"secretRef": {"name": "redis-auth", "key": "url"}},
    "tracing": {"otlpEndpoint": "http://collector:4318"},
    "storage": {"storageClassName": "", "size": "1Gi", "accessModes": ["ReadWriteOnce"], "keepOnDelete": False},
    "stages": {"dequeuePut": {"replicas": 3, "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}}},
               "enqueuePut": {"replicas": 2}},
}


@pytest.mark.parametrize("spec", [{}, FULL], ids=["default", "full"])
def test_every_manifest_is_valid_kubernetes(spec: dict[str, Any]) -> None:
    for manifest in built(**spec):
        try:
            kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{manifest['kind']}/{manifest['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_the_validator_refuses_what_it_should() -> None:
    deployment = by_kind(built(), "Deployment")["timerwheel-orders-dequeue-put"]
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["paht"] = "/x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_a_timerwheel_becomes_claim_settings_account_and_per_stage_workload_service_budget() -> None:
    manifests = built()
    kinds = sorted((m["kind"], m["metadata"]["name"]) for m in manifests)
    assert ("PersistentVolumeClaim", "timerwheel-orders-data") in kinds
    assert ("ConfigMap", "timerwheel-orders-settings") in kinds
    assert ("ServiceAccount", "timerwheel-orders") in kinds
    assert set(by_kind(manifests, "StatefulSet")) == {"timerwheel-orders-enqueue-put", "timerwheel-orders-dequeue-get"}
    assert set(by_kind(manifests, "Deployment")) == {
        "timerwheel-orders-enqueue-get", "timerwheel-orders-dequeue-getmsg", "timerwheel-orders-dequeue-put"}
    assert set(by_kind(manifests, "Service")) == set(by_kind(manifests, "PodDisruptionBudget")) == {
        f"timerwheel-orders-{s}" for s in STAGES}
    for name, sts in by_kind(manifests, "StatefulSet").items():
        assert sts["spec"]["serviceName"] == name


def test_no_name_can_make_tw_service_link_variables() -> None:
    for name in ("tw", "tw-x", "orders"):
        for manifest in built() if name == "orders" else build_all(read(wheel_body(name), "i"), wheel_body(name)):
            env_prefix = manifest["metadata"]["name"].upper().replace("-", "_")
            assert not env_prefix.startswith("TW_"), manifest["metadata"]["name"]
    for spec in pod_specs(built()).values():
        assert spec["enableServiceLinks"] is False
    for svc in by_kind(built(), "Service").values():
        assert svc["spec"]["clusterIP"] == "None"  # headless: kubelet makes no link variables for it


def test_stage_pods_are_secure_and_probed() -> None:
    for name, spec in pod_specs(built()).items():
        pod_sc = spec["securityContext"]
        assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] != 0, name
        assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert spec["automountServiceAccountToken"] is False
        (container,) = spec["containers"]
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
        assert container["imagePullPolicy"] == "Never"
        stage = name.removeprefix("timerwheel-orders-")
        assert container["command"] == ["timerwheel", "stage", stage]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts["/data"] == "data" and mounts["/tmp"] == "tmp"
        assert spec["volumes"][0]["persistentVolumeClaim"]["claimName"] == "timerwheel-orders-data"
    for m in built():
        if m["kind"] in ("Deployment", "StatefulSet"):
            labels = m["spec"]["template"]["metadata"]["labels"]
            assert labels["app.kubernetes.io/component"] == m["metadata"]["name"].removeprefix("timerwheel-orders-")
            assert labels["app.kubernetes.io/name"] == "timerwheel"
            assert labels["app.kubernetes.io/instance"] == "orders"


def test_the_settings_are_what_the_stages_accept() -> None:
    (cm,) = by_kind(built(**FULL), "ConfigMap").values()
    env = cm["data"]
    assert env["TW_SHARDS"] == "4" and env["TW_TICK_MS"] == "1000" and env["TW_WHEEL_SPAN_MS"] == "7200000"
    assert env["TW_DATA_DIR"] == "/data" and env["TW_HTTP_PORT"] == "8080"
    assert "TW_REDIS_URL" not in env  # from the Secret
    cfg = TimerConfig.from_env({**env, "TW_REDIS_URL": "redis://x"})
    assert (cfg.shards, cfg.tick_ms, cfg.roll_window_ms) == (4, 1000, 3_600_000)
    assert not any(kubernetes_service_var(k, v) for k, v in env.items())


def test_secrets_tracing_and_storage_options_reach_the_pods() -> None:
    manifests = built(**FULL)
    spec = pod_specs(manifests)["timerwheel-orders-dequeue-put"]
    (container,) = spec["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["TW_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "redis-auth", "key": "url"}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://collector:4318"
    assert {"name": "kafka-secret", "mountPath": "/etc/timerwheel/kafka", "readOnly": True} in container["volumeMounts"]
    assert {"name": "kafka-secret", "secret": {"secretName": "kafka-client"}} in spec["volumes"]
    assert container["resources"] == {"requests": {"cpu": "50m", "memory": "64Mi"}}
    assert by_kind(manifests, "Deployment")["timerwheel-orders-dequeue-put"]["spec"]["replicas"] == 3
    assert by_kind(manifests, "StatefulSet")["timerwheel-orders-enqueue-put"]["spec"]["replicas"] == 2
    (pvc,) = by_kind(manifests, "PersistentVolumeClaim").values()
    assert pvc["spec"]["storageClassName"] == "" and pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert pvc["metadata"]["ownerReferences"][0]["uid"] == wheel_body()["metadata"]["uid"]


def test_the_claim_is_kept_by_default_and_an_existing_claim_is_used_as_is() -> None:
    (pvc,) = by_kind(built(), "PersistentVolumeClaim").values()
    assert "ownerReferences" not in pvc["metadata"]  # survives the TimerWheel's deletion
    # ReadWriteOnce: what every cluster's default storage class offers (the pods then share its node)
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"] and "storageClassName" not in pvc["spec"]
    for m in built():
        if m["kind"] != "PersistentVolumeClaim":
            assert m["metadata"]["ownerReferences"][0]["kind"] == "TimerWheel"
    manifests = built(storage={"existingClaim": "my-nfs"})
    assert not by_kind(manifests, "PersistentVolumeClaim")
    for spec in pod_specs(manifests).values():
        assert spec["volumes"][0]["persistentVolumeClaim"]["claimName"] == "my-nfs"


def test_a_settings_change_rolls_the_pods() -> None:
    a = read(wheel_body(), "i")
    b = read(wheel_body(maxDelayMs=86_400_000), "i")
    assert settings_hash(a) != settings_hash(b)
    assert settings_hash(a) == settings_hash(read(wheel_body(), "i"))


def test_the_delivery_guarantee_reaches_the_settings_and_a_bad_one_is_named() -> None:
    def settings(**spec: Any) -> dict[str, str]:
        (cm,) = by_kind(built(**spec), "ConfigMap").values()
        return dict(cm["data"])

    # at its default it is not written: an upgrade of the operator rolls no pod of a TimerWheel without it
    assert "TW_DELIVERY_GUARANTEE" not in settings()
    assert "TW_DELIVERY_GUARANTEE" not in settings(deliveryGuarantee="at-least-once")
    env = settings(deliveryGuarantee="exactly-once")
    assert env["TW_DELIVERY_GUARANTEE"] == "exactly-once"
    assert TimerConfig.from_env({**env, "TW_REDIS_URL": "redis://x"}).delivery_guarantee == "exactly-once"
    with pytest.raises(SpecError, match="^spec.deliveryGuarantee: must be at-least-once or exactly-once, "
                                        "got 'twice'$") as refused:
        read(wheel_body(deliveryGuarantee="twice"), "i")
    assert refused.value.field == "spec.deliveryGuarantee" and "\n" not in str(refused.value)


@pytest.mark.parametrize(("spec", "field"), [
    ({"tickMs": 7}, "spec.tickMs"),
    ({"allowTopics": ["("]}, "spec.allowTopics"),
    ({"rollWindowMs": 100_000, "wheelSpanMs": 150_000}, "spec.wheelSpanMs"),
    ({"kafka": {}}, "spec.kafka.bootstrap"),
    ({"redis": {}}, "spec.redis"),
    ({"stages": {"enqueueGet": {"replicas": 2}}}, "spec.stages.enqueueGet.replicas"),
    ({"deliveryGuarantee": "twice"}, "spec.deliveryGuarantee"),
])
def test_a_bad_spec_that_slipped_past_the_api_server_is_named(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError, match=rf"^{field}: "):
        read(wheel_body(**spec), "i")


PLACED: dict[str, Any] = {
    "image": {"repository": "registry.example/timerwheel", "tag": "0.1.0", "pullPolicy": "Always",
              "pullSecrets": [{"name": "regcred"}]},
    "pods": {"annotations": {"sidecar.istio.io/inject": "false"}, "nodeSelector": {"pool": "timers"},
             "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "timers", "effect": "NoSchedule"}],
             "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                 {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
             "priorityClassName": "timers-high"},
}


def every_pod(body: dict[str, Any], claim: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """The pod templates of the five stages, a recovery Job and a window Job of ``body``."""
    from timerwheel_operator.manifests import recovery_job, window_job
    from timerwheel_operator.spec import with_claim

    wheel = with_claim(read(body, "timerwheel:dev", "Never"), claim)
    out = {m["metadata"]["name"]: m["spec"]["template"] for m in build_all(wheel, body)
           if m["kind"] in ("Deployment", "StatefulSet")}
    for job in (recovery_job(wheel, 0, 1, body), window_job(wheel, 1, {"TW_TICK_MS": "200"}, "200/2000/0", body)):
        out[job["metadata"]["name"]] = job["spec"]["template"]
    assert len(out) == 7
    return out


def test_pull_secrets_and_placement_reach_every_stage_pod_and_the_operator_s_jobs() -> None:
    body = wheel_body(**PLACED, storage={"accessModes": ["ReadWriteMany"]})
    for name, template in every_pod(body).items():
        spec = template["spec"]
        assert spec["imagePullSecrets"] == [{"name": "regcred"}], name
        assert spec["nodeSelector"] == {"pool": "timers"} and spec["priorityClassName"] == "timers-high", name
        assert spec["tolerations"] == PLACED["pods"]["tolerations"], name
        assert spec["affinity"] == PLACED["pods"]["affinity"], name  # ReadWriteMany: nothing added
        assert template["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false", name
        assert spec["containers"][0]["image"] == "registry.example/timerwheel:0.1.0", name
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, "spec": spec},
                                     K8S_VERSION, strict=True)
    # the operator's own pull secrets when the TimerWheel names none
    wheel = read(wheel_body(), "timerwheel:dev", "Never", ("from-operator",))
    assert wheel.pull_secrets == ("from-operator",)
    assert read(wheel_body(image={"pullSecrets": []}), "i", "Never", ("from-operator",)).pull_secrets == ()


def test_a_read_write_once_claim_keeps_every_pod_of_the_timerwheel_on_its_node() -> None:
    term = {"labelSelector": {"matchLabels": {"app.kubernetes.io/name": "timerwheel",
                                              "app.kubernetes.io/instance": "orders",
                                              "app.kubernetes.io/managed-by": "timerwheel-operator"}},
            "topologyKey": "kubernetes.io/hostname"}
    # the default claim is ReadWriteOnce: the pods go where the first one is, and each matches
    # the term itself (so the first one may start the group)
    for name, template in every_pod(wheel_body(pods=PLACED["pods"])).items():
        affinity = template["spec"]["affinity"]
        assert affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == [term], name
        assert affinity["nodeAffinity"] == PLACED["pods"]["affinity"]["nodeAffinity"], name  # the user's kept
        labels = template["metadata"]["labels"]
        assert all(labels[k] == v for k, v in term["labelSelector"]["matchLabels"].items()), name
    # the claim as the cluster has it decides: a bound ReadWriteMany claim spreads them (an
    # existing claim the spec knows nothing of, too), a ReadWriteOnce one keeps them together
    rwx = {"spec": {"accessModes": ["ReadWriteMany"]}, "status": {"phase": "Bound", "accessModes": ["ReadWriteMany"]}}
    for template in every_pod(wheel_body(storage={"existingClaim": "nfs"}), rwx).values():
        assert "affinity" not in template["spec"]
    rwo = {"spec": {"accessModes": ["ReadWriteOnce"]}, "status": {"phase": "Bound", "accessModes": ["ReadWriteOnce"]}}
    for template in every_pod(wheel_body(storage={"accessModes": ["ReadWriteMany"]}), rwo).values():
        assert template["spec"]["affinity"]["podAffinity"], template["metadata"]["labels"]


def test_a_made_claim_keeps_its_access_modes_and_class_a_spec_cannot_share_one_pod_only() -> None:
    from timerwheel_operator.manifests import volume_claim
    from timerwheel_operator.spec import with_claim

    body = wheel_body(storage={"accessModes": ["ReadWriteOnce"], "size": "2Gi"})
    live = {"spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "nfs"}, "status": {"phase": "Bound"}}
    pvc = volume_claim(with_claim(read(body, "i"), live), None)
    assert pvc["spec"] == {"accessModes": ["ReadWriteMany"], "storageClassName": "nfs",
                           "resources": {"requests": {"storage": "2Gi"}}}
    for modes in (["ReadWriteOncePod"], ["ReadOnlyMany"]):
        with pytest.raises(SpecError, match="^spec.storage.accessModes: .* cannot be shared by the five stages"):
            read(wheel_body(storage={"accessModes": modes}), "i")


def test_a_stage_ends_its_log_into_the_termination_message() -> None:
    for spec in pod_specs(built()).values():
        assert spec["containers"][0]["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_bad_placement_slipping_past_the_api_server_is_named() -> None:
    with pytest.raises(SpecError, match=r"^spec.pods.tolerations\[0\]: "):
        read(wheel_body(pods={"tolerations": ["NoSchedule"]}), "i")
    with pytest.raises(SpecError, match="^spec.pods.affinity: "):
        read(wheel_body(pods={"affinity": ["x"]}), "i")
