/* Paged attention over the K/V caches in place (the cpu_kernels library; engine/kernels/cpu.py
 * binds them): paged_decode_attention (one query token per sequence), paged_attention (prefill
 * chunks and decodes in one call) and its AMX tile path. */
#include "vec.h"

/* out[l] = (l & w) == 0 ? a[l] + a[l + w] : b[l - w] + b[l]: one level of the add tree that turns
 * NV_LANES vectors of partial products into one vector of as many dot products (lane j: key j). */
#define PA_I1(w, l) (((l) & (w)) == 0 ? (l) : NV_LANES + (l) - (w))
#define PA_I2(w, l) (((l) & (w)) == 0 ? (l) + (w) : NV_LANES + (l))
#if NV_LANES == 16
#define PA_MASK(I, w)                                                                                      \
    ((nvi){I(w, 0), I(w, 1), I(w, 2), I(w, 3), I(w, 4), I(w, 5), I(w, 6), I(w, 7), I(w, 8), I(w, 9), \
               I(w, 10), I(w, 11), I(w, 12), I(w, 13), I(w, 14), I(w, 15)})
#elif NV_LANES == 8
#define PA_MASK(I, w) ((nvi){I(w, 0), I(w, 1), I(w, 2), I(w, 3), I(w, 4), I(w, 5), I(w, 6), I(w, 7)})
#else
#define PA_MASK(I, w) ((nvi){I(w, 0), I(w, 1), I(w, 2), I(w, 3)})
#endif
#define PA_COMBINE(a, b, w) (__builtin_shuffle((a), (b), PA_MASK(PA_I1, w)) + __builtin_shuffle((a), (b), PA_MASK(PA_I2, w)))
#define PA_FOLD4(w, l) ((l) ^ 4) /* lanes 4-7 of each 8 onto 0-3 and back */

/* pa_sum_lanes(p): lane j of the result is the sum of p[j]'s lanes, for NV_LANES vectors of partial
 * products (one per key): a transposing add tree, no horizontal sum per key. */
#if NV_LANES == 8 && defined(__AVX__)
#include <immintrin.h>
/* AVX: hadd's pairwise sums within 128-bit halves, two levels, then the halves added across (GCC's
 * lowering of the generic 8-lane tree's cross-half level took more shuffles than these). */
static inline nvf pa_sum_lanes(const nvf *p) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps((__m256)p[0], (__m256)p[1]), _mm256_hadd_ps((__m256)p[2], (__m256)p[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps((__m256)p[4], (__m256)p[5]), _mm256_hadd_ps((__m256)p[6], (__m256)p[7]));
    /* a: lanes 0-3 the low halves' sums of p[0..3], lanes 4-7 their high halves'; b likewise for p[4..7] */
    return (nvf)_mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#elif NV_LANES == 4 && defined(__SSE3__)
#include <pmmintrin.h>
static inline nvf pa_sum_lanes(const nvf *p) {
    return (nvf)_mm_hadd_ps(_mm_hadd_ps((__m128)p[0], (__m128)p[1]), _mm_hadd_ps((__m128)p[2], (__m128)p[3]));
}
#else
static inline nvf pa_sum_lanes(const nvf *p) {
    nvf t[NV_LANES / 2];
    for (int i = 0; i < NV_LANES / 2; i++) t[i] = PA_COMBINE(p[2 * i], p[2 * i + 1], 1);
    for (int i = 0; i < NV_LANES / 4; i++) t[i] = PA_COMBINE(t[2 * i], t[2 * i + 1], 2);
#if NV_LANES >= 8
    for (int i = 0; i < NV_LANES / 8; i++) t[i] = PA_COMBINE(t[2 * i], t[2 * i + 1], 4);
#endif
#if NV_LANES >= 16
    t[0] = PA_COMBINE(t[0], t[1], 8);
#endif
    return t[0];
}
#endif

/* ------------------------------------------------------------------------------------------ paged decode attention
 * One query token per sequence, attending to its seq_lens[b] cached keys read in place through
 * its block table. q rows are rows[b] of q (row stride q_stride elements, heads * head_dim used),
 * output rows are rows[b] of out [*, heads * head_dim]. Caches [num_blocks, block_size, kv_heads,
 * head_dim].
 *
 * Work is split into tasks of whole blocks: one per sequence, or with fewer sequences than twice
 * the threads, a sequence's blocks in a few ranges (flash-decoding), merged afterwards with their
 * softmax maxima and sums. A task walks its blocks in order: a slot's keys for all KV heads are one
 * contiguous run, streamed once per pass (scores, then values), and the next block is prefetched
 * while one is computed, since the layer's weights evicted the cache and a decode step is bound by
 * reading it back. */
#define MIN_BLOCKS_PER_TASK 4

/* Prefetch of the blocks a task reads next. A task's K blocks then its V blocks are one stream of
 * block passes; while one is computed, the lines of the pass PREFETCH_PASSES_AHEAD on are prefetched
 * evenly over its key rows (BlockPrefetch: 4 lines per 3 rows for float32 9/3 heads of 64), spread
 * over the maths. One burst of a block's 192 prefetches (12 KiB, float32) at its start, as before,
 * filled Zen 2's ~22 L1 miss buffers: the rest of the burst waited for them as demand reads would
 * and the maths behind it with them, so a cold call took the hot call's time plus the read time (no
 * overlap; 1.5x slower than spread, bench/NOTES.md 'Decode attention: reads overlapped with the
 * maths'). The non-temporal hint (prefetchnta) made the decode attention 1.7-3.4x slower over 30
 * layers' caches, its lines evicted before they were read.
 *
 * Into L2 (prefetcht1), two passes ahead: a prefetch into L1 (T0) holds one of L1's few miss
 * buffers until its line arrives, so on Zen 4 a read of blocks in shuffled order took 14 GB/s a
 * thread with T0 prefetches at any distance (or none), 25-28 GB/s with T1 ones 8-24 KiB ahead
 * (a contiguous read: 30 GB/s); the kernel, one thread, float32 1 x 4096 keys cold 1.7-1.9x, bfloat16
 * 1.3-1.5x (bench/NOTES.md 'Decode attention from L2 prefetches'). On Zen 2, T1 one pass ahead was
 * level with T0 (within the noise). */
#define PREFETCH_LOCALITY 2 /* __builtin_prefetch's: prefetcht1 */
#define PREFETCH_PASSES_AHEAD 2

static inline void prefetch_block(const char *block, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(block + off, 0, PREFETCH_LOCALITY);
}

typedef struct {
    const char *next, *end; /* the lines of one block pass not prefetched yet */
} BlockPrefetch;

static inline void prefetch_line(BlockPrefetch *pf) {
    if (pf->next < pf->end) {
        __builtin_prefetch(pf->next, 0, PREFETCH_LOCALITY);
        pf->next += 64;
    }
}

typedef struct {
    const char *k_cache, *v_cache;
    const int32_t *table;
    int64_t heads, n_rep, block_size, slot_elems; /* slot_elems = kv_heads * head_dim */
    size_t slot_bytes;
    int bf16;
    const bf16_t *q_bf16; /* the task's query row as stored (bfloat16 calls; score_heads_dp's operand) */
    float scale;          /* the softmax scale score_heads_dp applies to its sums */
} AttendArgs;

/* A call's tasks, handed out one at a time (dynamic scheduling by hand, as paged_attention_amx's
 * PaItems): a thread claims its next task PREFETCH_PASSES_AHEAD block passes before the end of its
 * current one and prefetches that task's first K block over the first of those, which otherwise
 * came from memory unprefetched (1.05x float32, 1.03x bfloat16 on 32 decodes x 160 keys cold, 1
 * thread). A task's result does not depend on which thread runs it. */
typedef struct {
    int64_t next; /* the first unclaimed task (atomic) */
    int64_t tasks;
    const int64_t *task_begin; /* sequence b's tasks: [task_begin[b], task_begin[b + 1]) */
    const int32_t *seq_lens, *block_tables;
    int64_t max_blocks, block_size;
} DecodeTasks;

/* Task `task`'s sequence *b and its blocks [*blk_begin, *blk_end). */
static inline void task_blocks(const DecodeTasks *q, int64_t task, int64_t *b, int64_t *blk_begin, int64_t *blk_end) {
    int64_t s = 0;
    while (q->task_begin[s + 1] <= task) s++;
    const int64_t splits = q->task_begin[s + 1] - q->task_begin[s], split = task - q->task_begin[s];
    const int64_t blocks = (q->seq_lens[s] + q->block_size - 1) / q->block_size;
    *b = s, *blk_begin = blocks * split / splits, *blk_end = blocks * (split + 1) / splits;
}

/* Claim the next task (q->tasks where none is left); *first (where asked) its first K block, NULL
 * where there is none. */
static inline int64_t claim_task(DecodeTasks *q, const char *k_cache, size_t block_bytes, const char **first) {
    const int64_t task = __atomic_fetch_add(&q->next, 1, __ATOMIC_RELAXED);
    if (first) *first = NULL;
    if (task >= q->tasks) return q->tasks;
    int64_t b, blk_begin, blk_end;
    task_blocks(q, task, &b, &blk_begin, &blk_end);
    if (first && blk_begin < blk_end) *first = k_cache + (size_t)q->block_tables[b * q->max_blocks + blk_begin] * block_bytes;
    return task;
}

/* pa_sum4(p): lanes 0-3 of the result are the sums of p[0..3]'s lanes (the lanes past them: partial
 * sums, unused), for 4 vectors of partial products (one per key). */
#if NV_LANES == 8 && defined(__AVX__)
/* two hadd levels within the 128-bit halves, then the halves added */
static inline nvf pa_sum4(const nvf *p) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps((__m256)p[0], (__m256)p[1]), _mm256_hadd_ps((__m256)p[2], (__m256)p[3]));
    return (nvf)_mm256_castps128_ps256(_mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}
#else
/* pa_sum_lanes' first two levels (lane l of the result holds key l % 4's sums), then the upper
 * halves folded down */
static inline nvf pa_sum4(const nvf *p) {
    nvf t = PA_COMBINE(PA_COMBINE(p[0], p[1], 1), PA_COMBINE(p[2], p[3], 1), 2);
#if NV_LANES == 16
    t += __builtin_shuffle(t, (nvi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
#endif
#if NV_LANES >= 8
    t += __builtin_shuffle(t, PA_MASK(PA_FOLD4, 0));
#endif
    return t;
}
#endif

/* bfloat16 scores of query heads [h, h + RC) of one KV head (RC <= 3) over the block's n keys (rows
 * of bfloat16, stride elements apart; D a multiple of NV_LANES), 4 keys at a time: each K vector
 * widened in registers once for the RC heads (3 x 4 accumulators; q read as the FMA's memory
 * operand), no float32 copy of K stored and read back. s[r * s_stride + j] = q[r * D ..] . row j. */
static inline __attribute__((always_inline)) void score_heads_bf16(const void *rows, int64_t stride, int64_t n,
                                                                   const float *q, const int64_t D, const int RC,
                                                                   float *s, int64_t s_stride, BlockPrefetch *pf,
                                                                   int64_t *credit, int64_t head_lines, int64_t n_rep) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        nvf acc[3][4];
        for (int r = 0; r < RC; r++)
            for (int k = 0; k < 4; k++) acc[r][k] = (nvf){0};
        for (int64_t i = 0; i < D; i += NV_LANES) {
            for (int k = 0; k < 4; k++) {
                const nvf kv = nv_load_weight(rows, (j + k) * stride + i, 1);
                for (int r = 0; r < RC; r++) acc[r][k] += nv_loadf(q + r * D + i) * kv;
            }
        }
        for (int r = 0; r < RC; r++) {
            const nvf sums = pa_sum4(acc[r]);
            memcpy(s + r * s_stride + j, &sums, 4 * sizeof(float));
        }
        for (*credit += 4 * RC * head_lines; *credit >= n_rep; *credit -= n_rep) prefetch_line(pf);
    }
    for (; j < n; j++) {
        for (int r = 0; r < RC; r++) {
            float dot = 0.0f;
            for (int64_t i = 0; i < D; i++) dot += q[r * D + i] * bf16_to_f32(((const bf16_t *)rows)[j * stride + i]);
            s[r * s_stride + j] = dot;
        }
        for (*credit += RC * head_lines; *credit >= n_rep; *credit -= n_rep) prefetch_line(pf);
    }
}

#if defined(__AVX512BF16__) && NV_LANES == 16
#define ATTN_DPBF16 1
/* score_heads_bf16 by vdpbf16ps where the build has AVX512_BF16 (D a multiple of 32): the stored
 * bfloat16 query (q_bf16, unscaled) against each key's pairs as they sit in the cache, no widening,
 * half the multiply instructions; the sums times `scale` after. Each product of two bfloat16 values
 * is exact in float32 either way, so the scores differ from the widening path's only in summation
 * order (and the instruction's flush of denormal inputs and sums to zero, far below any score that
 * weighs in the softmax). */
static inline __attribute__((always_inline)) void score_heads_dp(const bf16_t *rows, int64_t stride, int64_t n,
                                                                 const bf16_t *q, const int64_t D, const int RC, float scale,
                                                                 float *s, int64_t s_stride, BlockPrefetch *pf,
                                                                 int64_t *credit, int64_t head_lines, int64_t n_rep) {
    const int64_t QV = D / 32; /* zmm of 32 bfloat16 per head */
    __m512bh qv[3][4];
    for (int r = 0; r < RC; r++)
        for (int64_t c = 0; c < QV && c < 4; c++) qv[r][c] = (__m512bh)_mm512_loadu_si512(q + r * D + c * 32);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        nvf acc[3][4];
        for (int r = 0; r < RC; r++)
            for (int k = 0; k < 4; k++) acc[r][k] = (nvf){0};
        for (int64_t c = 0; c < QV; c++) {
            for (int k = 0; k < 4; k++) {
                const __m512bh kv = (__m512bh)_mm512_loadu_si512(rows + (j + k) * stride + c * 32);
                for (int r = 0; r < RC; r++)
                    acc[r][k] = (nvf)_mm512_dpbf16_ps((__m512)acc[r][k], kv,
                                                      c < 4 ? qv[r][c] : (__m512bh)_mm512_loadu_si512(q + r * D + c * 32));
            }
        }
        for (int r = 0; r < RC; r++) {
            const nvf sums = pa_sum4(acc[r]) * scale;
            memcpy(s + r * s_stride + j, &sums, 4 * sizeof(float));
        }
        for (*credit += 4 * RC * head_lines; *credit >= n_rep; *credit -= n_rep) prefetch_line(pf);
    }
    for (; j < n; j++) {
        for (int r = 0; r < RC; r++) {
            float dot = 0.0f;
            for (int64_t i = 0; i < D; i++) dot += bf16_to_f32(q[r * D + i]) * bf16_to_f32(rows[j * stride + i]);
            s[r * s_stride + j] = dot * scale;
        }
        for (*credit += RC * head_lines; *credit >= n_rep; *credit -= n_rep) prefetch_line(pf);
    }
}
#endif

