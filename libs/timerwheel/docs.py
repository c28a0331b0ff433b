"""The reference tables of the docs, written from the code's own tables: ``python -m timerwheel.docs``.

A page holds hand-written prose and, between two markers, a generated region::

    <!-- BEGIN GENERATED service-variables: python -m timerwheel.docs -->
    ...
    <!-- END GENERATED service-variables -->

``python -m timerwheel.docs`` rewrites every region from ``config.ENV_VARS`` (with each
variable's default from its ``TimerConfig`` field), ``config.OTHER_ENV_VARS`` and
``config.TOOLING_ENV_VARS``; ``--check`` changes nothing and exits 1 naming each page that
differs (tests/test_docs.py runs it). A variable is documented by adding it to its table in
``config.py``, never by editing a page's region.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from timerwheel.config import ENV_VARS, OTHER_ENV_VARS, TOOLING_ENV_VARS, TOOLING_PREFIX, TimerConfig

#: The checkout: libs/timerwheel/docs.py -> the repository's root.
ROOT = Path(__file__).resolve().parents[2]

#: What a value of each kind of ``ENV_VARS`` may be written as (``config._convert`` reads them).
KIND_FORMATS = {
    "str": "text",
    "int": "integer",
    "float": "number",
    "bool": "`true` or `false` (also 1/0, yes/no, on/off)",
    "duration": "ms, or with units: `500ms`, `1.5s`, `10m`, `1h30m`, `2d`, `2w`",
    "levels": "durations separated by spaces",
    "ints": "comma-separated integers",
    "regexes": "comma-separated regular expressions",
}

_UNITS = (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000))
_BINARY = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def duration_text(ms: int) -> str:
    """``172800000`` -> ``"2d"``, ``1500`` -> ``"1500ms"``: the largest unit that divides it."""
    return next((f"{ms // size}{unit}" for unit, size in _UNITS if ms and ms % size == 0), f"{ms}ms")


def _default_text(var: str, attr: str, kind: str) -> str:
    """The default of ``var`` as the page shows it: the value to write, and what it reads as."""
    value = getattr(TimerConfig(), attr)
    gloss = ""
    if kind == "bool":
        text = "true" if value else "false"
    elif kind == "levels":
        text = " ".join(duration_text(ms) for ms in value)
    elif kind in ("ints", "regexes"):
        text = ",".join(map(str, value))
    else:
        text = str(value)
        if kind == "duration" and value:
            gloss = duration_text(value)
        elif kind == "int" and var.endswith("_BYTES"):
            gloss = next((f"{value // size} {unit}" for unit, size in _BINARY if value % size == 0), "")
    if not text:
        return "(empty)"
    return f"`{text}` ({gloss})" if gloss else f"`{text}`"


def _cell(text: str) -> str:
    """A table's prose in one Markdown cell: no column break, and a ``<name>`` outside code
    shown as written (not taken for an HTML tag)."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(part if i % 2 else part.replace("<", "&lt;") for i, part in enumerate(parts))


def service_variables() -> str:
    rows = ["| variable | default | written as | meaning |", "|---|---|---|---|"]
    for var, (attr, kind, meaning) in ENV_VARS.items():
        rows.append(f"| `{var}` | {_default_text(var, attr, kind)} | {KIND_FORMATS[kind]} | {_cell(meaning)} |")
    return "\n".join(rows)


def _two_columns(table: Mapping[str, str]) -> str:
    rows = ["| variable | meaning |", "|---|---|"]
    rows.extend(f"| `{var}` | {_cell(meaning)} |" for var, meaning in table.items())
    return "\n".join(rows)


def other_variables() -> str:
    return _two_columns(OTHER_ENV_VARS)


def tooling_variables() -> str:
    return _two_columns(TOOLING_ENV_VARS) + (
        f"\n| `{TOOLING_PREFIX}*` | the benchmarks' sizes and selections ([`BENCHMARKS.md`](../BENCHMARKS.md)) |")


#: page -> (region -> its content)
REGIONS: dict[str, dict[str, Callable[[], str]]] = {
    "docs/configuration.md": {"service-variables": service_variables, "other-variables": other_variables},
    "docs/development.md": {"tooling-variables": tooling_variables},
}


class MissingRegion(ValueError):
    """A page lacks the markers of a region the generator writes."""


def render(page: str, text: str) -> str:
    """``text`` of ``page`` with each of its generated regions written afresh."""
    for name, make in REGIONS[page].items():
        region = re.search(rf"<!-- BEGIN GENERATED {name}: python -m timerwheel.docs -->\n(.*?)"
                           rf"<!-- END GENERATED {name} -->", text, re.S)
        if region is None:
            raise MissingRegion(f"{page}: no region {name!r} (its BEGIN and END GENERATED markers)")
        text = text[:region.start(1)] + make() + "\n" + text[region.end(1):]
    return text


def stale_pages(root: Path = ROOT) -> list[str]:
    """The pages whose generated regions differ from what the code's tables give."""
    return [page for page in REGIONS if render(page, (root / page).read_text()) != (root / page).read_text()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m timerwheel.docs", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page is not up to date")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout (default: this one)")
    args = parser.parse_args(argv)
    stale = stale_pages(args.root)
    if args.check:
        for page in stale:
            sys.stderr.write(f"{page} is not what the code's tables give: run python -m timerwheel.docs\n")
        return 1 if stale else 0
    for page in stale:
        path = args.root / page
        path.write_text(render(page, path.read_text()))
        sys.stdout.write(f"wrote {page}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
