/* One-row linears over interleaved weights (the cpu_kernels library; engine/kernels/cpu.py binds
 * them; amx_linear.c reads the same bfloat16 pairs layout). */
#include "vec.h"

/* ------------------------------------------------------------------------------------------ one-row linear
 * out [rows, n] = x [rows, k] @ W^T, W given as [n / 16, k, 16] (16 output rows interleaved, so
 * each step of k is one contiguous 16-wide load and a vertical multiply-add: the weight streams
 * once, in order, with no horizontal sums). For decode at batch 1, where a small model's linears
 * are short enough that oneDNN's fixed cost per call is a large part of the step (bench/NOTES.md); any rows work, but
 * oneDNN wins from a few rows up. */
/* One 16-output block of one row: sums[j] = x . W[block row j] over k, W's block as [k, 16].
 * AVX-512 builds: one 16-lane vector per step of k. Narrower builds: two 8-lane halves. GCC lowers a
 * 64-byte generic vector poorly where the widest register is 32 bytes (the accumulators went
 * through the stack each step: on an AVX2 Zen 2 this kernel ran at 0.4 GB/s, 8x slower than torch's
 * float32 gemv, bench/NOTES.md 'AVX2 one-row linear'), so there the halves are spelled out as
 * native 8-lane vectors, each lane summed in the same order as the 16-lane code. */
#if defined(__AVX512F__)
static inline v16f load16(const char *p, int bf16) {
    if (bf16) {
        v16h h;
        memcpy(&h, p, sizeof(h));
        v16u u = __builtin_convertvector(h, v16u) << 16;
        v16f f;
        memcpy(&f, &u, sizeof(f));
        return f;
    }
    v16f f;
    memcpy(&f, p, sizeof(f));
    return f;
}

static inline void block_dot16(const char *w, const float *xm, int64_t k, int bf16, float *sums) {
    const size_t step = 16 * elem_size(bf16);
    v16f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}; /* four chains hide the FMA latency */
    int64_t i = 0;
    for (; i + 4 <= k; i += 4) {
        a0 += load16(w + (size_t)i * step, bf16) * xm[i];
        a1 += load16(w + (size_t)(i + 1) * step, bf16) * xm[i + 1];
        a2 += load16(w + (size_t)(i + 2) * step, bf16) * xm[i + 2];
        a3 += load16(w + (size_t)(i + 3) * step, bf16) * xm[i + 3];
    }
    for (; i < k; i++) a0 += load16(w + (size_t)i * step, bf16) * xm[i];
    v16f s = (a0 + a1) + (a2 + a3);
    memcpy(sums, &s, 16 * sizeof(float));
}
#else
typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline v8f load8(const char *p, int bf16) {
    v8f f;
    if (bf16) {
        v8h h;
        memcpy(&h, p, sizeof(h));
        v8u u = __builtin_convertvector(h, v8u) << 16;
        memcpy(&f, &u, sizeof(f));
    } else {
        memcpy(&f, p, sizeof(f));
    }
    return f;
}

static inline void block_dot16(const char *w, const float *xm, int64_t k, int bf16, float *sums) {
    const size_t es = elem_size(bf16), step = 16 * es, half = 8 * es;
    v8f a0 = {0}, b0 = {0}, a1 = {0}, b1 = {0}, a2 = {0}, b2 = {0}, a3 = {0}, b3 = {0}; /* a: lanes 0-7, b: 8-15 */
    int64_t i = 0;
    for (; i + 4 <= k; i += 4) {
        const char *p = w + (size_t)i * step;
        a0 += load8(p, bf16) * xm[i], b0 += load8(p + half, bf16) * xm[i];
        a1 += load8(p + step, bf16) * xm[i + 1], b1 += load8(p + step + half, bf16) * xm[i + 1];
        a2 += load8(p + 2 * step, bf16) * xm[i + 2], b2 += load8(p + 2 * step + half, bf16) * xm[i + 2];
        a3 += load8(p + 3 * step, bf16) * xm[i + 3], b3 += load8(p + 3 * step + half, bf16) * xm[i + 3];
    }
    for (; i < k; i++) {
        const char *p = w + (size_t)i * step;
        a0 += load8(p, bf16) * xm[i], b0 += load8(p + half, bf16) * xm[i];
    }
    const v8f lo = (a0 + a1) + (a2 + a3), hi = (b0 + b1) + (b2 + b3);
    memcpy(sums, &lo, sizeof(lo));
    memcpy(sums + 8, &hi, sizeof(hi));
}
#endif

