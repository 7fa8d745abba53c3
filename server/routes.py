"""Thin handlers: decode -> compat -> engine -> compat -> encode.

Chat and completions share one handler (and one batch handler), parameterized by their endpoint
kind (server/endpoints.py). Each handler (with the pieces in server/request_flow.py) leases its
engine from the registry for the whole request (a hot switch lets it finish on the weights it
started with) and closes its output iterator in a `finally`, which aborts the engine request when
the client goes away.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any, AsyncIterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from compat import protocol as p
from compat import to_engine
from compat.from_engine import token_text
from compat.images import image_refs
from engine.types import EngineClient
from server import media, sse
from server.app_keys import CONFIG_KEY, METRICS_KEY, STATE_KEY
from server.config import ServerConfig
from server.endpoints import KINDS, Assembler, EndpointKind, new_response_id
from server.errors import from_exception_logged
from server.registry import REGISTRY_KEY, ModelRegistry
from server.subsystems import SUBSYSTEMS_KEY
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
from server.tokenizer_info import model_or_only, tokenizer_info_body


def add_routes(app: web.Application) -> None:
    for kind in KINDS:
        app.router.add_post(kind.path, functools.partial(generate, kind))
        app.router.add_post(kind.batch_path, functools.partial(generate_batch, kind))
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)


def _registry(request: web.Request) -> ModelRegistry:
    return request.app[REGISTRY_KEY]


# --------------------------------------------------------------------------- responses
class _Timing:
    """TTFT and token counts for the access log."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.start_s = time.perf_counter()
        self.first = True

    def seen(self) -> None:
        if self.first:
            self.first = False
            log_fields(self.request, ttft_s=round(time.perf_counter() - self.start_s, 6))


async def _respond(
    request: web.Request, stream: bool, outputs: AsyncIterator[Indexed], assembler: Assembler, include_usage: bool
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
            return await sse.stream(request, None, outputs, lambda _: None, assembler.head_chunks(), tail)
        return await sse.stream(request, first, outputs, render, assembler.head_chunks(), tail)
    finally:
        await outputs.aclose()
        usage = assembler.usage()
        log_fields(request, prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens)


# --------------------------------------------------------------------------- chat and completions
async def generate(kind: EndpointKind, request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions and /v1/completions."""
    req, size = await decode_body(request, kind.decoder)
    async with lease(request, req.model) as engine:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        images = await media.prepare_images(kind.image_refs(kind.prompt(req)), engine, request.app[CONFIG_KEY])
        plan, assembler = await off_loop_if_large(size, kind.prepare, req, kind.prompt(req), engine, kind.response_id(),
                                                  include_usage=include_usage, images=images)
        return await _respond(request, req.stream, merged_outputs(engine, plan.requests), assembler, include_usage)


# --------------------------------------------------------------------------- batch endpoints
async def generate_batch(kind: EndpointKind, request: web.Request) -> web.Response:
    """POST /v1/batch/chat/completions and /v1/batch/completions: many prompts, shared parameters."""
    req, size = await decode_body(request, kind.batch_decoder)
    prompts, param = kind.batch_prompts(req)
    check_batch_size(request, len(prompts), param)
    async with lease(request, req.model) as engine:
        batch_id = new_response_id("batch")
        config = request.app[CONFIG_KEY]
        items = await asyncio.gather(*(_batch_item(kind, req, k, prompt, engine, kind.batch_item_id(batch_id, k), size, config)
                                       for k, prompt in enumerate(prompts)))
        return _batch_response(batch_id, kind.batch_object, req.model, list(items), request)


async def _batch_item(
    kind: EndpointKind, req: Any, index: int, prompt: Any, engine: EngineClient, response_id: str, body_bytes: int,
    config: ServerConfig,
) -> p.BatchItem:
    """One prompt of a batch: its own response, or its own error without failing the rest."""
    try:
        images = await media.prepare_images(kind.image_refs(prompt), engine, config)
        plan, assembler = await off_loop_if_large(body_bytes, kind.prepare, req, prompt, engine, response_id, images=images)
        return p.BatchItem(index=index, response=await collect(merged_outputs(engine, plan.requests), assembler))
    except Exception as exc:  # noqa: BLE001 - per-item errors are part of the response
        error = from_exception_logged(exc, "batch item failed", response_id=response_id)
        return p.BatchItem(index=index, error=p.ErrorDetail(message=error.message, type=error.error_type,
                                                            param=error.param, code=error.code))


def _batch_response(response_id: str, object_name: str, model: str, items: list[p.BatchItem],
                    request: web.Request) -> web.Response:
    prompt = sum(item.response.usage.prompt_tokens for item in items if item.response is not None)
    completion = sum(item.response.usage.completion_tokens for item in items if item.response is not None)
    log_fields(request, prompt_tokens=prompt, completion_tokens=completion, batch_items=len(items))
    usage = p.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
    return json_response(p.BatchResponse(id=response_id, object=object_name, created=int(time.time()), model=model,
                                         data=items, usage=usage))


# --------------------------------------------------------------------------- tokenizer endpoints
async def tokenize(request: web.Request) -> web.Response:
    req, size = await decode_body(request, p.TOKENIZE_DECODER)
    async with lease(request, model_or_only(request, req.model)) as engine:
        refs = image_refs(req.messages) if req.messages is not p.UNSET else []
        images = await media.prepare_images(refs, engine, request.app[CONFIG_KEY])
        ids = await off_loop_if_large(size, to_engine.tokenize, req, engine, images)
        strs = await off_loop_if_large(size, _token_strs, engine, ids) if req.return_token_strs else p.UNSET
        return json_response(p.TokenizeResponse(count=len(ids), max_model_len=engine.max_seq_len, tokens=ids,
                                                token_strs=strs))


def _token_strs(engine: EngineClient, ids: list[int]) -> list[str]:
    return [token_text(engine.tokenizer, i)[0] for i in ids]


async def detokenize(request: web.Request) -> web.Response:
    req, size = await decode_body(request, p.DETOKENIZE_DECODER)
    async with lease(request, model_or_only(request, req.model)) as engine:
        return json_response(p.DetokenizeResponse(prompt=await off_loop_if_large(size, to_engine.detokenize_ids, req, engine)))


async def tokenizer_info(request: web.Request) -> web.Response:
    """vLLM's GET /tokenizer_info (lm-eval's remote tokenizer); `?model=` picks one of several."""
    async with lease(request, model_or_only(request, request.query.get("model"))) as engine:
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
    # Optional subsystems are listed but never make the server unready: readiness tells a balancer
    # whether to send inference here, and inference works while, say, the batch store is down; a
    # balancer that pulled the replica would take inference down with it (issue 29). Their state is
    # here and in llamaserve:subsystem_up for whoever watches the server.
    subsystems = request.app[SUBSYSTEMS_KEY].all()
    if subsystems:
        body["subsystems"] = {sub.name: sub.to_json() for sub in subsystems}
    return json_response(body, status=200 if is_ready else 503)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS_KEY].render(), headers={"Content-Type": CONTENT_TYPE_LATEST})
