"""The README stays true: every environment variable is documented, and the test command is CI's."""

from __future__ import annotations

from pathlib import Path

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
