"""Llama Stack's native inference routes (llama-stack-client 0.2.x): chat-completion, completion
and the two batch calls, over the same engine path as the OpenAI routes.

compat/llama_stack.py rewrites each request as the OpenAI request it means; the handlers here
plan it with compat.to_engine, run it through the OpenAI assemblers, and reshape the result.
Errors keep the server's OpenAI error body: llama-stack-client prints any error body whole
("Error code: 400 - {...}"), it reads neither `detail` nor `error` specially. Streams are
Llama Stack chunk events and end without `[DONE]`, which its client would try to parse as JSON.
"""

from __future__ import annotations

import asyncio
import functools
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
from aiohttp import web

from compat import llama_stack as ls
from compat.from_engine import token_text
from engine.types import EngineClient, RequestOutput
from server import endpoints, media, sse
from server.app_keys import CONFIG_KEY
from server.config import ServerConfig
from server.endpoints import EndpointKind, Plan, new_response_id
from server.request_flow import (
    Indexed,
    check_batch_size,
    collect,
    decode_body,
    json_response,
    lease,
    log_fields,
    merged_outputs,
    off_loop_if_large,
)
from server.routes import health


def add_llama_stack_routes(app: web.Application) -> None:
    for kind in (_CHAT, _COMPLETION):
        app.router.add_post(kind.path, functools.partial(_serve, kind))
        app.router.add_post(kind.batch_path, functools.partial(_serve_batch, kind))
    # Llama Stack's vLLM provider checks health at urljoin(base_url, "health"): /v1/health for ".../v1/"
    app.router.add_get("/v1/health", health)


async def _decode(request: web.Request, decoder: Any) -> tuple[Any, int]:
    req, size = await decode_body(request, decoder)
    log_fields(request, model=req.model_id)
    return req, size


class _StopTokens:
    """The token that ended each choice, as text (<|eot_id|>, <|eom_id|>, ...): it decides
    end_of_turn vs end_of_message, which the OpenAI shapes do not carry."""

    def __init__(self, engine: EngineClient) -> None:
        self.tokenizer = engine.tokenizer
        self.by_index: dict[int, str | None] = {}

    def seen(self, index: int, out: RequestOutput) -> None:
        if out.finished:
            stop = out.stop_reason
            self.by_index[index] = token_text(self.tokenizer, stop)[0] if isinstance(stop, int) else None

    async def track(self, outputs: AsyncIterator[Indexed]) -> AsyncIterator[Indexed]:
        async with aclosing(outputs):
            async for index, out in outputs:
                self.seen(index, out)
                yield index, out


async def _stream(request: web.Request, events: AsyncIterator[dict], head: list[dict]) -> web.StreamResponse:
    async with aclosing(events):
        first = await anext(events, None)  # before headers: queue-full and similar keep their status
        if first is None:
            return await sse.stream(request, None, events, lambda _: None, head, list, done=b"")
        return await sse.stream(request, first, events, lambda event: event, head, list, done=b"")


# --------------------------------------------------------------------------- chat and completion
async def _chat_plan(req: Any, messages: list, engine: EngineClient, response_id: str, param: str, size: int,
                     config: ServerConfig) -> tuple[Any, Plan]:
    chat, parser_tools = await off_loop_if_large(size, ls.chat_request, req, messages, engine.chat_format.family, param)
    # ImageContentItems arrive as OpenAI image parts: one image path for both APIs (server/media.py)
    images = await media.prepare_images(endpoints.CHAT.image_refs(chat.messages), engine, config)
    extra = {"images": images} if images else {}
    plan = await off_loop_if_large(size, endpoints.CHAT.plan, chat, endpoints.CHAT.prompt(chat), engine, response_id, **extra)
    if parser_tools is not None:  # system_message_behavior=replace: the caller's prompt, our parser
        plan.tools = parser_tools
    return chat, plan


async def _completion_plan(req: Any, content: Any, engine: EngineClient, response_id: str, param: str, size: int,
                           config: ServerConfig) -> tuple[Any, Plan]:
    completion_req = await off_loop_if_large(size, ls.completion_request, req, content, param)
    plan = await off_loop_if_large(size, endpoints.COMPLETION.plan, completion_req,
                                   endpoints.COMPLETION.prompt(completion_req), engine, response_id)
    return completion_req, plan


async def _chat_events(outputs: AsyncIterator[Indexed], assembler: Any, stops: _StopTokens) -> AsyncIterator[dict]:
    events = ls.ChatEvents()
    async with aclosing(outputs):
        async for index, out in outputs:
            chunk = assembler.chunk(index, out)
            for event in events.progress(chunk) if chunk is not None else ():
                yield event
            if out.finished:
                finish = assembler.choices[index].finish_reason
                for event in events.complete(finish, stops.by_index.get(index), assembler.usage()):
                    yield event


