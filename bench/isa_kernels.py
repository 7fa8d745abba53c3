"""The C kernels that compile differently by ISA level, against torch on the same inputs (a script,
not a test): the one-row linear, the two decode attention kernels and the greedy argmax.

    PYTHONPATH=. python bench/isa_kernels.py [--threads 1] [--baseline OLD.so] [--ours NEW.so]

Below AVX-512 GCC lowers the kernels' 16-lane generic vectors poorly unless they are spelled as
native halves (bench/NOTES.md 'AVX2 one-row linear'); this prints where each kernel stands against
torch's own op on this CPU (demo shapes: dim 576, FFN 1536, 9/3 heads of 64, vocab 49152), best of 5
rounds, microseconds per call, the weight-stream rate for the linears. --baseline loads a second build
of the cpu_kernels library (a .so from the kernel cache of another checkout) and times it beside
this one, round for round: on a shared machine only such ratios carry over. --ours takes another
build in place of this tree's native one (e.g. both trees' x86-64-v2 builds from `python -m
engine.kernels.build prebuild DIR x86-64-v2`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import kernel_builds, load_average  # noqa: E402
from engine.kernels.cpu import CpuKernels  # noqa: E402

ROUNDS, CALLS = 5, 20


def best_us(fn: Callable[[], object]) -> float:
    fn()
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        best = min(best, (time.perf_counter() - start) / CALLS)
    return best * 1e6


def linears(libs: dict[str, CpuKernels], threads: int) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for n, k in ((3072, 576), (576, 1536), (960, 576), (2048, 2048)):
            w, x = torch.randn(n, k, dtype=dtype), torch.randn(1, k, dtype=dtype)
            mib = w.numel() * w.element_size() / 2**20
            cells = [f"torch {best_us(lambda: torch.nn.functional.linear(x, w)):8.1f}"]
            for name, lib in libs.items():
                call = lib.bind_interleaved(lib.interleave(w))
                us = best_us(lambda: call(x, threads))
                cells.append(f"{name} {us:8.1f} ({mib * 2**20 / us / 1e3:5.1f} GB/s)")
            print(f"linear {str(dtype)[6:]:8s} {n}x{k} ({mib:.1f} MiB): " + "  ".join(cells))


def attention(libs: dict[str, CpuKernels], threads: int) -> None:
    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    for seqs, keys in ((1, 512), (32, 192), (8, 512)):
        blocks = -(-keys // block)
        k_cache = torch.randn(seqs * blocks, block, kv_heads, head_dim)
        v_cache = torch.randn_like(k_cache)
        tables = torch.arange(seqs * blocks, dtype=torch.int32).view(seqs, blocks)
        lens = torch.full((seqs,), keys, dtype=torch.int32)
        qkv = torch.randn(seqs, (heads + 2 * kv_heads) * head_dim)
        out = torch.empty(seqs, heads * head_dim)
        rows, starts, ones = torch.arange(seqs), torch.arange(seqs, dtype=torch.int32), torch.ones(seqs, dtype=torch.int32)
        q = qkv[:, : heads * head_dim].view(seqs, heads, 1, head_dim)
        kk = k_cache.view(seqs, blocks * block, kv_heads, head_dim)[:, :keys].transpose(1, 2).repeat_interleave(3, 1)
        vv = v_cache.view(seqs, blocks * block, kv_heads, head_dim)[:, :keys].transpose(1, 2).repeat_interleave(3, 1)
        cells = [f"torch sdpa (K/V gathered beforehand) {best_us(lambda: torch.nn.functional.scaled_dot_product_attention(q, kk, vv)):8.1f}"]
        for name, lib in libs.items():
            decode = best_us(lambda: lib.paged_decode_attention(qkv, out, rows, k_cache, v_cache, tables, lens, heads, kv_heads, head_dim**-0.5, threads))
            paged = best_us(lambda: lib.paged_attention(qkv, out, starts, ones, lens, tables, k_cache, v_cache, heads, kv_heads, head_dim**-0.5, threads))
            cells.append(f"{name} decode {decode:8.1f} paged {paged:8.1f}")
        print(f"attention f32 {seqs} x {keys} keys: " + "  ".join(cells))


def argmax(libs: dict[str, CpuKernels], threads: int) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 32):
            logits = torch.randn(rows, 49152).to(dtype)
            as_f32 = logits.float().numpy()
            cells = [f"numpy(f32) {best_us(lambda: as_f32.argmax(axis=1)):8.1f}"]
            cells += [f"{name} {best_us(lambda: lib.argmax_rows(logits, threads)):8.1f}" for name, lib in libs.items()]
            print(f"argmax {str(dtype)[6:]:8s} [{rows}, 49152]: " + "  ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--baseline", type=Path, help="another build of the cpu_kernels library (.so)")
    parser.add_argument("--ours", type=Path, help="a build of the cpu_kernels library (.so) in place of the native one")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    libs = kernel_builds(opts.baseline)
    if opts.ours:
        import ctypes

        libs["ours"] = CpuKernels(ctypes.CDLL(str(opts.ours)), partial=True)
    print(f"torch {torch.__version__}, {opts.threads} threads, load average {load_average()}; us per call, best of {ROUNDS} x {CALLS}")
    linears(libs, opts.threads)
    attention(libs, opts.threads)
    argmax(libs, opts.threads)


if __name__ == "__main__":
    main()
