"""A TimerLog tail lost after its checkpoint published it (a torn or lost write that the disk had
acknowledged: e2e chaos cuts the newest record after a kill of enqueue-put) takes a cancel marker
with it. Until enqueue-put's recovery publishes again, dequeue-get and dequeue-put read the old
checkpoint, which says the marker is there: the marker's message must wait, not leave (CI's chaos
run leaked one cancel of 478 this way), and the recovery's offsets, which go back before what was
lost, let the watch find the cancel again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_late_input import START, Stages
from test_release import next_owner
from timerwheel.stages import EnqueuePut, dequeue_put
from timerwheel.stages.codec import Q_PUT
from timerwheel.stages.ownership import Ownership
from timerwheel.store import Flag
from timerwheel.store.format import RECORD_DTYPE, RECORD_SIZE
from timerwheel.store.layout import open_shard
from timerwheel.wire import id_hash


@pytest.fixture
def stages(tmp_path: Path) -> Iterator[Stages]:
    s = Stages(tmp_path)
    yield s
    s.close()


def _dequeue_only(s: Stages, rounds: int = 6) -> None:
    for _ in range(rounds):
        for stage in (s.dget, s.getmsg, s.dput):
            stage.step(0)


def test_a_cancel_marker_cut_after_its_checkpoint_still_cancels(stages: Stages) -> None:
    s = stages
    kept = s.client.schedule("dest", b"kept", deliver_at_ms=START + 2_000)
    doomed = s.client.schedule("dest", b"doomed", deliver_at_ms=START + 2_000)
    s.run()
    s.clock.set(START + 1_500)
    s.run()  # both read ahead by dequeue-get and held by dequeue-put
    s.client.cancel(doomed)
    s.run()  # the marker written and checkpointed: the TimerLog's last record
    (segment,) = (Path(s.config.data_dir) / "shard-0000" / "timerlog").glob("*.tlog")
    last = np.frombuffer(segment.read_bytes()[-RECORD_SIZE:], dtype=RECORD_DTYPE)[0]
    assert last["magic"] & 0xFF == Flag.DELETE and last["id_hash"] == id_hash(doomed.message_id)
    ckpt = s.put.owned[0].shard.load_enqueue_checkpoint()
    assert ckpt is not None and ckpt.flushed_pos == segment.stat().st_size
    s.put.close()  # enqueue-put is gone ...
    with open(segment, "r+b") as f:  # ... and its last record, acknowledged durable, torn in half
        f.truncate(segment.stat().st_size - 32)
    s.clock.set(START + 2_100)
    _dequeue_only(s)
    assert s.delivered() == []  # the slot cannot be told: its records wait
    assert s.ctx.metrics.counter("damaged_views", shard=0) > 0
    _restart_enqueue_put(s)
    s.run()
    assert s.put.owned[0].shard.recovery is not None and s.put.owned[0].shard.recovery.truncated_bytes == 32
    s.clock.set(START + 2_200)
    s.run()
    assert s.delivered() == [kept.message_id]
    assert s.ctx.metrics.counter("cancelled", topic="dest") == 1



def test_a_dequeue_get_restarted_meanwhile_waits_for_the_recovery_before_it_reads_the_slot(
        stages: Stages, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same with dequeue-get replaced while enqueue-put is down (both on a node that failed): the
    next owner reads the slot again from R at the old checkpoint. It must wait for the recovery
    rather than send the slot's messages as read past a marker it cannot see."""
    monkeypatch.setattr(dequeue_put, "OWNER_EPOCH_EVERY_S", 0.0)
    s = stages
    kept = s.client.schedule("dest", b"kept", deliver_at_ms=START + 2_000)
    doomed = s.client.schedule("dest", b"doomed", deliver_at_ms=START + 2_000)
    s.run()
    s.clock.set(START + 1_500)
    s.run()
    s.client.cancel(doomed)
    s.run()
    s.put.close()
    (segment,) = (Path(s.config.data_dir) / "shard-0000" / "timerlog").glob("*.tlog")
    with open(segment, "r+b") as f:
        f.truncate(segment.stat().st_size - 32)
    s.dget.close()  # what it sent is dropped as stale: the next owner reads the slot again from R
    next_owner(s)
    s.clock.set(START + 2_100)
    _dequeue_only(s)
    assert s.delivered() == []
    assert s.dget.owned[0].cursor <= START + 2_000  # the slot not read: it waits
    assert s.ctx.metrics.counter("damaged_views", shard=0) > 0
    _restart_enqueue_put(s)
    s.run()
    s.clock.set(START + 2_200)
    s.run()
    assert s.delivered() == [kept.message_id]
    assert s.ctx.metrics.counter("cancelled", topic="dest") == 1


def _restart_enqueue_put(s: Stages) -> None:
    cfg = s.config
    s.put = EnqueuePut(s.ctx, [0], lambda sh: open_shard(cfg, sh, writer=True), s.queues[Q_PUT],
                       Ownership(s.leases, "enqueue-put", "me", cfg.lease_ttl_ms),
                       input_ends=s.timer_topic_ends)
