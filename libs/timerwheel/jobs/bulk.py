"""Bulk scheduling: rows of a file become timer records on the timer topic, through Spark's sink.

Each row (``id, topic, key, value, deliver_at_ms | delay_ms [, partition, headers]``) is turned
into the control headers a producer would set and judged by the service's own parser
(``records.requests``: ``TimerRules``, so the same allow-list, max delay and topic rules), with
the write time as "now". Ids are required (they make a re-run idempotent); an id already on the
timer topic is skipped (an anti-join against it), and a second row with an id of the input is
refused. ``main`` prints ``{"read", "scheduled", "already_scheduled", "rejected"}``.
"""

from __future__ import annotations

import time
from typing import Any

from timerwheel.config import TimerConfig
from timerwheel.jobs import spark as sp
from timerwheel.jobs.records import CONTROL, field, last_header, record_size, requests
from timerwheel.log import stage_logger
from timerwheel.wire import H_DELAY_MS, H_DELIVER_AT, H_ID, H_PARTITION, H_TOPIC

COLUMNS = ("id", "topic", "key", "value", "deliver_at_ms", "delay_ms", "partition", "headers")

log = stage_logger("bulk-schedule")


def read_rows(spark: Any, path: str, fmt: str) -> Any:
    """The input with every column of ``COLUMNS`` (missing ones null): key and value as binary,
    the others as text; ``headers`` as a map of text (a JSON object in CSV)."""
    from pyspark.sql import functions as F

    reader = spark.read.format(fmt)
    if fmt == "csv":
        reader = reader.option("header", "true").option("inferSchema", "false")
    df = reader.load(path)
    cols = []
    for c in COLUMNS:
        if c not in df.columns:
            cols.append(F.lit(None).cast("map<string,string>" if c == "headers" else "string").alias(c))
        elif c == "headers":
            dtype = dict(df.dtypes)[c]
            cols.append((F.from_json(F.col(c), "map<string,string>") if dtype == "string"
                         else F.col(c).cast("map<string,string>")).alias(c))
        elif c in ("key", "value"):
            cols.append(F.col(c).cast("binary").alias(c))
        else:
            cols.append(F.col(c).cast("string").alias(c))
    return df.select(*cols).withColumn("row", F.monotonically_increasing_id())


def timer_headers(rows: Any) -> Any:
    """The headers of each row's timer record: the control ones, then the user's."""
    from pyspark.sql import functions as F

    def h(name: str, col: str) -> Any:
        return F.when(F.col(col).isNotNull(), F.array(F.struct(F.lit(name).alias("key"),
                                                              F.col(col).cast("binary").alias("value"))))

    control = F.concat(*[F.coalesce(h(n, c), F.array().cast("array<struct<key:string,value:binary>>"))
                         for n, c in ((H_TOPIC, "topic"), (H_DELIVER_AT, "deliver_at_ms"), (H_DELAY_MS, "delay_ms"),
                                      (H_ID, "id"), (H_PARTITION, "partition"))])
    user = F.coalesce(F.transform(F.map_entries("headers"), lambda e: F.struct(
        e["key"].alias("key"), e["value"].cast("binary").alias("value"))),
        F.array().cast("array<struct<key:string,value:binary>>"))
    return F.concat(control, user)


def judged(rows: Any, config: TimerConfig, now_ms: int) -> Any:
    """``rows`` with ``headers_out`` (the timer record's headers) and ``reason`` (null: valid)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    with_headers = rows.withColumn("headers_out", timer_headers(rows)).withColumn("size", record_size("headers_out"))
    narrowed = with_headers.drop("headers").withColumnRenamed("headers_out", "headers").select(
        F.lit(-1).alias("partition"), F.col("row").alias("offset"), F.lit(now_ms).cast("long").alias("timestamp_ms"),
        "size",
        F.struct(*[last_header(n).alias(field(n)) for n in CONTROL]).alias("h"))
    verdicts = requests(narrowed, config).select(F.col("offset").alias("row"), "error")
    first = Window.partitionBy("id").orderBy("row")
    return (with_headers.join(verdicts, "row")
            .withColumn("nth", F.when(F.col("id").isNotNull(), F.row_number().over(first)))
            .withColumn("reason", F.when(F.col("id").isNull() | (F.col("id") == ""), F.lit("missing id"))
                        .when(F.col("error").isNotNull(), F.col("error"))
                        .when(F.col("nth") > 1, F.lit("id repeated in the input"))))


def main(path: str, fmt: str, rejects: str, config: TimerConfig, master: str) -> dict[str, int]:
    from pyspark.sql import functions as F

    existing = sp.kafka_topics(config)
    spark = sp.session(master, app="timerwheel-bulk-schedule")
    rows = read_rows(spark, path, fmt)
    j = judged(rows, config, int(time.time() * 1000)).persist()
    timer = sp.read_topics(spark, config, [config.timer_topic] if config.timer_topic in existing else [])
    known = timer.select(last_header(H_ID).cast("string").alias("id")).filter(F.col("id").isNotNull()).distinct()
    valid = j.filter(F.col("reason").isNull())
    fresh = valid.join(known, "id", "left_anti").persist()
    bad = j.filter(F.col("reason").isNotNull())
    bad.select("id", "topic", "key", "value", "deliver_at_ms", "delay_ms", "partition", "headers", "reason") \
        .write.mode("overwrite").parquet(rejects)
    sp.write_topic(fresh.select("key", "value", "headers_out").withColumnRenamed("headers_out", "headers"),
                   config, config.timer_topic)
    counts = {"read": j.count(), "scheduled": fresh.count(), "rejected": bad.count()}
    counts["already_scheduled"] = counts["read"] - counts["rejected"] - counts["scheduled"]
    log.info("bulk-schedule done", **counts)
    return counts
