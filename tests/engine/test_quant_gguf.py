"""GGUF Q4_0 / Q4_1 / Q8_0 blocks kept native (engine/quant/gguf_blocks.py): after import our
dequantize() equals gguf's own dequantizer bit for bit, on tensors written by gguf's quantizer and
read back through a real GGUF file, and our linears compute on those numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.quant import gguf_blocks
from engine.quant.formats import Int4Weight, Int8Weight
from engine.kernels.quant import load_quant_kernels
from engine.quant.linear import QuantLinear

gguf = pytest.importorskip("gguf")
TYPES = ["Q4_0", "Q4_1", "Q8_0"]


def _weights(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    w[0, :32] = 0.0  # an all-zero block (scale 0)
    w[1, 5] = 3.0  # an outlier dominating its block
    return w


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("shape", [(48, 96), (3, 32), (16, 576)])
def test_blocks_dequantize_bit_exact(type_name: str, shape: tuple[int, int]) -> None:
    qtype = gguf.GGMLQuantizationType[type_name]
    raw = gguf.quants.quantize(_weights(*shape, seed=shape[1]), qtype)
    expected = gguf.quants.dequantize(raw, qtype)
    weight = gguf_blocks.from_gguf_blocks(raw, type_name, shape)
    assert isinstance(weight, Int8Weight if type_name == "Q8_0" else Int4Weight)
    assert weight.shape == shape and weight.group_size == 32
    assert (getattr(weight, "mins", None) is not None) == (type_name == "Q4_1")
    got = weight.dequantize(torch.float32).numpy()
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))  # bit for bit, signed zeros too
    # the C kernels' dequantizer matches as well
    kernels = load_quant_kernels()
    if kernels is not None:
        out = torch.empty(shape, dtype=torch.float32)
        kernels.dequantize(weight, 0, shape[0], out, 1)
        assert torch.equal(out, torch.from_numpy(expected))


def test_native_bytes_kept() -> None:
    """Resident bytes are GGUF's own: Q4_0 18, Q4_1 20, Q8_0 34 bytes per 32 weights."""
    shape = (64, 256)
    for type_name, per_block in (("Q4_0", 18), ("Q4_1", 20), ("Q8_0", 34)):
        raw = gguf.quants.quantize(_weights(*shape, seed=1), gguf.GGMLQuantizationType[type_name])
        assert gguf_blocks.from_gguf_blocks(raw, type_name, shape).nbytes() == raw.nbytes == 64 * 8 * per_block


def test_bad_blocks_rejected() -> None:
    raw = gguf.quants.quantize(_weights(4, 64, seed=2), gguf.GGMLQuantizationType.Q4_0)
    with pytest.raises(ValueError, match="does not hold"):
        gguf_blocks.from_gguf_blocks(raw, "Q4_0", (4, 96))
    with pytest.raises(ValueError, match="not kept native"):
        gguf_blocks.from_gguf_blocks(raw, "Q5_0", (4, 64))


def test_read_from_gguf_file(tmp_path) -> None:
    """Through a written GGUF file and gguf's reader (ggml shapes, mmapped block bytes); other types stay None."""
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    arrays = {}
    for i, type_name in enumerate(TYPES):
        qtype = gguf.GGMLQuantizationType[type_name]
        raw = gguf.quants.quantize(_weights(40, 64, seed=i), qtype)
        writer.add_tensor(f"w.{type_name}", raw, raw_shape=raw.shape, raw_dtype=qtype)
        arrays[type_name] = gguf.quants.dequantize(raw, qtype)
    writer.add_tensor("norm", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(path)
    for tensor in reader.tensors:
        weight = gguf_blocks.from_reader_tensor(tensor)
        if tensor.name == "norm":
            assert weight is None
            continue
        type_name = tensor.name.split(".")[1]
        assert weight.shape == (40, 64)
        assert np.array_equal(weight.dequantize().numpy(), arrays[type_name])


@pytest.mark.parametrize("type_name", TYPES)
def test_linear_on_gguf_numbers(type_name: str) -> None:
    """The quantized linear on imported blocks == x @ gguf's dequantized weight (float64 reference)."""
    shape = (40, 96)
    qtype = gguf.GGMLQuantizationType[type_name]
    raw = gguf.quants.quantize(_weights(*shape, seed=7), qtype)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).double()
    layer = QuantLinear(gguf_blocks.from_gguf_blocks(raw, type_name, shape), load_quant_kernels())
    x = torch.randn(3, shape[1], generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(layer(x).double(), x.double() @ dense.T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qtype_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_import_keep_quantized(tmp_path, qtype_name: str) -> None:
    """`import-gguf --keep-quantized`: the no-pickle shard holds every GGUF matrix in its own blocks,
    and its dequantized values are exactly the default import's float32 weights."""
    from engine.loading.gguf_import import QUANTIZED_WEIGHTS_FILE, WEIGHTS_FILE, import_gguf, main
    from engine.quant.shard_file import load_shard
    from tests.engine.test_gguf_import import hf_weights, write_gguf

    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf_weights(seed=1, tied=False), qtype=gguf.GGMLQuantizationType[qtype_name])
    dense_dir = import_gguf(path, tmp_path / "dense", progress=False)
    assert main([str(path), str(tmp_path / "native"), "--keep-quantized", "--quiet"]) == 0
    native_dir = tmp_path / "native"
    assert not (native_dir / WEIGHTS_FILE).exists() and (native_dir / "params.json").exists()
    quantized, plain = load_shard(native_dir / QUANTIZED_WEIGHTS_FILE)
    dense = torch.load(dense_dir / WEIGHTS_FILE, weights_only=True)
    assert {f"{k}.weight" for k in quantized} | set(plain) == set(dense)
    assert "layers.0.attention.wq" in quantized and "tok_embeddings" in quantized and "norm.weight" in plain
    expected_type = Int8Weight if qtype_name == "Q8_0" else Int4Weight
    for key, weight in quantized.items():
        assert isinstance(weight, expected_type)
        assert torch.equal(weight.dequantize(), dense[f"{key}.weight"]), key
    for name, tensor in plain.items():
        assert torch.equal(tensor, dense[name]), name
    # the default import again replaces the quantized file (one weights file per dir)
    import_gguf(path, native_dir, progress=False)
    assert (native_dir / WEIGHTS_FILE).exists() and not (native_dir / QUANTIZED_WEIGHTS_FILE).exists()
