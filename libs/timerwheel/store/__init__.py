"""Per-shard storage: the TimerLog, the TimerWheel, checkpoints and crash recovery (RIP-43).

Start with ``Shard`` (shard.py); FORMAT.md documents every byte on disk and the recovery algorithm.
"""

from timerwheel.store.checkpoint import (
    CarriedSlot,
    CorruptCheckpointError,
    DequeueCheckpoint,
    EnqueueCheckpoint,
    ReadAhead,
)
from timerwheel.store.format import (
    FORMAT_VERSION,
    RECORD_DTYPE,
    RECORD_SIZE,
    RECORD_STRUCT,
    Flag,
    TimerRecord,
    records_array,
)
from timerwheel.store.layout import shard_dir
from timerwheel.store.recovery import CrashRecoveryReport
from timerwheel.store.shard import Shard
from timerwheel.store.timerlog import TimerLog
from timerwheel.store.wheel import Slot, TimerWheel

__all__ = [
    "FORMAT_VERSION",
    "RECORD_DTYPE",
    "RECORD_SIZE",
    "RECORD_STRUCT",
    "CarriedSlot",
    "CorruptCheckpointError",
    "CrashRecoveryReport",
    "DequeueCheckpoint",
    "EnqueueCheckpoint",
    "Flag",
    "ReadAhead",
    "Shard",
    "Slot",
    "TimerLog",
    "TimerRecord",
    "TimerWheel",
    "records_array",
    "shard_dir",
]
