/* A pure-decode step in one call: every block and the final norm for 1..max_rows sequences that
 * each decode one token (engine/backends/cpu_step.py builds the program; engine/kernels/decode_step.py binds it).
 *
 * Why: a small model's step is ~9 kernel calls per layer (two add+RMSNorms, four linears, RoPE +
 * cache write, paged attention, SiLU-mul), and through Python and ctypes each call costs 4-7 us on
 * top of its work (plus a torch.empty for its output): ~1.5 ms of a 9-18 ms step at one stream, and
 * ~4 ms of a 29 ms 32-decode step on the demo model (bench/NOTES.md). Here the whole stack of layers
 * runs as one C loop over a program bound once at load: every weight's pointers and sizes, each
 * layer's K/V cache, scratch rows for the most rows it serves, and the addresses of the kernels
 * themselves (the cpu_kernels, quant_kernels and amx_linear libraries, loaded separately and
 * passed in by address, so this file holds no kernel code of its own and the step computes exactly
 * what the per-op path computes, call for call: one row through the one-row linears, 2+ rows
 * through the pairs copies' many-rows kernel (AMX tiles, or without them linear.c's pairs gemm) or, for interleaved copies, 2..few_rows rows through the interleaved linears' few-rows
 * path and rows past few_rows (up to max_rows) through gemm.c (bfloat16: interleaved_gemm_bf16, x
 * widened and the sums rounded in C), attention through whichever
 * paged kernel the step's metadata names).
 */
#include <stdint.h>
#include <stddef.h>

typedef void (*add_rms_norm_fn)(int, void *, const void *, const void *, void *, int64_t, int64_t, float, int);
typedef void (*silu_mul_fn)(int, const void *, void *, int64_t, int64_t, int);
typedef void (*rope_fn)(int, void *, int64_t, int64_t, int64_t, int64_t, const int64_t *, const float *, const int64_t *,
                        void *, void *, int);
/* The kernels that allocate scratch return 0 or vec.h's KERNEL_NO_MEMORY, which the step passes on. */
typedef int (*decode_attention_fn)(int, const void *, int64_t, void *, const int64_t *, const void *, const void *,
                                   const int32_t *, int64_t, const int32_t *, int64_t, int64_t, int64_t, int64_t, int64_t,
                                   float, int);
typedef int (*paged_attention_fn)(int, const void *, int64_t, void *, const int32_t *, const int32_t *, const int32_t *,
                                  const int32_t *, int64_t, int64_t, const void *, const void *, int64_t, int64_t,
                                  int64_t, int64_t, float, int);
typedef int (*interleaved_fn)(int, const void *, const void *, void *, int64_t, int64_t, int64_t, int);
typedef void (*pairs_fn)(const void *, const void *, void *, int64_t, int64_t, int64_t, int);
typedef int (*quant_fn)(const void *, int, const void *, int64_t, void *, int);
typedef int (*pairs_rows_fn)(const void *, const void *, void *, int64_t, int64_t, int64_t, int);
typedef int (*gemm_fn)(int, const float *, const void *, float *, int64_t, int64_t, int64_t, int);
typedef int (*gemm_bf16_fn)(const void *, const void *, void *, float *, int64_t, int64_t, int64_t, int);

/* The kernels, by address (engine.kernels.cpu.CpuKernels.address, QuantKernels.linear_address,
 * AmxLinear.address). */
typedef struct {
    add_rms_norm_fn add_rms_norm;
    silu_mul_fn silu_mul;
    rope_fn rope_and_cache_write;
    decode_attention_fn paged_decode_attention;
    paged_attention_fn paged_attention;
    interleaved_fn interleaved_linear;
    pairs_fn interleaved_linear_bf16_pairs; /* NULL where the library has none */
    quant_fn quant_linear;                  /* NULL without the quantized kernels */
    /* 2+ rows of the bfloat16 pairs copies: amx_linear_bf16 (AMX tiles) or, without tiles,
     * linear.c's pairs_gemm_bf16 (vdpbf16ps); NULL where the program has no pairs rows (2+ rows: the
     * interleaved linears) */
    pairs_rows_fn pairs_many_rows;
    gemm_fn interleaved_gemm;               /* float32 rows past the program's few_rows (gemm.c) */
    gemm_bf16_fn interleaved_gemm_bf16;     /* bfloat16 rows past few_rows: x widened, the sums rounded (gemm.c) */
} step_kernels;

