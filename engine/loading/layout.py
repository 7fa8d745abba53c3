"""How a checkpoint's weights are cut over model-parallel ranks: each weight's full shape and
parallel dimension (column-parallel: output rows; row-parallel: input columns; the vocab-parallel
embedding: vocab rows; Llama 4's experts: their hidden size F), and the slice a rank holds. The
vision encoders (Llama 3.2 Vision's, Llama 4's) are cut as llama-models' fairscale layers cut them.

What the loader reshards by (engine/loading/checkpoint.py) and what Meta's Llama 4 key mapping
(engine/loading/llama4.py) splits fused shards by; it reads only the architecture (ModelArgs).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.models.args import ModelArgs
from engine.models.llama4.args import VisionConfig, is_moe_layer, moe_hidden_dim
from engine.models.mllama.args import ENCODER, IMAGE_TOKEN_ROWS, VisionDims


@dataclass(frozen=True, slots=True)
class ParamLayout:
    full_shape: tuple[int, ...]
    parallel_dim: int | None  # None: replicated on every rank (norms)
    kv_heads: int = 0  # > 0 for wk/wv: ranks past n_kv_heads repeat heads (Meta's MP > n_kv_heads rule)


def param_layouts(args: ModelArgs, vision: VisionDims | VisionConfig | None = None) -> dict[str, ParamLayout]:
    """Every weight the model holds, with its full (unsharded) shape and parallel dimension; a Llama
    3.2 Vision model's image encoder sizes come from its weights (`vision`, engine/loading/mllama.py),
    a Llama 4 model's from its vision_args (`vision`, for a checkpoint that ships vision weights)."""
    ffn_layouts = llama4_ffn_layouts if args.is_llama4 else dense_ffn_layouts
    d = args.dim
    out = {"tok_embeddings.weight": ParamLayout((args.vocab_size, d), 0)}  # VocabParallelEmbedding
    for i in range(args.n_layers):
        p = f"layers.{i}."
        out.update(attention_layouts(args, p))
        out.update(ffn_layouts(args, i, p))
        out[p + "attention_norm.weight"] = ParamLayout((d,), None)
        out[p + "ffn_norm.weight"] = ParamLayout((d,), None)
    out["norm.weight"] = ParamLayout((d,), None)
    if not args.tie_word_embeddings:
        out["output.weight"] = ParamLayout((args.vocab_size, d), 0)
    if args.is_mllama:  # without `vision`: the released encoder's sizes (estimates before loading)
        assert args.vision_chunk_size is not None
        assert not isinstance(vision, VisionConfig)
        out.update(mllama_layouts(args, vision or VisionDims.release(args.vision_chunk_size)))
    if isinstance(vision, VisionConfig):
        out.update(llama4_vision_layouts(vision, d))
    return out


def attention_layouts(args: ModelArgs, prefix: str) -> dict[str, ParamLayout]:
    d, q, kv = args.dim, args.n_heads * args.head_dim, args.kv_heads * args.head_dim
    return {
        prefix + "attention.wq.weight": ParamLayout((q, d), 0),
        prefix + "attention.wk.weight": ParamLayout((kv, d), 0, args.kv_heads),
        prefix + "attention.wv.weight": ParamLayout((kv, d), 0, args.kv_heads),
        prefix + "attention.wo.weight": ParamLayout((d, q), 1),
    }


def dense_ffn_layouts(args: ModelArgs, layer_id: int, prefix: str) -> dict[str, ParamLayout]:
    d, f = args.dim, args.ffn_hidden_dim
    return {
        prefix + "feed_forward.w1.weight": ParamLayout((f, d), 0),
        prefix + "feed_forward.w2.weight": ParamLayout((d, f), 1),
        prefix + "feed_forward.w3.weight": ParamLayout((f, d), 0),
    }


