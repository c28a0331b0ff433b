"""Structured logs: one JSON line per event, always with stage and shard.

An error logged with ``exc=True`` (inside the ``except`` block) or ``exc=the_exception`` carries
its whole traceback in the ``traceback`` field (and its last line in ``error``), once, where the
error is handled: the code that handles an error logs it (with its traceback) and does not
raise it on; code that raises it on does not log it (the handler up the stack will). A failure
that repeats logs its traceback on the first time of a streak, then a short line now and then.

    log = stage_logger("enqueue-put", shard=3)
    log.info("checkpoint", write_ms=W, flushed_pos=pos)

Hot loops log per batch or per event, never per message.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "event": record.getMessage(),
        }
        fields = getattr(record, "tw_fields", None)
        if fields:
            line.update(fields)
        if record.exc_info:
            # The whole traceback, in the same one line (JSON escapes its newlines).
            text = self.formatException(record.exc_info)
            line["error"] = text.splitlines()[-1]
            line["traceback"] = text
        return json.dumps(line, default=str, separators=(",", ":"))


class StageLogger:
    """A logger bound to a stage and a shard (or ``-`` for stateless stages)."""

    def __init__(self, stage: str, shard: int | str = "-") -> None:
        self._log = logging.getLogger(f"timerwheel.{stage}")
        self._base = {"stage": stage, "shard": shard}

    def bind(self, **fields: Any) -> StageLogger:
        child = StageLogger.__new__(StageLogger)
        child._log = self._log
        child._base = {**self._base, **fields}
        return child

    def _emit(self, level: int, event: str, exc: bool | BaseException, fields: dict[str, Any]) -> None:
        if self._log.isEnabledFor(level):
            self._log.log(level, event, extra={"tw_fields": {**self._base, **fields}}, exc_info=exc)

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, event, False, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(logging.INFO, event, False, fields)

    def warning(self, event: str, exc: bool | BaseException = False, **fields: Any) -> None:
        self._emit(logging.WARNING, event, exc, fields)

    def error(self, event: str, exc: bool | BaseException = False, **fields: Any) -> None:
        self._emit(logging.ERROR, event, exc, fields)


def stage_logger(stage: str, shard: int | str = "-") -> StageLogger:
    return StageLogger(stage, shard)


def configure_logging(level: str = "INFO", stream: Any = None) -> None:
    """JSON lines to stderr (or ``stream``). Called once by the CLI and the services."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("timerwheel")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
