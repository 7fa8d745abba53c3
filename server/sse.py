"""Server-sent events: `data:` frames, an in-band error event, `data: [DONE]`.

Writes are awaited, so a slow reader holds the generator back (the engine's per-request output
slot then merges deltas) instead of buffering without bound. A reader that takes nothing for
`stream_write_timeout_s` is dropped (its connection aborted), and no stream outlives
`max_stream_duration_s`: either way the model lease is released, so DELETE and hot switches never
wait on a client. The caller owns the output iterator and closes it in its `finally`, which aborts
the request in the engine when the client leaves.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, Iterable, NamedTuple

import structlog
from aiohttp import web

from compat.protocol import ENCODER
from server.app_keys import CONFIG_KEY, REQUEST_ID
from server.errors import ApiError, from_exception_logged

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: don't buffer the stream
}
DONE = b"data: [DONE]\n\n"

log = structlog.get_logger("llamaserve.sse")


class Event(NamedTuple):
    """A named event (`event: NAME` before its data), as the Responses and Anthropic streams send."""

    name: str
    data: object


def frame(obj: object) -> bytes:
    """One `data:` frame; an Event also names itself; a list is its items' frames, in order."""
    if isinstance(obj, Event):
        return b"event: " + obj.name.encode() + b"\ndata: " + ENCODER.encode(obj.data) + b"\n\n"
    if isinstance(obj, list):
        return b"".join(frame(item) for item in obj)
    return b"data: " + ENCODER.encode(obj) + b"\n\n"


def error_frame(error: ApiError) -> bytes:
    """OpenAI's in-band error: the error body as one `data:` frame."""
    return b"data: " + error.to_json() + b"\n\n"


async def stream(
    request: web.Request,
    first: object,
    items: AsyncIterator,
    render: Callable[[object], object | None],
    head: Iterable[object],
    tail: Callable[[], Iterable[object]],
    done: bytes = DONE,
    error_frame: Callable[[ApiError], bytes] = error_frame,
) -> web.StreamResponse:
    """Send head chunks, one chunk per item (`first`, then the rest), tail chunks, [DONE]
    (`done`: Llama Stack's clients parse every event as JSON, so its streams end without one; nor do
    the Responses and Anthropic streams, whose `error_frame` is their own error event).

    `first` was awaited before this call, so errors raised before any output (queue full, invalid
    request) still get a proper HTTP status instead of an in-band error."""
    config = request.app[CONFIG_KEY]
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)

    async def write(data: bytes) -> None:
        if not may_wait(request.transport, len(data)):  # the usual token: no timer armed and cancelled
            await response.write(data)
            return
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for wraps every write (one a token per
        # stream) in a new Task, several event-loop turns each; this costs one timer handle
        timeout = asyncio.timeout(config.stream_write_timeout_s)
        try:
            async with timeout:
                await response.write(data)
        except TimeoutError:
            if timeout.expired():  # this write's own limit; the stream's lifetime is handled below
                raise _SlowReader() from None
            raise

    try:
        async with asyncio.timeout(config.max_stream_duration_s):
            body = b"".join(frame(chunk) for chunk in head)
            chunk = render(first)
            if chunk is not None:
                body += frame(chunk)
            await write(body)
            async for item in items:
                chunk = render(item)
                if chunk is not None:
                    await write(frame(chunk))
            await write(b"".join(frame(chunk) for chunk in tail()) + done)
    except (ConnectionError, _SlowReader):  # the client left or stopped reading; the caller's finally aborts
        _drop(request)
        return response
    except TimeoutError:  # the stream's lifetime is over: tell the client, then end
        log.warning("stream ended at its maximum duration", max_stream_duration_s=config.max_stream_duration_s)
        error = ApiError(408, f"The stream reached this server's maximum duration of "
                         f"{config.max_stream_duration_s:g} s.", code="stream_timeout", error_type="timeout_error")
        try:
            await write(error_frame(error) + done)
        except (ConnectionError, _SlowReader):
            _drop(request)
            return response
    except Exception as exc:  # noqa: BLE001 - any failure mid-stream becomes an in-band error event
        error = from_exception_logged(exc, "stream failed", request_id=request[REQUEST_ID], path=request.path)
        try:
            await write(error_frame(error) + done)
        except (ConnectionError, _SlowReader):
            _drop(request)
            return response
    await response.write_eof()
    return response


def may_wait(transport: asyncio.BaseTransport | None, num_bytes: int) -> bool:
    """Whether writing num_bytes more may wait for the reader, so needs the slow-reader timeout.

    A write waits only while the transport holds more than its high-water mark unsent (the
    protocol is paused; aiohttp then drains). When the socket took every earlier byte and this
    write alone fits under the mark, it cannot pause it: it returns without waiting, and arming
    and cancelling a timer for it (asyncio.timeout: a fifth of the event loop's Python per
    streamed token at one stream, py-spy, bench/NOTES.md) buys nothing. A reader that stops reading
    fills the socket, the transport starts holding bytes, and its next write is timed again."""
    if transport is None:
        return True
    try:  # uvloop's transports have these methods without being asyncio.WriteTransport instances
        _, high_water = transport.get_write_buffer_limits()
        return transport.get_write_buffer_size() > 0 or num_bytes > high_water
    except (AttributeError, NotImplementedError):  # a transport that cannot tell: always timed
        return True


class _SlowReader(Exception):
    """The client took no data for stream_write_timeout_s."""


def _drop(request: web.Request) -> None:
    """Abort the connection, so that aiohttp does not wait on it again to finish the response."""
    if request.transport is not None:
        request.transport.abort()
