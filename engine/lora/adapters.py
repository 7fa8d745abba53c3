"""LoRA adapters read from disk: torchtune's and PEFT's files, checked against a base, cut per rank.

Formats (detected from the folder's files; `adapter_config.json` beside them in both):
- torchtune: `adapter_model.pt`, keys in torchtune's names (`layers.0.attn.q_proj.lora_a.weight`,
  `attn.output_proj`, `mlp.w1/w2/w3`) or, from its Meta checkpointer, Meta's
  (`layers.0.attention.wq.lora_a.weight`). torchtune's model keeps Meta's q/k row order.
- PEFT (TRL, Unsloth, torchtune's HF checkpointer): `adapter_model.safetensors` or `.bin`, Hugging
  Face names (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, `mlp.gate_proj`
  ...). HF permutes q/k rows for its rotary layout, so the lora_B of q_proj/k_proj (whose rows are
  the projection's outputs) is un-permuted exactly as the base weights are.

The delta of a targeted linear W [out, in] is scale * B @ A (A [r, in], B [out, r]), with
scale = lora_alpha / r, or lora_alpha / sqrt(r) under rsLoRA. Anything this engine cannot apply as
that delta (DoRA, per-module rank or alpha patterns, extra trained modules, embeddings, the output
head) is refused by name, as is a shape that differs from the base: AdapterError, a 400.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.loading.file_guard import guarded
from engine.loading.layout import ParamLayout, param_layouts, rank_range
from engine.models.args import ModelArgs
from engine.types import InvalidRequest

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")  # in order of preference

# Each tool's module name -> the Meta linear it adapts (its prefix in a block).
MODULE_NAMES = {
    "q_proj": "attention.wq", "k_proj": "attention.wk", "v_proj": "attention.wv",
    "o_proj": "attention.wo", "output_proj": "attention.wo",
    "gate_proj": "feed_forward.w1", "down_proj": "feed_forward.w2", "up_proj": "feed_forward.w3",
    "wq": "attention.wq", "wk": "attention.wk", "wv": "attention.wv", "wo": "attention.wo",
    "w1": "feed_forward.w1", "w2": "feed_forward.w2", "w3": "feed_forward.w3",
}  # fmt: skip
# layers.{i}.{block part}.{module}.lora_{a|b}[.default].weight, after an optional PEFT/HF prefix
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp|attn|attention|feed_forward)\."
    r"(\w+)\.lora_([aAbB])(?:\.default)?\.weight$"
)
# config fields that change what the adapter computes beyond scale * B @ A: refused when set
_UNSUPPORTED_CONFIG = ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform")


class AdapterError(InvalidRequest):
    """An adapter this base cannot serve: the message names the file, key or field and what differs."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="lora_path", code="invalid_adapter")


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """One adapter over a base, full size (not yet cut per rank), float32 on the CPU."""

    rank: int  # r
    scale: float  # lora_alpha / r (rsLoRA: / sqrt(r))
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # Meta linear ("layers.0.attention.wq") -> (A [r, in], B [out, r])
    source: str  # the folder, for messages

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def weight_file(folder: Path) -> Path:
    """The folder's adapter weights file; AdapterError when it holds none."""
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return folder / name
    raise AdapterError(f"{folder.name}: no adapter weights ({', '.join(WEIGHT_FILES)}) in the adapter folder")


