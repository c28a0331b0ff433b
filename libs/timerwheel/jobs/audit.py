"""The delivery audit: what was scheduled (the timer topic) joined with what was delivered (the
destination topics), as the README's "Spark jobs" defines each figure.

- ``scheduled(requests)``: one row per distinct id of a valid, non-cancel, non-roll-hop timer
  record (its first record: lowest partition, offset), and ``cancelled`` ids from the cancels.
- ``delivered(raw)``: one row per (topic, id) seen on a destination: copies, first ``tw-delivered-at``.
- ``joined(scheduled, cancels, delivered)``: the two side by side, one row per scheduled id.
- ``figures(joined, now_ms, grace_ms, by)``: the counts and nearest-rank lateness percentiles,
  grouped by ``by`` (nothing: the total; topic; topic and hour).

``main`` only reads Kafka, calls these and writes ``summary.json``, the Parquet lists and the PNG.
Bad input is counted, never fatal: records of the timer topic ``TimerRules`` refuses, destination
records without ``tw-id`` or with an unparsable ``tw-delivered-at``, topics that do not exist.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from timerwheel.config import TimerConfig
from timerwheel.jobs import spark as sp
from timerwheel.jobs.plot import line_chart
from timerwheel.jobs.records import last_header, narrow, requests
from timerwheel.log import stage_logger
from timerwheel.wire import H_DELIVERED_AT, H_ID

HOUR_MS = 3_600_000
FIGURES = ("scheduled", "cancelled", "delivered", "duplicated", "lost", "pending", "cancelled_delivered", "early")
PERCENTILES = {"p50": 0.5, "p95": 0.95, "p99": 0.99}
#: DIR/hourly/'s columns: per topic and hour of the delivery time, the figures.
HOURLY_COLUMNS = ("topic", "hour_ms", *FIGURES, *PERCENTILES, "max")
HOURLY_SCHEMA = ", ".join(f"`{c}` {'string' if c == 'topic' else 'double' if c in PERCENTILES else 'long'}"
                          for c in HOURLY_COLUMNS)

log = stage_logger("audit")


def scheduled(reqs: Any) -> tuple[Any, Any]:
    """(scheduled: id, topic, deliver_ms, partition (the timer partition); cancels: distinct
    cancelled ids) of ``requests`` rows."""
    from pyspark.sql import functions as F

    valid = reqs.filter(F.col("error").isNull())
    first = F.min(F.struct("partition", "offset", "topic", "deliver_ms"))
    sched = (valid.filter(~F.col("cancel") & (F.col("roll") == 0)).groupBy("id").agg(first.alias("f"))
             .select("id", "f.topic", "f.deliver_ms", "f.partition"))
    cancels = valid.filter(F.col("cancel")).select("id").distinct()
    return sched, cancels


def destination_rows(raw: Any) -> Any:
    """topic, id (null: no ``tw-id``), delivered_at (null: no parsable ``tw-delivered-at``) of each
    destination record: the headers read once, the key and value dropped."""
    from pyspark.sql import functions as F

    at = last_header(H_DELIVERED_AT).cast("string")
    return raw.select("topic", last_header(H_ID).cast("string").alias("id"),
                      F.when(at.rlike("^[0-9]{1,18}$"), at.try_cast("long")).alias("delivered_at"))


def delivered(rows: Any) -> Any:
    """topic, id, copies, first_delivered_at (null if no copy had a parsable ``tw-delivered-at``)
    of ``destination_rows`` that carry ``tw-id``."""
    from pyspark.sql import functions as F

    return (rows.filter(F.col("id").isNotNull())
            .groupBy("topic", "id").agg(F.count(F.lit(1)).alias("copies"),
                                        F.min("delivered_at").alias("first_delivered_at")))


def joined(sched: Any, cancels: Any, deliv: Any) -> Any:
    """One row per scheduled id: id, topic, deliver_ms, hour_ms, cancelled, copies (0: none),
    first_delivered_at, lateness_ms."""
    from pyspark.sql import functions as F

    c = cancels.withColumn("cancelled", F.lit(True))
    return (sched.join(c, "id", "left").join(deliv, ["topic", "id"], "left")
            .select("id", "topic", "deliver_ms",
                    (F.floor(F.col("deliver_ms") / HOUR_MS) * HOUR_MS).cast("long").alias("hour_ms"),
                    F.coalesce("cancelled", F.lit(False)).alias("cancelled"),
                    F.coalesce("copies", F.lit(0)).cast("long").alias("copies"),
                    "first_delivered_at",
                    (F.col("first_delivered_at") - F.col("deliver_ms")).alias("lateness_ms")))


def figures(j: Any, now_ms: int, grace_ms: int) -> Any:
    """The audit's figures per topic and hour, per topic and in total, in one aggregation (a
    rollup): columns topic, hour_ms, level ("hour", "topic" or "total"), the figures."""
    from pyspark.sql import functions as F

    was = F.col("copies") > 0
    open_ = ~F.col("cancelled") & ~was
    due = F.col("deliver_ms") <= F.lit(now_ms - grace_ms)

    def count(cond: Any) -> Any:
        return F.sum(F.when(cond, 1).otherwise(0)).cast("long")

    aggs = [
        F.count(F.lit(1)).alias("scheduled"),
        count(F.col("cancelled")).alias("cancelled"),
        count(was).alias("delivered"),
        F.sum(F.greatest(F.col("copies") - 1, F.lit(0))).cast("long").alias("duplicated"),
        count(open_ & due).alias("lost"),
        count(open_ & ~due).alias("pending"),
        count(F.col("cancelled") & was).alias("cancelled_delivered"),
        count(was & (F.col("lateness_ms") < 0)).alias("early"),
        # percentile_disc: the smallest value whose cumulative share reaches q, i.e. the nearest rank
        *[F.expr(f"percentile_disc({q}) WITHIN GROUP (ORDER BY lateness_ms)").alias(name)
          for name, q in PERCENTILES.items()],
        F.max("lateness_ms").alias("max"),
    ]
    level = F.grouping_id("topic", "hour_ms")
    return (j.rollup("topic", "hour_ms").agg(*aggs, level.alias("g"))
            .withColumn("level", F.when(F.col("g") == 0, "hour").when(F.col("g") == 1, "topic").otherwise("total"))
            .drop("g"))


def _as_summary(row: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: int(row[k] or 0) for k in FIGURES}
    out["lateness_ms"] = {k: (None if row[k] is None else int(row[k])) for k in (*PERCENTILES, "max")}
    return out


def timer_requests(raw_timer: Any, config: TimerConfig) -> Any:
    """``requests`` of the timer topic's Kafka rows, persisted (the audit reads them twice)."""
    return requests(narrow(raw_timer).persist(), config).persist()


