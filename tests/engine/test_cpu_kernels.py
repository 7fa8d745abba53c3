"""The fused CPU kernels (engine/kernels/cpu.py over the cpu_kernels library, engine/kernels/csrc/)
against plain torch, and their build and cache (engine/kernels/build.py).

Each kernel is checked on its own against the torch maths it replaces (float32 tightly, bfloat16
within bf16 rounding), then the fused Transformer forward against the same model's torch path
(prefill, decode and mixed steps on a tiny checkpoint), then the guards: out-of-range indices
raise before any kernel touches memory, a failed build falls back to the torch path, and the
executor's `cpu_kernels` switch.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import math
import os
import random
import stat
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import build
from engine.kernels import cpu as ck
from engine.loading.checkpoint import load_rank_state_dict, resolve_checkpoint
from engine.config import EngineConfig
from engine.executor.worker_group import WorkerGroup
from engine.backends import select_backend
from engine.backends.base import Backend
from engine.backends import cpu as cpu_backends
from engine.backends.cpu import CpuKernelBackend, OneDnnBackend, PackedCpuLinear, pack_weight
from engine.backends.cpu import packing_available as cpu_packing_available
from engine.backends.torch_ops import TorchBackend
from engine.models.llama import Transformer, allocate_kv_caches, apply_rotary_emb, precompute_freqs_cis
from engine.executor.executor import build_step_inputs
from engine.core.sequence import ScheduledBatch, Sequence
from engine.executor.step_inputs import StepInputs
from engine.types import SamplingParams
from tests.conftest import TINY_DESCRIPTOR
from tests.engine.kernel_levels import cpu_kernels_for_level

DTYPES = [torch.float32, torch.bfloat16]
THREADS = 2  # the kernels' OpenMP team; parallel branches need more than one thread to mean anything


def nan_filled_caches(tables: list[list[int]], kv_lens: list[int], num_blocks: int, block_size: int, kv_heads: int,
                      head_dim: int, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches with random keys in each sequence's slots and NaN everywhere else, so a kernel
    that reads outside a sequence shows it."""
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for table, n in zip(tables, kv_lens):
        for t in range(n):
            k_cache[table[t // block_size], t % block_size] = (2 * torch.randn(kv_heads, head_dim, generator=g)).to(dtype)
            v_cache[table[t // block_size], t % block_size] = torch.randn(kv_heads, head_dim, generator=g).to(dtype)
    return k_cache, v_cache


@pytest.fixture(scope="module")
def kernels() -> ck.CpuKernels:
    loaded = ck.load_cpu_kernels()
    if loaded is None:
        pytest.skip("fused CPU kernels could not be built here (no working C compiler?); torch path only")
    return loaded


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: 1e-5 of the values' scale; bfloat16: a couple of bf16 ulps."""
    scale = max(1.0, float(expected.abs().max()))
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5 * scale, rtol=1e-5)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), atol=1e-2 * scale, rtol=1.6e-2)


# =========================================================================== kernels one by one
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, n, k", [(1, 16, 3), (1, 960, 576), (1, 4096, 256), (3, 48, 100)])  # 4096 x 256: parallel
def test_interleaved_linear(kernels, dtype, rows, n, k):
    g = gen(n * 31 + k)
    x = torch.randn(rows, k, generator=g).to(dtype)
    weight = torch.randn(n, k, generator=g).to(dtype)
    out = kernels.interleaved_linear(x, kernels.interleave(weight), THREADS)
    expected = x.double() @ weight.double().T  # float32 accumulation in the kernel either way
    assert out.shape == (rows, n) and out.dtype == dtype
    assert_close(out.double(), expected.to(dtype).double(), dtype)


# the portable loops; AVX2 with FMA; the AVX-512 builds' 16-lane generic code (as pairs of ymm)
# and x86-64-v4 (AVX-512 CPUs only): bfloat16 weights widened per load, not in vdpbf16ps pairs
LEVEL_SIMD_BITS = {"x86-64-v2": 128, "x86-64-v3": 256, "x86-64-v3-16-lanes": 512, "x86-64-v4": 512}


@pytest.mark.parametrize("level", ["native", *LEVEL_SIMD_BITS])
def test_few_rows_linear_every_build_level(kernels, tmp_path, level):
    """native: the build the server loads; x86-64-v3: AVX2's groups of 3 rows; x86-64-v2: the portable
    loops (groups of 1); x86-64-v3-16-lanes: AVX-512's groups of 4 rows, four chains and two blocks
    for one row (its bfloat16 vdpbf16ps pairs excepted). Rows 1..9 (across group boundaries), both dtypes, both outputs (x's dtype
    and float32), odd k and k below one round of chains, a weight large enough for the parallel
    branch: against the float64 product, and each row bit for bit the same alone, in any prefix of
    the batch, and at another thread count (its sums keep one order whatever the rows)."""
    built = kernels if level == "native" else cpu_kernels_for_level(tmp_path, level)
    if level != "native":
        assert built.simd_bits == LEVEL_SIMD_BITS[level]
    for n, k in ((16, 1), (48, 7), (32, 577), (4096, 129)):  # 4096 x 129: the parallel branch
        for dtype in DTYPES:
            g = gen(n + k)
            weight = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dtype)
            x = torch.randn(9, k, generator=g).to(dtype)
            packed = built.interleave(weight)
            expected = x.double() @ weight.double().T
            for f32_out in (False, True):
                batched = built.interleaved_linear(x, packed, THREADS, f32_out=f32_out)
                out_dtype = torch.float32 if f32_out else dtype
                assert batched.dtype == out_dtype and batched.shape == (9, n)
                assert_close(batched.double(), expected.to(out_dtype).double(), out_dtype)
                for rows in range(1, 10):
                    assert torch.equal(built.interleaved_linear(x[:rows], packed, THREADS, f32_out=f32_out), batched[:rows]), (n, k, dtype, rows)
                for row in range(9):
                    alone = built.interleaved_linear(x[row : row + 1].clone(), packed, 1, f32_out=f32_out)
                    assert torch.equal(alone, batched[row : row + 1]), (n, k, dtype, row)


def test_the_avx512_levels_compile(tmp_path):
    """The AVX-512 code of the interleaved linears (groups of 4 rows of 16 lanes) and of the decode
    step cannot run on a CPU without AVX-512, but must build: compiled here for x86-64-v4 and its
    AVX512_BF16 variant (the pairs kernel), not loaded."""
    try:
        built = build.prebuild(tmp_path, ["x86-64-v4", "x86-64-v4-bf16"], [build.CPU_KERNELS, build.DECODE_STEP])
    except (OSError, subprocess.SubprocessError) as exc:
        if "cannot" in str(exc) or "unrecognized" in str(exc):
            pytest.skip(f"this compiler cannot target AVX-512: {exc}")
        raise
    assert len(built) == 4 and all(path.stat().st_size > 0 for path in built)


class _Build:
    """Stands in for CpuKernels where only its vector width matters (the few-rows cutoff)."""

    def __init__(self, simd_bits: int) -> None:
        self.simd_bits = simd_bits


