"""Thin handlers: decode -> compat -> engine -> compat -> encode.

Each handler leases its engine from the registry for the whole request (a hot switch lets it
finish on the weights it started with) and closes its output iterator in a `finally`, which
aborts the engine request when the client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable, Sequence

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from compat import protocol as p
from compat import to_engine
from compat.from_engine import ChatAssembler, CompletionAssembler, token_text
from engine.types import EngineClient, EngineRequest, RequestOutput
from server import sse
from server.app_keys import CONFIG_KEY, LOG_FIELDS, METRICS_KEY, STATE_KEY
from server.errors import ApiError, from_exception
from server.registry import REGISTRY_KEY, ModelRegistry
from server.tokenizer_info import model_or_only, tokenizer_info_body

# Bodies above this are tokenized (and detokenized, and batch items planned) off the event loop, so
# one huge prompt can't stall every stream; the tokenizers release the GIL while they encode.
_INLINE_TOKENIZE_MAX_BYTES = 64 << 10

Indexed = tuple[int, RequestOutput]


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/batch/chat/completions", batch_chat_completions)
    app.router.add_post("/v1/batch/completions", batch_completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)


def _registry(request: web.Request) -> ModelRegistry:
    return request.app[REGISTRY_KEY]


def _lease(request: web.Request, model_id: str) -> contextlib.AbstractAsyncContextManager[EngineClient]:
    """The model's engine for the whole request (a dead one is retired and reloaded by the registry)."""
    return _registry(request).lease(model_id)


def _log(request: web.Request, **fields: Any) -> None:
    request[LOG_FIELDS].update(fields)


def json_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=p.ENCODER.encode(obj), status=status, content_type="application/json")


async def _decode(request: web.Request, decoder: Any) -> Any:
    body = await request.read()  # raises 413 past client_max_size
    req = p.decode(decoder, body)
    _log(request, model=getattr(req, "model", None))
    return req, len(body)


async def _off_loop_if_large(body_bytes: int, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) (rendering and tokenizing a prompt), in a thread when the body is large."""
    if body_bytes > _INLINE_TOKENIZE_MAX_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


# --------------------------------------------------------------------------- engine outputs
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


class _Timing:
    """TTFT and token counts for the access log."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.start_s = time.perf_counter()
        self.first = True

    def seen(self) -> None:
        if self.first:
            self.first = False
            _log(self.request, ttft_s=round(time.perf_counter() - self.start_s, 6))


async def _respond(
    request: web.Request, stream: bool, outputs: AsyncIterator[Indexed], assembler: Any, include_usage: bool,
    head: Callable[[], list],
) -> web.StreamResponse:
    timing = _Timing(request)
    try:
        if not stream:
            async for index, out in outputs:
                timing.seen()
                assembler.add(index, out)
            return json_response(assembler.response())
        first = await anext(outputs, None)  # before headers: queue-full and similar keep their status
        timing.seen()

        def render(item: Indexed) -> object | None:
            return assembler.chunk(*item)

        def tail() -> list:
            return [assembler.usage_chunk()] if include_usage else []

        if first is None:
            return await sse.stream(request, None, outputs, lambda _: None, head(), tail)
        return await sse.stream(request, first, outputs, render, head(), tail)
    finally:
        await outputs.aclose()
        usage = assembler.usage()
        _log(request, prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens)


def _response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# --------------------------------------------------------------------------- chat and completions
def _chat_assembler(req: Any, plan: Any, engine: EngineClient, response_id: str, *,
                    include_usage: bool = False) -> ChatAssembler:
    """One place that turns a chat request (single or batch item) and its plan into an assembler."""
    return ChatAssembler(
        response_id=response_id, model=req.model, tokenizer=engine.tokenizer, chat_format=engine.chat_format,
        tools=plan.tools, n=req.n, num_prompt_tokens=len(plan.prompt_token_ids), want_logprobs=req.logprobs,
        include_usage=include_usage, forced_tools=plan.forced_tools, max_tool_calls=plan.max_tool_calls,
    )


