"""The five RIP-43 stages as transport-agnostic loops, one module each.

    enqueue-get -> (put) -> enqueue-put -> TimerLog + wheel
    dequeue-get -> (fetch) -> dequeue-getmsg -> (deliver) -> dequeue-put -> destination
                                                   dequeue-put -> (done) -> dequeue-get

Each stage has ``step(timeout_s) -> int`` (one batch; 0 when idle, after waiting up to the
timeout) and ``close()``. ``timerwheel.runtime`` runs them in threads or processes.
"""

from timerwheel.stages.base import StageContext, Stopped
from timerwheel.stages.dequeue_get import DequeueGet
from timerwheel.stages.dequeue_getmsg import DequeueGetMsg
from timerwheel.stages.dequeue_put import DequeuePut
from timerwheel.stages.enqueue_get import EnqueueGet
from timerwheel.stages.enqueue_put import EnqueuePut

STAGE_NAMES = ("enqueue-get", "enqueue-put", "dequeue-get", "dequeue-getmsg", "dequeue-put")

__all__ = ["STAGE_NAMES", "DequeueGet", "DequeueGetMsg", "DequeuePut", "EnqueueGet", "EnqueuePut",
           "StageContext", "Stopped"]
