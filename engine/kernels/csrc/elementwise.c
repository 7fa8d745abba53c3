/* Elementwise kernels of a Llama step (the cpu_kernels library; engine/kernels/cpu.py binds them):
 * add + RMSNorm, SiLU-and-multiply, and RoPE with the K/V cache write, each one call over all the
 * step's rows where torch runs 5-30 small ops per layer. */
#include "vec.h"

#ifdef HAVE_AVX512_ROWS
static inline __m256i bf16x16_round_mul(__m512 a, __m512 b) {
#ifdef __AVX512BF16__
    const __m512 y = _mm512_mul_ps(bf16x16_to_f32((__m256i)_mm512_cvtneps_pbh(a)), b);
    if (__builtin_expect(_kortestz_mask16_u8(_mm512_fpclass_ps_mask(a, DENORMAL), _mm512_fpclass_ps_mask(y, DENORMAL)), 1))
        return (__m256i)_mm512_cvtneps_pbh(y);
#endif
    return bf16x16_round_soft(_mm512_mul_ps(bf16x16_to_f32(bf16x16_round_soft(a)), b));
}

/* 16 (masked: fewer) values of a row of either dtype, as float32, and back (rounded) */
static inline __m512 row16_load(const void *row, int64_t i, __mmask16 m, int bf16) {
    return bf16 ? bf16x16_load((const bf16_t *)row + i, m) : _mm512_maskz_loadu_ps(m, (const float *)row + i);
}

static inline void row16_store(void *row, int64_t i, __mmask16 m, __m512 x, int bf16) {
    if (bf16)
        _mm256_mask_storeu_epi16((bf16_t *)row + i, m, bf16x16_round(x));
    else
        _mm512_mask_storeu_ps((float *)row + i, m, x);
}
#endif

/* The value bfloat16 stores, bf16_to_f32(f32_to_bf16(x)), kept in 32-bit lanes: the rounded bits'
 * high half, a NaN quieted (f32_to_bf16's cases, the same bits). Through bf16_t the vectorized loops
 * narrowed every lane to 16 bits and widened it back (AVX2: a bfloat16 add + RMSNorm of 32 x 576 on 1
 * thread took 3.7x float32's time; bench/NOTES.md 'bfloat16 steps past 8 decodes'). */
static inline float round_bf16(float x) {
    union { uint32_t u; float f; } v = {.f = x};
    v.u = (v.u & 0x7fffffffu) > 0x7f800000u ? (v.u & 0xffff0000u) | 0x00400000u : (v.u + 0x7fffu + ((v.u >> 16) & 1u)) & 0xffff0000u;
    return v.f;
}

/* Row-wise elementwise kernels (norm, SiLU, RoPE) split sooner than PARALLEL_MIN_ELEMS: at 32
 * decode rows x 1536, 49K elements, two threads already beat one (bench/NOTES.md); RoPE + cache
 * write of 32 demo tokens (30K elements, AVX-512): 5.5 -> 4.6 us wall. */
#define ROWWISE_PARALLEL_MIN_ELEMS (PARALLEL_MIN_ELEMS / 4)

/* ------------------------------------------------------------------------------------------ RMSNorm
 * residual [rows, dim] += delta (if given, rounded to the model dtype as torch's add is), then
 * out = rms_norm(residual) * weight. float32: x * rsqrt(mean(x^2) + eps) * w in one rounding
 * (F.rms_norm); bfloat16: normalised in float32, rounded, times the weight, rounded again (the
 * torch path's `rms_norm(x.float()).type_as(x) * weight`). */
static void add_rms_norm_f32(float *res, const float *delta, const float *w, float *out, int64_t dim, float eps) {
    if (delta != NULL) {
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) res[i] += delta[i];
    }
    float sum_sq = 0.0f;
#pragma omp simd reduction(+ : sum_sq)
    for (int64_t i = 0; i < dim; i++) sum_sq += res[i] * res[i];
    const float inv_rms = 1.0f / sqrtf(sum_sq / (float)dim + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) out[i] = res[i] * inv_rms * w[i];
}

/* bfloat16 rows, NORM_ROWS at a time (add_rms_norm_rows_bf16); w: the weight as float32, x: NORM_ROWS * dim
 * floats of scratch (both the caller's, per thread). */
#define NORM_ROWS 8 /* sum_sq_rows keeps one accumulator a row, all in registers */