def _completion_assembler(req: Any, plan: Any, engine: EngineClient, response_id: str, *,
                          include_usage: bool = False) -> CompletionAssembler:
    """Likewise for completions; a batch item's plan holds one prompt."""
    return CompletionAssembler(
        response_id=response_id, model=req.model, tokenizer=engine.tokenizer,
        prompt_token_counts=[len(ids) for ids in plan.prompt_token_ids],
        echo_texts=plan.prompt_texts if req.echo else None, n=req.n, logprobs=req.logprobs,
        include_usage=include_usage, prompt_logprobs=req.prompt_logprobs, prompt_token_ids=plan.prompt_token_ids,
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    req, size = await _decode(request, p.CHAT_DECODER)
    async with _lease(request, req.model) as engine:
        response_id = _response_id("chatcmpl")
        plan = await _off_loop_if_large(size, to_engine.chat_plan, req, req.messages, engine, response_id)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        assembler = _chat_assembler(req, plan, engine, response_id, include_usage=include_usage)
        outputs = merged_outputs(engine, plan.requests)
        return await _respond(request, req.stream, outputs, assembler, include_usage, assembler.role_chunks)


async def completions(request: web.Request) -> web.StreamResponse:
    req, size = await _decode(request, p.COMPLETION_DECODER)
    async with _lease(request, req.model) as engine:
        response_id = _response_id("cmpl")
        plan = await _off_loop_if_large(size, to_engine.completion_plan, req, req.prompt, engine, response_id)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        assembler = _completion_assembler(req, plan, engine, response_id, include_usage=include_usage)
        outputs = merged_outputs(engine, plan.requests)
        return await _respond(request, req.stream, outputs, assembler, include_usage, list)


# --------------------------------------------------------------------------- batch endpoints
async def _collect(outputs: AsyncIterator[Indexed], assembler: Any) -> Any:
    async with aclosing(outputs):
        async for index, out in outputs:
            assembler.add(index, out)
    return assembler.response()


async def _batch_item(
    request: web.Request, index: int, make: Callable[[], tuple[AsyncIterator[Indexed], Any]], body_bytes: int
) -> p.BatchItem:
    """One prompt of a batch: its own response, or its own error without failing the rest."""
    try:
        outputs, assembler = await _off_loop_if_large(body_bytes, make)
        return p.BatchItem(index=index, response=await _collect(outputs, assembler))
    except Exception as exc:  # noqa: BLE001 - per-item errors are part of the response
        error = from_exception(exc)
        return p.BatchItem(index=index, error=p.ErrorDetail(message=error.message, type=error.error_type,
                                                            param=error.param, code=error.code))


def _check_batch_size(request: web.Request, count: int, param: str) -> None:
    limit = request.app[CONFIG_KEY].max_batch_request_items
    if count > limit:
        raise ApiError(400, f"{param} has {count} items; this server accepts at most {limit}", param=param,
                       code="batch_too_large")


def _batch_response(response_id: str, kind: str, model: str, items: list[p.BatchItem], request: web.Request) -> web.Response:
    prompt = sum(item.response.usage.prompt_tokens for item in items if item.response is not None)
    completion = sum(item.response.usage.completion_tokens for item in items if item.response is not None)
    _log(request, prompt_tokens=prompt, completion_tokens=completion, batch_items=len(items))
    usage = p.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
    return json_response(p.BatchResponse(id=response_id, object=kind, created=int(time.time()), model=model,
                                         data=items, usage=usage))


async def batch_chat_completions(request: web.Request) -> web.Response:
    req, size = await _decode(request, p.BATCH_CHAT_DECODER)
    _check_batch_size(request, len(req.messages_batch), "messages_batch")
    async with _lease(request, req.model) as engine:
        batch_id = _response_id("batch")

        def make(k: int, messages: list) -> Callable[[], tuple[AsyncIterator[Indexed], Any]]:
            def build() -> tuple[AsyncIterator[Indexed], Any]:
                response_id = f"chatcmpl-{batch_id}-{k}"
                plan = to_engine.chat_plan(req, messages, engine, response_id)
                return merged_outputs(engine, plan.requests), _chat_assembler(req, plan, engine, response_id)
            return build

        items = await asyncio.gather(*(_batch_item(request, k, make(k, m), size) for k, m in enumerate(req.messages_batch)))
        return _batch_response(batch_id, "batch.chat.completion", req.model, list(items), request)


async def batch_completions(request: web.Request) -> web.Response:
    req, size = await _decode(request, p.BATCH_COMPLETION_DECODER)
    prompts, param = to_engine.batch_prompts(req)
    _check_batch_size(request, len(prompts), param)
    async with _lease(request, req.model) as engine:
        batch_id = _response_id("batch")

        def make(k: int, prompt: str | list[int]) -> Callable[[], tuple[AsyncIterator[Indexed], Any]]:
            def build() -> tuple[AsyncIterator[Indexed], Any]:
                response_id = f"cmpl-{batch_id}-{k}"
                plan = to_engine.completion_plan(req, prompt if isinstance(prompt, str) else [prompt], engine, response_id)
                return merged_outputs(engine, plan.requests), _completion_assembler(req, plan, engine, response_id)
            return build

        items = await asyncio.gather(*(_batch_item(request, k, make(k, pr), size) for k, pr in enumerate(prompts)))
        return _batch_response(batch_id, "batch.text_completion", req.model, list(items), request)


# --------------------------------------------------------------------------- tokenizer endpoints
async def tokenize(request: web.Request) -> web.Response:
    req, size = await _decode(request, p.TOKENIZE_DECODER)
    async with _lease(request, model_or_only(request, req.model)) as engine:
        ids = await _off_loop_if_large(size, to_engine.tokenize, req, engine)
        strs = await _off_loop_if_large(size, _token_strs, engine, ids) if req.return_token_strs else p.UNSET
        return json_response(p.TokenizeResponse(count=len(ids), max_model_len=engine.max_seq_len, tokens=ids,
                                                token_strs=strs))


def _token_strs(engine: EngineClient, ids: list[int]) -> list[str]:
    return [token_text(engine.tokenizer, i)[0] for i in ids]


async def detokenize(request: web.Request) -> web.Response:
    req, size = await _decode(request, p.DETOKENIZE_DECODER)
    async with _lease(request, model_or_only(request, req.model)) as engine:
        return json_response(p.DetokenizeResponse(prompt=await _off_loop_if_large(size, to_engine.detokenize_ids, req, engine)))


async def tokenizer_info(request: web.Request) -> web.Response:
    """vLLM's GET /tokenizer_info (lm-eval's remote tokenizer); `?model=` picks one of several."""
    async with _lease(request, model_or_only(request, request.query.get("model"))) as engine:
        return json_response(tokenizer_info_body(engine))


# --------------------------------------------------------------------------- health, readiness, metrics
async def health(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    registry = _registry(request)
    is_ready = state.started and not state.draining and registry.ready()
    failures = registry.start_failures()  # a failed start-up load is not "loading": say so, and why
    status = "ready" if is_ready else "draining" if state.draining else "failed" if failures else "loading"
    body: dict = {"status": status}
    if state.startup_errors or failures:
        body["errors"] = [*state.startup_errors, *failures]
    return json_response(body, status=200 if is_ready else 503)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS_KEY].render(), headers={"Content-Type": CONTENT_TYPE_LATEST})
