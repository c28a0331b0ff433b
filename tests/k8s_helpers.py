"""What the operator and chart tests share: a sample TimerWheel, schema defaulting, the CRD's
CEL rules evaluated offline (cel-python) and a check of structural schemas."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import celpy
import jsonschema
from timerwheel_operator.crd import crd, spec_schema
from timerwheel_operator.values_schema import json_schema_of

Schema = dict[str, Any]


def wheel_body(name: str = "orders", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "timerwheel.io/v1alpha1",
        "kind": "TimerWheel",
        "metadata": {"name": name, "namespace": "tw-test", "uid": "0f4c5d1e-1111-2222-3333-444455556666",
                     "generation": 3},
        "spec": {"kafka": {"bootstrap": "10.0.0.5:9092"}, "redis": {"url": "redis://10.0.0.5:6379/0"}},
    }
    body["spec"].update(spec)
    return body


def with_defaults(schema: Schema, value: Any) -> Any:
    """``value`` with the schema's defaults filled in, as the API server does before validation."""
    if schema.get("type") == "object" and isinstance(value, dict):
        out = dict(value)
        for key, sub in (schema.get("properties") or {}).items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out:
                out[key] = with_defaults(sub, out[key])
        return out
    if schema.get("type") == "array" and isinstance(value, list) and "items" in schema:
        return [with_defaults(schema["items"], v) for v in value]
    return value


def _rules(schema: Schema, path: str) -> Iterator[tuple[str, Schema, Mapping[str, Any]]]:
    for rule in schema.get("x-kubernetes-validations") or []:
        yield path, schema, rule
    for key, sub in (schema.get("properties") or {}).items():
        yield from _rules(sub, f"{path}.{key}")


def _at(value: Any, path: str) -> Any:
    for key in [p for p in path.split(".") if p]:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def api_server_errors(spec: Mapping[str, Any], old_spec: Mapping[str, Any] | None = None) -> list[str]:
    """What the API server would answer to this spec (after defaulting): the OpenAPI schema's
    errors (field path and message) and the messages of the CEL rules that fail."""
    schema = spec_schema()
    new = with_defaults(schema, dict(spec))
    errors = [f"spec.{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in jsonschema.Draft7Validator(json_schema_of(schema)).iter_errors(new)]
    old = with_defaults(schema, dict(old_spec)) if old_spec is not None else None
    env = celpy.Environment()
    for path, _sub, rule in _rules(schema, ""):
        value = _at(new, path)
        if value is None:
            continue
        activation: dict[str, Any] = {"self": celpy.json_to_cel(value)}
        if "oldSelf" in rule["rule"]:
            if old is None or _at(old, path) is None:
                continue  # a transition rule checks updates only
            activation["oldSelf"] = celpy.json_to_cel(_at(old, path))
        result = env.program(env.compile(rule["rule"])).evaluate(activation)
        if result is not True and str(result) != "True":
            errors.append(rule["message"])
    return errors


def structural_errors(schema: Schema, path: str = "", in_junctor: bool = False) -> list[str]:
    """Kubernetes' structural schema rules (apiextensions "Specifying a structural schema"):
    every node has a type (or x-kubernetes-int-or-string / preserve-unknown-fields); inside
    anyOf / allOf / oneOf / not no type, default, description or additionalProperties, except
    int-or-string's ``anyOf: [{type: integer}, {type: string}]``; properties and
    additionalProperties never together; metadata restricts name and generateName only."""
    errors = []
    int_or_string = schema.get("x-kubernetes-int-or-string") is True
    if in_junctor:
        for key in ("default", "description", "additionalProperties", "nullable", "x-kubernetes-validations"):
            if key in schema:
                errors.append(f"{path}: {key} inside a junctor")
    elif "type" not in schema and not int_or_string and not schema.get("x-kubernetes-preserve-unknown-fields"):
        errors.append(f"{path or '<root>'}: no type")
    if "properties" in schema and "additionalProperties" in schema:
        errors.append(f"{path}: properties and additionalProperties together")
    for junctor in ("anyOf", "allOf", "oneOf"):
        for i, sub in enumerate(schema.get(junctor) or []):
            if int_or_string and junctor == "anyOf" and sub in ({"type": "integer"}, {"type": "string"}):
                continue
            if "type" in sub:
                errors.append(f"{path}.{junctor}[{i}]: type inside a junctor")
            errors += structural_errors(sub, f"{path}.{junctor}[{i}]", in_junctor=True)
    for key, sub in (schema.get("properties") or {}).items():
        if path == "" and key == "metadata" and set(sub) - {"type", "properties"}:
            errors.append("metadata: only type and properties name/generateName allowed")
        errors += structural_errors(sub, f"{path}.{key}", in_junctor)
    if isinstance(schema.get("additionalProperties"), dict):
        errors += structural_errors(schema["additionalProperties"], f"{path}[*]", in_junctor)
    if "items" in schema:
        errors += structural_errors(schema["items"], f"{path}[]", in_junctor)
    return errors


def crd_schema() -> Schema:
    schema: Schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema
