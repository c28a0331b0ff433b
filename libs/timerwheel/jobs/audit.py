"""The delivery audit: what was scheduled (the timer topic) matched with what was delivered (the
destination topics), as the README's "Spark jobs" defines each figure.

- ``scheduled(requests)``: one row per message ``(id, revision)`` scheduled (its first record:
  lowest partition, offset), and the messages a cancel withdrew or a reschedule moved (the
  forecast's input): ``_messages_and_decided`` decides as the service does.
- ``destination_rows(raw)``: topic, id, revision, ``tw-delivered-at`` of each destination record.
- ``matched(requests, destination_rows, topics)``: the two side by side, one row per message: its
  first scheduled record, whether it was cancelled (or moved), its copies on its topic, and the
  deliveries nobody scheduled or without ``tw-id``.
- ``figures(matched, now_ms, grace_ms)``: the counts and nearest-rank lateness percentiles per
  topic and hour, per topic and in total, with the destinations' bad-input counts.

``main`` only reads Kafka, calls these and writes ``summary.json``, the Parquet lists and the PNG.
Bad input is counted, never fatal: records of the timer topic ``TimerRules`` refuses, destination
records without ``tw-id`` or with an unparsable ``tw-delivered-at``, topics that do not exist.

Cost: each topic is read once. The timer topic's read judges the destinations and caches compact
records; then one job reads the destinations, shuffles them with the cached records by id (the
one large shuffle) and aggregates in hash tables only; then small jobs and writes.
"""

from __future__ import annotations

import functools
import json
import operator
import os
import shutil
import time
from pathlib import Path
from typing import Any

from timerwheel.config import TimerConfig
from timerwheel.jobs import spark as sp
from timerwheel.jobs.plot import line_chart
from timerwheel.jobs.records import Judged, digits_as_long, header_map, judged_requests, last_header, narrow
from timerwheel.log import stage_logger
from timerwheel.wire import H_DELIVERED_AT, H_ID, H_REVISION

HOUR_MS = 3_600_000
FIGURES = ("scheduled", "cancelled", "delivered", "duplicated", "lost", "pending", "cancelled_delivered", "early")
PERCENTILES = {"p50": 0.5, "p95": 0.95, "p99": 0.99}
#: DIR/hourly/'s columns: per topic and hour of the delivery time, the figures.
HOURLY_COLUMNS = ("topic", "hour_ms", *FIGURES, *PERCENTILES, "max")
HOURLY_SCHEMA = ", ".join(f"`{c}` {'string' if c == 'topic' else 'double' if c in PERCENTILES else 'long'}"
                          for c in HOURLY_COLUMNS)

log = stage_logger("audit")


def _messages_and_decided(reqs: Any, order: Any) -> tuple[Any, Any]:
    """(the messages scheduled: id, revision, topic, deliver_ms, partition, o (their record's
    place, ``order``), one row per record; the revisions decided: id, revision, cancelled (true:
    a cancel, false: moved by a reschedule)) of ``requests`` rows, as the service decides (design
    6.1-6.2, README "Cancel and reschedule").

    A message is ``(id, revision)``. Revision 0 and the copies ``deliver_now`` appends are valid
    records that are neither cancels, reschedules nor roll hops. Of a revision's markers (cancels of
    it, reschedules of it: ``tw-replaces``, revision + 1) the first in its timer partition decides:
    a cancel withdraws it, a reschedule moves it, and the reschedule's revision is then scheduled at
    its new time; a later marker of the same revision is void. Markers are few (none when no record
    needed the service's parser): their aggregation is a small one beside the audit's shuffle."""
    from pyspark.sql import functions as F

    valid = reqs.filter(F.col("error").isNull() & (F.col("roll") == 0))
    cancel, moves = F.col("cancel"), F.col("replaces").isNotNull()
    plain = valid.filter(~cancel & ~moves).select("id", "revision", "topic", "deliver_ms", "partition",
                                                  order.alias("o"))
    markers = valid.filter(cancel | moves).select(
        "id", F.when(cancel, F.col("revision")).otherwise(F.col("revision") - 1).alias("revision"),
        F.struct(order.alias("o"), cancel.alias("cancelled"), F.col("revision").alias("next"), "topic", "deliver_ms",
                 "partition").alias("m"), order.alias("at"))
    first = markers.groupBy("id", "revision").agg(F.min_by("m", "at").alias("m"))
    moved_to = first.filter(~F.col("m.cancelled")).select("id", F.col("m.next").alias("revision"), "m.topic",
                                                            "m.deliver_ms", "m.partition", "m.o")
    return plain.unionByName(moved_to), first.select("id", "revision", F.col("m.cancelled").alias("cancelled"))


