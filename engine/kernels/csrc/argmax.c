/* The greedy sampler's argmax (the cpu_kernels library; engine/kernels/cpu.py binds it). */
#include "vec.h"

/* ------------------------------------------------------------------------------------------ greedy sampling
 * ids[r], values[r] = the first index of row r's largest value and that value, as numpy's argmax on
 * the rows as float32 (engine/core/sampler.py's all-greedy path): equal values (+0 and -0 included) keep
 * the first, and a NaN anywhere wins (the first NaN). x: [rows, row_stride] of either dtype, cols
 * used. bfloat16 rows are read as they are: the float32 copy of a [32, 49152] batch cost more than
 * the search (bench/NOTES.md); float32 rows on both threads where numpy's argmax takes one. */
static inline int is_nan_bits(const void *x, int64_t i, int bf16) {
    return bf16 ? (((const bf16_t *)x)[i] & 0x7fff) > 0x7f80 : (((const uint32_t *)x)[i] & 0x7fffffffu) > 0x7f800000u;
}

static inline float value_at(const void *x, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const bf16_t *)x)[i]) : ((const float *)x)[i];
}

static int64_t first_nan(const void *x, int64_t cols, int bf16) {
    for (int64_t i = 0; i < cols; i++)
        if (is_nan_bits(x, i, bf16)) return i;
    return -1;
}

#ifdef HAVE_AVX512_ROWS
static inline __mmask32 row_mask32(int64_t left) { return left >= 32 ? (__mmask32)~0u : (__mmask32)((1u << left) - 1u); }

/* bfloat16 in two passes, the maximum and then the first position holding it. The maximum: 32 values
 * a step split into even and odd float32 lanes (no shuffles); NaN shows in the largest |x| bits
 * instead (vmaxps drops it). */
static float row_max_bf16(const bf16_t *x, int64_t cols, int *has_nan) {
    const __m512i minus_inf = _mm512_set1_epi16((short)0xff80), high = _mm512_set1_epi32((int)0xffff0000u);
    __m512 max = _mm512_set1_ps(-INFINITY);
    __m512i max_abs = _mm512_setzero_si512();
    for (int64_t i = 0; i < cols; i += 32) {
        const __m512i v = _mm512_mask_loadu_epi16(minus_inf, row_mask32(cols - i), x + i);
        max = _mm512_max_ps(max, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
        max = _mm512_max_ps(max, _mm512_castsi512_ps(_mm512_and_si512(v, high)));
        max_abs = _mm512_max_epu16(max_abs, _mm512_and_si512(v, _mm512_set1_epi16(0x7fff)));
    }
    *has_nan = _mm512_cmpgt_epu16_mask(max_abs, _mm512_set1_epi16(0x7f80)) != 0;
    return _mm512_reduce_max_ps(max);
}

/* float32 in one pass (a second would read the row from L3 again): per lane the largest value and the
 * first index holding it, four such accumulators side by side (the compare-and-blend chain is
 * latency-bound alone), then the smallest index among the lanes holding the maximum. Indices are
 * 32-bit lanes: cols < 2^31. */
#define ARGMAX_F32_WAYS 4
static int64_t argmax_row_f32(const float *x, int64_t cols, int *has_nan) {
    __m512 best[ARGMAX_F32_WAYS];
    __m512i best_at[ARGMAX_F32_WAYS], at[ARGMAX_F32_WAYS];
    __m512i max_abs = _mm512_setzero_si512();
    for (int w = 0; w < ARGMAX_F32_WAYS; w++) {
        best[w] = _mm512_set1_ps(-INFINITY);
        at[w] = best_at[w] = _mm512_add_epi32(_mm512_set1_epi32(16 * w), _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    }
    for (int64_t i = 0; i < cols; i += 16 * ARGMAX_F32_WAYS) {
#pragma GCC unroll 4
        for (int w = 0; w < ARGMAX_F32_WAYS; w++) {
            const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), row_mask(cols - i - 16 * w), x + i + 16 * w);
            const __mmask16 better = _mm512_cmp_ps_mask(v, best[w], _CMP_GT_OQ);
            best[w] = _mm512_mask_mov_ps(best[w], better, v);
            best_at[w] = _mm512_mask_mov_epi32(best_at[w], better, at[w]);
            at[w] = _mm512_add_epi32(at[w], _mm512_set1_epi32(16 * ARGMAX_F32_WAYS));
            max_abs = _mm512_max_epu32(max_abs, _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)));
        }
    }
    *has_nan = _mm512_cmpgt_epu32_mask(max_abs, _mm512_set1_epi32(0x7f800000)) != 0;
    __m512 all = best[0];
    for (int w = 1; w < ARGMAX_F32_WAYS; w++) all = _mm512_max_ps(all, best[w]);
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(all));
    __m512i first = _mm512_set1_epi32(INT32_MAX);
    for (int w = 0; w < ARGMAX_F32_WAYS; w++) /* lanes holding the maximum (either zero for a zero) */
        first = _mm512_mask_min_epi32(first, _mm512_cmp_ps_mask(best[w], top, _CMP_EQ_OQ), first, best_at[w]);
    return _mm512_reduce_min_epi32(first);
}

