/* bfloat16 linears y = x @ W^T through Intel AMX tiles (TDPBF16PS), for decode batches of many
 * streams (2..64 rows) where AVX512_BF16's vdpbf16ps runs out of instructions before the weights
 * run out of bandwidth (bench/NOTES.md 'AMX linears'), and for prefill chunks of weights that have
 * no oneDNN copy (a blocked loop once x outgrows L2, 'AMX linears at prefill sizes').
 *
 * The weight is the bfloat16 pairs layout linear.c's one-row kernel reads,
 * [n / 16, k / 2, 16, 2] (CpuKernels.interleave): each 16-column block's k / 2 rows of (column,
 * pair) are exactly AMX B tiles (16 pair-rows x 64 bytes) stacked along k, so one buffer serves the
 * one-row kernel and this one. x [rows, k] and out [rows, n] are row-major bfloat16 (out float32,
 * the tiles' sums unrounded, through amx_linear_bf16_f32_out: the output head's exact logits); k a
 * multiple of 32 and n of 16 (both return -1 otherwise, before touching anything).
 *
 * A row's sums do not depend on the other rows: each output element is one tile element's chain
 * over k in K_STEP order, whatever the row count, the row's place in its tile or the loop (the
 * blocked loop's float32 partial sums are stored and reloaded exactly).
 *
 * Compiled at every x86-64 level: the kernel carries its own target attributes and runs only after
 * amx_init() saw the CPU's AMX-BF16, AMX-TILE and AVX512_BF16 bits and Linux granted the tile data
 * state (arch_prctl ARCH_REQ_XCOMP_PERM, once per process). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"
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

/* out as the kernels write it: bfloat16 (rounded to nearest even) or, f32, the float32 sums;
 * `index` counts elements of out's type. */
typedef struct {
    void *base;
    int f32;
} Out;

/* 16 float32 sums at acc -> out's elements index .. index + 15. */
static inline void store16(Out out, int64_t index, const float *acc) {
    const __m512 v = _mm512_loadu_ps(acc);
    if (out.f32) _mm512_storeu_ps((float *)out.base + index, v);
    else _mm256_storeu_si256((__m256i *)((uint16_t *)out.base + index), (__m256i)_mm512_cvtneps_pbh(v));
}

#define ACC_STRIDE_BYTES (2 * COL_BLOCK * 4) /* a row of the float32 buffer: 32 columns */
#define ACC_BLOCK_FLOATS (ROW_BLOCK * 2 * COL_BLOCK)

/* The accumulators (row block r, column block c in tile 2r + c) -> acc, row block r at
 * acc + r * ACC_BLOCK_FLOATS, column block c at + c * 16 (row stride 32 floats). */
static inline void store_tiles(float *acc, int rbs, int cols) {
    _tile_stored(0, acc, ACC_STRIDE_BYTES);
    if (cols > 1) _tile_stored(1, acc + COL_BLOCK, ACC_STRIDE_BYTES);
    if (rbs > 1) _tile_stored(2, acc + ACC_BLOCK_FLOATS, ACC_STRIDE_BYTES);
    if (rbs > 1 && cols > 1) _tile_stored(3, acc + ACC_BLOCK_FLOATS + COL_BLOCK, ACC_STRIDE_BYTES);
}

/* A finished block's float32 sums, waiting to be stored to out's rows [row, row_end), columns col0 ..
 * col0 + cols * 16; row r's sums at acc + (r - row0) * 32. Stored a few rows at each k step of the
 * next block rather than all at once: each out line is a cold miss (written once a call), and storing
 * a block's rows in one go left the tiles idle behind those misses, 20-40% of a prefill-sized linear
 * (bench/NOTES.md 'The AMX linears' stores behind the next block'). */
typedef struct {
    const float *acc;
    Out out;
    int64_t n, col0, row0, row, row_end, per_step;
    int cols;
} Pending;

