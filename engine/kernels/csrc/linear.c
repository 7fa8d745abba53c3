/* Few-rows linears over interleaved weights (the cpu_kernels library; engine/kernels/cpu.py binds
 * them; amx_linear.c reads the same bfloat16 pairs layout). */
#include "vec.h"
#include <omp.h>

/* ------------------------------------------------------------------------------------------ few-rows linear
 * out [rows, n] = x [rows, k] @ W^T, W given as [n / 16, k, 16] (16 output rows interleaved, so
 * each step of k is one contiguous 16-wide load and a vertical multiply-add: the weight streams
 * once, in order, with no horizontal sums). For decode at 1..a few rows (a batch-1 step, speculative
 * verification, small batches), where a small model's linears are short enough that oneDNN's fixed
 * cost per call is a large part of the step and every row count up to a few is still memory-bound
 * (bench/NOTES.md 'Few-rows linear').
 *
 * Register blocking: rows go in groups of up to FEW_ROWS_GROUP, and each weight vector loaded feeds
 * every row of its group (one pass over a 16-output block per group instead of one per row). Each
 * row's sums keep one fixed order whatever the group: lane j of row m is LINEAR_CHAINS chains over k
 * (chain c takes the steps i = c mod LINEAR_CHAINS below the last whole round, in increasing i; the steps
 * left over go to chain 0), combined as chain_sum() says. So a row's result does not depend on how
 * many rows the call has or which group it lands in: batch-invariant by construction.
 *
 * AVX-512 builds: one 16-lane vector per step of k, four chains (hiding the FMA latency at one
 * row), groups of 4 rows (16 accumulators of the 32 zmm registers). Narrower builds: LINEAR_VECS
 * native vectors per step (vec.h's nvf: two of 8 lanes on AVX, four of 4 on SSE; GCC lowers a
 * generic vector wider than the widest register poorly: the accumulators went through the stack
 * each step, bench/NOTES.md 'AVX2 one-row linear', and in the portable build '... and the SSE one-row linear');
 * two chains, so a row holds 4 accumulators and AVX2's 16 ymm registers take groups of 3 rows (12
 * accumulators, the two weight vectors, one broadcast); the portable build (SSE: 8 accumulators, 4
 * weight vectors) keeps groups of 1. One row (a batch-1 decode) runs ONE_ROW_BLOCKS blocks
 * side by side instead (block_blocks_row: more FMA chains in flight and more streams for the
 * prefetchers, the same sums). */
#if NV_LANES == 16 /* the AVX-512 builds (and the 16-lane test build of x86-64-v3, vec.h) */
typedef v16f lvec;
#define LINEAR_VECS 1
#define LINEAR_CHAINS 4
#define FEW_ROWS_GROUP 4
#define LINEAR_SIMD_BITS 512
#define ONE_ROW_BLOCKS 2 /* one row: blocks read side by side (block_blocks_row; not measured on AVX-512) */
static inline lvec load_lvec(const char *p, int bf16) {
    lvec f;
    if (bf16) {
        v16h h;
        memcpy(&h, p, sizeof(h));
        v16u u = __builtin_convertvector(h, v16u) << 16;
        memcpy(&f, &u, sizeof(f));
    } else {
        memcpy(&f, p, sizeof(f));
    }
    return f;
}
static inline void load_vecs(const char *p, int bf16, lvec *wv) { wv[0] = load_lvec(p, bf16); }
static inline void load_vecs_tight(const char *p, int bf16, lvec *wv) { load_vecs(p, bf16, wv); }
static inline void store_vecs(float *sums, const lvec *s, int bf16) {
    (void)bf16;
    memcpy(sums, s, sizeof(*s));
}
/* (c0 + c1) + (c2 + c3), in that order at every call: the asm hides each pair's sum from GCC's
 * reassociation, which -fassociative-math (build.py) lets regroup the four into a chain, in an order
 * that differed between the instances (the v4 build's reassoc1 dump: (c0 + c1 + c2) + c3 for one
 * group's row, (c0 + c1 + c3) + c2 for another's), so a row's bits changed with its batch. Through
 * memory (a 64-byte vector has no register in the 16-lane x86-64-v3 test build): two stores and
 * loads a row and block, beside its k steps of FMAs. */
static inline lvec chain_sum(const lvec *c) {
    lvec low = c[0] + c[1], high = c[2] + c[3];
    __asm__("" : "+m"(low), "+m"(high));
    return low + high;
}
#else
typedef nvf lvec;
typedef nvu lvec_u;
#define LINEAR_VECS (16 / NV_LANES)
#define LINEAR_CHAINS 2
#if defined(__AVX2__) && defined(__FMA__)
#define FEW_ROWS_GROUP 3
#define LINEAR_SIMD_BITS 256
#define ONE_ROW_BLOCKS 3 /* 12 accumulators, the two weight vectors, one broadcast: 15 of 16 ymm */
#else
#define FEW_ROWS_GROUP 1
#define LINEAR_SIMD_BITS 128
#define ONE_ROW_BLOCKS 1 /* SSE: a row's 8 accumulators and 4 weight vectors; more blocks' would spill */
#endif
/* One step of k of a 16-output block as the LINEAR_VECS vectors the accumulators take. float32:
 * outputs in order (AVX: 0-7 and 8-15). bfloat16: each load of 2 * NV_LANES values as its even
 * outputs and its odd ones (AVX, one 32-byte load: 0, 2, .., 14 and 1, 3, .., 15): 32-bit lane i
 * holds output 2i in its low 16 bits and 2i + 1 in its high ones, so a shift and a mask widen them
 * all (two ALU ops, where zero-extending each 8 took a shuffle and a shift: 4; bench/NOTES.md 'One
 * stream: the one-row read rate'). Each output's products and sums are the same as widened in
 * order; store_vecs puts the lanes back in output order. */
