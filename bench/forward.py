"""Forward-pass throughput against this machine's roofline (a script, not a test).

    python bench/forward.py [--configs tiny,small] [--dtypes float32,bfloat16] [--threads N] [--json PATH]

Measures, in the same run: matmul GFLOP/s and memory bandwidth (the roofline), then prefill and
decode tokens/s at batch 1, 8 and 32 for the 'tiny' and 'small' random configs (vocab 128256),
each next to its bound: decode at batch 1 against weight bytes / bandwidth, decode at batch 32
and prefill against FLOPs per token / matmul FLOP/s. Numbers on a shared machine are noisy:
each figure is the best of a few repeats. The configs and the --json format are bench/common.py's.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Results, add_results_arguments, model_args, torch_machine  # noqa: E402
from engine.loading.checkpoint import random_state_dict  # noqa: E402
from engine.models.args import ModelArgs  # noqa: E402
from engine.backends import select_backend  # noqa: E402
from engine.backends.cpu import PackedCpuLinear, pack_weight, packing_available  # noqa: E402
from engine.backends.torch_ops import TorchBackend  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.models.llama import Transformer, allocate_kv_caches  # noqa: E402
from engine.executor.executor import build_step_inputs  # noqa: E402
from engine.core.sequence import ScheduledBatch, Sequence  # noqa: E402
from engine.types import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
CONTEXT_TOKENS = 128  # K/V already cached for each decoding sequence
PREFILL_TOKENS = 512
DECODE_STEPS = 8


def best_of(fn, repeats: int = 3) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


# --------------------------------------------------------------------------- the roofline
class Roofline:
    """Peak matmul FLOP/s per dtype and read bandwidth, sampled again before every config and
    kept at their best: on a shared machine a single sample underestimates the peak."""

    def __init__(self, *, smoke: bool = False) -> None:
        self.flops: dict[torch.dtype, float] = {}
        self.bandwidth = 0.0
        self._sizes = ({"n": 128}, {"mib": 8}) if smoke else ({}, {})

    def sample(self, dtype: torch.dtype) -> None:
        self.flops[dtype] = max(self.flops.get(dtype, 0.0), matmul_flops_per_s(dtype, **self._sizes[0]))
        self.bandwidth = max(self.bandwidth, memory_bytes_per_s(**self._sizes[1]))


def matmul_flops_per_s(dtype: torch.dtype, n: int = 1024) -> float:
    """The machine's matmul rate: the better of torch.mm (MKL) and oneDNN on a pre-packed weight.
    On AMD CPUs MKL takes a slower code path: here oneDNN runs fp32 at ~2.3x MKL's rate (430 vs
    185 GFLOP/s on 2 cores), so a roofline from torch.mm alone would be one engines can beat."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    reps = 4
    seconds = best_of(lambda: [torch.mm(a, b) for _ in range(reps)], repeats=5)
    if packing_available(dtype):
        packed = PackedCpuLinear(pack_weight(b))
        seconds = min(seconds, best_of(lambda: [packed(a) for _ in range(reps)], repeats=5))
    return 2 * n**3 * reps / seconds


def memory_bytes_per_s(mib: int = 512) -> float:
    """Streaming bandwidth, the better of a reduction (reads the buffer once, what decode does with
    weights) and a copy (reads and writes it): either alone can be compute-limited on one thread."""
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    read_s = best_of(lambda: x.sum(), repeats=5)
    copy_s = best_of(lambda: y.copy_(x), repeats=5)
    nbytes = x.numel() * 4
    return max(nbytes / read_s, 2 * nbytes / copy_s)


# --------------------------------------------------------------------------- the model
@dataclass
class Bench:
    args: ModelArgs
    dtype: torch.dtype
    model: Transformer
    caches: list

    @classmethod
    def build(cls, args: ModelArgs, dtype: torch.dtype, num_blocks: int, *, pack: bool) -> "Bench":
        cpu = torch.device("cpu")
        if pack:  # what WorkerGroup does on CPU: packed weights and the fused kernels
            backend = select_backend(EngineConfig(dtype=str(dtype).removeprefix("torch.")), cpu)
        else:
            backend = TorchBackend(cpu, dtype)
        state = random_state_dict(args, seed=0, dtype=dtype)
        model = Transformer.from_state_dict(args, state, backend, max_seq_len=CONTEXT_TOKENS + PREFILL_TOKENS + 64)
        caches = allocate_kv_caches(args, 1, num_blocks, BLOCK_SIZE, dtype=dtype, device=torch.device("cpu"))
        return cls(args, dtype, model, caches)

    def step(self, seqs: list[Sequence], counts: list[int]) -> None:
        inputs, _ = build_step_inputs(ScheduledBatch(seqs, counts), BLOCK_SIZE)
        self.model(inputs, self.caches)

    def prefill_tokens_per_s(self) -> float:
        seq = _sequence(0, PREFILL_TOKENS, 0)
        return PREFILL_TOKENS / best_of(lambda: self.step([seq], [PREFILL_TOKENS]), repeats=2)

    def decode_tokens_per_s(self, batch: int) -> float:
        seqs = [_sequence(i, CONTEXT_TOKENS, i) for i in range(batch)]

        def run() -> None:
            for s in seqs:
                del s.token_ids[CONTEXT_TOKENS:]
                s.num_computed_tokens = CONTEXT_TOKENS
            for _ in range(DECODE_STEPS):
                for s in seqs:  # each step's token is its sequence's last: its logits are computed, as in serving
                    s.token_ids.append(7)
                self.step(seqs, [1] * batch)
                for s in seqs:
                    s.num_computed_tokens += 1

        return batch * DECODE_STEPS / best_of(run)