def scheduled(reqs: Any) -> tuple[Any, Any]:
    """(scheduled: id, revision, topic, deliver_ms, partition (the timer partition), one row per
    message; decided: id, revision of the messages a cancel withdrew or a reschedule moved) of
    ``requests`` rows (``_messages_and_decided``)."""
    from pyspark.sql import functions as F

    messages, decided = _messages_and_decided(reqs, _order(ANY_EXTENT)[0])
    first = F.min(F.struct("o", "topic", "deliver_ms", "partition"))
    sched = (messages.groupBy("id", "revision").agg(first.alias("f"))
             .select("id", "revision", "f.topic", "f.deliver_ms", "f.partition"))
    return sched, decided.select("id", "revision")


def destination_rows(raw: Any) -> Any:
    """topic, id (null: no ``tw-id``), revision (``tw-revision``, else 0), delivered_at (null: no
    parsable ``tw-delivered-at``) of each destination record: the headers read once, the key and
    value dropped."""
    from pyspark.sql import functions as F

    m = F.col("m")
    at = last_header(H_DELIVERED_AT, m).cast("string")
    revision = digits_as_long(last_header(H_REVISION, m).cast("string"), 18)
    return (raw.select("topic", header_map().alias("m"))
            .select("topic", last_header(H_ID, m).cast("string").alias("id"),
                    F.coalesce(revision, F.lit(0).cast("long")).alias("revision"),
                    digits_as_long(at, 18).alias("delivered_at")))


#: Up to this many topics ``matched`` aggregates by id once, two columns per topic (its copies and
#: first delivery); more, by (id, topic) and then by id. One level: 9.2 s -> 8.8 s of the audit
#: of 1,000,000 + 1,000,000 records on one topic (medians of four warm rounds, same process).
ONE_LEVEL_TOPICS = 4

#: (largest partition, largest offset) of a timer topic nobody measured: any Kafka's.
ANY_EXTENT = (2**31 - 1, 2**63 - 1)


def _order(extent: tuple[int, int]) -> tuple[Any, str]:
    """(a record's place in the timer topic, (partition, offset), as one number ordered as the
    pair; its type). Unlike a struct, a hash aggregation can keep a number (a ``min`` of a struct
    is a sort aggregation). A long, partition * 2^b + offset, when ``extent`` (the largest
    partition and offset) fits in 63 bits; else a decimal(38,0) with b = 63 (slower: 1.2 s more at
    1,000,000 records)."""
    from pyspark.sql import functions as F

    partition, offset = extent
    bits = max(offset.bit_length(), 1)
    if partition.bit_length() + bits <= 63:
        return F.shiftleft(F.col("partition").cast("long"), bits) + F.col("offset"), "long"
    big = "decimal(38,0)"
    return F.col("partition").cast(big) * F.lit(str(2**63)).cast(big) + F.col("offset").cast(big), big


