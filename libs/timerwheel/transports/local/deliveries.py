"""Exactly-once releases of one shard on the local log: ``ShardDeliveries``' embedded counterpart.

``commit`` writes a batch's records and its progress record (partition ``shard`` of the progress
topic) in one ``LocalCommitLog.append_atomic``: through the journal, so a crash at any point
leaves all of them or none once the log is opened again (``journal`` module header). ``take``
finishes a batch left in the journal (a crash or a failed commit in this process), then reads
the shard's progress partition back from ``R - READ_BACK_MARGIN_MS`` (``read_since``).

Fencing is not needed as Kafka's ``init_transactions`` does it: one embedded process holds the
data directory (``DataDirLock``: a second ``timerwheel run`` on it is refused), so a shard has one
releaser, and a releaser that was killed writes nothing more. Still, each commit is a
compare-and-append (``append_atomic``'s ``expect_end``): its progress partition must end where this
object's take or last commit left it, else nothing is written and the caller takes again (a second
releaser of the shard: ``test_exactly_once``'s paused replica, run on the local log). A client in
another process that opens the same log only appends to the timer topic; the journal's lock keeps
it from reading a journal this process is still writing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from timerwheel.errors import TimerwheelError
from timerwheel.progress import READ_BACK_MARGIN_MS, Finished, Progress
from timerwheel.records import OutRecord

if TYPE_CHECKING:
    from timerwheel.transports.local.log import LocalCommitLog

__all__ = ["LocalShardDeliveries"]


class LocalShardDeliveries:
    """One shard's exactly-once releases on the local log (module header; ``stages.exactly_once.
    Deliveries``)."""

    def __init__(self, log: LocalCommitLog, progress_topic: str, shard: int) -> None:
        self._log = log
        self.progress_topic = progress_topic
        self.shard = shard
        #: False until ``take`` succeeded, and again after any failure of ``commit``.
        self.ready = False
        #: Where the progress partition ended at the take or after this object's last commit.
        self._end = 0

    def take(self, read_ms: int) -> Finished:
        """The journal's batch finished (or a torn one dropped), then what progress records name
        from ``R`` on."""
        self.ready = False
        self._log.recover_journal()
        since = max(0, read_ms - READ_BACK_MARGIN_MS)
        self._end = self._log.partition_log(self.progress_topic, self.shard).end()
        records = self._log.read_since(self.progress_topic, self.shard, since)
        finished = Finished.read_back(self.shard, [r.value for r in records if r.offset < self._end], read_ms)
        self.ready = True
        return finished

    def commit(self, records: Sequence[OutRecord], progress: Progress, now_ms: int) -> list[tuple[int, int]]:
        """``records`` and ``progress`` (stamped ``now_ms``) all or none; the records' positions.
        On any failure ``take`` again before the next commit: it decides what the journal holds."""
        if not self.ready:
            raise TimerwheelError(f"deliveries of shard {self.shard}: take the shard (read back) first")
        mark = progress.record(self.progress_topic, now_ms)
        try:
            positions = self._log.append_atomic([*records, mark],
                                                expect_end=(self.progress_topic, self.shard, self._end))
            self._end = positions[-1][1] + 1
            return positions[: len(records)]
        except BaseException:
            self.ready = False
            raise

    def close(self) -> None:
        """Nothing to close: the log is the runtime's."""
