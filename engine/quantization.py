"""How the linear weights are stored and multiplied, chosen once at load time.

Weight-only quantization (QUANTIZATION_TYPE) and, on CPU, oneDNN pre-packed weights.

"fp8_mixed": the transformer's linear weights (wq/wk/wv/wo/w1/w2/w3) are stored as float8_e4m3fn
with one scale per output row; embeddings, norms and the output head stay in the model dtype (the
"mixed" of Meta's fp8_mixed checkpoints). It mainly saves memory: the matmul runs in the model dtype
on the dequantised weight, with the per-row scale applied to the output, so it works on CPU too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.types import InvalidRequest

if TYPE_CHECKING:
    from engine.cpu_kernels import CpuKernels

SUPPORTED = ("fp8_mixed",)
FP8_DTYPE = torch.float8_e4m3fn
_FP8_MAX = 448.0  # largest finite float8_e4m3fn value
_LINEARS = {"attention": ("wq", "wk", "wv", "wo"), "feed_forward": ("w1", "w2", "w3")}
_ROW = ("wo", "w2")  # row-parallel: partial sums all-reduced; the others are column-parallel


def check_quantization(name: str | None) -> None:
    if name is not None and name not in SUPPORTED:
        raise InvalidRequest(
            f"unknown quantization {name!r}; supported: {', '.join(SUPPORTED)} (or none)", param="quantization"
        )


class Fp8RowwiseLinear(nn.Module):
    """y = (x @ Wq^T) * scale, Wq in float8 [out, in], scale [out] in the activation dtype."""

    def __init__(self, weight: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        super().__init__()
        amax = weight.detach().abs().amax(dim=1).float().clamp(min=1e-12)
        scale = amax / _FP8_MAX
        self.weight = nn.Parameter((weight.float() / scale[:, None]).to(FP8_DTYPE), requires_grad=False)
        self.scale = nn.Parameter(scale.to(weight.dtype), requires_grad=False)
        self._reduce = reduce  # row-parallel layers all-reduce their partial sums

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight.to(x.dtype)).mul_(self.scale)
        return self._reduce(out) if self._reduce is not None else out


Collective = Callable[[torch.Tensor], torch.Tensor] | None


def _collectives(mp_size: int) -> tuple[Collective, Collective]:
    """(all-reduce for row-parallel outputs, all-gather for the gathered output head)."""
    if mp_size == 1:
        return None, None
    from fairscale.nn.model_parallel.mappings import gather_from_model_parallel_region, reduce_from_model_parallel_region

    return reduce_from_model_parallel_region, gather_from_model_parallel_region


def _replace_linears(model: nn.Module, mp_size: int, make, *, include_head: bool) -> None:
    """Swap every transformer linear for make(weight, collective), keeping its collective."""
    reduce, gather = _collectives(mp_size)
    for block in model.layers:
        for parent_name, attrs in _LINEARS.items():
            parent = getattr(block, parent_name)
            for attr in attrs:
                if getattr(parent, attr) is None:  # fused away (pack_for_cpu)
                    continue
                replacement = make(getattr(parent, attr).weight, reduce if attr in _ROW else None)
                if replacement is not None:
                    setattr(parent, attr, replacement)
    if include_head and getattr(model, "output", None) is not None:
        replacement = make(model.output.weight, gather)
        if replacement is not None:
            model.output = replacement


def quantize_model(model: nn.Module, name: str | None, mp_size: int) -> None:
    """Replace the transformer's linears in place (after weights are loaded)."""
    check_quantization(name)
    if name is not None:
        _replace_linears(model, mp_size, Fp8RowwiseLinear, include_head=False)


# --------------------------------------------------------------------------- CPU: oneDNN packed weights
# The batch size oneDNN tunes the packed layout for. 16 beats 1 at every decode batch size here
# (demo-shaped weights, 2 threads): 1.2-1.8x at batch 1, 1.3-1.5x at 8, 1.2-1.6x at 32; the head
# [49152, 576]: 3.6 -> 2.3 ms at batch 1, 11.4 -> 6.9 ms at batch 32.
_PACK_BATCH_HINT = 16


# Linears of at most this many weight bytes also keep a copy in engine.cpu_kernels' interleaved
# layout for one-row inputs (decode at batch 1): oneDNN's fixed ~11 us per call is about a tenth of
# streaming such a weight (the demo model's per-layer linears, 1.3-7 MiB); for larger weights the
# copy would cost memory for little.
_ONE_ROW_MAX_WEIGHT_BYTES = 8 << 20


