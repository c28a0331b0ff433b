"""The wire contract: parsing, validation reasons, tickets and header rewriting."""

from __future__ import annotations

import pytest
from timerwheel.config import TimerConfig
from timerwheel.errors import InvalidTimerMessage
from timerwheel.records import Record
from timerwheel.wire import (
    Ticket,
    TimerRequest,
    TimerRules,
    default_id,
    delivered_headers,
    id_hash,
    marker_target,
    record_revision,
    record_roll,
    revision_id_hash,
    rolled_headers,
)

NOW = 1_700_000_000_000


def rec(*headers: tuple[str, str], value: bytes = b"v", ts: int = NOW, partition: int = 3, offset: int = 7) -> Record:
    return Record("__timer", partition, offset, ts, b"k", value, tuple((k, v.encode()) for k, v in headers))


@pytest.fixture
def rules() -> TimerRules:
    return TimerRules(TimerConfig(max_delay_ms=10 * 86_400_000))


def test_delay_ms_is_relative_to_the_record_timestamp(rules: TimerRules) -> None:
    req = rules.parse(rec(("tw-topic", "orders"), ("tw-delay-ms", "5000"), ts=NOW - 1000), NOW)
    assert req.deliver_ms == NOW + 4000
    assert req.topic == "orders" and not req.cancel and req.roll == 0


def test_deliver_at_is_absolute_and_id_defaults_to_partition_offset(rules: TimerRules) -> None:
    req = rules.parse(rec(("tw-topic", "orders"), ("tw-deliver-at", str(NOW + 123))), NOW)
    assert req.deliver_ms == NOW + 123
    assert req.message_id == default_id(3, 7) == "3-7"


def test_delay_levels_map_through_the_table() -> None:
    rules = TimerRules(TimerConfig(delay_levels_ms=(1000, 5000, 60_000)))
    for level, ms in ((1, 1000), (2, 5000), (3, 60_000)):
        assert rules.parse(rec(("tw-topic", "t"), ("tw-delay-level", str(level))), NOW).deliver_ms == NOW + ms
    with pytest.raises(InvalidTimerMessage, match=r"unknown tw-delay-level 4 \(levels are 1..3\)"):
        rules.parse(rec(("tw-topic", "t"), ("tw-delay-level", "4")), NOW)


def test_default_delay_levels_are_rocketmq_4x() -> None:
    levels = TimerConfig().delay_levels_ms
    assert len(levels) == 18
    assert levels[0] == 1000 and levels[3] == 30_000 and levels[16] == 3_600_000 and levels[17] == 7_200_000


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ((("tw-delay-ms", "5"),), "missing tw-topic"),
        ((("tw-topic", "t"),), "no delivery time"),
        ((("tw-topic", "t"), ("tw-delay-ms", "abc")), "unparsable tw-delay-ms"),
        ((("tw-topic", "t"), ("tw-deliver-at", "-5")), "negative tw-deliver-at"),
        ((("tw-topic", "t"), ("tw-deliver-at", "99999999999999999999")), "tw-deliver-at out of range"),
        ((("tw-topic", "t"), ("tw-delay-ms", str(11 * 86_400_000))), "exceeds max_delay_ms"),
        ((("tw-topic", "t"), ("tw-delay-level", "19")), "unknown tw-delay-level 19"),
        ((("tw-topic", "__consumer_offsets"), ("tw-delay-ms", "5")), "not allowed by allow_topics"),
        ((("tw-topic", "__timer"), ("tw-delay-ms", "5")), "destination is the timer topic"),
        ((("tw-topic", "../etc"), ("tw-delay-ms", "5")), "invalid destination topic name"),
        ((("tw-topic", "t"), ("tw-delay-ms", "5"), ("tw-deliver-at", "5")), "more than one delivery time"),
    ],
)
def test_invalid_records_name_their_reason(rules: TimerRules, headers: tuple[tuple[str, str], ...], reason: str) -> None:
    with pytest.raises(InvalidTimerMessage, match=reason):
        rules.parse(rec(*headers), NOW)


def test_oversized_record_is_rejected() -> None:
    rules = TimerRules(TimerConfig(max_record_bytes=2048))
    with pytest.raises(InvalidTimerMessage, match="exceeds max_record_bytes 2048"):
        rules.parse(rec(("tw-topic", "t"), ("tw-delay-ms", "5"), value=b"x" * 4096), NOW)


def test_allow_list_is_a_full_match_of_any_pattern() -> None:
    rules = TimerRules(TimerConfig(allow_topics=(r"orders\..*", "audit")))
    assert rules.topic_allowed("orders.eu") and rules.topic_allowed("audit")
    assert not rules.topic_allowed("audit-log") and not rules.topic_allowed("payments")