static inline void load_vecs(const char *p, int bf16, lvec *wv) {
    /* (the SSE build's second pair spelled out, not a loop over pairs: a loop changed GCC's inlining
     * and register choices in the AVX2 build's hot loops) */
    if (bf16) {
        lvec_u u;
        memcpy(&u, p, sizeof(u));
        /* (written as two shifts GCC folds them into the mask; with 3 blocks' or 3 rows' 12
         * accumulators the mask is rebuilt each round: interleaved_rows_bf16's pragma below) */
        const lvec_u even = u << 16, odd = u & 0xffff0000u;
        memcpy(&wv[0], &even, sizeof(lvec));
        memcpy(&wv[1], &odd, sizeof(lvec));
#if LINEAR_VECS == 4
        memcpy(&u, p + sizeof(u), sizeof(u));
        const lvec_u even2 = u << 16, odd2 = u & 0xffff0000u;
        memcpy(&wv[2], &even2, sizeof(lvec));
        memcpy(&wv[3], &odd2, sizeof(lvec));
#endif
    } else {
        memcpy(&wv[0], p, sizeof(lvec));
        memcpy(&wv[1], p + sizeof(lvec), sizeof(lvec));
#if LINEAR_VECS == 4
        memcpy(&wv[2], p + 2 * sizeof(lvec), sizeof(lvec));
        memcpy(&wv[3], p + 3 * sizeof(lvec), sizeof(lvec));
#endif
    }
}
/* load_vecs for the one-row loop of 3 blocks (AVX2: 12 accumulators, block_blocks_row): the odd
 * outputs' mask read from memory by each AND (an asm: GCC would turn it back into a mask register,
 * which it then rebuilds every round, or without interleaved_rows_bf16's pragma spills an
 * accumulator for). Cache-hot, one thread, Zen 2, one row [3072, 576]: 73.9 -> 68.4 us (x0.93; 89.9
 * before the pragma). Not in the few-rows groups: used there too, 3 rows ran x0.80 but 2 rows x1.13-1.28
 * (the same function's other group sizes; not understood), so they keep load_vecs (bench/NOTES.md
 * 'One stream, bfloat16: the accumulators in registers'). The same values either way. */
static inline void load_vecs_tight(const char *p, int bf16, lvec *wv) {
#if NV_LANES == 8 && defined(__AVX2__)
    if (bf16) {
        static const lvec_u high = {0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u,
                                    0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u};
        lvec_u u, odd;
        memcpy(&u, p, sizeof(u));
        const lvec_u even = u << 16;
        __asm__("vpand %1, %2, %0" : "=x"(odd) : "m"(high), "x"(u));
        memcpy(&wv[0], &even, sizeof(lvec));
        memcpy(&wv[1], &odd, sizeof(lvec));
        return;
    }
#endif
    load_vecs(p, bf16, wv);
}
static inline void store_vecs(float *sums, const lvec *s, int bf16) {
    if (bf16) {
        for (int i = 0; i < NV_LANES; i++) sums[2 * i] = s[0][i], sums[2 * i + 1] = s[1][i];
#if LINEAR_VECS == 4
        for (int i = 0; i < NV_LANES; i++) sums[8 + 2 * i] = s[2][i], sums[8 + 2 * i + 1] = s[3][i];
#endif
    } else {
        memcpy(sums, s, LINEAR_VECS * sizeof(*s));
    }
}
static inline lvec chain_sum(const lvec *c) { return c[0] + c[1]; }
#endif
/* One row, bfloat16 weights: how far ahead of each block's stream block_blocks_row prefetches (bytes;
 * 0: none, the hardware prefetchers alone). A bfloat16 step of k is 32 bytes against float32's 64, so
 * the same ONE_ROW_BLOCKS streams hold half the lines in flight and the loop waits on memory; 512 B
 * (8 lines a stream) ahead, wrapping onto the next pass's blocks, read the demo step's bfloat16
 * linears x0.90 the CPU time on Zen 2 (384 and 768: x0.91-0.93; straight on, no wrap: 256 x0.97, 512
 * x0.94, 1024-2048 slower; bench/NOTES.md 'One stream, bfloat16: a prefetch ahead of each block').
 * Measured on AVX2 only; float32 (64 B a step: twice the lines in flight) keeps none. -D to A/B. */
#ifndef ONE_ROW_PREFETCH_BYTES
#if LINEAR_SIMD_BITS == 256
#define ONE_ROW_PREFETCH_BYTES 512
#else
#define ONE_ROW_PREFETCH_BYTES 0
#endif
#endif

/* The vector width in bits the interleaved linears of this build are written for: 512, 256 (AVX2
 * with FMA) or 128 (the portable loops). engine.backends.cpu picks its few-rows cutoff from it. */
int interleaved_linear_simd_bits(void) { return LINEAR_SIMD_BITS; }

