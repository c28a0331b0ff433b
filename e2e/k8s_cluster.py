"""The real single-node Kubernetes cluster for e2e tests (``scripts/k8s.sh``), as a fixture.

``k8s`` (session scope) runs ``scripts/k8s.sh up`` and ``load-image`` once per session and yields
a :class:`Cluster`: its kubeconfig, the cached kubectl, the node's address that pods reach the host
on (Kafka and Redis listen there with ``TW_LISTEN_HOST``) and the image tag (``timerwheel:dev``,
``imagePullPolicy: Never``). The first ``up`` on a fresh machine builds Kubernetes from the Go
module proxy and the image with debootstrap (about half an hour on 2 cores; later runs take
seconds). A cluster that cannot be started FAILS the test with the script's message naming what
is missing. A cluster this session started is taken down at its end (keep it for the next run
with ``TW_KEEP_SERVERS=1``); one that was already running is left alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "k8s.sh"
#: A cold build (Kubernetes from source, the image base) on a fresh 2-core machine.
UP_TIMEOUT_S = float(os.environ.get("TW_K8S_UP_TIMEOUT", "3600"))


def write_values(path: Path, values: dict[str, Any]) -> str:
    """A Helm values file at ``path`` (its name returned), written as JSON: a YAML writer leaves a
    string such as ``1234e567`` (a random hex id) unquoted, and Helm's YAML reads it as a number
    (the chart's schema then refuses it)."""
    path.write_text(json.dumps(values, indent=1))
    return str(path)


def k8s_script(verb: str, timeout_s: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), verb], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                          check=False, env={**os.environ, **(env or {})})


def read_env() -> dict[str, str]:
    out = {}
    for line in k8s_script("env", timeout_s=30).stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key] = value
    return out


@dataclass
class Cluster:
    kubeconfig: str
    kubectl_bin: str
    host_ip: str
    image: str

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([self.kubectl_bin, "--kubeconfig", self.kubeconfig, *args], input=input,
                              capture_output=True, text=True, timeout=timeout, check=False)
        if check and done.returncode != 0:
            pytest.fail(f"kubectl {' '.join(args)} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}",
                        pytrace=False)
        return done

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def apply(self, *manifests: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(manifests)}))

    def wait_pods_done(self, *names: str, namespace: str = "default", timeout: float = 180) -> dict[str, str]:
        """Wait until the pods have terminated; their phases (Succeeded / Failed) by name."""
        deadline = time.monotonic() + timeout
        while True:
            phases = {n: self.get("pod", n, "-n", namespace)["status"].get("phase", "") for n in names}
            if all(p in ("Succeeded", "Failed") for p in phases.values()):
                return phases
            if time.monotonic() > deadline:
                described = self.kubectl("describe", "pod", *names, "-n", namespace, check=False).stdout[-3000:]
                pytest.fail(f"pods {phases} did not finish within {timeout:.0f}s:\n{described}", pytrace=False)
            time.sleep(0.5)

    def logs(self, name: str, namespace: str = "default") -> str:
        return self.kubectl("logs", name, "-n", namespace).stdout


@pytest.fixture(scope="session")
def k8s() -> Iterator[Cluster]:
    was_running = k8s_script("status", timeout_s=60).returncode == 0
    try:
        up = k8s_script("up", timeout_s=UP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"scripts/k8s.sh up did not finish within {UP_TIMEOUT_S:.0f}s (TW_K8S_UP_TIMEOUT)", pytrace=False)
    if up.returncode != 0:
        pytest.fail(f"the Kubernetes cluster could not be started (scripts/k8s.sh up, exit {up.returncode}):\n"
                    f"{up.stderr.strip()[-3000:]}", pytrace=False)
    try:
        load = k8s_script("load-image", timeout_s=UP_TIMEOUT_S)
        if load.returncode != 0:
            pytest.fail(f"the timerwheel image could not be loaded (scripts/k8s.sh load-image, exit "
                        f"{load.returncode}):\n{load.stderr.strip()[-3000:]}", pytrace=False)
        env = read_env()
        missing = [k for k in ("KUBECONFIG", "TW_KUBECTL", "TW_K8S_HOST_IP", "TW_K8S_IMAGE") if not env.get(k)]
        if missing:
            pytest.fail(f"scripts/k8s.sh env printed no {', '.join(missing)}", pytrace=False)
        yield Cluster(env["KUBECONFIG"], env["TW_KUBECTL"], env["TW_K8S_HOST_IP"], env["TW_K8S_IMAGE"])
    finally:
        if not was_running and os.environ.get("TW_KEEP_SERVERS", "") not in ("1", "true", "yes"):
            k8s_script("down", timeout_s=300)


