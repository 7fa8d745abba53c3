"""The request flow the Responses and Anthropic Messages routes share: each translates its request
into a chat request (compat/responses.py, compat/anthropic.py), which then runs exactly as chat
does (the CHAT endpoint kind's plan and assembler, server/endpoints.py), and turns chat's chunks into
its own objects and events. What differs per API: the names of parameters in errors, the builder
of its objects and its stream's events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterable, Mapping

from aiohttp import web

from compat import protocol as p
from compat.from_engine import ChatAssembler
from engine.types import ONLINE_PRIORITY, ContextLengthExceeded, EngineClient, InvalidRequest, RequestOutput
from server import sse
from server.endpoints import CHAT
from server.errors import ApiError
from server.request_flow import Indexed, log_fields, merged_outputs, off_loop_if_large


def renamed(exc: InvalidRequest, names: Mapping[str, str]) -> InvalidRequest:
    """chat's error, naming the field as the client's API spells it (`messages[2]` -> `input`)."""
    param = exc.param
    if param is None:
        return exc
    head = param.split("[", 1)[0].split(".", 1)[0]
    new = names.get(param) or names.get(head)
    if new is None:
        return exc
    if isinstance(exc, ContextLengthExceeded):
        return ContextLengthExceeded(str(exc), param=new)
    return InvalidRequest(str(exc), param=new, code=exc.code)


@dataclass(slots=True)
class ChatRun:
    """One chat request in flight: its chunks, and what the other APIs read at its end."""

    assembler: ChatAssembler
    outputs: AsyncIterator[Indexed]
    num_prompt_tokens: int
    last: RequestOutput | None = None

    async def chunks(self) -> AsyncIterator[p.ChatCompletionChunk | None]:
        async for index, out in self.outputs:
            self.last = out
            yield self.assembler.chunk(index, out)

    @property
    def finish_reason(self) -> str | None:
        return self.assembler.choices[0].finish_reason

    @property
    def stop(self) -> str | int | None:
        """The stop string (or token id) that ended the answer, as the engine reported it."""
        return self.last.stop_reason if self.last is not None else None

    async def aclose(self, request: web.Request | None = None) -> None:
        await self.outputs.aclose()  # aborts the engine request when it did not finish
        if request is not None:
            usage = self.assembler.usage()
            log_fields(request, prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens)


async def start_chat(body_bytes: int, chat: p.ChatCompletionRequest, engine: EngineClient, response_id: str,
                     names: Mapping[str, str], *, priority: int = ONLINE_PRIORITY) -> ChatRun:
    """chat's plan and assembler for `chat` (off the loop when the body was large); refusals name
    the client's own fields. Its engine requests are submitted as the chunks are read."""
    try:
        plan, assembler = await off_loop_if_large(body_bytes, CHAT.prepare, chat, chat.messages, engine, response_id,
                                                  priority=priority, include_usage=True)
    except InvalidRequest as exc:
        raise renamed(exc, names) from None
    return ChatRun(assembler, merged_outputs(engine, plan.requests), len(plan.prompt_token_ids))


_NOTHING = object()  # an iterator that ended before its first item


async def stream_events(
    request: web.Request, items: AsyncIterator[Any], render: Callable[[Any], object | None],
    head: Callable[[], Iterable[object]], error_frame: Callable[[ApiError], bytes],
) -> web.StreamResponse:
    """A stream of named events: the first item is awaited before the headers (a full queue or a
    refused request keeps its HTTP status), then `head`, then one render per item; no [DONE]."""
    first = await anext(items, _NOTHING)
    if first is _NOTHING:
        return await sse.stream(request, None, items, lambda _: None, head(), list, done=b"", error_frame=error_frame)
    return await sse.stream(request, first, items, render, head(), list, done=b"", error_frame=error_frame)


def not_found(what: str, ident: str, param: str | None = None, code: str = "not_found") -> ApiError:
    return ApiError(404, f"No {what} found with id '{ident[:128]}'.", param=param, code=code)
