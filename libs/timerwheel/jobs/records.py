"""Timer-topic records as the service reads them, in Spark: the one ``TimerRules``, two paths.

``requests(narrow, config)`` gives each record's verdict and normalised request, exactly what
``TimerRules.parse`` gives (tests/jobs/test_records.py checks the two agree on generated records,
edge cases included):

- The common record (what ``TimerRules.common`` accepts: an absolute ``tw-deliver-at``, none of the other control headers, size, id and max delay within the limits, an
  allowed destination) is read by Spark SQL expressions, with no Python per row. The headers are
  read as one map (``header_map``: code Spark compiles), not by a lambda per header.
- Every other record (cancels, roll hops, ``tw-delay-ms``, ``tw-delay-level``, anything invalid or
  odd) goes through ``TimerRules.parse_sized`` in a pandas UDF; when there is none (found in the
  same pass that collects the destinations), the UDF branch is left out of the plan.
- Destinations are few: the distinct ``tw-topic`` values are judged on the driver by
  ``TimerRules.destination_error`` (allow-list, topic names, not the timer topic) and joined back.

The record's own timestamp stands for "now" in the max-delay check (the service checks against
its clock when it reads the record, moments later). Only the control headers and the size are
kept (``narrow``), so the key, value and user headers are read once and dropped.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from timerwheel.config import TimerConfig
from timerwheel.wire import (
    H_CANCEL,
    H_DELAY_LEVEL,
    H_DELAY_MS,
    H_DELIVER_AT,
    H_ENQUEUED_AT,
    H_ID,
    H_PARTITION,
    H_ROLL,
    H_TOPIC,
    MAX_EPOCH_MS,
    MAX_ID_BYTES,
)

#: The control headers ``parse`` reads, as the fields of the ``h`` struct column (``-`` -> ``_``).
CONTROL = (H_TOPIC, H_DELIVER_AT, H_DELAY_MS, H_DELAY_LEVEL, H_ID, H_CANCEL, H_PARTITION, H_ROLL, H_ENQUEUED_AT)
#: Those that take ``parse`` off its short path (wire._FULL_PARSE).
_OFF_COMMON = (H_DELAY_MS, H_DELAY_LEVEL, H_CANCEL, H_PARTITION, H_ROLL, H_ENQUEUED_AT)
#: MAX_EPOCH_MS has 15 digits: a longer number (leading zeros aside) is out of range.
_COMMON_DIGITS = len(str(MAX_EPOCH_MS))


def field(header: str) -> str:
    return header.replace("-", "_")


#: The session setting ``header_map`` needs (``spark.session`` sets it): a repeated header keeps
#: its last value, as ``dict(record.headers)`` does, where Spark's default refuses the record.
MAP_KEY_DEDUP = ("spark.sql.mapKeyDedupPolicy", "LAST_WIN")


def header_map() -> Any:
    """The ``headers`` column (array of key, value) as a map, the last value of a repeated key
    kept. One compiled expression per record; a ``filter`` lambda per header is interpreted, per
    record and header (it took the timer topic's read from 1.5 s to 5 s at 200,000 records)."""
    from pyspark.sql import functions as F

    return F.map_from_entries("headers")


def last_header(name: str, headers: Any = None) -> Any:
    """The last value of header ``name`` (null if absent, empty if Kafka's is null: the service's
    transport reads it so), as ``dict(record.headers)`` keeps it; ``headers``: a ``header_map``
    column already selected (several headers read from one map)."""
    from pyspark.sql import functions as F

    m = header_map() if headers is None else headers
    return F.when(F.map_contains_key(m, F.lit(name)), F.coalesce(m[F.lit(name)], F.lit(bytearray())))


def narrow(raw: Any) -> Any:
    """partition, offset, timestamp_ms, size (``Record.size``), h (the control headers) of raw
    Kafka rows (``spark.read_topics``)."""
    from pyspark.sql import functions as F

    size = (F.coalesce(F.octet_length("key"), F.lit(0)) + F.coalesce(F.octet_length("value"), F.lit(0))
            + F.aggregate("headers", F.lit(0), lambda acc, h: acc + F.char_length(h["key"])
                          + F.coalesce(F.octet_length(h["value"]), F.lit(0))))
    # two projections: the map is built once per record, then read nine times
    return (raw.select("partition", "offset", "timestamp_ms", size.cast("long").alias("size"), header_map().alias("m"))
            .select("partition", "offset", "timestamp_ms", "size",
                    F.struct(*[last_header(h, F.col("m")).alias(field(h)) for h in CONTROL]).alias("h")))


RESULT_FIELDS = "error string, cancel boolean, id string, topic string, deliver_ms long, roll long"


def _verdicts(spark: Any, narrowed: Any, config: TimerConfig, common_but_topic: Any) -> tuple[Any, bool, list[str]]:
    """(raw tw-topic -> (verdict, decoded topic) for each distinct value, judged by TimerRules;
    whether every record is common; the allowed topics, sorted). One pass over ``narrowed``: per
    distinct tw-topic, how many of its records fail ``common_but_topic`` (the short path's tests
    other than the destination's)."""
    from pyspark.sql import functions as F

    from timerwheel.wire import TimerRules

    rules = TimerRules(config)
    topic = F.col(f"h.{field(H_TOPIC)}")
    per_topic = (narrowed.groupBy(topic.alias("t"))
                 .agg(F.count(F.when(~F.coalesce(common_but_topic, F.lit(False)), 1)).alias("odd")).collect())
    judged, all_common = [], True
    for raw, odd in per_topic:
        if raw is None:
            all_common = False
            continue
        name = bytes(raw).decode("utf-8", "replace")
        verdict = rules.destination_error(name)
        judged.append((bytes(raw), verdict, name))
        all_common = all_common and odd == 0 and verdict == ""
    allowed = sorted(name for _, verdict, name in judged if verdict == "")
    return spark.createDataFrame(judged, "topic_raw binary, verdict string, topic_name string"), all_common, allowed


def _parse_udf(config: TimerConfig) -> Any:
    from pyspark.sql.pandas.functions import pandas_udf

    names = [field(h) for h in CONTROL]

    @pandas_udf(RESULT_FIELDS)  # type: ignore[call-overload,untyped-decorator]  # a struct result: not in its overloads
    def parse(partition: pd.Series, offset: pd.Series, ts: pd.Series, size: pd.Series, h: pd.DataFrame) -> pd.DataFrame:
        from timerwheel.errors import InvalidTimerMessage
        from timerwheel.records import Record
        from timerwheel.wire import TimerRules

        rules = TimerRules(config)
        out: list[tuple[Any, ...]] = []
        columns = [h[n].tolist() for n in names]
        for i, (p, o, t, s) in enumerate(zip(partition.tolist(), offset.tolist(), ts.tolist(), size.tolist(), strict=True)):
            hdr = {name: bytes(col[i]) for name, col in zip(CONTROL, columns, strict=True) if col[i] is not None}
            record = Record("", int(p), int(o), int(t), None, None, tuple(hdr.items()))
            try:
                req = rules.parse_sized(record, int(t), hdr, int(s))
            except InvalidTimerMessage as exc:
                out.append((exc.reason, None, None, None, None, None))
                continue
            out.append((None, req.cancel, req.message_id, req.topic or None, req.deliver_ms, req.roll))
        return pd.DataFrame(out, columns=["error", "cancel", "id", "topic", "deliver_ms", "roll"])

    return parse


def requests(narrowed: Any, config: TimerConfig, *, short_cut: bool = True) -> Any:
    """partition, offset, timestamp_ms, error (null when valid), cancel, id (the message id, or
    the cancelled one's), topic (null for a cancel), deliver_ms, roll: ``TimerRules.parse`` of
    every record of ``narrowed`` (``narrow``'s columns). Cache ``narrowed`` first: it is read twice.
    When every record is common there is no UDF branch (``short_cut=False`` keeps it: the bench's
    "before")."""
    return judged_requests(narrowed, config, short_cut=short_cut)[0]


def judged_requests(narrowed: Any, config: TimerConfig, *, short_cut: bool = True) -> tuple[Any, list[str] | None]:
    """(``requests``, the sorted destinations of its records when every record is common, else
    None). Every common record is valid, so then the destinations are the allowed ``tw-topic``
    values, known from the pass that judged them: no Spark job needed to list them."""
    from pyspark.sql import functions as F

    spark = narrowed.sparkSession
    h = {name: F.col(f"h.{field(name)}") for name in CONTROL}
    at = h[H_DELIVER_AT].cast("string")
    raw_id = h[H_ID]
    # TimerRules.common takes a run of at most 20 ASCII digits (int() of it; a longer one, even
    # zero-padded, is refused by parse's grammar): leading zeros stripped, a value of more than
    # 15 digits is past MAX_EPOCH_MS and goes to parse for its reason.
    digits = F.regexp_replace(at, "^0+", "")
    deliver = F.when(digits == "", F.lit(0).cast("long")).otherwise(digits.try_cast("long"))
    off_common_absent = F.lit(True)
    for name in _OFF_COMMON:
        off_common_absent = off_common_absent & h[name].isNull()
    common_but_topic = (
        F.coalesce(at.rlike("^[0-9]{1,20}$") & (F.length(digits) <= _COMMON_DIGITS), F.lit(False))
        & off_common_absent
        & (F.col("size") <= F.lit(config.max_record_bytes))
        & (deliver <= F.lit(MAX_EPOCH_MS))
        & (deliver - F.col("timestamp_ms") <= F.lit(config.max_delay_ms))
        & (raw_id.isNull() | ((F.octet_length(raw_id) > 0) & (F.octet_length(raw_id) <= MAX_ID_BYTES)
                              & F.is_valid_utf8(raw_id.cast("string"))))
    )
    verdicts, all_common, destinations = _verdicts(spark, narrowed, config, common_but_topic)
    joined = narrowed.join(F.broadcast(verdicts), h[H_TOPIC] == verdicts["topic_raw"], "left")
    common = F.col("verdict").eqNullSafe("") & common_but_topic
    keys = ["partition", "offset", "timestamp_ms"]
    fast = joined.filter(common).select(
        *keys,
        F.lit(None).cast("string").alias("error"),
        F.lit(False).alias("cancel"),
        F.coalesce(raw_id.cast("string"), F.concat_ws("-", "partition", "offset")).alias("id"),
        F.col("topic_name").alias("topic"),
        deliver.alias("deliver_ms"),
        F.lit(0).cast("long").alias("roll"),
    )
    if all_common and short_cut:
        # No record for the UDF: its branch would still start a Python worker per partition and
        # scan the records a second time.
        return fast, destinations
    parse = _parse_udf(config)
    slow = (joined.filter(~F.coalesce(common, F.lit(False)))
            .select(*keys, parse("partition", "offset", "timestamp_ms", "size", "h").alias("r"))
            .select(*keys, "r.*"))
    return fast.unionByName(slow), destinations if all_common else None