/* `group` (a literal at each instantiation, 1..FEW_ROWS_GROUP) rows of one 16-output block:
 * sums[r][j] = x[r] . W[block row j] over k, W's block as [k, 16], x's rows k apart. next: the next
 * block to prefetch as this pass streams its own (NULL: none). A call of several groups reads each
 * block from memory in its first group's pass and from the caches in the others', during which the
 * memory would sit idle: the first pass fetches the next block ahead (at 8 rows, cold weights,
 * 10-13% faster on Zen 2, bench/NOTES.md 'Few-rows linear'). A call of one group of 2+ rows (2-3 on
 * AVX2) too: one block's single stream read alone ran at half one row's rate; with the next block as a
 * second stream 2 rows took x0.81-0.92 the time and 3 rows x0.72-0.90, cold, one thread, both dtypes
 * (bench/NOTES.md 'One stream, bfloat16: the accumulators in registers'). One row needs none: its
 * blocks' passes are the streams the hardware prefetchers follow (a software prefetch ahead of a
 * plain read slowed it, bench/NOTES.md 'One stream: the one-row read rate'). */
static inline __attribute__((always_inline)) void block_rows(const char *w, const float *x, int64_t k, int bf16, int group,
                                                             float (*sums)[16], const char *next) {
    const size_t step = 16 * elem_size(bf16);
    lvec acc[FEW_ROWS_GROUP][LINEAR_VECS][LINEAR_CHAINS];
#pragma GCC unroll 8
    for (int r = 0; r < group; r++)
#pragma GCC unroll 4
        for (int h = 0; h < LINEAR_VECS; h++)
#pragma GCC unroll 4
            for (int c = 0; c < LINEAR_CHAINS; c++) acc[r][h][c] = (lvec){0};
    int64_t i = 0;
    /* per step: the weight's halves loaded once into registers, then per row one broadcast of x
     * feeding both halves (AVX2, 3 rows: 12 accumulators + 2 weight halves + 1 broadcast = 15 of
     * 16 registers; the other orders made GCC reload the weight per row or spill) */
    for (; i + LINEAR_CHAINS <= k; i += LINEAR_CHAINS) {
#pragma GCC unroll 4
        for (int c = 0; c < LINEAR_CHAINS; c++) {
            if (next) __builtin_prefetch(next + (size_t)(i + c) * step, 0, 3);
            lvec wv[LINEAR_VECS];
            load_vecs(w + (size_t)(i + c) * step, bf16, wv);
#pragma GCC unroll 8
            for (int r = 0; r < group; r++) {
                const float xs = x[r * k + i + c];
#pragma GCC unroll 4
                for (int h = 0; h < LINEAR_VECS; h++) acc[r][h][c] += wv[h] * xs;
            }
        }
    }
    for (; i < k; i++) {
        lvec wv[LINEAR_VECS];
        load_vecs(w + (size_t)i * step, bf16, wv);
#pragma GCC unroll 8
        for (int r = 0; r < group; r++) {
            const float xs = x[r * k + i];
#pragma GCC unroll 4
            for (int h = 0; h < LINEAR_VECS; h++) acc[r][h][0] += wv[h] * xs;
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < group; r++) {
        lvec s[LINEAR_VECS];
#pragma GCC unroll 4
        for (int h = 0; h < LINEAR_VECS; h++) s[h] = chain_sum(acc[r][h]);
        store_vecs(sums[r], s, bf16);
    }
}

/* One row of `nb` (a literal, 1..ONE_ROW_BLOCKS) consecutive 16-output blocks at once, from w
 * (each block as block_rows reads it, k * 16 elements): sums[j] for block j. One row of one block
 * keeps only LINEAR_VECS x LINEAR_CHAINS accumulators (AVX2: 4) busy, each a chain of dependent
 * FMAs, and reads one sequential stream: at Zen 2's 5-cycle FMA latency 4 chains cap the loop at 4
 * FMAs per 5 cycles, and a core's read rate grows with the streams its prefetchers follow side by
 * side (bench/NOTES.md 'One stream: the one-row read rate'). nb blocks keep nb times the chains in
 * flight and read nb streams. Each lane's sum is block_rows' for one row, step for step (the same
 * chains over k, the same combine): the bits do not change. */
static inline __attribute__((always_inline)) void block_blocks_row(const char *w, int nb, const float *x, int64_t k, int bf16,
                                                                   float (*sums)[16]) {
    const size_t step = 16 * elem_size(bf16), block = (size_t)k * step;
    lvec acc[ONE_ROW_BLOCKS][LINEAR_VECS][LINEAR_CHAINS];
#pragma GCC unroll 4
    for (int b = 0; b < nb; b++)
#pragma GCC unroll 4
        for (int h = 0; h < LINEAR_VECS; h++)
#pragma GCC unroll 4
            for (int c = 0; c < LINEAR_CHAINS; c++) acc[b][h][c] = (lvec){0};
    int64_t i = 0;
    for (; i + LINEAR_CHAINS <= k; i += LINEAR_CHAINS) {
        /* one 64-byte line of each block a round at bfloat16 (2 steps of 32 B): one prefetch each.
         * Past a block's end the line is the next pass's block at the same offset (blocks lie
         * back to back: + nb - 1 blocks), so that pass starts on lines already coming, not cold
         * (x0.96 the CPU time of prefetching straight on; past the weight's end a prefetch is
         * harmless: it never faults) */
        if (bf16 && ONE_ROW_PREFETCH_BYTES > 0) {
            size_t ahead = (size_t)i * step + ONE_ROW_PREFETCH_BYTES;
            if (ahead >= block) ahead += (size_t)(nb - 1) * block;
#pragma GCC unroll 4
            for (int b = 0; b < nb; b++) __builtin_prefetch(w + b * block + ahead, 0, 3);
        }
#pragma GCC unroll 4
        for (int c = 0; c < LINEAR_CHAINS; c++) {
            const float xs = x[i + c];
#pragma GCC unroll 4
            for (int b = 0; b < nb; b++) {
                lvec wv[LINEAR_VECS];
                if (nb * LINEAR_VECS * LINEAR_CHAINS >= 12) load_vecs_tight(w + b * block + (size_t)(i + c) * step, bf16, wv);
                else load_vecs(w + b * block + (size_t)(i + c) * step, bf16, wv); /* registers to spare */
#pragma GCC unroll 4
                for (int h = 0; h < LINEAR_VECS; h++) acc[b][h][c] += wv[h] * xs;
            }
        }
    }
    for (; i < k; i++) {
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) {
            lvec wv[LINEAR_VECS];
            load_vecs(w + b * block + (size_t)i * step, bf16, wv);
#pragma GCC unroll 4
            for (int h = 0; h < LINEAR_VECS; h++) acc[b][h][0] += wv[h] * x[i];
        }
    }
#pragma GCC unroll 4
    for (int b = 0; b < nb; b++) {
        lvec s[LINEAR_VECS];
#pragma GCC unroll 4
        for (int h = 0; h < LINEAR_VECS; h++) s[h] = chain_sum(acc[b][h]);
        store_vecs(sums[b], s, bf16);
    }
}

