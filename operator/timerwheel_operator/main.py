"""The operator's entry point: ``timerwheel-operator`` (or ``python -m timerwheel_operator``).

Registers the handlers (importing ``handlers``) and sets every kopf setting in one startup hook.
The operator's own environment (never ``TW_*``, which are the stages'):

- ``TIMERWHEEL_IMAGE``: the stages' image when a TimerWheel names none (default ``timerwheel:dev``)
- ``TIMERWHEEL_IMAGE_PULL_POLICY``: its pull policy (default ``IfNotPresent``)
- ``TIMERWHEEL_IMAGE_PULL_SECRETS``: comma-separated Secrets the stage pods and the operator's Jobs
  pull their image with when a TimerWheel names none (``spec.image.pullSecrets``); default none
- ``TIMERWHEEL_WATCH_NAMESPACE``: comma-separated namespaces to watch (default: all)
- ``TIMERWHEEL_LOG_LEVEL``: ``DEBUG``, ``INFO`` (default), ``WARNING``

kopf's liveness probe answers on port 8081, ``/healthz``.

``timerwheel-operator crd`` prints the CustomResourceDefinition as YAML instead, and
``timerwheel-operator values-schema`` the chart's ``values.schema.json``.
``timerwheel-operator dashboards DIR`` writes the chart's Grafana dashboards (``monitoring``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import kopf

from timerwheel_operator import handlers as _handlers  # noqa: F401 - registers the handlers
from timerwheel_operator.handlers import timerwheel as _timerwheel  # noqa: F401
from timerwheel_operator.reconcile import OperatorConfig

PULL_POLICIES = ("Always", "IfNotPresent", "Never")
#: kopf's liveness endpoint (``/healthz``), probed by the chart.
HEALTH_PORT = 8081
#: A Secret's name: a DNS subdomain.
_SECRET_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


class OperatorConfigError(ValueError):
    """A ``TIMERWHEEL_*`` variable the operator refuses; the message names it."""


def config_from_env(env: Mapping[str, str]) -> OperatorConfig:
    image = env.get("TIMERWHEEL_IMAGE") or "timerwheel:dev"
    policy = env.get("TIMERWHEEL_IMAGE_PULL_POLICY") or "IfNotPresent"
    if policy not in PULL_POLICIES:
        raise OperatorConfigError(f"TIMERWHEEL_IMAGE_PULL_POLICY: must be one of {', '.join(PULL_POLICIES)}, "
                                  f"got {policy!r}")
    secrets = tuple(s.strip() for s in (env.get("TIMERWHEEL_IMAGE_PULL_SECRETS") or "").split(",") if s.strip())
    for name in secrets:
        if not _SECRET_NAME.match(name) or len(name) > 253:
            raise OperatorConfigError(f"TIMERWHEEL_IMAGE_PULL_SECRETS: {name!r} is not a Secret's name")
    return OperatorConfig(image=image, pull_policy=policy, pull_secrets=secrets)


def watch_namespaces(env: Mapping[str, str]) -> list[str]:
    return [n.strip() for n in (env.get("TIMERWHEEL_WATCH_NAMESPACE") or "").split(",") if n.strip()]


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """All of kopf's settings, in one place, and the handlers' shared state in kopf's memo."""
    from timerwheel_operator import context
    from timerwheel_operator.kube import KubeCluster
    from timerwheel_operator.retention import KafkaAdmin

    # State in annotations only: the CRD's status schema is strict (structural), and kopf's
    # own status fields would be pruned.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="timerwheel.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="timerwheel.io", key="last-handled-configuration")
    settings.peering.standalone = True  # one replica, Recreate: no peering objects needed
    # Watching given namespaces: take them as they are, without listing namespaces or watching
    # CRDs cluster-wide, so the operator needs no cluster-scoped role (the CRD comes first).
    settings.scanning.disabled = bool(watch_namespaces(os.environ))
    settings.posting.level = logging.WARNING  # Events for warnings (bad spec), not every step
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 30
    settings.execution.max_workers = 4
    ours = config_from_env(os.environ)
    context.install(memo, context.Context(KubeCluster(), ours, KafkaAdmin()))
    logger.info("timerwheel operator configured: image=%s pullPolicy=%s pullSecrets=%s", ours.image,
                ours.pull_policy, ",".join(ours.pull_secrets) or "-")


def print_crd() -> int:
    import yaml

    from timerwheel_operator.crd import crd

    sys.stdout.write(yaml.safe_dump(crd(), sort_keys=False, width=100))
    return 0


def print_values_schema() -> int:
    import json

    from timerwheel_operator.values_schema import values_schema

    sys.stdout.write(json.dumps(values_schema(), indent=2) + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["crd"]:
        return print_crd()
    if args[:1] == ["values-schema"]:
        return print_values_schema()
    if args[:1] == ["dashboards"] and len(args) == 2:
        from pathlib import Path

        from timerwheel_operator.monitoring import write_dashboards

        for path in write_dashboards(Path(args[1])):
            sys.stdout.write(f"{path}\n")
        return 0
    if args:
        sys.stderr.write("usage: timerwheel-operator [crd | values-schema | dashboards DIR]\n")
        return 2
    try:
        config_from_env(os.environ)
    except OperatorConfigError as exc:
        sys.stderr.write(f"{exc}\n")
        return 2
    level = (os.environ.get("TIMERWHEEL_LOG_LEVEL") or "INFO").upper()
    kopf.configure(verbose=level == "DEBUG", log_format=kopf.LogFormat.JSON, log_prefix=False)
    logging.getLogger().setLevel(level)
    namespaces = watch_namespaces(os.environ)
    asyncio.run(kopf.operator(standalone=True, clusterwide=not namespaces, namespaces=namespaces,
                              liveness_endpoint=f"http://0.0.0.0:{HEALTH_PORT}/healthz"))
    return 0