/* One linear: its one-row form, kind 0 interleaved ([n / 16, k, 16]), 1 bfloat16 column pairs
 * ([n / 16, k / 2, 16, 2]), 2 quantized (weight: quant_kernels.c's quant_weight descriptor). Where
 * the program serves 2+ rows either every linear is of kind 1 and the pairs many-rows kernel (AMX
 * tiles, or the pairs gemm) reads the same pairs copy (pairs_many_rows set), or every linear is of kind 0 and interleaved_linear takes the rows (its
 * few-rows path, as PackedCpuLinear's forward calls it for up to max_rows rows). */
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

/* Scratch, each buffer max_rows (rounded up to whole tile_rows: 16 on AMX, else 1) rows of its width,
 * in the model dtype; gemm_f32: a bfloat16 program's float32 rows for interleaved_gemm_bf16 (max_rows x
 * (the widest k + the widest n) floats: the widened x, then the sums), NULL where it has none. */
typedef struct {
    void *normed, *qkv, *attn, *attn_out, *gate_up, *act, *ffn_out;
    float *gemm_f32;
} step_scratch;

typedef struct {
    const step_kernels *kernels;
    const step_layer *layers;
    const step_scratch *scratch;
    const void *final_norm;
    int64_t n_layers, dim, heads, kv_heads, head_dim, hidden, block_size, bf16;
    int64_t max_rows, tile_rows; /* rows served (1: one-row linears only); the rows a pairs linear's input is padded to a multiple of (AMX tile height 16, else 1) */
    int64_t few_rows; /* interleaved linears: rows past this go to gemm.c (max_rows: never) */
    int64_t pairs_min_rows; /* the fewest rows the pairs many-rows kernel takes (2; 1 on AMX tiles in the batch-invariant mode) */
    float eps, scale;
} step_program;

/* Which paged kernel the step's metadata chose (CpuKernelBackend.attention_metadata). */
enum { ATTENTION_DECODE = 0, ATTENTION_PAGED = 1 };

/* Per step: where each sequence's one new token goes and which keys it reads. Sequence b's token
 * is row b (the per-op path's metadata for a pure-decode step says so too). */
typedef struct {
    int64_t rows, attention; /* sequences (= tokens); ATTENTION_* */
    const int64_t *position, *slot; /* [rows] */
    const int64_t *decode_rows;     /* [rows] int64 (ATTENTION_DECODE) */
    const int32_t *row_start, *new_tokens; /* [rows] int32 (ATTENTION_PAGED) */
    const int32_t *block_table, *seq_len;  /* [rows, max_blocks], [rows] */
    int64_t max_blocks;
    const float *rope; /* [max_pos, head_dim / 2, 2] float32 cos, sin */
} step_tokens;

/* Returns 0, or the linear kernel's error: KERNEL_NO_MEMORY (its input copy), -1 (the pairs kernel refused). */
static int run_linear(const step_program *p, const step_linear *l, const void *x, void *out, int64_t rows, int threads) {
    const step_kernels *kn = p->kernels;
    const int bf16 = (int)p->bf16;
    if (rows >= p->pairs_min_rows && kn->pairs_many_rows) {
        /* AMX: whole tiles: the rows past `rows` are scratch (their outputs unused), which the kernel
         * would otherwise copy x into a zero-padded buffer for; each row's sums are the same */
        const int64_t padded = (rows + p->tile_rows - 1) / p->tile_rows * p->tile_rows;
        return kn->pairs_many_rows(x, l->weight, out, padded, l->n, l->k, threads);
    }
    /* more than one row only for kind 0 (the program's max_rows says so); past few_rows the rows take
     * gemm.c, as PackedCpuLinear.forward sends them (the same kernel: the same bits): float32 as they
     * are, bfloat16 through interleaved_gemm_bf16 (x widened into the program's float32 scratch, the
     * sums rounded back), the function the per-op path calls */
    if (rows > p->few_rows && l->kind == LINEAR_INTERLEAVED)
        return bf16 ? kn->interleaved_gemm_bf16(x, l->weight, out, p->scratch->gemm_f32, rows, l->n, l->k, threads)
                    : kn->interleaved_gemm(0, (const float *)x, l->weight, (float *)out, rows, l->n, l->k, threads);
    switch (l->kind) {
    case LINEAR_BF16_PAIRS: kn->interleaved_linear_bf16_pairs(x, l->weight, out, rows, l->n, l->k, threads); return 0;
    case LINEAR_QUANT: return kn->quant_linear(l->weight, bf16, x, rows, out, threads);
    default: return kn->interleaved_linear(bf16, x, l->weight, out, rows, l->n, l->k, threads);
    }
}