/* Query heads [h, h + RC) of one KV head (RC <= 3, sum and p those heads' first): sum[r * D + i] +=
 * sum over the block's n keys of p[r * p_stride + j] * rows[j * stride + i] (float32, or BF16:
 * bfloat16 widened here, once for the RC heads, with no float32 copy stored and read back), 4
 * vectors of dims at a time for the RC heads together, each value vector loaded once for them. One head's 8 vectors at a
 * time were bound by the FMA latency (each accumulator took one FMA per key: 5 cycles a key on Zen 2)
 * and, as a float array, kept in memory by GCC. The next block pass's lines go out as the keys are
 * read (head_lines per key and head, over n_rep; see attend_blocks; *credit here in lines x D). */
static inline __attribute__((always_inline)) void weigh_values(const void *rows, int64_t stride, int64_t n, const float *p,
                                                               int64_t p_stride, float *sum, const int64_t D, const int RC,
                                                               const int BF16, BlockPrefetch *pf, int64_t *credit, int64_t head_lines,
                                                               int64_t n_rep) {
    for (int64_t d0 = 0; d0 < D; d0 += 4 * NV_LANES) {
        const int64_t m = (D - d0 < 4 * NV_LANES ? D - d0 : 4 * NV_LANES) / NV_LANES;
        nvf sv[3][4];
        for (int r = 0; r < RC; r++)
            for (int c = 0; c < 4; c++) sv[r][c] = c < m ? nv_loadf(sum + r * D + d0 + c * NV_LANES) : (nvf){0};
        for (int64_t j = 0; j < n; j++) {
            /* credit in lines x D: this chunk's m vectors of the RC rows' head_lines, spread over
             * every chunk (all on the first chunk, twice the rate, made cold float32 calls 1.1-1.2x
             * slower, as denser spreading did before) */
            for (*credit += RC * head_lines * m * NV_LANES; *credit >= n_rep * D; *credit -= n_rep * D) prefetch_line(pf);
            nvf w[3];
            for (int r = 0; r < RC; r++) w[r] = (nvf){0} + p[r * p_stride + j];
            for (int c = 0; c < 4; c++)
                if (c < m) {
                    const nvf v = nv_load_weight(rows, j * stride + d0 + c * NV_LANES, BF16);
                    for (int r = 0; r < RC; r++) sv[r][c] += w[r] * v;
                }
        }
        for (int r = 0; r < RC; r++)
            for (int c = 0; c < 4; c++)
                if (c < m) nv_storef(sum + r * D + d0 + c * NV_LANES, sv[r][c]);
    }
}

#ifdef ATTN_DPBF16
/* Two keys' rows of 32 bfloat16 dims (a, and b the next key's, zero past a run) as vdpbf16ps pairs
 * (key a's value low, b's high) per dim: *lo dims 0-15, *hi dims 16-31, in order. */
static inline __attribute__((always_inline)) void key_pairs(__m512i a, __m512i b, __m512i *lo, __m512i *hi) {
    const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                            39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    *lo = _mm512_permutex2var_epi16(a, lo_idx, b);
    *hi = _mm512_permutex2var_epi16(a, _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16)), b);
}

/* weigh_values for bfloat16 values by vdpbf16ps (AVX512_BF16; D a multiple of 64): keys in pairs,
 * each pair's two value rows interleaved by vpermt2w into (key j, key j + 1) pairs per dim, times
 * the pair of their weights rounded to bfloat16, as torch's CPU flash attention rounds its
 * probabilities before their product with V (the weights' sum, sum_out, stays in float32). Half the
 * multiply instructions and no widening. */
static inline __attribute__((always_inline)) void weigh_values_dp(const bf16_t *rows, int64_t stride, int64_t n, const float *p,
                                                                  int64_t p_stride, float *sum, const int64_t D, const int RC,
                                                                  BlockPrefetch *pf, int64_t *credit, int64_t head_lines,
                                                                  int64_t n_rep) {
    const int64_t pairs = (n + 1) / 2;
    uint32_t pp[3][pairs]; /* head r's weights as bfloat16 pairs (key 2i low, 2i + 1 high; 0 past n) */
    for (int r = 0; r < RC; r++) {
        bf16_t *w = (bf16_t *)pp[r];
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) _mm256_storeu_si256((__m256i *)(w + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + r * p_stride + j)));
        for (; j < n; j++) w[j] = f32_to_bf16(p[r * p_stride + j]);
        if (n & 1) w[n] = 0;
    }
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        __m512 sv[3][4];
        for (int r = 0; r < RC; r++)
            for (int c = 0; c < 4; c++) sv[r][c] = _mm512_loadu_ps(sum + r * D + d0 + c * 16);
        for (int64_t i = 0; i < pairs; i++) {
            const int64_t j = 2 * i;
            for (*credit += 2 * RC * head_lines * 64; *credit >= n_rep * D; *credit -= n_rep * D) prefetch_line(pf);
            const bf16_t *v0 = rows + j * stride + d0;
            __m512bh w[3];
            for (int r = 0; r < RC; r++) w[r] = (__m512bh)_mm512_set1_epi32((int)pp[r][i]);
            for (int c = 0; c < 2; c++) {
                const __m512i a = _mm512_loadu_si512(v0 + c * 32);
                const __m512i b = j + 1 < n ? _mm512_loadu_si512(v0 + stride + c * 32) : _mm512_setzero_si512();
                __m512i lo, hi;
                key_pairs(a, b, &lo, &hi);
                for (int r = 0; r < RC; r++) {
                    sv[r][2 * c] = _mm512_dpbf16_ps(sv[r][2 * c], (__m512bh)lo, w[r]);
                    sv[r][2 * c + 1] = _mm512_dpbf16_ps(sv[r][2 * c + 1], (__m512bh)hi, w[r]);
                }
            }
        }
        for (int r = 0; r < RC; r++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(sum + r * D + d0 + c * 16, sv[r][c]);
    }
}
#endif

/* Blocks [blk_begin, blk_end) of one sequence of len keys: per head, the largest score max[h],
 * sum[h] = sum of exp(score - max[h]) and acc[h] = the values weighted by those exps (unnormalised).
 * Loops run block outermost (a block is one contiguous run: read in order, the next one prefetched),
 * then KV head, then the query heads sharing it: a block's keys (or values) of one KV head come from
 * memory once and from L1 for the other query heads, and each head's running sum stays in
 * registers over the block. */
static inline __attribute__((always_inline)) void attend_blocks(
    const AttendArgs *a, const float *qf, int64_t len, int64_t blk_begin, int64_t blk_end, const int64_t D,
    float *scores, float *max_out, float *sum_out, float *acc, DecodeTasks *queue, int64_t *next_task) {
    const int64_t heads = a->heads, n_rep = a->n_rep, bs = a->block_size, first_key = blk_begin * bs;
    const int64_t last_key = blk_end * bs < len ? blk_end * bs : len, n_keys = last_key - first_key;
    const int64_t kv_heads = heads / n_rep, es = a->bf16 ? 2 : 4;
    const size_t block_bytes = a->slot_bytes * bs;
    float conv[bs][D]; /* bfloat16: one block of one KV head in float32 */
    /* block pass i of the task's stream: K block blk_begin + i, then (i >= blocks) V block i - blocks */
    const int64_t blocks = blk_end - blk_begin;
#define BLOCK_PASS(i) (((i) < blocks ? a->k_cache : a->v_cache) + (size_t)a->table[blk_begin + (i) % blocks] * block_bytes)
    /* the passes before the spread prefetch's first (the claim before it prefetched at most part of the first) */
    for (int64_t i = 0; i < PREFETCH_PASSES_AHEAD && i < 2 * blocks; i++) prefetch_block(BLOCK_PASS(i), block_bytes);
    int claimed = 0; /* the thread's next task */
    const int64_t head_lines = (D * es + 63) / 64; /* a slot's lines of one KV head */
    for (int pass = 0; pass < 2; pass++) { /* 0: scores from K; 1: values weighted by them */
        const char *cache = pass == 0 ? a->k_cache : a->v_cache;
        if (pass == 1) {
            for (int64_t h = 0; h < heads; h++) {
                float *s = scores + h * n_keys, max = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : max)
                for (int64_t t = 0; t < n_keys; t++) max = s[t] > max ? s[t] : max;
#pragma omp simd reduction(+ : sum)
                for (int64_t t = 0; t < n_keys; t++) {
                    /* below e^-46 a weight is < 1e-20 of the largest: dropping it changes no float
                     * sum, and keeps denormal products (slow on x86) out of the loop */
                    s[t] = s[t] - max < -46.0f ? 0.0f : exp_approx(s[t] - max);
                    sum += s[t];
                }
                max_out[h] = max;
                sum_out[h] = sum;
                memset(acc + h * D, 0, (size_t)D * sizeof(float));
            }
        }
        for (int64_t blk = blk_begin; blk < blk_end; blk++) {
            /* the next block pass, spread evenly over this one's key rows: a slot's head_lines of
             * one KV head shared out over its n_rep query heads' rows (credit counts them), so its
             * last lines go out with this block's last rows. Faster was slower: 2 lines a row
             * (float32 9/3 heads of 64) 1.2x, all of a row's lines on a KV head's first head's rows
             * (bfloat16) 1.08x. */
            const int64_t ahead = pass * blocks + (blk - blk_begin) + PREFETCH_PASSES_AHEAD;
            BlockPrefetch pf = {NULL, NULL};
            int64_t credit = 0;
            if (ahead < 2 * blocks) {
                pf = (BlockPrefetch){BLOCK_PASS(ahead), BLOCK_PASS(ahead) + block_bytes};
            } else if (!claimed) { /* past the task's last pass: the thread's next task is claimed now, its first K block read ahead */
                claimed = 1;
                const char *first = NULL;
                *next_task = claim_task(queue, a->k_cache, block_bytes, &first);
                if (first) pf = (BlockPrefetch){first, first + block_bytes};
            }
            for (int64_t g = 0; g < kv_heads; g++) {
                const char *block = cache + (size_t)a->table[blk] * block_bytes + (size_t)(g * D * es);
                const int64_t n = last_key - blk * bs < bs ? last_key - blk * bs : bs, t0 = blk * bs - first_key;
                const float *rows_f32 = (const float *)block; /* slot j's head g at j * slot_elems */
                int64_t stride = a->slot_elems;
                const int own_widening = D % NV_LANES == 0; /* score_heads_bf16 and weigh_values widen their own */
                if (a->bf16 && !own_widening) { /* load_row: vector rows on AVX-512 and AVX2 (vec.h) */
                    for (int64_t j = 0; j < n; j++) load_row(conv[j], block + (size_t)j * a->slot_bytes, D, 1);
                    rows_f32 = &conv[0][0];
                    stride = D;
                }
                for (int64_t h = g * n_rep; h < (g + 1) * n_rep; h++) {
                    if (pass == 0 && a->bf16 && own_widening) {
                        const int64_t rc = (g + 1) * n_rep - h < 3 ? (g + 1) * n_rep - h : 3;
                        float *s = scores + h * n_keys + t0;
#ifdef ATTN_DPBF16
                        if (D % 32 == 0) {
                            const bf16_t *kb = (const bf16_t *)block, *qb = a->q_bf16 + h * D;
                            if (rc == 3)
                                score_heads_dp(kb, a->slot_elems, n, qb, D, 3, a->scale, s, n_keys, &pf, &credit, head_lines, n_rep);
                            else if (rc == 2)
                                score_heads_dp(kb, a->slot_elems, n, qb, D, 2, a->scale, s, n_keys, &pf, &credit, head_lines, n_rep);
                            else
                                score_heads_dp(kb, a->slot_elems, n, qb, D, 1, a->scale, s, n_keys, &pf, &credit, head_lines, n_rep);
                            h += rc - 1;
                            continue;
                        }
#endif
                        if (rc == 3)
                            score_heads_bf16(block, a->slot_elems, n, qf + h * D, D, 3, s, n_keys, &pf, &credit, head_lines, n_rep);
                        else if (rc == 2)
                            score_heads_bf16(block, a->slot_elems, n, qf + h * D, D, 2, s, n_keys, &pf, &credit, head_lines, n_rep);
                        else
                            score_heads_bf16(block, a->slot_elems, n, qf + h * D, D, 1, s, n_keys, &pf, &credit, head_lines, n_rep);
                        h += rc - 1;
                        continue;
                    }
                    if (pass == 0) {
                        const float *qh = qf + h * D;
                        float *s = scores + h * n_keys + t0;
                        int64_t j = 0;
                        /* NV_LANES keys' dot products at once, in as many accumulators, summed across
                         * by one transposing add tree (pa_sum_lanes): one key at a time ended each dot
                         * product in a horizontal sum and its 8 FMAs in one dependent chain */
                        if (D % NV_LANES == 0)
                            for (; j + NV_LANES <= n; j += NV_LANES) {
                                nvf part[NV_LANES];
                                for (int k = 0; k < NV_LANES; k++) part[k] = (nvf){0};
                                for (int64_t i = 0; i < D; i += NV_LANES) {
                                    const nvf qv = nv_loadf(qh + i);
                                    for (int k = 0; k < NV_LANES; k++) part[k] += qv * nv_loadf(rows_f32 + (j + k) * stride + i);
                                }
                                nv_storef(s + j, pa_sum_lanes(part));
                                for (credit += NV_LANES * head_lines; credit >= n_rep; credit -= n_rep) prefetch_line(&pf);
                            }
                        for (; j < n; j++) {
                            const float *kv = rows_f32 + j * stride;
                            for (credit += head_lines; credit >= n_rep; credit -= n_rep) prefetch_line(&pf);
                            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                            for (int64_t i = 0; i < D; i++) dot += qh[i] * kv[i];
                            s[j] = dot;
                        }
                    } else {
                        const float *p = scores + h * n_keys + t0;
                        float *sum = acc + h * D;
                        if (D % NV_LANES == 0) {
                            const int64_t rc = (g + 1) * n_rep - h < 3 ? (g + 1) * n_rep - h : 3;
#define WEIGH(RC, BF16) weigh_values(block, a->slot_elems, n, p, n_keys, sum, D, RC, BF16, &pf, &credit, head_lines, n_rep)
#ifdef ATTN_DPBF16
#define WEIGH_DP(RC) weigh_values_dp((const bf16_t *)block, a->slot_elems, n, p, n_keys, sum, D, RC, &pf, &credit, head_lines, n_rep)
                            if (a->bf16 && D % 64 == 0)
                                rc == 3 ? WEIGH_DP(3) : rc == 2 ? WEIGH_DP(2) : WEIGH_DP(1);
                            else /* the widening path below */
#endif
                            if (a->bf16)
                                rc == 3 ? WEIGH(3, 1) : rc == 2 ? WEIGH(2, 1) : WEIGH(1, 1);
                            else
                                rc == 3 ? WEIGH(3, 0) : rc == 2 ? WEIGH(2, 0) : WEIGH(1, 0);
#undef WEIGH
#ifdef ATTN_DPBF16
#undef WEIGH_DP
#endif
                            h += rc - 1;
                        } else {
                            for (int64_t j = 0; j < n; j++) {
                                const float *kv = rows_f32 + j * stride, w = p[j];
                                for (credit += head_lines; credit >= n_rep; credit -= n_rep) prefetch_line(&pf);
#pragma omp simd
                                for (int64_t i = 0; i < D; i++) sum[i] += w * kv[i];
                            }
                        }
                    }
                }
            }
        }
    }
    if (!claimed) *next_task = claim_task(queue, a->k_cache, block_bytes, NULL);
}
#undef BLOCK_PASS

