"""The reference backend: every operation in plain torch ops, on any device and dtype.

Decodes are gathered into one padded batch for SDPA; prefill chunks go one at a time. This is
the path float64 (the exactness tests), CUDA and CPUs without the faster kernels run, and what
the other backends are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.backends.base import AttentionMetadata, AttentionPath, Backend, GatheredDecodes, HeadLayout, KVCache, PrefillChunk
from engine.models.llama import apply_rotary_emb, repeat_kv, rms_norm
from engine.executor.step_inputs import StepInputs


def split_heads(qkv: torch.Tensor, heads: HeadLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views q [tokens, heads, head_dim], k and v [tokens, kv_heads, head_dim] of a fused qkv."""
    rows = qkv.view(qkv.shape[0], heads.heads + 2 * heads.kv_heads, heads.head_dim)
    return rows.split((heads.heads, heads.kv_heads, heads.kv_heads), dim=1)


def prefill_attention(q, k, v, cache: KVCache, chunk: PrefillChunk, heads: HeadLayout) -> torch.Tensor:
    """One sequence's new tokens over its cached prefix and themselves: [n_new, heads, head_dim]."""
    if chunk.mask is None:  # no cached prefix: the new tokens are the whole K/V
        keys, values = k, v
    else:
        k_cache, v_cache = cache
        shape = (-1, heads.kv_heads, heads.head_dim)
        keys = k_cache.index_select(0, chunk.block_ids).view(shape)[: chunk.kv_len]
        values = v_cache.index_select(0, chunk.block_ids).view(shape)[: chunk.kv_len]
    # K/V heads repeated explicitly (the reference's repeat_kv): SDPA's enable_gqa drops to the
    # slow math kernel on CPU, and the copy is small next to a prefill's attention.
    # 4-D inputs: the CPU flash kernel takes [batch, heads, tokens, head_dim] only.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], repeat_kv(keys, heads.n_rep).transpose(0, 1)[None],
        repeat_kv(values, heads.n_rep).transpose(0, 1)[None],
        attn_mask=chunk.mask, is_causal=chunk.mask is None,
    )  # fmt: skip
    return out[0].transpose(0, 1)


class TorchBackend(Backend):
    name = "torch"

    def attention_metadata(self, inputs: StepInputs, freqs_cis: torch.Tensor, cache: KVCache, chunk_size: int | None = None) -> AttentionMetadata:
        block_size = cache[0].shape[1]
        starts, seq_lens, prefills, decodes = AttentionMetadata.split(inputs, block_size, chunk_size)
        rope = freqs_cis.index_select(0, inputs.positions).unsqueeze(1)
        if self.batch_invariant:  # each decode gathered alone: no padding to the batch's longest sequence
            prefills += [_decode_as_chunk(inputs, i, starts[i], seq_lens[i], block_size, chunk_size) for i in decodes]
            decodes = []
        gathered = _gathered_decodes(inputs, decodes, starts, seq_lens, block_size, chunk_size) if decodes else None
        return AttentionMetadata(AttentionPath.GATHERED, inputs.positions, inputs.slot_mapping, prefills, gathered, rope)

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is not None:
            residual = residual + delta
        return residual, rms_norm(residual, weight, eps)

    def rope_and_cache_write(self, qkv: torch.Tensor, heads: HeadLayout, cache: KVCache, meta: AttentionMetadata) -> None:
        rows = qkv.view(qkv.shape[0], heads.heads + 2 * heads.kv_heads, heads.head_dim)
        qk = rows[:, : heads.heads + heads.kv_heads]
        qk.copy_(apply_rotary_emb(qk, meta.rope))  # q and k rotated in one pass
        _, k, v = split_heads(qkv, heads)
        k_cache, v_cache = cache
        k_cache.view(-1, heads.kv_heads, heads.head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, heads.kv_heads, heads.head_dim).index_copy_(0, meta.slot_mapping, v)

    def attention(self, qkv: torch.Tensor, heads: HeadLayout, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = qkv.shape[0]
        q, k, v = split_heads(qkv, heads)
        decodes = meta.batched  # GatheredDecodes: this backend's only path
        if decodes is not None and not meta.prefills and isinstance(decodes.rows, slice):  # all decodes (then rows 0..n): no scatter
            return _decode_attention(q, cache, decodes, heads).view(num_tokens, -1)
        out = torch.empty_like(q)
        if decodes is not None:
            out[decodes.rows] = _decode_attention(q[decodes.rows], cache, decodes, heads)
        for chunk in meta.prefills:
            out[chunk.rows] = prefill_attention(q[chunk.rows], k[chunk.rows], v[chunk.rows], cache, chunk, heads)
        return out.view(num_tokens, -1)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)


def _decode_attention(q: torch.Tensor, cache: KVCache, decodes: GatheredDecodes, heads: HeadLayout) -> torch.Tensor:
    """One query per sequence. Grouped query heads ride in SDPA's query-length dim (the n_rep
    heads sharing a KV head are n_rep queries against it), so K/V are never repeated."""
    k_cache, v_cache = cache
    batch = q.shape[0]
    shape = (batch, decodes.num_blocks * k_cache.shape[1], heads.kv_heads, heads.head_dim)
    # index_select copies whole blocks; advanced indexing is much slower on CPU (bench/NOTES.md)
    keys = k_cache.index_select(0, decodes.block_ids).view(shape).transpose(1, 2)
    values = v_cache.index_select(0, decodes.block_ids).view(shape).transpose(1, 2)
    queries = q.view(batch, heads.kv_heads, heads.n_rep, heads.head_dim)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=decodes.mask)
    return out.reshape(batch, heads.heads, heads.head_dim)


def _gathered_decodes(
    inputs: StepInputs, decodes: list[int], starts: list[int], seq_lens: list[int], block_size: int, chunk_size: int | None = None
) -> GatheredDecodes:  # fmt: skip
    device = inputs.block_tables.device
    lens = [seq_lens[i] for i in decodes]
    max_blocks = -(-max(lens) // block_size)
    tables = inputs.block_tables if len(decodes) == len(seq_lens) else inputs.block_tables[decodes]
    block_ids = tables[:, :max_blocks].reshape(-1).to(torch.int64)
    key_pos = torch.arange(max_blocks * block_size, device=device)
    lens_t = torch.tensor(lens, device=device)[:, None]
    mask = key_pos[None, :] < lens_t
    if chunk_size is not None:  # the decode token at position len - 1 sees its own chunk only
        mask &= key_pos[None, :] >= (lens_t - 1) // chunk_size * chunk_size
    mask = mask[:, None, None, :]
    rows = [starts[i] for i in decodes]
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    rows_index = slice(rows[0], rows[0] + len(rows)) if contiguous else torch.tensor(rows, device=device)
    return GatheredDecodes(rows_index, block_ids, max_blocks, mask)


def _decode_as_chunk(inputs: StepInputs, i: int, start: int, kv_len: int, block_size: int, chunk_size: int | None) -> PrefillChunk:
    """Sequence i's decode token as a one-token chunk over its own cached keys only: its attention
    then reads exactly its kv_len keys, whatever the longest sequence of the batch (the gathered
    decodes are padded and masked to that one's length, which changes SDPA's sums)."""
    key_pos = torch.arange(kv_len, device=inputs.block_tables.device)[None, :]
    mask = key_pos >= (kv_len - 1) // chunk_size * chunk_size if chunk_size is not None else torch.ones_like(key_pos, dtype=torch.bool)
    block_ids = inputs.block_tables[i, : -(-kv_len // block_size)].to(torch.int64)
    return PrefillChunk(slice(start, start + 1), block_ids, kv_len, mask)
