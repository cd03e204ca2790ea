"""Logging set-up: one line per event, as text or JSON (``--log-format json``).

Call ``configure_logging`` once per process; log events with ``log_event(logger, "event", key=value...)``
so the fields (``request_id``, ``worker_id``...) come out as JSON keys or ``key=value`` text.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

# record attributes that are not event fields (uvicorn adds ``color_message``: the message with ANSI codes)
_RESERVED = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime", "color_message"}


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _RESERVED}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (seconds since epoch), level, logger, msg and the extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": round(record.created, 6), "level": record.levelname.lower(),
                               "logger": record.name, "msg": record.getMessage()}
        out.update(_fields(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """``time level logger msg key=value ...`` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%H:%M:%S", time.localtime(record.created))
        extra = " ".join(f"{k}={v}" for k, v in _fields(record).items())
        line = f"{ts} {record.levelname:<7} {record.name} {record.getMessage()}"
        if extra:
            line += " " + extra
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    """Route the root logger to stderr with the chosen format.

    Raises:
        ValueError: ``fmt`` is not ``text`` or ``json``, or ``level`` is not a logging level name.
    """
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', got {fmt!r}")
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log ``event`` with structured ``fields`` (e.g. ``request_id=...``) as one line."""
    logger.log(level, event, extra=fields)
