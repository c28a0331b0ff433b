"""The ``TimerWheel`` CustomResourceDefinition, built from the same limits as ``config.py``.

The chart ships the rendered form (``charts/timerwheel/crds/``); ``python -m timerwheel_operator
crd`` prints it and a test keeps the two equal. Each spec field maps to one ``TW_*`` variable
(``spec.SPEC_ENV``); the API server refuses what ``TimerConfig`` would refuse, with a message
naming the field: the schema's types, ranges and enums, plus CEL rules for what spans fields
(the shard count is immutable, the roll window is whole ticks, the wheel spans two windows).
"""

from __future__ import annotations

from typing import Any

from timerwheel.config import (
    ALLOWED_TICKS_MS,
    DAY_MS,
    DEFAULT_ALLOW_TOPICS,
    DEFAULT_DELAY_LEVELS,
    DELIVERY_GUARANTEES,
)

from timerwheel_operator import GROUP, KIND, PLURAL, VERSION

Schema = dict[str, Any]

#: The stages, in pipeline order, with their spec key.
STAGES = ("enqueue-get", "enqueue-put", "dequeue-get", "dequeue-getmsg", "dequeue-put")
#: The stages that own shards: StatefulSets, one owner per shard through leases.
SHARD_OWNERS = ("enqueue-put", "dequeue-get")
#: The delivery stages: ``spec.deliveryReplicas`` (the scale subresource, ``kubectl scale``) sets
#: their replicas unless ``spec.stages.<stage>.replicas`` does.
DELIVERY_STAGES = ("dequeue-getmsg", "dequeue-put")
#: Longest TimerWheel name: the StatefulSet "timerwheel-NAME-enqueue-put" must leave room for
#: the controller-revision-hash label (63 characters at most).
MAX_NAME = 28
MAX_MS = 10_000 * DAY_MS
KAFKA_TOPIC = r"^[a-zA-Z0-9._-]{1,249}$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


def stage_key(stage: str) -> str:
    """``dequeue-getmsg`` -> ``dequeueGetmsg``: the stage's key under ``spec.stages``."""
    head, *rest = stage.split("-")
    return head + "".join(part.capitalize() for part in rest)


def _int(minimum: int, maximum: int, default: int | None = None, doc: str = "") -> Schema:
    out: Schema = {"type": "integer", "format": "int64", "minimum": minimum, "maximum": maximum}
    if default is not None:
        out["default"] = default
    if doc:
        out["description"] = doc
    return out


def _str(doc: str, **more: Any) -> Schema:
    return {"type": "string", "description": doc, **more}


def _secret_ref(doc: str, key_default: str) -> Schema:
    return {
        "type": "object",
        "description": doc,
        "required": ["name"],
        "properties": {
            "name": _str("Secret in the TimerWheel's namespace", maxLength=253, pattern=DNS_LABEL),
            "key": _str("key in the Secret", default=key_default, maxLength=253, pattern=r"^[-._a-zA-Z0-9]+$"),
        },
    }


#: spec.kafka's keys of its Secret -> the TW_* file setting each becomes (spec.KAFKA_SECRET_FILES).
KAFKA_SECRET_KEYS = {"saslPasswordKey": "the SASL password (TW_KAFKA_SASL_PASSWORD_FILE)",
                     "caKey": "the PEM CA bundle that signed the brokers' certificates (TW_KAFKA_SSL_CAFILE)",
                     "certKey": "the PEM client certificate, for mutual TLS (TW_KAFKA_SSL_CERTFILE)",
                     "keyKey": "the PEM private key of certKey (TW_KAFKA_SSL_KEYFILE)"}


