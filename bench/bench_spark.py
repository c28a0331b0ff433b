"""The Spark jobs: the audit of N scheduled + N delivered records against a plain Spark read of
the same topics and the least join of them (one shuffle by id, a count per side), and bulk scheduling of N rows against a plain Spark Kafka write of them (ratios,
same run, same session).

Size: ``TW_BENCH_SPARK_N`` (default 200,000; the issue's size is 1,000,000). Rounds:
``TW_BENCH_SPARK_ROUNDS`` (default 2; the figures are the last round's, the first pays the JVM's
warm-up). Kafka: ``TW_KAFKA_BOOTSTRAP``, else ``scripts/kafka.sh up``'s broker. Spark:
``local[*]`` (``TW_BENCH_SPARK_MASTER``). Each figure line carries the load average at its end
(the machine is shared).
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from typing import Any

from bench.bench_production import servers
from bench.common import emit, say


def _timed(what: str, fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    s = time.perf_counter() - t0
    say(f"{what}: {s:.1f} s")
    return s


def header(key: str, value: Any) -> Any:
    """A Kafka header of Spark's Kafka sink: ``key`` and the column ``value`` as text."""
    from pyspark.sql import functions as F

    return F.struct(F.lit(key).alias("key"), value.cast("string").cast("binary").alias("value"))


def fill(spark: Any, kcfg: Any, n: int, timer: str, dest: str, since_ms: int, span_ms: int) -> Any:
    """N timer records on ``timer`` (ids m0, m1, ..., due from ``since_ms`` over ``span_ms``, 100-byte
    values) and a delivery of each on ``dest``, written through Spark's Kafka sink; returns the
    ids' frame (mid, id)."""
    from pyspark.sql import functions as F
    from timerwheel.jobs.spark import write_topic

    ids = spark.range(n).select(F.concat(F.lit("m"), F.col("id")).alias("mid"), F.col("id"))
    deliver = F.lit(since_ms) + F.col("id") % span_ms
    key, value = F.col("mid").cast("binary").alias("key"), F.lit(b"x" * 100).alias("value")
    write_topic(ids.select(key, value, F.array(header("tw-topic", F.lit(dest)), header("tw-deliver-at", deliver),
                                               header("tw-id", F.col("mid"))).alias("headers")), kcfg, timer)
    write_topic(ids.select(key, value, F.array(header("tw-id", F.col("mid")),
                                               header("tw-delivered-at", deliver + F.col("id") % 500))
                           .alias("headers")), kcfg, dest)
    return ids


def main() -> None:
    from pyspark.sql import functions as F
    from timerwheel.config import TimerConfig
    from timerwheel.jobs import audit, bulk
    from timerwheel.jobs.spark import read_topics, session, write_topic

    n = int(os.environ.get("TW_BENCH_SPARK_N", "200000"))
    master = os.environ.get("TW_BENCH_SPARK_MASTER", "local[*]")
    kafka, _ = servers(("kafka",))
    spark = session(master, app="timerwheel-bench")
    kcfg = TimerConfig(kafka_bootstrap=kafka)
    tag = uuid.uuid4().hex[:8]
    timer, dest, plain = f"bench-spark-timer-{tag}", f"bench-spark-dest-{tag}", f"bench-spark-plain-{tag}"
    now = int(time.time() * 1000)

    say(f"filling {n:,} timer records and {n:,} deliveries")
    ids = fill(spark, kcfg, n, timer, dest, now - 3_600_000, 3_600_000)

    def plain_read() -> None:
        df = read_topics(spark, kcfg, [timer, dest])
        df.agg(F.sum(F.length("value")), F.sum(F.size("headers")), F.max("offset")).collect()

    def least_join() -> None:
        # the least any audit does: one scan of both topics, the id from the headers, one shuffle by
        # id and a count per id and side (no rules, times, topics or lists): the floor beside the
        # audit's own figure
        df = read_topics(spark, kcfg, [timer, dest]).select(
            "topic", F.map_from_entries("headers")["tw-id"].cast("string").alias("id"))
        side = {name: F.count(F.when(F.col("topic") == t, 1)).alias(name) for name, t in (("s", timer), ("d", dest))}
        per_id = df.groupBy("id").agg(*side.values())
        per_id.agg(F.sum("s"), F.sum("d"), F.count(F.when(F.col("d") == 0, 1))).collect()

    out = tempfile.mkdtemp(prefix="bench-audit-")
    cfg = TimerConfig(timer_topic=timer, kafka_bootstrap=kafka)

    # Side by side, alternating: a plain read, the least join, the audit, a plain read; the ratios
    # are to the mean of the two reads around them.
    rounds = int(os.environ.get("TW_BENCH_SPARK_ROUNDS", "2"))
    for r in range(1, rounds + 1):
        read_before = _timed(f"round {r}: plain read of both topics", plain_read)
        floor_s = _timed(f"round {r}: least join of both topics", least_join)
        audit_s = _timed(f"round {r}: audit", lambda: audit.main(os.path.join(out, "audit"), cfg, None, 60_000,
                                                                  now, master))
        read_after = _timed(f"round {r}: plain read of both topics", plain_read)
    read_s = (read_before + read_after) / 2
    emit("spark_audit", 2 * n / audit_s, "records/s", records=2 * n, wall_s=round(audit_s, 1),
         plain_read_s=[round(read_before, 1), round(read_after, 1)], ratio_to_read=round(audit_s / read_s, 2),
         least_join_s=round(floor_s, 1), least_join_ratio_to_read=round(floor_s / read_s, 2),
         rounds=rounds, load_average=[round(x, 1) for x in os.getloadavg()])

    rows = os.path.join(out, "rows.parquet")
    ids.select(F.col("mid").alias("id"), F.lit(dest).alias("topic"), F.col("mid").cast("binary").alias("key"),
               F.lit(b"x" * 100).alias("value"),
               (F.lit(now + 3_600_000) + F.col("id") % 3_600_000).cast("string").alias("deliver_at_ms")) \
        .write.parquet(rows)
    bcfg = TimerConfig(timer_topic=f"bench-spark-bulk-{tag}", kafka_bootstrap=kafka)

    def plain_write() -> None:
        df = spark.read.parquet(rows)
        write_topic(df.select("key", "value", F.array(header("tw-topic", F.col("topic")),
                                                      header("tw-deliver-at", F.col("deliver_at_ms")),
                                                      header("tw-id", F.col("id"))).alias("headers")), kcfg, plain)

    write_s = _timed("plain Spark Kafka write", plain_write)
    bulk_s = _timed("bulk-schedule", lambda: bulk.main(rows, "parquet", os.path.join(out, "rejects"), bcfg,
                                                        master))
    emit("spark_bulk", n / bulk_s, "rows/s", rows=n, wall_s=round(bulk_s, 1), plain_write_s=round(write_s, 1),
         ratio_to_write=round(bulk_s / write_s, 2), load_average=[round(x, 1) for x in os.getloadavg()])