/* Rows per k step that store a block of `rows` rows within `steps` k steps. */
static inline int64_t rows_per_step(int64_t rows, int64_t steps) { return (rows + steps - 1) / steps; }

/* The next `count` waiting rows (all of them: INT64_MAX) -> out. */
static inline void pending_store(Pending *p, int64_t count) {
    const int64_t end = p->row_end - p->row < count ? p->row_end : p->row + count;
    for (; p->row < end; p->row++) {
        const float *a = p->acc + (p->row - p->row0) * 2 * COL_BLOCK;
        const int64_t index = p->row * p->n + p->col0;
        store16(p->out, index, a);
        if (p->cols > 1) store16(p->out, index + COL_BLOCK, a + COL_BLOCK);
    }
}

/* A k step's share of the waiting rows. */
static inline void pending_step(Pending *p) {
    if (p->row < p->row_end) pending_store(p, p->per_step);
}

/* One k step (K_STEP values of x) of the 2x2 tile block: x tiles 4, 5 (row blocks at a0, a1; a1
 * read only with rbs 2), weight tiles 6, 7 (column blocks at w0, w1; w1 only with cols 2) into the
 * accumulators 0..3 (row block r, column block c at 2r + c). */
static inline void tile_step(const char *a0, const char *a1, int64_t x_stride, const char *w0, const char *w1, int rbs, int cols) {
    _tile_loadd(4, a0, x_stride);
    _tile_loadd(6, w0, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (cols > 1) {
        _tile_loadd(7, w1, 64);
        _tile_dpbf16ps(1, 4, 7);
    }
    if (rbs > 1) {
        _tile_loadd(5, a1, x_stride);
        _tile_dpbf16ps(2, 5, 6);
        if (cols > 1) _tile_dpbf16ps(3, 5, 7);
    }
}

/* Column blocks [cb, cb + cols) (cols 1 or 2) x row blocks [rb, rb + row_blocks) (1 or 2), all k, into
 * acc ([32 rows][32 columns] float32), which becomes the waiting block; the one waiting before is
 * stored during the k loop. */
static inline void tile_block(const uint16_t *x, int64_t k, const char *w, int64_t pairs_bytes, int64_t cb, int cols,
                              int64_t rb, int row_blocks, Out out, int64_t n, int64_t rows, float *acc, Pending *pending) {
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
        tile_step(x0 + kk * 2, x1 + kk * 2, x_stride, w0 + w_off, w1 + w_off, row_blocks, cols);
        pending_step(pending);
    }
    pending_store(pending, INT64_MAX);
    store_tiles(acc, row_blocks, cols);
    const int64_t row0 = rb * ROW_BLOCK, end = (rb + row_blocks) * ROW_BLOCK;
    *pending = (Pending){acc, out, n, cb * COL_BLOCK, row0, row0, end < rows ? end : rows,
                         rows_per_step(end - row0, k / K_STEP), cols};
}

/* Work items are pairs of column blocks (32 output columns), split evenly over the threads: each
 * thread streams its share of the weight once, and for more than 32 rows re-reads each 32-column
 * slice (k * 64 bytes) from its own cache for every further 32 rows. */
static void amx_kernel(const uint16_t *x, const char *w, Out out, int64_t rows, int64_t padded_rows, int64_t n,
                       int64_t k, int num_threads) {
    const int64_t col_blocks = n / COL_BLOCK, items = (col_blocks + 1) / 2, pairs_bytes = k / 2 * 64;
    const int64_t row_blocks = padded_rows / ROW_BLOCK;
#pragma omp parallel num_threads(num_threads)
    {
        float acc[2][2 * ROW_BLOCK * 2 * COL_BLOCK] __attribute__((aligned(64)));
        Pending pending = {0};
        int buffer = 0;
        configure_tiles();
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            const int64_t cb = item * 2;
            const int cols = cb + 1 < col_blocks ? 2 : 1;
            for (int64_t rb = 0; rb < row_blocks; rb += 2, buffer ^= 1) {
                const int rbs = rb + 1 < row_blocks ? 2 : 1;
                tile_block(x, k, w, pairs_bytes, cb, cols, rb, rbs, out, n, rows, acc[buffer], &pending);
            }
        }
        pending_store(&pending, INT64_MAX);
        _tile_release();
    }
}

