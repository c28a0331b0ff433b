"""The README stays true: every environment variable is documented, and the test command is CI's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from timerwheel.config import ENV_VARS, OTHER_ENV_VARS, TOOLING_ENV_VARS

ROOT = Path(__file__).resolve().parent.parent


def test_every_environment_variable_is_in_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [v for v in [*ENV_VARS, *OTHER_ENV_VARS, *TOOLING_ENV_VARS] if f"`{v}`" not in readme]
    assert not missing, f"README does not document {missing}"


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and "\nmake test\n" in ci


def _documented(name: str, readme: str) -> bool:
    return f"`{name}`" in readme or f"`{name}," in readme or re.search(rf"`[^`]*\b{re.escape(name)}\b[^`]*`", readme) is not None


def test_every_metric_the_stages_record_is_documented() -> None:
    """A counter or gauge that the code records and the README does not name is a figure no
    operator knows to look for."""
    readme = (ROOT / "README.md").read_text()
    pattern = re.compile(r"\.(?:inc|inc_many|set|observe_many)\(\s*\"([a-z_]+)\"")
    names = {m for path in (ROOT / "libs" / "timerwheel").rglob("*.py") for m in pattern.findall(path.read_text())}
    assert len(names) > 20, f"the pattern found only {sorted(names)}"
    missing = sorted(n for n in names if not _documented(n, readme))
    assert not missing, f"README does not name the metrics {missing}"


def test_the_python_quick_start_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert blocks, "README has no Python example"
    monkeypatch.chdir(tmp_path)  # it writes ./data
    scope: dict[str, object] = {}
    exec(compile(blocks[0], "README.md (Python quick start)", "exec"), scope)  # noqa: S102 - our own README
    assert scope["delivered"] == [], "the example cancels its one message: nothing is delivered"
    assert (tmp_path / "data").is_dir()


def test_every_make_target_the_readme_names_exists() -> None:
    readme = (ROOT / "README.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", makefile, flags=re.M))
    # `make X` in backticks, or a line of a shell block that starts with it
    named = set(re.findall(r"(?:`|^)make ([a-z][a-z0-9-]*)", readme, flags=re.M))
    assert named, "README names no make target"
    assert not named - targets, f"README names make targets the Makefile lacks: {sorted(named - targets)}"
