"""The request path every entry point shares: the online OpenAI handlers (server/routes.py), the
Llama Stack routes and the Batch API runner. A model's engine is leased for the whole request,
the prompt is planned (off the event loop when large) by its kind (server/endpoints.py), the engine
requests are submitted together and their outputs merged by choice index, and the kind's assembler
turns them into OpenAI objects.
"""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable, Sequence

from aiohttp import web

from compat import protocol as p
from engine.types import EngineClient, EngineRequest, RequestOutput
from server.app_keys import CONFIG_KEY, LOG_FIELDS
from server.errors import ApiError
from server.registry import REGISTRY_KEY

# Bodies above this are decoded, nesting-checked, tokenized (and detokenized, and batch items
# planned) off the event loop, so one huge request can't stall every stream and /health: msgspec
# takes about 2.5 s for a 30 MB body on 2 cores. Smaller ones stay inline, where a thread hop would
# cost more than the work. The tokenizers release the GIL while they encode.
INLINE_MAX_BYTES = 64 << 10

Indexed = tuple[int, RequestOutput]


def lease(request: web.Request, model_id: str) -> contextlib.AbstractAsyncContextManager[EngineClient]:
    """The model's engine for the whole request (a dead one is retired and reloaded by the registry)."""
    return request.app[REGISTRY_KEY].lease(model_id)


def log_fields(request: web.Request, **fields: Any) -> None:
    request[LOG_FIELDS].update(fields)


def json_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=p.ENCODER.encode(obj), status=status, content_type="application/json")


async def decode_body(request: web.Request, decoder: Any) -> tuple[Any, int]:
    """The request, decoded and checked (off the loop when large), and its body's size in bytes."""
    body = await request.read()  # raises 413 past client_max_size
    req = await off_loop_if_large(len(body), p.decode, decoder, body)
    log_fields(request, model=getattr(req, "model", None))
    return req, len(body)


async def off_loop_if_large(body_bytes: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) (decoding a body, rendering and tokenizing a prompt), in a thread when the body is large."""
    if body_bytes > INLINE_MAX_BYTES:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


async def merged_outputs(engine: EngineClient, requests: Sequence[EngineRequest]) -> AsyncIterator[Indexed]:
    """Yield (choice index, delta) from all requests, submitted together so the engine batches them.
    Closing this iterator closes every engine iterator, which aborts unfinished requests."""
    if len(requests) == 1:
        async with aclosing(engine.generate(requests[0])) as outputs:
            async for out in outputs:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=2 * len(requests))  # bounded: backpressure reaches the engine
    done = object()

    async def pump(index: int, request: EngineRequest) -> None:
        try:
            async with aclosing(engine.generate(request)) as outputs:
                async for out in outputs:
                    await queue.put((index, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((index, exc))
        await queue.put((index, done))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(outputs: AsyncIterator[Indexed], assembler: Any) -> Any:
    async with aclosing(outputs):
        async for index, out in outputs:
            assembler.add(index, out)
    return assembler.response()


def check_batch_size(request: web.Request, count: int, param: str) -> None:
    limit = request.app[CONFIG_KEY].max_batch_request_items
    if count > limit:
        raise ApiError(400, f"{param} has {count} items; this server accepts at most {limit}", param=param,
                       code="batch_too_large")
