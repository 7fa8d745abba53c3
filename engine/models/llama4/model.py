"""Llama 4 text model (llama-models' llama4 reference) over the same backend operations as
engine/models/llama.py: the same paged, continuously batched forward, with Llama 4's block pieces as
their own layers:

- Llama4Attention: RoPE (Llama 4 scaling) on the RoPE layers, none on the NoPE layers (every
  nope_layer_interval-th); qk-norm (RMSNorm without weight, after RoPE) on the RoPE layers;
  attention temperature tuning of q on the NoPE layers; chunked local attention on the RoPE
  layers (each query sees its own chunk of attention_chunk_size positions, built by the backend
  as another metadata layout), global attention on the NoPE layers.
- MoEFeedForward: sigmoid-gated top-k routing plus a shared expert; routed inputs scaled by their
  gate before the experts (as the reference does); all of a step's tokens routed at once, sorted by
  expert, one matmul pair per expert over its tokens. Experts are split along their hidden size F
  across model-parallel ranks (Meta's split); one all-reduce for shared + routed outputs.
- dense layers (interleave_moe_layer_step > 1) are engine.models.llama.FeedForward.

Each expert's w1|w3 and w2 are linears like any other (engine/backends/: packed, quantized by
fp8_mixed, or fp8 as Meta's Maverick FP8 release ships them: ExpertWeights), prepared once at load.
A checkpoint that ships vision weights also gets its vision encoder (engine/models/llama4/vision.py:
this rank's slice, `image_encoder`), which the executor runs on every rank for each image
(engine/executor/images.py) before the step that fuses its rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.backends.base import AttentionMetadata, Backend, HeadLayout, KVCache, LinearNames, StepPlan
from engine.executor.step_inputs import StepInputs
from engine.models.args import ModelArgs
from engine.models.llama import Collectives, FeedForward, RMSNorm, Transformer, apply_rotary_emb, fuse_linears
from engine.models.llama4.args import VISION_PREFIXES, is_moe_layer, is_nope_layer, precompute_freqs_cis, vision_config
from engine.models.llama4.vision import Llama4VisionEncoder
from engine.models.weights import PreparedWeights
from engine.quant.formats import ExpertWeights, cat_rows
from engine.types import CheckpointError


@dataclass(slots=True)
class Llama4Step:
    """What every layer reads about one step, built once: the two attention layouts and the
    per-token RoPE rotations and NoPE temperature scales."""

    global_meta: AttentionMetadata  # NoPE layers (and RoPE layers without a chunk size)
    local_meta: AttentionMetadata  # RoPE layers: chunked local attention
    rope: torch.Tensor  # [tokens, 1, head_dim // 2] complex
    q_scale: torch.Tensor | None  # [tokens, 1, 1] attention temperature of the NoPE layers' q


def qk_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference's rmsnorm(x, eps): no weight, in float32 at least."""
    if x.dtype in (torch.float32, torch.float64):
        return F.rms_norm(x, (x.shape[-1],), None, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).type_as(x)


