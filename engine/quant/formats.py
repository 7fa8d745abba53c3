"""Quantized linear weights: one type per format, quantize-from-float and exact dequantize.

A weight is W [out_features, in_features] (torch's nn.Linear layout). Every format stores integer
codes plus float scales, and `dequantize()` is *the* definition of the numbers a format holds: the
linears in engine.quant.linear compute x @ dequantize()^T up to summation order.

- `int8`: int8 codes, value = scale * q. Per-row scales (float32, group_size = in_features) from our
  quantizer; GGUF Q8_0 imports keep their float16 scale per 32 columns (group_size 32).
- `int4`: 4-bit codes packed two to a byte, float16 scales per group of `group_size` columns (a
  multiple of 32; 32 is GGUF Q4_0 / Q4_1's block). Symmetric (no mins, Q4_0): value = scale * (q - 8);
  with mins (Q4_1): value = scale * q + min. Packing inside each 32-column block is GGUF's: byte j
  holds column j in its low nibble and column j + 16 in its high nibble.
- `fp8`: float8_e4m3fn codes, float32 scale per row, value = scale * float(q) (meta-reference's
  fp8_mixed rowwise scheme).

in_features must be a multiple of group_size for group-wise formats (int4 always): a shape that is
not raises ValueError naming the group sizes that fit; weights are never padded. MP shards: `rows()`
takes output rows (column-parallel shards), `cols()` takes input columns at group boundaries
(row-parallel shards); both are views of the codes, no requantization. A mixture-of-experts weight
kept quantized is an ExpertWeights: one weight per expert, cut along the reference's 3-D dims.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from engine.quant import linear as quant_linear

INT4_GROUP_SIZE = 32  # GGUF Q4_0 / Q4_1's block; the default for int4 quantization
_BLOCK = 32  # int4 nibble packing unit (GGUF's), so every int4 group size is a multiple of it
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class QuantizedWeight:
    """Codes and scales of one [out_features, in_features] weight; see the module docstring."""

    format: ClassVar[str]
    # fusing by rows (wq|wk|wv, w1|w3) would mix tensors that are not per output row (a LoRA adaptor's A)
    stacks_by_rows: ClassVar[bool] = False
    qweight: torch.Tensor
    scales: torch.Tensor  # [out, groups]
    group_size: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by role (on-disk names: `<key>.<role>`)."""
        return {"qweight": self.qweight, "scales": self.scales}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def header(self) -> dict[str, object]:
        """What the on-disk JSON header records beside the tensors."""
        return {"format": self.format, "shape": list(self.shape), "group_size": self.group_size}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def make_linear(self, backend: object) -> "torch.nn.Module":
        """Its Linear (engine.backends.base.PreparedWeight): QuantLinear over the C kernels when
        they build here, else its torch path. Every backend without its own linear for a
        quantized weight takes this one."""
        return quant_linear.make_linear(self)

    def rows(self, start: int, stop: int) -> "QuantizedWeight":
        """Output rows [start, stop) (a column-parallel shard)."""
        return replace(self, **{role: t[start:stop] for role, t in self.tensors().items()})

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` dequantized: [*ids.shape, in] (an embedding table kept quantized, e.g. GGUF
        Q8_0 token embeddings; only the looked-up rows are dequantized)."""
        flat = ids.reshape(-1)
        picked = replace(self, **{role: t.index_select(0, flat) for role, t in self.tensors().items()})
        return picked.dequantize(dtype).reshape(*ids.shape, self.in_features)

    def cols(self, start: int, stop: int) -> "QuantizedWeight":
        """Input columns [start, stop) (a row-parallel shard), at group boundaries."""
        per_row = self.group_size == self.in_features
        if not per_row and (start % self.group_size or stop % self.group_size):
            raise ValueError(f"{self.format} columns [{start}, {stop}) do not fall on group boundaries (group size {self.group_size})")
        if self.format == "int4" and (start % _BLOCK or stop % _BLOCK):  # one group a row: nibbles still packed per block
            raise ValueError(f"int4 columns [{start}, {stop}) do not fall on {_BLOCK}-column block boundaries")
        groups = slice(None) if per_row else slice(start // self.group_size, stop // self.group_size)
        return self._with_cols(start, stop, groups, stop - start if per_row else self.group_size)

    def _with_cols(self, start: int, stop: int, groups: slice, group_size: int) -> "QuantizedWeight":
        return replace(self, qweight=self.qweight[:, start:stop], scales=self.scales[:, groups], group_size=group_size)

    def contiguous(self) -> "QuantizedWeight":
        return replace(self, **{role: t.contiguous() for role, t in self.tensors().items()})

    def _scales_per_column(self) -> torch.Tensor:
        """Scales broadcast to [out, in] float32 (for dequantize)."""
        return self.scales.float().repeat_interleave(self.group_size, dim=1)


@dataclass(frozen=True)
class Int8Weight(QuantizedWeight):
    format: ClassVar[str] = "int8"
    # qweight: int8 [out, in]; scales: float32 [out, 1] (per row) or float16 / float32 [out, in / group_size]
    # int8_token_activations: the linear first fake-quantizes each input row to int8, asymmetric
    # (engine.quant.linear.fake_quantize_int8_tokens), as torchao's Int8DynActInt4WeightLinear does
    # for Meta's int4 QLoRA / SpinQuant releases (their int4 codes held here as int8)
    int8_token_activations: bool = False

    def header(self) -> dict[str, object]:
        found = super().header()
        if self.int8_token_activations:
            found["int8_token_activations"] = True
        return found

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.float() * self._scales_per_column()).to(dtype)


@dataclass(frozen=True)
class Fp8Weight(QuantizedWeight):
    format: ClassVar[str] = "fp8"
    # qweight: float8_e4m3fn [out, in]; scales: float32 [out, 1] (per row), or [out, groups] where
    # the shards of a Meta FP8 release, each scaled per row on its own, were merged (concat_cols)
    # activation_scale_ub: None: weight-only (our fp8_mixed on CPU). A bound: the linear first rounds
    # each input row to e4m3 with its amax capped there (engine.quant.linear.quantize_activation_rows_fp8), as
    # llama-models' fbgemm path does for Meta's FP8 releases (fp8_activation_scale_ub, 1200)
    activation_scale_ub: float | None = None

    def header(self) -> dict[str, object]:
        found = super().header()
        if self.activation_scale_ub is not None:
            found["activation_scale_ub"] = self.activation_scale_ub
        return found

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.scales.shape[1] == 1:
            return (self.qweight.float() * self.scales.float()).to(dtype)
        return (self.qweight.float() * self._scales_per_column()).to(dtype)


@dataclass(frozen=True)
class Int4Weight(QuantizedWeight):
    format: ClassVar[str] = "int4"
    # qweight: uint8 [out, in / 2], GGUF nibble order per 32-column block; scales: float16 [out, groups]
    mins: torch.Tensor | None = None  # float16 [out, groups]; None: symmetric (q - 8)
    in_features_: int = 0  # qweight holds two columns per byte

    @property
    def in_features(self) -> int:
        return self.in_features_

    def tensors(self) -> dict[str, torch.Tensor]:
        found = {"qweight": self.qweight, "scales": self.scales}
        if self.mins is not None:
            found["mins"] = self.mins
        return found

    def codes(self) -> torch.Tensor:
        """The unpacked 4-bit codes, uint8 [out, in] in column order."""
        out = self.out_features
        blocks = self.qweight.reshape(out, -1, 1, _BLOCK // 2)
        shifted = blocks >> torch.tensor([0, 4], dtype=torch.uint8, device=blocks.device).reshape(1, 1, 2, 1)
        return (shifted & 0x0F).reshape(out, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = self.codes().float()
        if self.mins is None:
            return (self._scales_per_column() * (q - 8.0)).to(dtype)
        mins = self.mins.float().repeat_interleave(self.group_size, dim=1)
        return (self._scales_per_column() * q + mins).to(dtype)

    def _with_cols(self, start: int, stop: int, groups: slice, group_size: int) -> "Int4Weight":
        mins = None if self.mins is None else self.mins[:, groups]
        return replace(
            self, qweight=self.qweight[:, start // 2 : stop // 2], scales=self.scales[:, groups], mins=mins,
            group_size=group_size, in_features_=stop - start,
        )  # fmt: skip


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight whose output rows are the weights' rows in order (fusing wq|wk|wv or w1|w3, which
    read the same input); they must share format, width, group size, scale dtype and mins."""
    first = weights[0]
    same = {(type(w), w.in_features, w.group_size, w.scales.dtype, getattr(w, "mins", None) is None,
             getattr(w, "activation_scale_ub", None)) for w in weights}  # fmt: skip
    if len(same) != 1:
        raise ValueError(f"cannot fuse weights of different formats or layouts: {sorted(map(str, same))}")
    return replace(first, **{role: torch.cat([w.tensors()[role] for w in weights]) for role in first.tensors()})


def concat_cols(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight whose input columns are the weights' columns in order (a row-parallel weight's
    shards merged when resharding), exactly: the codes, scales and mins side by side, the common
    group size kept. Per-row shards (int8, fp8) with equal scales stay per row; int8 shards with
    their own per-row scales become group-wise int8 with one group per shard (the kernels' group
    sizes: multiples of 32), and fp8 shards likewise group-wise fp8 (a Meta FP8 release's row-parallel
    w2, scaled per row on each rank). ValueError for what has no exact merged form."""
    first = weights[0]
    same = {(type(w), w.out_features, w.scales.dtype, getattr(w, "mins", None) is None) for w in weights}
    if len(same) != 1:
        raise ValueError(f"cannot merge the columns of weights of different formats or layouts: {sorted(map(str, same))}")
    per_row = not isinstance(first, Int4Weight) and all(w.group_size == w.in_features for w in weights)
    if per_row and all(torch.equal(w.scales, first.scales) for w in weights):
        group_size = sum(w.in_features for w in weights)
        return replace(first, qweight=torch.cat([w.qweight for w in weights], dim=1), group_size=group_size)
    if len({w.group_size for w in weights}) != 1 or first.group_size % _BLOCK:
        raise ValueError(
            f"{first.format} shards of widths {[w.in_features for w in weights]} with group sizes "
            f"{[w.group_size for w in weights]} have no common group size (a multiple of {_BLOCK}) to merge into"
        )
    merged = {role: torch.cat([w.tensors()[role] for w in weights], dim=1) for role in first.tensors()}
    if isinstance(first, Int4Weight):
        return replace(first, **merged, in_features_=sum(w.in_features for w in weights))
    return replace(first, **merged)


@dataclass(frozen=True)
class RowStack:
    """Weights of different formats fused into one linear by rows (a GGUF Q4_K_M file's Q4_K wq and
    wk beside a Q6_K wv; weights with LoRA adaptors, engine.quant.lora): its Linear runs each part's own linear and lays the outputs side by side,
    so every part keeps its format and kernels (engine.backends.base.PreparedWeight)."""

    parts: tuple[QuantizedWeight, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.out_features for p in self.parts), self.parts[0].in_features)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

    def make_linear(self, backend: object) -> "torch.nn.Module":
        return quant_linear.StackedLinear([backend.linear(p) for p in self.parts])  # type: ignore[attr-defined]


def cat_rows(parts: list) -> "torch.Tensor | QuantizedWeight | RowStack":
    """Row concatenation of float tensors (torch.cat) or of quantized weights (concat_rows; a
    RowStack where their formats differ): what load-time fusion calls, whichever form the
    checkpoint holds."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    quantized = all(isinstance(p, QuantizedWeight) for p in parts)
    stacked = len({type(p) for p in parts}) > 1 or any(p.stacks_by_rows for p in parts) if quantized else False
    if stacked and len({p.in_features for p in parts}) == 1:
        return RowStack(tuple(parts))
    return concat_rows(parts)


@dataclass(frozen=True)
class ExpertWeights:
    """A mixture-of-experts layer's stacked weight kept quantized: one QuantizedWeight [out, in] per
    expert, shaped as the reference's 3-D parameter [experts, in, out] (llama4's experts.w1 / w3
    [e, D, F], w2 [e, F, D]; a Meta Llama 4 FP8 release, engine/loading/meta_quantized.py). The loader
    cuts and merges it along the reference's dims like a tensor (narrow / cat): dim 2 (out) is each
    expert's rows, dim 1 (in) its columns, so model-parallel shards are the experts' own row and
    column shards; the model takes each expert's weight as its linear (expert())."""

    parts: tuple[QuantizedWeight, ...]

    @property
    def shape(self) -> tuple[int, int, int]:
        out, cols = self.parts[0].shape
        return (len(self.parts), cols, out)

    def expert(self, index: int) -> QuantizedWeight:
        return self.parts[index]

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

    def contiguous(self) -> "ExpertWeights":
        return replace(self, parts=tuple(p.contiguous() for p in self.parts))

    def narrow(self, dim: int, start: int, length: int) -> "ExpertWeights":
        """[start, start + length) along the reference's dim 1 (in: each expert's columns, at group
        boundaries, else ValueError) or 2 (out: each expert's rows)."""
        if dim == 2:
            return replace(self, parts=tuple(p.rows(start, start + length) for p in self.parts))
        if dim == 1:
            return replace(self, parts=tuple(p.cols(start, start + length) for p in self.parts))
        raise ValueError(f"expert weights are cut along in (1) or out (2), not dim {dim}")

    @staticmethod
    def cat(pieces: list["ExpertWeights"], dim: int) -> "ExpertWeights":
        """Shards merged along dim 2 (rows: concat_rows) or 1 (columns: concat_cols, exact or ValueError)."""
        merge = concat_rows if dim == 2 else concat_cols if dim == 1 else None
        if merge is None or len({len(p.parts) for p in pieces}) != 1:
            raise ValueError(f"cannot merge expert weights along dim {dim} ({[p.shape for p in pieces]})")
        return ExpertWeights(tuple(merge([p.parts[e] for p in pieces]) for e in range(len(pieces[0].parts))))


FORMATS: dict[str, type[QuantizedWeight]] = {cls.format: cls for cls in (Int8Weight, Int4Weight, Fp8Weight)}


# --------------------------------------------------------------------------- quantize from float
def _check_groups(in_features: int, group_size: int, multiple_of: int) -> None:
    if group_size <= 0 or group_size % multiple_of or in_features % group_size:
        fits = [g for g in (32, 64, 128, 256) if in_features % g == 0]
        raise ValueError(
            f"in_features {in_features} is not a multiple of the group size {group_size} (group sizes are multiples "
            f"of {multiple_of}); group sizes that fit: {fits or 'none'} (weights are not padded)"
        )


def _grouped(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """[out, in] float32 -> [out, groups, group_size]."""
    out, cols = weight.shape
    return weight.detach().float().reshape(out, cols // group_size, group_size)


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> Int8Weight:
    """Symmetric int8 (q in [-127, 127]); per-row float32 scales, or float16 per group of columns."""
    out, cols = weight.shape
    per_row = group_size is None or group_size == cols
    if not per_row:
        _check_groups(cols, group_size, _BLOCK)
    g = cols if per_row else group_size
    blocks = _grouped(weight, g)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    # per-row scales are kept bfloat16-exact (stored as float32) so that torch's bf16 weight-only
    # int8 op (engine.quant.linear) computes the same numbers; group scales are float16 like Q8_0's
    scale = scale.to(torch.bfloat16).to(torch.float32) if per_row else scale.to(torch.float16)
    inverse = torch.where(scale == 0, 0.0, 1.0 / scale.float())
    q = torch.round(blocks * inverse).clamp(-127, 127).to(torch.int8).reshape(out, cols)
    return Int8Weight(q, scale.reshape(out, -1), g)


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE, *, mins: bool = True) -> Int4Weight:
    """4-bit codes per group of columns with float16 scales, as GGUF's quantizers compute them:
    with mins (Q4_1): scale = (max - min) / 15; symmetric (Q4_0): scale = -(value of largest |w|) / 8.
    Codes are computed from the float16-rounded scale and min, so dequantize() is what was meant."""
    out, cols = weight.shape
    _check_groups(cols, group_size, _BLOCK)
    blocks = _grouped(weight, group_size)
    if mins:
        low = blocks.amin(dim=-1, keepdim=True).to(torch.float16)
        scale = ((blocks.amax(dim=-1, keepdim=True) - low.float()) / 15.0).to(torch.float16)
        inverse = torch.where(scale == 0, 0.0, 1.0 / scale.float())
        q = torch.round((blocks - low.float()) * inverse)
    else:
        index = blocks.abs().argmax(dim=-1, keepdim=True)
        scale = (torch.gather(blocks, -1, index) / -8.0).to(torch.float16)
        inverse = torch.where(scale == 0, 0.0, 1.0 / scale.float())
        q = torch.round(blocks * inverse) + 8.0
    codes = q.clamp(0, 15).to(torch.uint8).reshape(out, cols)
    return Int4Weight(
        pack_int4(codes), scale.reshape(out, -1), group_size, low.reshape(out, -1) if mins else None, in_features_=cols
    )


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [out, in] (0..15) -> [out, in / 2] in GGUF's per-32-column nibble order."""
    out, cols = codes.shape
    halves = codes.reshape(out, cols // _BLOCK, 2, _BLOCK // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(out, cols // 2).contiguous()


def quantize_fp8(weight: torch.Tensor) -> Fp8Weight:
    """float8_e4m3fn codes with one float32 scale per row (amax maps to 448)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1, keepdim=True) / _FP8_MAX).clamp(min=1e-12)
    return Fp8Weight((w / scale).to(FP8_DTYPE), scale, w.shape[1])


def quantize(weight: torch.Tensor, format: str, *, group_size: int | None = None) -> QuantizedWeight:
    """Quantize a float weight [out, in] into `format` ("int8", "int4", "fp8")."""
    if format == "int8":
        return quantize_int8(weight, group_size)
    if format == "int4":
        return quantize_int4(weight, group_size or INT4_GROUP_SIZE)
    if format == "fp8":
        return quantize_fp8(weight)
    raise ValueError(f"unknown weight format {format!r}; known: {', '.join(FORMATS)}")


def from_tensors(header: dict[str, object], tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
    """The weight a header (QuantizedWeight.header()) and its tensors describe; ValueError if they disagree."""
    fmt = header.get("format")
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; known: {', '.join(FORMATS)}")
    out, cols = (int(n) for n in header["shape"])  # type: ignore[union-attr]
    group_size = int(header["group_size"])  # type: ignore[arg-type]
    if fmt == "int4":
        weight: QuantizedWeight = Int4Weight(tensors["qweight"], tensors["scales"], group_size, tensors.get("mins"), cols)
    elif fmt == "int8" and header.get("int8_token_activations"):
        weight = Int8Weight(tensors["qweight"], tensors["scales"], group_size, True)
    elif fmt == "fp8" and header.get("activation_scale_ub") is not None:
        weight = Fp8Weight(tensors["qweight"], tensors["scales"], group_size, float(header["activation_scale_ub"]))  # type: ignore[arg-type]
    else:
        weight = FORMATS[fmt](tensors["qweight"], tensors["scales"], group_size)
    _validate(weight, out, cols)
    return weight


_DTYPES = {
    "int8": (torch.int8, (torch.float32, torch.float16)),
    "int4": (torch.uint8, (torch.float16,)),
    "fp8": (FP8_DTYPE, (torch.float32,)),
}


def _validate(weight: QuantizedWeight, out: int, cols: int) -> None:
    code_dtype, scale_dtypes = _DTYPES[weight.format]
    groups = cols // weight.group_size if weight.group_size and cols % weight.group_size == 0 else -1
    packed_cols = cols // 2 if weight.format == "int4" else cols
    problems = []
    if weight.qweight.dtype != code_dtype or tuple(weight.qweight.shape) != (out, packed_cols):
        problems.append(f"qweight {weight.qweight.dtype} {list(weight.qweight.shape)}")
    if weight.scales.dtype not in scale_dtypes or tuple(weight.scales.shape) != (out, groups):
        problems.append(f"scales {weight.scales.dtype} {list(weight.scales.shape)}")
    mins = getattr(weight, "mins", None)
    if mins is not None and (mins.dtype != torch.float16 or tuple(mins.shape) != (out, groups)):
        problems.append(f"mins {mins.dtype} {list(mins.shape)}")
    if weight.format == "int4" and weight.group_size % _BLOCK:
        problems.append(f"group_size {weight.group_size} (a multiple of {_BLOCK})")
    if problems:
        raise ValueError(f"{weight.format} weight of shape [{out}, {cols}] has unexpected " + ", ".join(problems))
