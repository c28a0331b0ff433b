"""End-to-end harness: the five stages as separate processes on real Kafka and Redis.

    pipe = Pipeline(tmp_path, kafka_bootstrap, redis_url, shards=2)   # TW_* settings as keywords
    # Secured servers: tw_env holds TW_KAFKA_SECURITY_PROTOCOL, TW_REDIS_PASSWORD_FILE, ...; the
    # stages get them, and the harness's own producer, collector, admin and Redis use them too.
    pipe = Pipeline(tmp_path, sasl_bootstrap, rediss_url, tw_env=security_settings)
    dest = pipe.new_dest("a", 2)                                         # named for this test, created
    with pipe.running(), TimerProducer(pipe) as producer, Collector(pipe, [dest]) as collector:
        # five `timerwheel stage NAME` processes, ready on /readyz; the producer writes with plain
        # kafka-python and the wire-contract headers. All stopped or closed when the block ends.
        m = producer.schedule(dest, now_ms() + 5_000); producer.cancel(m)
        pipe.kill("dequeue-put"); pipe.start("dequeue-put")      # SIGKILL, then a new process
        collector.wait_for(producer.expected(), timeout_s=60, pipe=pipe)
        rep = make_report("name", producer, collector)  # prints scheduled, delivered, lost, duplicated, late
        pipe.stop_cleanly()              # SIGTERM each, wait; asserts that every one exited 0

    # Or under a steady load: LoadRun starts run.producer, run.collector and run.load (SteadyLoad).
    with pipe.running(), LoadRun(pipe, dest, seed=1, rate=60, min_delay_ms=500,
                                 max_delay_ms=20_000) as run:
        ...
        missing, rep = run.drain("name", timeout_s=60)  # stop the load, wait for the rest, report

Everything a test creates is its own: topic names carry a random suffix, the data directory is
the test's tmp_path, Redis is one database of the server flushed at the start. Each stage
process writes its JSON log lines to ``tmp_path/logs/<name>.log`` (appended across restarts,
with a marker line per start); ``pipe.tails()`` gives the end of every log for assertion
messages.
"""

from __future__ import annotations

import heapq
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import redis
from infra import free_port
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from timerwheel.config import TimerConfig
from timerwheel.security import kafka_client_options, redis_client
from timerwheel.store import layout
from timerwheel.store.checkpoint import published_file
from timerwheel.store.format import RECORD_DTYPE, RECORD_SIZE, valid_mask
from two_mounts import TwoMounts

STAGES = ("enqueue-get", "enqueue-put", "dequeue-get", "dequeue-getmsg", "dequeue-put")
#: ``Pipeline.start(ALL_IN_ONE)`` runs ``timerwheel run --kafka --redis``: all five in one process.
ALL_IN_ONE = "all-in-one"
#: Stages whose crash may re-deliver the in-flight window (dequeue side).
DEQUEUE_SIDE = ("dequeue-get", "dequeue-getmsg", "dequeue-put")
ROOT = Path(__file__).resolve().parents[1]

_redis_dbs = itertools.count(1)
#: The settings the harness's own Kafka and Redis clients take from the stages' environment.
_SECURITY_VARS = ("TW_KAFKA_SECURITY_", "TW_KAFKA_SASL_", "TW_KAFKA_SSL_", "TW_REDIS_URL", "TW_REDIS_PASSWORD",
                  "TW_REDIS_SSL_")


def now_ms() -> int:
    return int(time.time() * 1000)


def with_db(url: str, db: int) -> str:
    """``redis://host:port/0`` -> ``redis://host:port/<db>``."""
    base = url.split("?", 1)[0].rstrip("/")
    head, _, last = base.rpartition("/")
    if last.isdigit() and head.count("/") >= 2:
        base = head
    return f"{base}/{db}"


