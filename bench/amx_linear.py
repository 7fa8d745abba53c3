"""Cold-weight A/B of bfloat16 linears: engine/kernels/csrc/amx_linear.c (AMX tiles) and, on CPUs with
AVX512_BF16 (with or without AMX), linear.c's pairs gemm (vdpbf16ps, path `pgemm`) against oneDNN on its
packed weight (PackedCpuLinear._onednn's call) and the one-row pairs kernel, for decode batches and
prefill chunks.

Each shape gets enough distinct weights (over --cold-mb in all) that every call reads its weight
from DRAM, as in a decode step over 30 layers (at prefill sizes a round stops after --round-gflop of
work: the weight's stream no longer matters there); the paths run interleaved, round after round,
and the median per round is printed, as time, weight GB/s and GFLOP/s (the machine may be shared:
read the ratios; --threads 1 times process CPU time, steadier there; --cold-mb 1 keeps one weight
per shape: warm).

    python bench/amx_linear.py --threads 2 --rows 2,8,16,32,64 --rounds 5
    python bench/amx_linear.py --threads 2 --rows 65,128,256,512,1024,2048,4096 --paths onednn,amx
    python bench/amx_linear.py --shapes big1b --rows 64,256,1024 --paths onednn,amx
    python bench/amx_linear.py --threads 1 --paths onednn,pgemm --rows 2,4,8,16,32,64,128,256,512
    python bench/amx_linear.py --threads 1 --paths pgemm --rows 8,16,32,64 --baseline /tmp/main/cpu_kernels.so
"""

from __future__ import annotations

import argparse
import dataclasses
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

from engine.kernels.amx import load_amx_linear  # noqa: E402
from engine.backends.cpu import PackedWeight, pack_weight  # noqa: E402
from bench.common import kernel_builds  # noqa: E402
from engine.kernels.cpu import load_cpu_kernels  # noqa: E402
from engine.kernels.memory import onednn_rows  # noqa: E402

DEMO_SHAPES = [(960, 576), (3072, 576), (576, 576), (576, 1536)]  # qkv, w13, wo, w2 [out, in]
BIG1B_SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # bench/common.py CONFIGS["big1b"]: qkv, wo, w13, w2
NAMED_SHAPES = {"demo": DEMO_SHAPES, "big1b": BIG1B_SHAPES}


def with_pairs(weight: torch.Tensor, kernels) -> PackedWeight:
    """pack_weight's copies, with the pairs copy whatever the weight's size (pack_weight keeps one up
    to INTERLEAVED_MAX_WEIGHT_BYTES only): the 1.1B model's shapes are timed too."""
    return dataclasses.replace(pack_weight(weight), interleaved=kernels.interleave(weight))


def time_per_call_us(fn, weights: list, calls_per_round: int, clock) -> float:
    start = clock()
    for i in range(calls_per_round):
        fn(weights[i % len(weights)])
    return (clock() - start) / calls_per_round * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="2,4,8,16,32,64")
    parser.add_argument("--shapes", default="demo", help="OUTxIN,... or demo / big1b")
    parser.add_argument("--cold-mb", type=int, default=600, help="weight bytes rotated per shape")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--round-gflop", type=float, default=4.0, help="work per path per round, at most (cold weights permitting)")
    parser.add_argument("--paths", default="onednn,amx,pairs", help="of onednn, amx, pairs (the one-row kernel), pgemm (linear.c's pairs gemm)")
    parser.add_argument("--baseline", type=Path, help="another build of the cpu_kernels library (.so): its pairs and pgemm paths run too, as old-pairs, old-pgemm")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels, amx = load_cpu_kernels(), load_amx_linear()
    if kernels is None or not kernels.has_bf16_pairs or (amx is None and "amx" in args.paths.split(",")):
        raise SystemExit("needs the CPU kernels with AVX512_BF16's pairs (and for the amx path AMX tiles)")
    baseline = kernel_builds(args.baseline).get("baseline")
    clock = time.process_time if args.threads == 1 else time.perf_counter
    print(f"threads {args.threads}, {args.cold_mb} MB of weights per shape, median of {args.rounds} interleaved rounds, "
          f"{'process CPU time' if args.threads == 1 else 'wall'}")
    shapes = NAMED_SHAPES.get(args.shapes) or [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    for n, k in shapes:
        copies = max(2, args.cold_mb * 2**20 // (n * k * 2))
        packed = [with_pairs(torch.randn(n, k).to(torch.bfloat16), kernels) for _ in range(copies)]
        weight_gb = n * k * 2 / 1e9
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k).to(torch.bfloat16)
            gflop = 2 * rows * n * k / 1e9
            calls = max(2, min(copies, int(args.round_gflop / gflop)))
            x_pad = torch.nn.functional.pad(x, (0, 0, 0, onednn_rows(rows) - rows))
            onednn = lambda p: torch.ops.mkldnn._linear_pointwise(x_pad, p.packed, None, "none", [], "")  # noqa: E731
            tiles = lambda p: amx.linear(x, p.interleaved, args.threads)  # noqa: E731
            pairs = lambda p: kernels.interleaved_linear(x, p.interleaved, args.threads)  # noqa: E731
            pgemm = lambda p: kernels.bind_pairs_gemm(p.interleaved)(x, args.threads)  # noqa: E731
            paths = {name: fn for name, fn in {"onednn": onednn, "amx": tiles, "pairs": pairs, "pgemm": pgemm}.items() if name in args.paths.split(",")}
            if baseline is not None:
                old = {"pairs": lambda p: baseline.interleaved_linear(x, p.interleaved, args.threads),
                       "pgemm": lambda p: baseline.bind_pairs_gemm(p.interleaved)(x, args.threads)}
                paths.update({f"old-{name}": fn for name, fn in old.items() if name in paths})
            times = {name: [] for name in paths}
            for fn in paths.values():  # warm-up: primitives created, pages touched
                fn(packed[0])
            for _ in range(args.rounds):
                for name, fn in paths.items():
                    times[name].append(time_per_call_us(fn, packed, calls, clock))
            med = {name: statistics.median(t) for name, t in times.items()}
            cells = "  ".join(f"{name} {us:8.1f} us ({weight_gb / us * 1e6:5.1f} GB/s, {gflop / us * 1e6:5.0f} GFLOP/s)" for name, us in med.items())
            ratios = "  ".join(f"onednn/{name} {med['onednn'] / med[name]:.2f}" for name in ("amx", "pgemm") if name in med and "onednn" in med)
            ratios += "".join(f"  {name}/old {med[name] / med[f'old-{name}']:.3f}" for name in ("pairs", "pgemm") if f"old-{name}" in med)
            print(f"[{n}x{k}] rows {rows:4d}: {cells}  {ratios}", flush=True)
        del packed


if __name__ == "__main__":
    main()
