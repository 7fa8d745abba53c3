"""csrc/gemm.c's many-rows float32 linear (CpuKernels.bind_gemm) against float64 maths at every row
count from 1 to 70 (tiles of 12, 6 or 3 rows, balanced, and their remainders), several 16-column
panel counts (odd ones: the AVX-512 build's two-panel tiles) and k past its 256-step blocks, in the
native build and the x86-64-v3 / v2 ones; each row's result independent of the other rows; the
bfloat16-in, bfloat16-out call (interleaved_gemm_bf16) equal to torch's rounding of the float32 sums; and
PackedCpuLinear's routing: which rows it sends there, every float32 weight's single copy there, the
batch-invariant mode kept off it."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from engine.backends import cpu as cpu_backend
from engine.backends.cpu import (
    ONE_COPY_MIN_GEMM_ROWS, CpuKernelBackend, PackedCpuLinear, PackedWeight, few_rows_cutoff, gemm_serves, pack_weight,
)  # fmt: skip
from engine.backends.torch_ops import TorchBackend
from engine.kernels import cpu as ck
from tests.engine.kernel_levels import cpu_kernels_for_level
from tests.engine.test_cpu_kernels import THREADS, TwoPaths, build_model, build_with, gen, kernels, make_seqs  # noqa: F401 - kernels: a fixture
from tests.engine.test_kernel_alloc_failures import failing  # noqa: F401 - a fixture

CPU = torch.device("cpu")
SHAPES = [(16, 3), (48, 257), (96, 600), (80, 31)]  # [n, k]: 1, 3, 6, 5 panels; k below, past and across 256-step blocks


def assert_within_f32_rounding(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Each output within float32 summation error of the exact dot product: k * 2^-24 of the sum of
    |products| (a dropped or doubled term, or a wrong row or column, breaks it)."""
    assert out.dtype == torch.float32 and out.shape == (x.shape[0], weight.shape[0])
    exact = x.double() @ weight.double().T
    bound = x.shape[1] * 2.0**-24 * (x.double().abs() @ weight.double().abs().T) + 1e-30
    assert ((out.double() - exact).abs() <= bound).all()


