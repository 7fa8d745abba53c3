"""structlog setup: JSON lines for machines or a console renderer for people; stdlib logs join in."""

from __future__ import annotations

import logging
import sys
from typing import Literal, TextIO

import structlog

LogFormat = Literal["json", "console"]


def configure_logging(log_format: LogFormat = "json", level: str = "info", stream: TextIO | None = None) -> None:
    """Called once by the CLI (process setup, like installing uvloop); apps and tests never call it."""
    level_no = logging.getLevelName(level.upper())
    if not isinstance(level_no, int):
        raise ValueError(f"unknown log level {level!r}")
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = structlog.processors.JSONRenderer() if log_format == "json" else structlog.dev.ConsoleRenderer()
    # Engine and library logs (stdlib logging) go through the same renderer and the same handler.
    handler = logging.StreamHandler(stream or sys.stderr)
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=lambda *_args: _HandlerWriter(handler),
        cache_logger_on_first_use=True,
    )
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processor=renderer,
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared, structlog.processors.format_exc_info],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level_no)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # our access line replaces it


class _HandlerWriter:
    """structlog's output through the stdlib handler's stream and lock: one line, one write, so
    the access log (event loop) and engine logs (other threads) never share a line."""

    def __init__(self, handler: logging.StreamHandler) -> None:
        self._handler = handler

    def msg(self, message: str) -> None:
        with self._handler.lock:
            self._handler.stream.write(message + "\n")
            self._handler.stream.flush()

    log = debug = info = warn = warning = error = err = critical = exception = fatal = failure = msg
