"""CPU backends: oneDNN pre-packed linears, and on top of them the fused C kernels.

OneDnnBackend: the torch backend's operations with every dense linear's weight reordered once, at
load, into oneDNN's blocked layout (much faster than F.linear at decode batch sizes, float32 and
bfloat16 alike; bench/NOTES.md).

CpuKernelBackend: also norms, RoPE + cache write, paged attention (decodes; prefill chunks too on AMX and on AVX builds) and SiLU-mul through
engine.kernels.cpu (one call each, no intermediate tensors, K/V read in place through the block
tables), and a second copy of each small weight in the interleaved layout the one-row kernel reads
(decode at batch 1, where oneDNN's fixed cost per call is a large part of the multiply; on AVX2
builds up to FEW_ROWS_MAX_ROWS rows, in register-blocked groups); in builds where it measured
faster than oneDNN, float32 inputs of more rows run csrc/gemm.c's many-rows kernel on that same copy
(AVX2: every row count, and every float32 weight keeps that copy in place of oneDNN's, one copy not
two; AVX-512: decode rows up to its cutoff, oneDNN's copy kept for prefill rows).
Where oneDNN has no kernel for bfloat16 (AVX2 CPUs), a bfloat16 model runs CpuKernelBackend too,
every linear on its interleaved copy alone: many rows on gemm.c as float32's (x widened and the sums
rounded back in the same C call), or in builds without it PackedCpuLinear._without_onednn.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.kernels.amx import AmxLinear, load_amx_linear
from engine.backends.base import (
    AttentionMetadata, AttentionPath, CompiledDecodeStep, HeadLayout, KVCache, Linear, PagedDecodes, PagedSequences, ParallelLinear,
    StepPlan,
)  # fmt: skip
from engine.backends.cpu_step import DecodeStep, build_decode_step
from engine.backends.torch_ops import TorchBackend, prefill_attention, split_heads
from engine.kernels.cpu import CpuKernels
from engine.kernels.memory import onednn_rows
from engine.executor.step_inputs import DecodeBounds, StepInputs
from engine.quant.linear import tiled_mm

# The batch size oneDNN tunes the packed layout for; 16 beats 1 at every decode batch size
# (bench/NOTES.md).
PACK_BATCH_HINT = 16

# Linears of at most this many weight bytes also keep a copy in engine.kernels.cpu's interleaved
# layout for one-row inputs: oneDNN's fixed cost per call is a large part of streaming such a weight;
# for larger weights a second copy would cost memory for little (bench/NOTES.md). Larger bfloat16
# weights on AMX CPUs, and on AVX512_BF16 builds with the pairs gemm, get the pairs copy instead of
# oneDNN's, and float32 weights of any size where csrc/gemm.c serves them (AVX2) the interleaved copy
# alone (pack_weight).
INTERLEAVED_MAX_WEIGHT_BYTES = 8 << 20

# bfloat16 inputs of 2 to this many rows run through AMX tiles (engine/kernels/csrc/amx_linear.c) on the
# pairs copy, where the CPU has them and the weight has that copy (INTERLEAVED_MAX_WEIGHT_BYTES):
# the kernel streamed the demo's and the 1.1B model's weight shapes 1.1-1.7x faster than oneDNN at
# every batch in 2..64 (bench/amx_linear.py, bench/NOTES.md 'AMX linears'); larger batches
# (prefill chunks) stay with oneDNN, which AMX matches or beats only up to about 256 rows on wide
# weights, except for weights with no oneDNN copy (pack_weight) and narrow ones (out_features <=
# in_features: wo, w2), which run every row count on the tiles: oneDNN's packed kernel splits
# their few output columns poorly, and the tiles ran them 1.1-1.7x faster at 128-512 rows
# (bench/NOTES.md 'Narrow weights on the tiles').
AMX_MAX_ROWS = 64

# bfloat16 inputs of 2 to this many rows run linear.c's pairs gemm (vdpbf16ps, register-blocked) on the
# pairs copy where the CPU has AVX512_BF16 but no AMX tiles (Zen 4; Cooper Lake, Ice Lake): the pairs
# many-rows kernel in the tiles' place (PackedCpuLinear._bind_pairs_rows). On a Zen 4, one thread, CPU
# time, cold weights, the demo's block shapes, against oneDNN's packed bfloat16: 1.76-2.03x at 2 rows,
# 1.28-1.56x at 8, 1.07-1.20x at 32, 1.03-1.13x at 64; at 128-512 rows level (0.98-1.07x), so oneDNN
# keeps prefill chunks (bench/amx_linear.py --paths onednn,pgemm; bench/NOTES.md 'bfloat16 many rows
# without AMX').
PAIRS_GEMM_MAX_ROWS = 64

# Inputs of 2 to this many rows run through the interleaved copy's few-rows kernel (csrc/linear.c: rows
# in register-blocked groups, each weight load feeding every row of its group) instead of oneDNN, by the
# loaded build's vector width (CpuKernels.simd_bits). AVX2 (Zen 2, cold weights: a stack of layers past
# the L3): 1.1-1.6x faster than oneDNN at 2..8 rows on the demo's block linears (bench/few_rows_linear.py,
# bench/NOTES.md 'Few-rows linear'). AVX-512 (Zen 4, float32, cold, one thread, CPU time): 1.3-1.9x oneDNN
# at 2..4 rows (one group of 4) and level with gemm.c there; from 5 rows (two groups) gemm.c, which takes
# the rows past the cutoff, ran 0.74-0.86x the few-rows kernel's time (bench/NOTES.md 'Zen 4: float32
# steps of 2..64 decodes'). Widths not listed: one row only (the portable build has groups of one row,
# no gain; AMX takes bfloat16 from 2 rows).
FEW_ROWS_MAX_ROWS: dict[int, int] = {256: 8, 512: 4}


def few_rows_cutoff(kernels: CpuKernels | None) -> int:
    """The most rows an interleaved copy serves with the loaded kernels' build (1: one row only)."""
    return 1 if kernels is None else FEW_ROWS_MAX_ROWS.get(kernels.simd_bits, 1)


