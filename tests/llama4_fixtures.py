"""Tiny random Llama 4 checkpoints in Meta's shipped format (fused wqkv, 2-D expert tensors, renamed
norms: engine/loading/llama4.py), for tests and demos.

write_tiny_llama4_checkpoint(out_dir) writes params.json + consolidated.NN.pth (+ tokenizer.model
when given): every Llama 4 feature on (MoE with several experts and top_k > 1 interleaved with
dense layers, a NoPE layer, chunked attention with a chunk smaller than test prompts, qk-norm,
temperature tuning that changes at short positions, Llama 4 RoPE scaling with a smooth band).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

TINY_LLAMA4_PARAMS: dict[str, Any] = dict(
    dim=64,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=256,
    multiple_of=16,
    ffn_dim_multiplier=1.3,
    ffn_exp=4.0,
    norm_eps=1e-5,
    rope_theta=500000.0,
    use_scaled_rope=True,
    rope_scaling_factor=8.0,
    rope_high_freq_factor=4.0,  # head_dim 16: one frequency falls in the smooth band
    nope_layer_interval=3,  # layer 2 has no RoPE
    attention_chunk_size=8,
    use_qk_norm=True,
    attn_temperature_tuning=True,
    floor_scale=4.0,  # the NoPE temperature changes every 4 positions (8192 in Scout)
    attn_scale=0.1,
    moe_args=dict(num_experts=4, top_k=2, capacity_factor=1.0, auto_scale_F=True, interleave_moe_layer_step=2),
)
TINY_LLAMA4_DESCRIPTOR = "Llama-4-Scout-17B-16E-Instruct"  # the family (tokenizer, chat format)


def tiny_llama4_args(**overrides: Any):
    from engine.models.args import ModelArgs

    params = {**TINY_LLAMA4_PARAMS, **overrides}
    return ModelArgs.from_params(params, source="tiny Llama 4 params")


def write_tiny_llama4_checkpoint(
    out_dir: Path, *, num_shards: int = 1, seed: int = 0, tokenizer_path: Path | None = None,
    dtype: torch.dtype = torch.float32, **overrides: Any,
) -> Path:  # fmt: skip
    """A complete tiny Llama 4 checkpoint (params.json, weights, optional tokenizer.model) in
    out_dir; `overrides` replace params.json fields (vocab_size=202048 for the real tokenizer)."""
    from engine.loading.checkpoint import write_random_checkpoint

    return write_random_checkpoint(
        Path(out_dir), tiny_llama4_args(**overrides), num_shards=num_shards, seed=seed, tokenizer_path=tokenizer_path, dtype=dtype
    )


LLAMA4_VOCAB_SIZE = 202048  # the real Llama 4 tokenizer's


def write_chained_llama4_checkpoint(out_dir: Path, chain: list[int], *, tokenizer_path: Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny Llama 4 checkpoint (real vocabulary) whose greedy continuation of token chain[i] is
    chain[i + 1]: a way to make random weights emit a chosen reply (a tool call, say) through the
    whole forward. Every layer's output projections are scaled down 100x (the residual stream stays
    near the current token's embedding), the final norm is 1, and each output row chain[i + 1]
    points along token chain[i]'s normalised embedding (logit ~80 against ~N(0, 1) for the rest).
    Each token of chain[:-1] must be distinct (one successor each)."""
    from engine.loading.checkpoint import PARAMS_FILE, random_state_dict
    from engine.loading.llama4 import to_meta_layout

    if len(set(chain[:-1])) != len(chain) - 1:
        raise ValueError("every token of the chain but the last must be distinct")
    args = tiny_llama4_args(vocab_size=LLAMA4_VOCAB_SIZE, **overrides)
    state = random_state_dict(args, seed=seed, dtype=torch.float32)
    for key, tensor in state.items():
        if key.endswith(("attention.wo.weight", "w2.weight", "experts.w2")):
            tensor.mul_(0.01)
    state["norm.weight"].fill_(1.0)
    emb, out = state["tok_embeddings.weight"], state["output.weight"]
    for src, dst in zip(chain, chain[1:]):
        out[dst] += 10.0 * emb[src] / emb[src].norm()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(to_meta_layout(state, args), out_dir / "consolidated.00.pth")
    (out_dir / PARAMS_FILE).write_text(json.dumps(args.to_params(), indent=2))
    (out_dir / Path(tokenizer_path).name).write_bytes(Path(tokenizer_path).read_bytes())
    return out_dir
