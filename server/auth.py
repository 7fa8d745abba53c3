"""Optional API keys: Bearer tokens compared in constant time; /health stays open.

`api_key` and the keys of `--api-keys-file` (named: NAME KEY per line) are for inference;
`admin_api_key` is for registering and deleting models. When an admin key is set it also works
for inference; when it is not, the inference keys guard both.

Every request gets an owner (`OWNER`): the name of the key it carried. The Batch API keeps each
owner's files and batches apart. `--api-key` owns as DEFAULT_OWNER, as does everyone on a server
without keys (so a server that gains its first key keeps its objects); the admin key as
ADMIN_OWNER; a keys-file key as its name, so several keys with one name (a rotation) share them.
"""

from __future__ import annotations

import hmac
from typing import Sequence

from aiohttp import web

from server.errors import ApiError
from server.safety import is_loopback

OPEN_PATHS = frozenset({"/health"})
_ADMIN_METHODS = frozenset({"POST", "DELETE", "PUT", "PATCH"})
_ADMIN_PATHS = frozenset({"/v1/models", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"})  # vLLM's LoRA routes too
DEFAULT_OWNER = "default"
ADMIN_OWNER = "admin"
OWNER = web.RequestKey("owner", str)  # set by the app's auth middleware

NamedKeys = Sequence[tuple[str, str]]  # (owner name, key)


def is_admin_route(request: web.Request) -> bool:
    return request.method in _ADMIN_METHODS and (
        request.path in _ADMIN_PATHS or request.path.startswith("/v1/models/")
    )


def bearer_token(request: web.Request) -> bytes | None:
    """The key a request carries: `Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY`."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        token = request.headers.get("x-api-key", "")
    if not token.strip():
        return None
    # aiohttp decodes header bytes with surrogateescape: a non-UTF-8 key compares as its raw bytes
    return token.strip().encode("utf-8", "surrogateescape")


def _matches(token: bytes | None, key: str | None) -> bool:
    return token is not None and key is not None and hmac.compare_digest(token, key.encode())


def _named_owner(token: bytes | None, named_keys: NamedKeys) -> str | None:
    """The name of the file key the token is; every key is compared, so the time does not say which."""
    owner = None
    for name, key in named_keys:
        if _matches(token, key) and owner is None:
            owner = name
    return owner


def check(request: web.Request, api_key: str | None, admin_api_key: str | None, *,
          allow_remote_admin: bool = False, named_keys: NamedKeys = ()) -> str:
    """The request's owner; raise ApiError 401/403 unless the request carries the key its route
    needs. With no key at all, registry routes are for loopback clients only (server/safety.py)."""
    if request.path in OPEN_PATHS:
        return DEFAULT_OWNER
    if api_key is None and admin_api_key is None and not named_keys:
        if is_admin_route(request) and not allow_remote_admin and not is_loopback(request.remote):
            raise ApiError(403, "Registering, switching and deleting models is open to loopback clients only on "
                           "a server without an admin API key.", code="admin_requires_loopback")
        return DEFAULT_OWNER
    token = bearer_token(request)
    is_admin = _matches(token, admin_api_key)
    named = _named_owner(token, named_keys)
    inference_owner = DEFAULT_OWNER if _matches(token, api_key) else named
    if is_admin_route(request) and admin_api_key is not None:
        if is_admin:
            return ADMIN_OWNER
        if inference_owner is not None:
            raise ApiError(403, "This endpoint requires the admin API key.", code="admin_key_required")
        raise _unauthorized(token)
    if is_admin:
        return ADMIN_OWNER
    if inference_owner is not None:
        return inference_owner
    if api_key is None and not named_keys and not is_admin_route(request):
        return DEFAULT_OWNER  # only an admin key is set: inference is open
    raise _unauthorized(token)


def _unauthorized(token: bytes | None) -> ApiError:
    if token is None:
        message = "You didn't provide an API key. Pass it in the Authorization header: 'Authorization: Bearer YOUR_KEY'."
    else:
        message = "Incorrect API key provided."
    return ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
