"""Decode attention over many sequences, cold (a script, not a test): paged_decode_attention and
paged_attention of this tree's cpu_kernels build, and of a baseline build (--baseline OLD.so), on a
demo-shaped decode step (9/3 heads of 64, 16-key blocks in shuffled order), each call on the next of
30 layers' caches as a step's layers are (the layer's weights evicted the last one's K/V), builds and
kernels interleaved round by round, the caches on 4 KiB pages and on huge pages (as
engine.models.llama.allocate_kv_caches places them on the CPU).

    PYTHONPATH=. python bench/decode_attention.py [--threads 1] [--baseline OLD.so] [--ours NEW.so] [--shapes 32x128,32x192,p512,m32]

--ours: a build to measure in place of this tree's -march=native one (another ISA level of this
tree: `python -m engine.kernels.build prebuild DIR x86-64-v3`).

Shapes: DxK, D decodes at K keys of context; p512, 4 whole 128-token prompts (a 512-token prefill
step); m32, 28 decodes at 160 keys + 3 whole 128-token prompts + the first 100 tokens of a 4th (as
bench/stream_profile.py's steps). Steps with prompts run paged_attention only (the decode kernel
takes no chunks), as the backend runs them on AVX2.

One thread: thread CPU time per call (other jobs on a shared machine disturb it far less than wall
time); more threads: wall time. Medians over --rounds passes of 30 layers; GFLOP/s counts the 4
flops per (query row, key, dim) of the scores and the weighted values; GB/s the K/V bytes read.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import kernel_builds, load_average  # noqa: E402
from engine.kernels.cpu import CpuKernels  # noqa: E402
from engine.kernels.memory import huge_page_zeros  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def step_shape(shape: str) -> tuple[list[int], list[int]]:
    """(new tokens, keys) per sequence of a --shapes entry."""
    if shape == "p512":
        return [128] * 4, [128] * 4
    if shape == "m32":
        return [1] * 28 + [128] * 3 + [100], [160] * 28 + [128] * 3 + [100]
    seqs, keys = (int(v) for v in shape.split("x"))
    return [1] * seqs, [keys] * seqs


def step_inputs(new_tokens: list[int], kv_lens: list[int], dtype: torch.dtype, seed: int, huge_pages: bool = False) -> dict:
    """One step's query rows (new_tokens[b] per sequence, the last of its kv_lens[b] keys) and 30
    layers' caches, every sequence's blocks shuffled; the caches on 4 KiB pages (torch's allocation)
    or, as the engine allocates them, on huge pages."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-keys // BLOCK) for keys in kv_lens]
    seqs, max_blocks = len(kv_lens), max(blocks)
    order = torch.randperm(sum(blocks), generator=g).tolist()
    ends = [sum(blocks[: b + 1]) for b in range(seqs)]
    tables = [order[end - n : end] + [0] * (max_blocks - n) for n, end in zip(blocks, ends)]
    shape = (sum(blocks), BLOCK, KV_HEADS, HEAD_DIM)
    flat = huge_page_zeros([shape] * (2 * LAYERS), dtype) if huge_pages else [torch.empty(shape, dtype=dtype) for _ in range(2 * LAYERS)]
    for cache in flat:
        cache.copy_(torch.randn(shape, generator=g))
    caches = [(flat[2 * layer], flat[2 * layer + 1]) for layer in range(LAYERS)]
    tokens = sum(new_tokens)
    starts = [sum(new_tokens[:b]) for b in range(seqs)]
    return {
        "qkv": torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g).to(dtype),
        "out": torch.empty(tokens, HEADS * HEAD_DIM, dtype=dtype),
        "caches": caches,
        "tables": torch.tensor(tables, dtype=torch.int32),
        "lens": torch.tensor(kv_lens, dtype=torch.int32),
        "rows": torch.arange(seqs),
        "starts": torch.tensor(starts, dtype=torch.int32),
        "new": torch.tensor(new_tokens, dtype=torch.int32),
    }


def call(lib, kernel: str, x: dict, layer: int, threads: int) -> None:
    k_cache, v_cache = x["caches"][layer]
    if kernel == "decode":
        lib.paged_decode_attention(x["qkv"], x["out"], x["rows"], k_cache, v_cache, x["tables"], x["lens"], HEADS, KV_HEADS, HEAD_DIM**-0.5, threads)
    else:
        lib.paged_attention(x["qkv"], x["out"], x["starts"], x["new"], x["lens"], x["tables"], k_cache, v_cache, HEADS, KV_HEADS, HEAD_DIM**-0.5, threads)


def us_per_call(lib, kernel: str, x: dict, threads: int) -> float:
    clock = time.thread_time if threads == 1 else time.perf_counter
    start = clock()
    for layer in range(LAYERS):
        call(lib, kernel, x, layer, threads)
    return (clock() - start) / LAYERS * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--baseline", type=Path, help="another build of the cpu_kernels library (.so)")
    parser.add_argument("--ours", type=Path, help="the build to measure as ours (default: this tree's -march=native one)")
    parser.add_argument("--shapes", default="32x128,32x192", help="decodes x keys, comma-separated")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=7)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    libs = kernel_builds(opts.baseline)
    if opts.ours:
        libs["ours"] = CpuKernels(ctypes.CDLL(str(opts.ours)), partial=True)
    print(f"{opts.threads} threads, load average {load_average()} at the start; us per call ({'thread CPU' if opts.threads == 1 else 'wall'}), median of {opts.rounds} x {LAYERS} layers")
    for dtype_name in opts.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for shape in opts.shapes.split(","):
            new_tokens, kv_lens = step_shape(shape)
            kernels = ("decode", "paged") if max(new_tokens) == 1 else ("paged",)
            seed = len(kv_lens) + max(kv_lens)
            pages = {"4k": step_inputs(new_tokens, kv_lens, dtype, seed), "huge": step_inputs(new_tokens, kv_lens, dtype, seed, huge_pages=True)}
            runs = {(name, kernel, page): [] for name in libs for kernel in kernels for page in pages}
            for _ in range(opts.rounds):
                for (name, kernel, page), times in runs.items():
                    x = pages[page]
                    call(libs[name], kernel, x, 0, opts.threads)  # warm the code, not the data: the other layers stay cold
                    times.append(us_per_call(libs[name], kernel, x, opts.threads))
            # each new token sees its prefix and the chunk up to itself
            pairs = sum(sum(keys - n + 1 + t for t in range(n)) for n, keys in zip(new_tokens, kv_lens))
            flops = 4 * HEADS * pairs * HEAD_DIM
            kv_bytes = 2 * sum(kv_lens) * KV_HEADS * HEAD_DIM * dtype.itemsize
            for (name, kernel, page), times in runs.items():
                us = statistics.median(times)
                print(f"{dtype_name} {shape:7s} {name} {kernel:6s} {page:4s} pages: {us:7.1f} us ({flops / us / 1e3:4.1f} GFLOP/s, {kv_bytes / us / 1e3:4.1f} GB/s)")
    print(f"load average at the end {load_average()}")


if __name__ == "__main__":
    main()
