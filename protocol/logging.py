"""Logging set-up: one line per event, as text or JSON (``--log-format json``).

Call ``configure_logging`` once per process; log events with ``log_event(logger, "event", key=value...)``
so the fields (``request_id``, ``worker_id``...) come out as JSON keys or ``key=value`` text. Lines meant
for the person running a command (``pdserve up``'s progress and ready block) go through ``say``: as
printed text, or as log events in the JSON format.

Libraries that print through a handler of their own are re-homed to the root logger's handler, so their
lines come out in the chosen format too (``rehome_library_loggers``): NIXL (``nixl_cu13``'s import gives
logger ``nixl`` a stdout handler) and transformers (its import gives logger ``transformers`` a stderr
handler); both set ``propagate`` off. They install the handler when imported, and pdserve imports them
late (NIXL when a KV transport is made, transformers with the model), from packages that may not import
this one (``kvtransfer``, ``engine``), so ``configure_logging`` also puts ``_RehomeAfterImport`` on
``sys.meta_path``: the import of such a library runs as usual and is followed by the re-homing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any, TextIO

# loggers of libraries that print through a handler of their own, not propagating to the root logger
LIBRARY_LOGGERS = ("nixl", "transformers")
# the modules whose import gives LIBRARY_LOGGERS those handlers (NIXL installs as nixl_cu13 / nixl_cu12,
# or as nixl, which imports one of them)
HANDLER_MODULES = frozenset({"nixl", "nixl_cu12", "nixl_cu13", "transformers"})
# in the JSON format no progress bar is drawn: (module, function) turning those of a library already
# imported off; HF_HUB_DISABLE_PROGRESS_BARS does it for one imported later (transformers' weight-loading
# bar follows huggingface_hub's setting as it stands when transformers is imported)
_PROGRESS_BARS_OFF = (("huggingface_hub.utils", "disable_progress_bars"),
                      ("transformers.utils.logging", "disable_progress_bar"))

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
    """Route the root logger to stderr with the chosen format, and the ``LIBRARY_LOGGERS`` to it, now and
    after each later import of a ``HANDLER_MODULES`` library (module docstring). In the JSON format also
    Python's warnings (``warnings.warn``) become log events of logger ``py.warnings``
    (``logging.captureWarnings``) and Hugging Face's progress bars (transformers' "Loading weights",
    downloads) are off: ``HF_HUB_DISABLE_PROGRESS_BARS=1`` in this process's environment, which the
    processes it starts inherit. In the text format warnings print as Python prints them and the bars
    are drawn.

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
    logging.captureWarnings(fmt == "json")
    if fmt == "json":
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        for module, off in _PROGRESS_BARS_OFF:
            if module in sys.modules:
                getattr(sys.modules[module], off)()
    if not any(isinstance(finder, _RehomeAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RehomeAfterImport())
    rehome_library_loggers()


def rehome_library_loggers(names: Sequence[str] = LIBRARY_LOGGERS) -> None:
    """Hand the records of the loggers ``names`` to the root logger's handler: their own handlers are
    removed and ``propagate`` is on. Their levels stay as the libraries set them (NIXL: info, or
    ``NIXL_LOG_LEVEL``; transformers: warning, or ``TRANSFORMERS_VERBOSITY``)."""
    for name in names:
        logger = logging.getLogger(name)
        for handler in logger.handlers[:]:
            logger.removeHandler(handler)
        logger.propagate = True


_FINDING: set[str] = set()  # HANDLER_MODULES names being looked up by a _RehomeAfterImport now


class _RehomeAfterImport(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: the import of a module in ``HANDLER_MODULES`` is found and run by the
    other finders and loaders as usual, then ``rehome_library_loggers`` runs."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in HANDLER_MODULES or fullname in _FINDING:
            return None  # in _FINDING: asked again from within this search (another such finder)
        _FINDING.add(fullname)
        try:
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                spec = find(fullname, path, target) if finder is not self and find is not None else None
                if spec is not None:
                    break
            else:
                return None
        finally:
            _FINDING.discard(fullname)
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None or getattr(exec_module, "rehomes", False):
            return spec  # a namespace package (no loader), or a shared loader already wrapped

        def exec_then_rehome(module: ModuleType) -> None:
            try:
                exec_module(module)
            finally:
                rehome_library_loggers()

        exec_then_rehome.rehomes = True  # type: ignore[attr-defined]
        loader.exec_module = exec_then_rehome  # type: ignore[method-assign]  # this module's loader only
        return spec


def json_format() -> bool:
    """Whether the root logger writes JSON lines (``configure_logging(fmt="json")``)."""
    return any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)


def say(logger: logging.Logger, msg: str, text: str | None = None, level: int = logging.INFO,
        stream: TextIO | None = None, **fields: Any) -> None:
    """Tell the person running a command ``msg``. In the JSON format (``json_format``) it is a log event
    of ``logger`` (``msg`` and ``fields``: one JSON line through the root handler, on stderr); in the text
    format ``text`` (default ``msg``; may span lines) is printed as is on ``stream`` (default stderr) and
    flushed, without ``fields``. Either way whatever ``--log-level`` is: the text is printed regardless,
    and so the event is written regardless of the loggers' levels."""
    if json_format():
        logger.handle(logger.makeRecord(logger.name, level, "", 0, msg, (), None, extra=fields))
    else:
        print(msg if text is None else text, file=stream if stream is not None else sys.stderr, flush=True)


def say_refused(command: str, why: str) -> None:
    """Why ``pdserve command`` does not start, or stops before serving: ``pdserve <command>: <why>`` on
    stderr, or with ``--log-format json`` one log event of logger ``pdserve.<command>`` at ERROR whose
    message is ``why`` and whose field ``refused`` is ``command`` (``say``), so a JSON log pipeline (the
    Kubernetes and docker-compose default) reads it like every other line."""
    say(logging.getLogger(f"pdserve.{command}"), why, f"pdserve {command}: {why}", logging.ERROR,
        refused=command)


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log ``event`` with structured ``fields`` (e.g. ``request_id=...``) as one line."""
    logger.log(level, event, extra=fields)
