#!/usr/bin/env python3
"""Build the image of services/Dockerfile without Docker: debootstrap + chroot + umoci + skopeo.

    scripts/image.py build [--tag timerwheel:dev] [--oci-archive PATH]
                                                    build (cached) and print the docker-archive path,
                                                    or with --oci-archive write the image there as an
                                                    OCI archive (what `make image` does: push it to a
                                                    registry with `skopeo copy oci-archive:PATH
                                                    docker://REGISTRY/timerwheel:TAG`) and print PATH
    scripts/image.py plan                           print, as JSON, the image config the build gives
    scripts/image.py run [--tag T] -- CMD ...       build (cached), then run CMD in a chroot of the
                                                    image as its USER, WORKDIR and ENV (a smoke test)

``--dockerfile`` picks another Dockerfile of the checkout (the Spark image's:
services/spark/Dockerfile, ``make spark-image``); each tag keeps its own docker-archive.

The Dockerfile is the one definition of the image. This builder reads it and carries out the same
instructions: FROM (a Debian base made with `debootstrap --variant=minbase`, see BASES), RUN (in a
chroot of the layer, as the current USER, in the current WORKDIR, with the current ENV), COPY
(from the checkout, minus .dockerignore), WORKDIR, USER, ENV, EXPOSE, ENTRYPOINT and CMD. Any other
instruction stops the build with one line naming it, so the Dockerfile cannot grow a step this
builder silently leaves out.

Layers are cached as Docker caches them: each RUN / COPY / WORKDIR step is a tag in an OCI layout
under $TW_CACHE_DIR/image (default ~/.cache/timerwheel/image), keyed on the base's package list,
every instruction before it and the content of the files COPY reads. A change to libs/ rebuilds
only the steps from `COPY libs` on. The docker-archive for `ctr images import` is written to a
temp name and renamed, like the base root file system, so an interrupted build leaves no
half-made cache entry. Needs root (chroot, file ownership) and Debian's debootstrap, umoci, skopeo.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import fnmatch
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "services" / "Dockerfile"
CACHE = Path(os.environ.get("TW_CACHE_DIR") or Path.home() / ".cache" / "timerwheel") / "image"
OCI = CACHE / "oci"
# Bump when the way a step is carried out changes (invalidates every cached layer).
RECIPE = "1"

# The Dockerfile's FROM, and the Debian base that stands in for it: same Python minor version
# (bookworm's python3 is 3.11), same tools the RUN steps use (sh, useradd, chmod, python3 -m venv).
BASES: dict[str, dict[str, object]] = {
    "python:3.11-slim": {
        "suite": "bookworm",
        "packages": ["python3", "python3-venv"],
        "env": {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
    },
}
# Host settings a RUN step's pip needs (a TLS-inspecting proxy's CA, timeouts); never put in layers.
# The host's Java trust store, for a RUN step's Maven (a TLS-inspecting proxy's CA); never in layers.
JAVA_CACERTS = Path("/etc/ssl/certs/java/cacerts")
PASS_ENV = ("PIP_DEFAULT_TIMEOUT", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_DISABLE_PIP_VERSION_CHECK")
SUPPORTED = ("FROM", "RUN", "COPY", "WORKDIR", "USER", "ENV", "EXPOSE", "ENTRYPOINT", "CMD")


class BuildError(Exception):
    pass


def log(msg: str) -> None:
    print(f"image.py: {msg}", file=sys.stderr, flush=True)


# --- the Dockerfile ---------------------------------------------------------------------------------


def parse(path: Path = DOCKERFILE) -> list[tuple[str, str, int]]:
    """(INSTRUCTION, arguments, line number) for each instruction; continuation lines joined."""
    out: list[tuple[str, str, int]] = []
    buf, start = "", 0
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, args = buf.partition(" ")
        word = word.upper()
        if word not in SUPPORTED:
            raise BuildError(f"{path.name}:{start}: instruction {word} is not supported by scripts/image.py "
                             f"(supported: {', '.join(SUPPORTED)})")
        out.append((word, args.strip(), start))
        buf = ""
    if not out or out[0][0] != "FROM":
        raise BuildError(f"{path.name}: the first instruction must be FROM")
    if sum(1 for w, _, _ in out if w == "FROM") != 1:
        raise BuildError(f"{path.name}: multi-stage builds (several FROM) are not supported by scripts/image.py")
    return out


def expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), ""), value)


def parse_env(args: str, env: dict[str, str]) -> dict[str, str]:
    words = shlex.split(args)
    if words and "=" not in words[0]:  # legacy form: ENV KEY value with spaces
        return {words[0]: expand(" ".join(words[1:]), env)}
    out = {}
    for w in words:
        k, sep, v = w.partition("=")
        if not sep:
            raise BuildError(f"ENV {args}: expected KEY=VALUE, got {w!r}")
        out[k] = expand(v, {**env, **out})
    return out


def exec_form(args: str) -> list[str]:
    if args.startswith("["):
        value = json.loads(args)
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise BuildError(f"expected a JSON list of strings: {args}")
        return value
    return ["/bin/sh", "-c", args]


def plan(path: Path = DOCKERFILE) -> dict[str, object]:
    """The image config the Dockerfile declares (what `docker build` and this builder both give)."""
    instrs = parse(path)
    base = instrs[0][1]
    if base not in BASES:
        raise BuildError(f"FROM {base}: no Debian stand-in known to scripts/image.py (known: {', '.join(BASES)})")
    env = dict(BASES[base]["env"])  # type: ignore[arg-type]
    cfg: dict[str, object] = {"from": base, "user": "", "workdir": "/", "entrypoint": [], "cmd": [],
                              "exposed_ports": [], "run": [], "copy": []}
    for word, args, _ in instrs[1:]:
        if word == "ENV":
            env.update(parse_env(args, env))
        elif word == "USER":
            cfg["user"] = expand(args, env)
        elif word == "WORKDIR":
            cfg["workdir"] = os.path.join(str(cfg["workdir"]), expand(args, env))
        elif word == "EXPOSE":
            cfg["exposed_ports"] = [*cfg["exposed_ports"],  # type: ignore[misc]
                                    *(p if "/" in p else f"{p}/tcp" for p in args.split())]
        elif word == "ENTRYPOINT":
            cfg["entrypoint"] = exec_form(args)
        elif word == "CMD":
            cfg["cmd"] = exec_form(args)
        elif word == "RUN":
            cfg["run"].append(args)  # type: ignore[attr-defined]
        elif word == "COPY":
            cfg["copy"].append(args)  # type: ignore[attr-defined]
    cfg["env"] = env
    return cfg


# --- helpers ----------------------------------------------------------------------------------------


def run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw)  # type: ignore[call-overload]
    except FileNotFoundError as e:
        raise BuildError(f"missing {cmd[0]}: install it (apt-get install {cmd[0]})") from e
    except subprocess.CalledProcessError as e:
        tail = "\n".join((e.stdout + e.stderr).strip().splitlines()[-30:])
        raise BuildError(f"{' '.join(cmd[:4])} ... failed (exit {e.returncode}):\n{tail}") from e


def sha(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def ignore_patterns() -> list[str]:
    f = ROOT / ".dockerignore"
    if not f.exists():
        return []
    return [ln.strip().removeprefix("**/") for ln in f.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def ignored(rel: Path, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(part, p) for p in patterns for part in rel.parts) or any(
        fnmatch.fnmatch(str(rel), p) for p in patterns)


def context_files(src: str, patterns: list[str]) -> list[tuple[Path, Path]]:
    """(absolute source, path relative to the COPY source) for the files COPY src takes."""
    p = (ROOT / src).resolve()
    if ROOT not in p.parents and p != ROOT:
        raise BuildError(f"COPY {src}: outside the build context {ROOT}")
    if not p.exists():
        raise BuildError(f"COPY {src}: no such file in {ROOT}")
    if p.is_file():
        return [(p, Path(p.name))]
    out = []
    for dirpath, dirnames, filenames in os.walk(p):
        d = Path(dirpath)
        dirnames[:] = sorted(x for x in dirnames if not ignored((d / x).relative_to(ROOT), patterns))
        for f in sorted(filenames):
            if not ignored((d / f).relative_to(ROOT), patterns):
                out.append((d / f, (d / f).relative_to(p)))
    return out


def tags() -> set[str]:
    if not (OCI / "index.json").exists():
        return set()
    return set(run(["umoci", "ls", "--layout", str(OCI)]).stdout.split())


@contextlib.contextmanager
def mounted(rootfs: Path) -> Iterator[None]:
    """/proc, /dev and the host's resolv.conf and CA bundle inside the chroot for one RUN step."""
    done: list[Path] = []
    saved_resolv = None
    resolv = rootfs / "etc" / "resolv.conf"
    try:
        for src, opts in (("/proc", ["-t", "proc", "proc"]), ("/dev", ["--bind", "/dev"])):
            dst = rootfs / src.lstrip("/")
            dst.mkdir(parents=True, exist_ok=True)
            run(["mount", *opts, str(dst)])
            done.append(dst)
        if resolv.exists() or resolv.is_symlink():
            saved_resolv = resolv.with_name("resolv.conf.tw-saved")
            resolv.rename(saved_resolv)
        shutil.copy("/etc/resolv.conf", resolv)
        ca = Path(os.environ.get("PIP_CERT", "/etc/ssl/certs/ca-certificates.crt"))
        if ca.exists():
            shutil.copy(ca, rootfs / "tmp" / "tw-host-ca.crt")
        if JAVA_CACERTS.exists():  # the same CAs for Java (Maven), as the host's Java trusts them
            shutil.copy(JAVA_CACERTS, rootfs / "tmp" / "tw-host-cacerts")
        yield
    finally:
        for d in reversed(done):
            subprocess.run(["umount", "-l", str(d)], check=False)
        resolv.unlink(missing_ok=True)
        if saved_resolv is not None:
            saved_resolv.rename(resolv)
        (rootfs / "tmp" / "tw-host-ca.crt").unlink(missing_ok=True)
        (rootfs / "tmp" / "tw-host-cacerts").unlink(missing_ok=True)


