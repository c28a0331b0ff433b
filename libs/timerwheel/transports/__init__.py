"""Transports: the commit log (Kafka in ``kafka/``, local segment files in ``local/``) and the work
queues (Redis Streams in ``redisq``, in-process in ``memory``). Stages only see the protocols in
``base``; both commit logs keep records read once in a ``readcache.ReadCache``."""

from timerwheel.transports.base import CommitLog, Consumer, LeaseStore, WorkQueue

__all__ = ["CommitLog", "Consumer", "LeaseStore", "WorkQueue"]
