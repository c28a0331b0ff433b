"""Configuration: every bad value fails at the edge, naming the field or variable."""

from __future__ import annotations

import re

import pytest
from timerwheel.config import ENV_VARS, TimerConfig, parse_duration_ms
from timerwheel.errors import ConfigError


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"tick_ms": 7}, "tick_ms"),
        ({"roll_window_ms": 150}, "roll_window_ms"),
        ({"wheel_span_ms": 86_400_000}, "wheel_span_ms"),
        ({"segment_bytes": 1000}, "segment_bytes"),
        ({"shards": 0}, "shards"),
        ({"allow_topics": ("(",)}, "allow_topics"),
        ({"dlq_topic": "__timer"}, "dlq_topic"),
        ({"delivery_guarantee": "exactly-twice"}, "delivery_guarantee"),
        ({"progress_topic": "__timer_dlq"}, "progress_topic"),
        ({"transaction_timeout_ms": 999}, "transaction_timeout_ms"),
    ],
)
def test_invalid_values_name_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        TimerConfig(**changes)  # type: ignore[arg-type]
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_wheel_defaults_to_twice_the_roll_window() -> None:
    cfg = TimerConfig(tick_ms=1000, roll_window_ms=86_400_000)
    assert cfg.wheel_slots == 2 * 86_400


def test_env_errors_name_the_variable() -> None:
    with pytest.raises(ConfigError, match="^TW_TICK_MS: must be one of"):
        TimerConfig.from_env({"TW_TICK_MS": "7"})
    with pytest.raises(ConfigError, match="^TW_SHARDS: cannot parse 'two'"):
        TimerConfig.from_env({"TW_SHARDS": "two"})


def test_an_unknown_tw_variable_is_refused_with_a_suggestion() -> None:
    with pytest.raises(ConfigError, match=r"^TW_SHARD: unknown variable \(did you mean TW_SHARDS\?\)"):
        TimerConfig.from_env({"TW_SHARD": "4"})
    with pytest.raises(ConfigError, match=r"^TW_NOTHING_LIKE_IT: unknown variable; docs/configuration.md"):
        TimerConfig.from_env({"TW_NOTHING_LIKE_IT": "1"})
    # The project's own tooling variables and other prefixes are not the service's business.
    cfg = TimerConfig.from_env({"TW_KEEP_SERVERS": "1", "TW_BENCH_MESSAGES": "5", "TWX": "1", "PATH": "/bin"})
    assert cfg.shards == TimerConfig().shards


def test_env_values_are_parsed() -> None:
    cfg = TimerConfig.from_env({"TW_ROLL_WINDOW_MS": "1d", "TW_ALLOW_TOPICS": "a.*, b", "TW_FSYNC": "false",
                                "TW_DELAY_LEVELS": "1s 2s"})
    assert cfg.roll_window_ms == 86_400_000 and cfg.allow_topics == ("a.*", "b")
    assert cfg.fsync is False and cfg.delay_levels_ms == (1000, 2000)


def test_exactly_once_settings_default_and_parse() -> None:
    cfg = TimerConfig()
    assert (cfg.delivery_guarantee, cfg.effective_progress_topic, cfg.transaction_timeout_ms) == \
        ("at-least-once", "__timer_progress", 10_000)
    cfg = TimerConfig.from_env({"TW_DELIVERY_GUARANTEE": "exactly-once", "TW_PROGRESS_TOPIC": "p",
                                "TW_TRANSACTION_TIMEOUT_MS": "20s"})
    assert (cfg.delivery_guarantee, cfg.effective_progress_topic, cfg.transaction_timeout_ms) == ("exactly-once", "p", 20_000)
    with pytest.raises(ConfigError, match="^TW_DELIVERY_GUARANTEE: must be at-least-once or exactly-once"):
        TimerConfig.from_env({"TW_DELIVERY_GUARANTEE": "once"})


def test_every_env_var_maps_to_a_field() -> None:
    fields = set(TimerConfig.__dataclass_fields__)
    assert all(attr in fields for attr, _kind, _doc in ENV_VARS.values())


def test_durations() -> None:
    assert parse_duration_ms("250ms") == 250 and parse_duration_ms("2h") == 7_200_000 and parse_duration_ms("15") == 15
    with pytest.raises(ValueError):
        parse_duration_ms("soon")


@pytest.mark.parametrize(("text", "ms"), [("1h30m", 5_400_000), ("1.5s", 1_500), ("2w", 1_209_600_000),
                                          ("1d12h", 129_600_000), (".5s", 500), ("0", 0), (" 10m ", 600_000)])
def test_durations_as_people_write_them(text: str, ms: int) -> None:
    assert parse_duration_ms(text) == ms


