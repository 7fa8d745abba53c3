"""Bit for bit against another build: the bfloat16 pairs kernels (linear.c's one-row kernel with
bfloat16 and float32 out, the output head's; and the pairs gemm) of this tree's cpu_kernels and of
OLD.so, on many shapes, row counts and both thread counts (a script, not a test: it proves that a
change meant to keep every sum's order, such as a prefetch, kept it). Exits 1 at the first
difference. Needs a CPU with AVX512_BF16.

    PYTHONPATH=. python bench/pairs_bits.py --baseline OLD.so
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import kernel_builds  # noqa: E402

OUTS = (640, 576, 960, 1536, 3072, 4096, 16, 48, 64, 96)  # n: whole panels, one or more panel groups per thread
INS = (2, 14, 16, 18, 62, 64, 66, 130, 576, 1536)  # k: even; tails of the 8-pair rounds, one round, none
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 16, 17, 23, 32, 33, 48, 64, 65, 100)
HEAD = (49152, 576)  # the demo's output head, at a few row counts


def results(lib, x: torch.Tensor, pairs: torch.Tensor, threads: int) -> list[torch.Tensor]:
    """Every pairs kernel's output for x, as integers (NaN-safe exact comparison)."""
    return [
        lib.interleaved_linear(x, pairs, threads, f32_out=True).view(torch.int32),
        lib.interleaved_linear(x, pairs, threads).view(torch.int16),
        lib.bind_pairs_gemm(pairs)(x, threads).view(torch.int16),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, required=True, help="another build of the cpu_kernels library (.so)")
    opts = parser.parse_args()
    libs = kernel_builds(opts.baseline)
    ours, old = libs["ours"], libs["baseline"]
    if not ours.has_bf16_pairs:
        sys.exit("this build has no pairs kernels (no AVX512_BF16)")
    gen = torch.Generator().manual_seed(1)
    cases = [(n, k, ROWS) for n in OUTS for k in INS] + [(*HEAD, (1, 3, 4, 8, 31, 32, 64))]
    compared = 0
    for n, k, rows_list in cases:
        pairs = ours.interleave(torch.randn(n, k, generator=gen).to(torch.bfloat16))
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
            for threads in (1, 2):
                for kernel, (a, b) in enumerate(zip(results(ours, x, pairs, threads), results(old, x, pairs, threads))):
                    if not torch.equal(a, b):
                        sys.exit(f"kernel {kernel} differs: n {n}, k {k}, rows {rows}, threads {threads}")
                    compared += 1
    print(f"identical bits in {compared} calls")


if __name__ == "__main__":
    main()
