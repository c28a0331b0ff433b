"""Plain functions from a read ``Wheel`` to the manifests the operator applies.

What one TimerWheel ``NAME`` becomes (every name starts ``timerwheel-NAME``, never ``tw-``):

- ``timerwheel-NAME-data``: the shared volume claim, unless ``spec.storage.existingClaim``;
  without an owner reference (kept when the TimerWheel goes) unless ``keepOnDelete: false``.
- ``timerwheel-NAME-settings``: a ConfigMap of the ``TW_*`` settings every stage reads.
- ``timerwheel-NAME``: the stages' ServiceAccount. The stages never call the API server: it has
  no role and mounts no token (least privilege is none).
- per stage: a StatefulSet (enqueue-put, dequeue-get: they own shards through leases) or a
  Deployment (the other three), a headless Service (port ``http`` 8080: /healthz, /readyz,
  /metrics; headless Services also make no service-link variables) and a PodDisruptionBudget.

Pods run as the image's non-root user 10001 with a read-only root file system, no privilege
escalation, no capabilities, seccomp RuntimeDefault, ``enableServiceLinks: false``, the volume
at /data and an emptyDir at /tmp. A change of the settings rolls the pods (a hash annotation).
Every pod of the TimerWheel, the stages' and the operator's Jobs', gets ``spec.pods`` (annotations,
nodeSelector, tolerations, affinity, priorityClassName) and ``spec.image.pullSecrets``; with a
ReadWriteOnce claim also a pod affinity that keeps them all on the claim's node (``affinity``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from timerwheel_operator import FIELD_MANAGER
from timerwheel_operator.crd import SHARD_OWNERS, STAGES
from timerwheel_operator.jobs import ATTEMPT
from timerwheel_operator.recovery import SHARD_LABEL
from timerwheel_operator.spec import (
    DATA_DIR,
    DEFAULT_ACCESS_MODES,
    HTTP_PORT,
    KAFKA_SECRET_DIR,
    Wheel,
    base_name,
    workload_name,
)
from timerwheel_operator.window import EXIT_REFUSED_UNCHANGED, WINDOW_ANNOTATION

Manifest = dict[str, Any]
USER_ID = 10001


def labels(wheel_name: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "timerwheel",
        "app.kubernetes.io/instance": wheel_name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "timerwheel",
        "app.kubernetes.io/managed-by": FIELD_MANAGER,
    }


def selector(wheel_name: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "timerwheel",
        "app.kubernetes.io/instance": wheel_name,
        "app.kubernetes.io/component": component,
    }


def owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(wheel: Wheel, name: str, component: str, owner: Mapping[str, Any] | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": wheel.namespace, "labels": labels(wheel.name, component)}
    if owner is not None:
        meta["ownerReferences"] = [owner_reference(owner)]
    return meta


def settings_name(wheel: Wheel) -> str:
    return f"{base_name(wheel.name)}-settings"


def settings_hash(wheel: Wheel) -> str:
    return hashlib.sha256(json.dumps(dict(wheel.env), sort_keys=True).encode()).hexdigest()[:16]


def config_map(wheel: Wheel, owner: Mapping[str, Any] | None) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(wheel, settings_name(wheel), "settings", owner),
        "data": dict(wheel.env),
    }


def volume_claim(wheel: Wheel, owner: Mapping[str, Any] | None) -> Manifest:
    """The claim the operator makes. Once made, its access modes and storage class stay as they
    are (Kubernetes refuses a change of either): the manifest repeats the live claim's."""
    storage = wheel.storage
    keep = storage.get("keepOnDelete", True)
    live = (wheel.live_claim or {}).get("spec") or {}
    spec: dict[str, Any] = {
        "accessModes": list(live.get("accessModes") or storage.get("accessModes") or DEFAULT_ACCESS_MODES),
        "resources": {"requests": {"storage": str(storage.get("size") or "10Gi")}},
    }
    if wheel.live_claim is not None:
        if "storageClassName" in live:
            spec["storageClassName"] = live["storageClassName"]
    elif "storageClassName" in storage:
        spec["storageClassName"] = storage["storageClassName"]
    meta = _meta(wheel, wheel.claim, "data", None if keep else owner)
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec}


