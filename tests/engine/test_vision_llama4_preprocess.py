"""engine/vision/llama4.py equals llama-models' Llama 4 preprocessing (its VariableSizeImageTransform
and, for several tiles, the global ResizeNormalizeImageTransform view), tensor for tensor."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from engine.vision.llama4 import Llama4ImagePreprocessor, best_canvas
from tests.llama4_vision_fixtures import reference_preprocess_module, random_image


@pytest.fixture(scope="module")
def reference():
    return reference_preprocess_module()


def reference_chunks(reference, image: Image.Image, tile: int, max_num_chunks: int):
    # llama_models.llama4.chat_format.ChatFormat._encode_content, minus the tokens
    tiles, ar = reference.VariableSizeImageTransform(tile)(image, max_num_chunks=max_num_chunks)
    if tiles.shape[0] > 1:
        tiles = torch.cat((tiles, reference.ResizeNormalizeImageTransform(tile, tile)(image).unsqueeze(0)), dim=0)
    return tiles, ar


@pytest.mark.parametrize("size", [(32, 32), (20, 12), (100, 30), (30, 100), (64, 64), (300, 200), (7, 300), (65, 33)])
@pytest.mark.parametrize("max_num_chunks", [1, 4, 16])
def test_pixels_and_grid_equal_the_reference(reference, size, max_num_chunks):
    image = Image.open(io.BytesIO(random_image(*size, seed=sum(size)))).convert("RGB")
    ours = Llama4ImagePreprocessor(tile_size=32, patch_size=8, pixel_shuffle_ratio=0.5,
                                   max_num_chunks=max_num_chunks).preprocess(image)
    tiles, ar = reference_chunks(reference, image, 32, max_num_chunks)
    assert ours.aspect_ratio == ar
    assert ours.num_chunks == tiles.shape[0]
    assert ours.tokens_per_chunk == 4  # (32 / 8)^2 patches, pixel shuffle 0.5 -> a quarter
    assert torch.equal(ours.pixels, tiles)


def test_canvas_choice_equals_the_reference_at_real_size(reference):
    transform = reference.VariableSizeImageTransform(448)
    possible = torch.tensor(transform.find_supported_resolutions(max_num_chunks=16, patch_size=448))
    for size in [(300, 800), (800, 300), (448, 448), (1000, 1000), (1, 5000), (2000, 900), (449, 447)]:
        assert best_canvas(size, 16, 448) == transform.get_best_fit(size, possible)


def test_hand_checked_layout():
    # 100x30 under 4 chunks: the reference upscales by the smallest factor >= 1: 32/30 fits a 4x1
    # (width x height) canvas of 128x32, so 4 tiles in one row, plus the global view
    out = Llama4ImagePreprocessor(tile_size=32, patch_size=8, pixel_shuffle_ratio=0.5, max_num_chunks=4).preprocess(
        Image.new("RGB", (100, 30), (255, 0, 0)))
    assert out.aspect_ratio == (1, 4) and out.num_chunks == 5 and tuple(out.pixels.shape) == (5, 3, 32, 32)
    assert out.pixels[0, 0, 0, 0].item() == 1.0 and out.pixels[0, 1, 0, 0].item() == -1.0  # red, normalized
    assert out.pixels[3, :, :, -1].eq(-1.0).all()  # the black padding right of the image (100 < 128)
