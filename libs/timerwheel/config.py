"""One validated configuration object, built at the edge (flags, environment) and passed in.

Every check lives in ``TimerConfig.__post_init__``; a bad value raises ``ConfigError`` naming
the field. ``TimerConfig.from_env`` maps the documented ``TW_*`` environment variables onto
the same fields, so an env var and a keyword argument are validated by the same code.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any
from urllib.parse import urlsplit

from timerwheel.errors import ConfigError

ALLOWED_TICKS_MS = (10, 100, 200, 500, 1000)
DAY_MS = 86_400_000
#: TW_LOOKAHEAD_MS by default (issue 30): a message is read, fetched and held a second before its time.
DEFAULT_LOOKAHEAD_MS = 1_000
#: How fast the look-ahead reckons one shard's records move from the wheel to dequeue-put (read,
#: fetched, held): a burst is read as long ahead as its records take at this rate, when that is
#: longer than the look-ahead (``TimerConfig.lookahead_max_ms``, ``DequeueGet._lead_ms``). On a
#: quiet machine five stage processes move 5,000-10,000 records a second in all: 20,000 due at
#: once, read 2 s ahead (at 5,000 a shard), were all held only 30 ms before their time.
LOOKAHEAD_RECORDS_PER_S = 2_500

#: RocketMQ 4.x delay levels 1..18.
DEFAULT_DELAY_LEVELS = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
#: Internal topics (``__*``) are denied unless an allow pattern names them.
DEFAULT_ALLOW_TOPICS = (r"(?!__).+",)

#: Kafka's codecs, and "none" (TW_KAFKA_COMPRESSION).
KAFKA_COMPRESSIONS = ("none", "gzip", "snappy", "lz4", "zstd")
#: TW_DELIVERY_GUARANTEE's values (issue 31).
DELIVERY_GUARANTEES = ("at-least-once", "exactly-once")
#: What enqueue-get does with a message for a destination that does not exist (TW_MISSING_TOPIC).
MISSING_TOPIC_POLICIES = ("hold", "dlq")

#: Kafka's security protocols (TW_KAFKA_SECURITY_PROTOCOL), and which of them use TLS / SASL.
KAFKA_SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
KAFKA_SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
#: URL schemes redis-py understands; ``rediss`` is Redis over TLS.
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")

_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": DAY_MS, "w": 7 * DAY_MS}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?|\.\d+)(ms|s|m|h|d|w)")
#: What a duration may look like, for error messages.
DURATION_FORMS = "5000 (ms), 250ms, 5s, 1.5s, 10m, 1h30m, 2d, 2w (units ms s m h d w)"


def parse_duration_ms(text: str) -> int:
    """A duration in whole milliseconds: ``"1500"`` (a bare number is milliseconds), ``"250ms"``,
    ``"1.5s"``, ``"1h30m"``, ``"2w"``. Raises ValueError listing the accepted forms (a negative
    one is refused as such)."""
    t = text.strip()
    body = t[1:] if t.startswith("-") else t
    if body.isdigit():
        total = Decimal(body)
    else:
        parts = _DURATION_PART.findall(body)
        if not parts or "".join(n + u for n, u in parts) != body:
            raise ValueError(f"expected a duration such as {DURATION_FORMS}, got {text!r}")
        total = sum((Decimal(n) * _UNITS_MS[u] for n, u in parts), Decimal(0))
    if body is not t:
        raise ValueError(f"a duration cannot be negative, got {text!r}")
    if total != int(total):
        raise ValueError(f"a duration is whole milliseconds, got {text!r} ({total} ms)")
    return int(total)


def parse_delay_levels(text: str) -> tuple[int, ...]:
    return tuple(parse_duration_ms(part) for part in text.split())


@dataclass(frozen=True, slots=True)
class TimerConfig:
    data_dir: str = "./data"
    shards: int = 1
    tick_ms: int = 100
    roll_window_ms: int = 2 * DAY_MS
    #: Span of the wheel; 0 means twice the roll window (the minimum).
    wheel_span_ms: int = 0
    segment_bytes: int = 64 * 1024 * 1024
    max_delay_ms: int = 400 * DAY_MS
    delay_levels_ms: tuple[int, ...] = field(default_factory=lambda: parse_delay_levels(DEFAULT_DELAY_LEVELS))
    allow_topics: tuple[str, ...] = DEFAULT_ALLOW_TOPICS
    timer_topic: str = "__timer"
    dlq_topic: str = "__timer_dlq"
    timer_partitions: int = 4
    max_record_bytes: int = 1024 * 1024
    #: Entries a work-queue partition holds before its producer blocks (flow control).
    queue_bound: int = 64
    #: Requests per work-queue entry / per TimerLog append batch.
    batch_size: int = 500
    #: Bytes of record payload a work-queue partition holds before its producer blocks (with
    #: ``queue_bound``: whichever is reached first). Bounds the deliver queue, which carries bodies.
    queue_bytes: int = 16 * 1024 * 1024
    #: Bytes of record payload a stage's batch stops at (a fetch entry, a read, a produce); a
    #: record larger than this is a batch of its own.
    batch_bytes: int = 4 * 1024 * 1024
    #: Memory dequeue-getmsg's Kafka read cache may take (records read ahead or in passing, each
    #: counted as its bytes plus ``readcache.RECORD_OVERHEAD``); 0: off.
    read_cache_bytes: int = 32 * 1024 * 1024
    #: Messages a shard's dequeue-get may have sent but not yet seen delivered.
    max_in_flight: int = 20_000
    #: Seconds a put into a full queue waits before it gives up and retries.
    queue_put_timeout_s: float = 5.0
    fsync: bool = True
    #: Seconds a shard lease lasts without renewal; a paused owner is fenced after it.
    lease_ttl_ms: int = 10_000
    #: How far W may run past the time up to which a shard's input is complete (enqueue-put's
    #: ``InputWatermark``). 0: every cancel acknowledged before its target's delivery time meets
    #: it; N: only those acknowledged at least N ms before it, for deliveries up to N ms sooner.
    cancel_lead_ms: int = 0
    #: "at-least-once" or "exactly-once" (issue 31: each delivery committed with its progress record
    #: in one Kafka transaction per shard; consumers read ``read_committed``).
    delivery_guarantee: str = "at-least-once"
    #: The topic of exactly-once's progress records (one partition per shard); "": ``<timer topic>_progress``.
    progress_topic: str = ""
    #: The delivery transactions' timeout, and how long a commit is waited for.
    transaction_timeout_ms: int = 10_000
    #: How far ahead of its delivery time a message may be read, fetched and held by dequeue-put
    #: (``TW_LOOKAHEAD_MS``); 0: a slot is read once W passes its end; -1: DEFAULT_LOOKAHEAD_MS, or
    #: less when the roll window allows less (``effective_lookahead_ms``).
    lookahead_ms: int = -1
    #: Shards this process may own (enqueue-put, dequeue-get); empty: all.
    own_shards: tuple[int, ...] = ()
    #: enqueue-get replicas split the timer partitions: p % replicas == replica_index.
    replica_index: int = 0
    replicas: int = 1
    kafka_bootstrap: str = ""
    #: Compression of the records timerwheel writes to Kafka (delivered, rolled, dead letters).
    kafka_compression: str = "none"
    #: A destination that does not exist when a message is scheduled: "hold" schedules it anyway
    #: (the topic may be created before it is due), "dlq" dead-letters it at once.
    missing_topic: str = "hold"
    #: A due message whose destination does not exist is held (re-tried) this long, then dead-lettered.
    missing_topic_hold_ms: int = 600_000
    #: Kafka security (docs/configuration.md, "Secured connections"): every Kafka client timerwheel makes
    #: takes these through ``timerwheel.security.kafka_client_options``.
    kafka_security_protocol: str = "PLAINTEXT"
    kafka_sasl_mechanism: str = ""
    kafka_sasl_username: str = ""
    kafka_sasl_password: str = field(default="", repr=False)
    #: A file holding the SASL password (a mounted Kubernetes secret); read when the clients are made.
    kafka_sasl_password_file: str = ""
    kafka_ssl_cafile: str = ""
    #: Client certificate and key, for brokers that require mutual TLS.
    kafka_ssl_certfile: str = ""
    kafka_ssl_keyfile: str = ""
    kafka_ssl_check_hostname: bool = True
    redis_url: str = ""
    redis_password: str = field(default="", repr=False)
    redis_password_file: str = ""
    #: CA bundle that signed the Redis server's certificate (with a ``rediss://`` URL).
    redis_ssl_cafile: str = ""
    http_port: int = 0
    #: Distinct destination topics that get their own ``topic`` label in the metrics; past it
    #: (and for a topic that is not a legal, allowed destination) the label is ``other``.
    metrics_topic_labels_max: int = 100
    #: Embedded mode: the local commit log deletes segments older than this; 0 means
    #: max(7 days, 1.5 x the roll window). At least 1.5 x the roll window (rolled messages are
    #: re-read from the timer topic), as for the timer topic's retention.ms on Kafka.
    log_retention_ms: int = 0

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ConfigError(name, message)

        need(bool(self.data_dir), "data_dir", "must not be empty")
        need(1 <= self.shards <= 4096, "shards", f"must be 1..4096, got {self.shards}")
        need(
            self.tick_ms in ALLOWED_TICKS_MS,
            "tick_ms",
            f"must be one of {', '.join(map(str, ALLOWED_TICKS_MS))} ms, got {self.tick_ms}",
        )
        need(
            self.roll_window_ms >= 10 * self.tick_ms and self.roll_window_ms % self.tick_ms == 0,
            "roll_window_ms",
            f"must be a multiple of tick_ms ({self.tick_ms}) and at least 10 ticks, got {self.roll_window_ms}",
        )
        span = self.wheel_span_ms or 2 * self.roll_window_ms
        need(
            span >= 2 * self.roll_window_ms and span % self.tick_ms == 0,
            "wheel_span_ms",
            f"must be a multiple of tick_ms and at least twice roll_window_ms ({2 * self.roll_window_ms}), got {span}",
        )
        from timerwheel.store.format import RECORD_SIZE  # the storage format's (not at import: a cycle)

        need(
            self.segment_bytes >= RECORD_SIZE and self.segment_bytes % RECORD_SIZE == 0,
            "segment_bytes",
            f"must be a positive multiple of the record size {RECORD_SIZE}, got {self.segment_bytes}",
        )
        need(self.max_delay_ms > 0, "max_delay_ms", f"must be > 0, got {self.max_delay_ms}")
        need(len(self.delay_levels_ms) > 0, "delay_levels", "must name at least one level")
        need(all(d > 0 for d in self.delay_levels_ms), "delay_levels", "every level must be > 0")
        for pattern in self.allow_topics:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ConfigError("allow_topics", f"bad regular expression {pattern!r}: {exc}") from None
        need(bool(self.timer_topic), "timer_topic", "must not be empty")
        need(bool(self.dlq_topic), "dlq_topic", "must not be empty")
        need(self.dlq_topic != self.timer_topic, "dlq_topic", "must differ from timer_topic")
        need(1 <= self.timer_partitions <= 10_000, "timer_partitions", f"must be 1..10000, got {self.timer_partitions}")
        need(self.max_record_bytes >= 1024, "max_record_bytes", f"must be >= 1024, got {self.max_record_bytes}")
        need(self.queue_bound >= 1, "queue_bound", f"must be >= 1, got {self.queue_bound}")
        need(1 <= self.batch_size <= 100_000, "batch_size", f"must be 1..100000, got {self.batch_size}")
        need(self.batch_bytes >= 64 * 1024, "batch_bytes", f"must be >= 65536, got {self.batch_bytes}")
        need(self.queue_bytes >= self.batch_bytes, "queue_bytes",
             f"must be >= batch_bytes ({self.batch_bytes}), got {self.queue_bytes}")
        need(self.read_cache_bytes >= 0, "read_cache_bytes", f"must be >= 0, got {self.read_cache_bytes}")
        need(self.max_in_flight >= self.batch_size, "max_in_flight", f"must be >= batch_size, got {self.max_in_flight}")
        need(self.queue_put_timeout_s > 0, "queue_put_timeout_s", "must be > 0")
        need(self.lease_ttl_ms >= 1000, "lease_ttl_ms", f"must be >= 1000, got {self.lease_ttl_ms}")
        need(0 <= self.cancel_lead_ms <= 60_000, "cancel_lead_ms", f"must be 0..60000, got {self.cancel_lead_ms}")
        need(self.delivery_guarantee in DELIVERY_GUARANTEES, "delivery_guarantee",
             f"must be {' or '.join(DELIVERY_GUARANTEES)}, got {self.delivery_guarantee!r}")
        need(self.effective_progress_topic not in (self.timer_topic, self.dlq_topic), "progress_topic",
             "must differ from the timer and dead-letter topics")
        need(1_000 <= self.transaction_timeout_ms <= 900_000, "transaction_timeout_ms",
             f"must be 1000..900000 (the broker's transaction.max.timeout.ms default), got {self.transaction_timeout_ms}")
        lookahead_max = self.lookahead_bound_ms
        need(self.lookahead_ms == -1 or 0 <= self.lookahead_ms <= lookahead_max, "lookahead_ms",
             f"must be 0..{lookahead_max} (60000 at most, and roll_window_ms / 6 - 2 ticks) or -1 (the default), "
             f"got {self.lookahead_ms}")
        need(all(0 <= s < self.shards for s in self.own_shards), "own_shards",
             f"every shard must be 0..{self.shards - 1}, got {list(self.own_shards)}")
        need(self.replicas >= 1, "replicas", f"must be >= 1, got {self.replicas}")
        need(0 <= self.replica_index < self.replicas, "replica_index",
             f"must be 0..{self.replicas - 1}, got {self.replica_index}")
        need(0 <= self.http_port <= 65535, "http_port", f"must be 0..65535, got {self.http_port}")
        need(0 <= self.metrics_topic_labels_max <= 100_000, "metrics_topic_labels_max",
             f"must be 0..100000, got {self.metrics_topic_labels_max}")
        need(self.log_retention_ms == 0 or self.log_retention_ms >= self.roll_window_ms * 3 // 2, "log_retention_ms",
             f"must be at least 1.5 x roll_window_ms ({self.roll_window_ms * 3 // 2}), got {self.log_retention_ms}")
        need(self.kafka_compression in KAFKA_COMPRESSIONS, "kafka_compression",
             f"must be one of {', '.join(KAFKA_COMPRESSIONS)}, got {self.kafka_compression!r}")
        need(self.missing_topic in MISSING_TOPIC_POLICIES, "missing_topic",
             f"must be one of {', '.join(MISSING_TOPIC_POLICIES)}, got {self.missing_topic!r}")
        need(self.missing_topic_hold_ms >= 0, "missing_topic_hold_ms", f"must be >= 0, got {self.missing_topic_hold_ms}")
        self._check_kafka_security(need)
        self._check_redis_security(need)

    def _check_kafka_security(self, need: Any) -> None:
        protocol = self.kafka_security_protocol
        need(protocol in KAFKA_SECURITY_PROTOCOLS, "kafka_security_protocol",
             f"must be one of {', '.join(KAFKA_SECURITY_PROTOCOLS)}, got {protocol!r}")
        if protocol.startswith("SASL_"):
            need(self.kafka_sasl_mechanism in KAFKA_SASL_MECHANISMS, "kafka_sasl_mechanism",
                 f"must be one of {', '.join(KAFKA_SASL_MECHANISMS)} with {protocol}, "
                 f"got {self.kafka_sasl_mechanism!r}")
            need(bool(self.kafka_sasl_username), "kafka_sasl_username", f"must be set with {protocol}")
            need(bool(self.kafka_sasl_password) or bool(self.kafka_sasl_password_file), "kafka_sasl_password",
                 f"must be set with {protocol} (or kafka_sasl_password_file)")
        else:
            for name in ("kafka_sasl_mechanism", "kafka_sasl_username", "kafka_sasl_password",
                         "kafka_sasl_password_file"):
                need(not getattr(self, name), name,
                     f"is used only with SASL_PLAINTEXT or SASL_SSL, but kafka_security_protocol is {protocol}")
        need(not (self.kafka_sasl_password and self.kafka_sasl_password_file), "kafka_sasl_password_file",
             "set either it or kafka_sasl_password, not both")
        tls = protocol in ("SSL", "SASL_SSL")
        for name in ("kafka_ssl_cafile", "kafka_ssl_certfile", "kafka_ssl_keyfile"):
            need(tls or not getattr(self, name), name,
                 f"is used only with SSL or SASL_SSL, but kafka_security_protocol is {protocol}")
        need(not self.kafka_ssl_keyfile or bool(self.kafka_ssl_certfile), "kafka_ssl_keyfile",
             "needs kafka_ssl_certfile (the client certificate)")
        for name in ("kafka_sasl_password_file", "kafka_ssl_cafile", "kafka_ssl_certfile", "kafka_ssl_keyfile"):
            _readable(need, name, getattr(self, name))
        if self.kafka_sasl_password_file:
            need(bool(read_secret(self.kafka_sasl_password_file)), "kafka_sasl_password_file",
                 f"{self.kafka_sasl_password_file} is empty")

    def _check_redis_security(self, need: Any) -> None:
        url = self.redis_url
        need(not url or url.startswith(REDIS_SCHEMES), "redis_url",
             f"must start with {', '.join(REDIS_SCHEMES)}, got {url.split('://')[0]!r}://...")
        need(not (self.redis_password and self.redis_password_file), "redis_password_file",
             "set either it or redis_password, not both")
        need(not ((self.redis_password or self.redis_password_file) and urlsplit(url).password), "redis_password",
             "the URL holds a password too (redis-py would use the URL's): set it in one place")
        need(not self.redis_ssl_cafile or url.startswith("rediss://"), "redis_ssl_cafile",
             "is used only with a rediss:// URL (Redis over TLS)")
        for name in ("redis_password_file", "redis_ssl_cafile"):
            _readable(need, name, getattr(self, name))
        if self.redis_password_file:
            need(bool(read_secret(self.redis_password_file)), "redis_password_file",
                 f"{self.redis_password_file} is empty")

    def kafka_password(self) -> str:
        """The SASL password, from ``kafka_sasl_password_file`` when set (read now: clients made later, e.g. after a
        restart, use a rotated Kubernetes secret)."""
        if self.kafka_sasl_password_file:
            return read_secret(self.kafka_sasl_password_file)
        return self.kafka_sasl_password

    def redis_secret(self) -> str:
        """The Redis password (``redis_password_file`` read now), or "" for none."""
        if self.redis_password_file:
            return read_secret(self.redis_password_file)
        return self.redis_password

    @property
    def effective_log_retention_ms(self) -> int:
        return self.log_retention_ms or max(7 * DAY_MS, self.roll_window_ms * 3 // 2)

    @property
    def effective_lookahead_ms(self) -> int:
        """TW_LOOKAHEAD_MS, its default (-1) made DEFAULT_LOOKAHEAD_MS within what the roll window allows."""
        if self.lookahead_ms >= 0:
            return self.lookahead_ms
        return min(DEFAULT_LOOKAHEAD_MS, self.lookahead_bound_ms)

    @property
    def lookahead_bound_ms(self) -> int:
        """What the roll window allows any look-ahead: roll_window_ms / 6 - 2 ticks, 60 s at most
        (design 3.1: W's cap ``c`` stays at least a sixth of the window)."""
        return max(0, min(60_000, self.roll_window_ms // 6 - 2 * self.tick_ms))

    @property
    def lookahead_max_ms(self) -> int:
        """The most a slot is read ahead of its time: the look-ahead grown by the time
        ``max_in_flight`` records take at LOOKAHEAD_RECORDS_PER_S, within what the roll window
        allows (roll_window_ms / 6 - 2 ticks, 60 s at most); 0 with TW_LOOKAHEAD_MS 0. A burst due
        at once is read this much earlier at most, so that it is held before its time."""
        base = self.effective_lookahead_ms
        if base <= 0:
            return 0
        return min(max(base, self.lookahead_bound_ms), base + self.max_in_flight * 1000 // LOOKAHEAD_RECORDS_PER_S)

    @property
    def effective_progress_topic(self) -> str:
        """TW_PROGRESS_TOPIC, or ``<timer topic>_progress``."""
        return self.progress_topic or f"{self.timer_topic}_progress"

    @property
    def transactional_id_prefix(self) -> str:
        """What Kafka transactional ids and the dead-letter group are named after
        (``<prefix>-dlq-<partition>``, group ``<prefix>-dlq``): the timer topic. The design's
        ``TW_TRANSACTIONAL_ID_PREFIX`` (docs/design/precision-and-exactly-once.md, 8) will set it;
        until then this is the one place that derives it."""
        return self.timer_topic

    @property
    def wheel_slots(self) -> int:
        return (self.wheel_span_ms or 2 * self.roll_window_ms) // self.tick_ms

    def replace(self, **changes: Any) -> TimerConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **overrides: Any) -> TimerConfig:
        """Build from ``TW_*`` variables (see ENV_VARS). A bad value names its variable, and so
        does a ``TW_*`` variable nobody reads: a typo (``TW_SHARD=4``) must not pass unseen."""
        for var in sorted(environ):
            if var.startswith("TW_") and not known_env_var(var) and not kubernetes_service_var(var, environ[var]):
                close = difflib.get_close_matches(var, [*ENV_VARS, *OTHER_ENV_VARS], 1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ConfigError(var, f"unknown variable{hint}; docs/configuration.md lists every TW_* variable")
        values: dict[str, Any] = {}
        for var, (attr, kind, _doc) in ENV_VARS.items():
            raw = environ.get(var)
            if raw is None or raw == "":
                continue
            try:
                values[attr] = _convert(kind, raw)
            except ValueError as exc:
                raise ConfigError(var, f"cannot parse {raw!r}: {exc}") from None
        values.update(overrides)
        try:
            return cls(**values)
        except ConfigError as exc:
            if exc.field in overrides:
                raise  # the caller names its own flag
            var = next((v for v, (a, _k, _d) in ENV_VARS.items() if a == exc.field), exc.field)
            raise ConfigError(var, str(exc).split(": ", 1)[1]) from None


def read_secret(path: str) -> str:
    """A secret from a file, as Kubernetes mounts them: the whole file but a trailing newline."""
    with open(path, encoding="utf-8") as f:
        return f.read().rstrip("\r\n")


def _readable(need: Any, name: str, path: str) -> None:
    """Refuse a file setting that names a file this process cannot read (never its content)."""
    if path:
        need(os.path.isfile(path) and os.access(path, os.R_OK), name, f"cannot read the file {path!r}")


def _convert(kind: str, raw: str) -> Any:
    if kind == "int":
        return int(raw)
    if kind == "float":
        return float(raw)
    if kind == "bool":
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError("expected true or false")
    if kind == "duration":
        return parse_duration_ms(raw)
    if kind == "levels":
        return parse_delay_levels(raw)
    if kind == "ints":
        return tuple(int(p) for p in raw.replace(" ", "").split(",") if p)
    if kind == "regexes":
        return tuple(p.strip() for p in raw.split(",") if p.strip())
    return raw


#: Every environment variable the services read: name -> (TimerConfig field, kind, meaning). The
#: meaning is what docs/configuration.md says of it (``python -m timerwheel.docs`` writes that page
#: from this table; the default comes from the TimerConfig field).
ENV_VARS: dict[str, tuple[str, str, str]] = {
    "TW_DATA_DIR": ("data_dir", "str", "shared volume holding each shard's TimerLog, wheel and checkpoints "
                    "(and in embedded mode the local commit log, `<data dir>/log`)"),
    "TW_SHARDS": ("shards", "int", "number of shards, 1..4096; timer partition p belongs to shard p % shards. "
                  "Fixed once the data directory is made"),
    "TW_TICK_MS": ("tick_ms", "int", "wheel precision: 10, 100, 200, 500 or 1000 ms"),
    "TW_ROLL_WINDOW_MS": ("roll_window_ms", "duration",
                          "messages due further than this past W are rolled: written into a slot inside the "
                          "window and written back to the timer topic when it fires. Whole ticks, at least 10"),
    "TW_WHEEL_SPAN_MS": ("wheel_span_ms", "duration", "wheel span, at least twice the roll window (0: twice it)"),
    "TW_SEGMENT_BYTES": ("segment_bytes", "int", "TimerLog segment size, a multiple of the 64-byte record"),
    "TW_MAX_DELAY_MS": ("max_delay_ms", "duration", "longest accepted delay; a longer one is dead-lettered"),
    "TW_DELAY_LEVELS": ("delay_levels_ms", "levels",
                        "the delay-level table of `tw-delay-level` 1..N: space-separated durations "
                        "(RocketMQ 4.x's 18 levels)"),
    "TW_ALLOW_TOPICS": ("allow_topics", "regexes",
                        "comma-separated regexes; a destination must fully match one (the default denies "
                        "internal `__*` topics)"),
    "TW_TIMER_TOPIC": ("timer_topic", "str", "the topic producers write timer messages to"),
    "TW_DLQ_TOPIC": ("dlq_topic", "str", "the dead-letter topic; must differ from the timer topic"),
    "TW_TIMER_PARTITIONS": ("timer_partitions", "int", "partitions of the timer topic when timerwheel creates it"),
    "TW_MAX_RECORD_BYTES": ("max_record_bytes", "int",
                            "larger timer records go to the DLQ (keep it a few hundred bytes under the "
                            "broker's limits)"),
    "TW_QUEUE_BOUND": ("queue_bound", "int",
                       "entries per work-queue partition before the producer blocks (flow control)"),
    "TW_BATCH_SIZE": ("batch_size", "int", "requests per work-queue entry and TimerLog batch, 1..100000"),
    "TW_QUEUE_BYTES": ("queue_bytes", "int",
                       "record bytes a work-queue partition holds before the producer blocks (with "
                       "`TW_QUEUE_BOUND`, whichever comes first): bounds the deliver queue in Redis; at least "
                       "`TW_BATCH_BYTES`"),
    "TW_BATCH_BYTES": ("batch_bytes", "int",
                       "record bytes a batch stops at (fetch entries, dequeue-getmsg's reads, dequeue-put's "
                       "produce, enqueue-get's Kafka fetch); at least 65536"),
    "TW_READ_CACHE_BYTES": ("read_cache_bytes", "int",
                            "memory dequeue-getmsg's read cache of timer records may take on Kafka, each record "
                            "counted as its bytes plus ~800 for the objects around it (0: no read-ahead; the "
                            "embedded mode's local log keeps 64 MiB)"),
    "TW_MAX_IN_FLIGHT": ("max_in_flight", "int",
                         "messages per shard sent by dequeue-get but not yet reported delivered (flow control); "
                         "at least `TW_BATCH_SIZE`"),
    "TW_FSYNC": ("fsync", "bool", "fsync the shards' TimerLog, wheel and checkpoints, and the local commit log"),
    "TW_LEASE_TTL_MS": ("lease_ttl_ms", "int",
                        "shard lease duration in ms, at least 1000; an owner paused longer is fenced"),
    "TW_CANCEL_LEAD_MS": ("cancel_lead_ms", "int",
                          "how far W may run past the time up to which a shard's input is written, 0..60000 ms. "
                          "0: every cancel acknowledged before its target's delivery time meets it. N: only "
                          "cancels acknowledged at least N ms before it are sure to, deliveries come up to "
                          "N ms sooner when enqueue-get lags, and dequeue-put looks at the timer topic up to "
                          "N ms before a record's time (it looks 20 ms before: N over 20 ms), "
                          "so that the record leaves at its time, not after a look at it"),
    "TW_DELIVERY_GUARANTEE": ("delivery_guarantee", "str",
                              "at-least-once (the default) or exactly-once: each delivery, roll hop and dead "
                              "letter of dequeue-put committed with its progress record in one Kafka transaction "
                              "per shard (consumers read read_committed); embedded: in one append through the "
                              "local log's journal"),
    "TW_PROGRESS_TOPIC": ("progress_topic", "str",
                          "exactly-once's progress topic, one partition per shard; empty: <timer topic>_progress"),
    "TW_TRANSACTION_TIMEOUT_MS": ("transaction_timeout_ms", "duration",
                                  "exactly-once: the delivery transactions' timeout and how long a commit is "
                                  "waited for, 1000..900000 ms"),
    "TW_LOOKAHEAD_MS": ("lookahead_ms", "int",
                        "how far ahead of its delivery time a message is read from the wheel, fetched and held "
                        "by dequeue-put until its time, 0..60000 ms and at most roll_window_ms / 6 - 2 ticks; "
                        "0: a slot is read once W passes its end; -1 (the default): 1000 ms, or roll_window_ms / 6 "
                        "- 2 ticks if less; a burst is read earlier, as long ahead as its records take at 2500 a "
                        "second a shard, at most max_in_flight's worth more (within the same roll-window bound)"),
    "TW_OWN_SHARDS": ("own_shards", "ints",
                      "comma-separated shards this process may own (enqueue-put, dequeue-get); empty: all"),
    "TW_REPLICA_INDEX": ("replica_index", "int",
                         "this enqueue-get replica's index: it reads partitions p with p % replicas == index"),
    "TW_REPLICAS": ("replicas", "int", "number of enqueue-get replicas"),
    "TW_KAFKA_BOOTSTRAP": ("kafka_bootstrap", "str", "Kafka bootstrap servers (production mode)"),
    "TW_KAFKA_COMPRESSION": ("kafka_compression", "str",
                             "compression of what timerwheel writes to Kafka (delivered records, roll hops, dead "
                             "letters): none, gzip, snappy, lz4 or zstd"),
    "TW_MISSING_TOPIC": ("missing_topic", "str",
                         "a destination that does not exist when the message is scheduled: hold (schedule it; "
                         "the topic may be created before it is due) or dlq (dead-letter it at once)"),
    "TW_MISSING_TOPIC_HOLD_MS": ("missing_topic_hold_ms", "duration",
                                 "a due message whose destination does not exist is held (tried again) this long, "
                                 "then dead-lettered"),
    "TW_KAFKA_SECURITY_PROTOCOL": ("kafka_security_protocol", "str",
                                   "PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL"),
    "TW_KAFKA_SASL_MECHANISM": ("kafka_sasl_mechanism", "str",
                                "PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (required with SASL_*)"),
    "TW_KAFKA_SASL_USERNAME": ("kafka_sasl_username", "str", "SASL user (required with SASL_*)"),
    "TW_KAFKA_SASL_PASSWORD": ("kafka_sasl_password", "str", "SASL password; or `TW_KAFKA_SASL_PASSWORD_FILE`"),
    "TW_KAFKA_SASL_PASSWORD_FILE": ("kafka_sasl_password_file", "str",
                                    "file holding the SASL password (a mounted Kubernetes secret; read when the "
                                    "clients are made, so a restarted pod uses a rotated secret; a trailing "
                                    "newline is dropped)"),
    "TW_KAFKA_SSL_CAFILE": ("kafka_ssl_cafile", "str",
                            "PEM bundle of the CA that signed the brokers' certificates (with SSL / SASL_SSL; "
                            "empty: the system's CAs)"),
    "TW_KAFKA_SSL_CERTFILE": ("kafka_ssl_certfile", "str",
                              "PEM client certificate, for brokers that require mutual TLS"),
    "TW_KAFKA_SSL_KEYFILE": ("kafka_ssl_keyfile", "str",
                             "PEM private key of that certificate (needs `TW_KAFKA_SSL_CERTFILE`)"),
    "TW_KAFKA_SSL_CHECK_HOSTNAME": ("kafka_ssl_check_hostname", "bool",
                                    "the broker's certificate must name the host connected to"),
    "TW_REDIS_URL": ("redis_url", "str",
                     "Redis URL for the work queues and leases (production mode); `rediss://` for TLS"),
    "TW_REDIS_PASSWORD": ("redis_password", "str", "Redis password (AUTH); or `TW_REDIS_PASSWORD_FILE`"),
    "TW_REDIS_PASSWORD_FILE": ("redis_password_file", "str", "file holding the Redis password (a mounted secret)"),
    "TW_REDIS_SSL_CAFILE": ("redis_ssl_cafile", "str",
                            "PEM bundle of the CA that signed Redis's certificate (with `rediss://`; empty: the "
                            "system's CAs)"),
    "TW_HTTP_PORT": ("http_port", "int", "port for `/healthz`, `/readyz` and `/metrics` (0: off)"),
    "TW_METRICS_TOPIC_LABELS_MAX": ("metrics_topic_labels_max", "int",
                                    "destination topics that get a topic label of their own in the metrics; past "
                                    "it, and for any topic that is not a legal destination `TW_ALLOW_TOPICS` allows "
                                    "(the timer and dead-letter topics included), the label is other"),
    "TW_LOG_RETENTION_MS": ("log_retention_ms", "duration",
                            "embedded mode: the local commit log (`<data dir>/log`) deletes whole segments whose "
                            "newest record is older than this, checked every minute; at least 1.5 x the roll "
                            "window (a rolled message is re-read from the timer topic). 0: max(7 days, 1.5 x the "
                            "roll window). Kafka keeps its own `retention.ms`"),
}

#: Variables read outside TimerConfig.
OTHER_ENV_VARS = {
    "TW_LOG_LEVEL": "level of the JSON log lines on stderr: DEBUG, INFO, WARNING or ERROR (default INFO)",
    "TW_SPARK_JARS": "Spark jobs: a directory of Spark's Kafka connector jars (default: scripts/spark.sh's cache)",
    "TW_SPARK_DRIVER_MEMORY": "Spark jobs: the driver's memory on local[*] (default 1g)",
    "TW_SPARK_SHUFFLE_PARTITIONS": "Spark jobs: spark.sql.shuffle.partitions (default 8)",
    "TW_CONSOLE_METRICS": "timerwheel console / top: the stages' /metrics endpoints, host:port,...",
    "TW_CONSOLE_ACTION_TOKEN_FILE": "timerwheel console: file holding the action token (none: read-only)",
    "TW_CONSOLE_HOST": "timerwheel console: address to listen on (default 127.0.0.1)",
    "TW_CONSOLE_PORT": "timerwheel console: port to listen on (default 8090)",
}

#: Variables of the project's own scripts, tests and benchmarks (docs/development.md);
#: a process may inherit them from a developer's shell, so they are not reported as unknown.
TOOLING_ENV_VARS = {
    "TW_KEEP_SERVERS": "tests: leave the Kafka and Redis they started running",
    "TW_E2E_ROLL_OWNERS": "e2e/test_k8s_day2.py: the shard owners' replicas through its image change (default 1; a figure with 2)",
    "TW_KAFKA_START_TIMEOUT": "scripts/kafka.sh: seconds to wait for the broker",
    "TW_KAFKA_HEAP": "scripts/kafka.sh: the broker's JVM heap",
    "TW_KAFKA_INSTANCE": "scripts/kafka.sh: a second, independent broker (.run/kafka-<instance>/)",
    "TW_KAFKA_BROKERS": "scripts/kafka.sh: a KRaft cluster of that many brokers, each also a controller "
                        "(replication 3, min.insync.replicas 2, the transaction state log replicated; "
                        "`kafka.sh stop|kill|start|restart I` acts on broker I); the `kafka_cluster3` "
                        "fixture's instance (`e2e/test_three_brokers.py`, `tests/test_kafka_cluster.py`)",
    "TW_KAFKA_AUTO_CREATE": "scripts/kafka.sh: whether the broker creates topics on first use (default true)",
    "TW_REDIS_START_TIMEOUT": "scripts/redis.sh: seconds to wait for redis-server",
    "TW_KAFKA_SASL_SSL": "scripts/kafka.sh: add a SASL_SSL listener (locally made CA, SCRAM and PLAIN users)",
    "TW_KAFKA_SASL_SSL_BOOTSTRAP": "scripts/kafka.sh: (written to its .env) the SASL_SSL listener's address",
    "TW_KAFKA_SASL_SSL_CAFILE": "scripts/kafka.sh: (written to its .env) the CA that signed the broker",
    "TW_KAFKA_SASL_SSL_USERNAME": "scripts/kafka.sh: (written to its .env) the SCRAM and PLAIN user",
    "TW_KAFKA_SASL_SSL_PASSWORD_FILE": "scripts/kafka.sh: (written to its .env) that user's password file",
    "TW_REDIS_INSTANCE": "scripts/redis.sh: a second, independent server (.run/redis-<instance>/)",
    "TW_REDIS_TLS": "scripts/redis.sh: the server requires TLS and a password (rediss://)",
    "TW_CACHE_DIR": "scripts/k8s.sh, helm.sh, image.py, spark.sh: build cache (default ~/.cache/timerwheel)",
    "TW_HELM_VERSION": "scripts/helm.sh: the helm version to build (default v3.22.0)",
    "TW_PROMETHEUS_VERSION": "scripts/prometheus.sh: the Prometheus Go module version to build (default v0.316.0)",
    "TW_PROMETHEUS_OPERATOR_VERSION": "scripts/prometheus.sh crds: the Prometheus Operator whose CRDs to use (default v0.85.0)",
    "TW_LISTEN_HOST": "scripts/kafka.sh, redis.sh: an address of this machine to listen on too",
    "TW_KAFKA_EXTERNAL_BOOTSTRAP": "scripts/kafka.sh env: the listener on TW_LISTEN_HOST",
    "TW_REDIS_EXTERNAL_URL": "scripts/redis.sh env: the server on TW_LISTEN_HOST",
    "TW_K8S_START_TIMEOUT": "scripts/k8s.sh: seconds to wait for each component",
    "TW_K8S_GO": "scripts/k8s.sh: the go binary that builds Kubernetes",
    "TW_K8S_NICE": "scripts/k8s.sh: nice level of the builds",
    "TW_K8S_UP_TIMEOUT": "e2e k8s fixture: seconds for scripts/k8s.sh up (a cold build)",
    "TW_KUBECTL": "scripts/k8s.sh env: the cached kubectl",
    "TW_K8S_HOST_IP": "scripts/k8s.sh env: the node's address pods reach the host on",
    "TW_K8S_IMAGE": "scripts/k8s.sh env: the image loaded into the cluster",
}
#: Prefix of the benchmarks' own variables (bench/).
TOOLING_PREFIX = "TW_BENCH_"


def known_env_var(var: str) -> bool:
    return var in ENV_VARS or var in OTHER_ENV_VARS or var in TOOLING_ENV_VARS or var.startswith(TOOLING_PREFIX)


# Kubernetes' service links: for a Service "tw-x" with port 8080/TCP named "http", kubelet gives
# every pod of the namespace TW_X_SERVICE_HOST=10.0.0.1, TW_X_SERVICE_PORT=8080,
# TW_X_SERVICE_PORT_HTTP=8080, TW_X_PORT=tcp://10.0.0.1:8080, TW_X_PORT_8080_TCP=tcp://10.0.0.1:8080,
# and TW_X_PORT_8080_TCP_PROTO=tcp / _PORT=8080 / _ADDR=10.0.0.1. The chart names no Service
# tw-* and turns links off, but a user's own Service may still be named so. Each form is
# recognised by its name AND the shape of its value, so a misspelt setting that happens to end
# in _PORT (TW_HTPP_PORT=8080) is still refused.
_IP = r"[0-9.]+|[0-9A-Fa-f:.]+"
_PROTO = r"TCP|UDP|SCTP"
_SERVICE_VAR_FORMS = (
    (re.compile(r"TW_\w+_SERVICE_HOST"), re.compile(_IP)),
    (re.compile(r"TW_\w+_SERVICE_PORT(_\w+)?"), re.compile(r"\d+")),
    (re.compile(r"TW_\w+_PORT"), re.compile(rf"(tcp|udp|sctp)://(\[?({_IP})\]?):\d+")),
    (re.compile(rf"TW_\w+_PORT_\d+_({_PROTO})"), re.compile(rf"(tcp|udp|sctp)://(\[?({_IP})\]?):\d+")),
    (re.compile(rf"TW_\w+_PORT_\d+_({_PROTO})_PROTO"), re.compile(r"tcp|udp|sctp")),
    (re.compile(rf"TW_\w+_PORT_\d+_({_PROTO})_PORT"), re.compile(r"\d+")),
    (re.compile(rf"TW_\w+_PORT_\d+_({_PROTO})_ADDR"), re.compile(_IP)),
)


def kubernetes_service_var(var: str, value: str) -> bool:
    """``var=value`` is one of the service-link variables kubelet injects (see above)."""
    return any(name.fullmatch(var) and shape.fullmatch(value) for name, shape in _SERVICE_VAR_FORMS)
