/* Many-rows float32 linear over the interleaved weights (the cpu_kernels library; engine/kernels/cpu.py
 * binds it, engine/backends/cpu.py PackedCpuLinear sends it the row counts it measured faster than
 * oneDNN at, interleaved_gemm_max_rows).
 *
 * out [rows, n] = x [rows, k] @ W^T, float32 throughout, W as interleave() lays it out for the one-row
 * kernel (linear.c): [n / 16, k, 16]. That layout is already a BLIS-style panel: 16 output columns,
 * each step of k one contiguous 64-byte line, the panels one after another. So no second copy: the
 * microkernel streams the one-row kernel's copy in order.
 *
 * Why: at 9..64 rows (a many-streams decode step) a linear is compute-bound in principle (the demo's
 * w13 at 32 rows: 113 MFLOP against 7 MB), but oneDNN's float32 kernel ran 52 GFLOP/s there on an AVX2
 * Zen 2 with the weights cold, as a step streams them (bench/NOTES.md 'AVX2 paged attention and where
 * a 32-stream step goes'). Here a register tile of GEMM_MR rows x GEMM_NP panels of accumulators
 * takes each weight vector once per tile and each x value as one broadcast; the weights are blocked by
 * GEMM_KC steps of k (balanced: 576 = 3 x 192) so a chunk of a panel stays in L1 across the row
 * tiles (for fewer rows longer blocks, the chunk in L2: GEMM_X_L2_BYTES); the last GEMM_PF_TILES row
 * tiles share out the prefetch of the next chunk (which, at a panel's end, is the next panel's first:
 * the layout is one stream); threads split the panels.
 *
 * x is read where it lies, a tile's rows as GEMM_MR broadcast streams (one base register each): packing
 * it as [k][tile rows] first cost one thread 12 us of a 32-row w13 call, 92 us at 256 rows, done
 * before the parallel loop (2-5% of one thread's time on the narrow shapes, twice that share on two
 * threads) and bought nothing measurable. Row tiles are balanced (32 rows at 6 a tile: 6, 6, 5, 5,
 * 5, 5), each size its own unrolled code.
 *
 * Each output is one chain of FMAs over k in order (the k blocks continue it through `out`): a row's
 * result is the same whatever the other rows and however many there are (batch-invariant), though not
 * bit-equal to the one-row kernel's (four chains). */
#include "vec.h"

/* In the build's native vector (vec.h's nvf, NV_LANES floats): GEMM_MR x GEMM_NP x (16 / NV_LANES) accumulators fit
 * the register file with the weight vectors and one broadcast beside them (AVX-512: 24 of 32 zmm; AVX2:
 * 12 of 16 ymm; SSE: 12 of 16 xmm). Per step of k a tile issues GEMM_NP x 16 / NV_LANES weight loads and
 * GEMM_MR broadcasts for their product of FMAs: 8 loads for 12 FMAs on AVX2, 14 for 24 on AVX-512. */
#if NV_LANES == 16
#define GEMM_MR 12
#define GEMM_NP 2
#elif NV_LANES == 8
#define GEMM_MR 6
#define GEMM_NP 1
#else
#define GEMM_MR 3
#define GEMM_NP 1
#endif
#define GEMM_VP (16 / NV_LANES) /* vectors per panel row */
/* Steps of k per block, at most: GEMM_NP panels' 256 x 64 bytes (16 KiB a panel) stay in L1 across
 * the row tiles, beside the tiles' rows of x (256 x GEMM_MR floats each). k is cut into balanced
 * blocks (576 = 3 x 192): with 256 + 256 + 64 the short block's tiles prefetched only 64 lines of
 * the next panel's first 256 (cold weights, one thread: w13 at 32 rows 1.09-1.16x faster together with
 * the prefetch below, bench/NOTES.md 'AVX2 many-rows linear, part 2'). */
