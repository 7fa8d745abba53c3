"""Llama 3.2 Vision's sizes: the cross-attention schedule (params.json) and the image encoder's
sizes, which llama-models hard-codes (width 1280, 32 + 8 layers, patch 14, 4 tiles) and which are
read here from the weights' shapes instead, so a checkpoint of any size loads."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.types import CheckpointError

# What llama-models fixes in code, not in params.json nor in any weight's shape.
VISION_HEADS = 16  # ImageAttention heads (head size = width / 16)
INTERMEDIATE_LAYERS = (3, 7, 15, 23, 30)  # encoder layers whose inputs are concatenated to its output
IMAGE_TOKEN_ROWS = 8  # learnable_embedding rows (max(mp_size, 8)); row 0 is <|image|>'s
ENCODER = "vision_model.vision_encoder."


def fusion_schedule(n_layers: int, num_cross_attention_layers: int) -> list[int]:
    """The text layers a cross-attention layer runs before (CrossAttentionTransformerText._init_fusion_schedule)."""
    k = math.ceil(n_layers / num_cross_attention_layers)
    return list(range(n_layers))[::-1][::k][:num_cross_attention_layers][::-1]


@dataclass(frozen=True, slots=True)
class VisionDims:
    """The image encoder's sizes, from its weights."""

    width: int  # encoder hidden size (1280 in the release)
    patch_size: int  # pixels per patch side (14)
    grid: int  # patches per tile side (vision_chunk_size // patch_size)
    max_tiles: int  # tile position tables' side (4)
    layers: int  # local transformer layers (32)
    global_layers: int  # gated global transformer layers (8)
    intermediate: tuple[int, ...]  # local layers whose inputs join the output (INTERMEDIATE_LAYERS below `layers`)

    @property
    def tokens_per_tile(self) -> int:
        return self.grid * self.grid + 1  # patches and the class token

    @property
    def output_dim(self) -> int:
        return (len(self.intermediate) + 1) * self.width

    @classmethod
    def release(cls, chunk_size: int) -> "VisionDims":
        """The released encoder's sizes (llama-models' constants), for estimates made before the
        weights are opened (memory budgets)."""
        return cls(1280, 14, chunk_size // 14, 4, 32, 8, INTERMEDIATE_LAYERS)

    @classmethod
    def from_shapes(cls, shapes: Mapping[str, Any], chunk_size: int, *, source: str) -> "VisionDims":
        """From a shard's tensor shapes (full, or column-split over `shapes`' model-parallel size:
        only replicated tensors and layer counts are read)."""

        def shape(key: str) -> tuple[int, ...]:
            if ENCODER + key not in shapes:
                raise CheckpointError(f"{source}: missing key {ENCODER + key!r} of a Llama 3.2 Vision checkpoint")
            return tuple(shapes[ENCODER + key])

        width = shape("class_embedding")[0]
        max_tiles, _, tokens, _ = shape("gated_positional_embedding")
        grid = math.isqrt(tokens - 1)
        if grid * grid != tokens - 1 or chunk_size % grid:
            raise CheckpointError(f"{source}: positional embedding of {tokens} tokens does not fit vision_chunk_size {chunk_size}")
        layers = _count(shapes, ENCODER + "transformer.resblocks.")
        global_layers = _count(shapes, ENCODER + "global_transformer.resblocks.")
        intermediate = tuple(i for i in INTERMEDIATE_LAYERS if i < layers)
        if width % VISION_HEADS:
            raise CheckpointError(f"{source}: vision width {width} does not split into {VISION_HEADS} heads")
        return cls(width, chunk_size // grid, grid, max_tiles, layers, global_layers, intermediate)


def _count(shapes: Mapping[str, Any], prefix: str) -> int:
    ids = {int(k[len(prefix):].split(".", 1)[0]) for k in shapes if k.startswith(prefix)}
    return max(ids) + 1 if ids else 0
