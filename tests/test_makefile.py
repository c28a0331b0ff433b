"""The Makefile's install (issue 32): ``make run`` installs only what running needs, with any
Python 3.11 or newer, and names the variable to set when it finds none. ``make -n`` shows what
a target would run without running it (a real install takes a minute)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAKE = shutil.which("make") or "/usr/bin/make"


def make(*args: str, path: str, dry_run: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "PY", "MAKEFLAGS", "MFLAGS")}
    return subprocess.run([MAKE, *(["-n"] if dry_run else []), "-C", str(ROOT), *args], capture_output=True,
                          text=True, timeout=60, env={**env, "PATH": path})


def _only(tmp_path: Path, **programs: str) -> str:
    """A PATH holding only ``programs`` (name -> what it is: a path to link to, or a shell script)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, what in programs.items():
        if what.startswith("#!"):
            (bin_dir / name).write_text(what)
            (bin_dir / name).chmod(0o755)
        else:
            (bin_dir / name).symlink_to(what)
    return str(bin_dir)


def test_make_run_installs_only_what_running_needs(tmp_path: Path) -> None:
    venv = str(tmp_path / "venv")
    run = make("run", f"VENV={venv}", path=os.environ["PATH"])
    assert run.returncode == 0, run.stderr
    installs = [line for line in run.stdout.splitlines() if "pip install" in line and "--upgrade pip" not in line]
    assert installs and all(line.rstrip().endswith("-e .") for line in installs), run.stdout
    assert "[dev" not in run.stdout
    setup = make("setup", f"VENV={venv}", path=os.environ["PATH"]).stdout
    assert "-e '.[dev]'" in setup, "make setup (and so make test) adds the developer extras"


def test_any_python_3_11_or_newer_is_taken(tmp_path: Path) -> None:
    """Not only one named python3.11: here the only interpreter on PATH is ``python3``."""
    path = _only(tmp_path, python3=sys.executable)
    done = make("setup-run", f"VENV={tmp_path / 'venv'}", path=path)
    assert done.returncode == 0, done.stderr
    assert f"{path}/python3 -m venv {tmp_path / 'venv'}" in done.stdout


def test_no_suitable_python_names_the_variable_to_set(tmp_path: Path) -> None:
    too_old = "#!/bin/sh\n[ \"$1\" = -V ] && echo 'Python 3.9.18'; exit 1\n"  # fails the 3.11 check
    path = _only(tmp_path, python3=too_old)
    done = make("setup-run", f"VENV={tmp_path / 'venv'}", path=path, dry_run=False)
    assert done.returncode != 0 and not (tmp_path / "venv").exists()
    assert "no Python 3.11 or newer on PATH" in done.stderr and "PYTHON=/path/to/python3" in done.stderr
    named = make("setup-run", f"VENV={tmp_path / 'venv'}", f"PYTHON={tmp_path / 'bin' / 'python3'}", path=path,
                 dry_run=False)
    assert named.returncode != 0 and "is Python 3.9.18, not Python 3.11 or newer" in named.stderr
