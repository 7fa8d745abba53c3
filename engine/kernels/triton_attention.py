"""Paged attention as one Triton kernel: decodes and prefill chunks over a cached prefix, reading
K/V in place from the paged cache through each sequence's block table (no gather into a padded batch).

The CUDA backend's attention (engine/backends/cuda.py) where triton imports; on CPU tensors the same
kernel runs under Triton's interpreter (numpy) when TRITON_INTERPRET=1 was set before triton was
imported (it decides at decoration, for the standard library's functions too), which is how CI tests
it against torch's attention, in a subprocess of its own (tests/engine/test_triton_attention.py).
Triton is the optional `cuda` extra: a CPU install never needs it.

Layout (AttentionPath.PAGED_TILES, PagedTiles): a step's new tokens are the flat rows of qkv; the
grid is (tiles, kv_heads), a tile being up to `tile_tokens` consecutive new tokens of one sequence.
Grouped query heads ride in the tile's rows: row m is token m // rep_pad of the tile with query head
kv_head * n_rep + m % rep_pad (rep_pad: n_rep to a power of two, the extra rows masked), so each K/V
row is read once for all the query heads sharing it. Key positions are read BLOCK_N at a time, each
through the block table (block = table[pos // block_size]), so the cache's block size is free (the
tests' 4-token blocks included) and tl.dot always sees 16+ keys. A query at position p (the
sequence's cached prefix plus its index among the new tokens) attends keys 0..p: decodes, prefill
chunks with or without a cached prefix are one rule. The new tokens' K/V are in the cache already
(rope_and_cache_write runs first), so every key is read from it.
"""

from __future__ import annotations

import math
import os
import torch

try:  # the optional `cuda` extra: without it the kernel is not defined and the torch path serves
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# keys per inner iteration: tl.dot needs 16+ on every dimension (the GPU's MMA tiles)
BLOCK_N = 32
# new tokens per tile of a step with prefill chunks (a pure-decode step: 1, one tile per sequence)
PREFILL_TILE_TOKENS = 16
MIN_ROWS = 16  # tl.dot's smallest M


def triton_available() -> bool:
    """triton imports (the `cuda` extra; torch's CUDA wheels bring it too)."""
    return triton is not None


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """The kernel's dtypes (tl.dot has no float64) and head sizes (a power of two from 16: its
    tl.arange over the head's dims); others stay on torch's attention."""
    return dtype in (torch.float32, torch.bfloat16, torch.float16) and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def tile_map(new_tokens: list[int], tile_tokens: int) -> tuple[list[int], list[int]]:
    """(sequence, first new token) of each tile: every sequence's new tokens cut into runs of at
    most tile_tokens."""
    seqs: list[int] = []
    firsts: list[int] = []
    for i, count in enumerate(new_tokens):
        for first in range(0, count, tile_tokens):
            seqs.append(i)
            firsts.append(first)
    return seqs, firsts


def rows_per_tile(tile_tokens: int, n_rep: int) -> int:
    """The kernel's BLOCK_M: tile_tokens x n_rep (to a power of two) rows, at least MIN_ROWS."""
    return max(MIN_ROWS, tile_tokens * _pow2(n_rep))


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(n)))


def paged_attention(
    qkv: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, tile_seq: torch.Tensor, tile_first: torch.Tensor,
    tile_tokens: int, heads: int, kv_heads: int, head_dim: int, scale: float,
) -> None:  # fmt: skip
    """out[row, h * head_dim:(h + 1) * head_dim] = softmax(q k^T * scale) v over each row's sequence's
    keys 0..its position, for every new token (qkv's rows [tokens, (heads + 2 kv_heads) * head_dim]).
    k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim]; block_tables [seqs, max_blocks]
    int32; seq_lens [seqs], query_start_loc [seqs + 1] int32; tile_seq, tile_first [tiles] int32
    (tile_map). Launches one kernel and syncs nothing: a CUDA graph may capture it."""
    num_tiles = tile_seq.shape[0]
    if num_tiles == 0:
        return
    if qkv.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton kernel runs on CPU tensors only under its interpreter (TRITON_INTERPRET=1 before triton is imported)")
    n_rep = heads // kv_heads
    _paged_attention_kernel[(num_tiles, kv_heads)](
        qkv, out, k_cache, v_cache, block_tables, seq_lens, query_start_loc, tile_seq, tile_first,
        scale * math.log2(math.e), qkv.stride(0), out.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        N_REP=n_rep, HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1], REP_PAD=_pow2(n_rep), TILE_TOKENS=tile_tokens,
        BLOCK_M=rows_per_tile(tile_tokens, n_rep), BLOCK_N=BLOCK_N, BLOCK_D=_pow2(head_dim),
    )  # fmt: skip


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
        qkv_ptr, out_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, tile_seq_ptr,
        tile_first_ptr, scale_log2, qkv_row_stride, out_row_stride, k_block_stride, k_slot_stride, k_head_stride,
        v_block_stride, v_slot_stride, v_head_stride, table_stride,
        N_REP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, REP_PAD: tl.constexpr,
        TILE_TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq = tl.load(tile_seq_ptr + tile)
        first = tl.load(tile_first_ptr + tile)
        row_start = tl.load(query_start_ptr + seq)
        new_tokens = tl.load(query_start_ptr + seq + 1) - row_start
        prefix = tl.load(seq_lens_ptr + seq) - new_tokens  # cached keys before this step's tokens

        m = tl.arange(0, BLOCK_M)
        token = first + m // REP_PAD  # the row's new token within its sequence
        rep = m % REP_PAD
        row_ok = (rep < N_REP) & (m // REP_PAD < TILE_TOKENS) & (token < new_tokens)
        head = kv_head * N_REP + rep
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        flat_row = (row_start + token).to(tl.int64)
        q = tl.load(qkv_ptr + flat_row[:, None] * qkv_row_stride + head[:, None] * HEAD_DIM + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
        q_pos = prefix + token
        # keys [0, kv_end): up to the tile's last query's position
        kv_end = prefix + tl.minimum(first + TILE_TOKENS, new_tokens)

        # a finite floor, not -inf: a padding row sees no key, and exp2(-inf - -inf) would be NaN
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        n = tl.arange(0, BLOCK_N)
        for start in range(0, kv_end, BLOCK_N):
            pos = start + n
            key_ok = pos < kv_end
            block = tl.load(block_tables_ptr + seq * table_stride + pos // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
            slot = pos % PAGE_SIZE
            kv_mask = key_ok[:, None] & d_ok[None, :]
            k = tl.load(k_cache_ptr + (block * k_block_stride + slot * k_slot_stride + kv_head * k_head_stride)[:, None] + d[None, :],
                        mask=kv_mask, other=0.0)  # fmt: skip
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
            s = tl.where(key_ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + (block * v_block_stride + slot * v_slot_stride + kv_head * v_head_stride)[:, None] + d[None, :],
                        mask=kv_mask, other=0.0)  # fmt: skip
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new
        result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + flat_row[:, None] * out_row_stride + head[:, None] * HEAD_DIM + d[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])  # fmt: skip