/* The batch-invariant mode's split: a sequence's blocks in ranges of about this many, however many
 * sequences the call has (the ranges' softmax merge then sums in the same order alone or batched). */
#define INVARIANT_BLOCKS_PER_TASK 16

/* invariant: split each sequence by its own length only (INVARIANT_BLOCKS_PER_TASK), not by how many
 * sequences share the call. Returns KERNEL_OK, or KERNEL_NO_MEMORY when its scratch cannot be
 * allocated (out is then undefined). */
static int decode_attention_impl(int bf16, const void *q, int64_t q_stride, void *out, const int64_t *rows,
                                 const void *k_cache, const void *v_cache, const int32_t *block_tables,
                                 int64_t max_blocks, const int32_t *seq_lens, int64_t num_seqs, int64_t heads,
                                 int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale, int num_threads,
                                 int invariant) {
    const size_t es = elem_size(bf16);
    const int64_t D = head_dim;
    /* tasks: sequence b owns tasks [task_begin[b], task_begin[b + 1]), each a range of its blocks */
    const int64_t want_splits = num_seqs < 2 * num_threads ? (2 * num_threads + num_seqs - 1) / num_seqs : 1;
    int64_t *task_begin = kernel_malloc((size_t)(num_seqs + 1) * sizeof(int64_t));
    if (!task_begin) return KERNEL_NO_MEMORY;
    int64_t total_keys = 0;
    task_begin[0] = 0;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t blocks = (seq_lens[b] + block_size - 1) / block_size;
        const int64_t most = (blocks + MIN_BLOCKS_PER_TASK - 1) / MIN_BLOCKS_PER_TASK;
        const int64_t splits = invariant ? (blocks + INVARIANT_BLOCKS_PER_TASK - 1) / INVARIANT_BLOCKS_PER_TASK
                                         : (want_splits < most ? want_splits : most);
        task_begin[b + 1] = task_begin[b] + (splits > 0 ? splits : 1);
        total_keys += seq_lens[b];
    }
    const int64_t tasks = task_begin[num_seqs], part = heads * (D + 2); /* per task: max, sum, acc */
    float *parts = kernel_malloc((size_t)(tasks * part) * sizeof(float));
    if (!parts) {
        free(task_begin);
        return KERNEL_NO_MEMORY;
    }
    int out_of_memory = 0; /* set by any task whose scores cannot be allocated; the others still run */
    const AttendArgs args = {(const char *)k_cache, (const char *)v_cache, NULL, heads, heads / kv_heads, block_size,
                             kv_heads * D, (size_t)kv_heads * D * es, bf16};
    DecodeTasks queue = {0, tasks, task_begin, seq_lens, block_tables, max_blocks, block_size};
#pragma omp parallel num_threads(num_threads) if (tasks > 1 && total_keys * heads * D >= PARALLEL_MIN_ELEMS)
    {
        int64_t task = claim_task(&queue, NULL, 0, NULL);
        while (task < tasks) {
            int64_t b, blk_begin, blk_end;
            task_blocks(&queue, task, &b, &blk_begin, &blk_end);
            const int64_t len = seq_lens[b];
            AttendArgs a = args;
            a.table = block_tables + b * max_blocks;
            float qf[heads * D];
            const char *q_row = (const char *)q + (size_t)rows[b] * q_stride * es;
            load_row(qf, q_row, heads * D, bf16);
            a.q_bf16 = bf16 ? (const bf16_t *)q_row : NULL;
            a.scale = scale;
#pragma omp simd
            for (int64_t i = 0; i < heads * D; i++) qf[i] *= scale;
            float *scores = kernel_malloc((size_t)(heads * (blk_end - blk_begin) * block_size) * sizeof(float));
            if (!scores) {
                __atomic_store_n(&out_of_memory, 1, __ATOMIC_RELAXED);
                task = claim_task(&queue, NULL, 0, NULL);
                continue;
            }
            float *mine = parts + task * part;
            if (D == 64)
                attend_blocks(&a, qf, len, blk_begin, blk_end, 64, scores, mine, mine + heads, mine + 2 * heads, &queue, &task);
            else if (D == 128)
                attend_blocks(&a, qf, len, blk_begin, blk_end, 128, scores, mine, mine + heads, mine + 2 * heads, &queue, &task);
            else
                attend_blocks(&a, qf, len, blk_begin, blk_end, D, scores, mine, mine + heads, mine + 2 * heads, &queue, &task);
            free(scores);
        }
    }
    if (out_of_memory) {
        free(parts);
        free(task_begin);
        return KERNEL_NO_MEMORY;
    }
    for (int64_t b = 0; b < num_seqs; b++) { /* merge each sequence's ranges; normalise */
        char *out_row = (char *)out + (size_t)rows[b] * heads * D * es;
        float merged[D];
        for (int64_t h = 0; h < heads; h++) {
            float max = -INFINITY, sum = 0.0f;
            for (int64_t task = task_begin[b]; task < task_begin[b + 1]; task++) {
                const float m = parts[task * part + h];
                max = m > max ? m : max;
            }
            memset(merged, 0, sizeof(merged));
            for (int64_t task = task_begin[b]; task < task_begin[b + 1]; task++) {
                const float *p = parts + task * part;
                const float weight = expf(p[h] - max), *acc = p + 2 * heads + h * D;
                sum += weight * p[heads + h];
#pragma omp simd
                for (int64_t i = 0; i < D; i++) merged[i] += weight * acc[i];
            }
            const float inv_sum = 1.0f / sum;
#pragma omp simd
            for (int64_t i = 0; i < D; i++) merged[i] *= inv_sum;
            store_row(out_row + (size_t)h * D * es, merged, D, bf16);
        }
    }
    free(parts);
    free(task_begin);
    return KERNEL_OK;
}


int paged_decode_attention(int bf16, const void *q, int64_t q_stride, void *out, const int64_t *rows,
                           const void *k_cache, const void *v_cache, const int32_t *block_tables,
                           int64_t max_blocks, const int32_t *seq_lens, int64_t num_seqs, int64_t heads,
                           int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale, int num_threads) {
    return decode_attention_impl(bf16, q, q_stride, out, rows, k_cache, v_cache, block_tables, max_blocks, seq_lens,
                                 num_seqs, heads, kv_heads, head_dim, block_size, scale, num_threads, 0);
}

/* paged_decode_attention for the batch-invariant mode: the same signature (the compiled decode step
 * calls either by address), each sequence's result independent of the others in the call. */
int paged_decode_attention_invariant(int bf16, const void *q, int64_t q_stride, void *out, const int64_t *rows,
                                     const void *k_cache, const void *v_cache, const int32_t *block_tables,
                                     int64_t max_blocks, const int32_t *seq_lens, int64_t num_seqs, int64_t heads,
                                     int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
                                     int num_threads) {
    return decode_attention_impl(bf16, q, q_stride, out, rows, k_cache, v_cache, block_tables, max_blocks, seq_lens,
                                 num_seqs, heads, kv_heads, head_dim, block_size, scale, num_threads, 1);
}

/* ------------------------------------------------------------------------------------------ paged attention
 * Many sequences' new tokens, prefill chunks and decodes alike, in one call (vLLM's CPU backend does
 * the same): sequence b's are rows row_start[b] .. row_start[b] + new_tokens[b] of qkv and out, the
 * last of its seq_lens[b] keys; token t of them sits at position seq_lens[b] - n_new + t and sees
 * keys 0 .. that position (its cached prefix and the chunk up to itself). K/V are read in place
 * through the block table: no gather, no repeat_kv, no mask materialised.
 *
 * Work items: (sequence, KV head, tile of up to PA_TILE_ROWS query rows, or one token's n_rep rows
 * if that is more), a query row being one (token, query head) of the n_rep heads sharing the KV
 * head, so a tile's keys and values are converted to float32 once and used by every row. Keys go 16 at a time (never across a block):
 * a row's 16 scores come from 16 vector dot products and one transposing add tree (no horizontal
 * sum per key), then an online softmax (flash attention) keeps a running max, sum and weighted
 * values per row. head_dim a multiple of 16. In AVX2 and AVX-512 builds, items of PA_GEMM_MIN_ROWS or more
 * query rows (prefill chunks) take pa_tile_gemm instead: the same maths as small register-tiled
 * GEMMs. bfloat16 caches on AMX CPUs take paged_attention_amx
 * (below) instead, which also beats torch's SDPA on prefill chunks. Which steps CpuKernelBackend
 * hands this path: paged_attention_takes_decodes and paged_attention_takes_chunks (the end of this
 * file). */
#define PA_TILE_ROWS 48
#define PA_KEYS 16

/* Spelled in the build's native vector (vec.h's nvf: one zmm on AVX-512, one ymm on AVX, one xmm
 * below). vec.h's 16-lane v16f is two or four registers there, and GCC lowered this kernel's 16-lane
 * shuffles lane by lane through the stack (scalar inserts): 2x paged_decode_attention's time on an
 * AVX2 Zen 2 (bench/NOTES.md 'AVX2 paged attention'). In native vectors the code is the same at every
 * level; the AVX-512 build does the same operations in the same order as before (same bits). */
typedef float pa_vec_u __attribute__((vector_size(NV_LANES * 4), aligned(4))); /* a float32 cache row read in place */

/* A row of D values as D / NV_LANES float32 vectors, bfloat16 ones in the kernel's lane order: each
 * run of 2 * NV_LANES values as its even-indexed then its odd-indexed values (a 32-bit lane holds one
 * of each: the odd one is the lane with its low half cleared, the even one the lane shifted up; no
 * widening shuffle, which would compete with the add tree's shuffles for the one port that runs
 * them). Dot products and weighted sums do not depend on the order as long as q, K, V and the output
 * share it; pa_unpermute puts the output back. A last run of NV_LANES values is widened as is. */
static inline void pa_load_row(nvf *dst, const char *src, int64_t DV, int bf16) {
    if (!bf16) {
        memcpy(dst, src, (size_t)DV * sizeof(nvf));
        return;
    }
    int64_t c = 0;
    for (; c + 2 <= DV; c += 2) {
        nvu u;
        memcpy(&u, src + c * 2 * NV_LANES, sizeof(u));
        const nvu even = u << 16, odd = u & 0xffff0000u;
        memcpy(&dst[c], &even, sizeof(even));
        memcpy(&dst[c + 1], &odd, sizeof(odd));
    }
    if (c < DV) {
        nvh h;
        memcpy(&h, src + c * 2 * NV_LANES, sizeof(h));
        const nvu u = __builtin_convertvector(h, nvu) << 16;
        memcpy(&dst[c], &u, sizeof(u));
    }
}

/* A row of D float32 values from pa_load_row's lane order (bfloat16) back to D values in order. */
static inline void pa_unpermute(float *dst, const nvf *src, int64_t DV, int bf16) {
    const float *f = (const float *)src;
    int64_t c = 0;
    if (bf16)
        for (; c + 2 <= DV; c += 2)
            for (int64_t i = 0; i < NV_LANES; i++) {
                dst[c * NV_LANES + 2 * i] = f[c * NV_LANES + i];
                dst[c * NV_LANES + 2 * i + 1] = f[(c + 1) * NV_LANES + i];
            }
    memcpy(dst + c * NV_LANES, f + c * NV_LANES, (size_t)(DV - c) * NV_LANES * sizeof(float));
}

typedef struct {
    const char *k_cache, *v_cache;
    int64_t n_rep, block_size, slot_elems, q_stride, out_stride; /* elements */
    int bf16;
    float scale;
} PagedArgs;

/* Keys in the run starting at key0: up to PA_KEYS, never past the block or the last key. */
static inline int64_t pa_run_length(int64_t key0, int64_t n_keys, int64_t block_size) {
    const int64_t left = n_keys - key0, in_block = block_size - key0 % block_size;
    const int64_t n = left < in_block ? left : in_block;
    return n < PA_KEYS ? n : PA_KEYS;
}

