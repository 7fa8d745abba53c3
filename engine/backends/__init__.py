"""Backends: the operations engine/models/llama.py runs, chosen once per model from device and dtype.

select_backend() is the one place that choice is made (docs/backends.md):
- CPU, float32/bfloat16, oneDNN able to run the dtype: CpuKernelBackend (oneDNN packed linears +
  the fused C kernels), or OneDnnBackend when the kernels are off or cannot be built;
- CPU, bfloat16 where oneDNN has no bfloat16 kernel (AVX2): CpuKernelBackend without oneDNN (its
  linears on the kernels' interleaved copies), or TorchBackend when the kernels are off;
- CUDA: CudaBackend (torch ops; quantized linears on engine.quant.cuda's kernels for the
  device's compute capability; tested on an H200 by .ci/cuda);
- anything else (float64, float16, float32 without oneDNN): TorchBackend, plain torch ops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.backends.base import Backend
    from engine.config import EngineConfig


def resolve_dtype(config: "EngineConfig") -> torch.dtype:
    """The model dtype: the configured one, else bfloat16 on CUDA, and on CPU bfloat16 where
    oneDNN runs it (half the weight bytes per token: faster decode, bench/NOTES.md), else float32."""
    if config.dtype is not None:
        return getattr(torch, config.dtype)
    if config.device == "cuda":
        return torch.bfloat16
    from engine.backends.cpu import packing_available

    return torch.bfloat16 if packing_available(torch.bfloat16) else torch.float32


def select_backend(config: "EngineConfig", device: torch.device) -> "Backend":
    """The backend for a model loaded on `device` under `config` (dtype, cpu_kernels, quantization)."""
    from engine.backends.torch_ops import TorchBackend

    dtype = resolve_dtype(config)
    if device.type == "cpu":
        from engine.backends.cpu import CpuKernelBackend, OneDnnBackend, packing_available
        from engine.kernels.cpu import load_cpu_kernels, supports

        packs = packing_available(dtype)
        # bfloat16 without oneDNN's bfloat16 kernel (AVX2): the C kernels still run it (CpuKernelBackend.onednn)
        if packs or dtype == torch.bfloat16:
            kernels = load_cpu_kernels() if config.cpu_kernels and supports(dtype) else None
            if kernels is not None:
                return CpuKernelBackend(device, dtype, kernels, quantization=config.quantization, batch_invariant=config.batch_invariant)
        if packs:
            return OneDnnBackend(device, dtype, quantization=config.quantization, batch_invariant=config.batch_invariant)
    if device.type == "cuda":
        from engine.backends.cuda import CudaBackend, device_capability

        return CudaBackend(device, dtype, quantization=config.quantization, batch_invariant=config.batch_invariant,
                           capability=device_capability(device))
    return TorchBackend(device, dtype, quantization=config.quantization, batch_invariant=config.batch_invariant)
