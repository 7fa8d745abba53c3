"""Images in requests: their bytes (data: URLs, or http(s) fetches the operator allowed), prepared
with the model's preprocessor off the event loop, bounded, every failure a 400 naming the field.

Fetching is off unless `--allowed-media-domains` names hosts: a request must not make the server
reach into the network it sits in. When on, each fetch (and each redirect hop, at most
MAX_REDIRECTS) must name an allowed host over http(s); the connector's resolver refuses loopback,
private, link-local and other non-global addresses (unless `--allow-private-media-addresses`), so
the check holds for the address actually connected to, not one looked up earlier; the body is read
up to max_image_bytes, all within media_fetch_timeout_s.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Mapping, Sequence
from urllib.parse import urljoin, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

from compat.images import ImageRef, is_data_url
from engine.types import EngineClient, ImageLimits, InvalidRequest, PreparedImage
from engine.vision import ImagePreprocessor
from engine.vision.decode import decode_data_url, prepare_image
from server.config import ServerConfig

MAX_REDIRECTS = 3
READ_CHUNK_BYTES = 64 << 10


def image_limits(config: ServerConfig) -> ImageLimits:
    return ImageLimits(max_image_bytes=config.max_image_bytes, max_image_pixels=config.max_image_pixels,
                       max_images_per_request=config.max_images_per_request)


async def prepare_images(refs: Sequence[ImageRef], engine: EngineClient, config: ServerConfig) -> Mapping[str, PreparedImage]:
    """Each image part's PreparedImage by its field; {} for a request without images."""
    if not refs:
        return {}
    preprocessor = getattr(engine, "image_preprocessor", None)  # engines that predate images take text only
    if preprocessor is None:
        raise InvalidRequest(f"model {engine.model_id!r} takes text only (see input_modalities in /v1/models)",
                             param=refs[0].param, code="images_not_supported")
    limits = image_limits(config)
    if len(refs) > limits.max_images_per_request:
        raise InvalidRequest(f"{len(refs)} images in one request; this server takes at most {limits.max_images_per_request}",
                             param=refs[limits.max_images_per_request].param, code="too_many_images")
    prepared: dict[str, PreparedImage] = {}
    for ref in refs:  # one at a time: the executor threads are shared with every other request
        if is_data_url(ref.url):  # base64 decoding, Pillow decoding and preprocessing, all in the thread
            if len(ref.url) > config.max_image_bytes * 4 // 3 + 256:  # base64 of more than the limit: don't decode it
                raise InvalidRequest(f"the image is over this server's limit of {config.max_image_bytes} bytes",
                                     param=ref.param, code="image_too_large")
            prepared[ref.param] = await asyncio.to_thread(_prepare_data_url, ref, preprocessor, limits)
        else:
            data = await fetch_image(ref, config)
            prepared[ref.param] = await asyncio.to_thread(prepare_image, data, preprocessor, limits, param=ref.param)
    return prepared


def _prepare_data_url(ref: ImageRef, preprocessor: ImagePreprocessor, limits: ImageLimits) -> PreparedImage:
    return prepare_image(decode_data_url(ref.url, param=ref.param), preprocessor, limits, param=ref.param)


async def fetch_image(ref: ImageRef, config: ServerConfig) -> bytes:
    """An http(s) image URL's bytes, where the operator allowed its host (see the module docstring)."""
    if not config.allowed_media_domains:
        raise InvalidRequest("this server takes images as data: URLs only (data:image/png;base64,...); its operator "
                             "has not allowed fetching image URLs (--allowed-media-domains)", param=ref.param,
                             code="image_url_not_allowed")
    try:
        return await asyncio.wait_for(_fetch(ref, config), timeout=config.media_fetch_timeout_s)
    except asyncio.TimeoutError:
        raise InvalidRequest(f"fetching the image took over {config.media_fetch_timeout_s} s", param=ref.param,
                             code="image_fetch_failed") from None
    except (aiohttp.ClientError, OSError) as exc:  # the resolver's refusal arrives as one of these
        raise InvalidRequest(f"the image could not be fetched: {exc}", param=ref.param, code="image_fetch_failed") from None


def _check_url(url: str, config: ServerConfig, param: str) -> None:
    parts = urlsplit(url)
    host = (parts.hostname or "").lower().rstrip(".")
    if parts.scheme not in ("http", "https") or not host:
        raise InvalidRequest("an image URL must be a data: URL or an http(s) URL", param=param, code="image_url_not_allowed")
    try:  # aiohttp connects to an IP literal without asking the resolver: check it here
        literal = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        literal = None
    if literal is not None and not literal.is_global and not config.allow_private_media_addresses:
        raise InvalidRequest(f"image URLs may not name the non-global address {host}", param=param,
                             code="image_url_not_allowed")
    allowed = config.allowed_media_domains
    if "*" not in allowed and not any(host == d.lower() or host.endswith("." + d.lower()) for d in allowed):
        raise InvalidRequest(f"image URLs from {host!r} are not allowed on this server", param=param,
                             code="image_url_not_allowed")


async def _fetch(ref: ImageRef, config: ServerConfig) -> bytes:
    resolver = GlobalOnlyResolver(allow_private=config.allow_private_media_addresses)
    url = ref.url
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(resolver=resolver, limit=1)) as session:
        for _ in range(MAX_REDIRECTS + 1):
            _check_url(url, config, ref.param)
            async with session.get(url, allow_redirects=False) as response:
                if response.status in (301, 302, 303, 307, 308) and "Location" in response.headers:
                    url = urljoin(url, response.headers["Location"])
                    continue
                if response.status != 200:
                    raise InvalidRequest(f"fetching the image answered HTTP {response.status}", param=ref.param,
                                         code="image_fetch_failed")
                data = bytearray()
                async for chunk in response.content.iter_chunked(READ_CHUNK_BYTES):
                    data += chunk
                    if len(data) > config.max_image_bytes:
                        raise InvalidRequest(f"the image is over this server's limit of {config.max_image_bytes} bytes",
                                             param=ref.param, code="image_too_large")
                return bytes(data)
    raise InvalidRequest(f"the image URL redirected more than {MAX_REDIRECTS} times", param=ref.param,
                         code="image_fetch_failed")


class GlobalOnlyResolver(AbstractResolver):
    """The default resolver, less the addresses a request must not reach (unless allowed)."""

    def __init__(self, *, allow_private: bool) -> None:
        self._inner = DefaultResolver()
        self._allow_private = allow_private

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        if self._allow_private:
            return results
        usable = [r for r in results if ipaddress.ip_address(r["host"]).is_global]
        if not usable:
            raise OSError(f"{host} resolves only to loopback, private or otherwise non-global addresses")
        return usable

    async def close(self) -> None:
        await self._inner.close()