def check_rows_1_to_70(lib: ck.CpuKernels, dtype: torch.dtype = torch.float32) -> None:
    """Float32 weights, or bfloat16 ones (widened per load: the sums within float32 rounding of the
    exact product of the bfloat16 values, x float32 or bfloat16)."""
    for n, k in SHAPES:
        g = gen(n * 1009 + k)
        weight = torch.randn(n, k, generator=g).to(dtype)
        gemm = lib.bind_gemm(lib.interleave(weight, pairs=False))
        for rows in range(1, 71):
            x = torch.randn(rows, k, generator=g).to(dtype if rows % 2 else torch.float32)
            assert_within_f32_rounding(gemm(x, THREADS), x, weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_rows_1_to_70_within_f32_rounding(kernels, dtype):
    check_rows_1_to_70(kernels, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 301: balanced blocks of rows (gemm.c GEMM_MC), each its own pass over the weights; 128 and 301: on AVX2 k
# (1000) in 2 blocks where a row alone has 1 (GEMM_X_L2_BYTES: longer k blocks for fewer rows; bfloat16 from
# 16 tiles: widened chunks of 500 steps, 301's passes of 101 rows at GEMM_WIDE_KC's cap)
@pytest.mark.parametrize("rows", [70, 128, 301])
def test_each_row_is_the_same_whatever_the_other_rows(kernels, rows, dtype):
    """One FMA chain per output, in k order: a row alone and in any batch gives the same bits. bfloat16
    weights: a call of many row tiles widens each chunk once (gemm.c widen_chunk), a row alone widens
    in its loads: the same values in the same order."""
    g = gen(rows)
    weight = torch.randn(96, 1000, generator=g).to(dtype)
    gemm = kernels.bind_gemm(kernels.interleave(weight, pairs=False))
    x = torch.randn(rows, 1000, generator=g)
    batched = gemm(x, THREADS)
    assert_within_f32_rounding(batched, x, weight)
    for row in (0, 5, 6, 13, rows - 1):
        assert torch.equal(gemm(x[row : row + 1].clone(), THREADS)[0], batched[row])
    assert torch.equal(gemm(x[1:23].clone(), THREADS), batched[1:23])


def test_sums_streamed_past_the_caches_are_the_same_bits(kernels):
    """A weight of 32 MiB and an out past 4 MiB (gemm.c stream_out, AVX2 builds): the last k block's
    sums are stored non-temporally (the earlier blocks' plainly, read back); within float32 rounding,
    and each row the same bits as alone (a one-row out: stored plainly)."""
    g = gen(32)
    weight = torch.randn(8192, 1024, generator=g)  # 32 MiB of float32
    gemm = kernels.bind_gemm(kernels.interleave(weight))
    x = torch.randn(230, 1024, generator=g)  # out 230 x 8192 floats: 7.2 MiB; on AVX2 2 passes of 115 rows, k in 2 blocks
    batched = gemm(x, THREADS)
    assert_within_f32_rounding(batched, x, weight)
    for row in (0, 7, 229):
        assert torch.equal(gemm(x[row : row + 1].clone(), THREADS)[0], batched[row])


def bfloat16_rows(rows: int, k: int, g: torch.Generator) -> torch.Tensor:
    """bfloat16 x whose sums, with a bfloat16 weight, land on rounding ties, overflow to inf, and
    include infs and NaNs (rows 1 and 2, where there are 3 rows or more), besides random rows."""
    x = torch.randn(rows, k, generator=g)
    x[0, :] = 0.0
    x[0, 0] = 1.0 + 2.0**-7  # times a weight of 1.5: 1.5 + 2^-7 + 2^-8, a tie between two bfloat16 values (row 0, column 0)
    if rows >= 3:
        x[1, :] = 3.0e38  # sums past float32's max: inf and -inf
        x[2, 1], x[2, 2] = float("inf"), float("nan")
    return x.to(torch.bfloat16)


def assert_same_bfloat16(got: torch.Tensor, expected: torch.Tensor) -> None:
    """The same bits, but for NaNs: NaN where torch's NaN is (torch writes 0xffff, the kernels a
    quiet NaN of the sum's sign and payload, vec.h's f32_to_bf16)."""
    assert got.dtype == expected.dtype == torch.bfloat16 and got.shape == expected.shape
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], expected.view(torch.int16)[~nan])


@pytest.mark.parametrize("rows", [1, 9, 17, 32, 64, 130, 301])
def test_bfloat16_out_is_the_float32_sums_rounded_as_torch_does(kernels, rows):
    """bind_gemm(out_dtype=bfloat16) (interleaved_gemm_bf16: x widened and the sums rounded in C, the
    function a bfloat16 compiled decode step calls too) gives torch's `.to(bfloat16)` of the float32
    gemm's sums bit for bit: round to nearest even (ties, overflow to inf), NaNs as NaNs; 130 and 301
    rows: several passes of rows (GEMM_MC), each converted on its own."""
    g = gen(rows + 7)
    for n, k in SHAPES:
        weight = torch.randn(n, k, generator=g)
        weight[0, 0] = 1.5
        weight = weight.to(torch.bfloat16)
        interleaved = kernels.interleave(weight, pairs=False)
        x = bfloat16_rows(rows, k, g)
        sums = kernels.bind_gemm(interleaved)(x, THREADS)
        assert sums[0, 0] == 1.5 + 2.0**-7 + 2.0**-8  # the tie (rounded to even: 1.5 + 2^-6)
        assert_same_bfloat16(kernels.bind_gemm(interleaved, out_dtype=torch.bfloat16)(x, THREADS), sums.to(torch.bfloat16))
    assert sums.isinf().any() and sums.isnan().any() or rows < 3


