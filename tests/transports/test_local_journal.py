"""The local log's journal: ``append_atomic`` leaves all of a batch or none, whatever step a crash
hits (``transports.local.journal``), and ``read_since`` finds the first record at a timestamp."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from timerwheel.records import OutRecord
from timerwheel.transports.local.journal import JOURNAL_FILE
from timerwheel.transports.local.log import LocalCommitLog

#: A batch over three partitions of two topics: the shape of a shard's release with its progress.
CHILD = r"""
import os, signal, sys
from timerwheel.records import OutRecord
from timerwheel.transports.local.log import LocalCommitLog
directory, point, nth = sys.argv[1], sys.argv[2], int(sys.argv[3])
log = LocalCommitLog(directory, fsync=True)
log.ensure_topic("dest", 2)
log.ensure_topic("progress", 1)
seen = []
def fault(where):
    seen.append(where)
    if where == point and seen.count(where) == nth:
        os.kill(os.getpid(), signal.SIGKILL)
log.journal_fault = fault
log.append_atomic([OutRecord("dest", None, b"d0", (), partition=0, timestamp_ms=1),
                   OutRecord("dest", None, b"d1", (), partition=1, timestamp_ms=1),
                   OutRecord("dest", None, b"d2", (), partition=0, timestamp_ms=1),
                   OutRecord("progress", None, b"mark", (), partition=0, timestamp_ms=1)])
print("returned", flush=True)
"""


def values(log: LocalCommitLog) -> dict[str, list[bytes | None]]:
    return {f"{t}/{p}": [r.value for r in log.read_since(t, p, 0)] for t, n in (("dest", 2), ("progress", 1))
            for p in range(n)}


ALL = {"dest/0": [b"d0", b"d2"], "dest/1": [b"d1"], "progress/0": [b"mark"]}
NONE: dict[str, list[bytes | None]] = {"dest/0": [], "dest/1": [], "progress/0": []}


def killed_at(tmp_path: Path, point: str, nth: int = 1) -> Path:
    """Run the batch in a child process SIGKILLed at ``point`` (its ``nth`` time); the log's directory."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    directory = tmp_path / "log"
    proc = subprocess.run([sys.executable, str(script), str(directory), point, str(nth)], capture_output=True,
                          timeout=60, env=os.environ)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    return directory


@pytest.mark.parametrize(("point", "nth"), [("journaled", 1), ("partition-written", 1), ("partition-written", 2),
                                            ("partition-written", 3), ("applied", 1)])
def test_a_batch_killed_after_its_journal_is_complete_is_there_once_after_reopening(
        tmp_path: Path, point: str, nth: int) -> None:
    directory = killed_at(tmp_path, point, nth)
    assert (directory / JOURNAL_FILE).stat().st_size > 0  # the kill left it
    log = LocalCommitLog(directory, fsync=False)  # opening re-applies it
    assert values(log) == ALL
    assert (directory / JOURNAL_FILE).stat().st_size == 0
    log.close()
    again = LocalCommitLog(directory, fsync=False)  # nothing left to apply: no second copy
    assert values(again) == ALL
    again.close()


@pytest.mark.parametrize("cut", [1, 8, 20, -1])
def test_a_torn_journal_is_dropped_and_nothing_of_its_batch_is_written(tmp_path: Path, cut: int) -> None:
    """The crash came while the journal was written (before any partition): its CRC or length
    does not check, and the batch is gone, all of it."""
    directory = killed_at(tmp_path, "journaled")
    journal = directory / JOURNAL_FILE
    raw = journal.read_bytes()
    journal.write_bytes(raw[:cut] if cut > 0 else raw[:-1] + bytes([raw[-1] ^ 1]))
    # The partitions as they were before step 2: the child died at "journaled", before writing them.
    log = LocalCommitLog(directory, fsync=False)
    assert values(log) == NONE
    assert journal.stat().st_size == 0
    log.append_atomic([OutRecord("dest", None, b"next", (), partition=1, timestamp_ms=2)])
    assert values(log)["dest/1"] == [b"next"]
    log.close()


def test_a_stale_complete_journal_is_re_applied_as_nothing(tmp_path: Path) -> None:
    """The journal is emptied without a sync: after a power loss it may come back complete. Its
    records are all in place, so re-applying it appends nothing."""
    directory = killed_at(tmp_path, "applied")
    stale = (directory / JOURNAL_FILE).read_bytes()
    log = LocalCommitLog(directory, fsync=False)
    log.close()
    (directory / JOURNAL_FILE).write_bytes(stale)
    again = LocalCommitLog(directory, fsync=False)
    assert values(again) == ALL
    again.close()


