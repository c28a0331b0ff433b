"""The Spark image, built without Docker (`make spark-image`: scripts/image.py, cached in
~/.cache/timerwheel/image) and run in a chroot of its root file system as its user, with only its
environment: Java 17 and PySpark are there, and `timerwheel audit` runs Spark against the test
Kafka (the chroot shares the host's network). The first build downloads Java, Maven's jars and
PySpark (~10 min); later ones reuse the layers. Needs root, debootstrap, umoci and skopeo."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT_S = 3600


def _apt_install(*packages: str) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", *packages]
    if subprocess.run(install, capture_output=True, env=env, timeout=900, check=False).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=900, check=False)
        subprocess.run(install, capture_output=True, env=env, timeout=900, check=False)


def in_image(*command: str) -> subprocess.CompletedProcess[str]:
    """``command`` in the Spark image (built first if its sources changed)."""
    missing = [t for t in ("debootstrap", "umoci", "skopeo", "chroot") if not shutil.which(t)]
    if os.geteuid() == 0 and missing:  # as scripts/k8s.sh does for the stage image (a fresh machine)
        _apt_install(*(t for t in missing if t != "chroot"))
        missing = [t for t in ("debootstrap", "umoci", "skopeo", "chroot") if not shutil.which(t)]
    if os.geteuid() != 0 or missing:
        pytest.fail(f"the Spark image needs root and {', '.join(missing) or 'nothing else'} "
                    f"(apt-get install debootstrap umoci skopeo)", pytrace=False)
    return subprocess.run(["python3", str(ROOT / "scripts" / "image.py"), "run", "--dockerfile",
                           str(ROOT / "services" / "spark" / "Dockerfile"), "--tag", "timerwheel-spark:dev",
                           "--", *command], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)


def test_the_spark_image_has_java_pyspark_and_the_jobs() -> None:
    done = in_image("sh", "-c", "id -u && java -version 2>&1 | head -1 && "
                    "python -c 'import pyspark; print(pyspark.__version__)' && ls $TW_SPARK_JARS && "
                    "timerwheel audit --help")
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "10001"
    assert 'version "17.' in lines[1], lines[1]
    assert lines[2] == "4.2.0"
    assert any(line.startswith("spark-sql-kafka-0-10_2.13-4.2.0") for line in lines), done.stdout
    assert "--grace" in done.stdout


def test_the_audit_runs_in_the_spark_image_against_kafka(kafka_bootstrap: str) -> None:
    topic = f"image-dest-{uuid.uuid4().hex[:8]}"
    out = f"/tmp/audit-{topic}"
    done = in_image("sh", "-c", f"timerwheel audit --kafka {kafka_bootstrap} --out {out} --topics {topic} "
                    f"--timer-topic image-timer-{topic} --master 'local[1]' && cat {out}/summary.json")
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout[done.stdout.index("{\n"):])
    assert summary["total"]["scheduled"] == 0 and summary["bad_input"]["unknown_topics"] == [topic]
