"""Meta's pre-quantized releases, loaded as shipped (`as_shipped`, called on each shard as it is opened).

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

int4 (Llama 3.2 1B/3B Instruct QLoRA_INT4_EO8 and SpinQuant_INT4_EO8): params.json has
`quantization_args` ({"group_size": 32, "scheme": "int4_weight_int8_dynamic_activation"}) and, for
QLoRA, `lora_args` ({"rank", "scale"}). Every transformer linear is llama-models'
Int8DynActInt4WeightLinearLoRA (torchao's Int8DynActInt4WeightLinear): `KEY.weight` int8 [out, in]
holding int4 codes (-8..7, unpacked), `KEY.scales` [out, in / group_size], `KEY.zeros` (optional,
zero), and for QLoRA `KEY.adaptor.A.weight` [rank, in] and `KEY.adaptor.B.weight` [out, rank]; the
output head (Int8WeightLinear) and the token embedding (Int8WeightEmbedding) are int8 with a scale per
row. They load as engine.quant Int8Weight (the int4 codes in int8, group-wise float32 scales: 8 bits
a weight resident instead of 4, the same values) whose linear fake-quantizes each input row to int8
as torchao's per_token_dynamic_quant does, then multiplies by the dequantized weight: torchao's own
F.linear(dq(x), dq(W)) up to summation order; a QLoRA adaptor adds B(A(x)) * scale on the unrounded
input (engine.quant.lora). SpinQuant's rotations are folded into its released weights (its
params.json says nothing more), so it loads the same way without adaptors.

FP8 Llama 4 (Llama-4-Maverick-17B-128E-Instruct-fp8), as llama-models' llama4/scripts/quantize.py
writes it and llama4/quantization/loader.py reads it: in every MoE layer but the first and the last,
the routed experts' `feed_forward.experts.moe_w_in_eD_F` / `moe_w_swiglu_eD_F` [e*D, F] and
`moe_w_out_eF_D` [e*F, D] hold float8_e4m3fn codes in the bf16 layout (F this shard's), each expert's
weight quantized per output row by fbgemm's quantize_fp8_per_row on the [e, out, in] transpose;
`fp8_scales_N.pt` maps `layers.{layer}.feed_forward.experts.{w1|w3|w2}` to float32 scales [e, out]
(out: F for w1 / w3, D for w2; value = code * scale). The shared expert, router, attention and the
dense layers stay bfloat16. The reference multiplies them with fbgemm's batched fp8 x fp8 row-wise
kernel (bmm_nt), each expert's input rows quantized to e4m3 with amax capped at 1200 as above. Here
each such tensor becomes an engine.quant ExpertWeights: one Fp8Weight [out, in] per expert with its
row scales and the 1200 bound, so each expert's linear computes as the Llama 3 FP8 linears do; the
experts shard along F with their rows (w1 / w3) and columns (w2: per-row scales of each saved
shard, group-wise at another model-parallel size, as for Llama 3's w2).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

import torch

from engine.loading.file_guard import guarded
from engine.loading.llama4 import SHIPPED_EXPERT_NAMES
from engine.models.args import ModelArgs
from engine.quant.formats import FP8_DTYPE, ExpertWeights, Fp8Weight, Int8Weight
from engine.quant.lora import LoraInt8Weight
from engine.types import CheckpointError

FP8_SCALES_FILE = "fp8_scales_{rank}.pt"
FP8_ACTIVATION_SCALE_UB = 1200.0  # llama-models' fp8_activation_scale_ub default (convert_to_quantized_model)
_SCALE_KEY = re.compile(r"^(\d+)_feed_forward\.(w[123])_(\d+)$")  # Llama 3: "<layer>_feed_forward.<w>_<rank>"
_EXPERT_SCALE_KEY = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w[123])$")  # Llama 4's routed experts


def fp8_scales_paths(checkpoint_dir: Path) -> list[Path]:
    return sorted(checkpoint_dir.glob("fp8_scales_*.pt"))


def is_fp8_release(checkpoint_dir: Path) -> bool:
    return bool(fp8_scales_paths(checkpoint_dir))


INT4_SCHEME = "int4_weight_int8_dynamic_activation"  # the one scheme llama-models' loader runs
_INT4_LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
_INT8_ROWS = ("output", "tok_embeddings")  # Int8WeightLinear, Int8WeightEmbedding: int8 with a scale per row


def release_formats(checkpoint_dir: Path, args: ModelArgs | None = None) -> set[str]:
    """The engine.quant formats a release's weights load as (for the device check before loading)."""
    found = {"fp8"} if is_fp8_release(checkpoint_dir) else set()
    if args is not None and dict(args.extra).get("quantization_args") is not None:
        found.add("int8")
    return found