def test_a_record_appended_by_another_process_after_the_crash_keeps_its_place(tmp_path: Path) -> None:
    """A client appends to a partition the killed batch had not reached yet: its record stays where
    it is, the batch's remainder goes after it, once."""
    directory = killed_at(tmp_path, "partition-written", 1)  # dest/0 written, dest/1 and progress not
    # The client's log opened while the journal looked empty (as if read just before the kill's
    # batch): its plain append lands on dest/1 first.
    raw = (directory / JOURNAL_FILE).read_bytes()
    (directory / JOURNAL_FILE).write_bytes(b"")
    plain = LocalCommitLog(directory, fsync=False)
    plain.append([OutRecord("dest", None, b"foreign", (), partition=1, timestamp_ms=3)])
    plain.close()
    (directory / JOURNAL_FILE).write_bytes(raw)
    log = LocalCommitLog(directory, fsync=False)
    assert values(log) == {"dest/0": [b"d0", b"d2"], "dest/1": [b"foreign", b"d1"], "progress/0": [b"mark"]}
    log.close()


def test_append_atomic_in_process_failure_is_finished_by_the_next_call(tmp_path: Path) -> None:
    """A failure between the steps (not a crash): the next append_atomic finishes the batch first."""
    log = LocalCommitLog(tmp_path, fsync=False)
    log.ensure_topic("dest", 2)

    def fail(where: str) -> None:
        if where == "partition-written":
            raise OSError("disk full")

    log.journal_fault = fail
    with pytest.raises(OSError):
        log.append_atomic([OutRecord("dest", None, b"a", (), partition=0), OutRecord("dest", None, b"b", (), partition=1)])
    log.journal_fault = lambda where: None
    assert log.append_atomic([OutRecord("dest", None, b"c", (), partition=1)]) == [(1, 1)]
    assert [r.value for r in log.read_since("dest", 1, 0)] == [b"b", b"c"]
    assert [r.value for r in log.read_since("dest", 0, 0)] == [b"a"]
    assert log.append_atomic([], "") == []
    log.close()


def test_read_since_gives_the_records_from_the_first_at_a_timestamp_to_the_end(tmp_path: Path) -> None:
    """The embedded log's side of a progress read-back (``KafkaCommitLog.read_since``)."""
    log = LocalCommitLog(tmp_path, fsync=False, segment_bytes=300)  # several segments
    log.ensure_topic("p", 2)
    stamps = [1_000 + 10 * i for i in range(200)]
    log.append([OutRecord("p", None, str(t).encode(), (), partition=1, timestamp_ms=t) for t in stamps])
    for since in (0, 1_000, 1_005, 1_010, 2_500, 2_990, 2_991):
        assert [int(r.value or b"") for r in log.read_since("p", 1, since)] == [t for t in stamps if t >= since]
    assert log.read_since("p", 0, 0) == []
    log.delete_before("p", 1, 100)  # retention: the search starts at the new start
    assert [r.offset for r in log.read_since("p", 1, 0)][0] == log.start_offsets("p")[1]
    log.close()


def test_dead_letters_are_written_once_across_restarts_and_a_crash(tmp_path: Path) -> None:
    """enqueue-get's dead letters on the local log (``DeadLetterLog``): a restart that reads the
    records again from an older checkpoint skips those written; a crash inside the write leaves
    them all or none, and the next log finishes them once."""
    letters = [(o, OutRecord("dlq", None, f"bad{o}".encode(), (), partition=0)) for o in (3, 5, 8)]
    log = LocalCommitLog(tmp_path, fsync=False)
    assert log.dead_letter_once("tw", "timer", 0, letters[:2]) == 2
    assert log.dead_letter_once("tw", "timer", 0, letters) == 1  # 3 and 5 were written
    assert log.dead_letter_once("tw", "timer", 1, [(3, letters[0][1])]) == 1  # another partition's own
    log.close()
    again = LocalCommitLog(tmp_path, fsync=False)  # a restart from an older checkpoint
    assert again.dead_letter_once("tw", "timer", 0, letters) == 0
    more = [(9, OutRecord("dlq", None, b"bad9", (), partition=0))]

    def crash(where: str) -> None:
        if where == "partition-written":
            raise KeyboardInterrupt  # the process dies here: nothing catches it

    again.journal_fault = crash
    with pytest.raises(KeyboardInterrupt):
        again.dead_letter_once("tw", "timer", 0, more)
    third = LocalCommitLog(tmp_path, fsync=False)  # opening finishes the journal
    assert third.dead_letter_once("tw", "timer", 0, [*letters, *more]) == 0
    assert [r.value for r in third.read_since("dlq", 0, 0)] == [b"bad3", b"bad5", b"bad8", b"bad3", b"bad9"]
    third.close()
