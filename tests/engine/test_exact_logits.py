"""Exact bfloat16 logits: the output head sums bfloat16 inputs times bfloat16 weights in float32 and
keeps the float32 sums (as llama.cpp does) on every backend, instead of rounding logits to bfloat16
(which tied '1' and '2' on the demo and made greedy depend on the rest of the batch: issue #35)."""

from __future__ import annotations

import ctypes
import subprocess

import pytest
import torch

from engine.backends.base import FloatHeadLinear
from engine.backends.cpu import CpuKernelBackend, OneDnnBackend
from engine.backends.torch_ops import TorchBackend
from engine.kernels import build
from engine.kernels import cpu as ck
from engine.core.sequence import ScheduledBatch, Sequence
from engine.loading.checkpoint import load_rank_state_dict, resolve_checkpoint
from engine.types import SamplingParams
from tests.conftest import TINY_DESCRIPTOR
from tests.engine.test_model import BlockAllocator, all_rows_inputs, make_executor, random_prompts

THREADS = 2
CPU = torch.device("cpu")


def head_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float64 logits of the same bfloat16 inputs and weights: the exact dot products."""
    return x.double() @ weight.double().T


def assert_within_f32_rounding(logits: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Each logit within float32 summation error of the exact value: k * 2^-24 of the sum of
    |products| (a bound a bfloat16-rounded logit, off by up to 2^-9 of itself, breaks)."""
    assert logits.dtype == torch.float32
    exact = head_reference(x, weight)
    bound = x.shape[-1] * 2.0**-24 * (x.double().abs() @ weight.double().abs().T) + 1e-30
    assert ((logits.double() - exact).abs() <= bound).all()


def near_tie(dim: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, float]:
    """x [1, dim] and a head [32, dim] whose rows 0 and 1 give logits 1 + 2^-12 and 1 (one bfloat16
    ulp at 1 is 2^-7: both round to 1.0 in bfloat16), the other rows far below."""
    x = torch.zeros(1, dim, dtype=dtype)
    x[0, 0], x[0, 1] = 1.0, 2.0**-6
    weight = torch.full((32, dim), -0.5, dtype=dtype)
    weight[:, 2:] = 0
    weight[0, 0], weight[0, 1] = 1.0, 2.0**-6  # 1 + 2^-12
    weight[1, 0], weight[1, 1] = 1.0, 0.0  # 1
    return x, weight, 2.0**-12


@pytest.fixture(scope="module")
def kernels() -> ck.CpuKernels:
    loaded = ck.load_cpu_kernels()
    if loaded is None:
        pytest.skip("fused CPU kernels could not be built here; torch path only")
    return loaded


def backends(kernels) -> list:
    """Every backend's bfloat16 head; none needs oneDNN's bfloat16 (an AVX2 CPU has none): the
    kernels' head is their interleaved copy, oneDNN's backend without kernels keeps torch's."""
    return [TorchBackend(CPU, torch.bfloat16), OneDnnBackend(CPU, torch.bfloat16), CpuKernelBackend(CPU, torch.bfloat16, kernels)]


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_every_backend_head_is_float32_within_f32_rounding(kernels, rows):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=g).bfloat16()
    x = torch.randn(rows, 80, generator=g).bfloat16()
    heads = [backend.head_linear(backend.prepare_head(weight)) for backend in backends(kernels)]
    assert [type(head).__name__ for head in heads] == ["FloatHeadLinear", "FloatHeadLinear", "InterleavedHeadLinear"]
    for head in heads:
        assert_within_f32_rounding(head(x), x, weight)


def test_a_near_tie_bfloat16_would_merge_stays_distinct(kernels):
    x, weight, gap = near_tie(64)
    rounded = x @ weight.T  # bfloat16 out: the two logits merge
    assert rounded[0, 0] == rounded[0, 1] == 1.0
    for backend in backends(kernels):
        logits = backend.head_linear(backend.prepare_head(weight))(x)
        assert logits[0, 0] - logits[0, 1] == gap and int(logits.argmax()) == 0, backend.name