def rank_range(layout: ParamLayout, rank: int, size: int) -> tuple[int, int]:
    """[start, end) along the parallel dim that `rank` of `size` holds."""
    total = layout.full_shape[layout.parallel_dim]  # type: ignore[index]
    if layout.kv_heads and size > layout.kv_heads:
        head_dim = total // layout.kv_heads
        head = rank * layout.kv_heads // size
        return head * head_dim, (head + 1) * head_dim
    step = total // size
    return rank * step, (rank + 1) * step


def local_shape(layout: ParamLayout, rank: int, size: int) -> tuple[int, ...]:
    if layout.parallel_dim is None:
        return layout.full_shape
    start, end = rank_range(layout, rank, size)
    shape = list(layout.full_shape)
    shape[layout.parallel_dim] = end - start
    return tuple(shape)


def llama4_ffn_layouts(args: ModelArgs, layer_id: int, prefix: str) -> dict[str, ParamLayout]:
    """A MoE layer's router, experts (split along F) and shared expert; dense layers as Llama 3."""
    if not is_moe_layer(args, layer_id):
        return dense_ffn_layouts(args, layer_id, prefix)
    d, e, fm = args.dim, args.moe_args.num_experts, moe_hidden_dim(args)
    p = prefix + "feed_forward."
    return {
        p + "router_DE": ParamLayout((d, e), None),
        p + "experts.w1": ParamLayout((e, d, fm), 2),
        p + "experts.w3": ParamLayout((e, d, fm), 2),
        p + "experts.w2": ParamLayout((e, fm, d), 1),
        p + "shared_expert.w1.weight": ParamLayout((fm, d), 0),
        p + "shared_expert.w3.weight": ParamLayout((fm, d), 0),
        p + "shared_expert.w2.weight": ParamLayout((d, fm), 1),
    }


def mllama_layouts(args: ModelArgs, vision: VisionDims) -> dict[str, ParamLayout]:
    """The cross-attention layers, the image-token embedding and the vision model (the text
    layers' layouts are Llama 3's)."""
    d, hd = args.dim, args.head_dim
    out = {"learnable_embedding.weight": ParamLayout((IMAGE_TOKEN_ROWS, d), 0)}
    for k in range(args.vision_num_cross_attention_layers):
        p = f"cross_attention_layers.{k}."
        out.update(attention_layouts(args, p))
        out.update(dense_ffn_layouts(args, k, p))
        out[p + "attention.q_norm.weight"] = ParamLayout((hd,), None)
        out[p + "attention.k_norm.weight"] = ParamLayout((hd,), None)
        for name in ("attention_norm.weight", "ffn_norm.weight"):
            out[p + name] = ParamLayout((d,), None)
        for gate in ("gate_attn", "gate_ffwd"):
            out[p + gate] = ParamLayout((1,), None)
    out.update(vision_layouts(vision))
    out["vision_model.vision_projection.weight"] = ParamLayout((d, vision.output_dim), 0)
    out["vision_model.vision_projection.bias"] = ParamLayout((d,), 0)
    return out


