/* bfloat16 linears y = x @ W^T through Intel AMX tiles (TDPBF16PS), for decode batches of many
 * streams (2..64 rows) where AVX512_BF16's vdpbf16ps runs out of instructions before the weights
 * run out of bandwidth (bench/NOTES.md 'AMX linears').
 *
 * The weight is the bfloat16 pairs layout engine/csrc/cpu_kernels.c's one-row kernel reads,
 * [n / 16, k / 2, 16, 2] (CpuKernels.interleave): each 16-column block's k / 2 rows of (column,
 * pair) are exactly AMX B tiles (16 pair-rows x 64 bytes) stacked along k, so one buffer serves the
 * one-row kernel and this one. x [rows, k] and out [rows, n] are row-major bfloat16; k a multiple
 * of 32 and n of 16 (amx_linear_bf16 returns -1 otherwise, before touching anything).
 *
 * Compiled at every x86-64 level: the kernel carries its own target attributes and runs only after
 * amx_init() saw the CPU's AMX-BF16, AMX-TILE and AVX512_BF16 bits and Linux granted the tile data
 * state (arch_prctl ARCH_REQ_XCOMP_PERM, once per process). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#ifdef AMX_COMPILED
#include <immintrin.h>
#endif

/* 1 where the kernel may run in this process (asks Linux for the tile state on first use), else 0. */
int amx_init(void) { return amx_tiles_permitted(); }

#ifdef AMX_COMPILED
AMX_TARGET_BEGIN

/* Tiles: 0..3 accumulators (row block r, column block c at 2r + c), 4..5 x (row blocks), 6..7 W
 * (column blocks). Every tile is 16 rows of 64 bytes: x is padded to whole 16-row blocks. */
static void configure_tiles(void) {
    AmxTileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}

#define ROW_BLOCK 16
#define COL_BLOCK 16
#define K_STEP 32           /* bf16 values of x per A tile row; W pairs per B tile: 16 */
#define W_TILE_BYTES 1024   /* one B tile: 16 pair-rows x 16 columns x 2 x bf16 */
/* Bytes ahead of the tile being loaded that each column block's stream is prefetched: a few tiles,
 * so that with two blocks per thread and two threads a dozen-odd KB are in flight. */
#ifndef PREFETCH_AHEAD_BYTES
#define PREFETCH_AHEAD_BYTES (4 * W_TILE_BYTES)
#endif

