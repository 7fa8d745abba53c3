/* Low-bit weight linears for CPU (the quant_kernels library: engine/kernels/build.py builds it,
 * engine/kernels/quant.py binds it).
 *
 * y[m, r] = sum_j x[m, j] * W[r, j], where W is stored as codes plus scales (engine/quant/formats.py
 * defines the numbers; these kernels compute the same dot products up to summation order). Each
 * 32-column block of a weight row is dequantized in registers (AVX-512: two zmm; AVX2: four ymm, in
 * intrinsics; other builds: portable loops over 16-float vectors) and multiplied into up to TILE input rows at once,
 * so a decode step streams the low-bit bytes once and larger batches re-read each row from L1.
 * OpenMP over output rows, with the caller's thread count (the libgomp torch already loaded).
 *
 * Formats (codes row-major, one row per output feature):
 *   int8: int8 codes, value = scale * q; scales float32 or float16 per group (group = k: per row).
 *   int4: two codes a byte, GGUF's order inside each 32-column block (byte j: column j low nibble,
 *         column j + 16 high nibble); float16 scales per group; value = scale * q + min, where min
 *         is the float16 `mins` entry or, without mins, -8 * scale (i.e. scale * (q - 8)).
 *   fp8:  float8_e4m3fn codes, float32 scales per row (or per group: shards of a Meta FP8 release
 *         merged), value = scale * fp8(q).
 *   Q4_K, Q5_K, Q6_K: GGUF's 256-value super-blocks as stored (the K-quants section below).
 * Activations and outputs are float32 (dtype code 0) or bfloat16 (code 1); sums are float32.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QK_AVX512 1 /* the conversions below in intrinsics: GCC lowers vector-extension casts badly */
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
/* x86-64-v3 (AVX2, FMA, F16C; Zen 2 here): the int8 / int4 / fp8 linears and dequantizers in 8-lane
 * intrinsics. The portable code's 16-lane vectors are two ymm registers here, and GCC lowered them
 * through the stack each step (accumulators stored and reloaded, lanes moved through general
 * registers): that code ran 5-10x slower than the float linear (bench/NOTES.md 'AVX2 quantized
 * linears'). */
#define QK_AVX2 1
#endif

#define AI inline __attribute__((always_inline))
#define BLOCK 32
#define TILE 8 /* input rows sharing one dequantized weight block */

enum { FMT_INT8 = 0, FMT_INT4 = 1, FMT_FP8 = 2 };

static inline float half_to_f32(uint16_t h) { /* IEEE binary16 -> float32, exact */
#ifdef __FLT16_MAX__
    _Float16 f;
    memcpy(&f, &h, sizeof(f));
    return (float)f; /* one vcvtsh2ss / vcvtph2ps where the CPU has it */
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exp == 0x1f) {
        v.u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        v.u = sign | ((exp + 112) << 23) | (man << 13);
    } else { /* zero or subnormal: man * 2^-24 */
        v.f = (float)man * 5.9604644775390625e-8f;
        v.u |= sign;
    }
    return v.f;
#endif
}

#ifdef __AVX2__
#include <immintrin.h>
static AI float hsum8(__m256 v) { /* the 8 lanes' sum (the AVX2 linears' last step per row) */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

/* fp8 e4m3fn -> float32, exact. AVX-512 and AVX2 (F16C): the code's bits are moved into a binary16
 * whose value is exactly value / 256 (same mantissa, exponent bias 15 vs 7, subnormals to
 * subnormals), converted by vcvtph2ps, and the 256 is folded into the row scale. Elsewhere: a
 * 256-entry table. */
#if defined(QK_AVX512) || defined(QK_AVX2)
#define FP8_UNSCALE 256.0f
#else
#define FP8_UNSCALE 1.0f
static float fp8_table[256];
__attribute__((constructor)) static void fill_fp8_table(void) {
    for (int c = 0; c < 256; c++) {
        int e = (c >> 3) & 15, m = c & 7;
        float mag = e ? (8.0f + (float)m) * (float)(1 << e) / 1024.0f /* (1 + m/8) 2^(e-7) */
                      : (float)m / 512.0f;                            /* m/8 2^-6 */
        fp8_table[c] = (c & 0x80) ? -mag : mag;
    }
}
#endif

typedef struct {
    const uint8_t *w;      /* codes, [n, k] bytes (int4: [n, k / 2]) */
    const void *scales;    /* [n, groups], float32 or float16 */
    const uint16_t *mins;  /* int4 only: [n, groups] float16, or NULL */
    int64_t n, k, group, groups;
    int scales_f16;
} qmat;

static AI float scale_at(const qmat *q, int64_t i) {
    return q->scales_f16 ? half_to_f32(((const uint16_t *)q->scales)[i]) : ((const float *)q->scales)[i];
}

/* The block's scale d and offset m for the format: value = q * d + m (int8, fp8: m = 0). */
static AI void group_params(const qmat *q, const int fmt, int64_t row, int64_t g, float *d, float *m) {
    const int64_t i = row * q->groups + g;
    *d = scale_at(q, i);
    *m = 0.0f;
    if (fmt == FMT_INT4) *m = q->mins ? half_to_f32(q->mins[i]) : -8.0f * *d;
    if (fmt == FMT_FP8) *d *= FP8_UNSCALE;
}

#if !defined(QK_AVX512) && !defined(QK_AVX2)
/* The block's codes at src (int4: 16 bytes; int8, fp8: 32) as 32 floats q * d + m, in portable
 * loops the compiler vectorizes at the build's width. */
static AI void dequant_vals(const uint8_t *src, const int fmt, float d, float m, float *vals) {
    if (fmt == FMT_INT4) {
        for (int i = 0; i < 16; i++) {
            vals[i] = (float)(src[i] & 15) * d + m;
            vals[i + 16] = (float)(src[i] >> 4) * d + m;
        }
    } else if (fmt == FMT_INT8) {
        for (int i = 0; i < BLOCK; i++) vals[i] = (float)(int8_t)src[i] * d;
    } else {
        for (int i = 0; i < BLOCK; i++) vals[i] = fp8_table[src[i]] * d;
    }
}
#endif

/* The codes of the block of `row` at column j; an int8 / fp8 row's last block shorter than 32
 * columns (cnt < 32) is copied into `tail` with zero codes after it. */
static AI const uint8_t *block_codes(const qmat *q, const int fmt, int64_t row, int64_t j, int64_t cnt, uint8_t *tail) {
    if (fmt == FMT_INT4) return q->w + (size_t)(row * (q->k / 2) + j / 2); /* int4 rows are whole blocks */
    const uint8_t *src = q->w + (size_t)(row * q->k + j);
    if (cnt == BLOCK) return src;
    memset(tail, 0, BLOCK);
    memcpy(tail, src, (size_t)cnt);
    return tail;
}

#ifndef QK_AVX2 /* AVX2: dequant_block8 below */
/* Dequantize the 32 columns of `row` starting at j (cnt < 32 only at an int8/fp8 row's end:
 * the missing columns come out as 0). Exact: each value is q * d + m rounded once, and q * d is
 * exact for 4- and 8-bit codes times a float16 scale, so the FMA rounds where the reference does. */
static AI void dequant_block(const qmat *q, const int fmt, int64_t row, int64_t j, int64_t cnt, float d, float m,
                             v16f *lo, v16f *hi) {
    uint8_t tail[BLOCK] = {0};
    const uint8_t *src = fmt == FMT_INT4 ? q->w + (size_t)(row * (q->k / 2) + j / 2) : q->w + (size_t)(row * q->k + j);
    if (fmt != FMT_INT4 && cnt < BLOCK) { /* int4 rows are whole blocks */
        memcpy(tail, src, (size_t)cnt);
        src = tail;
    }
#ifdef QK_AVX512
    const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
    if (fmt == FMT_INT4) {
        /* the block's 16 possible values q * d + m in one register, then each code picks its value:
         * vpermps reads only an index's low 4 bits, so the low nibble needs no mask (fewer uops
         * than converting every code to float and scaling it) */
        const __m512 table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), vd, vm);
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)src));
        *lo = (v16f)_mm512_permutexvar_ps(v, table);
        *hi = (v16f)_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
    } else if (fmt == FMT_INT8) {
        *lo = (v16f)_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src))), vd);
        *hi = (v16f)_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 16)))), vd);
    } else {
        for (int h = 0; h < 2; h++) {
            const __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + 16 * h)));
            const __m256i bits = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0x80)), 8),
                                                 _mm256_slli_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0x7f)), 7));
            const v16f f = (v16f)_mm512_mul_ps(_mm512_cvtph_ps(bits), vd);
            if (h == 0) *lo = f;
            else *hi = f;
        }
    }
