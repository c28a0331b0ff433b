"""What a new user hit with the command line (issue 32), each checked the way they meet it, in
this process (``timerwheel.cli.main``) where the command allows it."""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from timerwheel import cli
from timerwheel.cli import main, make_parser
from timerwheel.cli.common import CliError, build_config, with_stored_settings
from timerwheel.log import configure_logging
from timerwheel.records import OutRecord
from timerwheel.runtime.embedded import EmbeddedTimerwheel
from timerwheel.transports.kafka.log import KafkaCommitLog
from timerwheel.wire import Ticket

SETTINGS = {"tick_ms": 100, "roll_window_ms": 60_000, "shards": 2, "fsync": False}


class _CurrentStderr:
    """Log lines go to whatever ``sys.stderr`` is when they are written (each test captures its own)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


@pytest.fixture(autouse=True)
def _logs_to_the_current_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "configure_logging", lambda level: configure_logging(level, _CurrentStderr()))
    configure_logging("INFO", _CurrentStderr())


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def errors(err: str) -> list[str]:
    """The command's own lines on stderr (the JSON log lines left out)."""
    return [line for line in err.splitlines() if line.startswith("timerwheel: ")]


@pytest.fixture
def service(tmp_path: Path) -> Iterator[EmbeddedTimerwheel]:
    """A running embedded service on the system clock, as `make run` is."""
    with EmbeddedTimerwheel(tmp_path / "data", **SETTINGS) as tw:  # type: ignore[arg-type]
        yield tw


def _wait(condition: Callable[[], bool], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _stdin(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, data: bytes) -> None:
    """Standard input holding ``data``: a real file (``--lines`` reads its descriptor)."""
    path = tmp_path / f"stdin-{uuid.uuid4().hex[:6]}"
    path.write_bytes(data)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(open(path, "rb")))  # noqa: SIM115 - closed with the test


# -- times and durations ---------------------------------------------------------------------------

