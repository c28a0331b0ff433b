"""Handlers of the ``TimerWheel`` resource and of the objects its stages run on.

One reconcile loop per TimerWheel (``level``, a kopf daemon). A round (``run_round``) reads the
TimerWheel as it is now, applies what its spec implies, tends its shards and writes the status it
computed through the API. The loop runs one every ``RECONCILE_INTERVAL_S``, so a deleted
Deployment or a hand-edited ConfigMap comes back and the shards' progress is read, and at once
when something the status is made of changes: a pod, workload or volume claim of its stages
(``stage_changed``: kopf watches the objects labelled as the operator's) or its spec
(``spec_changed``). So ``Ready`` follows the stage pods within about a second instead of the
period. The watches only say "look now"; what a round does depends on levels alone. Rounds of one
TimerWheel never overlap (its lock, in the memo's ``Context``), and each one writes its status
before the next reads it.

An edge (create, resume after a restart, a spec change) runs a round at once and also reports a
bad spec as an Event (``InvalidSpec``) and what the API server refused (``ApplyFailed``). kopf
replays edges; a round run twice is harmless.

No handler puts a finalizer on a TimerWheel. kopf gives every daemon one (to stop it before the
object goes), but `helm uninstall` deletes the operator together with the TimerWheel, which
then stays Terminating forever, and its namespace with it. The loop needs none: kopf stops it
on the deletion event, and the owner references delete what the TimerWheel made.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Mapping
from typing import Any, cast

import kopf

from timerwheel_operator import FIELD_MANAGER, GROUP, KIND, PLURAL, VERSION, context
from timerwheel_operator import reconcile as rec
from timerwheel_operator.context import Context

#: The level check's period: a round at least this often.
RECONCILE_INTERVAL_S = 10.0
#: After a wake-up, the changes of one transition (a pod, then its workload's counts) are let
#: arrive together for this long, so that they make one round.
SETTLE_S = 0.3
#: The labels of everything the operator makes for a TimerWheel (``manifests.labels``).
OURS = {"app.kubernetes.io/managed-by": FIELD_MANAGER, "app.kubernetes.io/part-of": "timerwheel"}


def _post(body: kopf.Body, applied: rec.Applied, logger: kopf.Logger) -> None:
    """Every decision as an Event on the TimerWheel, and one log line each."""
    for event in applied.events:
        # kopf.event, not kopf.info: the settings post only warnings from kopf.info and logs.
        kopf.event(body, type="Warning" if event.warning else "Normal", reason=event.reason, message=event.message)
        logger.info("%s: %s", event.reason, event.message)


def run_round(ctx: Context, namespace: str, name: str, logger: kopf.Logger, edge: bool = False) -> None:
    """One round for the TimerWheel ``namespace/name``, read as it is now; nothing when it is gone.
    ``edge``: also report a bad spec and refused objects as warnings."""
    with ctx.wheels.lock((namespace, name)):
        found = ctx.cluster.get(f"{GROUP}/{VERSION}", KIND, namespace, name)
        if found is None or (found.get("metadata") or {}).get("deletionTimestamp"):
            return
        applied, status = rec.reconcile(found, ctx.cluster, ctx.config, int(time.time() * 1000), ctx.admin)
        ctx.cluster.patch_status(f"{GROUP}/{VERSION}", KIND, namespace, name, status)
    body = kopf.Body(cast(kopf.RawBody, found))
    if edge:
        if applied.error is not None:
            kopf.warn(body, reason="InvalidSpec", message=str(applied.error))
            logger.warning("invalid spec, nothing applied: %s", applied.error)
        for what, why in sorted(applied.failures.items()):
            kopf.warn(body, reason="ApplyFailed", message=f"{what}: {why}")
    _post(body, applied, logger)


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def spec_changed(name: str, namespace: str | None, memo: Any, logger: kopf.Logger, **_: Any) -> None:
    await asyncio.to_thread(run_round, context.of(memo), str(namespace), name, logger, True)


@kopf.daemon(GROUP, VERSION, PLURAL)
async def level(stopped: kopf.DaemonStopped, name: str, namespace: str | None, memo: Any, logger: kopf.Logger,
                **_: Any) -> None:
    ctx = context.of(memo)
    key = (str(namespace), name)
    wake = ctx.wheels.watch(key)
    try:
        while not stopped:
            wake.clear()
            try:
                await asyncio.to_thread(run_round, ctx, key[0], name, logger)
            except Exception as exc:  # noqa: BLE001 - one failed round (the API away): the next one tries again
                logger.warning("reconcile round failed: %s: %s", type(exc).__name__, exc)
            if await _woken(stopped, wake, RECONCILE_INTERVAL_S):
                await asyncio.sleep(SETTLE_S)
    finally:
        ctx.wheels.forget(key)


async def _woken(stopped: kopf.DaemonStopped, wake: asyncio.Event, timeout: float) -> bool:
    """Wait up to ``timeout`` for a wake-up or the stop; True when woken."""
    waits = {asyncio.ensure_future(stopped.wait()), asyncio.ensure_future(wake.wait())}
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await w
    return wake.is_set() and not stopped


@kopf.on.event("v1", "pods", labels=OURS)
@kopf.on.event("apps/v1", "deployments", labels=OURS)
@kopf.on.event("apps/v1", "statefulsets", labels=OURS)
@kopf.on.event("v1", "persistentvolumeclaims", labels=OURS)
async def stage_changed(namespace: str | None, labels: Mapping[str, str], memo: Any, **_: Any) -> None:
    """A stage pod, workload, Job pod or volume claim of a TimerWheel changed: look now."""
    instance = labels.get("app.kubernetes.io/instance")
    if instance:
        context.of(memo).wheels.wake((str(namespace), instance))


def _without_finalizer(registry: kopf.OperatorRegistry, fn: Any) -> None:
    """The handlers of ``fn`` in ``registry``, made not to require kopf's finalizer (which
    ``kopf.daemon`` always asks for); kopf removes it from objects that already have it."""
    spawning = registry._spawning
    spawning._handlers = [dataclasses.replace(h, requires_finalizer=False) if getattr(h, "fn", None) is fn else h
                          for h in spawning._handlers]


_without_finalizer(kopf.get_default_registry(), level)
