"""Llama 4 Hugging Face folders (`Llama4ForCausalLM`, `Llama4ForConditionalGeneration`) as Meta weights.

What transformers' Llama 4 code (models/llama4: modeling_llama4.py, configuration_llama4.py and its
convert_llama4_weights_to_hf.py) reads and writes, mapped to the names and layout of our Llama 4
model (engine/models/llama4/, the shipped keys in engine/loading/llama4.py):

- config.json (top level for Llama4ForCausalLM, `text_config` for Llama4ForConditionalGeneration) to
  params.json fields. transformers' defaults apply to keys a config leaves out (use_qk_norm,
  attn_temperature_tuning and a chunk of 8192 are on unless it says otherwise). `no_rope_layers`
  (1: RoPE, 0: NoPE) must be every n-th layer (-> nope_layer_interval), `moe_layers` every n-th
  (-> moe_args.interleave_moe_layer_step); `intermediate_size` (each expert's and the shared
  expert's hidden size) and `intermediate_size_mlp` (the dense layers') are reproduced by
  ffn_exp / ffn_dim_multiplier / multiple_of (llama4_ffn_params); rope type "llama3" with
  low_freq_factor 1 and original_max_position_embeddings 8192 -> use_scaled_rope, its factor and
  high_freq_factor (Llama 4's own apply_scaling).
- q/k are NOT un-permuted: transformers' Llama 4 applies RoPE to adjacent pairs as complex numbers
  (its apply_rotary_emb views the rows as (..., -1, 2) pairs, as Meta's code does) and its
  converter leaves permute_for_rope commented out; tests/engine/test_hf_llama4.py checks the logits
  against transformers' own forward.
- MoE: router.weight [E, D] -> router_DE [D, E] (its transpose); experts.gate_up_proj [E, D, 2F]
  -> experts.w1 [E, D, F] (gate: the first F columns) and experts.w3 (up: the last F);
  experts.down_proj [E, F, D] -> experts.w2; shared_expert.{gate,up,down}_proj -> w1, w3, w2.
  All views of the mapped file: no copy.
- The vision encoder and projector (`vision_model.*`, `multi_modal_projector.*`) are skipped with a
  log line: such a folder serves text. Meta's download of the same model (its original/ folder)
  serves images too.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from engine.types import CheckpointError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ARCHITECTURES = frozenset({"Llama4ForCausalLM", "Llama4ForConditionalGeneration"})
# Llama4TextConfig's defaults (transformers 5), for keys a config.json leaves out
_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5, "head_dim": 128, "num_local_experts": 16, "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 1, "use_qk_norm": True, "no_rope_layer_interval": 4, "attention_chunk_size": 8192,
    "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1, "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}  # fmt: skip
_VISION_PREFIXES = ("vision_model.", "multi_modal_projector.")

# HF name after "layers.N." -> Meta / reference name after "layers.N."
_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "feed_forward.gate_proj.weight": "feed_forward.w1.weight",  # dense layers
    "feed_forward.up_proj.weight": "feed_forward.w3.weight",
    "feed_forward.down_proj.weight": "feed_forward.w2.weight",
    "feed_forward.shared_expert.gate_proj.weight": "feed_forward.shared_expert.w1.weight",
    "feed_forward.shared_expert.up_proj.weight": "feed_forward.shared_expert.w3.weight",
    "feed_forward.shared_expert.down_proj.weight": "feed_forward.shared_expert.w2.weight",
    "feed_forward.experts.down_proj": "feed_forward.experts.w2",  # [E, F, D], the reference's own layout
}
_GLOBAL_NAMES = {"embed_tokens.weight": "tok_embeddings.weight", "norm.weight": "norm.weight", "lm_head.weight": "output.weight"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def is_llama4_config(config: dict[str, Any]) -> bool:
    architectures = config.get("architectures") or []
    return any(a in ARCHITECTURES for a in architectures) or config.get("model_type") in ("llama4", "llama4_text")


def text_config(config: dict[str, Any], source: Path) -> dict[str, Any]:
    """The text model's settings: `text_config` of a Llama4ForConditionalGeneration, else the top level."""
    text = config.get("text_config", config)
    if not isinstance(text, dict):
        raise CheckpointError(f"{source}: text_config must be an object, found {type(text).__name__}")
    return text


# --------------------------------------------------------------------------- config.json -> params.json
def _get(text: dict[str, Any], key: str) -> Any:
    value = text.get(key)
    return _DEFAULTS.get(key) if value is None else value


