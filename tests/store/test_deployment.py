"""The deployment file timerwheel.json: written once, compared on every start, never silently changed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from timerwheel.config import TimerConfig
from timerwheel.errors import FormatMismatchError
from timerwheel.store.deployment import SETTINGS_FILE, DeploymentSettings, check_settings, load_settings

ONE = DeploymentSettings(shards=1, tick_ms=100, wheel_span_ms=4_000, roll_window_ms=2_000, timer_topic="__timer")


def test_the_first_start_writes_the_settings_and_later_starts_with_them_pass(tmp_path: Path) -> None:
    assert load_settings(tmp_path) is None
    assert check_settings(tmp_path, ONE) == ONE
    body = json.loads((tmp_path / SETTINGS_FILE).read_text())
    assert body == {"shards": 1, "tick_ms": 100, "wheel_span_ms": 4_000, "roll_window_ms": 2_000,
                    "timer_topic": "__timer", "format_version": 1}
    assert check_settings(tmp_path, ONE) == ONE
    assert not [p.name for p in tmp_path.iterdir() if p.name != SETTINGS_FILE], "a temp file was left"


@pytest.mark.parametrize(("change", "names"), [
    ({"shards": 2}, "TW_SHARDS: stored 1, requested 2"),
    ({"tick_ms": 200}, "TW_TICK_MS: stored 100, requested 200"),
    ({"wheel_span_ms": 8_000}, "TW_WHEEL_SPAN_MS: stored 4000, requested 8000"),
    ({"roll_window_ms": 1_000}, "TW_ROLL_WINDOW_MS: stored 2000, requested 1000"),
    ({"timer_topic": "timers"}, "TW_TIMER_TOPIC: stored '__timer', requested 'timers'"),
])
def test_a_start_with_other_settings_is_refused_naming_stored_and_requested(
        tmp_path: Path, change: dict[str, object], names: str) -> None:
    check_settings(tmp_path, ONE)
    with pytest.raises(FormatMismatchError, match=names):
        check_settings(tmp_path, _with(ONE, **change))
    assert load_settings(tmp_path) == ONE, "a refused start must not rewrite the stored settings"


def _with(base: DeploymentSettings, **change: object) -> DeploymentSettings:
    from dataclasses import replace

    return replace(base, **change)  # type: ignore[arg-type]


def test_a_data_directory_without_the_file_is_adopted_unless_it_has_more_shards(tmp_path: Path) -> None:
    (tmp_path / "shard-0000").mkdir()
    (tmp_path / "shard-0001").mkdir()
    with pytest.raises(FormatMismatchError, match="holds shard-0001 but TW_SHARDS requests 1"):
        check_settings(tmp_path, ONE)
    assert load_settings(tmp_path) is None
    two = _with(ONE, shards=2)
    assert check_settings(tmp_path, two) == two
    assert load_settings(tmp_path) == two


def test_a_stage_that_writes_no_state_checks_but_never_creates_the_file(tmp_path: Path) -> None:
    assert check_settings(tmp_path, ONE, create=False) == ONE
    assert load_settings(tmp_path) is None
    check_settings(tmp_path, ONE)
    with pytest.raises(FormatMismatchError, match="TW_SHARDS"):
        check_settings(tmp_path, _with(ONE, shards=3), create=False)


def test_the_wheel_span_stored_is_the_one_used_when_the_config_leaves_it_to_the_default() -> None:
    cfg = TimerConfig(tick_ms=100, roll_window_ms=60_000)
    assert DeploymentSettings.of(cfg).wheel_span_ms == 120_000
    assert DeploymentSettings.of(cfg) == DeploymentSettings.of(cfg.replace(wheel_span_ms=120_000))
