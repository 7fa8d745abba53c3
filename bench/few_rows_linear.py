"""The interleaved linear at 1..8 rows with cold weights, against oneDNN's packed linear and (with
--baseline) another build of the cpu_kernels library (a script, not a test).

    PYTHONPATH=. python bench/few_rows_linear.py [--threads 2] [--rows 1,2,4,5,8] [--baseline OLD.so] [--rounds 3]

Cold weights, as a real model streams them: each shape is a stack of copies larger than the L3
(--stack-mib, default 64 MiB), called one after another, so every call reads its weight from
memory. Per shape and row count, each round times the whole stack once for every kernel in turn
(the order rotates by round, so the kernels share the machine's load alike); printed: the median
over rounds of us per call (wall), the CPU time per call (process time: on a shared machine the
steadier of the two when the team's threads are not descheduled), the weight-stream rate, and the
load average before and after. Quote ratios taken in one run, not absolute figures, where other
jobs share the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import kernel_builds, load_average  # noqa: E402
from engine.backends.cpu import PackedCpuLinear, pack_weight  # noqa: E402
from engine.kernels.cpu import CpuKernels  # noqa: E402

# the demo model's block linears (wqkv, wo, w13, w2) and its output head, float32 and bfloat16
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576))


def stack_time(calls: list[Callable[[], object]]) -> tuple[float, float]:
    """(wall, CPU) seconds per call over one pass of the stack."""
    wall, cpu = time.perf_counter(), time.process_time()
    for call in calls:
        call()
    return (time.perf_counter() - wall) / len(calls), (time.process_time() - cpu) / len(calls)


def bench_shape(libs: dict[str, CpuKernels], n: int, k: int, dtype: torch.dtype, rows_list: list[int], opts) -> None:
    weight_bytes = n * k * torch.tensor([], dtype=dtype).element_size()
    copies = max(2, (opts.stack_mib << 20) // weight_bytes)
    weights = [torch.randn(n, k).to(dtype) for _ in range(copies)]
    kernels = {name: [lib.bind_interleaved(lib.interleave(w)) for w in weights] for name, lib in libs.items()}
    onednn = [PackedCpuLinear(pack_weight(w)) for w in weights] if opts.onednn else []
    del weights
    for rows in rows_list:
        x = torch.randn(rows, k).to(dtype)
        runs = {name: [lambda f=f: f(x, opts.threads) for f in bound] for name, bound in kernels.items()}
        if onednn:
            runs["onednn"] = [lambda f=f: f(x) for f in onednn]
        for calls in runs.values():
            stack_time(calls)  # warm-up: oneDNN's primitive, the pages
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
        names = list(runs)
        for r in range(opts.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name].append(stack_time(runs[name]))
        cells = []
        for name, samples in times.items():
            wall = statistics.median(s[0] for s in samples)
            cpu = statistics.median(s[1] for s in samples)
            cells.append(f"{name} {wall * 1e6:7.0f} us (CPU {cpu * 1e6:7.0f}) {weight_bytes / wall / 1e9:5.1f} GB/s")
        print(f"{str(dtype)[6:]:8s} {n}x{k} rows {rows}: " + "  ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,2,4,5,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stack-mib", type=int, default=64, help="bytes of weights per shape's stack (past the L3)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    parser.add_argument("--baseline", type=Path, help="another build of the cpu_kernels library (.so)")
    parser.add_argument("--no-onednn", dest="onednn", action="store_false", help="skip oneDNN (bfloat16 without AVX-512 is emulated: slow)")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    libs = kernel_builds(opts.baseline)
    before = load_average()
    print(f"torch {torch.__version__}, {opts.threads} threads, {opts.stack_mib} MiB stacks (cold weights), median of {opts.rounds} rounds; "
          f"load average {before}")
    rows_list = [int(r) for r in opts.rows.split(",")]
    for dtype in (getattr(torch, d) for d in opts.dtypes.split(",")):
        for shape in opts.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            bench_shape(libs, n, k, dtype, rows_list, opts)
    print(f"load average before {before}, after {load_average()}")


if __name__ == "__main__":
    main()
