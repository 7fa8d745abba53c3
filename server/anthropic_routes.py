"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

A request becomes a chat request (compat/anthropic.py) and runs as chat does
(server/chat_bridge.py). Clients authenticate with `x-api-key` or Bearer (server/auth.py) and may
send `anthropic-version` (any value is accepted; the shapes served are the 2023-06-01 ones). Errors
on these routes, from the middlewares too, are Anthropic's body (`ANTHROPIC_PREFIX`, server/app.py).
"""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

from aiohttp import web

from compat import anthropic as a
from compat import protocol as p
from compat import to_engine
from engine.types import InvalidRequest
from server.chat_bridge import ChatRun, renamed, start_chat, stream_events
from server.errors import ApiError
from server.request_flow import decode_body, json_response, lease, off_loop_if_large
from server.sse import Event

ANTHROPIC_PREFIX = "/v1/messages"  # errors under it are rendered in Anthropic's shape


def add_anthropic_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)


def error_json(error: ApiError) -> bytes:
    return p.ENCODER.encode(a.error_body(error.status, error.message))


async def create_message(request: web.Request) -> web.StreamResponse:
    req, size = await decode_body(request, a.MESSAGES_DECODER)
    a.check_request(req)
    chat = await off_loop_if_large(size, a.to_chat, req)
    async with lease(request, req.model) as engine:
        message_id = a.new_message_id()
        run = await start_chat(size, chat, engine, message_id, a.CHAT_PARAMS)
        builder = a.MessageBuilder(message_id=message_id, model=req.model, num_input_tokens=run.num_prompt_tokens)
        try:
            if not req.stream:
                async for chunk in run.chunks():
                    builder.chunk(chunk)
                builder.finish(run.finish_reason, run.stop, run.assembler.usage())
                return json_response(builder.message())
            async with aclosing(_with_end(run, builder)) as items:
                return await stream_events(request, items, lambda item: _render(builder, item),
                                           lambda: _events(builder.head()), _error_frame)
        finally:
            await run.aclose(request)


class _Final(list):
    """The closing events (message_delta, message_stop)."""


async def _with_end(run: ChatRun, builder: a.MessageBuilder) -> Any:
    async for chunk in run.chunks():
        yield chunk
    yield _Final(builder.finish(run.finish_reason, run.stop, run.assembler.usage()))


def _render(builder: a.MessageBuilder, item: Any) -> list[Event] | None:
    events = item if isinstance(item, _Final) else builder.chunk(item)
    return _events(events) if events else None


def _events(events: list[tuple[str, dict[str, Any]]]) -> list[Event]:
    return [Event(name, data) for name, data in events]


def _error_frame(error: ApiError) -> bytes:
    return b"event: error\ndata: " + error_json(error) + b"\n\n"


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens as create would build it (system, messages, tools), without generating."""
    req, size = await decode_body(request, a.COUNT_TOKENS_DECODER)
    a.check_request(req)
    tokenize = await off_loop_if_large(size, _tokenize_request, req)
    async with lease(request, req.model) as engine:
        try:
            ids = await off_loop_if_large(size, to_engine.tokenize, tokenize, engine)
        except InvalidRequest as exc:
            raise renamed(exc, a.CHAT_PARAMS) from None
        return json_response(a.TokenCount(input_tokens=len(ids)))


def _tokenize_request(req: a.CountTokensRequest) -> p.TokenizeRequest:
    tools, _, _ = a.chat_tools(req)
    return p.TokenizeRequest(model=req.model, messages=a.chat_messages(req), tools=tools)
