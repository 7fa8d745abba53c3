"""Quantized CPU linears (engine/quant/linear.py, engine/kernels/csrc/quant_kernels.c): every format and
path against x @ dequantize(W)^T in float64 (float32: equal up to summation order; bfloat16:
within its rounding), the C kernels against the torch fallback, odd widths, batch shapes, the
builds of each x86-64 level this CPU runs (AVX2 intrinsics, portable loops), path choice by build,
model-parallel shards and resident bytes."""

from __future__ import annotations

import pytest
import torch

from engine.quant.formats import quantize, quantize_int4, quantize_int8
from engine.kernels.quant import load_quant_kernels
from engine.quant.linear import NARROW_SIMD_POLICY, QuantLinear, policy_for
from tests.engine.kernel_levels import quant_kernels_for_level

FORMATS = ["int8", "int4", "fp8"]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kernels():
    loaded = load_quant_kernels()
    if loaded is None:
        pytest.skip("quantized-linear C kernels could not be built here (no C compiler?); torch path only")
    return loaded


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def reference(x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
    return x.double() @ layer.weight_q.dequantize(torch.float64).T


def assert_matches(actual: torch.Tensor, x: torch.Tensor, layer: QuantLinear) -> None:
    """float32: summation order only (1e-5 of the output scale); bfloat16: output rounding plus, on
    the dequant_mm path, the bf16 rounding of the dequantized weight (as a bf16 model's weights are)."""
    expected = reference(x, layer)
    assert actual.dtype == x.dtype and actual.shape == expected.shape
    scale = float(expected.abs().max()) + 1e-12
    tol = 2e-6 if x.dtype == torch.float32 else 8e-3
    err = float((actual.double() - expected).abs().max()) / scale
    assert err <= tol, err


def layer_for(fmt: str, rows: int, cols: int, kernels, seed: int = 0, **kw) -> QuantLinear:
    w = torch.randn(rows, cols, generator=gen(seed)) * 0.05
    return QuantLinear(quantize(w, fmt, **kw), kernels)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["kernel", "dequant_mm", "torch"])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 13])
def test_paths_match_dequantized_reference(kernels, fmt: str, dtype: torch.dtype, path: str, rows: int) -> None:
    layer = layer_for(fmt, 80, 192, kernels, seed=rows)
    x = torch.randn(rows, 192, generator=gen(rows + 100)).to(dtype)
    assert_matches(layer.run(x, path), x, layer)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_symmetric_and_group_sizes(kernels, dtype: torch.dtype) -> None:
    w = torch.randn(40, 256, generator=gen(3))
    x = torch.randn(5, 256, generator=gen(4)).to(dtype)
    for q in (quantize_int4(w, mins=False), quantize_int4(w, group_size=64), quantize_int4(w, group_size=256, mins=False), quantize_int8(w, group_size=64)):
        layer = QuantLinear(q, kernels)
        for path in ("kernel", "dequant_mm", "torch"):
            assert_matches(layer.run(x, path), x, layer)



@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [576, 1536])
def test_one_row_kernel_every_group_layout(kernels, dtype: torch.dtype, cols: int) -> None:
    """Decode at batch 1 takes the kernel's one-row path (block dots scaled once per block, the
    offsets as one dot with per-group sums of x): Q4_1, Q4_0, wider groups, int8 per group and per
    row, with group counts that are not a multiple of 16 (18 and 48 groups at group 32)."""
    w = torch.randn(48, cols, generator=gen(cols)) * 0.05
    x = torch.randn(1, cols, generator=gen(cols + 1)).to(dtype)
    formats = (quantize_int4(w), quantize_int4(w, mins=False), quantize_int4(w, group_size=64), quantize_int4(w, group_size=192, mins=False),
               quantize_int8(w, group_size=32), quantize_int8(w))  # fmt: skip
    for q in formats:
        layer = QuantLinear(q, kernels)
        assert_matches(layer.run(x, "kernel"), x, layer)


