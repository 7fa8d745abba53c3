"""Decode attention over many sequences, cold (a script, not a test): paged_decode_attention and
paged_attention of this tree's cpu_kernels build, and of a baseline build (--baseline OLD.so), on a
demo-shaped decode step (9/3 heads of 64, 16-key blocks in shuffled order), each call on the next of
30 layers' caches as a step's layers are (the layer's weights evicted the last one's K/V), builds and
kernels interleaved round by round, the caches on 4 KiB pages and on huge pages (as
engine.models.llama.allocate_kv_caches places them on the CPU).

    PYTHONPATH=. python bench/decode_attention.py [--threads 1] [--baseline OLD.so] [--shapes 32x128,32x192]

One thread: thread CPU time per call (other jobs on a shared machine disturb it far less than wall
time); more threads: wall time. Medians over --rounds passes of 30 layers; GFLOP/s counts the 4
flops per (query row, key, dim) of the scores and the weighted values; GB/s the K/V bytes read.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import kernel_builds, load_average  # noqa: E402
from engine.kernels.memory import huge_page_zeros  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def step_inputs(seqs: int, keys: int, dtype: torch.dtype, seed: int, huge_pages: bool = False) -> dict:
    """One decode step's query rows and 30 layers' caches, every sequence's blocks shuffled; the
    caches on 4 KiB pages (torch's allocation) or, as the engine allocates them, on huge pages."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-keys // BLOCK)
    order = torch.randperm(seqs * blocks, generator=g)
    shape = (seqs * blocks, BLOCK, KV_HEADS, HEAD_DIM)
    flat = huge_page_zeros([shape] * (2 * LAYERS), dtype) if huge_pages else [torch.empty(shape, dtype=dtype) for _ in range(2 * LAYERS)]
    for cache in flat:
        cache.copy_(torch.randn(shape, generator=g))
    caches = [(flat[2 * layer], flat[2 * layer + 1]) for layer in range(LAYERS)]
    return {
        "qkv": torch.randn(seqs, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g).to(dtype),
        "out": torch.empty(seqs, HEADS * HEAD_DIM, dtype=dtype),
        "caches": caches,
        "tables": order.to(torch.int32).view(seqs, blocks).contiguous(),
        "lens": torch.full((seqs,), keys, dtype=torch.int32),
        "rows": torch.arange(seqs),
        "starts": torch.arange(seqs, dtype=torch.int32),
        "ones": torch.ones(seqs, dtype=torch.int32),
    }


def call(lib, kernel: str, x: dict, layer: int, threads: int) -> None:
    k_cache, v_cache = x["caches"][layer]
    if kernel == "decode":
        lib.paged_decode_attention(x["qkv"], x["out"], x["rows"], k_cache, v_cache, x["tables"], x["lens"], HEADS, KV_HEADS, HEAD_DIM**-0.5, threads)
    else:
        lib.paged_attention(x["qkv"], x["out"], x["starts"], x["ones"], x["lens"], x["tables"], k_cache, v_cache, HEADS, KV_HEADS, HEAD_DIM**-0.5, threads)


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
    parser.add_argument("--shapes", default="32x128,32x192", help="decodes x keys, comma-separated")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=7)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    libs = kernel_builds(opts.baseline)
    print(f"{opts.threads} threads, load average {load_average()} at the start; us per call ({'thread CPU' if opts.threads == 1 else 'wall'}), median of {opts.rounds} x {LAYERS} layers")
    for dtype_name in opts.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for shape in opts.shapes.split(","):
            seqs, keys = (int(v) for v in shape.split("x"))
            pages = {"4k": step_inputs(seqs, keys, dtype, seed=seqs + keys), "huge": step_inputs(seqs, keys, dtype, seed=seqs + keys, huge_pages=True)}
            runs = {(name, kernel, page): [] for name in libs for kernel in ("decode", "paged") for page in pages}
            for _ in range(opts.rounds):
                for (name, kernel, page), times in runs.items():
                    x = pages[page]
                    call(libs[name], kernel, x, 0, opts.threads)  # warm the code, not the data: the other layers stay cold
                    times.append(us_per_call(libs[name], kernel, x, opts.threads))
            flops = 4 * seqs * HEADS * keys * HEAD_DIM
            kv_bytes = 2 * seqs * keys * KV_HEADS * HEAD_DIM * dtype.itemsize
            for (name, kernel, page), times in runs.items():
                us = statistics.median(times)
                print(f"{dtype_name} {seqs} x {keys} keys, {name} {kernel:6s} {page:4s} pages: {us:7.1f} us ({flops / us / 1e3:4.1f} GFLOP/s, {kv_bytes / us / 1e3:4.1f} GB/s)")
    print(f"load average at the end {load_average()}")


if __name__ == "__main__":
    main()
