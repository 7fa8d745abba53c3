"""ctypes entry point over engine/kernels/csrc/amx_linear.c: bfloat16 linears on Intel AMX tiles for decode
batches of many streams, and for prefill chunks of weights that keep no oneDNN copy (the C side
picks a blocked loop for those sizes itself).

The weight is the bfloat16 pairs copy CpuKernels.interleave already makes ([n / 16, k / 2, 16, 2]),
which is the AMX B-tile layout as it stands: no further copy. Built and cached like every kernel
library (engine.kernels.build, AMX_LINEAR); the source compiles at every x86-64 level and the kernel
runs only where amx_init() finds AMX-BF16 and Linux grants the tile state. None where it cannot
run: PackedCpuLinear then keeps oneDNN.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

from engine.kernels.build import AMX_LINEAR, library_path
from engine.kernels.cpu import check_kernel

log = logging.getLogger(__name__)

# the kernel's tile sizes: k a multiple of K_STEP, n of 16
K_STEP = 32
_p, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class AmxLinear:
    """amx_linear_bf16 (and its float32-out twin) over pairs-layout weights; x [rows, k] bfloat16 contiguous."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn, self._fn_f32_out = lib.amx_linear_bf16, lib.amx_linear_bf16_f32_out
        for fn in (self._fn, self._fn_f32_out):
            fn.argtypes, fn.restype = (_p, _p, _p, _i64, _i64, _i64, _i32), _i32
        self._fail_allocs_after = lib.llamaserve_fail_allocs_after
        self._fail_allocs_after.argtypes, self._fail_allocs_after.restype = (_i64,), None

    def fail_allocs_after(self, num_allocs: int) -> None:
        """Test hook: the library's next num_allocs allocations succeed and every later one fails
        (its linears then raise MemoryError); a negative count restores the default, none fails."""
        self._fail_allocs_after(num_allocs)

    def address(self) -> int:
        """amx_linear_bf16 as a C function address (engine/kernels/csrc/decode_step.c calls it through this)."""
        return ctypes.cast(self._fn, ctypes.c_void_p).value

    @staticmethod
    def supports(pairs: torch.Tensor) -> bool:
        """Whether the kernel takes this weight: a bfloat16 pairs copy with k a multiple of K_STEP."""
        return pairs.dtype == torch.bfloat16 and pairs.dim() == 4 and pairs.shape[1] * 2 % K_STEP == 0 and pairs.is_contiguous()

    def linear(self, x: torch.Tensor, pairs: torch.Tensor, threads: int) -> torch.Tensor:
        return self.bind(pairs)(x, threads)

    def bind(self, pairs: torch.Tensor, *, f32_out: bool = False) -> Callable[[torch.Tensor, int], torch.Tensor]:
        """y = x @ W^T for one weight (pairs: [n / 16, k / 2, 16, 2], AmxLinear.supports), its sizes
        and pointer looked up once; f32_out: y the tiles' float32 sums (the output head's logits),
        else rounded to bfloat16. Either way a row's sums do not depend on the other rows."""
        if not self.supports(pairs):
            raise ValueError(f"AMX linear needs a contiguous bfloat16 pairs weight with k a multiple of {K_STEP}")
        n, k, weight_ptr = pairs.shape[0] * 16, pairs.shape[1] * 2, pairs.data_ptr()
        fn, out_dtype = (self._fn_f32_out, torch.float32) if f32_out else (self._fn, torch.bfloat16)

        def many_rows(x: torch.Tensor, threads: int) -> torch.Tensor:
            rows = x.shape[0]
            if x.dtype != torch.bfloat16 or x.shape[1] != k or not x.is_contiguous():
                raise ValueError(f"AMX linear input must be contiguous bfloat16 [rows, {k}], got {x.dtype} {tuple(x.shape)}")
            out = torch.empty(rows, n, dtype=out_dtype)
            if rows == 0:  # a step that samples no row (a long prompt's earlier chunks): the kernel takes 1+
                return out
            if failed := fn(x.data_ptr(), weight_ptr, out.data_ptr(), rows, n, k, threads):
                check_kernel(failed, "amx_linear_bf16")  # MemoryError, or RuntimeError: arguments refused
            return out

        many_rows.weight = pairs  # the pointer's owner lives as long as the call
        return many_rows


@functools.cache
def load_amx_linear(cache_dir: Path | None = None) -> AmxLinear | None:
    """The kernel where this CPU and OS run AMX bfloat16 tiles; None (logged once) elsewhere."""
    try:
        lib = ctypes.CDLL(str(library_path(AMX_LINEAR, cache_dir)))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("AMX linear kernel unavailable (%s); bfloat16 linears stay on oneDNN", exc)
        return None
    lib.amx_init.restype = _i32
    if not lib.amx_init():
        log.info("no AMX bfloat16 tiles on this CPU/OS; bfloat16 rows stay on oneDNN, or with AVX512_BF16 up to 64 on the pairs gemm (linear.c)")
        return None
    return AmxLinear(lib)
