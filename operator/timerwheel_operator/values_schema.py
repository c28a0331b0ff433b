"""The Helm chart's ``values.schema.json``, built here so that ``timerwheel.spec`` is checked by
the CRD's own spec schema (one definition). ``timerwheel-operator values-schema`` prints it; a
test keeps ``charts/timerwheel/values.schema.json`` equal to it.

Strict: every object refuses keys it does not name (``additionalProperties: false``), except
the free-form maps Kubernetes defines (node selectors, annotations, affinity, resources).
"""

from __future__ import annotations

from typing import Any

from timerwheel_operator.crd import QUANTITY, spec_schema

Schema = dict[str, Any]

_DROP = {"x-kubernetes-validations", "x-kubernetes-int-or-string", "format", "default",
         "x-kubernetes-list-type", "x-kubernetes-list-map-keys"}


def json_schema_of(openapi: Schema) -> Schema:
    """An OpenAPI v3 (structural) schema as strict JSON Schema: objects with properties refuse
    other keys, int-or-string becomes a type list, Kubernetes extensions go."""
    if openapi.get("x-kubernetes-int-or-string"):
        out: Schema = {"type": ["integer", "string"]}
        if "pattern" in openapi:
            # A pattern applies to strings only in JSON Schema, as in OpenAPI.
            out["pattern"] = openapi["pattern"]
        if "description" in openapi:
            out["description"] = openapi["description"]
        return out
    out = {k: v for k, v in openapi.items() if k not in _DROP and k not in ("anyOf",)}
    if "properties" in openapi:
        out["properties"] = {k: json_schema_of(v) for k, v in openapi["properties"].items()}
        out["additionalProperties"] = False
    if isinstance(openapi.get("additionalProperties"), dict):
        out["additionalProperties"] = json_schema_of(openapi["additionalProperties"])
    if "items" in openapi:
        out["items"] = json_schema_of(openapi["items"])
    return out


def _obj(props: Schema, required: list[str] | None = None, doc: str = "") -> Schema:
    out: Schema = {"type": "object", "additionalProperties": False, "properties": props}
    if required:
        out["required"] = required
    if doc:
        out["description"] = doc
    return out


_FREE_MAP: Schema = {"type": "object"}
_STRING_MAP: Schema = {"type": "object", "additionalProperties": {"type": "string"}}
_QUANTITIES: Schema = {"type": "object", "additionalProperties": json_schema_of(QUANTITY)}
#: A size as Spark reads it (spark.executor.memory): a number of MiB, or with a unit (512m, 2g).
_SPARK_SIZE = r"[0-9]+([kKmMgGtTpP][bB]?|[bB])?"
_PORT: Schema = {"type": "integer", "minimum": 1024, "maximum": 65535}
#: A Prometheus duration (30s, 5m, 1h30m).
_DURATION: Schema = {"type": "string", "pattern": r"^([0-9]+(ms|s|m|h|d|w|y))+$"}
_MS: Schema = {"type": "integer", "minimum": 0}


def _alert(thresholds: Schema) -> Schema:
    return _obj({"for": _DURATION, **thresholds}, ["for"])