def test_few_rows_cutoff_follows_the_loaded_build():
    """AVX2 builds: up to 8 rows through the interleaved kernel; AVX-512: 4 (one group; gemm.c takes
    more); the portable build: one row; no kernels: none beyond oneDNN's one row default."""
    assert [cpu_backends.few_rows_cutoff(_Build(bits)) for bits in (128, 256, 512)] == [1, 8, 4]
    assert cpu_backends.few_rows_cutoff(None) == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_few_rows_path(kernels, dtype, monkeypatch):
    """Rows up to the cutoff go through the interleaved copy (the kernel's bits), more through
    oneDNN; a pairs copy (AVX512_BF16 builds) serves one row only through it, its 2+ rows through
    the pairs gemm (test_packed_linear_routes_bfloat16_rows_through_the_pairs_gemm)."""
    if not cpu_packing_available(dtype):
        pytest.skip(f"oneDNN cannot run {dtype} here")
    monkeypatch.setitem(cpu_backends.FEW_ROWS_MAX_ROWS, kernels.simd_bits, 4)
    g = gen(6)
    weight = torch.randn(64, 32, generator=g).to(dtype)
    layer = PackedCpuLinear(pack_weight(weight, kernels), kernels)
    pairs = layer.interleaved.dim() == 4
    assert layer.few_rows() == (1 if pairs else 4)
    for rows in range(1, 7):
        x = torch.randn(rows, 32, generator=g).to(dtype)
        via_kernel = rows <= layer.few_rows()
        # past the cutoff: oneDNN, or where csrc/gemm.c serves float32 (AVX2) the gemm on the one copy,
        # or a pairs copy's many-rows kernel
        many = layer._gemm(x, THREADS) if layer.packed_weight is None else layer._many_rows(x, THREADS) if pairs else layer._onednn(x)
        expected = kernels.interleaved_linear(x, layer.interleaved, THREADS) if via_kernel else many
        assert torch.equal(layer(x), expected), rows
    assert layer(torch.randn(0, 32).to(dtype)).shape == (0, 64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("copies", ["both", "one", "invariant"])
def test_packed_linear_takes_an_empty_input_whatever_its_copies(kernels, dtype, copies):
    """A step whose chunk samples no row sends the head an empty input: every kind of weight this
    build makes (oneDNN's copy beside the interleaved one; the interleaved or pairs copy alone, as
    a large weight or one without oneDNN's kernel gets; the batch-invariant mode's) gives an empty
    output, whichever kernels its rows would otherwise take (found on Zen 4, where 0 rows reached
    an unbound gemm)."""
    if copies == "both" and not cpu_packing_available(dtype):
        pytest.skip(f"oneDNN cannot run {dtype} here")
    weight = torch.randn(64, 32, generator=gen(7)).to(dtype)
    packed = pack_weight(weight, kernels, invariant=copies == "invariant", onednn=copies == "both")
    layer = PackedCpuLinear(packed, kernels, invariant=copies == "invariant")
    out = layer(torch.randn(0, 32).to(dtype))
    assert out.shape == (0, 64) and out.dtype == dtype


# --------------------------------------------------------------------------- the pairs gemm (AVX512_BF16)
@pytest.fixture(scope="module")
def pairs_gemm(kernels):
    if kernels.address(ck.PAIRS_GEMM) is None:
        pytest.skip("no AVX512_BF16 pairs kernels in this build")
    return kernels


def assert_within_bf16_of_float32(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Within one bfloat16 rounding of the float32 product plus float32 summation-order error."""
    ref = x.float() @ weight.float().T
    tol = ref.abs() * 2**-8 + (x.float().abs() @ weight.float().abs().T) * 2**-20
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert ((out.float() - ref).abs() <= tol).all(), (out.float() - ref).abs().max()


# [out, in]: the demo's block shapes; one panel; 5 panels (a last group of 2); 4 (a lone last one);
# k of one pair, of an odd number of pairs
PAIRS_GEMM_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (16, 2), (80, 34), (64, 96)]


@pytest.mark.parametrize("n,k", PAIRS_GEMM_SHAPES)
def test_pairs_gemm_matches_float32_matmul(pairs_gemm, n, k):
    """Rows 1..65 across the 8-row tiles' boundaries (balanced tiles of every size), and past one pass
    of x (512 KiB: 170 rows of k 1536): against the float32 matmul; each row the same alone and at
    one thread as in the batch at two (one chain over k per output, the panels split statically)."""
    g = gen(n + k)
    weight = (torch.randn(n, k, generator=g) / math.sqrt(k)).bfloat16()
    call = pairs_gemm.bind_pairs_gemm(pairs_gemm.interleave(weight))
    for rows in (1, 2, 3, 7, 8, 9, 17, 33, 64, 65, 400):
        x = torch.randn(rows, k, generator=g).bfloat16()
        out = call(x, THREADS)
        assert_within_bf16_of_float32(out, x, weight)
        assert torch.equal(call(x, 1), out), rows
        for row in {0, rows // 2, rows - 1}:
            assert torch.equal(call(x[row : row + 1].clone(), 1), out[row : row + 1]), (rows, row)


def test_pairs_gemm_refuses_what_it_cannot_take(pairs_gemm):
    """The binding takes a contiguous bfloat16 pairs copy and x of its k; the C entry refuses n not
    whole panels or k odd (-1) before touching anything."""
    weight = torch.randn(32, 64).bfloat16()
    assert pairs_gemm.bind_pairs_gemm(weight) is None  # 2-D: not a pairs copy
    call = pairs_gemm.bind_pairs_gemm(pairs_gemm.interleave(weight))
    with pytest.raises(ValueError, match="pairs gemm"):
        call(torch.randn(2, 63).bfloat16(), THREADS)
    with pytest.raises(ValueError, match="pairs gemm"):
        call(torch.randn(2, 64), THREADS)
    fn = pairs_gemm._pairs_gemm
    x, out = torch.randn(2, 64).bfloat16(), torch.full((2, 32), 7.0).bfloat16()
    pairs = pairs_gemm.interleave(weight)
    assert fn(x.data_ptr(), pairs.data_ptr(), out.data_ptr(), 2, 24, 64, THREADS) == -1
    assert fn(x.data_ptr(), pairs.data_ptr(), out.data_ptr(), 2, 32, 63, THREADS) == -1
    assert (out == 7).all()


def test_packed_linear_routes_bfloat16_rows_through_the_pairs_gemm(pairs_gemm, monkeypatch):
    """Without AMX tiles a bfloat16 pairs copy runs 2..PAIRS_GEMM_MAX_ROWS rows through the pairs
    gemm (its bits), one row through the one-row kernel, more through oneDNN; the batch-invariant
    mode takes the one-row kernel at every row count."""
    if not cpu_packing_available(torch.bfloat16):
        pytest.skip("oneDNN cannot run bfloat16 here")
    monkeypatch.setattr(cpu_backends, "PAIRS_GEMM_MAX_ROWS", 5)
    g = gen(9)
    weight = torch.randn(64, 96, generator=g).bfloat16()
    packed = pack_weight(weight, pairs_gemm)
    layer, invariant = PackedCpuLinear(packed, pairs_gemm), PackedCpuLinear(packed, pairs_gemm, invariant=True)
    assert layer.pairs_rows() == 5 and not layer.pairs_on_tiles() and invariant.pairs_rows() == 0
    gemm, one_row = pairs_gemm.bind_pairs_gemm(layer.interleaved), pairs_gemm.bind_interleaved(layer.interleaved)
    for rows in range(1, 8):
        x = torch.randn(rows, 96, generator=g).bfloat16()
        expected = one_row(x, THREADS) if rows == 1 else gemm(x, THREADS) if rows <= 5 else layer._onednn(x)
        assert torch.equal(layer(x), expected), rows
        assert torch.equal(invariant(x), one_row(x, THREADS)), rows
    # a weight with the pairs copy only (no oneDNN copy to fall back on): the gemm takes every row count
    pairs_only = PackedCpuLinear(dataclasses.replace(packed, packed=None), pairs_gemm)
    for rows in (2, 6, 300):
        x = torch.randn(rows, 96, generator=g).bfloat16()
        assert torch.equal(pairs_only(x), gemm(x, THREADS)), rows


def test_a_large_bfloat16_weight_keeps_the_pairs_copy_alone_where_the_pairs_gemm_is(pairs_gemm, monkeypatch):
    """Past INTERLEAVED_MAX_WEIGHT_BYTES a bfloat16 weight gets the pairs copy in place of oneDNN's
    where the build has the pairs gemm (no AMX needed): one row on the one-row kernel, every other
    row count (prefill chunks too) on the gemm, no memory for a second copy; small weights keep both."""
    monkeypatch.setattr(cpu_backends, "INTERLEAVED_MAX_WEIGHT_BYTES", 64 * 96 * 2 - 1)  # this weight counts as large
    g = gen(12)
    weight = torch.randn(64, 96, generator=g).bfloat16()
    packed = pack_weight(weight, pairs_gemm)
    assert packed.packed is None and packed.interleaved is not None and packed.interleaved.dim() == 4
    layer = PackedCpuLinear(packed, pairs_gemm)
    assert layer.resident_bytes() == weight.numel() * 2 and layer.pairs_rows() == cpu_backends.AMX_MAX_ROWS  # a step's rows
    gemm, one_row = pairs_gemm.bind_pairs_gemm(layer.interleaved), pairs_gemm.bind_interleaved(layer.interleaved)
    for rows in (1, 2, cpu_backends.PAIRS_GEMM_MAX_ROWS + 1, 300):
        x = torch.randn(rows, 96, generator=g).bfloat16()
        out = layer(x)
        assert torch.equal(out, one_row(x, THREADS) if rows == 1 else gemm(x, THREADS)), rows
        assert_within_bf16_of_float32(out, x, weight)
    small = pack_weight(torch.randn(64, 48, generator=g).bfloat16(), pairs_gemm)  # 6 KiB: both copies
    assert small.packed is not None and small.interleaved is not None


@pytest.mark.parametrize("gemm", [True, False])
@pytest.mark.parametrize("cutoff", [1, 8])
def test_large_float32_head_runs_few_rows_on_its_interleaved_copy(kernels, cutoff, gemm, monkeypatch):
    """A float32 head larger than INTERLEAVED_MAX_WEIGHT_BYTES: where csrc/gemm.c serves it (AVX2,
    AVX-512), one copy, the interleaved one (no oneDNN copy), its rows up to the few-rows cutoff on the
    interleaved kernel, more on the gemm; without the gemm, oneDNN's copy alone for every row count."""
    if not cpu_packing_available(torch.float32):
        pytest.skip("no oneDNN here")
    if gemm and kernels.gemm_max_rows() == 0:
        pytest.skip("this build has no many-rows float32 kernel")
    monkeypatch.setitem(cpu_backends.FEW_ROWS_MAX_ROWS, kernels.simd_bits, cutoff)
    monkeypatch.setattr(cpu_backends, "INTERLEAVED_MAX_WEIGHT_BYTES", 0)  # every weight counts as large
    if not gemm:
        monkeypatch.setattr(cpu_backends, "gemm_serves", lambda *args: False)
    backend = CpuKernelBackend(torch.device("cpu"), torch.float32, kernels)
    weight = torch.randn(96, 40, generator=gen(3))
    head = backend.head_linear(backend.prepare_head(weight))
    assert isinstance(head, PackedCpuLinear) and (head.packed_weight is None) == gemm and (head.interleaved is not None) == gemm
    assert head.resident_bytes() == weight.numel() * 4  # one copy either way
    few = (cutoff if cutoff > 1 else 1) if gemm else 0
    assert head.few_rows() == few
    for rows in (1, cutoff, cutoff + 1):
        x = torch.randn(rows, 40, generator=gen(rows))
        if not gemm:
            expected = head._onednn(x)
        elif rows <= few:
            expected = kernels.interleaved_linear(x, head.interleaved, THREADS)
        else:
            expected = kernels.bind_gemm(head.interleaved)(x, THREADS)
        assert torch.equal(head(x), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_one_row_path(kernels, dtype):
    """With kernels, a small packed linear keeps an interleaved copy and answers one-row inputs
    from it, more rows from oneDNN; both agree with F.linear. Large weights get one copy: the
    interleaved one where a gemm of this build serves it, else oneDNN's."""
    if not cpu_packing_available(dtype):
        pytest.skip(f"oneDNN cannot run {dtype} here")
    g = gen(5)
    weight = torch.randn(64, 32, generator=g).to(dtype)
    layer = PackedCpuLinear(pack_weight(weight, kernels), kernels)
    assert layer.interleaved is not None
    for rows in (1, 3):
        x = torch.randn(rows, 32, generator=g).to(dtype)
        assert_close(layer(x).double(), F.linear(x.double(), weight.double()).to(dtype).double(), dtype)
    assert PackedCpuLinear(pack_weight(weight)).interleaved is None  # no kernels: oneDNN only
    big = torch.empty(16, (8 << 20) // (16 * weight.element_size()) + 16, dtype=dtype)
    big_layer = PackedCpuLinear(pack_weight(big, kernels), kernels)
    one_copy = kernels.gemm_max_rows() > 0 if dtype == torch.float32 else kernels.has_pairs_gemm
    if one_copy:  # csrc/gemm.c (float32) or the pairs gemm (bfloat16) serves it: its copy in place of oneDNN's
        assert big_layer.packed_weight is None and big_layer.interleaved is not None
    else:
        assert big_layer.interleaved is None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dim = x.shape[-1]
    if x.dtype == torch.float32:
        return F.rms_norm(x, (dim,), weight, eps)
    return F.rms_norm(x.float(), (dim,), None, eps).type_as(x) * weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [False, True], ids=["no_delta", "delta"])
@pytest.mark.parametrize(
    "rows, dim",
    [(1, 64), (1, 4096), (3, 100), (70, 1024)],  # 70 x 1024 >= 65536: the parallel branch
)
def test_add_rms_norm(kernels, dtype, with_delta, rows, dim):
    g = gen(rows * 7919 + dim)
    residual = (3 * torch.randn(rows, dim, generator=g)).to(dtype)
    delta = torch.randn(rows, dim, generator=g).to(dtype) if with_delta else None
    weight = (1 + 0.1 * torch.randn(dim, generator=g)).to(dtype)
    eps = 1e-5
    expected_residual = residual + delta if with_delta else residual.clone()
    expected = rms_norm_reference(expected_residual, weight, eps)

    out = torch.full((rows, dim), 123.0, dtype=dtype)
    residual_before, weight_before = residual.clone(), weight.clone()
    kernels.add_rms_norm(residual, delta, weight, out, eps, THREADS)

    # the add is one rounding to the model dtype, as torch's: bit for bit
    assert torch.equal(residual, expected_residual if with_delta else residual_before)
    assert torch.equal(weight, weight_before)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_leaves_delta_and_fills_out(kernels, dtype):
    """residual updated in place, delta left as it was, out written whole."""
    g = gen(5)
    residual = torch.randn(4, 96, generator=g).to(dtype)
    delta = torch.randn(4, 96, generator=g).to(dtype)
    delta_before = delta.clone()
    weight = torch.ones(96, dtype=dtype)
    out = torch.full((4, 96), float("nan"), dtype=dtype)
    kernels.add_rms_norm(residual, delta, weight, out, 1e-6, THREADS)
    assert torch.equal(delta, delta_before)
    assert not out.isnan().any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows, hidden",
    [(1, 5), (1, 700), (3, 1000), (2, 1536), (40, 2000)],  # not multiples of 512 (the C chunk); 40 x 2000: parallel
)
def test_silu_mul(kernels, dtype, rows, hidden):
    g = gen(rows * 31 + hidden)
    gate_up = (4 * torch.randn(rows, 2 * hidden, generator=g)).to(dtype)
    gate_up[0, :4] = torch.tensor([-120.0, 120.0, -90.0, 0.0])  # exp's clamps and zero
    gate, up = gate_up[:, :hidden], gate_up[:, hidden:]
    expected = F.silu(gate).mul(up)
    before = gate_up.clone()
    out = torch.full((rows, hidden), 123.0, dtype=dtype)
    kernels.silu_mul(gate_up, out, THREADS)
    assert torch.equal(gate_up, before)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "tokens, heads, kv_heads, head_dim",
    [(1, 4, 2, 16), (5, 8, 2, 64), (9, 9, 3, 128), (40, 8, 8, 128)],  # 40 x 3072 >= 65536: parallel
)
def test_rope_and_cache_write(kernels, dtype, tokens, heads, kv_heads, head_dim):
    g = gen(tokens * 1000 + heads * 10 + head_dim)
    max_pos, num_blocks, block_size = 300, 8, 16
    freqs_cis = precompute_freqs_cis(head_dim, max_pos, 500000.0, True, scale_factor=32.0)
    rope = torch.view_as_real(freqs_cis)
    assert rope.shape == (max_pos, head_dim // 2, 2) and rope.is_contiguous()
    positions = torch.randint(0, max_pos, (tokens,), generator=g, dtype=torch.int64)
    positions[0] = max_pos - 1  # the table's last row
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens].to(torch.int64)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)

    # reference: the torch path's rotation and index_copy
    split = qkv.view(tokens, heads + 2 * kv_heads, head_dim)
    fc = freqs_cis.index_select(0, positions).unsqueeze(1)
    q_ref = apply_rotary_emb(split[:, :heads], fc)
    k_ref = apply_rotary_emb(split[:, heads : heads + kv_heads], fc)
    v_ref = split[:, heads + kv_heads :].clone()
    k_cache_ref, v_cache_ref = k_cache.clone(), v_cache.clone()
    k_cache_ref.view(-1, kv_heads, head_dim).index_copy_(0, slots, k_ref)
    v_cache_ref.view(-1, kv_heads, head_dim).index_copy_(0, slots, v_ref)

    kernels.rope_and_cache_write(qkv, heads, kv_heads, head_dim, positions, rope, slots, k_cache, v_cache, THREADS)

    out = qkv.view(tokens, heads + 2 * kv_heads, head_dim)
    assert_close(out[:, :heads], q_ref, dtype)
    assert_close(out[:, heads : heads + kv_heads], k_ref, dtype)
    assert torch.equal(out[:, heads + kv_heads :], v_ref)  # v is copied, never rotated
    # the written slots hold exactly qkv's (rotated) k and v; every other slot is untouched
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    assert torch.equal(flat_k[slots], out[:, heads : heads + kv_heads])
    assert torch.equal(flat_v[slots], v_ref)
    assert_close(k_cache, k_cache_ref, dtype)
    others = torch.ones(num_blocks * block_size, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(flat_k[others], k_cache_ref.view(-1, kv_heads, head_dim)[others])
    assert torch.equal(flat_v[others], v_cache_ref.view(-1, kv_heads, head_dim)[others])


def test_rope_position_zero_is_identity(kernels):
    """Position 0 rotates by angle 0: q and k come back exactly as they were."""
    heads, kv_heads, head_dim = 2, 1, 8
    rope = torch.view_as_real(precompute_freqs_cis(head_dim, 4, 10000.0, False))
    qkv = torch.randn(1, (heads + 2 * kv_heads) * head_dim, generator=gen(1))
    before = qkv.clone()
    caches = torch.zeros(2, 2, kv_heads, head_dim), torch.zeros(2, 2, kv_heads, head_dim)
    kernels.rope_and_cache_write(qkv, heads, kv_heads, head_dim, torch.tensor([0]), rope, torch.tensor([3]), *caches, 1)
    assert torch.equal(qkv, before)
    assert torch.equal(caches[0][1, 1], before[0, heads * head_dim : (heads + 1) * head_dim].view(1, head_dim))
    assert torch.equal(caches[1][1, 1], before[0, (heads + 1) * head_dim :].view(1, head_dim))


# bfloat16 results below float32's normal range keep torch's rounding (the C kernels' hardware
# conversion, vcvtneps2bf16, would flush them to zero), in cases whose arithmetic is exact
BF16_DENORMALS = torch.arange(1, 128, dtype=torch.int16).view(torch.bfloat16)  # every positive one
BF16_DENORMALS = torch.cat([BF16_DENORMALS, -BF16_DENORMALS])


def test_silu_mul_bf16_denormals(kernels):
    """SiLU of a denormal is half of it, times up = 1: one rounding, torch's."""
    gate_up = torch.ones(2, 2 * 160, dtype=torch.bfloat16)
    gate_up[:, :127], gate_up[:, 127:160] = BF16_DENORMALS[:127], BF16_DENORMALS[127:160]
    out = torch.empty(2, 160, dtype=torch.bfloat16)
    kernels.silu_mul(gate_up, out, THREADS)
    assert torch.equal(out, F.silu(gate_up[:, :160]).mul(gate_up[:, 160:]))
    assert (out != 0).any()


def test_silu_mul_bf16_every_gate_value_matches_the_float32_kernel(kernels):
    """Every one of the 65536 bfloat16 gates (the AVX-512 build looks silu up in a table built from
    them): times up = 1, the bf16 kernel's bits are the float32 kernel's silu rounded once, NaN for NaN."""
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(1, -1)
    up = torch.ones_like(gate)
    out = torch.empty_like(gate)
    kernels.silu_mul(torch.cat([gate, up], 1), out, THREADS)
    out32 = torch.empty(gate.shape, dtype=torch.float32)
    kernels.silu_mul(torch.cat([gate, up], 1).float(), out32, THREADS)
    nan = gate.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out.view(torch.int16)[~nan], out32.bfloat16().view(torch.int16)[~nan])
    finite = gate.isfinite()  # torch's silu(-inf) is NaN (-inf * 0), the kernels' -inf
    assert_close(out[finite], F.silu(gate)[finite], torch.bfloat16)