/* block_blocks_row with `nb` a literal */
static inline void blocks_row(int bf16, const char *w, int nb, const float *x, int64_t k, float (*sums)[16]) {
    switch (nb) {
#if ONE_ROW_BLOCKS >= 3
    case 3: block_blocks_row(w, 3, x, k, bf16, sums); break;
#endif
#if ONE_ROW_BLOCKS >= 2
    case 2: block_blocks_row(w, 2, x, k, bf16, sums); break;
#endif
    default: block_blocks_row(w, 1, x, k, bf16, sums); break;
    }
}

/* Rows [m, m + group) of block b through block_rows with `group` a literal. */
static inline void block_group(int bf16, const char *w, const float *xm, int64_t k, int group, float (*sums)[16],
                               const char *next) {
    switch (group) {
#if FEW_ROWS_GROUP >= 4
    case 4: block_rows(w, xm, k, bf16, 4, sums, next); break;
#endif
#if FEW_ROWS_GROUP >= 3
    case 3: block_rows(w, xm, k, bf16, 3, sums, next); break;
#endif
#if FEW_ROWS_GROUP >= 2
    case 2: block_rows(w, xm, k, bf16, 2, sums, next); break;
#endif
    default: block_rows(w, xm, k, bf16, 1, sums, next); break;
    }
}

/* out_f32: the float32 sums stored as they are (the output head's exact logits) instead of rounded
 * to x's dtype. Rows in groups as even as FEW_ROWS_GROUP allows (5 rows on AVX2: 3 + 2, not 3 + 1 + 1:
 * a lone row's pass is the least efficient). One function per element type (BF16 a literal in each):
 * GCC outlines the parallel loop before it propagates constants, so a shared body would test the
 * element type at every step of k. */
