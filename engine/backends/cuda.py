"""The CUDA backend: the torch backend's operations, with quantized linears on CUDA kernels.

Tested on an NVIDIA H200 (tests/engine/test_cuda.py, tests/e2e/test_cuda_e2e.py; .ci/cuda runs them
where a GPU is lent, CI has none). Dense linears and attention are the torch backend's (cuBLAS,
SDPA); a quantized weight gets engine.quant.cuda's linear for this device's compute capability
(fp8 through torch._scaled_mm, int4 through tinygemm, the rest dequantized per tile).
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.backends.base import AttentionMetadata, HeadLayout, KVCache, Linear
from engine.backends.torch_ops import TorchBackend
from engine.quant.cuda import Capability, make_cuda_linear
from engine.quant.formats import QuantizedWeight


# SDPA's kernels without cuDNN's: its attention builds an execution plan for each new key length,
# which a decode step brings every time. On an H200 (torch 2.11) that took 330 us of host time per
# call, 4.7 ms of a 12.8 ms batch-1 step of a 1.1B model (bench/cuda_step_profile.py); the others
# have no per-shape setup. MATH serves float64.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def device_capability(device: torch.device) -> Capability | None:
    """The CUDA compute capability of `device`; None where torch has no CUDA device to ask."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]


class CudaBackend(TorchBackend):
    name = "cuda"

    def __init__(self, device: torch.device, dtype: torch.dtype, *, quantization: str | None = None,
                 batch_invariant: bool = False, capability: Capability | None = None) -> None:  # fmt: skip
        super().__init__(device, dtype, quantization=quantization, batch_invariant=batch_invariant)
        self.capability = capability

    def attention(self, qkv: torch.Tensor, heads: HeadLayout, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        with sdpa_kernel(SDPA_BACKENDS):
            return super().attention(qkv, heads, cache, meta)

    def special_linear(self, weight) -> Linear:
        if isinstance(weight, QuantizedWeight):
            return make_cuda_linear(weight, self.capability)
        return super().special_linear(weight)
