"""The CPU backend's compiled pure-decode step: the program of engine/kernels/csrc/decode_step.c
(bindings: engine/kernels/decode_step.py) built once at load from the model's blocks, and run as
one C call per step.

Why: each of the ~9 kernel calls per layer costs 4-7 us of Python and ctypes on top of its work,
~1.5 ms of a one-stream demo step and ~4 ms of a 32-decode one (bench/NOTES.md). The program holds
every block's weights in their one-row forms (PackedCpuLinear's interleaved copies, QuantLinear's
bound descriptors), the norms, scratch rows and the kernels' addresses; per step Python passes the
tokens' positions and slots and the attention layout's block tables and lengths (as
CpuKernelBackend.attention_metadata built them for the per-op path, through the paged kernel its
path names). It calls the same kernels in the same order as the per-op path (the tests check the
logits agree bit for bit), so it is an optimisation of dispatch only. The output head stays the
model's own module call after it (one call a step; a dense head is oneDNN's, as fast as a one-row
copy would be, bench/NOTES.md).

Steps of one decode are served wherever every block linear has a one-row form for the model dtype;
steps of 2..AMX_MAX_ROWS decodes only where every block linear also runs those rows on its pairs
copy's many-rows kernel (bfloat16 pairs copies: on an AMX CPU the tiles, on other AVX512_BF16 CPUs
linear.c's pairs gemm up to PAIRS_GEMM_MAX_ROWS; PackedCpuLinear.pairs_rows), as the per-op path would;
without tiles, steps of 2..N decodes where every block linear runs N rows through its interleaved
copy's few-rows kernel (PackedCpuLinear.few_rows: N by the build's vector width, 8 on AVX2): the
step's max_rows; and a model whose block linears send the rows past N to csrc/gemm.c
(PackedCpuLinear.gemm_rows: float32 on AVX2 and AVX-512 builds, and bfloat16 where oneDNN has no bfloat16
kernel) serves up to STEP_GEMM_MAX_ROWS decodes (or the gemm's cutoff: 64 on AVX-512), those rows through the same gemm (a 32-decode float32 demo
step on 2 threads on a Zen 2: 75.5 ms op by op, 65.0 ms in one call; bench/stream_profile.py
--ab). bfloat16 rows go through interleaved_gemm_bf16, the one C function both paths call: x widened
into a float32 scratch the program holds (max_rows x the widest k + n), the sums rounded back to
bfloat16 (bench/NOTES.md 'bfloat16 steps past 8 decodes'). Which steps it runs is the step plan's
choice (CpuKernelBackend.plan_step: pure-decode steps of 1..max_rows sequences); where a weight has no one-row form (too large for an
interleaved copy, a quantized path that another kernel serves faster at one row) or there is no
compiler, build_decode_step returns None and the model runs its per-op path.
"""

from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

from engine.backends.base import AttentionMetadata, AttentionPath, KVCache
from engine.kernels.amx import AmxLinear
from engine.kernels.cpu import CpuKernels, check_kernel
from engine.kernels.decode_step import (
    ATTENTION_DECODE, ATTENTION_PAGED, BLOCK_LINEARS, DTYPE_CODES, KERNEL_NAMES, LINEAR_KINDS, TILE_ROWS, StepKernels, StepLayer,
    StepLinear, StepProgram, StepScratch, StepTokens, load_decode_step_library,
)  # fmt: skip
from engine.kernels.memory import WeightArena

log = logging.getLogger(__name__)

# The most decodes a step runs through gemm.c's linears in one C call: its scratch holds this many
# rows (the demo: 3.8 MiB in float32; in bfloat16 1.9 MiB plus 2.25 MiB of float32 for the gemm's
# widened x and sums; the 1.1B: 18 MiB in float32). Larger pure-decode steps run op by op (the same kernels: the
# same bits). Op by op, a 32-decode float32 demo step took 75.5 ms against 65.0 in one call.
STEP_GEMM_MAX_ROWS = 128


