"""Server-sent events: `data:` frames, an in-band error event, `data: [DONE]`.

Writes are awaited, so a slow reader holds the generator back (the engine's per-request output
slot then merges deltas) instead of buffering without bound. The caller owns the output iterator
and closes it in its `finally`, which aborts the request in the engine when the client leaves.
"""

from __future__ import annotations

from typing import AsyncIterator, Callable, Iterable

import structlog
from aiohttp import web

from compat.protocol import ENCODER
from server.errors import ApiError, from_exception

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: don't buffer the stream
}
DONE = b"data: [DONE]\n\n"

log = structlog.get_logger("llamaserve.sse")


def frame(obj: object) -> bytes:
    return b"data: " + ENCODER.encode(obj) + b"\n\n"


async def stream(
    request: web.Request,
    first: object,
    items: AsyncIterator,
    render: Callable[[object], object | None],
    head: Iterable[object],
    tail: Callable[[], Iterable[object]],
    done: bytes = DONE,
) -> web.StreamResponse:
    """Send head chunks, one chunk per item (`first`, then the rest), tail chunks, [DONE]
    (`done`: Llama Stack's clients parse every event as JSON, so its streams end without one).

    `first` was awaited before this call, so errors raised before any output (queue full, invalid
    request) still get a proper HTTP status instead of an in-band error."""
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    try:
        body = b"".join(frame(chunk) for chunk in head)
        chunk = render(first)
        if chunk is not None:
            body += frame(chunk)
        await response.write(body)
        async for item in items:
            chunk = render(item)
            if chunk is not None:
                await response.write(frame(chunk))
        await response.write(b"".join(frame(chunk) for chunk in tail()) + done)
    except ConnectionError:  # the client left; the caller's finally aborts the request
        return response
    except Exception as exc:  # noqa: BLE001 - any failure mid-stream becomes an in-band error event
        error = from_exception(exc)
        if error.status >= 500 and not isinstance(exc, ApiError):
            log.error("stream failed", error=str(exc), exc_info=not error.code)
        try:
            await response.write(b"data: " + error.to_json() + b"\n\n" + done)
        except ConnectionError:
            return response
    await response.write_eof()
    return response
