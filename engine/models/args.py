"""A checkpoint's architecture: params.json, field for field as Meta writes it (ModelArgs).

Beside the model that reads it (engine/models/llama.py, engine/models/llama4/): the loader imports the
models, never the reverse. Llama 4's own rules and derived sizes are engine/models/llama4/args.py.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from engine.models.llama4.args import validate_llama4_args
from engine.types import CheckpointError

log = logging.getLogger(__name__)

# params.json fields that mean these weights are not plain dense Llama text weights.
# quantization_args / lora_args (Meta's int4 QLoRA and SpinQuant releases) are read by
# engine/loading/meta_quantized.py from `extra`
_INCOMPATIBLE_FIELDS = {
    "vision_args": "vision checkpoints are not supported",
}
# Llama 4's params.json has vision_args (kept in `extra`; engine/models/llama4/args.py, vision_config).
_LLAMA4_ALLOWED = frozenset({"vision_args"})


@dataclass(frozen=True, slots=True)
class MoEArgs:
    """params.json's moe_args (llama-models' llama4 MoEArgs, same defaults)."""

    num_experts: int = -1
    capacity_factor: float = 1.0
    auto_scale_F: bool = True  # noqa: N815 (Meta's name) hidden size scaled so active params match a dense layer
    top_k: int = 1
    interleave_moe_layer_step: int = 1  # every n-th layer is MoE (Maverick 2, Scout 1)

    @classmethod
    def from_params(cls, params: Any, *, source: str) -> "MoEArgs":
        if isinstance(params, MoEArgs):
            return params
        if not isinstance(params, dict):
            raise CheckpointError(f"{source}: moe_args must be an object, found {type(params).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - names)
        if unknown:
            log.info("%s: ignoring moe_args keys %s", source, ", ".join(unknown))
        return cls(**{k: v for k, v in params.items() if k in names})


_LLAMA4_FIELDS = frozenset(
    {"ffn_exp", "attention_chunk_size", "rope_high_freq_factor", "nope_layer_interval", "use_qk_norm",
     "attn_temperature_tuning", "floor_scale", "attn_scale", "moe_args"}
)  # fmt: skip


_VISION_FIELDS = ("vision_chunk_size", "vision_max_num_chunks", "vision_num_cross_attention_layers")


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """params.json, field for field as Meta writes it (llama3 reference `ModelArgs`)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None  # None: multi-head attention (n_kv_heads == n_heads)
    vocab_size: int = -1  # -1 (Llama 2): from the tokenizer
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    use_scaled_rope: bool = False  # Llama 3.1 long-context frequency scaling
    rope_scaling_factor: float | None = None  # with use_scaled_rope; None: 8 (Llama 3.1), 32 for Llama 3.2 1B/3B
    tie_word_embeddings: bool = False  # output.weight may be absent and shares tok_embeddings
    # Llama 4 (llama-models' llama4/args.py; engine/models/llama4/ reads them). Defaults: Llama 3 behaviour.
    ffn_exp: float | None = None  # MoE feed-forward size as a multiple of dim
    attention_chunk_size: int | None = None  # chunked local attention on the RoPE layers
    rope_high_freq_factor: float | None = None  # Llama 4's RoPE scaling (with rope_scaling_factor)
    nope_layer_interval: int | None = None  # every n-th layer has no positional encoding
    use_qk_norm: bool = False
    attn_temperature_tuning: bool = False  # on the NoPE layers
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    moe_args: MoEArgs | None = None
    # Llama 3.2 Vision (engine/models/mllama/): image tile side in pixels, tiles per image at most,
    # cross-attention layers interleaved with the text layers. None: a text model.
    vision_chunk_size: int | None = None
    vision_max_num_chunks: int = 4
    vision_num_cross_attention_layers: int = 0
    extra: tuple[tuple[str, Any], ...] = ()  # params.json keys this engine does not use, kept for the record

    @classmethod
    def from_params(cls, params: dict[str, Any], *, source: str, defaults: dict[str, Any] | None = None) -> "ModelArgs":
        """Build from params.json content; unknown keys are kept in `extra` and logged."""
        if not isinstance(params, dict):
            raise CheckpointError(f"{source}: expected a JSON object, found {type(params).__name__}")
        llama4 = params.get("moe_args") is not None
        for key, why in _INCOMPATIBLE_FIELDS.items():
            if params.get(key) is not None and not (llama4 and key in _LLAMA4_ALLOWED):
                raise CheckpointError(f"{source}: has {key!r}: {why}")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {**(defaults or {}), **{k: v for k, v in params.items() if k in names}}
        if known.get("moe_args") is not None:
            known["moe_args"] = MoEArgs.from_params(known["moe_args"], source=source)
        extra = tuple(sorted((k, v) for k, v in params.items() if k not in names))
        if extra:
            log.info("%s: ignoring params.json keys %s", source, ", ".join(k for k, _ in extra))
        missing = [k for k in ("dim", "n_layers", "n_heads") if k not in known]
        if missing:
            raise CheckpointError(f"{source}: missing required field(s) {', '.join(missing)}")
        try:
            args = cls(**known, extra=extra)
        except TypeError as exc:
            raise CheckpointError(f"{source}: {exc}") from None
        args.validate(source)
        return args

    def validate(self, source: str) -> None:
        def bad(message: str) -> CheckpointError:
            return CheckpointError(f"{source}: {message}")

        for name in ("dim", "n_layers", "n_heads", "multiple_of"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise bad(f"{name} must be a positive integer, found {value!r}")
        if self.dim % self.n_heads or self.head_dim % 2:
            raise bad(f"dim {self.dim} must split into {self.n_heads} heads of even size")
        if self.n_kv_heads is not None and (self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads):
            raise bad(f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.n_kv_heads}")
        if not self.norm_eps > 0 or not self.rope_theta > 0:
            raise bad("norm_eps and rope_theta must be > 0")
        if self.rope_scaling_factor is not None and not self.rope_scaling_factor >= 1:
            raise bad(f"rope_scaling_factor must be >= 1, found {self.rope_scaling_factor!r}")
        if self.is_llama4:
            validate_llama4_args(self, dict(self.extra), bad)
        if self.is_mllama:
            for name in _VISION_FIELDS:
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                    raise bad(f"{name} must be a positive integer, found {value!r}")
            if self.vision_num_cross_attention_layers > self.n_layers:
                raise bad(f"vision_num_cross_attention_layers {self.vision_num_cross_attention_layers} exceeds n_layers {self.n_layers}")

    def to_params(self) -> dict[str, Any]:
        """params.json content (the inverse of from_params)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        if self.vision_chunk_size is None:  # text models' params.json carry no vision fields
            for name in _VISION_FIELDS:
                del out[name]
        for optional in ("n_kv_heads", "rope_scaling_factor"):
            if out[optional] is None:
                del out[optional]
        if not out["tie_word_embeddings"]:
            del out["tie_word_embeddings"]
        for f in dataclasses.fields(self):  # Llama 4 fields only when they differ from Llama 3's defaults
            if f.name in _LLAMA4_FIELDS and out[f.name] == f.default:
                del out[f.name]
        if self.moe_args is not None:
            out["moe_args"] = dataclasses.asdict(self.moe_args)
        return {**out, **dict(self.extra)}

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def architecture(self) -> str:
        """The model family these args describe, a key of engine.models.MODEL_CLASSES."""
        return "llama4" if self.is_llama4 else "mllama" if self.is_mllama else "llama"

    @property
    def is_llama4(self) -> bool:
        """Llama 4's architecture (engine/models/llama4/): MoE, NoPE layers, chunked attention, qk-norm."""
        return self.moe_args is not None or self.nope_layer_interval is not None or self.attention_chunk_size is not None or self.use_qk_norm

    @property
    def is_mllama(self) -> bool:
        """Llama 3.2 Vision (engine/models/mllama/): an image encoder and cross-attention layers."""
        return self.vision_chunk_size is not None

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size, computed exactly as the llama3 reference FeedForward does."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)
