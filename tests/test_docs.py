"""``python -m timerwheel.docs``: the generated tables of docs/ are what the code's tables give."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from timerwheel import config, docs


def test_the_committed_pages_are_what_the_generator_makes() -> None:
    assert docs.stale_pages() == [], "run `make docs` (python -m timerwheel.docs) and commit the pages"


def test_check_fails_naming_a_page_whose_table_was_edited_by_hand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for page in docs.REGIONS:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(docs.ROOT / page, tmp_path / page)
    page = tmp_path / "docs" / "configuration.md"
    page.write_text(page.read_text().replace("| `TW_SHARDS` | `1` |", "| `TW_SHARDS` | `4` |"))
    assert docs.main(["--check", "--root", str(tmp_path)]) == 1
    assert "docs/configuration.md is not what the code's tables give" in capsys.readouterr().err
    assert docs.main(["--root", str(tmp_path)]) == 0
    assert docs.main(["--check", "--root", str(tmp_path)]) == 0
    assert (tmp_path / "docs" / "configuration.md").read_text() == (docs.ROOT / "docs" / "configuration.md").read_text()


def test_a_variable_added_to_the_code_makes_the_page_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(config.OTHER_ENV_VARS, "TW_SOMETHING_NEW", "a variable nobody documented yet")
    assert docs.stale_pages() == ["docs/configuration.md"]
    page = docs.render("docs/configuration.md", (docs.ROOT / "docs" / "configuration.md").read_text())
    assert "| `TW_SOMETHING_NEW` | a variable nobody documented yet |" in page


def test_the_defaults_are_the_configs_own() -> None:
    table = docs.service_variables()
    assert "| `TW_ROLL_WINDOW_MS` | `172800000` (2d) |" in table
    assert "| `TW_SEGMENT_BYTES` | `67108864` (64 MiB) |" in table
    assert "| `TW_DELAY_LEVELS` | `1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h` |" in table
    assert "| `TW_OWN_SHARDS` | (empty) |" in table
    assert table.count("\n| `TW_") == len(config.ENV_VARS)


def test_a_cell_keeps_its_columns_and_shows_angle_brackets() -> None:
    assert docs._cell("a | b, <instance> and `<data dir>`") == "a \\| b, &lt;instance> and `<data dir>`"


def test_a_page_without_its_markers_is_refused() -> None:
    with pytest.raises(docs.MissingRegion, match="service-variables"):
        docs.render("docs/configuration.md", "# Configuration\n")


@pytest.mark.parametrize(("ms", "text"), [(172_800_000, "2d"), (600_000, "10m"), (1500, "1500ms"), (5000, "5s"),
                                          (0, "0ms")])
def test_duration_text(ms: int, text: str) -> None:
    assert docs.duration_text(ms) == text
    if ms:
        assert config.parse_duration_ms(text) == ms
