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
replicated. The vision weights keep their names (llama-models' modules load them as shipped) and
are resharded like the text weights, by their layouts (engine/loading/layout.py,
llama4_vision_layouts), when the checkpoint ships them; each rank holds its slice.
"""

from __future__ import annotations

import logging

import torch

from engine.loading.layout import local_shape, param_layouts
from engine.models.args import ModelArgs
from engine.models.llama4.args import VISION_PREFIXES, is_moe_layer, moe_hidden_dim

log = logging.getLogger(__name__)


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


def normalize_shard(args: ModelArgs, state: dict[str, torch.Tensor], old_rank: int, old_size: int, *,
                    vision: bool = False) -> dict[str, torch.Tensor]:
    """One opened shard (rank old_rank of old_size) with Meta's shipped keys turned into the
    reference's module names and shapes (the load hooks' work); the vision weights kept as shipped
    when `vision` (the model loads them), else left out (a text-only load)."""
    out: dict[str, torch.Tensor] = {}
    layouts = param_layouts(args)
    for key, tensor in state.items():
        if (key.startswith(VISION_PREFIXES) and not vision) or key.endswith("._extra_state"):
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
