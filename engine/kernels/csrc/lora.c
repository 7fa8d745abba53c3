/* Segmented LoRA: every adapter's delta on one adapted linear, for all the step's runs of rows, in
 * one call (the cpu_kernels library; engine/kernels/cpu.py binds it, engine/lora/layers.py calls it
 * once per adapted linear after the base linear).
 *
 * Why: the torch path makes two small matmuls per run of rows and linear (8 adapters x 4 linears x
 * 30 layers x 2 = ~1900 calls a step on the demo, each several microseconds of dispatch over tiny
 * shapes) and multiplies the block-diagonal zeros of a fused linear's B. Here each run's rows are
 * multiplied by their adapter's weights as stored, each weight byte read once per call, with no
 * intermediate tensors: the ideal extra cost of serving adapters is reading their weights.
 *
 * For each run (first row, end row, slot) whose adapter adapts this linear:
 *   shrink: t[rows, sum of ranks] = x[rows] A^T, the parts' A stacked [sum of ranks, in];
 *   expand: y[rows, part k's columns] += t[rows, part k's ranks] B_k^T for each part k (scale folded
 *           in at install), so part k writes its own columns only. B_k^T [rank_k, out_k] is stored in
 *           blocks of LORA_COL_BLOCK columns, each block [rank_k, its width] row-major: one expand item
 *           reads one contiguous block per run (a single stream for the prefetcher, where the plain
 *           layout's rank_k rows of 256 bytes lie out_k apart).
 * x, y, A and B in the model dtype (float32 or bfloat16), products and sums in float32, y rounded
 * once (y + delta). Each row's result is computed in one fixed order whatever the other rows and
 * runs are (batch-invariant). Threads: the shrink splits over runs x blocks of rows, the expand over
 * blocks of output columns (every run's rows for that block), in one parallel region. */
#include <omp.h>

#include "vec.h"

#define LORA_MAX_PARTS 3 /* q|k|v */
#define LORA_ROW_BLOCK 4 /* rows sharing each load of A in the shrink */
#define LORA_COL_BLOCK 64 /* output columns per expand item (engine/kernels/cpu.py LORA_COL_BLOCK): 64 / NV_LANES accumulators */
#define LORA_BAD_ARGUMENTS (-22)

/* One adapter's weights for one linear, bound once at install (engine/lora/layers.py writes these as
 * five int64 words); a = NULL: the adapter leaves this linear alone. */
typedef struct {
    const void *a; /* [sum of ranks, in]: the parts' A stacked in part order */
    const void *b; /* part 0's B^T [rank_0, out_0] column-blocked (see above), then part 1's, ...: scale folded in */
    int64_t rank[LORA_MAX_PARTS]; /* each part's rank; 0: the adapter leaves that part alone */
} lora_desc;


static inline __attribute__((always_inline)) float lora_value(const char *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const bf16_t *)p)[i]) : ((const float *)p)[i];
}

static inline __attribute__((always_inline)) float lora_hsum(nvf v) {
    float a = 0.0f;
    for (int l = 0; l < NV_LANES; l++) a += v[l];
    return a;
}

/* t[m * t_stride + j] = dot(xr[m], A row j) for the block's nb (1..4) rows and j < sum_r; xr: float32
 * rows (a block of fewer rows repeats its last row, the extra sums discarded). Two accumulators a
 * row: eight independent FMA chains. */
static inline __attribute__((always_inline)) void shrink_block(const float *const xr[LORA_ROW_BLOCK], int nb, const char *a,
                                                                int64_t sum_r, int64_t in, int bf16, float *t, int64_t t_stride) {
    const size_t es = elem_size(bf16);
    const int64_t pairs = in / (2 * NV_LANES) * (2 * NV_LANES), full = in / NV_LANES * NV_LANES;
    for (int64_t j = 0; j < sum_r; j++) {
        const char *aj = a + (size_t)(j * in) * es;
        nvf acc[LORA_ROW_BLOCK][2] = {{{0}}};
        int64_t i = 0;
        for (; i < pairs; i += 2 * NV_LANES) {
            const nvf w0 = nv_load_weight(aj, i, bf16), w1 = nv_load_weight(aj, i + NV_LANES, bf16);
#pragma GCC unroll 4
            for (int m = 0; m < LORA_ROW_BLOCK; m++) {
                acc[m][0] += w0 * nv_loadf(xr[m] + i);
                acc[m][1] += w1 * nv_loadf(xr[m] + i + NV_LANES);
            }
        }
        for (; i < full; i += NV_LANES) {
            const nvf w0 = nv_load_weight(aj, i, bf16);
#pragma GCC unroll 4
            for (int m = 0; m < LORA_ROW_BLOCK; m++) acc[m][0] += w0 * nv_loadf(xr[m] + i);
        }
        float sums[LORA_ROW_BLOCK];
        for (int m = 0; m < LORA_ROW_BLOCK; m++) sums[m] = lora_hsum(acc[m][0] + acc[m][1]);
        for (; i < in; i++) {
            const float w = lora_value(aj, i, bf16);
            for (int m = 0; m < LORA_ROW_BLOCK; m++) sums[m] += w * xr[m][i];
        }
        for (int m = 0; m < nb; m++) t[m * t_stride + j] = sums[m];
    }
}

