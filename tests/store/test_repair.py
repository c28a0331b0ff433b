"""Lost or damaged shard state: the shard refuses to start, and `timerwheel recover` /
`timerwheel rebuild-wheel` repair it so that nothing is lost (real processes for the tools)."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from timerwheel import SimulatedClock, Timer
from timerwheel.config import TimerConfig
from timerwheel.errors import FormatMismatchError, ShardNeedsRecoveryError
from timerwheel.runtime.embedded import EmbeddedTimerwheel
from timerwheel.store import Shard, records_array
from timerwheel.store.checkpoint import DequeueCheckpoint, EnqueueCheckpoint
from timerwheel.store.layout import shard_dir
from timerwheel.store.repair import change_window, rebuild_wheel

ENV = {**os.environ, "TW_LOG_LEVEL": "WARNING"}
ENV.pop("TW_REDIS_URL", None)  # the lease check is not what these tests are about
START = 1_700_000_000_000
TICK = 100
SETTINGS = {"shards": 1, "tick_ms": TICK, "roll_window_ms": 60_000, "fsync": False}


def tw(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "timerwheel.cli", *args], capture_output=True, text=True,
                          timeout=120, env=ENV)


def delivered(tw_: EmbeddedTimerwheel) -> list[str]:
    return [(r.header("tw-id") or b"").decode() for r in tw_.read("t")]


def schedule_and_deliver_half(data: Path) -> tuple[list[str], list[str]]:
    """20 messages due 1..20 s after START; the clock moves to 10.5 s: the first 10 are delivered.
    Returns (delivered ids, all ids). The runtime is closed afterwards."""
    clock = SimulatedClock(START)
    with EmbeddedTimerwheel(data, clock=clock, **SETTINGS) as e:
        tickets = e.schedule_many([Timer("t", b"v", deliver_at_ms=START + 1_000 * (i + 1), message_id=f"m{i}")
                                   for i in range(20)])
        e.wait_idle()
        clock.set(START + 10_500)
        e.wait_idle()
        first = delivered(e)
    assert sorted(first) == sorted(f"m{i}" for i in range(10))
    return first, [t.message_id for t in tickets]


def deliver_all(data: Path) -> list[str]:
    clock = SimulatedClock(START + 10_500)
    with EmbeddedTimerwheel(data, clock=clock, **SETTINGS) as e:
        e.wait_idle()
        clock.set(START + 25_000)
        e.wait_idle()
        return delivered(e)


def dequeue_files(data: Path) -> list[Path]:
    return sorted((data / "shard-0000").glob("dequeue*.ckpt"))


def test_a_lost_dequeue_checkpoint_stops_the_shard_and_recover_loses_nothing(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first, ids = schedule_and_deliver_half(data)
    for f in dequeue_files(data):
        f.unlink()
    with pytest.raises(ShardNeedsRecoveryError) as refused:
        EmbeddedTimerwheel(data, clock=SimulatedClock(START + 10_500), **SETTINGS)
    why = str(refused.value)
    assert "dequeue checkpoint" in why and "missing" in why, why
    assert f"timerwheel recover --shard 0 --data-dir {data.absolute()}" in why
    run = tw("run", "--embedded", "--data-dir", str(data), "--shards", "1", "--tick-ms", "100",
             "--roll-window", "60000")
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 1 and last.startswith("timerwheel: error: shard 0: dequeue checkpoint"), run.stderr
    assert "timerwheel recover --shard 0" in last

    result = tw("recover", "--shard", "0", "--data-dir", str(data))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["status"] == "repaired" and report["dequeue_checkpoint"] == "rebuilt"
    assert report["enqueue_checkpoint"] == "kept"
    # The 10 delivered messages lie in slots before W: the lost R may have passed any of them.
    assert report["may_deliver_twice"] == 10
    assert report["read_ms"] == START + 1_000  # the earliest slot of a retained record
    again = tw("recover", "--shard", "0", "--data-dir", str(data))
    assert json.loads(again.stdout)["status"] == "ok", "a second recover found something left to repair"

    after = deliver_all(data)
    assert sorted(set(after)) == sorted(ids), "a message was lost"
    assert sorted(after[len(first):]) == sorted(ids), "each message once more after the recovery, no more"


def test_a_corrupt_dequeue_checkpoint_is_set_aside_not_trusted(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _first, ids = schedule_and_deliver_half(data)
    [ckpt] = dequeue_files(data)
    ckpt.write_bytes(b'{"kind": "dequeue", "read_ms": 9')
    with pytest.raises(ShardNeedsRecoveryError, match=f"{ckpt.name} is unreadable.*timerwheel recover --shard 0"):
        EmbeddedTimerwheel(data, clock=SimulatedClock(START + 10_500), **SETTINGS)
    report = json.loads(tw("recover", "--shard", "0", "--data-dir", str(data)).stdout)
    assert report["set_aside"] == [ckpt.name] and (ckpt.parent / (ckpt.name + ".corrupt")).exists()
    assert report["dequeue_checkpoint"] == "rebuilt" and report["may_deliver_twice"] == 10
    assert set(deliver_all(data)) == set(ids)


def test_the_repair_tools_refuse_a_shard_a_live_process_owns(tmp_path: Path) -> None:
    data = tmp_path / "data"
    schedule_and_deliver_half(data)
    wheel = data / "shard-0000" / "wheel"
    before = wheel.stat().st_ino
    with EmbeddedTimerwheel(data, clock=SimulatedClock(START + 10_500), **SETTINGS):
        for command in ("recover", "rebuild-wheel"):
            result = tw(command, "--shard", "0", "--data-dir", str(data))
            assert result.returncode == 3, result
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and "in use by another timerwheel process" in lines[0], result.stderr
            assert result.stdout == ""
    assert wheel.stat().st_ino == before, "rebuild-wheel replaced the wheel of a live writer"
    missing = tw("recover", "--shard", "3", "--data-dir", str(data))
    assert missing.returncode == 1 and "no shard at" in missing.stderr, missing.stderr


def test_rebuild_wheel_relinks_every_record_of_a_wiped_wheel(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _first, ids = schedule_and_deliver_half(data)
    wheel = data / "shard-0000" / "wheel"
    size = wheel.stat().st_size
    with open(wheel, "r+b") as f:  # keep the header (it says the wheel is durable): slots gone
        f.seek(64)
        f.write(bytes(size - 64))
    result = tw("rebuild-wheel", "--shard", "0", "--data-dir", str(data))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["status"] == "rebuilt" and report["records"] == 20 and report["relinked"] == 20
    assert set(deliver_all(data)) == set(ids)


def test_recover_cuts_a_torn_timerlog_tail(tmp_path: Path) -> None:
    data = tmp_path / "data"
    schedule_and_deliver_half(data)
    [segment] = sorted((data / "shard-0000" / "timerlog").glob("*.tlog"))
    end = segment.stat().st_size
    with open(segment, "ab") as f:
        f.write(b"\x40\x00\x00\x00" + b"\x01" * 30)  # half a record: a write torn by a crash
    report = json.loads(tw("recover", "--shard", "0", "--data-dir", str(data)).stdout)
    assert report["truncated_bytes"] == 34 and report["timerlog_end"] == end
    assert report["status"] == "repaired" and report["may_deliver_twice"] == 0
    assert segment.stat().st_size == end


def test_dequeue_get_leaves_a_shard_without_its_checkpoint_unowned_and_says_why(tmp_path: Path) -> None:
    """The production dequeue-get: it must not start the shard at some R of its own making."""
    from timerwheel import SystemClock, TimerConfig
    from timerwheel.metrics import Metrics
    from timerwheel.stages import DequeueGet, StageContext
    from timerwheel.stages.ownership import Ownership
    from timerwheel.store.layout import open_reader_if_exists
    from timerwheel.transports.memory import MemoryLeaseStore, MemoryWorkQueue

    data = tmp_path / "data"
    schedule_and_deliver_half(data)
    for f in dequeue_files(data):
        f.unlink()
    cfg = TimerConfig(data_dir=str(data), shards=1, tick_ms=TICK, roll_window_ms=60_000, fsync=False)
    ctx = StageContext(cfg, SystemClock(), Metrics(), consumer="test")
    stage = DequeueGet(ctx, [0], lambda s: open_reader_if_exists(cfg, s), MemoryWorkQueue("fetch", 1, 8),
                       MemoryWorkQueue("done", 1, 8), Ownership(MemoryLeaseStore(SystemClock()), "dequeue-get", "test"))
    try:
        stage.step(0.0)
        assert stage.owned == {}
        assert "dequeue.ckpt is missing" in stage.refused[0] and "timerwheel recover --shard 0" in stage.refused[0]
        # the operator sees it as it sees an unopenable shard, and marks the TimerWheel Degraded
        failed = {"shard": 0, "stage": "dequeue-get", "error": "RecoveryNeeded"}
        assert ctx.metrics.gauge("shard_open_failed", **failed) == 1
        assert tw("recover", "--shard", "0", "--data-dir", str(data)).returncode == 0
        stage.step(0.0)
        assert list(stage.owned) == [0] and stage.owned[0].read_ms == START + 1_000
        assert stage.refused == {}
        assert ctx.metrics.gauge("shard_open_failed", **failed) == 0
    finally:
        stage.close()


# --- rebuild-wheel --change-window --------------------------------------------------------------

def _spread(e: EmbeddedTimerwheel, n: int) -> dict[str, int]:
    """n messages due from 1 s after START, three a second (those past the 60 s roll window are
    rolled; a coarser tick puts several old slots in one); id -> due."""
    due = {f"w{i}": START + 1_000 + 330 * i + 7 * (i % 5) for i in range(n)}
    e.schedule_many([Timer("t", b"v", deliver_at_ms=at, message_id=m) for m, at in due.items()])
    return due


def _deliveries(e: EmbeddedTimerwheel) -> list[tuple[str, int]]:
    return [((r.header("tw-id") or b"").decode(), int(r.header("tw-delivered-at") or b"0")) for r in e.read("t")]


@pytest.mark.parametrize("new", [{"tick_ms": 1_000, "roll_window_ms": 120_000},
                                 {"tick_ms": TICK, "roll_window_ms": 120_000},
                                 {"tick_ms": 10, "roll_window_ms": 90_000, "wheel_span_ms": 200_000}],
                         ids=["coarser-tick-doubled-window", "doubled-window", "finer-tick"])
def test_a_window_change_rebuilds_the_wheel_and_every_message_comes_on_time(tmp_path: Path,
                                                                            new: dict[str, int]) -> None:
    data = tmp_path / "data"
    clock = SimulatedClock(START)
    with EmbeddedTimerwheel(data, clock=clock, **SETTINGS) as e:
        due = _spread(e, 250)
        e.wait_idle()
        clock.set(START + 10_550)
        e.wait_idle()
        before = _deliveries(e)
    assert sorted(m for m, _ in before) == sorted(m for m, at in due.items() if at < START + 10_500)
    settings = {**SETTINGS, **new}
    with pytest.raises(FormatMismatchError):  # the stored window is refused, as before
        EmbeddedTimerwheel(data, clock=SimulatedClock(START + 10_550), **settings)
    flags = [f"--{k.replace('_', '-')}" if k != "roll_window_ms" else "--roll-window-ms" for k in new]
    args = [a for flag, v in zip(flags, new.values(), strict=True) for a in (flag, str(v))]
    refused = tw("rebuild-wheel", "--shard", "0", "--data-dir", str(data), *args)
    assert refused.returncode == 2 and "--change-window" in refused.stderr, refused.stderr

    done = tw("rebuild-wheel", "--shard", "0", "--data-dir", str(data), "--change-window", *args)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["status"] == "rebuilt" and report["records"] >= 250 and report["records_per_s"] > 0, report
    assert report["tick_ms"] == new["tick_ms"] and report["roll_window_ms"] == new["roll_window_ms"]
    assert report["rechained"] > 0 if new["tick_ms"] > TICK else True, report  # new slots, new links
    stored = json.loads((data / "timerwheel.json").read_text())
    assert stored["tick_ms"] == new["tick_ms"] and stored["roll_window_ms"] == new["roll_window_ms"]
    assert stored["shards"] == 1

    clock = SimulatedClock(START + 10_550)
    with EmbeddedTimerwheel(data, clock=clock, **settings) as e:  # starts with the new settings
        while clock.now_ms() < START + 125_000:
            clock.advance(250)
            e.wait_idle()
        after = _deliveries(e)[len(before):]
    got = before + after
    first: dict[str, int] = {}
    for m, at in got:
        first.setdefault(m, at)
    assert sorted(first) == sorted(due), sorted(set(due) - set(first))
    early = [m for m, at in got if at < due[m]]
    assert early == []
    late = {m: first[m] - due[m] for m in due  # of those due after the change (the clock jumped before)
            if due[m] > START + 10_550 and first[m] - due[m] > max(new["tick_ms"], TICK) + 500}
    assert late == {}, late
    assert len(got) - len(first) <= report["may_deliver_twice"], (len(got) - len(first), report)


def _contents(data: Path) -> dict[Path, bytes]:
    """Every file of a data directory but the locks (which name the last pid to take them)."""
    return {p: p.read_bytes() for p in sorted(data.rglob("*")) if p.is_file() and not p.name.endswith("lock")}


def test_a_window_the_span_cannot_hold_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    data = tmp_path / "data"
    clock = SimulatedClock(START)
    with EmbeddedTimerwheel(data, clock=clock, **{**SETTINGS, "roll_window_ms": 100_000}) as e:
        _spread(e, 270)  # due up to 90 s ahead
        e.wait_idle()
    files = _contents(data)
    for check in ([], ["--check"]):  # --check: the same refusal, as the operator's Job asks it first
        done = tw("rebuild-wheel", "--shard", "0", "--data-dir", str(data), "--change-window", *check,
                  "--roll-window-ms", "20000")  # a 40 s span: the records 90 s ahead do not fit
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("timerwheel: error: TW_WHEEL_SPAN_MS:") and "nothing was changed" in done.stderr
        assert _contents(data) == files
    fits = tw("rebuild-wheel", "--shard", "0", "--data-dir", str(data), "--change-window", "--check",
              "--roll-window-ms", "60000", "--tick-ms", "1000")  # 120 s: they fit
    assert fits.returncode == 0, fits.stderr
    report = json.loads(fits.stdout)
    assert report["status"] == "fits" and report["records"] == 270 and report["latest_ms"] >= START + 89_000, report
    assert _contents(data) == files  # nothing changed
    alone = tw("rebuild-wheel", "--shard", "0", "--data-dir", str(data), "--check")
    assert alone.returncode == 2 and "--check: only with --change-window" in alone.stderr, alone.stderr
    bad = tw("rebuild-wheel", "--shard", "0", "--data-dir", str(data), "--change-window", "--tick-ms", "7")
    assert bad.returncode == 2 and "--tick-ms" in bad.stderr, bad.stderr


def test_change_window_of_a_shard_never_made_updates_the_deployment_file_only(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with EmbeddedTimerwheel(data, clock=SimulatedClock(START), **{**SETTINGS, "shards": 2}):
        pass
    done = tw("rebuild-wheel", "--shard", "5", "--data-dir", str(data), "--change-window",
              "--roll-window-ms", "120000")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["status"] == "no-shard"
    stored = json.loads((data / "timerwheel.json").read_text())
    assert stored["roll_window_ms"] == 120_000 and stored["shards"] == 2


# --- rebuilt files byte for byte against what the writer writes itself ----------------------------
#
# rebuild-wheel and --change-window read the TimerLog a segment (change_window) or a chunk
# (recovery) at a time. These tests put records on both sides of segment and chunk edges, a torn
# tail and a corrupt record at a segment's first position, and compare the files the tools leave
# with those the shard's own writer leaves when it is given the same records with those settings.

SEGMENT_RECORDS = 500


def _batches(n: int, span_ms: int, seed: int = 11) -> list[np.ndarray]:
    """``n`` records in batches of 1 to 700, due within ``span_ms`` of START; none is due in the
    second [START + 5 s, START + 6 s), which ``_odd_one`` (due in it) then has to itself."""
    rng = np.random.default_rng(seed)
    due = START + rng.integers(0, span_ms, n)
    due = np.where((due >= START + 5_000) & (due < START + 6_000), due + 1_000, due)
    out, k = [], 0
    while k < n:
        size = min(int(rng.integers(1, 700)), n - k)
        out.append(records_array(flags=np.where(rng.random(size) < 0.1, 4, 1), enqueue_ms=START,
                                 deliver_ms=due[k : k + size], src_partition=np.arange(size) % 3,
                                 src_offset=np.arange(k, k + size), src_size=100, topic_hash=7,
                                 id_hash=rng.integers(0, 2**63, size)))
        k += size
    return out


def _odd_one() -> np.ndarray:
    return records_array(flags=1, enqueue_ms=START, deliver_ms=[START + 5_500], src_partition=0,
                         src_offset=[10**9], src_size=100, topic_hash=7, id_hash=[42])


def _write_shard(data: Path, config: TimerConfig, batches: list[np.ndarray]) -> Path:
    """Shard 0 of ``data`` as its writer leaves it after appending ``batches`` with ``config``'s
    geometry, R and W at START; its directory."""
    directory = Path(shard_dir(data, 0))
    with Shard.open(directory, tick_ms=config.tick_ms, slots=config.wheel_slots,
                    segment_bytes=config.segment_bytes, fsync=False) as shard:
        for arr in batches:
            shard.append_array(arr.copy())
            shard.flush()
        end = shard.flush()
        shard.save_enqueue_checkpoint(EnqueueCheckpoint(flushed_pos=end, write_ms=START, next_offsets={}, epoch=1))
        shard.save_dequeue_checkpoint(DequeueCheckpoint(read_ms=START, epoch=1))
    return directory


def _files(directory: Path) -> dict[str, bytes]:
    """The TimerLog segments and the wheel, by name."""
    found = {p.name: p.read_bytes() for p in sorted((directory / "timerlog").glob("*.tlog"))}
    return {**found, "wheel": (directory / "wheel").read_bytes()}


def _tear_tail(directory: Path) -> None:
    last = sorted((directory / "timerlog").glob("*.tlog"))[-1]
    with open(last, "ab") as f:
        f.write(b"\x40\x00\x00\x00" + b"\x01" * 30)  # half a record: a write torn by a crash


def _flip(directory: Path, pos: int, segment_bytes: int) -> None:
    """Flip a bit of the id hash of the record at ``pos``: its CRC no longer matches."""
    path = directory / "timerlog" / f"{pos - pos % segment_bytes:020d}.tlog"
    with open(path, "r+b") as f:
        f.seek(pos % segment_bytes + 55)
        value = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([value ^ 0x10]))


@pytest.mark.parametrize("new", [{"tick_ms": 1_000}, {"tick_ms": 10, "roll_window_ms": 15_000},
                                 {"roll_window_ms": 120_000}],
                         ids=["coarser-tick", "finer-tick", "same-tick-bigger-span"])
def test_change_window_leaves_the_timerlog_and_wheel_the_writer_writes_with_the_new_settings(
        tmp_path: Path, new: dict[str, int]) -> None:
    old = TimerConfig(data_dir=str(tmp_path / "data"), tick_ms=TICK, roll_window_ms=60_000,
                      segment_bytes=SEGMENT_RECORDS * 64, fsync=False)
    wanted = dataclasses.replace(old, **new)
    batches = _batches(4_321, span_ms=25_000)
    # The odd record lands on the first position of the fourth segment: the corrupt one below.
    flat = np.concatenate(batches)
    at = 3 * SEGMENT_RECORDS
    batches = [flat[:at], _odd_one(), flat[at:]]
    directory = _write_shard(tmp_path / "data", old, batches)
    reference = _write_shard(tmp_path / "reference", dataclasses.replace(wanted, data_dir=str(tmp_path / "reference")),
                             batches)
    for d in (directory, reference):
        _flip(d, at * 64, old.segment_bytes)
    _tear_tail(directory)

    report = change_window(wanted, 0)

    assert report["status"] == "rebuilt" and report["records"] == len(flat)
    assert report["corrupt_records"] == 1 and report["truncated_bytes"] == 34
    assert report["segments_rewritten"] > 0 if new.get("tick_ms", TICK) != TICK else report["rechained"] == 0
    got, expected = _files(directory), _files(reference)
    assert sorted(got) == sorted(expected) and len(got) == 10
    for name in got:
        if name != "wheel":
            assert got[name] == expected[name], name
    # The writer linked the corrupt record (it was valid then); the rebuilt wheel does not.
    odd = 64 + 32 * ((START + 5_500) // wanted.tick_ms % wanted.wheel_slots)
    assert got["wheel"][odd : odd + 32] == bytes(32)
    assert struct.unpack_from("<qqqii", expected["wheel"], odd)[1:4] == (at * 64, at * 64, 1)
    assert got["wheel"][:odd] == expected["wheel"][:odd] and got["wheel"][odd + 32 :] == expected["wheel"][odd + 32 :]


def test_rebuild_wheel_writes_the_wheel_the_writer_wrote_across_chunks_and_segments(tmp_path: Path) -> None:
    """More records than recovery reads at a time (65,536), in segments of 100,000: chunk edges
    inside segments and at their ends; a torn tail."""
    config = TimerConfig(data_dir=str(tmp_path / "data"), tick_ms=TICK, roll_window_ms=60_000,
                         segment_bytes=100_000 * 64, fsync=False)
    directory = _write_shard(tmp_path / "data", config, _batches(150_000, span_ms=110_000))
    expected = _files(directory)
    _tear_tail(directory)

    report = rebuild_wheel(config, 0)

    assert report["records"] == report["relinked"] == 150_000 and report["truncated_bytes"] == 34
    got = _files(directory)
    assert sorted(got) == sorted(expected)
    for name in got:
        assert got[name] == expected[name], name
