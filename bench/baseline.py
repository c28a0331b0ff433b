"""What a benchmark runs: this checkout, the code before a change (``TW_BENCH_BASELINE``), and
settings variants of either (``TW_BENCH_VARIANTS``).

``TW_BENCH_BASELINE=<git rev>`` (a commit, a branch, a tag) makes the benchmarks that support it
run each measurement against that revision too, alternately with the current code in the same run,
and print both rows. The revision is extracted once with ``git archive`` into
``${TW_CACHE_DIR:-~/.cache/timerwheel}/bench-baseline/<commit>`` (outside the work tree, keyed on
the full commit id, written to a temporary directory and renamed into place), and its processes
run with ``PYTHONPATH`` at that tree's ``libs/`` before the installed package, in this checkout's
virtualenv: the benchmark code itself (``bench/``, the e2e harness, the load and the collectors)
is always the current one, so both rows are measured the same way.

One virtualenv serves both only while the two revisions ask for the same packages: when the
baseline's ``pyproject.toml`` lists other dependencies than the current one, ``checkout`` refuses
with the difference (install them side by side, or pick a revision with the same ones), rather
than measure old code on libraries it was not written for.

``TW_BENCH_VARIANTS="name:KEY=VALUE,KEY=VALUE;name2:KEY=VALUE"`` runs each code once per variant,
the variant's settings added to its stage processes' environment: two settings side by side in
one run, e.g. ``alo:TW_DELIVERY_GUARANTEE=at-least-once;eos:TW_DELIVERY_GUARANTEE=exactly-once``
or ``strict:TW_CANCEL_LEAD_MS=0;loose:TW_CANCEL_LEAD_MS=500``. A row's ``code`` label names the
code and the variant ("current eos", "baseline 1a2b3c4d5e6f eos").
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Code:
    """Where a run's timerwheel comes from (``libs`` None: the installed, current package) and
    the settings it runs with beyond the benchmark's own."""

    name: str
    libs: Path | None = None
    commit: str | None = None
    settings: tuple[tuple[str, str], ...] = ()

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with PYTHONPATH set for this code and
        the variant's settings."""
        env = dict(os.environ if base is None else base)
        if self.libs is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(self.libs), *filter(None, [env.get("PYTHONPATH", "")])])
        env.update(self.settings)
        return env


CURRENT = Code("current")


class BaselineError(RuntimeError):
    """The baseline revision cannot be used: the message names the revision and why."""


def cache_dir() -> Path:
    return Path(os.environ.get("TW_CACHE_DIR") or Path.home() / ".cache" / "timerwheel") / "bench-baseline"


def resolve(rev: str, repo: Path = ROOT) -> str:
    """The full commit id of ``rev`` in ``repo``."""
    done = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                          capture_output=True, text=True)
    if done.returncode != 0 or not done.stdout.strip():
        raise BaselineError(f"TW_BENCH_BASELINE={rev!r}: no such revision in {repo}")
    return done.stdout.strip()


def dependencies(pyproject: Path) -> list[str]:
    """The ``[project] dependencies`` of a pyproject.toml, normalised (spaces removed, sorted)."""
    with pyproject.open("rb") as f:
        data = tomllib.load(f)
    return sorted("".join(d.split()) for d in data.get("project", {}).get("dependencies", []))


def dependency_difference(current: list[str], baseline: list[str]) -> str:
    """Empty when equal, else "only in the baseline: ...; only in the current code: ..."."""
    old, new = sorted(set(baseline) - set(current)), sorted(set(current) - set(baseline))
    parts = ([f"only in the baseline: {', '.join(old)}"] if old else []) + \
            ([f"only in the current code: {', '.join(new)}"] if new else [])
    return "; ".join(parts)


def extract(commit: str, repo: Path, into: Path) -> Path:
    """The tree of ``commit`` at ``into/<commit>`` (once: a complete tree has ``.complete``)."""
    target = into / commit
    if (target / ".complete").exists():
        return target
    into.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{commit[:12]}.", dir=into))
    try:
        archive = tmp / "tree.tar"
        with archive.open("wb") as out:
            subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", commit], stdout=out, check=True)
        tree = tmp / "tree"
        with tarfile.open(archive) as tar:
            tar.extractall(tree, filter="data")
        archive.unlink()
        (tree / ".complete").write_text(commit + "\n")
        try:
            tree.rename(target)
        except OSError:  # another run extracted it meanwhile: its copy is the same tree
            if not (target / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def checkout(rev: str, repo: Path = ROOT, into: Path | None = None) -> Code:
    """The code of ``rev``, extracted into the cache, checked to need the current dependencies."""
    commit = resolve(rev, repo)
    tree = extract(commit, repo, into or cache_dir())
    if not (tree / "libs" / "timerwheel").is_dir():
        raise BaselineError(f"TW_BENCH_BASELINE={rev!r} ({commit[:12]}) has no libs/timerwheel")
    differ = dependency_difference(dependencies(repo / "pyproject.toml"), dependencies(tree / "pyproject.toml"))
    if differ:
        raise BaselineError(f"TW_BENCH_BASELINE={rev!r} ({commit[:12]}) needs other packages than this "
                            f"checkout's virtualenv has ({differ}): not measured on libraries it was not "
                            f"written for")
    return Code(f"baseline {commit[:12]}", tree / "libs", commit)


_SETTING = re.compile(r"[A-Z_][A-Z0-9_]*")


def variants(value: str) -> list[tuple[str, tuple[tuple[str, str], ...]]]:
    """``TW_BENCH_VARIANTS`` parsed: [(name, ((KEY, VALUE), ...)), ...]; empty: one, unnamed."""
    out: list[tuple[str, tuple[tuple[str, str], ...]]] = []
    for part in filter(None, (p.strip() for p in value.split(";"))):
        name, sep, body = part.partition(":")
        if not sep or not name.strip():
            raise BaselineError(f"TW_BENCH_VARIANTS: {part!r} is not name:KEY=VALUE,...")
        settings = []
        for pair in filter(None, (p.strip() for p in body.split(","))):
            key, eq, val = pair.partition("=")
            if not eq or not _SETTING.fullmatch(key.strip()):
                raise BaselineError(f"TW_BENCH_VARIANTS: {pair!r} of variant {name.strip()!r} is not KEY=VALUE")
            settings.append((key.strip(), val.strip()))
        out.append((name.strip(), tuple(settings)))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise BaselineError(f"TW_BENCH_VARIANTS: variant names repeat: {names}")
    return out or [("", ())]


def codes(env: dict[str, str] | None = None, repo: Path = ROOT) -> list[Code]:
    """What to measure, in the order each row runs it: the current code, then the baseline when
    ``TW_BENCH_BASELINE`` names one, each in every variant of ``TW_BENCH_VARIANTS``."""
    env = dict(os.environ if env is None else env)
    rev = env.get("TW_BENCH_BASELINE", "").strip()
    bases = [CURRENT, checkout(rev, repo)] if rev else [CURRENT]
    return [Code(f"{base.name} {name}".strip(), base.libs, base.commit, settings)
            for base in bases for name, settings in variants(env.get("TW_BENCH_VARIANTS", ""))]
