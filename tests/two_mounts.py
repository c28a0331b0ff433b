"""Two nodes on one machine: two ``bindfs -o auto_cache`` mounts of one directory (fixture ``mounts``).

Each FUSE mount has its own page cache, so they behave like two NFS clients of one export
(close-to-open at best): a file kept open or mapped through one mount shows old bytes after a
write and fsync through the other, and so does a re-open within the mount's attribute cache time
(see ../shared/design/PITFALLS.md, "Two nodes on one machine"). ``two_mounts`` installs bindfs
with apt-get when it is missing and FAILS, naming what is missing, when it cannot mount: a
shared-volume test that silently skips proves nothing. The mounts are unmounted with
``fusermount -u`` on the way out.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class TwoMounts:
    """``base`` is the directory itself; ``a`` and ``b`` are the two nodes' views of it."""

    base: Path
    a: Path
    b: Path


def _run(cmd: list[str], timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)


def _need_bindfs() -> str:
    found = shutil.which("bindfs")
    if found:
        return found
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if shutil.which("apt-get") is None:
        pytest.fail("bindfs is missing and there is no apt-get to install it (Debian package 'bindfs')")
    steps = (["apt-get", "install", "-y", "bindfs"], ["apt-get", "update"], ["apt-get", "install", "-y", "bindfs"])
    out = ""
    for step in steps:
        if shutil.which("bindfs"):
            break
        done = subprocess.run(step, capture_output=True, text=True, timeout=900, check=False, env=env)
        out = done.stdout[-2000:] + done.stderr[-2000:]
    found = shutil.which("bindfs")
    if not found:
        pytest.fail(f"bindfs is missing and `apt-get install -y bindfs` did not install it:\n{out}")
    return found


def _unmount(path: Path) -> None:
    for _attempt in range(20):
        if not os.path.ismount(path):
            return
        done = _run(["fusermount", "-u", str(path)], 30)
        if done.returncode == 0:
            return
        time.sleep(0.25)  # busy: a process of the test may still be closing files there
    _run(["fusermount", "-u", "-z", str(path)], 30)


@contextmanager
def two_mounts(root: Path) -> Iterator[TwoMounts]:
    """Mount ``root/base`` twice (``root/a``, ``root/b``) with ``bindfs -o auto_cache``."""
    bindfs = _need_bindfs()
    if not os.path.exists("/dev/fuse"):
        pytest.fail("/dev/fuse is missing: the two-mount tests need FUSE (bindfs)")
    if shutil.which("fusermount") is None:
        pytest.fail("fusermount is missing (Debian package 'fuse' or 'fuse3'): needed to unmount bindfs")
    mounts = TwoMounts(root / "base", root / "a", root / "b")
    for path in (mounts.base, mounts.a, mounts.b):
        path.mkdir(parents=True, exist_ok=True)
    mounted: list[Path] = []
    try:
        for view in (mounts.a, mounts.b):
            done = _run([bindfs, "-o", "auto_cache", str(mounts.base), str(view)], 60)
            if done.returncode != 0 or not os.path.ismount(view):
                pytest.fail(f"bindfs could not mount {mounts.base} on {view} (exit {done.returncode}): "
                            f"{done.stderr.strip() or done.stdout.strip()}")
            mounted.append(view)
        yield mounts
    finally:
        for view in reversed(mounted):
            _unmount(view)


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[TwoMounts]:
    with two_mounts(tmp_path / "volume") as m:
        yield m