def _one_row(linear: nn.Module, dtype: torch.dtype) -> StepLinear | None:
    describe = getattr(linear, "one_row_descriptor", None)  # PackedCpuLinear, QuantLinear
    form = describe(dtype) if describe is not None else None
    if form is None:
        return None
    kind, address, n, k = form
    return StepLinear(LINEAR_KINDS[kind], address, n, k)


class DecodeStep:
    """The bound program (engine.backends.base.CompiledDecodeStep). Holds every tensor and
    descriptor whose address the program keeps."""

    def __init__(self, fn, program: StepProgram, keep: list) -> None:
        self._fn, self._program, self._keep = fn, program, keep
        self._program_ref = ctypes.byref(program)
        self._layers = program.layers
        self.max_rows = program.max_rows
        self._cache_ptrs: list[int] = []

    def __call__(self, h: torch.Tensor, meta: AttentionMetadata, kv_caches: list[KVCache]) -> torch.Tensor:
        tokens = self._tokens(h.shape[0], meta)
        self._bind_caches(kv_caches)
        out = torch.empty_like(h)
        if failed := self._fn(self._program_ref, h.data_ptr(), out.data_ptr(), ctypes.byref(tokens), torch.get_num_threads()):
            check_kernel(failed, "decode step")  # MemoryError: a kernel's scratch; RuntimeError: the tiles refused a linear
        return out

    def _tokens(self, rows: int, meta: AttentionMetadata) -> StepTokens:
        """The step as the program reads it: `rows` sequences' decode tokens (the plan's choice,
        CpuKernelBackend.plan_step), attended by the paged kernel meta.path names."""
        if rows > self.max_rows:  # its scratch holds max_rows rows: a plan that chose it wrongly must not write past them
            raise ValueError(f"decode step: {rows} rows, it serves at most {self.max_rows}")
        paged = meta.batched
        if meta.path is AttentionPath.PAGED:  # PagedSequences: every sequence in one paged_attention call
            attention, decode_rows, row_start, new_tokens = ATTENTION_PAGED, None, paged.row_start.data_ptr(), paged.new_tokens.data_ptr()
        else:  # PagedDecodes: paged_decode_attention
            attention, decode_rows, row_start, new_tokens = ATTENTION_DECODE, paged.rows.data_ptr(), None, None
        tables = paged.block_tables
        return StepTokens(
            rows, attention, meta.positions.data_ptr(), meta.slot_mapping.data_ptr(), decode_rows, row_start, new_tokens,
            tables.data_ptr(), paged.seq_lens.data_ptr(), tables.shape[1], meta.rope.data_ptr(),
        )  # fmt: skip

    def _bind_caches(self, kv_caches: list[KVCache]) -> None:
        """Each layer's K/V pointers, re-read only when the caches are other tensors than last step's."""
        ptrs = [t.data_ptr() for pair in kv_caches for t in pair]
        if ptrs == self._cache_ptrs:
            return
        if len(kv_caches) != self._program.n_layers:
            raise ValueError(f"{len(kv_caches)} KV caches for {self._program.n_layers} layers")
        dtype, first = self._keep[0].dtype, kv_caches[0][0]  # a scratch row: the model dtype
        for i, (k_cache, v_cache) in enumerate(kv_caches):
            # one shape for all: attention_metadata checked the step's block ids against layer 0's
            if k_cache.shape != first.shape or tuple(k_cache.shape[2:]) != (self._program.kv_heads, self._program.head_dim) or v_cache.shape != k_cache.shape:
                raise ValueError(f"layer {i}: KV cache {list(k_cache.shape)} does not fit the decode step")
            if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.dtype != dtype or v_cache.dtype != dtype:
                raise ValueError(f"layer {i}: KV caches must be contiguous {dtype}")
            self._layers[i].k_cache, self._layers[i].v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        self._program.block_size = first.shape[1]
        self._cache_ptrs = ptrs