/* y_row[0 : width] += t_row[0 : rank] B^T for one row; block: one column block of B^T, [rank, width]. */
static inline __attribute__((always_inline)) void expand_row(const float *t_row, int64_t rank, const char *block,
                                                              int64_t width, char *y_row, int bf16) {
    const size_t es = elem_size(bf16);
    float delta[LORA_COL_BLOCK];
    if (width == LORA_COL_BLOCK) {
        nvf acc[LORA_COL_BLOCK / NV_LANES] = {0};
        for (int64_t j = 0; j < rank; j++) {
            const char *bj = block + (size_t)(j * width) * es;
            const float tj = t_row[j];
#pragma GCC unroll 16
            for (int q = 0; q < LORA_COL_BLOCK / NV_LANES; q++) acc[q] += nv_load_weight(bj, q * NV_LANES, bf16) * tj;
        }
        memcpy(delta, acc, sizeof(delta));
    } else {
        for (int64_t c = 0; c < width; c++) delta[c] = 0.0f;
        for (int64_t j = 0; j < rank; j++) {
            const char *bj = block + (size_t)(j * width) * es;
            const float tj = t_row[j];
            for (int64_t c = 0; c < width; c++) delta[c] += lora_value(bj, c, bf16) * tj;
        }
    }
    if (bf16) {
        bf16_t *yb = (bf16_t *)y_row;
        for (int64_t c = 0; c < width; c++) yb[c] = f32_to_bf16(bf16_to_f32(yb[c]) + delta[c]);
    } else {
        float *yf = (float *)y_row;
        for (int64_t c = 0; c < width; c++) yf[c] += delta[c];
    }
}

static inline int64_t sum_ranks(const lora_desc *d, int64_t parts) {
    int64_t s = 0;
    for (int64_t k = 0; k < parts; k++) s += d->rank[k];
    return s;
}

/* What the two phases share about one call (segmented_lora fills it once). */
typedef struct {
    const char *x;
    char *y;
    int64_t in, parts, out_total;
    const int64_t *out_sizes, *out_off, *col_items; /* [parts], [parts + 1], [parts + 1] */
    const lora_desc *table;
    const int64_t *runs, *t_off, *first_item; /* [num_runs, 3], [num_runs], [num_runs + 1] */
    int64_t num_runs;
    float *t;
} lora_call;

/* One shrink item: up to LORA_ROW_BLOCK rows of one run. xs: this thread's float32 rows (bfloat16 x). */
static inline __attribute__((always_inline)) void shrink_item_impl(const lora_call *c, int64_t item, float *xs, int bf16) {
    const size_t es = elem_size(bf16);
    int64_t r = 0;
    while (c->first_item[r + 1] <= item) r++;
    const int64_t *run = c->runs + 3 * r;
    const lora_desc *d = c->table + run[2];
    const int64_t sum_r = sum_ranks(d, c->parts), in = c->in;
    const int64_t row0 = run[0] + (item - c->first_item[r]) * LORA_ROW_BLOCK;
    const int nb = (int)(run[1] - row0 < LORA_ROW_BLOCK ? run[1] - row0 : LORA_ROW_BLOCK);
    const float *xr[LORA_ROW_BLOCK];
    for (int m = 0; m < LORA_ROW_BLOCK; m++) {
        const int64_t row = row0 + (m < nb ? m : nb - 1);
        if (bf16) {
            if (m < nb) load_row(xs + m * in, c->x + (size_t)(row * in) * es, in, 1);
            xr[m] = xs + (m < nb ? m : nb - 1) * in;
        } else {
            xr[m] = (const float *)c->x + row * in;
        }
    }
    shrink_block(xr, nb, (const char *)d->a, sum_r, in, bf16, c->t + c->t_off[r] + (row0 - run[0]) * sum_r, sum_r);
}

static void shrink_item(const lora_call *c, int64_t item, float *xs, int bf16) {
    if (bf16) shrink_item_impl(c, item, xs, 1);
    else shrink_item_impl(c, item, xs, 0);
}

/* One expand item: a block of up to LORA_COL_BLOCK output columns of one part, every run's rows. */
static inline __attribute__((always_inline)) void expand_item_impl(const lora_call *c, int64_t item, int bf16) {
    const size_t es = elem_size(bf16);
    int64_t k = 0;
    while (c->col_items[k + 1] <= item) k++;
    const int64_t out_k = c->out_sizes[k], c0 = (item - c->col_items[k]) * LORA_COL_BLOCK;
    const int64_t width = out_k - c0 < LORA_COL_BLOCK ? out_k - c0 : LORA_COL_BLOCK;
    for (int64_t r = 0; r < c->num_runs; r++) {
        if (c->first_item[r + 1] == c->first_item[r]) continue; /* inactive: empty, or the adapter leaves the linear alone */
        const int64_t *run = c->runs + 3 * r;
        const lora_desc *d = c->table + run[2];
        const int64_t rank = d->rank[k];
        if (rank == 0) continue;
        int64_t b_off = 0, t_col = 0;
        for (int64_t p = 0; p < k; p++) b_off += d->rank[p] * c->out_sizes[p], t_col += d->rank[p];
        const int64_t sum_r = sum_ranks(d, c->parts);
        const char *block = (const char *)d->b + (size_t)(b_off + c0 * rank) * es; /* the blocks before it are full */
        for (int64_t row = run[0]; row < run[1]; row++) {
            const float *t_row = c->t + c->t_off[r] + (row - run[0]) * sum_r + t_col;
            expand_row(t_row, rank, block, width, c->y + (size_t)(row * c->out_total + c->out_off[k] + c0) * es, bf16);
        }
    }
}

