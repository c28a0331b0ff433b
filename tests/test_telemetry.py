"""Tracing through the five stages (embedded, simulated clock, in-memory span exporter) and the
metrics a run leaves behind (on /metrics and over OTLP/http to a receiver in the test)."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, StatusCode, TraceFlags, TraceState
from otlp_receiver import OtlpReceiver, SpanRec
from otlp_receiver import joined as joined_records
from prometheus_client.parser import text_string_to_metric_families
from stages.scenario import by_id, header, step_through
from timerwheel import SimulatedClock, telemetry
from timerwheel.exposition import render
from timerwheel.metrics import COUNTERS, GAUGES, Metrics
from timerwheel.runtime.embedded import EmbeddedTimerwheel
from timerwheel.runtime.health import HealthServer

ROLL_WINDOW_MS = 10_000
START = 1_700_000_000_000


@pytest.fixture
def clock() -> SimulatedClock:
    return SimulatedClock(start_ms=START)


@pytest.fixture
def tw(tmp_path: Path, clock: SimulatedClock) -> Iterator[EmbeddedTimerwheel]:
    """An embedded timerwheel whose roll window makes a 25 s delay roll twice."""
    with EmbeddedTimerwheel(tmp_path / "data", clock=clock, tick_ms=100, roll_window_ms=ROLL_WINDOW_MS,
                            fsync=False) as opened:
        yield opened


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.use(provider)
    try:
        yield exporter
    finally:
        telemetry.use(None)
        provider.shutdown()


SpanKey = tuple[int, int]


def _key(span: ReadableSpan) -> SpanKey:
    assert span.context is not None
    return span.context.trace_id, span.context.span_id


def joined(start: ReadableSpan, spans: list[ReadableSpan]) -> list[ReadableSpan]:
    """Every span reachable from ``start`` through parents, children and links (either way)."""
    reached = {(r.trace_id, r.span_id) for r in joined_records(SpanRec.of(start), [SpanRec.of(s) for s in spans])}
    return [s for s in spans if _key(s) in reached]


def send_span_of(spans: list[ReadableSpan], message_id: str, cancel: bool = False) -> ReadableSpan:
    """The client's span of the message ``message_id`` (``cancel``: of the cancel of it)."""
    found = [s for s in spans if s.kind == SpanKind.PRODUCER and s.attributes is not None
             and s.attributes.get("messaging.message.id") == message_id
             and bool(s.attributes.get("timerwheel.cancel")) == cancel]
    assert len(found) == 1, [s.name for s in found]
    return found[0]


def run_scenario(tw: EmbeddedTimerwheel, clock: SimulatedClock) -> dict[str, Any]:
    normal = tw.schedule("orders", b"normal", delay_ms=1_000)
    rolled = tw.schedule("orders", b"rolled", delay_ms=25_000)
    cancelled = tw.schedule("orders", b"cancelled", delay_ms=2_000)
    invalid = tw.schedule(tw.config.timer_topic, b"loops", delay_ms=1_000)  # destination is the timer topic
    tw.wait_idle()
    tw.cancel(cancelled)
    step_through(tw, clock, [normal.deliver_at_ms, cancelled.deliver_at_ms, rolled.deliver_at_ms],
                 rolled.deliver_at_ms + 1_000)
    return {"normal": normal, "rolled": rolled, "cancelled": cancelled, "invalid": invalid}


