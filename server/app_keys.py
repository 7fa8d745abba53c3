"""The application's typed keys (aiohttp AppKey / RequestKey) and the state they hold: one module
that app.py, routes.py and the other handlers import, so none of them imports another for a key."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import structlog
from aiohttp import web

from server.config import ServerConfig
from server.metrics import ServerMetrics


@dataclass(slots=True)
class ServerState:
    started: bool = False  # configured models registered (and loaded unless skip_initialize)
    draining: bool = False  # SIGTERM seen: /ready says 503 so balancers stop sending
    startup_errors: list[str] = field(default_factory=list)
    startup_task: asyncio.Task | None = None
    in_flight: int = 0  # requests being handled, probes aside (server/drain.py)
    idle: asyncio.Event = field(default_factory=lambda: _set(asyncio.Event()))  # set while in_flight == 0


def _set(event: asyncio.Event) -> asyncio.Event:
    event.set()
    return event


CONFIG_KEY = web.AppKey("config", ServerConfig)
STATE_KEY = web.AppKey("state", ServerState)
METRICS_KEY = web.AppKey("metrics", ServerMetrics)
LOGGER_KEY = web.AppKey("access_logger", structlog.typing.FilteringBoundLogger)
# Request-scoped fields for the access log line (model, token counts, TTFT).
LOG_FIELDS = web.RequestKey("log_fields", dict)
REQUEST_ID = web.RequestKey("request_id", str)
