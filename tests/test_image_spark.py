"""The Spark image (services/spark/Dockerfile) is one scripts/image.py can build (`make
spark-image`): every instruction known to it, non-root, with Java, the connector's jars and the
``timerwheel`` command. The built image runs the jobs: e2e/test_spark_image.py."""

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
    assert plan["entrypoint"] == ["timerwheel"]
    assert plan["env"]["TW_SPARK_JARS"] == "/opt/spark-jars" and plan["env"]["JAVA_HOME"].startswith("/usr/lib/jvm/")
    # the slim base has no man pages: openjdk's post-install needs the directory (or apt-get fails)
    assert "mkdir -p /usr/share/man/man1" in plan["run"][0]
    assert any("['optional-dependencies']['spark']" in step for step in plan["run"])


def test_make_spark_image_builds_it_with_the_local_builder() -> None:
    make = (ROOT / "Makefile").read_text()
    assert "scripts/image.py build --dockerfile services/spark/Dockerfile --tag timerwheel-spark:dev" in make
