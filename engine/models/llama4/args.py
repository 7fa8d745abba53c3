"""Llama 4's params.json rules and the sizes derived from them, as llama-models' llama4 computes them."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.types import CheckpointError

if TYPE_CHECKING:
    from engine.models.args import ModelArgs


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def validate_llama4_args(args: "ModelArgs", extra: dict[str, Any], bad: Callable[[str], CheckpointError]) -> None:
    """Raise bad(...) for a Llama 4 params.json the reference could not run."""
    head_dim = extra.get("head_dim")
    if head_dim is not None and head_dim != args.dim // args.n_heads:
        # the reference's Attention and RoPE table use dim // n_heads whatever head_dim says
        raise bad(f"head_dim {head_dim!r} differs from dim // n_heads = {args.dim // args.n_heads}")
    for name in ("attention_chunk_size", "nope_layer_interval"):
        value = getattr(args, name)
        if value is not None and not _positive_int(value):
            raise bad(f"{name} must be a positive integer, found {value!r}")
    moe = args.moe_args
    if moe is None:
        return
    if not _positive_int(moe.num_experts):
        raise bad(f"moe_args.num_experts must be a positive integer, found {moe.num_experts!r}")
    if not _positive_int(moe.top_k) or moe.top_k > moe.num_experts:
        raise bad(f"moe_args.top_k must be in [1, num_experts={moe.num_experts}], found {moe.top_k!r}")
    if not _positive_int(moe.interleave_moe_layer_step):
        raise bad(f"moe_args.interleave_moe_layer_step must be a positive integer, found {moe.interleave_moe_layer_step!r}")
    if not (isinstance(moe.capacity_factor, (int, float)) and moe.capacity_factor > 0):
        raise bad(f"moe_args.capacity_factor must be > 0, found {moe.capacity_factor!r}")
    for name in ("ffn_exp", "ffn_dim_multiplier"):  # the reference's MoE hidden size reads both
        value = getattr(args, name)
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
            raise bad(f"a mixture-of-experts params.json needs {name} > 0, found {value!r}")


VISION_PREFIXES = ("vision_embeddings.", "vision_projection.")  # the vision weights' names in Meta's shards


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """params.json's vision_args (llama-models' llama4 VisionArgs), the fields the encoder and its
    weights' shapes read (engine/models/llama4/vision.py, engine/loading/layout.py)."""

    image_size: int  # tile side, pixels
    patch_size: int
    dim: int
    n_layers: int
    n_heads: int
    pixel_shuffle_ratio: float
    mlp_ratio: float = 4.0  # the encoder MLP's hidden size: int(mlp_ratio * dim), as the reference
    output_dim: int = 4096  # the adapter's width (VisionArgs' defaults)

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.mlp_ratio * self.dim)

    @property
    def shuffled_dim(self) -> int:
        """The adapter's input width: PixelShuffleMLP's int(input_dim // ps_ratio ** 2)."""
        return int(self.dim // (self.pixel_shuffle_ratio**2))

    @classmethod
    def from_params(cls, vision_args: Mapping, *, source: str = "params.json") -> "VisionConfig":
        try:
            size, patch = vision_args["image_size"], vision_args["patch_size"]
            if size["height"] != size["width"] or patch["height"] != patch["width"]:
                raise CheckpointError(f"{source}: only square tiles and patches are served (as every Llama 4 release ships)")
            optional = {name: vision_args[name] for name in ("mlp_ratio", "output_dim") if name in vision_args}
            return cls(image_size=int(size["width"]), patch_size=int(patch["width"]), dim=int(vision_args["dim"]),
                       n_layers=int(vision_args["n_layers"]), n_heads=int(vision_args["n_heads"]),
                       pixel_shuffle_ratio=float(vision_args["pixel_shuffle_ratio"]),
                       **{k: (float if k == "mlp_ratio" else int)(v) for k, v in optional.items()})
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{source}: vision_args is not llama-models' VisionArgs ({type(exc).__name__}: {exc})") from None

    def parallel_size_problems(self, mp_size: int) -> list[str]:
        """What model-parallel size mp_size does not divide: the reference's fairscale layers split
        the encoder's heads, widths and the adapter's width."""
        sizes = {"heads": self.n_heads, "width": self.dim, "MLP hidden size": self.mlp_hidden_dim,
                 "adapter width": self.output_dim}
        return [f"the vision encoder's {name} {value}" for name, value in sizes.items() if value % mp_size]


def vision_config(extra: Mapping[str, Any], *, source: str = "params.json") -> VisionConfig | None:
    """A Llama 4 params.json's vision_args (kept in ModelArgs.extra), or None for a text-only one."""
    vision_args = extra.get("vision_args")
    return None if vision_args is None else VisionConfig.from_params(vision_args, source=source)


def is_moe_layer(args: "ModelArgs", layer_id: int) -> bool:
    return args.moe_args is not None and (layer_id + 1) % args.moe_args.interleave_moe_layer_step == 0


def is_nope_layer(args: "ModelArgs", layer_id: int) -> bool:
    """No positional encoding (and global attention) on every nope_layer_interval-th layer."""
    return args.nope_layer_interval is not None and (layer_id + 1) % args.nope_layer_interval == 0


def moe_hidden_dim(args: "ModelArgs") -> int:
    """Each expert's (and the shared expert's) SwiGLU hidden size: llama4 MoE.__init__'s arithmetic."""
    moe = args.moe_args
    hidden = int(args.ffn_exp * args.dim)
    hidden = int(2 * hidden / 3)
    hidden = int(args.ffn_dim_multiplier * hidden)
    if moe.auto_scale_F:
        hidden = int(hidden / (moe.capacity_factor + 1))
    return hidden + (-hidden % args.multiple_of)


def apply_scaling(freqs: torch.Tensor, scale_factor: float, high_freq_factor: float) -> torch.Tensor:
    """Llama 4's RoPE frequency scaling (llama4 model.apply_scaling): as Llama 3.1's with the
    high-frequency factor a parameter (1 for Scout: no smooth band)."""
    low_freq_factor, old_context_len = 1, 8192
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / freqs
    if low_freq_wavelen != high_freq_wavelen:
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        banded = (1 - smooth) * freqs / scale_factor + smooth * freqs
    else:  # the band is empty
        banded = freqs
    return torch.where(wavelen < high_freq_wavelen, freqs, torch.where(wavelen > low_freq_wavelen, freqs / scale_factor, banded))


def precompute_freqs_cis(args: "ModelArgs", end: int, dtype: torch.dtype) -> torch.Tensor:
    """[end, head_dim // 2] complex rotations (the reference's table, here in `dtype`)."""
    head_dim = args.dim // args.n_heads
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, head_dim, 2, dtype=dtype)[: head_dim // 2] / head_dim))
    if args.use_scaled_rope:
        freqs = apply_scaling(freqs, args.rope_scaling_factor or 16.0, args.rope_high_freq_factor or 1.0)
    angles = torch.outer(torch.arange(end, dtype=dtype), freqs)
    return torch.polar(torch.ones_like(angles), angles)
