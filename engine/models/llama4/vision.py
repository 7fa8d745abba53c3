"""Llama 4's vision encoder, pixel-shuffle adapter and projection (llama-models' llama4/vision/
encoder.py, embedding.py and model.py's vision_projection), over Meta's weight names:

    vision_embeddings.vision_encoder.{conv1._linear.weight, class_embedding, positional_embedding_vlm,
        ln_pre.*, ln_post.*, transformer.resblocks.N.{attn.w{q,k,v,o}.{weight,bias}, ln_1.*, ln_2.*,
        mlp.c_fc.*, mlp.c_proj.*}}
    vision_embeddings.vision_adapter.mlp.{c_fc,c_proj}.weight
    vision_projection.weight

One image's chunks ([chunks, 3, tile, tile], engine/vision/llama4.py) become chunks x
tokens_per_chunk rows of the text model's width, in the order of the prompt's <|patch|> tokens
(the reference's scatter_embeddings fills them in that order). Each chunk is encoded on its own:
its patches plus a class token appended last, 2-D RoPE over the patch grid (none on the class
token), full (non-causal) attention, GELU MLPs; then the class token is dropped, the patches
pixel-shuffled (ratio r: r^2 as many tokens, 1/r^2 as wide), a bias-free GELU MLP (GELU after both
of its linears, as the reference's SimpleMLP), and the projection to the text width.

Model parallel as the reference's fairscale layers (engine/loading/layout.py, llama4_vision_layouts,
cuts the weights; each rank holds its slice): conv1's patch linear column-parallel and gathered;
wq/wk/wv and the MLPs' c_fc column-parallel (this rank's heads and hidden units), wo and c_proj
row-parallel, all-reduced, their biases added after; the adapter's c_fc / c_proj the same pair; the
projection column-parallel and gathered; embeddings and layer norms whole. Every rank runs its part
of each image (engine/executor/worker_group.py sends the pixels to every rank) and ends with the
same rows. Sizes come from `vision_args` (params.json, VisionConfig).

Quantization: the vision weights stay in the model dtype under fp8_mixed and int4_mixed, as in
llama-models' Llama 4 quantization (llama4/quantization/loader.py, should_quantize_block, line 65:
`if not isinstance(block, TransformerBlock): return False`; only the text TransformerBlocks' MoE
experts are converted, never the vision encoder's _TransformerBlocks or the adapter and projection).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from engine.models.llama4.args import VISION_PREFIXES, VisionConfig
from engine.models.mllama.vision import Collective, apply_collective

__all__ = ["VISION_PREFIXES", "Llama4VisionEncoder", "VisionConfig", "random_vision_state"]

_ENCODER = "vision_embeddings.vision_encoder."


class Llama4VisionEncoder:
    """Pixels of one image's chunks -> its <|patch|> rows in the text model's embedding space, over
    this rank's slice of the weights (all of them at model-parallel size 1)."""

    def __init__(self, config: VisionConfig, state: Mapping[str, torch.Tensor], *, mp_size: int = 1,
                 reduce: Collective = None, gather: Collective = None) -> None:  # fmt: skip
        self.config = config
        self.w = {k: v for k, v in state.items() if k.startswith(VISION_PREFIXES)}
        self.grid = config.image_size // config.patch_size
        self.n_local_heads = config.n_heads // mp_size
        self.head_dim = config.dim // config.n_heads
        self.reduce, self.gather = reduce, gather
        self.freqs_cis = _patch_rope(self.grid, self.head_dim).to(self.w["vision_projection.weight"].device)

    @property
    def dtype(self) -> torch.dtype:
        return self.w["vision_projection.weight"].dtype

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's vision weights."""
        return sum(t.numel() * t.element_size() for t in self.w.values())

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        """[chunks, 3, tile, tile] -> [chunks * tokens_per_chunk, text dim] (on every rank)."""
        w, c = self.w, self.config
        x = pixels.to(self.dtype)
        patch = c.patch_size
        x = F.unfold(x, kernel_size=(patch, patch), stride=(patch, patch)).permute(0, 2, 1)
        x = apply_collective(self.gather, F.linear(x, w[_ENCODER + "conv1._linear.weight"]))  # [chunks, grid^2, dim]
        cls = w[_ENCODER + "class_embedding"].to(x.dtype) + torch.zeros(x.shape[0], 1, x.shape[-1], dtype=x.dtype, device=x.device)
        x = torch.cat([x, cls], dim=1) + w[_ENCODER + "positional_embedding_vlm"].to(x.dtype)
        x = _layer_norm(x, w, _ENCODER + "ln_pre.")
        for i in range(c.n_layers):
            p = f"{_ENCODER}transformer.resblocks.{i}."
            x = x + self._attention(_layer_norm(x, w, p + "ln_1."), p + "attn.")
            hidden = F.gelu(F.linear(_layer_norm(x, w, p + "ln_2."), w[p + "mlp.c_fc.weight"], w[p + "mlp.c_fc.bias"]))
            x = x + self._row_parallel(hidden, p + "mlp.c_proj.weight") + w[p + "mlp.c_proj.bias"]
        x = _layer_norm(x, w, _ENCODER + "ln_post.")[:, :-1, :]  # the class token dropped
        x = _pixel_shuffle(x, c.pixel_shuffle_ratio)
        adapter = "vision_embeddings.vision_adapter.mlp."
        x = F.gelu(self._row_parallel(F.gelu(F.linear(x, w[adapter + "c_fc.weight"])), adapter + "c_proj.weight"))
        return apply_collective(self.gather, F.linear(x.reshape(-1, x.shape[-1]), w["vision_projection.weight"]))

    def _row_parallel(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """RowParallelLinear without its bias: this rank's input columns, summed over the ranks."""
        return apply_collective(self.reduce, F.linear(x, self.w[name]))

    def _attention(self, x: torch.Tensor, p: str) -> torch.Tensor:
        w, heads, head_dim = self.w, self.n_local_heads, self.head_dim
        bsz, seqlen, _ = x.shape
        q, k, v = (F.linear(x, w[f"{p}w{n}.weight"], w[f"{p}w{n}.bias"]).view(bsz, seqlen, heads, head_dim)
                   for n in "qkv")  # fmt: skip
        q, k = _rotate(q, self.freqs_cis), _rotate(k, self.freqs_cis)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self._row_parallel(out.transpose(1, 2).reshape(bsz, seqlen, heads * head_dim), p + "wo.weight") + w[p + "wo.bias"]


def _layer_norm(x: torch.Tensor, w: Mapping[str, torch.Tensor], p: str) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), w[p + "weight"], w[p + "bias"], 1e-5)