#else /* portable loops (the compiler vectorizes them) */
    float vals[BLOCK];
    dequant_vals(src, fmt, d, m, vals);
    memcpy(lo, vals, sizeof(*lo));
    memcpy(hi, vals + 16, sizeof(*hi));
#endif
}
#endif

#ifdef QK_AVX2
/* ------------------------------------------------------------------------------------------ AVX2 blocks
 * A 32-column block as four 8-lane vectors (columns 8i..8i+7 in v[i]), value = q * d + m as
 * dequant_block computes it (one FMA per value from exact q * d: the same bits). */
/* 16 fp8 codes (as 16-bit lanes) -> the binary16 bits whose values are theirs / 256 (see FP8_UNSCALE) */
static AI __m256i fp8x16_as_half(__m256i u) {
    return _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0x80)), 8),
                           _mm256_slli_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0x7f)), 7));
}

/* The block's codes at src (int4: 16 bytes; int8, fp8: 32) as four vectors of q * d + m. */
static AI void dequant_block8(const uint8_t *src, const int fmt, float d, float m, __m256 *v) {
    const __m256 vd = _mm256_set1_ps(d);
    if (fmt == FMT_INT4) { /* byte j: column j low nibble, column j + 16 high nibble */
        const __m256 vm = _mm256_set1_ps(m);
        const __m256i nib = _mm256_set1_epi32(15);
        const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)src));       /* bytes 0..7 */
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + 8))); /* bytes 8..15 */
        v[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(a, nib)), vd, vm);
        v[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, nib)), vd, vm);
        v[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), vd, vm);
        v[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), vd, vm);
    } else if (fmt == FMT_INT8) {
        for (int i = 0; i < 4; i++)
            v[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + 8 * i)))), vd);
    } else {
        for (int h = 0; h < 2; h++) {
            const __m256i bits = fp8x16_as_half(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + 16 * h))));
            v[2 * h] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(bits)), vd);
            v[2 * h + 1] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(bits, 1)), vd);
        }
    }
}

#endif

#ifdef QK_AVX512 /* the 16-lane tile kernel's helpers (narrower builds: the AVX2 and 4-lane code) */
static AI float hsum(v16f v) {
    return _mm512_reduce_add_ps((__m512)v); /* a shuffle tree: a scalar chain of 16 adds per row cost ~40% at k = 576 */
}

static AI v16f loadf(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof(v));
    return v;
}
#endif

/* Move to the group holding column j (blocks never straddle groups: group is k or a multiple of 32). */
static AI void enter_block(const qmat *q, const int fmt, int64_t row, int64_t j, int64_t *g, int64_t *group_end, float *d, float *m) {
    if (j >= *group_end) {
        ++*g;
        *group_end += q->group;
        group_params(q, fmt, row, *g, d, m);
    }
}

#ifdef QK_AVX2
/* res[t] = x[t] . W[row] for T input rows (x rows zero-padded to kp, a multiple of 32): each block
 * dequantized once into four vectors, multiplied into every row. A row's four quarters go to
 * `chains` accumulators (4 for one or two rows, 2 for three or four, 1 above): enough independent
 * FMA chains to hide their latency, at most 8 accumulators and the block's 4 vectors in the 16 ymm
 * registers. */
static AI void row_dot(const qmat *q, const int fmt, int64_t row, const float *x, int64_t kp, const int T, float *res) {
    const int chains = T <= 2 ? 4 : T <= 4 ? 2 : 1;
    __m256 acc[4][TILE]; /* [chain][input row] */
    for (int c = 0; c < chains; c++)
        for (int t = 0; t < T; t++) acc[c][t] = _mm256_setzero_ps();
    const int64_t k = q->k;
    int64_t g = -1, group_end = 0;
    float d = 0.0f, m = 0.0f;
    uint8_t tail[BLOCK];
    for (int64_t j = 0; j < k; j += BLOCK) {
        enter_block(q, fmt, row, j, &g, &group_end, &d, &m);
        __m256 v[4];
        dequant_block8(block_codes(q, fmt, row, j, k - j < BLOCK ? k - j : BLOCK, tail), fmt, d, m, v);
        for (int t = 0; t < T; t++) {
            const float *xt = x + t * kp + j;
            for (int i = 0; i < 4; i++) acc[i % chains][t] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(xt + 8 * i), acc[i % chains][t]);
        }
    }
    for (int t = 0; t < T; t++) {
        __m256 s = acc[0][t];
        if (chains == 4) s = _mm256_add_ps(_mm256_add_ps(acc[0][t], acc[1][t]), _mm256_add_ps(acc[2][t], acc[3][t]));
        else if (chains == 2) s = _mm256_add_ps(acc[0][t], acc[1][t]);
        res[t] = hsum8(s);
    }
}
#elif !defined(QK_AVX512)
/* The portable build (x86-64-v2, other architectures): as the AVX2 row_dot above, in 4-lane
 * vectors (SSE, NEON: one register each; 16-lane generic vectors went through the stack on these
 * too), each block dequantized by the portable loops into 32 floats first. */
typedef float v4f __attribute__((vector_size(16)));

