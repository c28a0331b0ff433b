"""RetryConsumer over the embedded timerwheel and its local log, on a simulated clock."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from timerwheel import ConfigError, Delivery, RetryConsumer, SimulatedClock, TimerwheelError
from timerwheel.records import Headers, OutRecord
from timerwheel.retry import BatchResult
from timerwheel.runtime.embedded import EmbeddedTimerwheel
from timerwheel.transports.local.log import LocalCommitLog

START = 1_700_000_000_000
TICK = 100
DAY = 86_400_000


@pytest.fixture
def tw(tmp_path: Path) -> Iterator[EmbeddedTimerwheel]:
    """The embedded timerwheel on a simulated clock, with a topic "orders" of two partitions."""
    with EmbeddedTimerwheel(tmp_path / "data", clock=SimulatedClock(start_ms=START), tick_ms=TICK,
                            roll_window_ms=DAY, fsync=False) as tw:
        tw.commit_log.ensure_topic("orders", 2)
        yield tw


@pytest.fixture
def clock(tw: EmbeddedTimerwheel) -> SimulatedClock:
    assert isinstance(tw.clock, SimulatedClock)
    return tw.clock


@pytest.fixture
def consumers(tw: EmbeddedTimerwheel, clock: SimulatedClock) -> Iterator[Callable[..., RetryConsumer]]:
    """RetryConsumers on the embedded timerwheel's log, closed at the end."""
    opened: list[RetryConsumer] = []

    def make(group: str, handler: Callable[[Delivery], object], **options: Any) -> RetryConsumer:
        options.setdefault("config", tw.config)
        consumer = RetryConsumer(options.pop("log", tw.commit_log), group, ["orders"], handler, clock=clock,
                                 **options)
        opened.append(consumer)
        return consumer

    yield make
    for c in opened:
        c.close()


def level_ms(tw: EmbeddedTimerwheel, level: int) -> int:
    return tw.config.delay_levels_ms[level - 1]


def send(tw: EmbeddedTimerwheel, n: int) -> None:
    """``n`` records to partition 0 of "orders": the offsets go on from the last one's."""
    tw.commit_log.append([OutRecord("orders", f"k{i}".encode(), f"v{i}".encode(), partition=0) for i in range(n)])


def at(tw: EmbeddedTimerwheel, clock: SimulatedClock, when_ms: int) -> None:
    """Move the clock to ``when_ms`` and let the pipeline deliver what is due."""
    tw.wait_idle()
    clock.set(when_ms)
    tw.wait_idle()


def drain(consumer: RetryConsumer) -> int:
    """Poll until a poll finds nothing (what is due has been delivered); the records handled."""
    total = 0
    while (got := consumer.poll_once(0.05)).records:
        assert got.committed
        total += got.records
    return total


def test_a_record_failing_twice_comes_back_at_levels_3_and_4_then_succeeds(
    tw: EmbeddedTimerwheel, clock: SimulatedClock, consumers: Callable[..., RetryConsumer]
) -> None:
    calls: list[tuple[int, Delivery]] = []

    def handler(d: Delivery) -> None:
        calls.append((clock.now_ms(), d))
        if len(calls) <= 2:
            raise ConnectionError("downstream away")

    consumer = consumers("billing", handler)
    tw.commit_log.append([OutRecord("orders", b"k", b"v", (("trace", b"t1"),), partition=1)])
    assert consumer.poll_once(0.5) == BatchResult(records=1, succeeded=0, retried=1, dead_lettered=0, committed=True)
    failed_at = clock.now_ms()
    for n, level in ((1, 3), (2, 4)):
        due = failed_at + level_ms(tw, level)
        at(tw, clock, due - TICK)
        assert drain(consumer) == 0, f"retry {n} came before its level-{level} delay"
        at(tw, clock, due + TICK)
        assert drain(consumer) == 1, f"retry {n} did not come at its level-{level} delay"
        when, d = calls[-1]
        assert level_ms(tw, level) <= d.timestamp_ms - failed_at <= level_ms(tw, level) + TICK
        assert (d.topic, d.reconsume_times, d.origin) == ("billing.retry", n, ("orders", 1, 0))
        assert (d.key, d.value, d.headers) == (b"k", b"v", (("trace", b"t1"),))
        failed_at = when
    assert len(calls) == 3
    at(tw, clock, clock.now_ms() + DAY)
    assert drain(consumer) == 0, "a record handled successfully came back"
    assert tw.read("billing.dlq") == []
    first = calls[0][1]
    assert (first.topic, first.partition, first.offset, first.reconsume_times) == ("orders", 1, 0, 0)


