"""Meta's pre-quantized releases, loaded as shipped.

FP8 (Llama 3.1 405B-Instruct FP8, the default 405B download): `consolidated.NN.pth` holds the
feed-forward w1, w2, w3 of every layer but the first and the last as float8_e4m3fn codes, everything
else in bfloat16, and `fp8_scales_N.pt` beside shard N maps `"{layer}_feed_forward.{w}_{N}"` to
that shard's float32 scale per output row (fbgemm's quantize_fp8_per_row: value = code * scale).
llama-models' reference (llama3/quantization/loader.py, quantize_impls.py) multiplies them with
fbgemm's fp8 x fp8 row-wise kernels, each activation row first quantized to e4m3 with its amax
capped at fp8_activation_scale_ub (1200). Here each such weight becomes an engine.quant Fp8Weight
with its scales (a row-parallel w2's scales shard with its rows: a release saved at MP=N loads at
MP=N, and at another size as group-wise fp8 with one scale per saved shard), carrying the 1200 bound:
its linear rounds the activations exactly as the reference quantizes them, then multiplies by the
dequantized weight, so the products are the reference's up to summation order (CPU; on CUDA from
compute capability 9.0 through torch's row-wise scaled matmul on the codes themselves).

The layout of Llama 4 Maverick's FP8 release (MoE experts) is not read here: such a shard's fp8
tensors without this file's scales are refused by name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

import torch

from engine.loading.file_guard import guarded
from engine.quant.formats import FP8_DTYPE, Fp8Weight
from engine.types import CheckpointError

FP8_SCALES_FILE = "fp8_scales_{rank}.pt"
FP8_ACTIVATION_SCALE_UB = 1200.0  # llama-models' fp8_activation_scale_ub default (convert_to_quantized_model)
_SCALE_KEY = re.compile(r"^(\d+)_feed_forward\.(w[123])_(\d+)$")


def fp8_scales_paths(checkpoint_dir: Path) -> list[Path]:
    return sorted(checkpoint_dir.glob("fp8_scales_*.pt"))


def is_fp8_release(checkpoint_dir: Path) -> bool:
    return bool(fp8_scales_paths(checkpoint_dir))


def release_formats(checkpoint_dir: Path) -> set[str]:
    """The engine.quant formats a release's weights load as (for the device check before loading)."""
    return {"fp8"} if is_fp8_release(checkpoint_dir) else set()


def _load_scales(path: Path) -> dict[str, torch.Tensor]:
    try:
        scales = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one error naming it
        raise CheckpointError(f"{path}: not a readable fp8 scales file: {exc}") from None
    if not isinstance(scales, dict) or not all(isinstance(v, torch.Tensor) for v in scales.values()):
        raise CheckpointError(f"{path}: expected a dict of scale tensors")
    return scales


def attach_fp8_scales(checkpoint_dir: Path, shard_path: Path, state: Mapping[str, Any], rank: int,
                      allowed_roots: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Shard `rank`'s state with its fp8 weights as Fp8Weight (codes, per-row scales, the activation
    bound); unchanged when the dir holds no fp8 scales. CheckpointError naming the file and key for a
    scale without its weight, a weight without its scale, or shapes that disagree."""
    out = dict(state)
    fp8_keys = {k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dtype == FP8_DTYPE}
    scales_path = checkpoint_dir / FP8_SCALES_FILE.format(rank=rank)
    if not scales_path.is_file():
        if fp8_keys:
            raise CheckpointError(f"{shard_path}: holds float8 weights ({sorted(fp8_keys)[0]}, ...) but {scales_path.name} is missing")
        return out
    scales = _load_scales(guarded(scales_path, allowed_roots))
    for name, scale in scales.items():
        match = _SCALE_KEY.match(name)
        if match is None or int(match.group(3)) != rank:
            raise CheckpointError(f"{scales_path}: unexpected key {name!r} (expected '<layer>_feed_forward.w1|w2|w3_{rank}')")
        key = f"layers.{match.group(1)}.feed_forward.{match.group(2)}.weight"
        weight = state.get(key)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise CheckpointError(f"{scales_path}: scale {name!r} has no weight {key!r} in {shard_path.name}")
        if scale.numel() != weight.shape[0]:
            raise CheckpointError(f"{scales_path}: scale {name!r} has {scale.numel()} values for {weight.shape[0]} rows of {key!r}")
        # the reference loads the weight with .to(float8_e4m3fn) (load_fp8): a shard that stores the codes in another dtype works too
        codes = weight if weight.dtype == FP8_DTYPE else weight.to(FP8_DTYPE)
        out[key] = Fp8Weight(codes, scale.reshape(-1, 1).float(), weight.shape[1], FP8_ACTIVATION_SCALE_UB)
        fp8_keys.discard(key)
    if fp8_keys:
        raise CheckpointError(f"{shard_path}: float8 weight {sorted(fp8_keys)[0]!r} has no scale in {scales_path.name}")
    return out


__all__ = ["FP8_ACTIVATION_SCALE_UB", "FP8_SCALES_FILE", "attach_fp8_scales", "fp8_scales_paths", "is_fp8_release", "release_formats"]
