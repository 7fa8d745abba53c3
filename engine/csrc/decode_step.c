/* A batch-1 decode step in one call (engine/backends/cpu_step.py builds and binds it).
 *
 * Why: at one stream a small model's step is ~9 kernel calls per layer (two add+RMSNorms, four
 * one-row linears, RoPE + cache write, paged attention, SiLU-mul), and through Python and ctypes
 * each call costs 4-7 us on top of its work: ~1.5 ms of a 9-18 ms step on the demo model
 * (bench/NOTES.md). Here the whole stack of layers and the final norm run as one C loop over a
 * program bound once at load: every weight's pointers and sizes, each layer's K/V cache, scratch
 * rows, and the addresses of the kernels themselves (engine/csrc/cpu_kernels.c and quant_kernels.c,
 * loaded separately and passed in by address, so this file holds no kernel code of its own and
 * the step computes exactly what the per-op path computes, call for call).
 */
#include <stdint.h>
#include <stddef.h>

typedef void (*add_rms_norm_fn)(int, void *, const void *, const void *, void *, int64_t, int64_t, float, int);
typedef void (*silu_mul_fn)(int, const void *, void *, int64_t, int64_t, int);
typedef void (*rope_fn)(int, void *, int64_t, int64_t, int64_t, int64_t, const int64_t *, const float *, const int64_t *,
                        void *, void *, int);
typedef void (*attention_fn)(int, const void *, int64_t, void *, const int64_t *, const void *, const void *,
                             const int32_t *, int64_t, const int32_t *, int64_t, int64_t, int64_t, int64_t, int64_t,
                             float, int);
typedef void (*interleaved_fn)(int, const void *, const void *, void *, int64_t, int64_t, int64_t, int);
typedef void (*pairs_fn)(const void *, const void *, void *, int64_t, int64_t, int64_t, int);
typedef int (*quant_fn)(const void *, int, const void *, int64_t, void *, int);

/* The kernels, by address (engine.cpu_kernels.CpuKernels.addresses, QuantKernels.address). */
typedef struct {
    add_rms_norm_fn add_rms_norm;
    silu_mul_fn silu_mul;
    rope_fn rope_and_cache_write;
    attention_fn paged_decode_attention;
    interleaved_fn interleaved_linear;
    pairs_fn interleaved_linear_bf16_pairs; /* NULL where the library has none */
    quant_fn quant_linear;                  /* NULL without the quantized kernels */
} step_kernels;

/* One linear's one-row form: kind 0 interleaved ([n / 16, k, 16]), 1 bfloat16 column pairs
 * ([n / 16, k / 2, 16, 2]), 2 quantized (weight: quant_kernels.c's quant_weight descriptor). */
enum { LINEAR_INTERLEAVED = 0, LINEAR_BF16_PAIRS = 1, LINEAR_QUANT = 2 };
typedef struct {
    int64_t kind;
    const void *weight;
    int64_t n, k;
} step_linear;

typedef struct {
    const void *attention_norm, *ffn_norm;
    step_linear wqkv, wo, w13, w2;
    void *k_cache, *v_cache; /* [num_blocks, block_size, kv_heads, head_dim] */
} step_layer;

/* Scratch rows, each one token wide, in the model dtype. */
typedef struct {
    void *normed, *qkv, *attn, *attn_out, *gate_up, *act, *ffn_out;
} step_scratch;

typedef struct {
    const step_kernels *kernels;
    const step_layer *layers;
    const step_scratch *scratch;
    const void *final_norm;
    int64_t n_layers, dim, heads, kv_heads, head_dim, hidden, block_size, bf16;
    float eps, scale;
} step_program;

/* Per step: where this token goes and which keys it reads. */
typedef struct {
    const int64_t *position, *slot, *row; /* one each (row: 0, the token's row) */
    const int32_t *block_table, *seq_len; /* [max_blocks], one */
    int64_t max_blocks;
    const float *rope; /* [max_pos, head_dim / 2, 2] float32 cos, sin */
} step_token;

/* Returns 0, or -1 when a quantized linear could not allocate its input copy. */
static int run_linear(const step_kernels *kn, const step_linear *l, int bf16, const void *x, void *out, int threads) {
    switch (l->kind) {
    case LINEAR_BF16_PAIRS: kn->interleaved_linear_bf16_pairs(x, l->weight, out, 1, l->n, l->k, threads); return 0;
    case LINEAR_QUANT: return kn->quant_linear(l->weight, bf16, x, 1, out, threads);
    default: kn->interleaved_linear(bf16, x, l->weight, out, 1, l->n, l->k, threads); return 0;
    }
}

/* residual [1, dim] (the token's embedding; the residual stream, updated in place) -> out [1, dim]
 * = the final norm of the last layer's stream, as Transformer.forward's per-op loop leaves it. */
int decode_step(const step_program *p, void *residual, void *out, const step_token *t, int threads) {
    const step_kernels *kn = p->kernels;
    const step_scratch *s = p->scratch;
    const int bf16 = (int)p->bf16;
    const void *delta = NULL; /* the previous layer's feed-forward output, added by the next norm */
    for (int64_t i = 0; i < p->n_layers; i++) {
        const step_layer *l = p->layers + i;
        kn->add_rms_norm(bf16, residual, delta, l->attention_norm, s->normed, 1, p->dim, p->eps, threads);
        if (run_linear(kn, &l->wqkv, bf16, s->normed, s->qkv, threads)) return -1;
        kn->rope_and_cache_write(bf16, s->qkv, 1, p->heads, p->kv_heads, p->head_dim, t->position, t->rope, t->slot,
                                 l->k_cache, l->v_cache, threads);
        kn->paged_decode_attention(bf16, s->qkv, l->wqkv.n, s->attn, t->row, l->k_cache, l->v_cache, t->block_table,
                                   t->max_blocks, t->seq_len, 1, p->heads, p->kv_heads, p->head_dim, p->block_size,
                                   p->scale, threads);
        if (run_linear(kn, &l->wo, bf16, s->attn, s->attn_out, threads)) return -1;
        kn->add_rms_norm(bf16, residual, s->attn_out, l->ffn_norm, s->normed, 1, p->dim, p->eps, threads);
        if (run_linear(kn, &l->w13, bf16, s->normed, s->gate_up, threads)) return -1;
        kn->silu_mul(bf16, s->gate_up, s->act, 1, p->hidden, threads);
        if (run_linear(kn, &l->w2, bf16, s->act, s->ffn_out, threads)) return -1;
        delta = s->ffn_out;
    }
    kn->add_rms_norm(bf16, residual, delta, p->final_norm, out, 1, p->dim, p->eps, threads);
    return 0;
}