/* The next run's K and V rows of one KV head, prefetched a line pair (K's and V's) at a time spread
 * evenly over this run's rows (pa_tile), as paged_decode_attention's BlockPrefetch: the run's 128
 * prefetches in one burst at its start (float32, heads of 64) filled Zen 2's ~22 L1 miss buffers
 * and stalled the maths behind them (32 decodes x 160 keys cold: 1.18x float32, 1.24x bfloat16;
 * bench/NOTES.md 'Decode attention: reads overlapped with the maths'). Into L2, as BlockPrefetch's
 * (PREFETCH_LOCALITY): on Zen 4, 1 thread, cold, 4 x 2048 and 32 x 160 decodes float32 1.43-1.55x,
 * bfloat16 1.14-1.22x. */
typedef struct {
    const char *k, *v; /* the slot being prefetched, at its line `line` */
    size_t slot_bytes;
    int64_t head_lines, line, slots_left;
} PaRunPrefetch;

static inline void pa_prefetch_pair(PaRunPrefetch *pf) {
    if (pf->slots_left <= 0) return;
    __builtin_prefetch(pf->k + pf->line * 64, 0, PREFETCH_LOCALITY);
    __builtin_prefetch(pf->v + pf->line * 64, 0, PREFETCH_LOCALITY);
    if (++pf->line == pf->head_lines) {
        pf->line = 0;
        pf->slots_left--;
        pf->k += pf->slot_bytes, pf->v += pf->slot_bytes;
    }
}

/* Byte offset in a cache of key `key`'s slot for one KV head (head_off into the slot), through the
 * sequence's block table. */
static inline size_t pa_slot_offset(const int32_t *table, int64_t key, int64_t block_size, size_t slot_bytes,
                                    size_t head_off) {
    return ((size_t)table[key / block_size] * block_size + key % block_size) * slot_bytes + head_off;
}

/* The prefetch of the run after the one at key0 (n keys): its K/V rows while this run computes (they
 * come back from memory: the layer's weights evicted them); none past the last key. */
static inline PaRunPrefetch pa_next_run_prefetch(const PagedArgs *a, const int32_t *table, int64_t key0, int64_t n,
                                                 int64_t n_keys, size_t slot_bytes, size_t head_off,
                                                 int64_t head_lines) {
    const int64_t key1 = key0 + n;
    if (key1 >= n_keys) return (PaRunPrefetch){NULL, NULL, slot_bytes, head_lines, 0, 0};
    const size_t next = pa_slot_offset(table, key1, a->block_size, slot_bytes, head_off);
    return (PaRunPrefetch){a->k_cache + next, a->v_cache + next, slot_bytes, head_lines, 0,
                           pa_run_length(key1, n_keys, a->block_size)};
}

/* Vectors of a row's weighted values accumulated at once (pa_tile): they stay in registers while
 * the run's keys stream past, instead of one dependent chain of FMAs per vector. */
#define PA_ACC_VECS 8

/* One work item: query rows [tok0, tok1) x the n_rep heads of KV head g of one sequence. */
static inline __attribute__((always_inline)) void pa_tile(const PagedArgs *a, const int64_t D, const char *q,
                                                          char *out, const int32_t *table, int64_t prefix,
                                                          int64_t tok0, int64_t tok1, int64_t g) {
    const int64_t n_rep = a->n_rep, rows = (tok1 - tok0) * n_rep, bs = a->block_size, DV = D / NV_LANES;
    const size_t es = a->bf16 ? 2 : 4, slot_bytes = (size_t)a->slot_elems * es, head_off = (size_t)(g * D) * es;
    const int64_t n_keys = prefix + tok1, head_lines = (D * (int64_t)es + 63) / 64; /* the tile's last token sees them all */
    /* rows <= PA_TILE_ROWS, or n_rep when that is more (one token per tile) */
    nvf qv[rows][DV], acc[rows][DV], kf[PA_KEYS][DV], vf[PA_KEYS][DV], zeros[DV];
    /* a run's K and V rows: float32 ones read in place in the cache (a copy cost more than the maths
     * for a decode's few query rows), bfloat16 ones widened into kf / vf; keys past the run: zeros */
    const pa_vec_u *kr[PA_KEYS], *vr[PA_KEYS];
    float row_max[rows], row_sum[rows];
    for (int64_t c = 0; c < DV; c++) zeros[c] = (nvf){0};
    for (int64_t r = 0; r < rows; r++) { /* row r: token tok0 + r / n_rep, head g * n_rep + r % n_rep */
        const char *src = q + ((size_t)((tok0 + r / n_rep) * a->q_stride) + (size_t)((g * n_rep + r % n_rep) * D)) * es;
        pa_load_row(qv[r], src, DV, a->bf16);
        for (int64_t c = 0; c < DV; c++) {
            qv[r][c] *= a->scale;
            acc[r][c] = (nvf){0};
        }
        row_max[r] = -INFINITY;
        row_sum[r] = 0.0f;
    }
    for (int64_t key0 = 0; key0 < n_keys;) {
        const int64_t n = pa_run_length(key0, n_keys, bs);
        const size_t first = pa_slot_offset(table, key0, bs, slot_bytes, head_off);
        PaRunPrefetch pf = pa_next_run_prefetch(a, table, key0, n, n_keys, slot_bytes, head_off, head_lines);
        /* ticks: a row's dot products count DV per NV_LANES keys, its weighted values one per key */
        const int64_t ticks = rows * (PA_KEYS / NV_LANES * DV + n), pairs = pf.slots_left * head_lines;
        int64_t credit = 0;
#define PA_TICK(count) for (credit += (count) * pairs; credit >= ticks; credit -= ticks) pa_prefetch_pair(&pf)
        for (int64_t j = 0; j < n; j++) {
            const char *k = a->k_cache + first + j * slot_bytes, *v = a->v_cache + first + j * slot_bytes;
            if (a->bf16) {
                pa_load_row(kf[j], k, DV, 1);
                pa_load_row(vf[j], v, DV, 1);
                k = (const char *)kf[j], v = (const char *)vf[j];
            }
            kr[j] = (const pa_vec_u *)k, vr[j] = (const pa_vec_u *)v;
        }
        for (int64_t j = n; j < PA_KEYS; j++) kr[j] = vr[j] = (const pa_vec_u *)zeros; /* scores of keys past the run: masked */
        for (int64_t r = 0; r < rows; r++) {
            const int64_t visible = prefix + tok0 + r / n_rep - key0 + 1; /* keys of this run row r sees */
            if (visible <= 0) continue;
            const int64_t m = visible < n ? visible : n;
            float s[PA_KEYS];
            for (int64_t k0 = 0; k0 < PA_KEYS; k0 += NV_LANES) { /* NV_LANES keys' dot products, then their sums */
                nvf p[NV_LANES];
                for (int64_t j = 0; j < NV_LANES; j++) p[j] = qv[r][0] * kr[k0 + j][0];
                for (int64_t c = 1; c < DV; c++) /* q's vector once for the keys (c outermost): a load per FMA, not two */
                    for (int64_t j = 0; j < NV_LANES; j++) p[j] += qv[r][c] * kr[k0 + j][c];
                PA_TICK(DV);
                const nvf scores = pa_sum_lanes(p);
                memcpy(s + k0, &scores, sizeof(scores));
            }
            float new_max = row_max[r];
#pragma omp simd reduction(max : new_max)
            for (int64_t j = 0; j < PA_KEYS; j++) {
                s[j] = j < m ? s[j] : -INFINITY; /* keys past the row's position or the run */
                new_max = s[j] > new_max ? s[j] : new_max;
            }
            const float rescale = row_max[r] == -INFINITY ? 0.0f : exp_approx(row_max[r] - new_max);
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < PA_KEYS; j++) {
                /* masked keys weigh 0; below e^-46 a weight changes no float sum (and keeps denormal
                 * products out of the loop), as in paged_decode_attention */
                s[j] = s[j] - new_max < -46.0f ? 0.0f : exp_approx(s[j] - new_max);
                sum += s[j];
            }
            row_sum[r] = row_sum[r] * rescale + sum;
            row_max[r] = new_max;
            for (int64_t c0 = 0; c0 < DV; c0 += PA_ACC_VECS) { /* each vector's sum in key order, as one chain did */
                const int64_t nc = DV - c0 < PA_ACC_VECS ? DV - c0 : PA_ACC_VECS;
                nvf o[PA_ACC_VECS];
                for (int64_t c = 0; c < nc; c++) o[c] = acc[r][c0 + c] * rescale;
                for (int64_t j = 0; j < m; j++) {
                    if (c0 == 0) PA_TICK(1);
                    for (int64_t c = 0; c < nc; c++) o[c] += vr[j][c0 + c] * s[j];
                }
                for (int64_t c = 0; c < nc; c++) acc[r][c0 + c] = o[c];
            }
        }
#undef PA_TICK
        while (pf.slots_left > 0) pa_prefetch_pair(&pf); /* rows that saw fewer keys left some */
        key0 += n;
    }
    for (int64_t r = 0; r < rows; r++) {
        char *dst = out + ((size_t)((tok0 + r / n_rep) * a->out_stride) + (size_t)((g * n_rep + r % n_rep) * D)) * es;
        const float inv_sum = 1.0f / row_sum[r];
        float o[D];
        for (int64_t c = 0; c < DV; c++) acc[r][c] *= inv_sum;
        pa_unpermute(o, acc[r], DV, a->bf16);
        store_row(dst, o, D, a->bf16);
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* ------------------------------------------------------------------------------------------ paged attention as small GEMMs (AVX2)
 * 256-bit code in the AVX-512 builds too: Zen 4 runs a 512-bit FMA as two 256-bit halves, and the
 * tiles' 12 accumulators and broadcasts were sized for 16 ymm registers.
 * pa_tile for items with many query rows (prefill chunks): per run of 16 keys, S^T = K Q^T and then
 * O += P V as register-tiled small GEMMs, as gemm.c's 6x16 tile, instead of a dot product and an
 * add tree per (row, key). pa_tile leaves most of the FMA rate unused there: a row's 16 scores
 * cost 16 dot products plus a transposing add tree, and its softmax runs one row at a time.
 * - Q^T [D][rows] is packed once per item, so a run's K rows are read as they lie in the cache (no
 *   per-run transpose): a 4-key x 24-row tile of scores takes each K element as a broadcast and Q^T
 *   as 3 vectors a dim step (12 ymm accumulators).
 * - The scores land as S^T [16 keys][rows]: a vector holds 8 rows' scores of one key, so the online
 *   softmax (running max, sum, rescale per row) and the causal mask run across rows, 8 at a time,
 *   with no horizontal operation.
 * - O [rows][D] += P V in 6-row x 16-dim tiles: P's weights broadcast, the run's V rows read in place
 *   (2 vectors a key), each O tile rescaled as it is loaded.
 * Each row's sums still run in key order (the weighted values) and dim order (the scores); the
 * result does not depend on the item's other rows. Decodes (a token's n_rep rows) keep pa_tile. */
#define PA_GEMM 1
#define PA_GEMM_MR 6 /* rows of a P V tile */
#define PA_GEMM_MIN_ROWS (2 * PA_GEMM_MR)
#define PA_GEMM_KEYS 4 /* keys of a scores tile */

/* Keys of the run [key0, key0 + n) that any of rows [r, r + nr) sees (their positions ascend): 0 or less for none. */
static inline int64_t pa_keys_seen(const int32_t *pos, int64_t r, int64_t nr, int64_t key0, int64_t n) {
    const int64_t seen = pos[r + nr - 1] - key0 + 1;
    return seen < n ? seen : n;
}

/* exp_approx on 8 lanes (the same polynomial), 0 where x < -46 as pa_tile's weights (and for -inf). */
static inline __m256 pa_weights8(__m256 x) {
    const __m256 small = _mm256_cmp_ps(x, _mm256_set1_ps(-46.0f), _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 k = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, k);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(EXP2_C6), f, _mm256_set1_ps(EXP2_C5));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C4));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C3));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C2));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C1));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C0));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(small, _mm256_mul_ps(p, _mm256_castsi256_ps(scale)));
}

/* dst rows k < 8 (dst + k * dst_stride) = column k of the 8 x 8 block at src (rows src_stride apart), times scale. */
static inline void pa_transpose8(const float *src, int64_t src_stride, float *dst, int64_t dst_stride, float scale) {
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * src_stride);
    for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44), u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44), u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    const __m256 sc = _mm256_set1_ps(scale);
    for (int k = 0; k < 4; k++) {
        _mm256_storeu_ps(dst + k * dst_stride, _mm256_mul_ps(_mm256_permute2f128_ps(u[k], u[k + 4], 0x20), sc));
        _mm256_storeu_ps(dst + (k + 4) * dst_stride, _mm256_mul_ps(_mm256_permute2f128_ps(u[k], u[k + 4], 0x31), sc));
    }
}

/* S^T rows [key j][nv vectors of 8 rows] of PA_GEMM_KEYS keys (kr[j]: key j's D values) against Q^T
 * (qt: dim d's rows at qt + d * RB), into st (key j at st + j * RB). */
static inline __attribute__((always_inline)) void pa_scores_tile(const float *const *kr, const float *qt, int64_t RB,
                                                                 int64_t D, float *st, const int nv) {
    __m256 s[PA_GEMM_KEYS][3];
    for (int j = 0; j < PA_GEMM_KEYS; j++)
        for (int v = 0; v < nv; v++) s[j][v] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        __m256 qv[3];
        for (int v = 0; v < nv; v++) {
            qv[v] = _mm256_loadu_ps(qt + d * RB + v * 8);
            /* in a register: GCC otherwise folds the load into each of the 4 keys' FMAs, 16 loads a
             * dim step for 12 FMAs, and the 2 load ports bound the tile */
            __asm__("" : "+x"(qv[v]));
        }
        for (int j = 0; j < PA_GEMM_KEYS; j++) {
            const __m256 k = _mm256_broadcast_ss(kr[j] + d);
            for (int v = 0; v < nv; v++) s[j][v] = _mm256_fmadd_ps(k, qv[v], s[j][v]);
        }
    }
    for (int j = 0; j < PA_GEMM_KEYS; j++)
        for (int v = 0; v < nv; v++) _mm256_storeu_ps(st + j * RB + v * 8, s[j][v]);
}

