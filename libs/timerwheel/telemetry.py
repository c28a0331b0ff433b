"""OpenTelemetry for timerwheel: spans per stage batch, W3C context in headers, OTLP export.

Off by default. ``configure_from_env()`` turns tracing on when ``OTEL_TRACES_EXPORTER=otlp``
or ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (OTLP over HTTP, configured by the standard
``OTEL_*`` variables), and OTLP metrics when ``OTEL_METRICS_EXPORTER=otlp``. Tests call
``use(provider)``. Stages ask ``tracer()`` (or ``batch_start()``) once per batch; with
tracing off that is one ``None`` check, no span and no link list is built.

Trace shape. A stage handles batches, so each stage records ONE span per batch, LINKED
(never parented) to the context of each message in it — at most ``MAX_LINKS`` (128) links
per span; the messages past the cap are not examined, only counted in
``timerwheel.links_dropped``. The message's context is the
``traceparent`` / ``tracestate`` of its timer record, which rides in the Kafka headers and
in the put queue's entries (``PutRequest.traceparent`` / ``.tracestate``; the fetch and
deliver entries point at the timer record, whose headers carry it).

=================  ========================  ========  ========================================
stage              span name                 kind      links to
=================  ========================  ========  ========================================
TimerClient        send <timer topic>        PRODUCER  (the caller's current span is the parent);
                                                       a cancel too, with timerwheel.cancel=true
                                                       and the target's messaging.message.id
enqueue-get        process <timer topic>     CONSUMER  each record's context
enqueue-put        enqueue-put               INTERNAL  each request's context (from the put entry)
dequeue-get        dequeue-get               INTERNAL  none: the TimerLog stores no context; one
                                                       span per slot batch (timerwheel.shard,
                                                       timerwheel.slot_time), whose context rides
                                                       in the fetch entry (``FetchEntry.traceparent``)
dequeue-getmsg     receive <timer topic>     CLIENT    the dequeue-get span of each fetch entry,
                                                       and each read record's context
dequeue-put        send <topic>              PRODUCER  each delivered / rolled record's context
=================  ========================  ========  ========================================

The wait (enqueue-put -> dequeue-get) is a hop across time: the spans after it are new
spans linked to the message's context, as are all hops here. dequeue-get cannot link the
messages (it reads TimerLog records, not timer records), so its span is joined to their
traces through dequeue-getmsg's span, which links both. dequeue-put injects ITS span's
context into the delivered record (and into a rolled record going back to the timer topic,
so the next hop links to the previous one), replacing the producer's ``traceparent``: a
consumer continues the trace from the delivery. One message's trace is thus send ->
process -> enqueue-put -> receive (-> dequeue-get) -> send <topic> -> the consumer.

The exceptional outcomes get a short span of their own, a CHILD of the message's context
(so they sit in the message's own trace): a cancelled message ends with span event
``cancelled``; a dead-lettered one has status ERROR, ``error.type`` and an ``exception``
event carrying the reason.

Attributes follow the messaging conventions (``messaging.system=kafka``,
``messaging.operation.type``, ``messaging.destination.name``,
``messaging.destination.partition.id``, ``messaging.kafka.offset``,
``messaging.message.id``, ``messaging.consumer.group.name``,
``messaging.batch.message_count``); per-message ones sit on the links, together with
``timerwheel.slot_time``, ``timerwheel.deliver_at``, ``timerwheel.roll`` and
``timerwheel.lateness_ms``; the stage's shard is ``timerwheel.shard``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from timerwheel.config import TimerConfig
from timerwheel.metrics import COUNTERS, GAUGES, HISTOGRAMS, Metrics
from timerwheel.records import Headers, OutRecord, Record
from timerwheel.store import Flag
from timerwheel.wire import H_ERROR, H_ID, H_TOPIC, TimerRules, message_id_of, record_roll

#: Links per batch span (the SDK's default span limit is also 128).
MAX_LINKS = 128
TRACE_HEADERS = ("traceparent", "tracestate")
CONSUMER_GROUP = "timerwheel"
SCOPE = "timerwheel"
_ROLL = int(Flag.ROLL)

_propagator = TraceContextTextMapPropagator()
_tracer: Tracer | None = None
_lock = threading.Lock()
_metrics_provider: Any = None


# -- switching on and off -----------------------------------------------------------------
def use(provider: trace.TracerProvider | None) -> None:
    """Trace with ``provider`` (None: tracing off). The global provider is left alone."""
    global _tracer
    _tracer = provider.get_tracer(SCOPE) if provider is not None else None


def tracer() -> Tracer | None:
    """The tracer, or None when tracing is off: check once per batch."""
    return _tracer


def batch_start() -> int | None:
    """Start time of a batch span in ns, or None when tracing is off."""
    return time.time_ns() if _tracer is not None else None


def tracing_requested(env: Mapping[str, str]) -> bool:
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return "otlp" in exporter.split(",")
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def metrics_requested(env: Mapping[str, str]) -> bool:
    return "otlp" in env.get("OTEL_METRICS_EXPORTER", "").strip().lower().split(",")


def _resource(env: Mapping[str, str], stage: str | None = None) -> Any:
    from opentelemetry.sdk.resources import Resource

    attrs = {} if env.get("OTEL_SERVICE_NAME") else {"service.name": "timerwheel"}
    if stage is not None:
        attrs["timerwheel.stage"] = stage
    return Resource.create(attrs)


def configure_from_env(metrics: Metrics | None = None, env: Mapping[str, str] | None = None,
                       stage: str | None = None) -> bool:
    """Set up OTLP/http export from the ``OTEL_*`` variables; True if tracing is on.

    Tracing is configured once per process; ``metrics`` (the process's registry) is exported
    through OTLP when ``OTEL_METRICS_EXPORTER=otlp``. A process running one stage names it in
    the resource (``timerwheel.stage``)."""
    env = os.environ if env is None else env
    with _lock:
        if _tracer is None and tracing_requested(env):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            provider = TracerProvider(resource=_resource(env, stage))
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            use(provider)
            import atexit

            atexit.register(provider.shutdown)
        if metrics is not None and metrics_requested(env):
            export_metrics(metrics, env, stage)
    return _tracer is not None


# -- W3C propagation ----------------------------------------------------------------------
def extract(headers: Iterable[tuple[str, bytes]]) -> Context | None:
    """The context in ``traceparent`` / ``tracestate`` headers, or None if there is none."""
    carrier = {k: v.decode("ascii", "replace") for k, v in headers if k in TRACE_HEADERS}
    if "traceparent" not in carrier:
        return None
    return _propagator.extract(carrier)


def span_context(headers: Iterable[tuple[str, bytes]]) -> SpanContext | None:
    ctx = extract(headers)
    if ctx is None:
        return None
    sc = trace.get_current_span(ctx).get_span_context()
    return sc if sc.is_valid else None


def inject(span: Span) -> Headers:
    """``traceparent`` (and ``tracestate``) headers carrying ``span``'s context."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, trace.set_span_in_context(span))
    return tuple((k, carrier[k].encode()) for k in TRACE_HEADERS if k in carrier)


def replace_trace_headers(headers: Headers, trace_headers: Headers) -> Headers:
    """``headers`` with their trace context replaced by ``trace_headers``."""
    return tuple(h for h in headers if h[0] not in TRACE_HEADERS) + trace_headers


# -- building blocks ----------------------------------------------------------------------
class Links:
    """Links of one batch span: one per distinct context, at most MAX_LINKS."""

    def __init__(self) -> None:
        self.links: list[Link] = []
        self.seen: set[tuple[int, int]] = set()
        self.dropped = 0

    def full(self) -> bool:
        """True once MAX_LINKS are taken: the caller then skips the message (counted as dropped)
        without extracting its context."""
        if len(self.links) < MAX_LINKS:
            return False
        self.dropped += 1
        return True

    def add(self, sc: SpanContext | None, attributes: dict[str, Any]) -> None:
        if sc is None:
            return
        key = (sc.trace_id, sc.span_id)
        if key in self.seen:
            return
        self.seen.add(key)
        self.links.append(Link(sc, attributes))


def _kafka(operation: str, destination: str | None, count: int) -> dict[str, Any]:
    attrs: dict[str, Any] = {"messaging.system": "kafka", "messaging.operation.type": operation,
                             "messaging.batch.message_count": count}
    if destination:
        attrs["messaging.destination.name"] = destination
    return attrs


def _span(tr: Tracer, name: str, kind: SpanKind, start_ns: int, attrs: dict[str, Any], links: Links) -> Span:
    if links.dropped:
        attrs["timerwheel.links_dropped"] = links.dropped
    return tr.start_span(name, kind=kind, attributes=attrs, links=links.links, start_time=start_ns)


def _context_of_traceparent(tp: str | None, ts: str | None = None) -> SpanContext | None:
    if not tp:
        return None
    carrier = {"traceparent": tp} if ts is None else {"traceparent": tp, "tracestate": ts}
    sc = trace.get_current_span(_propagator.extract(carrier)).get_span_context()
    return sc if sc.is_valid else None


def _message_attrs(rec: Record) -> dict[str, Any]:
    return {"messaging.message.id": message_id_of(rec), "messaging.destination.partition.id": str(rec.partition),
            "messaging.kafka.offset": rec.offset}


def _header_text(headers: Headers, name: str) -> str | None:
    found = None
    for k, v in headers:
        if k == name:
            found = v
    return found.decode("utf-8", "replace") if found is not None else None


def _outcome_span(tr: Tracer, stage: str, headers: Headers, attrs: dict[str, Any]) -> Span:
    """A short span of one message, a child of its context (its own trace)."""
    parent = extract(headers)
    return tr.start_span(stage, context=parent, kind=SpanKind.INTERNAL, attributes=attrs)


def record_dead_letters(tr: Tracer, stage: str, dlq_topic: str, out: Sequence[OutRecord]) -> None:
    """An ERROR span, child of the message's context, per record written to the DLQ."""
    for o in out:
        if o.topic != dlq_topic:
            continue
        reason = _header_text(o.headers, H_ERROR) or "dead-lettered"
        attrs: dict[str, Any] = {"error.type": "InvalidTimerMessage", "messaging.system": "kafka",
                                 "messaging.destination.name": dlq_topic}
        mid = _header_text(o.headers, H_ID)
        if mid:
            attrs["messaging.message.id"] = mid
        span = _outcome_span(tr, f"{stage} dead-letter", o.headers, attrs)
        span.add_event("exception", {"exception.type": "InvalidTimerMessage", "exception.message": reason})
        span.set_status(Status(StatusCode.ERROR, reason))
        span.end()


# -- one call per stage batch -------------------------------------------------------------
def enqueue_get_batch(start_ns: int, cfg: TimerConfig, records: Sequence[Record], dead: Sequence[OutRecord]) -> None:
    tr = _tracer
    if tr is None:
        return
    links = Links()
    for r in records:
        if not links.full():
            links.add(span_context(r.headers), _message_attrs(r))
    attrs = _kafka("process", cfg.timer_topic, len(records))
    attrs["messaging.consumer.group.name"] = CONSUMER_GROUP
    partitions = {r.partition for r in records}
    if len(partitions) == 1:
        attrs["messaging.destination.partition.id"] = str(next(iter(partitions)))
    if len(records) == 1:
        attrs["messaging.kafka.offset"] = records[0].offset
        attrs["messaging.message.id"] = message_id_of(records[0])
    span = _span(tr, f"process {cfg.timer_topic}", SpanKind.CONSUMER, start_ns, attrs, links)
    if dead:
        span.set_attribute("timerwheel.dead_lettered", len(dead))
        record_dead_letters(tr, "enqueue-get", cfg.dlq_topic, dead)
    span.end()


def enqueue_put_batch(start_ns: int, shard_id: int, requests: Iterable[tuple[int, Any]],
                      written: Sequence[Any], slot_of: Callable[[int], int]) -> None:
    """``requests``: (source partition, PutRequest); ``written``: the TimerRecords appended."""
    tr = _tracer
    if tr is None:
        return
    by_src = {(w.src_partition, w.src_offset): w for w in written}
    links = Links()
    for p, req in requests:
        rec = by_src.get((p, req.src_offset))
        if rec is None or links.full():
            continue
        links.add(_context_of_traceparent(req.traceparent, req.tracestate), {
            "messaging.destination.partition.id": str(p), "messaging.kafka.offset": req.src_offset,
            "timerwheel.slot_time": slot_of(rec.deliver_ms), "timerwheel.deliver_at": req.deliver_ms,
            "timerwheel.roll_hop": bool(rec.flags & _ROLL), "timerwheel.cancel": bool(req.cancel)})
    attrs = {"timerwheel.shard": shard_id, "messaging.batch.message_count": len(written)}
    _span(tr, "enqueue-put", SpanKind.INTERNAL, start_ns, attrs, links).end()


def dequeue_get_batch(shard_id: int, slot_time: int, items: Sequence[Any], now_ms: int,
                      roll_flag: int) -> str | None:
    """One span per fetch entry (a slot's batch): no per-message context exists here. Returns
    the span's ``traceparent``, for the fetch entry (dequeue-getmsg links it); None when off."""
    tr = _tracer
    if tr is None:
        return None
    rolls = sum(1 for i in items if i.flags & roll_flag)
    attrs = {"timerwheel.shard": shard_id, "timerwheel.slot_time": slot_time,
             "timerwheel.lateness_ms": max(0, now_ms - slot_time), "messaging.batch.message_count": len(items),
             "timerwheel.roll_hops": rolls}
    span = tr.start_span("dequeue-get", kind=SpanKind.INTERNAL, attributes=attrs)
    span.end()
    return dict(inject(span))["traceparent"].decode()


def dequeue_getmsg_batch(start_ns: int, cfg: TimerConfig, fetches: Sequence[Any],
                         wanted: Mapping[tuple[int, int], Record | None]) -> None:
    tr = _tracer
    if tr is None:
        return
    links = Links()
    for f in fetches:  # dequeue-get's spans first: they join its span to the messages' traces
        if not links.full():
            links.add(_context_of_traceparent(f.traceparent), {"timerwheel.shard": f.shard,
                                                                "timerwheel.slot_time": f.slot_time})
    count = 0
    for f in fetches:
        for item in f.items:
            count += 1
            rec = wanted.get((item.src_partition, item.src_offset))
            if rec is not None and not links.full():
                attrs = _message_attrs(rec)
                attrs["timerwheel.slot_time"] = f.slot_time
                links.add(span_context(rec.headers), attrs)
    attrs = _kafka("receive", cfg.timer_topic, count)
    attrs["messaging.consumer.group.name"] = CONSUMER_GROUP
    shards = {f.shard for f in fetches}
    if len(shards) == 1:
        attrs["timerwheel.shard"] = next(iter(shards))
    _span(tr, f"receive {cfg.timer_topic}", SpanKind.CLIENT, start_ns, attrs, links).end()


def dequeue_put_start() -> Span | None:
    """The batch span of dequeue-put, started before the records are built (its context goes
    into them); links and attributes are added by ``dequeue_put_batch``."""
    tr = _tracer
    if tr is None:
        return None
    return tr.start_span("send", kind=SpanKind.PRODUCER, attributes={
        "messaging.system": "kafka", "messaging.operation.type": "send"})


def dequeue_put_batch(span: Span, cfg: TimerConfig, rules: TimerRules, entries: Sequence[Any],
                      out: Sequence[OutRecord], now_ms: int, kinds: Mapping[str, int]) -> None:
    """Links per delivered / rolled message, outcome spans for cancelled and dead-lettered ones.

    ``entries`` are the decoded DeliverEntries; ``kinds`` maps DELIVER/ROLL/CANCELLED/DUPLICATE to codec values."""
    tr = _tracer
    links = Links()
    count = 0
    topics: set[str] = set()
    for entry in entries:
        for item in entry.items:
            count += 1
            rec = item.record
            if rec is None:
                continue
            attrs = _message_attrs(rec)
            attrs["timerwheel.roll"] = record_roll(rec)
            attrs["timerwheel.slot_time"] = entry.slot_time
            attrs["timerwheel.shard"] = entry.shard
            if item.kind in (kinds["CANCELLED"], kinds.get("DUPLICATE", -1)):
                if tr is not None:
                    o = _outcome_span(tr, "dequeue-put", rec.headers, attrs)
                    o.add_event("cancelled" if item.kind == kinds["CANCELLED"] else "copy dropped",
                                {"messaging.message.id": attrs["messaging.message.id"]})
                    o.end()
                continue
            if item.kind == kinds["DELIVER"]:
                topic = _header_text(rec.headers, H_TOPIC)
                if topic:
                    topics.add(topic)
            else:
                topics.add(cfg.timer_topic)
            if links.full():
                continue
            try:
                deliver = rules.delivery_time(rec, now_ms, check_max=False)
            except Exception:  # noqa: BLE001 - telemetry never fails a batch
                deliver = item.fire_ms
            attrs["timerwheel.deliver_at"] = deliver
            if item.kind == kinds["DELIVER"]:
                attrs["timerwheel.lateness_ms"] = now_ms - deliver
            links.add(span_context(rec.headers), attrs)
    for link in links.links:
        span.add_link(link.context, link.attributes)
    attrs = _kafka("send", next(iter(topics)) if len(topics) == 1 else None, count)
    if links.dropped:
        attrs["timerwheel.links_dropped"] = links.dropped
    span.set_attributes(attrs)
    if len(topics) == 1:
        span.update_name(f"send {next(iter(topics))}")
    if tr is not None:
        record_dead_letters(tr, "dequeue-put", cfg.dlq_topic, out)
    span.end()


def send_span(timer_topic: str, message_id: str, partition: int, destination: str | None,
              cancel: bool = False) -> tuple[Span, Headers] | None:
    """The client's PRODUCER span of one timer record and the headers that carry it: a message
    to ``destination``, or (``cancel``) the cancel of the message ``message_id``."""
    tr = _tracer
    if tr is None:
        return None
    attrs: dict[str, Any] = {
        "messaging.system": "kafka", "messaging.operation.type": "send",
        "messaging.destination.name": timer_topic, "messaging.destination.partition.id": str(partition),
        "messaging.message.id": message_id}
    if destination is not None:
        attrs["timerwheel.topic"] = destination
    if cancel:
        attrs["timerwheel.cancel"] = True
    span = tr.start_span(f"send {timer_topic}", kind=SpanKind.PRODUCER, attributes=attrs)
    return span, inject(span)


# -- metrics over OTLP --------------------------------------------------------------------
def export_metrics(metrics: Metrics, env: Mapping[str, str] | None = None, stage: str | None = None) -> Any:
    """Export the registry through OTLP/http: observable instruments that read it on collection."""
    global _metrics_provider
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.metrics import CallbackOptions, Observation
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    env = os.environ if env is None else env
    reader = PeriodicExportingMetricReader(OTLPMetricExporter())
    provider = MeterProvider(metric_readers=[reader], resource=_resource(env, stage))
    meter = provider.get_meter(SCOPE)

    def counter_cb(name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def cb(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(v, dict(k)) for k, v in metrics.snapshot("counters", name).items()]
        return cb

    def gauge_cb(name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def cb(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(v, dict(k)) for k, v in metrics.snapshot("gauges", name).items()]
        return cb

    # Every declared family (metrics.COUNTERS, GAUGES), recorded yet or not: the exporter reads
    # the same registry /metrics renders, so OTLP carries every counter /metrics shows.
    for name, doc in COUNTERS.items():
        meter.create_observable_counter(f"timerwheel.{name}", [counter_cb(name)], description=doc)
    for name, doc in GAUGES.items():
        meter.create_observable_gauge(f"timerwheel.{name}", [gauge_cb(name)], description=doc)

    def lateness(_options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(count, dict(k)) for k, (_b, _c, _s, count)
                in metrics.histogram_snapshot("delivery_lateness_ms").items()]

    meter.create_observable_counter("timerwheel.delivery_lateness_ms.count", [lateness],
                                    description=HISTOGRAMS["delivery_lateness_ms"] + " (count)")
    _metrics_provider = provider
    return provider
