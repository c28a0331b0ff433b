"""What the handlers share, kept in kopf's ``memo`` (kopf's documented place for operator state):
made once by ``main``'s startup hook, read by every handler through ``of(memo)``.

kopf gives each resource object a shallow copy of the operator's memo, so the one ``Context`` is
seen by the handlers of every object. Besides the doors to the cluster and Kafka and the
operator's own configuration it holds, per TimerWheel, the lock that keeps its rounds from
overlapping and the wake-up of its reconcile loop (``handlers.timerwheel``).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

from timerwheel_operator.kube import Cluster
from timerwheel_operator.reconcile import OperatorConfig
from timerwheel_operator.retention import Admin

#: The memo's key of the Context.
KEY = "timerwheel"

WheelKey = tuple[str, str]


@dataclass(slots=True)
class Wheels:
    """Per TimerWheel (namespace, name): a lock for its rounds (they run in threads) and the event
    that wakes its reconcile loop (set and awaited on kopf's event loop)."""

    locks: dict[WheelKey, threading.Lock] = field(default_factory=dict)
    wakes: dict[WheelKey, asyncio.Event] = field(default_factory=dict)
    _guard: threading.Lock = field(default_factory=threading.Lock)

    def lock(self, key: WheelKey) -> threading.Lock:
        with self._guard:
            return self.locks.setdefault(key, threading.Lock())

    def watch(self, key: WheelKey) -> asyncio.Event:
        """The wake-up of ``key``'s loop (made by the loop itself)."""
        return self.wakes.setdefault(key, asyncio.Event())

    def wake(self, key: WheelKey) -> bool:
        """Wake ``key``'s loop; False when no loop runs for it."""
        event = self.wakes.get(key)
        if event is not None:
            event.set()
        return event is not None

    def forget(self, key: WheelKey) -> None:
        """``key``'s loop has ended (its lock stays: a round of an edge may hold it still)."""
        self.wakes.pop(key, None)


@dataclass(slots=True)
class Context:
    cluster: Cluster
    config: OperatorConfig
    #: Kafka's admin API for the timer topic's retention (None: not checked)
    admin: Admin | None = None
    wheels: Wheels = field(default_factory=Wheels)


def install(memo: Any, context: Context) -> None:
    memo[KEY] = context


def of(memo: Any) -> Context:
    got = memo.get(KEY) if memo is not None else None
    if not isinstance(got, Context):
        raise RuntimeError("the operator's startup hook has not run: no context in kopf's memo")
    return got
