"""Per-call time of the quantized linears (engine/quant) against float linears, per path and batch.

For each weight shape (out x in), activation dtype and batch size (input rows) it prints the time
of one call of every available path: float F.linear and oneDNN-packed (the current float fast
path), then per format (int8, int4, fp8) our C kernel (`kernel`), dequantize-tiles + torch.mm
(`dequant_mm`), torch's int8 op where it applies (`aten_int8`), torch's own CPU int4 op on its own
packed layout (`aten_int4`, measured for comparison only: engine.quant does not store that
layout) and the path QuantLinear picks (`auto`). Also the weight bytes per format, and GB/s of the
weight stream at batch 1.

Times are a low percentile (the 10th) of single calls, which is robust to a shared, loaded machine
but still noisy there: say so when quoting them.

    python bench/quant_linear.py                      # demo-model shapes + 2048x8192, float32 and bfloat16
    python bench/quant_linear.py --shapes 1536x576 --dtypes bfloat16 --batches 1 8 --threads 1
    python bench/quant_linear.py --library /tmp/old/quant_kernels.so ...   # another build of quant_kernels.c
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from engine.quant.formats import Int4Weight, quantize
from engine.kernels.quant import QuantKernels, load_quant_kernels
from engine.quant.linear import QuantLinear

# SmolLM2-135M (the demo): wq/wo 576x576, wk/wv 192x576, w1/w3 1536x576, w2 576x1536, fused wqkv 960x576
DEFAULT_SHAPES = ("576x576", "1536x576", "576x1536", "3072x576", "2048x8192", "8192x2048")


def per_call_us(fn: Callable[[], object], max_calls: int = 200, budget_s: float = 0.4) -> float:
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < max_calls and time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 10] * 1e6


def _aten_int4(weight: Int4Weight, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """torch's CPU int4 weight-only op on the same codes (its layout; its scales in x's dtype)."""
    if weight.mins is None or weight.out_features % 64 or weight.group_size not in (32, 64, 128, 256):
        return None
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.codes().to(torch.int32), 1)
    scales = weight.scales.float()
    zeros = weight.mins.float() + 8 * scales  # its dequantization: (q - 8) * scale + zero
    scale_zeros = torch.stack([scales, zeros], -1).transpose(0, 1).contiguous().to(dtype)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, weight.group_size, scale_zeros)


def bench_shape(out_features: int, in_features: int, dtype: torch.dtype, batches: list[int], kernels) -> None:
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features) * 0.02
    dense = weight.to(dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(dense, 16) if torch.backends.mkldnn.is_available() else None
    except RuntimeError:  # bfloat16 on CPUs without AVX-512 or AVX-NE-CONVERT (Zen 2): oneDNN has no packed bf16 path
        packed = None
    layers = {fmt: QuantLinear(quantize(weight, fmt), kernels) for fmt in ("int8", "int4", "fp8")}
    aten_int4 = _aten_int4(layers["int4"].weight_q, dtype)
    float_bytes = dense.numel() * dense.element_size()
    sizes = ", ".join(f"{fmt} {layer.resident_bytes() / 2**20:.2f}" for fmt, layer in layers.items())
    print(f"\n{out_features}x{in_features} {str(dtype).removeprefix('torch.')}: MiB float {float_bytes / 2**20:.2f}, {sizes}")
    for rows in batches:
        x = torch.randn(rows, in_features).to(dtype)
        results = {"F.linear": per_call_us(lambda: F.linear(x, dense))}
        if packed is not None:
            results["onednn"] = per_call_us(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
        line = "  ".join(f"{k} {v:.0f}" for k, v in results.items())
        print(f"  batch {rows:3d}  float: {line}  (us)")
        for fmt, layer in layers.items():
            paths = ["kernel", "dequant_mm"] if kernels is not None else ["torch"]
            if layer._aten_scales is not None and dtype == torch.bfloat16:
                paths.append("aten_int8")
            timings = {p: per_call_us(lambda p=p: layer.run(x, p)) for p in paths}
            if fmt == "int4" and aten_int4 is not None:
                timings["aten_int4"] = per_call_us(lambda: aten_int4(x))
            auto = layer.path(rows, dtype)
            text = "  ".join(f"{p} {t:.0f}" for p, t in timings.items())
            stream = f"  weight stream {layer.resident_bytes() / timings[auto] / 1e3:.1f} GB/s" if rows == 1 else ""
            print(f"             {fmt:5s}: {text}  -> auto={auto}{stream}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="OUTxIN weight shapes")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32], help="input rows per call")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch / OpenMP threads")
    parser.add_argument("--library", help="load the quant kernels from this shared object (a before/after comparison of a kernel change)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = QuantKernels(ctypes.CDLL(args.library)) if args.library else load_quant_kernels()
    print(f"threads {args.threads}; C kernels: {'built' if kernels else 'unavailable (torch path)'}; "
          f"times: 10th percentile of single calls, microseconds")  # fmt: skip
    for dtype_name in args.dtypes:
        for shape in args.shapes:
            out_features, in_features = (int(n) for n in shape.lower().split("x"))
            bench_shape(out_features, in_features, getattr(torch, dtype_name), args.batches, kernels)


if __name__ == "__main__":
    main()
