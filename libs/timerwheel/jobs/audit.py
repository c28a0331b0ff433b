"""The delivery audit: what was scheduled (the timer topic) joined with what was delivered (the
destination topics), as the README's "Spark jobs" defines each figure.

- ``scheduled(requests)``: one row per distinct id of a valid, non-cancel, non-roll-hop timer
  record (its first record: lowest partition, offset), and ``cancelled`` ids from the cancels.
- ``delivered(rows)``: one row per (topic, id) seen on a destination: copies, first
  ``tw-delivered-at`` (and per topic one of id null: its records without ``tw-id``).
- ``joined(scheduled, cancels, delivered)``: the two side by side (a full join), one row per
  scheduled id and one per delivered (topic, id) nobody scheduled.
- ``figures(joined, now_ms, grace_ms)``: the counts and nearest-rank lateness percentiles per
  topic and hour, per topic and in total, with the destinations' bad-input counts, in one
  aggregation.

``main`` only reads Kafka, calls these and writes ``summary.json``, the Parquet lists and the PNG.
Bad input is counted, never fatal: records of the timer topic ``TimerRules`` refuses, destination
records without ``tw-id`` or with an unparsable ``tw-delivered-at``, topics that do not exist.

Cost: each topic is read once; the timer records once more from their cache when one of them
needs the service's parser. When every timer record is common (the usual case) the audit is two
scans and a join: the timer topic's (judging the destinations and caching the narrowed records),
then the destinations' joined to the cached records and aggregated, then small writes.
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
from timerwheel.jobs.records import header_map, judged_requests, last_header, narrow
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

    m = F.col("m")
    at = last_header(H_DELIVERED_AT, m).cast("string")
    return (raw.select("topic", header_map().alias("m"))
            .select("topic", last_header(H_ID, m).cast("string").alias("id"),
                    F.when(at.rlike("^[0-9]{1,18}$"), at.try_cast("long")).alias("delivered_at")))


def delivered(rows: Any) -> Any:
    """topic, id (null: the records without ``tw-id``), copies, first_delivered_at (null if no
    copy had a parsable ``tw-delivered-at``) of ``destination_rows``."""
    from pyspark.sql import functions as F

    # grouped after a shuffle by id alone, as ``scheduled`` is: ``joined`` then needs no other
    return rows.repartition("id").groupBy("topic", "id").agg(F.count(F.lit(1)).alias("copies"),
                                                             F.min("delivered_at").alias("first_delivered_at"))


def joined(sched: Any, cancels: Any, deliv: Any) -> Any:
    """One row per scheduled id: id, topic, deliver_ms, hour_ms, cancelled, copies (0: none),
    first_delivered_at, lateness_ms; and one per row of ``deliv`` nobody scheduled, deliver_ms
    null (a null id never matches: a topic's records without ``tw-id`` stay one row)."""
    from pyspark.sql import functions as F

    c = cancels.withColumn("cancelled", F.lit(True))
    return (sched.join(c, "id", "left").join(deliv, ["topic", "id"], "full")
            .select("id", "topic", "deliver_ms",
                    (F.floor(F.col("deliver_ms") / HOUR_MS) * HOUR_MS).cast("long").alias("hour_ms"),
                    F.coalesce("cancelled", F.lit(False)).alias("cancelled"),
                    F.coalesce("copies", F.lit(0)).cast("long").alias("copies"),
                    "first_delivered_at",
                    (F.col("first_delivered_at") - F.col("deliver_ms")).alias("lateness_ms")))


def figures(j: Any, now_ms: int, grace_ms: int) -> Any:
    """The audit's figures per topic and hour, per topic and in total, in one aggregation (a
    rollup) of ``joined``: columns topic, hour_ms, level ("hour", "topic" or "total"), the
    figures, and the deliveries without ``tw-id`` and of unknown ids. A level's row whose
    ``scheduled`` is 0 holds only the latter (rows of ``joined`` nobody scheduled)."""
    from pyspark.sql import functions as F

    known = F.col("deliver_ms").isNotNull()
    was = known & (F.col("copies") > 0)
    open_ = known & ~F.col("cancelled") & (F.col("copies") == 0)
    due = F.col("deliver_ms") <= F.lit(now_ms - grace_ms)

    def count(cond: Any) -> Any:
        return F.sum(F.when(cond, 1).otherwise(0)).cast("long")

    aggs = [
        F.count("deliver_ms").alias("scheduled"),
        count(known & F.col("cancelled")).alias("cancelled"),
        count(was).alias("delivered"),
        F.sum(F.when(known, F.greatest(F.col("copies") - 1, F.lit(0)))).cast("long").alias("duplicated"),
        count(open_ & due).alias("lost"),
        count(open_ & ~due).alias("pending"),
        count(F.col("cancelled") & was).alias("cancelled_delivered"),
        count(was & (F.col("lateness_ms") < 0)).alias("early"),
        # percentile_disc: the smallest value whose cumulative share reaches q, i.e. the nearest rank
        *[F.expr(f"percentile_disc({q}) WITHIN GROUP (ORDER BY lateness_ms)").alias(name)
          for name, q in PERCENTILES.items()],
        F.max("lateness_ms").alias("max"),
        F.sum(F.when(F.col("id").isNull(), F.col("copies")).otherwise(0)).cast("long").alias("without_id"),
        count(~known & F.col("id").isNotNull()).alias("unknown_ids"),
    ]
    level = F.grouping_id("topic", "hour_ms")
    return (j.rollup("topic", "hour_ms").agg(*aggs, level.alias("g"))
            .withColumn("level", F.when(F.col("g") == 0, "hour").when(F.col("g") == 1, "topic").otherwise("total"))
            .drop("g"))


def _as_summary(row: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: int(row[k] or 0) for k in FIGURES}
    out["lateness_ms"] = {k: (None if row[k] is None else int(row[k])) for k in (*PERCENTILES, "max")}
    return out


def timer_requests(raw_timer: Any, config: TimerConfig) -> tuple[Any, list[str] | None]:
    """(``requests`` of the timer topic's Kafka rows, their destinations when every record is
    common, else None). The narrowed records are cached (judging the destinations reads them
    first); the requests too when some record needs the service's parser (a UDF, read by several
    actions then). When all are common they are left uncached: one plan then reads them once."""
    reqs, destinations = judged_requests(narrow(raw_timer).persist(), config)
    return (reqs, destinations) if destinations is not None else (reqs.persist(), None)


def audit(reqs: Any, raw_dest: Any, now_ms: int, grace_ms: int, *, all_common: bool = False) -> dict[str, Any]:
    """The audit: total and topics (summary.json's dicts), joined (one row per scheduled id,
    persisted), hourly (rows of ``figures``' hour level) and the bad-input counts. Pure: ``reqs``
    from ``timer_requests`` (``all_common``: it found every record common, so none is invalid),
    ``raw_dest`` Kafka rows of the destinations (``spark.read_topics``).

    One Spark action reads the destinations, joins and aggregates: every level's figures and the
    destinations' bad-input counts come from one rollup of the full join."""
    from pyspark.sql import functions as F

    sched, cancels = scheduled(reqs)
    j_all = joined(sched, cancels, delivered(destination_rows(raw_dest))).persist()
    levels = [r.asDict() for r in figures(j_all, now_ms, grace_ms).collect()]
    hourly = [r for r in levels if r["level"] == "hour" and r["scheduled"] > 0]
    (total,) = [r for r in levels if r["level"] == "total"] or [{k: None for k in (*FIGURES, *PERCENTILES, "max",
                                                                                   "without_id", "unknown_ids")}]
    per_topic = {r["topic"]: _as_summary(r) for r in levels if r["level"] == "topic" and r["scheduled"] > 0}
    bad = {
        "invalid_timer_records": 0 if all_common else reqs.filter(F.col("error").isNotNull()).count(),
        "deliveries_without_id": int(total["without_id"] or 0),
        "deliveries_of_unknown_ids": int(total["unknown_ids"] or 0),
    }
    j = j_all.filter(F.col("deliver_ms").isNotNull())
    return {"total": _as_summary(total), "topics": per_topic, "joined": j, "hourly": hourly, "bad_input": bad}


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
    reqs, destinations = timer_requests(timer, config)
    if topics is None:
        topics = destinations if destinations is not None else sorted(
            r[0] for r in reqs.filter(F.col("topic").isNotNull() & F.col("error").isNull())
            .select("topic").distinct().collect())
    unknown = sorted(set(topics) - existing)
    dest = sp.read_topics(spark, config, [t for t in topics if t in existing])
    result = audit(reqs, dest, now, grace_ms, all_common=destinations is not None)
    summary = {"now_ms": now, "grace_ms": grace_ms, "dead_lettered": dlq.count(), "total": result["total"],
               "topics": result["topics"], "bad_input": {**result["bad_input"], "unknown_topics": unknown}}
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    j = result["joined"]
    open_due = ~F.col("cancelled") & (F.col("copies") == 0) & (F.col("deliver_ms") <= F.lit(now - grace_ms))
    cols = ["id", "topic", "deliver_ms", "cancelled", "copies", "first_delivered_at", "lateness_ms"]
    total = summary["total"]
    for name, rows in (("lost", j.filter(open_due)), ("duplicated", j.filter(F.col("copies") > 1)),
                       ("cancelled_delivered", j.filter(F.col("cancelled") & (F.col("copies") > 0)))):
        # an empty list (the summary counts it) is written without a scan of the joined rows
        rows = rows.select(*cols) if total[name] else rows.select(*cols).limit(0)
        rows.write.mode("overwrite").parquet(str(outdir / name))
    import pandas as pd

    hourly = [tuple(r[c] for c in HOURLY_COLUMNS) for r in result["hourly"]]
    spark.createDataFrame(hourly, schema=HOURLY_SCHEMA).write.mode("overwrite").parquet(str(outdir / "hourly"))
    _plot(pd.DataFrame(hourly, columns=list(HOURLY_COLUMNS)), outdir / "lateness.png")
    tmp = outdir / f".summary.json.{os.getpid()}"
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    tmp.replace(outdir / "summary.json")
    log.info("audit done", out=str(outdir), scheduled=summary["total"]["scheduled"], lost=summary["total"]["lost"])
    return summary
