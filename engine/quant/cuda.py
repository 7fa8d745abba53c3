"""CUDA linears over quantized weights (engine.quant.formats): y = x @ dequantize(W)^T.

The pure tensor code (the repacking into torch's layouts) is tested on the CPU; every path has run
on an NVIDIA H200 (sm_90, torch 2.11), each linear against its dequantized reference
(tests/engine/test_quant_cuda.py) and each QUANTIZATION_TYPE through the whole model
(tests/engine/test_cuda.py). Those tests skip without a GPU; .ci/cuda runs them where one is lent.

One path per weight, chosen at load from its format, its shape and the device's compute capability
(`plan()`); engine.backends.cuda.CudaBackend builds the linear, engine.quant.policy asks
`kernel_formats()` what a device can serve:

- `scaled_mm` (fp8, capability >= 9.0): torch._scaled_mm with row-wise scales, activations
  quantized per row to e4m3 on the fly (amax / 448, as meta-reference's fp8_mixed does through
  fbgemm's rowwise kernels). Row-wise scaling in torch's CUDA scaled matmul is an SM90 feature, so
  Ada (8.9) takes the weight-only path. Needs in and out features multiples of 16.
- `tinygemm` (int4, capability >= 8.0): torch._weight_int4pack_mm (gpt-fast / torchao's tinygemm
  kernel; bfloat16 activations, group sizes 32, 64, 128, 256, out features a multiple of 8, in
  features a multiple of 32). Its numbers are (q - 8) * scale + zero with bfloat16 scale and zero:
  GGUF Q4_0 maps to zero = 0 and Q4_1's min to zero = min + 8 * scale, both rounded from float16
  to bfloat16, so they are close to the file's values, not bit-equal (bfloat16 keeps 8 mantissa
  bits, float16 11). Only the packed int32 layout and the [groups, out, 2] scales stay resident.
- `dequant_mm` (int8 per row or per group, and whatever the two above cannot take): tiles of
  output rows dequantized to bfloat16 on the device, then one matmul per tile (cuBLAS). torch's
  CUDA `_weight_int8pack_mm` exists in recent torch but is a one-thread-per-output loop over K,
  with no tiling: not used.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from engine.quant.formats import ExpertWeights, Fp8Weight, Int4Weight, Int8Weight, QuantizedWeight
from engine.quant.kquants import K_FORMATS, KQuantWeight
from engine.quant.lora import LoraInt8Weight, LoraLinear
from engine.quant.linear import activation_rounding, quantize_activation_rows_fp8, tiled_dequant_mm

TINYGEMM_GROUP_SIZES = (32, 64, 128, 256)
TINYGEMM_MIN_CAPABILITY = (8, 0)  # mma.sync bf16 tensor cores, CUDA >= 12
SCALED_MM_ROWWISE_MIN_CAPABILITY = (9, 0)
# Dequantized tiles hold at most this many values (32 MiB in bfloat16): one transient buffer per call.
DEQUANT_TILE_ELEMS = 1 << 24

Capability = tuple[int, int]


# The compute capability each format needs on CUDA (None: any): fp8 and int8 run everywhere
# (their fallbacks are plain torch), int4 needs tinygemm.
# GGUF K-quants: their super-blocks dequantized tile by tile in torch (dequant_mm), any device.
MIN_CAPABILITY: dict[str, Capability | None] = {"fp8": None, "int8": None, "int4": TINYGEMM_MIN_CAPABILITY, **dict.fromkeys(K_FORMATS)}


def kernel_formats(capability: Capability | None) -> tuple[str, ...]:
    """The weight formats a CUDA device of `capability` serves (None: unknown, e.g. torch without
    CUDA, counts as below every minimum)."""
    return tuple(fmt for fmt, minimum in MIN_CAPABILITY.items() if minimum is None or _at_least(capability, minimum))


def plan(weight: QuantizedWeight, capability: Capability | None) -> str:
    """The path (module docstring) a weight takes on a device of `capability`."""
    n, k = weight.shape
    per_row = weight.scales.shape[-1] == 1
    if isinstance(weight, Fp8Weight) and per_row and _at_least(capability, SCALED_MM_ROWWISE_MIN_CAPABILITY) and n % 16 == 0 and k % 16 == 0:
        return "scaled_mm"
    if isinstance(weight, Int4Weight) and _at_least(capability, TINYGEMM_MIN_CAPABILITY) and tinygemm_fits(weight):
        return "tinygemm"
    return "dequant_mm"


def _at_least(capability: Capability | None, minimum: Capability) -> bool:
    return capability is not None and tuple(capability) >= minimum


def tinygemm_fits(weight: Int4Weight) -> bool:
    n, k = weight.shape
    return weight.group_size in TINYGEMM_GROUP_SIZES and n % 8 == 0 and k % 32 == 0


def to_device(weight: QuantizedWeight | ExpertWeights, device: torch.device) -> QuantizedWeight | ExpertWeights:
    """The same weight with its tensors on `device` (a checkpoint's codes are mapped on the CPU)."""
    if isinstance(weight, ExpertWeights):  # each expert's own weight
        return replace(weight, parts=tuple(to_device(p, device) for p in weight.parts))
    return replace(weight, **{role: t.to(device) for role, t in weight.tensors().items()})


# --------------------------------------------------------------------------- repacking (pure tensor code)
def tinygemm_uint8(weight: Int4Weight) -> torch.Tensor:
    """uint8 [out, in / 2] as torch._convert_weight_to_int4pack reads it: byte j holds column 2j in
    its high nibble and 2j + 1 in its low nibble (ours: GGUF's j / j + 16 per 32-column block)."""
    codes = weight.codes()
    return ((codes[:, 0::2] << 4) | codes[:, 1::2]).contiguous()


def codes_from_tinygemm_uint8(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of tinygemm_uint8's packing: uint8 codes [out, in] in column order."""
    out, half = packed.shape
    return torch.stack([packed >> 4, packed & 0x0F], dim=-1).reshape(out, 2 * half)


def tinygemm_scales_and_zeros(weight: Int4Weight) -> torch.Tensor:
    """bfloat16 [groups, out, 2] (scale, zero) such that (q - 8) * scale + zero is our value:
    symmetric (Q4_0) zero = 0; with mins zero = min + 8 * scale (computed in float32, rounded once)."""
    scales = weight.scales.float()
    zeros = torch.zeros_like(scales) if weight.mins is None else weight.mins.float() + 8.0 * scales
    return torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()


def tinygemm_reference(weight: Int4Weight) -> torch.Tensor:
    """float32 [out, in]: the values tinygemm multiplies by (bfloat16 scale and zero, applied in
    float32 here; the kernel's bfloat16 FMA rounds once more)."""
    sz = tinygemm_scales_and_zeros(weight).float()  # [groups, out, 2]
    scale, zero = (sz[..., i].t().repeat_interleave(weight.group_size, dim=1) for i in (0, 1))
    return (weight.codes().float() - 8.0) * scale + zero


def inner_k_tiles(in_features: int) -> int:
    """tinygemm's innerKTiles: the widest of 8, 4, 2 k-tiles of 16 that divides in_features."""
    return next(tiles for tiles in (8, 4, 2) if in_features % (tiles * 16) == 0)


def scaled_mm_fp8(x: torch.Tensor, codes_t: torch.Tensor, scales_row: torch.Tensor, scale_ub: float | None = None) -> torch.Tensor:
    """x [rows, in] @ (scales * codes)^T in bfloat16 through torch._scaled_mm with row-wise scales;
    codes_t is the weight's codes transposed ([in, out], column-major), scales_row float32 [1, out];
    the activations' amax capped at scale_ub where the weight says so (a Meta FP8 release)."""
    xq, x_scale = quantize_activation_rows_fp8(x, scale_ub)
    return torch._scaled_mm(xq, codes_t, scale_a=x_scale, scale_b=scales_row, out_dtype=torch.bfloat16)


# --------------------------------------------------------------------------- the linear
class CudaQuantLinear(nn.Module):
    """x [..., in_features] -> [..., out_features] in x's dtype over a quantized weight on a CUDA
    device, through the path plan() chose; keeps only what that path reads."""

    def __init__(self, weight: QuantizedWeight, path: str) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.weight_format = weight.format
        self.group_size = weight.group_size
        self.path = path
        self._activation_ub = getattr(weight, "activation_scale_ub", None)  # a Meta FP8 release: inputs rounded to fp8 per row
        self._round_input = activation_rounding(weight)  # Meta's releases (fp8 rows, int8 tokens), outside scaled_mm
        self._weight: QuantizedWeight | None = None
        self._held: tuple[torch.Tensor, ...]
        if path == "scaled_mm":
            self._held = (weight.qweight.contiguous().t(), weight.scales.float().reshape(1, -1).contiguous())
        elif path == "tinygemm":
            packed = torch._convert_weight_to_int4pack(tinygemm_uint8(weight), inner_k_tiles(weight.in_features))
            self._held = (packed, tinygemm_scales_and_zeros(weight))
        elif path == "dequant_mm":
            self._weight = weight.contiguous()
            self._held = tuple(self._weight.tensors().values())
        else:
            raise ValueError(f"unknown CUDA quantized path {path!r}")

    def storage_key(self) -> int:
        return self._held[0].data_ptr()

    def resident_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._held)

    def extra_repr(self) -> str:
        return f"{self.weight_format} via {self.path}, in_features={self.in_features}, out_features={self.out_features}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.path == "scaled_mm":
            out = scaled_mm_fp8(flat, *self._held, self._activation_ub)
        elif self.path == "tinygemm":
            out = torch._weight_int4pack_mm(flat.to(torch.bfloat16).contiguous(), self._held[0], self.group_size, self._held[1])
        else:
            if self._round_input is not None:
                flat = self._round_input(flat)
            out = dequant_mm(flat, self._weight)  # type: ignore[arg-type]
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def dequant_mm(x: torch.Tensor, weight: QuantizedWeight, tile_elems: int = DEQUANT_TILE_ELEMS) -> torch.Tensor:
    """x [rows, in] @ dequantize(weight)^T, the weight dequantized to bfloat16 for bfloat16 / float16
    inputs (cuBLAS's fast path), else float32, a tile of output rows at a time."""
    compute = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
    return tiled_dequant_mm(x, weight, compute, tile_elems=tile_elems)


def make_cuda_linear(weight: QuantizedWeight, capability: Capability | None) -> nn.Module:
    if isinstance(weight, LoraInt8Weight):  # the base on its CUDA path, the adaptor in torch
        return LoraLinear(make_cuda_linear(weight.base(), capability), weight)
    if not isinstance(weight, (Int8Weight, Int4Weight, Fp8Weight, KQuantWeight)):
        raise TypeError(f"no CUDA linear for {type(weight).__name__}")
    return CudaQuantLinear(weight, plan(weight, capability))
