"""The codec check: a process that reads Kafka refuses to start when a compression codec cannot
be decoded here.

A producer may compress with any of Kafka's codecs (gzip, snappy, lz4, zstd); without the
library kafka-python decodes one with, the first such batch fails every poll of its partition
(``UnsupportedCodecError``) and everything behind it on that partition stalls. ``check_codecs``
names each missing library instead, before any client is made.
"""

from __future__ import annotations

from timerwheel.errors import TimerwheelError

__all__ = ["KafkaCodecError", "check_codecs"]


class KafkaCodecError(TimerwheelError):
    """A Kafka compression codec cannot be decoded here: a library is missing."""


def check_codecs() -> None:
    """Raise ``KafkaCodecError`` naming each codec that kafka-python cannot decode here."""
    from kafka import codec

    # Kafka's codecs beyond gzip, the pip package kafka-python decodes each with, and its probe.
    libraries = (("snappy", "python-snappy", codec.has_snappy), ("lz4", "lz4", codec.has_lz4),
                 ("zstd", "zstandard", codec.has_zstd))
    missing = [f"{name} (pip install {package})" for name, package, available in libraries if not available()]
    if missing:
        raise KafkaCodecError(f"Kafka compression codecs cannot be decoded, a library is missing: "
                              f"{', '.join(missing)}")
