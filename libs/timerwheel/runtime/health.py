"""``/healthz``, ``/readyz`` and ``/metrics`` over HTTP for each process (port ``TW_HTTP_PORT``).

``/healthz`` answers 200 while the process loop runs; ``/readyz`` 200 once the stage has
started and its last step did not fail: able to take work (not "owns a shard": ownership is
the ``owned_shards`` gauge, see ``process.run_stage``);
``/metrics`` is the registry in Prometheus' text format.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from timerwheel.exposition import render
from timerwheel.metrics import Metrics


class HealthServer:
    def __init__(self, port: int, metrics: Metrics, live: Callable[[], bool], ready: Callable[[], bool],
                 host: str = "0.0.0.0") -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                path = self.path.split("?", 1)[0]
                if path == "/healthz":
                    ok = outer.live()
                    self._send(200 if ok else 503, b"ok\n" if ok else b"not live\n")
                elif path == "/readyz":
                    ok = outer.ready()
                    self._send(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
                elif path == "/metrics":
                    self._send(200, render(outer.metrics).encode(), "text/plain; version=0.0.4")
                else:
                    self._send(404, b"not found\n")

            def _send(self, code: int, body: bytes, ctype: str = "text/plain") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet access log
                return

        self.metrics = metrics
        self.live = live
        self.ready = ready
        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="tw-http", daemon=True)

    def start(self) -> HealthServer:
        self.thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