#define DEFINE_INTERLEAVED_ROWS(name, BF16)                                                                        \
    static void name(const float *xf, const void *weight, void *out, int64_t rows, int64_t n, int64_t k,           \
                     int num_threads, int out_f32) {                                                               \
        const size_t step = 16 * elem_size(BF16);                                                                  \
        const int64_t groups = (rows + FEW_ROWS_GROUP - 1) / FEW_ROWS_GROUP;                                       \
        if (rows == 1 && ONE_ROW_BLOCKS > 1) { /* ONE_ROW_BLOCKS blocks at a time (block_blocks_row) */            \
            const int64_t blocks = n / 16;                                                                         \
            _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (n * k >= 4 * PARALLEL_MIN_ELEMS)") \
            for (int64_t p = 0; p < (blocks + ONE_ROW_BLOCKS - 1) / ONE_ROW_BLOCKS; p++) {                         \
                const int64_t b0 = p * ONE_ROW_BLOCKS;                                                             \
                const int nb = (int)(blocks - b0 < ONE_ROW_BLOCKS ? blocks - b0 : ONE_ROW_BLOCKS);                 \
                float sums[ONE_ROW_BLOCKS][16];                                                                    \
                blocks_row(BF16, (const char *)weight + (size_t)(b0 * k) * step, nb, xf, k, sums);                 \
                for (int j = 0; j < nb; j++) {                                                                     \
                    const int64_t col = (b0 + j) * 16;                                                             \
                    if (out_f32) memcpy((float *)out + col, sums[j], sizeof(sums[j]));                             \
                    else store_row((char *)out + (size_t)col * elem_size(BF16), sums[j], 16, BF16);                \
                }                                                                                                  \
            }                                                                                                      \
            return;                                                                                                \
        }                                                                                                          \
        _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (n * k >= 4 * PARALLEL_MIN_ELEMS)") \
        for (int64_t b = 0; b < n / 16; b++) {                                                                     \
            const char *w = (const char *)weight + (size_t)(b * k) * step;                                         \
            for (int64_t g = 0, m = 0; g < groups; g++) {                                                          \
                /* the rows left split evenly over the groups left */                                              \
                const int group = (int)((rows - m + (groups - g) - 1) / (groups - g));                             \
                const char *next = g == 0 && rows > 1 && b + 1 < n / 16 ? w + k * step : NULL;                     \
                float sums[FEW_ROWS_GROUP][16];                                                                    \
                block_group(BF16, w, xf + m * k, k, group, sums, next);                                            \
                for (int r = 0; r < group; r++, m++) {                                                             \
                    if (out_f32) memcpy((float *)out + m * n + b * 16, sums[r], sizeof(sums[r]));                  \
                    else store_row((char *)out + (size_t)(m * n + b * 16) * elem_size(BF16), sums[r], 16, BF16);   \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
    }
DEFINE_INTERLEAVED_ROWS(interleaved_rows_f32, 0)
/* bfloat16: GCC's register allocator without loop pressure kept one of the 12 accumulators of the
 * 3-block (one row) and 3-row (few rows) loops on the stack (an FMA through memory and a store each
 * round: the store-to-load forwarding on that chain's FMA latency) while two ymm registers sat unused;
 * with -fira-loop-pressure all 12 stay in registers and the mask is rebuilt each round instead. Cache-hot,
 * one thread, Zen 2: one row [3072, 576] x0.83 the time, the same sums (bench/NOTES.md 'One stream,
 * bfloat16: the accumulators in registers'). float32's loops are the same code either way; AVX2
 * builds only (the portable SSE build ran x1.02-1.03 slower with it; AVX-512 not measured). Clang
 * ignores the pragma. */
#if LINEAR_SIMD_BITS == 256
#pragma GCC push_options
#pragma GCC optimize("ira-loop-pressure")
DEFINE_INTERLEAVED_ROWS(interleaved_rows_bf16, 1)
#pragma GCC pop_options
#else
DEFINE_INTERLEAVED_ROWS(interleaved_rows_bf16, 1)
#endif

static int interleaved_linear_impl(int bf16, const void *x, const void *weight, void *out, int64_t rows, int64_t n,
                                   int64_t k, int num_threads, int out_f32) {
    const size_t es = elem_size(bf16);
    float *xf = kernel_malloc((size_t)(rows * k) * sizeof(float));
    if (!xf) return KERNEL_NO_MEMORY;
    for (int64_t m = 0; m < rows; m++) load_row(xf + m * k, (const char *)x + (size_t)(m * k) * es, k, bf16);
    if (bf16) interleaved_rows_bf16(xf, weight, out, rows, n, k, num_threads, out_f32);
    else interleaved_rows_f32(xf, weight, out, rows, n, k, num_threads, out_f32);
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

/* Rows of one panel in groups of up to PAIRS_ROW_GROUP: each weight vector loaded once feeds every
 * row of the group (the one-row kernel alone loaded it once per row: one load per vdpbf16ps, which
 * capped the bfloat16 head's rows). Each row keeps its eight chains and their combine: the same sums
 * whatever the group, bit for bit those of a lone row. 3 rows: 24 accumulators of 32 zmm. */
#define PAIRS_ROW_GROUP 3
/* Two groups or more read each panel from memory in the first one's pass and from the caches in
 * the others', the memory idle there: they fetch the next panel of the thread's run (PAIRS_ROWS_AHEAD),
 * spread over all the passes (ahead_step bytes an 8-step round: 47 at 32 rows, k 576). Zen 4, one
 * thread, CPU time, the bfloat16 head [49152x576] against none: 4 rows 0.78x the time, 8 rows 0.58,
 * 16 0.72, 32 0.82, 64 0.80; an L1 hint 1.07, 0.93, 0.83, 0.79, 0.77 (bench/NOTES.md 'The pairs
 * kernels: the next weight ahead'). One group (1-3 rows: a batch-1 decode) keeps its plain stream.
 * Prefetches only: the sums are the same instructions in the same order. -D to A/B. */
#ifndef PAIRS_ROWS_AHEAD
#define PAIRS_ROWS_AHEAD 1
#endif
/* the cache level both pairs kernels fetch the next weight into: 2, L2 (prefetcht1) */
#ifndef PAIRS_AHEAD_LOCALITY
#define PAIRS_AHEAD_LOCALITY 2
#endif

/* `group` (a literal at each instantiation) rows of x, k apart, against one panel's pairs w: sums[r].
 * ahead (NULL: none): bytes of the next panel to fetch, ahead_step of them an 8-step round. */
static inline __attribute__((always_inline)) void pairs_rows(const char *w, const bf16_t *x, int64_t k, int group,
                                                             float (*sums)[16], const char *ahead, int64_t ahead_step) {
    const int64_t pairs = k / 2;
    /* eight chains hide vdpbf16ps's latency: streaming 30 demo layers' weights at one thread, 8
     * chains ran 0.8-0.85x the time of 4, 16 no better than 8 (bench/NOTES.md) */
    __m512 acc[PAIRS_ROW_GROUP][8];
#pragma GCC unroll 3
    for (int r = 0; r < group; r++)
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) acc[r][c] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= pairs; i += 8) {
        if (ahead)
            for (int64_t off = 0; off < ahead_step; off += 64) __builtin_prefetch(ahead + i / 8 * ahead_step + off, 0, PAIRS_AHEAD_LOCALITY);
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (size_t)(i + c) * 64);
#pragma GCC unroll 3
            for (int r = 0; r < group; r++)
                acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv, (__m512bh)_mm512_set1_epi32(x_pair(x + r * k, i + c)));
        }
    }
    for (; i < pairs; i++) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (size_t)i * 64);