def test_a_record_failing_always_reaches_the_group_dlq_after_16_retries_with_the_count(
    tw: EmbeddedTimerwheel, clock: SimulatedClock, consumers: Callable[..., RetryConsumer]
) -> None:
    calls: list[Delivery] = []

    def handler(d: Delivery) -> None:
        calls.append(d)
        raise ValueError(f"cannot bill {d.value!r}")

    consumer = consumers("billing", handler)
    send(tw, 1)
    consumer.poll_once(0.5)
    # RocketMQ's table and rule: the n-th retry waits level 3 + n - 1 (10 s ... 2 h), 16 of them.
    for n in range(1, 17):
        due = clock.now_ms() + level_ms(tw, 2 + n)
        at(tw, clock, due - TICK)
        assert drain(consumer) == 0
        at(tw, clock, due + TICK)
        assert drain(consumer) == 1
        assert calls[-1].reconsume_times == n
    assert len(calls) == 17
    (dead,) = tw.read("billing.dlq")
    assert (dead.key, dead.value) == (b"k0", b"v0")
    assert dead.header("tw-reconsume-times") == b"16"
    assert dead.header("tw-error") == b"ValueError: cannot bill b'v0'"
    assert (dead.header("tw-origin-topic"), dead.header("tw-origin-offset")) == (b"orders", b"0")
    assert dead.header("tw-source") == f"billing.retry/{calls[-1].partition}/{calls[-1].offset}".encode()
    assert dead.header("tw-id") is None, "the DLQ record keeps no stamp of the last hop"
    at(tw, clock, clock.now_ms() + DAY)
    assert drain(consumer) == 0 and len(tw.read("billing.dlq")) == 1


def test_another_group_of_the_same_topic_never_sees_the_retries(
    tw: EmbeddedTimerwheel, clock: SimulatedClock, consumers: Callable[..., RetryConsumer]
) -> None:
    failing: list[Delivery] = []
    seen: list[Delivery] = []

    def fail(d: Delivery) -> None:
        failing.append(d)
        raise RuntimeError("no")

    billing = consumers("billing", fail, max_reconsume_times=2)
    audit = consumers("audit", seen.append)
    send(tw, 5)
    for _ in range(3):
        drain(billing)
        drain(audit)
        at(tw, clock, clock.now_ms() + level_ms(tw, 4) + TICK)
    drain(billing)
    drain(audit)
    assert len(failing) == 15 and len(tw.read("billing.dlq")) == 5
    assert [(d.topic, d.partition, d.offset, d.reconsume_times) for d in seen] == [("orders", 0, i, 0) for i in range(5)]
    assert tw.read("audit.retry") == [] and tw.read("audit.dlq") == []


def test_malformed_retry_headers_and_a_raising_handler_never_stop_the_consumer(
    tw: EmbeddedTimerwheel, clock: SimulatedClock, consumers: Callable[..., RetryConsumer]
) -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text")

    calls: list[Delivery] = []

    def handler(d: Delivery) -> None:
        calls.append(d)
        if d.reconsume_times == 0:
            raise Unprintable() if d.offset % 2 else KeyError(d.headers)

    consumer = consumers("billing", handler)
    bad: list[Headers] = [
        (("tw-reconsume-times", b"lots"),),
        (("tw-reconsume-times", b"-3"),),
        (("tw-reconsume-times", b"99999999999999999999999"),),
        (("tw-reconsume-times", b"1"), ("tw-origin-topic", b"orders")),  # partition and offset missing
        (("tw-reconsume-times", b"1"), ("tw-origin-topic", b"a/b"), ("tw-origin-partition", b"0"),
         ("tw-origin-offset", b"0")),
        (("tw-reconsume-times", b"\xff\xfe"), ("tw-origin-topic", b"\xff"), ("tw-origin-partition", b"x"),
         ("tw-origin-offset", b"")),
    ]
    tw.commit_log.append([OutRecord("billing.retry", None, None, h, partition=0) for h in bad])
    got = consumer.poll_once(0.5)
    assert (got.records, got.retried, got.committed) == (len(bad), len(bad), True)
    assert [d.reconsume_times for d in calls] == [0] * len(bad)
    assert [d.origin for d in calls] == [("billing.retry", 0, i) for i in range(len(bad))]
    # Each comes back once with sound headers and is then handled.
    at(tw, clock, clock.now_ms() + level_ms(tw, 3) + TICK)
    assert drain(consumer) == len(bad)
    assert sorted(d.origin for d in calls[len(bad):]) == [("billing.retry", 0, i) for i in range(len(bad))]
    assert {d.reconsume_times for d in calls[len(bad):]} == {1}
    send(tw, 1)
    assert drain(consumer) == 1 and calls[-1].topic == "orders"
    retried = [r for r in tw.read("billing.retry") if r.header("tw-id") is not None]
    assert len(retried) == len(bad)
    assert all(r.header("tw-origin-topic") == b"billing.retry" and r.header("tw-reconsume-times") == b"1"
               for r in retried)


