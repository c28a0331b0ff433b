"""enqueue-put: put queue -> TimerLog + TimerWheel, then ``W`` and source offsets.

Owns shards. For each batch of entries of a shard:

1. skip requests whose source offset the shard already holds (re-reads after a restart or a
   rewind are free of duplicates: invariant 4);
2. choose each record's slot — the slot of its delivery time if that lies inside the roll
   window, a roll slot otherwise (design §5), the slot of ``W`` if already due (invariant 1);
3. append to the TimerLog, link into the wheel, flush (TimerLog, then wheel);
4. advance ``W`` (to now, never past the time up to which the shard's input is complete, see
   ``InputWatermark``, plus ``TW_CANCEL_LEAD_MS`` if set, and never more than ``w_cap_ms`` past
   ``R``, see below), save ``enqueue.ckpt`` atomically, and only then ack the queue.

Idle in production (``StageContext.wait_on_inputs``), a step blocks on the put queue, and an
unchanged W is published once a second only (IDLE_PUBLISH_S), but every PUBLISH_STEP_MS it moves
through a slot that holds records: dequeue-put releases a record once W passes its time, so one
due mid-slot waits ~10 ms for W, not the slot's end, while an empty wheel costs one checkpoint a
second. Any step publishes the same way (``_records_wait``), and while such records are due
within the look-ahead and W waits for its input, the timer topic's end is asked every
OBSERVE_SOON_S instead of twice a tick. The embedded runtime does the same on the system clock
(``StageContext.frugal``), waiting in ``idle_wait`` instead (a put by enqueue-get wakes it).

A crash anywhere leaves either the old checkpoint (the entries are redelivered or re-read
and the duplicates skipped by offset) or the new one (the entries were durable).

Rolling: a message due at least ``roll_window`` past ``W`` is written with the ROLL flag at
``W + window/2`` when what remains beyond the window is under a third of it, else at
``W + window``. Once inside the window a message, and a cancel marker for it, go to the slot
of the delivery time itself whatever path they took, so the two always meet there
(RocketMQ #7991 computed roll targets from the write time and missed).

W stays within ``w_cap_ms`` = ``c - tick`` of R, ``c = roll window / 3 - TW_LOOKAHEAD_MS - tick``
(``r_lead_ms``; design precision-and-exactly-once.md, 3.1-3.2), and so does every observation of the
input it counts (an observation grants at most the R known before its time + ``w_cap_ms``). Why:
a rolled record sits in roll slot ``f`` at least a third of the window before its delivery time
``d``, and until its hop is written back to the timer topic R stays at or before ``f``. So W stays
below ``f + c - tick <= d - 2 ticks`` until the hop is in Kafka, and any observation taken before
the hop's acknowledgement grants no more; one taken after it holds the hop below its ends. So the
hop, of a message or of its cancel, is written into the slot of ``d`` itself, never into a later
slot of W, however far dequeue-get lags: a rolled message and its cancel still meet. (Before,
only the wheel's room capped W, ``R + span - window - tick``: a dequeue-get more than a third of
the window behind let hops come back after their delivery time, and their cancels missed.) The
cap also keeps the wheel from lapping an unread slot, as that room did (``c`` is below it).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from timerwheel import telemetry
from timerwheel.config import TimerConfig
from timerwheel.errors import FencedError
from timerwheel.log import stage_logger
from timerwheel.stages.base import StageContext, decoded, get_by
from timerwheel.stages.codec import PUT_ROW_FIELDS, PutEntry, PutRequest, PutRow
from timerwheel.stages.owner import OwnedShard, ShardOwner
from timerwheel.stages.ownership import Ownership
from timerwheel.store import (
    CorruptCheckpointError,
    DequeueCheckpoint,
    EnqueueCheckpoint,
    Flag,
    Shard,
    shard_dir,
)
from timerwheel.store.format import RECORD_SIZE, RecordArray, records_array, records_from_array, valid_mask
from timerwheel.store.layout import recovery_command
from timerwheel.store.shard import recovery_needed
from timerwheel.transports.base import WorkQueue

STAGE = "enqueue-put"
_NORMAL, _ROLL, _DELETE = int(Flag.NORMAL), int(Flag.ROLL), int(Flag.DELETE)
RETAIN_EVERY_S = 30.0
#: A shard refused for want of ``timerwheel recover`` is looked at again this often.
RECOVERY_RETRY_S = 2.0
#: With ``ctx.frugal`` (production; embedded on the system clock), an idle shard's W is
#: published at most this often (R and the lag then move in steps of this size), but at once
#: when a slot that holds records becomes readable: a due message waits for its tick, never for this.
IDLE_PUBLISH_S = 1.0
#: The shortest idle wait (W held back by R: nothing to publish however often we look).
MIN_WAIT_S = 0.01
#: While a slot W moves through holds records, W is published each time it moved this far, not
#: only when its slot changes: dequeue-put releases a record due mid-slot once W passes it, so a
#: publication a tick only made such a record wait up to a tick (design precision-and-exactly-once.md
#: 3.3). 10 ms is what dequeue-put's poll of enqueue.ckpt adds anyway (``published.CKPT_POLL_S``);
#: each publication is a checkpoint save (and a TimerLog flush when records were appended).
PUBLISH_STEP_MS = 10
#: How often W asks where the timer topic ends while it waits for its input and a slot from W to
#: the look-ahead holds records (``InputWatermark``'s ``soon_s``); otherwise twice a tick.
#: A request costs ~1-2 ms of CPU in kafka-python (design 10): a few % of a core at this rate.
OBSERVE_SOON_S = 0.02
#: Observations of the timer topic's end a shard keeps while its input catches up with them.
MAX_UNREACHED_ENDS = 64
#: W waiting this long for the shard's input is logged (once until it moves again).
INPUT_WAIT_LOG_S = 10.0


def r_lead_ms(cfg: TimerConfig) -> int:
    """``c``: W stays below R + c - tick (module header), with the most a slot is read ahead
    (``lookahead_max_ms``: a burst is read earlier than ``TW_LOOKAHEAD_MS``) as the design's ``L``.
    That is at most roll window / 6 - 2 ticks, so c - tick is at least a sixth of the window and W
    always moves once R does.

    Not capped at 60 s as the design's ``c`` is (precision-and-exactly-once.md 3.1): that ceiling
    serves what is not built yet (retention down to ``W - c``, reschedule's checks of lattice
    points), and it would make W catch up after an outage in steps of 60 s, one round trip through
    dequeue-get each (1,440 for a day; a simulated clock jumping a year, half a million)."""
    return cfg.roll_window_ms // 3 - cfg.lookahead_max_ms - cfg.tick_ms


def wheel_headroom_ms(cfg: TimerConfig, shard: Shard) -> int:
    """How far W may run ahead of R before the wheel would lap a slot not read yet."""
    return shard.slots * shard.tick_ms - cfg.roll_window_ms - shard.tick_ms


def w_cap_ms(cfg: TimerConfig, shard: Shard) -> int:
    """``c - tick``: how far past R W may go (module header); dequeue-put's watch grants no more."""
    return min(wheel_headroom_ms(cfg, shard), r_lead_ms(cfg) - shard.tick_ms)