static AI v4f load4(const float *p) {
    v4f v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static AI void row_dot(const qmat *q, const int fmt, int64_t row, const float *x, int64_t kp, const int T, float *res) {
    const int chains = T <= 2 ? 4 : T <= 4 ? 2 : 1;
    v4f acc[4][TILE]; /* [chain][input row] */
    for (int c = 0; c < chains; c++)
        for (int t = 0; t < T; t++) acc[c][t] = (v4f){0};
    const int64_t k = q->k;
    int64_t g = -1, group_end = 0;
    float d = 0.0f, m = 0.0f;
    uint8_t tail[BLOCK];
    for (int64_t j = 0; j < k; j += BLOCK) {
        enter_block(q, fmt, row, j, &g, &group_end, &d, &m);
        float vals[BLOCK];
        dequant_vals(block_codes(q, fmt, row, j, k - j < BLOCK ? k - j : BLOCK, tail), fmt, d, m, vals);
        for (int t = 0; t < T; t++) {
            const float *xt = x + t * kp + j;
            for (int i = 0; i < 8; i++) acc[i % chains][t] += load4(vals + 4 * i) * load4(xt + 4 * i);
        }
    }
    for (int t = 0; t < T; t++) {
        v4f s = acc[0][t];
        if (chains == 4) s = (acc[0][t] + acc[1][t]) + (acc[2][t] + acc[3][t]);
        else if (chains == 2) s = acc[0][t] + acc[1][t];
        res[t] = (s[0] + s[1]) + (s[2] + s[3]);
    }
}
#else
/* res[t] = x[t] . W[row] for T input rows (x rows zero-padded to kp, a multiple of 32). With one
 * or two rows, two blocks per step feed four accumulator chains (FMA latency, not the work, would
 * bound a single chain). */
static AI void row_dot(const qmat *q, const int fmt, int64_t row, const float *x, int64_t kp, const int T, float *res) {
    const int pairs = T <= 2;
    v16f acc[2][2][TILE]; /* [block parity][low/high half][input row] */
    for (int t = 0; t < T; t++) acc[0][0][t] = acc[0][1][t] = acc[1][0][t] = acc[1][1][t] = (v16f){0};
    const int64_t k = q->k;
    int64_t g = -1, group_end = 0, j = 0;
    float d = 0.0f, m = 0.0f;
    v16f lo, hi, lo2, hi2;
    if (pairs) {
        for (; j + 2 * BLOCK <= k; j += 2 * BLOCK) {
            enter_block(q, fmt, row, j, &g, &group_end, &d, &m);
            dequant_block(q, fmt, row, j, BLOCK, d, m, &lo, &hi);
            enter_block(q, fmt, row, j + BLOCK, &g, &group_end, &d, &m);
            dequant_block(q, fmt, row, j + BLOCK, BLOCK, d, m, &lo2, &hi2);
            for (int t = 0; t < T; t++) {
                const float *xt = x + t * kp + j;
                acc[0][0][t] += lo * loadf(xt);
                acc[0][1][t] += hi * loadf(xt + 16);
                acc[1][0][t] += lo2 * loadf(xt + 32);
                acc[1][1][t] += hi2 * loadf(xt + 48);
            }
        }
    }
    for (; j < k; j += BLOCK) {
        enter_block(q, fmt, row, j, &g, &group_end, &d, &m);
        dequant_block(q, fmt, row, j, k - j < BLOCK ? k - j : BLOCK, d, m, &lo, &hi);
        for (int t = 0; t < T; t++) {
            acc[0][0][t] += lo * loadf(x + t * kp + j);
            acc[0][1][t] += hi * loadf(x + t * kp + j + 16);
        }
    }
    for (int t = 0; t < T; t++) res[t] = hsum((acc[0][0][t] + acc[0][1][t]) + (acc[1][0][t] + acc[1][1][t]));
}
#endif

static AI void row_dot_n(const qmat *q, const int fmt, int64_t row, const float *x, int64_t kp, int T, float *res) {
    switch (T) { /* constant T per case: the accumulators stay in registers */
    case 1: row_dot(q, fmt, row, x, kp, 1, res); break;
    case 2: row_dot(q, fmt, row, x, kp, 2, res); break;
    case 3: row_dot(q, fmt, row, x, kp, 3, res); break;
    case 4: row_dot(q, fmt, row, x, kp, 4, res); break;
    case 5: row_dot(q, fmt, row, x, kp, 5, res); break;
    case 6: row_dot(q, fmt, row, x, kp, 6, res); break;
    case 7: row_dot(q, fmt, row, x, kp, 7, res); break;
    default: row_dot(q, fmt, row, x, kp, TILE, res); break;
    }
}

/* x [rows, k] (float32 or bfloat16) -> float32 [rows, kp], zero-padded; NULL if out of memory. */
static float *padded_input(const void *x, int bf16, int64_t rows, int64_t k, int64_t kp) {
    float *xf = kernel_calloc((size_t)(rows * kp), sizeof(float));
    if (!xf) return NULL;
    for (int64_t m = 0; m < rows; m++) load_row(xf + m * kp, (const char *)x + (size_t)(m * k) * elem_size(bf16), k, bf16);
    return xf;
}


#if defined(QK_AVX512) || defined(QK_AVX2)
/* The codes, scales and mins of a row a few rows ahead: the weight streams from memory (a decode
 * step reads every layer once, far more than the caches hold), and three streams per row (codes,
 * scales, mins) are more than the hardware prefetcher runs ahead on. */
#define GEMV_PREFETCH_ROWS 4
static AI void prefetch_row(const int fmt, const qmat *q, int64_t row) {
    const int64_t row_bytes = fmt == FMT_INT4 ? q->k / 2 : q->k, scale_bytes = q->scales_f16 ? 2 : 4;
    const char *w = (const char *)q->w + (size_t)row * row_bytes;
    for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(w + off, _MM_HINT_T0);
    _mm_prefetch((const char *)q->scales + (size_t)(row * q->groups) * scale_bytes, _MM_HINT_T0);
    if (q->mins) _mm_prefetch((const char *)(q->mins + row * q->groups), _MM_HINT_T0);
}

#endif

#ifdef QK_AVX512
/* ------------------------------------------------------------------------------------------ one input row
 * Decode at batch 1 streams each weight once, so the work per 32-column block decides whether the
 * stream runs at memory bandwidth. Per block here: the codes as they are times x, summed into one
 * vector, then scaled once by the block's scale d (a broadcast load from a per-row float32 copy of
 * the scales; with wider groups, once per group: a per-row int8 scale once per row); the offsets' share, sum over blocks of m * sum(x over the block), is one short dot
 * product per row with block sums of x computed once per call. The same dot products as
 * sum((q * d + m) * x), reassociated (the tests' "up to summation order" tolerance holds it).
 * int4 with bfloat16 x on CPUs with AVX512_BF16: the 32 codes become 32 exact bfloat16 integers
 * (one vpermw from a table) and one vdpbf16ps multiplies them into x (each product exact in
 * float32); otherwise float32 codes through vpermps from a 0..15 table. Four accumulators hide
 * the FMA latency. Used for int8 and int4 weights whose rows are whole blocks. */
#define GEMV_CHAINS 4

/* kinds of block dot product: codes as float32 times float32 x (int4, int8), or int4 codes as
 * bfloat16 times bfloat16 x (vdpbf16ps) */
enum { DOT_INT4_F32 = 0, DOT_INT8_F32 = 1, DOT_INT4_BF16 = 2 };

/* The scales of `row`'s groups as float32 (dst [groups]). */
static AI void row_group_scales(const qmat *q, int64_t row, float *dst) {
    const int64_t groups = q->groups, base = row * groups;
    for (int64_t g = 0; g < groups; g += 16) {
        const __mmask16 mk = groups - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (groups - g)) - 1);
        const __m512 v = q->scales_f16 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, (const uint16_t *)q->scales + base + g))
                                       : _mm512_maskz_loadu_ps(mk, (const float *)q->scales + base + g);
        _mm512_mask_storeu_ps(dst + g, mk, v);
    }
}