#if defined(HAVE_AVX512_ROWS) || (defined(__AVX2__) && defined(__FMA__))
/* The sums of x[i]^2 in the order the portable loop had under -march=native on AVX-512 Intel CPUs
 * (GCC prefers 256 bits there), so results keep their bits: a 16-lane order changed a few outputs in
 * a million by an ulp, which turned greedy answers of a batch-dependent test (test_demo_model's
 * native Q4_1 facts, 4 of 10 runs). That order: an 8-lane accumulator, the dim % 8 tail added to
 * lane 0, then its reduction tree, here in vector ops (-fassociative-math may regroup scalar adds).
 * One row's sum is a chain of dim / 8 dependent FMAs: NORM_ROWS rows run theirs side by side
 * (1 thread, 512 x 576: 161 -> 100 us with 4 rows; 8 rows, which two FMA ports of 4-cycle latency
 * keep busy: 88 -> 82 us). */
static inline float sum_sq_finish(__m256 acc, const float *x, int64_t i, int64_t dim) {
    if (i < dim) {
        float lanes[8];
        _mm256_storeu_ps(lanes, acc);
        for (; i < dim; i++) lanes[0] = __builtin_fmaf(x[i], x[i], lanes[0]);
        acc = _mm256_loadu_ps(lanes);
    }
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1)); /* lanes j + j+4 */
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));                                        /* b0 + b2, b1 + b3 */
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 0x55)));
}

static void sum_sq_rows(const float *x, int64_t n, int64_t dim, float sums[NORM_ROWS]) { /* x: n <= NORM_ROWS rows */
    const float *row[NORM_ROWS];
    for (int64_t r = 0; r < NORM_ROWS; r++) row[r] = x + (r < n ? r : n - 1) * dim; /* spare chains redo the last row */
    __m256 acc[NORM_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < NORM_ROWS; r++) acc[r] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) {
#pragma GCC unroll 8
        for (int r = 0; r < NORM_ROWS; r++) {
            const __m256 v = _mm256_loadu_ps(row[r] + i);
            acc[r] = _mm256_fmadd_ps(v, v, acc[r]);
        }
    }
    for (int64_t r = 0; r < n; r++) sums[r] = sum_sq_finish(acc[r], row[r], i, dim);
}
#endif

#ifdef HAVE_AVX512_ROWS

/* res[i..i+16) (+= delta, rounded and stored back), as float32 into x */
static inline void add_row16_bf16(bf16_t *res, const bf16_t *delta, float *x, int64_t i, __mmask16 m) {
    __m512 v = bf16x16_load(res + i, m);
    if (delta != NULL) {
        const __m256i r = bf16x16_round(_mm512_add_ps(v, bf16x16_load(delta + i, m)));
        _mm256_mask_storeu_epi16(res + i, m, r);
        v = bf16x16_to_f32(r);
    }
    _mm512_mask_storeu_ps(x + i, m, v);
}

/* out = round(round(x * inv_rms) * w) for one row */
static inline void norm_row_bf16(const float *x, const float *w, bf16_t *out, int64_t dim, float inv_rms) {
    const __m512 scale = _mm512_set1_ps(inv_rms);
    int64_t i = 0;
    for (; i + 16 <= dim; i += 16) {
        const __m512 normed = _mm512_mul_ps(_mm512_loadu_ps(x + i), scale);
        _mm256_storeu_si256((__m256i *)(out + i), bf16x16_round_mul(normed, _mm512_loadu_ps(w + i)));
    }
    if (i < dim) {
        const __mmask16 m = row_mask(dim - i);
        const __m512 normed = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), scale);
        _mm256_mask_storeu_epi16(out + i, m, bf16x16_round_mul(normed, _mm512_maskz_loadu_ps(m, w + i)));
    }
}

