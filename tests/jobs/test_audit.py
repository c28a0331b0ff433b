"""timerwheel audit against records the test writes straight to Kafka, every kind, with the truth
computed here: every figure of summary.json must equal it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from audit_truth import audit_summary
from kafka_util import Writer, unique
from timerwheel.cli import main

NOW = 1_800_000_000_000
GRACE = 60_000
TS = NOW - 3_600_000  # the timer records' timestamps: an hour before the audit's now


@pytest.fixture(params=["one level", "two levels"])
def levels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``matched`` aggregating by id once (few topics: the usual case) or by (id, topic) first (more
    topics than ``ONE_LEVEL_TOPICS``): every figure must be the same either way."""
    from timerwheel.jobs import audit

    monkeypatch.setattr(audit, "ONE_LEVEL_TOPICS", 64 if request.param == "one level" else 0)
    return str(request.param)


def test_audit_summary_equals_the_truth_of_what_was_written(spark: Any, kafka_bootstrap: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str], levels: str) -> None:
    timer, dlq, a, b, missing = (unique("audit-timer"), unique("audit-dlq"), unique("audit-a"), unique("audit-b"),
                                 unique("audit-missing"))
    w = Writer(kafka_bootstrap)
    sched: dict[str, tuple[str, int]] = {}

    def schedule(mid: str | None, topic: str, *time_headers: tuple[str, bytes], deliver: int) -> str:
        hs = [("tw-topic", topic.encode()), *time_headers] + ([("tw-id", mid.encode())] if mid else [])
        p, o = w.send(timer, hs, TS)
        resolved = mid or f"{p}-{o}"
        sched.setdefault(resolved, (topic, deliver))
        return resolved

    # 40 on A, 25 on B, due from 2 h before now to 1 h after (absolute times)
    for i in range(40):
        d = NOW - 7_200_000 + i * 270_000
        schedule(f"a{i}", a, ("tw-deliver-at", str(d).encode()), deliver=d)
    for i in range(25):
        d = NOW - 5_000_000 + i * 250_000
        schedule(f"b{i}", b, ("tw-deliver-at", str(d).encode()), deliver=d)
    # the other two ways to say when, and a record without tw-id
    schedule("a-delay", a, ("tw-delay-ms", b"1000"), deliver=TS + 1000)
    schedule("a-level", a, ("tw-delay-level", b"3"), deliver=TS + 10_000)  # level 3 = 10 s
    no_id = schedule(None, b, ("tw-deliver-at", str(NOW - 900_000).encode()), deliver=NOW - 900_000)
    # a producer's retry (same id twice) and a roll hop of a0: neither is scheduled again
    schedule("a1", a, ("tw-deliver-at", str(NOW - 7_200_000 + 270_000).encode()), deliver=0)
    w.send(timer, [("tw-topic", a.encode()), ("tw-deliver-at", str(NOW - 7_200_000).encode()), ("tw-id", b"a0"),
                   ("tw-roll", b"1")], TS)
    # cancels: a2..a6 and b3 (a2, a3 get delivered all the same), and one for an id never scheduled
    cancelled = {"a2", "a3", "a4", "a5", "a6", "b3"}
    for mid in [*sorted(cancelled), "ghost"]:
        w.send(timer, [("tw-cancel", mid.encode()), ("tw-deliver-at", str(NOW).encode())], TS)
    # invalid timer records: no topic, unparsable time, a denied destination
    w.send(timer, [("tw-deliver-at", str(NOW).encode()), ("tw-id", b"x1")], TS)
    w.send(timer, [("tw-topic", a.encode()), ("tw-deliver-at", b"soon"), ("tw-id", b"x2")], TS)
    w.send(timer, [("tw-topic", b"__denied"), ("tw-deliver-at", str(NOW).encode()), ("tw-id", b"x3")], TS)
    # deliveries: most on time with varied lateness, some early, some duplicated, some missing
    deliveries: dict[str, list[int]] = {}

    def deliver(mid: str, topic: str, at: int) -> None:
        w.send(topic, [("tw-id", mid.encode()), ("tw-delivered-at", str(at).encode())], at)
        deliveries.setdefault(mid, []).append(at)

    for i in range(40):
        mid = f"a{i}"
        if i in (4, 5, 6) or i >= 36:  # cancelled and not delivered, or missing (lost or pending)
            continue
        d = sched[mid][1]
        deliver(mid, a, d + (i * 37) % 900 - (200 if i % 11 == 0 else 0))  # i % 11 == 0: early
        if i % 7 == 0:
            deliver(mid, a, d + 5000)  # a duplicate
            if i == 14:
                deliver(mid, a, d + 9000)
    for i in range(0, 25, 2):
        deliver(f"b{i}", b, sched[f"b{i}"][1] + 100 + i)
    deliver("a-delay", a, TS + 1500)
    deliver(no_id, b, NOW - 900_000 + 40)
    # bad or unknown deliveries: without tw-id, and an id nobody scheduled
    w.send(a, [("tw-delivered-at", str(NOW).encode())], NOW)
    w.send(b, [("tw-id", b"stranger"), ("tw-delivered-at", str(NOW).encode())], NOW)
    w.send(dlq, [("tw-error", b"x")], NOW)
    w.send(dlq, [("tw-error", b"y")], NOW)
    w.close()

    out = tmp_path / "audit"
    rc = main(["audit", "--kafka", kafka_bootstrap, "--out", str(out), "--timer-topic", timer, "--dlq-topic", dlq,
               "--now-ms", str(NOW), "--grace-ms", str(GRACE), "--master", "local[2]"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())

    total, per_topic = audit_summary(sched, cancelled, deliveries, NOW, GRACE)
    assert summary["now_ms"] == NOW and summary["grace_ms"] == GRACE
    assert summary["dead_lettered"] == 2
    assert summary["total"] == total
    assert summary["topics"] == per_topic and set(per_topic) == {a, b}
    assert summary["bad_input"] == {"invalid_timer_records": 3, "deliveries_without_id": 1,
                                    "deliveries_of_unknown_ids": 1, "unknown_topics": []}
    # the lists: the lost ids, the duplicated ones, the cancelled but delivered
    import pandas as pd

    lost = set(pd.read_parquet(out / "lost")["id"])
    assert lost == {i for i, (_, d) in sched.items() if i not in cancelled and i not in deliveries and d <= NOW - GRACE}
    assert set(pd.read_parquet(out / "duplicated")["id"]) == {i for i, c in deliveries.items() if len(c) > 1}
    assert set(pd.read_parquet(out / "cancelled_delivered")["id"]) == {"a2", "a3"}
    hourly = pd.read_parquet(out / "hourly")
    assert int(hourly["scheduled"].sum()) == len(sched)
    assert (out / "lateness.png").stat().st_size > 10_000
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary["total"]
    # --topics naming a topic that does not exist: reported, not a crash
    rc = main(["audit", "--kafka", kafka_bootstrap, "--out", str(tmp_path / "audit2"), "--timer-topic", timer,
               "--dlq-topic", dlq, "--topics", f"{a},{missing}", "--now-ms", str(NOW)])
    assert rc == 0
    second = json.loads((tmp_path / "audit2" / "summary.json").read_text())
    assert second["bad_input"]["unknown_topics"] == [missing]
    assert second["topics"][a] == summary["topics"][a]


def test_audit_of_only_common_timer_records_equals_the_truth(spark: Any, kafka_bootstrap: str, tmp_path: Path,
                                                             levels: str) -> None:
    """Every timer record common (the usual case): the destinations come from the pass that judged
    them and no record is counted invalid without a look. A destination that no record names is
    not read, a repeated header keeps its last value, a retried id its first record."""
    timer, a, b, other = unique("audit-common"), unique("audit-ca"), unique("audit-cb"), unique("audit-other")
    w = Writer(kafka_bootstrap)
    sched: dict[str, tuple[str, int]] = {}
    for i in range(30):
        topic, d = (a if i % 3 else b), NOW - 3_000_000 + i * 200_000
        # the first tw-deliver-at is overridden by the last, as dict(record.headers) keeps it
        w.send(timer, [("tw-topic", topic.encode()), ("tw-deliver-at", b"1"), ("tw-deliver-at", str(d).encode()),
                       ("tw-id", f"c{i}".encode())], TS)
        sched[f"c{i}"] = (topic, d)
    w.send(timer, [("tw-topic", b.encode()), ("tw-deliver-at", str(NOW).encode()), ("tw-id", b"c1")], TS)  # a retry
    deliveries: dict[str, list[int]] = {}
    for i in range(0, 30, 2):
        mid = f"c{i}"
        topic, d = sched[mid]
        for at in [d + 10 * i - 50] + ([d + 700] if i % 8 == 0 else []):
            w.send(topic, [("tw-id", mid.encode()), ("tw-delivered-at", str(at).encode())], at)
            deliveries.setdefault(mid, []).append(at)
    w.send(b, [("tw-id", b"c1"), ("tw-delivered-at", str(NOW).encode())], NOW)  # c1's copy on the wrong topic
    w.send(a, [("tw-delivered-at", str(NOW).encode())], NOW)
    w.send(other, [("tw-id", b"c3"), ("tw-delivered-at", str(NOW).encode())], NOW)
    w.close()

    out = tmp_path / "audit"
    assert main(["audit", "--kafka", kafka_bootstrap, "--out", str(out), "--timer-topic", timer,
                 "--now-ms", str(NOW), "--grace-ms", str(GRACE), "--master", "local[2]"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    total, per_topic = audit_summary(sched, set(), deliveries, NOW, GRACE)
    assert summary["total"] == total
    assert summary["topics"] == per_topic and set(per_topic) == {a, b}
    assert summary["bad_input"] == {"invalid_timer_records": 0, "deliveries_without_id": 1,
                                    "deliveries_of_unknown_ids": 1, "unknown_topics": []}
    import pandas as pd

    assert set(pd.read_parquet(out / "duplicated")["id"]) == {i for i, c in deliveries.items() if len(c) > 1}
    assert pd.read_parquet(out / "cancelled_delivered").empty


@pytest.mark.parametrize("full", [("lost",), ("duplicated",), ("lost", "duplicated", "cancelled_delivered")])
def test_each_list_holds_its_ids_whether_one_or_several_are_written(spark: Any, tmp_path: Path,
                                                                    full: tuple[str, ...]) -> None:
    """``_write_lists`` by hand: a list the summary counts holds exactly its ids (one list: read
    straight; several: one cached read for them all); a list it does not count is written empty."""
    import pandas as pd
    from timerwheel.jobs.audit import _write_lists

    schema = ("id string, revision long, topic string, deliver_ms long, cancelled boolean, copies long, "
              "first_delivered_at long, lateness_ms long")
    rows = {"lost": ("l", 0, "t", 10, False, 0, None, None), "duplicated": ("d", 0, "t", 10, False, 2, 15, 5),
            "cancelled_delivered": ("c", 1, "t", 10, True, 1, 12, 2)}
    ok = [("ok", 0, "t", 10, False, 1, 11, 1), ("pending", 0, "t", 900, False, 0, None, None)]
    joined = spark.createDataFrame([rows[name] for name in full] + ok, schema)
    _write_lists(joined, {name: int(name in full) for name in rows}, 100, tmp_path)
    for name, row in rows.items():
        assert list(pd.read_parquet(tmp_path / name)["id"]) == ([row[0]] if name in full else []), name


def test_matching_takes_each_ids_first_record_whether_its_place_is_a_long_or_a_decimal(spark: Any, levels: str) -> None:
    """``matched`` by hand: an id scheduled twice (its first record, lowest partition then offset,
    decides topic and time, even at an offset past 2^62), a roll hop and a cancel that schedule
    nothing, copies on the id's topic and on another, deliveries without ``tw-id`` and of an id
    nobody scheduled; revisions (issue 31): a reschedule moves a message, a second one and a cancel
    after it are void, a reschedule after a cancel is void, deliver now's copy. The same rows with
    the place as a long and as a decimal(38,0)."""
    from timerwheel.jobs.audit import ANY_EXTENT

    # the place a long (partition 1, offsets of 10 bits), a decimal (any Kafka's), a decimal (63 bits of offset)
    for huge, extents in [(1000, [(1, 1001), ANY_EXTENT]), (2**62 + 5, [(1, 2**62 + 6)])]:
        _matched_by_hand(spark, huge, extents)


def _matched_by_hand(spark: Any, huge: int, extents: list[tuple[int, int]]) -> None:
    from timerwheel.jobs.audit import matched

    rows = [
        # partition, offset, error, cancel, id, topic, deliver_ms, roll (revision 0, replaces none)
        (1, 5, None, False, "a", "x", 100, 0),
        (0, huge, None, False, "a", "y", 200, 0),   # a's first: partition 0
        (0, huge + 1, None, False, "a", "x", 300, 0),
        (0, 1, None, False, "b", "x", 400, 0),
        (0, 2, None, True, "b", None, None, 0),      # b cancelled
        (0, 3, None, False, "c", "x", 500, 0),
        (0, 0, None, False, "c", "y", 50, 1),        # a roll hop of c, before it: not c's first
        (0, 4, "missing tw-topic", None, None, None, None, None),
        (0, 6, None, True, "ghost-cancel", None, None, 0),
    ]
    revisions = [
        # ..., revision, replaces: the first marker of a revision decides, later ones are void
        (0, 10, None, False, "m", "x", 600, 0, 0, None),
        (0, 11, None, False, "m", "x", 700, 0, 1, 600),   # m moved to revision 1, due 700
        (0, 12, None, False, "m", "x", 800, 0, 1, 600),   # a second reschedule of m's revision 0: void
        (0, 13, None, True, "m", None, 600, 0, 0, None),  # a cancel of the moved revision 0: void
        (0, 14, None, False, "m", "x", 700, 1, 1, None),  # the move's hop back to the timer topic
        (0, 20, None, False, "n", "x", 600, 0, 0, None),
        (0, 21, None, True, "n", None, 600, 0, 0, None),  # n cancelled
        (0, 22, None, False, "n", "x", 900, 0, 1, 600),   # then rescheduled: void
        (0, 30, None, False, "d", "y", 600, 0, 0, None),
        (0, 31, None, False, "d", "y", 550, 0, 1, None),  # deliver now: a copy as revision 1
        (0, 32, None, True, "d", None, 600, 0, 0, None),  # and a cancel of revision 0
    ]
    reqs = spark.createDataFrame(
        [(*r, 0, None) for r in rows] + revisions,
        "partition int, offset long, error string, cancel boolean, id string, topic string, deliver_ms long, "
        "roll long, revision long, replaces long")
    dest = spark.createDataFrame([
        ("y", "a", 0, 260), ("y", "a", 0, 250), ("x", "a", 0, 120),  # a: 2 copies on y, one on x (unknown)
        ("x", "b", 0, 390),                                           # b: cancelled and delivered, early
        ("x", None, 0, 1), ("y", None, 0, 2), ("x", None, 0, None),  # 3 without tw-id
        ("y", "ghost", 0, 7),                                         # nobody scheduled it
        ("x", "m", 1, 710), ("x", "m", 0, 605),                       # m's revision 1, and its moved revision 0
        ("y", "d", 1, 560),
    ], "topic string, id string, revision long, delivered_at long")
    expected = {
        ("a", 0): ("y", 200, False, 2, 250, 50, 1, 0),
        ("b", 0): ("x", 400, True, 1, 390, -10, 0, 0),
        ("c", 0): ("x", 500, False, 0, None, None, 0, 0),
        ("ghost", 0): (None, None, False, 0, None, None, 1, 0),
        ("ghost-cancel", 0): (None, None, True, 0, None, None, 0, 0),
        (None, 0): (None, None, False, 0, None, None, 0, 3),
        ("m", 0): ("x", 600, True, 1, 605, 5, 0, 0),  # moved, yet delivered: cancelled_delivered
        ("m", 1): ("x", 700, False, 1, 710, 10, 0, 0),
        ("n", 0): ("x", 600, True, 0, None, None, 0, 0),
        ("d", 0): ("y", 600, True, 0, None, None, 0, 0),
        ("d", 1): ("y", 550, False, 1, 560, 10, 0, 0),
    }
    cols = ["topic", "deliver_ms", "cancelled", "copies", "first_delivered_at", "lateness_ms", "unknown", "without_id"]
    for extent in extents:
        got = {(r["id"], r["revision"]): tuple(r[c] for c in cols)
               for r in matched(reqs, dest, ["x", "y"], extent).collect()}
        assert got == expected, extent


def test_audit_counts_a_rescheduled_message_once_at_its_new_time(spark: Any, kafka_bootstrap: str,
                                                                 tmp_path: Path) -> None:
    """Reschedules as the client writes them (the same ``tw-id``, ``tw-revision`` + 1,
    ``tw-replaces``), through the service's parser: a message moved later is scheduled at its new
    time and delivered once, not late by the move nor "cancelled and delivered"; the first decision
    on a revision wins (a second reschedule and a cancel of the moved revision are void, a
    reschedule of a cancelled one too); deliver now's copy; a move's hop schedules nothing."""
    timer, a = unique("audit-resched"), unique("audit-ra")
    w = Writer(kafka_bootstrap)
    t0 = NOW - 3_000_000
    sched: dict[tuple[str, int], tuple[str, int]] = {}
    cancelled: set[tuple[str, int]] = set()

    def message(mid: str, deliver: int, revision: int = 0, replaces: int | None = None, roll: int = 0) -> None:
        hs = [("tw-topic", a.encode()), ("tw-deliver-at", str(deliver).encode()), ("tw-id", mid.encode())]
        hs += [("tw-revision", str(revision).encode())] if revision else []
        hs += [("tw-replaces", str(replaces).encode())] if replaces is not None else []
        hs += [("tw-roll", str(roll).encode())] if roll else []
        w.send(timer, hs, TS)

    def cancel(mid: str, at: int, revision: int = 0) -> None:
        w.send(timer, [("tw-cancel", mid.encode()), ("tw-deliver-at", str(at).encode()),
                       ("tw-revision", str(revision).encode())], TS)

    for i in range(6):
        sched[(f"m{i}", 0)] = (a, t0 + i)
        message(f"m{i}", t0 + i)
    # m0 moved 10 min later, then once more from its new ticket; its hop back to the timer topic
    message("m0", t0 + 600_000, 1, t0)
    message("m0", t0 + 600_000, 1, roll=1)
    message("m0", t0 + 900_000, 2, t0 + 600_000)
    sched[("m0", 1)], sched[("m0", 2)] = (a, t0 + 600_000), (a, t0 + 900_000)
    cancelled |= {("m0", 0), ("m0", 1)}
    # m1 moved, then moved again from its old ticket (void), then its old ticket cancelled (void)
    message("m1", t0 + 1 + 60_000, 1, t0 + 1)
    message("m1", t0 + 1 + 120_000, 1, t0 + 1)
    cancel("m1", t0 + 1, 0)
    sched[("m1", 1)] = (a, t0 + 1 + 60_000)
    cancelled.add(("m1", 0))
    # m2 cancelled, then rescheduled (void)
    cancel("m2", t0 + 2, 0)
    message("m2", t0 + 2 + 60_000, 1, t0 + 2)
    cancelled.add(("m2", 0))
    # m3 moved, then its new ticket cancelled
    message("m3", t0 + 3 + 60_000, 1, t0 + 3)
    cancel("m3", t0 + 3 + 60_000, 1)
    sched[("m3", 1)] = (a, t0 + 3 + 60_000)
    cancelled |= {("m3", 0), ("m3", 1)}
    # m4 delivered now: a copy as revision 1, then a cancel of revision 0
    message("m4", t0 - 1000, 1)
    cancel("m4", t0 + 4, 0)
    sched[("m4", 1)] = (a, t0 - 1000)
    cancelled.add(("m4", 0))
    deliveries: dict[tuple[str, int], list[int]] = {}

    def deliver(mid: str, revision: int, at: int) -> None:
        hs = [("tw-id", mid.encode()), ("tw-delivered-at", str(at).encode())]
        w.send(a, hs + ([("tw-revision", str(revision).encode())] if revision else []), at)
        deliveries.setdefault((mid, revision), []).append(at)

    deliver("m0", 2, t0 + 900_040)
    deliver("m1", 1, t0 + 60_031)
    deliver("m3", 0, t0 + 3 + 5)      # the moved revision delivered all the same: cancelled and delivered
    deliver("m4", 1, t0 - 990)
    deliver("m4", 1, t0 - 900)        # twice
    deliver("m5", 0, t0 + 5 + 70)
    w.close()

    out = tmp_path / "audit"
    assert main(["audit", "--kafka", kafka_bootstrap, "--out", str(out), "--timer-topic", timer,
                 "--now-ms", str(NOW), "--grace-ms", str(GRACE), "--master", "local[2]"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    total, per_topic = audit_summary(sched, cancelled, deliveries, NOW, GRACE)  # type: ignore[arg-type]
    assert summary["total"] == total and summary["topics"] == per_topic
    assert (total["scheduled"], total["delivered"], total["duplicated"], total["cancelled_delivered"]) == (11, 5, 1, 1)
    assert summary["bad_input"]["invalid_timer_records"] == 0
    assert summary["bad_input"]["deliveries_of_unknown_ids"] == 0
    import pandas as pd

    def listed(name: str) -> set[tuple[str, int]]:
        df = pd.read_parquet(out / name)
        return set(zip(df["id"], df["revision"], strict=True))

    assert listed("cancelled_delivered") == {("m3", 0)}
    assert listed("duplicated") == {("m4", 1)}
    assert listed("lost") == set()


def test_audit_of_an_unreachable_kafka_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str],
                                                              tmp_path: Path) -> None:
    pytest.importorskip("pyspark")
    rc = main(["audit", "--kafka", "127.0.0.1:1", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err == ["timerwheel: error: --kafka: cannot reach Kafka at 127.0.0.1:1: KafkaTimeoutError"]


def test_the_jobs_read_only_committed_records_as_the_stages_do(spark: Any, kafka_bootstrap: str) -> None:
    """A timer record of an aborted transaction was never scheduled, a delivery of one never
    delivered: ``read_topics`` (audit, forecast) sees what a read_committed stage sees."""
    from kafka import KafkaProducer
    from timerwheel.config import TimerConfig
    from timerwheel.jobs.spark import read_topics

    topic = unique("committed")
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=unique("tx"), acks="all")
    try:
        producer.init_transactions()
        for committed in (True, False, True):
            producer.begin_transaction()
            producer.send(topic, value=b"kept" if committed else b"aborted", partition=0)
            producer.flush()  # on the broker before the abort: a read_uncommitted reader would see it
            if committed:
                producer.commit_transaction()
            else:
                producer.abort_transaction()
    finally:
        producer.close()
    rows = read_topics(spark, TimerConfig(kafka_bootstrap=kafka_bootstrap), [topic]).select("value").collect()
    assert sorted(bytes(r["value"]) for r in rows) == [b"kept", b"kept"]
