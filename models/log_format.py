"""Log lines as text or as JSON objects: how every ``hivepath`` command sets up logging.

``text`` is ``HH:MM:SS LEVEL logger: message``. ``json`` (``--log-format json``) makes each line one
JSON object with the fields a peer's events use, ``time`` (Unix seconds) and ``event`` (``log``, or
the event a record stands for), then ``level``, ``logger`` and ``message``, ``exc`` with a traceback,
and any fields a record carries in ``extra={"fields": {...}}`` (:func:`event_extra`). Records of
hivemind (which otherwise prints through its own coloured handler) and warnings become such lines too.

Standard library only: the coordinator's image copies this file alone.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import traceback
from typing import Any, Optional, TextIO

__all__ = ["LOG_FORMATS", "JsonFormatter", "TEXT_FORMAT", "setup_logging", "event_extra"]

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_RESERVED = ("time", "event", "level", "logger", "message", "exc")
_LEVELS = {logging.CRITICAL: "CRITICAL", logging.ERROR: "ERROR", logging.WARNING: "WARNING", logging.INFO: "INFO",
           logging.DEBUG: "DEBUG"}
"""A JSON line's ``level`` for the standard levels, whatever names a library gave them (hivemind, once
imported, names WARNING ``WARN`` for every logger of the process)."""


def event_extra(event: str, **fields: Any) -> dict[str, Any]:
    """``extra=`` for a log record that stands for ``event`` with ``fields``: a JSON line carries them
    as its own fields (``{"event": "round", "module": "L0M1", ...}``); a text line shows the message."""
    return {"fields": {"event": event, **fields}}


def _plain(value: Any) -> Any:
    """``value`` as JSON can hold it: non-finite numbers become None, anything unknown its ``str``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        fields = dict(getattr(record, "fields", None) or {})
        line: dict[str, Any] = {"time": round(record.created, 3), "event": str(fields.pop("event", "log")),
                                "level": _LEVELS.get(record.levelno, record.levelname), "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            line["exc"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        for key, value in fields.items():
            line[key if key not in _RESERVED else f"field_{key}"] = _plain(value)
        return json.dumps(line, allow_nan=False, ensure_ascii=False)


class _ThroughRoot(logging.Logger):
    """The ``hivemind`` logger in JSON mode: hivemind gives it a handler of its own and stops it
    propagating when it is first imported; this one keeps propagating to the root's handler and
    takes no handler, so hivemind's records are JSON lines like every other."""

    @property
    def propagate(self) -> bool:  # type: ignore[override]
        return True

    @propagate.setter
    def propagate(self, value: bool) -> None:
        pass

    def addHandler(self, hdlr: logging.Handler) -> None:  # noqa: N802 - logging's name
        pass


def _route_hivemind_through_root() -> None:
    existing = logging.Logger.manager.loggerDict.get("hivemind")
    if isinstance(existing, _ThroughRoot):
        return
    if isinstance(existing, logging.Logger):  # hivemind already imported: undo its handler instead
        for handler in list(existing.handlers):
            existing.removeHandler(handler)
        existing.propagate = True
        return
    previous = logging.getLoggerClass()
    logging.setLoggerClass(_ThroughRoot)
    try:
        logging.getLogger("hivemind")
    finally:
        logging.setLoggerClass(previous)


def setup_logging(level: str = "INFO", fmt: str = "text", stream: Optional[TextIO] = None) -> None:
    """Log records at ``level`` and above to ``stream`` (stderr) as ``fmt`` lines (:data:`LOG_FORMATS`)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; use {' or '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
        _route_hivemind_through_root()
        logging.captureWarnings(True)
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT, datefmt="%H:%M:%S"))
    handler.hivepath = True  # type: ignore[attr-defined]  # replaced by the next call, others kept
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "hivepath", False):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level))