/* n <= NORM_ROWS consecutive rows; x: NORM_ROWS * dim floats of scratch */
static void add_rms_norm_rows_bf16(bf16_t *res, const bf16_t *delta, const float *w, bf16_t *out, float *x, int64_t n,
                                   int64_t dim, float eps) {
    for (int64_t r = 0; r < n; r++) {
        bf16_t *res_r = res + r * dim;
        const bf16_t *delta_r = delta ? delta + r * dim : NULL;
        int64_t i = 0;
        for (; i + 16 <= dim; i += 16) add_row16_bf16(res_r, delta_r, x + r * dim, i, 0xffff); /* constant mask: plain loads and stores */
        if (i < dim) add_row16_bf16(res_r, delta_r, x + r * dim, i, row_mask(dim - i));
    }
    float sums[NORM_ROWS];
    sum_sq_rows(x, n, dim, sums);
    for (int64_t r = 0; r < n; r++) norm_row_bf16(x + r * dim, w, out + r * dim, dim, 1.0f / sqrtf(sums[r] / (float)dim + eps));
}
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 builds: the AVX-512 rows' structure in 8 lanes (the sums side by side, sum_sq_rows, in the order
 * the portable loop had: the same bits), each value converted once; the portable loop's five passes
 * (widen, add and round, sum, two roundings, narrow) ran a 32 x 576 bfloat16 add + RMSNorm at 3x
 * float32's time on a Zen 2 (bench/NOTES.md 'bfloat16 steps past 8 decodes'). The 8-lane conversions
 * (bf16x8_load, bf16x8_round, bf16x8_store) are vec.h's, which load_row and store_row use too. */

/* n <= NORM_ROWS consecutive rows; x: NORM_ROWS * dim floats of scratch */
static void add_rms_norm_rows_bf16(bf16_t *res, const bf16_t *delta, const float *w, bf16_t *out, float *x, int64_t n,
                                   int64_t dim, float eps) {
    for (int64_t r = 0; r < n; r++) {
        bf16_t *res_r = res + r * dim;
        const bf16_t *delta_r = delta ? delta + r * dim : NULL;
        float *x_r = x + r * dim;
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8) {
            __m256 v = bf16x8_load(res_r + i);
            if (delta_r != NULL) {
                v = bf16x8_round(_mm256_add_ps(v, bf16x8_load(delta_r + i)));
                bf16x8_store(res_r + i, v);
            }
            _mm256_storeu_ps(x_r + i, v);
        }
        for (; i < dim; i++) {
            float v = bf16_to_f32(res_r[i]);
            if (delta_r != NULL) res_r[i] = f32_to_bf16(v = round_bf16(v + bf16_to_f32(delta_r[i])));
            x_r[i] = v;
        }
    }
    float sums[NORM_ROWS];
    sum_sq_rows(x, n, dim, sums);
    for (int64_t r = 0; r < n; r++) {
        const float *x_r = x + r * dim;
        bf16_t *out_r = out + r * dim;
        const float inv_rms = 1.0f / sqrtf(sums[r] / (float)dim + eps);
        const __m256 scale = _mm256_set1_ps(inv_rms);
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8)
            bf16x8_store(out_r + i, bf16x8_round(_mm256_mul_ps(bf16x8_round(_mm256_mul_ps(_mm256_loadu_ps(x_r + i), scale)), _mm256_loadu_ps(w + i))));
        for (; i < dim; i++) out_r[i] = f32_to_bf16(round_bf16(x_r[i] * inv_rms) * w[i]);
    }
}
#else
static void add_rms_norm_bf16(bf16_t *res, const bf16_t *delta, const float *w, bf16_t *out, float *x, int64_t dim, float eps) {
    load_row(x, res, dim, 1);
    if (delta != NULL) {
        float d[dim];
        load_row(d, delta, dim, 1);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) x[i] = round_bf16(x[i] + d[i]);
        store_row(res, x, dim, 1);
    }
    float sum_sq = 0.0f;
#pragma omp simd reduction(+ : sum_sq)
    for (int64_t i = 0; i < dim; i++) sum_sq += x[i] * x[i];
    const float inv_rms = 1.0f / sqrtf(sum_sq / (float)dim + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) x[i] = round_bf16(round_bf16(x[i] * inv_rms) * w[i]);
    store_row(out, x, dim, 1);
}

static void add_rms_norm_rows_bf16(bf16_t *res, const bf16_t *delta, const float *w, bf16_t *out, float *x, int64_t n,
                                   int64_t dim, float eps) {
    for (int64_t r = 0; r < n; r++)
        add_rms_norm_bf16(res + r * dim, delta ? delta + r * dim : NULL, w, out + r * dim, x, dim, eps);
}
#endif

void add_rms_norm(int bf16, void *residual, const void *delta, const void *weight, void *out, int64_t rows,
                  int64_t dim, float eps, int num_threads) {
    if (!bf16) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * dim >= ROWWISE_PARALLEL_MIN_ELEMS && rows > 1)
        for (int64_t r = 0; r < rows; r++)
            add_rms_norm_f32((float *)residual + r * dim, delta ? (const float *)delta + r * dim : NULL,
                             (const float *)weight, (float *)out + r * dim, dim, eps);
        return;
    }