def safe_rmtree(path: Path) -> None:
    """Delete a work dir, never through a mount left in it (a chroot's /dev or /proc)."""
    prefix = str(path) + "/"
    def mounts() -> list[str]:
        with open("/proc/mounts") as f:
            return sorted((ln.split()[1] for ln in f if ln.split()[1].startswith(prefix)), reverse=True)
    for m in mounts():
        subprocess.run(["umount", "-l", m], capture_output=True, check=False)
    left = mounts()
    if left:
        raise BuildError(f"cannot delete {path}: {left[0]} is still mounted there")
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def user_spec(rootfs: Path, user: str) -> str:
    if not user:
        return "0:0"
    name, _, group = user.partition(":")
    uid = gid = None
    for line in (rootfs / "etc" / "passwd").read_text().splitlines():
        f = line.split(":")
        if f[0] == name or f[2] == name:
            uid, gid = f[2], f[3]
    if uid is None:
        if not name.isdigit():
            raise BuildError(f"USER {user}: no such user in the image")
        uid, gid = name, name
    return f"{uid}:{group or gid}"


# --- the build --------------------------------------------------------------------------------------


def ensure_base(base: str) -> tuple[str, str]:
    """Tag of the debootstrapped base in the OCI layout (made once per package list)."""
    spec = BASES[base]
    key = sha(RECIPE, str(spec["suite"]), *spec["packages"])  # type: ignore[misc]
    tag = f"base-{key}"
    if tag in tags():
        return tag, key
    for tool in ("debootstrap", "umoci", "skopeo"):
        if not shutil.which(tool):
            raise BuildError(f"missing {tool}: install it (apt-get install {tool})")
    mirror = apt_mirror()
    work = Path(tempfile.mkdtemp(prefix="base.tmp.", dir=CACHE))
    try:
        rootfs = work / "rootfs"
        log(f"debootstrap --variant=minbase {spec['suite']} + {' '.join(spec['packages'])} from {mirror} (first build only)")  # type: ignore[arg-type]
        run(["debootstrap", "--variant=minbase", f"--include={','.join(spec['packages'])}",  # type: ignore[arg-type]
             str(spec["suite"]), str(rootfs), mirror])
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man",
                     "usr/share/locale", "usr/share/info", "var/log"):
            d = rootfs / junk
            if d.is_dir():
                for child in d.iterdir():
                    if child.is_dir() and not child.is_symlink():
                        shutil.rmtree(child)
                    elif child.name != "lock":
                        child.unlink()
        (rootfs / "etc" / "resolv.conf").unlink(missing_ok=True)
        (rootfs / "etc" / "hostname").unlink(missing_ok=True)
        bundle = work / "bundle"
        init_layout()
        new = f"new-{key}"
        run(["umoci", "new", "--image", f"{OCI}:{new}"])
        run(["umoci", "unpack", "--image", f"{OCI}:{new}", str(bundle)])
        shutil.rmtree(bundle / "rootfs")
        rootfs.rename(bundle / "rootfs")
        run(["umoci", "repack", "--history.created_by", f"debootstrap --variant=minbase {spec['suite']}",
             "--image", f"{OCI}:{tag}", str(bundle)])
        run(["umoci", "rm", "--image", f"{OCI}:{new}"])
    finally:
        safe_rmtree(work)
    return tag, key


