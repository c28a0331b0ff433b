"""Timer-topic records as the service reads them, in Spark: the one ``TimerRules``, two paths.

``requests(narrow, config)`` gives each record's verdict and normalised request, exactly what
``TimerRules.parse`` gives (tests/jobs/test_records.py checks the two agree on generated records,
edge cases included):

- The common record (what ``TimerRules.parse`` takes its short path for: an absolute
  ``tw-deliver-at``, none of the other control headers, size, id and max delay within the limits,
  an allowed destination) is read by Spark SQL expressions, with no Python per row. The headers
  are read as one map (``header_map``: code Spark compiles), not by a lambda per header.
- Destinations are few: the distinct ``tw-topic`` values are judged on the driver by
  ``TimerRules.destination_error`` (allow-list, topic names, not the timer topic) and joined back.
  A record that passes every other check of the short path but names a refused destination is
  refused with that verdict, as ``parse`` refuses it, also with no Python per row.
- Every other record (cancels, roll hops, ``tw-delay-ms``, ``tw-delay-level``, anything else
  invalid or odd) goes through ``TimerRules.parse`` (given the record's size) in a pandas UDF;
  when there is none (found in the same pass that judges the destinations), the UDF branch is
  left out of the plan.

The record's own timestamp stands for "now" in the max-delay check (the service checks against
its clock when it reads the record, moments later). Only the control headers and the size are
kept (``narrow``), so the key, value and user headers are read once and dropped.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pandas as pd

from timerwheel.config import TimerConfig
from timerwheel.wire import (
    H_CANCEL,
    H_DELAY_LEVEL,
    H_DELAY_MS,
    H_DELIVER_AT,
    H_ENQUEUED_AT,
    H_FIRST_OFFSET,
    H_ID,
    H_PARTITION,
    H_REPLACES,
    H_REVISION,
    H_ROLL,
    H_TOPIC,
    MAX_EPOCH_MS,
    MAX_ID_BYTES,
)

#: The control headers ``parse`` reads, as the fields of the ``h`` struct column (``-`` -> ``_``).
CONTROL = (H_TOPIC, H_DELIVER_AT, H_DELAY_MS, H_DELAY_LEVEL, H_ID, H_CANCEL, H_PARTITION, H_ROLL, H_ENQUEUED_AT,
           H_REVISION, H_REPLACES, H_FIRST_OFFSET)
#: Those that take ``parse`` off its short path (wire._FULL_PARSE).
_OFF_COMMON = (H_DELAY_MS, H_DELAY_LEVEL, H_CANCEL, H_PARTITION, H_ROLL, H_ENQUEUED_AT, H_REVISION, H_REPLACES,
               H_FIRST_OFFSET)


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


def digits_as_long(text: Any, most: int) -> Any:
    """String column ``text`` as a long when it is a run of 1 to ``most`` ASCII digits (leading
    zeros too), else null (also when the run is past a long). A value that prints back as itself
    (a non-negative long: no sign, space or leading zero), the usual case, is found without a
    regular expression (0.2 s per 1,000,000 values); any other is matched against one (``\\z``:
    Java's ``$`` also matches before a final line break)."""
    from pyspark.sql import functions as F

    value = text.try_cast("long")
    run = F.when(value.cast("string") == text, F.lit(True)).otherwise(text.rlike(f"^[0-9]{{1,{most}}}\\z"))
    return F.when((value >= 0) & (F.length(text) <= most) & run, value)


def record_size(headers: str = "headers") -> Any:
    """``Record.size`` of Kafka rows (key, value, ``headers``): the header keys' characters and
    values' bytes summed through ``array_join`` of the keys and of the values cast to text (the
    bytes kept, nulls skipped), code Spark compiles. An ``aggregate`` lambda over the headers is
    interpreted per record: 1.1 s more on the 1,000,000 timer records of the bench."""
    from pyspark.sql import functions as F

    def length(col: Any) -> Any:
        return F.coalesce(col, F.lit(0))

    return (length(F.octet_length("key")) + length(F.octet_length("value"))
            + length(F.char_length(F.array_join(F.col(f"{headers}.key"), "")))
            + length(F.octet_length(F.array_join(F.col(f"{headers}.value").cast("array<string>"), "")))).cast("long")


def narrow(raw: Any) -> Any:
    """partition, offset, timestamp_ms, size (``Record.size``), h (the control headers) of raw
    Kafka rows (``spark.read_topics``)."""
    from pyspark.sql import functions as F

    # two projections: the map is built once per record, then read nine times
    return (raw.select("partition", "offset", "timestamp_ms", record_size().alias("size"), header_map().alias("m"))
            .select("partition", "offset", "timestamp_ms", "size",
                    F.struct(*[last_header(h, F.col("m")).alias(field(h)) for h in CONTROL]).alias("h")))


RESULT_FIELDS = ("error string, cancel boolean, id string, topic string, deliver_ms long, roll long, revision long, "
                 "replaces long")
#: ``requests``' columns after partition, offset, timestamp_ms.
RESULTS = ("error", "cancel", "id", "topic", "deliver_ms", "roll", "revision", "replaces")


class Judged(NamedTuple):
    """``judged_requests``' answer."""

    #: ``requests``' rows.
    requests: Any
    #: The records' allowed destinations, sorted, when no record needs the service's parser
    #: (else None: the valid requests' topics tell).
    destinations: list[str] | None
    #: How many records are invalid, when no record needs the parser (else None).
    invalid: int | None
    #: The compact records every branch reads (persisted; ``unpersist`` when done).
    cache: Any
    #: The largest partition and offset of the records (0, 0 if none).
    extent: tuple[int, int]


def _verdicts(spark: Any, pre: Any, config: TimerConfig) -> tuple[Any, int, int, list[str], tuple[int, int]]:
    """(raw tw-topic -> (verdict, decoded topic) for each distinct value, judged by TimerRules as
    ``parse`` would refuse a record that passes every other check; how many records need the
    parser; how many are refused for their destination alone; the allowed topics, sorted; the
    largest partition and offset). One pass over the cached ``pre``, grouped by tw-topic."""
    from pyspark.sql import functions as F

    from timerwheel.wire import TimerRules

    rules = TimerRules(config)
    per_topic = (pre.groupBy("topic_raw")
                 .agg(F.count(F.when(~F.col("cbt"), 1)).alias("odd"), F.count(F.when(F.col("cbt"), 1)).alias("short"),
                      F.max("partition"), F.max("offset"))
                 .collect())
    judged, odd, refused, extent = [], 0, 0, (0, 0)
    for raw, n_odd, n_short, partition, offset in per_topic:
        extent = (max(extent[0], partition), max(extent[1], offset))
        odd += n_odd
        if not raw:  # none or empty; parse: "missing tw-topic"
            refused += n_short
            if raw is not None:
                judged.append((bytes(raw), f"missing {H_TOPIC}", ""))
            continue
        name = bytes(raw).decode("utf-8", "replace")
        verdict = rules.destination_error(name)
        judged.append((bytes(raw), verdict, name))
        refused += n_short if verdict else 0
    allowed = sorted(name for _, verdict, name in judged if verdict == "")
    return (spark.createDataFrame(judged, "topic_raw binary, verdict string, topic_name string"), odd, refused,
            allowed, extent)


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
                req = rules.parse(record, int(t), hdr, int(s))
            except InvalidTimerMessage as exc:
                out.append((exc.reason, None, None, None, None, None, None, None))
                continue
            out.append((None, req.cancel, req.message_id, req.topic or None, req.deliver_ms, req.roll, req.revision,
                        req.replaces))
        return pd.DataFrame(out, columns=list(RESULTS))

    return parse


def requests(narrowed: Any, config: TimerConfig, *, short_cut: bool = True) -> Any:
    """partition, offset, timestamp_ms, error (null when valid), cancel, id (the message id, or
    the cancelled one's), topic (null for a cancel), deliver_ms, roll, revision (a message's; a
    cancel's: the one it cancels), replaces (a reschedule's ``tw-replaces``, else null):
    ``TimerRules.parse`` of
    every record of ``narrowed`` (``narrow``'s columns, read once: ``judged_requests`` caches what
    it needs). When no record needs the parser there is no UDF branch (``short_cut=False`` sends
    every record to it: the tests' reference)."""
    return judged_requests(narrowed, config, short_cut=short_cut).requests


def judged_requests(narrowed: Any, config: TimerConfig, *, short_cut: bool = True) -> Judged:
    """``requests`` with what the pass that judges the destinations learnt (``Judged``).

    Each record is read once from ``narrowed`` into a compact cache: partition, offset,
    timestamp, raw tw-topic, whether it passes the checks of ``TimerRules.parse``'s short path but
    the destination's, then either its id and delivery time (it does) or its size and control
    headers (it does not: the parser's input). The destinations are judged on the driver, one
    verdict per distinct tw-topic; a record that passes every other check is valid if its
    destination is allowed, else refused with the destination's verdict, as ``parse`` says."""
    from pyspark.sql import functions as F

    spark = narrowed.sparkSession
    h = {name: F.col(f"h.{field(name)}") for name in CONTROL}
    at = h[H_DELIVER_AT].cast("string")
    raw_id = h[H_ID]
    # TimerRules.parse's short path takes a run of at most 20 ASCII digits (int() of it; a longer
    # one, even zero-padded, is refused by parse's grammar). One past a long is null here and one past
    # MAX_EPOCH_MS refused below: both go to parse for its reason.
    deliver = digits_as_long(at, 20)
    off_common_absent = F.lit(True)
    for name in _OFF_COMMON:
        off_common_absent = off_common_absent & h[name].isNull()
    common_but_topic = F.coalesce(
        deliver.isNotNull() & off_common_absent
        & (F.col("size") <= F.lit(config.max_record_bytes))
        & (deliver <= F.lit(MAX_EPOCH_MS))
        & (deliver - F.col("timestamp_ms") <= F.lit(config.max_delay_ms))
        & (raw_id.isNull() | ((F.octet_length(raw_id) > 0) & (F.octet_length(raw_id) <= MAX_ID_BYTES)
                              & F.is_valid_utf8(raw_id.cast("string")))),
        F.lit(False)) & F.lit(short_cut)
    keys = ["partition", "offset", "timestamp_ms"]
    short = F.col("cbt")
    pre = narrowed.select(
        *keys, h[H_TOPIC].alias("topic_raw"), common_but_topic.alias("cbt"),
        F.when(short, F.coalesce(raw_id.cast("string"), F.concat_ws("-", "partition", "offset"))).alias("fid"),
        F.when(short, deliver).alias("fdeliver"),
        F.when(~short, F.col("size")).alias("size"), F.when(~short, F.col("h")).alias("h"),
    ).persist()
    verdicts, odd, refused, destinations, extent = _verdicts(spark, pre, config)
    ok = F.col("verdict").eqNullSafe("")
    fast = (pre.filter(short).join(F.broadcast(verdicts), "topic_raw", "left").select(
        *keys,
        F.when(~ok, F.coalesce("verdict", F.lit(f"missing {H_TOPIC}"))).alias("error"),
        F.when(ok, F.lit(False)).alias("cancel"),
        F.when(ok, F.col("fid")).alias("id"),
        F.when(ok, F.col("topic_name")).alias("topic"),
        F.when(ok, F.col("fdeliver")).alias("deliver_ms"),
        F.when(ok, F.lit(0).cast("long")).alias("roll"),
        F.when(ok, F.lit(0).cast("long")).alias("revision"),
        F.lit(None).cast("long").alias("replaces"),
    ))
    if odd == 0:
        # No record for the UDF: its branch would still start a Python worker per partition and
        # scan the records a second time.
        return Judged(fast, destinations, refused, pre, extent)
    parse = _parse_udf(config)
    slow = (pre.filter(~short).select(*keys, parse("partition", "offset", "timestamp_ms", "size", "h").alias("r"))
            .select(*keys, "r.*"))
    return Judged(fast.unionByName(slow), None, None, pre, extent)
