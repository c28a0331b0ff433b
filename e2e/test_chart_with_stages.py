"""What the chart and the operator rely on, against the five real stage processes (Kafka, Redis):
the chart's `helm test` script schedules one message with the wire contract and sees it
delivered (and fails when nothing delivers), and the operator's status reader turns the stages'
own /metrics into per-shard owner, epoch, W and R. The same on a real cluster is the k8s e2e."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import Pipeline
from timerwheel_operator.stage_metrics import parse_prometheus, shard_status

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


def helm_test_job(kafka: str, timer_topic: str, topic: str, timeout_s: int) -> dict[str, Any]:
    out = subprocess.run([str(ROOT / "scripts" / "helm.sh"), "path"], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        pytest.fail(f"scripts/helm.sh could not build helm (needs Go and the Go module proxy):\n{out.stderr[-2000:]}")
    helm = out.stdout.strip().splitlines()[-1]
    rendered = subprocess.run(
        [helm, "template", "tw", str(ROOT / "charts" / "timerwheel"), "--show-only",
         "templates/tests/test-delivery.yaml", "--set", f"timerwheel.spec.kafka.bootstrap={kafka}",
         "--set", f"timerwheel.spec.timerTopic={timer_topic}", "--set", f"tests.topic={topic}",
         "--set", "tests.delayMs=1500", "--set", f"tests.timeoutSeconds={timeout_s}"],
        capture_output=True, text=True, timeout=120, check=True)
    job: dict[str, Any] = yaml.safe_load(rendered.stdout)
    return job


def run_job(job: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """The Job's one container, run here: the same python -c script and environment."""
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TW_")}
    env.update({e["name"]: e["value"] for e in container["env"]})
    assert container["command"][:2] == ["python3", "-c"]
    return subprocess.run([sys.executable, "-c", container["command"][2]], env=env, capture_output=True, text=True,
                          timeout=int(env["TIMEOUT_S"]) + 60)


def test_the_helm_test_job_passes_on_delivery_and_fails_without(
    tmp_path: Path, kafka_bootstrap: str, redis_url: str
) -> None:
    pipe = Pipeline(tmp_path, kafka_bootstrap, redis_url, shards=2)
    pipe.create_timer_topic()
    topic = pipe.dest("helm-test")
    with pipe.running():
        done = run_job(helm_test_job(kafka_bootstrap, pipe.timer_topic, topic, 60))
        assert done.returncode == 0, done.stdout + done.stderr
        assert '"event": "delivered"' in done.stdout
        # The operator's view of the same processes: each shard owned, with its epoch, W and R.
        deadline = time.monotonic() + 20
        while True:
            scrapes = {name: parse_prometheus(pipe.http(name, "/metrics")[1])
                       for name in ("enqueue-put", "dequeue-get")}
            shards = shard_status(scrapes, 2)
            if all(s.write_ms and s.read_ms for s in shards) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for s in shards:
            assert (s.owner, s.reader) == ("enqueue-put", "dequeue-get"), s
            assert s.epoch is not None and s.epoch >= 1, s
            assert s.write_ms and s.read_ms and s.read_ms <= s.write_ms + 100, s
            assert abs(s.write_ms - time.time() * 1000) < 60_000, s  # exact epoch ms, not 6 digits
    missed = run_job(helm_test_job(kafka_bootstrap, pipe.timer_topic, topic, 10))
    assert missed.returncode == 1 and '"event": "not delivered"' in missed.stdout, missed.stdout + missed.stderr