/* O rows [nr][dims c .. c + 15] (o: row i's dim c at o + i * D) = O * rescale[i] + sum over keys j < m of
 * P[i][j] (pt + j * RB + i) V[j] (vr[j] + c), in key order. */
static inline __attribute__((always_inline)) void pa_values_tile(const float *const *vr, const float *pt, int64_t RB,
                                                                 int64_t m, float *o, int64_t D, int64_t c,
                                                                 const float *rescale, const int nr) {
    __m256 acc[PA_GEMM_MR][2];
    for (int i = 0; i < nr; i++) {
        const __m256 sc = _mm256_broadcast_ss(rescale + i);
        acc[i][0] = _mm256_mul_ps(_mm256_loadu_ps(o + i * D), sc);
        acc[i][1] = _mm256_mul_ps(_mm256_loadu_ps(o + i * D + 8), sc);
    }
    for (int64_t j = 0; j < m; j++) {
        const __m256 v0 = _mm256_loadu_ps(vr[j] + c), v1 = _mm256_loadu_ps(vr[j] + c + 8);
        for (int i = 0; i < nr; i++) {
            const __m256 p = _mm256_broadcast_ss(pt + j * RB + i);
            acc[i][0] = _mm256_fmadd_ps(p, v0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(p, v1, acc[i][1]);
        }
    }
    for (int i = 0; i < nr; i++) {
        _mm256_storeu_ps(o + i * D, acc[i][0]);
        _mm256_storeu_ps(o + i * D + 8, acc[i][1]);
    }
}

/* pa_tile's work item (query rows [tok0, tok1) x the n_rep heads of KV head g) as small GEMMs; rows
 * at least PA_GEMM_MIN_ROWS, D a multiple of 16. */
static inline __attribute__((always_inline)) void pa_tile_gemm(const PagedArgs *a, const int64_t D, const char *q,
                                                               char *out, const int32_t *table, int64_t prefix,
                                                               int64_t tok0, int64_t tok1, int64_t g) {
    const int64_t n_rep = a->n_rep, rows = (tok1 - tok0) * n_rep, RB = (rows + 7) / 8 * 8, RV = RB / 8;
    const int64_t bs = a->block_size;
    const size_t es = a->bf16 ? 2 : 4, slot_bytes = (size_t)a->slot_elems * es, head_off = (size_t)(g * D) * es;
    const int64_t n_keys = prefix + tok1, head_lines = (D * (int64_t)es + 63) / 64;
    /* Q^T [D][RB] scaled (rows past `rows` zero), O [RB][D], S^T then P^T [PA_KEYS][RB] */
    float qt[D * RB], o[RB * D], st[PA_KEYS * RB], row[D], kf[PA_KEYS][D], vf[PA_KEYS][D], zeros[D];
    float row_max[RB], row_sum[RB], rescale[RB];
    int32_t pos[RB]; /* row r sees keys 0 .. pos[r]; rows past `rows` repeat the last one's */
    const float *kr[PA_KEYS], *vr[PA_KEYS];
    memset(zeros, 0, sizeof(zeros));
    memset(o, 0, sizeof(o));
    for (int64_t r = 0, tok = prefix + tok0, rep = 0; r < RB; r++) { /* tok: row r's position (no division a row) */
        pos[r] = (int32_t)tok;
        if (++rep == n_rep && r + 1 < rows) rep = 0, tok++;
        row_max[r] = -INFINITY, row_sum[r] = 0.0f;
    }
    for (int64_t r8 = 0; r8 < RB; r8 += 8) { /* Q^T by 8x8 blocks: one scalar store per element took a
                                              * quarter of a 4 x 128-token step's time */
        float q8[8][D];
        for (int64_t i = 0; i < 8; i++) {
            const int64_t r = r8 + i;
            if (r < rows)
                load_row(q8[i], q + ((size_t)((tok0 + r / n_rep) * a->q_stride) + (size_t)((g * n_rep + r % n_rep) * D)) * es, D, a->bf16);
            else
                memset(q8[i], 0, sizeof(q8[i]));
        }
        for (int64_t d0 = 0; d0 < D; d0 += 8) pa_transpose8(&q8[0][d0], D, qt + d0 * RB + r8, RB, a->scale);
    }
    for (int64_t key0 = 0; key0 < n_keys;) {
        const int64_t n = pa_run_length(key0, n_keys, bs);
        const size_t first = pa_slot_offset(table, key0, bs, slot_bytes, head_off);
        PaRunPrefetch pf = pa_next_run_prefetch(a, table, key0, n, n_keys, slot_bytes, head_off, head_lines);
        for (int64_t j = 0; j < n; j++) {
            const char *k = a->k_cache + first + j * slot_bytes, *v = a->v_cache + first + j * slot_bytes;
            if (a->bf16) {
                load_row(kf[j], k, D, 1);
                load_row(vf[j], v, D, 1);
                k = (const char *)kf[j], v = (const char *)vf[j];
            }
            kr[j] = (const float *)k, vr[j] = (const float *)v;
        }
        for (int64_t j = n; j < PA_KEYS; j++) kr[j] = vr[j] = zeros; /* keys past the run: masked */
        /* rows sorted by position: the first vector with a row that sees key0 (the last row sees all) */
        int64_t v0 = 0;
        while (pos[v0 * 8 + 7] < key0) v0++;
        const int64_t r0 = v0 * 8, key_groups = (n + PA_GEMM_KEYS - 1) / PA_GEMM_KEYS;
        /* the next run's K/V line pairs spread over this run's tiles */
        const int64_t ticks = key_groups * ((RV - v0 + 2) / 3) + (RB - r0 + PA_GEMM_MR - 1) / PA_GEMM_MR * (D / 16);
        const int64_t pairs = pf.slots_left * head_lines;
        int64_t credit = 0;
#define PA_GEMM_TICK() for (credit += pairs; credit >= ticks; credit -= ticks) pa_prefetch_pair(&pf)
        for (int64_t j0 = 0; j0 < n; j0 += PA_GEMM_KEYS)
            for (int64_t v = v0; v < RV; v += 3) {
                const float *qv = qt + v * 8;
                float *sv = st + j0 * RB + v * 8;
                PA_GEMM_TICK();
                switch (RV - v < 3 ? RV - v : 3) {
                case 1: pa_scores_tile(kr + j0, qv, RB, D, sv, 1); break;
                case 2: pa_scores_tile(kr + j0, qv, RB, D, sv, 2); break;
                default: pa_scores_tile(kr + j0, qv, RB, D, sv, 3); break;
                }
            }
        for (int64_t v = v0; v < RV; v++) { /* online softmax, 8 rows at a time */
            const __m256i last = _mm256_loadu_si256((const __m256i *)(pos + v * 8));
            const __m256 old_max = _mm256_loadu_ps(row_max + v * 8);
            __m256 new_max = old_max;
            for (int64_t j = 0; j < n; j++) { /* keys past a row's position: -inf */
                const __m256i seen = _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)(key0 + j)), last);
                const __m256 s = _mm256_blendv_ps(_mm256_loadu_ps(st + j * RB + v * 8), _mm256_set1_ps(-INFINITY), _mm256_castsi256_ps(seen));
                _mm256_storeu_ps(st + j * RB + v * 8, s);
                new_max = _mm256_max_ps(new_max, s);
            }
            const __m256 sc = pa_weights8(_mm256_sub_ps(old_max, new_max)); /* 0 where old_max was -inf */
            __m256 sum = _mm256_setzero_ps();
            for (int64_t j = 0; j < n; j++) {
                const __m256 w = pa_weights8(_mm256_sub_ps(_mm256_loadu_ps(st + j * RB + v * 8), new_max));
                _mm256_storeu_ps(st + j * RB + v * 8, w);
                sum = _mm256_add_ps(sum, w);
            }
            _mm256_storeu_ps(row_sum + v * 8, _mm256_fmadd_ps(_mm256_loadu_ps(row_sum + v * 8), sc, sum));
            _mm256_storeu_ps(row_max + v * 8, new_max);
            _mm256_storeu_ps(rescale + v * 8, sc);
        }
        for (int64_t r = r0; r < RB; r += PA_GEMM_MR) {
            const int64_t nr = RB - r < PA_GEMM_MR ? RB - r : PA_GEMM_MR, m = pa_keys_seen(pos, r, nr, key0, n);
            for (int64_t c = 0; c < D; c += 16) {
                PA_GEMM_TICK();
                if (m <= 0) continue; /* its rows' maxima did not move: rescale 1, nothing to add */
                float *ot = o + r * D + c; /* the tile's first row at its dims c */
                const float *pt = st + r;
                switch (nr) {
                case 2: pa_values_tile(vr, pt, RB, m, ot, D, c, rescale + r, 2); break;
                case 4: pa_values_tile(vr, pt, RB, m, ot, D, c, rescale + r, 4); break;
                default: pa_values_tile(vr, pt, RB, m, ot, D, c, rescale + r, 6); break;
                }
            }
        }
#undef PA_GEMM_TICK
        while (pf.slots_left > 0) pa_prefetch_pair(&pf);
        key0 += n;
    }
    for (int64_t r = 0; r < rows; r++) {
        char *dst = out + ((size_t)((tok0 + r / n_rep) * a->out_stride) + (size_t)((g * n_rep + r % n_rep) * D)) * es;
        const float inv_sum = 1.0f / row_sum[r];
        for (int64_t d = 0; d < D; d++) row[d] = o[r * D + d] * inv_sum;
        store_row(dst, row, D, a->bf16);
    }
}
#endif

/* Attention weights on 16 lanes: exp_approx for x <= 0 (a score less its row's maximum) in
 * intrinsics (the auto-vectorized loop split into 256-bit halves, whose stores a 512-bit reload could
 * not forward), 0 below -46 and for -inf as in pa_tile (such a weight changes no float sum). The lanes
 * kept lie in [-46, 0], so exp_approx's clamps change none of them, and scaling by 2^k with vscalefps
 * gives the bits its exponent arithmetic does, in one instruction instead of three. A macro, as
 * EXP2_POLY16: its users carry different target attributes (the AVX512_BF16 build's prefill tiles,
 * the AMX attention at every level). */
#define PA_WEIGHTS16(x)                                                                             \
    ({                                                                                              \
        const __m512 x_ = (x);                                                                      \
        const __mmask16 tiny_ = _mm512_cmp_ps_mask(x_, _mm512_set1_ps(-46.0f), _CMP_LT_OQ);       \
        const __m512 t_ = _mm512_mul_ps(x_, _mm512_set1_ps(1.44269504088896341f));                 \
        const __m512 k_ = _mm512_roundscale_ps(t_, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); \
        _mm512_maskz_scalef_ps((__mmask16)~tiny_, EXP2_POLY16(_mm512_sub_ps(t_, k_)), k_);        \
    })

#ifdef ATTN_DPBF16
/* ------------------------------------------------------------------------------------------ prefill chunks by vdpbf16ps
 * pa_tile_gemm for bfloat16 caches where the build has AVX512_BF16 (D a multiple of 64): the same
 * flash-attention steps over runs of 16 keys, the two products by vdpbf16ps on the bfloat16 values
 * as they are stored, 16 rows a zmm, with no float32 copy of K or V:
 * - S^T = K Q^T: Q^T packed once per item as dim pairs [D / 2][RB] (32-bit: dims 2i, 2i + 1 of a row),
 *   each key's pair a broadcast read from the cache (4 keys x 3 row vectors: 12 accumulators); the
 *   sums times the scale after (q unscaled: each product of two bfloat16 values is exact in float32).
 * - the online softmax as pa_tile_gemm's, 16 rows a zmm over S^T (PA_WEIGHTS16).
 * - O += P V: P^T as bfloat16 key pairs per row (rounded as torch's CPU flash attention rounds its
 *   probabilities before their product with V; the rows' sums stay float32), V's rows of a key pair
 *   interleaved by vpermt2w once per run, 6 rows x 64 dims a tile (24 accumulators).
 * Twice the multiplies an instruction of pa_tile_gemm's 256-bit FMAs, no widening of K or V. */
#define PA_DP_ROWS 16 /* rows a vector */

/* S^T rows [key j][nv vectors of 16 rows] (st + j * RB) of 4 keys (kp[j]: key j's D / 2 pairs) against Q^T pairs (qt: pair i's rows at qt + i * RB), times scale. */
static inline __attribute__((always_inline)) void pa_scores_tile_dp(const uint32_t *const *kp, const uint32_t *qt, int64_t RB,
                                                                    int64_t D2, float *st, const int nv, float scale) {
    __m512 s[PA_GEMM_KEYS][3];
    for (int j = 0; j < PA_GEMM_KEYS; j++)
        for (int v = 0; v < nv; v++) s[j][v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < D2; i++) {
        __m512bh qv[3];
        for (int v = 0; v < nv; v++) qv[v] = (__m512bh)_mm512_loadu_si512(qt + i * RB + v * PA_DP_ROWS);
        for (int j = 0; j < PA_GEMM_KEYS; j++) {
            const __m512bh k = (__m512bh)_mm512_set1_epi32((int)kp[j][i]);
            for (int v = 0; v < nv; v++) s[j][v] = _mm512_dpbf16_ps(s[j][v], qv[v], k);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int j = 0; j < PA_GEMM_KEYS; j++)
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(st + j * RB + v * PA_DP_ROWS, _mm512_mul_ps(s[j][v], sc));
}

/* O rows [nr][64 dims from vector c4] (o + i * D) = O * rescale[i] + sum over key pairs i < pairs of
 * P pair (pp + i * RB + row) . V pair (vp + i * DV + vector), in key order. */
static inline __attribute__((always_inline)) void pa_values_tile_dp(const __m512i *vp, int64_t DV, const uint32_t *pp,
                                                                    int64_t RB, int64_t pairs, float *o, int64_t D,
                                                                    int64_t c4, const float *rescale, const int nr) {
    __m512 acc[PA_GEMM_MR][4];
    for (int r = 0; r < nr; r++) {
        const __m512 sc = _mm512_set1_ps(rescale[r]);
        for (int v = 0; v < 4; v++) acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + (c4 + v) * 16), sc);
    }
    for (int64_t i = 0; i < pairs; i++) {
        __m512bh w[4];
        for (int v = 0; v < 4; v++) w[v] = (__m512bh)vp[i * DV + c4 + v];
        for (int r = 0; r < nr; r++) {
            const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pp[i * RB + r]);
            for (int v = 0; v < 4; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], w[v], p);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < 4; v++) _mm512_storeu_ps(o + r * D + (c4 + v) * 16, acc[r][v]);
}

