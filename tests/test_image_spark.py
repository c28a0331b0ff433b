"""The Spark image (services/spark/Dockerfile) is one scripts/image.py can build (`make
spark-image`): every instruction known to it, non-root, with Java, the connector's jars and the
``timerwheel`` command, and an entrypoint that also starts Spark executors (Spark's Kubernetes
scheduler runs executor pods of the same image). The built image runs the jobs:
e2e/test_spark_image.py; its executors: e2e/test_k8s_spark.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPARK_DOCKERFILE = ROOT / "services" / "spark" / "Dockerfile"


def test_the_builder_knows_every_instruction_of_the_spark_image() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "image.py"), "plan", "--dockerfile",
                           str(SPARK_DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["user"] not in ("", "0", "root")
    assert plan["entrypoint"] == ["/app/services/spark/entrypoint.sh"]
    assert plan["env"]["TW_SPARK_JARS"] == "/opt/spark-jars" and plan["env"]["JAVA_HOME"].startswith("/usr/lib/jvm/")
    # the executor's class path is PySpark's jars (spark-kubernetes and its fabric8 client among them)
    assert plan["env"]["SPARK_HOME"] == "/opt/timerwheel/lib/python3.11/site-packages/pyspark"
    assert plan["env"]["PYSPARK_PYTHON"] == "/opt/timerwheel/bin/python"
    # the slim base has no man pages: openjdk's post-install needs the directory (or apt-get fails)
    assert "mkdir -p /usr/share/man/man1" in plan["run"][0]
    assert any("['optional-dependencies']['spark']" in step for step in plan["run"])


def test_make_spark_image_builds_it_with_the_local_builder() -> None:
    make = (ROOT / "Makefile").read_text()
    assert "scripts/image.py build --dockerfile services/spark/Dockerfile --tag timerwheel-spark:dev" in make


def test_the_entrypoint_runs_timerwheel_or_a_spark_executor() -> None:
    script = (ROOT / "services" / "spark" / "entrypoint.sh").read_text()
    assert script.startswith("#!/bin/bash")
    assert 'exec timerwheel "$@"' in script
    # what Spark's own image's entrypoint.sh runs for an executor pod, with the arguments Spark 4.2's
    # KubernetesExecutorBackend takes
    for arg in ("--driver-url", "--executor-id", "--cores", "--app-id", "--hostname", "--resourceProfileId",
                "--podName"):
        assert f"{arg} " in script, arg
    assert "org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend" in script
    done = subprocess.run(["bash", "-n", str(ROOT / "services" / "spark" / "entrypoint.sh")], capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr
