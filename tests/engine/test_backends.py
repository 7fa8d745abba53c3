"""The model's seam (engine/backends): the Linear contract, the dispatch on prepared weight types,
load-time weight preparation and the backend choice. The forward's maths is checked against the
reference in test_model.py and the fused kernels against torch ops in test_cpu_kernels.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.backends import resolve_dtype, select_backend
from engine.backends.base import DenseLinear, Linear, LinearNames, ParallelLinear, PreparedWeight
from engine.backends.cpu import OneDnnBackend, PackedCpuLinear, pack_weight, packing_available
from engine.backends.torch_ops import TorchBackend
from engine.loading.checkpoint import random_state_dict
from engine.config import EngineConfig
from engine.models.llama import Transformer, allocate_kv_caches, fuse_linears, linear_names
from engine.quant.formats import Fp8Weight, quantize_fp8, quantize_int8
from engine.quant.linear import QuantLinear
from engine.executor.executor import build_step_inputs
from engine.core.sequence import ScheduledBatch, Sequence
from engine.types import SamplingParams

CPU = torch.device("cpu")


@dataclass(frozen=True)
class HalvedWeight:
    """A made-up prepared format (W stored as 2 * W, halved on the way out): a new weight class
    reaches the model through Backend.linear without any edit to model.py or to a backend."""

    doubled: torch.Tensor

    def make_linear(self, backend) -> "HalvedLinear":
        return HalvedLinear(self.doubled)


class HalvedLinear(nn.Module):
    def __init__(self, doubled: torch.Tensor) -> None:
        super().__init__()
        self.doubled = doubled
        self.out_features, self.in_features = doubled.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.doubled) * 0.5

    def resident_bytes(self) -> int:
        return self.doubled.numel() * self.doubled.element_size()


class HalvingBackend(TorchBackend):
    """TorchBackend whose prepare() stores every linear as a HalvedWeight."""

    def prepare_linear(self, weight):
        return HalvedWeight(weight * 2)


def logits_of(model: Transformer, prompt: list[int]) -> torch.Tensor:
    seq = Sequence(0, "r", list(prompt), len(prompt), SamplingParams(temperature=0.0))
    seq.block_table = [0, 1]
    inputs, _ = build_step_inputs(ScheduledBatch([seq], [len(prompt)]), 8)
    inputs = dataclasses.replace(inputs, logits_indices=torch.arange(len(prompt)))
    caches = allocate_kv_caches(model.params, 1, 2, 8, dtype=model.backend.dtype, device=CPU)
    return model(inputs, caches)


def test_a_new_prepared_weight_type_needs_no_model_change(tiny_model_args):
    state = random_state_dict(tiny_model_args, seed=3, dtype=torch.float64)
    dense = Transformer.from_state_dict(tiny_model_args, dict(state), TorchBackend(CPU, torch.float64), max_seq_len=16)
    halved = Transformer.from_state_dict(tiny_model_args, dict(state), HalvingBackend(CPU, torch.float64), max_seq_len=16)
    linears = [m for m in halved.modules() if isinstance(m, HalvedLinear)]
    assert len(linears) == 4 * tiny_model_args.n_layers + 1  # wqkv, wo, w13, w2 per block, and the head
    prompt = [1, 5, 9, 2, 7]
    torch.testing.assert_close(logits_of(halved, prompt), logits_of(dense, prompt), rtol=1e-12, atol=1e-12)


def test_every_linear_meets_the_contract():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 16, generator=g)
    x = torch.randn(3, 16, generator=g)
    layers: list[Linear] = [DenseLinear(weight), QuantLinear(quantize_fp8(weight), None), QuantLinear(quantize_int8(weight), None)]
    if packing_available(torch.float32):
        layers.append(PackedCpuLinear(pack_weight(weight)))
    for layer in layers:
        assert isinstance(layer, Linear)
        assert (layer.in_features, layer.out_features) == (16, 32) and layer.resident_bytes() > 0
        out = layer(x)
        assert out.shape == (3, 32) and out.dtype == x.dtype
        expected = F.linear(x, weight)
        assert float((out - expected).abs().max()) < 0.05 * float(expected.abs().max())  # fp8 / int8: close, not equal
    assert isinstance(quantize_fp8(weight), PreparedWeight)


def test_collectives_wrap_the_local_linear():
    calls: list[torch.Tensor] = []
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(8, 4, generator=g)
    layer = TorchBackend(CPU, torch.float32).linear(weight, lambda y: calls.append(y) or y + 1)
    assert isinstance(layer, ParallelLinear) and layer.resident_bytes() == weight.numel() * 4
    x = torch.randn(2, 4, generator=g)
    torch.testing.assert_close(layer(x), F.linear(x, weight) + 1)
    assert len(calls) == 1  # the local linear computed once, the collective applied once around it


def test_unknown_weight_type_is_refused():
    with pytest.raises(TypeError, match="no linear for a weight of type object"):
        TorchBackend(CPU, torch.float32).linear(object())


def test_fuse_linears_concatenates_this_ranks_rows(tiny_model_args):
    state = random_state_dict(tiny_model_args, seed=1, dtype=torch.float32)
    fused = fuse_linears(state, tiny_model_args.n_layers)
    p = "layers.0."
    expected = torch.cat([state[p + f"attention.{n}.weight"] for n in ("wq", "wk", "wv")])
    assert torch.equal(fused[p + "attention.wqkv.weight"], expected)
    assert torch.equal(fused[p + "feed_forward.w13.weight"], torch.cat([state[p + "feed_forward.w1.weight"], state[p + "feed_forward.w3.weight"]]))
    assert not any(k.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight")) for k in fused)
    names = linear_names(tiny_model_args.n_layers)
    assert isinstance(names, LinearNames) and all(name in fused for name in names.blocks)


def test_backend_prepare_quantizes_blocks_not_the_head():
    g = torch.Generator().manual_seed(2)
    weights = {"a": torch.randn(16, 8, generator=g), "head": torch.randn(16, 8, generator=g), "norm": torch.ones(8)}
    prepared = TorchBackend(CPU, torch.float32, quantization="fp8_mixed").prepare(weights, LinearNames(("a",), "head"))
    assert isinstance(prepared["a"], Fp8Weight)
    assert prepared["head"] is weights["head"] and prepared["norm"] is weights["norm"]


def test_dtype_and_backend_are_chosen_in_one_place():
    assert resolve_dtype(EngineConfig(dtype="float64")) == torch.float64
    assert resolve_dtype(EngineConfig(device="cuda")) == torch.bfloat16
    expected = torch.bfloat16 if packing_available(torch.bfloat16) else torch.float32
    assert resolve_dtype(EngineConfig()) == expected
    backend = select_backend(EngineConfig(dtype="float32", cpu_kernels=False), CPU)
    assert isinstance(backend, OneDnnBackend if packing_available(torch.float32) else TorchBackend)
    assert type(select_backend(EngineConfig(dtype="float16"), CPU)) is TorchBackend
