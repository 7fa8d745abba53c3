"""Llama 2 / 3 / 3.1 / 3.2 / 3.3 text model in the llama3 reference shape, over a paged KV cache.

Same modules, parameter names and maths as llama-models' llama3 `model.py` (RMSNorm, RoPE with
Llama 3.1 frequency scaling, grouped-query attention, SwiGLU, fairscale model-parallel layers),
so a Meta checkpoint's state dict loads as is. What differs is the forward contract: one flat
batch of new tokens from many sequences (prefill chunks and single decode tokens mixed), each
token's K/V written to its slot in a paged cache and attention read back through each sequence's
block table. Attention metadata is built once per step and passed down explicitly.

Model parallel: fairscale keeps its model-parallel group in process-global state, so a process
holds at most one model with mp_size > 1 at a time (engine.workers owns that group's lifetime).
With mp_size == 1 the layers are plain nn.Linear / nn.Embedding with the same parameter names:
no process group needed, and no collective calls on the hot path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.checkpoint import ModelArgs
from engine.step_inputs import StepInputs

if TYPE_CHECKING:
    from engine.cpu_kernels import CpuKernels

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V, each [num_blocks, block_size, n_local_kv_heads, head_dim]


# --------------------------------------------------------------------------- model-parallel layers
def _fairscale():
    import fairscale.nn.model_parallel.initialize as fs_init
    from fairscale.nn.model_parallel import layers

    return fs_init, layers


def _check_group(mp_size: int) -> None:
    fs_init, _ = _fairscale()
    if not fs_init.model_parallel_is_initialized():
        raise RuntimeError(
            f"model_parallel_size {mp_size} needs fairscale's model-parallel group; build the model through "
            "engine.executor.ModelExecutor (or engine.workers) which creates it"
        )
    world = fs_init.get_model_parallel_world_size()
    if world != mp_size:
        raise RuntimeError(
            f"this process already holds a model-parallel group of size {world}; one model with "
            f"model_parallel_size > 1 per process (asked for {mp_size})"
        )


def column_parallel_linear(in_features: int, out_features: int, mp_size: int, *, gather_output: bool = False) -> nn.Module:
    """fairscale ColumnParallelLinear (output rows split over ranks), or nn.Linear at mp_size 1."""
    if mp_size == 1:
        return nn.Linear(in_features, out_features, bias=False)
    _check_group(mp_size)
    _, layers = _fairscale()
    layer = layers.ColumnParallelLinear.__new__(layers.ColumnParallelLinear)
    # fairscale's __init__ materialises the full master weight on CPU to initialise it; the model
    # is built on the meta device and loaded from a checkpoint, so set the attributes directly.
    nn.Module.__init__(layer)
    layer.in_features, layer.out_features, layer.gather_output = in_features, out_features, gather_output
    layer.output_size_per_partition = out_features // mp_size
    layer.weight = nn.Parameter(torch.empty(out_features // mp_size, in_features), requires_grad=False)
    layer.register_parameter("bias", None)
    layer.master_weight = None
    return layer


def row_parallel_linear(in_features: int, out_features: int, mp_size: int) -> nn.Module:
    """fairscale RowParallelLinear (input columns split, outputs all-reduced), or nn.Linear."""
    if mp_size == 1:
        return nn.Linear(in_features, out_features, bias=False)
    _check_group(mp_size)
    _, layers = _fairscale()
    layer = layers.RowParallelLinear.__new__(layers.RowParallelLinear)
    nn.Module.__init__(layer)
    layer.in_features, layer.out_features, layer.input_is_parallel = in_features, out_features, True
    layer.input_size_per_partition = in_features // mp_size
    layer.weight = nn.Parameter(torch.empty(out_features, in_features // mp_size), requires_grad=False)
    layer.register_parameter("bias", None)
    layer.master_weight = None
    return layer


def vocab_parallel_embedding(vocab_size: int, dim: int, mp_size: int) -> nn.Module:
    """fairscale VocabParallelEmbedding (vocab rows split, outputs all-reduced), or nn.Embedding."""
    if mp_size == 1:
        return nn.Embedding(vocab_size, dim)
    _check_group(mp_size)
    fs_init, layers = _fairscale()
    layer = layers.VocabParallelEmbedding.__new__(layers.VocabParallelEmbedding)
    nn.Module.__init__(layer)
    layer.num_embeddings, layer.embedding_dim = vocab_size, dim
    layer.padding_idx, layer.max_norm, layer.norm_type = None, None, 2.0
    layer.scale_grad_by_freq, layer.sparse, layer._weight = False, False, None
    rank = fs_init.get_model_parallel_rank()
    per_rank = vocab_size // mp_size
    layer.vocab_start_index, layer.vocab_end_index = rank * per_rank, (rank + 1) * per_rank
    layer.num_embeddings_per_partition = per_rank
    layer.weight = nn.Parameter(torch.empty(per_rank, dim), requires_grad=False)
    return layer


# --------------------------------------------------------------------------- pure helpers
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float32, torch.float64):  # fused kernel, same maths
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).type_as(x) * self.weight


def apply_scaling(freqs: torch.Tensor, scale_factor: float = 8.0) -> torch.Tensor:
    """Llama 3.1 long-context RoPE frequency scaling (values from Meta's grid search; scale_factor
    8 for Llama 3.1/3.3, 32 for Llama 3.2 1B/3B)."""
    low_freq_factor, high_freq_factor, old_context_len = 1, 4, 8192
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * torch.pi / freqs
    new_freqs = torch.where(wavelen > low_freq_wavelen, freqs / scale_factor, freqs)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, (1 - smooth) * new_freqs / scale_factor + smooth * new_freqs, new_freqs)


def precompute_freqs_cis(
    head_dim: int, end: int, theta: float, use_scaled: bool, *, scale_factor: float = 8.0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[end, head_dim // 2] complex rotations, position-major (the reference's table)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=dtype, device="cpu")[: head_dim // 2] / head_dim))
    if use_scaled:
        freqs = apply_scaling(freqs, scale_factor)
    angles = torch.outer(torch.arange(end, dtype=dtype, device="cpu"), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] rotated by freqs_cis [tokens, 1, head_dim // 2] (adjacent pairs)."""
    real = x.to(freqs_cis.real.dtype).reshape(*x.shape[:-1], -1, 2)
    return torch.view_as_real(torch.view_as_complex(real) * freqs_cis).flatten(-2).type_as(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[tokens, n_kv_heads, head_dim] -> [tokens, n_kv_heads * n_rep, head_dim], each KV head
    serving n_rep consecutive query heads (torch.repeat_interleave(x, n_rep, dim=1))."""
    if n_rep == 1:
        return x
    tokens, n_kv_heads, head_dim = x.shape
    return x[:, :, None, :].expand(tokens, n_kv_heads, n_rep, head_dim).reshape(tokens, n_kv_heads * n_rep, head_dim)


# --------------------------------------------------------------------------- attention metadata
@dataclass(slots=True)
class PrefillChunk:
    rows: slice  # rows of the flat batch holding this sequence's new tokens
    block_ids: torch.Tensor  # [ceil(kv_len / block_size)] the sequence's blocks covering its K/V
    kv_len: int  # K/V length after this step (cached prefix + new tokens)
    mask: torch.Tensor | None  # [n_new, kv_len] bool, True = attend; None: no prefix, plain causal


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs about the batch layout, built once per step for all layers.
    Sequences with one new token (decodes) are attended together in one padded batch; longer
    chunks (prefills) one at a time, since their query lengths differ."""

    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token's K/V
    decode_rows: slice | torch.Tensor | None  # rows of the decode tokens (a slice when contiguous)
    decode_block_ids: torch.Tensor | None  # [num_decodes * max_blocks] int64, the decode block tables flattened
    num_decode_blocks: int  # max_blocks: blocks gathered per decoding sequence
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool, True = attend
    prefills: list[PrefillChunk]
    paged: "PagedDecodes | None" = None  # the decodes as the fused CPU kernel reads them (instead of the above)

    @classmethod
    def build(cls, inputs: StepInputs, block_size: int, *, paged: bool = False) -> "AttentionMetadata":
        starts = inputs.query_start_loc.tolist()
        seq_lens = inputs.seq_lens.tolist()
        device = inputs.block_tables.device
        counts = [starts[i + 1] - starts[i] for i in range(len(seq_lens))]
        prefills = [
            _prefill_chunk(inputs, i, starts[i], n_new, seq_lens[i], block_size, device)
            for i, n_new in enumerate(counts)
            if n_new > 1
        ]
        decodes = [i for i, n_new in enumerate(counts) if n_new == 1]
        if not decodes:
            return cls(inputs.slot_mapping, None, None, 0, None, prefills)
        if paged:
            return cls(inputs.slot_mapping, None, None, 0, None, prefills, PagedDecodes.build(inputs, decodes, starts))
        return cls(inputs.slot_mapping, *_decode_group(inputs, decodes, starts, seq_lens, block_size), prefills)


@dataclass(slots=True)
class PagedDecodes:
    """The decoding sequences for engine.cpu_kernels.paged_decode_attention, read in place."""

    rows: torch.Tensor  # [num_decodes] int64, flat-batch row of each decode token
    block_tables: torch.Tensor  # [num_decodes, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [num_decodes] int32, K/V length including this step's token

    @classmethod
    def build(cls, inputs: StepInputs, decodes: list[int], starts: list[int]) -> "PagedDecodes":
        if len(decodes) == len(starts) - 1:  # every sequence decodes: the step's tensors as they are
            return cls(inputs.query_start_loc[:-1].to(torch.int64), inputs.block_tables.contiguous(), inputs.seq_lens.contiguous())
        index = torch.tensor(decodes, dtype=torch.int64)
        rows = torch.tensor([starts[i] for i in decodes], dtype=torch.int64)
        return cls(rows, inputs.block_tables[index].contiguous(), inputs.seq_lens[index].contiguous())


def _decode_group(inputs: StepInputs, decodes: list[int], starts: list[int], seq_lens: list[int], block_size: int):
    """(rows, flattened block ids, blocks per sequence, padding mask) of the single-token sequences."""
    device = inputs.block_tables.device
    lens = [seq_lens[i] for i in decodes]
    max_blocks = -(-max(lens) // block_size)
    tables = inputs.block_tables if len(decodes) == len(seq_lens) else inputs.block_tables[decodes]
    block_ids = tables[:, :max_blocks].reshape(-1).to(torch.int64)
    key_pos = torch.arange(max_blocks * block_size, device=device)
    mask = (key_pos[None, :] < torch.tensor(lens, device=device)[:, None])[:, None, None, :]
    rows = [starts[i] for i in decodes]
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    return (slice(rows[0], rows[0] + len(rows)) if contiguous else torch.tensor(rows, device=device)), block_ids, max_blocks, mask


def _prefill_chunk(inputs: StepInputs, i: int, start: int, n_new: int, kv_len: int, block_size: int, device) -> PrefillChunk:
    num_blocks = -(-kv_len // block_size)
    prefix = kv_len - n_new
    mask = None
    if prefix > 0:  # query j sits at position prefix + j and sees keys 0..prefix + j
        query_pos = torch.arange(prefix, kv_len, device=device)[:, None]
        mask = torch.arange(kv_len, device=device)[None, :] <= query_pos
    return PrefillChunk(slice(start, start + n_new), inputs.block_tables[i, :num_blocks].to(torch.int64), kv_len, mask)


@dataclass(slots=True)
class FusedStep:
    """Per-step constants of the fused CPU path, passed down to every layer."""

    kernels: "CpuKernels"
    threads: int  # OpenMP threads for the kernels' parallel loops (torch's setting)
    positions: torch.Tensor  # [num_tokens] int64
    rope: torch.Tensor  # [max_seq_len, head_dim // 2, 2] float32


def _check_indices(inputs: StepInputs, meta: AttentionMetadata, *, num_positions: int, num_blocks: int, block_size: int) -> None:
    """The C kernels index raw memory with positions, slots and block ids: an out-of-range value
    (a scheduler bug) must raise here, as torch's indexing would, not corrupt memory."""
    ranges = [(inputs.positions, num_positions, "position", torch.int64), (inputs.slot_mapping, num_blocks * block_size, "KV slot", torch.int64)]
    if meta.paged is not None:
        paged = meta.paged
        ranges += [
            (paged.block_tables, num_blocks, "KV block id", torch.int32),
            (paged.seq_lens - 1, paged.block_tables.shape[1] * block_size, "decode length - 1", torch.int32),
            (paged.rows, inputs.num_tokens, "decode row", torch.int64),
        ]  # fmt: skip
    for values, limit, what, dtype in ranges:
        if values.dtype != dtype or not values.is_contiguous():
            raise ValueError(f"{what}s must be a contiguous {dtype} tensor, got {values.dtype}")
        low, high = torch.aminmax(values)
        if low < 0 or high >= limit:
            raise ValueError(f"a {what} is outside [0, {limit}): {int(low)}..{int(high)}")


# --------------------------------------------------------------------------- the transformer
class Attention(nn.Module):
    def __init__(self, args: ModelArgs, mp_size: int) -> None:
        super().__init__()
        self.n_kv_heads = args.kv_heads
        self.n_local_heads = args.n_heads // mp_size
        self.n_local_kv_heads = max(1, self.n_kv_heads // mp_size)  # past n_kv_heads ranks repeat heads
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = args.head_dim
        self.wq = column_parallel_linear(args.dim, args.n_heads * self.head_dim, mp_size)
        self.wk = column_parallel_linear(args.dim, self.n_local_kv_heads * mp_size * self.head_dim, mp_size)
        self.wv = column_parallel_linear(args.dim, self.n_local_kv_heads * mp_size * self.head_dim, mp_size)
        self.wo = row_parallel_linear(args.n_heads * self.head_dim, args.dim, mp_size)
        # wq|wk|wv fused into one linear at load time (engine.quantization.pack_for_cpu): one weight
        # read and one kernel call instead of three; wq/wk/wv are then None.
        self.wqkv: nn.Module | None = None

    def _qkv(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [tokens, heads, head_dim] and k rotated, and v [tokens, kv_heads, head_dim]."""
        num_tokens, heads, kv_heads = x.shape[0], self.n_local_heads, self.n_local_kv_heads
        if self.wqkv is None:
            q = apply_rotary_emb(self.wq(x).view(num_tokens, heads, self.head_dim), freqs_cis)
            k = apply_rotary_emb(self.wk(x).view(num_tokens, kv_heads, self.head_dim), freqs_cis)
            return q, k, self.wv(x).view(num_tokens, kv_heads, self.head_dim)
        qkv = self.wqkv(x).view(num_tokens, heads + 2 * kv_heads, self.head_dim)
        qk = apply_rotary_emb(qkv[:, : heads + kv_heads], freqs_cis)  # q and k rotated in one pass
        return qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self._qkv(x, freqs_cis)
        k_cache, v_cache = cache
        k_cache.view(-1, self.n_local_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, self.n_local_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)
        if not meta.prefills and isinstance(meta.decode_rows, slice):  # all decodes (then rows 0..n): no scatter
            return self.wo(self._decode(q, k_cache, v_cache, meta).view(num_tokens, -1))
        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self._decode(q[meta.decode_rows], k_cache, v_cache, meta)
        for chunk in meta.prefills:
            out[chunk.rows] = self._prefill(q[chunk.rows], k[chunk.rows], v[chunk.rows], k_cache, v_cache, chunk)
        return self.wo(out.view(num_tokens, -1))

    def forward_fused(self, x: torch.Tensor, cache: KVCache, meta: AttentionMetadata, step: "FusedStep") -> torch.Tensor:
        """forward() through engine.cpu_kernels: RoPE and the cache write in one call, decodes
        attended in place through their block tables; prefill chunks still go through SDPA."""
        num_tokens, heads, kv_heads = x.shape[0], self.n_local_heads, self.n_local_kv_heads
        qkv = self.wqkv(x)
        k_cache, v_cache = cache
        kernels, threads = step.kernels, step.threads
        kernels.rope_and_cache_write(qkv, heads, kv_heads, self.head_dim, step.positions, step.rope, meta.slot_mapping, k_cache, v_cache, threads)
        out = torch.empty(num_tokens, heads * self.head_dim, dtype=x.dtype)
        if meta.paged is not None:
            paged = meta.paged
            kernels.paged_decode_attention(
                qkv, out, paged.rows, k_cache, v_cache, paged.block_tables, paged.seq_lens, heads, kv_heads,
                self.head_dim**-0.5, threads,
            )  # fmt: skip
        if meta.prefills:
            q, k, v = qkv.view(num_tokens, heads + 2 * kv_heads, self.head_dim).split((heads, kv_heads, kv_heads), dim=1)
            out_heads = out.view(num_tokens, heads, self.head_dim)
            for chunk in meta.prefills:
                out_heads[chunk.rows] = self._prefill(q[chunk.rows], k[chunk.rows], v[chunk.rows], k_cache, v_cache, chunk)
        return self.wo(out)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One query per sequence. Grouped query heads ride in SDPA's query-length dim (the n_rep
        heads sharing a KV head are n_rep queries against it), so K/V are never repeated."""
        batch = q.shape[0]
        shape = (batch, meta.num_decode_blocks * k_cache.shape[1], self.n_local_kv_heads, self.head_dim)
        # index_select copies whole blocks; advanced indexing is ~8x slower on CPU here
        keys = k_cache.index_select(0, meta.decode_block_ids).view(shape).transpose(1, 2)
        values = v_cache.index_select(0, meta.decode_block_ids).view(shape).transpose(1, 2)
        queries = q.view(batch, self.n_local_kv_heads, self.n_rep, self.head_dim)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.decode_mask)
        return out.reshape(batch, self.n_local_heads, self.head_dim)

    def _prefill(self, q, k, v, k_cache, v_cache, chunk: PrefillChunk) -> torch.Tensor:
        if chunk.mask is None:  # no cached prefix: the new tokens are the whole K/V
            keys, values = k, v
        else:
            shape = (-1, self.n_local_kv_heads, self.head_dim)
            keys = k_cache.index_select(0, chunk.block_ids).view(shape)[: chunk.kv_len]
            values = v_cache.index_select(0, chunk.block_ids).view(shape)[: chunk.kv_len]
        # K/V heads repeated explicitly (the reference's repeat_kv): SDPA's enable_gqa drops to the
        # slow math kernel on CPU, and the copy is small next to a prefill's attention.
        # 4-D inputs: the CPU flash kernel takes [batch, heads, tokens, head_dim] only.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], repeat_kv(keys, self.n_rep).transpose(0, 1)[None],
            repeat_kv(values, self.n_rep).transpose(0, 1)[None],
            attn_mask=chunk.mask, is_causal=chunk.mask is None,
        )  # fmt: skip
        return out[0].transpose(0, 1)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs, mp_size: int) -> None:
        super().__init__()
        hidden = args.ffn_hidden_dim
        self.w1 = column_parallel_linear(args.dim, hidden, mp_size)
        self.w2 = row_parallel_linear(hidden, args.dim, mp_size)
        self.w3 = column_parallel_linear(args.dim, hidden, mp_size)
        self.w13: nn.Module | None = None  # w1|w3 fused at load time (see Attention.wqkv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w13 is None:
            return self.w2(F.silu(self.w1(x)).mul_(self.w3(x)))
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate).mul_(up))

    def forward_fused(self, x: torch.Tensor, step: "FusedStep") -> torch.Tensor:
        gate_up = self.w13(x)
        hidden = torch.empty(x.shape[0], gate_up.shape[1] // 2, dtype=x.dtype)
        step.kernels.silu_mul(gate_up, hidden, step.threads)
        return self.w2(hidden)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs, mp_size: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args, mp_size)
        self.feed_forward = FeedForward(args, mp_size)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, cache, meta)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Build it under `torch.device("meta")`, then load_state_dict(assign=True) and init_rope()."""

    def __init__(self, args: ModelArgs, *, mp_size: int = 1, max_seq_len: int) -> None:
        super().__init__()
        self.params = args
        self.mp_size = mp_size
        self.max_seq_len = max_seq_len
        self.vocab_size = args.vocab_size
        self.tok_embeddings = vocab_parallel_embedding(args.vocab_size, args.dim, mp_size)
        self.layers = nn.ModuleList(TransformerBlock(i, args, mp_size) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        if not args.tie_word_embeddings:
            self.output = column_parallel_linear(args.dim, args.vocab_size, mp_size, gather_output=True)
        self.freqs_cis: torch.Tensor | None = None
        # the tied output head in a faster layout than the embedding's (pack_for_cpu); same values
        self.tied_head: nn.Module | None = None
        self.cpu_kernels: CpuKernels | None = None  # use_cpu_kernels()
        self.rope_table: torch.Tensor | None = None  # freqs_cis as [max_seq_len, head_dim // 2, 2] (cos, sin)

    def init_rope(self, device: torch.device, dtype: torch.dtype) -> None:
        """The RoPE table, in float64 when the model runs in float64, else float32 (as Meta does)."""
        real = torch.float64 if dtype == torch.float64 else torch.float32
        args = self.params
        table = precompute_freqs_cis(
            args.head_dim, self.max_seq_len, args.rope_theta, args.use_scaled_rope,
            scale_factor=args.rope_scaling_factor or 8.0, dtype=real,
        )  # fmt: skip
        self.freqs_cis = table.to(device)

    def use_cpu_kernels(self, kernels: "CpuKernels | None") -> bool:
        """Run forward() through the fused CPU kernels from now on, where this model can: float32
        or bfloat16 weights on CPU with wq|wk|wv and w1|w3 fused (engine.quantization.pack_for_cpu)."""
        from engine.cpu_kernels import supports

        dtype = self.norm.weight.dtype
        eligible = (
            kernels is not None and supports(dtype) and self.norm.weight.device.type == "cpu"
            and self.freqs_cis is not None and self.freqs_cis.dtype == torch.complex64
            and all(layer.attention.wqkv is not None and layer.feed_forward.w13 is not None for layer in self.layers)
        )  # fmt: skip
        self.cpu_kernels = kernels if eligible else None
        self.rope_table = torch.view_as_real(self.freqs_cis) if eligible else None
        return eligible

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, kv_caches: list[KVCache]) -> torch.Tensor:
        """[num_logits, vocab_size] float32 logits for inputs.logits_indices rows."""
        if self.cpu_kernels is not None:
            return self._forward_fused(inputs, kv_caches, self.cpu_kernels)
        meta = AttentionMetadata.build(inputs, block_size=kv_caches[0][0].shape[1])
        freqs_cis = self.freqs_cis.index_select(0, inputs.positions).unsqueeze(1)
        h = self.tok_embeddings(inputs.input_ids)
        for layer, cache in zip(self.layers, kv_caches):
            h = layer(h, freqs_cis, cache, meta)
        return self.logits(h.index_select(0, inputs.logits_indices))

    def _forward_fused(self, inputs: StepInputs, kv_caches: list[KVCache], kernels: "CpuKernels") -> torch.Tensor:
        """forward() with each norm fused into the residual add before it: the residual stream h
        is updated in place and x always holds the next sublayer's normalised input."""
        k_cache = kv_caches[0][0]
        meta = AttentionMetadata.build(inputs, block_size=k_cache.shape[1], paged=True)
        _check_indices(inputs, meta, num_positions=self.rope_table.shape[0], num_blocks=k_cache.shape[0], block_size=k_cache.shape[1])
        step = FusedStep(kernels, torch.get_num_threads(), inputs.positions, self.rope_table)
        h = self.tok_embeddings(inputs.input_ids)
        x = torch.empty_like(h)
        norms = [layer.attention_norm for layer in self.layers] + [self.norm]
        kernels.add_rms_norm(h, None, norms[0].weight, x, norms[0].eps, step.threads)
        for layer, cache, next_norm in zip(self.layers, kv_caches, norms[1:]):
            kernels.add_rms_norm(h, layer.attention.forward_fused(x, cache, meta, step), layer.ffn_norm.weight, x, layer.ffn_norm.eps, step.threads)
            kernels.add_rms_norm(h, layer.feed_forward.forward_fused(x, step), next_norm.weight, x, next_norm.eps, step.threads)
        return self._project(x.index_select(0, inputs.logits_indices))  # x: h through the final norm

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self._project(self.norm(h))

    def _project(self, h: torch.Tensor) -> torch.Tensor:
        """The output head over already-normalised rows."""
        if self.params.tie_word_embeddings:
            return self._tied_logits(h)
        return self.output(h).float()

    def _tied_logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.tied_head is not None:
            return self.tied_head(h).float()
        weight = self.tok_embeddings.weight  # this rank's vocab rows
        logits = F.linear(h, weight)
        if self.mp_size > 1:
            from fairscale.nn.model_parallel.mappings import gather_from_model_parallel_region

            logits = gather_from_model_parallel_region(logits)
        return logits.float()


def kv_cache_shape(args: ModelArgs, mp_size: int, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    """Per layer, for K and for V: [num_blocks, block_size, n_local_kv_heads, head_dim]."""
    return (num_blocks, block_size, max(1, args.kv_heads // mp_size), args.head_dim)


def kv_cache_bytes_per_block(args: ModelArgs, mp_size: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, K and V, on one rank."""
    per_layer = math.prod(kv_cache_shape(args, mp_size, 1, block_size)) * torch.empty((), dtype=dtype).element_size()
    return 2 * args.n_layers * per_layer


def allocate_kv_caches(
    args: ModelArgs, mp_size: int, num_blocks: int, block_size: int, *, dtype: torch.dtype, device: torch.device
) -> list[KVCache]:
    shape = kv_cache_shape(args, mp_size, num_blocks, block_size)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(args.n_layers)
    ]