def http_get(port: int, path: str, timeout_s: float = 2.0) -> tuple[int, str]:
    """(status, body) of GET http://127.0.0.1:port/path; raises OSError when nothing listens."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def is_ready(port: int) -> bool:
    try:
        return http_get(port, "/readyz", 1.0)[0] == 200
    except OSError:
        return False


def owned_shards(port: int) -> int:
    """The shards a shard-owning stage owns now (its ``owned_shards`` gauge; 0 if unreadable)."""
    try:
        code, body = http_get(port, "/metrics", 1.0)
    except OSError:
        return 0
    if code != 200:
        return 0
    for line in body.splitlines():
        if line.startswith("timerwheel_owned_shards{"):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return f"(no log at {path})"
    return "\n".join(text[-lines:])


@dataclass
class StageProcess:
    """One stage process (a name such as ``enqueue-put`` or ``enqueue-put#2`` for a second replica)."""

    name: str
    stage: str
    port: int
    log_path: Path
    env: dict[str, str]
    popen: subprocess.Popen[bytes] | None = None
    starts: int = 0
    #: Stopped on purpose (``Pipeline.stop``), not dead.
    stopped: bool = False
    _log: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"{self.name} was never started"
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


class Pipeline:
    """The five stage processes of one test, sharing a data directory, topics and a Redis DB."""

    def __init__(self, workdir: Path, kafka: str, redis_url: str, *, mounts: TwoMounts | None = None,
                 tw_env: dict[str, str] | None = None, replication: int = 1, **settings: object) -> None:
        """``mounts``: the two-node layout — the data directory is ``mounts.base``, the enqueue
        stages use it through ``mounts.a`` and the dequeue stages through ``mounts.b`` (two
        ``bindfs -o auto_cache`` mounts: two page caches, as on two nodes of an NFS volume).
        ``tw_env``: security settings (``TW_KAFKA_SASL_*``, ...) of the stages and of the
        harness's own clients. ``replication``: of the topics the harness creates (3 on
        ``kafka_cluster3``)."""
        uid = uuid.uuid4().hex[:8]
        self.uid = uid
        self.kafka = kafka
        self.replication = replication
        self.workdir = workdir
        self.mounts = mounts
        self.data_dir = mounts.base if mounts is not None else workdir / "data"
        self.log_dir = workdir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis_url = with_db(redis_url, next(_redis_dbs) % 15 + 1)
        self.timer_topic = f"e2e-timer-{uid}"
        self.dlq_topic = f"e2e-dlq-{uid}"
        defaults: dict[str, object] = {
            "shards": 2,
            "tick_ms": 100,
            "timer_partitions": 4,
            "roll_window_ms": 20_000,
            "wheel_span_ms": 80_000,  # headroom for W while R waits on a reclaimed entry
            "max_delay_ms": 600_000,
            "allow_topics": f"e2e-dest-{uid}-.*",
            "lease_ttl_ms": 3_000,
            "batch_size": 100,
            "max_in_flight": 200,
            "queue_bound": 64,
            "fsync": "true",
        }
        defaults.update(settings)
        self.settings = defaults
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TW_")}
        self.env.update({
            "PYTHONUNBUFFERED": "1",
            "TW_LOG_LEVEL": "INFO",
            "TW_KAFKA_BOOTSTRAP": kafka,
            "TW_REDIS_URL": self.redis_url,
            "TW_DATA_DIR": str(self.data_dir),
            "TW_TIMER_TOPIC": self.timer_topic,
            "TW_DLQ_TOPIC": self.dlq_topic,
        })
        for key, value in defaults.items():
            self.env[f"TW_{key.upper()}"] = str(value)
        self.env.update(tw_env or {})
        # The harness's own clients connect as the stages do (TLS, SASL, Redis password).
        client_cfg = TimerConfig.from_env({k: v for k, v in self.env.items() if k.startswith(_SECURITY_VARS)})
        #: kafka-python options of every Kafka client the harness makes.
        self.kafka_options = kafka_client_options(client_cfg)
        self.procs: dict[str, StageProcess] = {}
        self.redis: redis.Redis = redis_client(client_cfg, self.redis_url)
        self.redis.flushdb()
        self._admin: KafkaAdminClient | None = None

    # -- topics --------------------------------------------------------------------------------

    def dest(self, name: str) -> str:
        """A destination topic name of this test (matches the allow-list)."""
        return f"e2e-dest-{self.uid}-{name}"

    def new_dest(self, name: str, partitions: int) -> str:
        """``dest(name)``, created with ``partitions`` partitions."""
        topic = self.dest(name)
        self.create_topic(topic, partitions)
        return topic

    @property
    def admin(self) -> KafkaAdminClient:
        if self._admin is None:
            self._admin = KafkaAdminClient(bootstrap_servers=self.kafka, client_id=f"e2e-admin-{self.uid}",
                                           **self.kafka_options)
        return self._admin

    def create_topic(self, topic: str, partitions: int, configs: dict[str, str] | None = None) -> None:
        self.admin.create_topics([NewTopic(topic, partitions, self.replication, topic_configs=configs or {})])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            found = self.admin.describe_topics([topic])
            if found and found[0]["error_code"] == 0 and len(found[0]["partitions"]) == partitions:
                return
            time.sleep(0.1)
        raise AssertionError(f"topic {topic} not visible 30 s after it was created")

    def create_timer_topic(self, configs: dict[str, str] | None = None) -> None:
        self.create_topic(self.timer_topic, int(str(self.settings["timer_partitions"])), configs)

    # -- processes -----------------------------------------------------------------------------

    def add(self, stage: str, name: str | None = None, **env: object) -> StageProcess:
        name = name or stage
        assert name not in self.procs, f"{name} already added"
        penv = dict(self.env)
        penv["TW_HTTP_PORT"] = str(free_port())
        if self.mounts is not None:
            penv["TW_DATA_DIR"] = str(self.mounts.b if stage in DEQUEUE_SIDE else self.mounts.a)
        penv.update({k: str(v) for k, v in env.items()})
        proc = StageProcess(name, stage, int(penv["TW_HTTP_PORT"]), self.log_dir / f"{name}.log", penv)
        self.procs[name] = proc
        return proc

    def start(self, name: str, wait_ready: bool = True, timeout_s: float = 60.0) -> StageProcess:
        proc = self.procs.get(name) or self.add(name.split("#", 1)[0], name)
        assert not proc.alive(), f"{name} is already running (pid {proc.pid})"
        proc.starts += 1
        proc.stopped = False
        if proc._log is not None:
            proc._log.close()
        proc._log = open(proc.log_path, "ab")  # noqa: SIM115 - stays open while the process runs
        proc._log.write(f"=== e2e: start #{proc.starts} of {name} at {time.strftime('%H:%M:%S')} ===\n".encode())
        proc._log.flush()
        # "all-in-one": the five stages in one process on the same transports (`timerwheel run`).
        argv = ["run", "--kafka", self.kafka, "--redis", self.redis_url] if proc.stage == ALL_IN_ONE \
            else ["stage", proc.stage]
        proc.popen = subprocess.Popen(
            [sys.executable, "-m", "timerwheel.cli", *argv],
            cwd=self.workdir, env=proc.env, stdin=subprocess.DEVNULL, stdout=proc._log, stderr=subprocess.STDOUT,
        )
        if wait_ready:
            self.wait_ready(name, timeout_s)
        return proc

    def start_all(self, timeout_s: float = 90.0) -> None:
        """enqueue-put first (it creates the shards the others wait for), then the rest."""
        order = ("enqueue-put", "enqueue-get", "dequeue-get", "dequeue-getmsg", "dequeue-put")
        for name in order:
            self.start(name, wait_ready=False)
        for name in order:
            self.wait_ready(name, timeout_s)

    @contextmanager
    def running(self, timeout_s: float = 90.0) -> Iterator[Pipeline]:
        """``start_all()``, and ``stop_all()`` on the way out whatever happened (a failed start too)."""
        try:
            self.start_all(timeout_s)
            yield self
        finally:
            self.stop_all()

    def start_all_missing(self, timeout_s: float = 90.0) -> None:
        """Start every stage not running yet, then wait until all are ready."""
        for name in ("enqueue-put", "enqueue-get", "dequeue-get", "dequeue-getmsg", "dequeue-put"):
            if name not in self.procs or not self.procs[name].alive():
                self.start(name, wait_ready=False)
        for name in STAGES:
            self.wait_ready(name, timeout_s)

    def http(self, name: str, path: str, timeout_s: float = 2.0) -> tuple[int, str]:
        return http_get(self.procs[name].port, path, timeout_s)

    def ready(self, name: str) -> bool:
        return is_ready(self.procs[name].port)

    def owns(self, name: str) -> int:
        """Shards the shard-owning stage ``name`` owns now (readiness does not say: see /readyz)."""
        return owned_shards(self.procs[name].port)

    def wait_ready(self, name: str, timeout_s: float = 60.0) -> None:
        """Until ``name`` is ready and, the first replica of a shard-owning stage, owns a shard."""
        proc = self.procs[name]
        owning = proc.stage in ("enqueue-put", "dequeue-get") and "#" not in name
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not proc.alive():
                raise AssertionError(f"{name} exited with {proc.popen.returncode if proc.popen else None} "
                                     f"before it was ready:\n{tail(proc.log_path)}")
            if self.ready(name) and (not owning or self.owns(name) > 0):
                return
            time.sleep(0.1)
        raise AssertionError(f"{name} not ready within {timeout_s} s:\n{tail(proc.log_path)}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        assert proc.popen is not None
        proc.popen.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            proc.popen.wait(30)

    def restart(self, name: str, wait_ready: bool = True, timeout_s: float = 60.0) -> StageProcess:
        if self.procs[name].alive():
            self.kill(name, signal.SIGKILL)
        return self.start(name, wait_ready, timeout_s)

    def stop(self, name: str, timeout_s: float = 20.0, terminated: bool = False) -> int | None:
        """SIGTERM, wait; SIGKILL after the timeout. Returns the exit code (None if it had to be killed)."""
        proc = self.procs[name]
        if proc.popen is None or proc.popen.poll() is not None:
            return proc.popen.returncode if proc.popen else None
        proc.stopped = True
        if not terminated:  # one SIGTERM only: a second one during interpreter shutdown kills it
            proc.popen.send_signal(signal.SIGCONT)
            proc.popen.send_signal(signal.SIGTERM)
        try:
            return proc.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait(10)
            return None

    def stop_all(self) -> dict[str, int | None]:
        for proc in self.procs.values():
            if proc.alive():
                assert proc.popen is not None
                proc.popen.send_signal(signal.SIGCONT)
                proc.popen.send_signal(signal.SIGTERM)
        codes = {name: self.stop(name, terminated=True) for name in self.procs}
        for proc in self.procs.values():
            if proc._log is not None:
                proc._log.close()
                proc._log = None
        if self._admin is not None:
            self._admin.close()
            self._admin = None
        self.redis.close()
        return codes

    def stop_cleanly(self) -> None:
        """``stop_all()``, then assert that every stage exited 0 on SIGTERM, naming those that did
        not (None: still running 20 s after SIGTERM, killed), with the end of every log."""
        codes = self.stop_all()
        unclean = {name: code for name, code in codes.items() if code != 0}
        assert not unclean, (f"not stopped cleanly by SIGTERM: {unclean} (exit codes of all: {codes})\n"
                             f"{self.tails()}")

    def dead(self) -> list[str]:
        """Processes that were started and have exited on their own (not by ``stop``)."""
        return [n for n, p in self.procs.items() if p.popen is not None and p.popen.poll() is not None
                and not p.stopped]

    def tails(self, names: Iterable[str] | None = None, lines: int = 25) -> str:
        out = []
        for name in names or self.procs:
            out.append(f"--- {name} ({self.procs[name].log_path}) ---\n{tail(self.procs[name].log_path, lines)}")
        return "\n".join(out)

    def log_lines(self, name: str) -> list[dict[str, Any]]:
        out = []
        for line in self.procs[name].log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out

    def vm_hwm_kb(self, name: str) -> int:
        """Peak RSS (VmHWM) of a running stage process."""
        with open(f"/proc/{self.procs[name].pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
        return 0

    def rss_kb(self, name: str) -> int:
        """Current RSS (VmRSS) of a running stage process; 0 once it is gone."""
        try:
            with open(f"/proc/{self.procs[name].pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1])
        except OSError:
            pass
        return 0

    def shard_dir(self, shard: int) -> Path:
        return Path(layout.shard_dir(self.data_dir, shard))

    def checkpoint(self, shard: int, kind: str = "enqueue") -> dict[str, Any]:
        """The published checkpoint (the newest epoch's file) as its JSON object."""
        for _attempt in range(5):
            path = published_file(str(self.shard_dir(shard) / f"{kind}.ckpt"))
            assert path is not None, f"shard {shard} has no {kind} checkpoint"
            try:
                return dict(json.loads(Path(path).read_text()))
            except FileNotFoundError:
                continue  # replaced by a newer owner's file meanwhile
        raise AssertionError(f"shard {shard}: the {kind} checkpoint kept moving")


class PeakSampler:
    """Samples every ``every_s`` the RSS of each stage process and Redis ``used_memory`` (the
    server's ``used_memory_peak`` covers its whole life, other tests' too), from a thread;
    ``take()`` returns the peaks since the last ``take`` in MiB, ``{"redis": ..., stage: ...}``."""

    def __init__(self, pipe: Pipeline, every_s: float = 0.02) -> None:
        self.pipe = pipe
        self.every_s = every_s
        self._peaks: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="e2e-peaks", daemon=True)

    def _sample(self) -> dict[str, float]:
        out = {name: self.pipe.rss_kb(name) / 1024 for name in list(self.pipe.procs)}
        out["redis"] = int(self.pipe.redis.info("memory")["used_memory"]) / 2**20
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                got = self._sample()
            except (redis.RedisError, OSError):
                continue
            with self._lock:
                for k, v in got.items():
                    self._peaks[k] = max(v, self._peaks.get(k, 0.0))

    def take(self) -> dict[str, float]:
        got = self._sample()
        with self._lock:
            peaks = {k: round(max(v, self._peaks.get(k, 0.0)), 1) for k, v in got.items()}
            self._peaks = {}
        return peaks

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


# -- producing -----------------------------------------------------------------------------------


@dataclass
class Scheduled:
    message_id: str
    topic: str
    deliver_at_ms: int
    partition: int
    sent_ms: int = 0
    acked: bool = False
    failed: str | None = None


class TimerProducer:
    """Writes timer records as any Kafka client would: plain kafka-python and the tw-* headers."""

    def __init__(self, pipe: Pipeline, seed: int = 0) -> None:
        self.pipe = pipe
        self.partitions = int(str(pipe.settings["timer_partitions"]))
        self.rng = random.Random(seed)
        self.producer = KafkaProducer(bootstrap_servers=pipe.kafka, client_id=f"e2e-producer-{pipe.uid}",
                                      acks="all", linger_ms=5, delivery_timeout_ms=120_000, **pipe.kafka_options)
        self.messages: dict[str, Scheduled] = {}
        self.cancelled: dict[str, Scheduled] = {}
        #: target id -> when its cancel was acknowledged (our clock: after the broker appended it).
        self.cancel_acked: dict[str, int] = {}
        self._lock = threading.Lock()

    def _send(self, record: Scheduled | None, headers: list[tuple[str, bytes]], partition: int,
              key: bytes | None, value: bytes | None, timestamp_ms: int | None = None) -> Any:
        future = self.producer.send(self.pipe.timer_topic, key=key, value=value, headers=headers, partition=partition,
                                    timestamp_ms=timestamp_ms)
        if record is not None:
            def ok(_md: object, rec: Scheduled = record) -> None:
                rec.acked = True

            def fail(exc: BaseException, rec: Scheduled = record) -> None:
                rec.failed = repr(exc)

            future.add_callback(ok)
            future.add_errback(fail)
        return future

    def schedule(self, topic: str, deliver_at_ms: int | None = None, value: bytes | None = None,
                 headers: Sequence[tuple[str, bytes]] = (), partition: int | None = None, *,
                 delay_ms: int | None = None, delay_level: tuple[int, int] | None = None,
                 key: bytes | None = None) -> Scheduled:
        """One timer message, by absolute time (tw-deliver-at), ``delay_ms`` (tw-delay-ms) or
        ``delay_level`` = (level, its delay in ms) (tw-delay-level); the record's timestamp is
        set explicitly so the expected delivery time is known exactly."""
        mid = uuid.uuid4().hex
        p = self.rng.randrange(self.partitions) if partition is None else partition
        stamp = now_ms()
        if delay_ms is not None:
            when = [("tw-delay-ms", str(delay_ms).encode())]
            deliver_at_ms = stamp + delay_ms
        elif delay_level is not None:
            when = [("tw-delay-level", str(delay_level[0]).encode())]
            deliver_at_ms = stamp + delay_level[1]
        else:
            assert deliver_at_ms is not None
            when = [("tw-deliver-at", str(deliver_at_ms).encode())]
        rec = Scheduled(mid, topic, deliver_at_ms, p, stamp)
        with self._lock:
            self.messages[mid] = rec
        hdrs = [("tw-topic", topic.encode()), *when, ("tw-id", mid.encode()), *headers]
        self._send(rec, hdrs, p, key if key is not None else mid.encode(),
                   value if value is not None else f"value-{mid}".encode(), stamp)
        return rec

    def cancel(self, target: Scheduled) -> None:
        """A cancel: tw-cancel=<id> and the target's tw-deliver-at, on the target's partition."""
        with self._lock:
            self.cancelled[target.message_id] = target
        headers = [("tw-cancel", target.message_id.encode()), ("tw-deliver-at", str(target.deliver_at_ms).encode())]
        future = self._send(None, headers, target.partition, target.message_id.encode(), None)

        def acked(_md: object, mid: str = target.message_id) -> None:
            self.cancel_acked[mid] = now_ms()

        future.add_callback(acked)

    def cancels_in_time(self) -> dict[str, Scheduled]:
        """Cancelled targets whose cancel was acknowledged before their delivery time; those
        acknowledged only at or after it (which may miss: a cancel must reach the timer topic
        before it is due), or never (send failed), are left out."""
        with self._lock:
            return {m: s for m, s in self.cancelled.items()
                    if m in self.cancel_acked and self.cancel_acked[m] < s.deliver_at_ms}

    def send_raw(self, headers: Sequence[tuple[str, bytes]], key: bytes | None, value: bytes | None,
                 partition: int = 0) -> Any:
        """Any record to the timer topic; its kafka-python future."""
        return self._send(None, list(headers), partition, key, value)

    def flush(self, timeout_s: float = 60.0) -> None:
        self.producer.flush(timeout=timeout_s)

    def close(self) -> None:
        self.producer.close(timeout=10)

    def __enter__(self) -> TimerProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def expected(self) -> dict[str, Scheduled]:
        """Acknowledged, not cancelled: what must be delivered."""
        with self._lock:
            return {m: s for m, s in self.messages.items() if s.acked and m not in self.cancelled}


class SteadyLoad:
    """A background thread scheduling ``rate`` messages/s with delays in [min_delay, max_delay] ms."""

    def __init__(self, producer: TimerProducer, topic: str, rate: float, min_delay_ms: int, max_delay_ms: int,
                 cancel_fraction: float = 0.0, cancel_before_ms: tuple[int, int] = (300, 1_500)) -> None:
        """``cancel_fraction`` of the messages are cancelled shortly before they are due (a
        uniform ``cancel_before_ms`` = (least, most) ms before, or at once if that is past): the
        hard case for a cancel."""
        self.producer = producer
        self.cancel_fraction = cancel_fraction
        self.cancel_before_ms = cancel_before_ms
        self.cancels = 0
        self.topic = topic
        self.rate = rate
        self.delays = (min_delay_ms, max_delay_ms)
        self.sent = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="e2e-load", daemon=True)

    def start(self) -> SteadyLoad:
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.monotonic()
        rng = random.Random(1)
        to_cancel: list[tuple[int, int, Scheduled]] = []  # (when, seq, target): a heap
        while not self._stop.is_set():
            due = int((time.monotonic() - t0) * self.rate)
            while self.sent < due and not self._stop.is_set():
                try:
                    m = self.producer.schedule(self.topic, now_ms() + rng.randint(*self.delays))
                    self.sent += 1
                    if rng.random() < self.cancel_fraction:
                        heapq.heappush(to_cancel, (m.deliver_at_ms - rng.randint(*self.cancel_before_ms), self.sent, m))
                except Exception:  # noqa: BLE001 - broker away: count it, keep the pace
                    self.errors += 1
                    time.sleep(0.1)
            while to_cancel and to_cancel[0][0] <= now_ms() and not self._stop.is_set():
                try:
                    self.producer.cancel(to_cancel[0][2])
                    self.cancels += 1
                except Exception:  # noqa: BLE001 - broker away: its target may be delivered (not counted)
                    self.errors += 1
                heapq.heappop(to_cancel)
            self._stop.wait(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def __enter__(self) -> SteadyLoad:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- consuming -----------------------------------------------------------------------------------


@dataclass
class Delivery:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, bytes]
    delivered_at_ms: int
    #: When the collector's poll returned it, by this process's clock: an independent clock, not
    #: the service's own ``tw-delivered-at``.
    received_at_ms: int = 0
    #: The destination record's Kafka timestamp (dequeue-put's producer stamps it at the send).
    timestamp_ms: int = 0


class Collector:
    """Reads destination topics (from the start) in a thread and groups the records by tw-id."""

    def __init__(self, pipe: Pipeline, topics: Sequence[str], *, keep_values: bool = True,
                 read_committed: bool = False) -> None:
        """``keep_values`` False: the deliveries' values are not kept (bursts of large records);
        ``read_committed``: aborted transactions' records are not read."""
        self.pipe = pipe
        self.topics = list(topics)
        self.keep_values = keep_values
        self.isolation = "read_committed" if read_committed else "read_uncommitted"
        self.by_id: dict[str, list[Delivery]] = {}
        self.records: list[Delivery] = []
        self.errors = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.consumer = KafkaConsumer(bootstrap_servers=pipe.kafka, group_id=None, enable_auto_commit=False,
                                      auto_offset_reset="earliest", client_id=f"e2e-collector-{pipe.uid}",
                                      fetch_max_wait_ms=100,
                                      isolation_level=self.isolation, **pipe.kafka_options)
        tps = []
        for topic in self.topics:
            parts = None
            deadline = time.monotonic() + 30
            while not parts and time.monotonic() < deadline:
                parts = self.consumer.partitions_for_topic(topic)
                if not parts:
                    time.sleep(0.2)
            assert parts, f"topic {topic} has no partitions; create it before collecting"
            tps += [TopicPartition(topic, p) for p in sorted(parts)]
        self.consumer.assign(tps)
        self.consumer.seek_to_beginning(*tps)
        self._thread = threading.Thread(target=self._run, name="e2e-collector", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                batches = self.consumer.poll(timeout_ms=200, max_records=5000)
            except Exception:  # noqa: BLE001 - the broker may be restarting; the consumer reconnects
                self.errors += 1
                self._stop.wait(0.5)
                continue
            got = []
            received = now_ms()
            for recs in batches.values():
                for r in recs:
                    headers = {k: bytes(v) for k, v in (r.headers or ())}
                    at = int(headers.get("tw-delivered-at", b"0") or 0)
                    got.append(Delivery(r.topic, r.partition, r.offset, r.key,
                                        r.value if self.keep_values else None, headers, at, received, r.timestamp))
            if got:
                with self._lock:
                    for d in got:
                        self.records.append(d)
                        mid = d.headers.get("tw-id", b"").decode()
                        self.by_id.setdefault(mid, []).append(d)

    def delivered_ids(self) -> set[str]:
        with self._lock:
            return set(self.by_id)

    def wait_for(self, ids: Iterable[str], timeout_s: float, pipe: Pipeline | None = None) -> set[str]:
        """Wait until every id was delivered or the timeout; returns the ids still missing."""
        wanted = set(ids)
        deadline = time.monotonic() + timeout_s
        while True:
            missing = wanted - self.delivered_ids()
            if not missing or time.monotonic() >= deadline:
                return missing
            if pipe is not None and pipe.dead():
                return missing
            time.sleep(0.2)

    def reread(self, ids: Iterable[str], timeout_s: float = 60) -> set[str]:
        """Read the topics again from their start to their ends with a new consumer and keep the
        copies of ``ids`` found there (received now); returns the ids found. When ``wait_for`` timed
        out this tells a message the pipeline never delivered from one this consumer did not
        fetch (kafka-python's fetcher kept asking a partition's old leader after a broker was
        killed and back, in a run of e2e/test_three_brokers.py)."""
        wanted = set(ids)
        consumer = KafkaConsumer(bootstrap_servers=self.pipe.kafka, group_id=None, enable_auto_commit=False,
                                 client_id=f"e2e-reread-{self.pipe.uid}", isolation_level=self.isolation,
                                 **self.pipe.kafka_options)
        found: list[Delivery] = []
        try:
            tps = [tp for tp in self.consumer.assignment()]
            consumer.assign(tps)
            consumer.seek_to_beginning(*tps)
            ends = consumer.end_offsets(tps)
            deadline = time.monotonic() + timeout_s
            while any(consumer.position(tp) < ends[tp] for tp in tps) and time.monotonic() < deadline:
                received = now_ms()
                for recs in consumer.poll(timeout_ms=500, max_records=10_000).values():
                    for r in recs:
                        headers = {k: bytes(v) for k, v in (r.headers or ())}
                        if headers.get("tw-id", b"").decode() in wanted:
                            at = int(headers.get("tw-delivered-at", b"0") or 0)
                            found.append(Delivery(r.topic, r.partition, r.offset, r.key,
                                                  r.value if self.keep_values else None, headers, at, received,
                                                  r.timestamp))
        finally:
            consumer.close(autocommit=False)
        with self._lock:
            for d in found:
                if not any(o.offset == d.offset and o.partition == d.partition and o.topic == d.topic
                           for o in self.by_id.get(d.headers.get("tw-id", b"").decode(), ())):
                    self.records.append(d)
                    self.by_id.setdefault(d.headers.get("tw-id", b"").decode(), []).append(d)
        return {d.headers.get("tw-id", b"").decode() for d in found}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.consumer.close(autocommit=False)

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def timer_topic_records(pipe: Pipeline, client: str, timeout_s: float = 60, *,
                        strict: bool = True) -> Iterator[tuple[int, int, int, dict[str, bytes]]]:
    """Every record of the timer topic from its beginning to its end offsets as of the call:
    (partition, offset, timestamp, headers). ``strict`` fails when the end is not reached within
    ``timeout_s``; otherwise the records read by then are all there is."""
    consumer = KafkaConsumer(bootstrap_servers=pipe.kafka, group_id=None, enable_auto_commit=False,
                             client_id=f"e2e-{client}-{pipe.uid}", **pipe.kafka_options)
    try:
        tps = [TopicPartition(pipe.timer_topic, p) for p in sorted(consumer.partitions_for_topic(pipe.timer_topic) or ())]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            if time.monotonic() >= deadline:
                assert not strict, f"the timer topic not read to its end within {timeout_s:.0f} s"
                return
            for recs in consumer.poll(timeout_ms=500, max_records=10_000).values():
                for r in recs:
                    yield r.partition, r.offset, r.timestamp, {k: bytes(v) for k, v in (r.headers or ())}
    finally:
        consumer.close(autocommit=False)


def late_hops(pipe: Pipeline, targets: dict[str, Scheduled], timeout_s: float = 60) -> dict[str, int]:
    """Of ``targets`` (rolled messages), those whose last roll hop reached the timer topic only at
    or after their delivery time: id -> when (the hop record's timestamp). Such a hop lands in a
    slot after its cancel's, and the cancel misses: what happened before W was capped at R plus a
    third of the roll window (issue 30), the first thing to look at when a cancel leaks."""
    last_hop: dict[str, int] = {}
    for _, _, timestamp, headers in timer_topic_records(pipe, "hops", timeout_s):
        mid = headers.get("tw-id", b"").decode()
        if mid in targets and int(headers.get("tw-roll", b"0") or 0) >= 1:
            last_hop[mid] = max(last_hop.get(mid, 0), timestamp)
    return {m: at for m, at in last_hop.items() if at >= targets[m].deliver_at_ms}


def leak_facts(pipe: Pipeline, ids: Iterable[str], shards: int, timeout_s: float = 60) -> str:
    """Where a leaked cancel's message and its cancel went, for a failure message: their timer-topic
    records (partition, offset, timestamp, headers) and the TimerLog records naming those offsets
    (shard, position, flags, delivery time), as the files hold them now."""
    wanted = set(ids)
    lines: list[str] = []
    sources: dict[tuple[int, int], str] = {}
    try:
        for partition, offset, timestamp, raw in timer_topic_records(pipe, "facts", timeout_s, strict=False):
            headers = {k: v.decode("utf-8", "replace") for k, v in raw.items()}
            mid = headers.get("tw-cancel") or headers.get("tw-id")
            if mid in wanted:
                sources[(partition, offset)] = mid
                lines.append(f"timer topic p{partition} o{offset} ts {timestamp}: {headers}")
        for shard in range(shards):
            for segment in sorted((pipe.shard_dir(shard) / "timerlog").glob("*.tlog")):
                data = segment.read_bytes()
                base = int(segment.stem) if segment.stem.isdigit() else 0
                arr = np.frombuffer(data[: len(data) - len(data) % RECORD_SIZE], dtype=RECORD_DTYPE)
                ok = valid_mask(arr)
                written = arr["magic"] != 0  # not positions left unused (zeros)
                for k, (p, o) in enumerate(zip(arr["src_partition"].tolist(), arr["src_offset"].tolist(), strict=True)):
                    if (p, o) in sources and written[k]:
                        lines.append(f"TimerLog shard {shard} position {base + k * RECORD_SIZE}: "
                                     f"{'valid' if ok[k] else 'INVALID'} flags {int(arr['magic'][k]) & 0xFF} "
                                     f"deliver {int(arr['deliver_ms'][k])} source p{p} o{o} ({sources[(p, o)]})")
                if len(data) % RECORD_SIZE:
                    lines.append(f"TimerLog shard {shard} {segment.name}: {len(data) % RECORD_SIZE} bytes of a torn record at the end")
            lines.append(f"shard {shard} enqueue.ckpt {pipe.checkpoint(shard)}")
    except Exception as exc:  # noqa: BLE001 - facts for a failure message: never hide the failure
        lines.append(f"(facts cut short: {exc!r})")
    return "\n".join(lines)


class LoadRun:
    """A steady load and what watches it, for the length of a ``with`` block: a TimerProducer
    (``producer``), a Collector of ``topic`` (``collector``) and a SteadyLoad into ``topic``
    (``load``), started at once. Leaving the block stops the load and closes the collector and
    the producer, whatever happened."""

    def __init__(self, pipe: Pipeline, topic: str, *, seed: int, rate: float, min_delay_ms: int,
                 max_delay_ms: int, cancel_fraction: float = 0.0,
                 cancel_before_ms: tuple[int, int] = (300, 1_500), read_committed: bool = False) -> None:
        """``read_committed``: the collector skips aborted transactions' records (exactly-once)."""
        self.pipe = pipe
        with ExitStack() as opened:  # what opened before a failure here is closed again
            self.producer = opened.enter_context(TimerProducer(pipe, seed=seed))
            self.collector = opened.enter_context(Collector(pipe, [topic], read_committed=read_committed))
            self.load = opened.enter_context(SteadyLoad(self.producer, topic, rate, min_delay_ms,
                                                        max_delay_ms, cancel_fraction, cancel_before_ms))
            self._opened = opened.pop_all()

    def drain(self, name: str, timeout_s: float) -> tuple[set[str], Report]:
        """Stop the load, wait until every acknowledged message is delivered (at most
        ``timeout_s``, less if a stage dies), give late copies 2 s to show, and report (see
        ``make_report``). Returns the ids still missing and the report."""
        self.load.stop()
        self.producer.flush()
        missing = self.collector.wait_for(self.producer.expected(), timeout_s, self.pipe)
        time.sleep(2)
        if missing:  # the collector's consumer, or the pipeline? A new consumer reads the topics again
            seen = self.collector.reread(missing)
            print(f"[{name}] {len(missing)} not collected in {timeout_s:.0f} s; a new consumer reading the "
                  f"destinations again found {len(seen)} of them", flush=True)
            missing -= seen
        return missing, make_report(name, self.producer, self.collector)

    def __enter__(self) -> LoadRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self._opened.close()  # in reverse: the load, the collector, the producer


# -- the report ----------------------------------------------------------------------------------


@dataclass
class Report:
    name: str
    scheduled: int
    delivered: int
    lost: list[str]
    duplicated: int
    late: int  # delivered more than 1 s after the delivery time
    early: list[str]
    cancelled_delivered: list[str]
    unexpected: list[str]  # delivered, yet never acknowledged to the producer (or unknown ids)
    lateness_ms: dict[str, float] = field(default_factory=dict)
    #: Early and lateness again by the collector's receive time (its own clock), not tw-delivered-at.
    early_received: list[str] = field(default_factory=list)
    received_lateness_ms: dict[str, float] = field(default_factory=dict)
    #: Lateness by the destination record's Kafka timestamp (the first copy's).
    timestamp_lateness_ms: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        return (f"[{self.name}] scheduled={self.scheduled} delivered={self.delivered} lost={len(self.lost)} "
                f"duplicated={self.duplicated} late>1s={self.late} early={len(self.early)} "
                f"early_by_receive={len(self.early_received)} "
                f"cancelled_but_delivered={len(self.cancelled_delivered)} unexpected={len(self.unexpected)} "
                f"lateness_ms={self.lateness_ms} lateness_by_timestamp_ms={self.timestamp_lateness_ms} "
                f"lateness_by_receive_ms={self.received_lateness_ms}")


def make_report(name: str, producer: TimerProducer, collector: Collector) -> Report:
    expected = producer.expected()
    with collector._lock:
        by_id = {k: list(v) for k, v in collector.by_id.items()}
    lost = sorted(m for m in expected if m not in by_id)
    delivered = [m for m in expected if m in by_id]
    duplicated = sum(len(by_id[m]) - 1 for m in delivered)
    # Late relative to the delivery time, or to the send time for a message already due when sent.
    lateness = sorted(by_id[m][0].delivered_at_ms - max(expected[m].deliver_at_ms, expected[m].sent_ms)
                      for m in delivered)
    late = sum(1 for x in lateness if x > 1000)
    early = sorted(m for m in delivered if by_id[m][0].delivered_at_ms < expected[m].deliver_at_ms)
    # The same by the collector's clock: the first copy's receive time (a bound on the delivery
    # that does not trust the service's stamp).
    received = sorted(min(d.received_at_ms for d in by_id[m]) - max(expected[m].deliver_at_ms, expected[m].sent_ms)
                      for m in delivered)
    stamped = sorted(by_id[m][0].timestamp_ms - max(expected[m].deliver_at_ms, expected[m].sent_ms) for m in delivered)
    early_received = sorted(m for m in delivered
                            if min(d.received_at_ms for d in by_id[m]) < expected[m].deliver_at_ms)
    cancelled = sorted(m for m in producer.cancels_in_time() if m in by_id)
    known = set(producer.messages)
    unexpected = sorted(m for m in by_id if m not in known or not producer.messages[m].acked)

    def pcts(values: list[int]) -> dict[str, float]:
        def pct(q: float) -> float:
            return float(values[min(len(values) - 1, int(q * len(values)))]) if values else float("nan")
        return {"p50": pct(0.5), "p99": pct(0.99), "max": float(values[-1]) if values else float("nan")}

    rep = Report(name, len(expected), len(delivered), lost, duplicated, late, early, cancelled, unexpected,
                 pcts(lateness), early_received, pcts(received), pcts(stamped))
    print(rep.line(), flush=True)
    return rep