static inline void prefetch_tile(const char *p) {
    for (int off = 0; off < W_TILE_BYTES; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

/* 16 float32 accumulator rows (row stride 16) -> rows of out, bfloat16 rounded to nearest even. */
static inline void store_block(const float *acc, uint16_t *out, int64_t n, int64_t rows) {
    for (int64_t r = 0; r < rows; r++) {
        const __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(acc + r * 16));
        _mm256_storeu_si256((__m256i *)(out + r * n), (__m256i)v);
    }
}

/* Column blocks [cb, cb + cols) (cols 1 or 2) x row blocks [rb, rb + row_blocks) (1 or 2), all k. */
static inline void tile_block(const uint16_t *x, int64_t k, const char *w, int64_t pairs_bytes, int64_t cb, int cols,
                              int64_t rb, int row_blocks, uint16_t *out, int64_t n, int64_t rows) {
    const char *w0 = w + cb * pairs_bytes, *w1 = w0 + pairs_bytes;
    const char *x0 = (const char *)(x + rb * ROW_BLOCK * k), *x1 = x0 + ROW_BLOCK * k * 2;
    const int64_t x_stride = k * 2;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kk = 0; kk < k; kk += K_STEP) {
        const int64_t w_off = kk / K_STEP * W_TILE_BYTES;
        if (PREFETCH_AHEAD_BYTES > 0 && w_off + PREFETCH_AHEAD_BYTES < pairs_bytes) {
            prefetch_tile(w0 + w_off + PREFETCH_AHEAD_BYTES);
            if (cols > 1) prefetch_tile(w1 + w_off + PREFETCH_AHEAD_BYTES);
        }
        _tile_loadd(4, x0 + kk * 2, x_stride);
        _tile_loadd(6, w0 + w_off, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (cols > 1) {
            _tile_loadd(7, w1 + w_off, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (row_blocks > 1) {
            _tile_loadd(5, x1 + kk * 2, x_stride);
            _tile_dpbf16ps(2, 5, 6);
            if (cols > 1) _tile_dpbf16ps(3, 5, 7);
        }
    }
    float acc[ROW_BLOCK * COL_BLOCK];
    for (int r = 0; r < row_blocks; r++) {
        const int64_t row0 = (rb + r) * ROW_BLOCK, valid = rows - row0 < ROW_BLOCK ? rows - row0 : ROW_BLOCK;
        for (int c = 0; c < cols; c++) {
            /* _tile_stored takes a constant tile number */
            if (2 * r + c == 0) _tile_stored(0, acc, 64);
            else if (2 * r + c == 1) _tile_stored(1, acc, 64);
            else if (2 * r + c == 2) _tile_stored(2, acc, 64);
            else _tile_stored(3, acc, 64);
            store_block(acc, out + row0 * n + (cb + c) * COL_BLOCK, n, valid);
        }
    }
}

/* Work items are pairs of column blocks (32 output columns), split evenly over the threads: each
 * thread streams its share of the weight once, and for more than 32 rows re-reads each 32-column
 * slice (k * 64 bytes) from its own cache for every further 32 rows. */
static void amx_kernel(const uint16_t *x, const char *w, uint16_t *out, int64_t rows, int64_t padded_rows, int64_t n,
                       int64_t k, int num_threads) {
    const int64_t col_blocks = n / COL_BLOCK, items = (col_blocks + 1) / 2, pairs_bytes = k / 2 * 64;
    const int64_t row_blocks = padded_rows / ROW_BLOCK;
#pragma omp parallel num_threads(num_threads)
    {
        configure_tiles();
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            const int64_t cb = item * 2;
            const int cols = cb + 1 < col_blocks ? 2 : 1;
            for (int64_t rb = 0; rb < row_blocks; rb += 2) {
                const int rbs = rb + 1 < row_blocks ? 2 : 1;
                tile_block(x, k, w, pairs_bytes, cb, cols, rb, rbs, out, n, rows);
            }
        }
        _tile_release();
    }
}

/* y [rows, n] = x [rows, k] @ W^T, W in the pairs layout; 0 done, -1 refused (shape or no AMX:
 * the caller runs another path). amx_init() must have returned 1 in this process. */
int amx_linear_bf16(const void *x, const void *weight, void *out, int64_t rows, int64_t n, int64_t k, int num_threads) {
    if (rows < 1 || n % COL_BLOCK || k % K_STEP || k < K_STEP) return -1;
    const int64_t padded_rows = (rows + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;
    if (padded_rows == rows) {
        amx_kernel((const uint16_t *)x, (const char *)weight, (uint16_t *)out, rows, rows, n, k, num_threads);
        return 0;
    }
    /* the last tile's missing rows read as zeros (their outputs are not stored) */
    const size_t x_bytes = (size_t)rows * k * 2, padded_bytes = (size_t)padded_rows * k * 2;
    uint16_t *padded = malloc(padded_bytes);
    if (!padded) return -1;
    memcpy(padded, x, x_bytes);
    memset((char *)padded + x_bytes, 0, padded_bytes - x_bytes);
    amx_kernel(padded, (const char *)weight, (uint16_t *)out, rows, padded_rows, n, k, num_threads);
    free(padded);
    return 0;
}

AMX_TARGET_END
#else
int amx_linear_bf16(const void *x, const void *weight, void *out, int64_t rows, int64_t n, int64_t k, int num_threads) {
    (void)x, (void)weight, (void)out, (void)rows, (void)n, (void)k, (void)num_threads;
    return -1;
}
#endif