def apt_mirror() -> str:
    for f in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        m = re.search(r"^URIs:\s*(\S+)", f.read_text(), re.M)
        if m and "security" not in m.group(1):
            return m.group(1)
    sl = Path("/etc/apt/sources.list")
    if sl.exists():
        m = re.search(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)", sl.read_text(), re.M)
        if m:
            return m.group(1)
    raise BuildError("no Debian mirror in /etc/apt/sources.list(.d): debootstrap needs one")


def init_layout() -> None:
    if not (OCI / "index.json").exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        run(["umoci", "init", "--layout", str(OCI)])


def apply_copy(args: str, rootfs: Path, workdir: str, patterns: list[str]) -> None:
    words = shlex.split(args)
    if any(w.startswith("--") for w in words):
        raise BuildError(f"COPY {args}: options are not supported by scripts/image.py")
    *srcs, dest = words
    dest_abs = dest if dest.startswith("/") else os.path.join(workdir, dest)
    into_dir = dest.endswith("/") or len(srcs) > 1
    for src in srcs:
        p = ROOT / src
        for f, rel in context_files(src, patterns):
            if p.is_dir():
                target = rootfs / dest_abs.lstrip("/") / rel
            elif into_dir:
                target = rootfs / dest_abs.lstrip("/") / f.name
            else:
                target = rootfs / dest_abs.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, target)
            os.chown(target, 0, 0)


