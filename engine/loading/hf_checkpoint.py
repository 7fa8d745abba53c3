"""Hugging Face Llama folders: config.json + model*.safetensors (or pytorch_model*.bin) as Meta weights.

What TRL, Unsloth, axolotl and torchtune's HF checkpointer write, and what the Hub serves. The
reader (engine/loading/formats.py has the interface) maps:

- config.json (`LlamaForCausalLM`) to params.json fields: hidden_size -> dim, intermediate_size ->
  multiple_of / ffn_dim_multiplier that reproduce it, rope_scaling of type "llama3" -> use_scaled_rope
  with its factor, tie_word_embeddings, max_position_embeddings -> max_seq_len. Anything the model
  cannot run (biases, another activation, another RoPE scaling, pre-quantized weights) is refused
  naming the field.
- HF tensor names to Meta's (model.layers.N.self_attn.q_proj.weight -> layers.N.attention.wq.weight, ...).
- q/k rows back to Meta's rotary order. HF's converter (transformers' convert_llama_weights_to_hf.py)
  permutes Meta's adjacent-pair rows into rotate_half's halves per head:
  w.view(n_heads, head_dim // 2, 2, dim).transpose(1, 2).reshape(n_heads * head_dim, dim);
  this undoes it exactly (a reshape and a transpose: no arithmetic).

Llama 4 folders (`Llama4ForCausalLM`, `Llama4ForConditionalGeneration`) are engine/loading/hf_llama4.py's
mapping: its config fields, MoE tensors, and no q/k un-permute (its RoPE pairs are Meta's).

The result is one unsharded state dict, which the loader reshards to any model-parallel size.
safetensors files are mapped copy-on-write (engine/quant/shard_file.py's reader), so only the
un-permuted q/k rows are copied; .bin files go through torch.load(mmap=True, weights_only=True).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.loading.file_guard import guarded
from engine.loading.formats import Found, numbered_set, safetensors_load, torch_load
from engine.loading.hf_llama4 import ARCHITECTURES as LLAMA4_ARCHITECTURES
from engine.loading.hf_llama4 import is_llama4_config, is_vision_tensor, llama4_config_params, llama4_tensors, refuse_biases_and_activation
from engine.loading.json_file import read_json_object
from engine.types import CheckpointError

if TYPE_CHECKING:
    import torch

    from engine.models.args import ModelArgs

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
# Weight layouts in the order they are looked for: (index file, single file).
_LAYOUTS = (
    ("model.safetensors.index.json", "model.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model.bin"),
)
_SHARDED_SAFETENSORS = re.compile(r"^model-(\d+)-of-(\d+)\.safetensors$")  # without an index (some exporters)
_ARCHITECTURES = frozenset({"LlamaForCausalLM", "LlamaModel"})

# HF name after "model.layers.N." -> Meta name after "layers.N."
_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_GLOBAL_NAMES = {"embed_tokens.weight": "tok_embeddings.weight", "norm.weight": "norm.weight", "lm_head.weight": "output.weight"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # older exports save the RoPE table: recomputed, not read


# --------------------------------------------------------------------------- config.json -> params.json
def _require(config: dict[str, Any], key: str, source: Path) -> Any:
    if key not in config:
        raise CheckpointError(f"{source}: missing {key!r}")
    return config[key]


def _rope_params(config: dict[str, Any], source: Path) -> dict[str, Any]:
    scaling = config.get("rope_scaling")
    if not scaling:
        return {"use_scaled_rope": False}
    if not isinstance(scaling, dict):
        raise CheckpointError(f"{source}: rope_scaling must be an object, found {type(scaling).__name__}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return {"use_scaled_rope": False}
    if kind != "llama3":
        raise CheckpointError(f"{source}: rope_scaling type {kind!r} is not supported (only 'llama3', Llama 3.1's)")
    # engine/models/llama.py's apply_scaling has Meta's constants; other values would be another model.
    fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    for key, value in fixed.items():
        if key in scaling and float(scaling[key]) != value:
            raise CheckpointError(f"{source}: rope_scaling {key} {scaling[key]!r} is not supported (Llama 3's is {value:g})")
    factor = scaling.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1:
        raise CheckpointError(f"{source}: rope_scaling factor must be a number >= 1, found {factor!r}")
    return {"use_scaled_rope": True, "rope_scaling_factor": float(factor)}


def config_params(config: dict[str, Any], source: Path) -> dict[str, Any]:
    """params.json fields for a Llama config.json; CheckpointError naming the field it cannot run."""
    from engine.loading.gguf_import import ffn_params

    architectures = config.get("architectures") or ["LlamaForCausalLM"]
    llama4 = is_llama4_config(config)
    if not llama4 and not any(a in _ARCHITECTURES for a in architectures):
        raise CheckpointError(f"{source}: architectures {architectures} is not a Llama text model "
                              f"(LlamaForCausalLM, {', '.join(sorted(LLAMA4_ARCHITECTURES))})")  # fmt: skip
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?") if isinstance(config["quantization_config"], dict) else "?"
        raise CheckpointError(f"{source}: pre-quantized Hugging Face weights (quantization_config {method!r}) are not "
                              "supported; serve the unquantized folder, with QUANTIZATION_TYPE to quantize at load")
    if llama4:
        return llama4_config_params(config, source)
    refuse_biases_and_activation(config, source, "Llama")
    dim = _require(config, "hidden_size", source)
    n_heads = _require(config, "num_attention_heads", source)
    hidden = _require(config, "intermediate_size", source)
    for key, value in (("hidden_size", dim), ("num_attention_heads", n_heads), ("intermediate_size", hidden)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CheckpointError(f"{source}: {key} must be a positive integer, found {value!r}")
    if dim % n_heads:
        raise CheckpointError(f"{source}: hidden_size {dim} is not a multiple of num_attention_heads {n_heads}")
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim != dim // n_heads:
        raise CheckpointError(f"{source}: head_dim {head_dim} differs from hidden_size / num_attention_heads = {dim // n_heads}; not supported")
    params: dict[str, Any] = {
        "dim": dim,
        "n_layers": _require(config, "num_hidden_layers", source),
        "n_heads": n_heads,
        "n_kv_heads": config.get("num_key_value_heads") or n_heads,
        "vocab_size": _require(config, "vocab_size", source),
        **ffn_params(dim, hidden),
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(config.get("rope_theta", 10000.0)),
        **_rope_params(config, source),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "hidden_dim": hidden,  # the FFN size as config.json states it (multiple_of above reproduces it)
    }
    if "max_position_embeddings" in config:
        params["max_seq_len"] = config["max_position_embeddings"]
    return params


# --------------------------------------------------------------------------- weights
def meta_name(hf_name: str) -> str | None:
    """The Meta key of an HF tensor name; None for tensors the model recomputes. Unknown names: KeyError."""
    if _IGNORED.search(hf_name):
        return None
    name = hf_name.removeprefix("model.")
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise KeyError(hf_name)


def unpermute_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF's rotate_half row order per head back to Meta's adjacent pairs (the inverse of
    convert_llama_weights_to_hf.py's permute). Exact: rows are moved, not computed."""
    rows, cols = weight.shape
    return weight.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _weight_files(path: Path) -> list[Path]:
    """The files holding the weights: those an index names, the numbered set, or `path` itself."""
    folder = path.parent
    if path.name.endswith(".index.json"):
        index = read_json_object(path)
        weight_map = (index or {}).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{path}: no weight_map")
        names = sorted(set(weight_map.values()))
        for name in names:
            # the index is data from the download: it may only name files beside it
            if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
                raise CheckpointError(f"{path}: weight_map names {name!r}, not a file in this folder")
            if not (folder / name).is_file():
                raise CheckpointError(f"{folder / name}: missing (named in {path.name})")
        return [folder / name for name in names]
    m = _SHARDED_SAFETENSORS.match(path.name)
    if m:
        return numbered_set(folder, _SHARDED_SAFETENSORS)
    return [path]


