"""ctypes bindings of engine/kernels/csrc/decode_step.c: a pure-decode step in one C call.

The structures mirror the C ones field for field (step_kernels, step_linear, step_layer,
step_scratch, step_program, step_tokens) and the constants its enums; the library is built and
cached like the other kernels (engine.kernels.build.library_path). What a program holds and when a
step runs it is the CPU backend's (engine/backends/cpu_step.py builds and calls it).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch

from engine.kernels.build import DECODE_STEP, library_path

log = logging.getLogger(__name__)

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the program's `bf16` flag and the kernels' dtype argument
LINEAR_KINDS = {"interleaved": 0, "pairs": 1, "quant": 2}  # LINEAR_*: a linear's one-row form
ATTENTION_DECODE, ATTENTION_PAGED = 0, 1  # ATTENTION_*: paged_decode_attention, paged_attention
TILE_ROWS = 16  # engine/kernels/csrc/amx_linear.c's ROW_BLOCK: the step pads its linears' rows to whole tiles (AMX only)
# the kernels the program calls by address, in step_kernels' order (quant_linear, pairs_many_rows after them)
KERNEL_NAMES = (
    "add_rms_norm", "silu_mul", "rope_and_cache_write", "paged_decode_attention", "paged_attention", "interleaved_linear",
    "interleaved_linear_bf16_pairs",
)  # fmt: skip
BLOCK_LINEARS = ("wqkv", "wo", "w13", "w2")  # a block's linears in step order (step_layer; decode_step.c's step_layer())
SCRATCH_BUFFERS = ("normed", "qkv", "attn", "attn_out", "gate_up", "act", "ffn_out")

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class StepKernels(ctypes.Structure):
    _fields_ = [(name, _p) for name in (*KERNEL_NAMES, "quant_linear", "pairs_many_rows", "interleaved_gemm", "interleaved_gemm_bf16")]


class StepLinear(ctypes.Structure):
    _fields_ = [("kind", _i64), ("weight", _p), ("n", _i64), ("k", _i64)]


class StepLayer(ctypes.Structure):
    _fields_ = [("attention_norm", _p), ("ffn_norm", _p), *((name, StepLinear) for name in BLOCK_LINEARS), ("k_cache", _p), ("v_cache", _p)]


class StepScratch(ctypes.Structure):
    _fields_ = [(name, _p) for name in (*SCRATCH_BUFFERS, "gemm_f32")]


class StepProgram(ctypes.Structure):
    _fields_ = [
        ("kernels", ctypes.POINTER(StepKernels)), ("layers", ctypes.POINTER(StepLayer)), ("scratch", ctypes.POINTER(StepScratch)),
        ("final_norm", _p),
        *((name, _i64) for name in ("n_layers", "dim", "heads", "kv_heads", "head_dim", "hidden", "block_size", "bf16", "max_rows", "tile_rows", "few_rows", "pairs_min_rows")),
        ("eps", _f32), ("scale", _f32),
    ]  # fmt: skip


class StepTokens(ctypes.Structure):
    _fields_ = [
        ("rows", _i64), ("attention", _i64), ("position", _p), ("slot", _p), ("decode_rows", _p), ("row_start", _p),
        ("new_tokens", _p), ("block_table", _p), ("seq_len", _p), ("max_blocks", _i64), ("rope", _p),
    ]  # fmt: skip


@functools.cache
def load_decode_step_library(cache_dir: Path | None = None) -> ctypes.CDLL | None:
    """The library with decode_step(program, h, out, tokens, threads) typed; None (logged once)
    where it cannot be built or loaded here."""
    try:
        lib = ctypes.CDLL(str(library_path(DECODE_STEP, cache_dir)))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("compiled decode step unavailable (%s); decode runs op by op", exc)
        return None
    lib.decode_step.argtypes = (ctypes.POINTER(StepProgram), _p, _p, ctypes.POINTER(StepTokens), ctypes.c_int)
    lib.decode_step.restype = ctypes.c_int
    return lib
