"""Llama 2 / 3 / 3.1 / 3.2 / 3.3 text model in the llama3 reference shape, over a paged KV cache.

Same modules, parameter names and maths as llama-models' llama3 `model.py` (RMSNorm, RoPE with
Llama 3.1 frequency scaling, grouped-query attention, SwiGLU, fairscale-style model parallelism),
so a Meta checkpoint's state dict loads as is. What differs:

- the forward contract: one flat batch of new tokens from many sequences (prefill chunks and
  single decode tokens mixed), each token's K/V written to its slot in a paged cache and
  attention read back through each sequence's block table. The backend plans each step once
  (Backend.plan_step: the attention layout and its kernel, or the compiled decode step) and the
  plan is passed down explicitly.
- every operation whose fastest form depends on the hardware (linears, add + RMSNorm, RoPE + cache
  write, attention, SiLU-mul) goes through a Backend chosen once per model (engine/backends/;
  docs/backends.md). A new backend or quantized linear is a new file there, never an `if` here.
- each residual add is fused into the RMSNorm that reads it (the reference's `h = x + f(norm(x))`
  computes the same values): a block returns the residual stream and its last sublayer's output.
- the model is built from weights prepared once at load (Transformer.from_state_dict): q|k|v and
  w1|w3 concatenated into one linear each, then quantized / packed by the backend.

Model parallel: fairscale keeps its model-parallel group in process-global state, so a process
holds at most one model with mp_size > 1 at a time (engine.executor.parallel owns that group's lifetime).
With mp_size == 1 there are no collectives on the hot path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from engine.backends.base import (
    AttentionMetadata, Backend, FloatOutput, HeadLayout, KVCache, LinearNames, ParallelLinear, RowByRow, StepPlan,
)  # fmt: skip
from engine.executor.step_inputs import StepInputs
from engine.kernels.memory import huge_page_zeros
from engine.models.args import ModelArgs
from engine.models.weights import PreparedWeights
from engine.quant.formats import QuantizedWeight, cat_rows
from engine.quant.linear import embedding

__all__ = ["KVCache", "Transformer", "allocate_kv_caches", "kv_cache_bytes_per_block", "kv_cache_shape"]


# --------------------------------------------------------------------------- model-parallel collectives
def _check_group(mp_size: int) -> None:
    import fairscale.nn.model_parallel.initialize as fs_init

    if not fs_init.model_parallel_is_initialized():
        raise RuntimeError(
            f"model_parallel_size {mp_size} needs fairscale's model-parallel group; build the model through "
            "engine.executor.worker_group.WorkerGroup (or engine.executor.parallel) which creates it"
        )
    world = fs_init.get_model_parallel_world_size()
    if world != mp_size:
        raise RuntimeError(
            f"this process already holds a model-parallel group of size {world}; one model with "
            f"model_parallel_size > 1 per process (asked for {mp_size})"
        )


class Collectives:
    """fairscale's mappings for this rank: all-reduce (row-parallel outputs, the embedding) and
    all-gather (the output head's vocab shards); None at mp_size 1."""

    def __init__(self, mp_size: int) -> None:
        self.mp_size = mp_size
        self.rank = 0
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.gather: Callable[[torch.Tensor], torch.Tensor] | None = None
        if mp_size > 1:
            _check_group(mp_size)
            import fairscale.nn.model_parallel.initialize as fs_init
            from fairscale.nn.model_parallel import mappings

            self.rank = fs_init.get_model_parallel_rank()
            self.reduce = mappings.reduce_from_model_parallel_region
            self.gather = mappings.gather_from_model_parallel_region


class _DirectCall(nn.Module):
    """A module whose call goes straight to forward (an instance's own forward, if set, included):
    nn.Module.__call__'s hook bookkeeping costs ~1-2 us a call, and the per-op path calls these
    modules 5 times a layer every step. None of them carries hooks."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


class VocabParallelEmbedding(_DirectCall):
    """fairscale's VocabParallelEmbedding over this rank's vocab rows (nn.Embedding at mp_size 1)."""

    def __init__(self, weight: torch.Tensor | QuantizedWeight, mp: Collectives, dtype: torch.dtype) -> None:
        super().__init__()
        self.lookup = embedding(weight, dtype)  # nn.Embedding; QuantEmbedding for a quantized table
        self.num_local = weight.shape[0]
        self.vocab_start_index = mp.rank * self.num_local
        self._reduce = mp.reduce

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self._reduce is None:
            return self.lookup(ids)
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_start_index + self.num_local)
        local = (ids - self.vocab_start_index).masked_fill_(outside, 0)
        return self._reduce(self.lookup(local).masked_fill_(outside[:, None], 0.0))


# --------------------------------------------------------------------------- pure helpers
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype in (torch.float32, torch.float64):  # fused kernel, same maths
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).type_as(x) * weight


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


# --------------------------------------------------------------------------- loading
# Column-parallel linears reading the same input, concatenated at load into one linear: one weight
# read and one matmul instead of three (two). Exact: each output is the same dot product.
FUSED_LINEARS = {"attention.wqkv": ("attention.wq", "attention.wk", "attention.wv"), "feed_forward.w13": ("feed_forward.w1", "feed_forward.w3")}


def fuse_linears(state: Mapping[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """The state dict with each block's wq|wk|wv and w1|w3 rows concatenated (this rank's rows:
    q heads, then k, then v; gate, then up)."""
    out = dict(state)
    for i in range(n_layers):
        for fused, parts in FUSED_LINEARS.items():
            names = [f"layers.{i}.{part}.weight" for part in parts]
            if all(name in out for name in names):
                out[f"layers.{i}.{fused}.weight"] = cat_rows([out.pop(name) for name in names])
    return out


def linear_names(n_layers: int) -> LinearNames:
    per_block = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")
    return LinearNames(tuple(f"layers.{i}.{name}.weight" for i in range(n_layers) for name in per_block), "output.weight")


# --------------------------------------------------------------------------- the transformer
class RMSNorm(_DirectCall):
    """forward(residual, delta): (residual + delta, rms_norm(residual + delta)), through the backend."""

    def __init__(self, weight: torch.Tensor, eps: float, backend: Backend) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.backend = backend

    def forward(self, residual: torch.Tensor, delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.backend.add_rms_norm(residual, delta, self.weight, self.eps)


class Attention(_DirectCall):
    def __init__(self, args: ModelArgs, weights: PreparedWeights, prefix: str, backend: Backend, mp: Collectives) -> None:
        super().__init__()
        n_local_heads = args.n_heads // mp.mp_size
        n_local_kv_heads = max(1, args.kv_heads // mp.mp_size)  # past n_kv_heads ranks repeat heads
        self.heads = HeadLayout(n_local_heads, n_local_kv_heads, args.head_dim)
        self.wqkv = backend.linear(weights.take(prefix + "wqkv.weight"))  # column-parallel: wq|wk|wv
        self.wo = backend.linear(weights.take(prefix + "wo.weight"), mp.reduce)  # row-parallel
        self.backend = backend

    def forward(self, x: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.wqkv(x)  # [tokens, (heads + 2 kv_heads) * head_dim]
        self.backend.rope_and_cache_write(qkv, self.heads, cache, meta)  # q, k rotated; k, v to their slots
        return self.wo(self.backend.attention(qkv, self.heads, cache, meta))


class FeedForward(_DirectCall):
    def __init__(self, weights: PreparedWeights, prefix: str, backend: Backend, mp: Collectives) -> None:
        super().__init__()
        self.w13 = backend.linear(weights.take(prefix + "w13.weight"))  # column-parallel: w1|w3
        self.w2 = backend.linear(weights.take(prefix + "w2.weight"), mp.reduce)  # row-parallel
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.backend.silu_mul(self.w13(x)))  # w2(silu(w1(x)) * w3(x))


class TransformerBlock(_DirectCall):
    def __init__(self, layer_id: int, args: ModelArgs, weights: PreparedWeights, backend: Backend, mp: Collectives) -> None:
        super().__init__()
        prefix = f"layers.{layer_id}."
        self.layer_id = layer_id
        self.attention = Attention(args, weights, prefix + "attention.", backend, mp)
        self.feed_forward = FeedForward(weights, prefix + "feed_forward.", backend, mp)
        self.attention_norm = RMSNorm(weights.take(prefix + "attention_norm.weight"), args.norm_eps, backend)
        self.ffn_norm = RMSNorm(weights.take(prefix + "ffn_norm.weight"), args.norm_eps, backend)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's h = x + attention(attention_norm(x)); out = h + feed_forward(ffn_norm(h)),
        with the previous block's output `delta` added into x by the first norm, and the feed-forward
        output returned unadded: (h, feed_forward output)."""
        x, normed = self.attention_norm(x, delta)
        h, normed = self.ffn_norm(x, self.attention(normed, cache, meta))
        return h, self.feed_forward(normed)


