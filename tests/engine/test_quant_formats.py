"""Quantized weight formats (engine/quant/formats.py) and their no-pickle shard file
(engine/quant/shard_file.py): quantization error bounds, exact dequantization, group-size errors,
model-parallel slicing at group boundaries, resident bytes, save/load round trips."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from engine.quant import formats, shard_file
from engine.quant.formats import Fp8Weight, Int4Weight, Int8Weight, quantize, quantize_int4, quantize_int8

FORMATS = ["int8", "int4", "fp8"]


def weight(rows: int = 48, cols: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.02


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantization_error_within_format_step(fmt: str) -> None:
    w = weight()
    q = quantize(w, fmt)
    err = (q.dequantize() - w).abs()
    if fmt == "int8":  # half a step of amax / 127 per row (+ the bf16 rounding of the scale)
        bound = w.abs().amax(dim=1, keepdim=True) / 127 * 0.51
    elif fmt == "int4":  # half a step of (max - min) / 15 per group of 32
        g = w.reshape(48, -1, 32)
        bound = ((g.amax(-1) - g.amin(-1)) / 15 * 0.51).repeat_interleave(32, dim=1) + 1e-4
    else:  # e4m3: 3 mantissa bits, relative 2^-4 (and the subnormal step)
        bound = w.abs() * 2**-4 + w.abs().amax(dim=1, keepdim=True) / 448 * 2**-9
    assert bool((err <= bound).all()), float((err - bound).max())


def test_int4_symmetric_and_codes() -> None:
    w = weight()
    q = quantize_int4(w, mins=False)
    assert q.mins is None and q.codes().max() <= 15
    expected = q.scales.float().repeat_interleave(32, dim=1) * (q.codes().float() - 8)
    assert torch.equal(q.dequantize(), expected)
    assert float((q.dequantize() - w).abs().max()) < float(w.abs().max()) / 7


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_dtype(fmt: str) -> None:
    q = quantize(weight(), fmt)
    assert torch.equal(q.dequantize(torch.bfloat16), q.dequantize(torch.float32).to(torch.bfloat16))


def test_zero_weight_quantizes_to_zero() -> None:
    for fmt in FORMATS:
        assert torch.equal(quantize(torch.zeros(4, 64), fmt).dequantize(), torch.zeros(4, 64))


def test_odd_in_features() -> None:
    """Group-wise formats need in_features % group_size == 0: a clear error, never padding.
    Per-row formats (int8 default, fp8) take any width."""
    w = weight(8, 100)
    with pytest.raises(ValueError, match="not a multiple of the group size 32.*fit: none"):
        quantize(w, "int4")
    with pytest.raises(ValueError, match="group sizes that fit: \\[32, 64\\]"):
        quantize_int4(weight(8, 192), group_size=128)
    with pytest.raises(ValueError, match="multiples of 32"):
        quantize_int4(weight(8, 96), group_size=48)
    with pytest.raises(ValueError, match="group size 32"):
        quantize_int8(w, group_size=32)
    for fmt in ("int8", "fp8"):
        assert quantize(w, fmt).shape == (8, 100)


def test_group_sizes() -> None:
    w = weight(16, 256)
    q64 = quantize_int4(w, group_size=64)
    assert q64.scales.shape == (16, 4) and q64.group_size == 64
    q8 = quantize_int8(w, group_size=32)
    assert q8.scales.shape == (16, 8) and q8.scales.dtype == torch.float16


@pytest.mark.parametrize("fmt,ratio_f32", [("int8", 4 * 128 / (128 + 4)), ("int4", 32 / 5), ("fp8", 4 * 128 / (128 + 4))])
def test_resident_bytes_factor(fmt: str, ratio_f32: float) -> None:
    """Bytes vs float32 (bfloat16: half): int8/fp8 1 byte + a float32 scale per row; int4 4 bits +
    float16 scale and min per 32 weights (5 bits a weight: 6.4x under float32, 3.2x under bf16)."""
    w = weight(64, 128)
    q = quantize(w, fmt)
    assert q.nbytes() * ratio_f32 == pytest.approx(w.numel() * 4)
    assert quantize_int4(w, mins=False).nbytes() * 32 / 4.5 == pytest.approx(w.numel() * 4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_and_cols_shards(fmt: str) -> None:
    """MP shards: output rows (column-parallel) and input columns at group boundaries (row-parallel)
    are exact slices of the dequantized weight; a cut inside a group is refused."""
    w = weight(48, 256)
    q = quantize(w, fmt)
    full = q.dequantize()
    assert torch.equal(q.rows(16, 32).dequantize(), full[16:32])
    for start, stop in ((0, 128), (128, 256), (64, 96)):
        shard = q.cols(start, stop)
        assert shard.in_features == stop - start
        assert torch.equal(shard.dequantize(), full[:, start:stop])
        assert torch.equal(shard.contiguous().dequantize(), full[:, start:stop])
    if fmt == "int4":
        with pytest.raises(ValueError, match="group boundaries"):
            q.cols(0, 80)


def test_cols_of_per_row_int8_any_cut() -> None:
    q = quantize_int8(weight(8, 100))
    assert torch.equal(q.cols(0, 37).dequantize(), q.dequantize()[:, :37])


# --------------------------------------------------------------------------- shard file
def _all_kinds() -> dict[str, formats.QuantizedWeight]:
    w = weight(32, 128, seed=3)
    return {
        "layers.0.attention.wq": quantize(w, "int8"),
        "layers.0.attention.wk": quantize(w, "int4"),
        "layers.0.attention.wv": quantize_int4(w, mins=False, group_size=64),
        "layers.0.attention.wo": quantize(w, "fp8"),
        "layers.0.feed_forward.w1": quantize_int8(w, group_size=32),
    }


def test_save_load_round_trip(tmp_path) -> None:
    quantized = _all_kinds()
    plain = {
        "tok_embeddings.weight": weight(10, 128).to(torch.bfloat16),
        "norm.weight": torch.ones(128),
        "layers.0.attention_norm.weight": torch.ones(128, dtype=torch.float16),
    }
    path = tmp_path / "consolidated.00.safetensors"
    shard_file.save_shard(path, quantized, plain)
    loaded_q, loaded_plain = shard_file.load_shard(path)
    assert loaded_plain.keys() == plain.keys()
    for name, tensor in plain.items():
        assert loaded_plain[name].dtype == tensor.dtype and torch.equal(loaded_plain[name], tensor)
    assert loaded_q.keys() == quantized.keys()
    for key, q in quantized.items():
        got = loaded_q[key]
        assert type(got) is type(q) and got.group_size == q.group_size and got.shape == q.shape
        for role, tensor in q.tensors().items():
            assert got.tensors()[role].dtype == tensor.dtype and torch.equal(got.tensors()[role].view(torch.uint8), tensor.view(torch.uint8))
        assert torch.equal(got.dequantize(), q.dequantize())


def test_file_is_safetensors_layout(tmp_path) -> None:
    """8-byte header length, JSON header with dtype/shape/data_offsets, our metadata entry, 8-aligned data."""
    path = tmp_path / "s.safetensors"
    shard_file.save_shard(path, {"w": quantize(weight(4, 64), "int4")}, {"n": torch.ones(3)})
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    assert (8 + length) % 8 == 0
    assert header["n"] == {"dtype": "F32", "shape": [3], "data_offsets": header["n"]["data_offsets"]}
    assert header["w.qweight"]["dtype"] == "U8" and header["w.qweight"]["shape"] == [4, 32]
    assert header["w.scales"]["dtype"] == "F16" and "w.mins" in header
    meta = json.loads(header["__metadata__"][shard_file.METADATA_KEY])
    assert meta == {"version": 1, "weights": {"w": {"format": "int4", "shape": [4, 64], "group_size": 32}}}
    assert len(raw) == 8 + length + max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__")


def test_load_rejects_inconsistent_metadata(tmp_path) -> None:
    path = tmp_path / "bad.safetensors"
    q = quantize(weight(4, 64), "int4")
    shard_file.save_shard(path, {"w": q}, {})
    raw = path.read_bytes()
    raw = raw.replace(b'\\"shape\\": [4, 64]', b'\\"shape\\": [4, 96]')
    path.write_bytes(raw)
    with pytest.raises(ValueError, match="bad quantized-weight metadata.*unexpected"):
        shard_file.load_shard(path)


def test_from_tensors_checks_dtypes() -> None:
    q = quantize(weight(4, 64), "fp8")
    with pytest.raises(ValueError, match="scales"):
        formats.from_tensors(q.header(), {"qweight": q.qweight, "scales": q.scales.half()})
    assert isinstance(formats.from_tensors(q.header(), q.tensors()), Fp8Weight)
    assert isinstance(formats.from_tensors(quantize(weight(4, 64), "int8").header(), quantize(weight(4, 64), "int8").tensors()), Int8Weight)
    assert isinstance(formats.from_tensors(quantize(weight(4, 64), "int4").header(), quantize(weight(4, 64), "int4").tensors()), Int4Weight)


@pytest.mark.parametrize("fmt", FORMATS)
def test_lookup_rows_as_embedding(fmt: str) -> None:
    q = quantize(weight(50, 64), fmt)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    got = q.lookup(ids, torch.bfloat16)
    assert got.shape == (2, 3, 64) and got.dtype == torch.bfloat16
    assert torch.equal(got, q.dequantize(torch.bfloat16)[ids])


def test_quantization_type_names() -> None:
    """The configured names (QUANTIZATION_TYPE / metadata.quantization) name a format and group size."""
    from engine.quant import QUANTIZATION_TYPES

    assert set(QUANTIZATION_TYPES) == {"fp8_mixed", "int4_mixed", "int8"}
    for name, qtype in QUANTIZATION_TYPES.items():
        q = quantize(weight(8, 64), qtype.format, group_size=qtype.group_size)
        assert q.format == qtype.format and q.group_size == (qtype.group_size or 64), name


@pytest.mark.parametrize("fmt", FORMATS)
def test_concat_rows_fuses_exactly(fmt: str) -> None:
    parts = [quantize(weight(r, 64, seed=r), fmt) for r in (8, 4, 4)]
    fused = formats.concat_rows(parts)
    assert fused.shape == (16, 64)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    with pytest.raises(ValueError, match="different formats"):
        formats.concat_rows([parts[0], quantize(weight(8, 64), "int8" if fmt != "int8" else "fp8")])
