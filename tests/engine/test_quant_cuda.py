"""engine.quant.cuda (issue 18's CUDA paths): the repacking into
torch's layouts round-trips exactly, the numbers each path computes match the dequantized float
reference where torch has a CPU kernel for the same op, the path chosen per compute capability,
and the up-front refusal of a quantized checkpoint on a device without kernels for it. Tests that
need CUDA are skipped without it."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.quant.cuda import (
    CudaQuantLinear,
    codes_from_tinygemm_uint8,
    dequant_mm,
    inner_k_tiles,
    kernel_formats,
    make_cuda_linear,
    plan,
    scaled_mm_fp8,
    tinygemm_reference,
    tinygemm_scales_and_zeros,
    tinygemm_uint8,
    to_device,
)
from engine.quant.formats import Int4Weight, pack_int4, quantize_fp8, quantize_int4, quantize_int8
from engine.quant.linear import quantize_activation_rows_fp8
from engine.types import InvalidRequest

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")


def _weight(out=64, cols=256, seed=0):
    return torch.randn(out, cols, generator=torch.Generator().manual_seed(seed)) / cols**0.5


def _x(rows=5, cols=256, seed=1, dtype=torch.float32):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("mins", [True, False])
def test_tinygemm_packing_round_trips(mins):
    w = quantize_int4(_weight(), 64, mins=mins)
    packed = tinygemm_uint8(w)
    assert packed.shape == (64, 128) and packed.dtype == torch.uint8
    assert torch.equal(codes_from_tinygemm_uint8(packed), w.codes())
    # and back into our GGUF nibble order, bit for bit
    assert torch.equal(pack_int4(codes_from_tinygemm_uint8(packed)), w.qweight)
    # torch's documented order: column 2j in the high nibble of byte j, 2j + 1 in the low one
    codes = w.codes()
    assert torch.equal(packed[:, 3] >> 4, codes[:, 6]) and torch.equal(packed[:, 3] & 0xF, codes[:, 7])


def test_tinygemm_scales_and_zeros_are_exact_when_bfloat16_holds_them():
    """Q4_1's min maps to zero = min + 8 * scale, Q4_0 to zero = 0: exact when the float16 scales
    and mins (and min + 8 * scale) are bfloat16 values; GGUF's arbitrary float16 scales are not."""
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (16, 64), generator=g, dtype=torch.uint8)
    scales = (2.0 ** torch.randint(-8, -2, (16, 2), generator=g)).to(torch.float16)
    mins = (torch.randint(-64, 64, (16, 2), generator=g) / 256).to(torch.float16)
    for m in (mins, None):
        w = Int4Weight(pack_int4(codes), scales, 32, m, in_features_=64)
        sz = tinygemm_scales_and_zeros(w)
        assert sz.shape == (2, 16, 2) and sz.dtype == torch.bfloat16
        assert torch.equal(tinygemm_reference(w), w.dequantize())
    gguf_like = quantize_int4(_weight(16, 64), 32)
    error = (tinygemm_reference(gguf_like) - gguf_like.dequantize()).abs().max()
    assert 0 < error <= 2**-8 * gguf_like.dequantize().abs().max()  # close, not bit-equal


@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
def test_tinygemm_scales_and_zeros_through_torchs_cpu_int4_op(group_size):
    """The same (q - 8) * scale + zero form in torch's CPU int4 op (its own packing): our scales and
    zeros give x @ tinygemm_reference^T up to bfloat16 rounding."""
    w = quantize_int4(_weight(64, 512), group_size)
    x = _x(3, 512, dtype=torch.bfloat16)
    packed = torch._convert_weight_to_int4pack_for_cpu(w.codes().to(torch.int32), inner_k_tiles(512))
    got = torch._weight_int4pack_mm_for_cpu(x, packed, group_size, tinygemm_scales_and_zeros(w))
    expected = x.float() @ tinygemm_reference(w).t()
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


def test_inner_k_tiles():
    assert [inner_k_tiles(k) for k in (576, 1536, 4096, 96)] == [4, 8, 8, 2]