/* pa_tile_gemm's item (query rows [tok0, tok1) x the n_rep heads of KV head g) by vdpbf16ps; bfloat16,
 * rows at least PA_GEMM_MIN_ROWS, D a multiple of 64. */
static inline __attribute__((always_inline)) void pa_tile_gemm_dp(const PagedArgs *a, const int64_t D, const char *q,
                                                                  char *out, const int32_t *table, int64_t prefix,
                                                                  int64_t tok0, int64_t tok1, int64_t g) {
    const int64_t n_rep = a->n_rep, rows = (tok1 - tok0) * n_rep, RB = (rows + PA_DP_ROWS - 1) / PA_DP_ROWS * PA_DP_ROWS;
    const int64_t D2 = D / 2, DV = D / 16, bs = a->block_size;
    const size_t slot_bytes = (size_t)a->slot_elems * 2, head_off = (size_t)(g * D) * 2;
    const int64_t n_keys = prefix + tok1, head_lines = (D * 2 + 63) / 64;
    /* Q^T pairs [D / 2][RB] (rows past `rows` zero), O [RB][D], S^T then P^T [PA_KEYS][RB] float32,
     * P^T pairs [PA_KEYS / 2][RB], V pairs [PA_KEYS / 2][DV] */
    uint32_t qt[D2 * RB], pp[PA_KEYS / 2 * RB], zeros[D2];
    float o[RB * D], st[PA_KEYS * RB], row[D], row_max[RB], row_sum[RB], rescale[RB];
    __m512i vp[PA_KEYS / 2 * DV];
    int32_t pos[RB]; /* row r sees keys 0 .. pos[r]; rows past `rows` repeat the last one's */
    const uint32_t *kp[PA_KEYS];
    memset(zeros, 0, sizeof(zeros));
    memset(o, 0, sizeof(o));
    memset(qt, 0, sizeof(qt));
    for (int64_t r = 0, tok = prefix + tok0, rep = 0; r < RB; r++) {
        pos[r] = (int32_t)tok;
        if (++rep == n_rep && r + 1 < rows) rep = 0, tok++;
        row_max[r] = -INFINITY, row_sum[r] = 0.0f;
    }
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t *qr = (const uint32_t *)(q + ((size_t)((tok0 + r / n_rep) * a->q_stride) + (size_t)((g * n_rep + r % n_rep) * D)) * 2);
        for (int64_t i = 0; i < D2; i++) qt[i * RB + r] = qr[i];
    }
    for (int64_t key0 = 0; key0 < n_keys;) {
        const int64_t n = pa_run_length(key0, n_keys, bs), pairs_n = (n + 1) / 2;
        const size_t first = pa_slot_offset(table, key0, bs, slot_bytes, head_off);
        PaRunPrefetch pf = pa_next_run_prefetch(a, table, key0, n, n_keys, slot_bytes, head_off, head_lines);
        for (int64_t j = 0; j < PA_KEYS; j++) kp[j] = j < n ? (const uint32_t *)(a->k_cache + first + j * slot_bytes) : zeros;
        /* rows sorted by position: the first 8-row vector with a row that sees key0 (the last row sees all) */
        int64_t v0 = 0;
        while (pos[v0 * 8 + 7] < key0) v0++;
        const int64_t r0 = v0 * 8, w0 = r0 / PA_DP_ROWS, WV = RB / PA_DP_ROWS, key_groups = (n + PA_GEMM_KEYS - 1) / PA_GEMM_KEYS;
        const int64_t ticks = key_groups * ((WV - w0 + 2) / 3) + (RB - r0 + PA_GEMM_MR - 1) / PA_GEMM_MR * (D / 64) + pairs_n;
        const int64_t prefetch_pairs = pf.slots_left * head_lines;
        int64_t credit = 0;
#define PA_DP_TICK() for (credit += prefetch_pairs; credit >= ticks; credit -= ticks) pa_prefetch_pair(&pf)
        for (int64_t j0 = 0; j0 < n; j0 += PA_GEMM_KEYS)
            for (int64_t w = w0; w < WV; w += 3) {
                const uint32_t *qv = qt + w * PA_DP_ROWS;
                float *sv = st + j0 * RB + w * PA_DP_ROWS;
                PA_DP_TICK();
                switch (WV - w < 3 ? WV - w : 3) {
                case 1: pa_scores_tile_dp(kp + j0, qv, RB, D2, sv, 1, a->scale); break;
                case 2: pa_scores_tile_dp(kp + j0, qv, RB, D2, sv, 2, a->scale); break;
                default: pa_scores_tile_dp(kp + j0, qv, RB, D2, sv, 3, a->scale); break;
                }
            }
        /* V's key pairs interleaved, while the scores' softmax waits (keys past the run: zero) */
        for (int64_t i = 0; i < pairs_n; i++) {
            PA_DP_TICK();
            const char *v0r = a->v_cache + first + (size_t)(2 * i) * slot_bytes;
            for (int64_t c = 0; c < D; c += 32) {
                const __m512i x = _mm512_loadu_si512(v0r + c * 2);
                const __m512i y = 2 * i + 1 < n ? _mm512_loadu_si512(v0r + slot_bytes + c * 2) : _mm512_setzero_si512();
                key_pairs(x, y, &vp[i * DV + c / 16], &vp[i * DV + c / 16 + 1]);
            }
        }
        for (int64_t w = w0; w < WV; w++) { /* online softmax, 16 rows at a time */
            const __m512i last = _mm512_loadu_si512(pos + w * PA_DP_ROWS);
            const __m512 old_max = _mm512_loadu_ps(row_max + w * PA_DP_ROWS);
            __m512 new_max = old_max;
            for (int64_t j = 0; j < n; j++) { /* keys past a row's position: -inf */
                const __mmask16 unseen = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32((int32_t)(key0 + j)), last);
                const __m512 s = _mm512_mask_mov_ps(_mm512_loadu_ps(st + j * RB + w * PA_DP_ROWS), unseen, _mm512_set1_ps(-INFINITY));
                _mm512_storeu_ps(st + j * RB + w * PA_DP_ROWS, s);
                new_max = _mm512_max_ps(new_max, s);
            }
            const __m512 sc = PA_WEIGHTS16(_mm512_sub_ps(old_max, new_max));
            __m512 sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < n; j++) {
                const __m512 x = PA_WEIGHTS16(_mm512_sub_ps(_mm512_loadu_ps(st + j * RB + w * PA_DP_ROWS), new_max));
                _mm512_storeu_ps(st + j * RB + w * PA_DP_ROWS, x);
                sum = _mm512_add_ps(sum, x);
            }
            _mm512_storeu_ps(row_sum + w * PA_DP_ROWS, _mm512_fmadd_ps(_mm512_loadu_ps(row_sum + w * PA_DP_ROWS), sc, sum));
            _mm512_storeu_ps(row_max + w * PA_DP_ROWS, new_max);
            _mm512_storeu_ps(rescale + w * PA_DP_ROWS, sc);
        }
        /* P^T as bfloat16 key pairs, 16 rows at a time (a key past the run: weight 0) */
        for (int64_t i = 0; i < pairs_n; i++)
            for (int64_t r = w0 * PA_DP_ROWS; r < RB; r += PA_DP_ROWS) {
                const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(st + 2 * i * RB + r)));
                const __m512i hi = 2 * i + 1 < n ? _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(st + (2 * i + 1) * RB + r)))
                                                 : _mm512_setzero_si512();
                _mm512_storeu_si512(pp + i * RB + r, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        for (int64_t r = r0; r < RB; r += PA_GEMM_MR) {
            const int64_t nr = RB - r < PA_GEMM_MR ? RB - r : PA_GEMM_MR, m = pa_keys_seen(pos, r, nr, key0, n);
            for (int64_t c4 = 0; c4 < DV; c4 += 4) {
                PA_DP_TICK();
                if (m <= 0) continue; /* its rows' maxima did not move: rescale 1, nothing to add */
                float *ot = o + r * D;
                const uint32_t *pt = pp + r;
                switch (nr) {
                case 2: pa_values_tile_dp(vp, DV, pt, RB, (m + 1) / 2, ot, D, c4, rescale + r, 2); break;
                case 4: pa_values_tile_dp(vp, DV, pt, RB, (m + 1) / 2, ot, D, c4, rescale + r, 4); break;
                default: pa_values_tile_dp(vp, DV, pt, RB, (m + 1) / 2, ot, D, c4, rescale + r, 6); break;
                }
            }
        }
#undef PA_DP_TICK
        while (pf.slots_left > 0) pa_prefetch_pair(&pf);
        key0 += n;
    }
    for (int64_t r = 0; r < rows; r++) {
        char *dst = out + ((size_t)((tok0 + r / n_rep) * a->out_stride) + (size_t)((g * n_rep + r % n_rep) * D)) * 2;
        const float inv_sum = 1.0f / row_sum[r];
        for (int64_t d = 0; d < D; d++) row[d] = o[r * D + d] * inv_sum;
        store_row(dst, row, D, 1);
    }
}
#endif

#ifdef AMX_COMPILED
#define PA_AMX 1 /* paged_attention_amx below: built at every level, run where amx_tiles_permitted() */
#define PA_AMX_KEYS 16 /* keys per run: a tile's rows */

/* Whether paged_attention_amx takes caches of this head_dim and block size in this process. */
static inline int pa_amx_applies(int64_t head_dim, int64_t block_size) {
    return head_dim % 64 == 0 && block_size % PA_AMX_KEYS == 0 && amx_tiles_permitted();
}

static int paged_attention_amx(const void *qkv, int64_t q_stride, void *out, const int32_t *row_start,
                               const int32_t *new_tokens, const int32_t *seq_lens, const int32_t *block_tables,
                               int64_t max_blocks, int64_t num_seqs, const void *k_cache, const void *v_cache,
                               int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
                               int num_threads);
#endif

/* Returns KERNEL_OK, or KERNEL_NO_MEMORY when its scratch cannot be allocated (out is then undefined). */
int paged_attention(int bf16, const void *qkv, int64_t q_stride, void *out, const int32_t *row_start,
                    const int32_t *new_tokens, const int32_t *seq_lens, const int32_t *block_tables, int64_t max_blocks, int64_t num_seqs,
                    const void *k_cache, const void *v_cache, int64_t heads, int64_t kv_heads, int64_t head_dim,
                    int64_t block_size, float scale, int num_threads) {
#ifdef PA_AMX
    const int on_tiles = bf16 ? paged_attention_amx(qkv, q_stride, out, row_start, new_tokens, seq_lens, block_tables,
                                                    max_blocks, num_seqs, k_cache, v_cache, heads, kv_heads, head_dim,
                                                    block_size, scale, num_threads)
                              : 0;
    if (on_tiles) return on_tiles == 1 ? KERNEL_OK : on_tiles;
#endif
    const size_t es = elem_size(bf16);
    const int64_t n_rep = heads / kv_heads, tile_tokens = n_rep < PA_TILE_ROWS ? PA_TILE_ROWS / n_rep : 1;
    /* items: sequence b's are [item_begin[b], item_begin[b + 1]), KV head major */
    int64_t *item_begin = kernel_malloc((size_t)(num_seqs + 1) * sizeof(int64_t)), work = 0;
    if (!item_begin) return KERNEL_NO_MEMORY;
    item_begin[0] = 0;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t n_new = new_tokens[b];
        item_begin[b + 1] = item_begin[b] + kv_heads * ((n_new + tile_tokens - 1) / tile_tokens);
        work += n_new * seq_lens[b];
    }
    const int64_t items = item_begin[num_seqs];
    const PagedArgs args = {(const char *)k_cache, (const char *)v_cache, n_rep, block_size, kv_heads * head_dim,
                            q_stride, heads * head_dim, bf16, scale};
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (items > 1 && work * heads * head_dim >= PARALLEL_MIN_ELEMS)
    for (int64_t item = 0; item < items; item++) {
        int64_t b = 0;
        while (item_begin[b + 1] <= item) b++;
        const int64_t n_new = new_tokens[b], tiles = (item_begin[b + 1] - item_begin[b]) / kv_heads;
        const int64_t g = (item - item_begin[b]) / tiles, tile = (item - item_begin[b]) % tiles;
        const int64_t tok0 = tile * tile_tokens, tok1 = tok0 + tile_tokens < n_new ? tok0 + tile_tokens : n_new;
        const char *q = (const char *)qkv + (size_t)row_start[b] * q_stride * es;
        char *o = (char *)out + (size_t)row_start[b] * heads * head_dim * es;
        const int32_t *table = block_tables + b * max_blocks;
        const int64_t prefix = seq_lens[b] - n_new;
/* the item through `kernel`, inlined with head_dim 64 a literal (the common size) or as it is */
#define PA_ITEM(kernel)                                                                   \
    (head_dim == 64 ? kernel(&args, 64, q, o, table, prefix, tok0, tok1, g)               \
                    : kernel(&args, head_dim, q, o, table, prefix, tok0, tok1, g))
#ifdef PA_GEMM
        if ((tok1 - tok0) * n_rep >= PA_GEMM_MIN_ROWS && head_dim % 16 == 0) {
#ifdef ATTN_DPBF16
            if (bf16 && head_dim % 64 == 0) {
                PA_ITEM(pa_tile_gemm_dp);
                continue;
            }
#endif
            PA_ITEM(pa_tile_gemm);
            continue;
        }
#endif
#undef PA_ITEM
        if (head_dim == 64)
            pa_tile(&args, 64, q, o, table, prefix, tok0, tok1, g);
        else if (head_dim == 128)
            pa_tile(&args, 128, q, o, table, prefix, tok0, tok1, g);
        else
            pa_tile(&args, head_dim, q, o, table, prefix, tok0, tok1, g);
    }
    free(item_begin);
    return KERNEL_OK;
}