#pragma GCC unroll 3
        for (int r = 0; r < group; r++) acc[r][0] = _mm512_dpbf16_ps(acc[r][0], wv, (__m512bh)_mm512_set1_epi32(x_pair(x + r * k, i)));
    }
#pragma GCC unroll 3
    for (int r = 0; r < group; r++) {
        __m512 *a = acc[r];
        const __m512 s0 = _mm512_add_ps(a[0], a[4]), s1 = _mm512_add_ps(a[1], a[5]), s2 = _mm512_add_ps(a[2], a[6]),
                     s3 = _mm512_add_ps(a[3], a[7]);
        _mm512_storeu_ps(sums[r], _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
    }
}

static inline void pairs_linear_impl(const void *x, const void *weight, void *out, int64_t rows, int64_t n, int64_t k,
                                     int num_threads, int out_f32) {
    const int64_t groups = (rows + PAIRS_ROW_GROUP - 1) / PAIRS_ROW_GROUP, panels = n / 16, panel_bytes = k / 2 * 64;
    const int64_t rounds = groups * (k / 2 / 8), ahead_step = PAIRS_ROWS_AHEAD && groups > 1 && rounds > 0 ? (panel_bytes + rounds - 1) / rounds : 0;
#pragma omp parallel num_threads(num_threads) if (n * k >= 4 * PARALLEL_MIN_ELEMS)
    {
        /* a static split spelled out: the panel after a thread's last is another thread's, not fetched */
        const int64_t thread = omp_get_thread_num(), team = omp_get_num_threads();
        const int64_t b0 = tile_start(thread, panels, team), b1 = tile_start(thread + 1, panels, team);
        for (int64_t b = b0; b < b1; b++) {
            const char *w = (const char *)weight + b * panel_bytes;
            const char *next = ahead_step && b + 1 < b1 ? w + panel_bytes : NULL;
            for (int64_t g = 0, m = 0; g < groups; g++) {
                /* the rows left split evenly over the groups left (4 rows: 2 + 2, not 3 + 1) */
                const int group = (int)((rows - m + (groups - g) - 1) / (groups - g));
                const bf16_t *xm = (const bf16_t *)x + m * k; /* pair i: columns 2i, 2i + 1 */
                const char *ahead = next ? next + g * (k / 2 / 8) * ahead_step : NULL;
                float sums[PAIRS_ROW_GROUP][16];
                if (group == 3) pairs_rows(w, xm, k, 3, sums, ahead, ahead_step);
                else if (group == 2) pairs_rows(w, xm, k, 2, sums, ahead, ahead_step);
                else pairs_rows(w, xm, k, 1, sums, ahead, ahead_step);
                for (int r = 0; r < group; r++, m++) {
                    if (out_f32) memcpy((float *)out + m * n + b * 16, sums[r], sizeof(sums[r]));
                    else store_row((bf16_t *)out + m * n + b * 16, sums[r], 16, 1);
                }
            }
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

/* ------------------------------------------------------------------------------------------ pairs gemm
 * bfloat16 many-rows linear over the same pairs copy, for CPUs with AVX512_BF16 and no AMX tiles (Zen
 * 4; Cooper Lake, Ice Lake): decode steps of many streams, where the one-row kernel above would
 * stream the weight once per row. A register tile of PAIRS_MR rows x PAIRS_NP 16-column panels of
 * float32 accumulators takes each 64-byte weight vector (two steps of k of a panel) once per tile
 * and each pair of x as one 32-bit broadcast: PAIRS_NP loads and PAIRS_MR broadcasts feed PAIRS_MR x
 * PAIRS_NP vdpbf16ps a pair step (8 x 3: 24 accumulators, 3 weights, 1 broadcast of 32 zmm). A
 * panel group's pairs (k / 2 x 64 bytes a panel: 55 KiB for 3 panels at k 576) stay in L2 across a
 * pass's row tiles; passes of at most PAIRS_X_L2_BYTES of x keep x in L2 across the groups.
 * Threads split the panel groups (static): each output is one chain of vdpbf16ps over k in order, so
 * a row's sums depend neither on the other rows nor on the thread count, though they are not the
 * one-row kernel's (eight chains). Rounded to bfloat16 as the one-row kernel's (store_row). */
#define PAIRS_MR 8
#define PAIRS_NP 3
/* A call of at most PAIRS_FEW_ROWS rows (one tile) takes PAIRS_FEW_NP panels a tile instead: 2-4 rows
 * x 3 panels keep only 6-12 chains of vdpbf16ps in flight on 3 streams. One thread, CPU time, cold,
 * the demo's block shapes, best of 5 alternating: 4 panels ran 2-4 rows 0.90-0.94x the time of 3; 6
 * panels 0.97-1.47x (4 x 6 accumulators and 6 weights: 31 of 32 zmm); 6 rows x 4 panels at every row
 * count, 8-64 rows 1.01-1.31x (8 rows in 2 tiles; bench/NOTES.md 'bfloat16 many rows without AMX'). */
#define PAIRS_FEW_ROWS 4
#define PAIRS_FEW_NP 4
#define PAIRS_X_L2_BYTES (512 << 10)

/* A pass's first row tile would read each panel group from memory, the others from L2, the memory
 * idle during them: at 32 rows 3 panels' 55 KiB (k 576) in a quarter of the group's time, more than
 * one core's read rate. So each group's tiles fetch the next group of the thread's run into L2
 * (PAIRS_AHEAD), spread evenly over all of them: ahead_step bytes a pair step (48 at 32 rows, k 576),
 * one prefetch a line. Zen 4, one thread, CPU time, cold weights, against the first-tile prefetch
 * alone, medians of 7-11 alternating rounds over several runs: the demo's block shapes at k 576, 6-8
 * rows (one tile) 0.75-0.85x the time, 12-16 rows 0.78-0.91, 32 rows 0.92-0.98. [576x1536] (48 KiB
 * panels, long enough for the hardware prefetchers) 1.02-1.05 at 8-32 rows (12 rows 0.93): panels of
 * at most PAIRS_AHEAD_MAX_PANEL_BYTES only. At 48-64 rows (6-8 tiles: the first is a sixth to an
 * eighth of the time) 0.98-1.03 at k 576, 1.03-1.08 at k 1536: up to PAIRS_AHEAD_MAX_TILES tiles.
 * An L1 hint in place of L2: the same at 32-64 rows, 16 rows 0.89 where L2 gave 0.81. The few-rows tiles (2-4 rows) gained 0.92-0.95 at k 576 and lost 1.10-1.16
 * at k 1536: none there (bench/NOTES.md 'The pairs kernels: the next weight ahead'). Where nothing
 * fetched a group (the thread's first, or no ahead) its first tile prefetches each panel's stream
 * PAIRS_PREFETCH_BYTES ahead where there are PAIRS_PREFETCH_MIN_TILES tiles (against none: 16-64
 * rows 0.92-0.96x the time; 4 rows 1.06-1.11x, so none at one tile; 512 and 2048 bytes within the
 * noise of 1024: bench/NOTES.md 'bfloat16 many rows without AMX'). -D to A/B. */
#ifndef PAIRS_PREFETCH_BYTES
#define PAIRS_PREFETCH_BYTES 1024
#endif
#ifndef PAIRS_PREFETCH_MIN_TILES
#define PAIRS_PREFETCH_MIN_TILES 2
#endif
#ifndef PAIRS_AHEAD
#define PAIRS_AHEAD 1
#endif
#ifndef PAIRS_AHEAD_MAX_TILES
#define PAIRS_AHEAD_MAX_TILES 4
#endif
#ifndef PAIRS_AHEAD_MAX_PANEL_BYTES
#define PAIRS_AHEAD_MAX_PANEL_BYTES (32 << 10)
#endif
/* One tile: out[mr rows, np panels] = x [mr rows, k apart] @ the panels' pairs (w: the first panel's,
 * the next ones panel_bytes further); pf: prefetch the panels' streams ahead; ahead (NULL: none): the
 * next group's bytes to fetch, ahead_step of them a pair step. mr and np literals at each call
 * (pairs_tile_rows' switch): the accumulators live in registers. */
static inline __attribute__((always_inline)) void pairs_tile(const int mr, const int np, const bf16_t *x, int64_t k,
                                                             const char *w, int64_t panel_bytes, bf16_t *out, int64_t n, int pf,
                                                             const char *ahead, int64_t ahead_step) {
    __m512 acc[PAIRS_MR][PAIRS_FEW_NP];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int p = 0; p < np; p++) acc[r][p] = _mm512_setzero_ps();
    const char *ahead_line = ahead; /* the next line to fetch: one prefetch a line, as the steps reach it */
    for (int64_t i = 0; i < k / 2; i++) {
        if (ahead)
            for (; ahead_line <= ahead + i * ahead_step; ahead_line += 64) __builtin_prefetch(ahead_line, 0, PAIRS_AHEAD_LOCALITY);
        __m512bh wv[PAIRS_FEW_NP];
#pragma GCC unroll 4
        for (int p = 0; p < np; p++) {
            if (PAIRS_PREFETCH_BYTES > 0 && pf) __builtin_prefetch(w + p * panel_bytes + i * 64 + PAIRS_PREFETCH_BYTES, 0, 3);
            wv[p] = (__m512bh)_mm512_loadu_si512(w + p * panel_bytes + i * 64);
        }
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(x_pair(x + r * k, i));
#pragma GCC unroll 4
            for (int p = 0; p < np; p++) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], wv[p], xb);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int p = 0; p < np; p++) _mm256_storeu_si256((__m256i *)(out + r * n + p * 16), bf16x16_round(acc[r][p]));
}