def _sequence(i: int, num_tokens: int, slot: int) -> Sequence:
    blocks_per_seq = math.ceil((CONTEXT_TOKENS + PREFILL_TOKENS) / BLOCK_SIZE)
    seq = Sequence(i, str(i), [7] * num_tokens, num_tokens, SamplingParams(temperature=0.0))
    seq.block_table = list(range(slot * blocks_per_seq, (slot + 1) * blocks_per_seq))
    return seq


def weight_counts(args: ModelArgs) -> tuple[int, int]:
    """(matmul parameters every token multiplies by, except the head; output head parameters)."""
    per_layer = args.dim * (args.n_heads + 2 * args.kv_heads) * args.head_dim + args.n_heads * args.head_dim * args.dim
    per_layer += 3 * args.dim * args.ffn_hidden_dim
    return args.n_layers * per_layer, args.vocab_size * args.dim


# --------------------------------------------------------------------------- report
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="tiny,small", help="tiny, small, demo (SmolLM2-135M's shape, tied head)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--no-pack", action="store_true", help="the plain torch path: F.linear instead of oneDNN packed weights, no fused CPU kernels")
    parser.add_argument("--smoke", action="store_true", help="a tiny roofline sample: checks the script runs (tests), numbers meaningless")
    add_results_arguments(parser)
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    batches = [int(b) for b in opts.batches.split(",")]
    packing = "plain F.linear, torch ops" if opts.no_pack else "oneDNN packed weights, fused CPU kernels"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {packing}; shared machine: numbers are noisy")
    roofline = Roofline(smoke=opts.smoke)
    results = []
    for dtype_name in opts.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for name in opts.configs.split(","):
            roofline.sample(dtype)
            results.append((name, dtype_name, measure(model_args(name), dtype, batches, pack=not opts.no_pack)))
    for dtype in roofline.flops:
        roofline.sample(dtype)  # once more after the runs, then report against the best samples
    out = Results("forward")
    print(f"memory read bandwidth: {roofline.bandwidth / 1e9:.1f} GB/s")
    out.add("read bandwidth", roofline.bandwidth, "B/s")
    for dtype, flops in roofline.flops.items():
        print(f"matmul {str(dtype).removeprefix('torch.')}: {flops / 1e9:.1f} GFLOP/s")
        out.add("matmul", flops, "FLOP/s", dtype=str(dtype).removeprefix("torch."))
    for name, dtype_name, measured in results:
        dtype = getattr(torch, dtype_name)
        report(name, dtype_name, model_args(name), dtype, measured, roofline.flops[dtype], roofline.bandwidth, out)
    out.write(opts.json, **torch_machine(), packed=not opts.no_pack)


def measure(args: ModelArgs, dtype: torch.dtype, batches: list[int], *, pack: bool) -> dict[str, float]:
    blocks = max(batches) * math.ceil((CONTEXT_TOKENS + PREFILL_TOKENS) / BLOCK_SIZE)
    bench = Bench.build(args, dtype, blocks, pack=pack)
    out = {"prefill": bench.prefill_tokens_per_s()}
    for batch in batches:
        out[f"decode {batch}"] = bench.decode_tokens_per_s(batch)
    return out


def report(name: str, dtype_name: str, args: ModelArgs, dtype: torch.dtype, measured: dict[str, float], flops: float, bandwidth: float,
           out: Results) -> None:
    body, head = weight_counts(args)
    elem = torch.empty((), dtype=dtype).element_size()
    kv_bytes_per_token = 2 * args.n_layers * args.kv_heads * args.head_dim * elem
    print(f"-- {name} {dtype_name}: {(body + 2 * head) / 1e6:.1f} M params ({(body + head) * elem / 2**20:.0f} MiB read per decode step)")
    prefill = measured["prefill"]
    prefill_bound = flops / (2 * body + 2 * head / PREFILL_TOKENS)  # the head runs for the last row only
    print(f"   prefill {PREFILL_TOKENS:4d} tok: {prefill:9.1f} tok/s  ({prefill / prefill_bound:5.1%} of compute bound {prefill_bound:9.1f})")
    out.add("prefill", prefill, "tok/s", config=name, dtype=dtype_name, tokens=PREFILL_TOKENS, bound=prefill_bound,
            bound_kind="compute", of_bound=prefill / prefill_bound)
    for key, tps in measured.items():
        if not key.startswith("decode"):
            continue
        batch = int(key.split()[1])
        step_bytes = (body + head) * elem + batch * CONTEXT_TOKENS * kv_bytes_per_token
        memory_bound = batch * bandwidth / step_bytes
        compute_bound = flops / (2 * (body + head))
        bound = min(memory_bound, compute_bound)
        which = "bandwidth" if memory_bound < compute_bound else "compute"
        print(
            f"   decode batch {batch:3d}: {tps:9.1f} tok/s  ({tps / bound:5.1%} of {which} bound {bound:9.1f}; "
            f"bandwidth bound {memory_bound:9.1f}, compute bound {compute_bound:9.1f})"
        )
        out.add("decode", tps, "tok/s", config=name, dtype=dtype_name, batch=batch, bound=bound, bound_kind=which,
                of_bound=tps / bound)


if __name__ == "__main__":
    main()