def matched(reqs: Any, dest: Any, topics: list[str], extent: tuple[int, int] = ANY_EXTENT) -> Any:
    """What was scheduled side by side with what was delivered, by message ``(id, revision)``, in
    one shuffle: one row per message, with id, revision, topic, deliver_ms, hour_ms, cancelled (a
    cancel withdrew it or a reschedule moved it), copies (0: none), first_delivered_at,
    lateness_ms, unknown (the (topic, message) pairs delivered that nobody scheduled: another topic
    than the message's, or a message never scheduled), without_id (copies without ``tw-id``: one
    row, id null). deliver_ms is null for a message nobody scheduled; its topic then is null too.

    ``reqs``: ``requests`` rows; ``dest``: ``destination_rows``; ``topics``: every topic of
    either (the scheduled records' destinations and the topics read); ``extent``: the largest
    partition and offset of ``reqs`` (``Judged.extent``).

    Scheduled messages and the decisions on them (``_messages_and_decided``) and deliveries are one
    union, shuffled once by id and counted per message (per topic in columns when there are at
    most ``ONE_LEVEL_TOPICS``, else per (message, topic) first): its first scheduled record (lowest
    partition, offset) gives its topic and delivery time, the deliveries on that topic are its
    copies. Topics are numbered on the way (a broadcast of ``topics``) so that every
    aggregation keeps numbers only and hashes (a join of the two sides and a ``min`` of a struct
    sorted them: 3.7 s of the 1,000,000 audit's 14.9)."""
    from pyspark.sql import functions as F

    spark = reqs.sparkSession
    numbers = F.broadcast(spark.createDataFrame(list(enumerate(topics)), "t int, topic string"))
    order, order_type = _order(extent)
    messages, decided = _messages_and_decided(reqs, order)

    def rows(df: Any, t: Any, o: Any, v: Any, k: int) -> Any:
        # k: 0 a scheduled message (o its place, v its delivery time), 1 a cancel or a move of it,
        # 2 a delivery (v its tw-delivered-at); one narrow row each, for the one shuffle
        return df.select("id", F.col("revision").cast("long").alias("revision"), t.cast("int").alias("t"),
                         o.cast(order_type).alias("o"), v.cast("long").alias("v"), F.lit(k).cast("byte").alias("k"))

    none = F.lit(None)
    union = (rows(messages.join(numbers, "topic"), F.col("t"), F.col("o"), F.col("deliver_ms"), 0)
             .unionByName(rows(decided, none, none, none, 1))
             .unionByName(rows(dest.join(numbers, "topic"), F.col("t"), none, F.col("delivered_at"), 2)))
    k, t, v = F.col("k"), F.col("t"), F.col("v")
    if len(topics) <= ONE_LEVEL_TOPICS:
        # one aggregation: each topic's copies and first delivery in columns of their own, the
        # id's topic (its first scheduled record's) picks its pair after
        counts = [F.count(F.when((k == 2) & (t == i), 1)) for i in range(len(topics))]
        firsts = [F.min(F.when((k == 2) & (t == i), v)) for i in range(len(topics))]
        agg = (union.repartition("id").groupBy("id", "revision")
               .agg(F.min("o").alias("o"), F.min_by("t", "o").alias("t"), F.min_by("v", "o").alias("deliver_ms"),
                    F.count(F.when(k == 1, 1)).alias("cancels"), F.count(F.when(k == 2, 1)).alias("all_copies"),
                    F.array(*counts).alias("cs"), F.array(*firsts).alias("fs")))
        per_id = agg.select("id", "revision", "o", "t", "deliver_ms", "cancels", "all_copies",
                            F.element_at("cs", t + 1).alias("copies"), F.element_at("fs", t + 1).alias("first_delivered_at"),
                            F.size(F.array_remove("cs", 0)).alias("pairs"))
    else:  # per (id, topic), then per id
        per_topic = (union.repartition("id").groupBy("id", "revision", "t")
                     .agg(F.min("o").alias("o"), F.min_by(F.when(k == 0, v), "o").alias("deliver_ms"),
                          F.count(F.when(k == 1, 1)).alias("cancels"), F.count(F.when(k == 2, 1)).alias("copies"),
                          F.min(F.when(k == 2, v)).alias("at")))
        per_id = per_topic.groupBy("id", "revision").agg(  # the same partitioning by id: no second shuffle
            F.min("o").alias("o"), F.min_by("t", "o").alias("t"), F.min_by("deliver_ms", "o").alias("deliver_ms"),
            F.min_by("copies", "o").alias("copies"), F.min_by("at", "o").alias("first_delivered_at"),
            F.sum("cancels").alias("cancels"), F.count(F.when(F.col("copies") > 0, 1)).alias("pairs"),
            F.sum("copies").alias("all_copies"))
    # min_by's value where no row has an ordering is not null (Spark 4.2): kept only if known
    known = F.col("o").isNotNull()

    def of_first(col: Any) -> Any:
        return F.when(known, col)

    copies = F.coalesce(of_first(F.col("copies")), F.lit(0)).cast("long")
    first_at = of_first(F.col("first_delivered_at"))
    return per_id.select(
        "id", "revision", of_first(F.element_at(F.array(*[F.lit(t) for t in topics]), F.col("t") + 1)).alias("topic"),
        of_first(F.col("deliver_ms")).alias("deliver_ms"),
        (F.floor(of_first(F.col("deliver_ms")) / HOUR_MS) * HOUR_MS).cast("long").alias("hour_ms"),
        (F.col("cancels") > 0).alias("cancelled"), copies.alias("copies"), first_at.alias("first_delivered_at"),
        (first_at - F.col("deliver_ms")).alias("lateness_ms"),
        F.when(F.col("id").isNotNull(), F.col("pairs") - F.when(copies > 0, 1).otherwise(0)).otherwise(0)
        .cast("long").alias("unknown"),
        F.when(F.col("id").isNull(), F.col("all_copies")).otherwise(0).cast("long").alias("without_id"))


