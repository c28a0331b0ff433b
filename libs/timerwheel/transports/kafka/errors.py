"""Errors of the Kafka commit log, and the one mapping of kafka-python's errors onto them.

``kafka_call`` wraps every call into kafka-python: a refused SASL login becomes ``AccessError``
naming the setting (not retried: the password is wrong), any other ``KafkaError`` becomes
``KafkaLogError`` (retriable: the stages back off and call again). ``REFUSED`` are the errors that
refuse one record for good (retrying it cannot succeed: the caller dead-letters it) and
``UNDECODABLE`` those of a batch that cannot be decoded (its partition is set aside).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import kafka.errors as kafka_errors

from timerwheel.errors import AccessError, TimerwheelError

__all__ = ["REFUSED", "UNDECODABLE", "KafkaLogError", "kafka_call", "refusal"]


class KafkaLogError(TimerwheelError):
    """A Kafka call failed or timed out. Retriable: the stages back off and call again.

    For ``append``, ``written[i]`` is ``(partition, offset)`` for each record that did land and
    ``None`` for each that did not.
    """

    def __init__(self, message: str, written: list[tuple[int, int] | None] | None = None,
                 refused: dict[int, str] | None = None, missing: dict[int, str] | None = None, *,
                 unknown_outcome: bool = False) -> None:
        super().__init__(message)
        self.written = written or []
        #: index -> why Kafka refuses that record for good (too large, invalid topic): retrying
        #: it cannot help; the caller dead-letters it instead.
        self.refused = refused or {}
        #: index -> the destination topic of a record that was not sent because the topic does
        #: not exist (no metadata within ``metadata_wait_s``); the caller holds or dead-letters it.
        self.missing = missing or {}
        #: A transaction's commit did not answer in time: it may have committed or not. The next
        #: ``init_transactions`` under its id decides, before anything else is written.
        self.unknown_outcome = unknown_outcome


#: Errors that refuse one record for good: retrying it cannot succeed. (``ValueError`` and
#: ``TypeError`` are kafka-python's for a record it cannot encode.)
REFUSED = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordListTooLargeError,
    kafka_errors.InvalidTopicError,
    kafka_errors.InvalidRecordError,
    kafka_errors.UnsupportedForMessageFormatError,
    ValueError,
    TypeError,
)

#: Errors of one batch that cannot be decoded: its partition is set aside, the others go on.
UNDECODABLE = (kafka_errors.CorruptRecordError, kafka_errors.UnsupportedCodecError)


def refusal(exc: BaseException) -> str:
    """Why Kafka refused a record (or could not decode a batch), for its dead letter or log line."""
    return f"{type(exc).__name__}: {exc}"[:300]


@contextmanager
def kafka_call(what: str) -> Iterator[None]:
    """Run a kafka-python call, raising ``AccessError`` for refused credentials and
    ``KafkaLogError`` (saying ``what`` failed) for any other Kafka error."""
    try:
        yield
    except KafkaLogError:
        raise
    except kafka_errors.SaslAuthenticationFailedError as exc:
        raise AccessError("TW_KAFKA_SASL_PASSWORD", f"{what}: Kafka refused the SASL credentials: {exc}") from None
    except kafka_errors.KafkaError as exc:
        raise KafkaLogError(f"{what} failed: {exc}") from exc