class Transformer(nn.Module):
    """Build it with Transformer.from_state_dict (the loading path, weights prepared once).

    Another architecture on the same skeleton (engine/models/llama4/) overrides `block`,
    `_rope_table`, `_prepare_weights`, `_linear_names` and `step_data` (what its blocks read
    about a step); the forward is this one."""

    block: type[nn.Module] = TransformerBlock

    def __init__(self, args: ModelArgs, weights: PreparedWeights, backend: Backend, *, mp_size: int, max_seq_len: int) -> None:
        super().__init__()
        mp = Collectives(mp_size)
        self.params = args
        self.mp_size = mp_size
        self.max_seq_len = max_seq_len
        self.vocab_size = args.vocab_size
        self.backend = backend
        self.tok_embeddings = VocabParallelEmbedding(weights.take("tok_embeddings.weight"), mp, backend.dtype)
        self.layers = nn.ModuleList(self.block(i, args, weights, backend, mp) for i in range(args.n_layers))
        self.norm = RMSNorm(weights.take("norm.weight"), args.norm_eps, backend)
        self.output = backend.head_linear(weights.take("output.weight"), mp.gather)  # column-parallel, gathered, float32 logits
        weights.check_all_taken()
        # a decode step compiled by the backend (all blocks and the final norm in one call, for the
        # pure-decode steps its plan gives it), or None: forward's per-op loop only. Built for this
        # class's blocks only (Llama 4 has its own).
        self.decode_step = backend.compiled_decode_step(self) if mp_size == 1 and self.block is TransformerBlock else None
        # the RoPE table, in float64 when the model runs in float64, else float32 (as Meta does)
        real = torch.float64 if backend.dtype == torch.float64 else torch.float32
        self.freqs_cis = self._rope_table(args, max_seq_len, real).to(backend.device)

    @staticmethod
    def _rope_table(args: ModelArgs, max_seq_len: int, real: torch.dtype) -> torch.Tensor:
        return precompute_freqs_cis(
            args.head_dim, max_seq_len, args.rope_theta, args.use_scaled_rope,
            scale_factor=args.rope_scaling_factor or 8.0, dtype=real,
        )  # fmt: skip

    @staticmethod
    def _prepare_weights(state: Mapping[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
        return fuse_linears(state, args.n_layers)

    @staticmethod
    def _linear_names(args: ModelArgs):
        return linear_names(args.n_layers)

    @classmethod
    def from_state_dict(
        cls, args: ModelArgs, state: Mapping[str, torch.Tensor], backend: Backend, *, mp_size: int = 1, max_seq_len: int,
        source: str = "checkpoint",
    ) -> "Transformer":  # fmt: skip
        """This rank's Meta-format state dict (in the model dtype, on the device) -> the model: the
        column linears fused, a tied output head taken from the embedding, then backend.prepare()."""
        weights = cls._prepare_weights(state, args)
        if args.tie_word_embeddings and "output.weight" not in weights:
            weights["output.weight"] = weights["tok_embeddings.weight"]
        # the fused float weights and the prepared dict are let go here: during __init__ each prepared
        # weight is referenced by its module only (engine.kernels.memory.WeightArena then moves the one-row
        # copies with one extra weight at a time, not a second copy of the model)
        weights = PreparedWeights(backend.prepare(weights, cls._linear_names(args)), source)
        return cls(args, weights, backend, mp_size=mp_size, max_seq_len=max_seq_len).eval()

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, kv_caches: list[KVCache]) -> torch.Tensor:
        """[num_logits, vocab_size] float32 logits (float64 in a float64 model) for
        inputs.logits_indices rows: a bfloat16 model's head sums in float32 and keeps them
        (Backend.head_linear). How the step runs is the backend's plan, made
        once here: the compiled step, or the blocks op by op over the plan's attention layout."""
        # a step with LoRA rows runs the blocks op by op: the adapters wrap the per-op linears (engine/lora/)
        compiled = self.decode_step if inputs.lora_ids is None else None
        plan = self.backend.plan_step(inputs, self.freqs_cis, kv_caches[0], compiled)
        h = self.tok_embeddings(inputs.input_ids)
        if inputs.image_rows is not None:  # early fusion: the reference's h * ~mask + h_image * mask
            h.index_copy_(0, inputs.image_rows, inputs.image_embeds.to(h.dtype))
        if plan.compiled:
            normed = self.decode_step(h, plan.attention, kv_caches)
        else:
            step, delta = self.step_data(inputs, kv_caches[0], plan), None
            for layer, cache in zip(self.layers, kv_caches):
                h, delta = layer(h, delta, cache, step)
            _, normed = self.norm(h, delta)
        return self.output(normed if inputs.takes_every_row else normed.index_select(0, inputs.logits_indices))

    def step_data(self, inputs: StepInputs, cache: KVCache, plan: StepPlan) -> AttentionMetadata:
        """What every block reads about this step (its forward's last argument): here the plan's
        attention layout; an architecture with more per-step data builds it here, once a step."""
        return plan.attention

    def weight_bytes(self) -> int:
        """Bytes this rank's weights hold, packed copies included, shared tensors counted once: each
        linear's resident_bytes() (a quantized linear's codes and scales are not parameters), plus
        every other parameter and buffer (embeddings, norms)."""
        # modules reporting their own bytes: linears (not the ParallelLinear / FloatOutput / RowByRow wrappers), quantized embeddings
        linears = [m for m in self.modules() if hasattr(m, "resident_bytes") and not isinstance(m, (ParallelLinear, FloatOutput, RowByRow))]
        in_linears = {_storage_key(t) for layer in linears for t in (*layer.parameters(), *layer.buffers())}
        rest = {_storage_key(t): t.numel() * t.element_size() for t in (*self.parameters(), *self.buffers())}
        # a quantized tied head and embedding share their codes: keyed by storage, counted once
        own = {m.storage_key() if hasattr(m, "storage_key") else id(m): m.resident_bytes() for m in linears}
        return sum(own.values()) + sum(n for key, n in rest.items() if key not in in_linears)


    def weight_formats(self) -> list[str]:
        """The formats the weights are held in: the model dtype, and each quantized format."""
        quantized = {m.weight_format for m in self.modules() if hasattr(m, "weight_format")}
        return [str(self.backend.dtype).removeprefix("torch."), *sorted(quantized)]


def _storage_key(tensor: torch.Tensor) -> int:
    """Tensors sharing storage share a key (a tied head); oneDNN's packed layout has no storage."""
    return id(tensor) if tensor.is_mkldnn else tensor.data_ptr()


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
    """Each layer's zeroed K and V caches; on the CPU all of them in one buffer on huge pages
    (engine.kernels.memory.huge_page_zeros: the attention kernels' scattered block reads)."""
    shape = kv_cache_shape(args, mp_size, num_blocks, block_size)
    if device.type == "cpu":
        caches = huge_page_zeros([shape] * (2 * args.n_layers), dtype)
        return [(caches[2 * layer], caches[2 * layer + 1]) for layer in range(args.n_layers)]
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(args.n_layers)
    ]