def _rank(q: float, n: str) -> Any:
    """The nearest rank of quantile ``q`` among column ``n``'s count of values, ceil(q * n), in
    integers (exact)."""
    from fractions import Fraction

    from pyspark.sql import functions as F

    f = Fraction(str(q))
    return F.expr(f"({n} * {f.numerator} + {f.denominator - 1}) div {f.denominator}")


def figures(j: Any, now_ms: int, grace_ms: int) -> Any:
    """The audit's figures per topic and hour, per topic and in total, from one aggregation of
    ``matched``'s rows: columns topic, hour_ms, level ("hour", "topic" or "total"), the figures,
    and the deliveries without ``tw-id`` and of unknown ids. A level's row whose ``scheduled`` is
    0 holds only the latter (rows of ids nobody scheduled).

    ``matched``'s rows are counted once, by topic, hour and lateness (a hash aggregation: every
    figure is a sum, the lateness a key). The levels and the nearest-rank percentiles come from
    that histogram, a few rows per distinct lateness: a running count per level, the percentile
    the smallest lateness whose count reaches its rank. (Three ``percentile_disc`` over a rollup
    kept every lateness of every level in memory and sorted it: 2x the Kafka read at 1,000,000.)"""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    known = F.col("deliver_ms").isNotNull()
    was = known & (F.col("copies") > 0)
    open_ = known & ~F.col("cancelled") & (F.col("copies") == 0)
    due = F.col("deliver_ms") <= F.lit(now_ms - grace_ms)

    def count(cond: Any) -> Any:
        return F.sum(F.when(cond, 1).otherwise(0)).cast("long")

    counts = {
        "scheduled": F.count("deliver_ms"),
        "cancelled": count(known & F.col("cancelled")),
        "delivered": count(was),
        "duplicated": F.sum(F.when(known, F.greatest(F.col("copies") - 1, F.lit(0))).otherwise(0)).cast("long"),
        "lost": count(open_ & due),
        "pending": count(open_ & ~due),
        "cancelled_delivered": count(F.col("cancelled") & was),
        "early": count(was & (F.col("lateness_ms") < 0)),
        "without_id": F.sum("without_id").cast("long"),
        "unknown_ids": F.sum("unknown").cast("long"),
        "n": F.count("lateness_ms"),  # the percentiles' population
    }
    hist = j.groupBy("topic", "hour_ms", "lateness_ms").agg(*[agg.alias(name) for name, agg in counts.items()])
    keys = ["topic", "hour_ms", "lateness_ms"]
    sums = [F.sum(name).cast("long").alias(name) for name in counts]
    levels = (hist.groupingSets([keys, ["topic", "lateness_ms"], ["lateness_ms"]], *keys)
              .agg(*sums, F.grouping("topic").alias("gt"), F.grouping("hour_ms").alias("gh")))
    group = ["gt", "gh", "topic", "hour_ms"]
    running = Window.partitionBy(*group).orderBy("lateness_ms").rowsBetween(Window.unboundedPreceding, 0)
    whole = Window.partitionBy(*group)
    ranked = levels.withColumn("below", F.sum("n").over(running)).withColumn("of", F.sum("n").over(whole))
    late = F.col("lateness_ms").isNotNull() & (F.col("n") > 0)
    pcts = [F.min(F.when(late & (F.col("below") >= _rank(q, "of")), F.col("lateness_ms")))
            .cast("double").alias(name) for name, q in PERCENTILES.items()]
    return (ranked.groupBy(*group)
            .agg(*[F.sum(name).cast("long").alias(name) for name in counts if name != "n"], *pcts,
                 F.max(F.when(late, F.col("lateness_ms"))).alias("max"))
            .withColumn("level", F.when(F.col("gt") == 1, "total").when(F.col("gh") == 1, "topic").otherwise("hour"))
            .drop("gt", "gh"))