def test_bfloat16_out_reports_its_scratch_failing(kernels, failing):  # noqa: F811
    """interleaved_gemm_bf16 allocates its float32 rows when called without a scratch (the per-op
    path): a failed allocation is a MemoryError, not a crash."""
    gemm = kernels.bind_gemm(kernels.interleave(torch.randn(32, 64).to(torch.bfloat16), pairs=False), out_dtype=torch.bfloat16)
    x = torch.randn(20, 64).to(torch.bfloat16)
    expected = gemm(x, THREADS)
    failing(0)
    with pytest.raises(MemoryError):
        gemm(x, THREADS)
    failing(-1)
    assert torch.equal(gemm(x, THREADS), expected)


def test_gemm_of_no_columns_is_zeros(kernels):
    gemm = kernels.bind_gemm(torch.empty(2, 0, 16))
    assert torch.equal(gemm(torch.empty(3, 0), THREADS), torch.zeros(3, 32))


def test_gemm_refuses_what_it_cannot_read(kernels):
    weight = kernels.interleave(torch.randn(32, 64))
    with pytest.raises(ValueError, match="float32 or bfloat16 \\[n / 16, k, 16\\]"):
        kernels.bind_gemm(torch.randn(2, 64, 16).to(torch.float16))
    gemm = kernels.bind_gemm(weight)
    with pytest.raises(ValueError, match="x \\[rows, 64\\]"):
        gemm(torch.randn(3, 63), THREADS)
    with pytest.raises(ValueError, match="contiguous float32"):
        gemm(torch.randn(64, 3).T, THREADS)


def test_gemm_needs_no_scratch(kernels, failing):  # noqa: F811
    """x is read where it lies (no packed copy): with every kernel allocation failing it still runs,
    at a row count past one pass of rows (GEMM_MC), bit for bit as before."""
    g = gen(2)
    x, weight = torch.randn(300, 64, generator=g), kernels.interleave(torch.randn(32, 64, generator=g))
    gemm = kernels.bind_gemm(weight)
    expected = gemm(x, THREADS)
    failing(0)
    assert torch.equal(gemm(x, THREADS), expected)


# --------------------------------------------------------------------------- each x86-64 level's build
# level: the most rows it takes from oneDNN (measured faster: AVX2 to 2048, AVX-512 on Zen 4 to 64; by
# the vector width, so the 16-lane v3 build answers as AVX-512 does); v4: AVX-512 CPUs only
LEVELS = {"x86-64-v3": 2048, "x86-64-v2": 0, "x86-64-v3-16-lanes": 64, "x86-64-v4": 64}


@pytest.fixture(scope="module", params=list(LEVELS))
def level_kernels(request, tmp_path_factory) -> tuple[str, ck.CpuKernels]:
    """The cpu_kernels library built for one x86-64 level (v3: 6 x 16 tiles of 8-lane AVX2 vectors; v2:
    3 x 16 of 4-lane SSE; v3 with 16 lanes: AVX-512's 12 x 32), as the image prebuilds them; skipped
    where this CPU cannot run it."""
    return request.param, cpu_kernels_for_level(tmp_path_factory.mktemp(request.param), request.param)


def test_gemm_at_each_level_within_f32_rounding(level_kernels):
    check_rows_1_to_70(level_kernels[1])
    check_rows_1_to_70(level_kernels[1], torch.bfloat16)
    test_bfloat16_out_is_the_float32_sums_rounded_as_torch_does(level_kernels[1], 70)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_level_keeps_a_row_the_same_whatever_the_other_rows(level_kernels, dtype):
    test_each_row_is_the_same_whatever_the_other_rows(level_kernels[1], 301, dtype)


def test_each_level_takes_the_rows_it_was_measured_faster_at(level_kernels):
    level, lib = level_kernels
    assert lib.gemm_max_rows() == LEVELS[level]


# --------------------------------------------------------------------------- PackedCpuLinear's routing
def gemm_kernels(kernels: ck.CpuKernels) -> ck.CpuKernels:
    if kernels.gemm_max_rows() == 0:
        pytest.skip("this build keeps oneDNN for every row count (the gemm was not measured faster at its vector width)")
    return kernels


