"""bfloat16 on CPUs whose oneDNN has no bfloat16 kernel (AVX2, no AVX512_BF16 or AMX: issue #35):
the C kernels serve it anyway (CpuKernelBackend.onednn False), every linear from its interleaved
copy only (one copy of the weights): few rows on the interleaved kernel, many on float32 tiles
widened from it (PackedCpuLinear._without_onednn), the head's logits in float32, one decode on the
compiled step. Forced on every CPU here by making packing_available say no for bfloat16 (the one
place the code decides it)."""

from __future__ import annotations

import pytest
import torch

import engine.backends.cpu as cpu_backends
from engine.backends import select_backend
from engine.backends.cpu import AMX_MAX_ROWS, WIDEN_MIN_ROWS, CpuKernelBackend, InterleavedHeadLinear, PackedCpuLinear, few_rows_cutoff, pack_weight
from engine.backends.cpu_step import STEP_GEMM_MAX_ROWS
from engine.config import EngineConfig
from tests.engine.test_cpu_kernels import kernels  # noqa: F401 - a fixture (the native cpu_kernels build)
from tests.engine.test_exact_logits import assert_within_f32_rounding
from tests.engine.test_model import make_executor, random_prompts, run_random_schedule

CPU = torch.device("cpu")


def bf16_gemm(kernels) -> bool:
    """Whether csrc/gemm.c takes a bfloat16 weight's many rows in this build: it has the gemm (AVX2,
    AVX-512) and interleave() lays bfloat16 out as [n / 16, k, 16] (not AVX512_BF16's pairs copy, which
    the gemm does not read: such CPUs have oneDNN's bfloat16, so these tests force a case no CPU has)."""
    return kernels.gemm_max_rows() > 0 and not bf16_pairs(kernels)


def bf16_pairs(kernels) -> bool:
    """Whether interleave() lays bfloat16 out as pairs (AVX512_BF16 builds): a copy whose many rows
    the pairs gemm takes (linear.c) in place of the gemm or widened tiles."""
    return kernels.interleave(torch.zeros(16, 2, dtype=torch.bfloat16)).dim() == 4


@pytest.fixture
def no_onednn_bf16(monkeypatch):
    """oneDNN as an AVX2 CPU has it: float32, no bfloat16."""
    monkeypatch.setattr(cpu_backends, "packing_available", lambda dtype: dtype == torch.float32)