/* int4: sum over groups of m * (sum of x over the group); m = mins, or -8 * scale without them. */
static AI float row_offsets(const qmat *q, int64_t row, const float *group_sums) {
    const int64_t groups = q->groups, base = row * groups;
    const uint16_t *m = q->mins ? q->mins + base : (const uint16_t *)q->scales + base;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g += 16) {
        const __mmask16 mk = groups - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (groups - g)) - 1);
        const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, m + g));
        acc = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(mk, group_sums + g), acc);
    }
    return _mm512_reduce_add_ps(acc) * (q->mins ? 1.0f : -8.0f);
}

/* The unscaled dot product of block b's 32 codes (row codes w) with x's 32 columns there. */
static AI __m512 block_dot(const int kind, const uint8_t *w, int64_t b, const void *x) {
#ifdef __AVX512BF16__
    if (kind == DOT_INT4_BF16) {
        /* word i of the table: bfloat16 of (i & 15); vpermw reads an index's low 5 bits */
        const __m512i table = _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0,
                                               0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140,
                                               0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000,
                                               0x3f80, 0x0000);
        /* words 0..15: byte j (column j, low nibble); words 16..31: byte j >> 4 (column j + 16) */
        const __m512i shifts = _mm512_set_epi16(4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
        const __m512i words = _mm512_srlv_epi16(
            _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(w + b * 16)))), shifts);
        return _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_permutexvar_epi16(words, table),
                                (__m512bh)_mm512_loadu_si512((const bf16_t *)x + b * BLOCK));
    }
#endif
    const float *xb = (const float *)x + b * BLOCK;
    __m512 lo, hi;
    if (kind == DOT_INT4_F32) {
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + b * (BLOCK / 2))));
        lo = _mm512_permutexvar_ps(v, iota); /* vpermps reads an index's low 4 bits: the low nibble */
        hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
    } else {
        lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + b * BLOCK))));
        hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + b * BLOCK + 16))));
    }
    return _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(xb)));
}

static AI __m512 sum_chains(const __m512 *acc) {
    return _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
}

/* sum over blocks of d(block) * block_dot: with 32-column groups each block scaled as it comes (four
 * chains); with wider groups (a per-row int8 scale: one group) a group's blocks summed unscaled
 * (four chains), then scaled once. */
static AI float row_dot_one(const int kind, const qmat *q, int64_t row, const void *x, const float *d) {
    const int64_t nb = q->k / BLOCK, per_group = q->group / BLOCK;
    const uint8_t *w = q->w + (size_t)row * (kind == DOT_INT8_F32 ? q->k : q->k / 2);
    __m512 acc[GEMV_CHAINS];
    for (int c = 0; c < GEMV_CHAINS; c++) acc[c] = _mm512_setzero_ps();
    if (per_group == 1) {
        int64_t b = 0;
        for (; b + GEMV_CHAINS <= nb; b += GEMV_CHAINS)
            for (int c = 0; c < GEMV_CHAINS; c++) acc[c] = _mm512_fmadd_ps(block_dot(kind, w, b + c, x), _mm512_set1_ps(d[b + c]), acc[c]);
        for (; b < nb; b++) acc[0] = _mm512_fmadd_ps(block_dot(kind, w, b, x), _mm512_set1_ps(d[b]), acc[0]);
        return _mm512_reduce_add_ps(sum_chains(acc));
    }
    __m512 total = _mm512_setzero_ps();
    for (int64_t g = 0; g < q->groups; g++) {
        const int64_t first = g * per_group, last = first + per_group;
        int64_t b = first;
        for (; b + GEMV_CHAINS <= last; b += GEMV_CHAINS)
            for (int c = 0; c < GEMV_CHAINS; c++) acc[c] = _mm512_add_ps(acc[c], block_dot(kind, w, b + c, x));
        for (; b < last; b++) acc[0] = _mm512_add_ps(acc[0], block_dot(kind, w, b, x));
        total = _mm512_fmadd_ps(sum_chains(acc), _mm512_set1_ps(d[g]), total);
        for (int c = 0; c < GEMV_CHAINS; c++) acc[c] = _mm512_setzero_ps();
    }
    return _mm512_reduce_add_ps(total);
}

/* out [1, n] = x [1, k] @ W^T for int8 / int4 weights with k and the group a multiple of 32. */
static AI int qgemv_kind(const int kind, const int fmt, int bf16, const void *x, const qmat *q, void *out, int num_threads) {
    const int64_t n = q->n, k = q->k, groups = q->groups;
    float *xf = kernel_malloc((size_t)(k + groups) * sizeof(float));
    if (!xf) return KERNEL_NO_MEMORY;
    float *group_sums = xf + k;
    for (int64_t i = 0; i < k; i++) xf[i] = bf16 ? bf16_to_f32(((const bf16_t *)x)[i]) : ((const float *)x)[i];
    for (int64_t g = 0; g < groups; g++) {
        float sum = 0.0f;
        for (int64_t i = g * q->group; i < (g + 1) * q->group; i++) sum += xf[i];
        group_sums[g] = sum;
    }
    const void *xk = kind == DOT_INT4_BF16 ? x : (const void *)xf; /* what block_dot reads */
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n * k >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < n; r++) {
        if (r + GEMV_PREFETCH_ROWS < n) prefetch_row(fmt, q, r + GEMV_PREFETCH_ROWS);
        float d[groups];
        row_group_scales(q, r, d);
        float res = row_dot_one(kind, q, r, xk, d);
        if (fmt == FMT_INT4) res += row_offsets(q, r, group_sums);
        if (bf16) ((bf16_t *)out)[r] = f32_to_bf16(res);
        else ((float *)out)[r] = res;
    }
    free(xf);
    return 0;
}

static int qgemv(const int fmt, int bf16, const void *x, const qmat *q, void *out, int num_threads) {
    if (fmt == FMT_INT8) return qgemv_kind(DOT_INT8_F32, FMT_INT8, bf16, x, q, out, num_threads);
#ifdef __AVX512BF16__
    if (bf16) return qgemv_kind(DOT_INT4_BF16, FMT_INT4, bf16, x, q, out, num_threads);
#endif
    return qgemv_kind(DOT_INT4_F32, FMT_INT4, bf16, x, q, out, num_threads);
}
#endif

#ifdef QK_AVX2
/* ------------------------------------------------------------------------------------------ one input row, AVX2
 * As the AVX-512 one-row path above, in 8-lane vectors: per 32-column block the codes as they are
 * times x, summed unscaled, then scaled once by the block's d (with wider groups, once per group);
 * int4's offsets, the sum over groups of m * (sum of x over the group), one scalar product per
 * group with x's group sums computed once per call. The same dot products as sum((q * d + m) * x),
 * reassociated; it saves the tile kernel's q * d + m per value (an FMA per 8 values), and four
 * chains hide the FMA latency. Used for int8, int4 and fp8 rows of whole blocks. */

