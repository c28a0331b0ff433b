"""Five stage processes on real Kafka and Redis export their spans over OTLP/http; each message
is one joined trace from the producer's send to the consumer of the delivered record.

The stages export to a receiver inside the test (``tests/otlp_receiver.py``). The producer
side is TimerClient over Kafka with a tracer of the test (each message sent under a caller's
span of its own trace, with a ``tracestate``); a consumer in the test continues each
delivered record's trace with a ``process`` span. Per message the
test follows the trace hop by hop, as a trace viewer would:

    send (client) <- process (enqueue-get) <- enqueue-put <- receive (dequeue-getmsg) -> dequeue-get
                  <- send <topic> (dequeue-put) <- parent of: process (consumer)

(``<-`` a link to the send span, ``->`` receive's link to dequeue-get's span of the slot.)
A cancelled message ends with a ``cancelled`` event, a dead-lettered one with an ERROR span.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from harness import Collector, Pipeline
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from otlp_receiver import OtlpReceiver, SpanRec, joined
from timerwheel import TimerClient, TimerConfig, telemetry
from timerwheel.transports.kafka.log import KafkaCommitLog
from timerwheel.wire import Ticket

pytestmark = pytest.mark.e2e

SHARDS = 2
TICK_MS = 100
SAMPLE = 6


def caller_span(i: int) -> NonRecordingSpan:
    """The application's span the message is sent under (remote: its trace starts upstream)."""
    rng = random.Random(i)
    return NonRecordingSpan(SpanContext(rng.getrandbits(128), rng.getrandbits(64), is_remote=True,
                                        trace_flags=TraceFlags(TraceFlags.SAMPLED),
                                        trace_state=TraceState([("e2e", f"m{i}")])))


def one(spans: list[SpanRec], what: str) -> SpanRec | str:
    """The single span of ``spans``, or a line saying what is missing (or doubled)."""
    if len(spans) == 1:
        return spans[0]
    return f"{what}: {len(spans)} spans {[s.name for s in spans]}"


def expect(problems: list[str], what: str, got: Any, wanted: Any) -> None:
    if got != wanted:
        problems.append(f"{what}: {got!r}, wanted {wanted!r}")