def assert_bf16_rounded_product(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """y within bfloat16 rounding (half an ulp, 2^-9 of |y|) plus float32 summation error of the
    exact x @ W^T of the same bfloat16 values (a bfloat16-summed product breaks it)."""
    assert y.dtype == torch.bfloat16
    exact = x.double() @ weight.double().T
    bound = 2.0**-8 * exact.abs() + x.shape[-1] * 2.0**-24 * (x.double().abs() @ weight.double().abs().T) + 1e-30
    assert ((y.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("rows", [1, 3, WIDEN_MIN_ROWS - 1, WIDEN_MIN_ROWS, 37])
@pytest.mark.parametrize("n, k", [(48, 40), (160, 96)])
def test_linear_without_onednn_is_the_rounded_exact_product(kernels, rows, n, k, monkeypatch):
    monkeypatch.setattr(cpu_backends, "WIDEN_TILE_ELEMS", 32 * k)  # tiles of 32 output rows: several per call, a partial last one
    g = torch.Generator().manual_seed(rows + n)
    weight = torch.randn(n, k, generator=g).bfloat16()
    packed = pack_weight(weight, kernels, onednn=False)
    assert packed.packed is None and packed.interleaved is not None  # one copy: the interleaved one
    layer = PackedCpuLinear(packed, kernels)
    assert layer.resident_bytes() == weight.numel() * weight.element_size()
    x = torch.randn(rows, k, generator=g).bfloat16()
    assert_bf16_rounded_product(layer(x), x, weight)


@pytest.mark.parametrize("gemm", [True, False], ids=["gemm", "widened-tiles"])
def test_each_path_is_taken(kernels, gemm, monkeypatch):
    """Few rows on the interleaved kernel; more on csrc/gemm.c where the build has it (bfloat16 widened
    per load), else from WIDEN_MIN_ROWS on widened tiles: the test above covers each only if the
    cutoffs split its row counts."""
    if gemm and not bf16_gemm(kernels):
        pytest.skip("this build has no many-rows kernel for a bfloat16 copy")
    if not gemm and bf16_pairs(kernels):
        pytest.skip("a pairs copy's many rows take the pairs gemm, not widened tiles (test_the_model_runs_every_linear_on_the_interleaved_copies)")
    if not gemm:
        monkeypatch.setattr(cpu_backends, "gemm_serves", lambda *args, **kwargs: False)
    layer = PackedCpuLinear(pack_weight(torch.randn(32, 16).bfloat16(), kernels, onednn=False), kernels)
    assert (layer._gemm is not None) == gemm and (layer._widen is None) == gemm
    calls = []
    name = "_gemm" if gemm else "_widen"
    kernel = getattr(layer, name)
    monkeypatch.setattr(layer, name, lambda *a: calls.append(a) or kernel(*a))
    below = few_rows_cutoff(kernels) if gemm else WIDEN_MIN_ROWS - 1
    layer(torch.randn(below, 16).bfloat16())
    assert calls == []
    layer(torch.randn(below + 1, 16).bfloat16())
    assert len(calls) == 1


@pytest.mark.parametrize("pairs", [False, True], ids=["interleaved", "pairs"])
def test_widened_tiles_are_the_weight_transposed(kernels, pairs):
    """bind_widen reads both layouts interleave() makes (the pairs one on AVX512_BF16 builds): each
    tile is exactly W[row0:row1]^T in float32."""
    n, k = 64, 10
    weight = torch.randn(n, k).bfloat16()
    layout = weight.view(n // 16, 16, k // 2, 2).transpose(1, 2).contiguous() if pairs else weight.view(n // 16, 16, k).transpose(1, 2).contiguous()
    widen = kernels.bind_widen(layout)
    for row0, row1 in [(0, 64), (16, 48), (48, 64)]:
        out = torch.full((k, row1 - row0), float("nan"))
        widen(row0, row1, out, 2)
        assert torch.equal(out, weight[row0:row1].float().T)
    with pytest.raises(ValueError):
        widen(8, 24, torch.empty(k, 16), 1)  # not whole blocks of 16


def test_selection_serves_bf16_on_the_kernels(kernels, no_onednn_bf16):
    backend = select_backend(EngineConfig(dtype="bfloat16"), CPU)
    assert isinstance(backend, CpuKernelBackend) and not backend.onednn and backend.dtype == torch.bfloat16
    assert type(select_backend(EngineConfig(dtype="bfloat16", cpu_kernels=False), CPU)).__name__ == "TorchBackend"
    assert select_backend(EngineConfig(dtype="float32"), CPU).onednn  # float32 keeps oneDNN's linears


def test_a_weight_the_kernels_cannot_lay_out_stays_dense(kernels, no_onednn_bf16):
    backend = select_backend(EngineConfig(dtype="bfloat16"), CPU)
    weight = torch.randn(24, 16).bfloat16()  # 24 output rows: no whole blocks of 16
    assert backend.prepare_linear(weight) is weight


@pytest.mark.parametrize("gemm", [True, False], ids=["gemm", "widened-tiles"])
@pytest.mark.parametrize("rows", [1, 8, 9, WIDEN_MIN_ROWS - 1, WIDEN_MIN_ROWS, 33])
def test_the_head_gives_float32_logits_at_every_row_count(kernels, no_onednn_bf16, rows, gemm, monkeypatch):
    """Few rows on the interleaved kernel, many on csrc/gemm.c where the build has it, else on
    widened tiles (a float32 GEMM): float32 sums of the bfloat16 products either way; the
    batch-invariant mode keeps the row kernel."""
    if gemm and not bf16_gemm(kernels):
        pytest.skip("this build has no many-rows kernel for a bfloat16 copy")
    if not gemm:
        monkeypatch.setattr(cpu_backends, "gemm_serves", lambda *args, **kwargs: False)
    backend = select_backend(EngineConfig(dtype="bfloat16"), CPU)
    g = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(160, 72, generator=g).bfloat16(), torch.randn(rows, 72, generator=g).bfloat16()
    head = backend.head_linear(backend.prepare_head(weight))
    assert isinstance(head, InterleavedHeadLinear) and (head._gemm is not None) == gemm and (head._widen is None) == gemm
    assert_within_f32_rounding(head(x), x, weight)
    invariant = select_backend(EngineConfig(dtype="bfloat16", batch_invariant=True), CPU)
    invariant_head = invariant.head_linear(invariant.prepare_head(weight))
    assert invariant_head._widen is None and invariant_head._gemm is None


@pytest.fixture(scope="module")
def executors(kernels, tiny_checkpoint):
    """(bfloat16 on the kernels without oneDNN, bfloat16 on torch ops, float64 on torch ops)"""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_backends, "packing_available", lambda dtype: dtype == torch.float32)
        fused = make_executor(tiny_checkpoint, dtype="bfloat16")
    made = [fused, make_executor(tiny_checkpoint, dtype="bfloat16", cpu_kernels=False), make_executor(tiny_checkpoint, dtype="float64")]
    yield made
    for executor in made:
        executor.shutdown()


def test_the_model_runs_every_linear_on_the_interleaved_copies(executors):
    model = executors[0]._shard.model
    assert model.backend.name == "cpu_kernels" and not model.backend.onednn
    linears = [m for m in model.modules() if isinstance(m, PackedCpuLinear)]
    # many rows: csrc/gemm.c where the build has it (bfloat16 widened per load), the pairs gemm on a
    # pairs copy (AVX512_BF16 builds), else widened tiles
    gemm, pairs = bf16_gemm(model.backend.kernels), bf16_pairs(model.backend.kernels)
    assert linears and all(m.packed_weight is None and (m._gemm is not None) == gemm and (m._many_rows is not None) == pairs
                           and (m._widen is None) == (gemm or pairs) for m in linears)  # fmt: skip
    assert isinstance(model.output, InterleavedHeadLinear)  # float32 logits
    # decodes run the compiled step: one, or up to the build's few-rows cutoff (the interleaved kernel's
    # register-blocked rows: 8 on AVX2 builds), and where csrc/gemm.c takes the rows past it up to
    # STEP_GEMM_MAX_ROWS (interleaved_gemm_bf16), or the pairs gemm up to AMX_MAX_ROWS (the step's pairs slot)
    step_rows = STEP_GEMM_MAX_ROWS if gemm else AMX_MAX_ROWS if pairs else min(linear.few_rows() for linear in linears)
    assert model.decode_step is not None and model.decode_step.max_rows == step_rows


def test_logits_and_greedy_against_float64_and_the_torch_path(executors):
    """A random schedule (prefill chunks of many rows, decodes, mixed): logits within bfloat16
    error of the float64 model's, greedy tokens as torch's bfloat16 path gives them."""
    prompts = random_prompts(256, [5, 23, 11, 30], seed=7)
    fused, plain, exact = (run_random_schedule(e, prompts, seed=3, max_new=6) for e in executors)
    for seq_id, prompt in enumerate(prompts):
        logits, tokens = fused[seq_id]
        logits64 = exact[seq_id][0][: len(prompt)]  # the prompt's positions: the same context in every run
        assert logits.dtype == torch.float32
        scale = float(logits64.abs().max())
        assert float((logits[: len(prompt)].double() - logits64).abs().max()) < 0.05 * scale  # bfloat16 weights and activations over two layers
        assert tokens == plain[seq_id][1]
