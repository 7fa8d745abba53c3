"""OpenAI's Responses API: POST /v1/responses and the stored responses around it.

    POST /v1/responses                      create (stream, background, previous_response_id)
    GET /v1/responses/{id}                  a stored response (a background one: its state so far)
    DELETE /v1/responses/{id}
    GET /v1/responses/{id}/input_items      its input items (after, limit, order)
    POST /v1/responses/{id}/cancel          stop a background response

A request becomes a chat request (compat/responses.py) and runs as chat does (server/chat_bridge.py).
Stored responses live in a ResponseStore beside the Batch API's database; the store is an optional
subsystem (server/subsystems.py): when it cannot open, requests that need it (store true, the GET
and DELETE routes, previous_response_id, background) answer 503 `responses_unavailable` with the
reason, and `store: false` requests serve on. It is tried again on use after a growing delay.

Background responses run in tasks the service owns (no module state): each holds its model's lease
like a request, is cancelled by /cancel or by the server's stop, and writes its end to the store.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
import uuid
from contextlib import aclosing
from pathlib import Path
from typing import Any, AsyncIterator, NamedTuple

import msgspec
import structlog
from aiohttp import web

from compat import protocol as p
from compat import responses as r
from compat.batch_protocol import ObjectList
from engine.types import InvalidRequest
from server.app_keys import CONFIG_KEY
from server.auth import OWNER
from server.chat_bridge import ChatRun, not_found, start_chat, stream_events
from server.config import ServerConfig
from server.errors import ApiError, from_exception_logged
from server.registry import REGISTRY_KEY, ModelRegistry
from server.request_flow import decode_body, json_response, lease, off_loop_if_large
from server.response_store import ResponseStore
from server.sse import Event
from server.subsystems import SUBSYSTEMS_KEY, Backoff, Subsystems, describe_failure

log = structlog.get_logger("llamaserve.responses")

RESPONSES_SUBSYSTEM = "responses"
OPEN_BACKOFF = Backoff(initial_s=1.0, max_s=60.0)  # between attempts to open a store that failed
_ITEMS_DECODER = msgspec.json.Decoder(list[dict[str, Any]])


class ResponseService:
    """The store (opened on first use) and the background responses running, for one app."""

    def __init__(self, config: ServerConfig, registry: ModelRegistry, subsystems: Subsystems) -> None:
        self.config = config
        self.registry = registry
        self.subsystems = subsystems
        subsystems.register(RESPONSES_SUBSYSTEM)
        self._store: ResponseStore | None = None
        self._temp_dir: Path | None = None
        self._failures = 0
        self._opening = asyncio.Lock()
        self.tasks: dict[str, asyncio.Task] = {}  # background response id -> its task
        self.closing = False  # a background response cancelled now failed (the server stopped); else a client cancelled it

    async def store(self) -> ResponseStore:
        """The open store, or a 503 saying why it is not (and when it is tried again)."""
        if self._store is not None:
            return self._store
        async with self._opening:
            state = self.subsystems.get(RESPONSES_SUBSYSTEM)
            if self._store is None and (state.retry_at_s is None or time.monotonic() >= state.retry_at_s):
                self.subsystems.starting(RESPONSES_SUBSYSTEM)
                try:
                    self._store = await asyncio.to_thread(self._open)
                    self._failures = 0
                    self.subsystems.up(RESPONSES_SUBSYSTEM)
                except Exception as exc:  # noqa: BLE001 - an optional subsystem fails alone
                    delay_s = OPEN_BACKOFF.delay_s(self._failures)
                    self._failures += 1
                    self.subsystems.down(RESPONSES_SUBSYSTEM, describe_failure(exc), retry_in_s=delay_s)
                    log.error("responses store failed to open", exc_info=exc, retry_in_s=delay_s)
        if self._store is None:
            raise self.subsystems.unavailable(RESPONSES_SUBSYSTEM, "The Responses store")
        return self._store

    def _open(self) -> ResponseStore:
        root = self.config.batch_dir
        if root is None:
            if self._temp_dir is None:
                self._temp_dir = Path(tempfile.mkdtemp(prefix="llamaserve-responses-"))
            root = self._temp_dir
        return ResponseStore(root, max_stored=self.config.responses_max_stored,
                             max_bytes=self.config.responses_max_bytes, retention_s=self.config.responses_retention_s)

    async def close(self) -> None:
        self.closing = True
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        if self._store is not None:
            await asyncio.to_thread(self._store.close)
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)


RESPONSES_KEY = web.AppKey("response_service", ResponseService)


def add_responses_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", retrieve_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", list_input_items)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)
    app.cleanup_ctx.append(_responses_context)


async def _responses_context(app: web.Application) -> AsyncIterator[None]:
    service = ResponseService(app[CONFIG_KEY], app[REGISTRY_KEY], app[SUBSYSTEMS_KEY])
    app[RESPONSES_KEY] = service
    try:
        yield
    finally:
        await service.close()


def _service(request: web.Request) -> ResponseService:
    return request.app[RESPONSES_KEY]


# --------------------------------------------------------------------------- create
async def create_response(request: web.Request) -> web.StreamResponse:
    req, size = await decode_body(request, r.RESPONSES_DECODER)
    r.check_request(req)
    service = _service(request)
    owner = request[OWNER]
    history: list[r.Item] = []
    if req.previous_response_id is not None:
        history = await _conversation(service, req.previous_response_id, owner)
    chat, inputs = await off_loop_if_large(size, _translate, req, history)
    store = await service.store() if req.store else None
    response_id = f"resp_{uuid.uuid4().hex}"
    builder = r.ResponseBuilder(r.response_shell(req, response_id, status="in_progress"))
    if req.background:
        async with lease(request, req.model) as engine:  # refusals (400) come back now, not as a failed response
            run = await start_chat(size, chat, engine, response_id, r.CHAT_PARAMS)
            await run.outputs.aclose()  # nothing was submitted: an async generator runs on first read
        return await _start_background(service, store, owner, req, chat, size, builder, inputs)
    async with lease(request, req.model) as engine:
        run = await start_chat(size, chat, engine, response_id, r.CHAT_PARAMS)
        try:
            if not req.stream:
                async for chunk in run.chunks():
                    builder.chunk(chunk)
                builder.finish(run.finish_reason, run.assembler.usage())
                await _save(store, owner, builder, inputs)
                return json_response(builder.response)
            async with aclosing(_with_end(run, store, owner, builder, inputs)) as items:
                return await stream_events(request, items, lambda item: _render(builder, item),
                                           lambda: _events(builder.head()), lambda error: _error_frame(builder, error))
        finally:
            await run.aclose(request)


def _translate(req: r.ResponsesRequest, history: list[r.Item]) -> tuple[p.ChatCompletionRequest, bytes]:
    """The chat request, and the input items as stored (history first); off the loop when the body is large."""
    items = r.with_ids(r.input_items(req.input))
    return r.to_chat(req, history, items), msgspec.json.encode([*history, *items])


class _Final(NamedTuple):
    events: list[dict[str, Any]]  # the closing events, sent once the response is stored


async def _with_end(run: ChatRun, store: ResponseStore | None, owner: str, builder: r.ResponseBuilder,
                    inputs: bytes) -> AsyncIterator[Any]:
    """The chat chunks, then the closing events once the response is stored: a client that reads
    response.completed can use its id at once (previous_response_id, GET)."""
    async for chunk in run.chunks():
        yield chunk
    events = builder.finish(run.finish_reason, run.assembler.usage())
    await _save(store, owner, builder, inputs)
    yield _Final(events)


def _render(builder: r.ResponseBuilder, item: Any) -> Event | list[Event] | None:
    events = item.events if isinstance(item, _Final) else builder.chunk(item)
    if len(events) == 1:  # a delta: most of a stream
        return _event(events[0])
    return _events(events) if events else None


def _event(event: Any) -> Event:
    return Event(event["type"] if isinstance(event, dict) else event.type, event)


def _events(events: list[Any]) -> list[Event]:
    return [_event(event) for event in events]


def _error_frame(builder: r.ResponseBuilder, error: ApiError) -> bytes:
    event = r.error_event(builder.sequence_number, error.code, error.message, error.param)
    return b"event: error\ndata: " + p.ENCODER.encode(event) + b"\n\n"


async def _save(store: ResponseStore | None, owner: str, builder: r.ResponseBuilder, inputs: bytes) -> None:
    if store is None:
        return
    response = builder.response
    await store.io(lambda: store.put(owner, response.id, created_at=response.created_at, status=response.status,
                                     response=p.ENCODER.encode(response), input_items=inputs))


async def _conversation(service: ResponseService, response_id: str, owner: str) -> list[r.Item]:
    """The previous response's input items and output, as the next turn's history."""
    store = await service.store()
    stored = await store.io(store.get, response_id, owner)
    if stored is None:
        raise not_found("response", response_id, param="previous_response_id", code="previous_response_not_found")
    if stored.status in ("queued", "in_progress"):
        raise InvalidRequest(f"previous response '{response_id}' has not finished yet", param="previous_response_id")
    response = msgspec.json.decode(stored.response, type=r.ResponseObject)
    return [*r.input_items(_ITEMS_DECODER.decode(stored.input_items), "previous_response_id"),
            *r.output_as_items(response.output)]


# --------------------------------------------------------------------------- background
async def _start_background(service: ResponseService, store: ResponseStore, owner: str, req: r.ResponsesRequest,
                            chat: p.ChatCompletionRequest, size: int, builder: r.ResponseBuilder,
                            inputs: bytes) -> web.Response:
    builder.response.status = "queued"
    await _save(store, owner, builder, inputs)
    task = asyncio.create_task(_run_background(service, store, owner, req, chat, size, builder))
    service.tasks[builder.response.id] = task
    task.add_done_callback(lambda _: service.tasks.pop(builder.response.id, None))
    return json_response(builder.response)


async def _run_background(service: ResponseService, store: ResponseStore, owner: str, req: r.ResponsesRequest,
                          chat: p.ChatCompletionRequest, size: int, builder: r.ResponseBuilder) -> None:
    response = builder.response
    try:
        async with service.registry.lease(req.model) as engine:
            run = await start_chat(size, chat, engine, response.id, r.CHAT_PARAMS)
            try:
                builder.response.status = "in_progress"
                await store.io(lambda: store.update(response.id, status="in_progress",
                                                    response=p.ENCODER.encode(response)))
                async for chunk in run.chunks():
                    builder.chunk(chunk)
                builder.finish(run.finish_reason, run.assembler.usage())
            finally:
                await run.aclose()
    except asyncio.CancelledError:
        if service.closing:
            builder.end("failed", "server_error", "the server stopped before this response finished")
        else:
            builder.end("cancelled", "cancelled", "the response was cancelled")
    except Exception as exc:  # noqa: BLE001 - the failure is the response's state, as OpenAI reports it
        error = from_exception_logged(exc, "background response failed", response_id=response.id)
        builder.end("failed", error.code or "server_error", error.message)
    await store.io(lambda: store.update(response.id, status=response.status, response=p.ENCODER.encode(response)))


async def cancel_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    service = _service(request)
    store = await service.store()
    stored = await _stored(request, store, response_id)
    task = service.tasks.get(response_id)
    if task is None:
        response = msgspec.json.decode(stored.response)
        if not response.get("background"):
            raise ApiError(400, "Only responses created with background true can be cancelled.",
                           param="response_id", code="invalid_value")
        return web.Response(body=stored.response, content_type="application/json")  # finished: as it is
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return web.Response(body=(await _stored(request, store, response_id)).response, content_type="application/json")


# --------------------------------------------------------------------------- stored responses
async def _stored(request: web.Request, store: ResponseStore, response_id: str) -> Any:
    stored = await store.io(store.get, response_id, request[OWNER])
    if stored is None:
        raise not_found("response", response_id, param="response_id")
    return stored


async def retrieve_response(request: web.Request) -> web.Response:
    store = await _service(request).store()
    stored = await _stored(request, store, request.match_info["response_id"])
    return web.Response(body=stored.response, content_type="application/json")


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    service = _service(request)
    store = await service.store()
    if not await store.io(store.delete, response_id, request[OWNER]):
        raise not_found("response", response_id, param="response_id")
    task = service.tasks.get(response_id)
    if task is not None:  # deleting a running response stops it
        task.cancel()
    return json_response(r.DeletedResponse(id=response_id))


async def list_input_items(request: web.Request) -> web.Response:
    store = await _service(request).store()
    stored = await _stored(request, store, request.match_info["response_id"])
    items = _ITEMS_DECODER.decode(stored.input_items)
    query = request.query
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, "order must be asc or desc", param="order", code="invalid_value")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise ApiError(400, "limit must be an integer from 1 to 100", param="limit", code="invalid_value")
    if order == "desc":
        items.reverse()
    for cursor, param in ((query.get("after"), "after"), (query.get("before"), "before")):
        if cursor is None:
            continue
        ids = [item.get("id") for item in items]
        if cursor not in ids:
            raise ApiError(400, f"{param} names no item of this response", param=param, code="invalid_value")
        at = ids.index(cursor)
        items = items[at + 1:] if param == "after" else items[:at]
    page = items[:limit]
    return json_response(ObjectList(data=page, first_id=page[0].get("id") if page else None,
                                    last_id=page[-1].get("id") if page else None, has_more=len(items) > limit))