/* (a full group's three prefetch modes each as its own loop, none tested per step: one loop with
 * both tests ran 64 rows at 1.04-1.05x the time of the loops before them) */
#define PAIRS_TILE_CASE(m)                                                                              \
    case m:                                                                                             \
        if (np == PAIRS_NP && ahead) pairs_tile(m, PAIRS_NP, x, k, w, panel_bytes, out, n, 0, ahead, ahead_step); \
        else if (np == PAIRS_NP && pf) pairs_tile(m, PAIRS_NP, x, k, w, panel_bytes, out, n, 1, NULL, 0);          \
        else if (np == PAIRS_NP) pairs_tile(m, PAIRS_NP, x, k, w, panel_bytes, out, n, 0, NULL, 0);                \
        else if (np == 2) pairs_tile(m, 2, x, k, w, panel_bytes, out, n, pf, ahead, ahead_step);                  \
        else pairs_tile(m, 1, x, k, w, panel_bytes, out, n, pf, ahead, ahead_step);                               \
        break;

static void pairs_tile_rows(int mr, int np, const bf16_t *x, int64_t k, const char *w, int64_t panel_bytes, bf16_t *out,
                            int64_t n, int pf, const char *ahead, int64_t ahead_step) {
    switch (mr) {
        PAIRS_TILE_CASE(1)
        PAIRS_TILE_CASE(2)
        PAIRS_TILE_CASE(3)
        PAIRS_TILE_CASE(4)
        PAIRS_TILE_CASE(5)
        PAIRS_TILE_CASE(6)
        PAIRS_TILE_CASE(7)
        PAIRS_TILE_CASE(8)
        default: break;
    }
}