#define GEMM_KC 256
/* Longer k blocks for fewer rows, up to where a block's x (rows x kc floats) fills this much of the L2
 * (beside the weight chunk, then read by each tile from the L2: 64 bytes per 6 cycles of FMAs, far
 * under what the L2 feeds): each row tile then runs more k steps per setup (its sums loaded from and
 * stored to `out` once a block, its pointers, its unrolled case). The 256-step blocks held a tile's 6
 * x 16 sums for 192 steps (k 576) or 256 (k 1536), and the setup cost showed: with the weights hot the
 * demo's shapes at 32 rows ran 95 GFLOP/s on one thread against 101 with one block over k (107: the
 * FMA peak). One thread, cold, against 256-step blocks (bench/NOTES.md 'gemm.c toward the FMA peak'):
 * 16-64 rows 0.93-0.98x the time, 128 rows 0.96-1.0x, 9 rows 0.95-1.02x; with GEMM_MC's passes of 128
 * rows every pass runs blocks of 512 steps or more (a bfloat16 chunk widened once too, up to
 * GEMM_WIDE_KC steps: its buffer). 384 KiB of Zen 2's 512 (256 before): a pass of 128 rows then takes the demo's k of 576 in
 * one block (2 of 288 before: each tile's sums stored and loaded back, its setup twice), k 1536 in 2
 * and 2048 in 3 (3 and 4 before), with room left for the weight chunk and out. One thread, cold, huge
 * pages, both with the out prefetch (prefetch_out_tile), time: 512 rows, the demo's wqkv 0.97-0.99,
 * w13 0.95-0.97, wo 0.96-0.97, w2 0.97-1.01, the 1.1B's 3072 x 2048 0.98-0.99, 2048 x 8192 0.98-1.0;
 * 128 rows 0.96-0.99; 32 rows level; 9 and 16 rows level at 448 KiB (bench/NOTES.md 'gemm.c at 512
 * rows'). AVX2 only: 0 elsewhere, where it was not measured (GEMM_KC's blocks at every row count). */
#if NV_LANES == 8
#define GEMM_X_L2_BYTES (384 << 10)
#else
#define GEMM_X_L2_BYTES 0
#endif
/* Row tiles that prefetch the next chunk, each an even share of its lines spread over its k steps:
 * the last ones of a block, so the lines arrive shortly before the next block needs them. The first
 * tile alone (256 prefetches within one tile's pass, more misses in flight than the L1 tracks) ran
 * 1.1-1.4x slower at 9-32 rows; every tile (lines fetched a whole block early, evicted again by the
 * x at 128 rows) 0.9x at 128; 2, 3 or 4 tiles, first or last, within 5% of each other. With the
 * longer k blocks of GEMM_X_L2_BYTES (a chunk several times the L1), 6 tiles (every tile at 32 rows):
 * one thread, cold, 16-128 rows 0.97-1.0x the time of 3 tiles, 512 rows level; 2 tiles 1.04-1.07x.
 * Builds with GEMM_KC's blocks at every row count (GEMM_X_L2_BYTES 0) keep 3. */
#if NV_LANES == 8
#define GEMM_PF_TILES 6
#else
#define GEMM_PF_TILES 3
#endif
/* Rows per pass over the weights: a block's x for one k block (GEMM_MC x GEMM_KC floats, 256 KiB)
 * stays in L2 while the panels stream past it. Without it, 2048 rows ran at 0.84-0.91x oneDNN
 * (x from L3 for every panel) where 1024 still ran 1.1x; another pass over the weights costs their
 * bytes once more, little beside 256 rows of FMAs on each. AVX2: 128 rows, whose x then fills the L2
 * budget of GEMM_X_L2_BYTES with k blocks of 768 steps (512 when the budget was 256 KiB) instead of 256
 * (fewer tile setups, as at few rows): one thread, cold, 512 rows 0.93-0.97x the time on the demo's blocks, 0.88x on the 1.1B's
 * 2048 x 8192 (64 rows: about the same, but a bfloat16 chunk is widened once only from 16 tiles, 96
 * rows, on AVX2). Elsewhere not measured: 256. */
#if NV_LANES == 8
#define GEMM_MC 128
#else
#define GEMM_MC 256
#endif
/* Sums stored past the caches (non-temporal, whole 64-byte lines: a panel row) where the weight is
 * at least GEMM_STREAM_MIN_WEIGHT_BYTES and the call's out at least GEMM_STREAM_MIN_OUT_BYTES: such a
 * weight streams through every cache level, so out's lines would leave them before anyone read them,
 * and a plain store first reads each line from DRAM (read for ownership) only to overwrite it. The
 * demo's head (49152 x 576 float32, 113 MB; out 6.3 MB at 32 rows): one thread, cold, 0.85-0.91x the
 * time; the 1.1B's 16384 x 2048 at 256 rows 0.91-1.03x; with a weight or an out that stays in the
 * caches (the demo's blocks; 32 rows of the 1.1B: 1 MB of out) not used (level where measured at 32
 * rows on the 1.1B). The last k block only (the earlier ones' sums are read back); AVX2 only, where
 * measured (bench/NOTES.md 'gemm.c toward the FMA peak'). */