def test_add_rms_norm_bf16_denormals(kernels):
    """Denormal residuals plus a zero delta stay; a tiny weight makes denormal outputs, zero only where torch's are."""
    dtype = torch.bfloat16
    residual = torch.randn(40, 576, generator=gen(11)).to(dtype)
    residual[:, ::3] = BF16_DENORMALS[: 576 // 3].repeat(40, 1)
    before = residual.clone()
    weight = torch.full((576,), 2.0**-130, dtype=dtype)
    out = torch.empty_like(residual)
    kernels.add_rms_norm(residual, torch.zeros_like(residual), weight, out, 1e-5, THREADS)
    assert torch.equal(residual, before)
    expected = rms_norm_reference(residual, weight, 1e-5)
    assert (expected.float().abs() < 1.1754944e-38).float().mean() > 0.9
    assert torch.equal(out == 0, expected == 0)
    assert_close(out.double() * 2.0**130, expected.double() * 2.0**130, dtype)  # in the normal range


def test_rope_bf16_denormals(kernels):
    """Position 0 rotates denormal q and k by angle 0: they come back exactly."""
    heads, kv_heads, head_dim = 9, 3, 64
    rope = torch.view_as_real(precompute_freqs_cis(head_dim, 4, 10000.0, False))
    qkv = BF16_DENORMALS.repeat(8)[: (heads + 2 * kv_heads) * head_dim].view(1, -1).clone()
    before = qkv.clone()
    caches = tuple(torch.zeros(2, 2, kv_heads, head_dim, dtype=torch.bfloat16) for _ in range(2))
    kernels.rope_and_cache_write(qkv, heads, kv_heads, head_dim, torch.tensor([0]), rope, torch.tensor([3]), *caches, 1)
    assert torch.equal(qkv, before)


SEQ_LENS = [1, 15, 16, 17, 100]
DECODE_ROWS = [8, 2, 5, 0, 7]  # in an output of 9 rows, not in order; rows 1, 3, 4, 6 are no decode's


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim", [(8, 2, 64), (9, 3, 128), (4, 4, 64), (8, 1, 128)], ids=lambda v: str(v)
)
def test_paged_decode_attention(kernels, dtype, heads, kv_heads, head_dim):
    g = gen(heads * 100 + kv_heads * 10 + head_dim)
    block_size, num_rows = 16, 9
    blocks_per_seq = [-(-n // block_size) for n in SEQ_LENS]
    max_blocks, num_blocks = max(blocks_per_seq), sum(blocks_per_seq) + 5
    # shuffled block ids: no sequence's blocks are adjacent or in order
    pool = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in blocks_per_seq:
        tables.append([pool.pop() for _ in range(n)] + [0] * (max_blocks - n))  # padded with 0, as the runner does
    block_tables = torch.tensor(tables, dtype=torch.int32)
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    rows = torch.tensor(DECODE_ROWS, dtype=torch.int64)

    k_cache, v_cache = nan_filled_caches(tables, SEQ_LENS, num_blocks, block_size, kv_heads, head_dim, dtype, g)
    width = (heads + 2 * kv_heads) * head_dim  # q rows strided by the whole qkv row
    qkv = torch.randn(num_rows, width, generator=g).to(dtype)
    out = torch.full((num_rows, heads * head_dim), 123.0, dtype=dtype)
    scale = head_dim**-0.5

    kernels.paged_decode_attention(qkv, out, rows, k_cache, v_cache, block_tables, seq_lens, heads, kv_heads, scale, THREADS)

    n_rep = heads // kv_heads
    for b, (row, n) in enumerate(zip(DECODE_ROWS, SEQ_LENS)):
        ids = torch.tensor(tables[b][: blocks_per_seq[b]])
        keys = k_cache[ids].reshape(-1, kv_heads, head_dim)[:n].double().repeat_interleave(n_rep, dim=1)
        values = v_cache[ids].reshape(-1, kv_heads, head_dim)[:n].double().repeat_interleave(n_rep, dim=1)
        q = qkv[row, : heads * head_dim].double().view(heads, head_dim)
        weights = (torch.einsum("hd,khd->hk", q, keys) * scale).softmax(-1)
        expected = torch.einsum("hk,khd->hd", weights, values).reshape(-1)
        assert_close(out[row].double(), expected, dtype)
    untouched = [r for r in range(num_rows) if r not in DECODE_ROWS]
    assert (out[untouched] == 123.0).all()


def three_sequences(dtype: torch.dtype, seed: int = 3):
    """qkv [3 rows], K/V caches [10 blocks of 16] and block tables of three sequences (60, 3 and 64
    keys over shuffled blocks); heads 4, kv_heads 2, head_dim 64."""
    g = gen(seed)
    heads, kv_heads, head_dim, block_size = 4, 2, 64, 16
    k_cache = torch.randn(10, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(10, block_size, kv_heads, head_dim, generator=g).to(dtype)
    qkv = torch.randn(3, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    tables = torch.tensor([[9, 3, 5, 1], [2, 0, 0, 0], [4, 6, 7, 8]], dtype=torch.int32)
    seq_lens = torch.tensor([60, 3, 64], dtype=torch.int32)
    return qkv, k_cache, v_cache, tables, seq_lens, heads, kv_heads, head_dim


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_attention_single_sequence_and_threads(kernels, dtype):
    """One sequence (the serial branch) and the same batch at 1 and 2 threads agree exactly."""
    qkv, k_cache, v_cache, tables, seq_lens, heads, kv_heads, head_dim = three_sequences(dtype)
    rows = torch.arange(3, dtype=torch.int64)
    outs = []
    for threads in (1, 2):
        out = torch.empty(3, heads * head_dim, dtype=dtype)
        kernels.paged_decode_attention(qkv, out, rows, k_cache, v_cache, tables, seq_lens, heads, kv_heads, 0.125, threads)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])  # one sequence per task: no reduction order depends on threads
    single = torch.empty(1, heads * head_dim, dtype=dtype)
    kernels.paged_decode_attention(
        qkv[2:], single, torch.zeros(1, dtype=torch.int64), k_cache, v_cache, tables[2:], seq_lens[2:], heads, kv_heads, 0.125, 2
    )  # fmt: skip
    assert torch.equal(single[0], outs[0][2])


# =========================================================================== the fused model
BLOCK_SIZE = 8
MAX_SEQ_LEN = 64
NUM_BLOCKS = 40


def build_model(checkpoint: Path, dtype: torch.dtype, kernels: ck.CpuKernels | None) -> Transformer:
    """What the executor builds on CPU: weights in dtype, packed (wq|wk|wv and w1|w3 fused), over
    the fused kernels (CpuKernelBackend; bfloat16 without oneDNN's bfloat16 on its interleaved
    copies) or, without kernels, torch ops (OneDnnBackend; TorchBackend where oneDNN lacks the dtype)."""
    packs = cpu_packing_available(dtype)
    if not packs and dtype != torch.bfloat16:
        pytest.skip(f"oneDNN packing of {dtype} unavailable here: the CPU backends need it")
    cpu = torch.device("cpu")
    if kernels is not None:
        backend = CpuKernelBackend(cpu, dtype, kernels)
    else:
        backend = OneDnnBackend(cpu, dtype) if packs else TorchBackend(cpu, dtype)
    return build_with(checkpoint, dtype, backend)


def build_with(checkpoint: Path, dtype: torch.dtype, backend: Backend) -> Transformer:
    spec = resolve_checkpoint(checkpoint, model_id="tiny", llama_model=TINY_DESCRIPTOR)
    state = {k: v.to(dtype).clone() for k, v in load_rank_state_dict(spec, 0, 1).items()}
    return Transformer.from_state_dict(spec.model_args, state, backend, max_seq_len=MAX_SEQ_LEN)


@pytest.fixture(scope="module", params=DTYPES, ids=["float32", "bfloat16"])
def fused_model(request, kernels, tiny_checkpoint):
    """(the model over the fused kernels, the same weights over torch ops)"""
    fused = build_model(tiny_checkpoint, request.param, kernels)
    assert isinstance(fused.backend, CpuKernelBackend) and fused.backend.kernels is kernels
    return fused, build_model(tiny_checkpoint, request.param, None)


def new_caches(model: Transformer):
    dtype = model.backend.dtype
    return allocate_kv_caches(model.params, 1, NUM_BLOCKS, BLOCK_SIZE, dtype=dtype, device=torch.device("cpu"))


class Allocator:
    """Block ids handed out shuffled, so no sequence's blocks are adjacent."""

    def __init__(self, seed: int) -> None:
        self.free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_table) * BLOCK_SIZE < num_tokens:
            seq.block_table.append(self.free.pop())


def step_inputs(seqs: list[Sequence], counts: list[int]) -> StepInputs:
    inputs, _ = build_step_inputs(ScheduledBatch(seqs, counts), BLOCK_SIZE)
    return dataclasses.replace(inputs, logits_indices=torch.arange(inputs.num_tokens))  # every row's logits


class TwoPaths:
    """One model's weights run through the fused kernels and through torch on two copies of the
    KV cache; every step's logits and caches compared."""

    def __init__(self, models: tuple[Transformer, Transformer]) -> None:
        self.model, self.torch_model = models
        self.dtype = self.model.backend.dtype
        self.fused_caches, self.torch_caches = new_caches(self.model), new_caches(self.model)
        self.alloc = Allocator(seed=1)

    def step(self, seqs: list[Sequence], counts: list[int]) -> torch.Tensor:
        for seq, count in zip(seqs, counts):
            self.alloc.grow(seq, seq.num_computed_tokens + count)
        inputs = step_inputs(seqs, counts)
        fused = self.model(inputs, self.fused_caches)
        plain = self.torch_model(inputs, self.torch_caches)
        assert fused.shape == plain.shape == (inputs.num_tokens, self.model.vocab_size)
        assert fused.isfinite().all()
        if self.dtype == torch.float32:
            torch.testing.assert_close(fused, plain, atol=1e-4, rtol=1e-4)
            for (kf, vf), (kt, vt) in zip(self.fused_caches, self.torch_caches):
                torch.testing.assert_close(kf, kt, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(vf, vt, atol=1e-5, rtol=1e-5)
        else:  # bf16: same roundings, other summation orders; a few ulps over two layers
            scale = float(plain.abs().max())
            assert float((fused - plain).abs().max()) < 0.03 * scale  # ~1% seen
            agree = (fused.argmax(-1) == plain.argmax(-1)).float().mean()
            assert agree >= 0.9, f"argmax agrees on {agree:.0%} of rows"  # 100% seen; near-ties may flip
            for (kf, vf), (kt, vt) in zip(self.fused_caches, self.torch_caches):
                assert_close(kf, kt, torch.bfloat16)
                assert_close(vf, vt, torch.bfloat16)
        # advance the sequences, appending the fused path's greedy token where a chunk completes one
        row = 0
        for seq, count in zip(seqs, counts):
            row += count
            seq.num_computed_tokens += count
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(int(fused[row - 1].argmax()))
        return fused


def make_seqs(vocab: int, lengths: list[int], seed: int) -> list[Sequence]:
    g = gen(seed)
    params = SamplingParams(temperature=0.0)
    return [Sequence(i, f"r{i}", torch.randint(0, vocab, (n,), generator=g).tolist(), n, params) for i, n in enumerate(lengths)]


def test_fused_forward_matches_torch_prefill_decode_mixed(fused_model):
    paths = TwoPaths(fused_model)
    vocab = fused_model[0].vocab_size
    seqs = make_seqs(vocab, [1, 7, 8, 9, 20, 30], seed=2)
    a, b, c, d, e, long = seqs

    # (a) prefill of several sequences (the 1-token prompt is attended as a decode, in between)
    paths.step([b, a, c, d, e], [7, 1, 8, 9, 20])
    # the long prompt's first chunk, next to decodes
    paths.step([a, long, c], [1, 12, 1])
    # (b) decode steps: every sequence decodes (the PagedDecodes fast path)
    for _ in range(3):
        paths.step([a, b, c, d, e], [1] * 5)
    # (c) mixed: decodes around a prefill chunk with a cached prefix of 12 tokens; the decode rows
    # are 0, 19 and 20, not contiguous
    paths.step([a, long, c, e], [1, 18, 1, 1])
    assert long.num_computed_tokens == 30
    paths.step([long, d, b], [1, 1, 1])  # the long sequence now decodes across its blocks too
    # a last chunk crossing a block boundary of a partially filled block, plus a decode
    more = make_seqs(vocab, [13], seed=3)[0]
    more.seq_id = 6
    paths.step([more], [5])
    paths.step([more, a], [8, 1])


@pytest.mark.parametrize(
    "dtype, cpu_kernels, expected",
    [("float32", True, CpuKernelBackend), ("float32", False, OneDnnBackend), ("float64", True, TorchBackend)],
)
def test_backend_selection(kernels, dtype, cpu_kernels, expected):
    """The fused kernels where they build and the dtype has them; oneDNN alone when they are off;
    torch ops for what neither runs (float64)."""
    if expected is not TorchBackend and not cpu_packing_available(getattr(torch, dtype)):
        pytest.skip("oneDNN cannot run this dtype here")
    backend = select_backend(EngineConfig(dtype=dtype, cpu_kernels=cpu_kernels), torch.device("cpu"))
    assert type(backend) is expected and backend.dtype == getattr(torch, dtype)


# =========================================================================== index guards
@pytest.fixture(scope="module")
def model32(kernels, tiny_checkpoint):
    return build_model(tiny_checkpoint, torch.float32, kernels)


def decode_batch(vocab: int) -> tuple[list[Sequence], StepInputs]:
    """Two sequences decoding their 11th and 13th token (two blocks each), shuffled blocks."""
    seqs = make_seqs(vocab, [11, 13], seed=4)
    alloc = Allocator(seed=5)
    for seq in seqs:
        alloc.grow(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens - 1
    return seqs, step_inputs(seqs, [1, 1])


def assert_rejected(model: Transformer, inputs: StepInputs, what: str) -> None:
    caches = new_caches(model)
    for k, v in caches:
        k.normal_(generator=gen(6))
        v.normal_(generator=gen(7))
    before = [(k.clone(), v.clone()) for k, v in caches]
    with pytest.raises(ValueError, match=what):
        model(inputs, caches)
    for (k, v), (k0, v0) in zip(caches, before):  # raised before any kernel wrote a slot
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_valid_decode_batch_runs(model32):
    _, inputs = decode_batch(model32.vocab_size)
    assert model32(inputs, new_caches(model32)).isfinite().all()


@pytest.mark.parametrize("slot", [NUM_BLOCKS * BLOCK_SIZE, NUM_BLOCKS * BLOCK_SIZE + 1000, -1])
def test_out_of_range_slot_raises(model32, slot):
    _, inputs = decode_batch(model32.vocab_size)
    slots = inputs.slot_mapping.clone()
    slots[1] = slot
    assert_rejected(model32, dataclasses.replace(inputs, slot_mapping=slots), "KV slot")


@pytest.mark.parametrize("position", [MAX_SEQ_LEN, 10**6, -1])
def test_out_of_range_position_raises(model32, position):
    _, inputs = decode_batch(model32.vocab_size)
    positions = inputs.positions.clone()
    positions[0] = position
    assert_rejected(model32, dataclasses.replace(inputs, positions=positions), "position")


@pytest.mark.parametrize("block_id", [NUM_BLOCKS, -3])
def test_out_of_range_block_id_raises(model32, block_id):
    _, inputs = decode_batch(model32.vocab_size)
    tables = inputs.block_tables.clone()
    tables[1, 0] = block_id
    assert_rejected(model32, dataclasses.replace(inputs, block_tables=tables), "KV block id")


def test_out_of_range_slot_in_prefill_raises(model32):
    seqs = make_seqs(model32.vocab_size, [6], seed=8)
    Allocator(seed=9).grow(seqs[0], 6)
    inputs = step_inputs(seqs, [6])
    slots = inputs.slot_mapping.clone()
    slots[-1] = NUM_BLOCKS * BLOCK_SIZE
    assert_rejected(model32, dataclasses.replace(inputs, slot_mapping=slots), "KV slot")


def test_seq_len_beyond_block_table_raises(model32, tiny_checkpoint):
    """The torch path cannot run this batch (RuntimeError); the fused one must not read past the table."""
    _, inputs = decode_batch(model32.vocab_size)
    seq_lens = inputs.seq_lens.clone()
    seq_lens[0] = 3 * BLOCK_SIZE  # the table row has 2 blocks
    bad = dataclasses.replace(inputs, seq_lens=seq_lens)
    torch_model = build_model(tiny_checkpoint, torch.float32, None)
    with pytest.raises(RuntimeError):
        torch_model(bad, new_caches(torch_model))
    with pytest.raises(ValueError, match="decode length"):
        model32(bad, new_caches(model32))


def test_index_dtype_mismatch_raises(model32):
    """The C kernels read positions as int64: int32 positions must be refused, not misread."""
    _, inputs = decode_batch(model32.vocab_size)
    bad = dataclasses.replace(inputs, positions=inputs.positions.to(torch.int32))
    with pytest.raises(ValueError, match="contiguous torch.int64"):
        model32(bad, new_caches(model32))


def layout_fields(meta) -> list:
    """An attention layout as comparable values: its path and every index tensor the kernels read."""
    batched = meta.batched
    tensors = [getattr(batched, f.name) for f in dataclasses.fields(batched)] if batched is not None else []
    return [meta.path, meta.positions, meta.slot_mapping, len(meta.prefills), *tensors]


@pytest.mark.parametrize("paged", [False, True], ids=["paged_decode_attention", "paged_attention"])
def test_pure_decode_layout_from_list_bounds_equals_the_checked_one(fused_model, paged, monkeypatch):
    """A pure-decode step that build_step_inputs marked (StepInputs.decode_bounds) is laid out and
    checked without reducing its tensors: step by step through changing batches (sequences joining
    and leaving, a new block, a prefill chunk in between, a replaced field), its layout and logits
    equal those of the same step with the marks dropped (the checks on the tensors)."""
    model = fused_model[0]
    if paged:  # the decodes in one paged_attention call, as on AMX tiles at 2+ decodes per thread
        monkeypatch.setattr(model.backend.kernels, "paged_attention_takes_decodes", lambda dtype: True)
    marked_caches, plain_caches = new_caches(model), new_caches(model)
    alloc = Allocator(seed=11)
    a, b, c, d = make_seqs(model.vocab_size, [3, 7, 8, 15], seed=12)
    steps = [([a, b], [3, 7]), ([a, b], [1, 1]), ([a, b], [1, 1]), ([a, b, c], [1, 1, 8]), ([a, b, c], [1, 1, 1]),
             ([b, c], [1, 1]), ([c, b, a], [1, 1, 1]), ([d], [15]), ([d, a], [1, 1]), ([d, a], [1, 1])]  # fmt: skip
    marked_steps = 0
    for seqs, counts in steps:
        for seq, count in zip(seqs, counts):
            alloc.grow(seq, seq.num_computed_tokens + count)  # b's 8th token and d's 16th+ need new blocks
        inputs, _ = build_step_inputs(ScheduledBatch(seqs, counts), BLOCK_SIZE)
        pure = all(count == 1 for count in counts)
        assert (inputs.decode_bounds is not None and inputs.decode_bounds.describes(inputs)) == pure
        marked_steps += pure
        plain = dataclasses.replace(inputs, decode_bounds=None)
        metas = [model.backend.attention_metadata(x, model.freqs_cis, marked_caches[0]) for x in (inputs, plain)]
        for got, want in zip(*(layout_fields(meta) for meta in metas), strict=True):
            assert torch.equal(got, want) if isinstance(got, torch.Tensor) else got == want
        logits = model(inputs, marked_caches)
        assert torch.equal(logits, model(plain, plain_caches))
        for seq, count, row_logits in zip(seqs, counts, logits, strict=True):  # every sequence samples here
            seq.num_computed_tokens += count
            seq.token_ids.append(int(row_logits.argmax()))
    assert marked_steps == 7
    # a field replaced after build_step_inputs: its marks no longer describe the step
    inputs, _ = build_step_inputs(ScheduledBatch([d, a], [1, 1]), BLOCK_SIZE)
    for name in ("positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc", "logits_indices"):
        assert not inputs.decode_bounds.describes(dataclasses.replace(inputs, **{name: getattr(inputs, name).clone()}))


def test_out_of_range_in_a_marked_pure_decode_step_raises(model32):
    """The checks made from build_step_inputs' lists refuse what the tensor checks refuse: a block id
    past the pool in a table, and a position past the rope table."""
    seqs, _ = decode_batch(model32.vocab_size)
    seqs[1].block_table[0] = NUM_BLOCKS  # not the block this step writes: only the table check sees it
    inputs, _ = build_step_inputs(ScheduledBatch(seqs, [1, 1]), BLOCK_SIZE)
    assert inputs.decode_bounds is not None and inputs.decode_bounds.describes(inputs)
    assert_rejected(model32, inputs, "KV block id")

    long = make_seqs(model32.vocab_size, [MAX_SEQ_LEN + 1], seed=13)[0]
    Allocator(seed=14).grow(long, MAX_SEQ_LEN + 1)
    long.num_computed_tokens = MAX_SEQ_LEN
    inputs, _ = build_step_inputs(ScheduledBatch([long], [1]), BLOCK_SIZE)
    assert inputs.decode_bounds is not None
    assert_rejected(model32, inputs, "position")


# =========================================================================== building and falling back
def fake_compiler(tmp_path: Path, *, version_ok: bool = True) -> str:
    """A `cc` that answers --version but fails every compile (or fails both)."""
    script = tmp_path / "fake-cc"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = --version ]; then echo "fake-cc 1.0"; exit {0 if version_ok else 3}; fi\n'
        'echo "fake-cc: error: cannot compile" >&2\nexit 1\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


@pytest.mark.parametrize("compiler", ["false", "/nonexistent/cc", "fake-fails-compile", "fake-fails-version"])
def test_failed_build_returns_none_and_warns(tmp_path, monkeypatch, caplog, compiler):
    if compiler.startswith("fake"):
        compiler = fake_compiler(tmp_path, version_ok=compiler == "fake-fails-compile")
    monkeypatch.setenv("CC", compiler)
    cache_dir = tmp_path / "cache"
    with caplog.at_level(logging.WARNING, logger="engine.kernels.cpu"):
        assert ck.load_cpu_kernels.__wrapped__(cache_dir) is None
    assert "fused CPU kernels unavailable" in caplog.text
    if cache_dir.exists():  # made only once the key is known: no .so, and no temporary build dir left
        assert list(cache_dir.iterdir()) == []


def test_cached_loader_falls_back_through_env(tmp_path, monkeypatch, caplog):
    """load_cpu_kernels() itself (functools.cache'd), with CC and the cache dir from the environment."""
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv(build.CACHE_DIR_ENV, str(tmp_path / "cache"))
    ck.load_cpu_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="engine.kernels.cpu"):
            assert ck.load_cpu_kernels() is None
        assert "fused CPU kernels unavailable" in caplog.text
    finally:
        ck.load_cpu_kernels.cache_clear()


def test_no_kernels_keeps_the_torch_path(tiny_checkpoint):
    model = build_model(tiny_checkpoint, torch.float32, None)
    assert type(model.backend) is OneDnnBackend
    seqs = make_seqs(model.vocab_size, [5, 1], seed=10)
    alloc = Allocator(seed=11)
    for seq in seqs:
        alloc.grow(seq, seq.num_tokens)
    logits = model(step_inputs(seqs, [5, 1]), new_caches(model))
    assert logits.shape == (6, model.vocab_size) and logits.isfinite().all()


def test_build_reuses_the_cached_library(tmp_path, monkeypatch):
    if ck.load_cpu_kernels() is None:
        pytest.skip("no working C compiler here")
    cache_dir = tmp_path / "cache"
    first = build.build_library(build.CPU_KERNELS, cache_dir)
    assert first.parent == cache_dir and first.name.startswith("cpu_kernels-") and first.suffix == ".so"
    mtime = first.stat().st_mtime_ns
    assert [p.name for p in cache_dir.iterdir()] == [first.name]  # no temporary build dir left behind

    calls: list[list[str]] = []
    real_run = subprocess.run

    def recording_run(cmd, *args, **kwargs):
        calls.append(list(cmd))
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", recording_run)
    second = build.build_library(build.CPU_KERNELS, cache_dir)
    assert second == first and second.stat().st_mtime_ns == mtime
    assert all("--version" in cmd for cmd in calls), f"recompiled: {calls}"  # only the key's version query
    assert ck.CpuKernels(ctypes.CDLL(str(second))) is not None


def test_build_key_depends_on_the_compiler(tmp_path):
    if ck.load_cpu_kernels() is None:
        pytest.skip("no working C compiler here")
    cc = build.c_compiler()
    assert build.build_key(build.CPU_KERNELS, cc) == build.build_key(build.CPU_KERNELS, cc)
    assert build.build_key(build.CPU_KERNELS, fake_compiler(tmp_path)) != build.build_key(build.CPU_KERNELS, cc)


# =========================================================================== the executor's switch
def make_executor(checkpoint: Path, dtype: str, **kw) -> WorkerGroup:
    spec = resolve_checkpoint(checkpoint, model_id="tiny", llama_model=TINY_DESCRIPTOR)
    config = EngineConfig(dtype=dtype, block_size_tokens=BLOCK_SIZE, max_batch_size=4, **kw)
    return WorkerGroup(spec, config, max_seq_len=MAX_SEQ_LEN)


def test_executor_cpu_kernels_switch(kernels, tiny_checkpoint):
    on = make_executor(tiny_checkpoint, "float32")
    off = make_executor(tiny_checkpoint, "float32", cpu_kernels=False)
    try:
        assert EngineConfig().cpu_kernels is True
        assert type(on._shard.model.backend) is CpuKernelBackend
        assert type(off._shard.model.backend) is OneDnnBackend
        seqs = make_seqs(on.vocab_size, [9, 1, 4], seed=12)
        alloc = Allocator(seed=13)
        for seq in seqs:
            alloc.grow(seq, seq.num_tokens)
        inputs = step_inputs(seqs, [9, 1, 4])
        torch.testing.assert_close(on.execute(inputs), off.execute(inputs), atol=1e-4, rtol=1e-4)
    finally:
        on.shutdown()
        off.shutdown()


def test_executor_float64_keeps_torch_path(kernels, tiny_checkpoint):
    executor = make_executor(tiny_checkpoint, "float64")
    try:
        assert type(executor._shard.model.backend) is TorchBackend
    finally:
        executor.shutdown()


# =========================================================================== the kernel cache's safety (issue 16)
def test_cache_dir_is_created_private(tmp_path):
    if ck.load_cpu_kernels() is None:
        pytest.skip("no working C compiler here")
    cache_dir = tmp_path / "fresh" / "kernels"
    build.build_library(build.CPU_KERNELS, cache_dir)
    assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o700


@pytest.mark.parametrize("what", ["dir", "library"])
def test_writable_by_others_cache_is_refused(tmp_path, monkeypatch, caplog, what):
    monkeypatch.setattr(build, "build_key", lambda library, cc: "fixedkey")
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir(mode=0o700)
    planted = cache_dir / "cpu_kernels-fixedkey.so"
    planted.write_bytes(b"not a library")  # whoever could write here could run code in the server
    (cache_dir if what == "dir" else planted).chmod(0o777 if what == "dir" else 0o666)
    with caplog.at_level(logging.WARNING, logger="engine.kernels.cpu"):
        assert ck.load_cpu_kernels.__wrapped__(cache_dir) is None
    assert "group- or world-writable" in caplog.text


def test_library_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "build_key", lambda library, cc: "fixedkey")
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir(mode=0o700)
    (cache_dir / "cpu_kernels-fixedkey.so").write_bytes(b"x")
    real_getuid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real_getuid + 1)  # as if another user had made them
    with pytest.raises(OSError, match="owned by uid"):
        build.build_library(build.CPU_KERNELS, cache_dir)