/* out_f32: the float32 sums stored as they are (the output head's exact logits) instead of rounded
 * to x's dtype. Each row's sums are the same whatever `rows` is (one fixed order over k per row):
 * batch-invariant by construction. bf16 is a literal at both call sites' instantiations (the
 * dispatch below), so the element type is not tested per load. */
static inline void interleaved_rows(int bf16, const float *xf, const void *weight, void *out, int64_t rows, int64_t n,
                                    int64_t k, int num_threads, int out_f32) {
    const size_t step = 16 * elem_size(bf16);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n * k >= 4 * PARALLEL_MIN_ELEMS)
    for (int64_t b = 0; b < n / 16; b++) {
        const char *w = (const char *)weight + (size_t)(b * k) * step;
        for (int64_t m = 0; m < rows; m++) {
            float sums[16];
            block_dot16(w, xf + m * k, k, bf16, sums);
            if (out_f32) memcpy((float *)out + m * n + b * 16, sums, sizeof(sums));
            else store_row((char *)out + (size_t)(m * n + b * 16) * elem_size(bf16), sums, 16, bf16);
        }
    }
}

static int interleaved_linear_impl(int bf16, const void *x, const void *weight, void *out, int64_t rows, int64_t n,
                                   int64_t k, int num_threads, int out_f32) {
    const size_t es = elem_size(bf16);
    float *xf = kernel_malloc((size_t)(rows * k) * sizeof(float));
    if (!xf) return KERNEL_NO_MEMORY;
    for (int64_t m = 0; m < rows; m++) load_row(xf + m * k, (const char *)x + (size_t)(m * k) * es, k, bf16);
    if (bf16) interleaved_rows(1, xf, weight, out, rows, n, k, num_threads, out_f32);
    else interleaved_rows(0, xf, weight, out, rows, n, k, num_threads, out_f32);
    free(xf);
    return KERNEL_OK;
}

/* Returns KERNEL_OK, or KERNEL_NO_MEMORY when x's float32 copy cannot be allocated. */
int interleaved_linear(int bf16, const void *x, const void *weight, void *out, int64_t rows, int64_t n, int64_t k,
                       int num_threads) {
    return interleaved_linear_impl(bf16, x, weight, out, rows, n, k, num_threads, 0);
}

/* interleaved_linear with float32 out whatever x's dtype: bfloat16 inputs and weights, float32
 * accumulation and output, as llama.cpp computes its output head (bfloat16 rounding of logits ties
 * tokens that differ, and makes greedy depend on what else is batched). */
int interleaved_linear_f32_out(int bf16, const void *x, const void *weight, void *out, int64_t rows, int64_t n,
                               int64_t k, int num_threads) {
    return interleaved_linear_impl(bf16, x, weight, out, rows, n, k, num_threads, 1);
}

/* ------------------------------------------------------------------------------------------ widened tiles
 * Blocks [block0, block1) of an interleaved weight ([n / 16, k, 16], as interleaved_linear reads it)
 * as float32 W^T columns: out [k, width] row-major, out[i][(b - block0) * 16 + j] = W[b * 16 + j][i],
 * width = (block1 - block0) * 16. For many-row inputs of a bfloat16 weight on CPUs whose oneDNN has
 * no bfloat16 kernel (AVX2): each tile widened once per call, then one float32 GEMM multiplies it
 * into every row (engine/backends/cpu.py), as quant_kernels.c's dequantized tiles are. In this
 * layout each step of k of a block is one contiguous 16-float store (the [width, k] layout would
 * scatter every value to its own row). */