/* The unscaled dot product of block b's 32 codes (row codes w) with x's 32 columns there. */
static AI __m256 block_dot8(const int fmt, const uint8_t *w, int64_t b, const float *x) {
    const float *xb = x + b * BLOCK;
    __m256 f[4];
    if (fmt == FMT_INT4) { /* byte j: column j low nibble, column j + 16 high nibble */
        const uint8_t *src = w + b * (BLOCK / 2);
        const __m256i nib = _mm256_set1_epi32(15);
        const __m256i lo8 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)src));
        const __m256i hi8 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + 8)));
        f[0] = _mm256_cvtepi32_ps(_mm256_and_si256(lo8, nib));
        f[1] = _mm256_cvtepi32_ps(_mm256_and_si256(hi8, nib));
        f[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(lo8, 4));
        f[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(hi8, 4));
    } else if (fmt == FMT_INT8) {
        for (int i = 0; i < 4; i++) f[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + b * BLOCK + 8 * i))));
    } else {
        for (int h = 0; h < 2; h++) {
            const __m256i bits = fp8x16_as_half(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + b * BLOCK + 16 * h))));
            f[2 * h] = _mm256_cvtph_ps(_mm256_castsi256_si128(bits));
            f[2 * h + 1] = _mm256_cvtph_ps(_mm256_extracti128_si256(bits, 1));
        }
    }
    const __m256 a = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xb + 8), _mm256_mul_ps(f[0], _mm256_loadu_ps(xb)));
    return _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xb + 24), _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xb + 16), a));
}

/* sum over blocks of d(block) * block_dot8 for `row`, d [groups] its group scales */
static AI float row_dot_one8(const int fmt, const qmat *q, int64_t row, const float *x, const float *d) {
    const int64_t nb = q->k / BLOCK, per_group = q->group / BLOCK;
    const uint8_t *w = q->w + (size_t)row * (fmt == FMT_INT4 ? q->k / 2 : q->k);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    if (per_group == 1) {
        int64_t b = 0;
        for (; b + 4 <= nb; b += 4)
            for (int c = 0; c < 4; c++) acc[c] = _mm256_fmadd_ps(block_dot8(fmt, w, b + c, x), _mm256_set1_ps(d[b + c]), acc[c]);
        for (; b < nb; b++) acc[0] = _mm256_fmadd_ps(block_dot8(fmt, w, b, x), _mm256_set1_ps(d[b]), acc[0]);
        return hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    }
    __m256 total = _mm256_setzero_ps();
    for (int64_t g = 0; g < q->groups; g++) {
        const int64_t last = (g + 1) * per_group;
        int64_t b = g * per_group;
        for (; b + 4 <= last; b += 4)
            for (int c = 0; c < 4; c++) acc[c] = _mm256_add_ps(acc[c], block_dot8(fmt, w, b + c, x));
        for (; b < last; b++) acc[0] = _mm256_add_ps(acc[0], block_dot8(fmt, w, b, x));
        total = _mm256_fmadd_ps(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])), _mm256_set1_ps(d[g]), total);
        for (int c = 0; c < 4; c++) acc[c] = _mm256_setzero_ps();
    }
    return hsum8(total);
}

/* d [groups] = `row`'s group scales as float32 (fp8: times FP8_UNSCALE, as group_params); returns
 * int4's offsets, the sum over groups of m * group_sums (0 for int8, fp8). Eight groups a step: per
 * group in scalar code this cost as much as the blocks' dot products at group 32. */
static AI float row_scales_offsets8(const int fmt, const qmat *q, int64_t row, const float *group_sums, float *d) {
    const int64_t groups = q->groups, base = row * groups;
    const __m256 unscale = _mm256_set1_ps(fmt == FMT_FP8 ? FP8_UNSCALE : 1.0f);
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) {
        const __m256 sc = q->scales_f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)q->scales + base + g)))
                                        : _mm256_loadu_ps((const float *)q->scales + base + g);
        _mm256_storeu_ps(d + g, _mm256_mul_ps(sc, unscale));
        if (fmt == FMT_INT4) {
            const __m256 m = q->mins ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(q->mins + base + g))) : _mm256_mul_ps(sc, _mm256_set1_ps(-8.0f));
            acc = _mm256_fmadd_ps(m, _mm256_loadu_ps(group_sums + g), acc);
        }
    }
    float offsets = hsum8(acc);
    for (; g < groups; g++) {
        float m;
        group_params(q, fmt, row, g, &d[g], &m);
        if (fmt == FMT_INT4) offsets += m * group_sums[g];
    }
    return offsets;
}

/* out [1, n] = x [1, k] @ W^T for weights whose k and group are a multiple of 32. */
static AI int qgemv8(const int fmt, int bf16, const void *x, const qmat *q, void *out, int num_threads) {
    const int64_t n = q->n, k = q->k, groups = q->groups;
    float *xf = kernel_malloc((size_t)(k + groups) * sizeof(float));
    if (!xf) return KERNEL_NO_MEMORY;
    float *group_sums = xf + k;
    load_row(xf, x, k, bf16);
    for (int64_t g = 0; g < groups; g++) {
        float sum = 0.0f;
        for (int64_t i = g * q->group; i < (g + 1) * q->group; i++) sum += xf[i];
        group_sums[g] = sum;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n * k >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < n; r++) {
        if (r + GEMV_PREFETCH_ROWS < n) prefetch_row(fmt, q, r + GEMV_PREFETCH_ROWS);
        float d[groups];
        const float offsets = row_scales_offsets8(fmt, q, r, group_sums, d);
        const float res = row_dot_one8(fmt, q, r, xf, d) + offsets;
        if (bf16) ((bf16_t *)out)[r] = f32_to_bf16(res);
        else ((float *)out)[r] = res;
    }
    free(xf);
    return 0;
}
#endif

static AI int qlinear(const int fmt, int bf16, const void *x, int64_t rows, const qmat *q, void *out, int num_threads) {
#ifdef QK_AVX512
    if (rows == 1 && fmt != FMT_FP8 && q->k % BLOCK == 0 && q->group % BLOCK == 0) return qgemv(fmt, bf16, x, q, out, num_threads);
#endif
#ifdef QK_AVX2
    if (rows == 1 && q->k % BLOCK == 0 && q->group % BLOCK == 0) return qgemv8(fmt, bf16, x, q, out, num_threads);
#endif
    const int64_t n = q->n, kp = (q->k + BLOCK - 1) / BLOCK * BLOCK;
    float *xf = padded_input(x, bf16, rows, q->k, kp);
    if (!xf) return KERNEL_NO_MEMORY;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n * q->k >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < n; r++) {
        for (int64_t m0 = 0; m0 < rows; m0 += TILE) {
            const int t = rows - m0 < TILE ? (int)(rows - m0) : TILE;
            float res[TILE];
            row_dot_n(q, fmt, r, xf + m0 * kp, kp, t, res);
            for (int i = 0; i < t; i++) {
                const size_t at = (size_t)((m0 + i) * n + r);
                if (bf16) ((bf16_t *)out)[at] = f32_to_bf16(res[i]);
                else ((float *)out)[at] = res[i];
            }
        }
    }
    free(xf);
    return 0;
}

