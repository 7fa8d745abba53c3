"""Llama 3.2 Vision's ImagePreprocessor (engine/vision/__init__.py): its image preprocessing, as llama-models' VariableSizeImageTransform does it
(llama3/multimodal/image_transform.py), over Pillow and torch only (torchvision's PyPI wheel is a
CUDA build that cannot load beside torch+cpu; the reference's torchvision calls on a PIL image
are Pillow's resize, a uint8 -> float / 255 conversion and a per-channel normalisation).

Steps: the best canvas of whole tiles for the image (at most max_num_chunks tiles), a resize
without distortion (Pillow bilinear, never upscaling past one tile unless the image is smaller),
black padding to the canvas, normalisation, then the canvas cut into tiles row by row. Output:
[tiles, 3, size, size] float32 and the aspect ratio (tile rows, tile columns).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from PIL import Image

from engine.models.args import ModelArgs
from engine.vision import Preprocessed
from engine.vision.llama4 import fit_without_distortion, split_tiles

MEAN = (0.48145466, 0.4578275, 0.40821073)  # CLIP's, as the reference normalises
STD = (0.26862954, 0.26130258, 0.27577711)


def supported_resolutions(max_num_chunks: int, size: int) -> list[tuple[int, int]]:
    """Every canvas of up to max_num_chunks tiles, as (width, height) in pixels, in the reference's order."""
    by_ratio: dict[float, list[tuple[int, int]]] = defaultdict(list)
    for chunks in range(max_num_chunks, 0, -1):
        factors = sorted({f for i in range(1, math.isqrt(chunks) + 1) if chunks % i == 0 for f in (i, chunks // i)})
        for factor in factors:
            by_ratio[factor / (chunks // factor)].append((factor, chunks // factor))
    return [(a * size, b * size) for pairs in by_ratio.values() for a, b in pairs]


def best_fit(image_size: tuple[int, int], resolutions: list[tuple[int, int]]) -> tuple[int, int]:
    """The canvas needing the least upscaling (else the least downscaling), smallest area on a tie
    (get_best_fit with resize_to_max_canvas False; scales in float32 as its torch tensors hold them)."""
    width, height = image_size
    canvases = torch.tensor(resolutions)
    scale_w, scale_h = canvases[:, 0] / width, canvases[:, 1] / height
    scales = torch.where(scale_w > scale_h, scale_h, scale_w)
    up = scales[scales >= 1]
    chosen_scale = torch.min(up) if len(up) > 0 else torch.max(scales[scales < 1])
    chosen = canvases[scales == chosen_scale]
    if len(chosen) > 1:
        chosen = chosen[torch.argmin(chosen[:, 0] * chosen[:, 1])][None]
    return tuple(chosen[0].tolist())  # type: ignore[return-value]


def resize_without_distortion(image: Image.Image, canvas: tuple[int, int], max_upscaling_size: int) -> Image.Image:
    """The reference's resize_without_distortion: the size Llama 4 computes too, bilinear in Pillow."""
    return image.resize(fit_without_distortion(image.size, canvas, max_upscaling_size), Image.BILINEAR)


def clip_normalized_tensor(image: Image.Image) -> torch.Tensor:
    """ToTensor then Normalize with CLIP's mean and std (Llama 4 uses 0.5: engine/vision/llama4.py): uint8 HWC -> float32 CHW in [0, 1] -> (x - mean) / std per channel."""
    data = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    x = data.view(image.size[1], image.size[0], 3).permute(2, 0, 1).to(torch.float32).div(255)
    return x.sub_(torch.tensor(MEAN)[:, None, None]).div_(torch.tensor(STD)[:, None, None])


def transform_image(image: Image.Image, *, size: int, max_num_chunks: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """An RGB image -> ([tiles, 3, size, size] float32, (tile rows, tile columns))."""
    if image.mode != "RGB":
        image = image.convert("RGB")
    canvas = best_fit(image.size, supported_resolutions(max_num_chunks, size))
    image = resize_without_distortion(image, canvas, size)
    padded = Image.new(mode="RGB", size=canvas, color=(0, 0, 0))
    padded.paste(image)
    x = clip_normalized_tensor(padded)
    columns, rows = canvas[0] // size, canvas[1] // size
    return split_tiles(x, rows, columns), (rows, columns)


def mllama_preprocessor(args: ModelArgs) -> "MllamaImagePreprocessor | None":
    """A Llama 3.2 Vision checkpoint's preprocessor (its vision_chunk_size and vision_max_num_chunks); None otherwise."""
    if not args.is_mllama or args.vision_chunk_size is None:
        return None
    return MllamaImagePreprocessor(chunk_size=args.vision_chunk_size, max_num_chunks=args.vision_max_num_chunks)


class MllamaImagePreprocessor:
    """The ImagePreprocessor of Llama 3.2 Vision for one checkpoint's vision_chunk_size and
    vision_max_num_chunks: pixels are the image's real tiles [tiles, 3, size, size] (the model pads
    them to max_num_chunks, stack_tiles); in the prompt the image is one <|image|> token."""

    def __init__(self, *, chunk_size: int, max_num_chunks: int) -> None:
        self.chunk_size, self.max_num_chunks = chunk_size, max_num_chunks

    def preprocess(self, image: Image.Image) -> Preprocessed:
        tiles, aspect_ratio = transform_image(image, size=self.chunk_size, max_num_chunks=self.max_num_chunks)
        return Preprocessed(pixels=tiles, aspect_ratio=aspect_ratio, num_chunks=tiles.shape[0], tokens_per_chunk=0)


def stack_tiles(tiles: list[torch.Tensor], max_num_chunks: int, size: int) -> torch.Tensor:
    """Each image's tiles padded with zero tiles to max_num_chunks, as the reference's _stack_images
    pads them (its encoder sees every padding tile): [images, max_num_chunks, 3, size, size]."""
    out = torch.zeros(len(tiles), max_num_chunks, 3, size, size)
    for i, t in enumerate(tiles):
        out[i, : t.shape[0]] = t
    return out


def vision_spans(locations: list[int], num_prompt_tokens: int) -> list[tuple[int, int]]:
    """Which text positions attend each image, as [start, end) (end -1: to the end of the
    sequence), from the positions of the prompt's <|image|> tokens, as llama-models'
    create_vision_mask gives them: an image from its <|image|> token to the next one; the last to
    the prompt's end when there are several (to the sequence's end when it is the only one);
    consecutive <|image|> tokens all reach the end of the text that follows them."""
    if not locations:
        return []
    if len(locations) == 1:
        return [(locations[0], -1)]
    spans = [[a, b] for a, b in zip(locations[:-1], locations[1:])] + [[locations[-1], num_prompt_tokens]]
    last_end = spans[-1][1]
    for span in spans[::-1]:
        if span[0] == span[1] - 1:
            span[1] = last_end
        last_end = span[1]
    return [(a, b) for a, b in spans]
