"""ctypes bindings of the fused CPU kernels (the cpu_kernels library: engine/kernels/csrc/
elementwise.c, attention.c, linear.c, argmax.c, lora.c, gemm.c; engine.kernels.build builds and caches it).

Why: at decode batch sizes a small model's step on CPU is its matmuls plus hundreds of tiny torch
ops (RMSNorm alone is six), each costing microseconds of dispatch, and paged attention through
torch must gather every sequence's blocks into a padded copy before SDPA. The C files do each of
those in one call with no intermediate tensors, and read K/V in place through the block tables.
No library here (no compiler, a failed build, a refused cache) or an unsupported dtype: the model
runs its torch path, which computes the same thing (tests check the two agree).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from engine.kernels.build import CPU_KERNELS, library_path

log = logging.getLogger(__name__)

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the C side's `bf16` argument
KERNEL_NO_MEMORY = -12  # csrc/vec.h: a kernel could not allocate its scratch (its output is undefined)

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# Each entry point: (argument types, result type).
SIGNATURES: dict[str, tuple[tuple[type, ...], type | None]] = {
    # dtype, residual, delta, weight, out, rows, dim, eps, threads
    "add_rms_norm": ((_i32, _p, _p, _p, _p, _i64, _i64, _f32, _i32), None),
    # dtype, gate_up, out, rows, hidden, threads
    "silu_mul": ((_i32, _p, _p, _i64, _i64, _i32), None),
    # dtype, qkv, tokens, heads, kv_heads, head_dim, positions, rope, slots, k_cache, v_cache, threads
    "rope_and_cache_write": ((_i32, _p, _i64, _i64, _i64, _i64, _p, _p, _p, _p, _p, _i32), None),
    # dtype, q, q_stride, out, rows, k_cache, v_cache, block_tables, max_blocks, seq_lens, num_seqs,
    # heads, kv_heads, head_dim, block_size, scale, threads
    "paged_decode_attention": ((_i32, _p, _i64, _p, _p, _p, _p, _p, _i64, _p, _i64, _i64, _i64, _i64, _i64, _f32, _i32), _i32),
    # paged_decode_attention's arguments; each sequence split by its own length only (batch-invariant mode)
    "paged_decode_attention_invariant": ((_i32, _p, _i64, _p, _p, _p, _p, _p, _i64, _p, _i64, _i64, _i64, _i64, _i64, _f32, _i32), _i32),
    # dtype, x, weight (interleaved), out, rows, n, k, threads
    "interleaved_linear": ((_i32, _p, _p, _p, _i64, _i64, _i64, _i32), _i32),
    # x, weight (bfloat16 pairs), out, rows, n, k, threads: only in builds for AVX512_BF16 (BF16_PAIRS)
    "interleaved_linear_bf16_pairs": ((_p, _p, _p, _i64, _i64, _i64, _i32), None),
    # interleaved_linear with float32 out whatever the input dtype (the output head's logits)
    "interleaved_linear_f32_out": ((_i32, _p, _p, _p, _i64, _i64, _i64, _i32), _i32),
    # bf16, pairs, weight (interleaved or pairs), k, block0, block1, out (float32 [k, (block1 - block0) * 16]), threads
    "interleaved_widen": ((_i32, _i32, _p, _i64, _i64, _i64, _p, _i32), None),
    # the pairs kernel with float32 out: only where BF16_PAIRS is
    "interleaved_linear_bf16_pairs_f32_out": ((_p, _p, _p, _i64, _i64, _i64, _i32), None),
    # x, weight (bfloat16 pairs), out, rows, n, k, threads -> 0, -1 (shape refused): the many-rows pairs kernel, where BF16_PAIRS is
    "pairs_gemm_bf16": ((_p, _p, _p, _i64, _i64, _i64, _i32), _i32),
    # bf16 (weight), x (float32), weight (interleaved), out (float32), rows, n, k, threads: the many-rows linear (csrc/gemm.c)
    "interleaved_gemm": ((_i32, _p, _p, _p, _i64, _i64, _i64, _i32), _i32),
    # x (bfloat16), weight (interleaved bfloat16), out (bfloat16), scratch (float32 rows x (k + n), or NULL), rows, n, k, threads:
    # interleaved_gemm with x widened and the sums rounded in C (csrc/gemm.c)
    "interleaved_gemm_bf16": ((_p, _p, _p, _p, _i64, _i64, _i64, _i32), _i32),
    # -> the most rows interleaved_gemm beats oneDNN's float32 linear at in this build (0: none measured)
    "interleaved_gemm_max_rows": ((), _i64),
    # dtype, qkv, q_stride, out, row_start, new_tokens, seq_lens, block_tables, max_blocks, num_seqs,
    # k_cache, v_cache, heads, kv_heads, head_dim, block_size, scale, threads
    "paged_attention": ((_i32, _p, _i64, _p, _p, _p, _p, _p, _i64, _i64, _p, _p, _i64, _i64, _i64, _i64, _f32, _i32), _i32),
    # dtype, head_dim, block_size -> 1 where paged_attention runs them on AMX tiles
    "paged_attention_on_tiles": ((_i32, _i64, _i64), ctypes.c_int),
    # dtype -> 1 where paged_attention beats paged_decode_attention on a step's decodes (bfloat16 on AMX tiles)
    "paged_attention_takes_decodes": ((_i32,), ctypes.c_int),
    # dtype, head_dim, block_size -> 1 where paged_attention beats SDPA on prefill chunks (tiles; AVX2 float32)
    "paged_attention_takes_chunks": ((_i32, _i64, _i64), ctypes.c_int),
    # dtype, x, rows, cols, row_stride, ids (int64), values (float32), threads
    "argmax_rows": ((_i32, _p, _i64, _i64, _i64, _p, _p, _i32), None),
    # dtype, x, y, rows, in, parts, out0, out1, out2, descriptors (lora_desc by slot), runs, num_runs, threads
    "segmented_lora": ((_i32, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _p, _p, _i64, _i32), _i32),
    # -> the vector width in bits of this build's interleaved linears: 512, 256 (AVX2 + FMA) or 128 (portable)
    "interleaved_linear_simd_bits": ((), ctypes.c_int),
    # n: the next n allocations succeed, every later one fails (a test hook; n < 0: none fails, the default)
    "llamaserve_fail_allocs_after": ((_i64,), None),
}
LORA_MAX_PARTS = 3  # csrc/lora.c: the most parts a fused linear has (q|k|v)
LORA_DESC_WORDS = 2 + LORA_MAX_PARTS  # csrc/lora.c's lora_desc as int64 words: A's address, B's, each part's rank
LORA_COL_BLOCK = 64  # csrc/lora.c: the output columns of one expand item, the blocks B^T is stored in
# built only for a CPU with AVX512_BF16 (-march=native there, the x86-64-v4-bf16 level)
BF16_PAIRS = "interleaved_linear_bf16_pairs"
BF16_PAIRS_F32_OUT = "interleaved_linear_bf16_pairs_f32_out"
PAIRS_GEMM = "pairs_gemm_bf16"


def supports(dtype: torch.dtype) -> bool:
    return dtype in DTYPE_CODES


def check_kernel(code: int, what: str) -> None:
    """A kernel's return code as the exception the step fails with: MemoryError when it could not
    allocate its scratch (the engine fails that step's requests and keeps serving), RuntimeError for
    any other refusal."""
    if code == KERNEL_NO_MEMORY:
        raise MemoryError(f"{what}: the C kernel could not allocate its scratch memory")
    if code != 0:
        raise RuntimeError(f"{what}: the C kernel refused its arguments (code {code})")


class CpuKernels:
    """Typed entry points over the loaded library. Every tensor must be contiguous in its rows as
    documented in the C files; the caller (engine.models.llama) owns those layouts."""

    def __init__(self, lib: ctypes.CDLL, *, partial: bool = False) -> None:
        """partial: bind only the entry points `lib` has (bench/elementwise_kernels.py's baseline, an
        older build); else one missing raises AttributeError (BF16_PAIRS may be missing)."""
        for name, (argtypes, restype) in SIGNATURES.items():
            fn = getattr(lib, name, None) if partial or name in (BF16_PAIRS, BF16_PAIRS_F32_OUT, PAIRS_GEMM) else getattr(lib, name)
            if fn is not None:
                fn.argtypes, fn.restype = argtypes, restype
        self._lib = lib
        # built for a CPU with AVX512_BF16 (-march=native there): bfloat16 one-row linears in pairs
        self._bf16_pairs = getattr(lib, BF16_PAIRS, None)
        self._bf16_pairs_f32_out = getattr(lib, BF16_PAIRS_F32_OUT, None)
        self._pairs_gemm = getattr(lib, PAIRS_GEMM, None)

    @property
    def has_bf16_pairs(self) -> bool:
        """Whether interleave() makes bfloat16 weights the pairs layout (this build has AVX512_BF16's kernel)."""
        return self._bf16_pairs is not None

    @property
    def has_pairs_gemm(self) -> bool:
        """Whether this build has linear.c's pairs gemm (AVX512_BF16): bfloat16 rows of any count from the pairs copy."""
        return self._pairs_gemm is not None

    @property
    def simd_bits(self) -> int:
        """The vector width the interleaved linears of this build are written for: 512 (AVX-512), 256
        (AVX2 with FMA) or 128 (the portable loops); the few-rows cutoff depends on it
        (engine.backends.cpu.few_rows_cutoff). 128 for an older build without the entry point."""
        fn = getattr(self._lib, "interleaved_linear_simd_bits", None)
        return 128 if fn is None else fn()

    def address(self, name: str) -> int | None:
        """The entry point `name` as a C function address (engine/kernels/csrc/decode_step.c calls the
        kernels through these); None if this build has no such function."""
        fn = getattr(self._lib, name, None)
        return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value

    def fail_allocs_after(self, num_allocs: int) -> None:
        """Test hook: the library's next num_allocs allocations succeed and every later one fails
        (its kernels then raise MemoryError); a negative count restores the default, none fails."""
        self._lib.llamaserve_fail_allocs_after(num_allocs)

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor, eps: float, threads: int) -> None:
        """residual += delta (in place, if given); out = rms_norm(residual) * weight."""
        rows, dim = residual.shape
        self._lib.add_rms_norm(
            DTYPE_CODES[residual.dtype], residual.data_ptr(), None if delta is None else delta.data_ptr(),
            weight.data_ptr(), out.data_ptr(), rows, dim, eps, threads,
        )  # fmt: skip

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor, threads: int) -> None:
        """out [rows, hidden] = silu(gate_up[:, :hidden]) * gate_up[:, hidden:]."""
        rows, hidden = out.shape
        self._lib.silu_mul(DTYPE_CODES[out.dtype], gate_up.data_ptr(), out.data_ptr(), rows, hidden, threads)

    def rope_and_cache_write(
        self, qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, positions: torch.Tensor,
        rope: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, threads: int,
    ) -> None:  # fmt: skip
        """Rotate qkv's q and k heads in place (rope: [max_pos, head_dim / 2, 2] float32 cos, sin)
        and copy each token's k and v to its cache slot."""
        self._lib.rope_and_cache_write(
            DTYPE_CODES[qkv.dtype], qkv.data_ptr(), qkv.shape[0], heads, kv_heads, head_dim, positions.data_ptr(),
            rope.data_ptr(), slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), threads,
        )  # fmt: skip

    def argmax_rows(self, x: torch.Tensor, threads: int) -> tuple[list[int], list[float]]:
        """Each row's first largest index and its value, as numpy's argmax on x.float() (NaN wins):
        x [rows, cols > 0] with contiguous rows."""
        rows, cols = x.shape
        ids, values = torch.empty(rows, dtype=torch.int64), torch.empty(rows, dtype=torch.float32)
        self._lib.argmax_rows(
            DTYPE_CODES[x.dtype], x.data_ptr(), rows, cols, x.stride(0), ids.data_ptr(), values.data_ptr(), threads
        )  # fmt: skip
        return ids.tolist(), values.tolist()

    def paged_decode_attention(
        self, qkv: torch.Tensor, out: torch.Tensor, rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        block_tables: torch.Tensor, seq_lens: torch.Tensor, heads: int, kv_heads: int, scale: float, threads: int,
        *, invariant: bool = False,
    ) -> None:  # fmt: skip
        """out[rows[b]] = attention of qkv[rows[b]]'s query heads over sequence b's cached K/V
        (block_tables [num_seqs, max_blocks] int32, seq_lens [num_seqs] int32). invariant: each
        sequence's blocks split by its length only, so its result does not depend on the others."""
        _, block_size, _, head_dim = k_cache.shape
        kernel = self._lib.paged_decode_attention_invariant if invariant else self._lib.paged_decode_attention
        code = kernel(
            DTYPE_CODES[qkv.dtype], qkv.data_ptr(), qkv.shape[1], out.data_ptr(), rows.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(), rows.shape[0],
            heads, kv_heads, head_dim, block_size, scale, threads,
        )  # fmt: skip
        check_kernel(code, "paged decode attention")

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
        code = self._lib.paged_attention(
            DTYPE_CODES[qkv.dtype], qkv.data_ptr(), qkv.shape[1], out.data_ptr(), row_start.data_ptr(), new_tokens.data_ptr(),
            seq_lens.data_ptr(), block_tables.data_ptr(), block_tables.shape[1], seq_lens.shape[0], k_cache.data_ptr(),
            v_cache.data_ptr(), heads, kv_heads, head_dim, block_size, scale, threads,
        )  # fmt: skip
        check_kernel(code, "paged attention")

    def paged_attention_takes_decodes(self, dtype: torch.dtype) -> bool:
        """Whether paged_attention is the faster kernel for a step's many decodes over caches of
        this dtype here: bfloat16 where the CPU grants AMX tiles; elsewhere paged_decode_attention
        keeps them (csrc/attention.c)."""
        return dtype in DTYPE_CODES and bool(self._lib.paged_attention_takes_decodes(DTYPE_CODES[dtype]))

    def paged_attention_takes_chunks(self, dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
        """Whether a step with prefill chunks runs every sequence in one paged_attention call rather
        than SDPA per chunk, for caches of this dtype, head_dim and block size: on AMX tiles
        (paged_attention_on_tiles), and in AVX builds below AVX-512 (csrc/attention.c)."""
        return dtype in DTYPE_CODES and bool(self._lib.paged_attention_takes_chunks(DTYPE_CODES[dtype], head_dim, block_size))

    def paged_attention_on_tiles(self, dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
        """Whether paged_attention runs on AMX tiles for caches of this dtype, head_dim and block size
        here (bfloat16, head_dim a multiple of 64, blocks a multiple of 16 keys, a CPU and OS that
        grant AMX): then it also beats torch's SDPA on prefill chunks."""
        return dtype in DTYPE_CODES and bool(self._lib.paged_attention_on_tiles(DTYPE_CODES[dtype], head_dim, block_size))

    def interleave(self, weight: torch.Tensor, *, pairs: bool = True) -> torch.Tensor:
        """[n, k] -> [n / 16, k, 16], the layout interleaved_linear reads (n a multiple of 16); bfloat16
        with even k where the library has the AVX512_BF16 kernel: [n / 16, k / 2, 16, 2] (pairs of
        columns side by side, what vdpbf16ps multiplies), unless `pairs` is False (the gemm's panels,
        which its bfloat16 path reads in every build: tests and benches run it where pairs exist too)."""
        n, k = weight.shape
        if pairs and weight.dtype == torch.bfloat16 and k % 2 == 0 and self._bf16_pairs is not None:
            return weight.detach().view(n // 16, 16, k // 2, 2).transpose(1, 2).contiguous()
        return weight.detach().view(n // 16, 16, k).transpose(1, 2).contiguous()

    def interleaved_linear(self, x: torch.Tensor, weight: torch.Tensor, threads: int, *, f32_out: bool = False) -> torch.Tensor:
        """x [rows, k] @ W^T with W as interleave() made it: [rows, n] in x's dtype, or float32 (the
        float32 sums unrounded) with f32_out."""
        return self.bind_interleaved(weight, f32_out=f32_out)(x, threads)

    def bind_interleaved(self, weight: torch.Tensor, *, f32_out: bool = False) -> Callable[[torch.Tensor, int], torch.Tensor]:
        """interleaved_linear for one weight, its sizes and pointer looked up once: a decode step
        makes four such calls per layer, and each Python-side lookup costs about a microsecond.
        f32_out: float32 out (the output head: exact logits from bfloat16 weights). Each row's
        result is the same whatever the number of rows (one fixed sum order per row); rows in small
        groups share each weight load (csrc/linear.c; the pairs kernel's groups of up to 3 rows too)."""
        n, weight_ptr, code = weight.shape[0] * 16, weight.data_ptr(), DTYPE_CODES[weight.dtype]
        pairs = weight.dim() == 4  # 4-D: bfloat16 pairs
        lib_fn = self._lib.interleaved_linear_f32_out if f32_out else self._lib.interleaved_linear
        pairs_fn = self._bf16_pairs_f32_out if f32_out else self._bf16_pairs

        def one_row(x: torch.Tensor, threads: int) -> torch.Tensor:
            rows, k = x.shape
            out = torch.empty(rows, n, dtype=torch.float32 if f32_out else x.dtype)
            if pairs:  # allocates nothing: no error to report
                pairs_fn(x.data_ptr(), weight_ptr, out.data_ptr(), rows, n, k, threads)
            elif failed := lib_fn(code, x.data_ptr(), weight_ptr, out.data_ptr(), rows, n, k, threads):
                check_kernel(failed, "interleaved linear")
            return out

        one_row.weight = weight  # the pointer's owner lives as long as the call
        return one_row

    def bind_widen(self, weight: torch.Tensor) -> Callable[[int, int, torch.Tensor, int], None]:
        """csrc/linear.c's interleaved_widen for one weight as interleave() made it: call(row0, row1,
        out, threads) writes W[row0:row1]^T as float32 into out (contiguous [in, row1 - row0]; row0
        and row1 multiples of 16), the tiles a float32 GEMM multiplies many rows by."""
        pairs = weight.dim() == 4
        k = weight.shape[1] * (2 if pairs else 1)
        fn, weight_ptr, bf16 = self._lib.interleaved_widen, weight.data_ptr(), DTYPE_CODES[weight.dtype]

        def call(row0: int, row1: int, out: torch.Tensor, threads: int) -> None:
            # the kernel writes out through raw offsets: a shape it does not expect is refused here
            if row0 % 16 or row1 % 16 or out.dtype != torch.float32 or out.shape != (k, row1 - row0) or not out.is_contiguous():
                raise ValueError(f"interleaved_widen: rows {row0}..{row1} into {out.dtype} {list(out.shape)}")
            fn(bf16, int(pairs), weight_ptr, k, row0 // 16, row1 // 16, out.data_ptr(), threads)

        call.weight = weight  # the pointer's owner lives as long as the call
        return call

    def bind_pairs_gemm(self, weight: torch.Tensor) -> Callable[[torch.Tensor, int], torch.Tensor] | None:
        """csrc/linear.c's pairs gemm for one bfloat16 pairs copy (interleave()'s 4-D layout):
        call(x [rows, k] bfloat16 contiguous, threads) -> [rows, n] bfloat16, each output one chain
        of vdpbf16ps over k (a row's result the same whatever the other rows and the threads); AmxLinear.bind's
        signature, for CPUs with AVX512_BF16 and no AMX tiles. None where this build has no such kernel."""
        if self._pairs_gemm is None or weight.dtype != torch.bfloat16 or weight.dim() != 4 or not weight.is_contiguous():
            return None
        n, k, weight_ptr, fn = weight.shape[0] * 16, weight.shape[1] * 2, weight.data_ptr(), self._pairs_gemm

        def many_rows(x: torch.Tensor, threads: int) -> torch.Tensor:
            # the kernel reads x through raw offsets: another shape or layout is refused here
            if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k or not x.is_contiguous():
                raise ValueError(f"pairs gemm takes contiguous bfloat16 x [rows, {k}], got {x.dtype} {list(x.shape)}")
            out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
            if failed := fn(x.data_ptr(), weight_ptr, out.data_ptr(), x.shape[0], n, k, threads):
                check_kernel(failed, "pairs gemm")
            return out

        many_rows.weight = weight  # the pointer's owner lives as long as the call
        return many_rows

    def gemm_max_rows(self) -> int:
        """The most rows (from 2) interleaved_gemm ran faster than oneDNN's packed float32 linear at,
        with the weights cold, in this build's vector width (csrc/gemm.c); 0 where it was not measured
        faster, and oneDNN keeps every row count."""
        return int(self._lib.interleaved_gemm_max_rows())

    def bind_gemm(self, weight: torch.Tensor, *, out_dtype: torch.dtype = torch.float32) -> Callable[[torch.Tensor, int], torch.Tensor]:
        """csrc/gemm.c's many-rows linear for one float32 or bfloat16 weight as interleave() made it
        ([n / 16, k, 16]: the one-row kernel's copy, read as the microkernel's panels): call(x [rows,
        k] contiguous, float32 (or bfloat16 for a bfloat16 weight: widened here); threads) -> [rows, n]
        float32 (bfloat16 weights are widened per load, the sums float32). out_dtype bfloat16 (a
        bfloat16 weight: a bfloat16 model's block linears): x bfloat16, the sums rounded to bfloat16,
        both conversions in C (interleaved_gemm_bf16, which the compiled decode step calls too: the
        same bits; one call, no float32 tensors). Each row's result is the same whatever the number
        of rows (one chain over k per output)."""
        if weight.dtype not in (torch.float32, torch.bfloat16) or weight.dim() != 3 or weight.shape[2] != 16 or not weight.is_contiguous():
            raise ValueError(f"interleaved_gemm takes a contiguous float32 or bfloat16 [n / 16, k, 16] weight, got {weight.dtype} "
                             f"{list(weight.shape)}")  # fmt: skip
        if out_dtype not in (torch.float32, weight.dtype):
            raise ValueError(f"interleaved_gemm: {out_dtype} out from a {weight.dtype} weight")
        n, k, weight_ptr = weight.shape[0] * 16, weight.shape[1], weight.data_ptr()
        bf16, inputs = DTYPE_CODES[weight.dtype], (weight.dtype,) if out_dtype == torch.bfloat16 else (torch.float32, weight.dtype)
        fn = self._lib.interleaved_gemm_bf16 if out_dtype == torch.bfloat16 else self._lib.interleaved_gemm

        def many_rows(x: torch.Tensor, threads: int) -> torch.Tensor:
            # the kernel reads x through raw offsets: another shape or layout is refused here
            if x.dtype not in inputs or x.dim() != 2 or x.shape[1] != k or not x.is_contiguous():
                raise ValueError(f"interleaved_gemm takes contiguous {str(weight.dtype)[6:]} x [rows, {k}], got {x.dtype} {list(x.shape)}")
            out = torch.empty(x.shape[0], n, dtype=out_dtype)
            if out_dtype == torch.bfloat16:  # x widened and the sums rounded in C, its scratch its own
                failed = fn(x.data_ptr(), weight_ptr, out.data_ptr(), None, x.shape[0], n, k, threads)
            else:
                x = x.float()  # the kernel's x is float32 (a bfloat16 x widened exactly)
                failed = fn(bf16, x.data_ptr(), weight_ptr, out.data_ptr(), x.shape[0], n, k, threads)
            if failed:
                check_kernel(failed, "interleaved gemm")
            return out

        many_rows.weight = weight  # the pointer's owner lives as long as the call
        return many_rows

    @staticmethod
    def lora_expand_layout(b_t: torch.Tensor) -> torch.Tensor:
        """One part's B^T [rank, out] as segmented_lora reads it: blocks of LORA_COL_BLOCK columns (the
        last one narrower), each [rank, its width] row-major, flattened."""
        rank, out = b_t.shape
        full = out // LORA_COL_BLOCK * LORA_COL_BLOCK
        blocks = b_t[:, :full].reshape(rank, full // LORA_COL_BLOCK, LORA_COL_BLOCK).transpose(0, 1)
        return torch.cat([blocks.reshape(-1), b_t[:, full:].reshape(-1)])

    def bind_segmented_lora(self, in_features: int, part_sizes: Sequence[int]) -> Callable[[torch.Tensor, torch.Tensor, int, int, int, int], None]:
        """csrc/lora.c's segmented_lora for one adapted linear, its sizes fixed here (in_features, each
        part's output columns on this rank, in row order): call(x, y, descriptors, runs, num_runs,
        threads) adds every run's LoRA delta of x [rows, in] into y [rows, sum(part_sizes)] in place
        (both contiguous, float32 or bfloat16). descriptors: the address of this linear's lora_desc
        array, indexed by the runs' slots; runs: the address of [num_runs, 3] int64 (first row, end
        row, slot). The per-step addresses come from engine.lora.layers.LoraSlots."""
        if not 1 <= len(part_sizes) <= LORA_MAX_PARTS:
            raise ValueError(f"segmented LoRA: {len(part_sizes)} parts, at most {LORA_MAX_PARTS}")
        fn, parts, out_features = self._lib.segmented_lora, len(part_sizes), sum(part_sizes)
        out0, out1, out2 = (*part_sizes, 0, 0)[:LORA_MAX_PARTS]

        def call(x: torch.Tensor, y: torch.Tensor, descriptors: int, runs: int, num_runs: int, threads: int) -> None:
            # the kernel writes y through raw row offsets: a shape or layout it does not expect is refused here
            if (x.dim() != 2 or x.shape[1] != in_features or y.shape != (x.shape[0], out_features) or x.dtype != y.dtype
                    or not x.is_contiguous() or not y.is_contiguous()):  # fmt: skip
                raise ValueError(f"segmented LoRA takes contiguous x [rows, {in_features}] and y [rows, {out_features}] "
                                 f"of one dtype, got {x.dtype} {list(x.shape)} and {y.dtype} {list(y.shape)}")  # fmt: skip
            if failed := fn(DTYPE_CODES[x.dtype], x.data_ptr(), y.data_ptr(), x.shape[0], in_features, parts, out0, out1,
                            out2, descriptors, runs, num_runs, threads):  # fmt: skip
                check_kernel(failed, "segmented LoRA")

        return call


@functools.cache
def load_cpu_kernels(cache_dir: Path | None = None) -> CpuKernels | None:
    """The kernels (engine.kernels.build.library_path); None (logged once) where they cannot be loaded here."""
    try:
        return CpuKernels(ctypes.CDLL(str(library_path(CPU_KERNELS, cache_dir))))
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        log.warning("fused CPU kernels unavailable (%s); using the torch path", exc)
        return None