def _as_summary(row: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: int(row[k] or 0) for k in FIGURES}
    out["lateness_ms"] = {k: (None if row[k] is None else int(row[k])) for k in (*PERCENTILES, "max")}
    return out


def timer_requests(raw_timer: Any, config: TimerConfig) -> Judged:
    """``judged_requests`` of the timer topic's Kafka rows. Its requests are persisted when some
    record needs the service's parser (a UDF, read by several actions then); when none does they
    are left uncached: one plan then reads them once from the compact cache."""
    judged = judged_requests(narrow(raw_timer), config)
    return judged if judged.destinations is not None else judged._replace(requests=judged.requests.persist())


def audit(reqs: Any, raw_dest: Any, now_ms: int, grace_ms: int, topics: list[str], *,
          invalid: int | None = None, extent: tuple[int, int] = ANY_EXTENT) -> dict[str, Any]:
    """The audit: total and topics (summary.json's dicts), joined (``matched``'s rows of the
    scheduled ids, not persisted: ``_write_lists`` reads them again when a list is not empty), hourly
    (rows of ``figures``' hour level) and the bad-input counts. Pure: ``reqs`` from
    ``timer_requests`` (``invalid``: its count of invalid records when it knows it; ``extent``:
    its largest partition and offset), ``raw_dest`` Kafka rows of the destinations
    (``spark.read_topics``), ``topics`` every destination of ``reqs`` and every topic of
    ``raw_dest``.

    One Spark action reads the destinations, matches them with the scheduled records and
    aggregates: every level's figures and the destinations' bad-input counts. The matched rows
    are not cached: a healthy audit (no lost, duplicated or cancelled-delivered id) reads them
    only there (a cache of them cost 0.5 s of the 1,000,000 audit's 11)."""
    from pyspark.sql import functions as F

    j_all = matched(reqs, destination_rows(raw_dest), topics, extent)
    levels = [r.asDict() for r in figures(j_all, now_ms, grace_ms).collect()]
    hourly = [r for r in levels if r["level"] == "hour" and r["scheduled"] > 0]
    (total,) = [r for r in levels if r["level"] == "total"] or [{k: None for k in (*FIGURES, *PERCENTILES, "max",
                                                                                   "without_id", "unknown_ids")}]
    per_topic = {r["topic"]: _as_summary(r) for r in levels if r["level"] == "topic" and r["scheduled"] > 0}
    bad = {
        "invalid_timer_records": invalid if invalid is not None else reqs.filter(F.col("error").isNotNull()).count(),
        "deliveries_without_id": int(total["without_id"] or 0),
        "deliveries_of_unknown_ids": int(total["unknown_ids"] or 0),
    }
    j = j_all.filter(F.col("deliver_ms").isNotNull())
    return {"total": _as_summary(total), "topics": per_topic, "joined": j, "hourly": hourly, "bad_input": bad}