@pytest.mark.parametrize("cpuinfo,expected", [
    ("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2\n\nprocessor\t: 1\nflags\t\t: fpu\n", "flags\t\t: fpu avx2"),
    ("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd sve\nCPU part\t: 0xd0c\n", "Features\t: fp asimd sve"),
    ("processor\t: 0\nhart\t\t: 1\nisa\t\t: rv64imafdc\n", "isa\t\t: rv64imafdc"),
    ("processor\t: 0\ncpu\t\t: POWER9\nclock\t\t: 2.2GHz\ncpu MHz\t: 2200\n", "cpu\t\t: POWER9\nclock\t\t: 2.2GHz"),
])
def test_build_key_reads_the_cpu_feature_line_on_every_architecture(cpuinfo, expected):
    assert build.cpu_feature_line(cpuinfo) == expected


# =========================================================================== prebuilt per x86-64 level (the image)
V2 = set(build.X86_LEVELS["x86-64-v2"])
V3 = V2 | build.X86_LEVELS["x86-64-v3"]


@pytest.mark.parametrize("flags, level", [
    (set(), None),
    (V2 - {"popcnt"}, None),
    (V2, "x86-64-v2"),
    (V3 - {"fma"}, "x86-64-v2"),
    (V3, "x86-64-v3"),
    (V3 | build.X86_LEVELS["x86-64-v4"], "x86-64-v4"),
    (V2 | build.X86_LEVELS["x86-64-v4"], "x86-64-v2"),  # AVX-512 without AVX2 cannot be v4
    (V3 | build.X86_LEVELS["x86-64-v4"] | {"avx512_bf16"}, "x86-64-v4-bf16"),
    (V3 | {"avx512_bf16"}, "x86-64-v3"),
])  # fmt: skip
def test_x86_level_from_cpu_flags(flags, level):
    assert build.x86_level(flags) == level


