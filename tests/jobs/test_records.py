"""The Spark reading of timer records agrees with ``TimerRules.parse``, record by record, on
generated records: every kind, and the edges of each limit (both of the job's paths: the SQL
expressions of the common record and the UDF for the rest)."""

from __future__ import annotations

import random
from typing import Any

from timerwheel.config import TimerConfig
from timerwheel.errors import InvalidTimerMessage
from timerwheel.jobs.records import RESULTS, digits_as_long, narrow, requests
from timerwheel.records import Record
from timerwheel.wire import MAX_EPOCH_MS, TimerRules

NOW = 1_800_000_000_000
CONFIG = TimerConfig(max_delay_ms=10 * 86_400_000, max_record_bytes=2000,
                     allow_topics=("orders.*", "pay"), delay_levels_ms=(1000, 5000, 60_000))


def _edge_headers() -> list[list[tuple[str, bytes]]]:
    at = str(NOW + 5000).encode()
    t = ("tw-topic", b"orders")
    return [
        [t, ("tw-deliver-at", at)],
        [t, ("tw-deliver-at", at), ("tw-id", b"abc")],
        [t, ("tw-deliver-at", at), ("tw-id", b"")],
        [t, ("tw-deliver-at", at), ("tw-id", b"x" * 1024)],
        [t, ("tw-deliver-at", at), ("tw-id", b"x" * 1025)],
        [t, ("tw-deliver-at", at), ("tw-id", b"\xff\xfebad-utf8")],
        [t, ("tw-deliver-at", at), ("tw-id", "caf\u00e9".encode())],
        [t, ("tw-deliver-at", b"0")],
        [t, ("tw-deliver-at", b"-5")],
        [t, ("tw-deliver-at", b" 12345 ")],
        [t, ("tw-deliver-at", b"12a")],
        [t, ("tw-deliver-at", b"+12345")],
        [t, ("tw-deliver-at", at + b"\n")],
        [t, ("tw-deliver-at", b"00" + at)],
        [t, ("tw-deliver-at", b"1.0")],
        [t, ("tw-deliver-at", b"")],
        [t, ("tw-deliver-at", str(MAX_EPOCH_MS).encode())],
        [t, ("tw-deliver-at", str(MAX_EPOCH_MS + 1).encode())],
        [t, ("tw-deliver-at", b"0000000000000000001000")],
        [t, ("tw-deliver-at", b"000000000000000001000")],
        [t, ("tw-deliver-at", b"99999999999999999999999")],
        [t, ("tw-deliver-at", str(NOW + 10 * 86_400_000).encode())],
        [t, ("tw-deliver-at", str(NOW + 10 * 86_400_000 + 1).encode())],
        [t, ("tw-deliver-at", b"1"), ("tw-deliver-at", at)],  # the last wins
        [t],
        [("tw-deliver-at", at)],
        [("tw-topic", b""), ("tw-deliver-at", at)],
        [("tw-topic", b"__internal"), ("tw-deliver-at", at)],
        [("tw-topic", b"__timer"), ("tw-deliver-at", at)],
        [("tw-topic", b"other"), ("tw-deliver-at", at)],
        [("tw-topic", b"pay"), ("tw-deliver-at", at)],
        [("tw-topic", b"bad topic"), ("tw-deliver-at", at)],
        [("tw-topic", b"orders\xff"), ("tw-deliver-at", at)],
        [t, ("tw-delay-ms", b"2500")],
        [t, ("tw-delay-ms", b"x")],
        [t, ("tw-delay-ms", str(10 * 86_400_000 + 1).encode())],
        [t, ("tw-delay-level", b"1")],
        [t, ("tw-delay-level", b"3")],
        [t, ("tw-delay-level", b"4")],
        [t, ("tw-delay-level", b"0")],
        [t, ("tw-deliver-at", at), ("tw-delay-ms", b"5")],
        [("tw-cancel", b"abc"), ("tw-deliver-at", at)],
        [("tw-cancel", b""), ("tw-deliver-at", at)],
        [("tw-cancel", b"abc")],
        [t, ("tw-deliver-at", at), ("tw-id", b"r1"), ("tw-roll", b"2"), ("tw-enqueued-at", b"17")],
        [t, ("tw-deliver-at", at), ("tw-roll", b"zz")],
        [t, ("tw-deliver-at", at), ("tw-partition", b"3")],
        [t, ("tw-deliver-at", at), ("tw-partition", b"-3")],
        [t, ("tw-deliver-at", at), ("user", b"u" * 1900)],
        [t, ("tw-deliver-at", at), ("user", b"u" * 1960)],
        # revisions (issue 31): a reschedule, a cancel of a revision, a marker's hop, and the invalid ones
        [t, ("tw-deliver-at", at), ("tw-id", b"m"), ("tw-revision", b"1"), ("tw-replaces", b"1000")],
        [t, ("tw-deliver-at", at), ("tw-id", b"m"), ("tw-revision", b"2")],
        [("tw-cancel", b"m"), ("tw-revision", b"3"), ("tw-deliver-at", at)],
        [t, ("tw-deliver-at", at), ("tw-id", b"m"), ("tw-revision", b"1"), ("tw-replaces", b"1000"),
         ("tw-roll", b"1"), ("tw-first-offset", b"7")],
        [t, ("tw-deliver-at", at), ("tw-revision", b"1"), ("tw-replaces", b"1000")],
        [t, ("tw-deliver-at", at), ("tw-id", b"m"), ("tw-replaces", b"1000")],
        [("tw-cancel", b"m"), ("tw-replaces", b"1000"), ("tw-deliver-at", at)],
        [t, ("tw-deliver-at", at), ("tw-revision", b"x")],
        [t, ("tw-deliver-at", at), ("tw-first-offset", b"-1")],
    ]


