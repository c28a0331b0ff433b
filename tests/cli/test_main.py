"""``main``: the dispatch and what ends a command (exit codes, one line per error)."""

from __future__ import annotations

import json
import sys

import pytest
from timerwheel import cli
from timerwheel.cli import inspect, service
from timerwheel.log import configure_logging
from timerwheel.stages import STAGE_NAMES


def _parse_the_batch() -> None:
    raise KeyError("slot 17")


def test_an_unexpected_error_ends_a_command_with_one_json_line_holding_its_traceback(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def broken(_args: object) -> int:
        _parse_the_batch()
        return 0

    monkeypatch.setattr(inspect, "cmd_inspect", broken)
    monkeypatch.setattr(cli, "configure_logging", lambda level: configure_logging(level, sys.stderr))
    assert cli.main(["inspect"]) == cli.EXIT_FAILED
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(lines) == 1, lines
    line = json.loads(lines[0])
    assert (line["level"], line["stage"], line["event"]) == ("error", "inspect", "command failed")
    assert line["error"] == "KeyError: 'slot 17'" and "in _parse_the_batch" in line["traceback"]


def test_the_stage_command_takes_exactly_the_stages() -> None:
    """The parser names the stages without importing them (a client command stays quick to start)."""
    parser = cli.make_parser()
    assert [parser.parse_args(["stage", name]).name for name in STAGE_NAMES] == list(STAGE_NAMES)
    assert service.STAGE_NAMES == STAGE_NAMES
    with pytest.raises(SystemExit):
        parser.parse_args(["stage", "enqueue"])
