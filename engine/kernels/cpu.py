"""Fused CPU kernels (engine/kernels/csrc/cpu_kernels.c): built once per machine, loaded with ctypes.

Why: at decode batch sizes a small model's step on CPU is its matmuls plus hundreds of tiny torch
ops (RMSNorm alone is six), each costing microseconds of dispatch, and paged attention through
torch must gather every sequence's blocks into a padded copy before SDPA. The C file does each of
those in one call with no intermediate tensors, and reads K/V in place through the block tables.

Built with the system C compiler (`$CC`, else `cc`) at first use into a cache dir keyed by the
source, the flags, the compiler and this CPU's feature line (`-march=native`), atomically, so
parallel processes can race. The cache dir is made 0700; a dir or library that another user owns
or that others may write is refused (the torch path runs instead). No compiler, a failed build or an unsupported dtype: the model runs its torch
path, which computes the same thing (tests check the two agree). The library links the libgomp
torch already loaded, so its parallel loops share the calling thread's OpenMP team.

Prebuilt (the container image): `python -m engine.kernels.cpu prebuild DIR` compiles every engine/kernels/csrc source
once per x86-64 microarchitecture level (v2: SSE4.2, v3: AVX2+FMA, v4: AVX-512; and v4-bf16, AVX-512
with AVX512_BF16, for the bfloat16 pairs and int4 x bf16 kernels) and LLAMASERVE_PREBUILT_KERNELS=DIR makes the loader take the highest level this CPU's flags allow,
so the image needs no compiler. Measured here (Xeon with AVX-512, a decode step of the 'tiny'
config, one thread): the v4 build ran within noise of -march=native.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.c"
CACHE_DIR_ENV = "LLAMASERVE_KERNEL_CACHE_DIR"
PREBUILT_DIR_ENV = "LLAMASERVE_PREBUILT_KERNELS"
# /proc/cpuinfo flags each x86-64 psABI level needs beyond the one before (lzcnt shows as abm)
X86_LEVELS: dict[str, frozenset[str]] = {
    "x86-64-v2": frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}),
    "x86-64-v3": frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}),
    "x86-64-v4": frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    # not a psABI level: v4 plus AVX512_BF16 (Cooper Lake, Sapphire Rapids and later, Zen 4), whose
    # vdpbf16ps the bfloat16 one-row linears and the int4 x bf16 dots use (bench/NOTES.md)
    "x86-64-v4-bf16": frozenset({"avx512_bf16"}),
}
# what each level compiles with in place of -march=native (default: -march=LEVEL)
LEVEL_MARCH: dict[str, tuple[str, ...]] = {"x86-64-v4-bf16": ("-march=x86-64-v4", "-mavx512bf16")}
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
    # dtype, qkv, q_stride, out, row_start, new_tokens, seq_lens, block_tables, max_blocks, num_seqs,
    # k_cache, v_cache, heads, kv_heads, head_dim, block_size, scale, threads
    "paged_attention": (_i32, _p, _i64, _p, _p, _p, _p, _p, _i64, _i64, _p, _p, _i64, _i64, _i64, _i64, _f32, _i32),
    # dtype, x, rows, cols, row_stride, ids (int64), values (float32), threads
    "argmax_rows": (_i32, _p, _i64, _i64, _i64, _p, _p, _i32),
}


def supports(dtype: torch.dtype) -> bool:
    return dtype in _DTYPE_CODES


class CpuKernels:
    """Typed entry points over the loaded library. Every tensor must be contiguous in its rows as
    documented in the C file; the caller (engine.models.llama) owns those layouts."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
        self._lib = lib
        # built for a CPU with AVX512_BF16 (-march=native there): bfloat16 one-row linears in pairs
        self._bf16_pairs = getattr(lib, "interleaved_linear_bf16_pairs", None)
        if self._bf16_pairs is not None:
            self._bf16_pairs.argtypes, self._bf16_pairs.restype = (_p, _p, _p, _i64, _i64, _i64, _i32), None
        self._lib.paged_attention_on_tiles.argtypes = (_i32, _i64, _i64)  # dtype, head_dim, block_size
        self._lib.paged_attention_on_tiles.restype = ctypes.c_int

    def address(self, name: str) -> int | None:
        """The entry point `name` as a C function address (engine/kernels/csrc/decode_step.c calls the
        kernels through these); None if this build has no such function."""
        fn = getattr(self._lib, name, None)
        return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value

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

    def argmax_rows(self, x: torch.Tensor, threads: int) -> tuple[list[int], list[float]]:
        """Each row's first largest index and its value, as numpy's argmax on x.float() (NaN wins):
        x [rows, cols > 0] with contiguous rows."""
        rows, cols = x.shape
        ids, values = torch.empty(rows, dtype=torch.int64), torch.empty(rows, dtype=torch.float32)
        self._lib.argmax_rows(
            _DTYPE_CODES[x.dtype], x.data_ptr(), rows, cols, x.stride(0), ids.data_ptr(), values.data_ptr(), threads
        )  # fmt: skip
        return ids.tolist(), values.tolist()

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

    def paged_attention(
        self, qkv: torch.Tensor, out: torch.Tensor, row_start: torch.Tensor, new_tokens: torch.Tensor, seq_lens: torch.Tensor,
        block_tables: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int, scale: float,
        threads: int,
    ) -> None:  # fmt: skip
        """out[row_start[b] : row_start[b] + new_tokens[b]] = causal attention of qkv's query heads on
        those rows (the last new_tokens[b] of sequence b's seq_lens[b] keys) over its cached K/V:
        prefill chunks (with or without a cached prefix) and decodes alike; other rows untouched.
        row_start, new_tokens, seq_lens [num_seqs] and block_tables [num_seqs, max_blocks] int32;
        head_dim a multiple of 16."""
        _, block_size, _, head_dim = k_cache.shape
        self._lib.paged_attention(
            _DTYPE_CODES[qkv.dtype], qkv.data_ptr(), qkv.shape[1], out.data_ptr(), row_start.data_ptr(), new_tokens.data_ptr(),
            seq_lens.data_ptr(), block_tables.data_ptr(), block_tables.shape[1], seq_lens.shape[0], k_cache.data_ptr(),
            v_cache.data_ptr(), heads, kv_heads, head_dim, block_size, scale, threads,
        )  # fmt: skip

    def paged_attention_on_tiles(self, dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
        """Whether paged_attention runs on AMX tiles for caches of this dtype, head_dim and block size
        here (bfloat16, head_dim a multiple of 64, blocks a multiple of 16 keys, a CPU and OS that
        grant AMX): then it also beats torch's SDPA on prefill chunks."""
        return dtype in _DTYPE_CODES and bool(self._lib.paged_attention_on_tiles(_DTYPE_CODES[dtype], head_dim, block_size))

    def interleave(self, weight: torch.Tensor) -> torch.Tensor:
        """[n, k] -> [n / 16, k, 16], the layout interleaved_linear reads (n a multiple of 16); bfloat16
        with even k where the library has the AVX512_BF16 kernel: [n / 16, k / 2, 16, 2] (pairs of
        columns side by side, what vdpbf16ps multiplies)."""
        n, k = weight.shape
        if weight.dtype == torch.bfloat16 and k % 2 == 0 and self._bf16_pairs is not None:
            return weight.detach().view(n // 16, 16, k // 2, 2).transpose(1, 2).contiguous()
        return weight.detach().view(n // 16, 16, k).transpose(1, 2).contiguous()

    def interleaved_linear(self, x: torch.Tensor, weight: torch.Tensor, threads: int) -> torch.Tensor:
        """x [rows, k] @ W^T with W as interleave() made it: [rows, n]."""
        return self.bind_interleaved(weight)(x, threads)

    def bind_interleaved(self, weight: torch.Tensor) -> Callable[[torch.Tensor, int], torch.Tensor]:
        """interleaved_linear for one weight, its sizes and pointer looked up once: a decode step
        makes four such calls per layer, and each Python-side lookup costs about a microsecond."""
        n, weight_ptr, code = weight.shape[0] * 16, weight.data_ptr(), _DTYPE_CODES[weight.dtype]
        pairs, lib_fn = weight.dim() == 4, self._lib.interleaved_linear  # 4-D: bfloat16 pairs

        def one_row(x: torch.Tensor, threads: int) -> torch.Tensor:
            rows, k = x.shape
            out = torch.empty(rows, n, dtype=x.dtype)
            if pairs:
                self._bf16_pairs(x.data_ptr(), weight_ptr, out.data_ptr(), rows, n, k, threads)
            else:
                lib_fn(code, x.data_ptr(), weight_ptr, out.data_ptr(), rows, n, k, threads)
            return out

        one_row.weight = weight  # the pointer's owner lives as long as the call
        return one_row


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or "~/.cache/llamaserve/kernels").expanduser()


def library_path(source: Path = SOURCE, cache_dir: Path | None = None) -> Path:
    """The shared library of one engine/kernels/csrc source: prebuilt for this CPU's level when
    LLAMASERVE_PREBUILT_KERNELS holds it, else built on first use (OSError, SubprocessError if it
    cannot be)."""
    prebuilt = find_prebuilt(Path(os.environ[PREBUILT_DIR_ENV]), source) if os.environ.get(PREBUILT_DIR_ENV) else None
    return prebuilt or _build(cache_dir or default_cache_dir(), source)


@functools.cache
def load_cpu_kernels(cache_dir: Path | None = None) -> CpuKernels | None:
    """The kernels (library_path); None (logged once) where they cannot be loaded here."""
    try:
        return CpuKernels(ctypes.CDLL(str(library_path(SOURCE, cache_dir))))
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        log.warning("fused CPU kernels unavailable (%s); using the torch path", exc)
        return None


def x86_level(cpu_flags: set[str] | frozenset[str]) -> str | None:
    """The highest x86-64 level whose flags (and every lower level's) the CPU has; None below v2."""
    level, needed = None, set()
    for name, flags in X86_LEVELS.items():
        needed |= flags
        if not needed <= cpu_flags:
            break
        level = name
    return level


def _source_digest(source: Path) -> "hashlib._Hash":
    """A digest of `source` and the headers it may #include."""
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):
        digest.update(header.read_bytes())
    return digest


def _source_key(source: Path = SOURCE) -> str:
    """Prebuilt libraries are named by the source, headers and flags they came from: a stale one is never loaded."""
    digest = _source_digest(source)
    digest.update(" ".join(_FLAGS).encode())
    return digest.hexdigest()[:16]


def prebuilt_name(level: str, source: Path = SOURCE) -> str:
    return f"{source.stem}-{_source_key(source)}-{level}.so"


def all_sources() -> list[Path]:
    """Every C file the engine loads (this module's kernels, engine.kernels.quant', the compiled decode step)."""
    return sorted(SOURCE.parent.glob("*.c"))


def find_prebuilt(directory: Path, source: Path = SOURCE) -> Path | None:
    """The library of `source` in `directory` for the best level this CPU runs; None (logged) if there is none."""
    level = x86_level(set(_cpu_flags().split(":", 1)[-1].split()))
    candidates = list(X86_LEVELS)[: list(X86_LEVELS).index(level) + 1] if level else []
    for name in reversed(candidates):
        path = directory / prebuilt_name(name, source)
        if path.is_file():
            log.info("%s: prebuilt %s for this CPU (%s)", source.name, path.name, level)
            return path
    log.warning("no prebuilt %s in %s for this CPU (level %s); building it if a compiler is here", source.name, directory, level)
    return None


def prebuild(out_dir: Path, levels: list[str] | None = None, sources: list[Path] | None = None) -> list[Path]:
    """Compile one library per source (default: all_sources()) and x86-64 level into `out_dir` (the
    image's builder stage runs this)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    built = []
    for source in sources or all_sources():
        for level in levels or list(X86_LEVELS):
            march = LEVEL_MARCH.get(level, (f"-march={level}",))
            flags = [g for f in _FLAGS for g in (march if f == "-march=native" else (f,))] + ["-Wno-psabi"]  # v16f returns: static inline only
            target = out_dir / prebuilt_name(level, source)
            subprocess.run([_compiler(), *flags, "-o", str(target), str(source)], check=True, timeout=_BUILD_TIMEOUT_S)
            built.append(target)
    return built


def _compiler() -> str:
    return os.environ.get("CC") or "cc"


def _build_key(compiler: str, source: Path = SOURCE) -> str:
    digest = _source_digest(source)
    digest.update(" ".join((compiler, *_FLAGS)).encode())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    digest.update(version.encode())
    digest.update(platform.machine().encode())
    digest.update(_cpu_flags().encode())  # -march=native code only runs on this kind of CPU
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        return cpu_feature_line(Path("/proc/cpuinfo").read_text())
    except OSError:
        return ""


# The line naming the CPU's instruction-set extensions: x86 "flags", Arm "Features", RISC-V "isa".
_FEATURE_KEYS = ("flags", "Features", "isa")
_VOLATILE_KEYS = ("processor", "cpu MHz", "BogoMIPS", "bogomips", "core id", "apicid", "initial apicid")


def cpu_feature_line(cpuinfo: str) -> str:
    """What -march=native code depends on: the feature line, or on an architecture without one, the
    first processor's description without its per-core and clock fields."""
    first_block = cpuinfo.strip().split("\n\n", 1)[0].splitlines()
    for line in first_block:
        if line.split(":", 1)[0].strip() in _FEATURE_KEYS:
            return line
    return "\n".join(line for line in first_block if line.split(":", 1)[0].strip() not in _VOLATILE_KEYS)


def _check_owned_private(path: Path, what: str) -> None:
    """Refuse a cache dir or library that another user owns or that others may write: loading a
    library runs its code, so whoever can replace it can run code in the server."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise OSError(f"kernel cache {what} {path} is a symlink; refusing it")
    if st.st_uid != os.getuid():
        raise OSError(f"kernel cache {what} {path} is owned by uid {st.st_uid}, not this user; refusing it")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise OSError(f"kernel cache {what} {path} is group- or world-writable; refusing it")


def _build(cache_dir: Path, source: Path = SOURCE) -> Path:
    """Compile `source` (a C file in engine/kernels/csrc; engine.kernels.quant builds a second one) into
    the cache dir once per source, flags, compiler and CPU; the path of the shared library."""
    compiler = _compiler()
    target = cache_dir / f"{source.stem}-{_build_key(compiler, source)}.so"
    cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_owned_private(cache_dir, "dir")
    if os.path.lexists(target):
        _check_owned_private(target, "library")
        return target
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


if __name__ == "__main__":  # python -m engine.kernels.cpu prebuild DIR [LEVEL ...]
    if len(sys.argv) < 3 or sys.argv[1] != "prebuild" or any(level not in X86_LEVELS for level in sys.argv[3:]):
        sys.exit(f"usage: python -m engine.kernels.cpu prebuild DIR [{' '.join(X86_LEVELS)}]")
    for path in prebuild(Path(sys.argv[2]), sys.argv[3:] or None):
        print(path)