def roll_targets(deliver_ms: npt.NDArray[np.int64], write_ms: int, base_ms: int,
                 roll_window_ms: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """The roll rule, for a batch: the time whose slot each record is written to, and whether
    that is a roll hop. A record due at least a roll window after ``base_ms`` (``_roll_base``)
    rolls to ``base_ms + window/2`` when what remains beyond the window is under a third of it,
    else to ``base_ms + window``; any other goes to its delivery time's slot, never one before W
    (``write_ms``): an already due record goes to the slot of W."""
    rolled = deliver_ms - base_ms >= roll_window_ms
    beyond = deliver_ms - (base_ms + roll_window_ms)
    fire = np.where(rolled, np.where(beyond < roll_window_ms // 3, base_ms + roll_window_ms // 2,
                                     base_ms + roll_window_ms),
                    np.maximum(deliver_ms, write_ms))
    return fire, rolled


def timerlog_records(partition: npt.NDArray[np.uint64], rows: list[PutRow], write_ms: int, base_ms: int,
                     roll_window_ms: int) -> RecordArray:
    """TimerLog records for a batch of put rows (``partition``: each row's source partition),
    built column-wise, each written to the slot ``roll_targets`` gives."""
    # fromiter over the flattened rows: a third faster than np.array(rows), which inspects each row
    flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.uint64, count=len(rows) * PUT_ROW_FIELDS)
    offset, size, enqueued, deliver, cancel, thash, ihash = flat.reshape(len(rows), PUT_ROW_FIELDS).T
    fire, rolled = roll_targets(deliver.astype(np.int64), write_ms, base_ms, roll_window_ms)
    flags = np.where(cancel.astype(bool), _DELETE, _NORMAL) | np.where(rolled, _ROLL, 0)
    return records_array(flags=flags, enqueue_ms=enqueued.astype(np.int64), deliver_ms=fire,
                         src_partition=partition, src_offset=offset.astype(np.int64), src_size=size,
                         topic_hash=thash, id_hash=ihash)


def late_marker_copies(shard: Shard, records: RecordArray, rows: list[PutRow], write_ms: int) -> RecordArray | None:
    """Copies, into the slot of W, of the cancel markers a late message's own slot holds.

    A message written after its delivery time goes to the slot of W (``roll_targets``), not to its
    own, where the cancels acknowledged before that time are (W passed it only once they were in
    the TimerLog). Only the service writes a message late that a cancel acknowledged before its
    time must still meet: a reschedule's new revision, which dequeue-put writes back to the timer
    topic where the old one leaves (issue 31), after its new time when that is close and the
    pipeline lags, and whose ticket may be cancelled or rescheduled again. So each late message
    takes its slot's markers of its id hash along (DELETE records naming the same source records),
    and dequeue-getmsg confirms them on the full id and revision as any other. ``records``: the
    batch's TimerLog records (``timerlog_records`` of ``rows`` at ``write_ms``); cost: one read
    of each distinct late slot, only for a batch with late messages: 0.22-0.29 ms for 1-500 late
    records of a slot of 500 (3.5 us for a batch of 500 on time), measured on this machine."""
    maybe = np.flatnonzero((records["deliver_ms"] == write_ms) & ((records["magic"] & 0xFF) == _NORMAL))
    if not maybe.size:
        return None
    tick = shard.tick_ms
    deliver = np.array([rows[i][3] for i in maybe.tolist()], dtype=np.int64)  # PutRow.deliver_ms
    own = deliver - deliver % tick
    late = own < write_ms - write_ms % tick
    if not late.any():
        return None
    idx, own = maybe[late], own[late]
    found = []
    for slot in np.unique(own).tolist():
        hashes = records["id_hash"][idx[own == slot]]
        for _positions, arr in shard.read_slot(slot):
            m = ((arr["magic"] & (_DELETE | _ROLL)) == _DELETE) & np.isin(arr["id_hash"], hashes)
            if m.any():
                found.append(arr[m])
    if not found:
        return None
    marks = np.concatenate(found)
    return records_array(flags=np.full(len(marks), _DELETE), enqueue_ms=marks["enqueue_ms"],
                         deliver_ms=np.full(len(marks), write_ms), src_partition=marks["src_partition"],
                         src_offset=marks["src_offset"], src_size=marks["src_size"], topic_hash=marks["topic_hash"],
                         id_hash=marks["id_hash"])