@dataclass
class Registry:
    """The local registry (scripts/registry.sh) on the node's address, with basic auth, holding the
    image `make image` wrote as ``repository:tag``; the cluster's containerd pulls from it."""

    address: str
    user: str
    password: str
    repository: str
    tag: str

    def copy(self, source: str, destination: str) -> None:
        """``skopeo copy`` between this registry's references (or from an archive: ``oci-archive:...``)."""
        creds = f"{self.user}:{self.password}"
        args = ["skopeo", "copy", "--quiet", "--dest-tls-verify=false", "--dest-creds", creds, source, destination]
        if source.startswith("docker://"):
            args[3:3] = ["--src-tls-verify=false", "--src-creds", creds]
        done = subprocess.run(args, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            pytest.fail(f"skopeo copy {source} {destination} failed: {done.stderr.strip()[-2000:]}", pytrace=False)

    def pull_secret(self, name: str, namespace: str) -> dict[str, Any]:
        """A kubernetes.io/dockerconfigjson Secret with this registry's credentials."""
        import base64

        auth = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        config = {"auths": {self.address: {"username": self.user, "password": self.password, "auth": auth}}}
        return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/dockerconfigjson",
                "metadata": {"name": name, "namespace": namespace},
                "data": {".dockerconfigjson": base64.b64encode(json.dumps(config).encode()).decode()}}


def _script(name: str, *args: str, env: dict[str, str] | None = None, timeout_s: float = 900) -> str:
    done = subprocess.run([str(ROOT / "scripts" / name), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s, check=False, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        pytest.fail(f"scripts/{name} {' '.join(args)} failed (exit {done.returncode}):\n{done.stderr.strip()[-3000:]}",
                    pytrace=False)
    return done.stdout


@pytest.fixture(scope="session")
def registry(k8s: Cluster) -> Iterator[Registry]:
    """The image as a user ships it to a cluster that is not ours: `make image` (an OCI archive),
    `skopeo copy` to a registry that wants a password, containerd told the registry speaks HTTP."""
    _script("registry.sh", "up", env={"TW_LISTEN_HOST": k8s.host_ip})
    env = dict(line.split("=", 1) for line in _script("registry.sh", "env").splitlines() if "=" in line)
    try:
        _script("k8s.sh", "trust-registry", env["TW_REGISTRY"], timeout_s=300)
        # --no-print-directory: under `make test` (MAKELEVEL set) make would print its directory
        # around the archive's path
        made = subprocess.run(["make", "--no-print-directory", "image"], cwd=ROOT, capture_output=True, text=True,
                              timeout=UP_TIMEOUT_S, check=False)
        if made.returncode != 0:
            pytest.fail(f"make image failed:\n{made.stderr.strip()[-3000:]}", pytrace=False)
        archive = Path(made.stdout.strip().splitlines()[-1])
        tag = archive.name.removeprefix("timerwheel-").removesuffix(".oci.tar")
        reg = Registry(env["TW_REGISTRY"], env["TW_REGISTRY_USER"], Path(env["TW_REGISTRY_PASSWORD_FILE"]).read_text().strip(),
                       f"{env['TW_REGISTRY']}/timerwheel", tag)
        reg.copy(f"oci-archive:{archive}", f"docker://{reg.repository}:{tag}")
        yield reg
    finally:
        if os.environ.get("TW_KEEP_SERVERS", "") not in ("1", "true", "yes"):
            subprocess.run([str(ROOT / "scripts" / "registry.sh"), "down"], cwd=ROOT, capture_output=True, timeout=120,
                           check=False)
