"""CPU linears over quantized weights (engine.quant.formats): y = x @ dequantize(W)^T.

One module for every format; it holds the codes and scales only (no float copy of the weight stays
resident) and picks a path per call from the number of input rows and the activation dtype:

- `kernel`: engine/kernels/csrc/quant_kernels.c, dequantizing each 32-column block in registers and
  multiplying it into up to 8 input rows at once. Batch-1 decode streams the low-bit bytes once.
- `aten_int8`: torch's weight-only int8 op (aten._weight_int8pack_mm) on the same int8 codes, for
  bfloat16 activations with per-row scales that bfloat16 holds exactly (quantize_int8 makes them so):
  it computes the same numbers, and below the dequant_mm threshold it beats our kernel in bfloat16.
- `dequant_mm`: dequantize tiles of output rows into a reused bf16/f32 buffer (C kernel) and
  multiply each through torch.mm (oneDNN, AMX on CPUs with it), for batches where the matmul's
  efficiency outweighs dequantizing every weight once per call.
- `torch`: no C kernels (no compiler): the same tiles dequantized by formats.py in torch.

The thresholds come from bench/quant_linear.py on the 2-core development machines (docs/quantization.md
has the numbers) and depend on the loaded kernels' build (policy_for: AVX-512 or narrower). The
module computes over its local model-parallel shard only: collectives belong to the caller (the
backend seam). Weights are told apart by their `format` name: formats.py names QuantLinear as its
weights' Linear (QuantizedWeight.make_linear), so this module imports it for type hints only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from engine.kernels import quant as quant_kernels  # load_quant_kernels looked up when called (tests stand in for it)
from engine.kernels.quant import FORMAT_CODES, QuantKernels, supports

if TYPE_CHECKING:
    from engine.quant.formats import QuantizedWeight

# Tiles of dequantized rows hold at most this many elements (1 MiB in float32): they stay in L2
# between the dequantization that writes them and the matmul that reads them.
TILE_ELEMS = 1 << 18


@dataclass(frozen=True, slots=True)
class Policy:
    """From how many input rows each path takes over (measured: bench/quant_linear.py). The defaults
    are the AVX-512 builds' (Xeon with AMX, Zen 4); policy_for picks by the loaded build."""

    dequant_min_rows_f32: int = 16  # float32: kernel ~= dequant+sgemm at 16 rows, 2.3x slower at 32, 2x faster at 8
    dequant_min_rows_bf16: int = 16  # bfloat16: kernel 1.3x faster at 8 rows, dequant+AMX GEMM 3.5x faster at 32
    # bfloat16 int8 per-row up to this many rows (0: never): torch's op beats our kernel (1.4x at 1 row)
    aten_int8_max_rows_bf16: int = 15
    # dequant_mm multiplies bfloat16 inputs in bfloat16 (AMX / AVX512_BF16 GEMMs); False: dequantizes to
    # float32 and runs an sgemm, where torch's bfloat16 matmul has no native instructions (emulated)
    bf16_matmul: bool = True


# Builds below AVX-512 (the AVX2 intrinsics, x86-64-v3; the portable loops), measured on Zen 2
# (bench/NOTES.md 'AVX2 quantized linears'): the kernel beats dequantize + sgemm up to 16 rows
# (1.5x there, 1.1x slower at 32); torch's bfloat16 matmul is emulated (10x slower than the kernel at
# 8-64 rows), so bfloat16 inputs go through the float32 sgemm; aten's int8 op wins at one row only.
NARROW_SIMD_POLICY = Policy(dequant_min_rows_f32=32, dequant_min_rows_bf16=32, aten_int8_max_rows_bf16=1, bf16_matmul=False)


def policy_for(kernels: QuantKernels | None) -> Policy:
    """The path cutoffs for the loaded kernels' build (QuantKernels.simd_bits): AVX-512's defaults, or
    NARROW_SIMD_POLICY below it; the defaults where no kernels load (the torch path)."""
    if kernels is None or kernels.simd_bits >= 512:
        return Policy()
    return NARROW_SIMD_POLICY


