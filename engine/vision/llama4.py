"""Llama 4's image preprocessing, as llama-models' llama4/preprocess.py and chat_format.py compute it,
over Pillow and torch (no torchvision: its PyPI wheel cannot load beside torch+cpu).

The reference's transforms, step by step, and what stands in for each torchvision call:
- the canvas: the tile grid (at most `max_num_chunks` tiles of `tile_size` pixels) that needs the
  least upscaling, else the least downscaling, smallest area on ties (`best_canvas`, the
  reference's find_supported_resolutions + get_best_fit, same float arithmetic);
- resize without distortion, upscaling at most to one tile (`F.resize` on a PIL image is Pillow's
  own `Image.resize(..., BILINEAR)`, which is what is called here), then paste onto a black canvas;
- `ToTensor` + `Normalize(0.5, 0.5)`: bytes / 255 as float32, then (x - 0.5) / 0.5;
- split into tiles row by row, and, when there is more than one tile, append the whole image
  resized to one tile (`tv.Resize((h, w))`: again Pillow bilinear) as the last chunk.
Each chunk becomes (tile / patch)^2 * pixel_shuffle_ratio^2 `<|patch|>` tokens.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from PIL import Image

from engine.vision import Preprocessed

MAX_NUM_CHUNKS = 16  # llama-models' ChatFormat default (and its generation.py's)


class Llama4ImagePreprocessor:
    """The ImagePreprocessor of Llama 4 (Scout, Maverick) for one checkpoint's `vision_args`."""

    def __init__(self, *, tile_size: int, patch_size: int, pixel_shuffle_ratio: float,
                 max_num_chunks: int = MAX_NUM_CHUNKS) -> None:
        if tile_size % patch_size:
            raise ValueError(f"image size {tile_size} is not a multiple of patch size {patch_size}")
        self.tile_size = tile_size
        self.max_num_chunks = max_num_chunks
        ds_ratio = int(round(1.0 / (pixel_shuffle_ratio**2)))
        self.tokens_per_chunk = int((tile_size // patch_size) ** 2 // ds_ratio)  # chat_format._encode_image

    def preprocess(self, image: Image.Image) -> Preprocessed:
        canvas_w, canvas_h = best_canvas(image.size, self.max_num_chunks, self.tile_size)
        resized = image.resize(fit_without_distortion(image.size, (canvas_w, canvas_h), self.tile_size),
                               Image.Resampling.BILINEAR)
        padded = Image.new("RGB", (canvas_w, canvas_h), (0, 0, 0))
        padded.paste(resized)
        rows, cols = canvas_h // self.tile_size, canvas_w // self.tile_size
        tiles = split_tiles(to_normalized_tensor(padded), rows, cols)
        if rows * cols > 1:
            whole = to_normalized_tensor(image.resize((self.tile_size, self.tile_size), Image.Resampling.BILINEAR))
            tiles = torch.cat((tiles, whole.unsqueeze(0)), dim=0)
        return Preprocessed(pixels=tiles, aspect_ratio=(rows, cols), num_chunks=tiles.shape[0],
                            tokens_per_chunk=self.tokens_per_chunk)


def supported_canvases(max_num_chunks: int, tile_size: int) -> list[tuple[int, int]]:
    """(height, width) canvases of up to max_num_chunks tiles, in the reference's order."""
    by_ratio: dict[float, list[tuple[int, int]]] = defaultdict(list)
    for chunks in range(max_num_chunks, 0, -1):
        factors = {f for i in range(1, int(chunks**0.5) + 1) if chunks % i == 0 for f in (i, chunks // i)}
        for height in sorted(factors):
            by_ratio[height / (chunks // height)].append((height, chunks // height))
    return [(h * tile_size, w * tile_size) for canvases in by_ratio.values() for h, w in canvases]


def best_canvas(image_size: tuple[int, int], max_num_chunks: int, tile_size: int) -> tuple[int, int]:
    """(width, height) of the canvas: the reference's get_best_fit, with its tensor arithmetic
    (float32 scales) kept, so that ties resolve the same way. It reads its (height, width) list
    as (width, height) pairs; the list holds both orientations, so only the tie order depends on
    it, and this keeps the reference's reading."""
    canvases = torch.tensor(supported_canvases(max_num_chunks, tile_size))
    width, height = image_size
    scale_w = canvases[:, 0] / width
    scale_h = canvases[:, 1] / height
    scales = torch.where(scale_w > scale_h, scale_h, scale_w)
    upscaling = scales[scales >= 1]
    selected = torch.min(upscaling) if len(upscaling) > 0 else torch.max(scales[scales < 1])
    chosen = canvases[scales == selected]
    if len(chosen) > 1:
        chosen = chosen[torch.argmin(chosen[:, 0] * chosen[:, 1])].unsqueeze(0)
    first, second = chosen[0].tolist()
    return first, second


def fit_without_distortion(image_size: tuple[int, int], canvas: tuple[int, int], max_upscaling: int) -> tuple[int, int]:
    """(width, height) to resize to: the reference's resize_without_distortion with
    max_upscaling_size = one tile (resize_to_max_canvas False), then get_max_res_without_distortion."""
    width, height = image_size
    target_w = min(max(width, max_upscaling), canvas[0])
    target_h = min(max(height, max_upscaling), canvas[1])
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        new_w, new_h = target_w, min(math.floor(height * scale_w), target_h)
    else:
        new_w, new_h = min(math.floor(width * scale_h), target_w), target_h
    return max(new_w, 1), max(new_h, 1)


def to_normalized_tensor(image: Image.Image) -> torch.Tensor:
    """torchvision's ToTensor then Normalize(mean 0.5, std 0.5): [3, H, W] float32 in [-1, 1]."""
    data = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    pixels = data.view(image.size[1], image.size[0], 3).permute(2, 0, 1).contiguous()
    return pixels.to(torch.float32).div(255).sub_(0.5).div_(0.5)


def split_tiles(image: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[3, H, W] -> [rows * cols, 3, H / rows, W / cols], row by row (the reference's _split)."""
    channels, height, width = image.shape
    tiles = image.view(channels, rows, height // rows, cols, width // cols).permute(1, 3, 0, 2, 4).contiguous()
    return tiles.view(rows * cols, channels, height // rows, width // cols)
