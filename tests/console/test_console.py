"""The console over a real data directory (an embedded timerwheel on a simulated clock, stopped):
paging pending timers, filters, id search, the overview's figures from real metric expositions,
the write actions' records (read back from the commit log) and every refusal; and `top`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from rich.console import Console as RichConsole
from starlette.testclient import TestClient
from timerwheel import EmbeddedTimerwheel, SimulatedClock, Ticket
from timerwheel.config import TimerConfig
from timerwheel.console.app import create_app, parse_time
from timerwheel.console.browse import Columns, browse_dead_letters, browse_pending, reason_kind
from timerwheel.console.overview import Counters, lateness, shard_rows
from timerwheel.console.source import Installation, Scrape, parse_metrics
from timerwheel.console.top import run as top_run
from timerwheel.exposition import render
from timerwheel.metrics import Metrics
from timerwheel.records import OutRecord, Record
from timerwheel.transports.local.log import LocalCommitLog
from timerwheel.wire import H_CANCEL, H_DELIVER_AT, H_ERROR, H_ID, H_SOURCE, H_TOPIC

START = 1_800_000_000_000
TOKEN = "t0ken"
CANCELLED = {"m010", "m020"}


@dataclass
class Data:
    path: Path
    clock: SimulatedClock
    config: TimerConfig
    due: dict[str, int]
    topic: dict[str, str]
    rolled: set[str]
    #: id -> the time a reschedule moved it to (listed by id only until its old time: not in ``due``)
    moved: dict[str, int]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Data:
    path = tmp_path_factory.mktemp("console") / "data"
    clock = SimulatedClock(start_ms=START)
    due: dict[str, int] = {}
    topic: dict[str, str] = {}
    with EmbeddedTimerwheel(path, clock=clock, tick_ms=100, roll_window_ms=60_000, shards=2, fsync=False) as tw:
        tickets = {}
        for i in range(300):
            mid, t = f"m{i:03d}", "a" if i % 3 == 0 else "b"
            due[mid], topic[mid] = START + 1_000 + 150 * i, t
            tickets[mid] = tw.schedule(t, f"value {i}".encode(), key=f"k{i}".encode(), deliver_at_ms=due[mid],
                                       message_id=mid, headers=[("x-n", str(i).encode())])
        rolled = set()
        for j in range(5):
            mid = f"r{j}"
            due[mid], topic[mid] = START + 300_000 + 1_000 * j, "b"
            tw.schedule("b", b"far", deliver_at_ms=due[mid], message_id=mid)
            rolled.add(mid)
        for mid in CANCELLED:
            tw.cancel(tickets[mid])
        moved = {"v0": START + 900_000}
        old = tw.schedule("a", b"moved", deliver_at_ms=START + 50_000, message_id="v0")
        tw.wait_idle()
        tw.reschedule(old, deliver_at_ms=moved["v0"])
        tw.wait_idle()
        config = tw.config
    return Data(path, clock, config, due, topic, rolled, moved)


@pytest.fixture
def inst(data: Data) -> Iterator[Installation]:
    i = Installation(data.config, [], clock=data.clock)
    yield i
    i.close()


def _all_pages(inst: Installation, data: Data, **kw: object) -> list[list[str]]:
    pages, after = [], None
    with inst.shards() as shards:
        while True:
            page = browse_pending(shards, inst.commit_log, data.config, START, START + 3_600_000, after=after, **kw)
            pages.append([i.message_id for i in page.items])
            keys = [(i.fire_ms, i.shard, i.position) for i in page.items]
            assert keys == sorted(keys)
            if page.next_cursor is None:
                return pages
            after = page.next_cursor


def test_pages_walk_every_pending_message_once_in_firing_order(inst: Installation, data: Data) -> None:
    pages = _all_pages(inst, data, limit=37)
    seen = [m for p in pages for m in p]
    assert len(seen) == len(set(seen))
    assert set(seen) == set(data.due) - CANCELLED
    assert all(len(p) <= 37 for p in pages) and len(pages) >= 300 // 37


def test_a_rolled_message_is_listed_at_its_hop_with_its_delivery_time(inst: Installation, data: Data) -> None:
    with inst.shards() as shards:
        page = browse_pending(shards, inst.commit_log, data.config, START, START + 3_600_000, message_id="r3")
    (item,) = page.items
    assert item.rolled and item.deliver_at_ms == data.due["r3"] and item.fire_ms < item.deliver_at_ms
    assert item.ticket == f"tw1.{item.partition}.{data.due['r3']}.r3"


def test_a_time_range_lists_exactly_the_messages_due_in_it(inst: Installation, data: Data) -> None:
    lo, hi = START + 10_000, START + 20_000
    with inst.shards() as shards:
        page = browse_pending(shards, inst.commit_log, data.config, lo, hi, limit=500)
    assert page.next_cursor is None
    assert {i.message_id for i in page.items} == {m for m, t in data.due.items() if lo <= t < hi} - CANCELLED
    first = page.items[0]
    assert first.key == f"k{int(first.message_id[1:])}".encode() and ("x-n", first.message_id[1:].lstrip("0")
                                                                         .encode() or b"0") in first.headers


def test_a_destination_filter_pages_through_exactly_its_messages(inst: Installation, data: Data) -> None:
    pages = _all_pages(inst, data, limit=20, topic="a")
    seen = [m for p in pages for m in p]
    assert sorted(seen) == sorted(m for m, t in data.topic.items() if t == "a" and m not in CANCELLED)
    assert all(len(p) == 20 for p in pages[:-1])


def test_a_walk_stops_at_its_budget_and_its_cursor_goes_on(inst: Installation, data: Data) -> None:
    pages = _all_pages(inst, data, limit=50, budget=20)
    seen = [m for p in pages for m in p]
    assert len(seen) == len(set(seen)) and set(seen) == set(data.due) - CANCELLED
    assert len(pages) > len(seen) // 50 + 1  # the budget cut pages short


def test_by_id_finds_the_message_and_not_a_cancelled_one(inst: Installation, data: Data) -> None:
    with inst.shards() as shards:
        found = browse_pending(shards, inst.commit_log, data.config, 0, 1 << 62, message_id="m050")
        gone = browse_pending(shards, inst.commit_log, data.config, 0, 1 << 62, message_id="m010")
    assert [(i.message_id, i.deliver_at_ms, i.topic) for i in found.items] == [("m050", data.due["m050"], "b")]
    assert found.method == "scan" and gone.items == []


def _exposition(epochs: dict[int, int], write_ms: int, delivered: float) -> Scrape:
    m = Metrics()
    for shard, epoch in epochs.items():
        m.set("owner_epoch", epoch, shard=shard, stage="enqueue-put")
        m.set("write_ms", write_ms + shard, shard=shard)
        m.set("input_wait_ms", 7, shard=shard)
    m.inc("delivered", delivered, topic="a")
    m.observe_many("delivery_lateness_ms", [3] * 50 + [120] * 49 + [7000])
    return Scrape("t", f"10.0.0.{len(epochs)}:8080", parse_metrics(render(m)))


def test_the_owner_of_a_shard_is_the_process_with_the_highest_epoch() -> None:
    old = _exposition({0: 3}, 1_000, 5)
    new = _exposition({0: 5, 1: 2}, 2_000, 5)
    rows = shard_rows([old, new])
    assert rows[0].owner == new.address and rows[0].epoch == 5 and rows[0].w_ms == 2_000
    assert rows[1].owner == new.address and rows[1].w_ms == 2_001 and rows[1].input_wait_ms == 7
    assert rows[0].reader is None


def test_rates_count_a_restarted_process_from_zero_and_lateness_estimates_quantiles() -> None:
    counters = Counters()
    counters.add([_exposition({0: 1}, 0, 100)])
    assert counters.add([_exposition({0: 1}, 0, 130)])["delivered"] == 30
    assert counters.add([_exposition({0: 1}, 0, 4)])["delivered"] == 34  # restarted: 4 new ones
    buckets, p50, p99, early = lateness([_exposition({0: 1}, 0, 1)])
    assert dict(buckets)[5.0] == 50 and dict(buckets)[150.0] == 49 and dict(buckets)[10000.0] == 1
    assert p50 is not None and p50 <= 5 and p99 is not None and 100 <= p99 <= 150 and early == 0


def _form(client: TestClient, path: str = "/pending") -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', client.get(path).text)
    assert match
    return match.group(1)


def _detail(text: str) -> str:
    match = re.search(r'id="outcome-detail">([^<]*)', text)
    assert match, text[-500:]
    return match.group(1).replace("&#39;", "'")


def _last_timer_record(data: Data, partition: int) -> Record:
    log = LocalCommitLog(data.path / "log", default_partitions=1, fsync=False)
    try:
        end = log.end_offsets(data.config.timer_topic)[partition]
        rec = log.read(data.config.timer_topic, [(partition, end - 1)])[0]
        assert rec is not None
        return rec
    finally:
        log.close()


def test_writes_are_refused_read_only_locked_with_a_stale_form_or_from_another_site(inst: Installation) -> None:
    with TestClient(create_app(inst, start_sampler=False)) as c:
        r = c.post("/pending/cancel", data={"csrf": _form(c), "id": "m100"})
        assert r.status_code == 403 and "read-only: no action token is configured" in _detail(r.text)
    with TestClient(create_app(inst, action_token=TOKEN, start_sampler=False)) as c:
        csrf = _form(c)
        r = c.post("/pending/cancel", data={"csrf": csrf, "id": "m100"})
        assert r.status_code == 403 and "need the action token" in _detail(r.text)
        r = c.post("/unlock", data={"csrf": csrf, "token": "guess"})
        assert r.status_code == 403 and _detail(r.text) == "that is not the action token"
        assert c.post("/unlock", data={"csrf": csrf, "token": TOKEN}, follow_redirects=False).status_code == 303
        r = c.post("/pending/cancel", data={"csrf": "stale", "id": "m100"})
        assert r.status_code == 403 and "CSRF token does not match" in _detail(r.text)
        r = c.post("/pending/cancel", data={"csrf": csrf, "id": "m100"}, headers={"origin": "http://evil.example"})
        assert r.status_code == 403 and "another site" in _detail(r.text)
        r = c.post("/pending/cancel", data={"csrf": csrf, "id": "nope"})
        assert r.status_code == 409 and "no pending message with id 'nope'" in _detail(r.text)
        assert "t0ken" not in c.get("/").text + c.get("/pending").text + c.get("/dead-letters").text


def test_a_cancel_from_the_console_is_a_tw_cancel_record_with_the_delivery_time(inst: Installation,
                                                                                data: Data) -> None:
    with TestClient(create_app(inst, action_token=TOKEN, start_sampler=False)) as c:
        csrf = _form(c)
        c.post("/unlock", data={"csrf": csrf, "token": TOKEN})
        r = c.post("/pending/cancel", data={"csrf": csrf, "id": "m200"})
        assert r.status_code == 200 and "Cancelled" in r.text, _detail(r.text)
    ticket = re.search(r'id="outcome-ticket">([^<]+)<', r.text)
    assert ticket
    partition = int(ticket.group(1).split(".")[1])
    rec = _last_timer_record(data, partition)
    assert rec.header(H_CANCEL) == b"m200" and rec.header(H_DELIVER_AT) == str(data.due["m200"]).encode()


def test_a_reschedule_writes_one_record_that_replaces_the_ticket_keeping_the_id(inst: Installation, data: Data) -> None:
    with TestClient(create_app(inst, action_token=TOKEN, start_sampler=False)) as c:
        csrf = _form(c)
        c.post("/unlock", data={"csrf": csrf, "token": TOKEN})
        r = c.post("/pending/reschedule", data={"csrf": csrf, "id": "m250", "deliver_at": "now+10m"})
        assert r.status_code == 200, _detail(r.text)
        r2 = c.post("/pending/reschedule", data={"csrf": csrf, "id": "m251", "deliver_at": "now-1m"})
        assert r2.status_code == 409 and "in the past" in _detail(r2.text)
    ticket = re.search(r'id="outcome-ticket">([^<]+)<', r.text)
    assert ticket
    new = Ticket.parse(ticket.group(1))
    assert (new.message_id, new.revision, new.deliver_at_ms) == ("m250", 1, START + 600_000)
    rec = _last_timer_record(data, new.partition)
    assert rec.header(H_ID) == b"m250" and rec.header(H_TOPIC) == b"b" and rec.value == b"value 250"
    assert rec.header(H_DELIVER_AT) == str(START + 600_000).encode() and rec.header("tw-revision") == b"1"
    assert rec.header("tw-replaces") == str(data.due["m250"]).encode()


def test_a_moved_message_is_found_by_id_at_its_new_time_and_cancelled_as_its_new_revision(
        inst: Installation, data: Data) -> None:
    """Rescheduled (issue 31) and its old time not come yet: the shards hold its old revision and
    the reschedule's marker only. Found by id as the reschedule record, its new time and revision;
    a cancel from the console names that revision (a cancel of revision 0 would be void)."""
    from timerwheel.console.browse import find_pending

    with inst.shards() as shards:
        item = find_pending(shards, inst.commit_log, data.config, "v0")
    assert item is not None and (item.revision, item.deliver_at_ms, item.topic) == (1, data.moved["v0"], "a")
    assert item.ticket == f"tw2.{item.partition}.{data.moved['v0']}.1.v0"
    with TestClient(create_app(inst, action_token=TOKEN, start_sampler=False)) as c:
        csrf = _form(c)
        c.post("/unlock", data={"csrf": csrf, "token": TOKEN})
        r = c.post("/pending/cancel", data={"csrf": csrf, "id": "v0"})
        assert r.status_code == 200 and "Cancelled" in r.text, _detail(r.text)
    rec = _last_timer_record(data, item.partition)
    assert rec.header(H_CANCEL) == b"v0" and rec.header("tw-revision") == b"1"
    assert rec.header(H_DELIVER_AT) == str(data.moved["v0"]).encode()


def test_deliver_now_writes_a_copy_due_now_then_the_cancel_and_is_refused_a_second_time(
        inst: Installation, data: Data) -> None:
    with TestClient(create_app(inst, action_token=TOKEN, start_sampler=False)) as c:
        csrf = _form(c)
        c.post("/unlock", data={"csrf": csrf, "token": TOKEN})
        r = c.post("/pending/deliver-now", data={"csrf": csrf, "id": "m260"})
        assert r.status_code == 200, _detail(r.text)
        ticket = re.search(r'id="outcome-ticket">([^<]+)<', r.text)
        assert ticket
        copy = Ticket.parse(ticket.group(1))
        assert (copy.message_id, copy.revision) == ("m260", 1) and copy.deliver_at_ms <= inst.now_ms()
        cancel = _last_timer_record(data, copy.partition)
        assert cancel.header(H_CANCEL) == b"m260" and cancel.header(H_DELIVER_AT) == str(data.due["m260"]).encode()
        r2 = c.post("/pending/deliver-now", data={"csrf": csrf, "id": "m260"})
        assert r2.status_code == 409 and "cancelled already" in _detail(r2.text), _detail(r2.text)


def test_a_dead_letter_is_redriven_as_a_new_timer_record_and_one_the_service_refuses_is_not(
        inst: Installation, data: Data) -> None:
    log = inst.commit_log
    log.ensure_topic(data.config.dlq_topic, 1)
    log.append([
        OutRecord(data.config.dlq_topic, b"k", b"v", (
            (H_TOPIC, b"later"), (H_DELIVER_AT, str(START - 5_000).encode()), (H_ID, b"d1"), ("x-user", b"1"),
            (H_ERROR, b"destination topic 'later' does not exist (TW_MISSING_TOPIC=dlq)"),
            (H_SOURCE, f"{data.config.timer_topic}/1/5".encode()))),
        OutRecord(data.config.dlq_topic, None, b"w", (
            (H_TOPIC, b"__internal"), (H_DELIVER_AT, str(START).encode()),
            (H_ERROR, b"destination '__internal' is not allowed by TW_ALLOW_TOPICS"),
            (H_SOURCE, f"{data.config.timer_topic}/0/9".encode()))),
    ])
    page = browse_dead_letters(log, data.config)
    assert [d.header(H_ID) for d in page.items][:2] == ["", "d1"]
    assert page.kinds[reason_kind("destination topic 'x' does not exist (TW_MISSING_TOPIC=dlq)")] == 1
    with TestClient(create_app(inst, action_token=TOKEN, start_sampler=False)) as c:
        csrf = _form(c, "/dead-letters")
        c.post("/unlock", data={"csrf": csrf, "token": TOKEN})
        r = c.post("/dead-letters/redrive", data={"csrf": csrf, "source": "/0/9"})
        assert r.status_code == 200 and "Nothing redriven" in r.text and "not allowed" in r.text, r.text[-800:]
        r = c.post("/dead-letters/redrive", data={"csrf": csrf, "reason": "does not exist"})
        assert r.status_code == 200 and "1 timer record(s)" in _detail(r.text)
        everything = c.post("/dead-letters/redrive", data={"csrf": csrf})
        assert everything.status_code == 400 and "needs a reason or a source" in _detail(everything.text)
    ticket = re.search(r'id="outcome-ticket">([^<]+)<', r.text)
    assert ticket
    rec = _last_timer_record(data, int(ticket.group(1).split(".")[1]))
    headers = dict(rec.headers)
    assert headers[H_TOPIC] == b"later" and headers[H_ID] == b"d1" and headers["x-user"] == b"1"
    assert int(headers[H_DELIVER_AT]) == START and H_ERROR not in headers and H_SOURCE not in headers


def test_pages_answer_and_bad_input_is_one_clear_line(inst: Installation) -> None:
    with TestClient(create_app(inst, start_sampler=False)) as c:
        overview = c.get("/")
        assert overview.status_code == 200 and overview.text.count('class="shard"') == 2
        assert "default-src 'self'" in overview.headers["content-security-policy"]
        r = c.get("/pending?from=tomorrow")
        assert r.status_code == 400 and "expected epoch ms, now[+-DURATION]" in _detail(r.text)
        r = c.get("/pending?from=now%2B1h&to=now")
        assert r.status_code == 400 and "the range is empty" in _detail(r.text)
        assert c.get("/pending?limit=0").status_code == 400
        assert c.get("/pending?after=x.y").status_code == 400
        assert c.get("/nowhere").status_code == 404


def test_times_typed_without_a_zone_are_the_viewers() -> None:
    assert parse_time("2026-01-01T10:00", 0, tz_offset_min=-60) == parse_time("2026-01-01T10:00+01:00", 0)
    assert parse_time("now+5m", 1_000) == 301_000 and parse_time("12345", 0) == 12345


def test_top_prints_the_shards(inst: Installation) -> None:
    out = RichConsole(record=True, width=220)
    top_run(inst, 0.05, once=True, console=out)
    text = out.export_text()
    assert "no owner" in text and "due: next minute" in text
    assert len([line for line in text.splitlines() if re.match(r"^\W*[01]\s*│", line)]) == 2, text


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TW_")}
    return subprocess.run([sys.executable, "-m", "timerwheel.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_the_top_command_prints_a_frame_and_bad_flags_are_one_line(data: Data) -> None:
    out = _cli("top", "--once", "--every", "0.2", "--data-dir", str(data.path))
    assert out.returncode == 0, out.stderr
    assert "W lag" in out.stdout and "due: next minute" in out.stdout, out.stdout
    for args, named in ((("console", "--port", "99999"), "--port: must be 1..65535"),
                        (("console", "--metrics", "nohost"), "TW_CONSOLE_METRICS: expected host:port"),
                        (("top", "--data-dir", str(data.path / "nowhere")), "is not a directory"),
                        (("console", "--action-token-file", str(data.path / "none")), "--action-token-file")):
        bad = _cli(*args, *(("--data-dir", str(data.path)) if "--data-dir" not in args else ()))
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and named in bad.stderr, (args, bad.stderr)


def test_the_columns_of_a_filter_catch_up_with_what_was_written_since(tmp_path: Path) -> None:
    clock = SimulatedClock(start_ms=START)
    columns: dict[int, Columns] = {}

    def write(first: int, n: int) -> None:
        with EmbeddedTimerwheel(tmp_path / "d", clock=clock, tick_ms=100, shards=1, fsync=False) as tw:
            for i in range(first, first + n):
                tw.schedule("x" if i % 2 else "y", b"v", deliver_at_ms=START + 5_000 + i, message_id=f"c{i}")
            tw.wait_idle()

    def page() -> tuple[list[str], int]:
        inst = Installation(TimerConfig(data_dir=str(tmp_path / "d"), shards=1), [], clock=clock)
        try:
            with inst.shards() as shards:
                found = browse_pending(shards, inst.commit_log, inst.config, START, START + 60_000, topic="x",
                                       limit=100, columns=columns)
            return [i.message_id for i in found.items], found.scanned
        finally:
            inst.close()

    write(0, 10)
    assert page() == ([f"c{i}" for i in range(1, 10, 2)], 10)
    write(10, 6)
    assert page() == ([f"c{i}" for i in range(1, 16, 2)], 6)  # only the new records read
