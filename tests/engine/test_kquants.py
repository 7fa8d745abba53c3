"""GGUF K-quants kept in their super-blocks (engine/quant/kquants.py, the K-quant section of
engine/kernels/csrc/quant_kernels.c): dequantization bit for bit equal to gguf.quants.dequantize on
random super-blocks, in torch and in the C kernels at each x86-64 level this CPU runs (the AVX2
intrinsics and the portable loops); the linears against torch on the dequantized weights; shards at
super-block boundaries."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kernels import quant as qk
from engine.quant import kquants
from engine.quant.linear import QuantLinear
from tests.engine.kernel_levels import quant_kernels_for_level

gguf = pytest.importorskip("gguf")
TYPES = ["Q4_K", "Q5_K", "Q6_K"]


def random_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random super-block bytes with finite float16 scales (random bytes would hold NaN/inf ones)."""
    cls = kquants.BY_GGML_TYPE[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * (cols // 256), cls.type_size), dtype=np.uint8)
    halves = rng.uniform(-0.02, 0.02, size=(raw.shape[0], 2)).astype(np.float16)
    halves[0] = np.float16(6e-8)  # a subnormal float16 scale
    fields = [(208, 0)] if type_name == "Q6_K" else [(0, 0), (2, 1)]
    for offset, which in fields:
        raw[:, offset : offset + 2] = halves[:, which : which + 1].copy().view(np.uint8)
    return raw.reshape(rows, -1)


def reference(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(shape)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("shape", [(3, 256), (17, 512)])
def test_dequantize_bit_exact_in_torch(type_name, shape):
    raw = random_blocks(type_name, *shape, seed=shape[0])
    weight = kquants.from_gguf_blocks(torch.from_numpy(raw), type_name, shape)
    assert weight.shape == shape and weight.nbytes() == raw.nbytes
    got = weight.dequantize(torch.float32).numpy()
    assert np.array_equal(got.view(np.uint32), reference(raw, type_name, shape).view(np.uint32))


@pytest.mark.parametrize("level", ["native", "x86-64-v3", "x86-64-v2"])
@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_bit_exact_in_c(tmp_path, level, type_name):
    """native: the build the server uses; x86-64-v3: the AVX2 intrinsics; x86-64-v2: the portable loops."""
    kernels = qk.load_quant_kernels() if level == "native" else quant_kernels_for_level(tmp_path, level)
    if kernels is None:
        pytest.skip("no C compiler")
    shape = (9, 768)
    raw = random_blocks(type_name, *shape, seed=7)
    weight = kquants.from_gguf_blocks(torch.from_numpy(raw), type_name, shape)
    out = torch.empty(shape)
    kernels.dequantize(weight, 0, shape[0], out, 1)
    assert np.array_equal(out.numpy().view(np.uint32), reference(raw, type_name, shape).view(np.uint32))
    tail = torch.empty(4, shape[1], dtype=torch.bfloat16)
    kernels.dequantize(weight, 5, 9, tail, 2)
    assert torch.equal(tail, weight.dequantize(torch.float32)[5:9].to(torch.bfloat16))


@pytest.mark.parametrize("level", ["native", "x86-64-v3", "x86-64-v2"])
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows", [1, 5, 11])
def test_linear_matches_torch_on_the_dequantized_weight(tmp_path, level, type_name, rows):
    kernels = qk.load_quant_kernels() if level == "native" else quant_kernels_for_level(tmp_path, level)
    if kernels is None:
        pytest.skip("no C compiler")
    shape = (40, 512)
    weight = kquants.from_gguf_blocks(torch.from_numpy(random_blocks(type_name, *shape, seed=3)), type_name, shape)
    dense = weight.dequantize(torch.float64)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    expected = x.double() @ dense.T
    layer = QuantLinear(weight, kernels)
    for path in ("kernel", "dequant_mm", "torch"):
        got = layer.run(x, path)
        assert torch.allclose(got.double(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item()), path
    got_bf16 = layer.run(x.to(torch.bfloat16), "kernel").double()
    assert torch.allclose(got_bf16, x.to(torch.bfloat16).double() @ dense.T, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


@pytest.mark.parametrize("type_name", TYPES)
def test_shards_on_super_block_boundaries(type_name):
    shape = (8, 768)
    weight = kquants.from_gguf_blocks(torch.from_numpy(random_blocks(type_name, *shape, seed=5)), type_name, shape)
    dense = weight.dequantize()
    assert torch.equal(weight.rows(2, 6).dequantize(), dense[2:6])
    assert torch.equal(weight.cols(256, 768).dequantize(), dense[:, 256:768])
    with pytest.raises(ValueError, match="super-block"):
        weight.cols(0, 128)


@pytest.mark.parametrize("quantize, type_name", [(kquants.quantize_q4_k, "Q4_K"), (kquants.quantize_q6_k, "Q6_K")])
def test_quantizers_round_trip_close_and_gguf_reads_their_bytes(quantize, type_name):
    w = torch.randn(6, 512, generator=torch.Generator().manual_seed(0)) * 0.05
    q = quantize(w)
    back = q.dequantize()
    assert (back - w).abs().max() < (0.012 if type_name == "Q4_K" else 0.004)
    expected = reference(q.qweight.numpy(), type_name, (6, 512))
    assert np.array_equal(back.numpy(), expected)


def test_bad_bytes_rejected():
    with pytest.raises(ValueError, match="does not hold"):
        kquants.from_gguf_blocks(torch.zeros(4 * 144, dtype=torch.uint8), "Q4_K", (4, 512))
    with pytest.raises(ValueError, match="not a K-quant"):
        kquants.from_gguf_blocks(torch.zeros(4, dtype=torch.uint8), "Q2_K", (1, 256))