def apply_run(args: str, rootfs: Path, env: dict[str, str], workdir: str, user: str) -> None:
    run_env = {**env, "HOME": "/root" if not user else env.get("HOME", "/tmp")}
    run_env.update({k: os.environ[k] for k in PASS_ENV if k in os.environ})
    run_env["PIP_CERT"] = "/tmp/tw-host-ca.crt"
    run_env["REQUESTS_CA_BUNDLE"] = "/tmp/tw-host-ca.crt"
    with mounted(rootfs):
        if not (rootfs / "tmp" / "tw-host-ca.crt").exists():
            run_env.pop("PIP_CERT")
            run_env.pop("REQUESTS_CA_BUNDLE")
        if (rootfs / "tmp" / "tw-host-cacerts").exists():
            run_env["JAVA_TOOL_OPTIONS"] = "-Djavax.net.ssl.trustStore=/tmp/tw-host-cacerts"
        cmd = ["chroot", f"--userspec={user_spec(rootfs, user)}", str(rootfs),
               "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in run_env.items()),
               "/bin/sh", "-c", f"cd {shlex.quote(workdir)} && {args}"]
        run(cmd)
    for junk in (rootfs / "root" / ".cache",):
        shutil.rmtree(junk, ignore_errors=True)
    for child in (rootfs / "tmp").iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def build(image_tag: str, dockerfile: Path = DOCKERFILE, docker_archive: bool = True) -> tuple[Path | None, str]:
    """(the docker-archive, the final tag in the OCI layout) of ``dockerfile``'s image; without
    ``docker_archive`` none is written (None)."""
    if os.geteuid() != 0:
        raise BuildError("scripts/image.py build needs root (chroot and file ownership)")
    CACHE.mkdir(parents=True, exist_ok=True)
    for stale in CACHE.glob("*.tmp.*"):  # what interrupted builds left (we hold the lock)
        safe_rmtree(stale)
    cfg = plan(dockerfile)
    instrs = parse(dockerfile)
    patterns = ignore_patterns()
    tag, key = ensure_base(str(cfg["from"]))
    init_layout()
    env = dict(BASES[str(cfg["from"])]["env"])  # type: ignore[arg-type]
    user, workdir = "", "/"
    bundle: Path | None = None
    work = Path(tempfile.mkdtemp(prefix="build.tmp.", dir=CACHE))
    have = tags()
    try:
        for word, args, line in instrs[1:]:
            if word == "ENV":
                env.update(parse_env(args, env))
                continue
            if word == "USER":
                user = expand(args, env)
                continue
            if word in ("EXPOSE", "ENTRYPOINT", "CMD"):
                continue
            if word == "WORKDIR":
                workdir = os.path.join(workdir, expand(args, env))
            # a filesystem step: its layer's key covers everything before it and what it reads
            parts = [key, word, args, workdir, user, json.dumps(env, sort_keys=True)]
            if word == "COPY":
                for src in shlex.split(args)[:-1]:
                    for f, rel in context_files(src, patterns):
                        parts += [str(rel), hashlib.sha256(f.read_bytes()).hexdigest(), oct(f.stat().st_mode & 0o111)]
            key = sha(*parts)
            step_tag = f"step-{key}"
            if bundle is None and step_tag in have:
                tag = step_tag
                continue
            if bundle is None:
                bundle = work / "bundle"
                run(["umoci", "unpack", "--image", f"{OCI}:{tag}", str(bundle)])
            rootfs = bundle / "rootfs"
            log(f"Dockerfile:{line} {word} {args[:90]}")
            if word == "WORKDIR":
                (rootfs / workdir.lstrip("/")).mkdir(parents=True, exist_ok=True)
            elif word == "COPY":
                apply_copy(args, rootfs, workdir, patterns)
            elif word == "RUN":
                apply_run(args, rootfs, env, workdir, user)
            run(["umoci", "repack", "--refresh-bundle", "--history.created_by", f"{word} {args}"[:500],
                 "--image", f"{OCI}:{step_tag}", str(bundle)])
            tag = step_tag
        # the config: what docker build records from USER, ENV, WORKDIR, EXPOSE, ENTRYPOINT, CMD
        final = f"final-{sha(key, json.dumps(cfg, sort_keys=True))}"
        archive = CACHE / f"{final}-{sha(image_tag)}.tar"
        if final not in tags():
            conf = ["umoci", "config", "--image", f"{OCI}:{tag}", "--tag", final,
                    "--clear=config.env", "--clear=config.entrypoint", "--clear=config.cmd",
                    "--clear=config.exposedports", "--config.workingdir", str(cfg["workdir"]),
                    "--config.user", str(cfg["user"] or "0")]
            for k, v in cfg["env"].items():  # type: ignore[attr-defined]
                conf += ["--config.env", f"{k}={v}"]
            for a in cfg["entrypoint"]:  # type: ignore[attr-defined]
                conf += ["--config.entrypoint", a]
            for a in cfg["cmd"]:  # type: ignore[attr-defined]
                conf += ["--config.cmd", a]
            for p in cfg["exposed_ports"]:  # type: ignore[attr-defined]
                conf += ["--config.exposedports", p]
            run(conf)
        if not docker_archive:
            return None, final
        if not archive.exists():
            tmp = archive.with_name(archive.name + f".tmp.{os.getpid()}")
            tmp.unlink(missing_ok=True)
            run(["skopeo", "copy", "--quiet", f"oci:{OCI}:{final}", f"docker-archive:{tmp}:{image_tag}"])
            tmp.rename(archive)
            # earlier builds' archives of this tag (another tag's image stays): the layers stay cached
            for old in CACHE.glob(f"final-*-{sha(image_tag)}.tar"):
                if old != archive:
                    old.unlink(missing_ok=True)
        return archive, final
    finally:
        safe_rmtree(work)