def test_cancel_needs_no_topic_and_keeps_the_target_id(rules: TimerRules) -> None:
    req = rules.parse(rec(("tw-cancel", "abc"), ("tw-deliver-at", str(NOW + 5))), NOW)
    assert req.cancel and req.message_id == "abc" and req.deliver_ms == NOW + 5


def test_ticket_round_trips_through_str() -> None:
    t = Ticket(2, NOW + 5000, "id.with.dots")
    assert Ticket.parse(str(t)) == t
    with pytest.raises(ValueError, match="not a timerwheel ticket"):
        Ticket.parse("garbage")


def test_a_revision_ticket_is_tw2_and_a_tw1_ticket_is_revision_0() -> None:
    t = Ticket(2, NOW + 5000, "id.with.dots", 3)
    assert str(t) == f"tw2.2.{NOW + 5000}.3.id.with.dots" and Ticket.parse(str(t)) == t
    assert Ticket.parse(f"tw1.2.{NOW}.x.y") == Ticket(2, NOW, "x.y", 0) and str(Ticket(2, NOW, "x.y")).startswith("tw1.")
    for bad in (f"tw2.2.{NOW}.x.id", f"tw2.2.{NOW}.1.", "tw2.2"):
        with pytest.raises(ValueError, match="not a timerwheel ticket"):
            Ticket.parse(bad)


def test_a_reschedule_is_a_marker_of_the_revision_before_and_revisions_hash_apart(rules: TimerRules) -> None:
    moved = rec(("tw-topic", "orders"), ("tw-id", "m"), ("tw-revision", "2"), ("tw-deliver-at", str(NOW + 9)),
                ("tw-replaces", str(NOW + 5)))
    req = rules.parse(moved, NOW)
    assert (req.cancel, req.message_id, req.revision, req.replaces, req.deliver_ms) == (False, "m", 2, NOW + 5, NOW + 9)
    assert marker_target(moved) == ("m", 1)
    assert marker_target(rec(("tw-cancel", "m"), ("tw-revision", "1"), ("tw-deliver-at", str(NOW)))) == ("m", 1)
    assert marker_target(rec(("tw-topic", "orders"), ("tw-id", "m"), ("tw-deliver-at", str(NOW)))) is None
    assert revision_id_hash("m", 0) == id_hash("m")
    assert len({revision_id_hash("m", r) for r in range(4)}) == 4


def test_delivered_headers_drop_control_headers_and_stamp_times() -> None:
    r = rec(("tw-topic", "t"), ("tw-delay-ms", "5"), ("user", "u1"), ("tw-partition", "0"), ("tw-id", "3-7"),
            ("tw-roll", "02"), ("user", "u2"))
    stamped = delivered_headers(r, dict(r.headers), str(NOW - 10).encode(), str(NOW).encode())
    assert stamped == (("user", b"u1"), ("user", b"u2"), ("tw-id", b"3-7"), ("tw-roll", b"2"),
                       ("tw-enqueued-at", str(NOW - 10).encode()), ("tw-delivered-at", str(NOW).encode()))
    only_control = rec(("tw-topic", "t"), ("tw-deliver-at", str(NOW)))  # no user header; the default id
    assert delivered_headers(only_control, dict(only_control.headers), b"1", b"2") == (
        ("tw-id", f"{only_control.partition}-{only_control.offset}".encode()), ("tw-roll", b"0"),
        ("tw-enqueued-at", b"1"), ("tw-delivered-at", b"2"))


def test_rolled_headers_make_the_time_absolute_and_count_the_roll() -> None:
    r = rec(("tw-topic", "t"), ("tw-delay-ms", "5"), ("user", "u1"), ("tw-roll", "1"))
    headers = dict(rolled_headers(r, "3-7", NOW + 99, 1, NOW - 1))
    assert headers["tw-deliver-at"] == str(NOW + 99).encode()
    assert headers["tw-roll"] == b"2" and headers["tw-id"] == b"3-7" and "tw-delay-ms" not in headers
    assert headers["user"] == b"u1" and headers["tw-topic"] == b"t"


def test_id_hash_is_stable_64_bit() -> None:
    assert id_hash("abc") == id_hash("abc") != id_hash("abd")
    assert 0 <= id_hash("abc") < 2**64


def test_id_hash_is_the_stored_format() -> None:
    """The TimerLog keeps these hashes: BLAKE2b-64 of the UTF-8 id, little-endian, for ever."""
    import hashlib

    for message_id in ("abc", "0-12345", "é-ünïcode", "x" * 1024):
        digest = hashlib.blake2b(message_id.encode(), digest_size=8).digest()
        assert id_hash(message_id) == int.from_bytes(digest, "little")
    assert id_hash("abc") == 0x5995D533D814BBD8  # pinned: a change here orphans every stored hash