#if NV_LANES == 8 && defined(__AVX2__) /* vec.h's immintrin.h: _mm256_stream_ps */
#define GEMM_STREAM_MIN_WEIGHT_BYTES (32ll << 20)
#define GEMM_STREAM_MIN_OUT_BYTES (4ll << 20)
#else
#define GEMM_STREAM_MIN_WEIGHT_BYTES 0
#define GEMM_STREAM_MIN_OUT_BYTES 0
#endif


/* One tile: out[mr rows, np panels of 16 columns] (+)= x [mr rows at ldx floats apart][kc] @ the panels' kc steps. mr, np and
 * bf16 are literals at every call (gemm_tile_rows' switch), so the accumulators live in registers. w:
 * the first panel's chunk (float32, or bfloat16 with bf16), the next panels panel_floats elements
 * further; first: start the sums at 0, else continue the previous block's from out; pf_lines lines
 * of each panel from line pf_line on (counted from w, 16 weights a line) prefetched, evenly over the
 * kc steps: one prefetch a step from a byte pointer moved a fixed stride (a prefetch takes the line
 * holding its address, so the stride need not be whole lines; rounded up, so every line of the
 * share is fetched). The line index in 16.16 fixed point it replaced cost 4 more ops a step (a
 * shift, a shift, a move, an add) in a loop of 12 FMAs: 6.7 cycles a step where the FMAs need 6;
 * one thread, 32 rows, 1.10x hot, 1.03-1.09x cold (bench/NOTES.md 'gemm.c toward the FMA peak'). */
static inline __attribute__((always_inline)) void gemm_tile(const int mr, const int np, const int bf16, const float *x, int64_t ldx,
                                                            const void *w, int64_t panel_floats, int64_t kc, float *out,
                                                            int64_t n, int first, int64_t pf_line, int64_t pf_lines, int stream) {
    (void)stream; /* builds without GEMM_STREAM_MIN_WEIGHT_BYTES */
    const int64_t elem_bytes = bf16 ? 2 : 4, pf_stride_bytes = (pf_lines * 16 * elem_bytes + kc - 1) / kc;
    const char *pf = (const char *)w + pf_line * 16 * elem_bytes;
    nvf acc[GEMM_MR][GEMM_NP * GEMM_VP];
#pragma GCC unroll 16
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 16
        for (int v = 0; v < np * GEMM_VP; v++) acc[r][v] = first ? (nvf){0} : nv_loadf(out + r * n + v * NV_LANES);
    for (int64_t i = 0; i < kc; i++) {
        nvf wv[GEMM_NP * GEMM_VP];
#pragma GCC unroll 16
        for (int p = 0; p < np; p++) {
            const int64_t line = p * panel_floats + i * 16;
            if (pf_lines) __builtin_prefetch(pf + p * panel_floats * elem_bytes, 0, 3);
#pragma GCC unroll 16
            for (int q = 0; q < GEMM_VP; q++) wv[p * GEMM_VP + q] = nv_load_weight(w, line + q * NV_LANES, bf16);
        }
#pragma GCC unroll 16
        for (int r = 0; r < mr; r++) {
            const float xs = x[r * ldx + i];
#pragma GCC unroll 16
            for (int v = 0; v < np * GEMM_VP; v++) acc[r][v] += wv[v] * xs;
        }
        pf += pf_stride_bytes;
    }
#pragma GCC unroll 16
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 16
        for (int v = 0; v < np * GEMM_VP; v++) {
#if GEMM_STREAM_MIN_WEIGHT_BYTES
            if (stream) {
                _mm256_stream_ps(out + r * n + v * NV_LANES, (__m256)acc[r][v]);
                continue;
            }
#endif
            nv_storef(out + r * n + v * NV_LANES, acc[r][v]);
        }
}

#define GEMM_TILE_CASE(m)                                                                          \
    case m:                                                                                        \
        if (np == GEMM_NP) gemm_tile(m, GEMM_NP, bf16, x, ldx, w, panel_floats, kc, out, n, first, pf_line, pf_lines, stream); \
        else gemm_tile(m, 1, bf16, x, ldx, w, panel_floats, kc, out, n, first, pf_line, pf_lines, stream);                     \
        break;

