"""The small error hierarchy of timerwheel. Messages name the thing and the value."""

from __future__ import annotations


class TimerwheelError(Exception):
    """Base of every error timerwheel raises on purpose."""


class ConfigError(TimerwheelError):
    """A configuration value is invalid. ``field`` names it (an env var, a flag or an attribute)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class FormatMismatchError(TimerwheelError):
    """A shard on disk was written with another format version, tick or slot count."""


class SourceMismatchError(FormatMismatchError):
    """The shards of a data directory were written from another commit log than the one this
    process reads: another Kafka cluster, another incarnation of the timer topic (deleted and
    made again), or a checkpointed offset beyond a partition's end. The message names both and
    the command that recovers (``timerwheel rebase``)."""


class CorruptRecordError(TimerwheelError):
    """A TimerLog record failed its CRC check where it must not (the middle of the log)."""

    def __init__(self, position: int, message: str) -> None:
        super().__init__(f"corrupt TimerLog record at position {position}: {message}")
        self.position = position


class TimerLogDamagedError(TimerwheelError):
    """A reader met a record of a slot's chain that its published checkpoint calls flushed, and it
    is cut off or invalid: the TimerLog lost records after they were published (a torn or lost
    tail), and the writer's recovery has not published a checkpoint since. What the slot holds
    cannot be told until then (a lost cancel marker must not let its message out)."""


class FencedError(TimerwheelError):
    """This process lost ownership of a shard: another owner holds a newer epoch."""


class QueueFullError(TimerwheelError):
    """A bounded work queue stayed full past the put timeout."""


class InvalidTimerMessage(TimerwheelError):
    """A timer-topic record that cannot be scheduled. ``reason`` goes into ``tw-error``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class AccessError(TimerwheelError):
    """Kafka or Redis refused this process's credentials or TLS settings (a wrong password, a
    certificate not trusted). Not retried: it names the setting to fix (``setting``)."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"{setting}: {message}")
        self.setting = setting


class ShardNeedsRecoveryError(TimerwheelError):
    """A shard's state cannot be trusted as it is (its dequeue checkpoint is lost or corrupt):
    the shard is not started, so nothing in it is skipped. The message names the file and the
    recovery command (``timerwheel recover``)."""


class ShardInUseError(TimerwheelError):
    """A recovery tool was asked to change a shard that a live process owns (its lock or lease)."""
