"""The process's one cluster connection and settings, set by ``main``'s startup hook and read
by the handlers (kopf passes handlers no context of ours), and the Kafka admin door."""

from __future__ import annotations

from timerwheel_operator.kube import Cluster
from timerwheel_operator.reconcile import Settings
from timerwheel_operator.retention import Admin

_state: dict[str, object] = {}


def install(cluster: Cluster, settings: Settings, admin: Admin | None = None) -> None:
    _state["cluster"] = cluster
    _state["settings"] = settings
    _state["admin"] = admin


def admin() -> Admin | None:
    """Kafka's admin API for the timer topic's retention (None: not checked)."""
    got = _state.get("admin")
    return got  # type: ignore[return-value]


def cluster() -> Cluster:
    got = _state.get("cluster")
    if got is None:
        raise RuntimeError("the operator's startup hook has not run")
    return got  # type: ignore[return-value]


def settings() -> Settings:
    got = _state.get("settings")
    return got if isinstance(got, Settings) else Settings()
