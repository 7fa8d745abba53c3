"""Llama 3.2 Vision's text model: the Llama 3 text layers over the paged KV cache, with
llama-models' cross-attention layers (CrossAttentionTransformerText, CrossAttentionTransformerBlock)
run before the text layers its fusion schedule names, over each sequence's image states.

Cross-attention keys and values come from the image states once per sequence (at its first
prefill step, engine/models/mllama/cache.py keeps them per sequence, apart from the paged text KV)
and are read by every later step of that sequence. A text row attends to the images whose span
(llama-models' create_vision_mask) covers its position; a row that attends to no image (every row
of a text-only sequence, the rows before a sequence's first <|image|>) passes through the
cross-attention layer unchanged, which is what the reference computes for it (its output and
feed-forward are multiplied by a zero row mask), so such rows skip the work.

Differences from the reference, none changing a value: keys/values are kept per KV head (the
reference stores them repeated n_rep times; the q/k RMSNorm is per head vector, so norm and repeat
commute) and only for an image's real tiles (its padding tiles are masked out of every row).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.backends.base import Backend
from engine.executor.step_inputs import StepInputs
from engine.models.args import ModelArgs
from engine.models.llama import Collectives, Transformer, TransformerBlock, VocabParallelEmbedding, repeat_kv, rms_norm
from engine.models.mllama.args import VisionDims, fusion_schedule
from engine.models.mllama.vision import VisionModel
from engine.models.weights import PreparedWeights


@dataclass
class CrossAttentionState:
    """One sequence's cross-attention keys and values on one rank, and which text attends to which image."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per cross-attention layer: K (normed), V, each [n_local_kv_heads, keys, head_dim]
    key_image: torch.Tensor  # [keys] int64, the image each key belongs to
    span_starts: torch.Tensor  # [images] int64, first text position attending each image
    span_ends: torch.Tensor  # [images] int64, one past the last (llama-models' -1: no end)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.kv for t in pair)


NO_END = 2**62  # a span running to the end of the sequence


class MllamaTextBlock(TransformerBlock):
    """A Llama 3 text block (its own class, so the backend's compiled decode step, which knows
    only the plain text model, is not built for this model)."""