static void expand_item(const lora_call *c, int64_t item, int bf16) {
    if (bf16) expand_item_impl(c, item, 1);
    else expand_item_impl(c, item, 0);
}

/* y [rows, out_0 + .. + out_{parts-1}] += each run's LoRA delta of x [rows, in] (both contiguous, the
 * model dtype: bf16 0 float32, 1 bfloat16). table: this linear's descriptors by slot; runs [num_runs,
 * 3] int64 (first row, end row, slot), rows outside every run untouched. Returns KERNEL_OK,
 * KERNEL_NO_MEMORY (scratch; y then partly updated), or LORA_BAD_ARGUMENTS (parts outside 1..3, a
 * run outside [0, rows]). */
int segmented_lora(int bf16, const void *x, void *y, int64_t rows, int64_t in, int64_t parts, int64_t out0, int64_t out1,
                   int64_t out2, const lora_desc *table, const int64_t *runs, int64_t num_runs, int num_threads) {
    const int64_t out_sizes[LORA_MAX_PARTS] = {out0, out1, out2};
    if (parts < 1 || parts > LORA_MAX_PARTS || num_runs < 0) return LORA_BAD_ARGUMENTS;
    int64_t *offsets = kernel_malloc((size_t)(2 * num_runs + 1) * sizeof(int64_t));
    if (!offsets) return KERNEL_NO_MEMORY;
    int64_t *t_off = offsets, *first_item = offsets + num_runs; /* first_item [num_runs + 1] */
    int64_t t_elems = 0, shrink_items = 0, work = 0, out_total = 0;
    for (int64_t k = 0; k < parts; k++) out_total += out_sizes[k];
    for (int64_t r = 0; r < num_runs; r++) {
        const int64_t start = runs[3 * r], end = runs[3 * r + 1];
        if (start < 0 || end < start || end > rows) {
            free(offsets);
            return LORA_BAD_ARGUMENTS;
        }
        const lora_desc *d = table + runs[3 * r + 2];
        const int64_t sum_r = d->a ? sum_ranks(d, parts) : 0;
        first_item[r] = shrink_items;
        t_off[r] = t_elems;
        if (sum_r == 0 || end == start) continue;
        t_elems += (end - start) * sum_r;
        shrink_items += (end - start + LORA_ROW_BLOCK - 1) / LORA_ROW_BLOCK;
        work += (end - start + 1) * sum_r * (in + out_total); /* multiply-adds, plus the weights read once */
    }
    first_item[num_runs] = shrink_items;
    if (shrink_items == 0) {
        free(offsets);
        return KERNEL_OK;
    }
    const int parallel = num_threads > 1 && work >= 4 * PARALLEL_MIN_ELEMS;
    const int threads = parallel ? num_threads : 1;
    float *t = kernel_malloc((size_t)t_elems * sizeof(float));
    float *x_scratch = bf16 ? kernel_malloc((size_t)threads * LORA_ROW_BLOCK * in * sizeof(float)) : NULL;
    if (!t || (bf16 && !x_scratch)) {
        free(t), free(x_scratch), free(offsets);
        return KERNEL_NO_MEMORY;
    }
    int64_t out_off[LORA_MAX_PARTS + 1] = {0}, col_items[LORA_MAX_PARTS + 1] = {0};
    for (int64_t k = 0; k < parts; k++) {
        out_off[k + 1] = out_off[k] + out_sizes[k];
        col_items[k + 1] = col_items[k] + (out_sizes[k] + LORA_COL_BLOCK - 1) / LORA_COL_BLOCK;
    }
    const lora_call call = {(const char *)x, (char *)y, in, parts, out_total, out_sizes, out_off, col_items, table, runs,
                            t_off, first_item, num_runs, t};
    const int64_t expand_items = col_items[parts];
#pragma omp parallel num_threads(threads) if (parallel)
    {
        float *xs = bf16 ? x_scratch + (size_t)omp_get_thread_num() * LORA_ROW_BLOCK * in : NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < shrink_items; item++) shrink_item(&call, item, xs, bf16);
        /* the implicit barrier: every t row is written before any expand reads it */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < expand_items; item++) expand_item(&call, item, bf16);
    }
    free(t), free(x_scratch), free(offsets);
    return KERNEL_OK;
}