class QuantLinear(nn.Module):
    """x [..., in_features] -> [..., out_features] in x's dtype (float32 or bfloat16), over a
    QuantizedWeight. `kernels` None runs the torch path."""

    def __init__(self, weight: QuantizedWeight, kernels: QuantKernels | None, policy: Policy | None = None) -> None:
        super().__init__()
        # a plain attribute, not buffers: a later model.to(dtype) must not convert codes or float16 scales
        self.weight_q = weight.contiguous()
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self._kernels = kernels
        self._kernel = kernels.bind(self.weight_q) if kernels is not None else None  # pointers fixed once
        self._policy = policy or policy_for(kernels)
        self._aten_scales = _aten_int8_scales(self.weight_q) if self._policy.aten_int8_max_rows_bf16 > 0 else None
        # Meta's pre-quantized releases: inputs rounded first (fp8 rows, int8 tokens), as their reference computes
        self._round_input = activation_rounding(weight)

    @property
    def weight_format(self) -> str:
        return self.weight_q.format

    def storage_key(self) -> int:
        """Shared with a QuantEmbedding over the same table (a tied head): counted once."""
        return self.weight_q.qweight.data_ptr()

    def resident_bytes(self) -> int:
        """Bytes of the weight storage this module keeps (codes, scales, mins, aten's scale copy)."""
        extra = 0 if self._aten_scales is None else self._aten_scales.numel() * self._aten_scales.element_size()
        return self.weight_q.nbytes() + extra

    def extra_repr(self) -> str:
        w = self.weight_q
        return f"{w.format}, in_features={self.in_features}, out_features={self.out_features}, group_size={w.group_size}"

    def path(self, rows: int, dtype: torch.dtype) -> str:
        """Which path a call with `rows` input rows of `dtype` takes."""
        bf16 = dtype == torch.bfloat16
        if bf16 and self._aten_scales is not None and rows <= self._policy.aten_int8_max_rows_bf16:
            return "aten_int8"
        if self._kernels is None or not supports(dtype):
            return "torch"
        min_rows = self._policy.dequant_min_rows_bf16 if bf16 else self._policy.dequant_min_rows_f32
        return "dequant_mm" if rows >= min_rows else "kernel"

    def one_row_descriptor(self, dtype: torch.dtype) -> tuple[str, int, int, int] | None:
        """("quant", bound descriptor address, out, in) when one input row of `dtype` runs through the
        C kernel (what a compiled decode step calls, engine/backends/cpu_step.py); None otherwise
        (another path is faster there, or no kernels)."""
        if self._kernel is None or self.path(1, dtype) != "kernel" or self._round_input is not None:
            return None  # the compiled step calls the kernel directly: it would skip the activations' rounding
        return "quant", self._kernel.descriptor_address, self.out_features, self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, this linear takes {self.in_features}")
        if self._round_input is not None:
            rounded = self._round_input(x.reshape(-1, self.in_features))
            out = self.run(rounded, self.path(rounded.shape[0], rounded.dtype))
            return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        if x.dim() == 2 and x.is_contiguous():  # the model's flat batch: no reshapes (a decode step makes ~120 calls)
            return self.run(x, self.path(x.shape[0], x.dtype))
        flat = x.reshape(-1, self.in_features).contiguous()
        return self.run(flat, self.path(flat.shape[0], x.dtype)).reshape(*x.shape[:-1], self.out_features)

    def run(self, x: torch.Tensor, path: str) -> torch.Tensor:
        """x [rows, in] (contiguous) through the named path (forward() picks it; benches and tests
        name it to compare paths)."""
        if path == "kernel" and self._kernel is not None:
            return self._kernel(x, torch.get_num_threads())
        if path == "aten_int8" and self._aten_scales is not None:
            return torch.ops.aten._weight_int8pack_mm(x, self.weight_q.qweight, self._aten_scales)
        if path in ("dequant_mm", "torch"):
            return self._dequant_mm(x, use_kernels=path == "dequant_mm")
        raise ValueError(f"path {path!r} is not available for this {self.weight_q.format} linear")

    def _dequant_mm(self, x: torch.Tensor, *, use_kernels: bool) -> torch.Tensor:
        native = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and self._policy.bf16_matmul)
        compute = x.dtype if native else torch.float32
        fill = None
        if use_kernels and self._kernels is not None:
            kernels, threads = self._kernels, torch.get_num_threads()
            fill = lambda row0, row1, tile: kernels.dequantize(self.weight_q, row0, row1, tile, threads)  # noqa: E731
        return tiled_dequant_mm(x, self.weight_q, compute, tile_elems=TILE_ELEMS, fill=fill)


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_activation_rows_fp8(x: torch.Tensor, scale_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes [rows, in], float32 scales [rows, 1]) of activations, as fbgemm's
    quantize_fp8_per_row (llama-models' FP8 path) computes them: each row's amax, capped at
    `scale_ub` and floored at 1e-12, maps to 448; codes = clamp(x * (448 / amax)); scale = 1 / that."""
    amax = x.detach().float().abs().amax(dim=-1, keepdim=True)
    amax = amax.clamp(min=1e-12, max=scale_ub) if scale_ub is not None else amax.clamp(min=1e-12)
    inverse = FP8_MAX / amax
    codes = (x.float() * inverse).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, 1.0 / inverse


def round_activation_rows_fp8(x: torch.Tensor, scale_ub: float | None) -> torch.Tensor:
    """x [rows, in] as its fp8 row-wise codes times their scales, float32: the activations the
    reference's fp8 x fp8 matmul multiplies (so x' @ dequantize(W)^T is its product up to order)."""
    codes, scales = quantize_activation_rows_fp8(x, scale_ub)
    return codes.float() * scales


def fake_quantize_int8_tokens(x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] float32 quantized to int8 per row and back, as torchao's per_token_dynamic_quant
    (Int8DynActInt4WeightLinear's activations): asymmetric over [min(x, 0), max(x, 0)] in 255 steps
    (scale floored at float32 eps), zero point -128 - round(min / scale), q = clamp(round(x * (1 /
    scale)) + zero, -128, 127), value = (q - zero) * scale."""
    x = x.float()
    low = torch.clamp(x.amin(dim=-1, keepdim=True), max=0.0)
    high = torch.clamp(x.amax(dim=-1, keepdim=True), min=0.0)
    scale = torch.clamp((high - low) / 255.0, min=torch.finfo(torch.float32).eps)
    zero = torch.clamp(-128.0 - torch.round(low / scale), -128.0, 127.0)
    q = torch.clamp(torch.round(x * (1.0 / scale)) + zero, -128.0, 127.0)
    return (q - zero) * scale