def service_account(wheel: Wheel, owner: Mapping[str, Any] | None) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(wheel, base_name(wheel.name), "stages", owner),
        "automountServiceAccountToken": False,
    }


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    }


def _env(wheel: Wheel) -> list[dict[str, Any]]:
    # The root file system is read-only: Python must not try to write bytecode caches there.
    env: list[dict[str, Any]] = [{"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}]
    if wheel.redis_secret is not None:
        env.append({"name": "TW_REDIS_URL", "valueFrom": {"secretKeyRef": {
            "name": wheel.redis_secret["name"], "key": wheel.redis_secret["key"]}}})
    if wheel.otlp_endpoint:
        env += [
            {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": wheel.otlp_endpoint},
            {"name": "OTEL_TRACES_EXPORTER", "value": "otlp"},
        ]
    return env


def _mounts(wheel: Wheel) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [{"name": "data", "mountPath": DATA_DIR}, {"name": "tmp", "mountPath": "/tmp"}]
    if wheel.kafka_secret:
        mounts.append({"name": "kafka-secret", "mountPath": KAFKA_SECRET_DIR, "readOnly": True})
    return mounts


CONTAINER_SECURITY: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}


def container(wheel: Wheel, stage: str) -> dict[str, Any]:
    env = _env(wheel)
    mounts = _mounts(wheel)
    spec = wheel.stage(stage)
    out: dict[str, Any] = {
        "name": stage,
        "image": wheel.image,
        "imagePullPolicy": wheel.pull_policy,
        "command": ["timerwheel", "stage", stage],
        "envFrom": [{"configMapRef": {"name": settings_name(wheel)}}],
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        # Liveness: the loop runs. Readiness: able to serve (not "owns its shards", which would
        # deadlock a one-replica rollout); startup allows a minute to reach Kafka and Redis.
        "startupProbe": _probe("/healthz", 2, 30),
        "livenessProbe": _probe("/healthz", 10, 3),
        "readinessProbe": _probe("/readyz", 5, 2),
        "volumeMounts": mounts,
        "securityContext": dict(CONTAINER_SECURITY),
        # a crashing stage's last log lines (its error) as the termination message: the operator
        # names it in the status (diagnosis: CrashLooping)
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    out["env"] = env
    if spec.resources:
        out["resources"] = dict(spec.resources)
    return out


def _volumes(wheel: Wheel) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [
        {"name": "data", "persistentVolumeClaim": {"claimName": wheel.claim}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}},
    ]
    if wheel.kafka_secret:
        volumes.append({"name": "kafka-secret", "secret": {"secretName": wheel.kafka_secret}})
    return volumes


POD_SECURITY: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": USER_ID,
    "runAsGroup": USER_ID,
    "fsGroup": USER_ID,
    "fsGroupChangePolicy": "OnRootMismatch",
    "seccompProfile": {"type": "RuntimeDefault"},
}


#: The labels that pick every pod of one TimerWheel (stages and Jobs), and none of the chart's
#: operator (which shares name and instance with a TimerWheel named after the release).
def wheel_pods(wheel_name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "timerwheel", "app.kubernetes.io/instance": wheel_name,
            "app.kubernetes.io/managed-by": FIELD_MANAGER}


def affinity(wheel: Wheel) -> dict[str, Any]:
    """``spec.pods.affinity``, and with a ReadWriteOnce claim (``Wheel.single_node``) a required
    pod affinity to the TimerWheel's other pods on the same node: the first pod goes where the
    volume can attach (the scheduler lets a pod that matches its own term start a group), every
    later one follows it, so the one-node volume is mounted by all of them."""
    out: dict[str, Any] = json.loads(json.dumps(dict(wheel.pods.affinity)))  # a copy to add to
    if wheel.single_node:
        pod_affinity = out.setdefault("podAffinity", {})
        pod_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(
            {"labelSelector": {"matchLabels": wheel_pods(wheel.name)}, "topologyKey": "kubernetes.io/hostname"})
    return out


def pod_placement(wheel: Wheel) -> dict[str, Any]:
    """What every pod spec of the TimerWheel gets from ``spec.pods`` and ``spec.image.pullSecrets``,
    and the one-node affinity of a ReadWriteOnce claim."""
    out: dict[str, Any] = {}
    if wheel.pull_secrets:
        out["imagePullSecrets"] = [{"name": n} for n in wheel.pull_secrets]
    if wheel.pods.node_selector:
        out["nodeSelector"] = dict(wheel.pods.node_selector)
    if wheel.pods.tolerations:
        out["tolerations"] = [dict(t) for t in wheel.pods.tolerations]
    wanted = affinity(wheel)
    if wanted:
        out["affinity"] = wanted
    if wheel.pods.priority_class:
        out["priorityClassName"] = wheel.pods.priority_class
    return out


def pod_template(wheel: Wheel, stage: str) -> dict[str, Any]:
    volumes = _volumes(wheel)
    return {
        "metadata": {
            "labels": labels(wheel.name, stage),
            "annotations": {**wheel.pods.annotations, "timerwheel.io/settings-hash": settings_hash(wheel)},
        },
        "spec": {
            "serviceAccountName": base_name(wheel.name),
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            # enqueue-put and dequeue-get release their shards on SIGTERM within this.
            "terminationGracePeriodSeconds": 30,
            "securityContext": dict(POD_SECURITY),
            **pod_placement(wheel),
            "containers": [container(wheel, stage)],
            "volumes": volumes,
        },
    }


def workload(wheel: Wheel, stage: str, owner: Mapping[str, Any] | None, replicas: int | None = None) -> Manifest:
    """``replicas``: the count to set (the autoscaler's), else the spec's; none at all for a
    stage whose replicas are managed externally (server-side apply then leaves them alone)."""
    name = workload_name(wheel.name, stage)
    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector(wheel.name, stage)},
        "template": pod_template(wheel, stage),
    }
    if wheel.stage(stage).operator_replicas:
        spec = {"replicas": wheel.stage(stage).replicas if replicas is None else replicas, **spec}
    if stage in SHARD_OWNERS:
        spec["serviceName"] = name
        spec["podManagementPolicy"] = "Parallel"
        spec["updateStrategy"] = {"type": "RollingUpdate"}
        kind = "StatefulSet"
    else:
        spec["strategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
        kind = "Deployment"
    return {"apiVersion": "apps/v1", "kind": kind, "metadata": _meta(wheel, name, stage, owner), "spec": spec}


#: The component label of the recovery Jobs and their pods.
RECOVERY = "recovery"
#: A recovery Job that runs longer than this is failed by Kubernetes (the pod is killed).
RECOVERY_DEADLINE_S = 600
#: Finished recovery Jobs (and their pods, with the log to read) are kept this long.
RECOVERY_TTL_S = 86_400


def _one_pod_job(wheel: Wheel, meta: Manifest, component: str, marks: Mapping[str, str],
                 container: Manifest, deadline_s: int) -> Manifest:
    """The operator's Jobs (recovery, window): one pod of ``container``, never retried by
    Kubernetes (the operator decides), failed after ``deadline_s``, kept RECOVERY_TTL_S; the
    stages' ServiceAccount (no role, no token), pod defaults and volumes."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": deadline_s,
            "ttlSecondsAfterFinished": RECOVERY_TTL_S,
            "template": {
                "metadata": {"labels": {**labels(wheel.name, component), **marks},
                             **({"annotations": dict(wheel.pods.annotations)} if wheel.pods.annotations else {})},
                "spec": {
                    "restartPolicy": "Never",
                    "serviceAccountName": base_name(wheel.name),
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": dict(POD_SECURITY),
                    **pod_placement(wheel),
                    "containers": [container],
                    "volumes": _volumes(wheel),
                },
            },
        },
    }


def recovery_job_name(wheel: Wheel, shard: int, serial: int) -> str:
    return f"{base_name(wheel.name)}-recover-{shard}-{serial}"


def recovery_job(wheel: Wheel, shard: int, serial: int, owner: Mapping[str, Any] | None) -> Manifest:
    """A Job running ``timerwheel recover --shard N`` on the stages' volume, with their settings,
    image and pod defaults; its own ServiceAccount is the stages' (no role, no token). One pod,
    never restarted by Kubernetes: the operator decides about another attempt (``recovery``)."""
    name = recovery_job_name(wheel, shard, serial)
    meta = _meta(wheel, name, RECOVERY, owner)
    marks = {SHARD_LABEL: str(shard), ATTEMPT: str(serial)}
    meta["labels"].update(marks)
    out = {
        "name": "recover",
        "image": wheel.image,
        "imagePullPolicy": wheel.pull_policy,
        "command": ["timerwheel", "recover", "--shard", str(shard), "--data-dir", DATA_DIR],
        "envFrom": [{"configMapRef": {"name": settings_name(wheel)}}],
        "env": _env(wheel),
        "volumeMounts": _mounts(wheel),
        "securityContext": dict(CONTAINER_SECURITY),
        # the report's last lines as the termination message when the log is gone
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    return _one_pod_job(wheel, meta, RECOVERY, marks, out, RECOVERY_DEADLINE_S)


#: The component label of the window Jobs (``window``) and their pods.
WINDOW = "window"
#: A window Job that runs longer than this is failed by Kubernetes (the shards stay paused).
WINDOW_DEADLINE_S = 3_600


def window_job_name(wheel: Wheel, serial: int) -> str:
    return f"{base_name(wheel.name)}-window-{serial}"


def window_job(wheel: Wheel, serial: int, env: Mapping[str, str], annotation: str,
               owner: Mapping[str, Any] | None) -> Manifest:
    """A Job running ``timerwheel rebuild-wheel --shard N --change-window`` for every shard, one
    after the other, with the new window's ``TW_*`` values (``env``) over the stages' ConfigMap;
    the recovery Job's image, volume, ServiceAccount and pod defaults. One pod, no retries: the
    operator decides (``window``). ``annotation`` names the window it builds."""
    name = window_job_name(wheel, serial)
    meta = _meta(wheel, name, WINDOW, owner)
    marks = {ATTEMPT: str(serial)}
    meta["labels"].update(marks)
    meta["annotations"] = {WINDOW_ANNOTATION: annotation}
    # Every shard checked first (exit 2 there: EXIT_REFUSED_UNCHANGED, nothing changed), then rebuilt.
    each = f"s=0; while [ $s -lt {wheel.config.shards} ]; do timerwheel rebuild-wheel --shard $s --data-dir {DATA_DIR} " \
           "--change-window"
    script = (f"set -e; {each} --check || {{ c=$?; [ $c -eq 2 ] && exit {EXIT_REFUSED_UNCHANGED}; exit $c; }}; "
              f"s=$((s+1)); done; {each}; s=$((s+1)); done")
    out = {
        "name": "rebuild-wheel",
        "image": wheel.image,
        "imagePullPolicy": wheel.pull_policy,
        "command": ["sh", "-c", script],
        "envFrom": [{"configMapRef": {"name": settings_name(wheel)}}],
        "env": [*_env(wheel), *({"name": k, "value": v} for k, v in sorted(env.items()))],
        "volumeMounts": _mounts(wheel),
        "securityContext": dict(CONTAINER_SECURITY),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    return _one_pod_job(wheel, meta, WINDOW, marks, out, WINDOW_DEADLINE_S)


def service(wheel: Wheel, stage: str, owner: Mapping[str, Any] | None) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(wheel, workload_name(wheel.name, stage), stage, owner),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector(wheel.name, stage),
            "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def disruption_budget(wheel: Wheel, stage: str, owner: Mapping[str, Any] | None) -> Manifest:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(wheel, workload_name(wheel.name, stage), stage, owner),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(wheel.name, stage)}},
    }


def build_all(wheel: Wheel, owner: Mapping[str, Any] | None,
              replicas: Mapping[str, int] | None = None) -> list[Manifest]:
    """Everything one TimerWheel becomes, in the order to apply it (claim and settings first);
    ``replicas`` overrides the spec's count of some stages (the autoscaler's decisions)."""
    out: list[Manifest] = []
    if wheel.make_claim:
        out.append(volume_claim(wheel, owner))
    out += [config_map(wheel, owner), service_account(wheel, owner)]
    for stage in STAGES:
        out += [service(wheel, stage, owner), workload(wheel, stage, owner, (replicas or {}).get(stage)),
                disruption_budget(wheel, stage, owner)]
    return out
