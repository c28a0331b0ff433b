"""The README stays true: every environment variable and metric is documented, the test command is
CI's, the quick start runs, and every command line, flag, make target, ``tw-*`` header and file
it names exists (each check fails on a README that names something the code does not have)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest
from timerwheel import wire
from timerwheel.cli import make_parser
from timerwheel.config import ENV_VARS, OTHER_ENV_VARS, TOOLING_ENV_VARS

ROOT = Path(__file__).resolve().parent.parent
#: The user-facing pages whose links and paths are checked.
PAGES = ("README.md", "BENCHMARKS.md", "charts/timerwheel/README.md")


def _shell_lines(text: str) -> list[str]:
    """The lines of the ```sh blocks, comments dropped, split at `;` and `&&`."""
    lines = []
    for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = re.sub(r"(^|\s)#.*", "", line)
            lines.extend(part.strip() for part in re.split(r";|&&", line) if part.strip())
    return lines


def _command_lines(text: str) -> list[str]:
    """Every `timerwheel ...` the page shows: in a shell block, or as inline code."""
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    # the command at a word start, or as .venv/bin/timerwheel (not charts/timerwheel)
    found = (re.search(r"(?:^|\s)(?:\.venv/bin/)?(timerwheel(?: [^;&]*)?)", line) for line in [*_shell_lines(text), *inline])
    return [m.group(1) for m in found if m]


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


def test_the_python_quick_start_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert blocks, "README has no Python example"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()  # `make run`'s, with other settings: the example must not touch it
    scope: dict[str, Any] = {}
    exec(compile(blocks[0], "README.md (Python quick start)", "exec"), scope)  # noqa: S102 - our own README
    delivered = scope["delivered"]
    assert [(r.key, r.value) for r in delivered] == [(b"k", b"hello")], "the example shows one delivery"
    assert delivered[0].header("tw-id") == scope["ticket"].message_id.encode()
    assert f"b'k' b'hello' b'{scope['ticket'].message_id}'" in capsys.readouterr().out
    assert not list((tmp_path / "data").iterdir()), "the example wrote into make run's ./data"


def test_every_make_target_the_readme_names_exists() -> None:
    readme = (ROOT / "README.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", makefile, flags=re.M))
    # `make X` in backticks, or a line of a shell block that starts with it (every target on it)
    named = set(re.findall(r"`make ([a-z][a-z0-9-]*)", readme))
    named |= {t for line in _shell_lines(readme) if line.startswith("make ") for t in line.split()[1:]}
    assert named, "README names no make target"
    assert not named - targets, f"README names make targets the Makefile lacks: {sorted(named - targets)}"


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = make_parser()
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(actions) == 1, "the CLI has one level of subcommands"
    return dict(actions[0].choices)


def test_every_command_line_the_readme_shows_has_only_flags_its_help_lists() -> None:
    """`timerwheel CMD --flag` in the README: CMD is a subcommand and `timerwheel CMD --help`
    lists --flag (a flag renamed in the code, or invented in the README, fails here)."""
    readme = (ROOT / "README.md").read_text()
    subs = _subcommands()
    top_help = make_parser().format_help()
    lines = _command_lines(readme)
    assert len(lines) >= 10, f"found only {lines}"
    wrong = []
    for line in lines:
        words = line.split()[1:]
        if not words:
            continue
        cmd = words[0]
        if cmd.startswith("--"):
            help_text = top_help
        elif cmd.isupper():  # a placeholder: timerwheel COMMAND --help
            help_text = "--help"
        elif cmd not in subs:
            wrong.append(f"{line!r}: no subcommand {cmd!r}")
            continue
        else:
            help_text = subs[cmd].format_help()
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", line):
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text):
                wrong.append(f"{line!r}: {flag} is not in `timerwheel {cmd} --help`")
    assert not wrong, "\n".join(wrong)


