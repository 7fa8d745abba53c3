"""engine/vision/decode.py: data URLs, bounded decoding, RGB conversion as llama-models does it."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from engine.types import ImageLimits, InvalidRequest
from engine.vision import Preprocessed
from engine.vision.decode import decode_data_url, decode_image, prepare_image

PARAM = "messages[0].content[1]"


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def test_data_url_round_trip_and_refusals():
    data = encode(Image.new("RGB", (3, 2), (1, 2, 3)), "PNG")
    assert decode_data_url("data:image/png;base64," + base64.b64encode(data).decode(), param=PARAM) == data
    for bad in ("http://x/y.png", "data:image/png,raw", "data:text/plain;base64,aGk=", "data:image/png;base64,!!"):
        with pytest.raises(InvalidRequest) as err:
            decode_data_url(bad, param=PARAM)
        assert err.value.param == PARAM


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_formats_decode_to_rgb(fmt):
    image = decode_image(encode(Image.new("RGB", (5, 4), (200, 10, 10)), fmt), ImageLimits(), param=PARAM)
    assert image.mode == "RGB" and image.size == (5, 4)


def test_rgba_is_pasted_over_white_as_llama_models_does():
    rgba = Image.new("RGBA", (2, 1), (0, 0, 0, 0))
    rgba.putpixel((1, 0), (10, 20, 30, 255))
    image = decode_image(encode(rgba, "PNG"), ImageLimits(), param=PARAM)
    assert image.getpixel((0, 0)) == (255, 255, 255) and image.getpixel((1, 0)) == (10, 20, 30)


def test_gif_first_frame():
    frames = [Image.new("P", (4, 4), i) for i in (3, 9)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    first = decode_image(buf.getvalue(), ImageLimits(), param=PARAM)
    assert first.getpixel((0, 0)) == frames[0].convert("RGB").getpixel((0, 0))


@pytest.mark.parametrize("case", ["corrupt", "truncated", "tiff", "too_many_bytes", "too_many_pixels"])
def test_bad_images_are_400_naming_the_field(case):
    png = encode(Image.new("RGB", (64, 64), (1, 2, 3)), "PNG")
    data, limits = {
        "corrupt": (b"\x89PNG not really", ImageLimits()),
        "truncated": (png[: len(png) // 2], ImageLimits()),
        "tiff": (encode(Image.new("RGB", (4, 4)), "TIFF"), ImageLimits()),
        "too_many_bytes": (png, ImageLimits(max_image_bytes=len(png) - 1)),
        "too_many_pixels": (png, ImageLimits(max_image_pixels=64 * 64 - 1)),
    }[case]
    with pytest.raises(InvalidRequest) as err:
        decode_image(data, limits, param=PARAM)
    assert err.value.param == PARAM
    assert err.value.code == ("image_too_large" if case.startswith("too_many") else "invalid_image")


class CountingPreprocessor:
    def preprocess(self, image: Image.Image) -> Preprocessed:
        return Preprocessed(pixels=image.size, aspect_ratio=(1, 1), num_chunks=1, tokens_per_chunk=7)


def test_prepare_image_hashes_the_bytes():
    a, b = (encode(Image.new("RGB", (4, 4), c), "PNG") for c in ((1, 1, 1), (2, 2, 2)))
    pa, pa2, pb = (prepare_image(d, CountingPreprocessor(), ImageLimits(), param=PARAM) for d in (a, a, b))
    assert pa.content_hash == pa2.content_hash != pb.content_hash
    assert (pa.tokens_per_chunk, pa.pixels, pa.param) == (7, (4, 4), PARAM)
