"""ctypes entry points over engine/kernels/csrc/quant_kernels.c (low-bit linears and dequantizers).

Built and cached like every kernel library (engine.kernels.build, QUANT_KERNELS: prebuilt per
x86-64 level in the image, else the system C compiler, -march=native, a cache dir keyed by sources,
flags, compiler and CPU). None where it cannot be loaded: engine.quant.linear then runs its torch
path, which computes the same numbers. Weights are engine.quant.formats' QuantizedWeight, told apart
by their `format` name: this module sits below engine.quant and imports it for type hints only.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.kernels.build import QUANT_KERNELS, library_path
from engine.kernels.cpu import check_kernel

if TYPE_CHECKING:
    from engine.quant.formats import QuantizedWeight

log = logging.getLogger(__name__)

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_p, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
FORMAT_CODES = {"int8": 0, "int4": 1, "fp8": 2, "q4_k": 3, "q5_k": 4, "q6_k": 5}  # QuantizedWeight.format -> quant_kernels.c's FMT_*
K_QUANT_FORMATS = ("q4_k", "q5_k", "q6_k")  # GGUF super-blocks as stored (engine.quant.kquants): no scale tensors


class _QuantWeightDesc(ctypes.Structure):
    """quant_kernels.c's quant_weight: one weight's pointers and sizes, filled once."""

    _fields_ = [("w", _p), ("scales", _p), ("mins", _p), ("n", _i64), ("k", _i64), ("group", _i64), ("fmt", ctypes.c_int32), ("scales_f16", ctypes.c_int32)]


SIGNATURES = {
    # weight desc, bf16, x, rows, out, threads
    "quant_linear": ((ctypes.POINTER(_QuantWeightDesc), _i32, _p, _i64, _p, _i32), _i32),
    # w, scales, scales_f16, n, k, group, row0, row1, bf16, out, threads
    "int8_dequantize": ((_p, _p, _i32, _i64, _i64, _i64, _i64, _i64, _i32, _p, _i32), None),
    # w, scales, mins, n, k, group, row0, row1, bf16, out, threads
    "int4_dequantize": ((_p, _p, _p, _i64, _i64, _i64, _i64, _i64, _i32, _p, _i32), None),
    # w, scales, n, k, group, row0, row1, bf16, out, threads
    "fp8_dequantize": ((_p, _p, _i64, _i64, _i64, _i64, _i64, _i32, _p, _i32), None),
    # blocks, fmt, n, k, row0, row1, bf16, out, threads
    "kquant_dequantize": ((_p, _i32, _i64, _i64, _i64, _i64, _i32, _p, _i32), None),
    # n: the next n allocations succeed, every later one fails (a test hook; n < 0: none fails, the default)
    "llamaserve_fail_allocs_after": ((_i64,), None),
    # the vector width the build's int8 / int4 / fp8 code uses: 512 (AVX-512), 256 (AVX2) or 128 (portable)
    "quant_kernels_simd_bits": ((), _i32),
}


def supports(dtype: torch.dtype) -> bool:
    return dtype in _DTYPE_CODES


class QuantKernels:
    """Typed calls; weights must be contiguous (QuantizedWeight.contiguous()), x [rows, in] contiguous."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, (argtypes, restype) in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        self._lib = lib

    @property
    def simd_bits(self) -> int:
        """The vector width of this build's int8 / int4 / fp8 code: 512 (AVX-512 intrinsics), 256 (AVX2)
        or 128 (portable loops); engine.quant.linear's path cutoffs depend on it."""
        return self._lib.quant_kernels_simd_bits()

    def fail_allocs_after(self, num_allocs: int) -> None:
        """Test hook: the library's next num_allocs allocations succeed and every later one fails
        (quantized linears then raise MemoryError); a negative count restores the default, none fails."""
        self._lib.llamaserve_fail_allocs_after(num_allocs)

    def linear(self, x: torch.Tensor, weight: QuantizedWeight, threads: int) -> torch.Tensor:
        """x [rows, in] @ dequantize(weight)^T -> [rows, out] in x's dtype."""
        return self.bind(weight)(x, threads)

    def bind(self, weight: QuantizedWeight) -> "BoundQuantLinear":
        """The kernel call for one weight with its pointers and sizes fixed (QuantLinear binds once)."""
        _check_contiguous(weight)
        if getattr(weight, "format", None) not in FORMAT_CODES:
            raise TypeError(f"no kernel for {type(weight).__name__}")
        return BoundQuantLinear(self._lib.quant_linear, weight)

    def linear_address(self) -> int:
        """quant_linear as a C function address (engine/kernels/csrc/decode_step.c calls it with a bound
        descriptor, BoundQuantLinear.descriptor_address)."""
        return ctypes.cast(self._lib.quant_linear, ctypes.c_void_p).value

    def dequantize(self, weight: QuantizedWeight, row0: int, row1: int, out: torch.Tensor, threads: int) -> torch.Tensor:
        """Rows [row0, row1) of dequantize(weight) written into out (contiguous [row1 - row0, in],
        float32 or bfloat16); returns out."""
        n, k = weight.shape
        if not (0 <= row0 <= row1 <= n) or out.shape != (row1 - row0, k) or not out.is_contiguous():
            raise ValueError(f"dequantize rows [{row0}, {row1}) of a [{n}, {k}] weight into {list(out.shape)}")
        _check_contiguous(weight)
        code, wp, sp = _DTYPE_CODES[out.dtype], weight.qweight.data_ptr(), weight.scales.data_ptr()
        if weight.format == "int4":
            mins = None if weight.mins is None else weight.mins.data_ptr()
            self._lib.int4_dequantize(wp, sp, mins, n, k, weight.group_size, row0, row1, code, out.data_ptr(), threads)
        elif weight.format == "int8":
            f16 = int(weight.scales.dtype == torch.float16)
            self._lib.int8_dequantize(wp, sp, f16, n, k, weight.group_size, row0, row1, code, out.data_ptr(), threads)
        elif weight.format == "fp8":
            self._lib.fp8_dequantize(wp, sp, n, k, weight.group_size, row0, row1, code, out.data_ptr(), threads)
        elif weight.format in K_QUANT_FORMATS:
            self._lib.kquant_dequantize(wp, FORMAT_CODES[weight.format], n, k, row0, row1, code, out.data_ptr(), threads)
        else:
            raise TypeError(f"no kernel for {type(weight).__name__}")
        return out