#ifdef PA_AMX
/* ------------------------------------------------------------------------------------------ paged attention on AMX tiles
 * paged_attention for bfloat16 caches on CPUs with AMX (head_dim a multiple of 64, blocks a multiple
 * of 16 keys). Items are (sequence, tile of tokens) with every
 * KV head in them, so a run of 16 keys is one block's contiguous K (and V) rows for all heads.
 * Two passes per item, no online rescaling:
 * - scores: S^T [16 keys, N query rows] = K Q^T per KV head and run, K the cache's rows as they are
 *   (a tile load with the slot stride: no copy, no transpose), Q^T packed once per item; then an
 *   exact softmax per row over all its keys, the weights rounded to bfloat16 (as torch's bfloat16
 *   SDPA rounds them before P V) and summed as rounded, so each output is their weighted mean;
 * - values: O [N, 64] += P [N, 16 keys] V [16 keys, 64] per run, V's rows loaded from the cache as
 *   they are too (the weights as (w, 0) and (0, w) pairs pick its even and odd dims), O accumulating
 *   in four tiles over all runs. With head_dim 64 (pa_amx_values_fused) each run's weights are made
 *   just before its multiplies instead of in a pass of their own: the same bits, one read of the
 *   scores instead of three passes over them.
 * Products of bfloat16 values are exact in float32 and the sums float32, as in pa_tile; the only
 * rounding pa_tile lacks is P's. A decode reads each key once from memory, and memory bounds it: the
 * scores pass prefetches the next run between its tile steps (and the thread's next item's first run
 * comes during the values pass), so the tile work runs under the misses (bench/NOTES.md, "Decode
 * attention at the bandwidth bound"). */
#include <immintrin.h>
AMX_TARGET_BEGIN

/* scores pass: tiles 0-2 S^T [16 keys, N] (float32), 3-4 K [16 keys, 32 dims], 5-6 Q^T [16 dim pairs, N];
 * values pass: tiles 0-1 P [N, 16 keys as (w, 0) / (0, w) pairs], 2-3 V [16 keys, 32 dims], 4-7 O [N, 16
 * even or odd dims] */
static void amx_configs(AmxTileConfig *scores, AmxTileConfig *values, int64_t n) {
    memset(scores, 0, sizeof(*scores));
    memset(values, 0, sizeof(*values));
    scores->palette = values->palette = 1;
    for (int t = 0; t <= 6; t++) scores->rows[t] = PA_AMX_KEYS, scores->colsb[t] = t == 3 || t == 4 ? 64 : (uint16_t)(4 * n);
    for (int t = 0; t <= 1; t++) values->rows[t] = (uint8_t)n, values->colsb[t] = 4 * PA_AMX_KEYS;
    for (int t = 2; t <= 3; t++) values->rows[t] = PA_AMX_KEYS, values->colsb[t] = 64;
    for (int t = 4; t <= 7; t++) values->rows[t] = (uint8_t)n, values->colsb[t] = 64;
}

/* The next run's K and V lines (one contiguous span each: the block's slots for all KV heads),
 * prefetched a few at a time between the scores pass's tile work: issued as one burst per head they
 * filled the line fill buffers and stalled the tile work behind them (32 decodes x 160 keys over 30
 * layers' caches, 1 thread: 5% slower, bench/NOTES.md). */
typedef struct {
    const char *k, *v;
    size_t at, end; /* bytes of the span left to prefetch: [at, end) */
} PaPrefetch;

#define PA_PREFETCH_LINES 4 /* lines of K and of V per call between tile steps; 2 and 8 were no better */

static inline void pa_prefetch_some(PaPrefetch *pf, size_t lines) {
    for (; lines > 0 && pf->at < pf->end; lines--, pf->at += 64) {
        __builtin_prefetch(pf->k + pf->at, 0, 3);
        __builtin_prefetch(pf->v + pf->at, 0, 3);
    }
}

/* A call's items, handed out one at a time (dynamic scheduling by hand): a thread claims its next
 * item once the current one's scores pass is done, and prefetches that item's first run during the
 * current one's softmax and values pass, which otherwise leave memory idle (their K/V were fetched
 * by the scores pass). */
typedef struct {
    int64_t next; /* the first unclaimed item (atomic) */
    int64_t items;
    const int64_t *item_begin; /* sequence b's items: [item_begin[b], item_begin[b + 1]) */
    const int32_t *block_tables;
    int64_t max_blocks;
    int out_of_memory; /* set (atomic) by a thread whose item could not allocate its scratch; it then stops */
} PaItems;

/* The sequence owning `item` (sequence b's items: [item_begin[b], item_begin[b + 1])). */
static inline int64_t pa_item_sequence(const int64_t *item_begin, int64_t item) {
    int64_t b = 0;
    while (item_begin[b + 1] <= item) b++;
    return b;
}

/* Claim the next item (it->items where none is left) and point *ahead at its first run's K/V span
 * (every item's scores pass starts at key 0 of its sequence). Its first two runs instead were no
 * better on blocks in order and slower on scattered ones: the values pass's own reads from L2 then
 * wait for fill buffers. */
static inline int64_t pa_claim(PaItems *it, const PagedArgs *a, PaPrefetch *ahead) {
    const int64_t item = __atomic_fetch_add(&it->next, 1, __ATOMIC_RELAXED);
    *ahead = (PaPrefetch){a->k_cache, a->v_cache, 0, 0};
    if (item >= it->items) return it->items;
    const int64_t b = pa_item_sequence(it->item_begin, item);
    const size_t slot_bytes = (size_t)a->slot_elems * 2, first = (size_t)it->block_tables[b * it->max_blocks] * a->block_size * slot_bytes;
    *ahead = (PaPrefetch){a->k_cache + first, a->v_cache + first, 0, PA_AMX_KEYS * slot_bytes};
    return item;
}

/* src [16][16] row-major -> rows[c] = column c (the stored S^T tile's query rows: no gather per row,
 * which took ~8% of the kernel). */
static inline __attribute__((always_inline)) void transpose16(const float *src, __m512 rows[16]) {
    __m512 t[16], *r = rows;
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(src + 16 * i);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
    }
}

/* A run's V rows as the tiles load them: in place, or for a last run of n < 16 keys copied into v_tail
 * with zeros past them (0 x NaN is NaN); *stride set to match. */
static inline const char *pa_v_rows(const char *v, int64_t n, size_t slot_bytes, uint16_t v_tail[PA_AMX_KEYS][64], long *stride) {
    *stride = (long)slot_bytes;
    if (n >= PA_AMX_KEYS) return v;
    for (int64_t j = 0; j < PA_AMX_KEYS; j++)
        if (j < n) memcpy(v_tail[j], v + j * slot_bytes, sizeof(v_tail[j]));
        else memset(v_tail[j], 0, sizeof(v_tail[j]));
    *stride = sizeof(v_tail[0]);
    return (const char *)v_tail;
}

/* 16 scores at s -> their weights exp(s - max) rounded to bfloat16, stored at dst as (w, 0) 32-bit pairs
 * (the form the P V tiles load); the weights as rounded, added to *sum (a row's sum is the sum of the
 * weights it is multiplied by). Both of pa_amx_item's values paths make their weights here. */
static inline __attribute__((always_inline)) void pa_amx_weights16(const float *s, __m512 max, void *dst, __m512 *sum) {
    const __m256bh w = _mm512_cvtneps_pbh(PA_WEIGHTS16(_mm512_sub_ps(_mm512_load_ps(s), max)));
    const __m512i low_half = _mm512_cvtepu16_epi32((__m256i)w); /* a 32-bit lane: (weight, 0) */
    _mm512_store_si512(dst, low_half);
    *sum = _mm512_add_ps(*sum, _mm512_castsi512_ps(_mm512_slli_epi32(low_half, 16)));
}

/* O (tiles 4-7) += P V for one run: the weights w as (w, 0) pairs (row stride w_stride bytes, the two
 * bytes before each row zero), V's 16 rows of 64 dims at v. */
static inline __attribute__((always_inline)) void pa_amx_pv_run(const void *w, long w_stride, const char *v, long v_stride) {
    _tile_loadd(0, w, w_stride);
    _tile_loadd(1, (const char *)w - 2, w_stride);
    _tile_loadd(2, v, v_stride);
    _tile_loadd(3, v + 64, v_stride);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 1, 2);
    _tile_dpbf16ps(6, 0, 3);
    _tile_dpbf16ps(7, 1, 3);
}

/* O in tiles 4-7 (per 32 dims: even, odd) -> group g's N output rows, dims d0 .. d0 + 63, each row
 * times inv[r], as bfloat16: dims 32 h + 2 t and 32 h + 2 t + 1 from o[2 h][r][t] and o[2 h + 1][r][t]. */
