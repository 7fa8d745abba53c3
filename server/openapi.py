"""GET /openapi.json: OpenAPI 3.1 of every route, generated from the msgspec types that decode the
requests (and encode the responses), so the document cannot drift from what the server accepts.

Routes are read from the app's router, so a route added anywhere appears; `REQUEST_TYPES` says
which Struct decodes each POST body (a test checks every POST route has one).
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
from aiohttp import web

from compat import protocol as p

_REF = "#/components/schemas/{name}"


class ErrorObject(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct, kw_only=True):
    """Every 4xx and 5xx body."""

    error: ErrorObject


def request_types() -> dict[tuple[str, str], type]:
    from server.model_routes import RegisterModelRequest

    return {
        ("POST", "/v1/chat/completions"): p.ChatCompletionRequest,
        ("POST", "/v1/completions"): p.CompletionRequest,
        ("POST", "/v1/batch/chat/completions"): p.BatchChatCompletionRequest,
        ("POST", "/v1/batch/completions"): p.BatchCompletionRequest,
        ("POST", "/tokenize"): p.TokenizeRequest,
        ("POST", "/detokenize"): p.DetokenizeRequest,
        ("POST", "/v1/models"): RegisterModelRequest,
    }


RESPONSE_TYPES: dict[tuple[str, str], type] = {
    ("POST", "/v1/chat/completions"): p.ChatCompletionResponse,
    ("POST", "/v1/completions"): p.CompletionResponse,
    # (BatchResponse's items hold an untagged union of two response Structs: no schema for it)
    ("POST", "/tokenize"): p.TokenizeResponse,
    ("POST", "/detokenize"): p.DetokenizeResponse,
}
_STATUSES = {"400": "invalid request", "401": "missing or wrong API key", "403": "not allowed",
             "404": "unknown model or route", "413": "body too large", "429": "queue full (Retry-After)",
             "500": "server fault (message carries the request id)",
             "503": "model loading, dead or server draining (Retry-After)"}


def openapi_path(canonical: str) -> tuple[str, list[str]]:
    """aiohttp's `/v1/models/{model_id:.+}` -> (`/v1/models/{model_id}`, ["model_id"])."""
    names: list[str] = []

    def plain(match: re.Match) -> str:
        names.append(match.group(1))
        return "{" + match.group(1) + "}"

    return re.sub(r"\{(\w+)(?::[^}]*)?\}", plain, canonical), names


def build_document(app: web.Application) -> dict[str, Any]:
    requests = request_types()
    bodies = {*requests.values(), *RESPONSE_TYPES.values(), ErrorResponse}
    _, components = msgspec.json.schema_components(sorted(bodies, key=lambda t: t.__name__), ref_template=_REF)
    paths: dict[str, dict[str, Any]] = {}
    for route in app.router.routes():
        if route.method == "HEAD" or route.resource is None:
            continue
        path, params = openapi_path(route.resource.canonical)
        key = (route.method, path)
        operation: dict[str, Any] = {"operationId": f"{route.method.lower()}_{path.strip('/').replace('/', '_')}",
                                     "responses": _responses(key)}
        if params:
            operation["parameters"] = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                                       for n in params]
        if key in requests:
            operation["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": _REF.format(name=requests[key].__name__)}}}}
        paths.setdefault(path, {})[route.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "llamaserve", "version": "1", "description": "OpenAI-compatible inference server"},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{}, {"bearer": []}],
    }


def _responses(key: tuple[str, str]) -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": {"$ref": _REF.format(name="ErrorResponse")}}}}
    ok: dict[str, Any] = {"description": "success"}
    if key in RESPONSE_TYPES:
        ok["content"] = {"application/json": {"schema": {"$ref": _REF.format(name=RESPONSE_TYPES[key].__name__)}},
                         "text/event-stream": {"schema": {"type": "string"}}}
    return {"200": ok, **{status: {"description": text, **error} for status, text in _STATUSES.items()}}


_DOCUMENT = web.AppKey("openapi_document", dict)  # {"json": bytes}, filled on first request


async def openapi_json(request: web.Request) -> web.Response:
    cache = request.app[_DOCUMENT]
    if "json" not in cache:  # every route is added by now: build once
        cache["json"] = msgspec.json.encode(build_document(request.app))
    return web.Response(body=cache["json"], content_type="application/json")


def add_openapi_route(app: web.Application) -> None:
    app[_DOCUMENT] = {}
    app.router.add_get("/openapi.json", openapi_json)