def message_trace(t: Ticket, send: SpanRec, delivered_tp: str, consumer: SpanRec,
                  spans: list[SpanRec], timer_topic: str, dest: str) -> list[str]:
    """What is missing or wrong in the trace of the delivered message ``t`` (empty: all there)."""
    p: list[str] = []
    mid = t.message_id
    shard = t.partition % SHARDS
    linking = [s for s in spans if s.links_to(send.trace_id, send.span_id)]

    got = one([s for s in linking if s.resource.get("timerwheel.stage") == "enqueue-get"], f"{mid} enqueue-get")
    if isinstance(got, str):
        p.append(got)
    else:
        expect(p, f"{mid} enqueue-get name/kind", (got.name, got.kind), (f"process {timer_topic}", "CONSUMER"))
        for key, value in {"messaging.system": "kafka", "messaging.destination.name": timer_topic,
                           "messaging.consumer.group.name": "timerwheel"}.items():
            expect(p, f"{mid} enqueue-get {key}", got.attributes.get(key), value)
        (link,) = got.links_to(send.trace_id, send.span_id)
        expect(p, f"{mid} enqueue-get link id", link.attributes.get("messaging.message.id"), mid)
        expect(p, f"{mid} enqueue-get link partition", link.attributes.get("messaging.destination.partition.id"),
               str(t.partition))

    put = one([s for s in linking if s.resource.get("timerwheel.stage") == "enqueue-put"], f"{mid} enqueue-put")
    if isinstance(put, str):
        p.append(put)
    else:
        expect(p, f"{mid} enqueue-put name/kind", (put.name, put.kind), ("enqueue-put", "INTERNAL"))
        expect(p, f"{mid} enqueue-put shard", put.attributes.get("timerwheel.shard"), shard)
        (link,) = put.links_to(send.trace_id, send.span_id)
        expect(p, f"{mid} enqueue-put link deliver_at", link.attributes.get("timerwheel.deliver_at"), t.deliver_at_ms)
        # Not checked here: the link's tracestate (the put entry's). Python's OTLP exporter (1.45)
        # leaves Link.trace_state out of what it sends; tests/test_telemetry.py checks it in process.

    slot_time = t.deliver_at_ms - t.deliver_at_ms % TICK_MS
    receive = one([s for s in linking if s.resource.get("timerwheel.stage") == "dequeue-getmsg"],
                  f"{mid} dequeue-getmsg")
    if isinstance(receive, str):
        p.append(receive)
    else:
        expect(p, f"{mid} receive name/kind", (receive.name, receive.kind), (f"receive {timer_topic}", "CLIENT"))
        expect(p, f"{mid} receive messaging.system", receive.attributes.get("messaging.system"), "kafka")
        (link,) = receive.links_to(send.trace_id, send.span_id)
        expect(p, f"{mid} receive link slot_time", link.attributes.get("timerwheel.slot_time"), slot_time)
        gets = {(s.trace_id, s.span_id): s for s in spans if s.resource.get("timerwheel.stage") == "dequeue-get"}
        get = one([gets[(li.trace_id, li.span_id)] for li in receive.links if (li.trace_id, li.span_id) in gets
                   and gets[(li.trace_id, li.span_id)].attributes.get("timerwheel.slot_time") == slot_time
                   and gets[(li.trace_id, li.span_id)].attributes.get("timerwheel.shard") == shard],
                  f"{mid} dequeue-get span of shard {shard}, slot {slot_time} linked from receive")
        if isinstance(get, str):
            p.append(get)
        else:
            expect(p, f"{mid} dequeue-get name/kind/links", (get.name, get.kind, get.links),
                   ("dequeue-get", "INTERNAL", ()))
            expect(p, f"{mid} dequeue-get shard", get.attributes.get("timerwheel.shard"), shard)
            lateness = get.attributes.get("timerwheel.lateness_ms")
            if not isinstance(lateness, int) or not 0 <= lateness < 10_000:
                p.append(f"{mid} dequeue-get lateness {lateness!r}")

    _version, trace_hex, span_hex, _flags = delivered_tp.split("-")
    by_id = {(s.trace_id, s.span_id): s for s in spans}
    deliver = by_id.get((int(trace_hex, 16), int(span_hex, 16)))
    if deliver is None:
        p.append(f"{mid}: no span {delivered_tp} (the delivered record's traceparent) received")
    else:
        # A batch that sends to one topic is named after it; one that also rolls records back
        # to the timer topic (or delivers to several topics) is plain `send`, without a destination.
        one_topic = deliver.name != "send"
        expect(p, f"{mid} dequeue-put name/kind/stage", (deliver.name, deliver.kind, deliver.resource.get("timerwheel.stage")),
               (f"send {dest}" if one_topic else "send", "PRODUCER", "dequeue-put"))
        expect(p, f"{mid} dequeue-put destination", deliver.attributes.get("messaging.destination.name"),
               dest if one_topic else None)
        links = deliver.links_to(send.trace_id, send.span_id)
        if len(links) != 1:
            p.append(f"{mid} dequeue-put span links the send span {len(links)} times")
        else:
            a = links[0].attributes
            expect(p, f"{mid} dequeue-put link id", a.get("messaging.message.id"), mid)
            expect(p, f"{mid} dequeue-put link deliver_at", a.get("timerwheel.deliver_at"), t.deliver_at_ms)
            expect(p, f"{mid} dequeue-put link shard/slot", (a.get("timerwheel.shard"), a.get("timerwheel.slot_time")),
                   (shard, slot_time))
            lateness = a.get("timerwheel.lateness_ms")
            if not isinstance(lateness, int) or not 0 <= lateness < 10_000:
                p.append(f"{mid} dequeue-put link lateness {lateness!r}")
        expect(p, f"{mid} consumer's parent", (consumer.trace_id, consumer.parent_span_id),
               (deliver.trace_id, deliver.span_id))

    if not p:  # everything is there: it is one trace
        names = {(s.name, s.resource.get("timerwheel.stage")) for s in joined(send, [*spans, send, consumer])}
        wanted = {(f"send {timer_topic}", None), (f"process {timer_topic}", "enqueue-get"), ("enqueue-put", "enqueue-put"),
                  ("dequeue-get", "dequeue-get"), (f"receive {timer_topic}", "dequeue-getmsg"),
                  (deliver.name if deliver else "", "dequeue-put"), (f"process {dest}", None)}
        if not wanted <= names:
            p.append(f"{mid}: the joined trace lacks {wanted - names}")
    return p