/* gemm_tile for a run-time mr in 1..GEMM_MR and np in {1, GEMM_NP}: one unrolled body per size
 * (inlined into the two weight types' instantiations below). */
static inline __attribute__((always_inline)) void gemm_tile_rows(const int bf16, int mr, int np, const float *x, int64_t ldx,
                                                                 const void *w, int64_t panel_floats, int64_t kc,
                                                                 float *out, int64_t n, int first, int64_t pf_line, int64_t pf_lines, int stream) {
    switch (mr) {
        GEMM_TILE_CASE(1)
        GEMM_TILE_CASE(2)
        GEMM_TILE_CASE(3)
#if GEMM_MR > 3
        GEMM_TILE_CASE(4)
        GEMM_TILE_CASE(5)
        GEMM_TILE_CASE(6)
#endif
#if GEMM_MR > 6
        GEMM_TILE_CASE(7)
        GEMM_TILE_CASE(8)
        GEMM_TILE_CASE(9)
        GEMM_TILE_CASE(10)
        GEMM_TILE_CASE(11)
        GEMM_TILE_CASE(12)
#endif
        default: break;
    }
}

static void gemm_tile_rows_f32(int mr, int np, const float *x, int64_t ldx, const void *w, int64_t panel_floats, int64_t kc,
                               float *out, int64_t n, int first, int64_t pf_line, int64_t pf_lines, int stream) {
    gemm_tile_rows(0, mr, np, x, ldx, w, panel_floats, kc, out, n, first, pf_line, pf_lines, stream);
}

static void gemm_tile_rows_bf16(int mr, int np, const float *x, int64_t ldx, const void *w, int64_t panel_floats, int64_t kc,
                                float *out, int64_t n, int first, int64_t pf_line, int64_t pf_lines, int stream) {
    gemm_tile_rows(1, mr, np, x, ldx, w, panel_floats, kc, out, n, first, pf_line, pf_lines, stream);
}

/* Row tiles from which a bfloat16 chunk is widened once (widen_chunk) instead of in each tile's loads:
 * AVX2, 2 threads, cold weights, against widening per load (bench/NOTES.md 'gemm.c: a bfloat16 chunk
 * widened once'): 128 and 512 rows (22 and 86 tiles) 1.07-1.09x; 16-32 rows (3-6 tiles) 0.81-0.92x (the
 * widened chunk has no software prefetch of the next one, and few tiles share it); 48-64 rows within
 * the noise either way. */
#define GEMM_WIDEN_MIN_TILES 16
/* The longest k block of a bfloat16 chunk widened once (widen_chunk; its buffer on the thread's stack):
 * the block a GEMM_MC-row pass takes under GEMM_X_L2_BYTES (768 steps on AVX2: the demo's k of 576 in
 * one block, 1536 in 2; 48 KiB of float32 a panel, in L2 as float32's long chunks are), GEMM_KC where
 * the longer blocks are off. With GEMM_KC's 256-step blocks at every row count a bfloat16 model's
 * 512-row linears ran 1.06-1.07x the float32 ones' time (k 576 in 3 blocks where float32 takes 1, each
 * tile's setup and its sums' store and reload thrice); with these 1.01-1.02x (one thread, cold, huge
 * pages, fastest of 15 calls; 128 rows 1.06-1.09x -> 1.03-1.04x: bench/NOTES.md 'bfloat16 prefill on AVX2'). */
#if GEMM_X_L2_BYTES / (GEMM_MC * 4) > GEMM_KC
#define GEMM_WIDE_KC (GEMM_X_L2_BYTES / (GEMM_MC * 4))
#else
#define GEMM_WIDE_KC GEMM_KC
#endif
/* np panels' chunks of kc steps (bfloat16, panel_elems apart) widened to float32, panel after panel
 * ([np][kc][16], at most GEMM_NP x GEMM_WIDE_KC x 16 floats: 48 KiB on AVX2, in L2 beside the tiles' x):
 * a bfloat16 weight's chunk is widened once for all the row tiles that read it, instead of once per
 * tile in the tile's loads (2 ops a vector beside its GEMM_MR FMAs). Widening is exact, and the
 * tiles then run the float32 code on the same values in the same order: the same bits. The chunk
 * is read here in one sequential pass, which the hardware prefetchers follow. */