def build_decode_step(model: nn.Module, kernels: CpuKernels, amx: AmxLinear | None = None, *, invariant: bool = False) -> DecodeStep | None:
    """The compiled step for engine.models.llama.Transformer's blocks, or None (logged) where a block
    linear has no one-row form or the program cannot be built. Where every block linear runs 2+ rows
    on its pairs copy (`amx`'s tiles, else the pairs gemm: one kernel for all), it also serves steps of
    2..their pairs_rows decodes; else, where every block linear
    is an interleaved copy, steps of up to their few_rows decodes. The KV caches (and their block
    size) are bound at the first step. invariant: the batch-invariant mode's decode attention, and on
    AMX tiles one row through them too (as PackedCpuLinear runs every row count there)."""
    dtype = model.backend.dtype
    if dtype not in DTYPE_CODES:
        return None
    # the output head last: a step reads it right after the blocks (a one-row head's copy moves too)
    gather_one_row_copies([linear for block in model.layers for linear in block_linears(block)] + [model.output])
    layers, keep = [], []
    for i, block in enumerate(model.layers):
        forms = {name: _one_row(linear, dtype) for name, linear in zip(BLOCK_LINEARS, block_linears(block))}
        if any(form is None for form in forms.values()):
            log.info("decode step: layer %d's %s has no one-row form; decode runs op by op", i, [n for n, f in forms.items() if f is None])
            return None
        keep += block_linears(block)  # the owners of the addresses in `forms`
        layers.append(StepLayer(block.attention_norm.weight.data_ptr(), block.ffn_norm.weight.data_ptr(), **forms))
    uses_quant = any(getattr(layer, name).kind == LINEAR_KINDS["quant"] for layer in layers for name in BLOCK_LINEARS)
    quant_address = _quant_linear_address() if uses_quant else None
    lib = load_decode_step_library()
    if lib is None or (uses_quant and quant_address is None):
        return None
    first = model.layers[0]
    heads = first.attention.heads
    dim, qkv_width, hidden = first.attention.wo.out_features, first.attention.wqkv.out_features, first.feed_forward.w2.in_features
    max_rows, pairs_rows, on_tiles, few_rows = _max_rows(model, layers)
    block_tiles = [linear.pairs_on_tiles() for linear in keep if hasattr(linear, "pairs_on_tiles")]
    if invariant and any(block_tiles) and not on_tiles:
        # the mode runs those linears' every row count on the tiles, and a step without them for all
        # would run its one row elsewhere: its bits would depend on the batch
        log.info("decode step: the batch-invariant mode with block linears partly on AMX tiles; decode runs op by op")
        return None
    tile_rows = TILE_ROWS if on_tiles else 1  # the rows the step pads a pairs linear's input to (whole AMX tiles)
    scratch_rows = -(-max_rows // tile_rows) * tile_rows
    scratch_widths = {"normed": dim, "qkv": qkv_width, "attn": heads.heads * heads.head_dim, "attn_out": dim, "gate_up": 2 * hidden, "act": hidden, "ffn_out": dim}
    scratch = _scratch(scratch_widths, scratch_rows, dtype)
    gemm_rows = few_rows < max_rows  # rows past few_rows through gemm.c
    if gemm_rows and dtype == torch.bfloat16:  # interleaved_gemm_bf16's widened x and float32 sums, rows x (k + n)
        step_linears = [getattr(layer, name) for layer in layers for name in BLOCK_LINEARS]
        scratch["gemm_f32"] = _scratch({"gemm_f32": max(f.k for f in step_linears) + max(f.n for f in step_linears)}, max_rows, torch.float32)["gemm_f32"]
    addresses = {name: kernels.address(name) for name in KERNEL_NAMES}
    if invariant:  # the batch-invariant mode's decode attention, as the per-op path calls it (same signature)
        addresses["paged_decode_attention"] = kernels.address("paged_decode_attention_invariant")
    pairs_kernel = (amx.address() if on_tiles else kernels.address("pairs_gemm_bf16")) if pairs_rows else None
    kernel_table = StepKernels(**addresses, quant_linear=quant_address, pairs_many_rows=pairs_kernel,
                               interleaved_gemm=kernels.address("interleaved_gemm") if gemm_rows else None,
                               interleaved_gemm_bf16=kernels.address("interleaved_gemm_bf16") if gemm_rows else None)
    layer_array = (StepLayer * len(layers))(*layers)
    scratch_table = StepScratch(**{name: t.data_ptr() for name, t in scratch.items()})
    program = StepProgram(
        ctypes.pointer(kernel_table), layer_array, ctypes.pointer(scratch_table), model.norm.weight.data_ptr(),
        len(layers), dim, heads.heads, heads.kv_heads, heads.head_dim, hidden, 0, DTYPE_CODES[dtype], max_rows, tile_rows,
        few_rows, 1 if invariant and on_tiles else 2, model.norm.eps, heads.head_dim**-0.5,
    )  # fmt: skip
    keep = [*scratch.values(), kernel_table, layer_array, scratch_table, model.norm.weight, *(b.attention_norm.weight for b in model.layers), *(b.ffn_norm.weight for b in model.layers), *keep]
    return DecodeStep(lib.decode_step, program, keep)


def _max_rows(model: nn.Module, layers: list[StepLayer]) -> tuple[int, bool, bool, int]:
    """(the most decodes a step serves, whether its 2+ rows run the pairs copies' many-rows kernel,
    whether that is the AMX tiles', the most rows its linears run through the interleaved kernel):
    every block linear's pairs_rows (the rows its forward runs on the pairs copy's many-rows kernel:
    AMX tiles, else linear.c's pairs gemm) where all have some; else, where every one is an
    interleaved copy, their few_rows (the rows their forward runs through the interleaved kernel),
    and where the linears all send the rows past those to csrc/gemm.c (AVX2 builds: float32, and
    bfloat16 without oneDNN's bfloat16), up to STEP_GEMM_MAX_ROWS of them too; else 1 (one-row
    linears only)."""
    linears = [linear for block in model.layers for linear in block_linears(block)]
    kinds = {getattr(layer, name).kind for layer in layers for name in BLOCK_LINEARS}
    if kinds == {LINEAR_KINDS["pairs"]}:
        rows = min(linear.pairs_rows() if hasattr(linear, "pairs_rows") else 0 for linear in linears)
        on_tiles = {linear.pairs_on_tiles() for linear in linears}
        if rows > 1 and len(on_tiles) == 1:  # one kernel for all (the step has one slot), as the per-op path runs them
            return rows, True, on_tiles.pop(), rows
    if kinds == {LINEAR_KINDS["interleaved"]}:
        few = max(1, min(linear.few_rows() if hasattr(linear, "few_rows") else 1 for linear in linears))
        gemm = min(linear.gemm_rows() if hasattr(linear, "gemm_rows") else 0 for linear in linears)
        return (min(gemm, STEP_GEMM_MAX_ROWS), False, False, few) if gemm > few else (few, False, False, few)
    return 1, False, False, 1


def _scratch(widths: dict[str, int], rows: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A zeroed [rows, width] buffer per name, all in one WeightArena (huge pages where granted)."""
    arena = WeightArena([(torch.Size((rows, width)), dtype) for width in widths.values()])
    return {name: arena.place(i, torch.zeros(rows, width, dtype=dtype)) for i, (name, width) in enumerate(widths.items())}


def block_linears(block: nn.Module) -> tuple[nn.Module, ...]:
    """A block's linears in the order a decode step runs them (BLOCK_LINEARS)."""
    return block.attention.wqkv, block.attention.wo, block.feed_forward.w13, block.feed_forward.w2


def gather_one_row_copies(linears: list[nn.Module]) -> WeightArena | None:
    """Moves the linears' interleaved one-row copies (PackedCpuLinear's) into one WeightArena, in
    this order: a batch-1 step then streams one huge-page buffer front to back instead of a
    hundred allocations, most of them on 4 KiB pages (engine/kernels/memory.py). None when none has one."""
    movable = [linear for linear in linears if getattr(linear, "interleaved", None) is not None and hasattr(linear, "move_one_row_copy")]
    if not movable:
        return None
    arena = WeightArena([(linear.interleaved.shape, linear.interleaved.dtype) for linear in movable])
    for i, linear in enumerate(movable):  # one at a time: each old copy is freed as its linear moves
        linear.move_one_row_copy(arena.place(i, linear.interleaved))
    return arena


def _quant_linear_address() -> int | None:
    from engine.kernels.quant import load_quant_kernels

    quant = load_quant_kernels()
    return None if quant is None else quant.linear_address()
