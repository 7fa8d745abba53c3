"""The seam between the model (engine/models/llama.py) and the hardware: the Backend and Linear contracts.

engine/models/llama.py is one forward in the shape of llama-models' reference; every operation whose
best implementation depends on the device and dtype goes through a Backend chosen once per model
(engine.backends.select_backend). A backend provides:

- prepare(weights, linears): run once at load, turns each linear's weight tensor into the form
  the backend multiplies with (quantized, packed, ...); the model never patches itself afterwards.
- linear(weight): the Linear module for one prepared weight, dispatched on the weight's type.
- add_rms_norm, rope_and_cache_write, attention (prefill chunks and paged decodes), silu_mul.
- compiled_decode_step(model), optional: a pure-decode step (one token of each of 1..max_rows
  sequences) through all blocks in one call, built once at load; None where the backend has none.
- lora_kernels(), optional: the C kernels that apply LoRA adapters in one call per adapted linear
  (engine/lora/layers.py); None where the backend has none (torch matmuls per run of rows).
- plan_step(inputs, ...): once per step, the StepPlan every reader of the step follows: the
  attention layout (AttentionMetadata, its `path` naming the kernel that attends it) and whether
  the compiled step runs the blocks. The model's forward, the compiled step and attention() read
  the plan; none of them chooses a path again. attention_metadata(inputs, ..., chunk_size) builds
  one layout (the plan's, and Llama 4's chunked one).

The Linear contract (what a quantized linear implements, see docs/backends.md): a module or
callable mapping x [..., in_features] -> y [..., out_features] in x's dtype, over this rank's
model-parallel shard only; collectives (all-reduce of row-parallel outputs, all-gather of the
output head) are applied around it by the backend (ParallelLinear), never inside it. The output
head is built by head_linear() instead: float32 logits whatever the model dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from engine.executor.step_inputs import StepInputs

if TYPE_CHECKING:
    from engine.kernels.cpu import CpuKernels

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V, each [num_blocks, block_size, n_local_kv_heads, head_dim]
Collective = Callable[[torch.Tensor], torch.Tensor]


@runtime_checkable
class Linear(Protocol):
    """y = x @ W^T over the local model-parallel shard: x [..., in_features] -> [..., out_features],
    in x's dtype. resident_bytes(): the memory its weights hold (packed copies included)."""

    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def resident_bytes(self) -> int: ...


class CompiledDecodeStep(Protocol):
    """step(h, meta, kv_caches): h [rows, dim] the tokens' embeddings (the residual stream, updated
    in place) -> the final norm's output [rows, dim], exactly as the per-op blocks compute it. Run
    only where the step's plan chose it (Backend.plan_step): every row one sequence's decode token,
    rows in 1..max_rows, attended on a paged path (meta.path)."""

    max_rows: int

    def __call__(self, h: torch.Tensor, meta: "AttentionMetadata", kv_caches: list[KVCache]) -> torch.Tensor: ...


@runtime_checkable
class PreparedWeight(Protocol):
    """A weight in a form other than a dense tensor (a quantized format, say): it names its Linear.
    Backends call make_linear(backend) for any prepared weight type they do not handle themselves,
    so a new format is a new class, never an edit to model.py or to an existing backend."""

    def make_linear(self, backend: "Backend") -> Linear: ...


@dataclass(frozen=True, slots=True)
class HeadLayout:
    """This rank's attention heads; qkv rows are [heads | kv_heads | kv_heads] x head_dim."""

    heads: int
    kv_heads: int
    head_dim: int

    @property
    def n_rep(self) -> int:
        return self.heads // self.kv_heads


@dataclass(frozen=True, slots=True)
class LinearNames:
    """Which state-dict entries are linear weights, for prepare(): the transformer's blocks (which
    a quantization applies to) and the output head (kept in the model dtype: fp8 "mixed")."""

    blocks: tuple[str, ...]
    head: str


# --------------------------------------------------------------------------- attention metadata
@dataclass(slots=True)
class PrefillChunk:
    rows: slice  # rows of the flat batch holding this sequence's new tokens
    block_ids: torch.Tensor  # [ceil(kv_len / block_size)] the sequence's blocks covering its K/V
    kv_len: int  # K/V length after this step (cached prefix + new tokens)
    mask: torch.Tensor | None  # [n_new, kv_len] bool, True = attend; None: no prefix, plain causal


