"""A RetryConsumer process for e2e/test_retry_consumer.py, that can kill itself (SIGKILL) at a chosen point.

    python e2e/retry_worker.py GROUP TOPIC OUTCOMES BATCH MAX_RECONSUME CRASH

Configured by the pipeline's ``TW_*`` environment (Kafka, timer topic, delay levels). The handler
decides by the record's value ``m<i>``: it fails while ``reconsume_times < i % 4`` and otherwise
succeeds, appending ``<origin topic>/<partition>/<offset> <value> <reconsume_times>`` to OUTCOMES
(one ``write`` on an O_APPEND file: a line is whole or absent after a kill). With
MAX_RECONSUME = 2, ``i % 4 == 3`` ends in the DLQ.

CRASH is ``none`` (run until SIGTERM, exit 0) or ``<point>:<k>``, to SIGKILL itself the k-th time
this process reaches ``point``:

- ``handling``: in the handler, before it records its outcome;
- ``handled``: in the handler, after it recorded a success (handled, not yet committed);
- ``written``: right after a retry or dead-letter write was acknowledged, before the commit;
- ``commit``: right before a commit;
- ``committed``: right after a commit returned (nothing of the batch may be lost then).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from timerwheel import Delivery, KafkaCommitLog, RetryConsumer, TimerConfig
from timerwheel.log import configure_logging
from timerwheel.records import OutRecord
from timerwheel.transports.kafka.consumers import KafkaGroupConsumer


def main() -> int:
    group, topic, outcomes, batch, max_reconsume, crash = sys.argv[1:7]
    point, _, k = crash.partition(":")
    left = {point: int(k)} if k else {}

    def reach(here: str) -> None:
        if here in left:
            left[here] -= 1
            if left[here] == 0:
                os.kill(os.getpid(), signal.SIGKILL)

    class Log(KafkaCommitLog):
        def append(self, records: Sequence[OutRecord]) -> list[tuple[int, int]]:
            written = super().append(records)
            reach("written")
            return written

        def group_consumer(self, group: str, topics: Sequence[str],
                           options: Mapping[str, object] | None = None) -> KafkaGroupConsumer:
            inner = super().group_consumer(group, topics, options)
            commit = inner.commit

            def commit_then(offsets: Mapping[tuple[str, int], int]) -> None:
                reach("commit")
                commit(offsets)
                reach("committed")

            inner.commit = commit_then  # type: ignore[method-assign]
            return inner

    fd = os.open(outcomes, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def handle(d: Delivery) -> None:
        reach("handling")
        i = int((d.value or b"m0")[1:])
        if d.reconsume_times < i % 4:
            raise RuntimeError(f"m{i} fails at reconsume {d.reconsume_times}")
        os.write(fd, f"{d.origin_topic}/{d.origin_partition}/{d.origin_offset} m{i} {d.reconsume_times}\n".encode())
        reach("handled")

    configure_logging(os.environ.get("TW_LOG_LEVEL", "INFO"))
    cfg = TimerConfig.from_env(os.environ)
    options: dict[str, Any] = {"group_instance_id": f"{group}-worker", "session_timeout_ms": 10_000}
    log = Log(cfg.kafka_bootstrap, client_id=f"retry-worker-{os.getpid()}")
    consumer = RetryConsumer(log, group, [topic], handle, config=cfg, max_reconsume_times=int(max_reconsume),
                             batch_size=int(batch), consumer_options=options)
    signal.signal(signal.SIGTERM, lambda *_: consumer.stop())
    try:
        consumer.run(poll_timeout_s=0.2)
    finally:
        consumer.close()
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