static AI void qdequantize(const int fmt, const qmat *q, int64_t row0, int64_t row1, int bf16, void *out, int num_threads) {
    const int64_t k = q->k;
#ifdef QK_AVX2
#pragma omp parallel for num_threads(num_threads) schedule(static) if ((row1 - row0) * k >= PARALLEL_MIN_ELEMS)
    for (int64_t r = row0; r < row1; r++) {
        int64_t g = -1, group_end = 0;
        float d = 0.0f, m = 0.0f;
        uint8_t tail[BLOCK];
        for (int64_t j = 0; j < k; j += BLOCK) {
            enter_block(q, fmt, r, j, &g, &group_end, &d, &m);
            const int64_t cnt = k - j < BLOCK ? k - j : BLOCK;
            __m256 v[4];
            dequant_block8(block_codes(q, fmt, r, j, cnt, tail), fmt, d, m, v);
            const size_t at = (size_t)((r - row0) * k + j);
            if (cnt == BLOCK) {
                for (int i = 0; i < 4; i++) {
                    if (bf16) bf16x8_store((bf16_t *)out + at + 8 * i, bf16x8_round(v[i])); /* vec.h's f32_to_bf16 on 8 lanes */
                    else _mm256_storeu_ps((float *)out + at + 8 * i, v[i]);
                }
                continue;
            }
            float vals[BLOCK];
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(vals + 8 * i, v[i]);
            store_row(bf16 ? (void *)((bf16_t *)out + at) : (void *)((float *)out + at), vals, cnt, bf16);
        }
    }
#else
#pragma omp parallel for num_threads(num_threads) schedule(static) if ((row1 - row0) * k >= PARALLEL_MIN_ELEMS)
    for (int64_t r = row0; r < row1; r++) {
        float vals[BLOCK];
        int64_t g = -1, group_end = 0;
        float d = 0.0f, m = 0.0f;
        for (int64_t j = 0; j < k; j += BLOCK) {
            enter_block(q, fmt, r, j, &g, &group_end, &d, &m);
            const int64_t cnt = k - j < BLOCK ? k - j : BLOCK;
            v16f lo, hi;
            dequant_block(q, fmt, r, j, cnt, d, m, &lo, &hi);
            memcpy(vals, &lo, sizeof(lo));
            memcpy(vals + 16, &hi, sizeof(hi));
            const size_t at = (size_t)((r - row0) * k + j);
            if (bf16) {
#ifdef __AVX512BF16__
                if (cnt == BLOCK) { /* vcvtne2ps2bf16 rounds to nearest even, as f32_to_bf16 does */
                    _mm512_storeu_si512((char *)out + at * sizeof(bf16_t), (__m512i)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo));
                    continue;
                }
#endif
                for (int64_t i = 0; i < cnt; i++) ((bf16_t *)out)[at + i] = f32_to_bf16(vals[i]);
            } else if (cnt == BLOCK) { /* constant size: inlined stores, not a memcpy call per block */
                memcpy((float *)out + at, vals, sizeof(vals));
            } else {
                memcpy((float *)out + at, vals, (size_t)cnt * sizeof(float));
            }
        }
    }
#endif
}

/* ------------------------------------------------------------------------------------------ K-quants
 * GGUF's Q4_K, Q5_K and Q6_K super-blocks (256 values; engine/quant/kquants.py describes the bytes),
 * read as stored. Dequantizing (kquant_dequantize, and the portable linear) gives gguf.quants.dequantize's
 * values bit for bit: the same float32 products and one subtraction, every product exact in float32,
 * so contraction into an FMA changes nothing. The linear multiplies into up to TILE input rows at
 * once: with AVX2 (x86-64-v3, this project's Zen 2 machines) the codes unpacked by intrinsics and
 * multiplied as they are, each chunk scaled once (kq_row_dot_avx2); elsewhere each super-block is
 * dequantized into 256 floats by portable loops, then multiplied. */
#define QK_K 256
enum { FMT_Q4_K = 3, FMT_Q5_K = 4, FMT_Q6_K = 5 };

static AI int64_t kq_type_size(const int fmt) { return fmt == FMT_Q4_K ? 144 : fmt == FMT_Q5_K ? 176 : 210; }

static AI float kq_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof(h));
    return half_to_f32(h);
}

/* ggml's get_scale_min_k4: sub-block j's 6-bit scale and min from the 12 packed bytes. */
static AI void kq_scale_min(const uint8_t *s, int j, float *sc, float *m) {
    if (j < 4) {
        *sc = (float)(s[j] & 63);
        *m = (float)(s[j + 4] & 63);
    } else {
        *sc = (float)((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
        *m = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

#ifdef __AVX2__
#include <immintrin.h>
/* out[0..32) = scale * codes[0..32) - offset, codes uint8 (or int8 with `is_signed`) in a register */
static AI void kq_store32(__m256i codes, int is_signed, float scale_lo, float scale_hi, float offset, float *out) {
    uint8_t tmp[32];
    _mm256_storeu_si256((__m256i *)tmp, codes);
    const __m256 vm = _mm256_set1_ps(offset);
    for (int c = 0; c < 4; c++) {
        const __m128i eight = _mm_loadl_epi64((const __m128i *)(tmp + 8 * c));
        const __m256 f = _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight));
        const __m256 vd = _mm256_set1_ps(c < 2 ? scale_lo : scale_hi);
        _mm256_storeu_ps(out + 8 * c, _mm256_sub_ps(_mm256_mul_ps(vd, f), vm));
    }
}
#endif

/* One super-block `b` of type fmt -> out[256] float32, bit for bit gguf's values. */
static AI void kq_dequant_block(const int fmt, const uint8_t *b, float *out) {
    if (fmt == FMT_Q6_K) {
        const float d = kq_half(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            for (int s = 0; s < 4; s++) { /* values 128 h + 32 s + i: low nibbles of ql[32 (s & 1) + i] (high for s >= 2), bits 2s of qh[i] */
                float *dst = out + 128 * h + 32 * s;
                const float d0 = d * (float)sc[8 * h + 2 * s], d1 = d * (float)sc[8 * h + 2 * s + 1];
#ifdef __AVX2__
                const __m256i lowb = _mm256_loadu_si256((const __m256i *)(ql + 32 * (s & 1)));
                const __m256i low = _mm256_and_si256(s >= 2 ? _mm256_srli_epi16(lowb, 4) : lowb, _mm256_set1_epi8(0x0F));
                const __m256i high = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)qh), _mm_cvtsi32_si128(2 * s)),
                                                      _mm256_set1_epi8(0x03));
                const __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
                kq_store32(q, 1, d0, d1, 0.0f, dst);
#else
                for (int i = 0; i < 32; i++) {
                    const int lo = (ql[32 * (s & 1) + i] >> (4 * (s >> 1))) & 15, hi = (qh[i] >> (2 * s)) & 3;
                    dst[i] = (i < 16 ? d0 : d1) * (float)((lo | (hi << 4)) - 32);
                }
#endif
            }
        }
        return;
    }
    /* Q4_K, Q5_K: four pairs of 32-value sub-blocks, 2p from the low nibbles of qs[32 p + i], 2p + 1 from the high */
    const float d = kq_half(b), dmin = kq_half(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *qs = fmt == FMT_Q5_K ? b + 48 : b + 16;
    for (int p = 0; p < 4; p++) {
        float sc0, m0, sc1, m1;
        kq_scale_min(scales, 2 * p, &sc0, &m0);
        kq_scale_min(scales, 2 * p + 1, &sc1, &m1);
        const float d0 = d * sc0, o0 = dmin * m0, d1 = d * sc1, o1 = dmin * m1;
        float *dst = out + 64 * p;
#ifdef __AVX2__
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * p)), nib = _mm256_set1_epi8(0x0F);
        __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        if (fmt == FMT_Q5_K) { /* the fifth bit: bit 2p (2p + 1) of qh[i], moved to bit 4 */
            const __m256i h = _mm256_loadu_si256((const __m256i *)qh), bit = _mm256_set1_epi8(0x10);
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_sll_epi16(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * p)), _mm_cvtsi32_si128(4)), bit));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_sll_epi16(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * p + 1)), _mm_cvtsi32_si128(4)), bit));
        }
        kq_store32(lo, 0, d0, d0, o0, dst);
        kq_store32(hi, 0, d1, d1, o1, dst + 32);