def read_adapter(folder: Path, args: ModelArgs, *, max_rank: int, roots: tuple[Path, ...] = ()) -> LoraAdapter:
    """Read and check one adapter folder against a base's architecture; AdapterError (400) naming
    what differs. roots: the checkpoint roots every file must resolve into (empty: trusted)."""
    folder = Path(folder)
    if args.is_llama4:
        raise AdapterError("LoRA adapters are served over Llama 2 / 3 models; this base is Llama 4")
    if not folder.is_dir():
        raise AdapterError(f"{folder.name}: the adapter folder does not exist")
    config = _read_config(guarded(folder / CONFIG_FILE, roots), folder)
    path = guarded(weight_file(folder), roots)
    raw = _load_tensors(path)
    hf_names = path.suffix != ".pt"  # PEFT's files: HF names and HF's rotary row order
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    if rank < 1:
        raise AdapterError(f"{CONFIG_FILE}: r must be >= 1, got {rank}")
    if rank > max_rank:
        raise AdapterError(f"{folder.name}: rank {rank} is above --max-lora-rank {max_rank}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs = _pair_up(raw, path.name, args)
    layouts = param_layouts(args)
    weights = {}
    for name, (a, b) in sorted(pairs.items()):
        out_features, in_features = layouts[name + ".weight"].full_shape
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise AdapterError(
                f"{path.name}: {name} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; this base needs "
                f"[{rank}, {in_features}] and [{out_features}, {rank}] (rank {rank} from {CONFIG_FILE})"
            )
        if hf_names and name.endswith(("attention.wq", "attention.wk")):
            heads = args.n_heads if name.endswith("wq") else args.kv_heads
            b = unpermute_rows(b, heads)
        weights[name] = (a.float().contiguous(), b.float().contiguous())
    return LoraAdapter(rank, scale, weights, folder.name)


def _read_config(path: Path, folder: Path) -> dict:
    if not path.is_file():
        raise AdapterError(f"{folder.name}: no {CONFIG_FILE} (it gives the adapter's r and lora_alpha)")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{CONFIG_FILE}: not valid JSON ({exc})") from None
    if not isinstance(config, dict) or not isinstance(config.get("r"), int):
        raise AdapterError(f"{CONFIG_FILE}: needs an integer `r` (the adapter's rank)")
    for key in _UNSUPPORTED_CONFIG:
        if config.get(key):
            raise AdapterError(f"{CONFIG_FILE}: {key} is set; only plain LoRA (scale * B @ A) adapters are served")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{CONFIG_FILE}: peft_type {config['peft_type']!r}; only LORA adapters are served")
    return config


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the caller's bad input
        raise AdapterError(f"{path.name}: cannot be read as adapter weights ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise AdapterError(f"{path.name}: not a dict of tensors")
    return state


def _pair_up(raw: dict[str, torch.Tensor], file_name: str, args: ModelArgs) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Meta linear name -> (A, B); AdapterError for a key this engine does not apply."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(f"{file_name}: {key!r} is not a LoRA weight of an attention or MLP projection")
        layer, _, module, which = match.groups()
        if module not in MODULE_NAMES:
            raise AdapterError(f"{file_name}: {key!r} adapts module {module!r}, which this engine does not know")
        if int(layer) >= args.n_layers:
            raise AdapterError(f"{file_name}: {key!r} is for layer {layer}; the base has {args.n_layers} layers")
        found.setdefault(f"layers.{layer}.{MODULE_NAMES[module]}", {})[which.lower()] = tensor
    if not found:
        raise AdapterError(f"{file_name}: holds no LoRA weights")
    for name, pair in found.items():
        if set(pair) != {"a", "b"}:
            missing = "lora_B" if "a" in pair else "lora_A"
            raise AdapterError(f"{file_name}: {name} has no {missing}")
    return {name: (pair["a"], pair["b"]) for name, pair in found.items()}


def unpermute_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows in HF's rotary order (each head's first halves, then second halves) back to Meta's
    (adjacent pairs): the inverse of the permutation HF's conversion script applies to wq/wk."""
    rows, cols = weight.shape
    return weight.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Meta's rotary row order -> HF's (what HF's conversion does; for writing PEFT test adapters)."""
    rows, cols = weight.shape
    return weight.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def shard_adapter(adapter: LoraAdapter, args: ModelArgs, rank: int, mp_size: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (A, B) per linear, cut the way its base linear is: column-parallel (wq, wk, wv,
    w1, w3) keeps all of A and this rank's rows of B; row-parallel (wo, w2) this rank's columns of
    A and all of B (the all-reduce after the base linear sums the ranks' partial deltas)."""
    if mp_size == 1:
        return dict(adapter.weights)
    layouts = param_layouts(args)
    out = {}
    for name, (a, b) in adapter.weights.items():
        layout: ParamLayout = layouts[name + ".weight"]
        start, end = rank_range(layout, rank, mp_size)
        if layout.parallel_dim == 0:
            out[name] = (a, b[start:end])
        else:
            out[name] = (a[:, start:end], b)
    return out


def merged_state_dict(state: dict[str, torch.Tensor], adapter: LoraAdapter) -> dict[str, torch.Tensor]:
    """A full Meta state dict with the adapter merged in (W + scale * B @ A): the reference the
    unmerged path is tested against."""
    out = dict(state)
    for name, (a, b) in adapter.weights.items():
        key = name + ".weight"
        out[key] = (state[key].double() + adapter.scale * (b.double() @ a.double())).to(state[key].dtype)
    return out