def temperature_scales(args: ModelArgs, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1 per position (float32, as the reference)."""
    pos = positions.to(torch.float32)
    scales = torch.log(torch.floor((pos + 1.0) / args.floor_scale) + 1.0) * args.attn_scale + 1.0
    return scales.to(dtype)[:, None, None]


class Llama4Attention(nn.Module):
    def __init__(self, args: ModelArgs, weights: PreparedWeights, prefix: str, backend: Backend, mp: Collectives, *, nope: bool) -> None:
        super().__init__()
        self.heads = HeadLayout(args.n_heads // mp.mp_size, max(1, args.kv_heads // mp.mp_size), args.head_dim)
        self.wqkv = backend.linear(weights.take(prefix + "wqkv.weight"))  # column-parallel: wq|wk|wv
        self.wo = backend.linear(weights.take(prefix + "wo.weight"), mp.reduce)  # row-parallel
        self.use_rope = not nope
        self.use_qk_norm = args.use_qk_norm and not nope
        self.temperature_tuning = args.attn_temperature_tuning and nope
        self.eps = args.norm_eps
        self.backend = backend

    def forward(self, x: torch.Tensor, cache: KVCache, meta: AttentionMetadata, step: Llama4Step) -> torch.Tensor:
        qkv = self.wqkv(x)
        heads = self.heads
        rows = qkv.view(qkv.shape[0], heads.heads + 2 * heads.kv_heads, heads.head_dim)
        qk = rows[:, : heads.heads + heads.kv_heads]
        if self.use_rope:  # reference order: RoPE, then qk-norm, then the temperature
            qk.copy_(apply_rotary_emb(qk, step.rope))
        if self.use_qk_norm:
            qk.copy_(qk_norm(qk, self.eps))
        if self.temperature_tuning:
            rows[:, : heads.heads] *= step.q_scale
        self.backend.cache_write(qkv, heads, cache, meta)
        return self.wo(self.backend.attention(qkv, heads, cache, meta))


class MoEFeedForward(nn.Module):
    """llama4 MoE: out = shared_expert(x) + sum over the top_k experts e of expert_e(sigmoid(score_e) * x)."""

    def __init__(self, args: ModelArgs, weights: PreparedWeights, prefix: str, backend: Backend, mp: Collectives) -> None:
        super().__init__()
        self.num_experts, self.top_k = args.moe_args.num_experts, args.moe_args.top_k
        self.router_DE = nn.Parameter(weights.take(prefix + "router_DE"), requires_grad=False)  # noqa: N815 replicated
        self.shared_w13 = backend.linear(weights.take(prefix + "shared_expert.w13.weight"))
        self.shared_w2 = backend.linear(weights.take(prefix + "shared_expert.w2.weight"))  # reduced with the experts
        self.experts_w13 = nn.ModuleList(backend.linear(weights.take(f"{prefix}experts.{e}.w13.weight")) for e in range(self.num_experts))
        self.experts_w2 = nn.ModuleList(backend.linear(weights.take(f"{prefix}experts.{e}.w2.weight")) for e in range(self.num_experts))
        self._reduce = mp.reduce
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_scores, top_experts = torch.topk(x @ self.router_DE, self.top_k, dim=1)  # [tokens, k]
        flat = top_experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, expert) pairs grouped by expert
        token_of = order // self.top_k
        routed = x.index_select(0, token_of) * torch.sigmoid(top_scores).reshape(-1, 1).index_select(0, order)
        routed_out = torch.empty_like(routed)
        start = 0
        for e, count in enumerate(torch.bincount(flat, minlength=self.num_experts).tolist()):
            if count:
                rows = slice(start, start + count)
                routed_out[rows] = self.experts_w2[e](self.backend.silu_mul(self.experts_w13[e](routed[rows])))
                start += count
        # back to (token, k) order and summed over k: index_add_ (a scatter) is ~100x slower on CPU in bfloat16
        per_token = torch.empty_like(routed_out).index_copy_(0, order, routed_out).view(-1, self.top_k, x.shape[1]).sum(dim=1)
        out = self.shared_w2(self.backend.silu_mul(self.shared_w13(x))).add_(per_token)
        return out if self._reduce is None else self._reduce(out)


class Llama4Block(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs, weights: PreparedWeights, backend: Backend, mp: Collectives) -> None:
        super().__init__()
        prefix = f"layers.{layer_id}."
        nope = is_nope_layer(args, layer_id)
        self.layer_id = layer_id
        self.chunked = not nope and args.attention_chunk_size is not None
        self.attention = Llama4Attention(args, weights, prefix + "attention.", backend, mp, nope=nope)
        if is_moe_layer(args, layer_id):
            self.feed_forward: nn.Module = MoEFeedForward(args, weights, prefix + "feed_forward.", backend, mp)
        else:
            self.feed_forward = FeedForward(weights, prefix + "feed_forward.", backend, mp)
        self.attention_norm = RMSNorm(weights.take(prefix + "attention_norm.weight"), args.norm_eps, backend)
        self.ffn_norm = RMSNorm(weights.take(prefix + "ffn_norm.weight"), args.norm_eps, backend)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, cache: KVCache, step: Llama4Step) -> tuple[torch.Tensor, torch.Tensor]:
        """As engine.models.llama.TransformerBlock: (h, feed-forward output), the add fused in the next norm."""
        meta = step.local_meta if self.chunked else step.global_meta
        x, normed = self.attention_norm(x, delta)
        h, normed = self.ffn_norm(x, self.attention(normed, cache, meta, step))
        return h, self.feed_forward(normed)


def llama4_linear_names(args: ModelArgs) -> LinearNames:
    names = []
    for i in range(args.n_layers):
        p = f"layers.{i}."
        names += [p + "attention.wqkv.weight", p + "attention.wo.weight"]
        if is_moe_layer(args, i):
            ff = p + "feed_forward."
            names += [ff + "shared_expert.w13.weight", ff + "shared_expert.w2.weight"]
            for e in range(args.moe_args.num_experts):
                names += [f"{ff}experts.{e}.w13.weight", f"{ff}experts.{e}.w2.weight"]
        else:
            names += [p + "feed_forward.w13.weight", p + "feed_forward.w2.weight"]
    return LinearNames(tuple(names), "output.weight")


def split_experts(state: Mapping[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """The MoE layers' [e, D, F] / [e, F, D] expert tensors as one linear weight per expert
    (w1|w3 -> [2F, D], w2 -> [D, F], as F.linear reads them) and the shared expert's w1|w3 fused.
    Experts kept quantized (ExpertWeights: a Meta FP8 release) already hold one [out, in] weight each."""
    out = dict(state)
    for i in range(args.n_layers):
        ff = f"layers.{i}.feed_forward."
        if not is_moe_layer(args, i):
            continue
        w1, w3, w2 = (out.pop(ff + f"experts.{w}") for w in ("w1", "w3", "w2"))
        for e in range(args.moe_args.num_experts):
            if isinstance(w1, ExpertWeights):
                out[f"{ff}experts.{e}.w13.weight"] = cat_rows([w1.expert(e), w3.expert(e)])
                out[f"{ff}experts.{e}.w2.weight"] = w2.expert(e)
                continue
            out[f"{ff}experts.{e}.w13.weight"] = torch.cat([w1[e].t(), w3[e].t()]).contiguous()
            out[f"{ff}experts.{e}.w2.weight"] = w2[e].t().contiguous()
        shared = [out.pop(ff + f"shared_expert.{w}.weight") for w in ("w1", "w3")]
        out[ff + "shared_expert.w13.weight"] = torch.cat(shared)
    return out


class Llama4Transformer(Transformer):
    """Transformer's skeleton, loading path and forward (embedding, blocks, norm, head; weights
    prepared once; one plan a step) with Llama 4's blocks, RoPE table, expert weights and per-step
    data (step_data: the chunked layout beside the plan's)."""

    block = Llama4Block

    def __init__(self, args: ModelArgs, weights: PreparedWeights, backend: Backend, *, mp_size: int, max_seq_len: int) -> None:
        vision = {name: w for prefix in VISION_PREFIXES for name, w in weights.take_prefixed(prefix).items()}
        super().__init__(args, weights, backend, mp_size=mp_size, max_seq_len=max_seq_len)
        self.image_encoder: Llama4VisionEncoder | None = None  # a text-only checkpoint (or load) has none
        if vision:
            config = vision_config(dict(args.extra))
            if config is None:
                raise CheckpointError("vision weights without params.json vision_args")
            mp = Collectives(mp_size)
            self.image_encoder = Llama4VisionEncoder(config, vision, mp_size=mp_size, reduce=mp.reduce, gather=mp.gather)

    def weight_bytes(self) -> int:
        """The text model's bytes, plus this rank's vision weights (plain tensors, not parameters)."""
        return super().weight_bytes() + (self.image_encoder.nbytes if self.image_encoder is not None else 0)

    @staticmethod
    def _rope_table(args: ModelArgs, max_seq_len: int, real: torch.dtype) -> torch.Tensor:
        return precompute_freqs_cis(args, max_seq_len, real)

    @staticmethod
    def _prepare_weights(state: Mapping[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
        return split_experts(fuse_linears(state, args.n_layers), args)

    @staticmethod
    def _linear_names(args: ModelArgs):
        return llama4_linear_names(args)

    def step_data(self, inputs: StepInputs, cache: KVCache, plan: StepPlan) -> Llama4Step:
        """The plan's layout for the NoPE layers, the chunked one for the RoPE layers (the one
        other layout a step builds), the tokens' RoPE rows and the NoPE layers' q temperatures."""
        args = self.params
        global_meta = plan.attention
        chunk = args.attention_chunk_size
        local_meta = self.backend.attention_metadata(inputs, self.freqs_cis, cache, chunk) if chunk else global_meta
        rope = self.freqs_cis.index_select(0, inputs.positions).unsqueeze(1)
        q_scale = temperature_scales(args, inputs.positions, self.backend.dtype) if args.attn_temperature_tuning else None
        return Llama4Step(global_meta, local_meta, rope, q_scale)