@dataclass(frozen=True, slots=True)
class Observation:
    """Where the timer topic ended (``ends``: partition -> high watermark) when our clock read
    ``t0``, and the R each shard had then as far as enqueue-put knew (``read_ms``: shard -> R, read
    before ``t0``; a shard missing there was not owned yet)."""

    t0: int
    read_ms: dict[int, int]
    ends: dict[int, int]


class InputWatermark:
    """Up to when each shard's input is complete: W never passes it.

    W is the time up to which a shard's slots may be read. Were it only the clock, a timer record
    that reaches the shard late (enqueue-get stopped, rebalancing, or rewinding after Redis lost
    its entries) would find its slot read already: a late message is merely late (it goes to the
    slot of W), but a late *cancel* misses its target, which is delivered. So W also waits for
    the input: at ``t0`` (our clock, read before the request) the timer topic ended at ``ends``,
    so every record the topic acknowledged before ``t0`` has an offset below its partition's end;
    once the shard has written every one of its partitions up to that end, its input is complete
    up to ``t0``. A cancel acknowledged before its target's delivery time is then in the wheel
    before the target's slot is read, however late it arrives, and it lands in the target's own
    slot (W is still before the delivery time when it is written).

    The ends are the **high watermarks** (``CommitLog.high_watermarks``: read_uncommitted), not the
    last stable offsets a ``read_committed`` reader stops at: while another producer's transaction
    is open on a partition, a plain cancel acknowledged after the transaction began lies above
    the last stable offset, and W waited for that offset only, so it passed the cancel's target
    before enqueue-get could read the cancel. Now W waits until the transaction ends: late, never
    wrong. It does not wait for good once it ends: enqueue-get's ``read_committed`` consumer moves
    its position past the commit or abort marker, the partition's last offset, to the high
    watermark, also when no record follows the marker (checked against Kafka 4.1 with
    kafka-python 3.0.12, after a commit and after an abort: the position reported after a fetch
    that returned no record was the high watermark), and enqueue-get hands such a move on as an
    entry without rows.

    ``ends()`` (the timer topic's end offsets) is asked at most every ``interval_s`` of real time,
    and only while some shard's W waits for its input. With ``background`` (production) a thread
    asks, so the stage's loop never waits for Kafka (the request took 12 ms median and up to
    430 ms on a loaded machine, twice a tick): ``observe`` returns the newest answer at once and
    wakes the thread for the next one. In process (embedded, a simulated clock) the log answers
    at once and ``observe`` asks itself."""

    def __init__(self, ctx: StageContext, ends: Callable[[], dict[int, int]], interval_s: float,
                 background: bool = False, read_ms: Callable[[], dict[int, int]] = dict,
                 soon_s: float | None = None) -> None:
        """``read_ms()``: R of each shard as enqueue-put knows it, asked before each request's ``t0``.
        ``soon_s``: the interval when ``observe`` is asked ``soon`` (records wait for W), at most
        ``interval_s``."""
        self.ctx = ctx
        self.ends = ends
        self.read_ms = read_ms
        self.interval_s = interval_s
        self.soon_s = interval_s if soon_s is None else min(soon_s, interval_s)
        #: ``observe`` was asked ``soon`` since the last request (the background thread's next
        #: request then waits ``soon_s`` after the last, not ``interval_s``).
        self._soon = threading.Event()
        #: (time.monotonic() before the request, the observation)
        self._last: tuple[float, Observation] | None = None
        #: When the last request failed (time.monotonic()): the next waits ``interval_s``.
        self._failed_at = -1e18
        #: Requests failed in a row (one warning a streak, one line when they work again).
        self._failures = 0
        self._asked = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="tw-input-ends", daemon=True)
            self._thread.start()

    def observe(self, soon: bool = False) -> Observation | None:
        """A new observation, or the last one when it is recent enough (``interval_s`` of real
        time, ``soon_s`` if ``soon``, or taken at this very clock time); None if Kafka did not
        answer. In the background: the newest answer, None before the first."""
        if self._thread is not None:
            if soon:
                self._soon.set()
            self._asked.set()
            last = self._last
            return None if last is None else last[1]
        mono, now = time.monotonic(), self.ctx.clock.now_ms()
        last = self._last
        interval_s = self.soon_s if soon else self.interval_s
        if last is not None and (mono - last[0] < interval_s
                                 or last[1].t0 == now and last[1].read_ms == self.read_ms()):
            # An observation is only ever its own time with its own ends; one of this clock time is
            # asked again only once R moved (it caps what an observation grants).
            return last[1]
        if mono - self._failed_at < interval_s:
            return None
        self._request()
        last = self._last
        return None if last is None or last[0] < mono else last[1]

    def _request(self) -> None:
        """One request: R and the clock read before it, the ends after. A failure keeps the last
        observation as it was (never its ends with the failure's time: W would run on)."""
        read = self.read_ms()
        mono, now = time.monotonic(), self.ctx.clock.now_ms()
        try:
            ends = self.ends()
        except Exception as exc:  # noqa: BLE001 - W waits (deliveries pause); the stage carries on
            self.ctx.metrics.inc("input_end_failures")
            if not self._failures:
                stage_logger(STAGE).warning("timer topic end offsets unavailable, W waits", error=str(exc))
            self._failures += 1
            self._failed_at = mono
            return
        if self._failures:
            stage_logger(STAGE).info("timer topic end offsets available again", failed_requests=self._failures)
            self._failures = 0
        self._last = (mono, Observation(now, read, ends))

    def _run(self) -> None:
        """The background requests: one at most every ``interval_s`` (``soon_s`` once ``observe``
        was asked ``soon``), each once ``observe`` asked for it (an idle W that needs nothing
        costs no request)."""
        while not self._stop.is_set():
            if not self._asked.wait(0.5) or self._stop.is_set():
                continue
            self._asked.clear()
            self._soon.clear()
            started = time.monotonic()
            self._request()
            self._stop.wait(max(0.0, self.soon_s - (time.monotonic() - started)))
            # The rest of interval_s, cut short by an ask with ``soon``
            rest = self.interval_s - (time.monotonic() - started)
            if rest > 0 and not self._stop.is_set():
                self._soon.wait(rest)

    def close(self) -> None:
        self._stop.set()
        self._asked.set()
        self._soon.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