def activation_rounding(weight: object) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How a weight's linear rounds its inputs first (None: it does not): fp8 rows for a Meta FP8
    release's weights, int8 tokens for a Meta int4 release's (both: float32 out)."""
    scale_ub = getattr(weight, "activation_scale_ub", None)
    if scale_ub is not None:
        return lambda x: round_activation_rows_fp8(x, scale_ub)
    if getattr(weight, "int8_token_activations", False):
        return fake_quantize_int8_tokens
    return None


def tiled_dequant_mm(x: torch.Tensor, weight: QuantizedWeight, compute: torch.dtype, *, tile_elems: int,
                     fill: Callable[[int, int, torch.Tensor], None] | None = None) -> torch.Tensor:
    """x [rows, in] @ dequantize(weight)^T in x's dtype, on x's device: tiled_mm over tiles of output
    rows dequantized to `compute` (by `fill(row0, row1, tile)`, else in torch)."""
    n, k = weight.shape
    if fill is None:
        fill = lambda row0, row1, tile: tile.copy_(weight.rows(row0, row1).dequantize(compute))  # noqa: E731
    return tiled_mm(x, n, compute, tile_rows=max(1, min(n, tile_elems // max(k, 1))), fill=fill)


def tiled_mm(x: torch.Tensor, out_features: int, compute: torch.dtype, *, tile_rows: int,
             fill: Callable[[int, int, torch.Tensor], None], transposed_tiles: bool = False,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """x [rows, in] @ W^T in out_dtype (default x's), on x's device, W [out_features, in] never whole in `compute`:
    out^T tile by tile, each tile of up to `tile_rows` output rows written by `fill(row0, row1, tile)`
    into one reused buffer (W[row0:row1] as a contiguous [row1 - row0, in] tile, or its transpose
    [in, row1 - row0] with transposed_tiles), then multiplied (the transposed output's row slices are
    contiguous, so mm writes in place). Quantized weights dequantize into the tiles; a bfloat16
    weight on a CPU without bfloat16 GEMMs widens into them (engine/backends/cpu.py)."""
    k = x.shape[1]
    buffer = torch.empty(tile_rows * k, dtype=compute, device=x.device)
    out_dtype = out_dtype or x.dtype
    out_t = torch.empty(out_features, x.shape[0], dtype=out_dtype, device=x.device)
    xt = x.to(compute).t()
    for row0 in range(0, out_features, tile_rows):
        row1 = min(out_features, row0 + tile_rows)
        tile = buffer[: (row1 - row0) * k].view((k, row1 - row0) if transposed_tiles else (row1 - row0, k))
        fill(row0, row1, tile)
        a = tile.t() if transposed_tiles else tile
        if compute == out_dtype:
            torch.mm(a, xt, out=out_t[row0:row1])
        else:
            out_t[row0:row1] = torch.mm(a, xt).to(out_dtype)
    return out_t.t().contiguous()


def _aten_int8_scales(weight: QuantizedWeight) -> torch.Tensor | None:
    """The bfloat16 per-row scales aten._weight_int8pack_mm takes, if they equal ours exactly."""
    if weight.format != "int8" or weight.group_size != weight.in_features:
        return None
    scales = weight.scales.reshape(-1)
    as_bf16 = scales.to(torch.bfloat16)
    return as_bf16 if torch.equal(as_bf16.float(), scales.float()) else None


def make_linear(weight: QuantizedWeight) -> QuantLinear:
    """The linear for a quantized weight (QuantizedWeight.make_linear, the backend seam's hook):
    QuantLinear over the C kernels when they load here, else its torch path; every format takes it."""
    if weight.format not in FORMAT_CODES:
        raise TypeError(f"no linear for {type(weight).__name__}")
    return QuantLinear(weight, quant_kernels.load_quant_kernels())


class StackedLinear(nn.Module):
    """x -> the outputs of several linears over the same input, side by side (formats.RowStack: a
    fused wq|wk|wv or w1|w3 whose parts hold different formats)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)  # submodules: each reports its own weight_format
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def storage_key(self) -> int:
        # Transformer.weight_bytes keys each module's bytes by storage and visits this module before
        # its parts: sharing the first part's key, its total is replaced by that part's own bytes,
        # and the parts' bytes are each counted once
        return self.parts[0].storage_key() if hasattr(self.parts[0], "storage_key") else id(self.parts[0])

    def resident_bytes(self) -> int:
        return sum(p.resident_bytes() for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


class QuantEmbedding(nn.Module):
    """An embedding table kept quantized (GGUF's Q8_0 token embeddings): only the looked-up rows
    are dequantized, into the model dtype."""

    def __init__(self, table: QuantizedWeight, dtype: torch.dtype, kernels: QuantKernels | None = None) -> None:
        super().__init__()
        self.table = table.contiguous()  # a plain attribute, as QuantLinear's (model.to() must not convert it)
        self.num_embeddings, self.embedding_dim = table.shape
        self.dtype = dtype
        on_cpu = self.table.qweight.device.type == "cpu"
        self._kernels = kernels if kernels is not None and on_cpu and supports(dtype) else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self._kernels is not None and ids.dim() == 1 and ids.numel() == 1:
            # a batch-1 decode step's token: its row dequantized by the C kernel (the same numbers) in
            # a few us, not the ~90 us of torch ops gathering codes and scales (bench/NOTES.md)
            row = int(ids[0])
            if not 0 <= row < self.num_embeddings:
                raise IndexError(f"token id {row} is outside the embedding table [0, {self.num_embeddings})")
            out = torch.empty(1, self.embedding_dim, dtype=self.dtype)
            return self._kernels.dequantize(self.table, row, row + 1, out, 1)
        return self.table.lookup(ids, self.dtype)

    @property
    def weight_format(self) -> str:
        return self.table.format

    def storage_key(self) -> int:
        return self.table.qweight.data_ptr()

    def resident_bytes(self) -> int:
        return self.table.nbytes()


def embedding(table: torch.Tensor | QuantizedWeight, dtype: torch.dtype) -> nn.Module:
    """ids -> rows of `table`: nn.Embedding over a float table, QuantEmbedding over a quantized one."""
    if isinstance(table, torch.Tensor):
        return nn.Embedding.from_pretrained(table, freeze=True)
    on_cpu = table.qweight.device.type == "cpu"
    return QuantEmbedding(table, dtype, quant_kernels.load_quant_kernels() if on_cpu else None)
