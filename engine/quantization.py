"""Weight-only quantization (QUANTIZATION_TYPE), applied at load by Backend.prepare.

The names a model is configured with (QUANTIZATION_TYPE, run.yaml, metadata.quantization) are
engine.quant.QUANTIZATION_TYPES: `fp8_mixed` (float8 e4m3, per-row scales), `int4_mixed` (int4,
group-wise scales and mins, group 32) and `int8` (per-row scales). Each quantizes the transformer's
linears (wq|wk|wv, wo, w1|w3, w2, fused at load) into an engine.quant weight; embeddings, norms
and the output head stay in the model dtype (meta-reference's "mixed"). A quantized weight is a
prepared weight (engine.backends.base.PreparedWeight) whose Linear is engine.quant.QuantLinear:
the codes and scales stay resident, never a float copy. docs/quantization.md has the formats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quant import QUANTIZATION_TYPES
from engine.quant.formats import QuantizedWeight, quantize
from engine.types import InvalidRequest

SUPPORTED = tuple(QUANTIZATION_TYPES)

# Devices with kernels for the quantized linears (engine.quant.linear runs on the CPU only; the
# CUDA paths have not been written or run on a GPU yet).
KERNEL_DEVICES = {"cpu": SUPPORTED}


@dataclass(frozen=True, slots=True)
class WeightsReport:
    """What /v1/models/{id} says about a loaded model's weights."""

    quantization: str | None  # the configured QUANTIZATION_TYPE (None: as the checkpoint holds them)
    formats: list[str]  # the weight formats held: the model dtype, plus any quantized formats
    resident_bytes: int  # all ranks: quantized codes and scales, packed copies, float tensors


def check_quantization(name: str | None, device_type: str | None = None) -> None:
    """InvalidRequest for an unknown type, or one with no kernels on `device_type`, listing what works."""
    if name is None:
        return
    if name not in SUPPORTED:
        raise InvalidRequest(f"unknown quantization {name!r}; supported: {', '.join(SUPPORTED)} (or none)", param="quantization")
    if device_type is not None and name not in KERNEL_DEVICES.get(device_type, ()):
        works = "; ".join(f"{device}: {', '.join(names)}" for device, names in KERNEL_DEVICES.items())
        raise InvalidRequest(
            f"quantization {name!r} has no kernels on {device_type}; what works: {works} (or no quantization on any device)",
            param="quantization",
        )


def quantize_weight(weight: torch.Tensor | QuantizedWeight, name: str | None) -> torch.Tensor | QuantizedWeight:
    """One transformer linear weight in the quantized type `name` (None: as it is). A weight that
    is already quantized (a checkpoint written quantized) is kept as it is, never requantized."""
    check_quantization(name)
    if name is None or isinstance(weight, QuantizedWeight):
        return weight
    kind = QUANTIZATION_TYPES[name]
    try:
        return quantize(weight, kind.format, group_size=kind.group_size).contiguous()
    except ValueError as exc:  # a width the group size does not divide
        raise InvalidRequest(f"quantization {name!r}: {exc}", param="quantization") from None
