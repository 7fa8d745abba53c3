"""Where a many-streams step's forward goes, by operation (a script, not a test).

    python bench/stream_profile.py [--threads 2] [--repeats 5] [--steps d32,m32,p512,...] [--decode-step off] [--ab] [--dtype float32]

Builds the demo-shaped model (SmolLM2-135M's shape, random weights, bfloat16 unless --dtype says
otherwise, the CPU backend WorkerGroup picks) and runs the step shapes a 32- or 64-stream run of 128 prompt + 64 output
tokens produces, timing every backend call and every linear (by its [M, N, K] shape) with wall
clocks around each (CPU ops are synchronous). Each linear's achieved GFLOP/s is printed next to
the matmul rate of the dtype measured at start (the roofline of the moment; on CPUs without oneDNN's
bfloat16, such as AVX2-only ones, float32's: the kernels run a bfloat16 model's linears as float32
FMAs on widened weights). Step shapes:

    d8 / d32 / d64  8 / 32 / 64 decodes at 160 tokens of context (the middle of 128 + 64)
    m32           28 decodes + 3 whole prompts + the first 100 tokens of a 4th (a 512 budget)
    pfx           28 decodes + 4 prompts' last 28 tokens behind a 100-token cached prefix
    p512 / p2048  4 / 16 whole 128-token prompts (one step of a 512 / 2048 budget)
    l2048         one whole 2048-token prompt (any lN: N tokens; a long prompt's prefill at a budget of N)
    c2048         a 2048-token prompt's last 512 tokens behind its first 1536 (any cN: the last chunk
                  of an N-token prompt at the default 512-token budget)

Pure-decode steps run the backend's compiled decode step (engine/backends/cpu_step.py: every block
in one C call) where it serves them; its calls are timed as one row, "decode step (fused)", and the
ops inside it are not seen. --decode-step off profiles the per-op path instead. --ab first times
each step's forward (no timers around anything) with the compiled step and without, alternating,
and prints the medians and their ratio.

--prefill-attention sdpa sends prefill chunks to torch's SDPA even where the backend would run them
through the paged_attention kernel (AMX tiles; float32 on AVX2 builds): run it beside the default to
compare the two on the same steps.

On a machine shared with other jobs the absolute times are noisy (--threads 1 times thread CPU
instead of wall: far steadier there); the shares are what carry over.
"""

from __future__ import annotations

import argparse
import collections
import functools
import math
import os
import sys
import time
from pathlib import Path

# what the server sets before torch loads (server/__main__.py): libgomp's default spin at each
# barrier makes 2-thread timings meaningless whenever anything else runs on the cores
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "100000")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import load_average, model_args  # noqa: E402
from bench.forward import matmul_flops_per_s  # noqa: E402
from engine.backends import select_backend  # noqa: E402
from engine.backends.cpu import InterleavedHeadLinear, PackedCpuLinear, packing_available  # noqa: E402
from engine.loading.checkpoint import random_state_dict  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.models.llama import Transformer, allocate_kv_caches  # noqa: E402
from engine.executor.executor import build_step_inputs  # noqa: E402
from engine.core.sampler import Sampler  # noqa: E402
from engine.core.sequence import ScheduledBatch, Sequence  # noqa: E402
from engine.types import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
PROMPT_TOKENS = 128
OUTPUT_TOKENS = 64
DECODE_CONTEXT = 160
CHUNK_TOKENS = 512  # the engine's default step budget
LONG_PROMPT_MAX = 8192  # lN / cN: the cache below holds 70 x 12 blocks of 16 tokens
MAX_TOKENS = PROMPT_TOKENS + OUTPUT_TOKENS


def clock() -> float:
    """Seconds for the timers: wall, or with --threads 1 the calling thread's CPU time (every op
    then runs on it), which a machine busy with other jobs disturbs far less."""
    return CLOCK[0]()


CLOCK = [time.perf_counter]