#else
        for (int i = 0; i < 32; i++) {
            int lo = qs[32 * p + i] & 15, hi = qs[32 * p + i] >> 4;
            if (fmt == FMT_Q5_K) {
                lo |= ((qh[i] >> (2 * p)) & 1) << 4;
                hi |= ((qh[i] >> (2 * p + 1)) & 1) << 4;
            }
            dst[i] = d0 * (float)lo - o0;
            dst[32 + i] = d1 * (float)hi - o1;
        }
#endif
    }
}

#ifndef __AVX2__
/* res[i] = dot(row `row` of the weight, x row i) for i < t, x float32 [t, k] (row stride k): each
 * super-block's 256 values times a row in four 4-lane chains (SSE / NEON registers; a 16-lane
 * accumulator per row went through the stack there), summed into the row's total per super-block. */
static AI void kq_row_dot_n(const int fmt, const uint8_t *w, int64_t k, const float *x, int t, float *res) {
    const int64_t size = kq_type_size(fmt);
    float vals[QK_K] __attribute__((aligned(64)));
    for (int i = 0; i < t; i++) res[i] = 0.0f;
    for (int64_t sb = 0; sb < k / QK_K; sb++) {
        kq_dequant_block(fmt, w + sb * size, vals);
        for (int i = 0; i < t; i++) {
            const float *xb = x + i * k + sb * QK_K;
            v4f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int c = 0; c < QK_K; c += 16) {
                a0 += load4(vals + c) * load4(xb + c);
                a1 += load4(vals + c + 4) * load4(xb + c + 4);
                a2 += load4(vals + c + 8) * load4(xb + c + 8);
                a3 += load4(vals + c + 12) * load4(xb + c + 12);
            }
            const v4f s = (a0 + a1) + (a2 + a3);
            res[i] += (s[0] + s[1]) + (s[2] + s[3]);
        }
    }
}
#endif

#ifdef __AVX2__
/* The linear's AVX2 path, factored: per 32-value chunk (one scale; Q6_K: two, one per 16) the codes
 * as they are times x, summed unscaled, then scaled once; Q4_K / Q5_K's offsets, the sum over chunks
 * of dmin * m * (sum of x over the chunk), one scalar product per chunk with x's chunk sums computed
 * once per call. The same dot products as sum(dequantized * x), reassociated (the tests' "up to
 * summation order" tolerance); about twice the dequantize-then-multiply loop's speed on Zen 2. */

/* The 32 codes of chunk c (0..7) of super-block b, as bytes: Q4_K / Q5_K 0..31, Q6_K -32..31. */
static AI __m256i kq_codes32(const int fmt, const uint8_t *b, int c) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    if (fmt == FMT_Q6_K) {
        const int h = c >> 2, s = c & 3;
        const __m256i lowb = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (s & 1)));
        const __m256i low = _mm256_and_si256(s >= 2 ? _mm256_srli_epi16(lowb, 4) : lowb, nib);
        const __m256i high = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)), _mm_cvtsi32_si128(2 * s)),
                                              _mm256_set1_epi8(0x03));
        return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
    }
    const __m256i v = _mm256_loadu_si256((const __m256i *)((fmt == FMT_Q5_K ? b + 48 : b + 16) + 32 * (c >> 1)));
    __m256i q = _mm256_and_si256((c & 1) ? _mm256_srli_epi16(v, 4) : v, nib);
    if (fmt == FMT_Q5_K) { /* the fifth bit: bit c of qh[i], moved to bit 4 */
        const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 16));
        q = _mm256_or_si256(q, _mm256_and_si256(_mm256_sll_epi16(_mm256_srl_epi16(h, _mm_cvtsi32_si128(c)), _mm_cvtsi32_si128(4)), _mm256_set1_epi8(0x10)));
    }
    return q;
}

/* res[i] = dot(weight row w, x row i) for i < t; xsums [t, k / 32]: x's sums over 32-value chunks. */
static AI void kq_row_dot_avx2(const int fmt, const uint8_t *w, int64_t k, const float *x, const float *xsums, int t, float *res) {
    const int64_t size = kq_type_size(fmt), chunks = k / 32;
    __m256 tot[TILE];
    float off[TILE];
    for (int i = 0; i < t; i++) {
        tot[i] = _mm256_setzero_ps();
        off[i] = 0.0f;
    }
    for (int64_t sb = 0; sb < k / QK_K; sb++) {
        const uint8_t *b = w + sb * size;
        float d_lo[8], d_hi[8], o[8];
        if (fmt == FMT_Q6_K) {
            const float d = kq_half(b + 208);
            const int8_t *sc = (const int8_t *)(b + 192);
            for (int c = 0; c < 8; c++) {
                d_lo[c] = d * (float)sc[2 * c];
                d_hi[c] = d * (float)sc[2 * c + 1];
                o[c] = 0.0f;
            }
        } else {
            const float d = kq_half(b), dmin = kq_half(b + 2);
            for (int c = 0; c < 8; c++) {
                float sc, m;
                kq_scale_min(b + 4, c, &sc, &m);
                d_lo[c] = d_hi[c] = d * sc;
                o[c] = dmin * m;
            }
        }
        for (int c = 0; c < 8; c++) {
            const __m256i codes = kq_codes32(fmt, b, c);
            const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
            const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            __m256 f[4];
            for (int j = 0; j < 4; j++)
                f[j] = _mm256_cvtepi32_ps(fmt == FMT_Q6_K ? _mm256_cvtepi8_epi32(parts[j]) : _mm256_cvtepu8_epi32(parts[j]));
            const __m256 dl = _mm256_set1_ps(d_lo[c]), dh = _mm256_set1_ps(d_hi[c]);
            for (int i = 0; i < t; i++) {
                const float *xb = x + i * k + sb * QK_K + 32 * c;
                const __m256 a0 = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xb + 8), _mm256_mul_ps(f[0], _mm256_loadu_ps(xb)));
                const __m256 a1 = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xb + 24), _mm256_mul_ps(f[2], _mm256_loadu_ps(xb + 16)));
                tot[i] = _mm256_fmadd_ps(a1, dh, _mm256_fmadd_ps(a0, dl, tot[i]));
                off[i] += o[c] * xsums[i * chunks + sb * 8 + c];
            }
        }
    }
    for (int i = 0; i < t; i++) res[i] = hsum8(tot[i]) - off[i];
}
#endif

