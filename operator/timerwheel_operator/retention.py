"""The timer topic's ``retention.ms``, kept at least 1.5 x the roll window.

A rolled message is read again from the timer topic when its roll slot fires, up to one roll
window after it was written (ARCHITECTURE §5): a topic that deletes records sooner loses it. The
stages refuse to start on such a topic; the operator keeps the topic right before that happens.
Every round (at most every ``CHECK_EVERY_MS``, at once while a window change waits) it reads
``retention.ms`` through Kafka's admin API and, with ``spec.kafka.manageRetention`` (default
true), raises it to the need. It never lowers it. Without that, or when the admin call is not
allowed (ACLs, credentials the operator does not have), a window change that needs more
retention is refused (``window``: ``WindowChangeRefused`` naming ``retention.ms``, the value found
and the value needed) and the old window keeps running.

``Admin`` is the door (tests give a fake); ``KafkaAdmin`` is kafka-python's ``KafkaAdminClient``,
one per bootstrap, kept, connected as the stages connect (``kafka_access``: the TLS / SASL settings
and the Secret of ``spec.kafka``). A fresh broker answers ``NodeNotReadyError`` for a moment, so a
read is retried a few times before it counts as failed.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from timerwheel.errors import AccessError
from timerwheel.transports.kafka.access import check_kafka_access

from timerwheel_operator.kafka_access import Access, AccessUnknown
from timerwheel_operator.spec import in_spec_words

FACTOR = 1.5
#: How often the retention is read when no window change waits for it.
CHECK_EVERY_MS = 60_000


class TopicMissing(Exception):
    """The timer topic does not exist yet (the stages create it at their first start)."""


class Admin(Protocol):
    def retention_ms(self, kafka: Access, topic: str) -> int | None:
        """The topic's effective retention.ms; None when unlimited. TopicMissing, or any error."""

    def set_retention_ms(self, kafka: Access, topic: str, value: int) -> None: ...


def needed_ms(roll_window_ms: int) -> int:
    return math.ceil(roll_window_ms * FACTOR)


@dataclass(frozen=True, slots=True)
class Check:
    """One look at the timer topic's retention. ``state``: Ok, Raised (the operator set it),
    TooLow (below the need, not raised), Unknown (not readable: ``message`` says why)."""

    topic: str
    needed_ms: int
    managed: bool
    state: str
    found_ms: int | None = None  # None: unlimited (or unknown)
    message: str = ""
    checked_ms: int = 0

    @property
    def enough(self) -> bool:
        return self.state in ("Ok", "Raised")

    def to_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"topic": self.topic, "neededMs": self.needed_ms, "managed": self.managed,
                               "state": self.state, "checkedMs": self.checked_ms}
        if self.state != "Unknown":
            out["retentionMs"] = -1 if self.found_ms is None else self.found_ms
        if self.message:
            out["message"] = self.message[:300]
        return out

    @classmethod
    def of_status(cls, status: Mapping[str, Any] | None) -> Check | None:
        if not status or "state" not in status:
            return None
        found = status.get("retentionMs")
        return cls(str(status.get("topic", "")), int(status.get("neededMs") or 0), bool(status.get("managed")),
                   str(status["state"]), None if found is None or int(found) < 0 else int(found),
                   str(status.get("message") or ""), int(status.get("checkedMs") or 0))


def keep(admin: Admin, kafka: Access | Callable[[], Access], topic: str, roll_window_ms: int, manage: bool,
         now_ms: int) -> Check:
    """Read the retention and raise it to 1.5 x ``roll_window_ms`` when ``manage`` and too low.
    ``kafka``: the Kafka, or how to make it (``kafka_access.access``, which may fail)."""
    need = needed_ms(roll_window_ms)
    try:
        if callable(kafka):
            kafka = kafka()
        found = admin.retention_ms(kafka, topic)
    except TopicMissing:
        return Check(topic, need, manage, "Unknown", message=f"topic {topic} does not exist yet", checked_ms=now_ms)
    except AccessUnknown as exc:
        return Check(topic, need, manage, "Unknown", message=f"cannot reach Kafka as the stages do: {exc}",
                     checked_ms=now_ms)
    except AccessError as exc:
        return Check(topic, need, manage, "Unknown", message=f"Kafka refused the stages' settings: "
                     f"{in_spec_words(str(exc))}", checked_ms=now_ms)
    except Exception as exc:  # noqa: BLE001 - not allowed, unreachable: said in the status
        return Check(topic, need, manage, "Unknown", message=f"cannot read retention.ms of {topic}: "
                     f"{type(exc).__name__}: {exc}", checked_ms=now_ms)
    if found is None or found >= need:
        return Check(topic, need, manage, "Ok", found, checked_ms=now_ms)
    if not manage:
        return Check(topic, need, manage, "TooLow", found, f"retention.ms of {topic} is {found}, below "
                     f"{need} (1.5 x rollWindowMs); spec.kafka.manageRetention is false", now_ms)
    try:
        admin.set_retention_ms(kafka, topic, need)
    except Exception as exc:  # noqa: BLE001 - an ACL may forbid it
        return Check(topic, need, manage, "TooLow", found, f"retention.ms of {topic} is {found}, below {need}, "
                     f"and raising it failed: {type(exc).__name__}: {exc}", now_ms)
    return Check(topic, need, manage, "Raised", need, f"raised retention.ms of {topic} from {found} to {need}",
                 now_ms)


