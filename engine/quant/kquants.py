"""GGUF K-quants (Q4_K, Q5_K, Q6_K) kept in their own super-blocks: what Q4_K_M / Q5_K_M / Q6_K
files hold, served without dequantizing them to float at load.

A row of `cols` values is cols / 256 super-blocks, stored exactly as ggml lays them out (qweight is
uint8 [out, cols / 256 * type_size], the file's bytes); there are no separate scale tensors (the
scales live inside each super-block), so `scales` is an empty placeholder and tensors() holds
qweight only. Per super-block (ggml's block_q4_K, block_q5_K, block_q6_K):
- Q4_K, 144 bytes: f16 d, f16 dmin, 12 bytes of eight 6-bit (scale, min) pairs, 128 bytes of
  nibbles; value = (d * sc[j]) * q - dmin * m[j] for 32-value sub-block j.
- Q5_K, 176 bytes: as Q4_K plus 32 bytes holding each value's fifth bit (bit j of byte i: value
  32 j + i), before the nibbles.
- Q6_K, 210 bytes: 128 bytes of low nibbles, 64 bytes of two high bits, 16 int8 scales (one per 16
  values), f16 d; value = (d * sc[j]) * (q - 32).
dequantize() does the float32 operations `gguf.quants.dequantize` does, in its order, so the values
are bit for bit its own (tests/engine/test_kquants.py checks it; every product there is exact in
float32, so a fused multiply-add in the C kernels rounds where numpy does). MP shards: rows() takes
output rows, cols() input columns at super-block boundaries (256), both views of the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from engine.quant.formats import QuantizedWeight

QK_K = 256  # values per super-block (ggml's QK_K)
_SCALE_BYTES = 12  # Q4_K / Q5_K packed 6-bit scales and mins


def _no_scales() -> torch.Tensor:
    return torch.empty(0, dtype=torch.float16)


@dataclass(frozen=True)
class KQuantWeight(QuantizedWeight):
    """One K-quant weight; the subclasses fix the type (see the module docstring)."""

    format: ClassVar[str]
    ggml_type: ClassVar[str]
    type_size: ClassVar[int]  # bytes per super-block
    in_features_: int = 0

    @property
    def in_features(self) -> int:
        return self.in_features_

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.qweight}

    def cols(self, start: int, stop: int) -> "KQuantWeight":
        if start % QK_K or stop % QK_K:
            raise ValueError(f"{self.format} columns [{start}, {stop}) do not fall on {QK_K}-column super-block boundaries")
        size = self.type_size
        return replace(self, qweight=self.qweight[:, start // QK_K * size : stop // QK_K * size], in_features_=stop - start)

    def blocks(self) -> torch.Tensor:
        """The super-blocks, uint8 [out * cols / 256, type_size]."""
        return self.qweight.contiguous().reshape(-1, self.type_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        values = self._dequantize_blocks(self.blocks())
        return values.reshape(self.out_features, self.in_features).to(dtype)

    def _dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def _f16(two_bytes: torch.Tensor) -> torch.Tensor:
    """[n, 2] little-endian bytes -> float32 [n, 1]."""
    return two_bytes.contiguous().view(torch.float16).float()


def _shifted(bytes_: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """[n, a, b] uint8 -> [n, a, len(shifts), b]: (byte >> shift) & mask for each shift."""
    shift = torch.tensor(shifts, dtype=torch.uint8, device=bytes_.device).reshape(1, 1, -1, 1)
    return (bytes_.unsqueeze(2) >> shift) & mask


def _scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 packed bytes -> (scales, mins), uint8 [n, 8] each (gguf's Q4_K.get_scale_min)."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mins


def _scales_and_offsets(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's shared head: per sub-block scale d*sc and offset dmin*m, [n, 8, 1] each."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mins = _scale_min(blocks[:, 4:16])
    return (d * sc.float()).reshape(n, -1, 1), (dmin * mins.float()).reshape(n, -1, 1)


@dataclass(frozen=True)
class Q4KWeight(KQuantWeight):
    format: ClassVar[str] = "q4_k"
    ggml_type: ClassVar[str] = "Q4_K"
    type_size: ClassVar[int] = 144

    def _dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        scale, offset = _scales_and_offsets(blocks)
        q = _shifted(blocks[:, 16:].reshape(n, 4, 32), [0, 4], 0x0F).reshape(n, 8, 32).float()
        return (scale * q - offset).reshape(n, QK_K)


@dataclass(frozen=True)
class Q5KWeight(KQuantWeight):
    format: ClassVar[str] = "q5_k"
    ggml_type: ClassVar[str] = "Q5_K"
    type_size: ClassVar[int] = 176

    def _dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        scale, offset = _scales_and_offsets(blocks)
        low = _shifted(blocks[:, 48:].reshape(n, 4, 32), [0, 4], 0x0F).reshape(n, 8, 32)
        high = _shifted(blocks[:, 16:48].reshape(n, 1, 32), list(range(8)), 0x01).reshape(n, 8, 32)
        q = (low | (high << 4)).float()
        return (scale * q - offset).reshape(n, QK_K)


@dataclass(frozen=True)
class Q6KWeight(KQuantWeight):
    format: ClassVar[str] = "q6_k"
    ggml_type: ClassVar[str] = "Q6_K"
    type_size: ClassVar[int] = 210

    def _dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
        d = _f16(blocks[:, 208:210])
        scale = (d * scales).reshape(n, QK_K // 16, 1)
        low = _shifted(blocks[:, 0:128].reshape(n, 2, 64), [0, 4], 0x0F).reshape(n, 8, 32)
        high = _shifted(blocks[:, 128:192].reshape(n, 2, 32), [0, 2, 4, 6], 0x03).reshape(n, 8, 32)
        q = ((low | (high << 4)).to(torch.int16) - 32).reshape(n, QK_K // 16, 16).float()
        return (scale * q).reshape(n, QK_K)


K_FORMATS: dict[str, type[KQuantWeight]] = {cls.format: cls for cls in (Q4KWeight, Q5KWeight, Q6KWeight)}
BY_GGML_TYPE: dict[str, type[KQuantWeight]] = {cls.ggml_type: cls for cls in K_FORMATS.values()}


def from_gguf_blocks(raw: torch.Tensor, type_name: str, shape: tuple[int, int]) -> KQuantWeight:
    """Our weight from a GGUF tensor's raw bytes (uint8, any shape) of K-quant `type_name` and torch
    shape [rows, cols]; ValueError if the bytes do not fit the type and shape."""
    cls = BY_GGML_TYPE.get(type_name)
    if cls is None:
        raise ValueError(f"GGUF type {type_name} is not a K-quant kept native; these are: {', '.join(BY_GGML_TYPE)}")
    rows, cols = shape
    if cols % QK_K or raw.dtype != torch.uint8 or raw.numel() != rows * (cols // QK_K) * cls.type_size:
        raise ValueError(
            f"{type_name} data of {raw.numel()} bytes ({raw.dtype}) does not hold a [{rows}, {cols}] tensor "
            f"(rows of {cols} / {QK_K} super-blocks of {cls.type_size} bytes)"
        )
    return cls(raw.reshape(rows, -1), _no_scales(), QK_K, in_features_=cols)


def from_tensors(header: dict[str, object], tensors: dict[str, torch.Tensor]) -> KQuantWeight:
    """The weight a shard file's header (QuantizedWeight.header()) and qweight describe."""
    cls = K_FORMATS[str(header["format"])]
    out, cols = (int(n) for n in header["shape"])  # type: ignore[union-attr]
    qweight = tensors["qweight"]
    if cols % QK_K or qweight.dtype != torch.uint8 or tuple(qweight.shape) != (out, cols // QK_K * cls.type_size):
        raise ValueError(f"{cls.format} weight of shape [{out}, {cols}] has unexpected qweight {qweight.dtype} {list(qweight.shape)}")
    return cls(qweight, _no_scales(), QK_K, in_features_=cols)


# --------------------------------------------------------------------------- quantize from float
# Simple round-to-nearest quantizers (not llama.cpp's error-minimizing search): for tests and for
# writing K-quant files from float weights where the exact codes matter less than the layout. Sub-block
# scales and mins round up, so no code clamps: the error stays within half a step.
def _pack_scale_min(sc: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 8] 6-bit scales and mins -> the 12 packed bytes (inverse of _scale_min)."""
    out = torch.zeros(sc.shape[0], _SCALE_BYTES, dtype=torch.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mins[:, 0:4] & 0x3F) | ((mins[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mins[:, 4:8] & 0x0F) << 4)
    return out


def _as_f16_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16).reshape(-1, 1).contiguous().view(torch.uint8)


def quantize_q4_k(weight: torch.Tensor) -> Q4KWeight:
    """Q4_K by rounding: per 32-value sub-block value ~= d * sc * q - dmin * m, codes 0..15."""
    rows, cols = weight.shape
    if cols % QK_K:
        raise ValueError(f"in_features {cols} is not a multiple of {QK_K} (K-quant super-blocks)")
    w = weight.detach().float().reshape(-1, 8, 32)
    low = torch.clamp(w.amin(dim=-1), max=0.0)  # value = scale * q - offset with offset = -low >= 0
    sub_scale = (w.amax(dim=-1) - low) / 15.0
    d = (sub_scale.amax(dim=-1) / 63.0).to(torch.float16).float()
    dmin = ((-low).amax(dim=-1) / 63.0).to(torch.float16).float()
    sc = torch.where(d[:, None] > 0, torch.ceil(sub_scale / d[:, None].clamp(min=1e-30)), 0).clamp(0, 63).to(torch.uint8)
    mins = torch.where(dmin[:, None] > 0, torch.ceil(-low / dmin[:, None].clamp(min=1e-30)), 0).clamp(0, 63).to(torch.uint8)
    scale, offset = d[:, None] * sc.float(), dmin[:, None] * mins.float()
    q = torch.where(scale[..., None] > 0, torch.round((w + offset[..., None]) / scale[..., None].clamp(min=1e-30)), 0)
    q = q.clamp(0, 15).to(torch.uint8).reshape(-1, 4, 2, 32)
    nibbles = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    blocks = torch.cat([_as_f16_bytes(d), _as_f16_bytes(dmin), _pack_scale_min(sc, mins), nibbles], dim=1)
    return Q4KWeight(blocks.reshape(rows, -1).contiguous(), _no_scales(), QK_K, in_features_=cols)


def quantize_q6_k(weight: torch.Tensor) -> Q6KWeight:
    """Q6_K by rounding: per 16-value group value ~= d * sc * (q - 32), sc int8, codes 0..63."""
    rows, cols = weight.shape
    if cols % QK_K:
        raise ValueError(f"in_features {cols} is not a multiple of {QK_K} (K-quant super-blocks)")
    w = weight.detach().float().reshape(-1, 16, 16)
    sub_scale = w.abs().amax(dim=-1) / 31.0
    d = (sub_scale.amax(dim=-1) / 127.0).to(torch.float16).float()
    sc = torch.where(d[:, None] > 0, torch.ceil(sub_scale / d[:, None].clamp(min=1e-30)), 0).clamp(-128, 127)
    scale = d[:, None] * sc
    q = torch.where(scale[..., None] > 0, torch.round(w / scale[..., None].clamp(min=1e-30)), 0).clamp(-32, 31) + 32
    q = q.to(torch.uint8).reshape(-1, 2, 4, 32)  # [blocks, half, quarter, 32]: value 128 h + 32 s + i
    ql = ((q[:, :, :2] & 0x0F) | ((q[:, :, 2:] & 0x0F) << 4)).reshape(-1, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)).reshape(-1, 64)
    blocks = torch.cat([ql, qh, sc.to(torch.int8).view(torch.uint8), _as_f16_bytes(d)], dim=1)
    return Q6KWeight(blocks.reshape(rows, -1).contiguous(), _no_scales(), QK_K, in_features_=cols)
