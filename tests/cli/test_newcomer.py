"""What a newcomer hit with the command line (issue 17), each checked the way they met it."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from infra import free_port
from timerwheel.cli import main, make_parser

ENV = {**os.environ, "TW_LOG_LEVEL": "WARNING"}
#: A new terminal: the venv is not activated, so its bin/ is not on PATH.
NEW_TERMINAL_PATH = "/usr/local/bin:/usr/bin:/bin"


def tw(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "timerwheel.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or ENV)


class Server:
    def __init__(self, data: Path, port: int, printed: list[str]) -> None:
        self.data, self.port, self.printed = data, port, printed


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``timerwheel run`` as ``make run`` starts it (the venv's script, a relative data dir), 3 shards."""
    cwd = tmp_path_factory.mktemp("run")
    port = free_port()
    script = Path(sys.executable).parent / "timerwheel"
    assert script.exists(), "the venv has no timerwheel script"
    env = {**ENV, "PATH": NEW_TERMINAL_PATH, "TW_HTTP_PORT": str(port), "TW_SHARDS": "3"}
    proc = subprocess.Popen([str(script), "run", "--embedded", "--data-dir", "data"], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    printed: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, f"run exited: {proc.wait()}"
            printed.append(line.rstrip("\n"))
            if line.startswith("Stop with"):
                break
        yield Server(cwd / "data", port, printed)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_run_prints_commands_that_work_as_printed_in_a_new_terminal(server: Server, tmp_path: Path) -> None:
    commands = [line.strip() for line in server.printed if line.startswith("  ")]
    assert len(commands) == 3, server.printed
    env = {**ENV, "PATH": NEW_TERMINAL_PATH}
    for command in commands:
        # Another terminal: another working directory, no venv on PATH.
        if "--follow" in command:  # it prints the message scheduled above when it is delivered, and waits on
            follow = subprocess.Popen(["bash", "-c", command], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
            try:
                assert follow.stdout is not None
                assert json.loads(follow.stdout.readline())["value"] == "hello", command
            finally:
                follow.terminate()
                follow.wait(30)
            continue
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, (command, done.stderr)
    assert not (tmp_path / "data").exists(), "a printed command used a path relative to the server's directory"


def test_the_commit_logs_are_exported_from_the_package() -> None:
    import timerwheel
    from timerwheel import KafkaCommitLog, LocalCommitLog

    assert {"KafkaCommitLog", "LocalCommitLog"} <= set(timerwheel.__all__)
    assert (KafkaCommitLog.__name__, LocalCommitLog.__name__) == ("KafkaCommitLog", "LocalCommitLog")


def test_local_commit_log_of_the_data_dir_reaches_the_running_service(server: Server) -> None:
    from timerwheel import TimerClient
    from timerwheel.transports.local.log import LocalCommitLog

    tickets: list[object] = []

    def schedule() -> None:  # what a reader of the README writes
        tickets.append(TimerClient(LocalCommitLog(str(server.data))).schedule("orders", b"from-python",
                                                                               delay_ms=200))

    thread = threading.Thread(target=schedule, daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), "TimerClient(LocalCommitLog(data dir)) hangs on the data directory's lock"
    assert tickets
    deadline = time.monotonic() + 30
    values: list[str] = []
    while "from-python" not in values and time.monotonic() < deadline:
        out = tw("consume", "--data-dir", str(server.data), "--topic", "orders")
        values = [json.loads(line)["value"] for line in out.stdout.splitlines()]
        time.sleep(0.2)
    assert "from-python" in values, "the message went where the service does not read"


def test_embedded_run_serves_health_and_metrics_on_tw_http_port(server: Server) -> None:
    base = f"http://127.0.0.1:{server.port}"
    for path, body in (("/healthz", "ok"), ("/readyz", "ready")):
        with urllib.request.urlopen(base + path, timeout=10) as r:
            assert r.status == 200 and r.read().decode().strip() == body
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        assert r.status == 200 and "# TYPE" in r.read().decode()
    assert any(f":{server.port}/metrics" in line for line in server.printed)


def test_inspect_shows_every_shard_without_shards_flag(server: Server) -> None:
    every = json.loads(tw("inspect", "--data-dir", str(server.data)).stdout)
    assert [s["shard"] for s in every["shards"]] == [0, 1, 2]
    one = json.loads(tw("inspect", "--data-dir", str(server.data), "--shards", "1").stdout)
    assert [s["shard"] for s in one["shards"]] == [0]


def test_cancel_after_the_delivery_time_says_it_can_no_longer_take_effect(server: Server) -> None:
    data = str(server.data)
    early = tw("schedule", "--data-dir", data, "--topic", "orders", "--delay-ms", "0", "--value", "now")
    assert early.returncode == 0, early.stderr
    time.sleep(0.05)
    late = tw("cancel", "--data-dir", data, early.stdout.strip())
    assert late.returncode == 1
    assert "can no longer take effect" in late.stderr and len(late.stderr.strip().splitlines()) == 1
    future = tw("schedule", "--data-dir", data, "--topic", "orders", "--delay-ms", "1h")
    in_time = tw("cancel", "--data-dir", data, future.stdout.strip())
    assert in_time.returncode == 0 and in_time.stdout.startswith("cancel sent")


@pytest.mark.parametrize(
    ("args", "env", "reason"),
    [
        (["--topic", "no spaces!", "--delay", "5s"], {}, "--topic: refused, the service would dead-letter it: "
         "invalid destination topic name"),
        (["--topic", "__timer", "--delay", "5s"], {}, "--topic: refused, the service would dead-letter it: "
         "destination is the timer topic"),
        (["--topic", "other", "--delay", "5s"], {"TW_ALLOW_TOPICS": r"orders\..*"}, "not allowed by TW_ALLOW_TOPICS"),
        (["--topic", "orders", "--delay", "401d"], {}, "--delay: refused, the service would dead-letter it: delay "
         "of 34646400000 ms exceeds TW_MAX_DELAY_MS 34560000000"),
        (["--topic", "orders", "--deliver-at", "253402300800000"], {}, "--deliver-at: refused, the service would "
         "dead-letter it: --deliver-at out of range"),
        (["--topic", "orders", "--delay-ms", "99999999999999999"], {"TW_MAX_DELAY_MS": str(2**62)}, "out of range"),
    ],
)
def test_schedule_refuses_what_the_service_would_dead_letter(tmp_path: Path, args: list[str], env: dict[str, str],
                                                              reason: str) -> None:
    result = tw("schedule", "--data-dir", str(tmp_path), "--create-data-dir", *args, env={**ENV, **env})
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("timerwheel: error:") and reason in lines[0], result.stderr
    assert "tw-" not in lines[0] and "max_delay_ms" not in lines[0], "the error names the wire, not the flag"
    timer_topic = tw("consume", "--data-dir", str(tmp_path), "--create-data-dir", "--topic", "__timer")
    assert timer_topic.returncode == 0 and timer_topic.stdout == "", "a refused timer was written"


def test_bad_delay_level_and_a_file_as_data_dir_are_one_line_exit_2(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    for args, names in (
        (["schedule", "--data-dir", str(tmp_path), "--topic", "t", "--delay-level", "0"], "--delay-level"),
        (["schedule", "--data-dir", str(tmp_path), "--topic", "t", "--delay-level", "99"], "--delay-level"),
        (["run", "--embedded", "--data-dir", str(not_a_dir)], str(not_a_dir)),
        (["schedule", "--data-dir", str(not_a_dir), "--topic", "t", "--delay-ms", "1s"], str(not_a_dir)),
    ):
        result = tw(*args)
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and names in lines[0] and lines[0].startswith("timerwheel: error:"), result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["schedule", "--topic", "t", "--delay-ms", "1s"],
        ["cancel", "tw1.0.1700000000000.abc"],
        ["consume", "--topic", "t"],
    ],
)
def test_client_commands_refuse_a_data_dir_that_does_not_exist(tmp_path: Path, args: list[str]) -> None:
    missing = tmp_path / "typo"
    result = tw(*args, "--data-dir", str(missing))
    assert result.returncode == 2, result.stderr
    assert str(missing) in result.stderr and "does not exist" in result.stderr
    assert not missing.exists(), "the command created the directory"
    created = tw(*args, "--data-dir", str(missing), "--create-data-dir")
    if args[0] == "consume":  # a topic nothing made yet
        assert created.returncode == 2 and "topic 't' does not exist" in created.stderr, created.stderr
    else:
        assert created.returncode in (0, 1), created.stderr  # cancel of a past ticket exits 1
    assert (missing / "log").is_dir()


CLIENT_COMMANDS = ("schedule", "cancel", "reschedule", "consume", "inspect", "pending")
SERVER_ONLY = {"--tick-ms", "--roll-window", "--max-delay", "--dlq-topic", "--allow-topics", "--timer-partitions",
               "--redis", "--embedded"}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = make_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_each_command_shows_only_its_own_flags_each_with_help() -> None:
    commands = _subparsers()
    for name, sub in commands.items():
        for action in sub._actions:
            assert action.help, f"{name}: {action.option_strings or action.dest} has no help"
        flags = {f for a in sub._actions for f in a.option_strings}
        if name in CLIENT_COMMANDS:
            assert not flags & SERVER_ONLY, f"{name} shows server-only flags {sorted(flags & SERVER_ONLY)}"
            if name not in ("inspect", "pending"):
                assert "--shards" not in flags, name


def test_version_and_one_error_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("timerwheel ")
    for argv in (["schedule", "--topic", "t"], ["frobnicate"], ["cancel"]):
        with pytest.raises(SystemExit) as failed:
            main(argv)
        assert failed.value.code == 2
        assert capsys.readouterr().err.startswith("timerwheel: error: "), argv


def test_run_prints_quoted_paths_a_shell_accepts(server: Server) -> None:
    schedule = next(line for line in server.printed if " schedule " in line)
    words = shlex.split(schedule)
    assert Path(words[0]).is_absolute() or words[0] == "timerwheel"
    assert Path(words[words.index("--data-dir") + 1]).is_absolute()


def test_consume_follow_on_kafka_waits_for_the_topic_the_first_delivery_makes(kafka_bootstrap: str) -> None:
    """The production quick start runs `consume --follow` right after `schedule`: the
    destination topic does not exist until the delivery makes it, and consume waited for it
    instead of failing with 'topic does not exist'."""
    import queue
    import uuid

    from timerwheel.records import OutRecord
    from timerwheel.transports.kafka.log import KafkaCommitLog

    topic = f"tw-follow-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([sys.executable, "-m", "timerwheel.cli", "consume", "--kafka", kafka_bootstrap,
                             "--topic", topic, "--follow"], env={**ENV, "TW_LOG_LEVEL": "INFO"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    log = KafkaCommitLog(kafka_bootstrap)
    try:
        waiting = proc.stderr.readline()
        assert "waiting for the topic" in waiting, (waiting, proc.poll())
        log.ensure_topic(topic, 1)
        log.append([OutRecord(topic, b"k", b"hello")])
        record = json.loads(lines.get(timeout=60))
        assert (record["topic"], record["key"], record["value"]) == (topic, "k", "hello")
    finally:
        log.close()
        proc.terminate()  # not SIGINT: a test run in the background inherits it ignored
        proc.wait(30)
