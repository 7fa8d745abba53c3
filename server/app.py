"""create_app(config, engine_factory): the aiohttp application, its middlewares and lifecycle.

Tests build the same app with a fake EngineFactory. Middlewares, outermost first: request id,
access log (one structlog line per request), errors (every exception -> OpenAI error body), drain,
auth, browser guard (Host, Origin and content type: server/browser_guard.py), stalled bodies
(server/connections.py).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from typing import AsyncIterator, Awaitable, Callable

import structlog
from aiohttp import web

from engine.config import launched_by_torchrun
from server import auth, routes
from server.anthropic_routes import ANTHROPIC_PREFIX, add_anthropic_routes
from server.anthropic_routes import error_json as anthropic_error_json
from server.app_keys import CONFIG_KEY, LOG_FIELDS, LOGGER_KEY, METRICS_KEY, REQUEST_ID, STATE_KEY, ServerState
from server.batch_api import add_batch_routes
from server.browser_guard import browser_guard
from server.config import ServerConfig, should_load
from server.connections import body_stall_middleware
from server.drain import drain_middleware
from server.errors import ApiError, from_exception, from_exception_logged
from server.llama_stack_routes import add_llama_stack_routes
from server.metrics import ServerMetrics
from server.model_routes import add_model_routes
from server.model_spec import EngineFactory
from server.openapi import add_openapi_route
from server.registry import REGISTRY_KEY, ModelRegistry
from server.responses_routes import add_responses_routes
from server.subsystems import SUBSYSTEMS_KEY, Subsystems

_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_app(config: ServerConfig, engine_factory: EngineFactory) -> web.Application:
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[request_id_middleware, access_log_middleware, error_middleware, drain_middleware,
                     auth_middleware, browser_guard(config), body_stall_middleware],
    )
    registry = ModelRegistry(
        engine_factory,
        checkpoint_roots=list(config.checkpoint_roots),
        memory_budget_bytes=config.memory_budget_bytes,
        evict_idle_lru=config.evict_idle_lru,
        load_wait_timeout_s=config.load_wait_timeout_s,
        keep_alive_s=config.keep_alive,
        default_speculative_config=config.engine.speculative_config,
    )
    app[CONFIG_KEY] = config
    app[STATE_KEY] = ServerState()
    app[REGISTRY_KEY] = registry
    metrics = ServerMetrics(registry.engines)
    metrics.add_lifecycle(registry.lifecycle_stats)
    subsystems = Subsystems()  # optional parts (the Batch API) register here and fail alone
    metrics.add_subsystems(lambda: [(state.name, state.is_up) for state in subsystems.all()])
    app[SUBSYSTEMS_KEY] = subsystems
    app[METRICS_KEY] = metrics
    app[LOGGER_KEY] = structlog.get_logger("llamaserve.access")
    routes.add_routes(app)
    add_model_routes(app)
    add_llama_stack_routes(app)  # Llama Stack's native inference API beside OpenAI's
    add_anthropic_routes(app)  # Anthropic's Messages API, on chat's path
    add_openapi_route(app)
    app.on_response_prepare.append(_add_request_id_header)
    app.on_shutdown.append(_start_draining)
    app.cleanup_ctx.append(_registry_context)
    add_batch_routes(app)  # after the registry's context: the batch runner stops before the engines do
    add_responses_routes(app)  # likewise: background responses stop before the engines do
    return app


# --------------------------------------------------------------------------- lifecycle
async def _registry_context(app: web.Application) -> AsyncIterator[None]:
    """Register (and load) the configured models in the background: the port opens at once and
    /ready turns 200 when they are loaded. On the way out, stop every engine."""
    registry = app[REGISTRY_KEY]
    state = app[STATE_KEY]
    state.startup_task = asyncio.create_task(_register_configured(app))
    # Under torchrun every rank follows the model it was launched with: it is never unloaded.
    sweeps = asyncio.create_task(_sweep_idle_models(registry) if not launched_by_torchrun() else asyncio.sleep(0))
    try:
        yield
    finally:
        state.draining = True
        state.startup_task.cancel()
        sweeps.cancel()
        await asyncio.gather(state.startup_task, sweeps, return_exceptions=True)
        await registry.close()


IDLE_SWEEP_INTERVAL_S = 1.0  # how often idle models are checked against their keep_alive


async def _sweep_idle_models(registry: ModelRegistry) -> None:
    """Unload models idle past their keep_alive (server/registry.py `sweep_idle`), for the server's life."""
    log = structlog.get_logger("llamaserve.registry")
    while True:
        await asyncio.sleep(IDLE_SWEEP_INTERVAL_S)
        try:
            registry.sweep_idle()
        except Exception:  # noqa: BLE001 - a failed sweep must not end the sweeps
            log.exception("idle model sweep failed")