def _generated(n: int, seed: int) -> list[Record]:
    rnd = random.Random(seed)
    out = [Record("__timer", 1, i, NOW - 1000, b"k", b"v", tuple(hs)) for i, hs in enumerate(_edge_headers())]
    topics = [b"orders", b"orders-eu", b"pay", b"__x", b"other"]
    for i in range(len(out), n):
        kind = rnd.random()
        hs: list[tuple[str, bytes]] = [("tw-topic", rnd.choice(topics))]
        if kind < 0.6:
            hs.append(("tw-deliver-at", str(NOW + rnd.randint(-10_000, 12 * 86_400_000)).encode()))
        elif kind < 0.75:
            hs.append(("tw-delay-ms", str(rnd.randint(0, 11 * 86_400_000)).encode()))
        elif kind < 0.85:
            hs.append(("tw-delay-level", str(rnd.randint(0, 4)).encode()))
        else:
            hs = [("tw-cancel", f"id-{rnd.randint(0, 50)}".encode()), ("tw-deliver-at", str(NOW).encode())]
        if rnd.random() < 0.5:
            hs.append(("tw-id", f"id-{i}".encode()))
        if rnd.random() < 0.1:
            hs.append(("tw-roll", str(rnd.randint(0, 3)).encode()))
        if rnd.random() < 0.1:
            hs.append(("tw-revision", str(rnd.randint(0, 3)).encode()))
            if rnd.random() < 0.5:
                hs.append(("tw-replaces", str(NOW + rnd.randint(0, 10_000)).encode()))
        value = b"v" * rnd.choice([0, 10, 1990])
        out.append(Record("__timer", rnd.randint(0, 3), i, NOW - rnd.randint(0, 5000), None, value, tuple(hs)))
    return out


def _expected(rules: TimerRules, r: Record) -> tuple[Any, ...]:
    try:
        req = rules.parse(r, r.timestamp_ms)
    except InvalidTimerMessage as exc:
        return (r.partition, r.offset, exc.reason, None, None, None, None, None, None, None)
    return (r.partition, r.offset, None, req.cancel, req.message_id, req.topic or None, req.deliver_ms, req.roll,
            req.revision, req.replaces)


