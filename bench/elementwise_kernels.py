"""The fused elementwise kernels at decode and prefill sizes, one by one (a script, not a test).

    PYTHONPATH=. python bench/elementwise_kernels.py [--threads 1,2] [--rows 32,512] [--baseline OLD.so] [--dtype float32]

Demo shape (dim 576, FFN 1536, 9/3 heads of 64, vocab 49152), bfloat16 (or --dtype): add_rms_norm, silu_mul and
rope_and_cache_write on inputs hot in the calling threads' caches, and silu_mul / add_rms_norm on
inputs a linear has just written (AMX tiles, else torch's bfloat16 linear, oneDNN: as in the model,
where the linear splits its output columns between the threads, so at 2 threads half of each row
comes from the other core, and oneDNN leaves its output outside the caches); the greedy
argmax of [rows, 49152] logits (bfloat16 and float32) against numpy's (after the float32 copy). Median
microseconds per call: at 1 thread the thread's CPU time, else wall. --baseline loads a second build of the cpu_kernels library (engine/kernels/csrc/; a .so from the
kernel cache of another checkout) and interleaves it with this one, call for call, in the same
process: on a machine shared with other jobs only such A/B ratios carry over.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

if "OMP_WAIT_POLICY" not in os.environ:  # as bench/stream_profile.py: no libgomp spin storms when the cores are shared
    os.environ.setdefault("GOMP_SPINCOUNT", "100000")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import load_average  # noqa: E402
from engine.kernels.amx import load_amx_linear  # noqa: E402
from engine.kernels.cpu import CpuKernels, load_cpu_kernels  # noqa: E402
from engine.core.sampler import _row_max  # noqa: E402

DIM, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 576, 1536, 9, 3, 64, 49152
EPS = 1e-5
WARMUP_CALLS = 3


def clock_for(threads: int) -> Callable[[], float]:
    """Wall seconds, or at 1 thread the calling thread's CPU time (every call then runs on it),
    which other jobs on a shared machine disturb far less."""
    return time.thread_time if threads == 1 else time.perf_counter


def median_of_calls_us(fn: Callable[[], object], calls: int, before: Callable[[], object] | None = None, *, threads: int = 2) -> float:
    """Median microseconds (clock_for(threads)) of fn over `calls` calls (after WARMUP_CALLS
    untimed), `before` (untimed) ahead of each."""
    clock = clock_for(threads)
    seconds = []
    for _ in range(WARMUP_CALLS):
        if before is not None:
            before()
        fn()
    for _ in range(calls):
        if before is not None:
            before()
        started = clock()
        fn()
        seconds.append(clock() - started)
    return sorted(seconds)[len(seconds) // 2] * 1e6


class Inputs:
    """One step's tensors at `rows` tokens (random, realistic magnitudes), reused by every call."""

    def __init__(self, rows: int, kernels: CpuKernels, dtype: torch.dtype) -> None:
        g = torch.Generator().manual_seed(rows)
        self.rows = rows
        self.residual = torch.randn(rows, DIM, generator=g).to(dtype)
        self.delta = (0.01 * torch.randn(rows, DIM, generator=g)).to(dtype)  # residual stays bounded over many calls
        self.norm_weight = torch.randn(DIM, generator=g).to(dtype)
        self.norm_out = torch.empty(rows, DIM, dtype=dtype)
        self.gate_up = torch.randn(rows, 2 * HIDDEN, generator=g).to(dtype)
        self.silu_out = torch.empty(rows, HIDDEN, dtype=dtype)
        self.qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g).to(dtype)
        self.positions = torch.arange(rows, dtype=torch.int64) % 128
        angles = torch.randn(2048, HEAD_DIM // 2, generator=g)
        self.rope = torch.stack([angles.cos(), angles.sin()], -1).contiguous()  # unit rotations: values stay put
        self.k_cache = torch.zeros(8192, KV_HEADS, HEAD_DIM, dtype=dtype)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.slots = torch.arange(rows, dtype=torch.int64) + 1024
        self.logits = torch.randn(min(rows, 64), VOCAB, generator=g).bfloat16()
        self.logits32 = self.logits.float()
        # the linears whose outputs feed silu_mul (w13) and add_rms_norm (w2) in the model: AMX tiles
        # where the CPU has them, else torch's bfloat16 linear (oneDNN, what a prefill step's rows
        # take on AVX512_BF16 CPUs without tiles), which leaves its output out of the caches
        self.x = torch.randn(rows, DIM, generator=g).to(dtype)
        self.h = torch.randn(rows, HIDDEN, generator=g).to(dtype)
        w13, w2 = (0.05 * torch.randn(2 * HIDDEN, DIM, generator=g)).to(dtype), (0.03 * torch.randn(DIM, HIDDEN, generator=g)).to(dtype)
        amx = load_amx_linear() if dtype == torch.bfloat16 else None
        if amx is not None:
            self.w13, self.w2 = amx.bind(kernels.interleave(w13)), amx.bind(kernels.interleave(w2))
        else:
            self.w13, self.w2 = (lambda x, threads: F.linear(x, w13)), (lambda x, threads: F.linear(x, w2))


def baseline_build(path: Path) -> CpuKernels:
    """CpuKernels over another build, which may predate entry points this checkout added (those it
    has keep their signatures)."""
    return CpuKernels(ctypes.CDLL(str(path)), partial=True)


def measure(k: CpuKernels, t: Inputs, threads: int, calls: int) -> dict[str, float]:
    """Median us per kernel call for one build."""
    median_us = functools.partial(median_of_calls_us, threads=threads)
    row: dict[str, float] = {
        "add_rms_norm": median_us(lambda: k.add_rms_norm(t.residual, t.delta, t.norm_weight, t.norm_out, EPS, threads), calls),
        "silu_mul": median_us(lambda: k.silu_mul(t.gate_up, t.silu_out, threads), calls),
        "rope_and_cache_write": median_us(
            lambda: k.rope_and_cache_write(
                t.qkv, HEADS, KV_HEADS, HEAD_DIM, t.positions, t.rope, t.slots, t.k_cache, t.v_cache, threads
            ),
            calls,
        ),
    }
    fresh: dict[str, torch.Tensor] = {}
    row["silu_mul after w13"] = median_us(
        lambda: k.silu_mul(fresh["gate_up"], t.silu_out, threads), calls, lambda: fresh.update(gate_up=t.w13(t.x, threads))
    )
    row["add_rms_norm after w2"] = median_us(
        lambda: k.add_rms_norm(t.residual, fresh["delta"], t.norm_weight, t.norm_out, EPS, threads),
        calls,
        lambda: fresh.update(delta=t.w2(t.h, threads)),
    )
    if k.address("argmax_rows") is not None:
        row[f"argmax [{t.logits.shape[0]}, {VOCAB}] bf16"] = median_us(lambda: k.argmax_rows(t.logits, threads), calls)
        row[f"argmax [{t.logits.shape[0]}, {VOCAB}] f32"] = median_us(lambda: k.argmax_rows(t.logits32, threads), calls)
    return row


def median_round(rounds: list[dict[str, float]], key: str) -> str:
    """The median round's microseconds for `key`, or '-' where the build lacks the kernel."""
    values = sorted(r[key] for r in rounds if key in r)
    return f"{values[len(values) // 2]:8.1f}" if values else "       -"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rows", default="32,512")
    parser.add_argument("--calls", type=int, default=40, help="timed calls per kernel and round (the median is kept)")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds of every build (the median round is printed)")
    parser.add_argument("--baseline", type=Path, help="another build of cpu_kernels.c to A/B against, call for call")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the activations' dtype (the argmax rows: both)")
    opts = parser.parse_args()
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the fused CPU kernels cannot be built here")
    builds = {"this": kernels}
    if opts.baseline is not None:
        builds = {"baseline": baseline_build(opts.baseline), **builds}
    print(f"{opts.dtype}, median us per call (1 thread: thread CPU time, else wall), {opts.rounds} interleaved rounds; load average {load_average()}")
    for threads in [int(x) for x in opts.threads.split(",")]:
        torch.set_num_threads(threads)
        for rows in [int(x) for x in opts.rows.split(",")]:
            inputs = Inputs(rows, kernels, getattr(torch, opts.dtype))
            rounds: dict[str, list[dict[str, float]]] = {name: [] for name in builds}
            for i in range(opts.rounds):  # ABBA: neither build always runs first
                for name, build in list(builds.items())[:: 1 if i % 2 == 0 else -1]:
                    rounds[name].append(measure(build, inputs, threads, opts.calls))
            copy_us = median_of_calls_us(lambda: _row_max(inputs.logits.float()), opts.calls, threads=threads)
            numpy_us = median_of_calls_us(lambda: _row_max(inputs.logits32), opts.calls, threads=threads)
            print(f"\n== {rows} rows, {threads} threads")
            for key in rounds["this"][0]:
                print(f"  {key:34s} " + "  ".join(f"{name} {median_round(rounds[name], key)}" for name in builds))
            print(f"  {'float32 copy + numpy argmax':34s} {copy_us:8.1f}")
            print(f"  {'numpy argmax of float32':34s} {numpy_us:8.1f}")


if __name__ == "__main__":
    main()