/* ---- Many rows (prefill chunks): blocked for L1 and L2 ----
 * The decode loop above re-reads each 32-row block of x (k * 64 bytes) for every 32 columns: from L2
 * while x fits there, from L3 once it does not (past ~1000 rows of k 1024), which cost it up to
 * 1.3-1.8x at 1024-4096 rows. Here each thread takes its 32-column slices for one block of rows
 * whose x fits an L2 budget (X_BLOCK_BYTES) at a time, and sweeps each slice in k chunks of at most
 * K_CHUNK_MAX over groups of GROUP_ROW_BLOCKS row blocks: a chunk's 2 x chunk / 32 weight tiles
 * are reused by every row pair of the group while they are in L1, partial sums kept in a float32
 * buffer between chunks (tile store and load are exact: the sums are those of one pass over k, bit
 * for bit those of the decode loop). */
#ifndef X_BLOCK_BYTES
#define X_BLOCK_BYTES (1 << 20)
#endif
#ifndef K_CHUNK_MAX
#define K_CHUNK_MAX 384
#endif
#ifndef GROUP_ROW_BLOCKS
#define GROUP_ROW_BLOCKS 4
#endif

/* One k chunk (`steps` k steps) of up to 2 row blocks x 2 column blocks: x tiles a0, a1 (row stride
 * x_stride) and weight tiles w0, w1 at the chunk's first step; the accumulators start at zero (first)
 * or from acc and end in acc (row block r, column block c at acc + r * ACC_BLOCK_FLOATS + c * 16). */
static inline void chunk_block(const char *a0, const char *a1, int64_t x_stride, const char *w0, const char *w1,
                               int64_t steps, int rbs, int cols, float *acc, int first, Pending *pending) {
    float *acc1 = acc + ACC_BLOCK_FLOATS;
    if (first) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_loadd(0, acc, ACC_STRIDE_BYTES);
        if (cols > 1) _tile_loadd(1, acc + COL_BLOCK, ACC_STRIDE_BYTES);
        if (rbs > 1) _tile_loadd(2, acc1, ACC_STRIDE_BYTES);
        if (rbs > 1 && cols > 1) _tile_loadd(3, acc1 + COL_BLOCK, ACC_STRIDE_BYTES);
    }
    for (int64_t s = 0; s < steps; s++) {
        const int64_t w_off = s * W_TILE_BYTES, x_off = s * K_STEP * 2;
        tile_step(a0 + x_off, a1 + x_off, x_stride, w0 + w_off, w1 + w_off, rbs, cols);
        pending_step(pending);
    }
    store_tiles(acc, rbs, cols);
}

/* k steps per chunk: chunks of at most K_CHUNK_MAX, as even as whole k steps allow. */
static int64_t chunk_steps_for(int64_t k) {
    const int64_t steps = k / K_STEP, chunks = (k + K_CHUNK_MAX - 1) / K_CHUNK_MAX;
    return (steps + chunks - 1) / chunks;
}

/* Row blocks of x per L2 block: a multiple of GROUP_ROW_BLOCKS, at least one group. */
static int64_t block_row_blocks_for(int64_t k) {
    const int64_t fit = X_BLOCK_BYTES / (ROW_BLOCK * k * 2) / GROUP_ROW_BLOCKS * GROUP_ROW_BLOCKS;
    return fit < GROUP_ROW_BLOCKS ? GROUP_ROW_BLOCKS : fit;
}

/* The operands of the blocked loop: x's full row blocks in place, a last partial one in `tail`
 * (16 rows, those past `rows` zero). */
typedef struct {
    const uint16_t *x, *tail;
    const char *w;
    Out out;
    int64_t rows, n, k, full_row_blocks, pairs_bytes, chunk_steps;
} ManyRows;

