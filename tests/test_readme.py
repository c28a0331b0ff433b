"""The README and the pages of docs/ stay true: the test command is CI's, the quick start runs, and
every command line, flag, make target, ``tw-*`` header, ``TW_*`` variable, file and link they name
exists (each check fails on a page that names something the code does not have). The reference
pages are complete: docs/configuration.md names every variable, docs/metrics.md every metric,
docs/cli.md every command and flag, the chart's README every value."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest
from timerwheel import wire
from timerwheel.cli import make_parser
from timerwheel.config import ENV_VARS, OTHER_ENV_VARS, TOOLING_ENV_VARS, known_env_var
from timerwheel.metrics import COUNTERS, GAUGES, HISTOGRAMS

ROOT = Path(__file__).resolve().parent.parent
#: The pages a reader acts on: the README and every page of docs/ (not docs/design/, which
#: describes what is still to be built).
DOCS = ("README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))
#: The user-facing pages whose links and paths are checked.
PAGES = (*DOCS, "BENCHMARKS.md", "charts/timerwheel/README.md")
#: ``TW_*`` names the pages show that are not variables, and why.
NOT_VARIABLES = {"TW_SHARD": "the typo configuration.md shows being refused"}


def _text(page: str) -> str:
    return (ROOT / page).read_text()


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


def test_the_docs_pages_are_found() -> None:
    assert {"docs/configuration.md", "docs/metrics.md", "docs/cli.md", "docs/operations.md"} <= set(DOCS)


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in _text("README.md") and "\nmake test\n" in ci


def test_the_python_quick_start_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    blocks = re.findall(r"```python\n(.*?)```", _text("README.md"), flags=re.S)
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


# -- variables ---------------------------------------------------------------------------------

def test_the_configuration_page_names_every_variable_the_services_read() -> None:
    page = _text("docs/configuration.md")
    missing = [v for v in [*ENV_VARS, *OTHER_ENV_VARS] if f"`{v}`" not in page]
    assert not missing, f"docs/configuration.md does not document {missing}"


def test_the_development_page_names_every_tooling_variable() -> None:
    page = _text("docs/development.md")
    missing = [v for v in TOOLING_ENV_VARS if f"`{v}`" not in page]
    assert not missing, f"docs/development.md does not document {missing}"


@pytest.mark.parametrize("page", DOCS)
def test_every_variable_a_page_names_exists(page: str) -> None:
    """A ``TW_*`` name in code on a page is a variable some process reads (a renamed or invented
    one fails); Kubernetes' service-link examples (``TW_X_...``) aside."""
    named = set(re.findall(r"`(TW_[A-Z0-9_]*[A-Z0-9])(?:=[^`]*)?`", _text(page)))
    unknown = sorted(v for v in named if not known_env_var(v) and v not in NOT_VARIABLES and not v.startswith("TW_X_"))
    assert not unknown, f"{page} names variables no process reads: {unknown}"


# -- metrics -----------------------------------------------------------------------------------

def _metric_rows(page: str) -> set[str]:
    """The first cells of the metric tables: `name`."""
    return {m for m in re.findall(r"^\| `([a-z_]+)` \| (?:counter|gauge|histogram) \|", page, flags=re.M)}


def test_the_metrics_page_names_every_metric_the_stages_record() -> None:
    """A counter or gauge that the code records and docs/metrics.md does not name is a figure no
    operator knows to look for; one it names that the registry does not declare does not exist."""
    rows = _metric_rows(_text("docs/metrics.md"))
    pattern = re.compile(r"\.(?:inc|inc_many|set|observe_many)\(\s*\"([a-z_]+)\"")
    recorded = {m for path in (ROOT / "libs" / "timerwheel").rglob("*.py") for m in pattern.findall(path.read_text())}
    assert len(recorded) > 20, f"the pattern found only {sorted(recorded)}"
    declared = {*COUNTERS, *GAUGES, *HISTOGRAMS}
    assert not recorded - rows, f"docs/metrics.md does not name the metrics {sorted(recorded - rows)}"
    assert not declared - rows, f"docs/metrics.md does not name the declared metrics {sorted(declared - rows)}"
    assert not rows - declared, f"docs/metrics.md names metrics the registry lacks: {sorted(rows - declared)}"


def test_the_metrics_page_gives_each_metric_its_kind() -> None:
    page = _text("docs/metrics.md")
    kinds = {"counter": COUNTERS, "gauge": GAUGES, "histogram": HISTOGRAMS}
    wrong = [f"{name} is not a {kind}" for name, kind in re.findall(r"^\| `([a-z_]+)` \| (counter|gauge|histogram) \|",
                                                                      page, flags=re.M) if name not in kinds[kind]]
    assert not wrong, wrong


# -- make targets, commands, flags ---------------------------------------------------------------