def test_durations_and_times_take_what_people_write(service: EmbeddedTimerwheel,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    data = service.config.data_dir
    before = int(time.time() * 1000)
    for given, delay in (("1h30m", 5_400_000), ("1.5s", 1_500), ("2w", 14 * 86_400_000), ("250ms", 250)):
        code, out, _err = run(capsys, "schedule", "--data-dir", data, "--topic", "t", "--delay", given)
        assert code == 0
        assert 0 <= Ticket.parse(out.strip()).deliver_at_ms - before - delay < 60_000, given
    at = datetime.fromtimestamp(before // 1000 + 86_400 * 100, UTC).replace(microsecond=0)
    code, out, _err = run(capsys, "schedule", "--data-dir", data, "--topic", "t", "--deliver-at", at.isoformat())
    assert code == 0 and Ticket.parse(out.strip()).deliver_at_ms == int(at.timestamp()) * 1000
    code, out, _err = run(capsys, "schedule", "--data-dir", data, "--topic", "t", "--deliver-at",
                          at.strftime("%Y-%m-%dT%H:%M:%S"))  # no zone: UTC
    assert code == 0 and Ticket.parse(out.strip()).deliver_at_ms == int(at.timestamp()) * 1000
    code, out, _err = run(capsys, "schedule", "--data-dir", data, "--topic", "t", "--deliver-at", "now+5m")
    assert code == 0 and 0 <= Ticket.parse(out.strip()).deliver_at_ms - before - 300_000 < 60_000
    code, out, err = run(capsys, "schedule", "--data-dir", data, "--topic", "t", "--deliver-at", "2020-01-01T00:00:00Z")
    assert code == 0 and errors(err) and "in the past" in errors(err)[0] and "--deliver-at" in errors(err)[0]


@pytest.mark.parametrize(("args", "expected"), [
    (["--delay", "-5s"], "argument --delay: a duration cannot be negative, got '-5s'"),
    (["--delay", "5x"], "argument --delay: expected a duration such as 5000 (ms), 250ms, 5s, 1.5s, 10m, 1h30m, 2d, 2w"),
    (["--delay-ms", "-1h"], "a duration cannot be negative, got '-1h'"),
    (["--deliver-at", "tomorrow"], "argument --deliver-at: expected epoch ms (1700000000000), now, now+5m"),
])
def test_a_bad_duration_or_time_names_the_flag_and_the_accepted_forms(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], expected: str) -> None:
    with pytest.raises(SystemExit) as done:
        main(["schedule", "--data-dir", str(tmp_path), "--topic", "t", *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and len(lines) == 1 and expected in lines[0], lines
    assert "expected one argument" not in lines[0]


# -- values ----------------------------------------------------------------------------------------

def test_values_from_a_file_from_stdin_and_binary_come_out_faithfully(
        service: EmbeddedTimerwheel, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    data = service.config.data_dir
    binary = bytes(range(256))
    (tmp_path / "blob").write_bytes(binary)
    assert run(capsys, "schedule", "--data-dir", data, "--topic", "bin", "--delay", "0", "--value",
               f"@{tmp_path / 'blob'}")[0] == 0
    _stdin(monkeypatch, tmp_path, "héllo\nwörld".encode())
    assert run(capsys, "schedule", "--data-dir", data, "--topic", "bin", "--delay", "0", "--value", "-")[0] == 0
    code, _out, err = run(capsys, "schedule", "--data-dir", data, "--topic", "bin", "--delay", "0", "--value",
                          f"@{tmp_path / 'missing'}")
    assert code == 2 and "--value: cannot read" in err
    _wait(lambda: len(service.read("bin")) == 2)
    code, out, _err = run(capsys, "consume", "--data-dir", data, "--topic", "bin")
    values = [json.loads(line)["value"] for line in out.splitlines()]
    assert code == 0 and {"base64": base64.b64encode(binary).decode()} in values and "héllo\nwörld" in values


def test_consume_raw_writes_the_values_bytes(service: EmbeddedTimerwheel, tmp_path: Path,
                                             capfdbinary: pytest.CaptureFixture[bytes]) -> None:
    service.schedule("raw", b"\xff\x00one", delay_ms=0)
    service.schedule("raw", b"two", delay_ms=0)
    _wait(lambda: len(service.read("raw")) == 2)
    assert main(["consume", "--data-dir", service.config.data_dir, "--topic", "raw", "--raw"]) == 0
    assert sorted(capfdbinary.readouterr().out.split(b"\n")[:2]) == [b"two", b"\xff\x00one"]


def test_lines_schedule_one_message_per_line_with_keys(
        service: EmbeddedTimerwheel, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    data = service.config.data_dir
    lines = [f"k{i}\tvalue {i}" for i in range(2_500)]  # more than one append's worth
    _stdin(monkeypatch, tmp_path, ("\n".join(lines[:-1]) + "\r\n" + lines[-1]).encode())  # CRLF, no final newline
    code, out, _err = run(capsys, "schedule", "--data-dir", data, "--topic", "many", "--delay", "100ms", "--lines",
                          "--key-separator", "\\t", "--header", "batch=1")
    tickets = [Ticket.parse(t) for t in out.split()]
    assert code == 0 and len(tickets) == 2_500 and len({t.message_id for t in tickets}) == 2_500
    _wait(lambda: len(service.read("many")) == 2_500)
    got = {(r.key, r.value, r.header("batch")) for r in service.read("many")}
    assert got == {(f"k{i}".encode(), f"value {i}".encode(), b"1") for i in range(2_500)}

    _stdin(monkeypatch, tmp_path, b"a\tb\nno separator\n")
    code, out, err = run(capsys, "schedule", "--data-dir", data, "--topic", "many", "--delay", "1s", "--lines",
                         "--key-separator", "\t")
    assert code == 2 and len(out.split()) == 1, "the line before the bad one is scheduled, its ticket printed"
    assert "standard input line 2: no --key-separator" in errors(err)[0]
    code, _out, err = run(capsys, "schedule", "--data-dir", data, "--topic", "many", "--delay", "1s", "--lines",
                          "--value", "x")
    assert code == 2 and "--value: not with --lines" in err

    monkeypatch.setenv("TW_MAX_RECORD_BYTES", "1024")
    _stdin(monkeypatch, tmp_path, b"first\nsecond\n" + b"x" * 2000 + b"\nlast\n")  # one read: one batch
    code, out, err = run(capsys, "schedule", "--data-dir", data, "--topic", "sized", "--delay", "100ms", "--lines")
    assert code == 2 and len(out.split()) == 2, "the lines before the refused one are scheduled, their tickets printed"
    assert "standard input line 3: refused, the service would dead-letter it: record of" in errors(err)[0]
    assert "exceeds TW_MAX_RECORD_BYTES 1024" in errors(err)[0]
    _wait(lambda: len(service.read("sized")) == 2)
    time.sleep(0.3)
    assert sorted(r.value for r in service.read("sized")) == [b"first", b"second"]


# -- the data directory, the ticket ----------------------------------------------------------------

def test_schedule_refuses_a_directory_no_service_has_run_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("# someone's\n")
    for directory in (home, tmp_path / "empty"):
        directory.mkdir(exist_ok=True)
        code, _out, err = run(capsys, "schedule", "--data-dir", str(directory), "--topic", "t", "--delay", "1s")
        assert code == 2 and f"--data-dir: {directory} holds no timerwheel.json" in err
        assert not (directory / "log").exists(), "a refused schedule wrote a log nobody reads"
    code, _out, err = run(capsys, "schedule", "--data-dir", str(home), "--create-data-dir", "--topic", "t",
                          "--delay", "1s")
    assert code == 2 and not (home / "log").exists(), "--create-data-dir made a data directory in a full directory"
    assert run(capsys, "schedule", "--data-dir", str(tmp_path / "empty"), "--create-data-dir", "--topic", "t",
               "--delay", "1s")[0] == 0


def test_a_ticket_naming_a_partition_that_does_not_exist_is_one_line(
        service: EmbeddedTimerwheel, capsys: pytest.CaptureFixture[str]) -> None:
    future = int(time.time() * 1000) + 3_600_000
    for command in (["cancel"], ["reschedule", "--delay", "1h"]):
        code, _out, err = run(capsys, *command[:1], "--data-dir", service.config.data_dir, f"tw1.99.{future}.x",
                              *command[1:])
        assert code == 2 and errors(err) == [
            "timerwheel: error: ticket: partition 99 does not exist: timer topic '__timer' has 4 partitions (a ticket "
            "of another timer topic or cluster?)"], err


# -- cancel, reschedule, pending -------------------------------------------------------------------

def test_cancel_says_whether_the_message_was_pending(service: EmbeddedTimerwheel,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    data = service.config.data_dir
    code, out, _err = run(capsys, "schedule", "--data-dir", data, "--topic", "orders", "--delay", "1h", "--id", "o-1")
    ticket = out.strip()
    code, out, _err = run(capsys, "cancel", "--data-dir", data, ticket)
    assert code == 0 and out.startswith("cancel sent for o-1: it was pending, due ")
    code, _out, err = run(capsys, "cancel", "--data-dir", data, ticket)  # again
    assert code == 1 and "o-1, but it is not pending" in errors(err)[0]
    made_up = str(Ticket(0, int(time.time() * 1000) + 3_600_000, "never-scheduled"))
    code, _out, err = run(capsys, "cancel", "--data-dir", data, made_up)
    assert code == 1 and "never-scheduled, but it is not pending" in errors(err)[0]


def test_cancel_by_id_through_the_pending_index_and_pending_shows_the_ticket(
        service: EmbeddedTimerwheel, capsys: pytest.CaptureFixture[str]) -> None:
    data = service.config.data_dir
    _code, out, _err = run(capsys, "schedule", "--data-dir", data, "--topic", "orders", "--delay", "1h", "--id", "o-2")
    ticket = out.strip()
    _wait(lambda: main(["pending", "--data-dir", data, "--id", "o-2"]) == 0
          and json.loads(capsys.readouterr().out)["count"] == 1)
    code, out, _err = run(capsys, "pending", "--data-dir", data, "--id", "o-2", "--iso")
    [shown] = json.loads(out)["timers"]
    assert shown["ticket"] == ticket and shown["deliver_at"].endswith("Z") and "deliver_at_ms" not in shown
    code, out, _err = run(capsys, "cancel", "--data-dir", data, "--id", "o-2")
    assert code == 0 and out.startswith("cancel sent for o-2: it was pending")
    code, _out, err = run(capsys, "cancel", "--data-dir", data, "--id", "o-2")
    assert code == 1 and "o-2 is not pending" in errors(err)[0] and "nothing was sent" in errors(err)[0]
    assert json.loads(run(capsys, "pending", "--data-dir", data, "--id", "o-2")[1])["count"] == 0


def test_reschedule_of_a_spent_ticket_is_refused_and_writes_nothing(
        service: EmbeddedTimerwheel, capsys: pytest.CaptureFixture[str]) -> None:
    data = service.config.data_dir
    _code, out, _err = run(capsys, "schedule", "--data-dir", data, "--topic", "orders", "--delay", "1h", "--id", "o-3")
    first = out.strip()
    code, out, _err = run(capsys, "reschedule", "--data-dir", data, first, "--delay", "2h")
    assert code == 0
    second = out.strip()
    ends = service.commit_log.end_offsets("__timer")
    code, out, err = run(capsys, "reschedule", "--data-dir", data, first, "--delay", "3h")  # the same ticket again
    assert code == 1 and out == "" and "o-3 is not pending" in errors(err)[0] and "ticket is spent" in errors(err)[0]
    assert service.commit_log.end_offsets("__timer") == ends, "a refused reschedule wrote to the timer topic"
    # listed at its new time with its new ticket while the shards hold only the old revision and the marker
    _wait(lambda: main(["pending", "--data-dir", data, "--id", "o-3"]) == 0
          and [t["ticket"] for t in json.loads(capsys.readouterr().out)["timers"]] == [second])
    [shown] = json.loads(run(capsys, "pending", "--data-dir", data, "--id", "o-3")[1])["timers"]
    assert shown["revision"] == 1 and shown["deliver_at_ms"] == Ticket.parse(second).deliver_at_ms
    code, out, _err = run(capsys, "cancel", "--data-dir", data, second)
    assert code == 0 and out.startswith("cancel sent for o-3: it was pending"), out
    code, _out, err = run(capsys, "reschedule", "--data-dir", data, second, "--delay", "3h")  # a cancelled one
    assert code == 1 and "o-3 is not pending" in errors(err)[0], err
    pending = json.loads(run(capsys, "pending", "--data-dir", data, "--topic", "orders")[1])
    assert pending["count"] == 0, "a cancelled or rescheduled message came back"


def test_cancel_on_kafka_without_shards_says_it_cannot_tell(
        kafka_bootstrap: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    topic = f"dayone-timer-{uuid.uuid4().hex[:8]}"
    ticket = str(Ticket(0, int(time.time() * 1000) + 3_600_000, "x"))
    code, out, _err = run(capsys, "cancel", "--kafka", kafka_bootstrap, "--timer-topic", topic, "--data-dir",
                          str(tmp_path / "none"), ticket)
    assert code == 0 and out.startswith("cancel sent for x (due ") and "is not known here: the data directory" in out


def test_schedule_on_kafka_warns_of_a_timer_topic_no_timerwheel_has_made(
        kafka_bootstrap: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The notes' first message went to a timer topic nothing read, in silence: a timer topic
    that does not exist is one no timerwheel has started on (a stage makes its own)."""
    topic = f"dayone-unread-{uuid.uuid4().hex[:8]}"
    code, out, err = run(capsys, "schedule", "--kafka", kafka_bootstrap, "--timer-topic", topic, "--topic", "orders",
                         "--delay", "1h")
    assert code == 0 and out.startswith("tw1.")
    assert f"warning: timer topic '{topic}' does not exist on {kafka_bootstrap}, so no timerwheel reads it" in err
    assert f"TW_TIMER_TOPIC={topic}" in err
    code, out, err = run(capsys, "schedule", "--kafka", kafka_bootstrap, "--timer-topic", topic, "--topic", "orders",
                         "--delay", "1h")
    assert code == 0 and "warning" not in err  # it exists now, as a stage would have made it


# -- consume ---------------------------------------------------------------------------------------

def test_consume_on_kafka_reads_to_the_end_and_refuses_a_missing_topic(
        kafka_bootstrap: str, capsys: pytest.CaptureFixture[str]) -> None:
    topic = f"dayone-consume-{uuid.uuid4().hex[:8]}"
    log = KafkaCommitLog(kafka_bootstrap)
    try:
        log.ensure_topic(topic, 3)
        log.append([OutRecord(topic, f"k{i}".encode(), f"v{i}".encode(), (("tw-delivered-at", b"1700000000000"),))
                    for i in range(30)])
    finally:
        log.close()
    code, out, _err = run(capsys, "consume", "--kafka", kafka_bootstrap, "--topic", topic, "--iso")
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and sorted(r["value"] for r in records) == sorted(f"v{i}" for i in range(30))
    assert records[0]["timestamp"].endswith("Z") and records[0]["headers"]["tw-delivered-at"] == \
        "2023-11-14T22:13:20.000Z"
    code, out, err = run(capsys, "consume", "--kafka", kafka_bootstrap, "--topic", topic + "-typo")
    assert code == 2 and out == "" and f"--topic: topic '{topic}-typo' does not exist" in err


def test_consume_of_a_local_topic_that_does_not_exist_says_so_and_makes_nothing(
        service: EmbeddedTimerwheel, capsys: pytest.CaptureFixture[str]) -> None:
    code, _out, err = run(capsys, "consume", "--data-dir", service.config.data_dir, "--topic", "ordres")
    assert code == 2 and "topic 'ordres' does not exist" in err
    assert not (Path(service.config.data_dir) / "log" / "ordres").exists()


def test_inspect_shows_iso_times(service: EmbeddedTimerwheel, capsys: pytest.CaptureFixture[str]) -> None:
    _wait(lambda: all(s["W"] for s in service.inspect()["shards"]))
    code, out, _err = run(capsys, "inspect", "--data-dir", service.config.data_dir, "--iso")
    report = json.loads(out)
    assert code == 0 and report["now"].endswith("Z") and all(s["W"].endswith("Z") for s in report["shards"])
    assert report["source"]["cluster_id"], "inspect shows where the shards' records come from"


# -- run, demo, help -------------------------------------------------------------------------------

def test_run_on_an_existing_data_directory_adopts_its_settings(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with EmbeddedTimerwheel(data, shards=3, tick_ms=10, roll_window_ms=7_200_000, fsync=False):
        pass

    def config(*argv: str) -> object:
        args = make_parser().parse_args(["run", "--data-dir", str(data), *argv])
        return with_stored_settings(build_config(args), args)

    adopted = config()
    assert (adopted.shards, adopted.tick_ms, adopted.roll_window_ms) == (3, 10, 7_200_000)  # type: ignore[attr-defined]
    with pytest.raises(CliError, match=r"^--shards: stored 3, requested 2: .*leave --shards out .*never changes"):
        config("--shards", "2")
    with pytest.raises(CliError, match=r"^--roll-window: stored 7200000, requested 3600000: .*--change-window"):
        config("--roll-window", "1h")


def test_demo_cancels_one_in_twenty(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _err = run(capsys, "demo", "--count", "30", "--max-delay", "1s")
    summary = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and summary["cancelled"] == 2 and summary["delivered"] == 28 and summary["early"] == 0


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = make_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_command_has_a_description_and_an_example() -> None:
    for name, sub in _commands().items():
        text = sub.format_help()
        assert sub.description and len(sub.description) > 40, name
        assert "examples:\n" in text and f"timerwheel {name}" in text.split("examples:\n", 1)[1], name
    stage = _commands()["stage"].format_help()
    for variable in ("TW_KAFKA_BOOTSTRAP", "TW_REDIS_URL", "TW_DATA_DIR", "TW_SHARDS", "TW_HTTP_PORT"):
        assert variable in stage, f"stage --help does not name {variable}"


def test_one_spelling_per_flag_and_the_old_ones_still_work() -> None:
    shown = {f for sub in _commands().values() for a in sub._actions if a.help != argparse.SUPPRESS
             for f in a.option_strings}
    assert not {f for f in shown if f.endswith(("-ms", "-s")) and f != "--tick-ms"}, "a unit in a flag's name"
    parser = make_parser()
    assert parser.parse_args(["schedule", "--topic", "t", "--delay-ms", "5s"]).delay_ms == 5_000
    assert parser.parse_args(["rebuild-wheel", "--shard", "0", "--roll-window-ms", "4d"]).roll_window == 4 * 86_400_000
    assert parser.parse_args(["rebuild-wheel", "--shard", "0", "--wheel-span-ms", "8d"]).wheel_span == 8 * 86_400_000
    assert parser.parse_args(["audit", "--kafka", "k", "--out", "o", "--grace-ms", "60000", "--now-ms", "5"]).grace_ms \
        == 60_000
    assert parser.parse_args(["demo", "--max-delay-s", "2"]).max_delay_s == 2.0
