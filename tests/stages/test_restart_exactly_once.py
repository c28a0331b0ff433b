"""The embedded runtime in exactly-once, SIGKILLed at random moments on a simulated clock and
started again (``test_restart``'s kill test, whose at-least-once window allows a copy more per
stop): every message, rolled ones too, is delivered once."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from scenario import by_id, step_through
from timerwheel import SimulatedClock
from timerwheel.runtime.embedded import EmbeddedTimerwheel

SETTINGS = dict(tick_ms=100, roll_window_ms=60_000, shards=2, fsync=False, max_in_flight=1_000, batch_size=100,
                delivery_guarantee="exactly-once")

CHILD = r"""
import json, os, sys, time, random
from timerwheel import SimulatedClock, Timer
from timerwheel.runtime.embedded import EmbeddedTimerwheel
data, seed, settings = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
state = json.load(open(data + ".clock")) if os.path.exists(data + ".clock") else {"now": 1_700_000_000_000}
clock = SimulatedClock(state["now"])
tw = EmbeddedTimerwheel(data, clock=clock, **settings)
rng = random.Random(seed)
now = clock.now_ms()
# Up to two roll windows ahead: some roll once or twice (a roll hop is released with progress too).
tickets = tw.schedule_many([Timer("t", b"v", deliver_at_ms=now + rng.randint(0, 120_000)) for _ in range(300)])
with open(data + f".scheduled.{seed}", "w") as f:
    json.dump([t.message_id for t in tickets], f)
print("scheduled", flush=True)
while True:
    now = clock.advance(rng.choice([100, 500, 2_000]))
    with open(data + ".clock.tmp", "w") as f:
        json.dump({"now": now}, f)
    os.replace(data + ".clock.tmp", data + ".clock")
    time.sleep(0.003)
"""


def test_sigkill_at_random_moments_in_exactly_once_delivers_each_message_once(tmp_path: Path) -> None:
    data = tmp_path / "data"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    rng = random.Random(7)
    scheduled: set[str] = set()
    for seed in range(8):
        proc = subprocess.Popen([sys.executable, str(script), str(data), str(seed), json.dumps(SETTINGS)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**os.environ, "TW_LOG_LEVEL": "WARNING"})
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        assert line.strip() == b"scheduled", f"child failed to start: {proc.stderr.read().decode()[-2000:]}"
        time.sleep(rng.uniform(0.05, 0.6))
        assert proc.poll() is None, f"child {seed} exited on its own ({proc.returncode}) before the kill"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
        scheduled |= set(json.loads(Path(f"{data}.scheduled.{seed}").read_text()))
    now = json.loads(Path(f"{data}.clock").read_text())["now"]
    clock = SimulatedClock(now)
    tw = EmbeddedTimerwheel(data, clock=clock, **SETTINGS)  # type: ignore[arg-type]
    try:
        step_through(tw, clock, [], now + 130_000 + 2 * 100)
        delivered = by_id(tw.read("t"))
        rolled = sum(1 for r in tw.read(tw.config.timer_topic) if r.header("tw-roll") is not None)
    finally:
        tw.close()
    assert set(delivered) == scheduled and len(scheduled) == 8 * 300, f"lost {len(scheduled - set(delivered))}"
    assert {m: len(c) for m, c in delivered.items() if len(c) > 1} == {}, "delivered twice"
    assert rolled > 0  # the roll hops were exercised