static void widen_chunk(const bf16_t *w, int np, int64_t panel_elems, int64_t kc, float *wide) {
    for (int p = 0; p < np; p++)
        for (int64_t i = 0; i < kc * 16; i += NV_LANES)
            nv_storef(wide + p * kc * 16 + i, nv_load_weight(w, p * panel_elems + i, 1));
}

static int stream_out(int bf16, const float *out, int64_t rows, int64_t n, int64_t k) {
    const int64_t weight_bytes = n * k * (bf16 ? 2 : 4), out_bytes = rows * n * (int64_t)sizeof(float);
    return GEMM_STREAM_MIN_WEIGHT_BYTES > 0 && weight_bytes >= GEMM_STREAM_MIN_WEIGHT_BYTES && out_bytes >= GEMM_STREAM_MIN_OUT_BYTES &&
           (uintptr_t)out % 64 == 0; /* n is whole 16-column panels: every row's lines then aligned too */
}

/* The next row tile's lines of `out` (rows r0 .. r1, np panels from column c0) fetched for writing while
 * this tile runs: a tile's first k block stores its sums over lines no cache may hold (at 512 rows
 * the call's out is 1.2-6.3 MB on the demo's shapes), and each such store first reads its line from
 * L3 or DRAM; fetched a tile ahead, the reads overlap a tile's FMAs (thousands of cycles) instead of
 * holding its stores. The thread's own next tile only (never a line another thread writes: a write
 * prefetch takes the line exclusive). One thread, cold, huge pages, 512 rows, time: the demo's wqkv
 * 0.91-0.95, w13 0.96-0.98, wo 0.96-1.0, w2 0.98-0.99; the 1.1B's (k 2048 and 8192: 4-16 k blocks, so
 * the first block's misses weigh less) 0.95-1.01, level; 32 and 128 rows (the driver's out in the
 * caches) level (bench/NOTES.md 'gemm.c at 512 rows'). The head (streamed sums): prefetched too,
 * 1.02-1.04x the time at 32 rows; not, 1.0-1.02. Measured on AVX2 only; a prefetch changes no result,
 * so every build does it. */
static inline void prefetch_out_tile(float *out, int64_t n, int64_t r0, int64_t r1, int64_t c0, int np) {
    for (int64_t r = r0; r < r1; r++)
        for (int p = 0; p < np; p++) __builtin_prefetch(out + r * n + c0 + p * 16, 1, 3);
}

/* One block of at most GEMM_MC rows; stream: its sums stored non-temporally (stream_out). For
 * interleaved_gemm_bf16 (else NULL): widen_x, bfloat16 rows widened into x (the caller's float32
 * scratch) by the same team before any tile reads them; rounded, each panel group's sums also rounded
 * to bfloat16 there [rows, n] as soon as its last k block is stored, by the thread that summed them,
 * while they are in its caches. One parallel region for the three: under other jobs on the cores each
 * region can wait a time slice for its second thread (a 32-row call on 2 threads at load 3.4: 7.7 ms
 * a region, bench/NOTES.md 'bfloat16 steps past 8 decodes'), and quiet a fork and join is ~microseconds. */
