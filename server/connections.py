"""Bounds on what one client can hold: a request body that stalls, a connection that idles, and
how many connections are open at once.

aiohttp has no body-read timeout: a client that sends headers and part of a body, then nothing,
holds its socket, its handler and (uploading) a temporary file for good. `body_stall_middleware`
drops it once its body has sent nothing for `body_read_timeout_s`: 408, its handler cancelled
(an upload's temporary file removed). It bounds silence, not the whole body, as nginx's
client_body_timeout does, so a 200 MB upload over a slow link is never cut. It covers every body
reader (JSON routes, registration, batch creation, every multipart part) in one place.

`CappedSite` is the listener: past `max_connections` open connections, one more is answered 503
(OpenAI's error shape, Retry-After) and closed before anything of it is read. Connections that
idle, or never send a request, are closed after `keepalive_timeout_s` (aiohttp's keep-alive timer
runs from the moment a connection opens; server/drain.py passes it).
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Protocol, cast

import structlog
from aiohttp import web

from server.app_keys import CONFIG_KEY
from server.errors import ApiError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

REFUSAL_RETRY_AFTER_S = 1
REFUSAL_LINGER_S = 5.0  # a refused client gets this long to read the 503 and close before the socket is aborted
REFUSAL_LOG_INTERVAL_S = 10.0

log = structlog.get_logger("llamaserve.connections")


# --------------------------------------------------------------------------- stalled bodies
class _Payload(Protocol):  # aiohttp's StreamReader, as watch_body reads it
    total_bytes: int

    def is_eof(self) -> bool: ...


class _Deadline(Protocol):  # asyncio.Timeout
    def reschedule(self, when: float | None) -> None: ...


@web.middleware
async def body_stall_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    payload = request.content
    if payload.is_eof():  # no body, or all of it here already: nothing left to stall
        return await handler(request)
    stall_s = request.app[CONFIG_KEY].body_read_timeout_s
    deadline = asyncio.timeout(None)
    watch: asyncio.Task | None = None
    try:
        async with deadline:
            watch = asyncio.create_task(watch_body(payload, deadline, stall_s))
            return await handler(request)
    except TimeoutError:
        if not deadline.expired():  # the handler's own timeout, not ours
            raise
        raise ApiError(408, f"The request body sent nothing for {stall_s:g} s (--body-read-timeout-s); send it "
                       "again.", code="body_timeout", error_type="timeout_error") from None
    finally:
        if watch is not None:
            watch.cancel()


async def watch_body(payload: _Payload, deadline: _Deadline, stall_s: float, *,
                     sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
    """Expire `deadline` (which cancels the handler) once the body has received nothing for a whole
    period of `stall_s`; checked once a period, so a stalled body goes after one to two of them."""
    received = -1
    while not payload.is_eof():
        if payload.total_bytes == received:
            deadline.reschedule(asyncio.get_running_loop().time())
            return
        received = payload.total_bytes
        await sleep(stall_s)


# --------------------------------------------------------------------------- the connection cap
class CappedSite(web.BaseSite):
    """aiohttp's TCPSite with a cap: its listener hands a new connection to the app's handler only
    while fewer than `max_connections` are open."""

    __slots__ = ("_host", "_port", "_max_connections")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, max_connections: int,
                 backlog: int = 128) -> None:
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port
        self._max_connections = max_connections

    @property
    def port(self) -> int:
        """The bound port (the one asked for, until started: 0 picks a free one)."""
        return self._server.sockets[0].getsockname()[1] if self._server else self._port

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None  # BaseSite refuses a runner that is not set up
        cap = _Cap(server, self._max_connections)
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Gate(cap), self._host, self._port, backlog=self._backlog)


class _Cap:
    """What every connection's gate shares: the server's live connections, the limit, the refusal."""

    def __init__(self, server: web.Server, max_connections: int) -> None:
        self.server = server
        self.max_connections = max_connections
        error = ApiError(503, f"This server has its maximum of {max_connections} connections open "
                         "(--max-connections); retry shortly.", code="too_many_connections")
        body = error.to_json()
        self.refusal = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(body)}\r\nRetry-After: {REFUSAL_RETRY_AFTER_S}\r\n"
                        "Connection: close\r\n\r\n").encode() + body
        self.next_warning_s = 0.0  # a flood of refusals logs one line per REFUSAL_LOG_INTERVAL_S

    def admits(self) -> bool:
        return len(self.server.connections) < self.max_connections

    def warn(self) -> None:
        now_s = asyncio.get_running_loop().time()
        if now_s >= self.next_warning_s:
            self.next_warning_s = now_s + REFUSAL_LOG_INTERVAL_S
            log.warning("refusing connections: at the connection cap", max_connections=self.max_connections)


class _Gate(asyncio.Protocol):
    """Each new connection's first protocol. When the connection opens it either hands it to aiohttp's
    handler (the count is exact: each opening is decided after the previous admitted one was counted
    by the server) or answers 503 and closes, dropping what the client still sends."""

    def __init__(self, cap: _Cap) -> None:
        self.cap = cap
        self.abort_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # a TCP transport (uvloop's is no asyncio.Transport subclass)
        if self.cap.admits():
            handler = self.cap.server()
            transport.set_protocol(handler)
            handler.connection_made(transport)
            return
        self.cap.warn()
        transport.write(self.cap.refusal)
        # FIN after the response, not close(): closing with the client's request unread sends a reset,
        # which can destroy the 503 before the client reads it
        transport.write_eof()
        self.abort_timer = asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        pass  # the refused client's request: read and dropped

    def eof_received(self) -> bool:
        return False  # the client closed too: close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self.abort_timer is not None:
            self.abort_timer.cancel()