class PackedCpuLinear(nn.Module):
    """y = x @ W^T through oneDNN with W reordered once into its blocked layout. On CPU this is
    2-5x faster than F.linear at decode batch sizes, in float32 and bfloat16 alike (bench/forward.py).
    With the fused CPU kernels, small weights also get an interleaved copy for one-row inputs."""

    def __init__(self, packed: torch.Tensor, out_features: int, collective: Collective, one_row: "OneRow | None" = None) -> None:
        super().__init__()
        self.register_buffer("packed_weight", packed, persistent=False)
        self.out_features = out_features
        self._collective = collective
        self._one_row = one_row

    @classmethod
    def pack(cls, weight: torch.Tensor, collective: Collective, *, kernels: "CpuKernels | None" = None) -> "PackedCpuLinear | None":
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
            return None
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
        one_row = None
        if kernels is not None and weight.shape[0] % 16 == 0 and weight.numel() * weight.element_size() <= _ONE_ROW_MAX_WEIGHT_BYTES:
            one_row = OneRow(kernels, kernels.interleave(weight))
        return cls(packed, weight.shape[0], collective, one_row)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._one_row is not None and x.shape[0] == 1:
            out = self._one_row.kernels.interleaved_linear(x.contiguous(), self._one_row.weight, torch.get_num_threads())
        else:
            out = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, None, "none", [], "")
        return self._collective(out) if self._collective is not None else out


@dataclass(frozen=True, slots=True)
class OneRow:
    kernels: "CpuKernels"
    weight: torch.Tensor  # [out / 16, in, 16], CpuKernels.interleave


def cpu_packing_available(dtype: torch.dtype) -> bool:
    """oneDNN present and able to run this dtype here (bfloat16 needs AVX-512 class CPUs)."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ones(8, 16, dtype=dtype)
        layer = PackedCpuLinear.pack(weight, None)
        return bool(torch.equal(layer(torch.ones(2, 16, dtype=dtype)), torch.full((2, 8), 16.0, dtype=dtype)))
    except (RuntimeError, AttributeError):  # no oneDNN kernel for this dtype / build
        return False


# Column-parallel linears reading the same input, fused into one packed linear per group: one
# weight read and one oneDNN call instead of two or three (the per-call cost dominates at decode).
_FUSED = {"attention": ("wqkv", ("wq", "wk", "wv")), "feed_forward": ("w13", ("w1", "w3"))}


def _fuse_column_linears(model: nn.Module, pack: Callable[[torch.Tensor, Collective], "PackedCpuLinear | None"]) -> None:
    """Concatenate each block's wq/wk/wv and w1/w3 rows into one packed linear (wqkv, w13) and drop
    the parts. Exact: each output is the same dot product. fp8 layers are left apart."""
    for block in model.layers:
        for parent_name, (fused_name, parts) in _FUSED.items():
            parent = getattr(block, parent_name)
            weights = [getattr(parent, name).weight for name in parts]
            if any(w.dtype not in (torch.float32, torch.bfloat16) for w in weights):
                continue
            fused = pack(torch.cat([w.detach() for w in weights]), None)
            if fused is None:
                continue
            setattr(parent, fused_name, fused)
            for name in parts:
                setattr(parent, name, None)


def pack_for_cpu(model: nn.Module, mp_size: int, dtype: torch.dtype, kernels: "CpuKernels | None" = None) -> bool:
    """Pack every full-precision linear (fp8-quantized ones stay as they are), fusing the column
    linears that share an input, and the tied output head; False if unavailable. With kernels,
    small linears also get the one-row path (PackedCpuLinear)."""
    if not cpu_packing_available(dtype):
        return False
    pack = functools.partial(PackedCpuLinear.pack, kernels=kernels)
    _fuse_column_linears(model, pack)
    _replace_linears(model, mp_size, pack, include_head=True)
    if model.params.tie_word_embeddings:
        # a packed copy of the embedding (which stays for the lookups): 3x faster than F.linear on
        # it at decode batch sizes, for one more copy of the vocab x dim weight in memory
        model.tied_head = pack(model.tok_embeddings.weight, _collectives(mp_size)[1])
    return True