def _positive_int(text: dict[str, Any], key: str, source: Path) -> int:
    value = _get(text, key)
    if value is None:
        raise CheckpointError(f"{source}: missing {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"{source}: {key} must be a positive integer, found {value!r}")
    return value


def every_nth(layers: set[int], n_layers: int, key: str, source: Path) -> int | None:
    """n such that `layers` are exactly the layers i with (i + 1) % n == 0 (the only pattern Meta's
    params.json can state); None for no layers; CheckpointError naming `key` for another pattern."""
    if not layers:
        return None
    n = min(layers) + 1
    if layers != {i for i in range(n_layers) if (i + 1) % n == 0}:
        raise CheckpointError(f"{source}: {key} {sorted(layers)} is not every n-th layer; not supported")
    return n


def _rope_params(text: dict[str, Any], source: Path) -> dict[str, Any]:
    """rope_parameters (transformers 5) or rope_scaling + rope_theta (4.x) -> Llama 4's RoPE fields."""
    scaling = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise CheckpointError(f"{source}: rope_parameters must be an object, found {type(scaling).__name__}")
    theta = scaling.get("rope_theta", _get(text, "rope_theta"))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    params: dict[str, Any] = {"rope_theta": float(theta), "use_scaled_rope": False}
    if kind in (None, "default"):
        return params
    if kind != "llama3":
        raise CheckpointError(f"{source}: rope type {kind!r} is not supported (Llama 4's is 'llama3')")
    # engine/models/llama4/args.py's apply_scaling fixes these two, as Meta's llama4 code does
    for key, fixed in (("low_freq_factor", 1.0), ("original_max_position_embeddings", 8192)):
        if key in scaling and float(scaling[key]) != fixed:
            raise CheckpointError(f"{source}: rope {key} {scaling[key]!r} is not supported (Llama 4's is {fixed:g})")
    factor, high = scaling.get("factor"), scaling.get("high_freq_factor", 1.0)
    for key, value in (("factor", factor), ("high_freq_factor", high)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1:
            raise CheckpointError(f"{source}: rope {key} must be a number >= 1, found {value!r}")
    return {**params, "use_scaled_rope": True, "rope_scaling_factor": float(factor), "rope_high_freq_factor": float(high)}


def llama4_ffn_params(dim: int, dense_hidden: int, moe_hidden: int | None) -> dict[str, Any]:
    """ffn_exp, ffn_dim_multiplier, multiple_of and the MoE scaling under which llama-models' llama4
    formulas (engine/models/args.py ffn_hidden_dim for the dense layers, engine/models/llama4/args.py
    moe_hidden_dim for the experts) give exactly these sizes: Meta's published form first (Scout and
    Maverick: ffn_exp 4, multiplier 1.2, auto_scale_F), else an exact form with multiple_of 1."""
    from engine.models.args import ModelArgs, MoEArgs
    from engine.models.llama4.args import moe_hidden_dim

    def fits(candidate: dict[str, Any]) -> bool:
        moe = candidate.get("moe_args")
        args = ModelArgs(dim=dim, n_layers=1, n_heads=1, **{**candidate, "moe_args": MoEArgs(num_experts=1, **moe) if moe else None})
        return args.ffn_hidden_dim == dense_hidden and (moe_hidden is None or moe_hidden_dim(args) == moe_hidden)

    scaled = {"capacity_factor": 1.0, "auto_scale_F": True}
    for multiple_of in (2048, 1024, 256):
        candidate = {"ffn_exp": 4.0, "ffn_dim_multiplier": 1.2, "multiple_of": multiple_of, "moe_args": scaled}
        if fits(candidate):
            return candidate
    # multiple_of 1: the dense size is int(multiplier * int(8 * dim / 3)), the experts' int(multiplier *
    # int(2 * int(ffn_exp * dim) / 3)); the fractions keep the products off integer boundaries
    base = int(2 * (4 * dim) / 3)
    for fraction in (0.5, 0.25, 0.75, 0.1, 0.9):
        multiplier = (dense_hidden + fraction) / base
        candidate = {"ffn_exp": 4.0, "ffn_dim_multiplier": multiplier, "multiple_of": 1, "moe_args": {"auto_scale_F": False}}
        if moe_hidden is not None:
            inner = math.ceil(moe_hidden / multiplier)  # int(2 * int(ffn_exp * dim) / 3) must be this
            outer = math.ceil(3 * inner / 2)  # ... and int(ffn_exp * dim) this
            candidate["ffn_exp"] = (outer + 0.5) / dim
        if fits(candidate):
            return candidate
    raise CheckpointError(f"cannot express intermediate_size {moe_hidden} and intermediate_size_mlp {dense_hidden} "
                          f"for hidden_size {dim} in Llama 4's params.json")  # fmt: skip


def refuse_biases_and_activation(config: dict[str, Any], source: Path, family: str) -> None:
    """CheckpointError for a Hugging Face config with linear biases or an activation other than
    SiLU, which no Llama has (the Llama 3 mapping in hf_checkpoint.py refuses them here too)."""
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise CheckpointError(f"{source}: {flag} is true; {family} has no biases")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{source}: hidden_act {act!r} is not supported ({family}'s is 'silu')")


def llama4_config_params(config: dict[str, Any], source: Path) -> dict[str, Any]:
    """params.json fields for a Llama 4 config.json (module docstring); CheckpointError naming the
    field it cannot run."""
    text = text_config(config, source)
    refuse_biases_and_activation(text, source, "Llama 4")
    dim, n_heads = _positive_int(text, "hidden_size", source), _positive_int(text, "num_attention_heads", source)
    n_layers = _positive_int(text, "num_hidden_layers", source)
    if dim % n_heads or _get(text, "head_dim") != dim // n_heads:
        raise CheckpointError(f"{source}: head_dim {_get(text, 'head_dim')!r} differs from hidden_size / "
                              f"num_attention_heads = {dim / n_heads:g}; not supported")  # fmt: skip
    no_rope = text.get("no_rope_layers")
    if not no_rope:  # transformers builds it from no_rope_layer_interval (an empty list too)
        interval = _positive_int(text, "no_rope_layer_interval", source)
        no_rope = [int((i + 1) % interval != 0) for i in range(n_layers)]
    if not isinstance(no_rope, list) or len(no_rope) < n_layers:
        raise CheckpointError(f"{source}: no_rope_layers must list at least num_hidden_layers ({n_layers}) entries")
    nope_interval = every_nth({i for i in range(n_layers) if not no_rope[i]}, n_layers, "no_rope_layers (0: NoPE)", source)
    # null: no chunked attention (only a missing key takes transformers' default)
    chunk = text["attention_chunk_size"] if "attention_chunk_size" in text else _DEFAULTS["attention_chunk_size"]
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0):
        raise CheckpointError(f"{source}: attention_chunk_size must be a positive integer or null, found {chunk!r}")
    expected_types = ["chunked_attention" if no_rope[i] and chunk is not None else "full_attention" for i in range(n_layers)]
    if text.get("layer_types") is not None and list(text["layer_types"])[:n_layers] != expected_types:
        raise CheckpointError(f"{source}: layer_types {text['layer_types']} differ from Llama 4's (chunked attention "
                              f"on the RoPE layers: {expected_types}); not supported")  # fmt: skip
    step = _positive_int(text, "interleave_moe_layer_step", source)
    moe_layers = text.get("moe_layers")
    moe_layers = list(range(step - 1, n_layers, step)) if moe_layers is None else moe_layers
    moe_step = every_nth(set(moe_layers), n_layers, "moe_layers", source)
    moe_hidden = _positive_int(text, "intermediate_size", source) if moe_step else None
    ffn = llama4_ffn_params(dim, _positive_int(text, "intermediate_size_mlp", source), moe_hidden)
    moe_args = None
    if moe_step is not None:
        moe_args = {"num_experts": _positive_int(text, "num_local_experts", source), "top_k": _positive_int(text, "num_experts_per_tok", source),
                    "capacity_factor": 1.0, "auto_scale_F": True, **ffn["moe_args"], "interleave_moe_layer_step": moe_step}  # fmt: skip
    params: dict[str, Any] = {
        "dim": dim,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": text.get("num_key_value_heads") or n_heads,
        "vocab_size": _positive_int(text, "vocab_size", source),
        "multiple_of": ffn["multiple_of"],
        "ffn_dim_multiplier": ffn["ffn_dim_multiplier"],
        "ffn_exp": ffn["ffn_exp"],
        "norm_eps": float(_get(text, "rms_norm_eps")),
        **_rope_params(text, source),
        "nope_layer_interval": nope_interval,
        "attention_chunk_size": chunk,
        "use_qk_norm": bool(_get(text, "use_qk_norm")),
        "attn_temperature_tuning": bool(_get(text, "attn_temperature_tuning")),  # older configs say 4: on
        "floor_scale": float(_get(text, "floor_scale")),
        "attn_scale": float(_get(text, "attn_scale")),
        "moe_args": moe_args,
        "tie_word_embeddings": bool(_get(text, "tie_word_embeddings")),
    }
    if "max_position_embeddings" in text:
        params["max_seq_len"] = text["max_position_embeddings"]
    return params


# --------------------------------------------------------------------------- weights
def llama4_tensors(hf_name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The Meta-named tensors one HF tensor holds (views; gate_up_proj holds two); nothing for the
    vision weights (skipped: the caller logs them). Unknown names: KeyError."""
    name = hf_name.removeprefix("language_model.")
    if name.startswith(_VISION_PREFIXES):
        return
    name = name.removeprefix("model.")
    if name in _GLOBAL_NAMES:
        yield _GLOBAL_NAMES[name], tensor
        return
    m = _LAYER.match(name)
    if m is None:
        raise KeyError(hf_name)
    prefix, rest = f"layers.{m.group(1)}.", m.group(2)
    if rest in _LAYER_NAMES:
        yield prefix + _LAYER_NAMES[rest], tensor
    elif rest == "feed_forward.router.weight":  # nn.Linear's [E, D]; the reference multiplies x @ router_DE
        yield prefix + "feed_forward.router_DE", tensor.t()
    elif rest == "feed_forward.experts.gate_up_proj" and tensor.dim() == 3:  # [E, D, gate F | up F]
        gate, up = tensor.chunk(2, dim=2)
        yield prefix + "feed_forward.experts.w1", gate
        yield prefix + "feed_forward.experts.w3", up
    else:
        raise KeyError(hf_name)


def is_vision_tensor(hf_name: str) -> bool:
    return hf_name.removeprefix("language_model.").startswith(_VISION_PREFIXES)


__all__ = ["ARCHITECTURES", "every_nth", "is_llama4_config", "is_vision_tensor", "llama4_config_params", "llama4_ffn_params",
           "llama4_tensors", "text_config"]  # fmt: skip
