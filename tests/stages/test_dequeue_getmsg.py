"""dequeue-getmsg builds deliver items column-wise: a plain entry's are all deliveries, and in an
entry with a roll hop, a missing record or a cancel each item gets its own kind."""

from __future__ import annotations

from pathlib import Path

from timerwheel import SimulatedClock, TimerConfig
from timerwheel.records import OutRecord
from timerwheel.stages import codec
from timerwheel.stages.base import StageContext
from timerwheel.stages.codec import DeliverEntry, DeliverItem, FetchEntry, FetchItem
from timerwheel.stages.dequeue_getmsg import DequeueGetMsg
from timerwheel.store import Flag
from timerwheel.transports.local.log import LocalCommitLog
from timerwheel.transports.memory import MemoryWorkQueue

START = 1_700_000_000_000
NORMAL, ROLLED = int(Flag.NORMAL), int(Flag.ROLL)


def test_plain_and_mixed_entries_give_the_same_deliver_items(tmp_path: Path) -> None:
    config = TimerConfig(data_dir=str(tmp_path), shards=1, fsync=False)
    log = LocalCommitLog(tmp_path / "log", fsync=False)
    log.ensure_topic(config.timer_topic, 2)
    for p in range(2):
        log.append([OutRecord(config.timer_topic, f"k{i}".encode(), b"v", (("tw-id", f"{p}-{i}".encode()),),
                              partition=p) for i in range(6)])
    log.append([OutRecord(config.timer_topic, None, b"", (("tw-cancel", b"1-2"),), partition=1)])  # marker at 1/6
    fetch_q, deliver_q = MemoryWorkQueue("fetch", 1, 64), MemoryWorkQueue("deliver", 1, 64)
    getmsg = DequeueGetMsg(StageContext(config, SimulatedClock(START)), log, fetch_q, deliver_q, [0])

    def item(p: int, o: int, flags: int = NORMAL, cancels: tuple[tuple[int, int], ...] = ()) -> FetchItem:
        return FetchItem(64 * o, flags, p, o, START + o, START - o, cancels)

    plain = FetchEntry(0, 1, START, 640, tuple(item(p, o) for p in range(2) for o in range(6)))
    rolled = FetchEntry(0, 1, START + 100, 640, (item(0, 1), item(1, 1, ROLLED)))
    missing = FetchEntry(0, 1, START + 200, 640, (item(0, 2), item(1, 99)))
    # two candidate markers of one id hash: 0/5 is a message, not a cancel; 1/6 names 1-2
    cancelled = FetchEntry(0, 1, START + 300, 640, (item(1, 2, cancels=((0, 5), (1, 6))),
                                                    item(1, 3, cancels=((0, 5), (1, 6)))))
    fetch_q.put(0, [plain, rolled, missing, cancelled], 1.0)  # type: ignore[list-item]  # in-process entries
    getmsg.step(0)
    out = [DeliverEntry.decode(payload) for _eid, payload in deliver_q.get(0, "t", 10, 0)]
    records = {(r.partition, r.offset): r for r in log.read(config.timer_topic, [(p, o) for p in range(2) for o in range(6)])
               if r is not None}

    def expect(kind: int, i: FetchItem) -> DeliverItem:
        return DeliverItem(kind, i.fire_ms, i.enqueued_ms, records.get((i.src_partition, i.src_offset)),
                           i.src_partition, i.src_offset, None)

    assert [e.slot_time for e in out] == [START, START + 100, START + 200, START + 300]
    assert {e.read_pos for e in out} == {640}
    assert list(out[0].items) == [expect(codec.DELIVER, i) for i in plain.items]
    assert all(type(i) is DeliverItem for e in out for i in e.items)
    assert list(out[1].items) == [expect(codec.DELIVER, rolled.items[0]), expect(codec.ROLL, rolled.items[1])]
    assert list(out[2].items) == [expect(codec.DELIVER, missing.items[0]), expect(codec.MISSING, missing.items[1])]
    # the marker names 1-2: that one is cancelled; 1-3 only shares the (simulated) id hash
    assert list(out[3].items) == [expect(codec.CANCELLED, cancelled.items[0]), expect(codec.DELIVER, cancelled.items[1])]
    log.close()