# the cutoff a build where the gemm serves float32 measured (AVX2, csrc/gemm.c), for forcing that situation elsewhere
FORCED_GEMM_MAX_ROWS = 2048


@pytest.fixture(params=["build", "forced"])
def serving_kernels(request, kernels, monkeypatch) -> ck.CpuKernels:
    """The native kernels where csrc/gemm.c serves float32 on one copy (AVX2 builds: their cutoff
    reaches ONE_COPY_MIN_GEMM_ROWS; skipped elsewhere), and forced on any build by giving it AVX2's
    cutoff (the kernel itself runs in every build; only gemm_max_rows says where it is the faster one)."""
    if request.param == "forced":
        monkeypatch.setattr(kernels, "gemm_max_rows", lambda: FORCED_GEMM_MAX_ROWS)
    if 0 < kernels.gemm_max_rows() < ONE_COPY_MIN_GEMM_ROWS:
        pytest.skip("this build's gemm takes decode rows only: oneDNN's copy kept for prefill rows")
    return gemm_kernels(kernels)


# a cutoff short of ONE_COPY_MIN_GEMM_ROWS, as AVX-512 builds measured (decode rows only), for forcing it elsewhere
FORCED_DECODE_GEMM_MAX_ROWS = 64


@pytest.fixture(params=["build", "forced"])
def decode_gemm_kernels(request, kernels, monkeypatch) -> ck.CpuKernels:
    """The native kernels where csrc/gemm.c takes float32 decode rows only (AVX-512 builds; skipped
    elsewhere), and forced on any build with oneDNN's float32 by giving it such a cutoff."""
    if not cpu_backend.packing_available(torch.float32):
        pytest.skip("no oneDNN float32 kernel here")
    if request.param == "forced":
        monkeypatch.setattr(kernels, "gemm_max_rows", lambda: FORCED_DECODE_GEMM_MAX_ROWS)
    if not 0 < kernels.gemm_max_rows() < ONE_COPY_MIN_GEMM_ROWS:
        pytest.skip("this build's gemm takes every row count, or none")
    return kernels


def test_a_decode_rows_cutoff_keeps_onednn_for_the_rows_past_it(decode_gemm_kernels, monkeypatch):
    """Where the gemm was measured faster for decode rows only, a float32 weight keeps both copies:
    up to the few-rows cutoff the interleaved kernel, then up to gemm_max_rows the gemm (its bits
    exactly), past it oneDNN (its bits exactly), each within float32 rounding of the float64 product;
    a weight too large for a second copy (the head) the interleaved copy alone, every row past the
    few-rows cutoff on the gemm."""
    lib = decode_gemm_kernels
    g = gen(9)
    weight = torch.randn(64, 96, generator=g)
    packed = pack_weight(weight, lib)
    layer = PackedCpuLinear(packed, lib)
    assert packed.packed is not None and packed.interleaved is not None and layer.gemm_rows() == lib.gemm_max_rows()
    gemm, one_row, max_rows, few = lib.bind_gemm(packed.interleaved), lib.bind_interleaved(packed.interleaved), lib.gemm_max_rows(), few_rows_cutoff(lib)
    for rows in sorted({1, few, few + 1, max_rows, max_rows + 1, 512}):
        x = torch.randn(rows, 96, generator=g)
        out = layer(x)
        assert_within_f32_rounding(out, x, weight)
        expected = one_row(x, THREADS) if rows <= few else gemm(x, THREADS) if rows <= max_rows else layer._onednn(x)
        assert torch.equal(out, expected), rows
    monkeypatch.setattr(cpu_backend, "INTERLEAVED_MAX_WEIGHT_BYTES", weight.numel() * 4 - 1)  # the demo's head: 113 MB
    large = PackedCpuLinear(pack_weight(weight, lib), lib)
    assert large.packed_weight is None and large.gemm_rows() > ONE_COPY_MIN_GEMM_ROWS
    x = torch.randn(max_rows + 1, 96, generator=g)
    assert torch.equal(large(x), gemm(x, THREADS))


