"""The local log's directory, and the rule for the names in it.

Layout on disk::

    <directory>/.lock                          flock held while a topic or an id is made
    <directory>/@log.json                      {"id": uuid}: this log's own id (``cluster_id``), made when first asked
    <directory>/<topic>/topic.json             {"format": 1, "partitions": n, "id": uuid}, written once,
                                               atomically (a topic made before ids gets its "id" when first asked)
    <directory>/<topic>/<p>/                   partition p: its segments and lock (``segments``)
    <directory>/@groups/<group>.json           a consumer group's committed offsets (``consumers``)
    <directory>/@groups/<group>.lock           flock held by the group's one member
    <directory>/@journal                       append_atomic's redo journal: empty, or one batch
                                               (header magic "TWJ1", CRC-32, length; msgpack
                                               [[topic, partition, first offset, [[crc, body], ...]], ...])
    <directory>/@journal.lock                  flock held by the one writer or recoverer of the journal

Topic and group names follow Kafka's rule (1..249 of ``[A-Za-z0-9._-]``), which also keeps a name
from escaping the directory; ``@`` is in no such name, so no topic collides with ``@groups``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from timerwheel.errors import TimerwheelError
from timerwheel.store.layout import holds_shards

__all__ = ["FORMAT_VERSION", "GROUPS_DIR", "LOG_ID_FILE", "InvalidTopicError", "check_name", "commit_log_dir"]

#: The version of topic.json and of a group's offsets file.
FORMAT_VERSION = 1
#: The log's own id, beside the topics: ``@`` is in no topic name.
LOG_ID_FILE = "@log.json"
#: Consumer groups' offsets, beside the topics.
GROUPS_DIR = "@groups"
#: Kafka's rule for topic names.
_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")


class InvalidTopicError(TimerwheelError, ValueError):
    """A topic name the local log cannot hold (Kafka's rule: 1..249 of ``[A-Za-z0-9._-]``)."""


def valid_name(name: str) -> bool:
    """Whether ``name`` follows Kafka's rule for topic and group names."""
    return bool(_NAME.fullmatch(name)) and name not in (".", "..")


def check_name(kind: str, name: str) -> None:
    """Raise ``InvalidTopicError`` unless ``name`` (of a ``kind``: topic, group) follows Kafka's rule."""
    if not valid_name(name):
        raise InvalidTopicError(f"invalid {kind} name {name!r}: the local log allows 1..249 of [A-Za-z0-9._-]")


def commit_log_dir(directory: str | os.PathLike[str]) -> Path:
    """The commit log's directory for ``directory``: an embedded timerwheel's data directory
    (it holds ``log/`` that is not a topic, or shard directories) keeps its log in ``<dir>/log``, so
    ``LocalCommitLog("./data")`` is the log the service in ./data reads; any other directory is
    the log itself. (Taking the data directory as the log used to wait forever on its ``.lock``,
    which the running service holds.)"""
    path = Path(directory)
    log_dir = path / "log"
    if log_dir.is_dir() and not (log_dir / "topic.json").exists():
        return log_dir
    if holds_shards(path):
        return log_dir
    return path
