"""The few-rows kernel (csrc/linear.c, CpuKernels.bind_interleaved) against csrc/gemm.c (bind_gemm) on the
same interleaved float32 copy, at the row counts where one hands over to the other (a script, not a test).

    python bench/few_rows_vs_gemm.py [--rows 2,3,4,5,6,8,12] [--rounds 7]

Cold weights: each shape a stack of copies past the L3 (--stack-mib), called one after another. One
thread, the calling thread's CPU time per call (steadier than wall time on a shared machine); the two
kernels alternate round by round, the median per kernel is printed with gemm's time over few-rows'. Sets
FEW_ROWS_MAX_ROWS (engine/backends/cpu.py): the rows past it go to the gemm.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kernels.cpu import load_cpu_kernels  # noqa: E402

BLOCK_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # the demo's wqkv, wo, w13, w2 [out, in]


def us_per_call(calls: list, x: torch.Tensor) -> float:
    start = time.thread_time()
    for call in calls:
        call(x, 1)
    return (time.thread_time() - start) / len(calls) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="2,3,4,5,6,8,12")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--stack-mib", type=int, default=256, help="weight bytes per shape's stack (past the L3)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    kernels = load_cpu_kernels()
    print(f"{kernels.simd_bits}-bit build, 1 thread (thread CPU time), {args.stack_mib} MiB stacks, median of {args.rounds} rounds")
    for n, k in BLOCK_SHAPES:
        copies = [kernels.interleave(torch.randn(n, k)) for _ in range(max(2, (args.stack_mib << 20) // (n * k * 4)))]
        paths = {"few": [kernels.bind_interleaved(w) for w in copies], "gemm": [kernels.bind_gemm(w) for w in copies]}
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            times: dict[str, list[float]] = {name: [] for name in paths}
            for round_index in range(args.rounds):
                for name in sorted(paths, reverse=bool(round_index % 2)):
                    times[name].append(us_per_call(paths[name], x))
            few, gemm = statistics.median(times["few"]), statistics.median(times["gemm"])
            print(f"[{n}x{k}] rows {rows:3d}: few {few:7.1f} us  gemm {gemm:7.1f} us  gemm/few {gemm / few:.2f}", flush=True)


if __name__ == "__main__":
    main()
