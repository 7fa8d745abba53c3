"""Llama 3.2 Vision's image encoder and projection, as llama-models' llama3/multimodal/model.py
computes them (VisionEncoder, CrossAttentionTransformerVision), over this rank's weights.

Input: each image as vision_max_num_chunks tiles of [3, chunk, chunk] (real tiles first, zeros
after; engine/vision/mllama.py) and its aspect ratio (tile rows, tile columns). Output:
[images, tiles, tokens_per_tile, dim] image states in the text model's width. The encoder's quirks
are kept because the weights were trained with them: every image runs as max_num_chunks tiles,
each padded to a multiple of 8 tokens, and only pad-to-pad attention is masked (real tokens attend
to padding tiles too), so an image's states depend on the tile count, never on other images.

Model parallel as the reference: conv patch, q/k/v, c_fc and the projection column-parallel
(gathered where the reference gathers), wo and c_proj row-parallel (all-reduced), the rest
replicated. Sizes come from the weights (VisionDims), never from constants.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from engine.models.mllama.args import ENCODER, VISION_HEADS, VisionDims

Collective = Callable[[torch.Tensor], torch.Tensor] | None


def apply_collective(collective: Collective, x: torch.Tensor) -> torch.Tensor:
    """A fairscale mapping on x (an all-reduce, an all-gather), or x at model-parallel size 1."""
    return x if collective is None else collective(x)


class VisionModel:
    """Image encoder + projection over a state dict slice (keys under `vision_model.`)."""

    def __init__(self, weights: Mapping[str, torch.Tensor], dims: VisionDims, *, mp_size: int,
                 reduce: Collective, gather: Collective) -> None:  # fmt: skip
        self.w = {k: v for k, v in weights.items() if k.startswith("vision_model.")}
        self.dims = dims
        self.reduce, self.gather = reduce, gather
        self.n_local_heads = VISION_HEADS // mp_size
        self.head_dim = dims.width // VISION_HEADS

    def _p(self, name: str) -> torch.Tensor:
        return self.w[ENCODER + name]

    # ------------------------------------------------------------------ blocks
    def _attention(self, p: str, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        bs, slen, _ = x.shape
        q, k, v = (F.linear(x, self._p(p + f"attn.{n}.weight")).view(bs, slen, self.n_local_heads, self.head_dim).transpose(1, 2)
                   for n in ("wq", "wk", "wv"))  # fmt: skip
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        out = out.transpose(1, 2).contiguous().reshape(bs, slen, -1)
        return apply_collective(self.reduce, F.linear(out, self._p(p + "attn.wo.weight")))

    def _mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(F.linear(x, self._p(p + "mlp.c_fc.weight"), self._p(p + "mlp.c_fc.bias")))
        hidden = apply_collective(self.reduce, F.linear(hidden, self._p(p + "mlp.c_proj.weight")))
        return hidden + self._p(p + "mlp.c_proj.bias")

    def _layer_norm(self, p: str, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self._p(p + ".weight"), self._p(p + ".bias"), 1e-5)

    def _block(self, p: str, x: torch.Tensor, mask: torch.Tensor, gated: bool) -> torch.Tensor:
        gate_attn = self._p(p + "gate_attn").tanh() if gated else 1
        gate_ffn = self._p(p + "gate_ffn").tanh() if gated else 1
        x = x + gate_attn * self._attention(p, self._layer_norm(p + "ln_1", x), mask)
        return x + gate_ffn * self._mlp(p, self._layer_norm(p + "ln_2", x))

    def _tile_embed(self, name: str, x: torch.Tensor, ar: list[tuple[int, int]]) -> torch.Tensor:
        """TilePositionEmbedding: each real tile gets its (row, column) embedding, gated."""
        embed = self._p(name + ".embedding")
        out = torch.zeros(x.shape[0], x.shape[1], 1, x.shape[-1], dtype=x.dtype, device=x.device)
        for idx, (h, w) in enumerate(ar):
            out[idx, : w * h] = embed[:h, :w].reshape(w * h, 1, -1)
        return x + out * self._p(name + ".gate").tanh()

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def __call__(self, images: torch.Tensor, ar: list[tuple[int, int]]) -> torch.Tensor:
        """images [n, tiles, 3, chunk, chunk], ar: (tile rows, tile columns) per image ->
        [n, tiles, tokens_per_tile, dim] projected image states (on every rank)."""
        return self.project(self.encode(images, ar))

    def encode(self, images: torch.Tensor, ar: list[tuple[int, int]]) -> torch.Tensor:
        n, tiles, nch, size, _ = images.shape
        dims = self.dims
        x = F.unfold(images.reshape(n * tiles, nch, size, size), kernel_size=dims.patch_size, stride=dims.patch_size)
        x = apply_collective(self.gather, F.linear(x.permute(0, 2, 1), self._p("conv1._linear.weight")))
        _, ntok, dim = x.shape
        x = self._tile_embed("pre_tile_pos_embed", x.reshape(n, tiles, ntok, dim), ar).reshape(n * tiles, ntok, dim)
        cls = self._p("class_embedding").to(x.dtype) + torch.zeros(x.shape[0], 1, dim, dtype=x.dtype, device=x.device)
        x = torch.cat([cls, x], dim=1)
        ntok += 1
        x = x.reshape(n, tiles, ntok, dim)
        gate = self._p("gated_positional_embedding_gate").tanh()
        x = (x.view(n * tiles, ntok, dim) + self._p("positional_embedding") * (1 - gate)).view(n, tiles, ntok, dim)
        table = self._p("gated_positional_embedding")
        for idx, (h, w) in enumerate(ar):
            x[idx, : h * w] += table[:h, :w].reshape(h * w, ntok, dim) * gate
        x = self._layer_norm("ln_pre", x)
        npad = 8 - ntok % 8  # the reference pads 8 tokens when ntok is a multiple of 8 already
        x = torch.cat([x, torch.zeros(n, tiles, npad, dim, dtype=x.dtype, device=x.device)], dim=2)
        mask = _encoder_mask(x, ar, ntok, tiles).expand(-1, self.n_local_heads, -1, -1)
        x = x.view(n, -1, dim)
        intermediate = []
        for i in range(dims.layers):
            if i in dims.intermediate:
                intermediate.append(x)
            x = self._block(f"transformer.resblocks.{i}.", x, mask, gated=False)
        x = self._layer_norm("ln_post", x)
        x = self._tile_embed("post_tile_pos_embed", x.reshape(n, tiles, ntok + npad, dim), ar)
        x = x.reshape(n, tiles * (ntok + npad), dim)
        for i in range(dims.global_layers):
            x = self._block(f"global_transformer.resblocks.{i}.", x, mask, gated=True)
        x = x.reshape(n, tiles, ntok + npad, dim)[:, :, :ntok]
        inter = torch.stack(intermediate, dim=-1).reshape(n, tiles, ntok + npad, -1)[:, :, :ntok]
        return torch.cat([x, inter], dim=-1)

    def project(self, states: torch.Tensor) -> torch.Tensor:
        """CrossAttentionTransformerVision's projection into the text width (column-parallel, gathered)."""
        w, b = self.w["vision_model.vision_projection.weight"], self.w["vision_model.vision_projection.bias"]
        return apply_collective(self.gather, F.linear(states, w, b))


def _encoder_mask(x: torch.Tensor, ar: list[tuple[int, int]], ntok: int, tiles: int) -> torch.Tensor:
    """build_encoder_attention_mask: -inf (dtype min) where both tokens are padding (a padding
    tile, or a tile's pad-to-8 tokens), else 0. [n, 1, L, L]."""
    masks = []
    for h, w in ar:
        pad = torch.ones((tiles, x.shape[2], 1), dtype=x.dtype, device=x.device)
        pad[: h * w, :ntok] = 0
        pad = pad.view(tiles * x.shape[2], -1)
        masks.append((pad @ pad.T * torch.finfo(x.dtype).min).unsqueeze(0))
    return torch.stack(masks)
