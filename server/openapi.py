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

from compat import anthropic as a
from compat import batch_protocol as bp
from compat import responses as r
from compat import llama_stack as ls
from compat import protocol as p
from server.model_routes import LoadLoraAdapterRequest, RegisterModelRequest, UnloadLoraAdapterRequest

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
    return {
        ("POST", "/v1/inference/chat-completion"): ls.ChatCompletionRequest,
        ("POST", "/v1/inference/completion"): ls.CompletionRequest,
        ("POST", "/v1/inference/batch-chat-completion"): ls.BatchChatCompletionRequest,
        ("POST", "/v1/inference/batch-completion"): ls.BatchCompletionRequest,
        ("POST", "/v1/batches"): bp.CreateBatchRequest,
        ("POST", "/v1/chat/completions"): p.ChatCompletionRequest,
        ("POST", "/v1/completions"): p.CompletionRequest,
        ("POST", "/v1/batch/chat/completions"): p.BatchChatCompletionRequest,
        ("POST", "/v1/batch/completions"): p.BatchCompletionRequest,
        ("POST", "/tokenize"): p.TokenizeRequest,
        ("POST", "/detokenize"): p.DetokenizeRequest,
        ("POST", "/v1/models"): RegisterModelRequest,
        ("POST", "/v1/load_lora_adapter"): LoadLoraAdapterRequest,
        ("POST", "/v1/unload_lora_adapter"): UnloadLoraAdapterRequest,
        ("POST", "/v1/responses"): r.ResponsesRequest,
        ("POST", "/v1/messages"): a.MessagesRequest,
        ("POST", "/v1/messages/count_tokens"): a.CountTokensRequest,
    }


RESPONSE_TYPES: dict[tuple[str, str], type] = {
    ("POST", "/v1/chat/completions"): p.ChatCompletionResponse,
    ("POST", "/v1/completions"): p.CompletionResponse,
    # (BatchResponse's items hold an untagged union of two response Structs: no schema for it)
    ("POST", "/tokenize"): p.TokenizeResponse,
    ("POST", "/detokenize"): p.DetokenizeResponse,
    ("POST", "/v1/responses"): r.ResponseObject,
    ("GET", "/v1/responses/{response_id}"): r.ResponseObject,
    ("POST", "/v1/responses/{response_id}/cancel"): r.ResponseObject,
    ("DELETE", "/v1/responses/{response_id}"): r.DeletedResponse,
    ("GET", "/v1/responses/{response_id}/input_items"): bp.ObjectList,
    ("POST", "/v1/messages"): a.MessageObject,
    ("POST", "/v1/messages/count_tokens"): a.TokenCount,
}
# Bodies that are not one JSON Struct: the Batch API's upload (OpenAI's multipart form) and cancel (no body).
_OTHER_BODIES: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", "/v1/files"): {"required": True, "content": {"multipart/form-data": {"schema": {
        "type": "object", "required": ["file", "purpose"],
        "properties": {"file": {"type": "string", "format": "binary"}, "purpose": {"type": "string", "enum": ["batch"]}},
    }}}},
    ("POST", "/v1/batches/{batch_id}/cancel"): {"required": False, "content": {"application/json": {"schema": {
        "type": "object"}}}},
    ("POST", "/v1/responses/{response_id}/cancel"): {"required": False, "content": {"application/json": {"schema": {
        "type": "object"}}}},
}
_STATUSES = {"400": "invalid request", "401": "missing or wrong API key", "403": "not allowed",
             "404": "unknown model or route", "408": "the request body stalled", "413": "body too large",
             "415": "a JSON route's body is not application/json", "429": "queue full (Retry-After)",
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
    bodies = sorted({*requests.values(), *RESPONSE_TYPES.values(), ErrorResponse, a.ErrorBody},
                    key=lambda t: t.__qualname__)
    # msgspec names each component (module-qualified where two Structs share a name): keep its refs.
    refs, components = msgspec.json.schema_components(bodies, ref_template=_REF)
    ref_of = dict(zip(bodies, refs))
    paths: dict[str, dict[str, Any]] = {}
    for route in app.router.routes():
        if route.method == "HEAD" or route.resource is None:
            continue
        path, params = openapi_path(route.resource.canonical)
        key = (route.method, path)
        operation: dict[str, Any] = {"operationId": f"{route.method.lower()}_{path.strip('/').replace('/', '_')}",
                                     "responses": _responses(key, ref_of)}
        if params:
            operation["parameters"] = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                                       for n in params]
        if key in requests:
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref_of[requests[key]]}}}
        elif key in _OTHER_BODIES:
            operation["requestBody"] = _OTHER_BODIES[key]
        paths.setdefault(path, {})[route.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "llamaserve", "version": "1", "description": "OpenAI-compatible inference server"},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{}, {"bearer": []}],
    }


def _responses(key: tuple[str, str], ref_of: dict[type, dict[str, Any]]) -> dict[str, Any]:
    error_type = a.ErrorBody if key[1].startswith("/v1/messages") else ErrorResponse  # Anthropic's routes: its shape
    error = {"content": {"application/json": {"schema": ref_of[error_type]}}}
    ok: dict[str, Any] = {"description": "success"}
    if key in RESPONSE_TYPES:
        ok["content"] = {"application/json": {"schema": ref_of[RESPONSE_TYPES[key]]},
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