# A weight without oneDNN's copy (bfloat16 where oneDNN has no bfloat16 kernel: AVX2 CPUs) runs inputs
# of this many rows and more on float32 tiles widened from its interleaved copy and a float32 GEMM
# (PackedCpuLinear._without_onednn), fewer on the interleaved kernel. Tiles of at most
# WIDEN_TILE_ELEMS float32 (1 MiB) stay in L2 between the widening and the GEMM, as
# engine.quant.linear's dequantized tiles do.
WIDEN_MIN_ROWS = 16
WIDEN_TILE_ELEMS = 1 << 18

# A float32 weight small enough for two copies holds the interleaved copy in place of oneDNN's (one
# copy) only where csrc/gemm.c was measured faster than oneDNN up to at least this many rows: a prefill
# step of the default token budget (EngineConfig.max_num_batched_tokens), so oneDNN's copy would be read
# by no common step. AVX2 (cutoff 2048) does; AVX-512 (Zen 4, cutoff 64: 0.91-0.98x oneDNN at 512 rows,
# one thread) keeps both copies, as it held them before, and oneDNN takes the rows past the cutoff. A
# weight too large for two copies (the demo's 113 MB head) takes the interleaved one wherever the gemm
# serves: on Zen 4 (one thread, cold, CPU time) the head's one row ran 1.49x oneDNN's speed on the
# one-row kernel, 2 rows 1.43x, 4 rows 0.93x, 8-32 rows on the gemm 1.02-1.09x, 64 rows 0.94x
# (bench/NOTES.md 'Zen 4: float32 steps of 2..64 decodes').
ONE_COPY_MIN_GEMM_ROWS = 512


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A linear weight in oneDNN's blocked layout, plus (small weights, with the kernels) a copy in
    the layout CpuKernels.interleaved_linear reads for one-row inputs; a large bfloat16 weight on an
    AMX CPU has the pairs copy only (AMX tiles serve every row count from it)."""

    packed: torch.Tensor | None  # opaque oneDNN layout of the [out, in] weight; None: AMX only
    out_features: int
    in_features: int
    interleaved: torch.Tensor | None  # [out / 16, in, 16] (CpuKernels.interleave)


def pack_weight(weight: torch.Tensor, kernels: CpuKernels | None = None, amx: AmxLinear | None = None, *, invariant: bool = False,
                onednn: bool = True) -> PackedWeight:  # fmt: skip
    """oneDNN's copy, and the interleaved one for weights up to INTERLEAVED_MAX_WEIGHT_BYTES; with
    `amx`, a larger bfloat16 weight the tiles take gets the pairs copy in place of oneDNN's (one
    copy either way): its decode batches then stream it 1.1-1.4x faster and one row runs the
    one-row kernel, for prefill chunks on tiles at ~0.9x oneDNN (bench/NOTES.md 'AMX linears').
    Without tiles, where the build has the pairs gemm (AVX512_BF16: Zen 4), likewise: on the 1.1B
    model's shapes one row ran 1.16-1.51x oneDNN's speed, 32 rows 1.01-1.13x, 512-row prefill chunks
    0.87-1.01x (bench/NOTES.md 'Large bfloat16 weights without AMX'); oneDNN alone had left such a
    model's one-row steps at ~22 GB/s and off the compiled decode step.
    onednn False (oneDNN has no kernel for the dtype here: bfloat16 on AVX2): the interleaved copy
    only, whatever its size (PackedCpuLinear's rows without oneDNN); `kernels` and out_features a
    multiple of 16 needed (OneDnnBackend.prepare_linear keeps other weights dense).
    Likewise a float32 weight gets the interleaved copy in place of oneDNN's where csrc/gemm.c serves
    it up to ONE_COPY_MIN_GEMM_ROWS rows or more (AVX2 builds: any size), or where the gemm serves it at
    all and it is too large for two copies (AVX-512 too: the head; ONE_COPY_MIN_GEMM_ROWS says why).
    On AVX2: one row on the one-row kernel 1.2-1.3x, 2..64 rows on the gemm 1.3-1.4x oneDNN's speed,
    ahead up to 2048 rows on two threads (bench/NOTES.md 'AVX2 many-rows linear' and its part 2), past the default 512-token step budget, so oneDNN's copy
    would never be read there and held the demo's block weights twice (bench/NOTES.md 'One float32
    copy'). Rows past the cutoff (a larger step budget) run the gemm too, in blocks of its own
    (interleaved_gemm cuts any row count): where oneDNN's copy would have been level or slightly
    ahead (4096 rows, the demo's block shapes, one thread: the gemm 0.95-1.04x oneDNN's speed, under load;
    bench/NOTES.md 'One float32 copy')."""
    interleaved = None
    if kernels is not None and weight.shape[0] % 16 == 0:
        # one copy: the row kernel (batch-invariant mode), the widened tiles (no oneDNN kernel for the
        # dtype) or the gemm serve every row count from the interleaved copy
        small = weight.numel() * weight.element_size() <= INTERLEAVED_MAX_WEIGHT_BYTES
        gemm_copy = gemm_serves(weight.dtype, weight.shape[0], kernels) and (not small or kernels.gemm_max_rows() >= ONE_COPY_MIN_GEMM_ROWS)
        if invariant or not onednn or gemm_copy:
            return PackedWeight(None, weight.shape[0], weight.shape[1], kernels.interleave(weight))
        if small:
            interleaved = kernels.interleave(weight)
        elif weight.dtype == torch.bfloat16 and (amx is not None or kernels.has_pairs_gemm):
            pairs = kernels.interleave(weight)
            # the many-rows kernel PackedCpuLinear binds to it (_bind_pairs_rows) then takes every row count
            takes_every_row = AmxLinear.supports(pairs) if amx is not None else kernels.bind_pairs_gemm(pairs) is not None
            if takes_every_row:
                return PackedWeight(None, weight.shape[0], weight.shape[1], pairs)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
    return PackedWeight(packed, weight.shape[0], weight.shape[1], interleaved)


def gemm_serves(dtype: torch.dtype, out_features: int, kernels: CpuKernels | None, *, onednn: bool = True) -> bool:
    """Whether inputs of 2+ rows on a weight run csrc/gemm.c (from its interleaved copy): a float32
    weight, or a bfloat16 one without oneDNN's copy (onednn False: no oneDNN bfloat16 kernel here;
    widened per load), of whole 16-column panels, in a build where the kernel measured faster than
    oneDNN (CpuKernels.gemm_max_rows: by the build's vector width, not the CPU's name)."""
    served = dtype == torch.float32 or (dtype == torch.bfloat16 and not onednn)
    return kernels is not None and served and out_features % 16 == 0 and kernels.gemm_max_rows() > 0


class PackedCpuLinear(nn.Module):
    """y = x @ W^T through oneDNN on the packed weight; inputs of one row (up to few_rows_cutoff
    rows) through the interleaved copy when there is one; float32 inputs of more rows up to
    gemm_max_rows (any number, for a weight without oneDNN's copy) through csrc/gemm.c on that
    same copy (the interleaved layout is its panel layout: no further copy), in builds where it
    measured faster than oneDNN; with `amx`, bfloat16 inputs of 2..AMX_MAX_ROWS rows (any number,
    for a narrow weight or one without oneDNN's copy) through AMX tiles on that same copy (the
    pairs layout is the AMX weight-tile layout), without it on AVX512_BF16 builds 2..PAIRS_GEMM_MAX_ROWS
    rows through linear.c's pairs gemm on that copy. A weight with none of oneDNN's copy, the gemm or
    tiles (bfloat16 on AVX2) runs every row count from its interleaved copy (_without_onednn)."""

    def __init__(self, weight: PackedWeight, kernels: CpuKernels | None = None, amx: AmxLinear | None = None, *, invariant: bool = False) -> None:
        super().__init__()
        # batch-invariant mode: every row count through the AMX tiles where they take the weight, else
        # the one-row kernel (one fixed order per row either way), or without its copy, oneDNN one row
        # per call (its kernel choice depends on the rows)
        self._invariant = invariant
        self.batch_invariant = invariant  # Backend.linear wraps no RowByRow around it
        self.register_buffer("packed_weight", weight.packed, persistent=False)
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.register_buffer("interleaved", weight.interleaved if kernels is not None else None, persistent=False)
        self._kernels, self._amx = kernels, amx
        self._bind(weight.interleaved)
        if weight.packed is None and self._many_rows is None and self._gemm is None and self._widen is None and not (invariant and self._one_row is not None):
            raise ValueError("a PackedWeight without oneDNN's copy needs the AMX, many-rows or widening kernel (or the invariant mode's row kernel)")

    def _bind(self, interleaved: torch.Tensor | None) -> None:
        """The calls that read the interleaved copy: one row (the one-row kernel), float32 2+ rows
        (csrc/gemm.c, where it serves) and, with AMX, bfloat16 2+ rows (the tiles read the same
        pairs layout). Bound once: the decode step's ~120 calls skip the module's buffer lookups.
        Not the gemm in the batch-invariant mode: its sums differ from the one-row kernel's, which
        serves one row there (each kernel alone does not depend on the rows; the pair would)."""
        self._one_row = self._kernels.bind_interleaved(interleaved) if self._kernels is not None and interleaved is not None else None
        # a pairs copy (4-D) serves one row through it: its 2+ rows take the pairs many-rows kernel
        # (_bind_pairs_rows) or oneDNN, both faster there
        self._few_rows = (few_rows_cutoff(self._kernels) if interleaved.dim() == 3 else 1) if self._one_row is not None else 0
        self._many_rows, self._max_pairs_rows = self._bind_pairs_rows(interleaved)
        gemm = (self._one_row is not None and not self._invariant and interleaved.dim() == 3
                and gemm_serves(interleaved.dtype, self.out_features, self._kernels, onednn=self.packed_weight is not None))  # fmt: skip
        # its rows out in the model dtype: a bfloat16 weight's sums rounded in C (interleaved_gemm_bf16)
        self._gemm = self._kernels.bind_gemm(interleaved, out_dtype=interleaved.dtype) if gemm else None
        # the most rows it takes: every count for a weight without oneDNN's copy (every float32 weight
        # pack_weight makes where the gemm serves); with both copies (built by hand) the measured cutoff
        self._gemm_max_rows = (sys.maxsize if self.packed_weight is None else self._kernels.gemm_max_rows()) if gemm else 0

        no_onednn = self._one_row is not None and self.packed_weight is None and self._many_rows is None and self._gemm is None
        self._widen = self._kernels.bind_widen(interleaved) if no_onednn else None

    def _bind_pairs_rows(self, interleaved: torch.Tensor | None) -> tuple[Callable[[torch.Tensor, int], torch.Tensor] | None, int]:
        """The pairs copy's many-rows kernel and the most rows it takes: one seam for 'bfloat16 2+ rows
        from the pairs copy'. AMX tiles where the CPU has them (every row count for a narrow weight or
        one without oneDNN's copy, else AMX_MAX_ROWS); without tiles, on AVX512_BF16 builds, linear.c's
        pairs gemm up to PAIRS_GEMM_MAX_ROWS (every row count for a weight without oneDNN's copy: nothing
        else takes them), never in the batch-invariant mode (its sums are not the one-row kernel's).
        (None, 0) without either."""
        if self._one_row is None or interleaved.dim() != 4:
            return None, 0
        if self._amx is not None and AmxLinear.supports(interleaved):
            narrow = self.packed_weight is None or self.out_features <= self.in_features
            return self._amx.bind(interleaved), sys.maxsize if narrow else AMX_MAX_ROWS
        gemm = None if self._invariant else self._kernels.bind_pairs_gemm(interleaved)
        if gemm is None:
            return None, 0
        return gemm, sys.maxsize if self.packed_weight is None else PAIRS_GEMM_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Up to _few_rows rows (one, or few_rows_cutoff's): the interleaved kernel; rows up to
        _gemm_max_rows: csrc/gemm.c (float32 weights, and bfloat16 ones without oneDNN's copy); bfloat16 rows up to _max_pairs_rows: the pairs copy's
        many-rows kernel (AMX tiles, else linear.c's pairs gemm); a weight
        without oneDNN's copy: _without_onednn; else oneDNN. Chosen here, per call, by the input's
        rows, not in the step's plan: one step's linears see different row counts (the blocks all
        its tokens, the head its sampled rows, each expert its routed tokens)."""
        if x.dim() != 2 and self.packed_weight is None and self._gemm is not None:  # no oneDNN copy to take other shapes
            return self(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        rows = x.shape[0]
        if rows == 0 and x.dim() == 2:  # a step that samples no row: no kernel takes an empty input (nor oneDNN's absent copy)
            return x.new_empty(0, self.out_features)
        if self._invariant:
            if self._many_rows is not None and x.dim() == 2 and x.dtype == torch.bfloat16:  # AMX tiles (the mode has no pairs gemm)
                return self._many_rows(x.contiguous(), torch.get_num_threads())
            if self._one_row is not None and x.dim() == 2:
                return self._one_row(x.contiguous(), torch.get_num_threads())
            return torch.cat([self._onednn(x[i : i + 1]) for i in range(rows)]) if rows > 1 else self._onednn(x)
        if 0 < rows <= self._few_rows and x.dim() == 2:
            return self._one_row(x.contiguous(), torch.get_num_threads())
        if rows <= self._gemm_max_rows and x.dtype == self.interleaved.dtype and x.dim() == 2:
            return self._gemm(x.contiguous(), torch.get_num_threads())
        if rows <= self._max_pairs_rows and self._many_rows is not None and x.dim() == 2 and x.dtype == torch.bfloat16:
            return self._many_rows(x.contiguous(), torch.get_num_threads())
        if self._widen is not None:
            return self._without_onednn(x)
        return self._onednn(x)

    def _without_onednn(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of a weight that has no oneDNN copy (its dtype has no oneDNN kernel here: bfloat16 on
        AVX2) nor AMX tiles: the one seam for 'many rows of a bfloat16 weight without oneDNN'. Up
        to WIDEN_MIN_ROWS - 1 rows: the interleaved kernel (each row's sums in float32); from there
        tiles of the interleaved copy widened to float32 and multiplied by a float32 GEMM (torch's
        bfloat16 matmul has no native instructions on such CPUs: bench/NOTES.md 'bfloat16 on AVX2')."""
        flat = x.reshape(-1, self.in_features).contiguous()
        threads = torch.get_num_threads()
        if flat.shape[0] < WIDEN_MIN_ROWS:
            y = self._one_row(flat, threads)
        else:
            y = widened_mm(flat, self._widen, self.out_features, threads)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        """Rows padded to the buckets of engine.kernels.memory.onednn_rows: oneDNN keeps a primitive per row count."""
        rows = x.shape[0]
        padded_rows = onednn_rows(rows) if x.dim() == 2 else rows
        if padded_rows != rows:
            x = torch.nn.functional.pad(x, (0, 0, 0, padded_rows - rows))
        y = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, None, "none", [], "")
        return y[:rows] if padded_rows != rows else y

    def move_one_row_copy(self, copy: torch.Tensor) -> None:
        """Serve one-row inputs from `copy`, an equal copy of the interleaved weight placed elsewhere
        (engine.kernels.memory.WeightArena: the decode step's weights on huge pages, in the order it reads them)."""
        if self.interleaved is None or copy.shape != self.interleaved.shape or copy.dtype != self.interleaved.dtype:
            raise ValueError("move_one_row_copy: not a copy of this linear's interleaved weight")
        self.interleaved = copy
        self._bind(copy)

    def one_row_descriptor(self, dtype: torch.dtype) -> tuple[str, int, int, int] | None:
        """(layout, weight address, out, in) of the one-row copy for a compiled decode step
        (engine/backends/cpu_step.py): "pairs" ([out / 16, in / 2, 16, 2] bfloat16) or "interleaved"
        ([out / 16, in, 16]); None without one (too large, or no kernels)."""
        if self._one_row is None or self.interleaved.dtype != dtype:
            return None
        layout = "pairs" if self.interleaved.dim() == 4 else "interleaved"
        return layout, self.interleaved.data_ptr(), self.out_features, self.in_features

    def few_rows(self) -> int:
        """The most rows forward runs through the interleaved kernel on the one-row copy (1: one row
        only; 0 without a copy), for a compiled decode step of several sequences without AMX
        (engine/backends/cpu_step.py)."""
        return self._few_rows

    def gemm_rows(self) -> int:
        """The most rows forward sends csrc/gemm.c (past few_rows, an input of the copy's dtype; 0 where
        it sends none), for a compiled decode step of many sequences (engine/backends/cpu_step.py: float32, and
        bfloat16 where oneDNN has no bfloat16 kernel)."""
        return self._gemm_max_rows if self._gemm is not None else 0

    def pairs_rows(self) -> int:
        """The most rows (from 2) forward runs on the pairs copy's many-rows kernel (AMX tiles, else
        linear.c's pairs gemm) up to AMX_MAX_ROWS, for a compiled decode step of many sequences
        (engine/backends/cpu_step.py); 0 without one."""
        return min(self._max_pairs_rows, AMX_MAX_ROWS) if self._many_rows is not None else 0

    def pairs_on_tiles(self) -> bool:
        """Whether that kernel is the AMX tiles' (whose step pads its rows to whole tiles)."""
        return self._many_rows is not None and self._amx is not None

    def resident_bytes(self) -> int:
        copies = [t for t in (self.packed_weight, self.interleaved) if t is not None]
        return sum(t.numel() * t.element_size() for t in copies)


def widened_mm(x: torch.Tensor, widen: Callable[[int, int, torch.Tensor, int], None], out_features: int, threads: int,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """x [rows, in] @ W^T through a float32 GEMM over tiles of W widened by `widen`
    (CpuKernels.bind_widen): each tile a multiple of 16 output rows (the interleaved blocks), within
    WIDEN_TILE_ELEMS. In out_dtype, default x's."""
    tile_rows = min(out_features, max(16, WIDEN_TILE_ELEMS // x.shape[1] // 16 * 16))
    return tiled_mm(x, out_features, torch.float32, tile_rows=tile_rows, fill=lambda row0, row1, tile: widen(row0, row1, tile, threads),
                    transposed_tiles=True, out_dtype=out_dtype)  # fmt: skip


def packing_available(dtype: torch.dtype) -> bool:
    """oneDNN present and able to run this dtype here (bfloat16 needs AVX-512 class CPUs)."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        layer = PackedCpuLinear(pack_weight(torch.ones(8, 16, dtype=dtype)))
        return bool(torch.equal(layer(torch.ones(2, 16, dtype=dtype)), torch.full((2, 8), 16.0, dtype=dtype)))
    except (RuntimeError, AttributeError):  # no oneDNN kernel for this dtype / build
        return False


@dataclass(frozen=True, slots=True)
class InterleavedHead:
    """A bfloat16 output head in the one-row kernels' layout only (CpuKernels.interleave: no oneDNN
    copy, so no more memory than before), for float32 logits (InterleavedHeadLinear)."""

    interleaved: torch.Tensor
    out_features: int
    in_features: int


class InterleavedHeadLinear(nn.Module):
    """The bfloat16 output head through interleaved_linear_f32_out: bfloat16 inputs and weights,
    float32 sums kept as the logits (oneDNN's bfloat16 linear rounds them to bfloat16). Every row
    is summed in one fixed order whatever the rows (the logits do not depend on the batch), but
    with `widen`: many rows then run a float32 GEMM over widened tiles (CPUs without oneDNN's bfloat16).
    With `amx`, every row runs on the tiles instead (amx_linear_bf16_f32_out, the same copy: the
    pairs layout is the tiles' layout), each row's sums in the tiles' one order whatever the rows:
    still independent of the batch. The demo's head [49152, 576], 2 threads: 32 rows 8.5 ms on the
    one-row kernel's register-blocked rows (vdpbf16ps), 1.4 ms on the tiles; one row level (bench/NOTES.md
    'The float32 head on AMX tiles')."""

    def __init__(self, head: InterleavedHead, kernels: CpuKernels, *, widen: bool = False, amx: AmxLinear | None = None) -> None:
        super().__init__()
        self.register_buffer("interleaved", head.interleaved, persistent=False)
        self.out_features, self.in_features = head.out_features, head.in_features
        self._kernels, self._widens, self._amx_kernels = kernels, widen, amx
        self._few_rows = few_rows_cutoff(kernels)
        self._bind(head.interleaved)

    def _bind(self, weight: torch.Tensor) -> None:
        kernels = self._kernels
        self._rows = kernels.bind_interleaved(weight, f32_out=True)
        amx = self._amx_kernels is not None and AmxLinear.supports(weight)
        self._amx = self._amx_kernels.bind(weight, f32_out=True) if amx else None
        # widen: WIDEN_MIN_ROWS rows and more through widened float32 tiles and a float32 GEMM, as
        # PackedCpuLinear without oneDNN (float32 sums too, in the GEMM's order: the logits then
        # depend on the rows; never in the batch-invariant mode)
        # (where csrc/gemm.c serves bfloat16 weights, rows past the few-rows cutoff run it instead:
        # bfloat16 widened per load, no tiles written and read back)
        gemm = self._widens and weight.dim() == 3 and gemm_serves(weight.dtype, self.out_features, kernels, onednn=False)
        self._gemm = kernels.bind_gemm(weight) if gemm else None
        self._widen = kernels.bind_widen(weight) if self._widens and not gemm else None

    def move_one_row_copy(self, copy: torch.Tensor) -> None:
        """Serve every row from `copy`, an equal copy of the interleaved weight placed elsewhere: the
        compiled decode step's huge-page arena, right after the last block's weights
        (engine/backends/cpu_step.py gather_one_row_copies; on 4 KiB pages the demo's one-row head
        took x1.08-1.30 the time at 1 thread, bench/NOTES.md 'One stream, bfloat16: the accumulators in registers')."""
        if copy.shape != self.interleaved.shape or copy.dtype != self.interleaved.dtype:
            raise ValueError("move_one_row_copy: not a copy of this head's interleaved weight")
        self.interleaved = copy
        self._bind(copy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._amx is not None:
            return self._amx(x.contiguous(), torch.get_num_threads())
        if self._gemm is not None and x.shape[0] > self._few_rows:
            return self._gemm(x.contiguous(), torch.get_num_threads())
        if self._widen is not None and x.shape[0] >= WIDEN_MIN_ROWS:
            return widened_mm(x.contiguous(), self._widen, self.out_features, torch.get_num_threads(), out_dtype=torch.float32)
        return self._rows(x.contiguous(), torch.get_num_threads())

    def resident_bytes(self) -> int:
        return self.interleaved.numel() * self.interleaved.element_size()


class OneDnnBackend(TorchBackend):
    """torch ops, with dense linears packed for oneDNN at load (quantized ones stay as they are)."""

    name = "onednn"
    kernels: CpuKernels | None = None
    amx: AmxLinear | None = None
    onednn = True  # oneDNN runs the model dtype here (CpuKernelBackend: False for bfloat16 on AVX2)

    def prepare_linear(self, weight):
        if not isinstance(weight, torch.Tensor):
            return weight
        if not self.onednn and weight.shape[0] % 16:  # no oneDNN, no interleaved layout: torch's linear
            return weight
        return pack_weight(weight, self.kernels, self.amx, invariant=self.batch_invariant, onednn=self.onednn)

    def prepare_head(self, weight):
        """A bfloat16 head: the kernels' interleaved copy (float32 logits at one-row-kernel speed),
        else the tensor as it is (torch's FloatHeadLinear); oneDNN's bfloat16 linear would round the
        logits. float32 heads pack as the block linears do (pack_weight: oneDNN's copy, or where
        csrc/gemm.c serves float32, the interleaved copy in its place), their sums float32
        already (in the batch-invariant mode they take the row kernel too: oneDNN's sums depend on
        the rows)."""
        if not isinstance(weight, torch.Tensor) or not (weight.dtype == torch.bfloat16 or self.batch_invariant):
            return self.prepare_linear(weight)
        if self.kernels is not None and weight.shape[0] % 16 == 0:
            return InterleavedHead(self.kernels.interleave(weight), weight.shape[0], weight.shape[1])
        return weight

    def head_linear(self, weight, collective=None) -> Linear:
        if isinstance(weight, InterleavedHead):
            local = InterleavedHeadLinear(weight, self.kernels, widen=not self.onednn and not self.batch_invariant, amx=self.amx)
            return local if collective is None else ParallelLinear(local, collective)
        return super().head_linear(weight, collective)

    def special_linear(self, weight) -> Linear:
        if isinstance(weight, PackedWeight):
            return PackedCpuLinear(weight, self.kernels, self.amx, invariant=self.batch_invariant)
        return super().special_linear(weight)


class CpuKernelBackend(OneDnnBackend):
    """OneDnnBackend with the norms, RoPE + cache write, decode attention and SiLU-mul in C.
    The residual stream is updated in place by add_rms_norm."""

    name = "cpu_kernels"

    def __init__(self, device: torch.device, dtype: torch.dtype, kernels: CpuKernels, *, quantization: str | None = None,
                 batch_invariant: bool = False) -> None:  # fmt: skip
        super().__init__(device, dtype, quantization=quantization, batch_invariant=batch_invariant)
        self.kernels = kernels
        # bfloat16 where oneDNN has no bfloat16 kernel (AVX2): every linear on the interleaved copy
        # only (PackedCpuLinear._without_onednn), the head on the kernels (prepare_head)
        self.onednn = packing_available(dtype)
        # the batch-invariant mode too: a row's sums on the tiles do not depend on the other rows
        # (amx_linear.c), so there every row count of a bfloat16 linear takes them
        self.amx = load_amx_linear() if dtype == torch.bfloat16 else None

    def plan_step(self, inputs: StepInputs, freqs_cis: torch.Tensor, cache: KVCache, compiled: CompiledDecodeStep | None) -> StepPlan:
        """The compiled step where it serves the step: every sequence decodes one token (each
        sequence has at least one: num_tokens == num_seqs), at most its max_rows of them, on a
        paged path (the kernels it calls); else the blocks op by op."""
        meta = self.attention_metadata(inputs, freqs_cis, cache)
        rows = inputs.num_tokens
        pure_decode = rows == inputs.num_seqs
        served = compiled is not None and pure_decode and 0 < rows <= compiled.max_rows and meta.path is not AttentionPath.GATHERED
        return StepPlan(meta, served)

    def attention_metadata(self, inputs: StepInputs, freqs_cis: torch.Tensor, cache: KVCache, chunk_size: int | None = None) -> AttentionMetadata:
        """The paths, in order: torch's (GATHERED) for chunk windows the kernels cannot read (chunk
        size not a multiple of the block size); every sequence in one paged_attention call where it
        beats SDPA on prefill chunks (AMX tiles; AVX builds: paged_attention_takes_chunks) and a
        sequence has 2+ new tokens (a prefill chunk); the decodes in one
        paged_attention call from two per thread where it is the faster (bfloat16 on AMX tiles;
        prefill chunks: SDPA); else paged_decode_attention."""
        num_blocks, block_size, _, head_dim = cache[0].shape
        if chunk_size is not None and chunk_size % block_size:  # the kernel reads whole blocks: torch's masks
            return TorchBackend.attention_metadata(self, inputs, freqs_cis, cache, chunk_size)
        rope = torch.view_as_real(freqs_cis)  # [max_seq_len, head_dim // 2, 2] float32 (cos, sin)
        # a sequence with 2+ new tokens (each has at least one): a prefill chunk, which the tiles take too
        positions, slots = inputs.positions, inputs.slot_mapping
        # the batch-invariant mode: paged_decode_attention (split per sequence) for the decodes, SDPA per prefill chunk
        varying = not self.batch_invariant
        bounds = inputs.decode_bounds
        if chunk_size is None and bounds is not None and bounds.describes(inputs):
            check_decode_bounds(bounds, num_positions=rope.shape[0], num_blocks=num_blocks, block_size=block_size,
                                table_width=inputs.block_tables.shape[1])  # fmt: skip
            if varying and self._paged_takes_decodes(inputs.num_seqs, cache[0].dtype, head_dim):
                # every sequence one row: its rows are the step's group starts as they are
                rows = PagedSequences(inputs.query_start_loc[:-1], torch.ones(inputs.num_seqs, dtype=torch.int32), inputs.seq_lens, inputs.block_tables)
                return AttentionMetadata(AttentionPath.PAGED, positions, slots, [], rows, rope)
            # every row samples in order: logits_indices is 0..num_tokens - 1, each decode's int64 row
            paged = PagedDecodes(inputs.logits_indices, inputs.block_tables, inputs.seq_lens)
            return AttentionMetadata(AttentionPath.PAGED_DECODES, positions, slots, [], paged, rope)
        if varying and chunk_size is None and inputs.num_tokens > inputs.num_seqs and self.kernels.paged_attention_takes_chunks(cache[0].dtype, head_dim, block_size):
            meta = AttentionMetadata(AttentionPath.PAGED, positions, slots, [], _all_sequences(inputs), rope)
        else:
            starts, _, prefills, decodes = AttentionMetadata.split(inputs, block_size, chunk_size)
            if varying and chunk_size is None and self._paged_takes_decodes(len(decodes), cache[0].dtype, head_dim):
                meta = AttentionMetadata(AttentionPath.PAGED, positions, slots, prefills, _paged_decode_sequences(inputs, decodes, starts), rope)
            else:
                paged = _paged_decodes(inputs, decodes, starts) if decodes else None
                if paged is not None and chunk_size is not None:
                    paged = _window_paged_decodes(paged, chunk_size // block_size, block_size)
                meta = AttentionMetadata(AttentionPath.PAGED_DECODES, positions, slots, prefills, paged, rope)
        check_indices(inputs, meta, num_positions=rope.shape[0], num_blocks=num_blocks, block_size=block_size)
        return meta

    def _paged_takes_decodes(self, num_decodes: int, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether a step's decodes go to paged_attention in one call (two per thread or more, where
        it is the faster: paged_attention_takes_decodes) rather than paged_decode_attention."""
        return head_dim % 16 == 0 and num_decodes >= 2 * torch.get_num_threads() and self.kernels.paged_attention_takes_decodes(dtype)

    def compiled_decode_step(self, model: nn.Module) -> DecodeStep | None:
        return build_decode_step(model, self.kernels, self.amx, invariant=self.batch_invariant)

    def lora_kernels(self) -> CpuKernels:
        return self.kernels

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty_like(residual)
        self.kernels.add_rms_norm(residual, delta, weight, out, eps, torch.get_num_threads())
        return residual, out

    def rope_and_cache_write(self, qkv: torch.Tensor, heads: HeadLayout, cache: KVCache, meta: AttentionMetadata) -> None:
        k_cache, v_cache = cache
        self.kernels.rope_and_cache_write(
            qkv, heads.heads, heads.kv_heads, heads.head_dim, meta.positions, meta.rope, meta.slot_mapping,
            k_cache, v_cache, torch.get_num_threads(),
        )  # fmt: skip

    def attention(self, qkv: torch.Tensor, heads: HeadLayout, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        path = meta.path
        if path is AttentionPath.GATHERED:  # a layout the kernels cannot read (see attention_metadata)
            return TorchBackend.attention(self, qkv, heads, cache, meta)
        num_tokens = qkv.shape[0]
        out = torch.empty(num_tokens, heads.heads * heads.head_dim, dtype=qkv.dtype)
        k_cache, v_cache = cache
        batched = meta.batched
        if path is AttentionPath.PAGED:  # the decodes (on tiles: every sequence) in one call; prefill chunks below
            self.kernels.paged_attention(
                qkv, out, batched.row_start, batched.new_tokens, batched.seq_lens, batched.block_tables, k_cache, v_cache,
                heads.heads, heads.kv_heads, heads.head_dim**-0.5, torch.get_num_threads(),
            )  # fmt: skip
        elif batched is not None:
            self.kernels.paged_decode_attention(
                qkv, out, batched.rows, k_cache, v_cache, batched.block_tables, batched.seq_lens, heads.heads,
                heads.kv_heads, heads.head_dim**-0.5, torch.get_num_threads(), invariant=self.batch_invariant,
            )  # fmt: skip
        if meta.prefills:
            q, k, v = split_heads(qkv, heads)
            out_heads = out.view(num_tokens, heads.heads, heads.head_dim)
            for chunk in meta.prefills:
                out_heads[chunk.rows] = prefill_attention(q[chunk.rows], k[chunk.rows], v[chunk.rows], cache, chunk, heads)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        hidden = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
        self.kernels.silu_mul(gate_up, hidden, torch.get_num_threads())
        return hidden


# paged_attention takes all of a step's sequences on AMX tiles (1.3-2.5x faster than SDPA on prefill
# chunks, bench/NOTES.md) and on every AVX build (AVX2 Zen 2: float32 1.6x, bfloat16 2.8x; AVX-512
# Zen 4: float32 4.6x, bfloat16 3.3x); elsewhere (SSE) prefill chunks stay with torch's SDPA, and
# decodes with paged_decode_attention.
def _paged_decode_sequences(inputs: StepInputs, decodes: list[int], starts: list[int]) -> PagedSequences:
    """For steps with at least two decodes per thread where paged_attention takes them (bfloat16 on
    AMX tiles: paged_attention_takes_decodes); paged_decode_attention's splitting of one sequence's
    blocks over the threads is what a few decodes need."""
    row_start, tables, seq_lens = _decode_rows(inputs, decodes, starts, torch.int32)
    return PagedSequences(row_start, torch.ones(len(decodes), dtype=torch.int32), seq_lens, tables)


def _all_sequences(inputs: StepInputs) -> PagedSequences:
    """Every sequence of the step, prefill chunks (with or without a cached prefix) and decodes
    alike, for one paged_attention call; no prefills left for SDPA."""
    starts = inputs.query_start_loc.to(torch.int32)
    row_start, new_tokens = starts[:-1].contiguous(), (starts[1:] - starts[:-1]).contiguous()
    return PagedSequences(row_start, new_tokens, inputs.seq_lens.contiguous(), inputs.block_tables.contiguous())


def _paged_decodes(inputs: StepInputs, decodes: list[int], starts: list[int]) -> PagedDecodes:
    return PagedDecodes(*_decode_rows(inputs, decodes, starts, torch.int64))


def _decode_rows(inputs: StepInputs, decodes: list[int], starts: list[int], row_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(flat-batch row of each decode token in row_dtype, block tables, seq_lens) of the decoding
    sequences, each contiguous."""
    if len(decodes) == len(starts) - 1:  # every sequence decodes: the step's tensors as they are
        return inputs.query_start_loc[:-1].to(row_dtype).contiguous(), inputs.block_tables.contiguous(), inputs.seq_lens.contiguous()
    index = torch.tensor(decodes, dtype=torch.int64)
    rows = torch.tensor([starts[i] for i in decodes], dtype=row_dtype)
    return rows, inputs.block_tables.index_select(0, index).contiguous(), inputs.seq_lens.index_select(0, index).contiguous()


def _window_paged_decodes(paged: PagedDecodes, chunk_blocks: int, block_size: int) -> PagedDecodes:
    """Chunked local attention through the paged kernel: each decode's block table starts at its
    chunk's first block (chunk_size a multiple of block_size) and its length counts from there,
    so the kernel reads exactly keys [p // chunk_size * chunk_size, p]."""
    first_block = (paged.seq_lens.to(torch.int64) - 1) // (chunk_blocks * block_size) * chunk_blocks  # [decodes]
    width = paged.block_tables.shape[1]
    cols = (first_block[:, None] + torch.arange(width)[None, :]).clamp_(max=width - 1)
    tables = paged.block_tables.gather(1, cols).contiguous()
    seq_lens = (paged.seq_lens - (first_block * block_size).to(torch.int32)).contiguous()
    return PagedDecodes(paged.rows, tables, seq_lens)


def check_indices(inputs: StepInputs, meta: AttentionMetadata, *, num_positions: int, num_blocks: int, block_size: int) -> None:
    """The C kernels index raw memory with positions, slots and block ids: an out-of-range value
    (a scheduler bug) must raise here, as torch's indexing would, not corrupt memory."""
    ranges = [(inputs.positions, num_positions, "position", torch.int64), (inputs.slot_mapping, num_blocks * block_size, "KV slot", torch.int64)]
    decode = None  # (block tables, seq_lens, rows, the rows' dtype), as the step's kernel reads them
    batched = meta.batched
    if meta.path is AttentionPath.PAGED:
        decode = (batched.block_tables, batched.seq_lens, batched.row_start, torch.int32)
        # a sequence's new tokens: at least 1, no more than its K/V, rows inside the step
        ranges += [
            (batched.new_tokens - 1, 1 << 30, "new token count - 1", torch.int32),
            (batched.seq_lens - batched.new_tokens, 1 << 30, "cached prefix length", torch.int32),
            (batched.row_start + batched.new_tokens - 1, inputs.num_tokens, "last new row", torch.int32),
        ]  # fmt: skip
    elif batched is not None:
        decode = (batched.block_tables, batched.seq_lens, batched.rows, torch.int64)
    if decode is not None:
        tables, seq_lens, rows, row_dtype = decode
        ranges += [
            (tables, num_blocks, "KV block id", torch.int32),
            (seq_lens - 1, tables.shape[1] * block_size, "decode length - 1", torch.int32),
            (rows, inputs.num_tokens, "decode row", row_dtype),
        ]  # fmt: skip
    for values, limit, what, dtype in ranges:
        if values.dtype != dtype or not values.is_contiguous():
            raise ValueError(f"{what}s must be a contiguous {dtype} tensor, got {values.dtype}")
        low, high = (bound.item() for bound in torch.aminmax(values))  # Python ints: tensor comparisons cost ~10x more
        _check_range(low, high, limit, what)


def check_decode_bounds(bounds: DecodeBounds, *, num_positions: int, num_blocks: int, block_size: int, table_width: int) -> None:
    """check_indices for a pure-decode step from the ranges build_step_inputs took of its lists (the
    same limits; its rows are 0..num_tokens - 1 and each sequence's new tokens 1 by construction:
    DecodeBounds.describes)."""
    (low_len, high_len) = bounds.seq_lens
    for (low, high), limit, what in (
        (bounds.positions, num_positions, "position"),
        (bounds.slots, num_blocks * block_size, "KV slot"),
        (bounds.block_ids, num_blocks, "KV block id"),
        ((low_len - 1, high_len - 1), table_width * block_size, "decode length - 1"),
    ):  # fmt: skip
        _check_range(low, high, limit, what)


def _check_range(low: int, high: int, limit: int, what: str) -> None:
    if low < 0 or high >= limit:
        raise ValueError(f"a {what} is outside [0, {limit}): {low}..{high}")
