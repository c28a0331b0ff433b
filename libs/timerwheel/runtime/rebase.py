"""Re-base a data directory on the timer topic it is pointed at (``timerwheel rebase``).

A start refuses shards written from another source (``wiring.check_source``): another Kafka
cluster, the timer topic deleted and made again, a local ``log/`` replaced, or checkpoints beyond
a partition's end. Their positions name records that the topic now read does not hold, so they
cannot be read on. ``rebase`` is the explicit way out when that topic is the one to serve from
now on (when the shards' own topic still exists, point the stages back at it instead):

* The old ``shard-NNNN`` directories are moved, whole, into ``set-aside-<UTC time>/`` in the data
  directory (kept for inspection; delete it once you are sure). The messages still pending in
  them are **not delivered**: their timer records are in the other topic. The report counts the
  records in their wheels from R (``pending_records``, as ``timerwheel inspect`` does: cancel
  markers and roll hops included).
* Fresh shards start at the topic's **start** offsets (``start_offsets``): every record the
  topic holds is scheduled, so nothing written to it meanwhile is skipped; a record that another
  timerwheel already delivered from this topic (a cluster served by another deployment) is
  **delivered again**. To move to a cluster whose topics were mirrored, with their deliveries,
  use ``timerwheel recover-from-kafka`` instead: it skips what the destinations hold.
* The deployment file records the topic's source; its settings stay.

Preconditions: every stage stopped (the data directory's lock for the embedded runtime; with
Redis, no heartbeat and no lease, whose work queues are then cleared: their entries name the
old positions). Order: the queues cleared, the shards moved, the new ones made, the source
recorded last, so a run that fails midway is run again.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from timerwheel.config import TimerConfig
from timerwheel.errors import TimerwheelError
from timerwheel.log import stage_logger
from timerwheel.runtime.disaster import check_stopped, clear_queues, make_shards
from timerwheel.runtime.inspect import wheel_count
from timerwheel.runtime.wiring import ensure_topics, offsets_beyond_end
from timerwheel.store.deployment import DeploymentSettings, Source, check_settings, load_source, store_source
from timerwheel.store.layout import DataDirLock, found_shards, open_found_shard, shard_dir
from timerwheel.transports.base import CommitLog

log = stage_logger("rebase")

#: The directory the old shards are moved into, in the data directory.
SET_ASIDE_PREFIX = "set-aside-"


class NothingToRebase(TimerwheelError):  # noqa: N818 - a refusal, not a failure
    """The shards were written from the topic this command reads: rebasing would only lose them."""


@dataclass(frozen=True)
class RebaseReport:
    data_dir: str
    source_before: Source | None
    source: Source
    #: The old shards, and where they went (None on a dry run).
    shards: list[int]
    set_aside: str | None
    #: Records in the old shards' wheels from R: what they still held, not delivered.
    pending_records: int
    #: Timer-topic partition -> where the fresh shards start.
    start_offsets: dict[int, int]
    dry_run: bool

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["command"] = "rebase"
        out["start_offsets"] = {str(p): o for p, o in sorted(self.start_offsets.items())}
        return out


def rebase(config: TimerConfig, commit_log: CommitLog, redis_client: Any | None, *, dry_run: bool = False,
           now_ms: int | None = None) -> RebaseReport:
    """Set the data directory's shards aside and start fresh ones on ``commit_log``'s timer topic
    (see the module docstring). ``redis_client``: the stages' Redis (production), else None."""
    if redis_client is not None:
        from timerwheel.transports.redisq import running_processes

        check_stopped(running_processes(redis_client))
    data = config.data_dir
    lock = DataDirLock(data)
    try:
        check_settings(data, DeploymentSettings.of(config), create=not dry_run, fsync=config.fsync)
        ensure_topics(config, commit_log)
        stored = load_source(data)
        current = Source(commit_log.cluster_id(), commit_log.topic_id(config.timer_topic))
        shards = found_shards(data)
        if shards and stored == current and not offsets_beyond_end(config, commit_log):
            raise NothingToRebase(f"the shards of {data} were written from this {config.timer_topic!r} (cluster id "
                                  f"{current.cluster_id}, topic id {current.timer_topic_id}): rebase would only lose "
                                  "what they hold")
        pending = sum(_pending_records(data, s) for s in shards)
        starts = commit_log.start_offsets(config.timer_topic)
        set_aside = None
        if not dry_run:
            if redis_client is not None:
                clear_queues(config, redis_client)
            if shards:
                set_aside = os.path.join(data, SET_ASIDE_PREFIX + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
                os.makedirs(set_aside)
                for s in shards:
                    os.rename(shard_dir(data, s), shard_dir(set_aside, s))
            make_shards(config, starts, now_ms if now_ms is not None else int(time.time() * 1000))
            store_source(data, current, fsync=config.fsync)
            log.info("rebased", set_aside=set_aside, pending_records=pending,
                     start_offsets={str(p): o for p, o in sorted(starts.items())})
        return RebaseReport(data, stored, current, shards, set_aside, pending, starts, dry_run)
    finally:
        lock.release()


def _pending_records(data_dir: str, shard_id: int) -> int:
    shard = open_found_shard(data_dir, shard_id)
    try:
        deq = shard.load_dequeue_checkpoint()
        return wheel_count(shard, deq.read_ms) if deq is not None else 0
    finally:
        shard.close()

