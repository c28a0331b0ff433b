"""The operator's only door to the cluster: server-side apply of manifests, reads of the stage
workloads, pods, claims, their Events and the operator's Jobs, a Job pod's log, deletion of a
stalled shard's owner pod, the TimerWheel's status, and scrapes of the pods' ``/metrics``.
``Cluster`` is the interface the reconcile functions take; tests give them a fake.
"""

from __future__ import annotations

import contextlib
import urllib.request
from collections.abc import Mapping
from typing import Any, Protocol

from timerwheel_operator import FIELD_MANAGER


class Cluster(Protocol):
    def apply(self, manifest: Mapping[str, Any]) -> None: ...

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None: ...

    def pods(self, namespace: str, selector: Mapping[str, str]) -> list[dict[str, Any]]: ...

    def scrape(self, ip: str, port: int) -> str: ...

    def jobs(self, namespace: str, selector: Mapping[str, str]) -> list[dict[str, Any]]: ...

    def pod_log(self, namespace: str, name: str) -> str: ...

    def delete_pod(self, namespace: str, name: str) -> None: ...

    def events(self, namespace: str, kind: str, name: str) -> list[dict[str, Any]]: ...

    def patch_status(self, api_version: str, kind: str, namespace: str, name: str,
                     status: Mapping[str, Any]) -> None: ...


class KubeCluster:
    """``Cluster`` over the ``kubernetes`` client's dynamic client (in-cluster config, else
    ~/.kube/config)."""

    def __init__(self, scrape_timeout_s: float = 3.0) -> None:
        import kubernetes
        from kubernetes.dynamic import DynamicClient

        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()
        self.dynamic = DynamicClient(kubernetes.client.ApiClient())
        self.scrape_timeout_s = scrape_timeout_s

    def _resource(self, api_version: str, kind: str) -> Any:
        return self.dynamic.resources.get(api_version=api_version, kind=kind)

    def apply(self, manifest: Mapping[str, Any]) -> None:
        # Server-side apply: the server merges our fields and owns them; repeating it is a no-op.
        self.dynamic.server_side_apply(self._resource(manifest["apiVersion"], manifest["kind"]), body=dict(manifest),
                                       field_manager=FIELD_MANAGER, force_conflicts=True)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        from kubernetes.dynamic.exceptions import NotFoundError

        try:
            out: dict[str, Any] = self._resource(api_version, kind).get(name=name, namespace=namespace).to_dict()
        except NotFoundError:
            return None
        return out

    def pods(self, namespace: str, selector: Mapping[str, str]) -> list[dict[str, Any]]:
        query = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        out = self._resource("v1", "Pod").get(namespace=namespace, label_selector=query).to_dict()
        return list(out.get("items") or [])

    def jobs(self, namespace: str, selector: Mapping[str, str]) -> list[dict[str, Any]]:
        query = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        out = self._resource("batch/v1", "Job").get(namespace=namespace, label_selector=query).to_dict()
        return list(out.get("items") or [])

    def pod_log(self, namespace: str, name: str) -> str:
        import kubernetes

        got: str = kubernetes.client.CoreV1Api(self.dynamic.client).read_namespaced_pod_log(
            name, namespace, tail_lines=200, _request_timeout=10)
        return got

    def delete_pod(self, namespace: str, name: str) -> None:
        from kubernetes.dynamic.exceptions import NotFoundError

        with contextlib.suppress(NotFoundError):  # gone already: what we wanted
            self._resource("v1", "Pod").delete(name=name, namespace=namespace)

    def events(self, namespace: str, kind: str, name: str) -> list[dict[str, Any]]:
        """The Events about one object (core/v1), oldest first."""
        out = self._resource("v1", "Event").get(
            namespace=namespace, field_selector=f"involvedObject.kind={kind},involvedObject.name={name}").to_dict()
        items = list(out.get("items") or [])
        return sorted(items, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))

    def patch_status(self, api_version: str, kind: str, namespace: str, name: str,
                     status: Mapping[str, Any]) -> None:
        """A merge patch of the object's ``status`` subresource (a null drops a key)."""
        self._resource(api_version, kind).status.patch(body={"status": dict(status)}, name=name, namespace=namespace,
                                                       content_type="application/merge-patch+json")

    def scrape(self, ip: str, port: int) -> str:
        with urllib.request.urlopen(f"http://{ip}:{port}/metrics", timeout=self.scrape_timeout_s) as resp:
            body: bytes = resp.read()
        return body.decode()