static inline __attribute__((always_inline)) void pa_amx_store_o(const PagedArgs *a, char *out, int64_t g, int64_t N,
                                                                int64_t D, int64_t d0, int64_t tok0, const float *inv) {
    float o[4][16][16] __attribute__((aligned(64)));
    _tile_stored(4, o[0], 64);
    _tile_stored(5, o[1], 64);
    _tile_stored(6, o[2], 64);
    _tile_stored(7, o[3], 64);
    const __m512i low = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i high = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int64_t r = 0; r < N; r++) {
        char *dst = out + ((size_t)((tok0 + r / a->n_rep) * a->out_stride) + (size_t)((g * a->n_rep + r % a->n_rep) * D + d0)) * 2;
        const __m512 f = _mm512_set1_ps(inv[r]);
        for (int h = 0; h < 2; h++) {
            const __m512 x = _mm512_load_ps(o[2 * h][r]), y = _mm512_load_ps(o[2 * h + 1][r]);
            const __m512 lo = _mm512_mul_ps(_mm512_permutex2var_ps(x, low, y), f);
            const __m512 hi = _mm512_mul_ps(_mm512_permutex2var_ps(x, high, y), f);
            _mm512_storeu_si512(dst + h * 64, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

/* pa_amx_item's softmax and values passes in one, for head_dim 64: each 16-key run's weights
 * exp(s - max) rounded to bfloat16 are made for the item's N rows just before the run's P V
 * multiplies, into a small buffer the tiles then load from L1, and the rows' sums kept beside them;
 * two passes over the item's scores (~370 KB for a 2048-token prompt: L2), one in place, fall to
 * one read. The same weights and sums as the two passes, in the same order. */
static inline __attribute__((always_inline)) void pa_amx_values_fused(
    const PagedArgs *a, int64_t groups, int64_t split, int64_t N, char *out, const int32_t *table, int64_t tok0,
    int64_t n_keys, int64_t padded, const float *scores, const __m512 *row_max, PaPrefetch *ahead,
    const AmxTileConfig *cfg_values) {
    enum { D = 64 };
    const int64_t bs = a->block_size;
    const size_t slot_bytes = (size_t)a->slot_elems * 2;
    /* a run's weights as (w, 0) pairs, [N rows][16 keys], after one zero lane (the (0, w) load starts 2
     * bytes early); two, so a run's weights are written while the last run's are still being loaded */
    uint32_t run_buf[2][16 + 16 * PA_AMX_KEYS] __attribute__((aligned(64)));
    __m512 sums[16];
    uint16_t v_tail[PA_AMX_KEYS][64] __attribute__((aligned(64)));
    memset(run_buf, 0, sizeof(run_buf));
    _tile_loadconfig(cfg_values);
    for (int64_t g = 0; g < groups; g++) {
        float max[16];
        for (int64_t r = 0; r < N; r++) max[r] = _mm512_reduce_max_ps(row_max[g * N + r]), sums[r] = _mm512_setzero_ps();
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t key0 = 0, turn = 0; key0 < n_keys; key0 += PA_AMX_KEYS, turn ^= 1) {
            pa_prefetch_some(ahead, PA_PREFETCH_LINES);
            uint32_t *w = run_buf[turn] + 16;
            const float *s = scores + g * N * padded + key0;
            for (int64_t r = 0; r < N; r++) pa_amx_weights16(s + r * padded, _mm512_set1_ps(max[r]), w + r * PA_AMX_KEYS, &sums[r]);
            long stride;
            const char *v = pa_v_rows(a->v_cache + ((size_t)table[key0 / bs] * bs + key0 % bs) * slot_bytes + (size_t)(g / split * D) * 2,
                                      n_keys - key0, slot_bytes, v_tail, &stride);
            pa_amx_pv_run(w, PA_AMX_KEYS * 4, v, stride);
        }
        float inv[16];
        for (int64_t r = 0; r < N; r++) inv[r] = 1.0f / _mm512_reduce_add_ps(sums[r]);
        pa_amx_store_o(a, out, g, N, D, 0, tok0, inv);
    }
}

/* One item: tokens [tok0, tok1) of one sequence (its prefix cached keys before them), all KV heads.
 * Each KV head's query heads are `split` groups of a->n_rep (<= 16), g numbering the groups (KV head
 * g / split); N = (tok1 - tok0) * a->n_rep query rows per group. Claims the thread's next item from
 * `items` into *claimed (pa_claim) when its scores pass is done. */
static inline __attribute__((always_inline)) void pa_amx_item(
    const PagedArgs *a, const int64_t D, int64_t groups, int64_t split, const char *q, char *out, const int32_t *table,
    int64_t prefix, int64_t tok0, int64_t tok1, PaItems *items, int64_t *claimed) {
    const int64_t n_rep = a->n_rep, N = (tok1 - tok0) * n_rep, bs = a->block_size, chunks = D / 32;
    const int64_t n_keys = prefix + tok1, padded = (n_keys + PA_AMX_KEYS - 1) / PA_AMX_KEYS * PA_AMX_KEYS;
    const size_t slot_bytes = (size_t)a->slot_elems * 2, run_bytes = PA_AMX_KEYS * slot_bytes;
    /* one allocation: Q^T [g][chunk][dim pair][N], 64 zero bytes, scores [g][N][padded] (then the weights),
     * each row's running maximum (16 lanes) */
    const size_t qt_bytes = (size_t)(groups * chunks * 16 * N) * 4, scores_bytes = (size_t)(groups * N * padded) * 4;
    char *scratch = kernel_aligned_alloc(64, qt_bytes + 64 + scores_bytes + (size_t)(groups * N) * 64);
    if (!scratch) { /* *claimed stays as the caller set it (no item): this thread stops */
        __atomic_store_n(&items->out_of_memory, 1, __ATOMIC_RELAXED);
        return;
    }
    uint32_t *qt = (uint32_t *)scratch;
    memset(scratch + qt_bytes, 0, 64);
    float *scores = (float *)(scratch + qt_bytes + 64);
    __m512 *row_max = (__m512 *)(scratch + qt_bytes + 64 + scores_bytes); /* the softmax's maximum, kept as scores are stored */
    for (int64_t row = 0; row < groups * N; row++) row_max[row] = _mm512_set1_ps(-INFINITY);
    float inv_sum[groups * N];
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32((int)N)); /* lane i: row i of a [16][N] matrix */
    for (int64_t g = 0; g < groups; g++)
        for (int64_t r = 0; r < N; r++) { /* query row r's 16 dim pairs of each chunk down column r */
            const char *src = q + ((size_t)((tok0 + r / n_rep) * a->q_stride) + (size_t)((g * n_rep + r % n_rep) * D)) * 2;
            for (int64_t c = 0; c < chunks; c++)
                _mm512_i32scatter_epi32(qt + (g * chunks + c) * 16 * N + r, column, _mm512_loadu_si512(src + c * 64), 4);
        }
    AmxTileConfig cfg_scores, cfg_values;
    amx_configs(&cfg_scores, &cfg_values, N);
    float s_t[3 * PA_AMX_KEYS * 16] __attribute__((aligned(64))); /* S^T [16 keys][16, N used] of three heads */
    _tile_loadconfig(&cfg_scores);
    PaPrefetch pf = {a->k_cache, a->v_cache, 0, 0};
    for (int64_t key0 = 0; key0 < n_keys; key0 += PA_AMX_KEYS) {
        const int64_t n = n_keys - key0 < PA_AMX_KEYS ? n_keys - key0 : PA_AMX_KEYS;
        const size_t run = ((size_t)table[key0 / bs] * bs + key0 % bs) * slot_bytes;
        pa_prefetch_some(&pf, SIZE_MAX); /* this run's lines not prefetched yet */
        const int64_t key1 = key0 + PA_AMX_KEYS;
        if (key1 < n_keys) {
            const size_t next = ((size_t)table[key1 / bs] * bs + key1 % bs) * slot_bytes;
            pf = (PaPrefetch){a->k_cache + next, a->v_cache + next, 0, run_bytes};
        }
        /* Tiles are not renamed: a load into a tile waits for the multiply still reading it. So the
         * heads take turns over three S^T tiles, and the K and Q^T chunks alternate between two tiles
         * each: the next multiply's operands load while the last one runs. */
        for (int64_t g = 0; g < groups; g++) {
            const char *k = a->k_cache + run + (size_t)(g / split * D) * 2;
            const uint32_t *qg = qt + g * chunks * 16 * N;
            for (int64_t c = 0; c < chunks; c++) {
#define PA_AMX_QK(S, K, Q)                                                                                 \
    do {                                                                                                   \
        if (c == 0) _tile_zero(S);                                                                         \
        _tile_loadd(K, k + c * 64, (long)slot_bytes);                                                      \
        _tile_loadd(Q, qg + c * 16 * N, 4 * N);                                                            \
        _tile_dpbf16ps(S, K, Q);                                                                           \
    } while (0)
                pa_prefetch_some(&pf, PA_PREFETCH_LINES);
                const int64_t turn = (g * chunks + c) & 1;
                switch (g % 3) {
                case 0: if (turn) PA_AMX_QK(0, 4, 6); else PA_AMX_QK(0, 3, 5); break;
                case 1: if (turn) PA_AMX_QK(1, 4, 6); else PA_AMX_QK(1, 3, 5); break;
                default: if (turn) PA_AMX_QK(2, 4, 6); else PA_AMX_QK(2, 3, 5); break;
                }
#undef PA_AMX_QK
            }
            float *s_g = s_t + (g % 3) * PA_AMX_KEYS * 16;
            switch (g % 3) {
            case 0: _tile_stored(0, s_g, 64); break;
            case 1: _tile_stored(1, s_g, 64); break;
            default: _tile_stored(2, s_g, 64); break;
            }
            if (g + 1 < groups && g % 3 != 2) continue; /* the scores once all of the turn's heads are issued */
            for (int64_t h = g - g % 3; h <= g; h++) {
                __m512 rows[16]; /* row r: query row r's scores against the run's 16 keys */
                transpose16(s_t + (h % 3) * PA_AMX_KEYS * 16, rows);
                for (int64_t r = 0; r < N; r++) {
                    pa_prefetch_some(&pf, PA_PREFETCH_LINES);
                    const int64_t visible = prefix + tok0 + r / n_rep - key0 + 1, m = visible < n ? visible : n;
                    const __mmask16 keep = m >= 16 ? 0xffff : (m <= 0 ? 0 : (__mmask16)((1u << m) - 1));
                    const __m512 raw = rows[r];
                    const __m512 s = _mm512_mul_ps(raw, _mm512_set1_ps(a->scale));
                    const __m512 kept = _mm512_mask_blend_ps(keep, _mm512_set1_ps(-INFINITY), s);
                    _mm512_store_ps(scores + (h * N + r) * padded + key0, kept);
                    row_max[h * N + r] = _mm512_max_ps(row_max[h * N + r], kept);
                }
            }
        }
    }
    PaPrefetch ahead;
    *claimed = pa_claim(items, a, &ahead);
    if (D == 64) { /* the weights made run by run in the values pass below, from L1 */
        pa_amx_values_fused(a, groups, split, N, out, table, tok0, n_keys, padded, scores, row_max, &ahead, &cfg_values);
        pa_prefetch_some(&ahead, SIZE_MAX);
        free(scratch);
        return;
    }
    for (int64_t row = 0; row < groups * N; row++) { /* softmax, in place: the weights rounded to bfloat16 */
        pa_prefetch_some(&ahead, PA_PREFETCH_LINES);
        float *s = scores + row * padded;
        __m512 vsum = _mm512_setzero_ps();
        const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(row_max[row]));
        for (int64_t j = 0; j < padded; j += 16) pa_amx_weights16(s + j, max, s + j, &vsum); /* in place */
        inv_sum[row] = 1.0f / _mm512_reduce_add_ps(vsum);
    }
    /* P V with V's rows as they lie in the cache (no interleaving of key pairs): a tile multiply sums
     * A[m][2k] B[k][n][0] + A[m][2k + 1] B[k][n][1] with B's row k one key's 32 dims as 16 pairs, so
     * A = the weights as (w, 0) pairs gives the even dims, and (0, w) pairs, the same buffer loaded
     * 2 bytes early (the 64 bytes before it are zero), the odd ones. */
    uint16_t v_tail[PA_AMX_KEYS][64] __attribute__((aligned(64))); /* a last run's keys, zeros past them (0 x NaN is NaN) */
    _tile_loadconfig(&cfg_values);
    for (int64_t g = 0; g < groups; g++)
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
            for (int64_t key0 = 0; key0 < n_keys; key0 += PA_AMX_KEYS) {
                pa_prefetch_some(&ahead, PA_PREFETCH_LINES);
                long stride;
                const char *v = pa_v_rows(a->v_cache + ((size_t)table[key0 / bs] * bs + key0 % bs) * slot_bytes + (size_t)(g / split * D + d0) * 2,
                                          n_keys - key0, slot_bytes, v_tail, &stride);
                pa_amx_pv_run(scores + g * N * padded + key0, padded * 4, v, stride);
            }
            pa_amx_store_o(a, out, g, N, D, d0, tok0, inv_sum + g * N);
        }
    pa_prefetch_some(&ahead, SIZE_MAX); /* what the values pass left */
    free(scratch);
}

/* paged_attention through pa_amx_item where it applies (returns 1, or KERNEL_NO_MEMORY when its
 * scratch cannot be allocated), else 0 and nothing done. */
static int paged_attention_amx(const void *qkv, int64_t q_stride, void *out, const int32_t *row_start,
                               const int32_t *new_tokens, const int32_t *seq_lens, const int32_t *block_tables,
                               int64_t max_blocks, int64_t num_seqs, const void *k_cache, const void *v_cache,
                               int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
                               int num_threads) {
    if (!pa_amx_applies(head_dim, block_size)) return 0;
    /* at most 16 query rows per group of a KV head's query heads (a tile's columns): more than 16
     * query heads per KV head split into equal groups */
    int64_t split = (heads / kv_heads + 15) / 16;
    while ((heads / kv_heads) % split) split++;
    const int64_t n_rep = heads / kv_heads / split, tile_tokens = 16 / n_rep;
    int64_t *item_begin = kernel_malloc((size_t)(num_seqs + 1) * sizeof(int64_t)), work = 0;
    if (!item_begin) return KERNEL_NO_MEMORY;
    item_begin[0] = 0;
    for (int64_t b = 0; b < num_seqs; b++) {
        item_begin[b + 1] = item_begin[b] + (new_tokens[b] + tile_tokens - 1) / tile_tokens;
        work += new_tokens[b] * seq_lens[b];
    }
    const int64_t items = item_begin[num_seqs];
    const PagedArgs args = {(const char *)k_cache, (const char *)v_cache, n_rep, block_size, kv_heads * head_dim,
                            q_stride, heads * head_dim, 1, scale};
    PaItems sched = {0, items, item_begin, block_tables, max_blocks, 0};
#pragma omp parallel num_threads(num_threads) if (items > 1 && work * heads * head_dim >= PARALLEL_MIN_ELEMS)
    {
        int64_t item = __atomic_fetch_add(&sched.next, 1, __ATOMIC_RELAXED);
        while (item < items) {
            const int64_t b = pa_item_sequence(item_begin, item);
            const int64_t n_new = new_tokens[b], tok0 = (item - item_begin[b]) * tile_tokens;
            const int64_t tok1 = tok0 + tile_tokens < n_new ? tok0 + tile_tokens : n_new;
            const char *q = (const char *)qkv + (size_t)row_start[b] * q_stride * 2;
            char *o = (char *)out + (size_t)row_start[b] * heads * head_dim * 2;
            const int32_t *table = block_tables + b * max_blocks;
            int64_t next = items;
            if (head_dim == 64)
                pa_amx_item(&args, 64, kv_heads * split, split, q, o, table, seq_lens[b] - n_new, tok0, tok1,
                            &sched, &next);
            else
                pa_amx_item(&args, head_dim, kv_heads * split, split, q, o, table, seq_lens[b] - n_new, tok0, tok1,
                            &sched, &next);
            item = next;
        }
        _tile_release(); /* the thread's tile state back to init: no 8 KB of it saved at each switch */
    }
    free(item_begin);
    return sched.out_of_memory ? KERNEL_NO_MEMORY : 1;
}
AMX_TARGET_END
#endif

/* 1 where paged_attention runs bfloat16 caches of this head_dim and block size on AMX tiles: then it
 * beats torch's SDPA on prefill chunks too (bench/NOTES.md), and CpuKernelBackend hands it those as
 * well. */
int paged_attention_on_tiles(int bf16, int64_t head_dim, int64_t block_size) {
#ifdef PA_AMX
    return bf16 && pa_amx_applies(head_dim, block_size);
#else
    (void)bf16, (void)head_dim, (void)block_size;
    return 0;
#endif
}

/* 1 where paged_attention should take a step's decodes (two or more per thread) of caches in this
 * dtype instead of paged_decode_attention: bfloat16 where the CPU grants AMX tiles (the tile path
 * where the cache's shape suits it, paged_attention_on_tiles). Elsewhere paged_decode_attention is
 * the faster on both dtypes: on an AVX2 Zen 2 (30 layers' caches on huge pages, 1 thread) float32
 * 1.33x once both spread their prefetches, bfloat16 1.38-1.51x since it widens K and V in registers
 * once for a KV head's query heads (bench/NOTES.md 'AVX2 paged attention', 'Decode attention over a
 * KV head's query rows', 'Decode attention: reads overlapped with the maths', 'Decode attention at
 * long context'); with 512-bit vectors on Zen 4 (no AMX), where paged_attention had been chosen for
 * them (1.8x at 32 decodes on an AMX Xeon, before paged_decode_attention's register blocking),
 * float32 1.36-1.44x and bfloat16 1.77-1.97x at 4-64 decodes (bench/NOTES.md 'Decode attention from
 * L2 prefetches'). Its splitting of a sequence's blocks also serves a few long decodes. */
int paged_attention_takes_decodes(int bf16) {
#ifdef PA_AMX
    return bf16 && amx_tiles_permitted();
#else
    (void)bf16;
    return 0;
#endif
}

/* 1 where a step with prefill chunks should run all its sequences, chunks and decodes, in one
 * paged_attention call instead of SDPA per chunk: on AMX tiles (paged_attention_on_tiles), and on
 * every AVX build. On an AVX2 Zen 2 the 8-lane pa_tile ran a step's chunks 1.6x faster than torch's
 * float32 SDPA, and pa_tile_gemm 1.5-1.7x faster again on 4 x 128-token prompts (4 prompts of 128
 * tokens and a 512-token mixed step of the demo; bench/NOTES.md 'Prefill chunks as small GEMMs',
 * 'AVX2 paged attention'), a bfloat16 128-token chunk 2.8x faster than torch's bfloat16 SDPA, which
 * has no native bfloat16 instructions there (bench/NOTES.md 'bfloat16 on AVX2'). On an AVX-512 Zen 4
 * without AMX (pa_tile_gemm's 256-bit tiles; Zen 4 runs 512-bit FMAs as two 256-bit halves) a
 * 4 x 128-token prefill step's attention took 23 ms instead of SDPA's 76 in bfloat16 and 22 instead
 * of 100 in float32, 30 layers, 2 threads (bench/NOTES.md 'Prefill attention on AVX-512 without
 * AMX'). The SSE build keeps SDPA: not measured against it there. */
int paged_attention_takes_chunks(int bf16, int64_t head_dim, int64_t block_size) {
    if (paged_attention_on_tiles(bf16, head_dim, block_size)) return 1;
#if defined(__AVX__)
    return head_dim % 16 == 0;
#else
    return 0;
#endif
}