def test_a_float32_linear_holds_one_copy_and_the_gemm_serves_every_row_count(serving_kernels):
    """Where the gemm serves float32, a small block weight keeps the interleaved copy only (no
    oneDNN packed tensor, resident_bytes one copy): one row (up to the few-rows cutoff) through the
    interleaved kernel, every other row count, past gemm_max_rows too, through the gemm (its bits
    exactly), each within float32 rounding of the float64 product; 3-D inputs flattened onto it."""
    lib = serving_kernels
    g = gen(3)
    weight = torch.randn(64, 96, generator=g)
    packed = pack_weight(weight, lib)
    layer = PackedCpuLinear(packed, lib)
    assert packed.packed is None and layer.packed_weight is None and layer.resident_bytes() == weight.numel() * 4
    gemm, one_row, max_rows, few = lib.bind_gemm(packed.interleaved), lib.bind_interleaved(packed.interleaved), lib.gemm_max_rows(), few_rows_cutoff(lib)
    for rows in sorted({1, 2, few, few + 1, 8, 32, 512, max_rows, max_rows + 1, 3000}):
        x = torch.randn(rows, 96, generator=g)
        out = layer(x)
        assert_within_f32_rounding(out, x, weight)
        assert torch.equal(out, one_row(x, THREADS) if rows <= few else gemm(x, THREADS)), rows
    x = torch.randn(3, 40, 96, generator=g)
    assert torch.equal(layer(x), gemm(x.reshape(120, 96), THREADS).reshape(3, 40, 64))


def test_one_copy_is_batch_invariant_across_the_cutoff(serving_kernels):
    """On the one copy, a row's result does not depend on its batch: bit for bit the same at every
    row count the gemm takes, below and above gemm_max_rows; and in the batch-invariant mode (the
    row kernel at every count) a row alone equals the row batched at 1, 8, 32, 512 and 3000 rows."""
    lib = serving_kernels
    g = gen(8)
    weight = torch.randn(80, 72, generator=g)
    x = torch.randn(3000, 72, generator=g)
    max_rows, few = lib.gemm_max_rows(), few_rows_cutoff(lib)
    layer = PackedCpuLinear(pack_weight(weight, lib), lib)
    full = layer(x)
    for rows in sorted({few + 1, 32, 512, max_rows, max_rows + 1, 3000}):
        assert torch.equal(layer(x[:rows]), full[:rows]), rows
    invariant = CpuKernelBackend(CPU, torch.float32, lib, batch_invariant=True)
    linear = invariant.special_linear(invariant.prepare_linear(weight))
    assert linear.packed_weight is None and linear.resident_bytes() == weight.numel() * 4
    alone = torch.cat([linear(x[i : i + 1]) for i in (0, 7, 31, 511, 2999)])
    for rows in (1, 8, 32, 512, 3000):
        batched = linear(x[:rows])
        assert_within_f32_rounding(batched, x[:rows], weight)
        assert torch.equal(batched[rows - 1], alone[[1, 8, 32, 512, 3000].index(rows)]), rows


def test_the_gemm_copy_replaces_onednn_only_where_the_gemm_serves(kernels, monkeypatch):
    """Builds where the gemm does not serve float32 (cutoff 0: AMX, AVX-512, the portable build) keep
    oneDNN's copy beside the small weights' interleaved one, as before."""
    if not cpu_backend.packing_available(torch.float32):
        pytest.skip("no oneDNN float32 kernel here")
    monkeypatch.setattr(kernels, "gemm_max_rows", lambda: 0)
    weight = torch.randn(64, 96, generator=gen(5))
    packed = pack_weight(weight, kernels)
    layer = PackedCpuLinear(packed, kernels)
    assert packed.packed is not None and layer._gemm is None and layer.resident_bytes() == 2 * weight.numel() * 4
    x = torch.randn(33, 96, generator=gen(6))
    assert torch.equal(layer(x), layer._onednn(x))