def test_torch_head_chunks_the_widening(monkeypatch):
    """A head wider than CHUNK_ROWS is widened a slab at a time, with the same logits."""
    monkeypatch.setattr(FloatHeadLinear, "CHUNK_ROWS", 16)
    g = torch.Generator().manual_seed(3)
    weight, x = torch.randn(72, 40, generator=g).bfloat16(), torch.randn(5, 40, generator=g).bfloat16()
    assert_within_f32_rounding(FloatHeadLinear(weight)(x), x, weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_f32_out_kernel_rows_are_batch_invariant(kernels, dtype):
    """interleaved_linear_f32_out: float32 sums within f32 rounding, each row bit-identical alone
    and among others (one fixed order per row)."""
    g = torch.Generator().manual_seed(11)
    weight, x = torch.randn(4096, 256, generator=g).to(dtype), torch.randn(9, 256, generator=g).to(dtype)
    interleaved = kernels.interleave(weight)
    together = kernels.interleaved_linear(x, interleaved, THREADS, f32_out=True)
    assert_within_f32_rounding(together, x, weight)
    for row in range(x.shape[0]):
        assert torch.equal(kernels.interleaved_linear(x[row : row + 1], interleaved, THREADS, f32_out=True)[0], together[row])


@pytest.mark.parametrize("level", ["x86-64-v2", "x86-64-v3"])
def test_f32_out_kernel_on_each_level(tmp_path, level):
    """The portable (v2) and AVX2 (v3) builds of the head kernel: float32 logits within f32 rounding."""
    cpu_level = build.cpu_level()
    if cpu_level is None or list(build.X86_LEVELS).index(cpu_level) < list(build.X86_LEVELS).index(level):
        pytest.skip(f"this CPU cannot run {level}")
    try:
        (built,) = build.prebuild(tmp_path, [level], [build.CPU_KERNELS])
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"no working C compiler here: {exc}")
    kernels = ck.CpuKernels(ctypes.CDLL(str(built)))
    g = torch.Generator().manual_seed(5)
    weight, x = torch.randn(64, 48, generator=g).bfloat16(), torch.randn(2, 48, generator=g).bfloat16()
    assert_within_f32_rounding(kernels.interleaved_linear(x, kernels.interleave(weight), THREADS, f32_out=True), x, weight)
    tie_x, tie_w, gap = near_tie(48)
    logits = kernels.interleaved_linear(tie_x, kernels.interleave(tie_w), THREADS, f32_out=True)
    assert logits[0, 0] - logits[0, 1] == gap


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch_or_onednn"])
def test_bf16_model_head_is_exact_f32_of_its_inputs(tiny_checkpoint, cpu_kernels):
    """On the tiny bfloat16 checkpoint: the model's logits are float32, within f32 rounding of the
    float64 product of the head's own bfloat16 inputs and weights."""
    executor = make_executor(tiny_checkpoint, dtype="bfloat16", cpu_kernels=cpu_kernels)
    try:
        model = executor._shard.model
        seen = []
        hook = model.output.register_forward_hook(lambda _m, args, out: seen.append((args[0], out)))
        prompt = random_prompts(model.vocab_size, [9], seed=4)[0]
        seq = Sequence(0, "r", prompt, len(prompt), SamplingParams())
        BlockAllocator(executor.num_blocks, 0).grow(seq, len(prompt))
        logits = executor.execute(all_rows_inputs(ScheduledBatch([seq], [len(prompt)])))
        hook.remove()
        (normed, out), = seen
    finally:
        executor.shutdown()
    assert logits.dtype == torch.float32 and normed.dtype == torch.bfloat16
    assert torch.equal(logits, out)
    spec = resolve_checkpoint(tiny_checkpoint, model_id="tiny", llama_model=TINY_DESCRIPTOR)
    assert_within_f32_rounding(out, normed, load_rank_state_dict(spec, 0, 1)["output.weight"].bfloat16())
