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
from timerwheel.jobs.records import judged_requests, last_header, narrow
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


#: Spark's Kafka type of a record's headers.
HEADERS = "array<struct<key:string,value:binary>>"


def timer_headers(rows: Any) -> Any:
    """The headers of each row's timer record: the control ones, then the user's."""
    from pyspark.sql import functions as F

    none = F.array().cast(HEADERS)

    def h(name: str, col: str) -> Any:
        return F.when(F.col(col).isNotNull(), F.array(F.struct(F.lit(name).alias("key"),
                                                              F.col(col).cast("binary").alias("value"))))

    control = F.concat(*[F.coalesce(h(n, c), none)
                         for n, c in ((H_TOPIC, "topic"), (H_DELIVER_AT, "deliver_at_ms"), (H_DELAY_MS, "delay_ms"),
                                      (H_ID, "id"), (H_PARTITION, "partition"))])
    # a cast of the whole array, not a lambda per header (interpreted per row)
    user = F.coalesce(F.map_entries("headers").cast(HEADERS), none)
    return F.concat(control, user)


#: A side of the bulk's joins at most this many rows is broadcast (its count is known first), so
#: the input's wide rows are not shuffled; a larger one is joined by a shuffle.
BROADCAST_ROWS = 200_000


def _small(df: Any, rows: int) -> Any:
    from pyspark.sql import functions as F

    return F.broadcast(df) if rows <= BROADCAST_ROWS else df


def judged(rows: Any, config: TimerConfig, now_ms: int) -> tuple[Any, list[Any]]:
    """(``rows`` with ``headers_out`` (the timer record's headers) and ``reason`` (null: valid);
    the caches it built, to unpersist when done).

    The verdicts are the parser's (``records.judged_requests``) on the records read back; only
    the refused rows' verdicts and the repeated ids' first rows are joined back to the input,
    each counted first and broadcast when small (the usual input: few refused, no id twice), so
    the input's wide rows are not shuffled (a join of every row's verdict by row and a window
    per id shuffled them twice: 3.3 s of the 1,000,000-row bench's 18)."""
    from pyspark.sql import functions as F

    with_headers = rows.withColumn("headers_out", timer_headers(rows))
    # read back as the timer topic's records are (one header map per row, Record.size)
    result = judged_requests(narrow(with_headers.select(
        F.lit(-1).alias("partition"), F.col("row").alias("offset"), F.lit(now_ms).cast("long").alias("timestamp_ms"),
        "key", "value", F.col("headers_out").alias("headers"))), config)
    refused = result.requests.filter(F.col("error").isNotNull()).select(F.col("offset").alias("row"), "error")
    if result.invalid is None:  # the parser ran: its verdicts kept for the join, counted
        refused = refused.persist()
        n_refused = refused.count()
    else:
        n_refused = result.invalid
    repeated = (rows.filter(F.col("id").isNotNull()).groupBy("id")
                .agg(F.min("row").alias("first_row"), F.count(F.lit(1)).alias("copies"))
                .filter(F.col("copies") > 1).select("id", "first_row").persist())
    n_repeated = repeated.count()
    j = (with_headers.join(_small(refused, n_refused), "row", "left")
         .join(_small(repeated, n_repeated), "id", "left")
         .withColumn("reason", F.when(F.col("id").isNull() | (F.col("id") == ""), F.lit("missing id"))
                     .when(F.col("error").isNotNull(), F.col("error"))
                     .when(F.col("first_row").isNotNull() & (F.col("row") != F.col("first_row")),
                           F.lit("id repeated in the input"))))
    return j, [result.cache, refused, repeated]


def main(path: str, fmt: str, rejects: str, config: TimerConfig, master: str) -> dict[str, int]:
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    existing = sp.kafka_topics(config)
    spark = sp.session(master, app="timerwheel-bulk-schedule")
    rows = read_rows(spark, path, fmt)
    j, cached = judged(rows, config, int(time.time() * 1000))
    timer = sp.read_topics(spark, config, [config.timer_topic] if config.timer_topic in existing else [])
    known = timer.select(last_header(H_ID).cast("string").alias("id")).filter(F.col("id").isNotNull()).distinct()
    # read and rejected observed on the rejects' write (one pass over every row), scheduled on the
    # Kafka write (the DataSource V2 sink reports observed metrics; the V1 sink reported none)
    seen, written = Observation("bulk"), Observation("bulk-scheduled")
    j.select("id", "topic", "key", "value", "deliver_at_ms", "delay_ms", "partition", "headers", "reason") \
        .observe(seen, F.count(F.lit(1)).alias("read"), F.count("reason").alias("rejected")) \
        .filter(F.col("reason").isNotNull()).write.mode("overwrite").parquet(rejects)
    fresh = j.filter(F.col("reason").isNull()).join(known, "id", "left_anti")
    sp.write_topic(fresh.select("key", "value", F.col("headers_out").alias("headers"))
                   .observe(written, F.count(F.lit(1)).alias("scheduled")), config, config.timer_topic)
    n = {name: int(v) for name, v in (seen.get | written.get).items()}
    for df in cached:
        df.unpersist()
    scheduled = n["scheduled"]
    counts = {"read": n["read"], "scheduled": scheduled, "rejected": n["rejected"],
              "already_scheduled": n["read"] - n["rejected"] - scheduled}
    log.info("bulk-schedule done", **counts)
    return counts