def values_schema() -> Schema:
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "timerwheel chart values",
        **_obj({
            "image": _obj({
                "repository": {"type": "string", "minLength": 1},
                "tag": {"type": "string"},
                "pullPolicy": {"type": "string", "enum": ["Always", "IfNotPresent", "Never"]},
            }, ["repository", "pullPolicy"], "the one image of the operator and the stages"),
            "imagePullSecrets": {"type": "array", "items": _obj({"name": {"type": "string"}}, ["name"])},
            "nameOverride": {"type": "string", "maxLength": 40},
            "fullnameOverride": {"type": "string", "maxLength": 54},
            "operator": _obj({
                "clusterWide": {"type": "boolean"},
                "logLevel": {"type": "string", "enum": ["DEBUG", "INFO", "WARNING", "ERROR"]},
                "serviceAccount": _obj({"name": {"type": "string"}}),
                "resources": _obj({"requests": _QUANTITIES, "limits": _QUANTITIES}),
                "podAnnotations": _STRING_MAP,
                "nodeSelector": _STRING_MAP,
                "tolerations": {"type": "array", "items": {"type": "object"}},
                "affinity": _FREE_MAP,
            }),
            "podSecurityContext": {"type": "object", "description": "the operator pod's securityContext"},
            "securityContext": {"type": "object", "description": "the operator container's securityContext"},
            "timerwheel": _obj({
                "create": {"type": "boolean"},
                "name": {"type": "string", "maxLength": 28, "pattern": r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$"},
                "spec": json_schema_of(spec_schema()),
            }, ["create", "spec"], "the TimerWheel the chart makes (its spec is the CRD's)"),
            "spark": _obj({
                "image": _obj({
                    "repository": {"type": "string", "minLength": 1},
                    "tag": {"type": "string"},
                    "pullPolicy": {"type": "string", "enum": ["Always", "IfNotPresent", "Never"]},
                }, ["repository", "pullPolicy"], "the Spark image (services/spark/Dockerfile)"),
                "master": {"type": "string", "minLength": 1},
                "resources": _obj({"requests": _QUANTITIES, "limits": _QUANTITIES}),
                "driverMemory": {"type": "string", "pattern": f"^{_SPARK_SIZE}$"},
                "dataClaim": {"type": "string", "pattern": r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$"},
                "kubernetes": _obj({
                    "enabled": {"type": "boolean"},
                    "executors": _obj({
                        "instances": {"type": "integer", "minimum": 1},
                        "cores": {"type": "integer", "minimum": 1},
                        "memory": {"type": "string", "pattern": f"^{_SPARK_SIZE}$"},
                        "memoryOverhead": {"type": "string", "pattern": f"^({_SPARK_SIZE})?$"},
                    }),
                    "apiServer": {"type": "string", "pattern": r"^(https?://[^\s]+)?$"},
                    "driverPort": _PORT,
                    "blockManagerPort": _PORT,
                    "serviceAccount": _obj({
                        "create": {"type": "boolean"},
                        "name": {"type": "string", "pattern": r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$"},
                    }),
                    "conf": {"type": "object", "propertyNames": {"pattern": r"^spark\.[^\s=:]+$"},
                             "additionalProperties": {"type": "string", "pattern": r"^[^\n\r]*$"}},
                }, None, "Spark's Kubernetes scheduler: the job's pod the driver, executor pods of the Spark image"),
                "audit": _obj({
                    "enabled": {"type": "boolean"},
                    "schedule": {"type": "string", "minLength": 9},
                    "graceMs": {"type": "integer", "minimum": 0},
                    "topics": {"type": "string", "pattern": r"^([a-zA-Z0-9._-]{1,249}(,[a-zA-Z0-9._-]{1,249})*)?$"},
                }),
                "forecast": _obj({
                    "enabled": {"type": "boolean"},
                    "schedule": {"type": "string", "minLength": 9},
                    "hours": {"type": "integer", "minimum": 1},
                }),
                "bulk": _obj({
                    "enabled": {"type": "boolean"},
                    "input": {"type": "string", "minLength": 1},
                    "format": {"type": "string", "enum": ["parquet", "csv", "json"]},
                    "rejects": {"type": "string", "minLength": 1},
                }),
            }, None, "optional Spark jobs: the audit and forecast CronJobs and the bulk-schedule Job"),
            "console": _obj({
                "enabled": {"type": "boolean"},
                "actionToken": _obj({
                    "secretName": {"type": "string", "pattern": r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$"},
                    "key": {"type": "string", "pattern": r"^[-._a-zA-Z0-9]+$"},
                }, None, "the Secret holding the token that unlocks the console's actions (empty: read-only)"),
                "port": _PORT,
                "sampleEverySeconds": {"type": "number", "exclusiveMinimum": 0, "maximum": 600},
                "resources": _obj({"requests": _QUANTITIES, "limits": _QUANTITIES}),
                "podAnnotations": _STRING_MAP,
                "nodeSelector": _STRING_MAP,
                "tolerations": {"type": "array", "items": {"type": "object"}},
                "affinity": _FREE_MAP,
            }, None, "the web console (docs/console.md), a Deployment of the stage image"),
            "monitoring": _obj({
                "podMonitor": _obj({
                    "enabled": {"type": "boolean"},
                    "interval": _DURATION,
                    "labels": _STRING_MAP,
                }, None, "a PodMonitor of the stage pods (with the Prometheus Operator's CRDs)"),
                "prometheusRule": _obj({
                    "enabled": {"type": "boolean"},
                    "labels": _STRING_MAP,
                    "alerts": _obj({
                        "writeWatermarkBehind": _alert({"lagMs": _MS}),
                        "readTimeBehind": _alert({"lagMs": _MS}),
                        "inputWait": _alert({"waitMs": _MS}),
                        "shardUnowned": _alert({}),
                        "deadLetters": _alert({"perSecond": {"type": "number", "minimum": 0}}),
                        "earlyDelivery": _alert({}),
                        "deadQueueEntries": _alert({}),
                        "stageStalled": _alert({"window": _DURATION}),
                    }, None, "each alert's for: and threshold (docs/runbook.md)"),
                }, None, "a PrometheusRule of the alerts (with the Prometheus Operator's CRDs)"),
                "dashboards": _obj({
                    "enabled": {"type": "boolean"},
                    "labels": _STRING_MAP,
                    "annotations": _STRING_MAP,
                }, None, "Grafana dashboards as ConfigMaps for Grafana's sidecar"),
            }, None, "Prometheus Operator objects and Grafana dashboards (docs/runbook.md)"),
            "tests": _obj({
                "enabled": {"type": "boolean"},
                "topic": {"type": "string", "pattern": r"^[a-zA-Z0-9._-]{1,249}$"},
                "delayMs": {"type": "integer", "minimum": 0, "maximum": 600000},
                "timeoutSeconds": {"type": "integer", "minimum": 10, "maximum": 3600},
            }),
        }, ["image", "operator", "timerwheel"]),
    }