class FlakyLog(LocalCommitLog):
    """The local log whose appends to the timer topic fail while ``failures`` > 0."""

    failures = 0

    def append(self, records: Any) -> list[tuple[int, int]]:
        if self.failures and any(r.topic == "__timer" for r in records):
            self.failures -= 1
            raise OSError("disk away")
        return super().append(records)


def test_a_batch_is_committed_only_once_its_retries_are_written(
    tw: EmbeddedTimerwheel, clock: SimulatedClock, consumers: Callable[..., RetryConsumer]
) -> None:
    handled: list[Delivery] = []

    def handler(d: Delivery) -> None:
        handled.append(d)
        if d.offset in (1, 3) and d.reconsume_times == 0:
            raise TimeoutError()

    log = FlakyLog(Path(tw.config.data_dir) / "log", fsync=False, clock=clock)
    first = consumers("billing", handler, log=log, batch_size=10)
    send(tw, 3)
    log.failures = 2
    got = first.poll_once(0.5)  # two failed writes, backed off, the third is durable: then the commit
    assert (got.records, got.retried, got.committed, log.failures) == (3, 1, True, 0)
    assert len([r for r in tw.read("__timer") if r.header("tw-topic") == b"billing.retry"]) == 1

    # A consumer stopped while its retry cannot be written commits nothing: its batch is read again.
    send(tw, 2)
    log.failures = 10**6
    first.stop()
    got = first.poll_once(0.5)
    assert (got.records, got.committed) == (2, False)
    first.close()
    log.failures = 0
    second = consumers("billing", handler, log=log)
    assert drain(second) == 2
    assert [(d.offset, d.reconsume_times) for d in handled] == [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (3, 0), (4, 0)]
    at(tw, clock, clock.now_ms() + level_ms(tw, 3) + TICK)
    assert drain(second) == 2
    assert sorted((d.origin, d.reconsume_times) for d in handled[7:]) == [(("orders", 0, 1), 1), (("orders", 0, 3), 1)]
    log.close()


def test_a_group_resumes_after_its_last_commit_and_has_one_member_on_the_local_log(
    tw: EmbeddedTimerwheel, consumers: Callable[..., RetryConsumer]
) -> None:
    seen: list[Delivery] = []
    first = consumers("billing", seen.append)
    send(tw, 3)
    assert drain(first) == 3
    with pytest.raises(TimerwheelError, match="has a member already"):
        consumers("billing", seen.append)
    first.close()
    send(tw, 2)
    second = consumers("billing", seen.append)
    assert drain(second) == 2 and len(seen) == 5


@pytest.mark.parametrize(("field", "kwargs"), [
    ("group", {"group": "bad group"}),
    ("topics", {"topics": []}),
    ("topics", {"topics": ["billing.retry"]}),
    ("max_reconsume_times", {"max_reconsume_times": -1}),
    ("batch_size", {"batch_size": 0}),
    ("dlq_topic", {"dlq_topic": "billing.retry"}),
    ("retry_topic", {"retry_topic": "__billing"}),
])
def test_a_bad_setting_is_refused_naming_it(tw: EmbeddedTimerwheel, field: str, kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = {"group": "billing", "topics": ["orders"], **kwargs}
    with pytest.raises(ConfigError) as err:
        RetryConsumer(tw.commit_log, args.pop("group"), args.pop("topics"), print, config=tw.config, **args)
    assert err.value.field == field
