"""Another producer's transaction held open on a timer partition holds W (issue 30): W waits
for the partition's high watermark, not its last stable offset, so a plain cancel acknowledged
after the transaction began still meets its target, however long the transaction stays open.

The five stages run in this process (the embedded runtime) over the session's real Kafka, on the
system clock: a message due 2 s after it is scheduled, a cancel sent behind the open transaction.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from kafka import KafkaProducer
from timerwheel import EmbeddedTimerwheel, SystemClock, TimerConfig
from timerwheel.records import Record
from timerwheel.runtime.wiring import QUEUES, Transports
from timerwheel.transports.kafka.log import KafkaCommitLog
from timerwheel.transports.memory import MemoryLeaseStore, MemoryWorkQueue


def _until(what: str, ok: Callable[[], bool], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.02)


@pytest.mark.parametrize("ending", ["abort", "commit"])
def test_a_plain_cancel_behind_an_open_transaction_wins(tmp_path: Path, kafka_bootstrap: str, ending: str) -> None:
    uid = uuid.uuid4().hex[:8]
    cfg = TimerConfig(data_dir=str(tmp_path / "data"), timer_topic=f"tw-opentx-{uid}", dlq_topic=f"tw-opentx-{uid}-dlq",
                      timer_partitions=1, shards=1, fsync=False)
    dest = f"tw-opentx-dest-{uid}"
    log = KafkaCommitLog(kafka_bootstrap)
    log.ensure_topic(dest, 1)
    transports = Transports(log, {name: MemoryWorkQueue(name, cfg.shards, cfg.queue_bound) for name in QUEUES},
                            MemoryLeaseStore(SystemClock()))
    other = KafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=f"tw-opentx-{uid}", acks="all")
    delivered: list[Record] = []
    consumer = log.consumer(dest, {0: 0})
    try:
        with EmbeddedTimerwheel(config=cfg, transports=transports) as tw:
            due = int(time.time() * 1000) + 2_000
            kept = tw.schedule(dest, b"kept", deliver_at_ms=due)
            doomed = tw.schedule(dest, b"doomed", deliver_at_ms=due)
            other.init_transactions()
            other.begin_transaction()
            # A timer record of its own (due later), sent and flushed: the partition's last stable
            # offset stops below it until the transaction ends.
            other.send(cfg.timer_topic, b"later", partition=0,
                       headers=[("tw-topic", dest.encode()), ("tw-deliver-at", str(due + 60_000).encode())])
            other.flush()
            tw.cancel(doomed)  # plain, acknowledged before it is due: behind the open transaction
            _until("the due time to pass by a second", lambda: time.time() * 1000 >= due + 1_000)
            written = tw.metrics.gauge("write_ms", shard=0)
            assert written < due, f"W passed the due time ({written - due} ms) while a cancel was unread"
            assert tw.metrics.gauge("input_wait_ms", shard=0) > 0
            delivered += consumer.poll(100, 0.2)
            assert delivered == []
            (other.abort_transaction if ending == "abort" else other.commit_transaction)()
            _until("a delivery", lambda: bool(delivered.extend(consumer.poll(100, 0.2)) or delivered))
            _until("the cancel", lambda: tw.metrics.counter("cancelled", topic=dest) == 1)
            delivered += consumer.poll(100, 0.5)
            assert [r.value for r in delivered] == [b"kept"], "the cancel behind the transaction missed"
            assert delivered[0].header("tw-id") == kept.message_id.encode()
            assert tw.metrics.gauge("write_ms", shard=0) >= due  # and W moved on past the transaction's end
    finally:
        consumer.close()
        other.close(timeout=5)
        log.close()