@dataclass
class PutShard(OwnedShard):
    #: W: the time up to which the shard's slots may be read once published.
    write_ms: int = 0
    #: The wheel's room past R (the shard's own wheel less a roll window and a tick): rolling
    #: relative to at most R + this, a write (at most a roll window later) never laps an unread slot.
    headroom_ms: int = 0
    #: W never passes R + this (``c - tick``, module header; below ``headroom_ms``).
    w_cap_ms: int = 0
    next_offsets: dict[int, int] = field(default_factory=dict)
    #: The slot of W as last published, and W itself.
    published_ms: int = -1
    published_w_ms: int = -1
    #: When W was last published, or found with nothing new to publish (time.monotonic()).
    published_at: float = 0.0
    #: R as last read from dequeue.ckpt (a lower bound of the real R).
    read_ms: int = -(2**62)
    #: The shard's input is complete up to here (``InputWatermark``).
    input_ms: int = 0
    #: W may go up to here by its input: the newest observation the input reached, its ``t0``
    #: (+ ``TW_CANCEL_LEAD_MS``) capped at the R known before it + ``w_cap_ms``. W never passes it.
    granted_ms: int = 0
    #: Observations (t0, what they grant, end offset per partition of this shard) the input has
    #: not reached yet, oldest first.
    unreached_ends: list[tuple[int, int, dict[int, int]]] = field(default_factory=list)
    #: When W began to wait for the input (time.monotonic()), 0 if it does not; whether that was logged.
    input_wait_since: float = 0.0
    input_wait_logged: bool = False


