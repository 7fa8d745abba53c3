"""Fused CPU kernels (engine/csrc/cpu_kernels.c): built once per machine, loaded with ctypes.

Why: at decode batch sizes a small model's step on CPU is its matmuls plus hundreds of tiny torch
ops (RMSNorm alone is six), each costing microseconds of dispatch, and paged attention through
torch must gather every sequence's blocks into a padded copy before SDPA. The C file does each of
those in one call with no intermediate tensors, and reads K/V in place through the block tables.

Built with the system C compiler (`$CC`, else `cc`) at first use into a cache dir keyed by the
source, the flags, the compiler and this CPU's flags (`-march=native`), atomically, so parallel
processes can race. No compiler, a failed build or an unsupported dtype: the model runs its torch
path, which computes the same thing (tests check the two agree). The library links the libgomp
torch already loaded, so its parallel loops share the calling thread's OpenMP team.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.c"
CACHE_DIR_ENV = "LLAMASERVE_KERNEL_CACHE_DIR"
# -fassociative-math (with the two flags it needs) lets reductions such as dot products end in a
# vector add tree instead of 16 dependent scalar adds; -fno-math-errno keeps sqrtf inline.
_FLAGS = (
    "-O3", "-march=native", "-fopenmp", "-std=gnu11", "-shared", "-fPIC",
    "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-fno-math-errno",
)  # fmt: skip
_BUILD_TIMEOUT_S = 300
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    # dtype, residual, delta, weight, out, rows, dim, eps, threads
    "add_rms_norm": (_i32, _p, _p, _p, _p, _i64, _i64, _f32, _i32),
    # dtype, gate_up, out, rows, hidden, threads
    "silu_mul": (_i32, _p, _p, _i64, _i64, _i32),
    # dtype, qkv, tokens, heads, kv_heads, head_dim, positions, rope, slots, k_cache, v_cache, threads
    "rope_and_cache_write": (_i32, _p, _i64, _i64, _i64, _i64, _p, _p, _p, _p, _p, _i32),
    # dtype, q, q_stride, out, rows, k_cache, v_cache, block_tables, max_blocks, seq_lens, num_seqs,
    # heads, kv_heads, head_dim, block_size, scale, threads
    "paged_decode_attention": (_i32, _p, _i64, _p, _p, _p, _p, _p, _i64, _p, _i64, _i64, _i64, _i64, _i64, _f32, _i32),
    # dtype, x, weight (interleaved), out, rows, n, k, threads
    "interleaved_linear": (_i32, _p, _p, _p, _i64, _i64, _i64, _i32),
}


def supports(dtype: torch.dtype) -> bool:
    return dtype in _DTYPE_CODES


class CpuKernels:
    """Typed entry points over the loaded library. Every tensor must be contiguous in its rows as
    documented in the C file; the caller (engine.model) owns those layouts."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
        self._lib = lib

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor, eps: float, threads: int) -> None:
        """residual += delta (in place, if given); out = rms_norm(residual) * weight."""
        rows, dim = residual.shape
        self._lib.add_rms_norm(
            _DTYPE_CODES[residual.dtype], residual.data_ptr(), None if delta is None else delta.data_ptr(),
            weight.data_ptr(), out.data_ptr(), rows, dim, eps, threads,
        )  # fmt: skip

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor, threads: int) -> None:
        """out [rows, hidden] = silu(gate_up[:, :hidden]) * gate_up[:, hidden:]."""
        rows, hidden = out.shape
        self._lib.silu_mul(_DTYPE_CODES[out.dtype], gate_up.data_ptr(), out.data_ptr(), rows, hidden, threads)

    def rope_and_cache_write(
        self, qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, positions: torch.Tensor,
        rope: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, threads: int,
    ) -> None:  # fmt: skip
        """Rotate qkv's q and k heads in place (rope: [max_pos, head_dim / 2, 2] float32 cos, sin)
        and copy each token's k and v to its cache slot."""
        self._lib.rope_and_cache_write(
            _DTYPE_CODES[qkv.dtype], qkv.data_ptr(), qkv.shape[0], heads, kv_heads, head_dim, positions.data_ptr(),
            rope.data_ptr(), slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), threads,
        )  # fmt: skip

    def paged_decode_attention(
        self, qkv: torch.Tensor, out: torch.Tensor, rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        block_tables: torch.Tensor, seq_lens: torch.Tensor, heads: int, kv_heads: int, scale: float, threads: int,
    ) -> None:  # fmt: skip
        """out[rows[b]] = attention of qkv[rows[b]]'s query heads over sequence b's cached K/V
        (block_tables [num_seqs, max_blocks] int32, seq_lens [num_seqs] int32)."""
        _, block_size, _, head_dim = k_cache.shape
        self._lib.paged_decode_attention(
            _DTYPE_CODES[qkv.dtype], qkv.data_ptr(), qkv.shape[1], out.data_ptr(), rows.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(), rows.shape[0],
            heads, kv_heads, head_dim, block_size, scale, threads,
        )  # fmt: skip

    @staticmethod
    def interleave(weight: torch.Tensor) -> torch.Tensor:
        """[n, k] -> [n / 16, k, 16], the layout interleaved_linear reads (n a multiple of 16)."""
        n, k = weight.shape
        return weight.detach().view(n // 16, 16, k).transpose(1, 2).contiguous()

    def interleaved_linear(self, x: torch.Tensor, weight: torch.Tensor, threads: int) -> torch.Tensor:
        """x [rows, k] @ W^T with W as interleave() made it: [rows, n]."""
        rows, k = x.shape
        out = torch.empty(rows, weight.shape[0] * 16, dtype=x.dtype)
        self._lib.interleaved_linear(_DTYPE_CODES[x.dtype], x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, out.shape[1], k, threads)
        return out


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or "~/.cache/llamaserve/kernels").expanduser()


@functools.cache
def load_cpu_kernels(cache_dir: Path | None = None) -> CpuKernels | None:
    """The kernels, built on first use; None (logged once) where they cannot be built here."""
    try:
        return CpuKernels(ctypes.CDLL(str(_build(cache_dir or default_cache_dir()))))
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        log.warning("fused CPU kernels unavailable (%s); using the torch path", exc)
        return None


def _compiler() -> str:
    return os.environ.get("CC") or "cc"


def _build_key(compiler: str, source: Path = SOURCE) -> str:
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):  # what the sources #include
        digest.update(header.read_bytes())
    digest.update(" ".join((compiler, *_FLAGS)).encode())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    digest.update(version.encode())
    digest.update(_cpu_flags().encode())  # -march=native code only runs on this kind of CPU
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


def _build(cache_dir: Path, source: Path = SOURCE) -> Path:
    """Compile `source` (a C file in engine/csrc; engine.quant.kernels builds a second one) into
    the cache dir once per source, flags, compiler and CPU; the path of the shared library."""
    compiler = _compiler()
    target = cache_dir / f"{source.stem}-{_build_key(compiler, source)}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *_FLAGS, "-o", str(built), str(source)], capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S
        )
        if result.returncode != 0:
            raise OSError(f"{compiler} failed on {source.name}: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: a racing process sees the whole file or none
    log.info("built %s into %s", source.name, target)
    return target