def audit(reqs: Any, raw_dest: Any, now_ms: int, grace_ms: int) -> dict[str, Any]:
    """The audit: total and topics (summary.json's dicts), joined (one row per scheduled id,
    persisted), hourly (rows of ``figures``' hour level) and the bad-input counts. Pure: ``reqs``
    from ``timer_requests``, ``raw_dest`` Kafka rows of the destinations (``spark.read_topics``).

    Few Spark jobs, each destination record read once: the figures of every level come from one
    rollup, the bad-input counts of the destinations from one aggregation of their cached rows."""
    from pyspark.sql import functions as F

    sched, cancels = scheduled(reqs)
    dest = destination_rows(raw_dest).persist()
    j = joined(sched, cancels, delivered(dest)).persist()
    levels = figures(j, now_ms, grace_ms).collect()
    hourly = [r.asDict() for r in levels if r["level"] == "hour"]
    (total,) = [r.asDict() for r in levels if r["level"] == "total"] or [{k: None for k in (*FIGURES, *PERCENTILES, "max")}]
    per_topic = {r["topic"]: _as_summary(r.asDict()) for r in levels if r["level"] == "topic"}
    seen = dest.agg(F.count(F.when(F.col("id").isNull(), 1)).alias("without_id"),
                    F.count_distinct("topic", "id").alias("ids")).collect()[0]
    summary_total = _as_summary(total)
    bad = {
        "invalid_timer_records": reqs.filter(F.col("error").isNotNull()).count(),
        "deliveries_without_id": int(seen["without_id"]),
        # distinct (topic, id) delivered: those of scheduled ids, and the others
        "deliveries_of_unknown_ids": int(seen["ids"]) - summary_total["delivered"],
    }
    return {"total": summary_total, "topics": per_topic, "joined": j, "hourly": hourly, "bad_input": bad}