def refusal(check: Check, roll_window_ms: int) -> str | None:
    """Why a window change to ``roll_window_ms`` cannot be done for retention, or None."""
    if check.enough:
        return None
    need = needed_ms(roll_window_ms)
    if check.state == "Unknown":
        return f"retention.ms: cannot verify that {check.topic} keeps records {need} ms (1.5 x rollWindowMs): " \
               f"{check.message}"
    found = "unknown" if check.found_ms is None else str(check.found_ms)
    return f"retention.ms of {check.topic} is {found}, needs at least {need} (1.5 x rollWindowMs " \
           f"{roll_window_ms}): {check.message}"


class KafkaAdmin:
    """``Admin`` over kafka-python, one client per bootstrap, connected with the stages' TLS and SASL
    settings (``Access``; a client whose settings changed, e.g. a rotated password, is replaced).
    Before a secured client is made the broker is asked whether it accepts them
    (``transports.kafka.access.check_kafka_access``): a wrong password is one line naming the setting, not
    kafka-python's "Unable to bootstrap" after its timeout."""

    def __init__(self, timeout_ms: int = 10_000, attempts: int = 5) -> None:
        self.timeout_ms = timeout_ms
        self.attempts = attempts
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()
        #: one admin call at a time: kopf's handler and timer may reconcile together
        self._calls = threading.Lock()

    def _client(self, kafka: Access) -> Any:
        from kafka import KafkaAdminClient

        with self._lock:
            known = self._clients.get(kafka.bootstrap)
            if known is not None and known[0] == kafka.options:
                return known[1]
        if known is not None:
            self._drop(kafka.bootstrap)
        if kafka.config is not None:
            check_kafka_access(kafka.config, kafka.bootstrap, timeout_s=self.timeout_ms / 1000)
        client = KafkaAdminClient(bootstrap_servers=kafka.bootstrap.split(","), client_id="timerwheel-operator",
                                  request_timeout_ms=self.timeout_ms, **kafka.client_options())
        with self._lock:
            self._clients[kafka.bootstrap] = (kafka.options, client)
        return client

    def _drop(self, bootstrap: str) -> None:
        with self._lock:
            known = self._clients.pop(bootstrap, None)
        if known is not None:
            with contextlib.suppress(Exception):  # closing a broken client
                known[1].close()

    def retention_ms(self, kafka: Access, topic: str) -> int | None:
        from kafka.admin import ConfigResource, ConfigResourceType
        from kafka.errors import KafkaError, NodeNotReadyError, UnknownTopicOrPartitionError

        resource = ConfigResource(ConfigResourceType.TOPIC, topic, ["retention.ms"])
        for attempt in range(self.attempts):
            try:
                with self._calls:
                    found = self._client(kafka).describe_configs([resource], config_filter="all")
                break
            except UnknownTopicOrPartitionError:
                raise TopicMissing(topic) from None
            except NodeNotReadyError:  # a fresh broker: ask again
                if attempt == self.attempts - 1:
                    raise
                time.sleep(0.5 * (attempt + 1))
            except KafkaError:
                self._drop(kafka.bootstrap)
                raise
        entry = (found.get("topic") or {}).get(topic, {}).get("retention.ms")
        if entry is None or entry.get("value") is None:
            raise TopicMissing(topic)
        value = int(entry["value"])
        return None if value < 0 else value

    def set_retention_ms(self, kafka: Access, topic: str, value: int) -> None:
        from kafka.admin import ConfigResource, ConfigResourceType

        resource = ConfigResource(ConfigResourceType.TOPIC, topic, {"retention.ms": str(value)})
        with self._calls:
            result = self._client(kafka).alter_configs([resource])
        outcome = (result.get("topic") or {}).get(topic) if isinstance(result, dict) else None
        if outcome is not None and not _ok(outcome):
            raise RuntimeError(f"alter_configs of {topic}: {outcome}")


def _ok(outcome: Any) -> bool:
    code = getattr(outcome, "errno", None)
    if code is None and isinstance(outcome, tuple | list) and outcome and isinstance(outcome[0], int):
        code = outcome[0]
    return code in (None, 0)
