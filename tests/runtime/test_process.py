"""The process of a stage or of ``timerwheel run``: its HTTP port. Whole processes: their
commands in tests/cli/test_commands.py, on Kafka and Redis in e2e/test_process.py; /readyz of a
stage that fails: tests/runtime/test_runner.py (``TrackedStage``)."""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from infra import free_port
from timerwheel import TimerConfig
from timerwheel.cli import main
from timerwheel.errors import ConfigError
from timerwheel.metrics import Metrics
from timerwheel.runtime.process import serve_http


def test_no_port_serves_nothing() -> None:
    assert serve_http(TimerConfig(http_port=0), Metrics(), live=lambda: True, ready=lambda: True) is None


def test_a_port_that_cannot_be_served_is_a_config_error_naming_tw_http_port() -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"^TW_HTTP_PORT: cannot serve on port {port}: Address already in use"):
            serve_http(TimerConfig(http_port=port), Metrics(), live=lambda: True, ready=lambda: True)


def test_a_stage_says_at_once_that_it_cannot_reach_kafka(tmp_path: Path, redis_url: str) -> None:
    """kafka-python tells only after its 30 s bootstrap timeout: the stage said nothing for 31 s."""
    nobody = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "TW_KAFKA_BOOTSTRAP": nobody, "TW_REDIS_URL": redis_url, "TW_DATA_DIR": str(tmp_path),
           "TW_LOG_LEVEL": "INFO"}
    proc = subprocess.Popen([sys.executable, "-m", "timerwheel.cli", "stage", "enqueue-get"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
    started = time.monotonic()
    try:
        while True:
            line = json.loads(lines.get(timeout=max(0.1, 15 - (time.monotonic() - started))))
            if line["event"] == "cannot reach Kafka, waiting for it":
                break
        assert line["level"] == "warning" and line["bootstrap"] == nobody and "Connection refused" in line["error"]
    finally:
        proc.terminate()
        assert proc.wait(30) == 0, "a stage stopped while waiting for Kafka exits cleanly"


def test_run_on_kafka_and_a_client_command_say_at_once_that_they_cannot_reach_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nobody = f"127.0.0.1:{free_port()}"
    for argv in (["schedule", "--kafka", nobody, "--topic", "t", "--delay", "1s"],
                 ["run", "--kafka", nobody, "--redis", "redis://127.0.0.1:1/0", "--data-dir", str(tmp_path)]):
        started = time.monotonic()
        assert main(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"timerwheel: error: cannot reach Kafka at {nobody} ({nobody}: Connection refused)")
        assert time.monotonic() - started < 10, "it waited for kafka-python's bootstrap timeout"