#pragma omp parallel num_threads(num_threads) if (rows * dim >= ROWWISE_PARALLEL_MIN_ELEMS && rows > 1)
    {
        float w[dim], x[NORM_ROWS * dim]; /* the weight widened once per thread, not once per row */
        load_row(w, weight, dim, 1);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r += NORM_ROWS) {
            const int64_t n = rows - r < NORM_ROWS ? rows - r : NORM_ROWS;
            add_rms_norm_rows_bf16((bf16_t *)residual + r * dim, delta ? (const bf16_t *)delta + r * dim : NULL, w,
                                   (bf16_t *)out + r * dim, x, n, dim, eps);
        }
    }
}

/* ------------------------------------------------------------------------------------------ SiLU
 * gate_up [rows, 2 * hidden] (w1 | w3 outputs) -> out [rows, hidden] = silu(gate) * up, each
 * rounded to the model dtype as torch's silu and mul_ are. */
static inline float silu(float x) { return x / (1.0f + exp_approx(-x)); }

#ifdef HAVE_AVX512_ROWS
/* silu() on 16 lanes, the same bits: exp_approx's steps as GCC compiles the scalar code (the
 * polynomial in FMAs, 1 + p * 2^k as one FMA, which vscalefps + add equals since p * 2^k is exact
 * wherever 1 + it is not just 1). exp_approx(-g)'s clamp of -g to [-87, 88] is g's to [-88, 87];
 * vreduceps gives f = t - rint(t) in one step, exactly, so k = t - f exactly too. */
static inline __m512 silu16(__m512 g) {
    const __m512 x = _mm512_min_ps(_mm512_set1_ps(87.0f), _mm512_max_ps(_mm512_set1_ps(-88.0f), g)); /* NaN stays */
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(-1.44269504088896341f));
    const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEAREST_INT), k = _mm512_sub_ps(t, f);
    const __m512 p = EXP2_POLY16(f);
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_scalef_ps(p, k)));
}

/* A bfloat16 gate takes one of 65536 values: round_bf16(silu(g)) for each, as float32, indexed by g's
 * bits (256 KiB, filled once when the library loads). Reading it replaces silu16's ~20 vector ops
 * and its division (vdivps alone is ~16 cycles a vector on the AMX Xeon, the bound of the computed
 * loop; the whole computed loop ~26 cycles on Zen 4); activations cluster in a few exponents, so the
 * lines it touches stay in L1. Same bits as round_bf16(silu16(g)) by construction (f32_to_bf16's
 * rounding, denormals kept); the multiply by up and its rounding are unchanged. */
static float silu_bf16_table[1 << 16];

/* Whether silu_mul reads the table one gate at a time rather than with vgatherdps: on AMD CPUs a
 * 16-lane gather is microcoded (Zen 4: ~22 cycles), and sixteen loads inserted into a vector take
 * ~12 (1 thread, 512 x 1536 hot: 377 -> 204 us; bench/NOTES.md 'Elementwise kernels on Zen 4');
 * Intel's gathers (the AMX Xeon: ~5 cycles a vector past the stream) keep the gather. Set once
 * when the library loads, as the table is; builds with LLAMASERVE_SILU_GATHER (a test variant,
 * tests/engine/kernel_levels.py) gather on every CPU. */
static int silu_table_by_loads;

__attribute__((constructor)) static void fill_silu_bf16_table(void) {
    for (int32_t i = 0; i < (1 << 16); i += 16) {
        const __m512i bits = _mm512_add_epi32(_mm512_set1_epi32(i), _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
        const __m512 g = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
        _mm512_storeu_ps(silu_bf16_table + i, bf16x16_to_f32(bf16x16_round_soft(silu16(g))));
    }
#ifndef LLAMASERVE_SILU_GATHER
    __builtin_cpu_init();
    silu_table_by_loads = __builtin_cpu_is("amd");
#endif
}

static inline __m128 silu_bf16_lookup4(const bf16_t *gate) {
    __m128 v = _mm_load_ss(silu_bf16_table + gate[0]);
    v = _mm_insert_ps(v, _mm_load_ss(silu_bf16_table + gate[1]), 0x10);
    v = _mm_insert_ps(v, _mm_load_ss(silu_bf16_table + gate[2]), 0x20);
    return _mm_insert_ps(v, _mm_load_ss(silu_bf16_table + gate[3]), 0x30);
}

/* silu_bf16_table[gate] on 16 (masked: fewer) lanes: by loads (whole vectors) or a gather */
static inline __m512 silu_bf16_lookup16(const bf16_t *gate, __mmask16 m) {
    if (silu_table_by_loads && m == 0xffff) {
        const __m256 lo = _mm256_insertf128_ps(_mm256_castps128_ps256(silu_bf16_lookup4(gate)), silu_bf16_lookup4(gate + 4), 1);
        const __m256 hi = _mm256_insertf128_ps(_mm256_castps128_ps256(silu_bf16_lookup4(gate + 8)), silu_bf16_lookup4(gate + 12), 1);
        return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
    }
    const __m512i index = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, gate));
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, index, silu_bf16_table, 4);
}