@pytest.mark.parametrize(("text", "says"), [
    ("-5s", "a duration cannot be negative, got '-5s'"), ("-5", "cannot be negative"),
    ("5x", "expected a duration such as 5000 (ms), 250ms, 5s, 1.5s, 10m, 1h30m, 2d, 2w (units ms s m h d w)"),
    ("1.5", "expected a duration"), ("1h 30m", "expected a duration"), ("0.5ms", "whole milliseconds"),
])
def test_a_bad_duration_says_why_and_lists_the_forms(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        parse_duration_ms(text)


def test_an_env_duration_takes_the_same_forms() -> None:
    assert TimerConfig.from_env({"TW_ROLL_WINDOW_MS": "1d12h"}).roll_window_ms == 129_600_000


#: What kubelet injects for a Service "tw-queue" (ClusterIP 10.96.4.7) with ports 8080/TCP "http"
#: and 9090/UDP, and for an IPv6 Service "tw-six": pkg/kubelet/envvars's forms.
KUBELET_SERVICE_LINKS = {
    "TW_QUEUE_SERVICE_HOST": "10.96.4.7",
    "TW_QUEUE_SERVICE_PORT": "8080",
    "TW_QUEUE_SERVICE_PORT_HTTP": "8080",
    "TW_QUEUE_PORT": "tcp://10.96.4.7:8080",
    "TW_QUEUE_PORT_8080_TCP": "tcp://10.96.4.7:8080",
    "TW_QUEUE_PORT_8080_TCP_PROTO": "tcp",
    "TW_QUEUE_PORT_8080_TCP_PORT": "8080",
    "TW_QUEUE_PORT_8080_TCP_ADDR": "10.96.4.7",
    "TW_QUEUE_PORT_9090_UDP": "udp://10.96.4.7:9090",
    "TW_QUEUE_PORT_9090_UDP_PROTO": "udp",
    "TW_QUEUE_PORT_9090_UDP_PORT": "9090",
    "TW_QUEUE_PORT_9090_UDP_ADDR": "10.96.4.7",
    "TW_SIX_SERVICE_HOST": "fd00:10:96::4",
    "TW_SIX_PORT": "tcp://[fd00:10:96::4]:8080",
}


def test_kubernetes_service_link_variables_are_not_settings() -> None:
    cfg = TimerConfig.from_env({**KUBELET_SERVICE_LINKS, "TW_SHARDS": "3"})
    assert cfg.shards == 3


@pytest.mark.parametrize(("var", "value"), [
    ("TW_HTPP_PORT", "8080"),           # a misspelt TW_HTTP_PORT: ends like a link, is not one
    ("TW_SHARD", "4"),
    ("TW_QUEUE_SERVICE_HOST", "four"),  # a link's name with a value kubelet never writes
    ("TW_QUEUE_PORT", "8080"),
    ("TW_QUEUE_PORT_8080_TCP_PROTO", "http"),
])
def test_a_misspelt_setting_is_still_refused_beside_service_links(var: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{var}: unknown variable"):
        TimerConfig.from_env({**KUBELET_SERVICE_LINKS, var: value})


def test_byte_bounds_refuse_bad_values_naming_the_variable() -> None:
    with pytest.raises(ConfigError, match="^TW_BATCH_BYTES: must be >= 65536, got 1000"):
        TimerConfig.from_env({"TW_BATCH_BYTES": "1000"})
    with pytest.raises(ConfigError, match=r"^TW_QUEUE_BYTES: must be >= batch_bytes \(4194304\), got 1048576"):
        TimerConfig.from_env({"TW_QUEUE_BYTES": "1048576"})
    with pytest.raises(ConfigError, match="^TW_READ_CACHE_BYTES: must be >= 0, got -1"):
        TimerConfig.from_env({"TW_READ_CACHE_BYTES": "-1"})
    with pytest.raises(ConfigError, match="^TW_QUEUE_BYTES: cannot parse '16MB'"):
        TimerConfig.from_env({"TW_QUEUE_BYTES": "16MB"})
    cfg = TimerConfig.from_env({"TW_QUEUE_BYTES": "8388608", "TW_BATCH_BYTES": "1048576", "TW_READ_CACHE_BYTES": "0"})
    assert (cfg.queue_bytes, cfg.batch_bytes, cfg.read_cache_bytes) == (8 * 2**20, 2**20, 0)


def test_the_most_a_burst_is_read_ahead_is_the_look_ahead_and_max_in_flights_worth_within_the_roll_window() -> None:
    """``lookahead_max_ms``: TW_LOOKAHEAD_MS + max_in_flight records at LOOKAHEAD_RECORDS_PER_S (a
    second per 2,500), never past what the roll window allows TW_LOOKAHEAD_MS (window / 6 - 2
    ticks, 60 s at most), and 0 when reading ahead is off."""
    assert TimerConfig().lookahead_max_ms == 1_000 + 8_000  # 2-day window, max_in_flight 20,000
    assert TimerConfig(max_in_flight=5_000).lookahead_max_ms == 3_000
    assert TimerConfig(lookahead_ms=2_500, max_in_flight=1_000_000).lookahead_max_ms == 60_000
    assert TimerConfig(roll_window_ms=20_000, tick_ms=100).lookahead_max_ms == 20_000 // 6 - 200  # 3,133
    assert TimerConfig(roll_window_ms=20_000, tick_ms=100).effective_lookahead_ms == 1_000
    assert TimerConfig(lookahead_ms=0).lookahead_max_ms == 0
