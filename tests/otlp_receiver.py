"""An OTLP/http receiver for tests: what a collector would get, decoded.

    receiver = OtlpReceiver().start()     # a thread; POST /v1/traces and /v1/metrics
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
    ...
    spans = receiver.spans()              # every span received so far, flattened (SpanRec)
    points = receiver.metric("timerwheel.delivered")
    receiver.close()

Bodies are protobuf (``ExportTraceServiceRequest`` / ``ExportMetricsServiceRequest``),
gzip- or deflate-compressed when the exporter says so in ``Content-Encoding``.
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from opentelemetry.sdk.trace import ReadableSpan

#: Span kinds and status codes by their OpenTelemetry API names.
KINDS = {Span.SPAN_KIND_INTERNAL: "INTERNAL", Span.SPAN_KIND_SERVER: "SERVER", Span.SPAN_KIND_CLIENT: "CLIENT",
         Span.SPAN_KIND_PRODUCER: "PRODUCER", Span.SPAN_KIND_CONSUMER: "CONSUMER"}
STATUS = {Status.STATUS_CODE_UNSET: "UNSET", Status.STATUS_CODE_OK: "OK", Status.STATUS_CODE_ERROR: "ERROR"}


def value_of(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return tuple(value_of(x) for x in v.array_value.values)
    return getattr(v, which) if which else None


def attrs_of(kvs: Any) -> dict[str, Any]:
    return {kv.key: value_of(kv.value) for kv in kvs}


@dataclass(frozen=True)
class LinkRec:
    trace_id: int
    span_id: int
    trace_state: str
    attributes: Mapping[str, Any]


@dataclass(frozen=True)
class SpanRec:
    """One received span, ids as ints (as ``opentelemetry.trace.SpanContext`` has them)."""

    name: str
    kind: str
    trace_id: int
    span_id: int
    parent_span_id: int | None
    attributes: Mapping[str, Any]
    links: tuple[LinkRec, ...]
    events: tuple[tuple[str, Mapping[str, Any]], ...]
    status: str
    resource: Mapping[str, Any]

    def links_to(self, trace_id: int, span_id: int) -> list[LinkRec]:
        return [li for li in self.links if (li.trace_id, li.span_id) == (trace_id, span_id)]

    @classmethod
    def of(cls, s: ReadableSpan) -> SpanRec:
        """The same view of a span recorded in this process (an SDK span)."""
        assert s.context is not None
        return cls(
            name=s.name, kind=s.kind.name, trace_id=s.context.trace_id, span_id=s.context.span_id,
            parent_span_id=s.parent.span_id if s.parent is not None else None, attributes=dict(s.attributes or {}),
            links=tuple(LinkRec(li.context.trace_id, li.context.span_id, li.context.trace_state.to_header(),
                                dict(li.attributes or {})) for li in s.links),
            events=tuple((e.name, dict(e.attributes or {})) for e in s.events),
            status=s.status.status_code.name, resource=dict(s.resource.attributes))


def joined(start: SpanRec, spans: list[SpanRec]) -> list[SpanRec]:
    """Every span reachable from ``start`` through parents, children and links (either way)."""
    edges: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for s in spans:
        others = [(li.trace_id, li.span_id) for li in s.links]
        if s.parent_span_id is not None:
            others.append((s.trace_id, s.parent_span_id))
        for o in others:
            edges.setdefault((s.trace_id, s.span_id), set()).add(o)
            edges.setdefault(o, set()).add((s.trace_id, s.span_id))
    seen = {(start.trace_id, start.span_id)}
    todo = list(seen)
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return [s for s in spans if (s.trace_id, s.span_id) in seen]


def _id(raw: bytes) -> int:
    return int.from_bytes(raw, "big")


def _span(s: Span, resource: dict[str, Any]) -> SpanRec:
    return SpanRec(
        name=s.name, kind=KINDS.get(s.kind, str(s.kind)), trace_id=_id(s.trace_id), span_id=_id(s.span_id),
        parent_span_id=_id(s.parent_span_id) if s.parent_span_id else None, attributes=attrs_of(s.attributes),
        links=tuple(LinkRec(_id(li.trace_id), _id(li.span_id), li.trace_state, attrs_of(li.attributes))
                    for li in s.links),
        events=tuple((e.name, attrs_of(e.attributes)) for e in s.events),
        status=STATUS.get(s.status.code, str(s.status.code)), resource=resource)


class OtlpReceiver:
    """``host``: the address to listen on (``127.0.0.1``; a pod reaches the node's address)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.trace_requests: list[ExportTraceServiceRequest] = []
        self.metric_requests: list[ExportMetricsServiceRequest] = []
        self.bad_requests: list[str] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                reply = receiver._take(self.path, body)
                if reply is None:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *_args: object) -> None:
                pass

        self.host = host
        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, name="otlp-receiver", daemon=True)

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.server.server_address[1]}"

    def _take(self, path: str, body: bytes) -> bytes | None:
        if path == "/v1/traces":
            req = ExportTraceServiceRequest.FromString(body)
            with self._lock:
                self.trace_requests.append(req)
            return bytes(ExportTraceServiceResponse().SerializeToString())
        if path == "/v1/metrics":
            mreq = ExportMetricsServiceRequest.FromString(body)
            with self._lock:
                self.metric_requests.append(mreq)
            return bytes(ExportMetricsServiceResponse().SerializeToString())
        with self._lock:
            self.bad_requests.append(path)
        return None

    def spans(self) -> list[SpanRec]:
        with self._lock:
            requests = list(self.trace_requests)
        out = []
        for req in requests:
            for rs in req.resource_spans:
                resource = attrs_of(rs.resource.attributes)
                for ss in rs.scope_spans:
                    out.extend(_span(s, resource) for s in ss.spans)
        return out

    def metric(self, name: str) -> list[tuple[dict[str, Any], Any, dict[str, Any]]]:
        """The data points of metric ``name`` in the latest request that has it: (attributes,
        value, the metric's kind facts: ``type``, ``monotonic``, and the resource)."""
        with self._lock:
            requests = list(self.metric_requests)
        for req in reversed(requests):
            for rm in req.resource_metrics:
                resource = attrs_of(rm.resource.attributes)
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        if m.name != name:
                            continue
                        kind = m.WhichOneof("data")
                        data = getattr(m, kind)
                        facts = {"type": kind, "monotonic": getattr(data, "is_monotonic", None), "resource": resource}
                        return [(attrs_of(p.attributes), getattr(p, p.WhichOneof("value")), facts)
                                for p in data.data_points]
        return []

    def wait(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Poll ``done`` until it holds or the timeout passes; returns its last answer."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() >= deadline:
                return done()
            time.sleep(0.1)
        return True

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)