def vision_layouts(v: VisionDims) -> dict[str, ParamLayout]:
    w, tiles, tokens = v.width, v.max_tiles, v.tokens_per_tile
    out = {
        ENCODER + "conv1._linear.weight": ParamLayout((w, 3 * v.patch_size * v.patch_size), 0),
        ENCODER + "class_embedding": ParamLayout((w,), None),
        ENCODER + "positional_embedding": ParamLayout((tokens, w), None),
        ENCODER + "gated_positional_embedding": ParamLayout((tiles, tiles, tokens, w), None),
        ENCODER + "gated_positional_embedding_gate": ParamLayout((1,), None),
    }
    for norm in ("ln_pre", "ln_post"):
        out[ENCODER + norm + ".weight"] = ParamLayout((w,), None)
        out[ENCODER + norm + ".bias"] = ParamLayout((w,), None)
    for table in ("pre_tile_pos_embed", "post_tile_pos_embed"):
        out[ENCODER + table + ".embedding"] = ParamLayout((tiles, tiles, 1, w), None)
        out[ENCODER + table + ".gate"] = ParamLayout((1,), None)
    for stack, count, gated in (("transformer", v.layers, False), ("global_transformer", v.global_layers, True)):
        for i in range(count):
            p = f"{ENCODER}{stack}.resblocks.{i}."
            for name in ("wq", "wk", "wv"):
                out[p + f"attn.{name}.weight"] = ParamLayout((w, w), 0)
            out[p + "attn.wo.weight"] = ParamLayout((w, w), 1)
            out[p + "mlp.c_fc.weight"] = ParamLayout((4 * w, w), 0)
            out[p + "mlp.c_fc.bias"] = ParamLayout((4 * w,), 0)
            out[p + "mlp.c_proj.weight"] = ParamLayout((w, 4 * w), 1)
            out[p + "mlp.c_proj.bias"] = ParamLayout((w,), None)
            for norm in ("ln_1", "ln_2"):
                out[p + norm + ".weight"] = ParamLayout((w,), None)
                out[p + norm + ".bias"] = ParamLayout((w,), None)
            if gated:
                out[p + "gate_attn"] = ParamLayout((1,), None)
                out[p + "gate_ffn"] = ParamLayout((1,), None)
    return out


def llama4_vision_layouts(v: VisionConfig, text_dim: int) -> dict[str, ParamLayout]:
    """Llama 4's vision encoder, pixel-shuffle adapter and projection, as llama-models' llama4
    vision/encoder.py, embedding.py and model.py shard them: ColumnParallelLinear weights (and
    biases) split along their output rows (conv1's patch linear, wq/wk/wv, the MLPs' c_fc, the
    projection), RowParallelLinear weights along their input columns (wo, c_proj; their biases,
    added after the all-reduce, whole), the embeddings and layer norms whole on every rank."""
    e = "vision_embeddings.vision_encoder."
    d, hidden, grid = v.dim, v.mlp_hidden_dim, v.image_size // v.patch_size
    out = {
        e + "conv1._linear.weight": ParamLayout((d, 3 * v.patch_size * v.patch_size), 0),
        e + "class_embedding": ParamLayout((d,), None),
        e + "positional_embedding_vlm": ParamLayout((grid * grid + 1, d), None),
    }
    for norm in ("ln_pre.", "ln_post."):
        out[e + norm + "weight"], out[e + norm + "bias"] = ParamLayout((d,), None), ParamLayout((d,), None)
    for i in range(v.n_layers):
        p = f"{e}transformer.resblocks.{i}."
        for name in ("wq", "wk", "wv"):
            out[f"{p}attn.{name}.weight"], out[f"{p}attn.{name}.bias"] = ParamLayout((d, d), 0), ParamLayout((d,), 0)
        out[p + "attn.wo.weight"], out[p + "attn.wo.bias"] = ParamLayout((d, d), 1), ParamLayout((d,), None)
        for norm in ("ln_1.", "ln_2."):
            out[p + norm + "weight"], out[p + norm + "bias"] = ParamLayout((d,), None), ParamLayout((d,), None)
        out[p + "mlp.c_fc.weight"], out[p + "mlp.c_fc.bias"] = ParamLayout((hidden, d), 0), ParamLayout((hidden,), 0)
        out[p + "mlp.c_proj.weight"], out[p + "mlp.c_proj.bias"] = ParamLayout((d, hidden), 1), ParamLayout((d,), None)
    adapter = "vision_embeddings.vision_adapter.mlp."  # SimpleMLP, bias-free
    out[adapter + "c_fc.weight"] = ParamLayout((v.output_dim, v.shuffled_dim), 0)
    out[adapter + "c_proj.weight"] = ParamLayout((v.output_dim, v.output_dim), 1)
    out["vision_projection.weight"] = ParamLayout((text_dim, v.output_dim), 0)
    return out
