"""Bounded image decoding: bytes as sent -> RGB Pillow image -> the model's PreparedImage.

Runs in an executor, never on the event loop. The byte limit is checked before Pillow sees the
data, the pixel limit from the header before pixels are decoded (Pillow's own decompression-bomb
guard is a process-wide setting, so it is not relied on), and only the formats images arrive in
over the API are opened: a TIFF or PSD parser is attack surface no client needs.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings

from PIL import Image, UnidentifiedImageError

from engine.types import ImageLimits, InvalidRequest, PreparedImage
from engine.vision import ImagePreprocessor

ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


def decode_data_url(url: str, *, param: str) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL; anything else is a 400 naming `param`."""
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:"):
        raise InvalidRequest("an image data URL must look like data:image/png;base64,...", param=param)
    media_type, *options = header[len("data:"):].split(";")
    if "base64" not in options:
        raise InvalidRequest("an image data URL must be base64 encoded (data:image/png;base64,...)", param=param)
    if media_type and not media_type.startswith("image/"):
        raise InvalidRequest(f"a data URL of type {media_type!r} is not an image", param=param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("the image data URL is not valid base64", param=param) from None


def decode_image(data: bytes, limits: ImageLimits, *, param: str) -> Image.Image:
    """The image as RGB, converted as llama-models' `convert_image_to_rgb` does (alpha over white)."""
    if len(data) > limits.max_image_bytes:
        raise InvalidRequest(f"the image is {len(data)} bytes, over this server's limit of {limits.max_image_bytes}",
                             param=param, code="image_too_large")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
            width, height = image.size
            if width * height > limits.max_image_pixels:
                raise InvalidRequest(f"the image is {width}x{height} pixels, over this server's limit of "
                                     f"{limits.max_image_pixels} pixels", param=param, code="image_too_large")
            image.seek(0)  # a GIF's (or animated WebP's) first frame
            image.load()
            return _to_rgb(image)
    except InvalidRequest:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError,
            Image.DecompressionBombWarning) as exc:
        raise InvalidRequest(f"the image could not be decoded (PNG, JPEG, WebP or GIF expected): {exc}",
                             param=param, code="invalid_image") from None


def _to_rgb(image: Image.Image) -> Image.Image:
    # llama-models' chat_format.convert_image_to_rgb: RGBA is pasted over white; everything else
    # goes through Pillow's convert (a palette with transparency included, as it does).
    if image.mode == "RGBA":
        rgb = Image.new("RGB", image.size, (255, 255, 255))
        rgb.paste(image, mask=image.split()[3])
        return rgb
    return image.convert("RGB")


def content_hash(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def prepare_image(data: bytes, preprocessor: ImagePreprocessor, limits: ImageLimits, *, param: str) -> PreparedImage:
    """Decode (bounded) and preprocess one image; every failure is a 400 naming `param`."""
    image = decode_image(data, limits, param=param)
    try:
        out = preprocessor.preprocess(image)
    except (ValueError, OSError) as exc:
        raise InvalidRequest(f"the image could not be preprocessed: {exc}", param=param, code="invalid_image") from None
    return PreparedImage(content_hash=content_hash(data), aspect_ratio=out.aspect_ratio, num_chunks=out.num_chunks,
                         tokens_per_chunk=out.tokens_per_chunk, pixels=out.pixels, param=param)