def _rotate(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """The reference's apply_rotary_emb: complex product in float32 (at least), back to x's dtype."""
    real = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = torch.view_as_complex(x.to(real).reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs_cis.to(xc.dtype).view(1, x.shape[1], 1, -1)).flatten(3)
    return out.type_as(x)


def _patch_rope(grid: int, head_dim: int) -> torch.Tensor:
    """[grid^2 + 1, head_dim / 2] complex: the reference VisionEncoder's freq_cis (x then y
    frequencies of each patch, every other one kept; the class token's all zero, so unrotated)."""
    idx = torch.arange(grid * grid, dtype=torch.int32).reshape(-1, 1)
    idx = torch.cat([idx, idx[:1]], dim=0)
    idx[-1, -1] = -2  # the class token
    dim = head_dim // 2
    base = 1.0 / (10000 ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))

    def freqs(t: torch.Tensor) -> torch.Tensor:
        return torch.einsum("..., f -> ... f", t.type(base.dtype), base).repeat_interleave(2, dim=-1)

    fx, fy = freqs(idx % grid + 1), freqs(idx // grid + 1)
    angles = torch.cat([fx, fy], dim=-1).float().contiguous()[..., ::2]
    angles = angles.masked_fill(idx[:, :, None] < 0, 0)
    return torch.view_as_complex(torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1)).squeeze(1)


def _pixel_shuffle(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """The reference's PixelShuffle + pixel_shuffle_op: [n, grid^2, c] -> [n, grid^2 r^2, c / r^2]."""
    n, tokens, c = x.shape
    side = int(math.sqrt(tokens))
    x = x.reshape(n, side, side, c)
    n, w, h, c = x.shape
    x = x.view(n, w, int(h * ratio), int(c / ratio)).permute(0, 2, 1, 3).contiguous()
    x = x.view(n, int(h * ratio), int(w * ratio), int(c / (ratio * ratio))).permute(0, 2, 1, 3).contiguous()
    return x.reshape(n, -1, x.shape[-1])


def random_vision_state(config: VisionConfig, *, output_dim: int, mlp_ratio: float, text_dim: int, seed: int,
                        dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random weights under Meta's vision names and shapes (tests and benches)."""
    gen = torch.Generator().manual_seed(seed)
    d, patch, grid = config.dim, config.patch_size, config.image_size // config.patch_size
    hidden = int(mlp_ratio * d)
    shuffled = int(d / config.pixel_shuffle_ratio**2)
    shapes = {_ENCODER + "conv1._linear.weight": (d, 3 * patch * patch), _ENCODER + "class_embedding": (d,),
              _ENCODER + "positional_embedding_vlm": (grid * grid + 1, d),
              "vision_embeddings.vision_adapter.mlp.c_fc.weight": (output_dim, shuffled),
              "vision_embeddings.vision_adapter.mlp.c_proj.weight": (output_dim, output_dim),
              "vision_projection.weight": (text_dim, output_dim)}
    for ln in ("ln_pre.", "ln_post."):
        shapes[_ENCODER + ln + "weight"], shapes[_ENCODER + ln + "bias"] = (d,), (d,)
    for i in range(config.n_layers):
        p = f"{_ENCODER}transformer.resblocks.{i}."
        for n in "qkvo":
            shapes[f"{p}attn.w{n}.weight"], shapes[f"{p}attn.w{n}.bias"] = (d, d), (d,)
        for ln in ("ln_1.", "ln_2."):
            shapes[p + ln + "weight"], shapes[p + ln + "bias"] = (d,), (d,)
        shapes[p + "mlp.c_fc.weight"], shapes[p + "mlp.c_fc.bias"] = (hidden, d), (hidden,)
        shapes[p + "mlp.c_proj.weight"], shapes[p + "mlp.c_proj.bias"] = (d, hidden), (d,)
    state = {}
    for name, shape in shapes.items():
        scale = 1.0 if name.endswith(("ln_pre.weight", "ln_post.weight", "ln_1.weight", "ln_2.weight")) else 0.0
        fan_in = shape[-1] if len(shape) > 1 else 1
        noise = torch.randn(shape, generator=gen) / math.sqrt(fan_in) * (1.0 if len(shape) > 1 else 0.1)
        state[name] = (scale + noise).to(dtype)
    return state
