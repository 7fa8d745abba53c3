"""Random LoRA adapters over the tiny test base, written as torchtune and PEFT write them.

Each adapter is generated in Meta's row order (what the merged reference uses) and then saved in
its tool's names and layout: PEFT's lora_B of q_proj/k_proj permuted into HF's rotary order."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.lora.adapters import permute_rows
from engine.models.args import ModelArgs

META_PARTS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
              "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
TORCHTUNE_NAMES = {"attention.wq": "attn.q_proj", "attention.wk": "attn.k_proj", "attention.wv": "attn.v_proj",
                   "attention.wo": "attn.output_proj", "feed_forward.w1": "mlp.w1", "feed_forward.w2": "mlp.w2",
                   "feed_forward.w3": "mlp.w3"}
PEFT_NAMES = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
              "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
              "feed_forward.w3": "mlp.up_proj"}


@dataclass
class WrittenAdapter:
    folder: Path
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # Meta linear -> (A, B), Meta row order

    def merged(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """W + scale * B @ A on every adapted weight: the reference model's weights."""
        out = dict(state)
        for name, (a, b) in self.weights.items():
            key = name + ".weight"
            out[key] = (state[key].double() + self.scale * (b.double() @ a.double())).to(state[key].dtype)
        return out


def shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    q, kv, d, f = args.n_heads * args.head_dim, args.kv_heads * args.head_dim, args.dim, args.ffn_hidden_dim
    return {"attention.wq": (q, d), "attention.wk": (kv, d), "attention.wv": (kv, d), "attention.wo": (d, q),
            "feed_forward.w1": (f, d), "feed_forward.w2": (d, f), "feed_forward.w3": (f, d)}


def random_lora(args: ModelArgs, rank: int, seed: int, parts=META_PARTS) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(args.n_layers):
        for part in parts:
            rows, cols = shapes(args)[part]
            a = torch.randn(rank, cols, generator=gen) / math.sqrt(cols)
            b = torch.randn(rows, rank, generator=gen) * 0.2  # non-zero: the adapter changes the outputs
            out[f"layers.{layer}.{part}"] = (a, b)
    return out


def write_torchtune(folder: Path, args: ModelArgs, *, rank: int = 4, alpha: float = 8.0, seed: int = 1,
                    meta_names: bool = False) -> WrittenAdapter:
    """adapter_model.pt in torchtune's names (or, meta_names, its Meta checkpointer's)."""
    folder.mkdir(parents=True, exist_ok=True)
    weights = random_lora(args, rank, seed)
    state = {}
    for name, (a, b) in weights.items():
        layer, part = name.split(".", 2)[1], name.split(".", 2)[2]
        module = part if meta_names else TORCHTUNE_NAMES[part]
        state[f"layers.{layer}.{module}.lora_a.weight"] = a
        state[f"layers.{layer}.{module}.lora_b.weight"] = b
    torch.save(state, folder / "adapter_model.pt")
    config = {"r": rank, "lora_alpha": alpha, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                   "down_proj", "up_proj"], "peft_type": "LORA"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return WrittenAdapter(folder, alpha / rank, weights)


def write_peft(folder: Path, args: ModelArgs, *, rank: int = 8, alpha: float = 16.0, seed: int = 2,
               rslora: bool = True, fmt: str = "safetensors") -> WrittenAdapter:
    """adapter_model.safetensors (or .bin) in PEFT's HF names, q/k lora_B in HF's rotary order."""
    folder.mkdir(parents=True, exist_ok=True)
    weights = random_lora(args, rank, seed)
    state = {}
    for name, (a, b) in weights.items():
        layer, part = name.split(".", 2)[1], name.split(".", 2)[2]
        if part == "attention.wq":
            b = permute_rows(b, args.n_heads)
        elif part == "attention.wk":
            b = permute_rows(b, args.kv_heads)
        prefix = f"base_model.model.model.layers.{layer}.{PEFT_NAMES[part]}"
        state[f"{prefix}.lora_A.weight"] = a.contiguous()
        state[f"{prefix}.lora_B.weight"] = b.contiguous()
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(folder / "adapter_model.safetensors"))
    else:
        torch.save(state, folder / "adapter_model.bin")
    config = {"r": rank, "lora_alpha": alpha, "use_rslora": rslora, "peft_type": "LORA", "modules_to_save": None,
              "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    return WrittenAdapter(folder, scale, weights)