class BoundQuantLinear:
    """x [rows, in] -> x @ dequantize(weight)^T [rows, out] in x's dtype, through the C kernel. Holds
    the weight (its tensors must outlive the pointers in the descriptor)."""

    def __init__(self, fn, weight: QuantizedWeight) -> None:
        self._fn, self._weight = fn, weight
        self.out_features, self.in_features = weight.shape
        mins = getattr(weight, "mins", None)
        self._desc = _QuantWeightDesc(
            weight.qweight.data_ptr(), weight.scales.data_ptr(), None if mins is None else mins.data_ptr(),
            self.out_features, self.in_features, weight.group_size, FORMAT_CODES[weight.format],
            int(weight.scales.dtype == torch.float16),
        )  # fmt: skip
        self._desc_ref = ctypes.byref(self._desc)

    @property
    def descriptor_address(self) -> int:
        """The bound quant_weight descriptor's address; valid while this object lives."""
        return ctypes.addressof(self._desc)

    def __call__(self, x: torch.Tensor, threads: int) -> torch.Tensor:
        k = self.in_features
        if x.dim() != 2 or x.shape[1] != k or not x.is_contiguous() or x.dtype not in _DTYPE_CODES:
            raise ValueError(f"quantized linear takes contiguous float32/bfloat16 x [rows, {k}], got {x.dtype} {list(x.shape)}")
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        if failed := self._fn(self._desc_ref, _DTYPE_CODES[x.dtype], x.data_ptr(), x.shape[0], out.data_ptr(), threads):
            check_kernel(failed, f"quantized linear of {x.shape[0]}x{k}")
        return out


def _check_contiguous(weight: QuantizedWeight) -> None:
    """The C code walks the codes and scales as dense row-major arrays."""
    if not all(t.is_contiguous() for t in weight.tensors().values()):
        raise ValueError(f"{weight.format} weight tensors must be contiguous (QuantizedWeight.contiguous())")


@functools.cache
def load_quant_kernels(cache_dir: Path | None = None) -> QuantKernels | None:
    """The kernels, built on first use; None (logged once) where they cannot be built here."""
    try:
        return QuantKernels(ctypes.CDLL(str(library_path(QUANT_KERNELS, cache_dir))))
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        log.warning("quantized-linear C kernels unavailable (%s); using the torch path", exc)
        return None