def _kafka_schema() -> Schema:
    """spec.kafka: the bootstrap servers and the client's TLS / SASL settings, as the stages read
    them (TW_KAFKA_*); the secret material comes from keys of one Secret mounted in every stage."""
    keys = {k: _str(f"key in secretName holding {doc}", maxLength=253, pattern=r"^[-._a-zA-Z0-9]+$")
            for k, doc in KAFKA_SECRET_KEYS.items()}
    return {
        "type": "object",
        "required": ["bootstrap"],
        "properties": {
            "bootstrap": _str("Kafka bootstrap servers, host:port[,host:port] (TW_KAFKA_BOOTSTRAP)",
                              minLength=1, maxLength=4096, pattern=r"^[^\s,]+(,[^\s,]+)*$"),
            "secretName": _str("Secret with the client's SASL/TLS material, mounted read-only at "
                               "/etc/timerwheel/kafka in every stage", maxLength=253, pattern=DNS_LABEL),
            "manageRetention": {"type": "boolean", "default": True,
                                "description": "the operator raises the timer topic's retention.ms to 1.5 x "
                                               "rollWindowMs through Kafka's admin API (never lowers it); "
                                               "false: a window change that needs more is refused"},
            "securityProtocol": _str("TW_KAFKA_SECURITY_PROTOCOL (unset: PLAINTEXT)",
                                     enum=["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]),
            "saslMechanism": _str("TW_KAFKA_SASL_MECHANISM, with SASL_*", enum=["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]),
            "saslUsername": _str("TW_KAFKA_SASL_USERNAME, with SASL_*", maxLength=1024),
            "checkHostname": {"type": "boolean", "description": "TW_KAFKA_SSL_CHECK_HOSTNAME (unset: true): the "
                              "brokers' certificates must name the host connected to"},
            **keys,
        },
        "x-kubernetes-validations": [{
            "rule": "has(self.secretName) || !(" + " || ".join(f"has(self.{k})" for k in KAFKA_SECRET_KEYS) + ")",
            "message": "spec.kafka: saslPasswordKey, caKey, certKey and keyKey name keys of secretName: set it",
        }],
    }


QUANTITY: Schema = {
    "x-kubernetes-int-or-string": True,
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "pattern": r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$",
}

RESOURCES: Schema = {
    "type": "object",
    "description": "the stage container's requests and limits (cpu, memory, ephemeral-storage)",
    "properties": {
        "requests": {"type": "object", "additionalProperties": QUANTITY},
        "limits": {"type": "object", "additionalProperties": QUANTITY},
    },
}


def _stage_schema(stage: str) -> Schema:
    if stage == "enqueue-get":
        # Each enqueue-get replica needs its own TW_REPLICA_INDEX, which a Deployment cannot give;
        # more replicas come with the operator's scaling work.
        replicas = _int(0, 1, 1, "0 stops the stage; enqueue-get runs one replica for now")
    elif stage in SHARD_OWNERS:
        replicas = _int(0, 4096, 1, "pods competing for the shards (at most spec.shards); each shard has one owner")
    else:
        replicas = _int(0, 1000, None, "consumers of the stage's work queue; unset: spec.deliveryReplicas")
    props: Schema = {"replicas": replicas, "resources": RESOURCES}
    if stage not in SHARD_OWNERS and stage != "enqueue-get":
        props["replicasManagedBy"] = {
            "type": "string", "enum": ["operator", "external"], "default": "operator",
            "description": "operator: the operator sets the replicas (spec.stages.*.replicas, or spec.autoscale); "
                           "external: it never sets them (your HorizontalPodAutoscaler or kubectl scale does)",
        }
    return {
        "type": "object",
        "description": f"the {stage} stage",
        "properties": props,
    }


#: How a change of the window is done (``window``): not refused, but a managed operation.
WINDOW_CHANGE = ("changing it pauses enqueue-put and dequeue-get, rebuilds every shard's wheel with a Job "
                 "(timerwheel rebuild-wheel --change-window) and rolls the stages (condition WindowRolling)")


def _autoscale_schema() -> Schema:
    bounds: Schema = {
        "type": "object",
        "properties": {"minReplicas": _int(1, 1000), "maxReplicas": _int(1, 1000)},
        "x-kubernetes-validations": [{
            "rule": "!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
            "message": "minReplicas must not exceed maxReplicas",
        }],
    }
    return {
        "type": "object",
        "description": "the operator scales dequeue-getmsg and dequeue-put ahead of the load the wheel "
                       "holds (see timerwheel_operator.autoscale); the stages' replicas are then its, not "
                       "spec.stages.*.replicas",
        "properties": {
            "enabled": {"type": "boolean", "default": False},
            "minReplicas": _int(1, 1000, 1),
            "maxReplicas": _int(1, 1000, 4),
            "lookAheadMs": _int(1000, DAY_MS, 60_000, "lead time: a spike due within it is scaled for now "
                                "(read over 60 s or 300 s ahead, the narrowest covering it)"),
            "messagesPerSecondPerReplica": _int(1, 10_000_000, 2_000, "what one replica of each stage sustains"),
            "scaleDownDelayMs": _int(0, DAY_MS, 120_000, "a lower count waits this long after the last change"),
            "dequeueGetmsg": {**bounds, "description": "min/max for dequeue-getmsg (default: the ones above)"},
            "dequeuePut": {**bounds, "description": "min/max for dequeue-put (default: the ones above)"},
        },
        "x-kubernetes-validations": [{
            "rule": "!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
            "message": "spec.autoscale.minReplicas must not exceed maxReplicas",
        }],
    }


_STRING_MAP: Schema = {"type": "object", "additionalProperties": {"type": "string"}}


def _pods_schema() -> Schema:
    """spec.pods: placement and metadata of every pod of the TimerWheel (stages and Jobs)."""
    toleration = {"type": "object", "properties": {
        "key": {"type": "string", "maxLength": 316},
        "operator": {"type": "string", "enum": ["Exists", "Equal"]},
        "value": {"type": "string", "maxLength": 63},
        "effect": {"type": "string", "enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]},
        "tolerationSeconds": {"type": "integer", "format": "int64"},
    }}
    return {
        "type": "object",
        "description": "placement and metadata of the stage pods and of the operator's Jobs (recovery, window "
                       "change); with a ReadWriteOnce claim the operator adds a pod affinity that keeps them "
                       "on the claim's node",
        "properties": {
            "annotations": {**_STRING_MAP, "description": "annotations of every pod (e.g. a service mesh's)"},
            "nodeSelector": {**_STRING_MAP, "description": "the pods' nodeSelector"},
            "tolerations": {"type": "array", "maxItems": 50, "items": toleration,
                            "description": "the pods' tolerations"},
            "affinity": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                         "description": "the pods' affinity (core/v1 Affinity), checked by the API server when "
                                        "the operator applies the workloads (ApplyFailed names a bad one)"},
            "priorityClassName": _str("the pods' PriorityClass (empty: the cluster's default)", maxLength=253,
                                      pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$"),
        },
    }


def spec_schema() -> Schema:
    ticks = list(ALLOWED_TICKS_MS)
    stages: Schema = {
        "type": "object",
        "description": "replicas and resources per stage",
        "default": {},
        "properties": {stage_key(s): {**_stage_schema(s), "default": {}} for s in STAGES},
    }
    return {
        "type": "object",
        "required": ["kafka", "redis"],
        "properties": {
            "shards": {
                **_int(1, 4096, 1, "number of shards (TW_SHARDS); timer partition p belongs to shard p % shards. "
                       "Immutable: changing it would move partitions between shards"),
                "x-kubernetes-validations": [{
                    "rule": "self == oldSelf",
                    "message": "spec.shards is immutable: changing the shard count would move timer partitions "
                               "between shards and deliver old messages again",
                }],
            },
            "tickMs": {
                "type": "integer", "format": "int64", "enum": ticks, "default": 100,
                "description": f"wheel precision in ms (TW_TICK_MS): one of {', '.join(map(str, ticks))}; "
                               + WINDOW_CHANGE,
            },
            "rollWindowMs": _int(10, MAX_MS, 2 * DAY_MS,
                                 "messages due further than this past W are rolled (TW_ROLL_WINDOW_MS); a multiple "
                                 "of tickMs, at least 10 ticks; the timer topic keeps 1.5 x it; " + WINDOW_CHANGE),
            "wheelSpanMs": _int(0, 2 * MAX_MS, 0,
                                "span of the wheel (TW_WHEEL_SPAN_MS): 0 means 2 x rollWindowMs, else a "
                                "multiple of tickMs at least 2 x rollWindowMs; " + WINDOW_CHANGE),
            "deliveryReplicas": _int(0, 1000, 1, "replicas of dequeue-getmsg and dequeue-put, set by `kubectl scale "
                                     "timerwheel/NAME --replicas=N` (the scale subresource); "
                                     "spec.stages.<stage>.replicas, when set, wins for its stage; ignored while "
                                     "spec.autoscale.enabled or replicasManagedBy: external"),
            "maxDelayMs": _int(1, MAX_MS, 400 * DAY_MS, "longest accepted delay (TW_MAX_DELAY_MS)"),
            "delayLevels": _str("delay-level table (TW_DELAY_LEVELS)", default=DEFAULT_DELAY_LEVELS,
                                maxLength=1024, pattern=r"^\s*\d+(ms|s|m|h|d)?(\s+\d+(ms|s|m|h|d)?)*\s*$"),
            "timerTopic": _str("topic producers write timer messages to (TW_TIMER_TOPIC)", default="__timer",
                               pattern=KAFKA_TOPIC),
            "dlqTopic": _str("dead-letter topic (TW_DLQ_TOPIC)", default="__timer_dlq", pattern=KAFKA_TOPIC),
            "timerPartitions": _int(1, 10_000, 4, "partitions of the timer topic when timerwheel creates it "
                                    "(TW_TIMER_PARTITIONS)"),
            "allowTopics": {
                "type": "array",
                "description": "regular expressions a destination topic must fully match (TW_ALLOW_TOPICS)",
                "default": list(DEFAULT_ALLOW_TOPICS),
                "maxItems": 100,
                "items": {"type": "string", "minLength": 1, "maxLength": 512, "pattern": r"^[^,]+$"},
            },
            "deliveryGuarantee": _str("at-least-once (the default) or exactly-once: dequeue-put commits each "
                                      "shard's deliveries, roll hops and dead letters with a progress record in "
                                      "one Kafka transaction; consumers must read with "
                                      "isolation.level=read_committed (TW_DELIVERY_GUARANTEE)",
                                      enum=list(DELIVERY_GUARANTEES), default="at-least-once"),
            "kafka": _kafka_schema(),
            "redis": {
                "type": "object",
                "properties": {
                    "url": _str("Redis URL for the work queues and leases (TW_REDIS_URL)", maxLength=4096,
                                pattern=r"^rediss?://"),
                    "secretRef": _secret_ref("Secret key holding the Redis URL (with its password); "
                                             "wins over url", "url"),
                },
                "x-kubernetes-validations": [{
                    "rule": "has(self.url) || has(self.secretRef)",
                    "message": "spec.redis needs url or secretRef",
                }],
            },
            "storage": {
                "type": "object",
                "description": "the shared volume holding every shard's TimerLog, wheel and checkpoints",
                "default": {},
                "properties": {
                    "existingClaim": _str("use this PersistentVolumeClaim instead of making one",
                                          maxLength=253, pattern=DNS_LABEL),
                    "storageClassName": _str("storage class of the claim the operator makes (unset: the "
                                             "cluster's default; \"\": no class, binds a pre-made volume)",
                                             maxLength=253),
                    "size": {**QUANTITY, "default": "10Gi", "description": "size of the claim"},
                    "accessModes": {
                        "type": "array", "default": ["ReadWriteOnce"], "minItems": 1, "maxItems": 4,
                        "description": "access modes of the claim the operator makes: ReadWriteOnce (the default, "
                                       "offered by every cluster's default storage class): every pod of the "
                                       "TimerWheel runs on the claim's node; ReadWriteMany (NFS, EFS, Filestore, "
                                       "Azure Files, CephFS): any node. A claim keeps the modes it was made with",
                        "items": {"type": "string", "enum": ["ReadWriteMany", "ReadWriteOnce",
                                                             "ReadWriteOncePod", "ReadOnlyMany"]},
                    },
                    "keepOnDelete": {"type": "boolean", "default": True,
                                     "description": "keep the claim (and the timers on it) when the "
                                                    "TimerWheel is deleted"},
                },
            },
            "stages": stages,
            "image": {
                "type": "object",
                "description": "the stages' image (default: the operator's own)",
                "properties": {
                    "repository": _str("image repository", maxLength=512),
                    "tag": _str("image tag", maxLength=128),
                    "pullPolicy": {"type": "string", "enum": ["Always", "IfNotPresent", "Never"]},
                    "pullSecrets": {
                        "type": "array", "maxItems": 20,
                        "description": "Secrets (kubernetes.io/dockerconfigjson, in the TimerWheel's namespace) "
                                       "the stage pods and the operator's Jobs pull the image with (default: the "
                                       "operator's, TIMERWHEEL_IMAGE_PULL_SECRETS)",
                        "items": {"type": "object", "required": ["name"], "properties": {
                            "name": _str("the Secret's name", maxLength=253, pattern=DNS_SUBDOMAIN)}},
                    },
                },
            },
            "pods": _pods_schema(),
            "tracing": {
                "type": "object",
                "properties": {
                    "otlpEndpoint": _str("OTLP/http endpoint of the traces (OTEL_EXPORTER_OTLP_ENDPOINT); "
                                         "unset: tracing off", maxLength=2048, pattern=r"^https?://"),
                },
            },
            "autoscale": _autoscale_schema(),
            "recovery": {
                "type": "object",
                "description": "checkpoint recovery and stall detection by the operator",
                "default": {},
                "properties": {
                    "auto": {"type": "boolean", "default": True,
                             "description": "run a Job of `timerwheel recover --shard N` for a shard whose owner "
                                            "reports RecoveryNeeded (a lost or unreadable checkpoint)"},
                    "maxAttempts": _int(1, 20, 3, "failed recovery Jobs in a row (15 s, 30 s, 60 s ... apart) "
                                        "before the TimerWheel is Degraded with reason RecoveryFailed"),
                    "stallAfterMs": _int(30_000, 86_400_000, 60_000,
                                         "a shard whose W or R has not advanced for this long while due is "
                                         "Degraded (ShardStalled); at least 30 s and 10 ticks + 1 s"),
                    "restartStalled": {"type": "boolean", "default": True,
                                       "description": "delete (restart) the owner pod of a stalled shard, at "
                                                      "most once per stallAfterMs"},
                },
            },
        },
        "x-kubernetes-validations": [
            {
                "rule": "self.rollWindowMs % self.tickMs == 0 && self.rollWindowMs >= 10 * self.tickMs",
                "message": "spec.rollWindowMs must be a multiple of spec.tickMs and at least 10 ticks",
                "fieldPath": ".rollWindowMs",
            },
            {
                "rule": "self.wheelSpanMs == 0 || (self.wheelSpanMs % self.tickMs == 0 "
                        "&& self.wheelSpanMs >= 2 * self.rollWindowMs)",
                "message": "spec.wheelSpanMs must be 0 or a multiple of spec.tickMs at least twice "
                           "spec.rollWindowMs: the roll window is too large for the span",
                "fieldPath": ".wheelSpanMs",
            },
            {
                "rule": "self.dlqTopic != self.timerTopic",
                "message": "spec.dlqTopic must differ from spec.timerTopic",
                "fieldPath": ".dlqTopic",
            },
            *({
                "rule": f"!has(self.stages) || !has(self.stages.{stage_key(s)}) "
                        f"|| !has(self.stages.{stage_key(s)}.replicas) || self.stages.{stage_key(s)}.replicas <= self.shards",
                "message": f"spec.stages.{stage_key(s)}.replicas must not exceed spec.shards "
                           "(a pod without a shard would idle)",
                "fieldPath": f".stages.{stage_key(s)}.replicas",
            } for s in SHARD_OWNERS),
        ],
    }


_CONDITION: Schema = {
    "type": "object",
    "required": ["type", "status"],
    "properties": {
        "type": {"type": "string"},
        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
        "reason": {"type": "string"},
        "message": {"type": "string"},
        "lastTransitionTime": {"type": "string", "format": "date-time"},
        "observedGeneration": {"type": "integer", "format": "int64"},
    },
}

_RECOVERY_STATUS: Schema = {
    "type": "object",
    "description": "the shard's last recovery Job (timerwheel recover) and its outcome",
    "properties": {
        "job": {"type": "string", "description": "the Job's name"},
        "pod": {"type": "string", "description": "its pod, whose log holds the JSON report"},
        "state": {"type": "string", "enum": ["Starting", "Running", "Succeeded", "Failed", "GaveUp", "Resolved"]},
        "reason": {"type": "string"},
        "message": {"type": "string"},
        "exitCode": {"type": "integer"},
        "attempts": {"type": "integer", "description": "failed Jobs in a row"},
        "serial": {"type": "integer", "description": "Jobs started for this shard (names the next one)"},
        "startedMs": {"type": "integer", "format": "int64"},
        "finishedMs": {"type": "integer", "format": "int64"},
        "report": {
            "type": "object",
            "description": "from the report timerwheel recover printed",
            "properties": {
                "status": {"type": "string"},
                "enqueue_checkpoint": {"type": "string"},
                "dequeue_checkpoint": {"type": "string"},
                "set_aside": {"type": "array", "items": {"type": "string"}},
                "read_ms": {"type": "integer", "format": "int64"},
                "write_ms": {"type": "integer", "format": "int64"},
                "records": {"type": "integer", "format": "int64"},
                "truncated_bytes": {"type": "integer", "format": "int64"},
                "relinked": {"type": "integer", "format": "int64"},
                "repaired_slots": {"type": "integer", "format": "int64"},
                "may_deliver_twice": {"type": "integer", "format": "int64"},
                "seconds": {"type": "number"},
            },
        },
    },
}

_SHARD_STATUS: Schema = {
    "type": "object",
    "required": ["shard"],
    "properties": {
        "shard": {"type": "integer"},
        "owner": {"type": "string", "description": "the enqueue-put pod that owns the shard"},
        "reader": {"type": "string", "description": "the dequeue-get pod that owns the shard"},
        "epoch": {"type": "integer", "format": "int64", "description": "the owner's lease epoch"},
        "W": {"type": "integer", "format": "int64", "description": "write watermark, epoch ms"},
        "R": {"type": "integer", "format": "int64", "description": "read time, epoch ms"},
        "writeLagMs": {"type": "integer", "format": "int64"},
        "lagMs": {"type": "integer", "format": "int64", "description": "now - R: how late delivery runs"},
        "inFlight": {"type": "integer", "format": "int64"},
        "pending": {"type": "integer", "format": "int64", "description": "messages in the wheel from R on"},
        "timerLogBytes": {"type": "integer", "format": "int64"},
        "inputWaitMs": {"type": "integer", "format": "int64",
                        "description": "how long W has waited for timer records not yet written (enqueue-get "
                                       "down or behind, Kafka unreachable): not a stall of the owner"},
        "openError": {"type": "string", "description": "pods that cannot open the shard, and why"},
        "wAdvancedMs": {"type": "integer", "format": "int64",
                        "description": "when the operator last saw W change, epoch ms (stall detection)"},
        "rAdvancedMs": {"type": "integer", "format": "int64",
                        "description": "when the operator last saw R change, epoch ms (stall detection)"},
        "restartedMs": {"type": "integer", "format": "int64",
                        "description": "when the operator last deleted the pod of this stalled shard, epoch ms"},
        "recovery": _RECOVERY_STATUS,
    },
}

_STAGE_STATUS: Schema = {
    "type": "object",
    "properties": {
        "replicas": {"type": "integer"},
        "readyReplicas": {"type": "integer"},
        "desired": {"type": "integer"},
    },
}


_WINDOW_SPEC: Schema = {"type": "object", "properties": {
    "tickMs": {"type": "integer", "format": "int64"}, "rollWindowMs": {"type": "integer", "format": "int64"},
    "wheelSpanMs": {"type": "integer", "format": "int64"}}}

_WINDOW_STATUS: Schema = {
    "type": "object",
    "description": "the window change (timerwheel_operator.window): pause, rebuild every wheel, resume",
    "properties": {
        "current": {**_WINDOW_SPEC, "description": "the window the shards were built with"},
        "currentUnknown": {"type": "boolean", "description": "a rebuild failed: the shards' window is unknown"},
        "target": {**_WINDOW_SPEC, "description": "the window being rolled to"},
        "phase": {"type": "string",
                  "enum": ["Steady", "Refused", "Pausing", "Rebuilding", "Resuming", "Done", "Failed"]},
        "reason": {"type": "string"},
        "message": {"type": "string"},
        "job": {"type": "string", "description": "the rebuild Job"},
        "serial": {"type": "integer", "description": "rebuild Jobs started (names the next one)"},
        "attempts": {"type": "integer"},
        "failedGeneration": {"type": "integer", "format": "int64"},
        "startedMs": {"type": "integer", "format": "int64", "description": "when the pause began, epoch ms"},
        "pausedMs": {"type": "integer", "format": "int64", "description": "when no owner was left, epoch ms"},
        "rebuiltMs": {"type": "integer", "format": "int64", "description": "when the Job succeeded, epoch ms"},
        "doneMs": {"type": "integer", "format": "int64", "description": "when the TimerWheel was Ready again"},
        "finishedMs": {"type": "integer", "format": "int64"},
        "pausedSeconds": {"type": "number", "description": "shard owners stopped, from the pause to the resume"},
        "report": {"type": "object", "description": "from the Job's reports", "properties": {
            "shards": {"type": "integer"}, "records": {"type": "integer", "format": "int64"},
            "seconds": {"type": "number"}, "recordsPerSecond": {"type": "number"},
            "mayDeliverTwice": {"type": "integer", "format": "int64"}}},
    },
}

_RETENTION_STATUS: Schema = {
    "type": "object",
    "description": "the timer topic's retention.ms as the operator last read it (timerwheel_operator.retention)",
    "properties": {
        "topic": {"type": "string"},
        "retentionMs": {"type": "integer", "format": "int64", "description": "-1: unlimited"},
        "neededMs": {"type": "integer", "format": "int64", "description": "1.5 x rollWindowMs"},
        "managed": {"type": "boolean"},
        "state": {"type": "string", "enum": ["Ok", "Raised", "TooLow", "Unknown"]},
        "message": {"type": "string"},
        "checkedMs": {"type": "integer", "format": "int64"},
    },
}


def status_schema() -> Schema:
    return {
        "type": "object",
        "properties": {
            "observedGeneration": {"type": "integer", "format": "int64"},
            "conditions": {
                "type": "array", "items": _CONDITION,
                "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"],
            },
            "shards": {"type": "array", "items": _SHARD_STATUS},
            "stages": {"type": "object", "properties": {s: _STAGE_STATUS for s in STAGES}},
            "readyStages": {"type": "string", "description": "stages with all replicas ready, e.g. 5/5"},
            "autoscale": {
                "type": "object",
                "description": "the autoscaler's last decision per stage (kept here so that a restarted "
                               "operator decides alike)",
                "properties": {s: {
                    "type": "object",
                    "properties": {
                        "replicas": {"type": "integer"},
                        "reason": {"type": "string"},
                        "message": {"type": "string"},
                        "lastChangeMs": {"type": "integer", "format": "int64"},
                    },
                } for s in ("dequeue-getmsg", "dequeue-put")},
            },
            "maxLagMs": {"type": "integer", "format": "int64"},
            "deliveryReplicas": {"type": "integer", "description": "replicas of the delivery stages (the fewer of "
                                 "dequeue-getmsg and dequeue-put): the scale subresource's status"},
            "deliverySelector": {"type": "string", "description": "label selector of the delivery stages' pods"},
            "window": _WINDOW_STATUS,
            "retention": _RETENTION_STATUS,
        },
    }


def crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "timerwheel", "app.kubernetes.io/component": "crd"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": "timerwheel",
                      "shortNames": ["tw"], "categories": ["timerwheel"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}, "scale": {
                    "specReplicasPath": ".spec.deliveryReplicas",
                    "statusReplicasPath": ".status.deliveryReplicas",
                    "labelSelectorPath": ".status.deliverySelector",
                }},
                "additionalPrinterColumns": [
                    {"name": "Shards", "type": "integer", "jsonPath": ".spec.shards"},
                    {"name": "Tick", "type": "integer", "jsonPath": ".spec.tickMs"},
                    {"name": "Stages", "type": "string", "jsonPath": ".status.readyStages"},
                    {"name": "Ready", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"Ready\")].status"},
                    {"name": "Scaling", "type": "string",
                     "jsonPath": ".status.conditions[?(@.type==\"Scaling\")].status"},
                    {"name": "Degraded", "type": "string",
                     "jsonPath": ".status.conditions[?(@.type==\"Degraded\")].status"},
                    {"name": "Recovering", "type": "string", "priority": 1,
                     "jsonPath": ".status.conditions[?(@.type==\"Recovering\")].status"},
                    {"name": "Lag", "type": "integer", "jsonPath": ".status.maxLagMs", "description": "ms"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "One timerwheel installation: arbitrary-delay timer messages for Kafka.",
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec_schema(),
                        "status": status_schema(),
                    },
                    "x-kubernetes-validations": [{
                        "rule": f"self.metadata.name.size() <= {MAX_NAME}",
                        "message": f"metadata.name must be at most {MAX_NAME} characters (the stage "
                                   "workloads are named timerwheel-NAME-STAGE)",
                    }],
                }},
            }],
        },
    }
