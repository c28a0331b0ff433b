"""The kopf handlers as registered, and the reconcile loop on a fake cluster: the operator's state
lives in kopf's memo, an edge runs a round that writes the status through the API, and a change of
a stage's pod, workload or claim wakes the TimerWheel's loop at once instead of at the period."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import kopf
import pytest
from k8s_helpers import wheel_body
from test_reconcile import SETTINGS, FakeCluster
from timerwheel_operator import context
from timerwheel_operator.handlers import timerwheel as handlers

LOG = logging.getLogger("test")


def registered() -> list[Any]:
    import timerwheel_operator.main  # noqa: F401 - registers

    registry = kopf.get_default_registry()
    return [*registry._spawning.get_all_handlers(), *registry._changing.get_all_handlers(),
            *registry._watching.get_all_handlers()]


def test_the_handlers_and_the_startup_hook_are_registered() -> None:
    ids = {h.id for h in registered()}
    assert any("spec_changed" in i for i in ids) and any(i.endswith("level") for i in ids)
    assert any("configure" in h.id for h in kopf.get_default_registry()._activities.get_all_handlers())


def test_no_handler_puts_a_finalizer_on_a_timerwheel() -> None:
    """Else `helm uninstall`, which deletes the operator with the TimerWheel, leaves the
    TimerWheel (and its namespace) Terminating forever."""
    handlers_ = registered()
    assert any(h.id.endswith("level") for h in handlers_)
    assert [h.id for h in handlers_ if getattr(h, "requires_finalizer", None)] == []


def test_the_stages_pods_workloads_and_claims_are_watched_by_the_operator_s_labels() -> None:
    kopf.get_default_registry()
    watched = [h for h in registered() if getattr(h, "fn", None) is handlers.stage_changed]
    assert len(watched) == 4
    for h in watched:
        assert h.labels == handlers.OURS, h.labels


def _memo(cluster: FakeCluster) -> kopf.Memo:
    memo = kopf.Memo()
    context.install(memo, context.Context(cluster, SETTINGS))
    return memo


def test_state_comes_from_kopf_s_memo_and_a_missing_one_is_named() -> None:
    with pytest.raises(RuntimeError, match="startup hook has not run"):
        context.of(kopf.Memo())
    cluster = FakeCluster()
    assert context.of(_memo(cluster)).cluster is cluster


def test_an_edge_runs_a_round_that_writes_the_status_through_the_api() -> None:
    cluster = FakeCluster()
    cluster.objects[("TimerWheel", "orders")] = wheel_body()
    asyncio.run(handlers.spec_changed(name="orders", namespace="tw-test", memo=_memo(cluster), logger=LOG))
    assert cluster.objects[("TimerWheel", "orders")]["status"]["observedGeneration"] == 3
    assert ("ConfigMap", "timerwheel-orders-settings") in cluster.objects
    # a TimerWheel gone meanwhile: nothing is applied for it
    before = cluster.applies
    asyncio.run(handlers.spec_changed(name="gone", namespace="tw-test", memo=_memo(cluster), logger=LOG))
    assert cluster.applies == before


class Stopped:
    """kopf's ``stopped`` flag of a daemon, as the test sets it."""

    def __init__(self) -> None:
        self.flag = asyncio.Event()

    def __bool__(self) -> bool:
        return self.flag.is_set()

    async def wait(self) -> None:
        await self.flag.wait()


async def _until(ok: Callable[[], bool], timeout: float) -> float:
    t0 = time.monotonic()
    while not ok():
        assert time.monotonic() - t0 < timeout, "not within the time"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


def test_a_stage_change_wakes_the_loop_at_once_and_the_period_runs_it_anyway() -> None:
    cluster = FakeCluster()
    cluster.objects[("TimerWheel", "orders")] = wheel_body()
    memo = _memo(cluster)
    deployment = ("Deployment", "timerwheel-orders-dequeue-put")

    async def scenario() -> None:
        stopped = Stopped()
        loop = asyncio.ensure_future(handlers.level(stopped=stopped, name="orders", namespace="tw-test", memo=memo,
                                                    logger=LOG))
        await _until(lambda: deployment in cluster.objects, 5)  # the first round, at once
        del cluster.objects[deployment]
        await asyncio.sleep(0.5)
        assert deployment not in cluster.objects  # nothing looks before the period ...
        # ... but a change of one of its stage's pods does (another TimerWheel's does not)
        await handlers.stage_changed(namespace="tw-test", labels={"app.kubernetes.io/instance": "other"}, memo=memo)
        await asyncio.sleep(0.5)
        assert deployment not in cluster.objects
        await handlers.stage_changed(namespace="tw-test", labels={"app.kubernetes.io/instance": "orders"}, memo=memo)
        took = await _until(lambda: deployment in cluster.objects, handlers.RECONCILE_INTERVAL_S / 3)
        assert took < handlers.RECONCILE_INTERVAL_S / 3
        stopped.flag.set()
        await asyncio.wait_for(loop, 5)  # stops at once, not after the period
        assert ("tw-test", "orders") not in context.of(memo).wheels.wakes

    asyncio.run(scenario())


def test_rounds_of_one_timerwheel_never_overlap() -> None:
    """An edge and the loop (or two wake-ups) run rounds in threads: the TimerWheel's lock keeps
    one from reading a status the other has not written yet."""
    inside: list[int] = []
    overlaps: list[int] = []

    class Slow(FakeCluster):
        def patch_status(self, api_version: str, kind: str, namespace: str, name: str, status: Any) -> None:
            inside.append(1)
            if len(inside) > 1:
                overlaps.append(len(inside))
            time.sleep(0.2)
            super().patch_status(api_version, kind, namespace, name, status)
            inside.pop()

    cluster = Slow()
    cluster.objects[("TimerWheel", "orders")] = wheel_body()
    memo = _memo(cluster)

    async def both() -> None:
        await asyncio.gather(*(handlers.spec_changed(name="orders", namespace="tw-test", memo=memo, logger=LOG)
                               for _ in range(3)))

    asyncio.run(both())
    assert overlaps == [] and cluster.objects[("TimerWheel", "orders")]["status"]["observedGeneration"] == 3