void interleaved_widen(int bf16, int pairs, const void *weight, int64_t k, int64_t block0, int64_t block1, float *out,
                       int num_threads) {
    const int64_t width = (block1 - block0) * 16;
    const size_t es = elem_size(bf16);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (width * k >= 4 * PARALLEL_MIN_ELEMS)
    for (int64_t i = 0; i < k; i++) {
        for (int64_t b = block0; b < block1; b++) {
            float *dst = out + i * width + (b - block0) * 16;
            if (pairs) { /* [n / 16, k / 2, 16, 2] bfloat16 (the AVX512_BF16 builds' layout): column i of row j at (i / 2, j, i % 2) */
                const bf16_t *h = (const bf16_t *)weight + (size_t)(b * k + (i & ~(int64_t)1)) * 16 + (i & 1);
                for (int j = 0; j < 16; j++) dst[j] = bf16_to_f32(h[2 * j]);
            } else if (bf16) {
                const bf16_t *h = (const bf16_t *)weight + (size_t)(b * k + i) * 16;
                for (int j = 0; j < 16; j++) dst[j] = bf16_to_f32(h[j]);
            } else {
                memcpy(dst, (const float *)weight + (size_t)(b * k + i) * 16, 16 * sizeof(float));
            }
        }
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
/* bfloat16 one-row linear on AVX512_BF16 CPUs: W given as [n / 16, k / 2, 16, 2] (16 output rows
 * interleaved, each with two consecutive columns side by side), so one 64-byte load holds two steps
 * of k for 16 outputs and one vdpbf16ps multiplies them by the broadcast pair of x (each product of
 * two bfloat16 values is exact in float32; the sums are float32, as in interleaved_linear). Half the
 * instructions per weight byte of converting each value to float32 first: the loop keeps up with
 * memory. k even. */
static inline int x_pair(const bf16_t *x, int64_t i) { /* columns 2i and 2i + 1 as one 32-bit lane (x may be 2-byte aligned only) */
    int pair;
    memcpy(&pair, x + 2 * i, sizeof(pair));
    return pair;
}

static inline void pairs_linear_impl(const void *x, const void *weight, void *out, int64_t rows, int64_t n, int64_t k,
                                     int num_threads, int out_f32) {
    const int64_t pairs = k / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n * k >= 4 * PARALLEL_MIN_ELEMS)
    for (int64_t b = 0; b < n / 16; b++) {
        const char *w = (const char *)weight + (size_t)(b * pairs) * 64;
        for (int64_t m = 0; m < rows; m++) {
            const bf16_t *xm = (const bf16_t *)x + m * k; /* pair i: columns 2i, 2i + 1 */
            /* eight chains hide vdpbf16ps's latency: streaming 30 demo layers' weights at one thread,
             * 8 chains ran 0.8-0.85x the time of 4, 16 no better than 8 (bench/NOTES.md) */
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            int64_t i = 0;
#define PAIR_STEP(acc, j) \
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w + (size_t)(j) * 64), (__m512bh)_mm512_set1_epi32(x_pair(xm, j)))
            for (; i + 8 <= pairs; i += 8) {
                PAIR_STEP(a0, i);
                PAIR_STEP(a1, i + 1);
                PAIR_STEP(a2, i + 2);
                PAIR_STEP(a3, i + 3);
                PAIR_STEP(a4, i + 4);
                PAIR_STEP(a5, i + 5);
                PAIR_STEP(a6, i + 6);
                PAIR_STEP(a7, i + 7);
            }
            for (; i < pairs; i++) PAIR_STEP(a0, i);
#undef PAIR_STEP
            a0 = _mm512_add_ps(a0, a4), a1 = _mm512_add_ps(a1, a5), a2 = _mm512_add_ps(a2, a6), a3 = _mm512_add_ps(a3, a7);
            float sums[16];
            _mm512_storeu_ps(sums, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
            if (out_f32) memcpy((float *)out + m * n + b * 16, sums, sizeof(sums));
            else store_row((bf16_t *)out + m * n + b * 16, sums, 16, 1);
        }
    }
}

void interleaved_linear_bf16_pairs(const void *x, const void *weight, void *out, int64_t rows, int64_t n, int64_t k,
                                   int num_threads) {
    pairs_linear_impl(x, weight, out, rows, n, k, num_threads, 0);
}

/* the pairs kernel with float32 out (interleaved_linear_f32_out's, for the pairs layout) */
void interleaved_linear_bf16_pairs_f32_out(const void *x, const void *weight, void *out, int64_t rows, int64_t n,
                                           int64_t k, int num_threads) {
    pairs_linear_impl(x, weight, out, rows, n, k, num_threads, 1);
}
#endif
