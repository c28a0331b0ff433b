"""timerwheel bulk-schedule writes one correct timer record per valid row (as the service's own
parser reads it), refuses the others with a reason, schedules nothing twice; timerwheel forecast
then counts them per minute, topic and shard exactly."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka_util import unique
from timerwheel.cli import main
from timerwheel.config import TimerConfig
from timerwheel.records import Record
from timerwheel.wire import TimerRules

ROWS = 20_000


def _rows(dest: str, other: str, now: int) -> tuple[pd.DataFrame, dict[int, str]]:
    rows: list[dict[str, Any]] = []
    bad: dict[int, str] = {}
    for i in range(ROWS):
        r: dict[str, Any] = {"id": f"r{i}", "topic": dest if i % 3 else other, "key": f"k{i % 97}".encode(),
                             "value": f"value {i}".encode(), "deliver_at_ms": str(now + 60_000 + i * 500),
                             "delay_ms": None}
        if i % 5 == 1:
            r["deliver_at_ms"], r["delay_ms"] = None, str(3_600_000 + i)
        if i % 501 == 7:
            r["topic"], bad[i] = "__internal", "not allowed"
        elif i % 733 == 8:
            r["deliver_at_ms"], r["delay_ms"], bad[i] = "tomorrow", None, "unparsable tw-deliver-at"
        elif i % 877 == 9:
            r["deliver_at_ms"], r["delay_ms"], bad[i] = str(now), "5", "more than one delivery time"
        elif i % 997 == 10:
            r["id"], bad[i] = None, "missing id"
        elif i == 12_345:
            r["id"], bad[i] = "r1", "id repeated in the input"
        rows.append(r)
    return pd.DataFrame(rows), bad


def _read_all(bootstrap: str, topic: str) -> list[Record]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    parts = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or []]
    consumer.assign(parts)
    consumer.seek_to_beginning()
    end = consumer.end_offsets(parts)
    out: list[Record] = []
    while any(consumer.position(tp) < end[tp] for tp in parts):
        for tp, batch in consumer.poll(timeout_ms=1000).items():
            out += [Record(tp.topic, tp.partition, m.offset, m.timestamp, m.key, m.value, tuple(m.headers))
                    for m in batch]
    consumer.close()
    return out


def test_bulk_schedule_writes_valid_rows_once_and_forecast_counts_them(
        spark: Any, kafka_bootstrap: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    timer, dest, other = unique("bulk-timer"), unique("bulk-dest"), unique("bulk-other")
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    admin.create_topics([NewTopic(timer, 4, 1)])
    admin.close()
    now = int(time.time() * 1000)
    frame, bad = _rows(dest, other, now)
    frame.to_parquet(tmp_path / "rows.parquet")
    args = ["bulk-schedule", "--kafka", kafka_bootstrap, "--input", str(tmp_path / "rows.parquet"),
            "--timer-topic", timer, "--master", "local[2]"]

    assert main([*args, "--rejects", str(tmp_path / "rejects")]) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first == {"read": ROWS, "scheduled": ROWS - len(bad), "already_scheduled": 0, "rejected": len(bad)}
    rejects = pd.read_parquet(tmp_path / "rejects")
    reasons = {(int(r.value.decode().split()[-1]) if r.value is not None else None): r.reason
               for r in rejects.itertuples()}
    assert set(reasons) == set(bad)
    for i, why in bad.items():
        assert why in reasons[i], (i, reasons[i])

    # every valid row is one timer record the service reads back as that row
    records = _read_all(kafka_bootstrap, timer)
    assert len(records) == ROWS - len(bad)
    rules = TimerRules(TimerConfig(timer_topic=timer))
    by_id = {}
    for rec in records:
        req = rules.parse(rec, rec.timestamp_ms)
        by_id[req.message_id] = (req, rec)
    assert len(by_id) == len(records)
    for i, row in enumerate(frame.itertuples()):
        if i in bad:
            continue
        req, rec = by_id[row.id]
        assert (req.topic, rec.key, rec.value) == (row.topic, row.key, row.value)
        expected = int(row.deliver_at_ms) if row.deliver_at_ms is not None else rec.timestamp_ms + int(row.delay_ms)
        assert req.deliver_ms == expected
        assert not req.cancel and req.roll == 0

    # the same input again: nothing twice
    assert main([*args, "--rejects", str(tmp_path / "rejects2")]) == 0
    second = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert second == {"read": ROWS, "scheduled": 0, "already_scheduled": ROWS - len(bad), "rejected": len(bad)}
    assert len(_read_all(kafka_bootstrap, timer)) == ROWS - len(bad)

    # forecast: due per minute, topic and shard (partition % 3) in the next 2 hours; two messages
    # rescheduled (one of them twice: the second reschedule of its first ticket is void) count at
    # their new time, a cancelled one not at all
    hours, shards = 2, 3
    due = {mid: (req.topic, rec.partition, req.deliver_ms) for mid, (req, rec) in by_id.items()}
    ahead = sorted(mid for mid, (_, _, d) in due.items() if now < d <= now + 3_600_000)[:3]
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    for mid, later in [(ahead[0], 1_800_000), (ahead[1], 600_000), (ahead[1], 1_200_000), (ahead[2], None)]:
        topic, partition, at = due[mid]
        original = by_id[mid][0].deliver_ms
        hs = ([("tw-cancel", mid.encode())] if later is None else
              [("tw-topic", topic.encode()), ("tw-id", mid.encode()), ("tw-revision", b"1"),
               ("tw-replaces", str(original).encode())])
        producer.send(timer, value=b"v", headers=[*hs, ("tw-deliver-at", str(original + (later or 0)).encode())],
                      partition=partition).get(timeout=60)
        if later is None:
            del due[mid]
        elif at == original:  # the first decision on the ticket: the message moves
            due[mid] = (topic, partition, original + later)
    producer.close()
    truth = Counter((topic, partition % shards, d // 60_000 * 60_000)
                    for topic, partition, d in due.values() if now < d <= now + hours * 3_600_000)
    out = tmp_path / "forecast"
    assert main(["forecast", "--kafka", kafka_bootstrap, "--timer-topic", timer, "--out", str(out),
                 "--hours", str(hours), "--shards", str(shards), "--now-ms", str(now)]) == 0
    minutes = pd.read_parquet(out / "minutes")
    got = Counter({(r.topic, int(r.shard), int(r.minute_ms)): int(r.due) for r in minutes.itertuples()})
    assert got == truth
    peak = json.loads((out / "peak.json").read_text())
    per_minute = Counter()
    for (_, _, m), n in truth.items():
        per_minute[m] += n
    assert peak["due"] == sum(truth.values())
    assert peak["peak_due"] == max(per_minute.values())
    assert per_minute[peak["peak_minute_ms"]] == peak["peak_due"]
    assert (out / "forecast.png").stat().st_size > 10_000


@pytest.mark.parametrize("broadcast_rows", [0, 200_000])
def test_bulk_verdicts_are_the_same_whether_the_refused_rows_are_broadcast_or_shuffled(
        spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, broadcast_rows: int) -> None:
    from timerwheel.jobs import bulk

    monkeypatch.setattr(bulk, "BROADCAST_ROWS", broadcast_rows)
    # Spark's own threshold would broadcast these small sides (10 MB) without the hint
    threshold = spark.conf.get("spark.sql.autoBroadcastJoinThreshold")
    spark.conf.set("spark.sql.autoBroadcastJoinThreshold", "-1")
    now = int(time.time() * 1000)
    frame, bad = _rows("dest", "other", now)
    frame.to_parquet(tmp_path / "rows.parquet")
    try:
        j, cached = bulk.judged(bulk.read_rows(spark, str(tmp_path / "rows.parquet"), "parquet"), TimerConfig(), now)
        plan = j._jdf.queryExecution().executedPlan().toString()
        reasons = {int(r.value.decode().split()[-1]): r.reason
                   for r in j.filter("reason is not null").select("value", "reason").collect()}
        for df in cached:
            df.unpersist()
    finally:  # the session is shared by the module's tests
        spark.conf.set("spark.sql.autoBroadcastJoinThreshold", threshold)
    for key in ("row", "id"):  # the joins back by row (the refused) and by id (the repeated)
        assert (f"BroadcastHashJoin [{key}#" in plan) == (broadcast_rows > 0), plan
        assert (f"SortMergeJoin [{key}#" in plan) == (broadcast_rows == 0), plan
    assert set(reasons) == set(bad)
    for i, why in bad.items():
        assert why in reasons[i], (i, reasons[i])
