"""What the console reads: the stages' ``/metrics``, the shards on the data volume, the commit log.

``Installation`` holds the three. The shards are opened as read-only views (``writer=False``, as
``timerwheel inspect`` opens them): nothing on the volume is ever written, and a volume mounted
read-only is enough. The stages' endpoints are ``host:port`` targets; a name that resolves to
several addresses (a Kubernetes headless Service: one address per pod) is scraped at each, so
every replica of a stage is seen without access to the Kubernetes API.
"""

from __future__ import annotations

import socket
import threading
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from timerwheel.clock import Clock, SystemClock
from timerwheel.config import TimerConfig
from timerwheel.console.browse import Columns
from timerwheel.errors import ConfigError, TimerwheelError
from timerwheel.log import stage_logger
from timerwheel.store import Shard
from timerwheel.transports.base import CommitLog

#: How long one scrape of one endpoint may take.
SCRAPE_TIMEOUT_S = 2.0
#: The stages' metric families carry this prefix (``timerwheel.exposition.PREFIX``).
PREFIX = "timerwheel_"


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return next((v for k, v in self.labels if k == key), None)


@dataclass(slots=True)
class Scrape:
    """One endpoint's ``/metrics`` at one moment; ``error`` when it could not be read."""

    target: str
    address: str
    samples: list[Sample] = field(default_factory=list)
    error: str | None = None


def parse_target(text: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); a bad target raises ConfigError naming it."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError("TW_CONSOLE_METRICS", f"expected host:port, got {text!r}")
    return host.strip("[]"), int(port)


def addresses(target: str) -> list[str]:
    """Every ``ip:port`` a target stands for (a headless Service: one per pod); none when the
    name does not resolve now."""
    host, port = parse_target(target)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return []
    found = sorted({f"{info[4][0]}:{port}" for info in infos if info[0] == socket.AF_INET}
                   or {f"[{info[4][0]}]:{port}" for info in infos})
    return found or [f"{host}:{port}"]


def parse_metrics(text: str) -> list[Sample]:
    """The samples of Prometheus' text format, read by prometheus_client's own parser."""
    out = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.append(Sample(s.name, tuple(sorted(s.labels.items())), float(s.value)))
    return out


def scrape_one(target: str, address: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> Scrape:
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as resp:  # noqa: S310 - http only
            return Scrape(target, address, parse_metrics(resp.read().decode("utf-8", "replace")))
    except (OSError, ValueError) as exc:
        return Scrape(target, address, error=f"{type(exc).__name__}: {str(exc)[:200]}")


class Installation:
    """The console's view of one timerwheel: shards read-only, the stages' metrics, the commit log.

    A shard view is used by one thread at a time: ``with inst.shards() as shards`` holds its lock
    (the request threads share the "pages" views; the sampler has its own)."""

    def __init__(self, config: TimerConfig, metrics_targets: Sequence[str], *, commit_log: CommitLog | None = None,
                 clock: Clock | None = None) -> None:
        for target in metrics_targets:
            parse_target(target)
        self.config = config
        self.targets = list(metrics_targets)
        self.clock = clock or SystemClock()
        self.lock = threading.RLock()
        self._views: dict[str, tuple[threading.Lock, dict[int, Shard]]] = {}
        self._columns: dict[str, dict[int, Columns]] = {}
        self._commit_log = commit_log
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="tw-console-scrape")
        self.log = stage_logger("console")

    # -- shards ------------------------------------------------------------------------------------

    @contextmanager
    def shards(self, view: str = "pages") -> Iterator[dict[int, Shard]]:
        """Read-only views of the shards found in the data directory (opened on first use, and
        again for a shard that appeared since), held under the view's lock. Each ``view`` has views
        of its own, so the sampler's wheel counts never hold up a page."""
        from timerwheel.store.layout import found_shards, open_found_shard

        with self.lock:
            lock, shards = self._views.setdefault(view, (threading.Lock(), {}))
        with lock:
            for s in found_shards(self.config.data_dir):
                if s not in shards:
                    try:
                        shards[s] = open_found_shard(self.config.data_dir, s)
                    except (OSError, TimerwheelError) as exc:  # not created yet, or being recovered
                        self.log.warning("shard not readable", shard=s, error=str(exc)[:200])
            yield shards

    def columns(self, view: str = "pages") -> dict[int, Columns]:
        """The view's in-memory TimerLog columns per shard (``browse.Columns``): use them inside
        ``with inst.shards(view)``, under its lock."""
        with self.lock:
            return self._columns.setdefault(view, {})

    # -- metrics -----------------------------------------------------------------------------------

    def scrape(self) -> list[Scrape]:
        """Every endpoint of every target, scraped in parallel."""
        resolved = list(self._pool.map(addresses, self.targets))  # each name at once: a slow resolver waits once
        pairs = [(t, a) for t, found in zip(self.targets, resolved, strict=True) for a in found]
        unresolved = [Scrape(t, t, error="the name does not resolve") for t, found in zip(self.targets, resolved,
                                                                                            strict=True) if not found]
        return list(self._pool.map(lambda pair: scrape_one(*pair), pairs)) + unresolved

    # -- the commit log ----------------------------------------------------------------------------

    @property
    def commit_log(self) -> CommitLog:
        """Kafka when ``TW_KAFKA_BOOTSTRAP`` is set, else the local log in the data directory."""
        with self.lock:
            if self._commit_log is None:
                if self.config.kafka_bootstrap:
                    from timerwheel.transports.kafka.log import KafkaCommitLog

                    self._commit_log = KafkaCommitLog.from_config(self.config)
                else:
                    from timerwheel.transports.local.log import LocalCommitLog

                    self._commit_log = LocalCommitLog(Path(self.config.data_dir) / "log", default_partitions=1,
                                                      fsync=self.config.fsync)
            return self._commit_log

    def now_ms(self) -> int:
        return self.clock.now_ms()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self.lock:
            for lock, shards in self._views.values():
                with lock:
                    for shard in shards.values():
                        shard.close()
            self._views.clear()
            if self._commit_log is not None:
                self._commit_log.close()
                self._commit_log = None