/* f32_to_bf16(silu_bf16_table[gate] * up) on 16 (masked: fewer) lanes */
static inline __m256i silu_mul16(const bf16_t *gate, const bf16_t *up, __mmask16 m) {
    return bf16x16_round(_mm512_mul_ps(silu_bf16_lookup16(gate, m), bf16x16_load(up, m)));
}

static void silu_mul_row_bf16(const bf16_t *gate, const bf16_t *up, bf16_t *out, int64_t hidden) {
    int64_t i = 0;
    for (; i + 16 <= hidden; i += 16) {
        stream_prefetch(gate + i), stream_prefetch(up + i);
        _mm256_storeu_si256((__m256i *)(out + i), silu_mul16(gate + i, up + i, 0xffff));
    }
    if (i < hidden) {
        const __mmask16 m = row_mask(hidden - i);
        _mm256_mask_storeu_epi16(out + i, m, silu_mul16(gate + i, up + i, m));
    }
}
#elif defined(HAVE_AVX2_ROWS)
/* AVX2 builds: the AVX-512 build's table of round_bf16(silu(g)) by g's bits, filled by the portable
 * loop's own expression (the same bits as computing it in the row), read with 8-lane gathers: the
 * computed loop (exp_approx, a division, two roundings and the conversions, every lane) ran a
 * 32-decode demo step's silu_mul (32 x 1536) at 2.5x float32's time on a Zen 2, 1 thread
 * (bench/NOTES.md 'bfloat16 steps past 8 decodes'). The products rounded as store_row rounds them
 * (vec.h's 8-lane conversions). */
static float silu_bf16_table[1 << 16];

__attribute__((constructor)) static void fill_silu_bf16_table(void) {
    for (int32_t i = 0; i < (1 << 16); i++) silu_bf16_table[i] = bf16_to_f32((bf16_t)i);
#pragma omp simd
    for (int32_t i = 0; i < (1 << 16); i++) silu_bf16_table[i] = round_bf16(silu(silu_bf16_table[i]));
}

static void silu_mul_row_bf16(const bf16_t *gate, const bf16_t *up, bf16_t *out, int64_t hidden) {
    int64_t i = 0;
    for (; i + 8 <= hidden; i += 8) {
        const __m256 s = _mm256_i32gather_ps(silu_bf16_table, _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(gate + i))), 4);
        bf16x8_store(out + i, bf16x8_round(_mm256_mul_ps(s, bf16x8_load(up + i))));
    }
    for (; i < hidden; i++) out[i] = f32_to_bf16(silu_bf16_table[gate[i]] * bf16_to_f32(up[i]));
}
#else
static void silu_mul_row_bf16(const bf16_t *gate, const bf16_t *up, bf16_t *out, int64_t hidden) {
    enum { CHUNK = 512 }; /* bounded stack use whatever the FFN width */
    float g[CHUNK], u[CHUNK];
    for (int64_t start = 0; start < hidden; start += CHUNK) {
        const int64_t n = hidden - start < CHUNK ? hidden - start : CHUNK;
        load_row(g, gate + start, n, 1);
        load_row(u, up + start, n, 1);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) g[i] = round_bf16(round_bf16(silu(g[i])) * u[i]);
        store_row(out + start, g, n, 1);
    }
}
#endif

#ifdef HAVE_AVX512_ROWS
/* silu16's 512-bit steps (GCC vectorizes the loop below at 256 bits here), the same bits */
static void silu_mul_row_f32(const float *gate, const float *up, float *out, int64_t hidden) {
    for (int64_t i = 0; i < hidden; i += 16) {
        const __mmask16 m = row_mask(hidden - i);
        stream_prefetch(gate + i), stream_prefetch(up + i);
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(silu16(_mm512_maskz_loadu_ps(m, gate + i)), _mm512_maskz_loadu_ps(m, up + i)));
    }
}
#else
static void silu_mul_row_f32(const float *gate, const float *up, float *out, int64_t hidden) {
#pragma omp simd
    for (int64_t i = 0; i < hidden; i++) out[i] = silu(gate[i]) * up[i];
}
#endif

