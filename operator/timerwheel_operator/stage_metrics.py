"""Read the stages' own ``/metrics`` (Prometheus text, ``timerwheel.exposition.render``)
into per-shard status.

The shard-owning stages export, per shard: enqueue-put ``timerwheel_write_ms`` (W),
``timerwheel_write_lag_ms``, ``timerwheel_timerlog_bytes``, ``timerwheel_owner_epoch{stage=
"enqueue-put"}``; dequeue-get ``timerwheel_read_ms`` (R), ``timerwheel_read_lag_ms``,
``timerwheel_in_flight``, ``timerwheel_owner_epoch{stage="dequeue-get"}``; either may export
``timerwheel_pending`` (sampled every 15 s); either ``timerwheel_shard_open_failed`` (1 while it
cannot open the shard). A pod that lost a shard may still show its last figures, so for each
shard the pod with the highest epoch is its owner.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

Labels = tuple[tuple[str, str], ...]

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?P<labels>.*)\})?\s+(?P<value>\S+)(\s+\S+)?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)')


class MetricsParseError(ValueError):
    """A line of the exposition text that is not a sample, a comment or blank."""


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: Labels
    value: float

    def label(self, key: str) -> str | None:
        return next((v for k, v in self.labels if k == key), None)


def _unescape(value: str) -> str:
    return value.replace(r"\\", "\x00").replace(r"\"", '"').replace(r"\n", "\n").replace("\x00", "\\")


def parse_prometheus(text: str) -> list[Sample]:
    """Samples of Prometheus' text format (version 0.0.4). Comments and blank lines are skipped;
    anything else that is not a sample raises ``MetricsParseError`` naming the line."""
    samples = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            raise MetricsParseError(f"line {number}: not a sample: {line[:80]!r}")
        labels: list[tuple[str, str]] = []
        body = match.group("labels") or ""
        pos = 0
        while pos < len(body.rstrip()):
            lm = _LABEL.match(body, pos)
            if not lm:
                raise MetricsParseError(f"line {number}: bad labels: {body[:80]!r}")
            labels.append((lm.group(1), _unescape(lm.group(2))))
            pos = lm.end()
        try:
            value = float(match.group("value"))
        except ValueError:
            raise MetricsParseError(f"line {number}: bad value {match.group('value')!r}") from None
        samples.append(Sample(match.group("name"), tuple(sorted(labels)), value))
    return samples


@dataclass(slots=True)
class ShardStatus:
    shard: int
    owner: str | None = None
    reader: str | None = None
    epoch: int | None = None
    read_epoch: int | None = None
    write_ms: int | None = None
    read_ms: int | None = None
    write_lag_ms: int | None = None
    lag_ms: int | None = None
    in_flight: int | None = None
    pending: int | None = None
    timerlog_bytes: int | None = None
    #: How long W has waited for timer records not yet written (enqueue-get down or behind, Kafka away).
    input_wait_ms: int | None = None
    #: "stage pod: ErrorClass" of each pod that reports it cannot open the shard.
    open_errors: list[str] = field(default_factory=list)

    def to_status(self) -> dict[str, int | str]:
        """The CRD's ``status.shards[]`` item (absent figures left out)."""
        pairs: dict[str, int | str | None] = {
            "shard": self.shard, "owner": self.owner, "reader": self.reader, "epoch": self.epoch,
            "W": self.write_ms, "R": self.read_ms, "writeLagMs": self.write_lag_ms, "lagMs": self.lag_ms,
            "inFlight": self.in_flight, "pending": self.pending, "timerLogBytes": self.timerlog_bytes,
            "inputWaitMs": self.input_wait_ms,
            "openError": "; ".join(self.open_errors) or None,
        }
        return {k: v for k, v in pairs.items() if v is not None}


@dataclass(slots=True)
class _Pick:
    """The figures of one (shard, stage) from the pod with the highest epoch."""

    epoch: int = -1
    pod: str | None = None
    values: dict[str, float] = field(default_factory=dict)


_WRITER = {"timerwheel_write_ms", "timerwheel_write_lag_ms", "timerwheel_timerlog_bytes", "timerwheel_input_wait_ms"}
_READER = {"timerwheel_read_ms", "timerwheel_read_lag_ms", "timerwheel_in_flight"}


def _int(value: float | None) -> int | None:
    if value is None or math.isnan(value) or math.isinf(value):
        return None
    return int(value)


def shard_status(scrapes: Mapping[str, Iterable[Sample]], shards: int) -> list[ShardStatus]:
    """Per-shard status from the samples of each pod (``pod name -> samples``), one entry per
    shard 0..shards-1 (a shard nobody reports has only its number)."""
    picks: dict[tuple[int, str], _Pick] = {}
    pending: dict[int, float] = {}
    unopenable: dict[int, list[str]] = {}
    for pod, samples in sorted(scrapes.items()):
        by_shard: dict[int, dict[str, float]] = {}
        epochs: dict[tuple[int, str], int] = {}
        for s in samples:
            shard_label = s.label("shard")
            if shard_label is None or not shard_label.isdigit():
                continue
            shard = int(shard_label)
            if s.name == "timerwheel_owner_epoch":
                epochs[(shard, s.label("stage") or "")] = int(s.value)
            elif s.name == "timerwheel_shard_open_failed" and s.value >= 1:
                unopenable.setdefault(shard, []).append(f"{s.label('stage')} {pod}: {s.label('error')}")
            elif s.name == "timerwheel_pending":
                pending[shard] = max(pending.get(shard, 0.0), s.value)
            elif s.name in _WRITER or s.name in _READER:
                by_shard.setdefault(shard, {})[s.name] = s.value
        for (shard, stage), epoch in epochs.items():
            wanted = _WRITER if stage == "enqueue-put" else _READER
            pick = picks.setdefault((shard, stage), _Pick())
            if epoch > pick.epoch:
                values = {k: v for k, v in by_shard.get(shard, {}).items() if k in wanted}
                picks[(shard, stage)] = _Pick(epoch, pod, values)
    out = []
    for shard in range(shards):
        st = ShardStatus(shard)
        w = picks.get((shard, "enqueue-put"))
        if w is not None:
            st.owner, st.epoch = w.pod, w.epoch
            st.write_ms = _int(w.values.get("timerwheel_write_ms"))
            st.write_lag_ms = _int(w.values.get("timerwheel_write_lag_ms"))
            st.timerlog_bytes = _int(w.values.get("timerwheel_timerlog_bytes"))
            st.input_wait_ms = _int(w.values.get("timerwheel_input_wait_ms"))
        r = picks.get((shard, "dequeue-get"))
        if r is not None:
            st.reader, st.read_epoch = r.pod, r.epoch
            st.read_ms = _int(r.values.get("timerwheel_read_ms"))
            st.lag_ms = _int(r.values.get("timerwheel_read_lag_ms"))
            st.in_flight = _int(r.values.get("timerwheel_in_flight"))
        st.pending = _int(pending.get(shard))
        st.open_errors = unopenable.get(shard, [])
        out.append(st)
    return out
