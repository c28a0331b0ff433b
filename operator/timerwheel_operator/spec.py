"""A ``TimerWheel``'s spec read into plain values: its ``TW_*`` settings, validated by the
services' own ``TimerConfig`` (one set of rules), and the names of what the operator makes.

The API server's schema refuses most bad specs already; what slips past it (an object written
before a rule existed, a regular expression that does not compile) is caught here, and the
operator reports it in the status and an Event instead of failing.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from timerwheel.config import DAY_MS, DEFAULT_ALLOW_TOPICS, DEFAULT_DELAY_LEVELS, ENV_VARS, TimerConfig
from timerwheel.errors import ConfigError

from timerwheel_operator.autoscale import AUTOSCALED, AutoscalePolicy
from timerwheel_operator.crd import DELIVERY_STAGES, STAGES, stage_key
from timerwheel_operator.recovery import RecoveryPolicy

#: Port of /healthz, /readyz and /metrics in every stage container (TW_HTTP_PORT).
HTTP_PORT = 8080
#: Mount point of the shared volume (TW_DATA_DIR).
DATA_DIR = "/data"
KAFKA_SECRET_DIR = "/etc/timerwheel/kafka"

#: spec.kafka field -> the TW_* variable it sets (only when the field is set: a TimerWheel without
#: them keeps the ConfigMap, and so the pods, it had).
KAFKA_ENV = {"securityProtocol": "TW_KAFKA_SECURITY_PROTOCOL", "saslMechanism": "TW_KAFKA_SASL_MECHANISM",
             "saslUsername": "TW_KAFKA_SASL_USERNAME", "checkHostname": "TW_KAFKA_SSL_CHECK_HOSTNAME"}
#: spec.kafka key of its Secret -> the TW_*_FILE variable naming that key's file under KAFKA_SECRET_DIR.
KAFKA_SECRET_FILES = {"saslPasswordKey": "TW_KAFKA_SASL_PASSWORD_FILE", "caKey": "TW_KAFKA_SSL_CAFILE",
                      "certKey": "TW_KAFKA_SSL_CERTFILE", "keyKey": "TW_KAFKA_SSL_KEYFILE"}

#: spec field -> (TW_* variable, default): the spec's settings as the stages read them.
SPEC_ENV: dict[str, tuple[str, Any]] = {
    "shards": ("TW_SHARDS", 1),
    "tickMs": ("TW_TICK_MS", 100),
    "rollWindowMs": ("TW_ROLL_WINDOW_MS", 2 * DAY_MS),
    "wheelSpanMs": ("TW_WHEEL_SPAN_MS", 0),
    "maxDelayMs": ("TW_MAX_DELAY_MS", 400 * DAY_MS),
    "delayLevels": ("TW_DELAY_LEVELS", DEFAULT_DELAY_LEVELS),
    "timerTopic": ("TW_TIMER_TOPIC", "__timer"),
    "dlqTopic": ("TW_DLQ_TOPIC", "__timer_dlq"),
    "timerPartitions": ("TW_TIMER_PARTITIONS", 4),
    "allowTopics": ("TW_ALLOW_TOPICS", list(DEFAULT_ALLOW_TOPICS)),
    "deliveryGuarantee": ("TW_DELIVERY_GUARANTEE", "at-least-once"),
}


#: SPEC_ENV fields added after the first release: written into the ConfigMap only when they differ
#: from their default, so that an operator upgrade does not roll every stage pod of a TimerWheel
#: that does not use them (the pods carry the ConfigMap's hash).
WRITTEN_WHEN_SET = frozenset({"deliveryGuarantee"})


class SpecError(ConfigError):
    """A spec value the stages would refuse; ``field`` is its path in the spec."""


@dataclass(frozen=True, slots=True)
class StageSpec:
    name: str
    replicas: int
    resources: Mapping[str, Any]
    #: False: ``replicasManagedBy: external`` (a user's HPA or kubectl scale sets them).
    operator_replicas: bool = True


@dataclass(frozen=True, slots=True)
class PodSettings:
    """``spec.pods``: what every pod of the TimerWheel gets (the five stages' and the operator's
    Jobs'), besides what the operator sets itself."""

    annotations: Mapping[str, str] = dataclasses.field(default_factory=dict)
    node_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    priority_class: str | None = None


#: Access modes a claim shared by the five stages may have: ReadWriteMany (pods on any node) or
#: ReadWriteOnce (one node: every pod of the TimerWheel goes where the first one is).
SHARED_MODES = ("ReadWriteMany", "ReadWriteOnce")
DEFAULT_ACCESS_MODES = ("ReadWriteOnce",)


@dataclass(frozen=True, slots=True)
class Wheel:
    """One TimerWheel, read and validated: what the manifest builders need."""

    name: str
    namespace: str
    env: Mapping[str, str]
    #: as checked: its Kafka secret-file settings name a stand-in (``_checkable``), not the Secret
    config: TimerConfig
    stages: tuple[StageSpec, ...]
    claim: str
    make_claim: bool
    storage: Mapping[str, Any]
    redis_secret: Mapping[str, str] | None
    kafka_secret: str | None
    otlp_endpoint: str | None
    image: str
    pull_policy: str
    #: stage -> its autoscale policy, for the stages the operator autoscales (empty: off).
    autoscale: Mapping[str, AutoscalePolicy] = dataclasses.field(default_factory=dict)
    #: ``spec.recovery``: recovery Jobs and stall detection (``recovery``).
    recovery: RecoveryPolicy = dataclasses.field(default_factory=RecoveryPolicy)
    #: ``spec.kafka.manageRetention``: the operator raises the timer topic's retention.ms (``retention``).
    manage_retention: bool = True
    #: Secrets the stage pods and the Jobs pull the image with (``spec.image.pullSecrets``).
    pull_secrets: tuple[str, ...] = ()
    pods: PodSettings = dataclasses.field(default_factory=PodSettings)
    #: The volume claim as the cluster has it (``with_claim``); None: not made yet, or not read.
    live_claim: Mapping[str, Any] | None = None

    def stage(self, name: str) -> StageSpec:
        return next(s for s in self.stages if s.name == name)

    @property
    def access_modes(self) -> tuple[str, ...]:
        """The claim's access modes: the bound claim's (what its volume offers), else the spec's."""
        live = self.live_claim or {}
        modes = (live.get("status") or {}).get("accessModes") or (live.get("spec") or {}).get("accessModes") \
            or self.storage.get("accessModes") or DEFAULT_ACCESS_MODES
        return tuple(str(m) for m in modes)

    @property
    def single_node(self) -> bool:
        """Every pod on one node (the claim's): its volume is not ReadWriteMany."""
        return "ReadWriteMany" not in self.access_modes


def with_claim(wheel: Wheel, claim: Mapping[str, Any] | None) -> Wheel:
    """``wheel`` knowing its claim as the cluster has it (its access modes decide the layout)."""
    return dataclasses.replace(wheel, live_claim=claim)


def autoscale_policies(spec: Mapping[str, Any], stages: Mapping[str, StageSpec]) -> dict[str, AutoscalePolicy]:
    """``spec.autoscale`` read into a policy per autoscaled stage; none when disabled, and none
    for a stage whose replicas are managed externally (the operator never fights a user's HPA)."""
    auto = spec.get("autoscale") or {}
    if not auto.get("enabled"):
        return {}
    out = {}
    for stage, key in AUTOSCALED.items():
        if not stages[stage].operator_replicas:
            continue
        own = auto.get(key) or {}
        low = int(own.get("minReplicas", auto.get("minReplicas", 1)))
        high = int(own.get("maxReplicas", auto.get("maxReplicas", 4)))
        if low > high:
            raise SpecError(f"spec.autoscale.{key}.minReplicas", f"must not exceed maxReplicas ({low} > {high})")
        out[stage] = AutoscalePolicy(min_replicas=low, max_replicas=high, lead_ms=int(auto.get("lookAheadMs", 60_000)),
                            per_replica_per_s=float(auto.get("messagesPerSecondPerReplica", 2_000)),
                            scale_down_delay_ms=int(auto.get("scaleDownDelayMs", 120_000)))
    return out


def base_name(name: str) -> str:
    """Every object of the TimerWheel ``name`` starts so. Never ``tw-``: a Service named so would
    give every pod ``TW_*_SERVICE_HOST`` variables (see ``config.kubernetes_service_var``)."""
    return f"timerwheel-{name}"


def workload_name(name: str, stage: str) -> str:
    return f"{base_name(name)}-{stage}"


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def settings_env(spec: Mapping[str, Any]) -> dict[str, str]:
    """The ConfigMap's ``TW_*`` settings: every SPEC_ENV field (its default when absent), Kafka,
    the data directory and the HTTP port. Redis comes from the spec's url or Secret (``env``)."""
    env = {var: _env_value(spec.get(field, default)) for field, (var, default) in SPEC_ENV.items()
           if field not in WRITTEN_WHEN_SET or spec.get(field, default) != default}
    env.update(kafka_env(spec.get("kafka") or {}))
    url = spec.get("redis", {}).get("url")
    if url and not spec.get("redis", {}).get("secretRef"):
        env["TW_REDIS_URL"] = str(url)
    env["TW_DATA_DIR"] = DATA_DIR
    env["TW_HTTP_PORT"] = str(HTTP_PORT)
    return dict(sorted(env.items()))


def kafka_env(kafka: Mapping[str, Any]) -> dict[str, str]:
    """``spec.kafka`` as the stages' ``TW_KAFKA_*`` settings: the bootstrap servers, the TLS / SASL
    settings that are set, and each named key of ``secretName`` as a file under KAFKA_SECRET_DIR
    (the Secret's mount). The chart's Spark jobs set the same (templates/spark-jobs.yaml)."""
    env = {"TW_KAFKA_BOOTSTRAP": str(kafka.get("bootstrap", ""))}
    for field, var in KAFKA_ENV.items():
        if kafka.get(field) is not None:
            env[var] = _env_value(kafka[field])
    for field, var in KAFKA_SECRET_FILES.items():
        if kafka.get(field):
            env[var] = f"{KAFKA_SECRET_DIR}/{kafka[field]}"
    return env


def field_of(var: str) -> str:
    for field, (env_var, _default) in SPEC_ENV.items():
        if env_var == var:
            return f"spec.{field}"
    kafka = {v: f"spec.kafka.{f}" for f, v in (*KAFKA_ENV.items(), *KAFKA_SECRET_FILES.items())}
    kafka["TW_KAFKA_SASL_PASSWORD"] = "spec.kafka.saslPasswordKey"
    return {"TW_KAFKA_BOOTSTRAP": "spec.kafka.bootstrap", "TW_REDIS_URL": "spec.redis.url", **kafka}.get(var, var)


def in_spec_words(message: str) -> str:
    """A message of the stages' (a ``TimerConfig`` refusal, a tool's error line) with the settings
    it names given as the spec fields that set them: ``TW_*`` variables (``TW_WHEEL_SPAN_MS`` ->
    ``spec.wheelSpanMs``) and Kafka attributes (``kafka_ssl_certfile`` -> ``spec.kafka.certKey``)."""
    for var, (attr, _kind, _doc) in ENV_VARS.items():
        field = field_of(var)
        if field == var:
            continue
        if var in message:
            message = re.sub(rf"\b{var}\b", field, message)
        if attr.startswith("kafka_") and attr in message:
            message = re.sub(rf"\b{attr}\b", field, message)
    return message


def _checkable(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` as this process can check it: the Secret's files exist only in the stages' pods, so
    each ``*_FILE`` setting names a stand-in (this module: readable, not empty). What the files
    hold is the stages' to check, when they connect."""
    stand_in = os.path.abspath(__file__)
    return {k: stand_in if k in KAFKA_SECRET_FILES.values() else v for k, v in env.items()}


def pod_settings(spec: Mapping[str, Any]) -> PodSettings:
    """``spec.pods``, checked for what the schema cannot say (a toleration is an object)."""
    pods = spec.get("pods") or {}
    tolerations = list(pods.get("tolerations") or [])
    for i, t in enumerate(tolerations):
        if not isinstance(t, Mapping):
            raise SpecError(f"spec.pods.tolerations[{i}]", f"must be an object, got {t!r}")
    affinity = pods.get("affinity") or {}
    if not isinstance(affinity, Mapping):
        raise SpecError("spec.pods.affinity", f"must be an object, got {affinity!r}")
    return PodSettings({str(k): str(v) for k, v in (pods.get("annotations") or {}).items()},
                       {str(k): str(v) for k, v in (pods.get("nodeSelector") or {}).items()},
                       tuple(dict(t) for t in tolerations), dict(affinity), pods.get("priorityClassName") or None)


def read(body: Mapping[str, Any], default_image: str, default_pull_policy: str = "IfNotPresent",
         default_pull_secrets: tuple[str, ...] = ()) -> Wheel:
    """Read and validate one TimerWheel object. Raises ``SpecError`` naming the spec field."""
    meta = body.get("metadata", {})
    spec: Mapping[str, Any] = body.get("spec") or {}
    name = str(meta.get("name", ""))
    namespace = str(meta.get("namespace", "default"))
    env = settings_env(spec)
    try:
        # The stages' own check; TW_REDIS_URL may live in a Secret, so a stand-in is validated.
        config = TimerConfig.from_env({**_checkable(env), "TW_REDIS_URL": env.get("TW_REDIS_URL", "redis://secret")})
    except ConfigError as exc:
        field = field_of(exc.field)
        raise SpecError(field, in_spec_words(str(exc).split(": ", 1)[1]).replace(f" (or {field})", "")) from None
    if not env["TW_KAFKA_BOOTSTRAP"]:
        raise SpecError("spec.kafka.bootstrap", "must name the Kafka bootstrap servers")
    kafka = spec.get("kafka") or {}
    for field in KAFKA_SECRET_FILES:
        if kafka.get(field) and not kafka.get("secretName"):
            raise SpecError(f"spec.kafka.{field}", "names a key of spec.kafka.secretName, which is not set")
    redis = spec.get("redis") or {}
    secret_ref = redis.get("secretRef")
    if not redis.get("url") and not secret_ref:
        raise SpecError("spec.redis", "needs url or secretRef")
    stages_spec = spec.get("stages") or {}
    stages = []
    delivery = int(spec.get("deliveryReplicas", 1))
    if delivery < 0:
        raise SpecError("spec.deliveryReplicas", f"must be >= 0, got {delivery}")
    for stage in STAGES:
        one = stages_spec.get(stage_key(stage)) or {}
        # dequeue-getmsg and dequeue-put: their own replicas win over spec.deliveryReplicas (kubectl scale)
        replicas = int(one.get("replicas", delivery if stage in DELIVERY_STAGES else 1))
        if replicas < 0:
            raise SpecError(f"spec.stages.{stage_key(stage)}.replicas", f"must be >= 0, got {replicas}")
        if stage == "enqueue-get" and replicas > 1:
            raise SpecError("spec.stages.enqueueGet.replicas", f"must be 0 or 1 for now, got {replicas}")
        managed = str(one.get("replicasManagedBy") or "operator")
        if managed not in ("operator", "external"):
            raise SpecError(f"spec.stages.{stage_key(stage)}.replicasManagedBy",
                            f"must be operator or external, got {managed!r}")
        stages.append(StageSpec(stage, replicas, dict(one.get("resources") or {}), managed == "operator"))
    storage = dict(spec.get("storage") or {})
    existing = storage.get("existingClaim")
    modes = list(storage.get("accessModes") or DEFAULT_ACCESS_MODES)
    if not set(modes) & set(SHARED_MODES):
        raise SpecError("spec.storage.accessModes", f"{', '.join(modes)} cannot be shared by the five stages: "
                        "use ReadWriteOnce (every pod on the claim's node) or ReadWriteMany (any node)")
    image_spec = spec.get("image") or {}
    image = default_image
    if image_spec.get("repository"):
        image = f"{image_spec['repository']}:{image_spec.get('tag') or 'latest'}"
    secret = {"name": str(secret_ref["name"]), "key": str(secret_ref.get("key", "url"))} if secret_ref else None
    return Wheel(
        name=name,
        namespace=namespace,
        env=env,
        config=config,
        stages=tuple(stages),
        claim=str(existing) if existing else f"{base_name(name)}-data",
        make_claim=not existing,
        storage=storage,
        redis_secret=secret,
        kafka_secret=(spec.get("kafka") or {}).get("secretName"),
        otlp_endpoint=(spec.get("tracing") or {}).get("otlpEndpoint"),
        image=image,
        pull_policy=str(image_spec.get("pullPolicy") or default_pull_policy),
        autoscale=autoscale_policies(spec, {s.name: s for s in stages}),
        recovery=RecoveryPolicy.of(spec, config.tick_ms),
        manage_retention=bool((spec.get("kafka") or {}).get("manageRetention", True)),
        pull_secrets=tuple(str(x["name"]) for x in image_spec["pullSecrets"] if x.get("name"))
        if image_spec.get("pullSecrets") is not None else tuple(default_pull_secrets),
        pods=pod_settings(spec),
    )
