"""Handlers of the ``TimerWheel`` resource.

An edge (create, resume after a restart, a spec change) applies the spec at once and reports a
bad one as an Event; the timer reconciles the level every ``interval`` seconds, so a deleted
Deployment or a hand-edited ConfigMap comes back, and writes the status from what it observes.
Both only call ``reconcile``; running either twice is harmless (kopf replays events).
"""

from __future__ import annotations

from typing import Any

import kopf

from timerwheel_operator import GROUP, PLURAL, VERSION
from timerwheel_operator import reconcile as rec
from timerwheel_operator.runtime import cluster, settings

RECONCILE_INTERVAL_S = 10.0


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def spec_changed(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **_: Any) -> None:
    applied = rec.ensure(body, cluster(), settings())
    if applied.error is not None:
        kopf.warn(body, reason="InvalidSpec", message=str(applied.error))
        logger.warning("invalid spec, nothing applied: %s", applied.error)
    for what, why in sorted(applied.failures.items()):
        kopf.warn(body, reason="ApplyFailed", message=f"{what}: {why}")
    patch.status.update(rec.observe(body, applied, cluster()))


@kopf.timer(GROUP, VERSION, PLURAL, interval=RECONCILE_INTERVAL_S, initial_delay=RECONCILE_INTERVAL_S)
def level(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    applied = rec.ensure(body, cluster(), settings())
    patch.status.update(rec.observe(body, applied, cluster()))
