"""The process's one cluster connection and settings, set by ``main``'s startup hook and read
by the handlers (kopf passes handlers no context of ours)."""

from __future__ import annotations

from timerwheel_operator.kube import Cluster
from timerwheel_operator.reconcile import Settings

_state: dict[str, object] = {}


def install(cluster: Cluster, settings: Settings) -> None:
    _state["cluster"] = cluster
    _state["settings"] = settings


def cluster() -> Cluster:
    got = _state.get("cluster")
    if got is None:
        raise RuntimeError("the operator's startup hook has not run")
    return got  # type: ignore[return-value]


def settings() -> Settings:
    got = _state.get("settings")
    return got if isinstance(got, Settings) else Settings()