def test_kernel_vs_torch_fallback(kernels) -> None:
    """The C kernel and the torch-only module (no kernels) agree up to summation order."""
    for fmt in FORMATS:
        w = torch.randn(96, 320, generator=gen(5))
        with_c, without = QuantLinear(quantize(w, fmt), kernels), QuantLinear(quantize(w, fmt), None)
        x = torch.randn(4, 320, generator=gen(6))
        assert without.path(4, torch.float32) == "torch"
        torch.testing.assert_close(with_c(x), without(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("cols", [1, 33, 100, 17 * 32 + 5])
def test_per_row_formats_take_any_width(kernels, fmt: str, cols: int) -> None:
    """int8 (per row) and fp8 have no groups: widths that are not a multiple of 32 run (kernel tail)."""
    layer = layer_for(fmt, 24, cols, kernels)
    for rows in (1, 9):
        x = torch.randn(rows, cols, generator=gen(cols))
        assert_matches(layer.run(x, "kernel"), x, layer)
        assert_matches(layer.run(x, "dequant_mm"), x, layer)


@pytest.mark.parametrize("fmt", FORMATS)
def test_forward_shapes_and_path_choice(kernels, fmt: str) -> None:
    layer = layer_for(fmt, 64, 128, kernels)
    x = torch.randn(2, 3, 128, generator=gen(1))
    y = layer(x)
    assert y.shape == (2, 3, 64)
    assert_matches(y.reshape(6, 64), x.reshape(6, 128), layer)
    assert layer.path(1, torch.float32) == "kernel"
    assert layer.path(64, torch.float32) == "dequant_mm"
    assert layer.path(64, torch.bfloat16) == "dequant_mm"
    assert layer.path(1, torch.bfloat16) == ("aten_int8" if fmt == "int8" else "kernel")
    with pytest.raises(ValueError, match="takes 128"):
        layer(torch.randn(1, 96))


def test_aten_int8_path_same_numbers(kernels) -> None:
    """torch's bf16 int8 op runs on our codes with our (bf16-exact) per-row scales: same values."""
    layer = layer_for("int8", 64, 256, kernels)
    assert layer._aten_scales is not None
    x = torch.randn(3, 256, generator=gen(2)).to(torch.bfloat16)
    assert_matches(layer.run(x, "aten_int8"), x, layer)
    assert_matches(layer(x), x, layer)
    grouped = QuantLinear(quantize_int8(torch.randn(8, 64), group_size=32), kernels)  # Q8_0-like: not eligible
    assert grouped._aten_scales is None and grouped.path(1, torch.bfloat16) == "kernel"


@pytest.mark.parametrize("fmt", FORMATS)
def test_model_parallel_shards(kernels, fmt: str) -> None:
    """Column-parallel (split rows): shards' outputs concatenate to the full output; row-parallel
    (split input columns at group boundaries): shards' partial outputs sum to it."""
    layer = layer_for(fmt, 64, 256, kernels)
    x = torch.randn(3, 256, generator=gen(9))
    full = layer(x).double()
    by_rows = [QuantLinear(layer.weight_q.rows(r, r + 32), kernels) for r in (0, 32)]
    torch.testing.assert_close(torch.cat([s(x) for s in by_rows], dim=1).double(), full, atol=0, rtol=0)
    by_cols = [QuantLinear(layer.weight_q.cols(c, c + 128), kernels) for c in (0, 128)]
    partial = sum(s(x[:, c : c + 128]).double() for s, c in zip(by_cols, (0, 128)))
    torch.testing.assert_close(partial, full, atol=1e-5 * float(full.abs().max()), rtol=0)


@pytest.mark.parametrize("fmt,factor_bf16", [("int8", 2 * 576 / (576 + 4)), ("int4", 16 / 5), ("fp8", 2 * 576 / (576 + 4))])
def test_resident_bytes_drop(kernels, fmt: str, factor_bf16: float) -> None:
    """resident_bytes() counts codes and scales only; the module keeps no float weight."""
    w = torch.randn(1536, 576, generator=gen(0))
    layer = QuantLinear(quantize(w, fmt), kernels)
    bf16_bytes = w.numel() * 2
    extra = 1536 * 2 if fmt == "int8" else 0  # the bf16 copy of the per-row scales aten's op takes
    assert layer.resident_bytes() == pytest.approx(bf16_bytes / factor_bf16 + extra)
    floats = [t for t in vars(layer).values() if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() >= w.numel() // 16]
    assert not floats and not list(layer.parameters()) and not list(layer.buffers())


def test_empty_batch(kernels) -> None:
    layer = layer_for("int4", 32, 64, kernels)
    assert layer(torch.zeros(0, 64)).shape == (0, 32)


def test_failed_build_falls_back_to_torch(tmp_path, monkeypatch) -> None:
    """No working compiler: load_quant_kernels() is None (logged) and the module runs its torch path."""
    from engine.kernels import quant as qk

    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc (fake) 1.0'\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    qk.load_quant_kernels.cache_clear()
    try:
        assert qk.load_quant_kernels(tmp_path / "cache") is None
    finally:
        qk.load_quant_kernels.cache_clear()
    layer = layer_for("int4", 16, 64, None)
    x = torch.randn(2, 64, generator=gen(0))
    assert layer.path(2, torch.float32) == "torch"
    assert_matches(layer(x), x, layer)


def test_quant_kernel_build_key_covers_its_source() -> None:
    from engine.kernels import build
    from engine.kernels import quant as qk

    if qk.load_quant_kernels() is None:
        pytest.skip("no working C compiler here")
    cc = build.c_compiler()
    assert build.build_key(build.QUANT_KERNELS, cc) != build.build_key(build.CPU_KERNELS, cc)


def test_kernel_same_bits_for_any_thread_count(kernels) -> None:
    """Each output row is summed by one thread in a fixed order: the OpenMP team size changes nothing."""
    layer = layer_for("int4", 512, 256, kernels)  # 512 x 256 reaches the parallel threshold
    x = torch.randn(3, 256, generator=gen(12))
    assert torch.equal(kernels.linear(x, layer.weight_q, 1), kernels.linear(x, layer.weight_q, 2))


LEVEL_SIMD_BITS = {"x86-64-v2": 128, "x86-64-v3": 256}  # the portable loops; the AVX2 intrinsics


@pytest.mark.parametrize("level", ["native", "x86-64-v3", "x86-64-v2"])
def test_every_build_level_against_the_reference(kernels, tmp_path, level: str) -> None:
    """native: the build the server loads; x86-64-v3: the AVX2 intrinsics (Zen 2); x86-64-v2: the
    portable loops. Every format and group layout, row counts that take each accumulator layout
    (1-2 rows: four chains, 3-4: two, 5-8: one; 9 and 13: a full tile and a partial one), widths
    with a short last block (int8 / fp8), an odd number of output rows, both dtypes; kernel and
    dequant_mm against the float64 reference, the dequantizer bit for bit against torch's."""
    built = kernels if level == "native" else quant_kernels_for_level(tmp_path, level)
    if level != "native":
        assert built.simd_bits == LEVEL_SIMD_BITS[level]
    w = lambda cols, seed: torch.randn(37, cols, generator=gen(seed)) * 0.05  # noqa: E731
    weights = [quantize_int8(w(100, 1)), quantize_int8(w(17 * 32 + 5, 2)), quantize_int8(w(192, 3), group_size=64),
               quantize(w(100, 4), "fp8"), quantize(w(17 * 32 + 5, 5), "fp8"), quantize_int4(w(576, 6)),
               quantize_int4(w(192, 7), mins=False), quantize_int4(w(256, 8), 64)]  # fmt: skip
    for q in weights:
        layer = QuantLinear(q, built)
        for dtype in DTYPES:
            for rows in (1, 2, 3, 4, 5, 8, 9, 13):
                x = torch.randn(rows, q.in_features, generator=gen(rows)).to(dtype)
                assert_matches(layer.run(x, "kernel"), x, layer)
            assert_matches(layer.run(x, "dequant_mm"), x, layer)
            tile = torch.empty(37, q.in_features, dtype=dtype)
            built.dequantize(q, 0, 37, tile, 1)
            assert torch.equal(tile, q.dequantize(dtype)), (q.format, q.in_features, dtype)


class _Build:
    """Stands in for QuantKernels where only its vector width matters (the path choice)."""

    def __init__(self, simd_bits: int) -> None:
        self.simd_bits = simd_bits

    def bind(self, weight):
        return None


@pytest.mark.parametrize("fmt", FORMATS)
def test_path_cutoffs_follow_the_loaded_build(fmt: str) -> None:
    """AVX-512 builds: dequant_mm from 16 rows, bfloat16 multiplied in bfloat16; narrower builds
    (AVX2, portable): the kernel up to 31 rows, bfloat16 dequantized to float32 for the matmul."""
    q = quantize(torch.randn(64, 128, generator=gen(3)), fmt)
    wide, narrow = QuantLinear(q, _Build(512)), QuantLinear(q, _Build(256))
    assert policy_for(_Build(128)) == policy_for(_Build(256)) == NARROW_SIMD_POLICY != policy_for(_Build(512))
    assert [wide.path(r, torch.float32) for r in (8, 15, 16, 32)] == ["kernel"] * 2 + ["dequant_mm"] * 2
    assert [narrow.path(r, torch.float32) for r in (2, 8, 16, 31, 32, 64)] == ["kernel"] * 4 + ["dequant_mm"] * 2
    small_bf16 = "aten_int8" if fmt == "int8" else "kernel"  # torch's int8 op: per-row int8 with bf16-exact scales
    assert [wide.path(r, torch.bfloat16) for r in (1, 15, 16)] == [small_bf16] * 2 + ["dequant_mm"]
    assert [narrow.path(r, torch.bfloat16) for r in (1, 2, 31, 32)] == [small_bf16, "kernel", "kernel", "dequant_mm"]
    assert wide._policy.bf16_matmul and not narrow._policy.bf16_matmul


def test_narrow_build_multiplies_bfloat16_in_float32(kernels) -> None:
    """Without bf16_matmul, dequant_mm's bfloat16 result is the float32 product rounded once: the
    same as running float32 inputs (bf16 values) through the float32 path and rounding."""
    layer = layer_for("int4", 40, 256, kernels, seed=9)
    narrow = QuantLinear(layer.weight_q, kernels, NARROW_SIMD_POLICY)
    x = torch.randn(33, 256, generator=gen(9)).to(torch.bfloat16)
    assert torch.equal(narrow.run(x, "dequant_mm"), narrow.run(x.float(), "dequant_mm").to(torch.bfloat16))
    assert_matches(narrow.run(x, "dequant_mm"), x, layer)


def test_avx512_build_without_bf16(kernels, tmp_path) -> None:
    """AVX-512 CPUs without AVX512_BF16 (the prebuilt x86-64-v4 level) run the one-row path's
    float32 code for bfloat16 inputs too: built here for that level, against the reference."""
    import ctypes
    import subprocess

    from engine.kernels import build
    from engine.kernels import quant as qk

    levels = list(build.X86_LEVELS)
    level = build.cpu_level()
    if level is None or levels.index(level) < levels.index("x86-64-v4"):  # v4 code runs on v4-bf16 CPUs too
        pytest.skip("this CPU cannot run x86-64-v4 code")
    target = tmp_path / "quant_kernels_v4.so"
    try:
        build.compile_library(build.QUANT_KERNELS, target, [*build.compiler_flags(["-march=x86-64-v4"]), "-Wno-psabi"])
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot build an x86-64-v4 variant here: {str(exc)[-300:]}")
    v4 = qk.QuantKernels(ctypes.CDLL(str(target)))
    w = torch.randn(48, 576, generator=gen(21)) * 0.05
    for q in (quantize_int4(w), quantize_int4(w, mins=False), quantize_int8(w, group_size=32)):
        layer = QuantLinear(q, v4)
        for dtype in DTYPES:
            x = torch.randn(1, 576, generator=gen(22)).to(dtype)
            assert_matches(layer.run(x, "kernel"), x, layer)


def test_kernel_entry_points_check_layouts(kernels) -> None:
    q = quantize(torch.randn(16, 64), "int4")
    with pytest.raises(ValueError, match="contiguous"):
        kernels.linear(torch.randn(64, 2).t(), q, 1)
    with pytest.raises(ValueError, match=r"x \[rows, 64\]"):
        kernels.linear(torch.randn(2, 32), q, 1)
    with pytest.raises(ValueError, match="must be contiguous"):
        kernels.linear(torch.randn(2, 32), q.cols(0, 32), 1)
    with pytest.raises(ValueError, match="dequantize rows"):
        kernels.dequantize(q, 0, 17, torch.empty(17, 64), 1)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_one_token_through_the_kernel_equals_torch_lookup(kernels, fmt, dtype):
    """A decode step's single id is dequantized by the C kernel: the same numbers as the torch lookup."""
    from engine.quant.linear import QuantEmbedding

    table = quantize(torch.randn(40, 96, generator=gen(11)), fmt)
    fast, plain = QuantEmbedding(table, dtype, kernels), QuantEmbedding(table, dtype)
    for row in (0, 17, 39):
        ids = torch.tensor([row])
        got = fast(ids)
        assert got.shape == (1, 96) and got.dtype == dtype
        assert torch.equal(got, plain(ids))
    assert torch.equal(fast(torch.tensor([3, 5])), plain(torch.tensor([3, 5])))  # several ids: the torch lookup
    with pytest.raises(IndexError):
        fast(torch.tensor([40]))