#define PAIRS_FEW_CASE(m)                                                                          \
    case m:                                                                                        \
        switch (np) {                                                                              \
        case 4: pairs_tile(m, 4, x, k, w, panel_bytes, out, n, 0, NULL, 0); break;                           \
        case 3: pairs_tile(m, 3, x, k, w, panel_bytes, out, n, 0, NULL, 0); break;                           \
        case 2: pairs_tile(m, 2, x, k, w, panel_bytes, out, n, 0, NULL, 0); break;                           \
        default: pairs_tile(m, 1, x, k, w, panel_bytes, out, n, 0, NULL, 0); break;                          \
        }                                                                                          \
        break;

/* pairs_tile for a call of at most PAIRS_FEW_ROWS rows: np in 1..PAIRS_FEW_NP (4; one tile: no prefetch) */
static void pairs_tile_few(int mr, int np, const bf16_t *x, int64_t k, const char *w, int64_t panel_bytes, bf16_t *out,
                           int64_t n) {
    switch (mr) {
        PAIRS_FEW_CASE(1)
        PAIRS_FEW_CASE(2)
        PAIRS_FEW_CASE(3)
        PAIRS_FEW_CASE(4)
        default: break;
    }
}

/* out [rows, n] bfloat16 = x [rows, k] bfloat16 @ W^T, W the pairs copy [n / 16, k / 2, 16, 2]
 * (amx_linear_bf16's signature: the compiled decode step calls either through one slot). Returns 0,
 * or -1 for a shape it does not take (n not whole panels, k odd), before touching anything. */
int pairs_gemm_bf16(const void *x, const void *weight, void *out, int64_t rows, int64_t n, int64_t k, int num_threads) {
    if (rows < 1 || n < 16 || n % 16 || k < 2 || k % 2 || num_threads < 1) return -1;
    const int few = rows <= PAIRS_FEW_ROWS;
    const int64_t group_panels = few ? PAIRS_FEW_NP : PAIRS_NP;
    const int64_t panels = n / 16, groups = (panels + group_panels - 1) / group_panels, panel_bytes = k / 2 * 64;
    const int64_t x_rows = PAIRS_X_L2_BYTES / (k * 2), pass_rows_max = x_rows < PAIRS_MR ? PAIRS_MR : x_rows;
    const int64_t passes = (rows + pass_rows_max - 1) / pass_rows_max, pass_rows = (rows + passes - 1) / passes;
#pragma omp parallel num_threads(num_threads) if (rows * n * k >= 4 * PARALLEL_MIN_ELEMS)
    {
        /* each thread its own run of groups (a static split), the same every pass: no
         * barrier between passes, and the group a pass prefetches ahead is always its own next */
        const int64_t thread = omp_get_thread_num(), team = omp_get_num_threads();
        const int64_t g0 = tile_start(thread, groups, team), g1 = tile_start(thread + 1, groups, team);
        for (int64_t m0 = 0; m0 < rows; m0 += pass_rows) {
            const int64_t mb = rows - m0 < pass_rows ? rows - m0 : pass_rows, tiles = (mb + PAIRS_MR - 1) / PAIRS_MR;
            const bf16_t *xm = (const bf16_t *)x + m0 * k;
            bf16_t *om = (bf16_t *)out + m0 * n;
            const int ahead = PAIRS_AHEAD && !few && tiles <= PAIRS_AHEAD_MAX_TILES && panel_bytes <= PAIRS_AHEAD_MAX_PANEL_BYTES;
            for (int64_t g = g0; g < g1; g++) {
                const int64_t p0 = g * group_panels;
                const int np = (int)(panels - p0 < group_panels ? panels - p0 : group_panels);
                const char *w = (const char *)weight + p0 * panel_bytes;
                if (few) { /* one tile of all the rows */
                    pairs_tile_few((int)rows, np, xm, k, w, panel_bytes, om + p0 * 16, n);
                    continue;
                }
                /* the next group's panels (contiguous after this group's), ahead_step bytes a pair step */
                const int64_t next_np = g + 1 < g1 ? (panels - p0 - np < group_panels ? panels - p0 - np : group_panels) : 0;
                const int64_t steps = tiles * (k / 2), ahead_step = ahead && next_np > 0 ? (next_np * panel_bytes + steps - 1) / steps : 0;
                const int first = g == g0 || !ahead; /* no group before it fetched this one */
                for (int64_t t = 0; t < tiles; t++) {
                    const int64_t r0 = tile_start(t, mb, tiles), mr = tile_start(t + 1, mb, tiles) - r0;
                    const char *next = ahead_step ? w + np * panel_bytes + t * (k / 2) * ahead_step : NULL;
                    pairs_tile_rows((int)mr, np, xm + r0 * k, k, w, panel_bytes, om + r0 * n + p0 * 16, n,
                                    first && t == 0 && tiles >= PAIRS_PREFETCH_MIN_TILES, next, ahead_step);
                }
            }
        }
    }
    return 0;
}
#endif