def test_spark_reads_timer_records_as_timer_rules_parse_does(spark: Any) -> None:
    records = _generated(600, seed=15)
    rows = [(r.partition, r.offset, r.timestamp_ms, r.key, r.value, [(k, v) for k, v in r.headers]) for r in records]
    raw = spark.createDataFrame(rows, "partition int, offset long, timestamp_ms long, key binary, value binary, "
                                      "headers array<struct<key: string, value: binary>>")
    got = {(r.partition, r.offset): tuple(r) for r in
           requests(narrow(raw).cache(), CONFIG)
           .select("partition", "offset", *RESULTS).collect()}
    rules = TimerRules(CONFIG)
    expected = {(r.partition, r.offset): _expected(rules, r) for r in records}
    assert len(got) == len(records)
    mismatches = {k: (got[k], v) for k, v in expected.items() if got[k] != v}
    assert not mismatches
    # both paths ran: valid common records and everything else
    assert sum(1 for v in expected.values() if v[2] is None) > 100
    assert sum(1 for v in expected.values() if v[2] is not None) > 50


def _raw(spark: Any, records: list[Record]) -> Any:
    rows = [(r.partition, r.offset, r.timestamp_ms, r.key, r.value, [(k, v) for k, v in r.headers]) for r in records]
    return spark.createDataFrame(rows, "partition int, offset long, timestamp_ms long, key binary, value binary, "
                                       "headers array<struct<key: string, value: binary>>")


def _plan(df: Any) -> str:
    return str(df._jdf.queryExecution().executedPlan().toString())


def test_records_that_are_all_common_need_no_python_udf(spark: Any) -> None:
    at = str(NOW + 5000).encode()
    common = [Record("__timer", i % 2, i, NOW, b"k", b"v", (("tw-topic", b"orders" if i % 3 else b"pay"),
                                                            ("tw-deliver-at", at), ("tw-id", b"m%d" % i)))
              for i in range(30)]
    narrowed = narrow(_raw(spark, common)).cache()
    short = requests(narrowed, CONFIG)
    assert "EvalPython" not in _plan(short)
    full = requests(narrowed, CONFIG, short_cut=False)
    assert "EvalPython" in _plan(full)  # the check above can fail
    assert sorted(map(tuple, short.collect())) == sorted(map(tuple, full.collect()))
    rules = TimerRules(CONFIG)
    assert {(r.partition, r.offset, *(r[c] for c in RESULTS)) for r in short.collect()} == {_expected(rules, r) for r in common}
    # one record of another kind brings the UDF back
    odd = Record("__timer", 0, 99, NOW, None, None, (("tw-topic", b"orders"), ("tw-delay-ms", b"5")))
    assert "EvalPython" in _plan(requests(narrow(_raw(spark, [*common, odd])), CONFIG))
    # a destination the rules refuse, or none, on an otherwise common record does not: its
    # verdict comes from the destination's, as parse gives it
    refused = [Record("__timer", 0, 99, NOW, None, None, (("tw-topic", t), ("tw-deliver-at", at)))
               for t in (b"__timer", b"no such/topic", b"")]
    refused.append(Record("__timer", 0, 100, NOW, None, None, (("tw-deliver-at", at),)))
    mixed = requests(narrow(_raw(spark, [*common, *refused])), CONFIG)
    assert "EvalPython" not in _plan(mixed)
    got = {(r.partition, r.offset, *(r[c] for c in RESULTS)) for r in mixed.collect()}
    assert got == {_expected(rules, r) for r in [*common, *refused]}
    assert sum(1 for g in got if g[2] is not None) == len(refused)


def test_digits_as_long_takes_a_run_of_ascii_digits_and_nothing_else(spark: Any) -> None:
    """The timer topic's ``tw-deliver-at`` (20 digits at most) and the destinations'
    ``tw-delivered-at`` (18) are read as bytes.isdigit() runs of that length: the print-back
    short cut and the regular expression together, against Python's own reading."""
    from pyspark.sql import functions as F

    values = ["0", "7", "1795000000000", "00123", "0" * 18, "9" * 18, "9" * 19, "0" * 19 + "5", str(2**63 - 1),
              str(2**63), "9" * 20, "0" * 20, "0" * 21, "", "-5", "-0", "+5", " 5", "5 ", "5\n", "\n5", "1.0", "1e3",
              "0x10", "12a", "\u0665", "１２", str(MAX_EPOCH_MS)]
    df = spark.createDataFrame([(v,) for v in values], "v string")
    for most in (18, 20):
        got = dict(df.select("v", digits_as_long(F.col("v"), most).alias("n")).collect())
        want = {v: int(v) if v.encode().isdigit() and len(v) <= most and int(v) < 2**63 else None for v in values}
        assert got == want, most