class HFReader:
    """config.json + model.safetensors[.index.json] / pytorch_model.bin[.index.json]."""

    name = "hf"

    def find(self, folder: Path) -> Found | None:
        config_path = folder / CONFIG_FILE
        if not config_path.is_file():
            return None
        weights = next((folder / name for pair in _LAYOUTS for name in pair if (folder / name).is_file()), None)
        if weights is None:
            numbered = numbered_set(folder, _SHARDED_SAFETENSORS)
            weights = numbered[0] if numbered else None
        if weights is None:
            return None  # config.json alone (e.g. beside an adapter): not an HF model folder
        config = read_json_object(config_path)
        if config is None:  # raced away since is_file
            raise CheckpointError(f"{config_path}: missing")
        return Found(self.name, folder, (weights,), config_params(config, config_path), config_path)

    def read_shard(self, path: Path, args: ModelArgs, allowed_roots: tuple[Path, ...]) -> dict[str, Any]:
        state: dict[str, Any] = {}
        skipped_vision = 0
        for file in _weight_files(path):
            file = guarded(file, allowed_roots)
            part = safetensors_load(file) if file.suffix == ".safetensors" else torch_load(file)
            for hf_name, tensor in part.items():
                try:
                    named = list(llama4_tensors(hf_name, tensor)) if args.is_llama4 else [(meta_name(hf_name), tensor)]
                except KeyError:
                    raise CheckpointError(f"{file}: unexpected tensor {hf_name!r} (not a Llama weight)") from None
                skipped_vision += args.is_llama4 and is_vision_tensor(hf_name)
                for key, value in named:
                    if key is None:
                        continue
                    if key in state:
                        raise CheckpointError(f"{file}: tensor {hf_name!r} is also in an earlier weight file")
                    state[key] = value
        if skipped_vision:
            log.info("%s: skipped %d vision encoder / projector tensors: a Llama 4 Hugging Face folder serves text "
                     "(Meta's download of the same model serves images)", path.parent, skipped_vision)  # fmt: skip
        if args.tie_word_embeddings:
            state.pop("output.weight", None)  # some exporters save the tied head too: the same tensor
        if args.is_llama4:  # q/k already in Meta's adjacent-pair order (engine/loading/hf_llama4.py)
            return state
        for i in range(args.n_layers):
            for key, heads in ((f"layers.{i}.attention.wq.weight", args.n_heads), (f"layers.{i}.attention.wk.weight", args.kv_heads)):
                weight = state.get(key)
                if weight is not None and weight.dim() == 2 and weight.shape[0] % (2 * heads) == 0:
                    state[key] = unpermute_rotary(weight, heads)  # wrong shapes are reported by the loader
        return state


__all__ = ["CONFIG_FILE", "HFReader", "config_params", "meta_name", "unpermute_rotary"]
