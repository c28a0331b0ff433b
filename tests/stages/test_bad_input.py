"""Every invalid timer record goes to the DLQ with its reason; the pipeline keeps delivering."""

from __future__ import annotations

from collections.abc import Callable

from scenario import header, step_through
from timerwheel import SimulatedClock
from timerwheel.records import OutRecord
from timerwheel.runtime.embedded import EmbeddedTimerwheel

CASES = {
    "no-topic": ((("tw-delay-ms", b"5"),), "missing tw-topic"),
    "no-time": ((("tw-topic", b"t"),), "no delivery time"),
    "bad-time": ((("tw-topic", b"t"), ("tw-deliver-at", b"tomorrow")), "unparsable tw-deliver-at"),
    "negative": ((("tw-topic", b"t"), ("tw-delay-ms", b"-1")), "negative tw-delay-ms"),
    "overflow": ((("tw-topic", b"t"), ("tw-deliver-at", b"18446744073709551616")), "out of range"),
    "too-far": ((("tw-topic", b"t"), ("tw-delay-ms", str(401 * 86_400_000).encode())), "exceeds max_delay_ms"),
    "level": ((("tw-topic", b"t"), ("tw-delay-level", b"99")), "unknown tw-delay-level 99"),
    "internal": ((("tw-topic", b"__consumer_offsets"), ("tw-delay-ms", b"5")), "not allowed by allow_topics"),
    "denied": ((("tw-topic", b"secret"), ("tw-delay-ms", b"5")), "not allowed by allow_topics"),
    "loop": ((("tw-topic", b"__timer"), ("tw-delay-ms", b"5")), "destination is the timer topic"),
}


def test_each_bad_record_is_dead_lettered_with_its_reason(
    make_tw: Callable[..., EmbeddedTimerwheel], clock: SimulatedClock
) -> None:
    tw = make_tw(allow_topics=("t", "ok", "big"), max_record_bytes=4096)
    records = [OutRecord("__timer", name.encode(), b"payload", headers, partition=i % 4)
               for i, (name, (headers, _)) in enumerate(CASES.items())]
    records.append(OutRecord("__timer", b"oversized", b"x" * 8192, (("tw-topic", b"big"), ("tw-delay-ms", b"5"))))
    good = tw.schedule("ok", b"still delivered", delay_ms=500)
    tw.commit_log.append(records)
    later = tw.schedule("ok", b"after the bad ones", delay_ms=500)
    step_through(tw, clock, [good.deliver_at_ms, later.deliver_at_ms], clock.now_ms() + 2_000)

    dead = {r.key: r for r in tw.read("__timer_dlq")}
    assert len(dead) == len(CASES) + 1
    for name, (_headers, reason) in CASES.items():
        r = dead[name.encode()]
        assert reason in header(r, "tw-error"), (name, header(r, "tw-error"))
        assert r.value == b"payload"
        assert header(r, "tw-source").startswith("__timer/")
    assert "exceeds max_record_bytes 4096" in header(dead[b"oversized"], "tw-error")
    assert sorted(r.value for r in tw.read("ok")) == [b"after the bad ones", b"still delivered"]
    assert tw.metrics.counter("dead_lettered") == len(CASES) + 1


def test_out_of_range_destination_partition_is_dead_lettered_at_delivery(
    make_tw: Callable[..., EmbeddedTimerwheel], clock: SimulatedClock
) -> None:
    tw = make_tw()
    tw.commit_log.ensure_topic("p1", 1)
    bad = tw.schedule("p1", b"x", delay_ms=100, partition=5)
    ok = tw.schedule("p1", b"y", delay_ms=100, partition=0)
    step_through(tw, clock, [bad.deliver_at_ms, ok.deliver_at_ms], clock.now_ms() + 1_000)
    assert [r.value for r in tw.read("p1")] == [b"y"]
    (dead,) = tw.read("__timer_dlq")
    assert "tw-partition 5 out of range" in header(dead, "tw-error")