class AttentionPath(Enum):
    """The kernel that attends a layout's batched sequences (AttentionMetadata.batched), chosen by
    the backend when it builds the layout; prefill chunks left in `prefills` go to torch's SDPA
    one at a time on every path."""

    GATHERED = "gathered"  # torch SDPA over the decodes' blocks gathered into one padded batch (GatheredDecodes)
    PAGED_DECODES = "paged decodes"  # paged_decode_attention: the decodes in place through their block tables (PagedDecodes)
    PAGED = "paged"  # one paged_attention call (PagedSequences): the decodes, or on AMX tiles every sequence
    PAGED_TILES = "paged tiles"  # CUDA: every sequence in one Triton kernel (PagedTiles), no prefills left for SDPA


@dataclass(slots=True)
class GatheredDecodes:
    """The decoding sequences as torch SDPA reads them: their blocks gathered into one padded batch."""

    rows: slice | torch.Tensor  # rows of the decode tokens (a slice when contiguous)
    block_ids: torch.Tensor  # [num_decodes * max_blocks] int64, the decode block tables flattened
    num_blocks: int  # max_blocks: blocks gathered per decoding sequence
    mask: torch.Tensor  # [num_decodes, 1, 1, max_blocks * block_size] bool, True = attend


@dataclass(slots=True)
class PagedDecodes:
    """The decoding sequences as paged_decode_attention reads them, in place through the tables."""

    rows: torch.Tensor  # [num_decodes] int64, flat-batch row of each decode token
    block_tables: torch.Tensor  # [num_decodes, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [num_decodes] int32, K/V length including this step's token


@dataclass(slots=True)
class PagedSequences:
    """Sequences as one paged_attention call reads them (each with its new tokens, causal over its
    cached prefix): the decodes, or every sequence of the step (prefill chunks included) where the
    kernel runs on AMX tiles."""

    row_start: torch.Tensor  # [sequences] int32, flat-batch row of each sequence's first new token
    new_tokens: torch.Tensor  # [sequences] int32, its new tokens (1 for a decode)
    seq_lens: torch.Tensor  # [sequences] int32, K/V length including this step's tokens
    block_tables: torch.Tensor  # [sequences, max_blocks] int32


