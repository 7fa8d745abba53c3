"""A batch-1 decode step as one C call (engine/csrc/decode_step.c), bound once at load.

Why: at one stream each of the ~9 kernel calls per layer costs 4-7 us of Python and ctypes on top
of its work, ~1.5 ms of a demo step (bench/NOTES.md). The program holds every block's weights in
their one-row forms (PackedCpuLinear's interleaved copies, QuantLinear's bound descriptors), the
norms, scratch rows and the kernels' addresses; per step Python passes the token's position, slot
and block table. It calls the same kernels in the same order as the per-op path (the tests check
the logits agree), so it is an optimisation of dispatch only. The output head stays the model's
own module call after it (one call a step; a dense head is oneDNN's, as fast as a one-row copy
would be, bench/NOTES.md).

Built only where every block linear has a one-row form for the model dtype; otherwise (a weight
too large for an interleaved copy, a quantized path that another kernel serves faster at one row,
no compiler) build_decode_step returns None and the model runs its per-op path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch
from torch import nn

from engine.backends.base import AttentionMetadata, KVCache, PagedDecodes
from engine.cpu_kernels import CpuKernels, library_path
from engine.memory import WeightArena

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent.parent / "csrc" / "decode_step.c"
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_LINEAR_KINDS = {"interleaved": 0, "pairs": 1, "quant": 2}  # decode_step.c's LINEAR_*
_KERNEL_NAMES = ("add_rms_norm", "silu_mul", "rope_and_cache_write", "paged_decode_attention", "interleaved_linear", "interleaved_linear_bf16_pairs")

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _p) for name in (*_KERNEL_NAMES, "quant_linear")]


class _Linear(ctypes.Structure):
    _fields_ = [("kind", _i64), ("weight", _p), ("n", _i64), ("k", _i64)]


_BLOCK_LINEARS = ("wqkv", "wo", "w13", "w2")  # a block's linears in step order (decode_step.c's step_layer)


class _Layer(ctypes.Structure):
    _fields_ = [("attention_norm", _p), ("ffn_norm", _p), *((name, _Linear) for name in _BLOCK_LINEARS), ("k_cache", _p), ("v_cache", _p)]


_SCRATCH = ("normed", "qkv", "attn", "attn_out", "gate_up", "act", "ffn_out")


class _Scratch(ctypes.Structure):
    _fields_ = [(name, _p) for name in _SCRATCH]


class _Program(ctypes.Structure):
    _fields_ = [
        ("kernels", ctypes.POINTER(_Kernels)), ("layers", ctypes.POINTER(_Layer)), ("scratch", ctypes.POINTER(_Scratch)),
        ("final_norm", _p), *((name, _i64) for name in ("n_layers", "dim", "heads", "kv_heads", "head_dim", "hidden", "block_size", "bf16")),
        ("eps", _f32), ("scale", _f32),
    ]  # fmt: skip


class _Token(ctypes.Structure):
    _fields_ = [("position", _p), ("slot", _p), ("row", _p), ("block_table", _p), ("seq_len", _p), ("max_blocks", _i64), ("rope", _p)]


@functools.cache
def _load_library(cache_dir: Path | None = None) -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(library_path(SOURCE, cache_dir)))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("compiled decode step unavailable (%s); decode runs op by op", exc)
        return None
    lib.decode_step.argtypes = (ctypes.POINTER(_Program), _p, _p, ctypes.POINTER(_Token), ctypes.c_int)
    lib.decode_step.restype = ctypes.c_int
    return lib


def _one_row(linear: nn.Module, dtype: torch.dtype) -> _Linear | None:
    describe = getattr(linear, "one_row_descriptor", None)  # PackedCpuLinear, QuantLinear
    form = describe(dtype) if describe is not None else None
    if form is None:
        return None
    kind, address, n, k = form
    return _Linear(_LINEAR_KINDS[kind], address, n, k)


class DecodeStep:
    """The bound program (engine.backends.base.BatchOneDecodeStep). Holds every tensor and
    descriptor whose address the program keeps."""

    def __init__(self, fn, program: _Program, keep: list) -> None:
        self._fn, self._program, self._keep = fn, program, keep
        self._program_ref = ctypes.byref(program)
        self._layers = program.layers
        self._cache_ptrs: list[int] = []

    def __call__(self, h: torch.Tensor, meta: AttentionMetadata, kv_caches: list[KVCache]) -> torch.Tensor | None:
        paged = meta.decodes
        if h.shape[0] != 1 or meta.prefills or not isinstance(paged, PagedDecodes):
            return None
        self._bind_caches(kv_caches)
        out = torch.empty_like(h)
        token = _Token(
            meta.positions.data_ptr(), meta.slot_mapping.data_ptr(), paged.rows.data_ptr(), paged.block_tables.data_ptr(),
            paged.seq_lens.data_ptr(), paged.block_tables.shape[1], meta.rope.data_ptr(),
        )  # fmt: skip
        if self._fn(self._program_ref, h.data_ptr(), out.data_ptr(), ctypes.byref(token), torch.get_num_threads()) != 0:
            raise MemoryError("decode step: a quantized linear could not allocate its input copy")
        return out

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


def build_decode_step(model: nn.Module, kernels: CpuKernels) -> DecodeStep | None:
    """The compiled step for engine.model.Transformer's blocks, or None (logged) where a block
    linear has no one-row form or the program cannot be built. The KV caches (and their block
    size) are bound at the first step."""
    dtype = model.backend.dtype
    if dtype not in _DTYPE_CODES:
        return None
    gather_one_row_copies([linear for block in model.layers for linear in _block_linears(block)])
    layers, keep = [], []
    for i, block in enumerate(model.layers):
        forms = {name: _one_row(linear, dtype) for name, linear in zip(_BLOCK_LINEARS, _block_linears(block))}
        if any(form is None for form in forms.values()):
            log.info("decode step: layer %d's %s has no one-row form; decode runs op by op", i, [n for n, f in forms.items() if f is None])
            return None
        keep += _block_linears(block)  # the owners of the addresses in `forms`
        layers.append(_Layer(block.attention_norm.weight.data_ptr(), block.ffn_norm.weight.data_ptr(), **forms))
    uses_quant = any(getattr(layer, name).kind == _LINEAR_KINDS["quant"] for layer in layers for name in _BLOCK_LINEARS)
    quant_address = _quant_linear_address() if uses_quant else None
    lib = _load_library()
    if lib is None or (uses_quant and quant_address is None):
        return None
    first = model.layers[0]
    heads = first.attention.heads
    dim, qkv_width, hidden = first.attention.wo.out_features, first.attention.wqkv.out_features, first.feed_forward.w2.in_features
    scratch_sizes = {"normed": dim, "qkv": qkv_width, "attn": heads.heads * heads.head_dim, "attn_out": dim, "gate_up": 2 * hidden, "act": hidden, "ffn_out": dim}
    scratch = {name: torch.empty(1, size, dtype=dtype) for name, size in scratch_sizes.items()}
    addresses = {name: kernels.address(name) for name in _KERNEL_NAMES}
    kernel_table = _Kernels(**addresses, quant_linear=quant_address)
    layer_array = (_Layer * len(layers))(*layers)
    scratch_table = _Scratch(**{name: t.data_ptr() for name, t in scratch.items()})
    program = _Program(
        ctypes.pointer(kernel_table), layer_array, ctypes.pointer(scratch_table), model.norm.weight.data_ptr(),
        len(layers), dim, heads.heads, heads.kv_heads, heads.head_dim, hidden, 0, _DTYPE_CODES[dtype],
        model.norm.eps, heads.head_dim**-0.5,
    )  # fmt: skip
    keep = [*scratch.values(), kernel_table, layer_array, scratch_table, model.norm.weight, *(b.attention_norm.weight for b in model.layers), *(b.ffn_norm.weight for b in model.layers), *keep]
    return DecodeStep(lib.decode_step, program, keep)


def _block_linears(block: nn.Module) -> tuple[nn.Module, ...]:
    """A block's linears in the order a decode step runs them (_BLOCK_LINEARS)."""
    return block.attention.wqkv, block.attention.wo, block.feed_forward.w13, block.feed_forward.w2


def gather_one_row_copies(linears: list[nn.Module]) -> WeightArena | None:
    """Moves the linears' interleaved one-row copies (PackedCpuLinear's) into one WeightArena, in
    this order: a batch-1 step then streams one huge-page buffer front to back instead of a
    hundred allocations, most of them on 4 KiB pages (engine/memory.py). None when none has one."""
    movable = [linear for linear in linears if getattr(linear, "interleaved", None) is not None and hasattr(linear, "move_one_row_copy")]
    if not movable:
        return None
    arena = WeightArena([(linear.interleaved.shape, linear.interleaved.dtype) for linear in movable])
    for i, linear in enumerate(movable):  # one at a time: each old copy is freed as its linear moves
        linear.move_one_row_copy(arena.place(i, linear.interleaved))
    return arena


def _quant_linear_address() -> int | None:
    from engine.quant.kernels import load_quant_kernels

    quant = load_quant_kernels()
    return None if quant is None else quant.linear_address()
