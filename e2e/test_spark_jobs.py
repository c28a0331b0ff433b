"""The Spark jobs against a real run of the five stage processes (real Kafka and Redis).

- ``timerwheel audit`` after a run with cancels and two stages killed and restarted midway: every
  figure of summary.json equals what the test counts from what it produced and consumed.
- ``timerwheel bulk-schedule`` of a few hundred rows, some invalid: the stages deliver each valid
  row once, not before its time by the collector's own clock, as written; no reject arrives.

Both run the CLI as a process with the stages' environment (``TW_*``: the timer topic, the DLQ,
the allow-list), as an operator would beside the stages.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from audit_truth import audit_summary
from harness import Collector, Pipeline, Scheduled, TimerProducer, now_ms
from kafka import KafkaConsumer, TopicPartition

pytestmark = pytest.mark.e2e

GRACE_MS = 60_000


def spark_job(pipe: Pipeline, *args: str) -> subprocess.CompletedProcess[str]:
    """``timerwheel ARGS`` with the stages' environment; asserts exit 0."""
    done = subprocess.run([sys.executable, "-m", "timerwheel.cli", *args, "--kafka", pipe.kafka, "--master", "local[2]"],
                          env=pipe.env, cwd=pipe.workdir, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"timerwheel {args[0]} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done


def audit(pipe: Pipeline, out: Path, now: int) -> dict[str, Any]:
    spark_job(pipe, "audit", "--out", str(out), "--now-ms", str(now), "--grace-ms", str(GRACE_MS))
    return dict(json.loads((out / "summary.json").read_text()))


def timer_records(pipe: Pipeline) -> dict[str, tuple[int, dict[str, bytes]]]:
    """tw-id -> (timestamp, headers) of each record of the timer topic that is not a roll hop."""
    consumer = KafkaConsumer(bootstrap_servers=pipe.kafka, group_id=None, enable_auto_commit=False,
                             **pipe.kafka_options)
    try:
        tps = [TopicPartition(pipe.timer_topic, p) for p in sorted(consumer.partitions_for_topic(pipe.timer_topic))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        out: dict[str, tuple[int, dict[str, bytes]]] = {}
        while any(consumer.position(tp) < end[tp] for tp in tps):
            for recs in consumer.poll(timeout_ms=500).values():
                for r in recs:
                    h = {k: bytes(v) for k, v in (r.headers or ())}
                    if "tw-id" in h and int(h.get("tw-roll", b"0")) == 0:
                        out[h["tw-id"].decode()] = (r.timestamp, h)
        return out
    finally:
        consumer.close(autocommit=False)


def wait_records(collector: Collector, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while len(collector.records) < count and time.monotonic() < deadline:
        time.sleep(0.2)


def caught_up(pipe: Pipeline, collector: Collector, timeout_s: float = 30.0) -> None:
    """Wait until ``collector`` holds every record its topics hold now (the stages stopped): as
    many as a fresh consumer reads up to their ends (not the ends' sum: the dead letters are
    written in transactions, and each commit marker takes an offset)."""
    consumer = KafkaConsumer(bootstrap_servers=pipe.kafka, group_id=None, enable_auto_commit=False,
                             **pipe.kafka_options)
    try:
        tps = [TopicPartition(t, p) for t in collector.topics for p in sorted(consumer.partitions_for_topic(t))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        total = 0
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            assert time.monotonic() < deadline, f"{collector.topics} not read to their ends within {timeout_s:.0f} s"
            total += sum(len(recs) for recs in consumer.poll(timeout_ms=500).values())
    finally:
        consumer.close(autocommit=False)
    wait_records(collector, total, timeout_s)
    assert len(collector.records) == total, f"the collector has {len(collector.records)} of {total} records"


def test_the_audit_of_a_run_with_cancels_and_restarts_equals_the_runs_own_counts(
    tmp_path: Path, kafka_bootstrap: str, redis_url: str
) -> None:
    pytest.importorskip("pyspark", reason="the Spark jobs need the .[spark] extra (make setup-spark)")
    pipe = Pipeline(tmp_path, kafka_bootstrap, redis_url)
    dest_a, dest_b = pipe.new_dest("a", 2), pipe.new_dest("b", 3)
    with (
        pipe.running(),
        TimerProducer(pipe, seed=15) as producer,
        Collector(pipe, [dest_a, dest_b]) as collector,
        Collector(pipe, [pipe.dlq_topic]) as dlq,
    ):
        rng = random.Random(15)
        start = now_ms()
        first = [producer.schedule(dest_a if i % 2 else dest_b, start + rng.randint(0, 15_000)) for i in range(300)]
        first += [producer.schedule(dest_b, delay_ms=rng.randint(0, 10_000)) for _ in range(40)]
        first += [producer.schedule(dest_a, delay_level=lv) for lv in [(1, 1_000), (2, 5_000), (3, 10_000)] * 5]
        # Due 5 minutes ahead (they roll every 20 s): pending at the audit's now, lost 10 minutes later.
        later = [producer.schedule(dest_a if i % 2 else dest_b, start + 300_000 + i * 10) for i in range(10)]
        for m in rng.sample([m for m in first if m.deliver_at_ms - start >= 6_000], 40) + later[:3]:
            producer.cancel(m)
        # Dead-lettered: a denied destination, no delivery time, an unparsable one.
        bad = [[("tw-topic", b"secret"), ("tw-delay-ms", b"5")], [("tw-topic", dest_a.encode())],
               [("tw-topic", dest_b.encode()), ("tw-deliver-at", b"soon")]]
        for i, headers in enumerate(bad):
            producer.send_raw(headers, f"bad{i}".encode(), b"payload", partition=i)
        producer.flush()

        time.sleep(4)  # some delivered, many in the wheel: kill the delivering stage mid-run
        pipe.restart("dequeue-put")
        restarted = now_ms()
        second = [producer.schedule(dest_a if i % 3 else dest_b, restarted + rng.randint(0, 12_000))
                  for i in range(200)]
        for m in rng.sample([m for m in second if m.deliver_at_ms - restarted >= 6_000], 25):
            producer.cancel(m)
        producer.flush()
        time.sleep(2)
        pipe.restart("enqueue-put")  # and the one that writes the wheel

        expected = {mid: m for mid, m in producer.expected().items() if mid not in _scheduled_ids(later)}
        assert len(producer.messages) == 300 + 40 + 15 + 10 + 200, "the producer's sends were not all acknowledged"
        missing = collector.wait_for(expected, 90, pipe)
        assert not missing, f"{len(missing)} not delivered\n{pipe.tails()}"
        # Cancels of messages already delivered: cancelled and delivered, in both counts.
        done = rng.sample([m for m in first if m.message_id in collector.delivered_ids()
                           and m.message_id not in producer.cancelled], 4)
        for m in done:
            producer.cancel(m)
        producer.flush()
        time.sleep(3)  # late copies and anything a cancel failed to stop show up by now
        pipe.stop_cleanly()
        caught_up(pipe, collector)
        caught_up(pipe, dlq)
        audit_now = now_ms()

        # The run's own counts, from what the test produced and what its collectors consumed.
        sched: dict[str, tuple[str, int]] = {mid: (m.topic, m.deliver_at_ms) for mid, m in producer.messages.items()}
        with collector._lock:
            copies = list(collector.records)
        deliveries: dict[str, list[int]] = {}
        unknown = set()
        for d in copies:
            mid = d.headers.get("tw-id", b"").decode()
            if mid in sched and sched[mid][0] == d.topic:
                deliveries.setdefault(mid, []).append(d.delivered_at_ms)
            else:
                unknown.add((d.topic, mid))
        cancelled = set(producer.cancelled)
        total, per_topic = audit_summary(sched, cancelled, deliveries, audit_now, GRACE_MS)
        # Not vacuous: the run had each kind the audit counts (duplicates only if a kill re-delivered).
        assert total["cancelled"] == 40 + 3 + 25 + 4 and total["cancelled_delivered"] >= 4
        assert total["pending"] == 7 and total["lost"] == 0

        summary = audit(pipe, tmp_path / "audit", audit_now)
        assert summary["now_ms"] == audit_now and summary["grace_ms"] == GRACE_MS
        assert summary["dead_lettered"] == len(dlq.records) == len(bad)
        assert summary["total"] == total, f"audit {summary['total']}\nrun   {total}"
        assert summary["topics"] == per_topic and set(per_topic) == {dest_a, dest_b}
        assert summary["bad_input"] == {"invalid_timer_records": len(bad), "deliveries_without_id": 0,
                                        "deliveries_of_unknown_ids": len(unknown), "unknown_topics": []}
        lists = {name: set(pd.read_parquet(tmp_path / "audit" / name)["id"])
                 for name in ("lost", "duplicated", "cancelled_delivered")}
        assert lists == {"lost": set(), "duplicated": {m for m, c in deliveries.items() if len(c) > 1},
                         "cancelled_delivered": {m for m in cancelled if m in deliveries}}

    # Ten minutes on, the seven still in the wheel are past due and the grace: lost.
    later_now = audit_now + 600_000
    summary = audit(pipe, tmp_path / "audit-later", later_now)
    total_later, per_topic_later = audit_summary(sched, cancelled, deliveries, later_now, GRACE_MS)
    assert total_later["lost"] == 7 and total_later["pending"] == 0
    assert summary["total"] == total_later and summary["topics"] == per_topic_later
    assert set(pd.read_parquet(tmp_path / "audit-later" / "lost")["id"]) == {
        m.message_id for m in later if m.message_id not in cancelled}


def _scheduled_ids(messages: list[Scheduled]) -> set[str]:
    return {m.message_id for m in messages}


BULK_ROWS = 300


def _bulk_rows(a: str, b: str, t0: int) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """Rows due 40..55 s after ``t0`` (absolute, or a delay from the write), some with a partition
    and user headers; and the invalid ones: row index -> the reason the rejects must give."""
    rows: list[dict[str, Any]] = []
    bad: dict[int, str] = {}
    for i in range(BULK_ROWS):
        r: dict[str, Any] = {"id": f"bulk-{i}", "topic": a if i % 2 else b, "key": f"k{i}".encode(),
                             "value": f"value {i}".encode(), "deliver_at_ms": str(t0 + 40_000 + i * 50),
                             "delay_ms": None, "partition": None, "headers": [("trace", f"t{i}")]}
        if i % 5 == 1:
            r["deliver_at_ms"], r["delay_ms"] = None, str(30_000 + i * 50)
        if i % 7 == 3:
            r["partition"] = "1"
        if i % 4 == 0:
            r["headers"] = []
        if i % 37 == 5:
            r["topic"], bad[i] = "secret", "not allowed by allow_topics"
        elif i % 41 == 6:
            r["deliver_at_ms"], r["delay_ms"], bad[i] = "tomorrow", None, "unparsable tw-deliver-at"
        elif i % 43 == 7:
            r["deliver_at_ms"], r["delay_ms"], bad[i] = str(t0 + 40_000), "5", "more than one delivery time"
        elif i % 47 == 8:
            r["deliver_at_ms"], r["delay_ms"], bad[i] = None, str(700_000), "exceeds max_delay_ms"
        elif i % 53 == 9:
            r["id"], bad[i] = None, "missing id"
        elif i in (250, 251):
            r["id"], bad[i] = "bulk-20", "id repeated in the input"
        rows.append(r)
    return rows, bad


def test_bulk_scheduled_rows_are_delivered_once_on_time_as_written_by_the_stages(
    tmp_path: Path, kafka_bootstrap: str, redis_url: str
) -> None:
    pytest.importorskip("pyspark", reason="the Spark jobs need the .[spark] extra (make setup-spark)")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pipe = Pipeline(tmp_path, kafka_bootstrap, redis_url, max_delay_ms=600_000)
    dest_a, dest_b = pipe.new_dest("a", 2), pipe.new_dest("b", 3)
    t0 = now_ms()
    rows, bad = _bulk_rows(dest_a, dest_b, t0)
    schema = pa.schema([("id", pa.string()), ("topic", pa.string()), ("key", pa.binary()), ("value", pa.binary()),
                        ("deliver_at_ms", pa.string()), ("delay_ms", pa.string()), ("partition", pa.string()),
                        ("headers", pa.map_(pa.string(), pa.string()))])
    pq.write_table(pa.Table.from_pylist(rows, schema), tmp_path / "rows.parquet")
    valid = {r["id"]: r for i, r in enumerate(rows) if i not in bad}
    with pipe.running(), Collector(pipe, [dest_a, dest_b]) as collector:
        done = spark_job(pipe, "bulk-schedule", "--input", str(tmp_path / "rows.parquet"),
                         "--rejects", str(tmp_path / "rejects"))
        assert json.loads(done.stdout.strip().splitlines()[-1]) == {
            "read": BULK_ROWS, "scheduled": len(valid), "already_scheduled": 0, "rejected": len(bad)}
        rejects = pd.read_parquet(tmp_path / "rejects")
        got = {int(r.value.decode().split()[-1]): r.reason for r in rejects.itertuples()}
        assert set(got) == set(bad)
        for i, why in bad.items():
            assert why in got[i], (i, got[i])

        missing = collector.wait_for(valid, 120, pipe)
        assert not missing, f"{len(missing)} valid rows not delivered: {sorted(missing)[:10]}\n{pipe.tails()}"
        time.sleep(3)  # a second copy, or a reject, would show up by now
        pipe.stop_cleanly()
        caught_up(pipe, collector)

    written = timer_records(pipe)
    assert set(written) == set(valid)
    assert set(collector.by_id) == set(valid), "delivered ids that are no valid row"
    for mid, row in valid.items():
        (d,) = collector.by_id[mid]
        stamp, _ = written[mid]
        due = int(row["deliver_at_ms"]) if row["deliver_at_ms"] is not None else stamp + int(row["delay_ms"])
        assert d.received_at_ms >= due and d.delivered_at_ms >= due, (mid, due, d)
        assert (d.topic, d.key, d.value) == (row["topic"], row["key"], row["value"])
        assert {k: v for k, v in d.headers.items() if not k.startswith("tw-")} == {
            k: v.encode() for k, v in row["headers"]}
        if row["partition"] is not None:
            assert d.partition == int(row["partition"])
