"""Llama 4 MoE decode against a dense model of the same active parameters (a script, not a test).

    python bench/llama4_moe.py [--batches 1,32] [--experts 8] [--layers 4]

A 'small' random Llama 4 config (dim 1024, top-1 of E experts + the shared expert per layer, NoPE
every 4th layer, qk-norm) and a dense Llama 3 config whose SwiGLU hidden size is the MoE layer's
active hidden size (shared + one routed expert: 2 x 1792): the same active parameters per token.
Prints decode tokens/s at each batch size, through the CPU backend the engine would choose, and
the weight memory per expert format (the model dtype, fp8_mixed). Noisy on a shared machine: each
figure is the best of a few repeats.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from forward import BLOCK_SIZE, CONTEXT_TOKENS, DECODE_STEPS, _sequence, best_of  # noqa: E402

from engine.backends import resolve_dtype, select_backend  # noqa: E402
from engine.loading.checkpoint import random_state_dict  # noqa: E402
from engine.models import model_class  # noqa: E402
from engine.models.args import ModelArgs, MoEArgs  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.models.llama import allocate_kv_caches  # noqa: E402
from engine.executor.executor import build_step_inputs  # noqa: E402
from engine.core.sequence import ScheduledBatch  # noqa: E402

SMALL = dict(dim=1024, n_heads=16, n_kv_heads=8, vocab_size=202048, multiple_of=256, rope_theta=500000.0)


def llama4_small(experts: int, layers: int) -> ModelArgs:
    return ModelArgs(
        **SMALL, n_layers=layers, ffn_dim_multiplier=1.2, ffn_exp=4.0, nope_layer_interval=4, attention_chunk_size=8192,
        use_qk_norm=True, moe_args=MoEArgs(num_experts=experts, top_k=1, interleave_moe_layer_step=1),
    )  # fmt: skip


def dense_same_active(layers: int) -> ModelArgs:
    return ModelArgs(**SMALL, n_layers=layers, ffn_dim_multiplier=1.3128)  # SwiGLU hidden 3584 = 2 x 1792


def decode_tokens_per_s(args: ModelArgs, config: EngineConfig, batch: int) -> tuple[float, int]:
    cpu = torch.device("cpu")
    backend = select_backend(config, cpu)
    model = model_class(args).from_state_dict(args, random_state_dict(args, seed=0, dtype=backend.dtype), backend, max_seq_len=1024)
    caches = allocate_kv_caches(args, 1, batch * 64, BLOCK_SIZE, dtype=backend.dtype, device=cpu)
    seqs = [_sequence(i, CONTEXT_TOKENS + DECODE_STEPS, i) for i in range(batch)]

    def run() -> None:
        for s in seqs:
            s.num_computed_tokens = CONTEXT_TOKENS
        for _ in range(DECODE_STEPS):
            model(build_step_inputs(ScheduledBatch(seqs, [1] * batch), BLOCK_SIZE)[0], caches)
            for s in seqs:
                s.num_computed_tokens += 1

    return batch * DECODE_STEPS / best_of(run), model.weight_bytes()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--quantizations", default="none,fp8_mixed")
    opts = parser.parse_args()
    dtype = str(resolve_dtype(EngineConfig())).removeprefix("torch.")
    print(f"threads {torch.get_num_threads()}, dtype {dtype}")
    models = {"llama4-moe": llama4_small(opts.experts, opts.layers), "dense-same-active": dense_same_active(opts.layers)}
    for quant in opts.quantizations.split(","):
        config = EngineConfig(dtype=dtype, quantization=None if quant == "none" else quant)
        for name, args in models.items():
            for batch in map(int, opts.batches.split(",")):
                tok_s, nbytes = decode_tokens_per_s(args, config, batch)
                print(f"{name:18s} {quant:9s} batch {batch:3d}: {tok_s:8.1f} tok/s decode, weights {nbytes / 2**20:7.1f} MiB")


if __name__ == "__main__":
    main()