def test_valid_delivery_times_of_a_batch_agree_with_delivery_time() -> None:
    rules = TimerRules(TimerConfig())
    absolute = [*(rec(("tw-topic", "t"), ("tw-deliver-at", str(NOW + i))) for i in range(5)),
                rec(("tw-topic", "t"), ("tw-deliver-at", " 42"))]  # spaces: _decimal strips them too
    mixed = [*absolute, rec(("tw-topic", "t"), ("tw-delay-ms", "250")), rec(("tw-topic", "t"), ("tw-delay-level", "3")),
             rec(("tw-topic", "t"), ("tw-deliver-at", " 17 "))]
    for batch in (absolute, mixed):
        expected = [rules.delivery_time(r, NOW, check_max=False) for r in batch]
        assert rules.valid_delivery_times(batch, [dict(r.headers) for r in batch]) == expected
    assert rules.valid_delivery_times([], []) == []


def test_the_short_path_of_parse_agrees_with_the_full_checks() -> None:
    """A common record gives the request its headers say; the same record taken off the short path
    (a ``tw-roll: 0`` added, its size given as before) gives the same request through every check."""
    rules = TimerRules(TimerConfig(max_delay_ms=10 * 86_400_000, max_record_bytes=2048))
    rules.parse(rec(("tw-topic", "orders"), ("tw-deliver-at", str(NOW))), NOW)  # the destination is known now
    at = ("tw-deliver-at", str(NOW + 5_000))
    cases = [
        rec(("tw-topic", "orders"), at),
        rec(("tw-topic", "orders"), at, ("tw-id", "order-17"), ("user", "u")),
        rec(("tw-topic", "orders"), at, ("tw-topic", "orders")),  # repeated: the last one wins
        rec(("tw-topic", "orders"), at, ("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01")),
        rec(("tw-topic", "orders"), ("tw-deliver-at", str(NOW + 10 * 86_400_000))),  # exactly the max delay
        rec(("tw-topic", "orders"), at, value=b"x" * (2048 - 1 - 14 - 26)),  # exactly max_record_bytes
    ]
    for r in cases:
        size = len(r.key or b"") + len(r.value or b"") + sum(len(k) + len(v) for k, v in r.headers)
        hdr = dict(r.headers)
        raw_id = hdr.get("tw-id")
        expected = TimerRequest(int(hdr["tw-deliver-at"]), False, raw_id.decode() if raw_id else "3-7", "orders", 0,
                                r.timestamp_ms, r.partition, r.offset, size)
        assert rules.parse(r, NOW) == expected, r.headers
        assert rules.parse(r, NOW, hdr, size) == expected, r.headers  # its size given, as the Spark jobs do
        full = r._replace(headers=(*r.headers, ("tw-roll", b"0")))
        assert rules.parse(full, NOW, dict(full.headers), size) == expected, r.headers
    refused = [
        (rec(("tw-topic", "orders"), ("tw-deliver-at", str(NOW + 10 * 86_400_000 + 1))), "exceeds max_delay_ms"),
        (rec(("tw-topic", "orders"), at, value=b"x" * 2048), "exceeds max_record_bytes"),
        (rec(("tw-topic", "orders"), at, ("tw-id", "")), "tw-id must be"),
        (rec(("tw-topic", "orders"), at, ("tw-id", "i" * 1025)), "tw-id must be"),
        (rec(("tw-topic", "orders"), ("tw-deliver-at", "9" * 16)), "out of range"),
        # zero-padded past 20 digits: a valid number, yet what parse's grammar refuses (issue 16)
        (rec(("tw-topic", "orders"), ("tw-deliver-at", str(NOW + 5_000).zfill(21))), "unparsable tw-deliver-at"),
        (rec(("tw-topic", "orders"), at, ("tw-delay-ms", "5")), "more than one delivery time"),
        (rec(("tw-topic", "__internal"), at), "not allowed"),
    ]
    for r, reason in refused:
        with pytest.raises(InvalidTimerMessage, match=reason):
            rules.parse(r, NOW)


def test_roll_and_revision_read_back_from_a_timer_record_default_to_zero() -> None:
    """What the console and ``pending`` show of a record they read back: ``tw-roll`` and
    ``tw-revision`` as numbers, 0 when absent or not a run of digits (a producer's own header)."""
    assert (record_roll(rec(("tw-roll", "3"))), record_revision(rec(("tw-revision", "2")))) == (3, 2)
    assert (record_roll(rec()), record_revision(rec())) == (0, 0)
    assert (record_roll(rec(("tw-roll", "-1"))), record_revision(rec(("tw-revision", "x")))) == (0, 0)