@pytest.mark.parametrize("page", DOCS)
def test_every_make_target_a_page_names_exists(page: str) -> None:
    text = _text(page)
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(), flags=re.M))
    # `make X` in backticks, or a line of a shell block that starts with it (every target on it)
    named = set(re.findall(r"`make ([a-z][a-z0-9-]*)", text))
    named |= {t for line in _shell_lines(text) if line.startswith("make ") for t in line.split()[1:]}
    assert not named - targets, f"{page} names make targets the Makefile lacks: {sorted(named - targets)}"


def test_the_readme_names_its_two_commands() -> None:
    lines = _shell_lines(_text("README.md"))
    assert "make run" in lines and "make test" in lines


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = make_parser()
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(actions) == 1, "the CLI has one level of subcommands"
    return dict(actions[0].choices)


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}


@pytest.mark.parametrize("page", DOCS)
def test_every_command_line_a_page_shows_has_only_flags_its_help_lists(page: str) -> None:
    """`timerwheel CMD --flag` on a page: CMD is a subcommand and `timerwheel CMD --help` lists
    --flag (a flag renamed in the code, or invented on the page, fails here)."""
    subs = _subcommands()
    top_help = make_parser().format_help()
    wrong = []
    for line in _command_lines(_text(page)):
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


def test_the_readme_and_the_cli_page_show_command_lines() -> None:
    assert len(_command_lines(_text("README.md"))) >= 5
    assert len(_command_lines(_text("docs/cli.md"))) >= 15


@pytest.mark.parametrize("page", DOCS)
def test_every_stage_name_a_page_shows_is_a_stage(page: str) -> None:
    choices = next(a.choices for a in _subcommands()["stage"]._actions if a.dest == "name")
    assert choices is not None
    shown = {name for line in _command_lines(_text(page))
             for m in [re.match(r"timerwheel stage (\S+)", line)] if m and not m.group(1).startswith(("$", "NAME"))
             for name in m.group(1).split("|")}
    assert shown <= set(choices), f"not stages: {sorted(shown - set(choices))}"


def test_the_production_quick_start_starts_every_stage() -> None:
    choices = next(a.choices for a in _subcommands()["stage"]._actions if a.dest == "name")
    assert choices is not None
    assert any(all(c in line for c in choices) for line in _shell_lines(_text("README.md"))), "no line starts every stage"


def test_the_cli_page_shows_every_command_and_names_every_flag() -> None:
    page = _text("docs/cli.md")
    shown = {line.split()[1] for line in _command_lines(page) if len(line.split()) > 1}
    missing = sorted(set(_subcommands()) - shown)
    assert not missing, f"docs/cli.md shows no `timerwheel {missing[0]} ...` line" if missing else ""
    unnamed = sorted(f"{cmd} {flag}" for cmd, sub in _subcommands().items() for flag in _flags(sub)
                     if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", page))
    assert not unnamed, f"docs/cli.md does not name the flags {unnamed}"


# -- the wire contract ---------------------------------------------------------------------------

def _headers_named(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w/.-])(tw-[a-z]+(?:-[a-z]+)*)(?![\w.-])", text))


def _headers_defined() -> set[str]:
    defined = {v for k, v in vars(wire).items() if k.startswith("H_") and isinstance(v, str)}
    assert len(defined) >= 10, f"wire.py defines only {sorted(defined)}"
    return defined


def test_the_readme_names_exactly_the_tw_headers_of_the_wire_contract() -> None:
    named, defined = _headers_named(_text("README.md")), _headers_defined()
    assert not named - defined, f"README names headers wire.py does not define: {sorted(named - defined)}"
    assert not defined - named, f"README does not name the headers {sorted(defined - named)}"


@pytest.mark.parametrize("page", DOCS)
def test_every_tw_header_a_page_names_is_in_the_wire_contract(page: str) -> None:
    extra = _headers_named(_text(page)) - _headers_defined()
    assert not extra, f"{page} names headers wire.py does not define: {sorted(extra)}"


# -- files and links -----------------------------------------------------------------------------

def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    prose = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_anchor(h) for h in re.findall(r"^#+ (.*)$", prose, flags=re.M)}


@pytest.mark.parametrize("page", PAGES)
def test_every_file_and_anchor_a_page_links_exists(page: str) -> None:
    path = ROOT / page
    prose = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file) if file else path
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
            broken.append(target)
    # paths in inline code: `libs/...`, `tests/...`, `services/README.md`, ...
    for code in re.findall(r"`([^`\n]+)`", prose):
        in_repo = re.fullmatch(r"(?:libs|tests|e2e|scripts|bench|services|operator|charts|docs|\.ci)/[\w./-]*", code)
        if in_repo and not (ROOT / code).exists():
            broken.append(code)
    assert not broken, f"{page} names files or anchors that do not exist: {broken}"


# -- the chart's values --------------------------------------------------------------------------

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
