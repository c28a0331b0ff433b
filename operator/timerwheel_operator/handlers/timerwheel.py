"""Handlers of the ``TimerWheel`` resource.

An edge (create, resume after a restart, a spec change) applies the spec at once and reports a
bad one as an Event; the timer reconciles the level every ``interval`` seconds, so a deleted
Deployment or a hand-edited ConfigMap comes back, and writes the status from what it observes.
Both only call ``reconcile``; running either twice is harmless (kopf replays events).

No handler puts a finalizer on a TimerWheel. kopf gives every timer one (to stop it before the
object goes), but `helm uninstall` deletes the operator together with the TimerWheel, which
then stays Terminating forever, and its namespace with it. The timer needs none: kopf stops it
on the deletion event, and the owner references delete what the TimerWheel made.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import kopf

from timerwheel_operator import GROUP, PLURAL, VERSION
from timerwheel_operator import reconcile as rec
from timerwheel_operator.runtime import admin, cluster, settings

RECONCILE_INTERVAL_S = 10.0


def _post(body: kopf.Body, applied: rec.Applied, logger: kopf.Logger) -> None:
    """Every decision as an Event on the TimerWheel, and one log line each."""
    for event in applied.events:
        # kopf.event, not kopf.info: the settings post only warnings from kopf.info and logs.
        kopf.event(body, type="Warning" if event.warning else "Normal", reason=event.reason, message=event.message)
        logger.info("%s: %s", event.reason, event.message)


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def spec_changed(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **_: Any) -> None:
    applied, status = rec.reconcile(body, cluster(), settings(), int(time.time() * 1000), admin())
    if applied.error is not None:
        kopf.warn(body, reason="InvalidSpec", message=str(applied.error))
        logger.warning("invalid spec, nothing applied: %s", applied.error)
    for what, why in sorted(applied.failures.items()):
        kopf.warn(body, reason="ApplyFailed", message=f"{what}: {why}")
    _post(body, applied, logger)
    patch.status.update(status)


@kopf.timer(GROUP, VERSION, PLURAL, interval=RECONCILE_INTERVAL_S, initial_delay=RECONCILE_INTERVAL_S)
def level(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **_: Any) -> None:
    applied, status = rec.reconcile(body, cluster(), settings(), int(time.time() * 1000), admin())
    _post(body, applied, logger)
    patch.status.update(status)


def _without_finalizer(registry: kopf.OperatorRegistry, fn: Any) -> None:
    """The handlers of ``fn`` in ``registry``, made not to require kopf's finalizer (which
    ``kopf.timer`` always asks for); kopf removes it from objects that already have it."""
    spawning = registry._spawning
    spawning._handlers = [dataclasses.replace(h, requires_finalizer=False) if getattr(h, "fn", None) is fn else h
                          for h in spawning._handlers]


_without_finalizer(kopf.get_default_registry(), level)
