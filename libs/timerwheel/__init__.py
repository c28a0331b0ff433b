"""timerwheel: arbitrary-delay timer messages for Kafka (RocketMQ RIP-43: TimerLog + TimerWheel)."""

from timerwheel.client import Timer, TimerClient
from timerwheel.clock import Clock, SimulatedClock, SystemClock
from timerwheel.config import TimerConfig
from timerwheel.errors import ConfigError, TimerwheelError
from timerwheel.retry import Delivery, RetryConsumer
from timerwheel.wire import Ticket

__all__ = ["Clock", "ConfigError", "Delivery", "EmbeddedTimerwheel", "KafkaCommitLog", "LocalCommitLog", "RetryConsumer",
           "SimulatedClock", "SystemClock", "Ticket", "Timer", "TimerClient", "TimerConfig", "TimerwheelError"]


def __getattr__(name: str) -> object:
    # Lazy, so that `import timerwheel` stays light for clients that only produce.
    if name == "EmbeddedTimerwheel":
        from timerwheel.runtime.embedded import EmbeddedTimerwheel

        return EmbeddedTimerwheel
    if name == "LocalCommitLog":
        from timerwheel.transports.local.log import LocalCommitLog

        return LocalCommitLog
    if name == "KafkaCommitLog":  # kafka-python is imported only by who uses it
        from timerwheel.transports.kafka.log import KafkaCommitLog

        return KafkaCommitLog
    raise AttributeError(name)