static void gemm_block(int bf16, const float *x, const void *weight, float *out, int64_t rows, int64_t n, int64_t k,
                       int num_threads, int stream, const bf16_t *widen_x, bf16_t *rounded) {
    const int64_t tiles = (rows + GEMM_MR - 1) / GEMM_MR;
    const int64_t panels = n / 16, groups = (panels + GEMM_NP - 1) / GEMM_NP, panel_floats = k * 16;
    /* a bfloat16 chunk widened once goes to a buffer of at most GEMM_WIDE_KC steps (widen_chunk) */
    const int widen = bf16 && tiles >= GEMM_WIDEN_MIN_TILES;
    const int64_t kc_l2 = GEMM_X_L2_BYTES / (rows * (int64_t)sizeof(float));
    const int64_t kc_long = widen && kc_l2 > GEMM_WIDE_KC ? GEMM_WIDE_KC : kc_l2, kc_max = kc_long < GEMM_KC ? GEMM_KC : kc_long;
    const int64_t k_blocks = (k + kc_max - 1) / kc_max, kc_full = (k + k_blocks - 1) / k_blocks; /* balanced */
    const int64_t pf_tiles = tiles < GEMM_PF_TILES ? tiles : GEMM_PF_TILES;
#pragma omp parallel num_threads(num_threads) if (rows * n * k >= 4 * PARALLEL_MIN_ELEMS)
    {
    if (widen_x) { /* the loop's implicit barrier: every row widened before the tiles read any */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) load_row((float *)x + r * k, widen_x + r * k, k, 1);
    }
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t p0 = g * GEMM_NP;
        const int np = panels - p0 < GEMM_NP ? (int)(panels - p0) : GEMM_NP;
        for (int64_t k0 = 0; k0 < k; k0 += kc_full) {
            const int64_t kc = k - k0 < kc_full ? k - k0 : kc_full;
            /* the stream's next chunk, right after this one: this panel's next block, or after its
             * last the next panel's first */
            const int64_t next = k0 + kc < k ? (k - k0 - kc < kc_full ? k - k0 - kc : kc_full) : kc_full;
            const void *w = (const char *)weight + (size_t)(p0 * panel_floats + k0 * 16) * (bf16 ? 2 : 4);
            /* out's lines fetched ahead (prefetch_out_tile) in the first k block only (the later ones find
             * them cached), and never for sums stored past the caches (stream_out: the fetch is the read
             * those stores avoid) */
            const int pf_out = k0 == 0 && !(stream && k0 + kc >= k);
            if (widen) { /* widen the chunk once for every row tile (widen_chunk) */
                float wide[GEMM_NP * GEMM_WIDE_KC * 16];
                widen_chunk((const bf16_t *)w, np, panel_floats, kc, wide);
                for (int64_t t = 0; t < tiles; t++) {
                    const int64_t r0 = tile_start(t, rows, tiles), mr = tile_start(t + 1, rows, tiles) - r0;
                    if (pf_out && t + 1 < tiles) prefetch_out_tile(out, n, r0 + mr, tile_start(t + 2, rows, tiles), p0 * 16, np);
                    gemm_tile_rows_f32((int)mr, np, x + r0 * k + k0, k, wide, kc * 16, kc, out + r0 * n + p0 * 16, n,
                                       k0 == 0, 0, 0, stream && k0 + kc >= k);
                }
                continue;
            }
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t r0 = tile_start(t, rows, tiles), mr = tile_start(t + 1, rows, tiles) - r0;
                if (pf_out && t + 1 < tiles) prefetch_out_tile(out, n, r0 + mr, tile_start(t + 2, rows, tiles), p0 * 16, np);
                const int64_t share = t - (tiles - pf_tiles); /* this tile's share of the prefetch, if >= 0 */
                const int64_t pf0 = share < 0 ? 0 : next * share / pf_tiles, pf1 = share < 0 ? 0 : next * (share + 1) / pf_tiles;
                (bf16 ? gemm_tile_rows_bf16 : gemm_tile_rows_f32)((int)mr, np, x + r0 * k + k0, k, w, panel_floats, kc,
                                                                  out + r0 * n + p0 * 16, n, k0 == 0, kc + pf0, pf1 - pf0,
                                                                  stream && k0 + kc >= k);
            }
        }
#if GEMM_STREAM_MIN_WEIGHT_BYTES
        if (stream) _mm_sfence(); /* the streamed lines ordered before the team's barrier and any reader */
#endif
        if (rounded)
            for (int64_t r = 0; r < rows; r++) store_row(rounded + r * n + p0 * 16, out + r * n + p0 * 16, np * 16, 1);
    }
    }
}

/* out [rows, n] float32 = x [rows, k] float32 @ W^T, W interleaved [n / 16, k, 16] float32 (bf16 0) or
 * bfloat16 (bf16 1: widened per load, float32 sums: a bfloat16 model on CPUs without oneDNN's bfloat16).
 * Returns KERNEL_OK (it allocates nothing; the int keeps the kernels' calling convention). */
