"""Llama 3.2 Vision's shipped keys and how each splits across model-parallel ranks.

The release (one unnumbered consolidated.pth for 11B, consolidated.NN.pth for 90B) holds
llama-models' CrossAttentionTransformer state dict: `text_model.` + the Llama 3 text names plus
`cross_attention_layers.K.` and `learnable_embedding`, and `vision_model.` + the image encoder and
projection. normalize_shard drops `text_model.` so the text weights carry the names the text model
already loads; the layouts follow the reference's fairscale layers (ColumnParallelLinear: rows,
RowParallelLinear: columns, VocabParallelEmbedding: rows; everything else replicated;
engine/loading/layout.py mllama_layouts)."""

from __future__ import annotations

from typing import Any

from engine.models.args import ModelArgs
from engine.models.mllama.args import VisionDims

TEXT_PREFIX = "text_model."


def normalize_shard(state: dict[str, Any]) -> dict[str, Any]:
    """Shipped keys -> the names param_layouts gives (text keys without `text_model.`)."""
    return {k.removeprefix(TEXT_PREFIX): v for k, v in state.items()}


def vision_dims(state: dict[str, Any], args: ModelArgs, *, source: str) -> VisionDims:
    """The image encoder's sizes from a (normalized) shard's shapes."""
    assert args.vision_chunk_size is not None
    return VisionDims.from_shapes({k: tuple(v.shape) for k, v in state.items()}, args.vision_chunk_size, source=source)
