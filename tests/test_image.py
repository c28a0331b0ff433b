"""The image the local cluster runs and services/Dockerfile stay in step (scripts/image.py), and
the cluster script refuses bad input with one line. The built image itself is checked on the
cluster: e2e/test_k8s_smoke.py."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGE_PY = ROOT / "scripts" / "image.py"


def _plan(dockerfile: Path | None = None) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, str(IMAGE_PY), "plan"] + (["--dockerfile", str(dockerfile)] if dockerfile else [])
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)


def _dockerfile_by_hand() -> dict[str, object]:
    text = re.sub(r"\\\n\s*", " ", (ROOT / "services" / "Dockerfile").read_text())
    out: dict[str, object] = {"env": {}}
    for line in text.splitlines():
        word, _, args = line.strip().partition(" ")
        if word == "FROM":
            out["from"] = args.strip()
        elif word == "USER":
            out["user"] = args.strip()
        elif word == "ENV":
            out["env"].update(dict(w.split("=", 1) for w in shlex.split(args)))  # type: ignore[attr-defined]
        elif word == "ENTRYPOINT":
            out["entrypoint"] = json.loads(args)
        elif word == "WORKDIR":
            out["workdir"] = args.strip()
    return out


def test_the_local_build_gives_the_dockerfiles_config() -> None:
    done = _plan()
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    want = _dockerfile_by_hand()
    assert plan["from"] == want["from"]
    assert plan["user"] == want["user"]
    assert plan["entrypoint"] == want["entrypoint"]
    assert plan["workdir"] == want["workdir"]
    for key, value in want["env"].items():  # type: ignore[attr-defined]
        assert plan["env"][key] == value, key


def test_the_image_is_non_root_and_installs_the_operator_extra() -> None:
    want = _dockerfile_by_hand()
    assert want["user"] not in ("", "0", "root")
    text = (ROOT / "services" / "Dockerfile").read_text()
    # the dependency layer reads the project's dependencies and the operator extra's from pyproject
    assert "'dependencies'" in text and "get('operator'" in text
    assert "useradd --uid " + str(want["user"]) in text


def test_the_debian_stand_in_has_the_same_python() -> None:
    """FROM python:3.X-slim is built on a Debian suite whose python3 is 3.X (bookworm: 3.11)."""
    from_ = str(_dockerfile_by_hand()["from"])
    m = re.fullmatch(r"python:(\d+\.\d+)-slim", from_)
    assert m, from_
    src = IMAGE_PY.read_text()
    assert f'"{from_}"' in src and '"suite": "bookworm"' in src
    assert m.group(1) == "3.11"  # bookworm's python3


@pytest.mark.parametrize("line", ["ADD . /app", "HEALTHCHECK CMD true", "ARG X=1", "VOLUME /data"])
def test_an_instruction_the_builder_does_not_know_stops_it(tmp_path: Path, line: str) -> None:
    df = tmp_path / "Dockerfile"
    df.write_text(f"FROM python:3.11-slim\n{line}\nUSER 10001\n")
    done = _plan(df)
    assert done.returncode == 1
    assert len(done.stderr.strip().splitlines()) == 1
    assert line.split()[0] in done.stderr and "not supported" in done.stderr


def test_an_unknown_base_stops_the_builder(tmp_path: Path) -> None:
    df = tmp_path / "Dockerfile"
    df.write_text("FROM alpine:3.20\nUSER 10001\n")
    done = _plan(df)
    assert done.returncode == 1 and "alpine:3.20" in done.stderr


def test_k8s_script_refuses_an_unknown_verb() -> None:
    done = subprocess.run([str(ROOT / "scripts" / "k8s.sh"), "frobnicate"], capture_output=True, text=True,
                          timeout=30, check=False)
    assert done.returncode != 0
    assert len(done.stderr.strip().splitlines()) == 1 and "usage: scripts/k8s.sh" in done.stderr


def test_servers_refuse_a_listen_host_of_another_machine() -> None:
    for script in ("redis.sh", "kafka.sh"):
        done = subprocess.run([str(ROOT / "scripts" / script), "up"], capture_output=True, text=True, timeout=30,
                              check=False, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "TW_LISTEN_HOST": "192.0.2.254"})
        assert done.returncode != 0
        assert "TW_LISTEN_HOST=192.0.2.254 is not an address of this machine" in done.stderr


def test_k8s_script_without_a_cluster_says_so(tmp_path: Path) -> None:
    """status and env of a checkout with no cluster: exit 1, one line (no state is created)."""
    copy = tmp_path / "scripts"
    copy.mkdir()
    for name in ("k8s.sh", "common.sh"):
        (copy / name).write_text((ROOT / "scripts" / name).read_text())
        (copy / name).chmod(0o755)
    status = subprocess.run([str(copy / "k8s.sh"), "status"], capture_output=True, text=True, timeout=30, check=False)
    assert status.returncode == 1 and status.stdout.strip() == "not running"
    env = subprocess.run([str(copy / "k8s.sh"), "env"], capture_output=True, text=True, timeout=30, check=False)
    assert env.returncode == 1
    assert env.stderr.strip() == "k8s.sh: no cluster started: run 'scripts/k8s.sh up'"
    assert not (tmp_path / ".run" / "k8s").exists()


def test_make_image_writes_an_oci_archive_of_the_chart_s_app_version() -> None:
    chart = (ROOT / "charts" / "timerwheel" / "Chart.yaml").read_text()
    version = re.search(r'^appVersion: "?([^"\n]+)"?$', chart, re.M).group(1)  # type: ignore[union-attr]
    # --no-print-directory: under `make test` (MAKELEVEL set) make prints its directory too
    done = subprocess.run(["make", "--no-print-directory", "-n", "image"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["python3", "scripts/image.py", "build", "--tag", f"timerwheel:{version}",
                                   "--oci-archive", f"dist/timerwheel-{version}.oci.tar"]
    helped = subprocess.run([sys.executable, str(IMAGE_PY), "build", "--help"], capture_output=True, text=True,
                            timeout=60, check=False)
    assert "--oci-archive" in helped.stdout