static inline const char *row_block(const ManyRows *m, int64_t rb) {
    return (const char *)(rb < m->full_row_blocks ? m->x + rb * ROW_BLOCK * m->k : m->tail);
}

/* Column blocks cb, cb + cols over row blocks [rb0, rb1) (at most GROUP_ROW_BLOCKS), all k, into acc,
 * which becomes the waiting block; the one waiting before is stored during the k steps. */
static void slice_group(const ManyRows *m, int64_t cb, int cols, int64_t rb0, int64_t rb1, float *acc, Pending *pending) {
    const char *w0 = m->w + cb * m->pairs_bytes, *w1 = w0 + m->pairs_bytes;
    const int64_t steps_total = m->k / K_STEP;
    for (int64_t s0 = 0; s0 < steps_total; s0 += m->chunk_steps) {
        const int64_t steps = steps_total - s0 < m->chunk_steps ? steps_total - s0 : m->chunk_steps;
        for (int64_t rb = rb0; rb < rb1; rb += 2) {
            const int rbs = rb + 1 < rb1 ? 2 : 1;
            const char *a0 = row_block(m, rb) + s0 * K_STEP * 2, *a1 = rbs > 1 ? row_block(m, rb + 1) + s0 * K_STEP * 2 : a0;
            chunk_block(a0, a1, m->k * 2, w0 + s0 * W_TILE_BYTES, w1 + s0 * W_TILE_BYTES, steps, rbs, cols,
                        acc + (rb - rb0) * ACC_BLOCK_FLOATS, s0 == 0, pending);
        }
    }
    pending_store(pending, INT64_MAX);
    const int64_t row0 = rb0 * ROW_BLOCK, row1 = rb1 * ROW_BLOCK < m->rows ? rb1 * ROW_BLOCK : m->rows;
    *pending = (Pending){acc, m->out, m->n, cb * COL_BLOCK, row0, row0, row1,
                         rows_per_step(row1 - row0, steps_total * ((rb1 - rb0 + 1) / 2)), cols};
}

static void amx_kernel_many_rows(const ManyRows *m, int num_threads) {
    const int64_t col_blocks = m->n / COL_BLOCK, items = (col_blocks + 1) / 2;
    const int64_t row_blocks = (m->rows + ROW_BLOCK - 1) / ROW_BLOCK, block_rbs = block_row_blocks_for(m->k);
#pragma omp parallel num_threads(num_threads)
    {
        float acc[2][GROUP_ROW_BLOCKS * ACC_BLOCK_FLOATS] __attribute__((aligned(64)));
        Pending pending = {0};
        int buffer = 0;
        configure_tiles();
        for (int64_t b0 = 0; b0 < row_blocks; b0 += block_rbs) {
            const int64_t b1 = b0 + block_rbs < row_blocks ? b0 + block_rbs : row_blocks;
#pragma omp for schedule(static) nowait
            for (int64_t item = 0; item < items; item++) {
                const int64_t cb = item * 2;
                const int cols = cb + 1 < col_blocks ? 2 : 1;
                for (int64_t g0 = b0; g0 < b1; g0 += GROUP_ROW_BLOCKS, buffer ^= 1)
                    slice_group(m, cb, cols, g0, g0 + GROUP_ROW_BLOCKS < b1 ? g0 + GROUP_ROW_BLOCKS : b1, acc[buffer], &pending);
            }
        }
        pending_store(&pending, INT64_MAX);
        _tile_release();
    }
}

