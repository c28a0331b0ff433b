"""The baseline checkout of the benchmarks (``bench/baseline.py``): a revision extracted once
into a cache outside the work tree, its ``libs/`` put first on the stage processes' PYTHONPATH,
refused when it needs other packages. On a throwaway git repository in tmp_path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: ``bench`` is no installed package

from bench.baseline import CURRENT, BaselineError, checkout, codes, dependency_difference, variants  # noqa: E402

PYPROJECT = '[project]\nname = "timerwheel"\ndependencies = [{deps}]\n'


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                               "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}).stdout.strip()


def commit(repo: Path, marker: str, deps: str = '"numpy>=1.26"') -> str:
    (repo / "libs" / "timerwheel").mkdir(parents=True, exist_ok=True)
    (repo / "libs" / "timerwheel" / "__init__.py").write_text(f"MARKER = {marker!r}\n")
    (repo / "pyproject.toml").write_text(PYPROJECT.format(deps=deps))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", marker)
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repo"
    path.mkdir()
    git(path, "init", "-q")
    return path


def test_a_revision_is_extracted_once_and_its_libs_come_first(repo: Path, tmp_path: Path) -> None:
    old = commit(repo, "old")
    commit(repo, "new")
    cache = tmp_path / "cache"
    code = checkout("HEAD~1", repo, cache)
    assert code.commit == old
    assert code.libs == cache / old / "libs"
    assert (code.libs / "timerwheel" / "__init__.py").read_text() == "MARKER = 'old'\n"
    # The stage processes import the baseline's package, not the installed one.
    env = code.env({"PATH": "/usr/bin:/bin", "PYTHONPATH": "/elsewhere"})
    assert env["PYTHONPATH"] == f"{code.libs}:/elsewhere"
    out = subprocess.run([sys.executable, "-c", "import timerwheel; print(timerwheel.MARKER)"], env=env,
                         capture_output=True, text=True, cwd=tmp_path, check=True).stdout
    assert out.strip() == "old"
    # A second checkout reuses the extracted tree (keyed on the commit), whatever the name used.
    (cache / old / "libs" / "timerwheel" / "__init__.py").write_text("MARKER = 'kept'\n")
    assert checkout(old, repo, cache).libs == code.libs
    assert (code.libs / "timerwheel" / "__init__.py").read_text() == "MARKER = 'kept'\n"
    assert sorted(p.name for p in cache.iterdir()) == [old]  # no temporary directory left behind


def test_the_current_code_changes_nothing(repo: Path) -> None:
    assert CURRENT.env({"PATH": "/bin"}) == {"PATH": "/bin"}
    assert codes({}, repo) == [CURRENT]


def test_an_unknown_revision_is_named(repo: Path, tmp_path: Path) -> None:
    commit(repo, "only")
    with pytest.raises(BaselineError, match="'no-such-rev'"):
        checkout("no-such-rev", repo, tmp_path / "cache")


def test_a_revision_needing_other_packages_is_refused(repo: Path, tmp_path: Path) -> None:
    commit(repo, "old", '"numpy>=1.20"')
    commit(repo, "new", '"numpy>=1.26"')
    with pytest.raises(BaselineError, match=r"only in the baseline: numpy>=1.20; only in the current code: numpy>=1.26"):
        checkout("HEAD~1", repo, tmp_path / "cache")


def test_dependency_difference_ignores_order_and_spacing() -> None:
    assert dependency_difference(["a>=1", "b"], ["b", "a>=1"]) == ""
    assert dependency_difference(["a"], []) == "only in the current code: a"


def test_variants_run_each_code_with_their_settings(repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TW_CACHE_DIR", str(tmp_path / "cache"))
    commit(repo, "old")
    commit(repo, "new")
    got = codes({"TW_BENCH_BASELINE": "HEAD~1",
                 "TW_BENCH_VARIANTS": "alo:TW_DELIVERY_GUARANTEE=at-least-once; eos:TW_DELIVERY_GUARANTEE=exactly-once"},
                repo)
    assert [c.name.split(" ")[0] + " " + c.name.split(" ")[-1] for c in got] == [
        "current alo", "current eos", "baseline alo", "baseline eos"]
    assert got[1].env({})["TW_DELIVERY_GUARANTEE"] == "exactly-once"
    assert got[2].libs is not None and got[2].env({})["TW_DELIVERY_GUARANTEE"] == "at-least-once"


@pytest.mark.parametrize("value", ["nocolon", "a:KEY", "a:lower=1", "a:K=1;a:K=2", ":K=1"])
def test_a_malformed_variant_is_refused_naming_it(value: str) -> None:
    with pytest.raises(BaselineError, match="TW_BENCH_VARIANTS"):
        variants(value)


def test_no_variants_is_one_unnamed_run() -> None:
    assert variants("") == [("", ())]
