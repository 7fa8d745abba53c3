"""Images in: bounded decoding, and each model family's preprocessing into pixels and tokens.

The path of one image (server -> engine, off the event loop):

1. compat finds the image parts of a request and the field each came from (`messages[i].content[j]`);
   the server gets their bytes (a `data:` URL, or an http(s) fetch the operator allowed).
2. `engine.vision.decode.prepare_image(data, preprocessor, limits, param)` runs in an executor: it
   checks the byte and pixel limits (pixels from the header, before any pixel is decoded), decodes
   with Pillow (PNG, JPEG, WebP, GIF's first frame) to RGB as llama-models does, hashes the bytes,
   and calls the model's preprocessor. Every failure is `InvalidRequest` naming `param` (a 400).
3. The chat format places the image's tokens from the `PreparedImage` layout fields
   (`aspect_ratio`, `num_chunks`, `tokens_per_chunk`) and records an `ImagePlacement` (offset and
   length in the prompt) on the `EngineRequest`.
4. The model encodes `pixels` once per request and puts the results where its tokens are
   (Llama 4: early fusion over `<|patch|>` rows; Llama 3.2 Vision: cross-attention states).

The per-family protocol, `ImagePreprocessor`:

    preprocess(image: PIL.Image.Image) -> Preprocessed

takes an RGB image (already converted as llama-models' `convert_image_to_rgb` does) and returns
`Preprocessed(pixels, aspect_ratio, num_chunks, tokens_per_chunk)`: the float32 tensor the family's
encoder takes (Llama 4: [num_chunks, 3, tile, tile], tiles then the global view), the tile grid
(rows, columns), how many chunks `pixels` holds, and how many tokens each chunk becomes in the
prompt. Implementations are pure functions of the image and the checkpoint's vision arguments
(deterministic: the prefix cache keys blocks by the image's bytes). `Llama4ImagePreprocessor`
(engine/vision/llama4.py) is one; Llama 3.2 Vision's lives beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # Pillow only where images are decoded
    from PIL import Image


@dataclass(frozen=True, slots=True)
class Preprocessed:
    """What a family's preprocessor makes of one image (see the module docstring)."""

    pixels: object  # torch.Tensor, [num_chunks, 3, H, W] float32 for Llama 4
    aspect_ratio: tuple[int, int]  # (tiles high, tiles wide)
    num_chunks: int
    tokens_per_chunk: int


class ImagePreprocessor(Protocol):
    """One model family's image transform (tiles, resize, normalization) and token count."""

    def preprocess(self, image: "Image.Image") -> Preprocessed: ...