static int kq_linear(const int fmt, int bf16, const void *x, int64_t rows, int64_t n, int64_t k, const uint8_t *w, void *out,
                     int num_threads) {
    float *xf = padded_input(x, bf16, rows, k, k); /* k is whole super-blocks */
    if (!xf) return KERNEL_NO_MEMORY;
    const int64_t row_bytes = k / QK_K * kq_type_size(fmt);
#ifdef __AVX2__
    const int64_t chunks = k / 32;
    float *xsums = kernel_malloc((size_t)(rows * chunks) * sizeof(float));
    if (!xsums) {
        free(xf);
        return KERNEL_NO_MEMORY;
    }
    for (int64_t m = 0; m < rows * chunks; m++) {
        float sum = 0.0f;
        for (int i = 0; i < 32; i++) sum += xf[m * 32 + i];
        xsums[m] = sum;
    }
#endif
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n * k >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < n; r++) {
        for (int64_t m0 = 0; m0 < rows; m0 += TILE) {
            const int t = rows - m0 < TILE ? (int)(rows - m0) : TILE;
            float res[TILE];
#ifdef __AVX2__
            kq_row_dot_avx2(fmt, w + r * row_bytes, k, xf + m0 * k, xsums + m0 * chunks, t, res);
#else
            kq_row_dot_n(fmt, w + r * row_bytes, k, xf + m0 * k, t, res);
#endif
            for (int i = 0; i < t; i++) {
                const size_t at = (size_t)((m0 + i) * n + r);
                if (bf16) ((bf16_t *)out)[at] = f32_to_bf16(res[i]);
                else ((float *)out)[at] = res[i];
            }
        }
    }
#ifdef __AVX2__
    free(xsums);
#endif
    free(xf);
    return 0;
}

/* Dequantize output rows [row0, row1) of a K-quant weight (fmt: 3 Q4_K, 4 Q5_K, 5 Q6_K) into out
 * [row1 - row0, k] (float32 or bfloat16). */
void kquant_dequantize(const void *w, int fmt, int64_t n, int64_t k, int64_t row0, int64_t row1, int bf16, void *out,
                       int num_threads) {
    (void)n;
    const int64_t size = kq_type_size(fmt), row_bytes = k / QK_K * size;
#pragma omp parallel for num_threads(num_threads) schedule(static) if ((row1 - row0) * k >= PARALLEL_MIN_ELEMS)
    for (int64_t r = row0; r < row1; r++) {
        float vals[QK_K];
        for (int64_t sb = 0; sb < k / QK_K; sb++) {
            kq_dequant_block(fmt, (const uint8_t *)w + r * row_bytes + sb * size, vals);
            const size_t at = (size_t)((r - row0) * k + sb * QK_K);
            if (bf16) {
                for (int i = 0; i < QK_K; i++) ((bf16_t *)out)[at + i] = f32_to_bf16(vals[i]);
            } else {
                memcpy((float *)out + at, vals, sizeof(vals));
            }
        }
    }
}

static qmat make_qmat(const void *w, const void *scales, int scales_f16, const uint16_t *mins, int64_t n, int64_t k, int64_t group) {
    qmat q = {(const uint8_t *)w, scales, mins, n, k, group, (k + group - 1) / group, scales_f16};
    return q;
}

/* The vector width in bits the int8 / int4 / fp8 code of this build is written for: 512 (AVX-512
 * intrinsics), 256 (AVX2 intrinsics) or 128 (the portable loops). engine.quant.linear picks its
 * kernel / dequant_mm cutoffs from it: they differ by build (bench/NOTES.md 'AVX2 quantized linears'). */
int quant_kernels_simd_bits(void) {
#if defined(QK_AVX512)
    return 512;
#elif defined(QK_AVX2)
    return 256;
#else
    return 128;
#endif
}

/* Entry point of the linears: one weight described once (engine.kernels.quant.QuantKernels.bind
 * fills the struct at load), so a call passes six arguments, not eleven: a decode step makes about
 * four calls per layer, and converting each ctypes argument costs about as much as a small kernel.
 * Returns KERNEL_OK, or KERNEL_NO_MEMORY when the input copy cannot be allocated. */
typedef struct {
    const void *w, *scales, *mins; /* mins: int4 only, or NULL */
    int64_t n, k, group;
    int32_t fmt, scales_f16;
} quant_weight;

int quant_linear(const quant_weight *d, int bf16, const void *x, int64_t rows, void *out, int num_threads) {
    qmat q = make_qmat(d->w, d->scales, d->scales_f16, (const uint16_t *)d->mins, d->n, d->k, d->group);
    switch (d->fmt) {
    case FMT_INT8: return qlinear(FMT_INT8, bf16, x, rows, &q, out, num_threads);
    case FMT_INT4: return qlinear(FMT_INT4, bf16, x, rows, &q, out, num_threads);
    case FMT_Q4_K: return kq_linear(FMT_Q4_K, bf16, x, rows, d->n, d->k, (const uint8_t *)d->w, out, num_threads);
    case FMT_Q5_K: return kq_linear(FMT_Q5_K, bf16, x, rows, d->n, d->k, (const uint8_t *)d->w, out, num_threads);
    case FMT_Q6_K: return kq_linear(FMT_Q6_K, bf16, x, rows, d->n, d->k, (const uint8_t *)d->w, out, num_threads);
    default: return qlinear(FMT_FP8, bf16, x, rows, &q, out, num_threads);
    }
}

/* Dequantize output rows [row0, row1) into out [row1 - row0, k] (float32 or bfloat16). */
void int8_dequantize(const void *w, const void *scales, int scales_f16, int64_t n, int64_t k, int64_t group,
                     int64_t row0, int64_t row1, int bf16, void *out, int num_threads) {
    qmat q = make_qmat(w, scales, scales_f16, NULL, n, k, group);
    qdequantize(FMT_INT8, &q, row0, row1, bf16, out, num_threads);
}

void int4_dequantize(const void *w, const void *scales, const void *mins, int64_t n, int64_t k, int64_t group,
                     int64_t row0, int64_t row1, int bf16, void *out, int num_threads) {
    qmat q = make_qmat(w, scales, 1, (const uint16_t *)mins, n, k, group);
    qdequantize(FMT_INT4, &q, row0, row1, bf16, out, num_threads);
}

void fp8_dequantize(const void *w, const void *scales, int64_t n, int64_t k, int64_t group, int64_t row0, int64_t row1, int bf16,
                    void *out, int num_threads) {
    qmat q = make_qmat(w, scales, 0, NULL, n, k, group);
    qdequantize(FMT_FP8, &q, row0, row1, bf16, out, num_threads);
}