class CrossAttentionBlock(nn.Module):
    """CrossAttentionTransformerBlock: tanh-gated cross-attention and feed-forward, this rank's heads."""

    def __init__(self, args: ModelArgs, w: Mapping[str, torch.Tensor], prefix: str, mp: Collectives) -> None:
        super().__init__()
        self.w = {k.removeprefix(prefix): v for k, v in w.items() if k.startswith(prefix)}
        self.n_local_heads = args.n_heads // mp.mp_size
        self.n_local_kv_heads = max(1, args.kv_heads // mp.mp_size)  # past n_kv_heads ranks repeat heads, as in text attention
        self.head_dim = args.head_dim
        self.eps = args.norm_eps
        self.reduce = mp.reduce

    def _row_parallel(self, x: torch.Tensor, name: str) -> torch.Tensor:
        out = F.linear(x, self.w[name])
        return out if self.reduce is None else self.reduce(out)

    def key_values(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """states [keys, dim] -> K (k_norm applied), V, each [n_local_kv_heads, keys, head_dim]."""
        k = F.linear(states, self.w["attention.wk.weight"]).view(-1, self.n_local_kv_heads, self.head_dim)
        v = F.linear(states, self.w["attention.wv.weight"]).view(-1, self.n_local_kv_heads, self.head_dim)
        k = rms_norm(k, self.w["attention.k_norm.weight"], self.eps)
        return k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [rows, dim] of one sequence, each attending to at least one key; mask [rows, keys]."""
        w, rows = self.w, x.shape[0]
        normed = rms_norm(x, w["attention_norm.weight"], self.eps)
        q = rms_norm(F.linear(normed, w["attention.wq.weight"]).view(rows, self.n_local_heads, self.head_dim),
                     w["attention.q_norm.weight"], self.eps).transpose(0, 1)  # fmt: skip
        n_rep = self.n_local_heads // self.n_local_kv_heads
        k, v = (repeat_kv(t.transpose(0, 1), n_rep).transpose(0, 1) for t in (k, v))
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask[None, None], dropout_p=0.0)[0]
        h = x + w["gate_attn"].tanh() * self._row_parallel(out.transpose(0, 1).reshape(rows, -1), "attention.wo.weight")
        normed = rms_norm(h, w["ffn_norm.weight"], self.eps)
        hidden = F.silu(F.linear(normed, w["feed_forward.w1.weight"])) * F.linear(normed, w["feed_forward.w3.weight"])
        return h + w["gate_ffwd"].tanh() * self._row_parallel(hidden, "feed_forward.w2.weight")


class MllamaTransformer(Transformer):
    """The text model with cross-attention layers, and the vision model that feeds them."""

    block = MllamaTextBlock

    def __init__(self, args: ModelArgs, weights: PreparedWeights, backend: Backend, *, mp_size: int, max_seq_len: int) -> None:
        mp = Collectives(mp_size)
        vision_weights = weights.take_prefixed("vision_model.")
        xattn_weights = weights.take_prefixed("cross_attention_layers.")
        image_embedding = weights.take("learnable_embedding.weight")
        super().__init__(args, weights, backend, mp_size=mp_size, max_seq_len=max_seq_len)
        assert args.vision_chunk_size is not None
        dims = VisionDims.from_shapes({k: v.shape for k, v in vision_weights.items()}, args.vision_chunk_size, source="weights")
        self.vision = VisionModel(vision_weights, dims, mp_size=mp_size, reduce=mp.reduce, gather=mp.gather)
        self.image_embeddings = VocabParallelEmbedding(image_embedding, mp, backend.dtype)
        schedule = fusion_schedule(args.n_layers, args.vision_num_cross_attention_layers)
        self.cross_attention_layers = nn.ModuleList(
            CrossAttentionBlock(args, xattn_weights, f"cross_attention_layers.{k}.", mp) for k in range(len(schedule))
        )
        self.cross_attention_before = {layer: k for k, layer in enumerate(schedule)}  # text layer -> cross-attention layer
        self._vision_weights = vision_weights  # counted in weight_bytes (plain tensors, not parameters)
        self._xattn_weights = xattn_weights

    # ------------------------------------------------------------------ images
    @torch.inference_mode()
    def cross_attention_state(self, images: torch.Tensor, aspect_ratios: list[tuple[int, int]],
                              spans: list[tuple[int, int]]) -> CrossAttentionState:  # fmt: skip
        """One sequence's images [n, max_tiles, 3, chunk, chunk] (real tiles first), their (rows,
        columns) of tiles and the text spans attending them ([start, end), end -1: to the end) ->
        its cross-attention keys and values on this rank."""
        dtype, device = self.backend.dtype, self.backend.device
        states = self.vision(images.to(device=device, dtype=dtype), aspect_ratios)  # [n, tiles, tokens, dim]
        real = [states[i, : h * w].reshape(-1, states.shape[-1]) for i, (h, w) in enumerate(aspect_ratios)]
        key_image = torch.cat([torch.full((t.shape[0],), i, dtype=torch.int64) for i, t in enumerate(real)]).to(device)
        tokens = torch.cat(real)
        kv = [layer.key_values(tokens) for layer in self.cross_attention_layers]
        starts = torch.tensor([s for s, _ in spans], dtype=torch.int64, device=device)
        ends = torch.tensor([NO_END if e == -1 else e for _, e in spans], dtype=torch.int64, device=device)
        return CrossAttentionState(kv, key_image, starts, ends)

    # ------------------------------------------------------------------ forward
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """get_partially_trainable_embedding: ids past the text vocabulary (<|image|>, 128256) read
        the learnable image-token rows."""
        image = ids >= self.vocab_size
        if not bool(image.any()):
            return self.tok_embeddings(ids)
        h = self.tok_embeddings(ids.masked_fill(image, 0))
        h[image] = self.image_embeddings(ids[image] - self.vocab_size)
        return h

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, kv_caches: list, cross: list[CrossAttentionState | None] | None = None) -> torch.Tensor:
        """As Transformer.forward, with `cross` giving each sequence of the batch its images'
        state (None: no image), in batch order."""
        plan = self.backend.plan_step(inputs, self.freqs_cis, kv_caches[0], None)
        h = self.embed(inputs.input_ids)
        attending = self._attending_rows(inputs, cross)
        step, delta = self.step_data(inputs, kv_caches[0], plan), None
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            k = self.cross_attention_before.get(i)
            if k is not None and attending:
                h = h if delta is None else h + delta
                h, delta = self._cross_attend(h, k, attending), None
            h, delta = layer(h, delta, cache, step)
        _, normed = self.norm(h, delta)
        return self.output(normed.index_select(0, inputs.logits_indices))

    def _attending_rows(self, inputs: StepInputs, cross: list[CrossAttentionState | None] | None):
        """(row indices, mask [rows, keys], state) per sequence with rows attending an image."""
        out = []
        if not cross:
            return out
        starts = inputs.query_start_loc.tolist()
        for i, state in enumerate(cross):
            if state is None:
                continue
            positions = inputs.positions[starts[i] : starts[i + 1]]
            allowed = (positions[:, None] >= state.span_starts[state.key_image][None]) & (
                positions[:, None] < state.span_ends[state.key_image][None]
            )
            rows = allowed.any(dim=1).nonzero().squeeze(1)
            if rows.numel():
                mask = torch.zeros(allowed.shape, dtype=self.backend.dtype, device=positions.device)
                mask.masked_fill_(~allowed, torch.finfo(self.backend.dtype).min)
                out.append((rows + starts[i], mask.index_select(0, rows), state))
        return out

    def _cross_attend(self, h: torch.Tensor, k: int, attending) -> torch.Tensor:
        h = h.clone()
        layer = self.cross_attention_layers[k]
        for rows, mask, state in attending:
            key, value = state.kv[k]
            h[rows] = layer(h.index_select(0, rows), key, value, mask)
        return h

    def weight_bytes(self) -> int:
        extra = sum(t.numel() * t.element_size() for w in (self._vision_weights, self._xattn_weights) for t in w.values())
        return super().weight_bytes() + extra