def test_large_float32_head_keeps_one_copy_and_serves_every_row_count(kernels, monkeypatch):
    """A float32 head (or block weight) too large for a second copy: the interleaved copy in place
    of oneDNN's (no more memory), one row (up to the few-rows cutoff) on the interleaved kernel, any
    more (past gemm_max_rows too) on the gemm; the batch-invariant mode keeps the row kernel for every count."""
    lib = gemm_kernels(kernels)
    g = gen(4)
    weight = torch.randn(128, 64, generator=g)
    monkeypatch.setattr(cpu_backend, "INTERLEAVED_MAX_WEIGHT_BYTES", weight.numel() * 4 - 1)  # the demo's head: 113 MB
    backend = CpuKernelBackend(CPU, torch.float32, lib)
    prepared = backend.prepare_head(weight)
    assert isinstance(prepared, PackedWeight) and prepared.packed is None and gemm_serves(weight.dtype, 128, lib)
    head = backend.head_linear(prepared)
    assert head.resident_bytes() == weight.numel() * 4
    gemm = lib.bind_gemm(prepared.interleaved)
    few = few_rows_cutoff(lib)
    for rows in (1, 2, few + 1, 33, lib.gemm_max_rows() + 5):
        x = torch.randn(rows, 64, generator=g)
        out = head(x)
        assert_within_f32_rounding(out, x, weight)
        if rows > few:
            assert torch.equal(out, gemm(x, THREADS))
    invariant = CpuKernelBackend(CPU, torch.float32, lib, batch_invariant=True)
    x = torch.randn(5, 64, generator=g)
    row_kernel = lib.interleaved_linear(x, prepared.interleaved, THREADS)
    for linear in (invariant.head_linear(invariant.prepare_head(weight)), invariant.special_linear(invariant.prepare_linear(weight))):
        assert torch.equal(linear(x), row_kernel) and torch.equal(linear(x[2:3].clone()), row_kernel[2:3])


def test_no_gemm_for_bfloat16_or_without_kernels(kernels):
    weight = torch.randn(32, 64)
    assert not gemm_serves(torch.bfloat16, 32, kernels) and not gemm_serves(torch.float32, 32, None)
    # bfloat16 only without oneDNN's copy (no oneDNN bfloat16 kernel: AVX2), where the build has the gemm
    assert gemm_serves(torch.bfloat16, 32, kernels, onednn=False) == (kernels.gemm_max_rows() > 0)
    assert not gemm_serves(torch.float32, 24, kernels)  # not whole 16-column panels
    assert pack_weight(torch.randn(32, (8 << 20) // 128 + 16), None).packed is not None  # no kernels: oneDNN's copy
    layer = PackedCpuLinear(pack_weight(weight))
    assert torch.allclose(layer(torch.ones(4, 64)), F.linear(torch.ones(4, 64), weight), atol=1e-4)


def test_a_float32_model_runs_on_one_copy_of_each_weight(serving_kernels, tiny_checkpoint):
    """Where the gemm serves float32, each linear and the head keep the interleaved copy only, small
    or large, the model's weight_bytes (the loaded-bytes figure) counts each weight once, as torch's
    unpacked model holds them, and its prefill, decode and mixed steps (1 to 28 rows a linear) match
    oneDNN's model."""
    lib = serving_kernels
    model = build_model(tiny_checkpoint, torch.float32, lib)
    linears = [m for m in model.modules() if isinstance(m, PackedCpuLinear)]
    assert len(linears) == 4 * model.params.n_layers + 1 and all(m.packed_weight is None and m._gemm is not None for m in linears)
    assert model.weight_bytes() == build_with(tiny_checkpoint, torch.float32, TorchBackend(CPU, torch.float32)).weight_bytes()
    paths = TwoPaths((model, build_model(tiny_checkpoint, torch.float32, None)))
    a, b, c, d = make_seqs(model.vocab_size, [1, 7, 9, 20], seed=2)
    paths.step([b, a, c, d], [7, 1, 9, 11])  # prefill chunks and a one-token prompt
    paths.step([a, b, c], [1, 1, 1])  # decodes
    paths.step([a, d, c], [1, 9, 1])  # decodes around the rest of a prompt
    paths.step([d], [1])  # one row: the one-row kernel