def test_a_delivered_message_is_one_linked_trace_from_send_to_delivery(
        tw: EmbeddedTimerwheel, clock: SimulatedClock, spans: InMemorySpanExporter) -> None:
    t = run_scenario(tw, clock)
    timer_topic = tw.config.timer_topic
    done = list(spans.get_finished_spans())
    delivered = by_id(tw.read("orders"))
    assert set(delivered) == {t["normal"].message_id, t["rolled"].message_id}

    send = send_span_of(done, t["normal"].message_id)
    assert send.name == f"send {timer_topic}"
    trace = joined(send, done)
    names = {s.name for s in trace}
    assert {f"send {timer_topic}", f"process {timer_topic}", "enqueue-put", "dequeue-get", f"receive {timer_topic}",
            "send orders"} <= names, names

    # The stage spans that link the send span directly (a batch span also links other messages).
    by_name = {s.name: s for s in trace if any(li.context.span_id == send.context.span_id  # type: ignore[union-attr]
                                               for li in s.links)}
    assert {f"process {timer_topic}", "enqueue-put", f"receive {timer_topic}", "send orders"} <= set(by_name)
    assert by_name[f"process {timer_topic}"].kind == SpanKind.CONSUMER
    assert by_name[f"receive {timer_topic}"].kind == SpanKind.CLIENT
    assert by_name["enqueue-put"].attributes is not None
    assert "timerwheel.shard" in by_name["enqueue-put"].attributes

    # dequeue-get (which reads the TimerLog, where no context is kept) joins through the
    # receive span: it links the dequeue-get span of the message's slot as well.
    receive = by_name[f"receive {timer_topic}"]
    msg_link = next(li for li in receive.links if li.context.span_id == send.context.span_id)  # type: ignore[union-attr]
    slot_time = msg_link.attributes["timerwheel.slot_time"]  # type: ignore[index]
    gets = {_key(s): s for s in done if s.name == "dequeue-get"}
    linked_gets = [gets[(li.context.trace_id, li.context.span_id)] for li in receive.links
                   if (li.context.trace_id, li.context.span_id) in gets]
    (get,) = [g for g in linked_gets if g.attributes["timerwheel.slot_time"] == slot_time]  # type: ignore[index]
    assert get.kind == SpanKind.INTERNAL and len(get.links) == 0
    assert get.attributes["timerwheel.shard"] == by_name["enqueue-put"].attributes["timerwheel.shard"]  # type: ignore[index]
    for s in (send, by_name[f"process {timer_topic}"], by_name["send orders"]):
        assert s.attributes is not None and s.attributes["messaging.system"] == "kafka"
    assert by_name[f"process {timer_topic}"].attributes["messaging.consumer.group.name"] == "timerwheel"  # type: ignore[index]

    put = by_name["send orders"]
    assert put.kind == SpanKind.PRODUCER
    assert put.attributes is not None and put.attributes["messaging.destination.name"] == "orders"
    link = next(li for li in put.links if li.context.span_id == send.context.span_id)  # type: ignore[union-attr]
    assert link.attributes is not None
    assert link.attributes["messaging.message.id"] == t["normal"].message_id
    assert link.attributes["timerwheel.lateness_ms"] >= 0  # type: ignore[operator]
    assert link.attributes["timerwheel.deliver_at"] == t["normal"].deliver_at_ms

    # The delivered record continues the trace from dequeue-put's span.
    (record,) = delivered[t["normal"].message_id]
    version, trace_id, span_id, _flags = header(record, "traceparent").split("-")
    assert (int(trace_id, 16), int(span_id, 16)) == _key(put)

    # The rolled message: each roll hop's dequeue-put span is linked to the one before.
    (rolled_record,) = delivered[t["rolled"].message_id]
    hops = int(header(rolled_record, "tw-roll"))
    assert hops >= 1
    rolled_trace = joined(send_span_of(done, t["rolled"].message_id), done)
    puts = [s for s in rolled_trace if s.name in ("send orders", f"send {timer_topic}") and s.kind == SpanKind.PRODUCER
            and s.attributes is not None and s.attributes.get("messaging.operation.type") == "send"
            and "messaging.batch.message_count" in s.attributes]
    assert len(puts) >= hops + 1
    # ... through the hop record: its traceparent is the roll's span, which the next hop's
    # enqueue-put links (so one trace runs through the pods, where no span is shared in memory).
    rolls = [s for s in puts if s.name == f"send {timer_topic}"]
    enqueue_links = {li.context.span_id for s in done if s.name == "enqueue-put" for li in s.links}  # type: ignore[union-attr]
    assert len(rolls) == hops and all(r.context.span_id in enqueue_links for r in rolls)  # type: ignore[union-attr]
    _, r_trace, r_span, _ = header(rolled_record, "traceparent").split("-")
    assert (int(r_trace, 16), int(r_span, 16)) in {_key(s) for s in puts}