def test_every_stage_name_the_readme_shows_is_a_stage() -> None:
    readme = (ROOT / "README.md").read_text()
    choices = next(a.choices for a in _subcommands()["stage"]._actions if a.dest == "name")
    assert choices is not None
    shown = {name for line in _command_lines(readme)
             for m in [re.match(r"timerwheel stage (\S+)", line)] if m and not m.group(1).startswith(("$", "NAME"))
             for name in m.group(1).split("|")}
    assert shown, "README shows no `timerwheel stage NAME` line"
    assert shown <= set(choices), f"not stages: {sorted(shown - set(choices))}"
    # the five-stage loop of the production quick start names every stage
    assert any(all(c in line for c in choices) for line in readme.splitlines()), "no line starts every stage"


def test_every_subcommand_is_in_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    shown = {line.split()[1] for line in _command_lines(readme) if len(line.split()) > 1}
    missing = sorted(set(_subcommands()) - shown)
    assert not missing, f"README shows no `timerwheel {missing[0]} ...` line" if missing else ""


def test_the_readme_names_exactly_the_tw_headers_of_the_wire_contract() -> None:
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"(?<![\w/.-])(tw-[a-z]+(?:-[a-z]+)*)(?![\w.-])", readme))
    defined = {v for k, v in vars(wire).items() if k.startswith("H_") and isinstance(v, str)}
    assert len(defined) >= 10, f"wire.py defines only {sorted(defined)}"
    assert not named - defined, f"README names headers wire.py does not define: {sorted(named - defined)}"
    assert not defined - named, f"README does not name the headers {sorted(defined - named)}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES)
def test_every_file_and_anchor_a_page_links_exists(page: str) -> None:
    path = ROOT / page
    text = path.read_text()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.*)$", prose, flags=re.M)}
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        missing = not (path.parent / file).exists() if file else anchor not in anchors
        if missing:
            broken.append(target)
    # paths in inline code: `libs/...`, `tests/...`, `services/README.md`, ...
    for code in re.findall(r"`([^`\n]+)`", prose):
        in_repo = re.fullmatch(r"(?:libs|tests|e2e|scripts|bench|services|operator|charts|\.ci)/[\w./-]*", code)
        if in_repo and not (ROOT / code).exists():
            broken.append(code)
    assert not broken, f"{page} names files or anchors that do not exist: {broken}"


def _schema_paths(node: dict[str, object], prefix: str = "") -> set[str]:
    props = node.get("properties")
    if not isinstance(props, dict):
        return set()
    out = set()
    for key, sub in props.items():
        out.add(prefix + key)
        out |= _schema_paths(sub, f"{prefix}{key}.")
    return out


def test_the_chart_readme_names_every_value_and_no_other() -> None:
    """The chart README's values table against values.schema.json: a value it names must exist,
    and every value under the top level and under timerwheel.spec must be named."""
    chart = ROOT / "charts" / "timerwheel"
    schema = json.loads((chart / "values.schema.json").read_text())
    paths = _schema_paths(schema)
    stages = sorted(p.split(".")[3] for p in paths if re.fullmatch(r"timerwheel\.spec\.stages\.\w+", p))
    assert len(stages) == 5, stages
    rows = [line.split("|")[1] for line in (chart / "README.md").read_text().splitlines() if line.startswith("| `")]
    named = {n.replace("<stage>", s) for row in rows for n in re.findall(r"`([\w.<>]+)`", row)
             for s in (stages if "<stage>" in n else [""])}
    assert named, "the chart README has no values table"
    assert not named - paths, f"the chart README names values the chart does not have: {sorted(named - paths)}"
    must = {p for p in paths if p.count(".") == 0 or re.fullmatch(r"timerwheel\.spec\.\w+", p)}
    covered = {p for p in must if p in named or any(n.startswith(p + ".") for n in named)}
    assert not must - covered, f"the chart README does not name the values {sorted(must - covered)}"
