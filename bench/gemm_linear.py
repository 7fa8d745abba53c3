"""Cold-weight A/B of float32 linears at many-streams row counts: engine/kernels/csrc/gemm.c
(interleaved_gemm, on the one-row kernel's interleaved copy) against oneDNN on its packed weight
(PackedCpuLinear._onednn's call), for the demo's shapes (the head included) or others. With --dtype
bfloat16 (gemm.c widening the bfloat16 weights per load) the other path is what a bfloat16 weight
without oneDNN's bfloat16 kernel (AVX2) would run instead: tiles widened to float32 and torch's float32
GEMM (engine.backends.cpu.widened_mm).

Each shape gets enough distinct weights (over --cold-mb in all, at least 2) that every call reads its
weight from DRAM, as a decode step over 30 layers does (the L3 here is 16 MiB); the two paths run
interleaved, round after round, and the median per round is printed as time and GFLOP/s. One thread:
the calling thread's CPU time (other jobs on a shared machine disturb it far less than wall time);
more threads: wall time. Read the ratios on a shared machine.

    python bench/gemm_linear.py --threads 1 --rows 9,16,24,32,48,64 --rounds 5
    python bench/gemm_linear.py --shapes head --rows 32,64 --rounds 3
    python bench/gemm_linear.py --shapes 3072x576 --rows 128,512 --baseline OLD_cpu_kernels.so
    python bench/gemm_linear.py --dtype bfloat16 --shapes blocks --rows 32,512,2048 --rounds 3
    python bench/gemm_linear.py --shapes blocks --rows 32 --huge-pages --baseline OLD_cpu_kernels.so
    python bench/gemm_linear.py --dtype bfloat16 --io --shapes blocks --rows 9,32,64,128 --rounds 5

--io (bfloat16): what a bfloat16 model's rows cost around the gemm instead: "gemm" on a float32 x with
float32 sums (the gemm alone), "bf16 io" interleaved_gemm_bf16 (x widened and the sums rounded in C,
what PackedCpuLinear and the compiled decode step call), "torch io" x.float(), the gemm and
.to(bfloat16) (the per-op path before it).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

# as the server does (server/__main__.py): libgomp's default spin at each barrier makes 2-thread
# timings meaningless whenever anything else runs on the cores
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "100000")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backends.cpu import PACK_BATCH_HINT, widened_mm  # noqa: E402
from engine.kernels.cpu import CpuKernels, load_cpu_kernels  # noqa: E402
from engine.kernels.memory import WeightArena, onednn_rows  # noqa: E402

DEMO_SHAPES = [(960, 576), (3072, 576), (576, 576), (576, 1536), (49152, 576)]  # qkv, w13, wo, w2, head [out, in]
NAMED_SHAPES = {"demo": DEMO_SHAPES, "blocks": DEMO_SHAPES[:4], "head": DEMO_SHAPES[4:]}


def time_per_call_us(fn, weights: list, calls: int, cpu_time: bool) -> float:
    clock = time.thread_time if cpu_time else time.perf_counter
    start = clock()
    for i in range(calls):
        fn(weights[i % len(weights)])
    return (clock() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="9,16,24,32,48,64")
    parser.add_argument("--shapes", default="demo", help="OUTxIN,... or demo / blocks / head")
    parser.add_argument("--cold-mb", type=int, default=256, help="weight bytes rotated per shape (the L3 is 16 MiB here)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--round-gflop", type=float, default=2.0, help="work per path per round, at most (cold weights permitting)")
    parser.add_argument("--baseline", help="another cpu_kernels .so (an older gemm.c): timed as a third path")
    parser.add_argument("--huge-pages", action="store_true",
                        help="the gemms' interleaved copies in one WeightArena (2 MiB pages where granted), as a served model holds "
                             "its block linears (engine/backends/cpu_step.py); oneDNN's packed copies stay where torch put them")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the weights' (bfloat16: against widened tiles + float32 GEMM, not oneDNN)")
    parser.add_argument("--io", action="store_true", help="bfloat16: the gemm alone against its bfloat16 in and out (module docstring)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("needs the CPU kernels (no compiler?)")
    baseline = CpuKernels(ctypes.CDLL(args.baseline), partial=True) if args.baseline else None
    cpu_time = args.threads == 1
    print(f"threads {args.threads} ({'thread CPU time' if cpu_time else 'wall time'}), {args.cold_mb} MB of weights per shape, "
          f"{args.dtype} weights, median of {args.rounds} interleaved rounds, gemm's max rows here {kernels.gemm_max_rows()}, "
          f"gemm weights on {'a huge-page arena' if args.huge_pages else 'torch tensors (4 KiB pages)'}, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    shapes = NAMED_SHAPES.get(args.shapes) or [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    dtype = getattr(torch, args.dtype)
    for n, k in shapes:
        copies = max(2, args.cold_mb * 2**20 // (n * k * dtype.itemsize))
        weights = [torch.randn(n, k).to(dtype) for _ in range(copies)]
        if dtype == torch.float32:
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT) for w in weights]
        else:  # the path a bfloat16 weight without oneDNN's kernel takes past the few rows
            packed = [kernels.bind_widen(kernels.interleave(w)) for w in weights]
        interleaved = [kernels.interleave(w, pairs=False) for w in weights]  # the gemm's panels, where pairs exist too
        if args.huge_pages:  # one arena for every copy (the old kernel's read the same ones)
            arena = WeightArena([(t.shape, t.dtype) for t in interleaved])
            interleaved = [arena.place(i, t) for i, t in enumerate(interleaved)]
        gemms = [kernels.bind_gemm(t) for t in interleaved]
        olds = [baseline.bind_gemm(t) for t in interleaved] if baseline else []
        del weights
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k).to(dtype)
            gflop = 2 * rows * n * k / 1e9
            calls = max(2, min(copies, int(args.round_gflop / gflop)))
            x_pad = torch.nn.functional.pad(x, (0, 0, 0, onednn_rows(rows) - rows))
            other = ("onednn", lambda p: torch.ops.mkldnn._linear_pointwise(x_pad, p, None, "none", [], "")) if dtype == torch.float32 else \
                ("widened", lambda widen: widened_mm(x, widen, n, args.threads))
            paths = {
                other[0]: (other[1], packed),
                "gemm": (lambda g: g(x, args.threads), gemms),
            }
            if baseline:
                paths["old"] = (lambda g: g(x, args.threads), olds)
            if args.io and dtype == torch.bfloat16:
                x_f32, rounded = x.float(), [kernels.bind_gemm(t, out_dtype=torch.bfloat16) for t in interleaved]
                other = ("torch io", lambda g: g(x, args.threads).to(torch.bfloat16))  # x.float() inside bind_gemm's float32 call
                paths = {other[0]: (other[1], gemms), "gemm": (lambda g: g(x_f32, args.threads), gemms),
                         "bf16 io": (lambda g: g(x, args.threads), rounded)}  # fmt: skip
            times = {name: [] for name in paths}
            for fn, ws in paths.values():  # warm-up: primitives created, pages touched
                fn(ws[0])
            for _ in range(args.rounds):
                for name, (fn, ws) in paths.items():
                    times[name].append(time_per_call_us(fn, ws, calls, cpu_time))
            med = {name: statistics.median(t) for name, t in times.items()}
            cells = "  ".join(f"{name} {us:9.1f} us ({gflop / us * 1e6:5.1f} GFLOP/s)" for name, us in med.items())
            print(f"[{n}x{k}] rows {rows:4d}: {cells}  {other[0]}/gemm {med[other[0]] / med['gemm']:.2f}", flush=True)
        del packed, gemms, olds, interleaved


if __name__ == "__main__":
    main()