def test_fp8_scaled_mm_matches_its_dequantized_reference():
    """torch._scaled_mm with row-wise scales, on the GPU where there is one, else on the CPU (torch
    2.13 has a CPU kernel for row-wise scales; older ones refuse): the activations quantized per row
    to e4m3 times the fp8 weight equal the dequantized product up to bfloat16 output rounding, and
    stay close to the unquantized activations' product."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    w = to_device(quantize_fp8(_weight(64, 256)), device)
    x = _x(5, 256).to(device)
    try:
        got = scaled_mm_fp8(x, w.qweight.t(), w.scales.reshape(1, -1))
    except RuntimeError as exc:
        if device.type == "cpu" and "per-tensor scaling" in str(exc):
            pytest.skip(f"torch {torch.__version__} has no CPU _scaled_mm with row-wise scales")
        raise
    xq, x_scale = quantize_activation_rows_fp8(x)
    exact = (xq.float() * x_scale) @ w.dequantize().t()
    torch.testing.assert_close(got.float(), exact, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got.float(), x @ w.dequantize().t(), atol=0.1, rtol=0.1)
    linear = CudaQuantLinear(w, "scaled_mm")  # the module runs the same op
    xb = x.to(torch.bfloat16)
    assert torch.equal(linear(xb), scaled_mm_fp8(xb, w.qweight.t(), w.scales.reshape(1, -1)))
    assert linear.resident_bytes() == w.nbytes()


@pytest.mark.parametrize(
    "weight",
    [quantize_int8(_weight()), quantize_int8(_weight(), 32), quantize_int4(_weight()), quantize_int4(_weight(), 64, mins=False), quantize_fp8(_weight())],
    ids=["int8", "int8_g32", "int4", "int4_sym_g64", "fp8"],
)
def test_dequant_mm_matches_the_dequantized_reference(weight):
    x = _x()
    expected = x @ weight.dequantize().t()
    torch.testing.assert_close(dequant_mm(x, weight, tile_elems=1000), expected, atol=1e-5, rtol=1e-5)  # several tiles
    linear = CudaQuantLinear(weight, "dequant_mm")
    torch.testing.assert_close(linear(x[None]), expected[None], atol=1e-5, rtol=1e-5)
    bf16 = linear(x.to(torch.bfloat16))
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), expected, atol=5e-2, rtol=5e-2)


def test_paths_by_compute_capability():
    fp8, int4, int8 = quantize_fp8(_weight()), quantize_int4(_weight(), 64), quantize_int8(_weight())
    assert [plan(fp8, c) for c in (None, (8, 0), (8, 9), (9, 0))] == ["dequant_mm"] * 3 + ["scaled_mm"]
    assert [plan(int4, c) for c in (None, (7, 5), (8, 0), (9, 0))] == ["dequant_mm"] * 2 + ["tinygemm"] * 2
    assert plan(quantize_int4(_weight(64, 512), 512), (9, 0)) == "dequant_mm"  # tinygemm: groups up to 256
    assert plan(quantize_fp8(_weight(60, 256)), (9, 0)) == "dequant_mm"  # scaled_mm: multiples of 16
    assert plan(int8, (9, 0)) == "dequant_mm"
    k_quants = ("q4_k", "q5_k", "q6_k")  # GGUF super-blocks: dequantized tile by tile on any GPU
    assert kernel_formats(None) == ("fp8", "int8", *k_quants) and kernel_formats((7, 5)) == ("fp8", "int8", *k_quants)
    assert kernel_formats((8, 0)) == ("fp8", "int8", "int4", *k_quants)


def test_select_backend_picks_the_cuda_backend_for_cuda():
    from engine.backends import select_backend
    from engine.backends.cuda import CudaBackend

    backend = select_backend(EngineConfig(device="cuda"), torch.device("cuda"))
    assert isinstance(backend, CudaBackend) and backend.dtype == torch.bfloat16
    weight = quantize_int4(_weight())
    if torch.cuda.is_available():
        weight = to_device(weight, backend.device)  # as the loader does before building linears
    linear = backend.linear(weight)
    assert isinstance(linear, CudaQuantLinear)
    assert linear.path == ("tinygemm" if backend.capability and backend.capability >= (8, 0) else "dequant_mm")


def test_a_quantized_checkpoint_on_a_device_without_its_kernels_is_refused_up_front(tmp_path, tiny_model_args):
    """QUANTIZATION_TYPE unset: the formats come from the checkpoint's headers, and the load fails
    before any weight is mapped, listing what works."""
    from engine.loading.checkpoint import resolve_checkpoint, write_random_checkpoint
    from engine.executor.worker_group import WorkerGroup
    from tests.conftest import TINY_DESCRIPTOR
    from tests.engine.test_quant_checkpoint import _write_int4_checkpoint

    quant_dir = _write_int4_checkpoint(write_random_checkpoint(tmp_path / "float", tiny_model_args, seed=6), tmp_path / "int4")
    spec = resolve_checkpoint(quant_dir, model_id="tiny", llama_model=TINY_DESCRIPTOR)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0):
        pytest.skip("this CUDA device has int4 kernels")
    for quantization in (None, "int8"):  # a configured type does not override the checkpoint's format
        with pytest.raises(InvalidRequest, match=r"checkpoint .*int4: int4 weights have no kernels on cuda.*what works there: fp8_mixed, int8"):
            WorkerGroup(spec, EngineConfig(device="cuda", quantization=quantization), max_seq_len=64)


def test_checkpoint_formats_come_from_the_headers(tmp_path, tiny_model_args):
    from engine.loading.checkpoint import CheckpointError, quantized_formats, resolve_checkpoint, write_random_checkpoint
    from tests.conftest import TINY_DESCRIPTOR
    from tests.engine.test_quant_checkpoint import _write_int4_checkpoint

    float_dir = write_random_checkpoint(tmp_path / "float", tiny_model_args, seed=6)
    quant_dir = _write_int4_checkpoint(float_dir, tmp_path / "int4")
    assert quantized_formats(resolve_checkpoint(float_dir, model_id="tiny", llama_model=TINY_DESCRIPTOR)) == set()
    spec = resolve_checkpoint(quant_dir, model_id="tiny", llama_model=TINY_DESCRIPTOR)
    assert quantized_formats(spec) == {"int4"}
    (quant_dir / "consolidated.00.safetensors").write_bytes(b"\xff" * 16)  # a header length past the file
    with pytest.raises(CheckpointError, match="not a readable quantized shard"):
        quantized_formats(spec)


# --------------------------------------------------------------------------- on a GPU only
@NEEDS_CUDA
@pytest.mark.parametrize(
    "weight",
    [quantize_int4(_weight(), 32), quantize_int4(_weight(), 128, mins=False), quantize_fp8(_weight()), quantize_int8(_weight())],
    ids=["int4_g32", "int4_sym_g128", "fp8", "int8"],
)
def test_cuda_linear_matches_the_dequantized_reference(weight):
    from engine.backends.cuda import device_capability

    device = torch.device("cuda")
    linear = make_cuda_linear(to_device(weight, device), device_capability(device))
    x = _x(dtype=torch.bfloat16).to(device)
    reference = tinygemm_reference(weight) if linear.path == "tinygemm" else weight.dequantize()
    expected = x.float().cpu() @ reference.t()
    tolerance = 0.1 if linear.path == "scaled_mm" else 3e-2  # fp8 activations
    torch.testing.assert_close(linear(x).float().cpu(), expected, atol=tolerance, rtol=tolerance)


def test_cuda_attention_runs_without_cudnn(monkeypatch):
    """CudaBackend.attention off the Triton path is the torch backend's with cuDNN's SDPA left out
    (engine/backends/cuda.py says why), and only for that call."""
    from types import SimpleNamespace

    from engine.backends.base import AttentionPath
    from engine.backends.cuda import CudaBackend
    from engine.backends.torch_ops import TorchBackend

    seen = []
    monkeypatch.setattr(TorchBackend, "attention", lambda self, *args: seen.append(torch.backends.cuda.cudnn_sdp_enabled()) or "out")
    backend = CudaBackend(torch.device("cpu"), torch.float32)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    meta = SimpleNamespace(path=AttentionPath.GATHERED)  # a layout SDPA runs (the Triton kernel's is PAGED_TILES)
    assert backend.attention(None, None, None, meta) == "out" and seen == [False]
    assert torch.backends.cuda.cudnn_sdp_enabled()
