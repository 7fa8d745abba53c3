"""Weight-only quantization (QUANTIZATION_TYPE), applied at load by Backend.prepare.

The names a model is configured with (QUANTIZATION_TYPE, run.yaml, metadata.quantization) are
engine.quant.QUANTIZATION_TYPES: `fp8_mixed` (float8 e4m3, per-row scales), `int4_mixed` (int4,
group-wise scales and mins, group 32) and `int8` (per-row scales). Each quantizes the transformer's
linears (wq|wk|wv, wo, w1|w3, w2, fused at load) into an engine.quant weight; embeddings, norms
and the output head stay in the model dtype (meta-reference's "mixed"). A quantized weight is a
prepared weight (engine.backends.base.PreparedWeight) whose Linear is engine.quant.linear.QuantLinear:
the codes and scales stay resident, never a float copy. docs/quantization.md has the formats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quant import QUANTIZATION_TYPES
from engine.quant.formats import QuantizedWeight, quantize
from engine.quant.kquants import K_FORMATS
from engine.types import InvalidRequest

SUPPORTED = tuple(QUANTIZATION_TYPES)

# The configured type's weight format, and back (a checkpoint declares formats, a config names types)
TYPE_OF_FORMAT = {kind.format: name for name, kind in QUANTIZATION_TYPES.items()}


@dataclass(frozen=True, slots=True)
class WeightsReport:
    """What /v1/models/{id} says about a loaded model's weights."""

    quantization: str | None  # the configured QUANTIZATION_TYPE (None: as the checkpoint holds them)
    formats: list[str]  # the weight formats held: the model dtype, plus any quantized formats
    resident_bytes: int  # all ranks: quantized codes and scales, packed copies, float tensors


def kernel_formats(device_type: str, capability: tuple[int, int] | None = None) -> tuple[str, ...]:
    """The weight formats with kernels on a device: every one on the CPU (engine.quant.linear);
    on CUDA what engine.quant.cuda serves at that compute capability (None: unknown); none elsewhere."""
    if device_type == "cpu":
        return (*(kind.format for kind in QUANTIZATION_TYPES.values()), *K_FORMATS)
    if device_type == "cuda":
        from engine.quant.cuda import kernel_formats as cuda_formats

        return cuda_formats(capability)
    return ()


def check_quantization(name: str | None, device_type: str | None = None, capability: tuple[int, int] | None = None) -> None:
    """InvalidRequest for an unknown type, or one with no kernels on `device_type` (of CUDA
    `capability`), listing what works."""
    if name is None:
        return
    if name not in SUPPORTED:
        raise InvalidRequest(f"unknown quantization {name!r}; supported: {', '.join(SUPPORTED)} (or none)", param="quantization")
    if device_type is not None:
        check_formats({QUANTIZATION_TYPES[name].format}, device_type, capability, what=f"quantization {name!r}")


def _label(fmt: str) -> str:
    """A format as a user names it: its QUANTIZATION_TYPE, or for a GGUF K-quant (never a
    configured type: only a checkpoint holds one) its GGML name."""
    return TYPE_OF_FORMAT.get(fmt) or f"{fmt.upper()} (GGUF)"


def check_formats(formats: set[str], device_type: str, capability: tuple[int, int] | None = None, *, what: str) -> None:
    """InvalidRequest when a weight format in `formats` has no kernels on the device, naming `what`
    asked for it (a configured type, a checkpoint's weights) and what works there and elsewhere."""
    available = kernel_formats(device_type, capability)
    missing = sorted(f for f in formats if f not in available)
    if not missing:
        return
    from engine.quant.cuda import MIN_CAPABILITY

    where = device_type if capability is None or device_type != "cuda" else f"cuda (compute capability {capability[0]}.{capability[1]})"
    here = ", ".join(_label(f) for f in available) or "none"
    on_cuda = ", ".join(
        f"{_label(fmt)} " + ("on any GPU" if minimum is None else f"from compute capability {minimum[0]}.{minimum[1]}")
        for fmt, minimum in MIN_CAPABILITY.items()
    )
    raise InvalidRequest(
        f"{what}: {', '.join(missing)} weights have no kernels on {where}; what works there: {here}; "
        f"on cpu: {', '.join(_label(f) for f in kernel_formats('cpu'))}; on cuda: {on_cuda} "
        f"(or unquantized weights on any device)",
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
