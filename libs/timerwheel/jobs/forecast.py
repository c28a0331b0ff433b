"""The load forecast: messages due per minute ahead, per destination topic and per shard.

``due_per_minute(sched, cancels, now_ms, hours, shards)`` counts what is scheduled, not cancelled
and due in ``(now, now + hours]`` by minute of its delivery time (shard: timer partition % shards,
as the service assigns them). ``main`` reads the timer topic and writes ``DIR/minutes/`` (Parquet:
topic, shard, minute_ms, due), ``DIR/forecast.png`` and ``DIR/peak.json`` (the busiest minute).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from timerwheel.config import TimerConfig
from timerwheel.jobs import spark as sp
from timerwheel.jobs.audit import scheduled, timer_requests
from timerwheel.jobs.plot import line_chart
from timerwheel.log import stage_logger

MINUTE_MS = 60_000

log = stage_logger("forecast")


def due_per_minute(sched: Any, cancels: Any, now_ms: int, hours: int, shards: int) -> Any:
    """topic, shard, minute_ms, due of ``scheduled``'s rows."""
    from pyspark.sql import functions as F

    ahead = sched.join(cancels, ["id", "revision"], "left_anti").filter(
        (F.col("deliver_ms") > F.lit(now_ms)) & (F.col("deliver_ms") <= F.lit(now_ms + hours * 3_600_000)))
    return (ahead.select("topic", (F.col("partition") % F.lit(shards)).alias("shard"),
                         (F.floor(F.col("deliver_ms") / MINUTE_MS) * MINUTE_MS).cast("long").alias("minute_ms"))
            .groupBy("topic", "shard", "minute_ms").agg(F.count(F.lit(1)).alias("due")))


def _plot(per_minute: Any, path: Path) -> None:
    by_topic = per_minute.groupby(["topic", "minute_ms"], as_index=False)["due"].sum()
    series = [(str(topic), [time.strftime("%m-%d %H:%M", time.gmtime(m / 1000)) for m in rows["minute_ms"]],
               rows["due"], "-") for topic, rows in by_topic.sort_values("minute_ms").groupby("topic")]
    line_chart(series, "minute (UTC)", "messages due", "timerwheel: messages due per minute", path)


def main(out: str, config: TimerConfig, hours: int, now_ms: int | None, master: str) -> dict[str, Any]:
    existing = sp.kafka_topics(config)
    now = int(time.time() * 1000) if now_ms is None else now_ms
    spark = sp.session(master, app="timerwheel-forecast")
    timer = sp.read_topics(spark, config, [config.timer_topic] if config.timer_topic in existing else [])
    sched, cancels = scheduled(timer_requests(timer, config).requests)
    minutes = due_per_minute(sched, cancels, now, hours, config.shards).persist()
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    minutes.write.mode("overwrite").parquet(str(outdir / "minutes"))
    pdf = minutes.toPandas()
    _plot(pdf, outdir / "forecast.png")
    total = pdf.groupby("minute_ms")["due"].sum() if len(pdf) else None
    peak = {"now_ms": now, "hours": hours, "due": int(pdf["due"].sum()) if len(pdf) else 0,
            "peak_minute_ms": int(total.idxmax()) if total is not None else None,
            "peak_due": int(total.max()) if total is not None else 0}
    (outdir / "peak.json").write_text(json.dumps(peak, sort_keys=True) + "\n")
    log.info("forecast done", out=str(outdir), **peak)
    return peak