def _write_held(path: Path, rows: list[tuple[Any, ...]], schema: Any) -> None:
    """``rows`` the driver holds (``schema``: Spark's) as a Parquet directory such as Spark writes
    (one part file and ``_SUCCESS``, anything there before replaced), written by pyarrow: a Spark
    write is a job each, 0.6 s of the 1,000,000 audit for its four small or empty directories."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.sql.pandas.types import to_arrow_schema

    arrow = to_arrow_schema(schema)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([dict(zip(arrow.names, r, strict=True)) for r in rows], schema=arrow),
                   path / "part-00000.parquet")
    (path / "_SUCCESS").touch()


def _write_lists(joined: Any, total: dict[str, Any], due_ms: int, outdir: Path) -> None:
    """DIR/lost/, DIR/duplicated/, DIR/cancelled_delivered/ of ``joined`` (``audit``'s); an empty
    one (``total``, the summary's, counts it) is written without a scan. When some list is not
    empty the matched rows are read again (the destinations' scan and the shuffle; the timer
    records' compact cache is still there), once for all the lists that are not empty."""
    from pyspark.sql import functions as F

    cols = ["id", "revision", "topic", "deliver_ms", "cancelled", "copies", "first_delivered_at", "lateness_ms"]
    open_due = ~F.col("cancelled") & (F.col("copies") == 0) & (F.col("deliver_ms") <= F.lit(due_ms))
    lists = {"lost": open_due, "duplicated": F.col("copies") > 1,
             "cancelled_delivered": F.col("cancelled") & (F.col("copies") > 0)}
    full = [name for name in lists if total[name]]
    rows = joined.select(*cols)
    if len(full) > 1:  # one read of the matched rows for every list
        rows = rows.filter(functools.reduce(operator.or_, [lists[name] for name in full])).persist()
    for name, cond in lists.items():
        if name in full:
            rows.filter(cond).write.mode("overwrite").parquet(str(outdir / name))
        else:
            _write_held(outdir / name, [], rows.schema)
    rows.unpersist()


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
    judged = timer_requests(timer, config)
    reqs, destinations = judged.requests, judged.destinations
    if destinations is None:
        destinations = sorted(r[0] for r in reqs.filter(F.col("topic").isNotNull() & F.col("error").isNull())
                              .select("topic").distinct().collect())
    topics = destinations if topics is None else topics
    unknown = sorted(set(topics) - existing)
    dest = sp.read_topics(spark, config, [t for t in topics if t in existing])
    result = audit(reqs, dest, now, grace_ms, sorted({*destinations, *topics}), invalid=judged.invalid,
                   extent=judged.extent)
    summary = {"now_ms": now, "grace_ms": grace_ms, "dead_lettered": dlq.count(), "total": result["total"],
               "topics": result["topics"], "bad_input": {**result["bad_input"], "unknown_topics": unknown}}
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    _write_lists(result["joined"], summary["total"], now - grace_ms, outdir)
    import pandas as pd

    hourly = [tuple(r[c] for c in HOURLY_COLUMNS) for r in result["hourly"]]
    _write_held(outdir / "hourly", hourly, spark.createDataFrame([], HOURLY_SCHEMA).schema)
    _plot(pd.DataFrame(hourly, columns=list(HOURLY_COLUMNS)), outdir / "lateness.png")
    tmp = outdir / f".summary.json.{os.getpid()}"
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    tmp.replace(outdir / "summary.json")
    judged.cache.unpersist()
    log.info("audit done", out=str(outdir), scheduled=summary["total"]["scheduled"], lost=summary["total"]["lost"])
    return summary
