"""The deployment file ``timerwheel.json``: what every shard of a data directory was made with.

At the data directory's root (ARCHITECTURE §3; FORMAT.md has the fields). The first process that
starts on a data directory writes it, atomically and only if it is not there yet (a hard link of a
complete temp file: of two processes starting at once, one wins and the other compares with what
it wrote). Every later start compares its settings with the stored ones and refuses any
difference, naming both values: a different shard count would move timer-topic partitions
between shards (``p % shards``), so the new owner of a partition would resume it from offset 0
and deliver old messages again; a different tick, wheel span or roll window would read the
wheels with the wrong geometry; another timer topic would pair these offsets with other records.

The file also records the shards' ``Source``: the cluster id and the timer topic's id that their
offsets belong to (``runtime.wiring.check_source`` compares them at every start, FORMAT.md).

A data directory made before this file existed is adopted: the first start writes the current
settings, unless a ``shard-NNNN`` directory at or beyond the requested shard count shows the data
was made with more shards. The shard count is never changed in place; tick, span and roll window
change only through ``timerwheel rebuild-wheel --change-window`` (the operator's procedure), which
rebuilds every shard's wheel and then rewrites this file (``store_window``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from timerwheel.errors import FormatMismatchError, TimerwheelError
from timerwheel.files import FILE_MODE, atomic_write, fsync_dir, temp_path
from timerwheel.store.format import FORMAT_VERSION
from timerwheel.store.layout import found_shards, shard_dir

SETTINGS_FILE = "timerwheel.json"

#: The TW_* variable of each stored setting, so a refusal names what the user sets.
VARIABLE_OF = {
    "shards": "TW_SHARDS", "tick_ms": "TW_TICK_MS", "wheel_span_ms": "TW_WHEEL_SPAN_MS",
    "roll_window_ms": "TW_ROLL_WINDOW_MS", "timer_topic": "TW_TIMER_TOPIC", "format_version": "format version",
}

@dataclass(frozen=True, slots=True)
class DeploymentSettings:
    """The settings every shard of one data directory shares, fixed at its first start."""

    shards: int
    tick_ms: int
    wheel_span_ms: int
    roll_window_ms: int
    timer_topic: str
    format_version: int = FORMAT_VERSION

    @classmethod
    def of(cls, config: Any) -> DeploymentSettings:
        """From a ``TimerConfig`` (the wheel span as used: a span of 0 means twice the roll window)."""
        return cls(int(config.shards), int(config.tick_ms), int(config.wheel_slots) * int(config.tick_ms),
                   int(config.roll_window_ms), str(config.timer_topic))


@dataclass(frozen=True, slots=True)
class Source:
    """Where the shards' timer records come from: the commit log's cluster id and the timer
    topic's id (None where the log cannot tell). The offsets of the enqueue checkpoints and the
    source positions of the TimerLog records point into this incarnation of the timer topic and
    no other: a topic made again (or another cluster's) holds other records at those offsets."""

    cluster_id: str | None
    timer_topic_id: str | None

    def differences(self, other: Source) -> list[str]:
        """``cluster id stored X, found Y`` for each id known on both sides that differs."""
        return [f"{name.replace('_', ' ')} stored {mine}, found {theirs}"
                for name, mine, theirs in (("cluster_id", self.cluster_id, other.cluster_id),
                                           ("timer_topic_id", self.timer_topic_id, other.timer_topic_id))
                if mine is not None and theirs is not None and mine != theirs]


def settings_path(data_dir: str | os.PathLike[str]) -> str:
    return os.path.join(os.fspath(data_dir), SETTINGS_FILE)


def load_settings(data_dir: str | os.PathLike[str]) -> DeploymentSettings | None:
    """The stored settings, or None if the data directory has no deployment file yet."""
    stored = _load(data_dir)
    return None if stored is None else stored[0]


def _load(data_dir: str | os.PathLike[str]) -> tuple[DeploymentSettings, dict[str, Any]] | None:
    """The stored settings and the file's JSON object, from one read (another stage may replace
    the file meanwhile: through a FUSE or NFS mount a second open can find its name missing for a
    moment), or None if there is no deployment file yet."""
    path = settings_path(data_dir)
    try:
        with open(path, "rb") as f:
            body: Any = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise TimerwheelError(f"deployment file {path} is unreadable: {exc}") from None
    try:
        if not isinstance(body, dict):
            raise TypeError("not a JSON object")
        fields = {name: body[name] for name in DeploymentSettings.__dataclass_fields__}
        ints = [n for n, v in fields.items() if n != "timer_topic" and (not isinstance(v, int) or isinstance(v, bool))]
        if ints or not isinstance(fields["timer_topic"], str):
            raise TypeError(f"bad field {(ints or ['timer_topic'])[0]}")
        return DeploymentSettings(**fields), body
    except (KeyError, TypeError) as exc:
        raise TimerwheelError(f"deployment file {path} is unreadable: {exc}") from None


def load_source(data_dir: str | os.PathLike[str]) -> Source | None:
    """The stored source, or None if the deployment file records none (or does not exist)."""
    stored = load_deployment(data_dir)
    return None if stored is None else stored[1]


def load_deployment(data_dir: str | os.PathLike[str]) -> tuple[DeploymentSettings, Source | None] | None:
    """The stored settings and source (None where none is recorded), from one read of the
    deployment file, or None if there is none yet."""
    stored = _load(data_dir)
    if stored is None:
        return None
    settings, body = stored
    raw = body.get("source")
    if raw is None:
        return settings, None
    ids = [raw.get(name) for name in Source.__dataclass_fields__] if isinstance(raw, dict) else [0]
    if any(v is not None and not isinstance(v, str) for v in ids):
        raise TimerwheelError(f"deployment file {settings_path(data_dir)} is unreadable: bad field source")
    return settings, Source(*ids)


def store_source(data_dir: str | os.PathLike[str], source: Source, *, fsync: bool = True,
                 settings: DeploymentSettings | None = None) -> None:
    """Record ``source`` in the deployment file (atomically replaced; ``check_settings`` wrote it)
    beside ``settings``, the file's as the caller just read them (else read here: through a FUSE or
    NFS mount, a second open while another node replaces the file can find it missing; seen on
    two mounts of one volume, both nodes recording the source at once)."""
    stored = settings if settings is not None else load_settings(data_dir)
    if stored is None:
        raise TimerwheelError(f"deployment file {settings_path(data_dir)} does not exist: no source can be recorded")
    _rewrite(data_dir, stored, source, fsync)


def _rewrite(data_dir: str | os.PathLike[str], settings: DeploymentSettings, source: Source | None,
             fsync: bool) -> None:
    body: dict[str, Any] = asdict(settings)
    if source is not None:
        body["source"] = asdict(source)
    atomic_write(settings_path(data_dir), json.dumps(body, indent=1, sort_keys=True).encode() + b"\n", fsync)


def shards_to_show(data_dir: str | os.PathLike[str], count: int | None = None) -> list[int]:
    """The shards of ``data_dir`` a tool reads (``inspect``, ``pending``): those found among
    0..count-1, by default the stored shard count, or without a deployment file every shard found."""
    found = found_shards(data_dir)
    if count is None:
        stored = load_settings(data_dir)
        count = stored.shards if stored is not None else None
    return found if count is None else [s for s in range(count) if s in found]


def _refuse(data_dir: str | os.PathLike[str], stored: DeploymentSettings, wanted: DeploymentSettings) -> None:
    mine, theirs = asdict(wanted), asdict(stored)
    wrong = [f"{VARIABLE_OF[n]}: stored {theirs[n]!r}, requested {mine[n]!r}" for n in mine if mine[n] != theirs[n]]
    if wrong:
        raise FormatMismatchError(
            f"data directory {os.fspath(data_dir)} was made with other settings ({'; '.join(wrong)}; see "
            f"{SETTINGS_FILE}): start with the stored values (the shard count never changes: timer partitions "
            "would move between shards and old messages be delivered again)")


def check_settings(data_dir: str | os.PathLike[str], wanted: DeploymentSettings, *, create: bool = True,
                   fsync: bool = True) -> DeploymentSettings:
    """Compare ``wanted`` with the deployment file, writing it first if there is none (``create``).

    Raises FormatMismatchError naming every setting that differs. Without ``create`` a data
    directory with no file passes (a stage that writes no shard state)."""
    stored = load_settings(data_dir)
    if stored is None:
        beyond = [s for s in found_shards(data_dir) if s >= wanted.shards]
        if beyond:
            raise FormatMismatchError(
                f"data directory {os.fspath(data_dir)} holds {os.path.basename(shard_dir(data_dir, beyond[-1]))} but TW_SHARDS requests "
                f"{wanted.shards}: it was made with at least {beyond[-1] + 1} shards (the shard count never changes)")
        if not create:
            return wanted
        stored = _write_once(data_dir, wanted, fsync)
    _refuse(data_dir, stored, wanted)
    return stored


def _write_once(data_dir: str | os.PathLike[str], wanted: DeploymentSettings, fsync: bool) -> DeploymentSettings:
    """Write the file unless it exists; the settings that are stored afterwards."""
    os.makedirs(data_dir, exist_ok=True)
    path = settings_path(data_dir)
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        os.write(fd, json.dumps(asdict(wanted), indent=1, sort_keys=True).encode() + b"\n")
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if another process wrote it first: never replaces a stored file
    except FileExistsError:
        pass
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        # A file system without hard links: a rename, only if still absent (a small window).
        if not os.path.exists(path):
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    if fsync:
        fsync_dir(os.fspath(data_dir))
    stored = load_settings(data_dir)
    if stored is None:
        raise TimerwheelError(f"deployment file {path} vanished right after it was written")
    return stored


#: The settings ``store_window`` may change; the others (shard count, timer topic) never change.
WINDOW_FIELDS = ("tick_ms", "wheel_span_ms", "roll_window_ms")


def store_window(data_dir: str | os.PathLike[str], wanted: DeploymentSettings, *,
                  fsync: bool = True) -> DeploymentSettings | None:
    """Store ``wanted``'s tick, wheel span and roll window in the deployment file (atomically
    replaced); the settings stored before, or None if there was no file (it is written then).

    Only for ``timerwheel rebuild-wheel --change-window`` once it has rebuilt the shards: any other
    difference (shard count, timer topic, format version) is refused as ``check_settings`` does."""
    deployment = load_deployment(data_dir)
    if deployment is None:
        check_settings(data_dir, wanted, fsync=fsync)
        return None
    stored, source = deployment
    fixed = {n: getattr(wanted, n) for n in DeploymentSettings.__dataclass_fields__ if n not in WINDOW_FIELDS}
    _refuse(data_dir, stored, DeploymentSettings(**fixed, **{n: getattr(stored, n) for n in WINDOW_FIELDS}))
    if stored != wanted:
        _rewrite(data_dir, wanted, source, fsync)
    return stored


def refuse_other_window(data_dir: str | os.PathLike[str], wanted: DeploymentSettings, asked: Collection[str],
                        named: Mapping[str, str]) -> None:
    """Refuse (FormatMismatchError, as a start refuses it) a tick, roll window or wheel span that was
    asked for (``asked``: field names) and differs from the stored one, pointing to
    ``--change-window``; the span is compared too when the roll window is asked (a span of 0
    follows it). ``named``: how the message names each of the three fields. Nothing stored: no
    refusal (the first start stores what it is given)."""
    stored = load_settings(data_dir)
    if stored is None or not asked:
        return
    wrong = [f"{named[n]}: stored {getattr(stored, n)}, requested {getattr(wanted, n)}"
             for n in ("tick_ms", "roll_window_ms", "wheel_span_ms")
             if (n in asked or (n == "wheel_span_ms" and "roll_window_ms" in asked))
             and getattr(stored, n) != getattr(wanted, n)]
    if wrong:
        raise FormatMismatchError(f"data directory {os.fspath(data_dir)} was made with other settings "
                                  f"({'; '.join(wrong)}; see {SETTINGS_FILE}): add --change-window to rebuild every "
                                  "shard's wheel with the new values (stages stopped), or give the stored ones")