void silu_mul(int bf16, const void *gate_up, void *out, int64_t rows, int64_t hidden, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * hidden >= ROWWISE_PARALLEL_MIN_ELEMS && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        if (bf16) {
            const bf16_t *g = (const bf16_t *)gate_up + r * 2 * hidden;
            silu_mul_row_bf16(g, g + hidden, (bf16_t *)out + r * hidden, hidden);
            continue;
        }
        const float *g = (const float *)gate_up + r * 2 * hidden, *u = g + hidden; /* no staging copies */
        silu_mul_row_f32(g, u, (float *)out + r * hidden, hidden);
    }
}

/* ------------------------------------------------------------------------------------------ RoPE + cache write
 * qkv [tokens, (heads + 2 * kv_heads) * head_dim]: q and k heads rotated in place by the
 * position's angles (adjacent pairs (x[2i], x[2i+1]) as complex numbers, the reference's layout),
 * rope [max_pos, head_dim / 2, 2] float32 (cos, sin); then k and v copied to their cache slot:
 * caches [num_slots, kv_heads, head_dim]. */
/* One token's heads [rot_heads, head_dim] rotated in place by its angles [head_dim / 2, 2]. */
#ifdef HAVE_AVX512_ROWS
/* 16 lanes are 8 (re, im) pairs: re' = re * c - im * s, im' = re * s + im * c with the products of re
 * fused, as GCC's vectorized scalar loop rounds them (same bits): fmaddsub(re re, c s, im im * s c).
 * Each chunk of the angles serves every head. */
static void rope_heads(void *heads, const float *angles, int64_t rot_heads, int64_t head_dim, int bf16) {
    for (int64_t i = 0; i < head_dim; i += 16) {
        const __mmask16 m = row_mask(head_dim - i);
        const __m512 cs = _mm512_maskz_loadu_ps(m, angles + i), sc = _mm512_permute_ps(cs, 0xB1);
        for (int64_t h = 0; h < rot_heads; h++) {
            const __m512 x = row16_load(heads, h * head_dim + i, m, bf16);
            const __m512 y = _mm512_fmaddsub_ps(_mm512_moveldup_ps(x), cs, _mm512_mul_ps(_mm512_movehdup_ps(x), sc));
            row16_store(heads, h * head_dim + i, m, y, bf16);
        }
    }
}
#else
static void rope_heads(void *heads, const float *angles, int64_t rot_heads, int64_t head_dim, int bf16) {
    const size_t es = elem_size(bf16);
    float x[head_dim];
    for (int64_t h = 0; h < rot_heads; h++) {
        char *head = (char *)heads + (size_t)h * head_dim * es;
        load_row(x, head, head_dim, bf16);
#pragma omp simd
        for (int64_t i = 0; i < head_dim / 2; i++) {
            const float re = x[2 * i], im = x[2 * i + 1], c = angles[2 * i], s = angles[2 * i + 1];
            x[2 * i] = re * c - im * s;
            x[2 * i + 1] = re * s + im * c;
        }
        store_row(head, x, head_dim, bf16);
    }
}
#endif

void rope_and_cache_write(int bf16, void *qkv, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim,
                          const int64_t *positions, const float *rope, const int64_t *slots, void *k_cache,
                          void *v_cache, int num_threads) {
    const size_t es = elem_size(bf16);
    const int64_t row_elems = (heads + 2 * kv_heads) * head_dim;
    const size_t kv_bytes = (size_t)kv_heads * head_dim * es;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens * row_elems >= ROWWISE_PARALLEL_MIN_ELEMS && tokens > 1)
    for (int64_t t = 0; t < tokens; t++) {
        char *row = (char *)qkv + (size_t)t * row_elems * es;
        rope_heads(row, rope + positions[t] * head_dim, heads + kv_heads, head_dim, bf16);
        const char *k = row + (size_t)heads * head_dim * es;
        memcpy((char *)k_cache + (size_t)slots[t] * kv_bytes, k, kv_bytes);
        memcpy((char *)v_cache + (size_t)slots[t] * kv_bytes, k + kv_bytes, kv_bytes);
    }
}