class Timers:
    """Accumulated wall seconds and call counts per key; `wrap` times a callable under a key."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self.flops: dict[str, float] = collections.defaultdict(float)

    def add(self, key: str, seconds: float, flops: float = 0.0) -> None:
        self.seconds[key] += seconds
        self.calls[key] += 1
        self.flops[key] += flops

    def wrap(self, key: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            started = clock()
            out = fn(*args, **kwargs)
            self.add(key, clock() - started)
            return out

        return timed

    def reset(self) -> None:
        self.seconds.clear(), self.calls.clear(), self.flops.clear()


def instrument(model: Transformer, timers: Timers) -> None:
    """Wall timers around every backend operation and every packed linear (keyed by shape)."""
    backend = model.backend
    for name in ("attention_metadata", "add_rms_norm", "rope_and_cache_write", "silu_mul"):
        setattr(backend, name, timers.wrap(name, getattr(backend, name)))
    attention = backend.attention

    def timed_attention(qkv, heads, cache, meta):
        started = clock()
        out = attention(qkv, heads, cache, meta)
        timers.add("attention", clock() - started)
        return out

    backend.attention = timed_attention
    for module_name, module in model.named_modules():
        if isinstance(module, (PackedCpuLinear, InterleavedHeadLinear)):  # the latter: a bfloat16 head (float32 logits)
            role = "head" if module_name.startswith("output") else module_name.rsplit(".", 1)[-1]
            forward = module.forward

            def timed_linear(x, _forward=forward, _role=role, _n=module.out_features, _k=module.in_features):
                started = clock()
                out = _forward(x)
                timers.add(f"linear {_role} [{x.shape[0]}x{_n}x{_k}]", clock() - started, 2.0 * x.shape[0] * _n * _k)
                return out

            module.forward = timed_linear
    embed = model.tok_embeddings.forward
    model.tok_embeddings.forward = timers.wrap("embedding", embed)
    if model.decode_step is not None:
        model.decode_step = timed_decode_step(model.decode_step, timers)


def timed_decode_step(step, timers: Timers):
    """The compiled decode step, each call timed (it runs the steps the backend's plan gives it)."""

    def timed(h, meta, kv_caches):
        started = clock()
        out = step(h, meta, kv_caches)
        timers.add("decode step (fused)", clock() - started)
        return out

    timed.max_rows = step.max_rows  # what the plan reads (engine.backends.base.CompiledDecodeStep)
    return timed


def sequence(seq_id: int, slot: int, num_tokens: int, computed: int, max_tokens: int = MAX_TOKENS) -> Sequence:
    blocks = math.ceil(max_tokens / BLOCK_SIZE)
    seq = Sequence(seq_id, str(seq_id), [(seq_id * 7919 + i) % 40000 + 100 for i in range(num_tokens)], PROMPT_TOKENS, SamplingParams(temperature=0.0))
    seq.block_table = list(range(slot * blocks, (slot + 1) * blocks))
    seq.num_computed_tokens = computed
    return seq


def step_shape(name: str) -> tuple[list[Sequence], list[int]]:
    """(sequences, new tokens each) of one named step (module docstring)."""
    seqs, counts = [], []

    def decodes(n: int) -> None:
        for _ in range(n):
            seqs.append(sequence(len(seqs), len(seqs), DECODE_CONTEXT, DECODE_CONTEXT - 1))
            counts.append(1)

    def prompts(n: int, new: int, prefix: int = 0) -> None:
        for _ in range(n):
            seqs.append(sequence(len(seqs), len(seqs), PROMPT_TOKENS, prefix))
            counts.append(new)

    if name in ("d8", "d32", "d64"):
        decodes(int(name[1:]))
    elif name == "m32":
        decodes(28), prompts(3, PROMPT_TOKENS), prompts(1, 100)
        seqs[-1].token_ids = seqs[-1].token_ids[:PROMPT_TOKENS]  # its first 100 tokens: no sample
    elif name == "pfx":
        decodes(28), prompts(4, PROMPT_TOKENS - 100, prefix=100)
    elif name in ("p512", "p2048"):
        prompts(int(name[1:]) // PROMPT_TOKENS, PROMPT_TOKENS)
    elif name[:1] in ("l", "c") and name[1:].isdigit() and CHUNK_TOKENS <= int(name[1:]) <= LONG_PROMPT_MAX:
        n = int(name[1:])
        new = n if name[0] == "l" else CHUNK_TOKENS
        seqs.append(sequence(0, 0, n, n - new, max_tokens=n))
        counts.append(new)
    else:
        raise SystemExit(f"unknown step {name!r}")
    return seqs, counts


def compare_decode_step(model: Transformer, caches, steps: list[str], repeats: int) -> None:
    """Each step's forward, untimed inside, with the compiled decode step and without it, in
    alternating pairs after one warm-up pair: the medians and per-op / fused."""
    step = model.decode_step
    if step is None:
        print("A/B: the backend built no compiled decode step")
        return
    print(f"A/B: forward with the compiled decode step (fused) and without (per-op), {repeats} alternating pairs, medians")
    for name in steps:
        seqs, counts = step_shape(name)
        inputs, _ = build_step_inputs(ScheduledBatch(seqs, counts), BLOCK_SIZE)
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(repeats + 1):
            for fused in (True, False):
                model.decode_step = step if fused else None
                started = clock()
                model(inputs, caches)
                times[fused].append(clock() - started)
        model.decode_step = step
        fused_s, per_op_s = (sorted(times[f][1:])[repeats // 2] for f in (True, False))
        print(f"  {name:6s} fused {fused_s * 1e3:7.2f} ms  per-op {per_op_s * 1e3:7.2f} ms  per-op / fused {per_op_s / fused_s:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each step (after one warm-up); the median step is kept")
    parser.add_argument("--steps", default="d32,m32,pfx,d64,p512,p2048")
    parser.add_argument("--top", type=int, default=14, help="rows printed per step")
    parser.add_argument("--config", default="demo", help="the model shape (bench/common.py CONFIGS), e.g. big1b")
    parser.add_argument("--decode-step", choices=("on", "off"), default="on", help="off: pure-decode steps run op by op too")
    parser.add_argument("--ab", action="store_true", help="first time each step's forward with and without the compiled decode step")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the model's and the KV cache's dtype")
    parser.add_argument("--prefill-attention", choices=("auto", "sdpa"), default="auto", help="sdpa: prefill chunks never through paged_attention")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    if opts.threads == 1:
        CLOCK[0] = time.thread_time
    args = model_args(opts.config)
    dtype = getattr(torch, opts.dtype)
    backend = select_backend(EngineConfig(dtype=opts.dtype), torch.device("cpu"))
    model = Transformer.from_state_dict(args, random_state_dict(args, seed=0, dtype=dtype), backend, max_seq_len=LONG_PROMPT_MAX)
    if opts.prefill_attention == "sdpa" and getattr(backend, "kernels", None) is not None:
        backend.kernels.paged_attention_takes_chunks = lambda *args: False
    caches = allocate_kv_caches(args, 1, 70 * math.ceil(MAX_TOKENS / BLOCK_SIZE), BLOCK_SIZE, dtype=dtype, device=torch.device("cpu"))
    for k_cache, v_cache in caches:  # K/V values of a realistic size
        k_cache.normal_(), v_cache.normal_()
    # without oneDNN's bfloat16 (AVX2) a bfloat16 model's linears are float32 FMAs on widened weights
    # (gemm.c), and torch's emulated bfloat16 matmul took minutes to sample a meaningless 1 GFLOP/s
    roofline_dtype = dtype if packing_available(dtype) else torch.float32
    peak = matmul_flops_per_s(roofline_dtype)
    print(f"backend {backend.name}, prefill attention {opts.prefill_attention}, {opts.threads} threads ({'thread CPU time' if opts.threads == 1 else 'wall'}), {str(roofline_dtype).removeprefix('torch.')} matmul roofline {peak / 1e9:.0f} GFLOP/s, load average {load_average()}")
    if opts.ab:
        compare_decode_step(model, caches, opts.steps.split(","), opts.repeats)
    if opts.decode_step == "off":
        model.decode_step = None
    timers = Timers()
    instrument(model, timers)
    sampler = Sampler()
    for name in opts.steps.split(","):
        seqs, counts = step_shape(name)
        runs = []
        for _ in range(opts.repeats + 1):
            timers.reset()
            started = clock()
            inputs, sampling = build_step_inputs(ScheduledBatch(seqs, counts), BLOCK_SIZE)
            timers.add("build_step_inputs", clock() - started)
            forward_started = clock()
            logits = model(inputs, caches)
            timers.add("forward (all)", clock() - forward_started)
            sample_started = clock()
            sampler.sample(logits, [seqs[i] for i in sampling])
            timers.add("sampling", clock() - sample_started)
            runs.append((timers.seconds["forward (all)"], dict(timers.seconds), dict(timers.calls), dict(timers.flops)))
        runs = sorted(runs[1:], key=lambda run: run[0])
        forward_s, seconds, calls, flops = runs[len(runs) // 2]
        tokens = sum(counts)
        timed = sum(s for k, s in seconds.items() if k not in ("forward (all)", "build_step_inputs", "sampling"))
        seconds["untimed (python, modules)"] = forward_s - timed
        linear_s = sum(s for k, s in seconds.items() if k.startswith("linear"))
        linear_flops = sum(flops.values())
        rate = linear_flops / linear_s if linear_s else 0.0
        linears = f"linears {linear_s / forward_s:.0%} at {rate / 1e9:.0f} GFLOP/s ({rate / peak:.0%} of roofline)" if linear_s else "no linear timed"
        print(f"\n== {name}: {len(seqs)} seqs, {tokens} tokens; forward {forward_s * 1e3:.1f} ms ({tokens / forward_s:.0f} tok/s); {linears}")
        for key, s in sorted(seconds.items(), key=lambda kv: -kv[1])[: opts.top]:
            rate = f"  {flops[key] / s / 1e9:6.0f} GFLOP/s" if flops.get(key) else ""
            share = f"{s / forward_s:5.1%}" if key not in ("forward (all)",) else "     "
            print(f"  {key:42s} {s * 1e3:8.2f} ms {share} x{calls.get(key, 0):<4d}{rate}")


if __name__ == "__main__":
    main()
