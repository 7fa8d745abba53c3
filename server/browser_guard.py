"""What keeps a web page the operator visits away from a keyless server.

Any page can make the browser send requests to 127.0.0.1:8000, and browser requests come from
loopback, so "admin is loopback-only" does not hold against them. Two ways in:

- DNS rebinding: a page at attacker.example points its name at 127.0.0.1; the browser then holds our
  responses same-origin and lets the page read them (models, every uploaded file). Its requests say
  `Host: attacker.example`, so a keyless server answers only the Host names it knows: localhost,
  the bind host (unless a wildcard) and `allowed_hosts`, with or without a port, and any IP address
  (rebinding needs a name: a page can send `Host: 10.0.0.9` only to the machine at that address).
  Others get 400 `invalid_host`, as Django and Starlette's TrustedHostMiddleware answer (RFC 9112
  gives 400 for a bad Host; 421 is for an HTTP/2 connection reused for another authority).
- Cross-site requests: a page may send a POST anywhere without asking first (a CORS "simple request")
  when its body is text/plain, form-urlencoded or multipart, or has no type; it cannot read the
  answer, but the request acts (register or delete a model, upload, cancel). JSON routes take only
  `application/json` (415 otherwise), which a page can send cross-origin only after a preflight we
  never grant. A keyless server also refuses a request whose `Origin` names a host it does not
  answer (403), which covers the one multipart route and body-less POSTs.

With an API key none of this is needed: a page cannot make the browser send our key (it is no
cookie), so its requests get 401. The content-type rule holds on every server, as part of the API.
Probes (/health, /ready, /metrics) answer any Host: orchestrators probe by IP address, and they
read no user data and change nothing.
"""

from __future__ import annotations

import ipaddress
from typing import Awaitable, Callable
from urllib.parse import urlsplit

from aiohttp import hdrs, web

from server.config import ServerConfig
from server.drain import PROBE_PATHS
from server.errors import ApiError
from server.safety import is_loopback

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]

JSON_TYPE = "application/json"
MULTIPART_ROUTES = frozenset({("POST", "/v1/files")})  # the routes whose body is a form, checked by their handler
ANY_HOST = "*"
_WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})


def host_name(authority: str) -> str:
    """A Host header or host setting without its port: 'LocalHost:8000' -> 'localhost', '[::1]:80' -> '::1'."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        return authority[1:].partition("]")[0]
    if authority.count(":") == 1:  # name:port (a bare IPv6 address has several colons and no port)
        return authority.partition(":")[0]
    return authority


def allowed_host_names(config: ServerConfig) -> frozenset[str]:
    """Host names a keyless server answers besides loopback ones (server/safety.py is_loopback)."""
    names = {host_name(name) for name in config.allowed_hosts}
    if config.host not in _WILDCARD_BINDS:
        names.add(host_name(config.host))
    return frozenset(names)


def is_allowed_host(name: str, allowed: frozenset[str]) -> bool:
    return is_loopback(name) or name in allowed or ANY_HOST in allowed


def browser_guard(config: ServerConfig) -> Middleware:
    """The middleware for this config: Host and Origin checks when keyless, the content type always."""
    # an admin key alone leaves inference, files and batches open; named keys (--api-keys-file) close them
    keyless = config.api_key is None and not config.named_api_keys
    allowed = allowed_host_names(config)

    @web.middleware
    async def browser_guard_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.match_info.http_exception is not None:  # 404 / 405 first
            return await handler(request)
        if keyless and request.path not in PROBE_PATHS:
            check_host(request, allowed)
            check_origin(request, allowed)
        check_content_type(request)
        return await handler(request)

    return browser_guard_middleware


def is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def check_host(request: web.Request, allowed: frozenset[str]) -> None:
    """Any IP-address Host passes: rebinding needs a name the attacker controls, and a page can only
    send `Host: <address>` to the machine at that address (a LAN client, a pod probe, a gateway)."""
    host = request.headers.get(hdrs.HOST)
    name = host_name(host) if host is not None else ""
    if host is not None and not is_ip_literal(name) and not is_allowed_host(name, allowed):  # browsers always send one
        raise ApiError(400, f"Host {host!r} is not served here: without an API key this server answers only "
                       "IP addresses, localhost and the names in --allowed-hosts (this keeps DNS-rebinding "
                       "web pages out). Add the name to --allowed-hosts, or set --api-key.", code="invalid_host")


def check_origin(request: web.Request, allowed: frozenset[str]) -> None:
    origin = request.headers.get(hdrs.ORIGIN)
    if origin is None:
        return
    name = urlsplit(origin).hostname  # None for "null" (sandboxed pages, file: URLs)
    if name is None or not is_allowed_host(name, allowed):
        raise ApiError(403, f"Requests from web pages of origin {origin!r} are refused: without an API key this "
                       "server answers pages only from localhost, loopback addresses and --allowed-hosts.",
                       code="origin_not_allowed")


def check_content_type(request: web.Request) -> None:
    """A body sent to a JSON route is application/json (any charset parameter). One sent with no type
    is read as JSON too unless a browser sent it: browsers send Origin with every POST."""
    if not request.body_exists or (request.method, request.path) in MULTIPART_ROUTES:
        return
    if hdrs.CONTENT_TYPE not in request.headers:
        if hdrs.ORIGIN not in request.headers:  # curl -X POST, httpx content=...
            return
    elif request.content_type == JSON_TYPE:
        return
    given = request.headers.get(hdrs.CONTENT_TYPE, "none")
    raise ApiError(415, f"{request.method} {request.path} takes a JSON body: send 'Content-Type: application/json' "
                   f"(got {given!r})", code="unsupported_media_type")