def as_shipped(checkpoint_dir: Path, args: ModelArgs, shard_path: Path, state: Mapping[str, Any], rank: int,
               allowed_roots: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Shard `rank`'s state with a pre-quantized release's weights as engine.quant weights (FP8:
    fp8_scales_N.pt; int4: params.json's quantization_args); unchanged for any other checkpoint."""
    state = attach_fp8_scales(checkpoint_dir, args, shard_path, state, rank, allowed_roots)
    return attach_int4_release(args, shard_path, state)


def _int4_settings(args: ModelArgs, shard_path: Path) -> tuple[int, tuple[int, float] | None] | None:
    """(group size, (LoRA rank, scale) or None) from params.json, None for no int4 release."""
    extra = dict(args.extra)
    qargs, lora = extra.get("quantization_args"), extra.get("lora_args")
    if qargs is None:
        if lora is not None:
            raise CheckpointError(f"{shard_path.parent}: params.json has lora_args without quantization_args: unmerged LoRA adapters are not supported")
        return None
    source = shard_path.parent / "params.json"
    if not isinstance(qargs, dict) or qargs.get("scheme") not in (None, INT4_SCHEME) or not isinstance(qargs.get("group_size"), int):
        raise CheckpointError(f"{source}: quantization_args {qargs!r}: only scheme {INT4_SCHEME!r} with an integer group_size is supported")
    group = qargs["group_size"]
    if group <= 0 or group % 32:
        raise CheckpointError(f"{source}: quantization_args group_size {group}: supported group sizes are multiples of 32")
    if lora is None:
        return group, None
    if not isinstance(lora, dict) or not isinstance(lora.get("rank"), int) or not isinstance(lora.get("scale"), (int, float)):
        raise CheckpointError(f"{source}: lora_args {lora!r}: expected an integer rank and a number scale")
    return group, (lora["rank"], float(lora["scale"]))


def attach_int4_release(args: ModelArgs, shard_path: Path, state: Mapping[str, Any]) -> dict[str, Any]:
    """A Meta int4 release's shard as engine.quant weights (module docstring); unchanged without
    quantization_args. CheckpointError naming the file and key for what the layout does not hold."""
    settings = _int4_settings(args, shard_path)
    out = dict(state)
    if settings is None:
        return out
    group, lora = settings

    def take(key: str) -> torch.Tensor:
        found = out.pop(key, None)
        if not isinstance(found, torch.Tensor):
            raise CheckpointError(f"{shard_path}: int4 release without {key!r}")
        return found

    for prefix in (*_INT8_ROWS, *(f"layers.{i}.{name}" for i in range(args.n_layers) for name in _INT4_LINEARS)):
        codes, scales = take(prefix + ".weight"), take(prefix + ".scales")
        if codes.dtype != torch.int8 or codes.dim() != 2:
            raise CheckpointError(f"{shard_path}: {prefix}.weight is {codes.dtype} {list(codes.shape)}, expected int8 codes [out, in]")
        rows, cols = codes.shape
        if prefix in _INT8_ROWS:
            if scales.numel() != rows:
                raise CheckpointError(f"{shard_path}: {prefix}.scales has {scales.numel()} values for {rows} rows")
            out[prefix + ".weight"] = Int8Weight(codes, scales.reshape(rows, 1).float(), cols)
            continue
        if cols % group or tuple(scales.shape) != (rows, cols // group):
            raise CheckpointError(f"{shard_path}: {prefix}.scales has shape {list(scales.shape)}, expected {[rows, cols // group]} (group size {group})")
        zeros = out.pop(prefix + ".zeros", None)
        if zeros is not None and bool(torch.any(zeros != 0)):
            raise CheckpointError(f"{shard_path}: {prefix}.zeros holds non-zero zero points; the int4 scheme is symmetric")
        if bool(torch.any(codes < -8)) or bool(torch.any(codes > 7)):
            raise CheckpointError(f"{shard_path}: {prefix}.weight holds values outside int4's -8..7")
        weight = Int8Weight(codes, scales.float(), group, True)
        if lora is not None:
            a, b = take(prefix + ".adaptor.A.weight"), take(prefix + ".adaptor.B.weight")
            if tuple(a.shape) != (lora[0], cols) or tuple(b.shape) != (rows, lora[0]):
                raise CheckpointError(f"{shard_path}: {prefix}.adaptor has A {list(a.shape)} and B {list(b.shape)}, expected {[lora[0], cols]} and {[rows, lora[0]]}")
            weight = LoraInt8Weight(codes, scales.float(), group, True, lora_a=a, lora_b=b, lora_scale=lora[1])
        out[prefix + ".weight"] = weight
    return out


def _load_scales(path: Path) -> dict[str, torch.Tensor]:
    try:
        scales = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one error naming it
        raise CheckpointError(f"{path}: not a readable fp8 scales file: {exc}") from None
    if not isinstance(scales, dict) or not all(isinstance(v, torch.Tensor) for v in scales.values()):
        raise CheckpointError(f"{path}: expected a dict of scale tensors")
    return scales


def _fp8_experts(args: ModelArgs, weight: torch.Tensor, which: str, scale: torch.Tensor, where: str) -> ExpertWeights:
    """A Llama 4 FP8 release's routed-expert tensor (the shipped 2-D layout, module docstring) and its
    scales [e, out] as one Fp8Weight [out, in] per expert; CheckpointError (prefixed `where`) for
    shapes that disagree."""
    if args.moe_args is None:
        raise CheckpointError(f"{where}: expert scales, but params.json has no moe_args")
    experts, dim = args.moe_args.num_experts, args.dim
    rows, cols = weight.shape
    # [e, in, out] as the reference's experts.w1 / w3 [e, D, F] and w2 [e, F, D]
    if which == "w2" and cols == dim and rows % experts == 0:
        codes = weight.view(experts, rows // experts, dim)
    elif which != "w2" and rows == experts * dim:
        codes = weight.view(experts, dim, cols)
    else:
        raise CheckpointError(f"{where}: weight of shape {[rows, cols]} is not {experts} experts' {which} (dim {dim})")
    out_features = codes.shape[2]
    if scale.numel() != experts * out_features:
        raise CheckpointError(f"{where}: {scale.numel()} scales for {experts} experts x {out_features} rows")
    scale = scale.reshape(experts, out_features, 1).float()
    codes = codes if codes.dtype == FP8_DTYPE else codes.to(FP8_DTYPE)  # as load_fp8's .to(float8_e4m3fn)
    return ExpertWeights(tuple(Fp8Weight(codes[e].t(), scale[e], codes.shape[1], FP8_ACTIVATION_SCALE_UB) for e in range(experts)))


def attach_fp8_scales(checkpoint_dir: Path, args: ModelArgs, shard_path: Path, state: Mapping[str, Any], rank: int,
                      allowed_roots: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Shard `rank`'s state with its fp8 weights as Fp8Weight (codes, per-row scales, the activation
    bound), a Llama 4 release's routed experts as ExpertWeights under the reference's names
    (`layers.N.feed_forward.experts.w1`); unchanged when the dir holds no fp8 scales.
    CheckpointError naming the file and key for a scale without its weight, a weight without its
    scale, or shapes that disagree."""
    out = dict(state)
    fp8_keys = {k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dtype == FP8_DTYPE}
    scales_path = checkpoint_dir / FP8_SCALES_FILE.format(rank=rank)
    if not scales_path.is_file():
        if fp8_keys:
            raise CheckpointError(f"{shard_path}: holds float8 weights ({sorted(fp8_keys)[0]}, ...) but {scales_path.name} is missing")
        return out
    scales = _load_scales(guarded(scales_path, allowed_roots))
    for name, scale in scales.items():
        expert = _EXPERT_SCALE_KEY.match(name)
        if expert is not None:
            shipped = f"layers.{expert.group(1)}.feed_forward.experts.{SHIPPED_EXPERT_NAMES[expert.group(2)]}"
            weight = out.pop(shipped, None)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
                raise CheckpointError(f"{scales_path}: scale {name!r} has no weight {shipped!r} in {shard_path.name}")
            out[name] = _fp8_experts(args, weight, expert.group(2), scale, f"{scales_path}: {name!r} ({shard_path.name}: {shipped!r})")
            fp8_keys.discard(shipped)
            continue
        match = _SCALE_KEY.match(name)
        if match is None or int(match.group(3)) != rank:
            raise CheckpointError(f"{scales_path}: unexpected key {name!r} (expected '<layer>_feed_forward.w1|w2|w3_{rank}', "
                                  "or Llama 4's 'layers.<layer>.feed_forward.experts.w1|w2|w3')")  # fmt: skip
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


__all__ = [
    "FP8_ACTIVATION_SCALE_UB", "FP8_SCALES_FILE", "INT4_SCHEME", "as_shipped", "attach_fp8_scales", "attach_int4_release",
    "fp8_scales_paths", "is_fp8_release", "release_formats",
]  # fmt: skip
