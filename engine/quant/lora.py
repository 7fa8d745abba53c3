"""A quantized weight with a LoRA adaptor beside it: Meta's int4 QLoRA releases (Llama 3.2 1B/3B
QLoRA_INT4_EO8), whose every transformer linear is llama-models' Int8DynActInt4WeightLinearLoRA:
y = base(x) + B(A(x)) * scale, the base a torchao Int8DynActInt4WeightLinear (int4 codes with group
scales, inputs fake-quantized to int8 per token) and the adaptor two float linears on the
unquantized input (A [rank, in], B [out, rank]).

Model-parallel shards: output rows take B's rows (A whole), input columns take A's columns (B
whole): a row-parallel rank's partial B(A_r x_r) sums over ranks to B(A x), as its base's partials do.
Fused linears (wq|wk|wv, w1|w3) keep one adaptor per part (formats.RowStack), never a concatenated A.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from engine.quant.formats import Int8Weight


@dataclass(frozen=True)
class LoraInt8Weight(Int8Weight):
    stacks_by_rows = True
    lora_a: torch.Tensor | None = None  # [rank, in]
    lora_b: torch.Tensor | None = None  # [out, rank]
    lora_scale: float = 1.0

    def tensors(self) -> dict[str, torch.Tensor]:
        return {**super().tensors(), "lora_a": self.lora_a, "lora_b": self.lora_b}  # type: ignore[dict-item]

    def base(self) -> Int8Weight:
        return Int8Weight(self.qweight, self.scales, self.group_size, self.int8_token_activations)

    def rows(self, start: int, stop: int) -> "LoraInt8Weight":
        return replace(self, qweight=self.qweight[start:stop], scales=self.scales[start:stop], lora_b=self.lora_b[start:stop])  # type: ignore[index]

    def cols(self, start: int, stop: int) -> "LoraInt8Weight":
        return _with_base(self, self.base().cols(start, stop), lora_a=self.lora_a[:, start:stop])  # type: ignore[index]

    def contiguous(self) -> "LoraInt8Weight":
        return _with_base(self, self.base().contiguous(), lora_a=self.lora_a.contiguous(), lora_b=self.lora_b.contiguous())  # type: ignore[union-attr]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The base's values only: the adaptor is a separate product (it reads the unrounded input)."""
        return self.base().dequantize(dtype)

    def make_linear(self, backend: object) -> nn.Module:
        return LoraLinear(backend.linear(self.base()), self)  # type: ignore[attr-defined]


def _with_base(weight: LoraInt8Weight, base: Int8Weight, **adaptor: torch.Tensor) -> LoraInt8Weight:
    fields = {"lora_a": weight.lora_a, "lora_b": weight.lora_b, **adaptor}
    return LoraInt8Weight(base.qweight, base.scales, base.group_size, base.int8_token_activations, lora_scale=weight.lora_scale, **fields)


class LoraLinear(nn.Module):
    """y = base(x) + (x @ A^T @ B^T) * scale, the adaptor in float32 on the input as it came. The
    base linear is held, not registered as a submodule: this module reports the weight's format and
    all its bytes once (Transformer.weight_bytes and weight_formats walk the modules)."""

    def __init__(self, base: nn.Module, weight: LoraInt8Weight) -> None:
        super().__init__()
        self._base = (base,)  # a tuple: nn.Module would register a bare module attribute
        self.in_features, self.out_features = base.in_features, base.out_features
        self.lora_a, self.lora_b = weight.lora_a.float(), weight.lora_b.float()  # type: ignore[union-attr]
        self.lora_scale = weight.lora_scale
        self.weight_format = getattr(base, "weight_format", weight.format)

    def storage_key(self) -> int:
        base = self._base[0]
        return base.storage_key() if hasattr(base, "storage_key") else id(base)

    def resident_bytes(self) -> int:
        return self._base[0].resident_bytes() + sum(t.numel() * t.element_size() for t in (self.lora_a, self.lora_b))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        adaptor = (x.float() @ self.lora_a.t()) @ self.lora_b.t()
        return (self._base[0](x).float() + adaptor * self.lora_scale).to(x.dtype)


__all__ = ["LoraInt8Weight", "LoraLinear"]
