"""Llama 4 checkpoints: the keys and shapes Meta ships, mapped to the reference's module names.

Meta's consolidated.NN.pth for Llama 4 hold fused and renamed tensors that llama-models' load
hooks (llama4 model.py, moe.py, ffn.py) turn back into the module parameters:

    attention.wqkv.weight              -> attention.wq | wk | wv (this shard's heads)
    attention.wqkv.layer_norm_weight   -> attention_norm.weight
    feed_forward.norm.weight           -> ffn_norm.weight (MoE layers)
    feed_forward.mlp.fc1_weight        -> feed_forward.w1 | w3 (dense layers), fc2_weight -> w2,
    feed_forward.mlp.layer_norm_weight -> ffn_norm.weight
    feed_forward.experts.moe_w_in_eD_F [e*D, F] -> experts.w1 [e, D, F] (moe_w_swiglu_eD_F -> w3)
    feed_forward.experts.moe_w_out_eF_D [e*F, D] -> experts.w2 [e, F, D]
    feed_forward.w_in_shared_FD.weight -> shared_expert.w1.weight (w_swiglu_FD -> w3, w_out_shared_DF -> w2)

normalize_shard() applies them to each shard as it is opened, so resharding (engine/loading/checkpoint.py)
works on the reference names: experts split along F on every rank (Meta's MP split), the router
replicated. Vision weights are left out of the text model's shards; load_vision_state reads them
whole for the vision encoder (engine/models/llama4/vision.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import torch

from engine.loading.file_guard import guarded
from engine.loading.formats import torch_load
from engine.loading.json_file import read_json_object

from engine.loading.layout import local_shape, param_layouts
from engine.models.args import ModelArgs
from engine.models.llama4.args import is_moe_layer, moe_hidden_dim

log = logging.getLogger(__name__)

_VISION_PREFIXES = ("vision_embeddings.", "vision_projection.")


def parallel_size_problems(args: ModelArgs, mp_size: int) -> list[str]:
    if args.moe_args is not None and moe_hidden_dim(args) % mp_size:
        return [f"expert hidden size {moe_hidden_dim(args)}"]
    return []


# shipped name suffix -> reference name suffix (renames without reshaping)
_RENAMES = {
    "attention.wqkv.layer_norm_weight": "attention_norm.weight",
    "feed_forward.norm.weight": "ffn_norm.weight",
    "feed_forward.mlp.layer_norm_weight": "ffn_norm.weight",
    "feed_forward.mlp.fc2_weight": "feed_forward.w2.weight",
    "feed_forward.w_in_shared_FD.weight": "feed_forward.shared_expert.w1.weight",
    "feed_forward.w_swiglu_FD.weight": "feed_forward.shared_expert.w3.weight",
    "feed_forward.w_out_shared_DF.weight": "feed_forward.shared_expert.w2.weight",
}
# reference expert weight -> its shipped name under feed_forward.experts. (also what a Meta FP8
# release quantizes, engine/loading/meta_quantized.py)
SHIPPED_EXPERT_NAMES = {"w1": "moe_w_in_eD_F", "w3": "moe_w_swiglu_eD_F", "w2": "moe_w_out_eF_D"}
_EXPERTS = {  # shipped -> (reference name, 3-D view of the 2-D [e*D, F] / [e*F, D] tensor)
    f"feed_forward.experts.{shipped}": (f"feed_forward.experts.{w}", shipped[-4:]) for w, shipped in SHIPPED_EXPERT_NAMES.items()
}


def normalize_shard(args: ModelArgs, state: dict[str, torch.Tensor], old_rank: int, old_size: int) -> dict[str, torch.Tensor]:
    """One opened shard (rank old_rank of old_size) with Meta's shipped keys turned into the
    reference's module names and shapes (the load hooks' work); vision weights left out (load_vision_state)."""
    out: dict[str, torch.Tensor] = {}
    layouts = param_layouts(args)
    for key, tensor in state.items():
        if key.startswith(_VISION_PREFIXES) or key.endswith("._extra_state"):
            continue
        if not key.startswith("layers."):
            out[key] = tensor
            continue
        prefix, suffix = _split_layer_key(key)
        if suffix in _RENAMES:
            out[prefix + _RENAMES[suffix]] = tensor
        elif suffix in _EXPERTS and isinstance(tensor, torch.Tensor):
            name, form = _EXPERTS[suffix]
            e, d = args.moe_args.num_experts, args.dim
            out[prefix + name] = tensor.view(e, d, -1) if form == "eD_F" else tensor.view(e, -1, d)
        elif suffix == "attention.wqkv.weight" and isinstance(tensor, torch.Tensor):
            q_rows = local_shape(layouts[prefix + "attention.wq.weight"], old_rank, old_size)[0]
            kv_rows = local_shape(layouts[prefix + "attention.wk.weight"], old_rank, old_size)[0]
            for part, rows in zip(("wq", "wk", "wv"), tensor.split([q_rows, kv_rows, kv_rows])):
                out[f"{prefix}attention.{part}.weight"] = rows
        elif suffix == "feed_forward.mlp.fc1_weight" and isinstance(tensor, torch.Tensor):
            w1, w3 = tensor.chunk(2, dim=0)
            out[prefix + "feed_forward.w1.weight"], out[prefix + "feed_forward.w3.weight"] = w1, w3
        else:
            out[key] = tensor
    return out


def _split_layer_key(key: str) -> tuple[str, str]:
    """'layers.3.attention.wo.weight' -> ('layers.3.', 'attention.wo.weight')."""
    head, index, rest = (key.split(".", 2) + ["", ""])[:3]
    return f"{head}.{index}.", rest


def to_meta_layout(shard: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """One rank's reference-named shard in the layout Meta ships (the inverse of normalize_shard):
    what tests and demos write, so every load goes through the shipped-format path."""
    out = dict(shard)
    for i in range(args.n_layers):
        p = f"layers.{i}."
        out[p + "attention.wqkv.weight"] = torch.cat([out.pop(f"{p}attention.{w}.weight") for w in ("wq", "wk", "wv")])
        out[p + "attention.wqkv.layer_norm_weight"] = out.pop(p + "attention_norm.weight")
        if is_moe_layer(args, i):
            out[p + "feed_forward.norm.weight"] = out.pop(p + "ffn_norm.weight")
            for shipped, (name, _) in _EXPERTS.items():
                tensor = out.pop(p + name)
                out[p + shipped] = tensor.reshape(-1, tensor.shape[-1]).contiguous()
            for shipped, name in _RENAMES.items():
                if ".shared_expert." in name:
                    out[p + shipped] = out.pop(p + name)
        else:
            out[p + "feed_forward.mlp.layer_norm_weight"] = out.pop(p + "ffn_norm.weight")
            out[p + "feed_forward.mlp.fc1_weight"] = torch.cat([out.pop(p + "feed_forward.w1.weight"), out.pop(p + "feed_forward.w3.weight")])
            out[p + "feed_forward.mlp.fc2_weight"] = out.pop(p + "feed_forward.w2.weight")
    return out


# --------------------------------------------------------------------------- vision weights
# How the reference shards each vision linear over model-parallel ranks (fairscale layers): a
# column-parallel weight (and its bias) is split along dim 0, a row-parallel weight along dim 1
# (its bias whole on every rank); everything else is whole on every rank.
_VISION_COLUMN = ("conv1._linear.weight", "attn.wq.", "attn.wk.", "attn.wv.", "mlp.c_fc.", "vision_projection.weight")
_VISION_ROW = ("attn.wo.weight", "mlp.c_proj.weight")


def read_vision_args(checkpoint_dir: Path) -> dict[str, Any] | None:
    """params.json's vision_args (beside the shards, or in original/ as Hugging Face repos keep it),
    or None for a text-only checkpoint."""
    for path in (Path(checkpoint_dir) / "params.json", Path(checkpoint_dir) / "original" / "params.json"):
        if path.is_file():
            vision = (read_json_object(path) or {}).get("vision_args")
            return vision if isinstance(vision, dict) else None
    return None


def load_vision_state(shard_paths: Sequence[Path], allowed_roots: Sequence[Path], dtype: torch.dtype,
                      device: torch.device) -> dict[str, torch.Tensor]:
    """The vision encoder, adapter and projection weights, whole: each shard's part gathered as the
    reference's column- and row-parallel layers split them (rank 0 encodes images for every rank)."""
    parts: dict[str, list[torch.Tensor]] = {}
    for path in shard_paths:
        state = torch_load(guarded(path, allowed_roots))
        for key, tensor in state.items():
            if key.startswith(_VISION_PREFIXES) and not key.endswith("._extra_state"):
                parts.setdefault(key, []).append(tensor)
    out = {}
    for key, tensors in parts.items():
        if len(tensors) == 1 or not any(name in key for name in _VISION_COLUMN + _VISION_ROW):
            whole = tensors[0]
        else:
            whole = torch.cat(tensors, dim=1 if any(name in key for name in _VISION_ROW) else 0)
        out[key] = whole.to(device=device, dtype=dtype)
    return out