def test_cancelled_and_dead_lettered_messages_end_their_traces(
        tw: EmbeddedTimerwheel, clock: SimulatedClock, spans: InMemorySpanExporter) -> None:
    t = run_scenario(tw, clock)
    done = list(spans.get_finished_spans())

    send = send_span_of(done, t["cancelled"].message_id)
    ends = [s for s in done if s.parent is not None and s.parent.span_id == send.context.span_id]  # type: ignore[union-attr]
    assert [e.name for s in ends for e in s.events] == ["cancelled"]
    assert all(s.context.trace_id == send.context.trace_id for s in ends)  # type: ignore[union-attr]

    bad = send_span_of(done, t["invalid"].message_id)
    errors = [s for s in done if s.parent is not None and s.parent.span_id == bad.context.span_id]  # type: ignore[union-attr]
    assert len(errors) == 1
    (err,) = errors
    assert err.status.status_code == StatusCode.ERROR
    assert err.attributes is not None and err.attributes["error.type"] == "InvalidTimerMessage"
    (event,) = err.events
    assert event.name == "exception"
    assert "timer topic" in str(event.attributes["exception.message"])  # type: ignore[index]
    assert len(tw.read(tw.config.dlq_topic)) == 1


def test_a_cancel_is_a_producer_span_whose_context_rides_the_cancel_record(
        tw: EmbeddedTimerwheel, clock: SimulatedClock, spans: InMemorySpanExporter) -> None:
    t = run_scenario(tw, clock)
    done = list(spans.get_finished_spans())
    timer_topic = tw.config.timer_topic
    target = t["cancelled"]

    cancel = send_span_of(done, target.message_id, cancel=True)
    assert cancel.name == f"send {timer_topic}"
    assert cancel.attributes is not None and "timerwheel.topic" not in cancel.attributes
    assert cancel.attributes["messaging.destination.partition.id"] == str(target.partition)
    assert cancel.attributes["messaging.system"] == "kafka"
    assert _key(cancel)[0] != _key(send_span_of(done, target.message_id))[0]  # no current span: a trace of its own

    (record,) = [r for r in tw.read(timer_topic) if r.header("tw-cancel") == target.message_id.encode()]
    _version, trace_id, span_id, _flags = header(record, "traceparent").split("-")
    assert (int(trace_id, 16), int(span_id, 16)) == _key(cancel)
    # The enqueue side links it like any timer record; it ends in the target's `cancelled` span.
    linking = {s.name: s for s in done if any(li.context.span_id == cancel.context.span_id  # type: ignore[union-attr]
                                                 for li in s.links)}
    assert set(linking) == {f"process {timer_topic}", "enqueue-put"}
    (link,) = [li for li in linking["enqueue-put"].links if li.context.span_id == cancel.context.span_id]  # type: ignore[union-attr]
    assert link.attributes is not None and link.attributes["timerwheel.cancel"] is True


def test_tracestate_rides_the_put_queue_into_the_enqueue_put_links(
        tw: EmbeddedTimerwheel, clock: SimulatedClock, spans: InMemorySpanExporter) -> None:
    state = TraceState([("vendor", "v1"), ("team", "orders")])
    caller = NonRecordingSpan(SpanContext(0x1234_5678_9ABC_DEF0_1234_5678_9ABC_DEF0, 0x1234_5678_9ABC_DEF0,
                                          is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED),
                                          trace_state=state))
    with trace.use_span(caller):
        ticket = tw.schedule("orders", b"v", delay_ms=1_000)
    step_through(tw, clock, [ticket.deliver_at_ms], ticket.deliver_at_ms + 500)
    done = list(spans.get_finished_spans())

    send = send_span_of(done, ticket.message_id)
    assert send.parent is not None and send.parent.span_id == caller.get_span_context().span_id
    (timer_record,) = [r for r in tw.read(tw.config.timer_topic) if r.header("tw-id") == ticket.message_id.encode()]
    assert header(timer_record, "tracestate") == "vendor=v1,team=orders"
    put = next(s for s in done if s.name == "enqueue-put")
    (link,) = [li for li in put.links if li.context.span_id == send.context.span_id]  # type: ignore[union-attr]
    assert link.context.trace_state == state
    assert link.context.trace_id == caller.get_span_context().trace_id


