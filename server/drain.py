"""Graceful stop: on SIGTERM/SIGINT keep listening while in-flight requests finish, refusing new work.

While draining, /ready answers 503 (so a balancer stops sending), /health and /metrics still
answer, and every other new request gets 503 `shutting_down` with Retry-After: a client on a kept
connection, or one that reaches this replica before the balancer notices, is told to go elsewhere
instead of finding the port closed. Once no request is in flight, or `drain_timeout_s` has passed,
aiohttp stops: it closes the listener, cancels what is still running (handler cancellation aborts
those requests in the engine) and runs the cleanup context, which stops every engine and its
model-parallel workers.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Awaitable, Callable

import structlog
from aiohttp import web

from server.app_keys import CONFIG_KEY, STATE_KEY
from server.connections import CappedSite
from server.errors import ApiError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})  # answered while draining, not counted as work
DRAIN_RETRY_AFTER_S = 5  # a balancer retries on another replica; this one is back after a restart and a load
FINAL_GRACE_S = 1.0  # after the drain bound: how long aiohttp still waits before cancelling handlers

log = structlog.get_logger("llamaserve.shutdown")


def shutting_down_error() -> ApiError:
    return ApiError(503, "the server is shutting down; retry on another replica or after it restarts",
                    code="shutting_down", headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)})


@web.middleware
async def drain_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse new work while draining; count the requests in flight so the drain knows when it is done."""
    if request.path in PROBE_PATHS:
        return await handler(request)
    state = request.app[STATE_KEY]
    if state.draining:
        raise shutting_down_error()
    state.in_flight += 1
    state.idle.clear()
    try:
        return await handler(request)
    finally:
        state.in_flight -= 1
        if state.in_flight == 0:
            state.idle.set()


async def drain(app: web.Application, drain_timeout_s: float) -> None:
    """Refuse new requests and wait (at most `drain_timeout_s`) for the ones in flight to end."""
    state = app[STATE_KEY]
    state.draining = True
    log.info("draining", in_flight=state.in_flight, drain_timeout_s=drain_timeout_s)
    try:
        await asyncio.wait_for(state.idle.wait(), drain_timeout_s)
    except TimeoutError:
        log.warning("drain bound reached; cancelling the requests still running", in_flight=state.in_flight)


def run(app: web.Application, *, host: str, port: int, drain_timeout_s: float,
        loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
    """web.run_app with a drain phase before the listener closes: serve until SIGTERM/SIGINT, drain, stop."""
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_serve(app, host=host, port=port, drain_timeout_s=drain_timeout_s))


def make_runner(app: web.Application) -> web.AppRunner:
    return web.AppRunner(
        app,
        handler_cancellation=True,  # a client that disconnects cancels its handler, which aborts its request
        access_log=None,  # our middleware logs one structured line per request
        shutdown_timeout=FINAL_GRACE_S,  # the drain already waited for in-flight requests
        # from the moment a connection opens: also bounds one that never sends a request (server/connections.py)
        keepalive_timeout=app[CONFIG_KEY].keepalive_timeout_s,
    )


async def _serve(app: web.Application, *, host: str, port: int, drain_timeout_s: float) -> None:
    runner = make_runner(app)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await CappedSite(runner, host, port, max_connections=app[CONFIG_KEY].max_connections).start()
        await stop.wait()
        await drain(app, drain_timeout_s)
    finally:
        await runner.cleanup()