def test_prebuilt_library_is_found_and_computes_like_torch(tmp_path, monkeypatch):
    """The lowest level runs on any x86-64 CI machine; a stale build (other source) is never picked."""
    if build.cpu_level() is None:
        pytest.skip("not an x86-64-v2 CPU")
    try:
        (built,) = build.prebuild(tmp_path, ["x86-64-v2"], [build.CPU_KERNELS])
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"no working C compiler here: {exc}")
    (tmp_path / built.name.replace("-x86-64-v2", "-x86-64-v4").replace(build.source_key(build.CPU_KERNELS), "0" * 16)).write_bytes(b"stale")
    assert build.find_prebuilt(tmp_path, build.CPU_KERNELS) == built
    kernels = ck.CpuKernels(ctypes.CDLL(str(built)))
    residual, weight = torch.randn(3, 64, generator=gen(5)), torch.randn(64, generator=gen(6))
    out = torch.empty_like(residual)
    expected = residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-5) * weight
    kernels.add_rms_norm(residual, None, weight, out, 1e-5, THREADS)
    assert_close(out, expected, torch.float32)


def test_portable_build_gives_the_native_builds_bits(kernels, tmp_path):
    """The x86-64-v2 build (portable loops: silu computed, not looked up; argmax in one scalar pass)
    against this machine's build: bfloat16 SiLU-mul of every gate value times random up, bfloat16
    add+RMSNorm, and the greedy argmax of both dtypes, bit for bit."""
    if build.cpu_level() is None:
        pytest.skip("not an x86-64-v2 CPU")
    try:
        (built,) = build.prebuild(tmp_path, ["x86-64-v2"], [build.CPU_KERNELS])
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"no working C compiler here: {exc}")
    portable, g = ck.CpuKernels(ctypes.CDLL(str(built))), gen(9)
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(64, 1024)
    gate_up = torch.cat([gate, (4 * torch.randn(64, 1024, generator=g)).bfloat16()], 1)
    residual = (3 * torch.randn(37, 576, generator=g)).bfloat16()
    delta, weight = torch.randn(37, 576, generator=g).bfloat16(), torch.randn(576, generator=g).bfloat16()
    logits = torch.randint(-3, 3, (33, 1000), generator=g).float()
    logits[3, 7], logits[5, 9], logits[6] = math.nan, math.inf, -0.0
    results = []
    for library in (kernels, portable):
        silu = torch.empty(64, 1024, dtype=torch.bfloat16)
        library.silu_mul(gate_up, silu, THREADS)
        res, normed = residual.clone(), torch.empty_like(residual)
        library.add_rms_norm(res, delta, weight, normed, 1e-5, THREADS)
        argmax = [library.argmax_rows(logits.to(dtype), THREADS) for dtype in DTYPES]
        results.append((silu.view(torch.int16), res.view(torch.int16), normed.view(torch.int16), str(argmax)))
    for native, plain in zip(*results):
        assert torch.equal(native, plain) if isinstance(native, torch.Tensor) else native == plain