def test_metrics_are_exported_over_otlp_with_the_counts_of_a_run(
        tw: EmbeddedTimerwheel, clock: SimulatedClock, monkeypatch: pytest.MonkeyPatch) -> None:
    normal = [tw.schedule("orders", b"n", delay_ms=1_000 + 100 * i) for i in range(4)]
    doomed = [tw.schedule("orders", b"c", delay_ms=2_000 + 100 * i) for i in range(2)]
    tw.schedule(tw.config.timer_topic, b"x", delay_ms=1_000)  # dead-lettered
    tw.wait_idle()
    for ticket in doomed:
        tw.cancel(ticket)
    due = [x.deliver_at_ms for x in normal + doomed]
    step_through(tw, clock, due, max(due) + 1_000)
    assert len(tw.read("orders")) == 4
    tw.sample_gauges()

    receiver = OtlpReceiver().start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    provider = telemetry.export_metrics(tw.metrics, env={})
    try:
        assert provider.force_flush(10_000)
    finally:
        provider.shutdown()
        receiver.close()
    assert receiver.bad_requests == []

    def points(name: str) -> dict[tuple[tuple[str, Any], ...], Any]:
        found = receiver.metric(f"timerwheel.{name}")
        assert found, f"timerwheel.{name} not exported; got {len(receiver.metric_requests)} requests"
        return {tuple(sorted(attrs.items())): value for attrs, value, _facts in found}

    assert points("scheduled") == {(("topic", "orders"),): 6}
    assert points("delivered") == {(("topic", "orders"),): 4}
    assert points("cancelled") == {(("topic", "orders"),): 2}
    assert points("dead_lettered") == {(("topic", "other"),): 1}  # the timer topic is no destination
    assert points("cancel_requests") == {(): 2}
    assert points("delivery_lateness_ms.count") == {(): 4}
    (_attrs, _value, facts), *_ = receiver.metric("timerwheel.delivered")
    assert facts["type"] == "sum" and facts["monotonic"] is True
    assert facts["resource"]["service.name"] == "timerwheel"
    # Gauges go as gauges: nothing is left in the wheels.
    pending = receiver.metric("timerwheel.pending")
    assert pending and {v for _a, v, _f in pending} == {0}
    assert {f["type"] for _a, _v, f in pending} == {"gauge"}


