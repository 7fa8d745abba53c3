"""Weight-only quantization applied at load time (QUANTIZATION_TYPE).

"fp8_mixed": the transformer's linear weights (wq/wk/wv/wo/w1/w2/w3) are stored as float8_e4m3fn
with one scale per output row; embeddings, norms and the output head stay in the model dtype (the
"mixed" of Meta's fp8_mixed checkpoints). It mainly saves memory: the matmul runs in the model dtype
on the dequantised weight, with the per-row scale applied to the output, so it works on CPU too.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.types import InvalidRequest

SUPPORTED = ("fp8_mixed",)
FP8_DTYPE = torch.float8_e4m3fn
_FP8_MAX = 448.0  # largest finite float8_e4m3fn value
_COLUMN = ("wq", "wk", "wv", "w1", "w3")
_ROW = ("wo", "w2")


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


def quantize_model(model: nn.Module, name: str | None, mp_size: int) -> None:
    """Replace the transformer's linears in place (after weights are loaded)."""
    check_quantization(name)
    if name is None:
        return
    reduce = None
    if mp_size > 1:
        from fairscale.nn.model_parallel.mappings import reduce_from_model_parallel_region

        reduce = reduce_from_model_parallel_region
    for block in model.layers:
        for parent in (block.attention, block.feed_forward):
            for attr in (*_COLUMN, *_ROW):
                layer = getattr(parent, attr, None)
                if layer is not None:
                    setattr(parent, attr, Fp8RowwiseLinear(layer.weight, reduce if attr in _ROW else None))
