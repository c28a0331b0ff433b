"""Transports: the commit log (Kafka or local segment files) and the work queues (Redis Streams or
in-process). Stages only see the protocols in ``base``."""

from timerwheel.transports.base import CommitLog, Consumer, LeaseStore, WorkQueue

__all__ = ["CommitLog", "Consumer", "LeaseStore", "WorkQueue"]
