"""HealthServer: /healthz and /readyz answer what the process says at the time of the request,
/metrics serves the registry in Prometheus' text format, anything else is 404."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from timerwheel.metrics import Metrics
from timerwheel.runtime.health import HealthServer


@pytest.fixture
def server() -> Iterator[tuple[HealthServer, dict[str, bool]]]:
    state = {"live": True, "ready": False}
    metrics = Metrics()
    metrics.inc("delivered", 3, topic="orders")
    started = HealthServer(0, metrics, live=lambda: state["live"], ready=lambda: state["ready"],
                           host="127.0.0.1").start()
    yield started, state
    started.close()


def get(server: HealthServer, path: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=10) as reply:
            return reply.status, reply.headers["Content-Type"], reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def test_the_probes_answer_what_the_process_says_now(server: tuple[HealthServer, dict[str, bool]]) -> None:
    http, state = server
    assert get(http, "/healthz")[::2] == (200, "ok\n")
    assert get(http, "/readyz")[::2] == (503, "not ready\n")
    state["ready"] = True
    assert get(http, "/readyz?verbose")[::2] == (200, "ready\n")
    state["live"] = False
    assert get(http, "/healthz")[::2] == (503, "not live\n")


def test_metrics_is_the_registry_in_prometheus_text_and_other_paths_are_404(
        server: tuple[HealthServer, dict[str, bool]]) -> None:
    http, _state = server
    code, kind, body = get(http, "/metrics")
    assert (code, kind) == (200, "text/plain; version=0.0.4")
    [family] = [f for f in text_string_to_metric_families(body) if f.name == "timerwheel_delivered"]
    assert [(s.name, s.labels, s.value) for s in family.samples] == [
        ("timerwheel_delivered_total", {"topic": "orders"}, 3.0)]
    assert get(http, "/")[0] == 404 and get(http, "/metrics/x")[0] == 404
