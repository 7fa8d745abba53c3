"""Optional API keys: Bearer tokens compared in constant time; /health stays open.

Two keys: `api_key` for inference, `admin_api_key` for registering and deleting models. When an
admin key is set it also works for inference; when it is not, the inference key guards both.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from server.errors import ApiError
from server.safety import is_loopback

OPEN_PATHS = frozenset({"/health"})
_ADMIN_METHODS = frozenset({"POST", "DELETE", "PUT", "PATCH"})


def is_admin_route(request: web.Request) -> bool:
    return request.method in _ADMIN_METHODS and (request.path == "/v1/models" or request.path.startswith("/v1/models/"))


def bearer_token(request: web.Request) -> bytes | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    # aiohttp decodes header bytes with surrogateescape: a non-UTF-8 key compares as its raw bytes
    return token.strip().encode("utf-8", "surrogateescape")


def _matches(token: bytes | None, key: str | None) -> bool:
    return token is not None and key is not None and hmac.compare_digest(token, key.encode())


def check(request: web.Request, api_key: str | None, admin_api_key: str | None, *,
          allow_remote_admin: bool = False) -> None:
    """Raise ApiError 401/403 unless the request carries the key its route needs; with no key at
    all, registry routes are for loopback clients only (server/safety.py)."""
    if request.path in OPEN_PATHS:
        return
    if api_key is None and admin_api_key is None:
        if is_admin_route(request) and not allow_remote_admin and not is_loopback(request.remote):
            raise ApiError(403, "Registering, switching and deleting models is open to loopback clients only on "
                           "a server without an admin API key.", code="admin_requires_loopback")
        return
    token = bearer_token(request)
    is_admin = _matches(token, admin_api_key)
    if is_admin_route(request) and admin_api_key is not None:
        if is_admin:
            return
        if _matches(token, api_key):
            raise ApiError(403, "This endpoint requires the admin API key.", code="admin_key_required")
        raise _unauthorized(token)
    if is_admin or _matches(token, api_key) or api_key is None and not is_admin_route(request):
        return
    raise _unauthorized(token)


def _unauthorized(token: bytes | None) -> ApiError:
    if token is None:
        message = "You didn't provide an API key. Pass it in the Authorization header: 'Authorization: Bearer YOUR_KEY'."
    else:
        message = "Incorrect API key provided."
    return ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