int interleaved_gemm(int bf16, const float *x, const void *weight, float *out, int64_t rows, int64_t n, int64_t k,
                     int num_threads) {
    if (rows <= 0 || n <= 0) return KERNEL_OK;
    if (k <= 0) { /* an empty sum: no k block would write out */
        memset(out, 0, (size_t)(rows * n) * sizeof(float));
        return KERNEL_OK;
    }
    const int stream = stream_out(bf16, out, rows, n, k); /* by the whole call's out, of which each pass writes its rows */
    const int64_t blocks = (rows + GEMM_MC - 1) / GEMM_MC, block_rows = (rows + blocks - 1) / blocks; /* balanced */
    for (int64_t m0 = 0; m0 < rows; m0 += block_rows) {
        const int64_t mb = rows - m0 < block_rows ? rows - m0 : block_rows;
        gemm_block(bf16, x + m0 * k, weight, out + m0 * n, mb, n, k, num_threads, stream, NULL, NULL);
    }
    return KERNEL_OK;
}

/* out [rows, n] bfloat16 = x [rows, k] bfloat16 @ W^T, W interleaved bfloat16 [n / 16, k, 16]: a
 * bfloat16 model's many rows (CPUs without oneDNN's bfloat16; PackedCpuLinear's per-op rows and the
 * compiled decode step call this one function, so both get the same bits). x widened exactly to
 * float32, interleaved_gemm's float32 sums (the same chains: the result of a row does not depend on
 * the others), each rounded once to bfloat16 (vec.h's f32_to_bf16: torch's round to nearest even; a
 * NaN stays a quiet NaN of its sign and payload, where torch's .to(bfloat16) writes 0xffff), as
 * torch's `x.float()`, the gemm and `.to(bfloat16)` gave; done GEMM_MC rows at a time, so a pass's x
 * and sums are converted while they are in the caches (gemm_block). scratch: rows x (k + n) floats (the widened x, then the sums), or NULL: allocated here for
 * one pass. Returns KERNEL_OK, or KERNEL_NO_MEMORY (that allocation failed; out undefined). */
int interleaved_gemm_bf16(const bf16_t *x, const bf16_t *weight, bf16_t *out, float *scratch, int64_t rows, int64_t n,
                          int64_t k, int num_threads) {
    if (rows <= 0 || n <= 0) return KERNEL_OK;
    const int64_t blocks = (rows + GEMM_MC - 1) / GEMM_MC, block_rows = (rows + blocks - 1) / blocks; /* interleaved_gemm's passes */
    float *owned = scratch ? NULL : kernel_malloc((size_t)(block_rows * (k + n)) * sizeof(float));
    if (!scratch && !owned) return KERNEL_NO_MEMORY;
    float *xf = scratch ? scratch : owned, *sums = xf + block_rows * k;
    for (int64_t m0 = 0; m0 < rows; m0 += block_rows) {
        const int64_t mb = rows - m0 < block_rows ? rows - m0 : block_rows;
        if (k > 0) /* x widened, the sums rounded, in the gemm's own region (never streamed past the caches) */
            gemm_block(1, xf, weight, sums, mb, n, k, num_threads, 0, x + m0 * k, out + m0 * n);
        else /* an empty sum: +0, whose bfloat16 bits are zeros */
            memset(out + m0 * n, 0, (size_t)(mb * n) * sizeof(bf16_t));
    }
    free(owned);
    return KERNEL_OK;
}

/* The most rows PackedCpuLinear sends interleaved_gemm (float32; from 2 rows up: one row has the
 * one-row kernel) from a weight that also has oneDNN's copy, by this build's vector width, where
 * measured faster than oneDNN's packed float32 kernel with the weights cold (bench/gemm_linear.py,
 * bench/NOTES.md 'AVX2 many-rows linear' and its part 2): on AVX2, two threads, 1.37-1.86x at 32
 * rows, 1.17-1.24x at 512 (a prefill step of the default 512-token budget), 1.06-1.18x at 1024 and
 * 2048 on the demo's block shapes; one thread level or ahead up to 2048. Past 2048 oneDNN keeps them
 * (not measured on every shape). 0: not measured faster at any row count in this build, oneDNN
 * keeps them. */
int64_t interleaved_gemm_max_rows(void) {
#if NV_LANES == 8
    return 2048;
#elif NV_LANES == 16
    /* Zen 4, one thread, cold, CPU time (bench/gemm_linear.py; bench/NOTES.md 'Zen 4: float32 steps of
     * 2..64 decodes'): 1.07-1.38x oneDNN at 8-32 rows, level to 1.08x at 64, 0.94-1.06x by shape at 128
     * (a layer's four 0.97-0.98x), 0.91-0.98x at 512-2048 (oneDNN near the FMA peak there). */
    return 64;
#else
    return 0; /* SSE builds: not measured faster */
#endif
}
