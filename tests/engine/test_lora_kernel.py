"""The segmented LoRA kernel (engine/kernels/csrc/lora.c) against a float64 reference and against
the torch path (engine/lora/layers.py's matmuls per run): runs of several lengths, adapters of
different ranks, fused linears with GQA part sizes, parts and linears an adapter leaves alone,
rows with no adapter between runs, empty runs, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from engine.backends.base import DenseLinear
from engine.config import EngineConfig
from engine.executor.step_inputs import StepInputs
from engine.kernels.cpu import CpuKernels, load_cpu_kernels
from engine.lora.layers import LORA_LINEARS, LoraLinear, LoraSlots
from tests.engine.kernel_levels import cpu_kernels_for_level

SCALE = 1.75


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    loaded = load_cpu_kernels()
    if loaded is None:
        pytest.skip("fused CPU kernels could not be built here (no working C compiler?)")
    return loaded


def step_inputs(new_tokens: list[int], lora_ids: list[int]) -> StepInputs:
    """What LoraSlots.begin_step reads (query_start_loc, lora_ids); the rest is unused filler."""
    starts = [0]
    for n in new_tokens:
        starts.append(starts[-1] + n)
    seqs, tokens = len(new_tokens), starts[-1]
    zeros = torch.zeros(tokens, dtype=torch.int64)
    return StepInputs(zeros, zeros, zeros, torch.zeros(seqs, 1, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
                      torch.ones(seqs, dtype=torch.int32), torch.zeros(1, dtype=torch.int64),
                      lora_ids=torch.tensor(lora_ids, dtype=torch.int64))  # fmt: skip


def random_adapter(linear: str, in_features: int, sizes: list[int], rank: int, seed: int, parts: tuple[str, ...] | None = None,
                   ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """(A [rank, in], B [out_k, rank]) per Meta part of `linear` in layer 0 (all parts, or `parts`)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for part, out_k in zip(LORA_LINEARS[linear], sizes):
        if parts is None or part in parts:
            out[f"layers.0.{part}"] = (torch.randn(rank, in_features, generator=gen) / in_features**0.5,
                                       torch.randn(out_k, rank, generator=gen) * 0.3)  # fmt: skip
    return out


def reference(x: torch.Tensor, weight: torch.Tensor, y_base: torch.Tensor, linear: str, sizes: list[int],
              adapters: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]], new_tokens: list[int], lora_ids: list[int],
              dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """float64: the base's output plus scale * (x A^T) B^T of each row's adapter on each part's
    columns, from the weights as the model dtype holds them (A, and scale * B, rounded to it)."""
    out = y_base.double().clone()
    offsets = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    row = 0
    for n, lora_id in zip(new_tokens, lora_ids):
        for k, part in enumerate(LORA_LINEARS[linear]):
            pair = adapters.get(lora_id, {}).get(f"layers.0.{part}")
            if pair is None:
                continue
            a = pair[0].to(dtype).double()
            b_scaled = (pair[1].double() * SCALE).to(dtype).double()
            out[row : row + n, offsets[k] : offsets[k + 1]] += x[row : row + n].double() @ a.t() @ b_scaled.t()
        row += n
    return out


def build(linear: str, in_features: int, sizes: list[int], dtype: torch.dtype, kernels: CpuKernels | None,
          adapters: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]], weight: torch.Tensor) -> tuple[LoraLinear, LoraSlots]:  # fmt: skip
    slots = LoraSlots(kernels=kernels)
    layer = LoraLinear(DenseLinear(weight), f"layers.0.{linear}", slots, sizes)
    for lora_id, local in adapters.items():
        slots.install(lora_id, local, SCALE, {linear: sizes}, dtype=dtype, device=torch.device("cpu"))
    return layer, slots


def forward(layer: LoraLinear, slots: LoraSlots, x: torch.Tensor, new_tokens: list[int], lora_ids: list[int]) -> torch.Tensor:
    slots.begin_step(step_inputs(new_tokens, lora_ids))
    try:
        return layer(x)
    finally:
        slots.end_step()