@dataclass(slots=True)
class PagedTiles:
    """Every sequence of the step as engine/kernels/triton_attention.py reads them, in place through
    the block tables: each sequence's new tokens cut into tiles of at most tile_tokens (its tile_map)."""

    block_tables: torch.Tensor  # [sequences, max_blocks] int32
    seq_lens: torch.Tensor  # [sequences] int32, K/V length including this step's tokens
    query_start_loc: torch.Tensor  # [sequences + 1] int32, flat-batch row of each sequence's first new token
    tile_seq: torch.Tensor  # [tiles] int32, the sequence of each tile
    tile_first: torch.Tensor  # [tiles] int32, the tile's first new token within its sequence
    tile_tokens: int  # new tokens per tile at most (1: a pure-decode step, one tile per sequence)


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs about one step's batch, built once per step for all layers by
    the backend (Backend.attention_metadata). Prefill chunks in `prefills` are attended one at a
    time; `batched` sequences together, in the layout of the kernel `path` names."""

    path: AttentionPath
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token's K/V
    prefills: list[PrefillChunk]
    batched: GatheredDecodes | PagedDecodes | PagedSequences | PagedTiles | None  # None: no sequence attended together
    rope: torch.Tensor  # torch: [num_tokens, 1, head_dim // 2] complex rotations; kernels: the whole table

    @staticmethod
    def split(inputs: StepInputs, block_size: int, chunk_size: int | None = None) -> tuple[list[int], list[int], list[PrefillChunk], list[int]]:
        """(row starts, K/V lengths, prefill chunks, indices of the decoding sequences). With
        chunk_size (Llama 4's chunked local attention) a query at position p sees keys
        [p // chunk_size * chunk_size, p] only."""
        starts = inputs.query_start_loc.tolist()
        seq_lens = inputs.seq_lens.tolist()
        counts = [starts[i + 1] - starts[i] for i in range(len(seq_lens))]
        prefills = [
            _prefill_chunk(inputs, i, starts[i], n_new, seq_lens[i], block_size, chunk_size)
            for i, n_new in enumerate(counts)
            if n_new > 1
        ]
        return starts, seq_lens, prefills, [i for i, n_new in enumerate(counts) if n_new == 1]


def _prefill_chunk(inputs: StepInputs, i: int, start: int, n_new: int, kv_len: int, block_size: int, chunk_size: int | None = None) -> PrefillChunk:
    device = inputs.block_tables.device
    num_blocks = -(-kv_len // block_size)
    prefix = kv_len - n_new
    mask = None
    windowed = chunk_size is not None and kv_len > chunk_size  # else the window is plain causal
    if prefix > 0 or windowed:  # query j sits at position prefix + j and sees keys 0..prefix + j
        query_pos = torch.arange(prefix, kv_len, device=device)[:, None]
        key_pos = torch.arange(kv_len, device=device)[None, :]
        mask = key_pos <= query_pos
        if windowed:  # ... from the start of its own chunk only
            mask &= key_pos >= query_pos // chunk_size * chunk_size
    return PrefillChunk(slice(start, start + n_new), inputs.block_tables[i, :num_blocks].to(torch.int64), kv_len, mask)


@dataclass(slots=True)
class StepPlan:
    """How one step runs, decided once by the backend (Backend.plan_step): the model's forward runs
    the compiled step or its blocks by `compiled`, and every attention call (the compiled step's
    too) takes the kernel attention.path names."""

    attention: AttentionMetadata  # the step's attention layout (Llama 4's NoPE layers: the global one)
    compiled: bool  # the model's compiled decode step runs every block and the final norm in one call


# --------------------------------------------------------------------------- the backend
class ParallelLinear(nn.Module):
    """A local Linear with its model-parallel collective applied to the output (all-reduce for a
    row-parallel layer, all-gather for the output head)."""

    def __init__(self, local: Linear, collective: Collective) -> None:
        super().__init__()
        self.local = local
        self.in_features, self.out_features = local.in_features, local.out_features
        self._collective = collective

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._collective(self.local(x))

    def resident_bytes(self) -> int:
        return self.local.resident_bytes()


class Backend:
    """The operations engine/models/llama.py's forward runs, for one device and dtype. This base class
    holds what every backend shares (the load-time preparation of the weights, the linear
    dispatch); engine.backends.torch_ops is the reference implementation of the operations."""

    name = "base"

    def __init__(self, device: torch.device, dtype: torch.dtype, *, quantization: str | None = None, batch_invariant: bool = False) -> None:
        self.device = device
        self.dtype = dtype
        self.quantization = quantization
        # every row's result independent of the rest of the batch (EngineConfig.batch_invariant):
        # linears row by row in one fixed order, decode attention per sequence (docs/backends.md)
        self.batch_invariant = batch_invariant

    # ----------------------------------------------------------------- load time
    def prepare(self, weights: Mapping[str, torch.Tensor], linears: LinearNames) -> dict[str, Any]:
        """Once at load: each linear weight in the form linear() takes (quantized, then packed by
        the backend). Other entries (embeddings, norms) pass through as tensors."""
        from engine.quant.policy import quantize_weight

        out: dict[str, Any] = dict(weights)
        for name in linears.blocks:  # popped first: this dict holds no float copy once quantized
            out[name] = self.prepare_linear(quantize_weight(out.pop(name), self.quantization))
        out[linears.head] = self.prepare_head(out[linears.head])
        return out

    def prepare_head(self, weight: Any) -> Any:
        """The output head's weight in the form head_linear() takes (here: prepare_linear's)."""
        return self.prepare_linear(weight)

    def prepare_linear(self, weight: Any) -> Any:
        """One linear weight in this backend's preferred form (identity: a dense tensor)."""
        return weight

    def linear(self, weight: Any, collective: Collective | None = None) -> Linear:
        """The Linear for one prepared weight, by its type; wrapped with its collective if any."""
        local = self.dense_linear(weight) if isinstance(weight, torch.Tensor) else self.special_linear(weight)
        if self.batch_invariant and not getattr(local, "batch_invariant", False):  # a quantized linear, say
            local = RowByRow(local)
        return local if collective is None else ParallelLinear(local, collective)

    def dense_linear(self, weight: torch.Tensor) -> Linear:
        return RowwiseLinear(weight) if self.batch_invariant else DenseLinear(weight)

    def head_linear(self, weight: Any, collective: Collective | None = None) -> Linear:
        """The output head: float32 logits (float64 in a float64 model) whatever the model dtype,
        bfloat16 inputs and weights with float32 sums, as llama.cpp computes them; rounding the
        logits to bfloat16 ties tokens that differ and makes greedy depend on the rest of the batch.
        The vocab shards are gathered in float32 (the local outputs' dtype)."""
        if isinstance(weight, torch.Tensor):
            local: Linear = FloatHeadLinear(weight, rowwise=self.batch_invariant)
        elif self.dtype in (torch.float32, torch.float64):  # its output is float32 (float64) already
            local = self.linear(weight)
        else:  # a prepared or quantized head: its linear, widened (its own sums set the precision)
            local = FloatOutput(self.linear(weight))
        return local if collective is None else ParallelLinear(local, collective)

    def special_linear(self, weight: Any) -> Linear:
        """A prepared weight (not a dense tensor): a backend overrides this for the formats it has
        its own Linear for, then defers here, where the weight names its Linear."""
        if isinstance(weight, PreparedWeight):
            return weight.make_linear(self)
        raise TypeError(f"{self.name} backend: no linear for a weight of type {type(weight).__name__}")

    # ----------------------------------------------------------------- per step (see torch_ops)
    def plan_step(self, inputs: StepInputs, freqs_cis: torch.Tensor, cache: KVCache, compiled: CompiledDecodeStep | None) -> StepPlan:
        """The one decision of how this step runs, for a model whose compiled step (from
        compiled_decode_step) is `compiled`: here the attention layout, blocks op by op (this
        backend compiles no step)."""
        return StepPlan(self.attention_metadata(inputs, freqs_cis, cache), False)

    def attention_metadata(self, inputs: StepInputs, freqs_cis: torch.Tensor, cache: KVCache, chunk_size: int | None = None) -> AttentionMetadata:
        """One attention layout for the step, its path chosen here. chunk_size: chunked local
        attention (Llama 4's RoPE layers), each query's keys limited to its own chunk of
        chunk_size positions."""
        raise NotImplementedError

    def cache_write(self, qkv: torch.Tensor, heads: HeadLayout, cache: KVCache, meta: AttentionMetadata) -> None:
        """Each token's k and v (as they are in qkv, no rotation) written to its cache slot: for
        layers that rotate and normalise q and k themselves (Llama 4)."""
        rows = qkv.view(qkv.shape[0], heads.heads + 2 * heads.kv_heads, heads.head_dim)
        k_cache, v_cache = cache
        k_cache.view(-1, heads.kv_heads, heads.head_dim).index_copy_(0, meta.slot_mapping, rows[:, heads.heads : heads.heads + heads.kv_heads])
        v_cache.view(-1, heads.kv_heads, heads.head_dim).index_copy_(0, meta.slot_mapping, rows[:, heads.heads + heads.kv_heads :])

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, rms_norm(residual + delta) * weight); residual may be updated in place."""
        raise NotImplementedError

    def rope_and_cache_write(self, qkv: torch.Tensor, heads: HeadLayout, cache: KVCache, meta: AttentionMetadata) -> None:
        """Rotate qkv's q and k heads in place ([tokens, (heads + 2 kv_heads) * head_dim]) and write
        each token's k and v to its cache slot."""
        raise NotImplementedError

    def attention(self, qkv: torch.Tensor, heads: HeadLayout, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """[tokens, heads * head_dim]: each token's queries over its sequence's cached K/V (causal)."""
        raise NotImplementedError

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] silu(gate) * up, gate_up = [gate | up] [rows, 2 * hidden]."""
        raise NotImplementedError

    # ----------------------------------------------------------------- load time, optional
    def captures_decode_steps(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether a pure-decode step of a model in `dtype` with heads of head_dim runs without
        reading a device tensor on the host (no .tolist(), no shape from data), so a CUDA graph may
        capture it (engine/executor/cuda_graphs.py). False here: the torch layouts read the lengths."""
        return False

    def compiled_decode_step(self, model: nn.Module) -> CompiledDecodeStep | None:
        """A compiled pure-decode step (one token of each of 1..max_rows sequences) through all of
        `model`'s blocks and its final norm (engine.models.llama.Transformer, mp_size 1), built once
        at load; plan_step says which steps it runs. None (here): the model runs its blocks op by op."""
        return None

    def lora_kernels(self) -> "CpuKernels | None":
        """The kernels whose segmented_lora applies every adapter's runs of rows on an adapted linear
        in one call (engine/lora/layers.py); None (here): torch matmuls per run of rows."""
        return None


class DenseLinear(nn.Module):
    """y = x @ W^T with W as loaded (F.linear): the reference linear."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def resident_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear one row at a time: BLAS and oneDNN pick their kernel (and so the order of each dot
    product's sums) by the number of rows; one row per call is the same call alone or batched."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.cat([F.linear(rows[i : i + 1], weight) for i in range(rows.shape[0])]) if rows.shape[0] else F.linear(rows, weight)
    return out.view(*x.shape[:-1], weight.shape[0])


class RowwiseLinear(DenseLinear):
    """DenseLinear for the batch-invariant mode: each row in its own matmul (rowwise_linear)."""

    batch_invariant = True  # Backend.linear wraps no RowByRow around it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rowwise_linear(x, self.weight)


class FloatHeadLinear(nn.Module):
    """The output head in torch ops with float32 logits: a float32 or float64 weight as F.linear;
    a bfloat16 / float16 one multiplied in float32 a slab of CHUNK_ROWS vocab rows at a time,
    widened as it is read (the products of two bfloat16 values are exact in float32, the sums are
    float32), so no float32 copy of the whole head (vocab x dim) is ever resident."""

    CHUNK_ROWS = 4096  # [4096, 4096] float32: 64 MiB at most of scratch for an 8B model's head

    def __init__(self, weight: torch.Tensor, *, rowwise: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.out_features, self.in_features = weight.shape
        self.rowwise = rowwise  # batch-invariant mode: one row per matmul (RowwiseLinear's why)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype in (torch.float32, torch.float64):
            return rowwise_linear(x, self.weight) if self.rowwise else F.linear(x, self.weight)
        xf = x.float()
        out = torch.empty(*x.shape[:-1], self.out_features, dtype=torch.float32, device=x.device)
        for start in range(0, self.out_features, self.CHUNK_ROWS):
            slab = self.weight[start : start + self.CHUNK_ROWS].float()
            out[..., start : start + self.CHUNK_ROWS] = rowwise_linear(xf, slab) if self.rowwise else F.linear(xf, slab)
        return out

    def resident_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class RowByRow(nn.Module):
    """The batch-invariant mode's wrapper for a Linear whose kernel may depend on the row count (a
    quantized format's): one call per row, each the same call alone or batched. At one row it is the
    linear itself, so a compiled decode step may still call the linear's one-row form."""

    batch_invariant = True

    def __init__(self, local: Linear) -> None:
        super().__init__()
        self.local = local
        self.in_features, self.out_features = local.in_features, local.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= 1:
            return self.local(x)
        return torch.cat([self.local(rows[i : i + 1]) for i in range(rows.shape[0])]).view(*x.shape[:-1], self.out_features)

    def one_row_descriptor(self, dtype: torch.dtype):
        describe = getattr(self.local, "one_row_descriptor", None)
        return describe(dtype) if describe is not None else None

    def resident_bytes(self) -> int:
        return self.local.resident_bytes()


class FloatOutput(nn.Module):
    """A Linear whose output is widened to float32 (a quantized head: its kernel rounds to x's dtype)."""

    def __init__(self, local: Linear) -> None:
        super().__init__()
        self.local = local
        self.in_features, self.out_features = local.in_features, local.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        return y if y.dtype in (torch.float32, torch.float64) else y.float()

    def resident_bytes(self) -> int:
        return self.local.resident_bytes()