/* Returns 0, or KERNEL_NO_MEMORY (the attention kernel's scratch). */
static int run_attention(const step_program *p, const step_layer *l, const step_tokens *t, int threads) {
    const step_kernels *kn = p->kernels;
    const step_scratch *s = p->scratch;
    const int bf16 = (int)p->bf16;
    if (t->attention == ATTENTION_PAGED)
        return kn->paged_attention(bf16, s->qkv, l->wqkv.n, s->attn, t->row_start, t->new_tokens, t->seq_len,
                                   t->block_table, t->max_blocks, t->rows, l->k_cache, l->v_cache, p->heads,
                                   p->kv_heads, p->head_dim, p->block_size, p->scale, threads);
    return kn->paged_decode_attention(bf16, s->qkv, l->wqkv.n, s->attn, t->decode_rows, l->k_cache, l->v_cache,
                                      t->block_table, t->max_blocks, t->seq_len, t->rows, p->heads, p->kv_heads,
                                      p->head_dim, p->block_size, p->scale, threads);
}

/* residual [rows, dim] (the tokens' embeddings; the residual stream, updated in place) -> out
 * [rows, dim] = the final norm of the last layer's stream, as Transformer.forward's per-op loop
 * leaves it. Returns 0, -2 (rows outside 1..max_rows), or the first kernel error: -1 (the pairs kernel refused
 * a linear) or KERNEL_NO_MEMORY (a kernel could not allocate its scratch). */
int decode_step(const step_program *p, void *residual, void *out, const step_tokens *t, int threads) {
    const step_kernels *kn = p->kernels;
    const step_scratch *s = p->scratch;
    const int bf16 = (int)p->bf16;
    const int64_t rows = t->rows;
    if (rows < 1 || rows > p->max_rows) return -2;
    const void *delta = NULL; /* the previous layer's feed-forward output, added by the next norm */
    int rc;
    for (int64_t i = 0; i < p->n_layers; i++) {
        const step_layer *l = p->layers + i;
        kn->add_rms_norm(bf16, residual, delta, l->attention_norm, s->normed, rows, p->dim, p->eps, threads);
        if ((rc = run_linear(p, &l->wqkv, s->normed, s->qkv, rows, threads))) return rc;
        kn->rope_and_cache_write(bf16, s->qkv, rows, p->heads, p->kv_heads, p->head_dim, t->position, t->rope, t->slot,
                                 l->k_cache, l->v_cache, threads);
        if ((rc = run_attention(p, l, t, threads))) return rc;
        if ((rc = run_linear(p, &l->wo, s->attn, s->attn_out, rows, threads))) return rc;
        kn->add_rms_norm(bf16, residual, s->attn_out, l->ffn_norm, s->normed, rows, p->dim, p->eps, threads);
        if ((rc = run_linear(p, &l->w13, s->normed, s->gate_up, rows, threads))) return rc;
        kn->silu_mul(bf16, s->gate_up, s->act, rows, p->hidden, threads);
        if ((rc = run_linear(p, &l->w2, s->act, s->ffn_out, rows, threads))) return rc;
        delta = s->ffn_out;
    }
    kn->add_rms_norm(bf16, residual, delta, p->final_norm, out, rows, p->dim, p->eps, threads);
    return 0;
}