async def _register_configured(app: web.Application) -> None:
    registry = app[REGISTRY_KEY]
    state = app[STATE_KEY]
    log = structlog.get_logger("llamaserve.startup")
    for spec in app[CONFIG_KEY].models:
        try:
            if should_load(spec):
                registry.register_background(spec)  # loads in its own task; /ready waits for it
            else:
                await registry.register(spec, load=False)
        except Exception as exc:  # noqa: BLE001 - one bad model must not stop the others
            state.startup_errors.append(f"{spec.model_id}: {from_exception(exc).message}")
            log.error("model registration failed", model=spec.model_id, error=str(exc))
    for lora in app[CONFIG_KEY].lora_modules:  # loaded on their base by their first request
        try:
            await registry.register_adapter(lora.name, lora.path, lora.base_model, metadata=dict(lora.metadata),
                                            load=False, trusted=True)
        except Exception as exc:  # noqa: BLE001 - one bad adapter must not stop the others
            state.startup_errors.append(f"{lora.name}: {from_exception(exc).message}")
            log.error("adapter registration failed", model=lora.name, error=str(exc))
    state.started = True  # load failures show as `failed` models in /v1/models


async def _start_draining(app: web.Application) -> None:
    app[STATE_KEY].draining = True


# --------------------------------------------------------------------------- middlewares
async def _add_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    request_id = request.get(REQUEST_ID)
    if request_id is not None:
        response.headers["X-Request-Id"] = request_id


@web.middleware
async def request_id_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Honour a sane incoming X-Request-Id (so a trace spans proxies), else make one."""
    incoming = request.headers.get("X-Request-Id", "")
    request[REQUEST_ID] = incoming if _VALID_REQUEST_ID.match(incoming) else uuid.uuid4().hex
    return await handler(request)


@web.middleware
async def access_log_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    fields: dict = {}
    request[LOG_FIELDS] = fields
    start_s = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except asyncio.CancelledError:
        status = 499  # the client closed the connection (nginx's convention)
        raise
    finally:
        latency_s = time.perf_counter() - start_s
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
        metrics = request.app[METRICS_KEY]
        metrics.http_requests.labels(request.method, route, str(status)).inc()
        metrics.http_latency.labels(route).observe(latency_s)
        request.app[LOGGER_KEY].info(
            "request", request_id=request[REQUEST_ID], method=request.method, path=request.path, status=status,
            latency_s=round(latency_s, 6), **fields,
        )


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = _http_error(request, exc)
    except ApiError as exc:
        error = exc
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - nothing escapes as a traceback
        error = from_exception_logged(exc, "request failed", request_id=request[REQUEST_ID], path=request.path)
    if error.status >= 500:
        error.message += f" (request id {request[REQUEST_ID]})"
    request[LOG_FIELDS]["error_code"] = error.code
    # Anthropic's SDKs read their own error body on their routes; every other route answers OpenAI's
    body = anthropic_error_json(error) if request.path.startswith(ANTHROPIC_PREFIX) else error.to_json()
    return web.Response(body=body, status=error.status, headers=error.headers, content_type="application/json")


def _http_error(request: web.Request, exc: web.HTTPException) -> ApiError:
    headers = {k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")}
    if exc.status == 404:
        return ApiError(404, f"Invalid URL ({request.method} {request.path})", code="not_found", headers=headers)
    if exc.status == 405:
        return ApiError(405, f"Method {request.method} is not allowed for {request.path}",
                        code="method_not_allowed", headers=headers)
    if exc.status == 413:
        limit = request.app[CONFIG_KEY].max_body_bytes
        return ApiError(413, f"Request body is too large: the limit is {limit} bytes", code="request_too_large")
    return ApiError(exc.status, exc.reason or "HTTP error", code=None, headers=headers)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    config = request.app[CONFIG_KEY]
    request[auth.OWNER] = auth.check(request, config.api_key, config.admin_api_key,
                                     allow_remote_admin=config.allow_remote_admin, named_keys=config.named_api_keys)
    return await handler(request)