# (linear, in_features, part sizes): GQA q|k|v (column blocks of 64 and a 32-column tail), gate|up
# with widths and an input that are not multiples of 16 (the scalar tails), a single-part linear
CASES = [
    ("attention.wqkv", 64, [96, 32, 32]),
    ("feed_forward.w13", 40, [72, 72]),
    ("attention.wo", 96, [64]),
]
# 1: rank 4 on every part; 2: rank 8 on some parts only (q and v, PEFT's usual targets; up only);
# 3: rank 16 on every part; 4: adapted elsewhere, it leaves this linear alone
NEW_TOKENS = [3, 1, 5, 1, 9, 0, 2, 1, 4, 6]
LORA_IDS = [1, 1, 0, 2, 3, 2, 1, 4, 0, 2]
ADAPTER_2_PARTS = {"attention.wqkv": ("attention.wq", "attention.wv"), "feed_forward.w13": ("feed_forward.w3",),
                   "attention.wo": ("attention.wo",)}  # fmt: skip


def adapter_set(linear: str, in_features: int, sizes: list[int]) -> dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    return {
        1: random_adapter(linear, in_features, sizes, 4, seed=1),
        2: random_adapter(linear, in_features, sizes, 8, seed=2, parts=ADAPTER_2_PARTS[linear]),
        3: random_adapter(linear, in_features, sizes, 16, seed=3),
        4: {},
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("linear", "in_features", "sizes"), CASES)
def test_kernel_equals_the_float64_reference_and_the_torch_path(kernels, dtype, linear, in_features, sizes):
    gen = torch.Generator().manual_seed(7)
    rows = sum(NEW_TOKENS)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    weight = (torch.randn(sum(sizes), in_features, generator=gen) / in_features**0.5).to(dtype)
    installed = adapter_set(linear, in_features, sizes)
    kernel_layer, kernel_slots = build(linear, in_features, sizes, dtype, kernels, installed, weight)
    torch_layer, torch_slots = build(linear, in_features, sizes, dtype, None, installed, weight)
    y_base = DenseLinear(weight)(x)

    got = forward(kernel_layer, kernel_slots, x, NEW_TOKENS, LORA_IDS)
    via_torch = forward(torch_layer, torch_slots, x, NEW_TOKENS, LORA_IDS)
    expected = reference(x, weight, y_base, linear, sizes, installed, NEW_TOKENS, LORA_IDS, dtype)

    # float32: the sums' order only; bfloat16: y + delta rounded once (the torch path also rounds x A^T)
    atol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, rtol=0 if dtype == torch.float32 else 8e-3, atol=atol)
    torch.testing.assert_close(got.double(), via_torch.double(), rtol=0 if dtype == torch.float32 else 1.6e-2, atol=2 * atol)
    # the test means something: the adapters moved every adapted row, and left the others exactly as the base made them
    starts = [sum(NEW_TOKENS[:i]) for i in range(len(NEW_TOKENS))]
    untouched = [r for i, n in enumerate(NEW_TOKENS) for r in range(starts[i], starts[i] + n) if LORA_IDS[i] in (0, 4)]
    adapted = [r for r in range(rows) if r not in untouched]
    assert torch.equal(got[untouched], y_base[untouched])
    assert (got[adapted].double() - y_base[adapted].double()).abs().amax(dim=1).min() > 10 * atol
    # the parts adapter 2 leaves alone (wk; w1) keep the base's columns on its rows
    rows_of_2 = [r for i, n in enumerate(NEW_TOKENS) for r in range(starts[i], starts[i] + n) if LORA_IDS[i] == 2]
    offsets = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    for k, part in enumerate(LORA_LINEARS[linear]):
        columns = slice(offsets[k], offsets[k + 1])
        same = torch.equal(got[rows_of_2, columns], y_base[rows_of_2, columns])
        assert same == (part not in ADAPTER_2_PARTS[linear]), part


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_is_the_same_alone_batched_and_on_one_or_two_threads(kernels, dtype):
    """Large enough to run on both threads; every output is summed by one thread in one order."""
    linear, in_features, sizes = "attention.wqkv", 256, [512, 128, 128]
    gen = torch.Generator().manual_seed(11)
    new_tokens, lora_ids = [17, 1, 1, 23, 1, 8], [1, 2, 0, 2, 3, 1]
    x = torch.randn(sum(new_tokens), in_features, generator=gen).to(dtype)
    weight = (torch.randn(sum(sizes), in_features, generator=gen) / 16).to(dtype)
    adapters = {i: random_adapter(linear, in_features, sizes, rank, seed=i) for i, rank in ((1, 16), (2, 32), (3, 8))}
    layer, slots = build(linear, in_features, sizes, dtype, kernels, adapters, weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = forward(layer, slots, x, new_tokens, lora_ids)
        torch.set_num_threads(1)
        one = forward(layer, slots, x, new_tokens, lora_ids)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    last = sum(new_tokens[:3])  # the fourth sequence's rows (adapter 2), alone in a step of their own
    alone = forward(layer, slots, x[last : last + 23].contiguous(), [23], [2])
    assert torch.equal(alone, two[last : last + 23])


@pytest.fixture(scope="module", params=["x86-64-v2", "x86-64-v3-16-lanes"])
def level_kernels(request, tmp_path_factory) -> CpuKernels:
    """lora.c in other vector widths than the native build's: the 4-lane SSE loops, and the AVX-512
    builds' 16 lanes (as pairs of ymm on x86-64-v3); skipped where this CPU cannot run them."""
    return cpu_kernels_for_level(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_level_equals_the_float64_reference_and_keeps_rows_the_same(level_kernels, dtype):
    for linear, in_features, sizes in CASES:
        test_kernel_equals_the_float64_reference_and_the_torch_path(level_kernels, dtype, linear, in_features, sizes)
    test_each_row_is_the_same_alone_batched_and_on_one_or_two_threads(level_kernels, dtype)


def test_swapped_and_removed_adapters_reuse_their_slots(kernels):
    linear, in_features, sizes = "feed_forward.w13", 32, [48, 48]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, in_features, generator=gen)
    weight = torch.randn(96, in_features, generator=gen) / 8
    adapters = {i: random_adapter(linear, in_features, sizes, 4, seed=i) for i in range(1, 7)}
    layer, slots = build(linear, in_features, sizes, torch.float32, kernels, {i: adapters[i] for i in range(1, 6)}, weight)
    assert slots.descriptors.shape[1] == 8  # grown from 4 by the fifth adapter; every earlier slot kept
    slots.remove(2)
    slots.install(6, adapters[6], SCALE, {linear: sizes}, dtype=torch.float32, device=torch.device("cpu"))
    assert slots.slot_of[6] == 1  # the freed slot
    got = forward(layer, slots, x, [2, 2, 2], [1, 6, 5])
    expected = reference(x, weight, DenseLinear(weight)(x), linear, sizes, adapters, [2, 2, 2], [1, 6, 5], torch.float32)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-5)
    with pytest.raises(RuntimeError, match="not loaded"):
        forward(layer, slots, x, [6], [2])