class EnqueuePut:
    def __init__(self, ctx: StageContext, shard_ids: Iterable[int], open_shard: Callable[[int], Shard],
                 put_queue: WorkQueue, ownership: Ownership,
                 input_ends: Callable[[], dict[int, int]] | None = None) -> None:
        """``open_shard(id)`` opens a shard as its writer, which runs recovery: it is only
        called once the lease is ours, so two writers never touch one TimerLog.

        ``input_ends()``: the timer topic's high watermarks (``CommitLog.high_watermarks``); W
        then waits for the input (``InputWatermark``). Without it W follows the clock and R alone
        (unit tests that feed the put queue by hand)."""
        self.ctx = ctx
        #: R of each shard as last read (``PutShard.read_ms``), for the observations' ``read_ms``:
        #: a copy the background thread can take while the loop updates it.
        self._read_known: dict[int, int] = {}
        # Production asks Kafka at most twice a tick while W waits, every OBSERVE_SOON_S while
        # records are due soon (``_records_soon``); in process the log answers at once, and a
        # simulated clock must see its input complete as soon as it moves.
        self.input = None if input_ends is None else InputWatermark(
            ctx, input_ends, ctx.config.tick_ms / 2000 if ctx.wait_on_inputs else 0.0,
            background=ctx.wait_on_inputs, read_ms=self._read_known.copy, soon_s=OBSERVE_SOON_S)
        self.queue = put_queue
        self.open_shard = open_shard
        self.logger = stage_logger(STAGE)
        self._retained = time.monotonic()
        #: Shards whose lease we hold while their previous owner still has them open (logged once).
        self._blocked: set[int] = set()
        #: When each shard waiting for ``timerwheel recover`` was last looked at.
        self._refused_at: dict[int, float] = {}
        #: The last step found no entry (the next one may wait on the queue).
        self._idle = False
        self.owner: ShardOwner[PutShard] = ShardOwner(ctx, STAGE, shard_ids, ownership, self._take, self._close,
                                                      "writing")
        self.owner.take_shards()

    @property
    def owned(self) -> dict[int, PutShard]:
        """The shards this replica owns now, by id."""
        return self.owner.owned

    @property
    def refused(self) -> dict[int, str]:
        """Shards left unstarted because their state needs ``timerwheel recover``: shard -> why."""
        return self.owner.refused

    def _take(self, shard_id: int) -> PutShard | None:
        """Acquire the shard's lease, then open it as its writer (recovering it), or None: not now."""
        if shard_id in self.refused and time.monotonic() - self._refused_at.get(shard_id, 0.0) < RECOVERY_RETRY_S:
            return None
        ownership, unopenable = self.owner.ownership, self.owner.unopenable
        # A lease kept from an earlier try (below) is still ours.
        epoch = ownership.epochs.get(shard_id) or ownership.acquire(shard_id)
        if epoch is None:
            return None
        why = recovery_needed(self._dir(shard_id))  # before opening: Shard.open would fail or recover
        if why is not None:
            self._refuse(shard_id, why)
            return None
        try:
            shard = self.open_shard(shard_id)
        except FencedError as exc:
            # e2e fix: the previous owner still holds the shard's writer lock (paused past its
            # lease, or still closing). Keep the lease, which fences it, and retry next step;
            # raising here killed the new owner while it held the lease.
            if shard_id not in self._blocked:
                self._blocked.add(shard_id)
                self.logger.warning("shard still locked by its previous owner, waiting", shard=shard_id,
                                    error=str(exc))
            return None
        except CorruptCheckpointError as exc:
            self._refuse(shard_id, f"{exc}; the shard is not started: run `{recovery_command(self._dir(shard_id))}`")
            return None
        except Exception as exc:  # noqa: BLE001 - one shard that cannot be opened must not stop the others
            # Keep the lease (nobody else writes a shard in this state) and retry next step;
            # the operator marks the TimerWheel Degraded naming the shard and the error.
            unopenable.report(shard_id, exc)
            return None
        unopenable.clear(shard_id)
        self._blocked.discard(shard_id)
        ckpt = shard.load_enqueue_checkpoint()
        if ckpt is not None and ckpt.epoch >= epoch:
            # The lease store forgot (Redis flushed): take an epoch above the checkpoint's.
            ownership.release_all_of(shard_id)
            epoch = ownership.acquire(shard_id, floor=ckpt.epoch)
            if epoch is None:
                shard.close()
                return None
        return self._start(shard_id, shard, epoch)

    @staticmethod
    def _close(st: PutShard) -> None:
        st.shard.close()

    def _dir(self, shard_id: int) -> str:
        return shard_dir(self.ctx.config.data_dir, shard_id)

    def _refuse(self, shard_id: int, why: str) -> None:
        """Leave a shard whose state needs ``timerwheel recover`` unstarted (its lease released, so the
        tool may run), saying why once; it is looked at again every RECOVERY_RETRY_S and starts once repaired."""
        self.owner.ownership.release_all_of(shard_id)
        self._refused_at[shard_id] = time.monotonic()
        self.owner.unopenable.refuse(shard_id, why)

    def _start(self, shard_id: int, shard: Shard, epoch: int) -> PutShard:
        log = stage_logger(STAGE, shard_id)
        ckpt = shard.load_enqueue_checkpoint()
        now = self.ctx.clock.now_ms()
        st = PutShard(shard_id, shard, log, epoch, headroom_ms=wheel_headroom_ms(self.ctx.config, shard),
                      w_cap_ms=w_cap_ms(self.ctx.config, shard))
        if ckpt is None:
            # A new shard starts at the clock; from here on W waits for its input.
            st.write_ms = now
            if shard.load_dequeue_checkpoint() is None:
                # Bootstrap R at the shard's first W, so dequeue-get starts where writes start.
                shard.save_dequeue_checkpoint(DequeueCheckpoint(read_ms=shard.slot_time(now), epoch=0))
        else:
            st.write_ms = ckpt.write_ms
            st.next_offsets = dict(ckpt.next_offsets)
        report = shard.recovery
        if report is not None:
            if ckpt is not None and report.end_pos < ckpt.flushed_pos:
                # e2e fix: records the checkpoint called durable are gone (a torn or lost tail).
                # Resume after the newest source offset still in the TimerLog (design §4.4), not
                # after the checkpoint's, so that Kafka hands the lost records over again.
                st.next_offsets = _offsets_after_loss(shard, st.next_offsets, ckpt.flushed_pos - report.end_pos)
                # Readers read up to that checkpoint: what is written from here on goes past it
                # (``Shard.skip_to``), never at a position they took as read.
                skipped = shard.skip_to(ckpt.flushed_pos)
                log.warning("TimerLog lost checkpointed records; resuming from the records it still holds",
                            flushed_pos=ckpt.flushed_pos, end_pos=report.end_pos, offsets=st.next_offsets,
                            skipped_bytes=skipped)
            for p, offset in report.max_src_offsets.items():
                st.next_offsets[p] = max(st.next_offsets.get(p, 0), offset + 1)
            log.info("recovered", epoch=epoch, checked_from=report.checked_from, end_pos=report.end_pos,
                     records=report.records_checked, truncated_bytes=report.truncated_bytes,
                     relinked=report.relinked, corrupt=len(report.corrupt), seconds=round(report.seconds, 3))
        # A checkpointed W had its input complete up to W less the lead it may have run ahead.
        st.input_ms = st.write_ms - self.ctx.config.cancel_lead_ms
        st.granted_ms = st.write_ms
        self._advance_w(st)
        self._publish(st)
        return st

    def shard_offsets(self, shard_id: int) -> dict[int, int]:
        st = self.owned.get(shard_id)
        return dict(st.next_offsets) if st else {}

    def step(self, timeout_s: float) -> int:
        """One pass over the owned shards; returns entries written plus W publications."""
        owner = self.owner
        owner.renew()
        for st in owner.balance():
            self._hand_over(st)
        self._blocked.intersection_update(owner.ownership.epochs)  # a lease let go: said again if blocked again
        if owner.waiting:
            owner.take_shards()
        self._retain()
        wait = self.ctx.wait_on_inputs and bool(self.owned)
        block, on_time = self._idle_wait_s(timeout_s) if wait and self._idle else (0.0, False)
        got: dict[int, list[tuple[str, bytes]]] = {}
        for st in self.owned.values():
            # Left pending by a previous owner, every later entry would look like a gap: taken
            # over first (offsets skip what the shard holds already).
            stale = st.take_over_pending(self.queue, self.ctx)
            if stale:
                got[st.shard_id] = stale
        take = get_by if on_time else _get_many
        for shard_id, fresh in take(self.ctx, self.queue, list(self.owned), self.ctx.config.queue_bound,
                                    0 if got else block).items():
            got[shard_id] = got.get(shard_id, []) + fresh
        self._idle = not got
        progress = 0
        for st in list(self.owned.values()):
            entries = got.get(st.shard_id)
            try:
                if entries:
                    self.write(st, entries)
                    progress += len(entries)
                elif self._idle_advance(st):
                    owner.ownership.check(st.shard_id)
                    self._publish(st)
                    progress += 1  # a new W is progress too: dequeue-get may now read more
            except FencedError as exc:
                owner.lose(st.shard_id, str(exc))
        if not progress and not wait:
            self.ctx.idle_wait(STAGE, self._idle_wait_s(timeout_s)[0] if self.ctx.frugal and self.owned else timeout_s)
        return progress

    def _idle_advance(self, st: PutShard) -> bool:
        """``_advance_w`` for a shard with no new entry. With ``ctx.frugal``, W stays where it
        was published for up to IDLE_PUBLISH_S, unless records wait for it (``_records_wait``)."""
        if not self.ctx.frugal or st.published_ms < 0:
            return self._advance_w(st)
        if time.monotonic() - st.published_at < IDLE_PUBLISH_S and not self._records_wait(st, self._target_w(st)):
            return False
        if self._advance_w(st):
            return True
        st.published_at = time.monotonic()  # nothing new (W held back by R): look again in IDLE_PUBLISH_S
        return False

    def _idle_wait_s(self, timeout_s: float) -> tuple[float, bool]:
        """How long an idle step may wait on the queue: until some shard's W is due to be
        published (IDLE_PUBLISH_S after the last, or the end of the next slot holding records);
        and whether the wait must end on time (a due slot's end: see ``get_by``)."""
        now_ms = self.ctx.clock.now_ms()
        mono = time.monotonic()
        wait, on_time = timeout_s, False
        for st in self.owned.values():
            tick = st.shard.tick_ms
            wait = min(wait, max(st.published_at + IDLE_PUBLISH_S - mono, (st.published_ms + tick - now_ms) / 1000))
        for st in self.owned.values():
            if st.unreached_ends:
                continue  # W waits for entries of this shard, and an entry ends the wait
            tick = st.shard.tick_ms
            due = st.shard.next_nonempty(st.published_ms, st.published_ms + max(0, int(wait * 1000)) + tick)
            # W is published PUBLISH_STEP_MS into the slot holding records, and every PUBLISH_STEP_MS on
            if due is not None and (at := max(due, st.published_w_ms) + PUBLISH_STEP_MS - now_ms) / 1000 <= wait:
                wait, on_time = at / 1000, True
        return max(MIN_WAIT_S, wait), on_time

    def write(self, st: PutShard, entries: list[tuple[str, bytes]]) -> None:
        t0 = telemetry.batch_start()
        gaps = 0
        offsets = dict(st.next_offsets)
        rows: list[PutRow] = []
        partitions: list[int] = []
        counts: list[int] = []
        for entry in decoded(self.ctx, self.queue, st.shard_id, entries, PutEntry.decode, st.logger):
            p = entry.src_partition
            have = offsets.get(p, 0)
            if entry.from_offset > have:
                # Entries before this one were lost in transit; enqueue-get rewinds to `have`.
                gaps += 1
                continue
            new = entry.rows if entry.from_offset == have else [r for r in entry.rows if r[0] >= have]
            if new:
                rows += new
                partitions.append(p)
                counts.append(len(new))
            offsets[p] = max(have, entry.next_offset)
        if gaps:
            self.ctx.metrics.inc("put_gaps", gaps, shard=st.shard_id)
            st.logger.warning("entries after a gap skipped", entries=gaps)
        self.owner.ownership.check(st.shard_id)
        records = timerlog_records(np.repeat(np.array(partitions, dtype=np.uint64), counts), rows, st.write_ms,
                                   self._roll_base(st), self.ctx.config.roll_window_ms) if rows else None
        if records is not None:
            copies = late_marker_copies(st.shard, records, rows, st.write_ms)
            if copies is not None:
                records = np.concatenate((copies, records))
                self.ctx.metrics.inc("late_marker_copies", len(copies), shard=st.shard_id)
            st.shard.append_array(records)
        st.next_offsets = offsets  # only once the records are in the TimerLog
        self._advance_w(st)
        self._publish(st)
        self.queue.ack(st.shard_id, [eid for eid, _ in entries])
        self.ctx.metrics.inc("timerlog_records", len(rows), shard=st.shard_id)
        if t0 is not None:
            written = records_from_array(records) if records is not None else []
            telemetry.enqueue_put_batch(t0, st.shard_id, _requests(entries), written, st.shard.slot_time)

    def _target_w(self, st: PutShard, observe: bool = True) -> int:
        """Now, never more than ``w_cap_ms`` past R (module header), and never past what the
        shard's input grants (``InputWatermark``, ``granted_ms``; ``observe``: ask where the timer
        topic ends if that would move W).

        R only grows, so the last R we read gives a safe cap; R is re-read only when that cap binds."""
        now = self.ctx.clock.now_ms()
        if now > st.read_ms + st.w_cap_ms:
            dq = st.shard.load_dequeue_checkpoint()
            st.read_ms = dq.read_ms if dq else st.write_ms
            self._read_known[st.shard_id] = st.read_ms
        target = min(now, st.read_ms + st.w_cap_ms)
        # Observed while W wants more than the input grants, or (with a lead) than it is known complete
        if self.input is not None and target > min(st.input_ms, st.granted_ms):
            if observe:
                self._input_complete(st, self._records_soon(st, now))
            target = min(target, st.granted_ms)
        return max(st.write_ms, target)

    def _roll_base(self, st: PutShard) -> int:
        """What rolling is relative to: W as the clock alone would set it (now, capped by R), not
        W held back for the input. A shard whose input lagged would otherwise roll messages due
        soon (due a roll window after a W far behind), and their hops, read only once W catches
        up, could come back after their delivery time, each into the slot of W then: a message
        and its cancel would no longer meet. Writes stay inside the wheel: up to this + roll
        window, which the cap keeps clear of unread slots."""
        return max(st.write_ms, min(self.ctx.clock.now_ms(), st.read_ms + st.headroom_ms))

    def _records_soon(self, st: PutShard, now: int) -> bool:
        """A slot from the published W's to the look-ahead's end holds records: they wait for W,
        or soon will (the scan stops a minute past W: a W that far behind moves a lot anyway)."""
        end = min(now, st.published_w_ms + 60_000) + self.ctx.config.effective_lookahead_ms + st.shard.tick_ms
        return st.shard.next_nonempty(st.published_ms, end) is not None

    def _input_complete(self, st: PutShard, soon: bool = False) -> None:
        """Move ``st.input_ms`` and ``st.granted_ms`` to the newest observation of the timer
        topic's end that the shard's written offsets have reached, observing again (``soon``:
        records wait, see ``InputWatermark.observe``) if none is awaited. An observation grants
        its ``t0`` (+ ``TW_CANCEL_LEAD_MS``), but never more than the R known before it +
        ``w_cap_ms``: one taken before a roll hop was acknowledged, and reached only after R moved
        past the hop's roll slot, must not carry W past the hop's delivery time while the hop is
        still in Kafka."""
        assert self.input is not None
        have = st.next_offsets
        unreached = st.unreached_ends
        if len(unreached) < MAX_UNREACHED_ENDS:
            seen = self.input.observe(soon)
            r0 = None if seen is None else seen.read_ms.get(st.shard_id)
            if seen is not None and r0 is not None and (not unreached or seen.t0 > unreached[-1][0]):
                shards = self.ctx.config.shards
                granted = min(seen.t0 + self.ctx.config.cancel_lead_ms, r0 + st.w_cap_ms)
                # An end that seems to move back (a broker just restarted) is not trusted: the
                # records below the higher end are waited for, as new ones soon pass it anyway.
                unreached.append((seen.t0, granted, {p: e for p, e in seen.ends.items() if p % shards == st.shard_id}))
        done = 0
        for t0, granted, ends in unreached:
            if any(have.get(p, 0) < e for p, e in ends.items()):
                break
            st.input_ms = max(st.input_ms, t0)
            st.granted_ms = max(st.granted_ms, granted)
            done += 1
        if done:
            del unreached[:done]
        self._report_input_wait(st)

    def _report_input_wait(self, st: PutShard) -> None:
        """``input_wait_ms`` per shard, and one log line when W has waited INPUT_WAIT_LOG_S for
        its input (enqueue-get stopped or far behind): deliveries of the shard pause meanwhile."""
        waiting = bool(st.unreached_ends)
        now = self.ctx.clock.now_ms()
        self.ctx.metrics.set("input_wait_ms", max(0, now - st.input_ms) if waiting else 0, shard=st.shard_id)
        if not waiting:
            if st.input_wait_logged:
                st.logger.info("W no longer waits for the timer topic", input_ms=st.input_ms)
            st.input_wait_since, st.input_wait_logged = 0.0, False
            return
        mono = time.monotonic()
        if not st.input_wait_since:
            st.input_wait_since = mono
        elif not st.input_wait_logged and mono - st.input_wait_since >= INPUT_WAIT_LOG_S:
            st.input_wait_logged = True
            behind = {str(p): [st.next_offsets.get(p, 0), e] for p, e in st.unreached_ends[0][2].items()
                      if st.next_offsets.get(p, 0) < e}
            st.logger.warning("W waits for the timer topic: records acknowledged before it are not written yet "
                              "(is enqueue-get running? is a producer's transaction open on a partition? W waits "
                              "until it ends)", waited_s=round(mono - st.input_wait_since, 1),
                              input_ms=st.input_ms, behind=behind)

    def _advance_w(self, st: PutShard) -> bool:
        """Move W to its target. True if it is worth publishing: its slot differs from the
        published one, or records wait for it (``_records_wait``)."""
        st.write_ms = self._target_w(st)
        return self._worth_publishing(st, st.write_ms)

    def _worth_publishing(self, st: PutShard, write_ms: int) -> bool:
        """W at ``write_ms`` is in another slot than the published W, or records wait for it."""
        return st.shard.slot_time(write_ms) != st.published_ms or self._records_wait(st, write_ms)

    def _moved(self, st: PutShard, write_ms: int) -> bool:
        """W at ``write_ms`` is in another slot than the published W, or PUBLISH_STEP_MS past it."""
        return st.shard.slot_time(write_ms) != st.published_ms or write_ms - st.published_w_ms >= PUBLISH_STEP_MS

    def _records_wait(self, st: PutShard, write_ms: int) -> bool:
        """W at ``write_ms`` lets records go that wait for it: it is in another slot than the
        published W, or PUBLISH_STEP_MS past it, and a slot between the two holds records (dequeue-put
        releases a record once W passes its time; dequeue-get reads a slot once W passes its end)."""
        return self._moved(st, write_ms) and st.shard.next_nonempty(st.published_ms, write_ms) is not None

    def _publish(self, st: PutShard) -> None:
        flushed = st.shard.flush()
        st.published_at = time.monotonic()
        st.shard.save_enqueue_checkpoint(EnqueueCheckpoint(
            flushed_pos=flushed, write_ms=st.write_ms, next_offsets=dict(st.next_offsets), epoch=st.epoch))
        slot = st.shard.slot_time(st.write_ms)
        if self._moved(st, st.write_ms):
            # Told in process (readers re-read enqueue.ckpt at once), at most every PUBLISH_STEP_MS in a slot
            pub = self.ctx.published_w
            pub[st.shard_id] = pub.get(st.shard_id, 0) + 1
            if slot != st.published_ms:
                self.ctx.wake("dequeue-get")  # a new slot may be readable
        st.published_ms, st.published_w_ms = slot, st.write_ms
        now = self.ctx.clock.now_ms()
        self.ctx.metrics.set("write_lag_ms", max(0, now - st.write_ms), shard=st.shard_id)
        self.ctx.metrics.set("timerlog_bytes", flushed - st.shard.log.start_pos, shard=st.shard_id)
        self.ctx.metrics.set("write_ms", st.write_ms, shard=st.shard_id)
        self.ctx.metrics.set("owner_epoch", st.epoch, shard=st.shard_id, stage=STAGE)

    def _hand_over(self, st: PutShard) -> None:
        """Publish a last checkpoint, then let the shard go (``ShardOwner.hand_over``: closed, then
        its lease released): its next owner takes it at once and finds everything written so far durable."""
        try:
            self.owner.ownership.check(st.shard_id)
            self._publish(st)
        except FencedError as exc:
            self.owner.lose(st.shard_id, str(exc))
            return
        self.owner.hand_over(st, write_ms=st.write_ms)

    def _retain(self) -> None:
        """Delete TimerLog segments whose records all fire before R (every 30 s)."""
        now = time.monotonic()
        if now - self._retained < RETAIN_EVERY_S:
            return
        self._retained = now
        for st in self.owned.values():
            dq = st.shard.load_dequeue_checkpoint()
            if dq is not None:
                deleted = st.shard.retain(dq.read_ms)
                if deleted:
                    st.logger.info("retention", segments_deleted=deleted, read_ms=dq.read_ms)

    def caught_up(self) -> bool:
        """Every owned shard has published W for the current slot (or its cap), and as far as
        records wait for it (``_records_wait``)."""
        return not any(self._worth_publishing(st, self._target_w(st, observe=False)) for st in self.owned.values())

    def close(self) -> None:
        for st in self.owned.values():
            try:
                self._publish(st)
            except Exception:  # noqa: BLE001 - best effort on shutdown; recovery covers the rest
                st.logger.error("final checkpoint failed", exc=True)
            st.shard.close()
        self.owner.leave()
        if self.input is not None:
            self.input.close()