static int amx_linear_many_rows(const uint16_t *x, const char *w, Out out, int64_t rows, int64_t n, int64_t k,
                                int num_threads) {
    ManyRows m = {x, NULL, w, out, rows, n, k, rows / ROW_BLOCK, k / 2 * 64, chunk_steps_for(k)};
    uint16_t *tail = NULL;
    const int64_t tail_rows = rows % ROW_BLOCK;
    if (tail_rows) {
        if (!(tail = kernel_calloc((size_t)ROW_BLOCK * k, 2))) return KERNEL_NO_MEMORY;
        memcpy(tail, x + m.full_row_blocks * ROW_BLOCK * k, (size_t)tail_rows * k * 2);
        m.tail = tail;
    }
    amx_kernel_many_rows(&m, num_threads);
    free(tail);
    return 0;
}

/* Whether the blocked loop above runs: once x outgrows the L2 budget (~500 rows of k 1024, more at
 * smaller k; never for decode batches), where the decode loop would re-read it from L3 for every
 * 32 columns; below that the two ran level. Up to k 8192 (one group of 4 row blocks in the 1 MB
 * budget): with groups of 8 a block of x that fits L2 was under 256 rows past k 2048, and streaming
 * the weight once per block cost more than the decode loop's re-reads of x (0.7x); with groups of 4
 * a 1.1B model's w2 (k 8192) runs 1.17-1.2x the decode loop's rate at one thread and level at two,
 * k 14336 0.93x (bench/NOTES.md 'AMX linears at prefill sizes', 'The AMX linears' stores behind
 * the next block'). */
static int many_rows(int64_t rows, int64_t k) {
    return rows > 64 && rows * k * 2 > X_BLOCK_BYTES && k * 2 * ROW_BLOCK * GROUP_ROW_BLOCKS <= X_BLOCK_BYTES;
}

static int amx_linear(const void *x, const void *weight, Out out, int64_t rows, int64_t n, int64_t k, int num_threads) {
    if (rows < 1 || n % COL_BLOCK || k % K_STEP || k < K_STEP || num_threads < 1) return -1;
    const int64_t padded_rows = (rows + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;
    if (many_rows(rows, k)) return amx_linear_many_rows(x, weight, out, rows, n, k, num_threads);
    if (padded_rows == rows) {
        amx_kernel((const uint16_t *)x, (const char *)weight, out, rows, rows, n, k, num_threads);
        return 0;
    }
    /* the last tile's missing rows read as zeros (their outputs are not stored) */
    const size_t x_bytes = (size_t)rows * k * 2, padded_bytes = (size_t)padded_rows * k * 2;
    uint16_t *padded = kernel_malloc(padded_bytes);
    if (!padded) return KERNEL_NO_MEMORY;
    memcpy(padded, x, x_bytes);
    memset((char *)padded + x_bytes, 0, padded_bytes - x_bytes);
    amx_kernel(padded, (const char *)weight, out, rows, padded_rows, n, k, num_threads);
    free(padded);
    return 0;
}

/* y [rows, n] = x [rows, k] @ W^T, W in the pairs layout, out bfloat16 (_f32_out: float32); 0 done,
 * -1 refused (shape or no AMX: the caller runs another path), KERNEL_NO_MEMORY when its padded input
 * copy cannot be allocated. amx_init() must have returned 1 in this process. */
int amx_linear_bf16(const void *x, const void *weight, void *out, int64_t rows, int64_t n, int64_t k, int num_threads) {
    return amx_linear(x, weight, (Out){out, 0}, rows, n, k, num_threads);
}

int amx_linear_bf16_f32_out(const void *x, const void *weight, void *out, int64_t rows, int64_t n, int64_t k, int num_threads) {
    return amx_linear(x, weight, (Out){out, 1}, rows, n, k, num_threads);
}

AMX_TARGET_END
#else
int amx_linear_bf16(const void *x, const void *weight, void *out, int64_t rows, int64_t n, int64_t k, int num_threads) {
    (void)x, (void)weight, (void)out, (void)rows, (void)n, (void)k, (void)num_threads;
    return -1;
}

int amx_linear_bf16_f32_out(const void *x, const void *weight, void *out, int64_t rows, int64_t n, int64_t k, int num_threads) {
    return amx_linear_bf16(x, weight, out, rows, n, k, num_threads);
}
#endif