def test_bad_runs_and_failed_allocations_raise(kernels):
    linear, in_features, sizes = "attention.wo", 32, [32]
    x = torch.randn(4, in_features)
    layer, slots = build(linear, in_features, sizes, torch.float32, kernels,
                         {1: random_adapter(linear, in_features, sizes, 4, seed=1)}, torch.randn(32, in_features))  # fmt: skip
    slots.begin_step(step_inputs([4], [1]))
    try:
        slots.run_rows[0, 1] = 5  # past the last row: refused, never read
        slots.run_rows_address = slots.run_rows.data_ptr()
        with pytest.raises(RuntimeError, match="segmented LoRA"):
            layer(x)
    finally:
        slots.end_step()
    y = torch.zeros(32, 4).t()  # [4, 32] but column-major: the kernel's row offsets would land elsewhere
    with pytest.raises(ValueError, match="contiguous"):
        kernels.bind_segmented_lora(in_features, sizes)(x, y, 0, 0, 0, 1)
    kernels.fail_allocs_after(0)
    try:
        with pytest.raises(MemoryError):
            forward(layer, slots, x, [4], [1])
    finally:
        kernels.fail_allocs_after(-1)


def test_the_cpu_kernel_backend_chooses_the_kernel_and_others_the_torch_path(kernels):
    from engine.backends import select_backend

    cpu = torch.device("cpu")
    assert select_backend(EngineConfig(dtype="float32"), cpu).lora_kernels() is not None
    assert select_backend(EngineConfig(dtype="float32", cpu_kernels=False), cpu).lora_kernels() is None
    assert select_backend(EngineConfig(dtype="float64"), cpu).lora_kernels() is None