def _get_many(ctx: StageContext, queue: WorkQueue, partitions: list[int], max_entries: int,
              wait_s: float) -> dict[int, list[tuple[str, bytes]]]:
    """``get_by`` for a wait that may end late (Redis's timeout granularity)."""
    return queue.get_many(partitions, ctx.consumer, max_entries, wait_s)


def _requests(entries: list[tuple[str, bytes]]) -> Iterator[tuple[int, PutRequest]]:
    """(source partition, request) of each entry, decoded again: only when tracing is on."""
    for _eid, payload in entries:
        entry = PutEntry.decode(payload)
        for req in entry.requests:
            yield entry.src_partition, req


def _offsets_after_loss(shard: Shard, offsets: dict[int, int], lost_bytes: int) -> dict[int, int]:
    """Next source offset per partition after the newest record of it still in the TimerLog.

    A shard writes each partition's records in offset order, so any lost record of a partition
    lies past its newest surviving one. A partition with no record left is rewound by the number
    of records lost (its records may all have been among them)."""
    newest: dict[int, int] = {}
    for _first, arr in shard.log.iter_chunks(shard.log.start_pos, shard.log.end_pos):
        good = arr[valid_mask(arr)]
        if len(good):
            parts, offs = good["src_partition"].astype(np.int64), good["src_offset"].astype(np.int64)
            for p in np.unique(parts).tolist():
                newest[p] = max(newest.get(p, -1), int(offs[parts == p].max()))
    lost = -(-lost_bytes // RECORD_SIZE)
    out = {p: max(0, o - lost) for p, o in offsets.items()}
    out.update({p: o + 1 for p, o in newest.items()})
    return out
