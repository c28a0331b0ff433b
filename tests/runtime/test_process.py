"""The process of a stage or of ``timerwheel run``: its HTTP port. Whole processes: their
commands in tests/cli/test_commands.py, on Kafka and Redis in e2e/test_process.py; /readyz of a
stage that fails: tests/runtime/test_runner.py (``TrackedStage``)."""

from __future__ import annotations

import socket

import pytest
from timerwheel import TimerConfig
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