def export_oci(final: str, image_tag: str, path: Path) -> Path:
    """Write the image ``final`` of the layout as an OCI archive at ``path``, named ``image_tag``
    (written to a temp name and renamed: an interrupted export leaves nothing half-made)."""
    path = path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        run(["skopeo", "copy", "--quiet", f"oci:{OCI}:{final}", f"oci-archive:{tmp}:{image_tag}"])
        tmp.rename(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def run_in_image(final: str, cfg: dict[str, object], command: list[str]) -> int:
    """Run ``command`` (default: the image's ENTRYPOINT + CMD) in a chroot of the image ``final``
    as its USER, in its WORKDIR, with only its ENV; the unpacked copy is deleted afterwards."""
    work = Path(tempfile.mkdtemp(prefix="run.tmp.", dir=CACHE))
    try:
        bundle = work / "bundle"
        run(["umoci", "unpack", "--image", f"{OCI}:{final}", str(bundle)])
        rootfs = bundle / "rootfs"
        argv = command or [*cfg["entrypoint"], *cfg["cmd"]]  # type: ignore[misc]
        if not argv:
            raise BuildError("run: no command given and the image has no ENTRYPOINT or CMD")
        env = [f"{k}={v}" for k, v in cfg["env"].items()]  # type: ignore[attr-defined]
        (rootfs / "tmp").chmod(0o1777)
        # as a container runtime provides it: this host's name resolves (Spark looks it up)
        shutil.copy("/etc/hosts", rootfs / "etc" / "hosts")
        with mounted(rootfs):
            done = subprocess.run(["chroot", f"--userspec={user_spec(rootfs, str(cfg['user']))}", str(rootfs),
                                   "/usr/bin/env", "-i", *env, "/bin/sh", "-c",
                                   f"cd {shlex.quote(str(cfg['workdir']))} && exec \"$@\"", "sh", *argv],
                                  check=False)
        return done.returncode
    finally:
        safe_rmtree(work)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="scripts/image.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    b = sub.add_parser("build")
    b.add_argument("--tag", default="timerwheel:dev")
    b.add_argument("--dockerfile", type=Path, default=DOCKERFILE)
    b.add_argument("--oci-archive", type=Path, help="write the image to this OCI archive (instead of the "
                                                     "docker-archive) and print its path")
    p = sub.add_parser("plan")
    p.add_argument("--dockerfile", type=Path, default=DOCKERFILE)
    r = sub.add_parser("run")
    r.add_argument("--tag", default="timerwheel:dev")
    r.add_argument("--dockerfile", type=Path, default=DOCKERFILE)
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ... (default: ENTRYPOINT + CMD)")
    a = ap.parse_args(argv)
    # a TERM (scripts/k8s.sh stopping a background build) unwinds: chroot mounts are undone
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if a.verb == "plan":
            print(json.dumps(plan(a.dockerfile), indent=2))
        else:
            CACHE.mkdir(parents=True, exist_ok=True)
            dockerfile = a.dockerfile.resolve()
            # one build at a time per cache; a run holds it too (a build deletes what it takes for
            # an interrupted build's work directory, the run's unpacked image among them)
            with open(CACHE / "build.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                oci_only = a.verb == "build" and a.oci_archive is not None
                archive, final = build(a.tag, dockerfile, docker_archive=not oci_only)
                if a.verb == "build":
                    print(export_oci(final, a.tag, a.oci_archive) if oci_only else archive)
                    return 0
                command = a.command[1:] if a.command[:1] == ["--"] else a.command
                return run_in_image(final, plan(dockerfile), command)
    except BuildError as e:
        print(f"image.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