def test_every_counter_of_metrics_reaches_the_otlp_receiver(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each declared counter (the families /metrics shows: tests/test_metrics.py checks that the
    code records no other) arrives over OTLP with its value and labels; so does each gauge."""
    m = Metrics()
    for i, name in enumerate(COUNTERS, 1):
        m.inc(name, i, topic="orders")
    for i, name in enumerate(GAUGES, 1):
        m.set(name, 1000 + i, shard=3)
    shown = {f.name for f in text_string_to_metric_families(render(m))}
    assert shown == {f"timerwheel_{n}" for n in [*COUNTERS, *GAUGES]}
    receiver = OtlpReceiver().start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    provider = telemetry.export_metrics(m, env={})
    try:
        assert provider.force_flush(10_000)
    finally:
        provider.shutdown()
        receiver.close()
    missing = []
    for i, name in enumerate(COUNTERS, 1):
        got = receiver.metric(f"timerwheel.{name}")
        if [(attrs, value, facts["type"], facts["monotonic"]) for attrs, value, facts in got] != \
                [({"topic": "orders"}, i, "sum", True)]:
            missing.append((name, got))
    for i, name in enumerate(GAUGES, 1):
        got = receiver.metric(f"timerwheel.{name}")
        if [(attrs, value, facts["type"]) for attrs, value, facts in got] != [({"shard": "3"}, 1000 + i, "gauge")]:
            missing.append((name, got))
    assert missing == [], f"not exported as recorded: {missing}"


def test_tracing_off_records_no_spans(clock: SimulatedClock, tmp_path: Path) -> None:
    """The same scenario with the exporter's provider in use records spans; after ``use(None)``,
    none (so the check below is against an exporter that would see them)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.use(provider)
    try:
        with EmbeddedTimerwheel(tmp_path / "on", clock=clock, tick_ms=100, roll_window_ms=ROLL_WINDOW_MS,
                                fsync=False) as tw:
            run_scenario(tw, clock)
        assert exporter.get_finished_spans(), "tracing on: the exporter sees the stages' spans"
        exporter.clear()
    finally:
        telemetry.use(None)
    assert telemetry.tracer() is None and telemetry.batch_start() is None
    with EmbeddedTimerwheel(tmp_path / "off", clock=clock, tick_ms=100, roll_window_ms=ROLL_WINDOW_MS,
                            fsync=False) as tw:
        run_scenario(tw, clock)
        assert exporter.get_finished_spans() == ()
        assert all(r.header("traceparent") is None for r in tw.read("orders"))


def test_tracing_is_configured_by_the_otel_variables() -> None:
    assert not telemetry.tracing_requested({})
    assert telemetry.tracing_requested({"OTEL_TRACES_EXPORTER": "otlp"})
    assert not telemetry.tracing_requested({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"})
    assert telemetry.tracing_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert telemetry.metrics_requested({"OTEL_METRICS_EXPORTER": "otlp"})
    assert not telemetry.configure_from_env(env={})


def test_every_counter_equals_the_truth_and_metrics_renders_it(
        tw: EmbeddedTimerwheel, clock: SimulatedClock) -> None:
    normal = [tw.schedule("orders", b"n", delay_ms=1_000 + 100 * i) for i in range(5)]
    rolled = [tw.schedule("orders", b"r", delay_ms=25_000 + 100 * i) for i in range(2)]
    doomed = [tw.schedule("orders", b"c", delay_ms=3_000 + 100 * i) for i in range(3)]
    for _ in range(2):
        tw.schedule(tw.config.timer_topic, b"x", delay_ms=1_000)
    tw.wait_idle()
    for ticket in doomed:
        tw.cancel(ticket)
    tw.wait_idle()
    tw.sample_gauges()
    m = tw.metrics
    # 10 messages and 3 cancel markers wait in the wheels. Between stages only the deliver entry
    # dequeue-put holds: the first message, due 1 s ahead, was read ahead (TW_LOOKAHEAD_MS, 1 s).
    assert sum(m.gauges["pending"].values()) == 13
    assert {k: v for k, v in m.gauges["queue_depth"].items() if v} == {(("partition", "0"), ("queue", "deliver")): 1}

    due = [x.deliver_at_ms for x in normal + rolled + doomed]
    step_through(tw, clock, due, max(due) + 1_000)
    delivered = tw.read("orders")
    hops = sum(int(header(r, "tw-roll")) for r in delivered)
    assert len(delivered) == 7 and hops >= 2
    tw.sample_gauges()
    assert sum(m.gauges["pending"].values()) == 0

    assert m.counter("scheduled", topic="orders") == 10
    assert m.counter("cancel_requests") == 3
    assert m.counter("delivered", topic="orders") == 7
    assert m.counter("cancelled", topic="orders") == 3
    assert m.counter("rolled", topic="orders") == hops
    assert m.counter("dead_lettered", topic="other") == 2  # the timer topic: no destination, no label of its own
    assert m.counter("dead_lettered") == 2
    assert m.histograms["delivery_lateness_ms"][()].count == 7

    server = HealthServer(0, m, live=lambda: True, ready=lambda: True, host="127.0.0.1").start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        server.close()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    expected = {
        ("timerwheel_scheduled_total", (("topic", "orders"),)): 10,
        ("timerwheel_delivered_total", (("topic", "orders"),)): 7,
        ("timerwheel_cancelled_total", (("topic", "orders"),)): 3,
        ("timerwheel_rolled_total", (("topic", "orders"),)): hops,
        ("timerwheel_dead_lettered_total", (("topic", "other"),)): 2,
        ("timerwheel_cancel_requests_total", ()): 3,
        ("timerwheel_delivery_lateness_ms_count", ()): 7,
        ("timerwheel_pending", (("shard", "0"),)): 0,
        ("timerwheel_queue_depth", (("partition", "0"), ("queue", "put"))): 0,
    }
    for key, value in expected.items():
        assert samples.get(key) == value, f"{key} is {samples.get(key)} in /metrics, not {value}:\n{text}"