@pytest.mark.parametrize("level", ["x86-64-v3", "x86-64-v4-silu-gather"])
def test_silu_mul_gives_the_native_builds_bits_at_each_level(kernels, tmp_path, level):
    """SiLU-mul of the AVX2 build (8-lane gathers; float32: GCC's vectorized loop) and of the AVX-512
    build that gathers where this CPU's reads the table by loads (AMD), against this machine's build:
    bfloat16 every gate value times random up, float32 values across the exponent range (the clamps,
    denormals, infinities, NaN) times random up, bit for bit."""
    other, g = cpu_kernels_for_level(tmp_path, level), gen(13)
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(64, 1024)
    gate_up = torch.cat([gate, (4 * torch.randn(64, 1024, generator=g)).bfloat16()], 1)[:, 3:-2]  # rows of 1019 + 1019
    gate32 = torch.randint(-(2**31), 2**31 - 1, (64, 1000), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    gate32[0, :8] = torch.tensor([-200.0, 200.0, -88.5, 87.5, math.inf, -math.inf, math.nan, -0.0])
    gate32[1:] = torch.where(gate32[1:].abs() < 1e-30, gate32[1:], torch.randn(63, 1000, generator=g) * 20)
    gate_up32 = torch.cat([gate32, torch.randn(64, 1000, generator=g)], 1)
    for inputs in (gate_up, gate_up32):
        results = []
        for library in (kernels, other):
            out = torch.empty(inputs.shape[0], inputs.shape[1] // 2, dtype=inputs.dtype)
            library.silu_mul(inputs.contiguous(), out, THREADS)
            results.append(out.view(torch.int16 if inputs.dtype == torch.bfloat16 else torch.int32))
        assert torch.equal(*results), inputs.dtype


def test_the_bf16_level_is_built_with_avx512_bf16(tmp_path):
    """The image's best build on an AVX512_BF16 CPU has the bfloat16 pairs kernel (vdpbf16ps), which a
    plain x86-64-v4 build lacks, and computes the same one-row linear as torch."""
    if build.cpu_level() != "x86-64-v4-bf16":
        pytest.skip("not an AVX-512 CPU with AVX512_BF16")
    try:
        built = {level: build.prebuild(tmp_path, [level], [build.CPU_KERNELS])[0] for level in ("x86-64-v4", "x86-64-v4-bf16")}
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"no working C compiler here: {exc}")
    assert build.find_prebuilt(tmp_path, build.CPU_KERNELS) == built["x86-64-v4-bf16"]
    assert not ck.CpuKernels(ctypes.CDLL(str(built["x86-64-v4"]))).has_bf16_pairs
    kernels = ck.CpuKernels(ctypes.CDLL(str(built["x86-64-v4-bf16"])))
    assert kernels.has_bf16_pairs
    weight = torch.randn(64, 96, generator=gen(7)).to(torch.bfloat16)
    x = torch.randn(1, 96, generator=gen(8)).to(torch.bfloat16)
    one_row = kernels.bind_interleaved(kernels.interleave(weight))
    assert_close(one_row(x, THREADS), F.linear(x.float(), weight.float()).to(torch.bfloat16), torch.bfloat16)


def test_every_source_is_prebuilt_and_loaded_from_the_image_dir(tmp_path, monkeypatch):
    """The image has no compiler: the quantized kernels and the compiled decode step come prebuilt
    too, and library_path takes them from LLAMASERVE_PREBUILT_KERNELS instead of building."""
    if build.cpu_level() is None:
        pytest.skip("not an x86-64-v2 CPU")
    try:
        built = build.prebuild(tmp_path, ["x86-64-v2"])
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"no working C compiler here: {exc}")
    assert {path.name.split("-")[0] for path in built} == {"amx_linear", "cpu_kernels", "decode_step", "quant_kernels"}
    monkeypatch.setenv(build.PREBUILT_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent-compiler")  # building instead would fail
    for library in build.LIBRARIES:
        path = build.library_path(library, tmp_path / "cache")
        assert path in built
        ctypes.CDLL(str(path))


def test_every_c_source_is_in_one_library():
    """A C file no library lists would be neither built nor prebuilt."""
    listed = [source for library in build.LIBRARIES for source in library.sources]
    assert sorted(listed) == sorted(path.name for path in build.CSRC_DIR.glob("*.c"))