async def _completion_events(outputs: AsyncIterator[Indexed], assembler: Any, stops: _StopTokens) -> AsyncIterator[dict]:
    async with aclosing(outputs):
        async for index, out in outputs:
            chunk = assembler.chunk(index, out)
            if chunk is not None:
                yield ls.completion_chunk(chunk, stops.by_index.get(index))


@dataclass(frozen=True, slots=True)
class _Kind:
    """Llama Stack's chat or completion: its routes, decoders and fields, and how its request is
    rewritten as one of the OpenAI endpoint kind `openai` (which plans it and assembles the response)
    and that response reshaped."""

    openai: EndpointKind
    path: str
    batch_path: str
    decoder: msgspec.json.Decoder
    batch_decoder: msgspec.json.Decoder
    item_field: str  # the request's prompt field (also the `param` its errors name)
    batch_field: str  # a batch request's list of them
    # async (ls request, item, engine, response id, param, body size, config) -> (OpenAI request, plan)
    plan: Callable[..., Awaitable[tuple[Any, Plan]]]
    respond: Callable[[Any, str | None], dict]  # OpenAI response, stop token -> Llama Stack response
    events: Callable[..., AsyncIterator[dict]]  # (outputs, assembler, stops) -> Llama Stack stream events
    head: Callable[[], list[dict]]  # stream events before any output


_CHAT = _Kind(
    openai=endpoints.CHAT, path="/v1/inference/chat-completion", batch_path="/v1/inference/batch-chat-completion",
    decoder=ls.CHAT_DECODER, batch_decoder=ls.BATCH_CHAT_DECODER, item_field="messages", batch_field="messages_batch",
    plan=_chat_plan, respond=ls.chat_response, events=_chat_events, head=lambda: [ls.ChatEvents.start()],
)
_COMPLETION = _Kind(
    openai=endpoints.COMPLETION, path="/v1/inference/completion", batch_path="/v1/inference/batch-completion",
    decoder=ls.COMPLETION_DECODER, batch_decoder=ls.BATCH_COMPLETION_DECODER, item_field="content",
    batch_field="content_batch", plan=_completion_plan, respond=ls.completion_response, events=_completion_events,
    head=list,
)


async def _serve(kind: _Kind, request: web.Request) -> web.StreamResponse:
    """POST /v1/inference/chat-completion and /v1/inference/completion."""
    req, size = await _decode(request, kind.decoder)
    async with lease(request, req.model_id) as engine:
        response_id = kind.openai.response_id()
        item = getattr(req, kind.item_field)
        converted, plan = await kind.plan(req, item, engine, response_id, kind.item_field, size, request.app[CONFIG_KEY])
        assembler = kind.openai.assembler(converted, plan, engine, response_id)
        stops = _StopTokens(engine)
        outputs = stops.track(merged_outputs(engine, plan.requests))
        if req.stream:
            return await _stream(request, kind.events(outputs, assembler, stops), kind.head())
        response = await collect(outputs, assembler)
        return json_response(kind.respond(response, stops.by_index.get(0)))


async def _serve_batch(kind: _Kind, request: web.Request) -> web.Response:
    """POST /v1/inference/batch-chat-completion and /v1/inference/batch-completion."""
    req, size = await _decode(request, kind.batch_decoder)
    items, param = getattr(req, kind.batch_field), kind.batch_field
    check_batch_size(request, len(items), param)
    async with lease(request, req.model_id) as engine:
        batch_id = new_response_id("batch")

        async def one(k: int, item: Any) -> dict:
            response_id = kind.openai.batch_item_id(batch_id, k)
            converted, plan = await kind.plan(req, item, engine, response_id, f"{param}[{k}]", size, request.app[CONFIG_KEY])
            assembler = kind.openai.assembler(converted, plan, engine, response_id)
            stops = _StopTokens(engine)
            response = await collect(stops.track(merged_outputs(engine, plan.requests)), assembler)
            return kind.respond(response, stops.by_index.get(0))

        return json_response({"batch": await _all(one, items)})


async def _all(one: Callable[[int, Any], Any], items: list) -> list[dict]:
    """Every item submitted together, so the engine batches them. Llama Stack's batch response has
    no per-item error: the first failure fails the call, and the TaskGroup aborts the rest."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(k, item)) for k, item in enumerate(items)]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [task.result() for task in tasks]