/* The first position holding `best` (either zero for a zero): bfloat16 compares bits, 32 a step */
static int64_t first_equal_bf16(const bf16_t *x, int64_t cols, float best) {
    union { float f; uint32_t u; } b = {best};
    const uint16_t bits = (uint16_t)(b.u >> 16), care = (bits & 0x7fff) ? 0xffff : 0x7fff; /* -0 == +0 */
    const __m512i target = _mm512_set1_epi16((short)(bits & care)), keep = _mm512_set1_epi16((short)care);
    for (int64_t i = 0; i < cols; i += 32) {
        const __mmask32 m = row_mask32(cols - i);
        const __mmask32 hit = _mm512_mask_cmpeq_epi16_mask(m, _mm512_and_si512(_mm512_maskz_loadu_epi16(m, x + i), keep), target);
        if (hit) return i + __builtin_ctz(hit);
    }
    return 0; /* not reached: the maximum is one of the row's values */
}

static int64_t argmax_row(const void *x, int64_t cols, int bf16, float *value) {
    int has_nan;
    int64_t i;
    if (bf16) {
        const float best = row_max_bf16(x, cols, &has_nan);
        i = has_nan ? 0 : first_equal_bf16(x, cols, best);
    } else {
        i = argmax_row_f32(x, cols, &has_nan);
    }
    if (has_nan) i = first_nan(x, cols, bf16);
    *value = value_at(x, i, bf16);
    return i;
}
#else
/* Other builds: two passes the vectorizer takes (a max reduction that also finds the largest |x|
 * bits, for NaN; then the first position equal to the maximum, 64 values per early-exit check).
 * The scalar loop before compared against a reloaded best value with a branch per element: on an
 * AVX2 Zen 2 a [32, 49152] float32 batch took 20-24 ms where numpy's argmax takes 0.2 ms
 * (bench/NOTES.md 'AVX2 one-row linear'). */
#define ARGMAX_CHUNK 64
static inline __attribute__((always_inline)) int64_t argmax_row_portable(const void *x, int64_t cols, int bf16) {
    float best = -INFINITY;
    uint32_t max_abs = 0;
    if (bf16) {
        const bf16_t *b = (const bf16_t *)x;
#pragma omp simd reduction(max : best, max_abs)
        for (int64_t i = 0; i < cols; i++) {
            const float v = bf16_to_f32(b[i]);
            const uint32_t a = (uint32_t)(b[i] & 0x7fffu) << 16;
            best = v > best ? v : best;
            max_abs = a > max_abs ? a : max_abs;
        }
    } else {
        const float *f = (const float *)x;
        const uint32_t *u = (const uint32_t *)x;
#pragma omp simd reduction(max : best, max_abs)
        for (int64_t i = 0; i < cols; i++) {
            const uint32_t a = u[i] & 0x7fffffffu;
            best = f[i] > best ? f[i] : best;
            max_abs = a > max_abs ? a : max_abs;
        }
    }
    if (max_abs > 0x7f800000u) return first_nan(x, cols, bf16);
    for (int64_t i0 = 0; i0 < cols; i0 += ARGMAX_CHUNK) { /* the first value == best (either zero for a zero) */
        const int64_t end = i0 + ARGMAX_CHUNK < cols ? i0 + ARGMAX_CHUNK : cols;
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t i = i0; i < end; i++) hit |= value_at(x, i, bf16) == best;
        if (hit)
            for (int64_t i = i0; i < end; i++)
                if (value_at(x, i, bf16) == best) return i;
    }
    return 0; /* a row of -inf only: the first */
}

static int64_t argmax_row(const void *x, int64_t cols, int bf16, float *value) {
    const int64_t i = bf16 ? argmax_row_portable(x, cols, 1) : argmax_row_portable(x, cols, 0);
    *value = value_at(x, i, bf16);
    return i;
}
#endif

void argmax_rows(int bf16, const void *x, int64_t rows, int64_t cols, int64_t row_stride, int64_t *ids, float *values,
                 int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * cols >= PARALLEL_MIN_ELEMS && rows > 1)
    for (int64_t r = 0; r < rows; r++)
        ids[r] = argmax_row((const char *)x + (size_t)r * row_stride * elem_size(bf16), cols, bf16, values + r);
}
