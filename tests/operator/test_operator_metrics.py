"""Parsing the stages' /metrics and turning it into per-shard status."""

from __future__ import annotations

import pytest
from timerwheel.exposition import render
from timerwheel.metrics import Metrics
from timerwheel_operator.stage_metrics import MetricsParseError, Sample, parse_prometheus, shard_status


def stage_metrics(stage: str, shard: int, epoch: int, **gauges: float) -> str:
    m = Metrics()
    m.inc("scheduled", 5, topic="orders")
    m.observe_many("delivery_lateness_ms", [3.0, 40.0])
    m.set("owner_epoch", epoch, shard=shard, stage=stage)
    for name, value in gauges.items():
        m.set(name, value, shard=shard)
    return render(m)


def test_the_stages_own_exposition_parses() -> None:
    text = stage_metrics("enqueue-put", 2, 7, write_ms=1_700_000_000_100, timerlog_bytes=6400)
    samples = parse_prometheus(text)
    by_name = {(s.name, s.labels): s.value for s in samples}
    assert by_name[("timerwheel_owner_epoch", (("shard", "2"), ("stage", "enqueue-put")))] == 7
    assert by_name[("timerwheel_write_ms", (("shard", "2"),))] == 1_700_000_000_100
    assert by_name[("timerwheel_scheduled_total", (("topic", "orders"),))] == 5
    assert by_name[("timerwheel_delivery_lateness_ms_bucket", (("le", "+Inf"),))] == 2
    assert len(samples) == len([ln for ln in text.splitlines() if ln and not ln.startswith("#")])


def test_labels_with_escapes_and_timestamps() -> None:
    (s,) = parse_prometheus('x_total{path="a\\"b\\\\c",code="200"} 1.5e3 1700000000000\n')
    assert s == Sample("x_total", (("code", "200"), ("path", 'a"b\\c')), 1500.0)


@pytest.mark.parametrize("line", ["garbage here too", 'x{a="1" 3', "x notanumber"])
def test_a_bad_line_is_refused_naming_its_number(line: str) -> None:
    with pytest.raises(MetricsParseError, match=r"^line 2: "):
        parse_prometheus("# HELP fine\n" + line + "\n")


def test_each_shard_takes_its_figures_from_the_owner_with_the_highest_epoch() -> None:
    scrapes = {
        "put-0": parse_prometheus(stage_metrics("enqueue-put", 0, 3, write_ms=1000, write_lag_ms=50,
                                                timerlog_bytes=640)),
        # put-1 lost shard 0 (epoch 2) but still shows its old figures; owns shard 1.
        "put-1": parse_prometheus(stage_metrics("enqueue-put", 0, 2, write_ms=10, timerlog_bytes=64)
                                  + stage_metrics("enqueue-put", 1, 5, write_ms=2000, timerlog_bytes=128)),
        "get-0": parse_prometheus(stage_metrics("dequeue-get", 0, 4, read_ms=900, read_lag_ms=120, in_flight=7,
                                                pending=42)),
    }
    s0, s1, s2 = shard_status(scrapes, 3)
    assert s0.to_status() == {"shard": 0, "owner": "put-0", "reader": "get-0", "epoch": 3, "W": 1000, "R": 900,
                              "writeLagMs": 50, "lagMs": 120, "inFlight": 7, "pending": 42, "timerLogBytes": 640}
    assert (s1.owner, s1.epoch, s1.write_ms, s1.reader) == ("put-1", 5, 2000, None)
    assert s2.to_status() == {"shard": 2}


def test_a_reader_figure_never_comes_from_a_writer_pod() -> None:
    scrapes = {"put-0": parse_prometheus(stage_metrics("enqueue-put", 0, 1, read_ms=5, write_ms=9))}
    (s0,) = shard_status(scrapes, 1)
    assert s0.read_ms is None and s0.write_ms == 9


def test_a_shard_an_owner_cannot_open_is_named_with_the_pod_and_error() -> None:
    m = Metrics()
    m.set("shard_open_failed", 1, shard=1, stage="enqueue-put", error="OSError")
    m.set("shard_open_failed", 0, shard=0, stage="enqueue-put", error="OSError")  # opened since
    s0, s1 = shard_status({"put-0": parse_prometheus(render(m))}, 2)
    assert s0.open_errors == [] and "openError" not in s0.to_status()
    assert s1.to_status()["openError"] == "enqueue-put put-0: OSError"
