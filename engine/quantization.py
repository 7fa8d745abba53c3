"""Weight-only quantization (QUANTIZATION_TYPE), applied at load by Backend.prepare.

"fp8_mixed": the transformer's linear weights (wq|wk|wv, wo, w1|w3, w2) are stored as
float8_e4m3fn with one scale per output row; embeddings, norms and the output head stay in the
model dtype (the "mixed" of Meta's fp8_mixed checkpoints). It mainly saves memory: the matmul runs
in the model dtype on the dequantised weight, with the per-row scale applied to the output, so it
works on every backend. A quantized format is a prepared weight that names its Linear
(engine.backends.base.PreparedWeight); docs/backends.md says how to add one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.types import InvalidRequest

if TYPE_CHECKING:
    from engine.backends.base import Backend

SUPPORTED = ("fp8_mixed",)
FP8_DTYPE = torch.float8_e4m3fn
_FP8_MAX = 448.0  # largest finite float8_e4m3fn value


def check_quantization(name: str | None) -> None:
    if name is not None and name not in SUPPORTED:
        raise InvalidRequest(
            f"unknown quantization {name!r}; supported: {', '.join(SUPPORTED)} (or none)", param="quantization"
        )


@dataclass(frozen=True, slots=True)
class Fp8RowwiseWeight:
    """W ~= data * scale[:, None]: data float8 [out, in], scale [out] in the model dtype."""

    data: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Fp8RowwiseWeight":
        amax = weight.detach().abs().amax(dim=1).float().clamp(min=1e-12)
        scale = amax / _FP8_MAX
        return cls((weight.float() / scale[:, None]).to(FP8_DTYPE), scale.to(weight.dtype))

    def make_linear(self, backend: "Backend") -> "Fp8RowwiseLinear":
        return Fp8RowwiseLinear(self)


class Fp8RowwiseLinear(nn.Module):
    """y = (x @ Wq^T) * scale (engine.backends.base.Linear over the local shard)."""

    def __init__(self, weight: Fp8RowwiseWeight) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.data, requires_grad=False)
        self.scale = nn.Parameter(weight.scale, requires_grad=False)
        self.out_features, self.in_features = weight.data.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype)).mul_(self.scale)

    def resident_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in (self.weight, self.scale))


def quantize_weight(weight: torch.Tensor, name: str | None) -> torch.Tensor | Fp8RowwiseWeight:
    """One transformer linear weight in the quantized format `name` (None: as it is)."""
    check_quantization(name)
    return weight if name is None else Fp8RowwiseWeight.quantize(weight)