def test_each_message_is_one_trace_across_the_five_stage_processes(
    tmp_path: Any, kafka_bootstrap: str, redis_url: str
) -> None:
    receiver = OtlpReceiver().start()
    app_spans = InMemorySpanExporter()
    app = TracerProvider(resource=Resource.create({"service.name": "e2e-app"}))
    app.add_span_processor(SimpleSpanProcessor(app_spans))
    pipe = Pipeline(tmp_path, kafka_bootstrap, redis_url, shards=SHARDS, tick_ms=TICK_MS)
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER",
                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_COMPRESSION"):
        pipe.env.pop(name, None)
    pipe.env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"})
    dest = pipe.new_dest("traced", 2)
    log = collector = None
    telemetry.use(app)
    try:
        pipe.start_all()
        log = KafkaCommitLog(kafka_bootstrap, client_id=f"e2e-client-{pipe.uid}")
        client = TimerClient(log, TimerConfig(timer_topic=pipe.timer_topic, timer_partitions=4, shards=SHARDS))
        collector = Collector(pipe, [dest])
        tickets: list[Ticket] = []
        for i in range(SAMPLE):
            with trace.use_span(caller_span(i)):
                tickets.append(client.schedule(dest, f"v{i}".encode(), delay_ms=2_500 + 150 * i))
        doomed = client.schedule(dest, b"doomed", delay_ms=3_500)
        client.cancel(doomed)
        denied = client.schedule("secret", b"denied", delay_ms=1_000)  # not on the allow-list

        missing = collector.wait_for([t.message_id for t in tickets], 30, pipe)
        assert not missing, f"not delivered: {missing}\n{pipe.tails()}"
        # The consumer continues each delivered record's trace.
        consumer_tracer = app.get_tracer("e2e-consumer")
        delivered_tp: dict[str, str] = {}
        for t in tickets:
            (d,) = collector.by_id[t.message_id]
            delivered_tp[t.message_id] = d.headers["traceparent"].decode()
            parent = TraceContextTextMapPropagator().extract({"traceparent": delivered_tp[t.message_id]})
            consumer_tracer.start_span(f"process {dest}", context=parent, kind=SpanKind.CONSUMER, attributes={
                "messaging.system": "kafka", "messaging.destination.name": dest,
                "messaging.message.id": t.message_id}).end()
        mine = [SpanRec.of(s) for s in app_spans.get_finished_spans()]

        def sent(message_id: str, cancel: bool = False) -> SpanRec:
            (s,) = [s for s in mine if s.kind == "PRODUCER" and s.attributes.get("messaging.message.id") == message_id
                    and bool(s.attributes.get("timerwheel.cancel")) == cancel]
            return s

        consumers = {s.attributes["messaging.message.id"]: s for s in mine if s.name == f"process {dest}"}

        def problems() -> list[str]:
            spans = receiver.spans()
            out: list[str] = []
            for t in tickets:
                out += message_trace(t, sent(t.message_id), delivered_tp[t.message_id], consumers[t.message_id],
                                     spans, pipe.timer_topic, dest)
            # The cancelled message: its trace ends in a child span with the event `cancelled`, and
            # the cancel's own send span is linked on the enqueue side.
            d_send, c_send = sent(doomed.message_id), sent(doomed.message_id, cancel=True)
            ends = [s for s in spans if (s.trace_id, s.parent_span_id) == (d_send.trace_id, d_send.span_id)]
            end = one(ends, "cancelled outcome span")
            if isinstance(end, str):
                out.append(end)
            else:
                expect(out, "cancelled outcome", (end.name, end.resource.get("timerwheel.stage"), end.events),
                       ("dequeue-put", "dequeue-put", (("cancelled", {"messaging.message.id": doomed.message_id}),)))
            expect(out, "stages linking the cancel",
                   sorted(str(s.resource.get("timerwheel.stage")) for s in spans if s.links_to(c_send.trace_id, c_send.span_id)),
                   ["enqueue-get", "enqueue-put"])
            expect(out, "stages linking the cancelled message",
                   sorted(str(s.resource.get("timerwheel.stage")) for s in spans if s.links_to(d_send.trace_id, d_send.span_id)),
                   ["dequeue-getmsg", "enqueue-get", "enqueue-put"])
            # The dead-lettered message: an ERROR span, child of its send span.
            b_send = sent(denied.message_id)
            err = one([s for s in spans if (s.trace_id, s.parent_span_id) == (b_send.trace_id, b_send.span_id)],
                      "dead-letter span")
            if isinstance(err, str):
                out.append(err)
            else:
                expect(out, "dead-letter span", (err.name, err.kind, err.status, err.resource.get("timerwheel.stage")),
                       ("enqueue-get dead-letter", "INTERNAL", "ERROR", "enqueue-get"))
                expect(out, "dead-letter error.type", err.attributes.get("error.type"), "InvalidTimerMessage")
                expect(out, "dead-letter destination", err.attributes.get("messaging.destination.name"), pipe.dlq_topic)
                reasons = [str(a.get("exception.message")) for name, a in err.events if name == "exception"]
                if not (len(reasons) == 1 and "not allowed by allow_topics" in reasons[0]):
                    out.append(f"dead-letter exception events {err.events}")
            expect(out, "service.name of the stages", {s.resource.get("service.name") for s in spans}, {"timerwheel"})
            return out

        receiver.wait(lambda: not problems(), 30)
        found = problems()
        assert not found, "\n".join(found) + f"\n{len(receiver.spans())} spans received\n{pipe.tails()}"
        assert receiver.bad_requests == []
        assert doomed.message_id not in collector.by_id
    finally:
        telemetry.use(None)
        if collector is not None:
            collector.close()
        if log is not None:
            log.close()
        codes = pipe.stop_all()  # before the receiver closes: the stages flush their spans on exit
        receiver.close()
        app.shutdown()
    assert all(code == 0 for code in codes.values()), f"exit codes {codes}\n{pipe.tails()}"