def _plot(hourly_pd: Any, path: Path) -> None:
    series = []
    for topic, rows in hourly_pd.sort_values("hour_ms").groupby("topic"):
        hours = [time.strftime("%m-%d %H:00", time.gmtime(h / 1000)) for h in rows["hour_ms"]]
        series += [(f"{topic} {name}", hours, rows[name], style) for name, style in (("p50", "-"), ("p99", "--"))]
    line_chart(series, "hour of the delivery time (UTC)", "lateness (ms)",
               "timerwheel delivery lateness per topic and hour", path)


def main(out: str, config: TimerConfig, topics: list[str] | None, grace_ms: int,
         now_ms: int | None, master: str) -> dict[str, Any]:
    """Run the audit against Kafka; write ``out``; return summary.json's content."""
    from pyspark.sql import functions as F

    existing = sp.kafka_topics(config)
    now = int(time.time() * 1000) if now_ms is None else now_ms
    spark = sp.session(master, app="timerwheel-audit")
    timer = sp.read_topics(spark, config, [config.timer_topic] if config.timer_topic in existing else [])
    dlq = sp.read_topics(spark, config, [config.dlq_topic] if config.dlq_topic in existing else [])
    reqs = timer_requests(timer, config)
    if topics is None:
        topics = sorted(r[0] for r in reqs.filter(F.col("topic").isNotNull() & F.col("error").isNull())
                        .select("topic").distinct().collect())
    unknown = sorted(set(topics) - existing)
    dest = sp.read_topics(spark, config, [t for t in topics if t in existing])
    result = audit(reqs, dest, now, grace_ms)
    summary = {"now_ms": now, "grace_ms": grace_ms, "dead_lettered": dlq.count(), "total": result["total"],
               "topics": result["topics"], "bad_input": {**result["bad_input"], "unknown_topics": unknown}}
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    j = result["joined"]
    open_due = ~F.col("cancelled") & (F.col("copies") == 0) & (F.col("deliver_ms") <= F.lit(now - grace_ms))
    cols = ["id", "topic", "deliver_ms", "cancelled", "copies", "first_delivered_at", "lateness_ms"]
    j.filter(open_due).select(*cols).write.mode("overwrite").parquet(str(outdir / "lost"))
    j.filter(F.col("copies") > 1).select(*cols).write.mode("overwrite").parquet(str(outdir / "duplicated"))
    j.filter(F.col("cancelled") & (F.col("copies") > 0)).select(*cols).write.mode("overwrite").parquet(
        str(outdir / "cancelled_delivered"))
    import pandas as pd

    hourly = [tuple(r[c] for c in HOURLY_COLUMNS) for r in result["hourly"]]
    spark.createDataFrame(hourly, schema=HOURLY_SCHEMA).write.mode("overwrite").parquet(str(outdir / "hourly"))
    _plot(pd.DataFrame(hourly, columns=list(HOURLY_COLUMNS)), outdir / "lateness.png")
    tmp = outdir / f".summary.json.{os.getpid()}"
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    tmp.replace(outdir / "summary.json")
    log.info("audit done", out=str(outdir), scheduled=summary["total"]["scheduled"], lost=summary["total"]["lost"])
    return summary
