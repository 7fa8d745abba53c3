/* A/B of csrc/gemm.c variants without Python between the calls: compiles one gemm.c (the committed
 * one or an edited copy) into a timing driver, so two builds can be timed interleaved from a shell
 * loop (bench/NOTES.md 'AVX2 many-rows linear, part 2'). Not a test; not part of the kernels.
 *
 *   gcc -O3 -march=native -fopenmp -std=gnu11 -fassociative-math -fno-signed-zeros -fno-trapping-math \
 *       -fno-math-errno -Iengine/kernels/csrc -DGEMM_SRC='"/path/to/gemm.c"' bench/gemm_variants.c -o /tmp/gemm_new
 *   /tmp/gemm_new N K ROWS CALLS [THREADS]     e.g. /tmp/gemm_new 3072 576 32 150 (the demo's w13 at 32 rows)
 *
 * Weights: enough copies of [N, K] to pass 200 MB, rotated call after call, so each call reads its
 * weight from DRAM as a decode step does (HOT=1: one copy, for the micro-kernel's own rate);
 * BF16=1: bfloat16 weights (widened per load); IO=1 (with BF16): interleaved_gemm_bf16, x and out bfloat16
 * as a bfloat16 model's linears call it (x widened, the sums rounded, a caller's scratch); HUGE=1: the weights on huge pages (madvise), as the server's
 * WeightArena holds them (else 4 KiB pages: a TLB miss per page of a cold weight). Prints the median and the fastest call's thread CPU time (steady on
 * a shared machine; one thread) and wall time, as GFLOP/s; PEAK=1 also the one-thread FMA peak of
 * this core (12 independent vfmadd231ps chains on ymm registers: AVX2 builds), the roofline to read
 * the GFLOP/s against. */
#include GEMM_SRC
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

static double seconds(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
    const double d = *(const double *)a - *(const double *)b;
    return d < 0 ? -1 : d > 0;
}

#if defined(__AVX2__)
static double fma_peak_gflops(void) {
    const long iterations = 100000000;
    const double start = seconds(CLOCK_THREAD_CPUTIME_ID);
    for (long i = 0; i < iterations; i++)
        __asm__ volatile("vfmadd231ps %%ymm14, %%ymm15, %%ymm0\n vfmadd231ps %%ymm14, %%ymm15, %%ymm1\n"
                         "vfmadd231ps %%ymm14, %%ymm15, %%ymm2\n vfmadd231ps %%ymm14, %%ymm15, %%ymm3\n"
                         "vfmadd231ps %%ymm14, %%ymm15, %%ymm4\n vfmadd231ps %%ymm14, %%ymm15, %%ymm5\n"
                         "vfmadd231ps %%ymm14, %%ymm15, %%ymm6\n vfmadd231ps %%ymm14, %%ymm15, %%ymm7\n"
                         "vfmadd231ps %%ymm14, %%ymm15, %%ymm8\n vfmadd231ps %%ymm14, %%ymm15, %%ymm9\n"
                         "vfmadd231ps %%ymm14, %%ymm15, %%ymm10\n vfmadd231ps %%ymm14, %%ymm15, %%ymm11\n" ::
                             : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
                               "xmm11");
    return (double)iterations * 12 * 16 / (seconds(CLOCK_THREAD_CPUTIME_ID) - start) / 1e9;
}
#endif

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s N K ROWS CALLS [THREADS]\n", argv[0]);
        return 2;
    }
    const int64_t n = atol(argv[1]), k = atol(argv[2]), rows = atol(argv[3]);
    const int calls = atoi(argv[4]) < 1 ? 1 : atoi(argv[4]) > 1000 ? 1000 : atoi(argv[4]);
    const int threads = argc > 5 ? atoi(argv[5]) : 1, bf16 = getenv("BF16") != NULL;
#if defined(__AVX2__)
    if (getenv("PEAK")) printf("FMA peak, one thread: %.1f GFLOP/s\n", fma_peak_gflops());
#endif
    const int64_t copies = getenv("HOT") ? 1 : (200l << 20) / (n * k * 4) + 1, elem = bf16 ? 2 : 4;
    /* HUGE=1: the weights on 2 MiB pages (madvise), as the server places them (engine.kernels.memory.WeightArena) */
    const size_t w_bytes = ((size_t)(copies * n * k * 4) + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
    char *w = aligned_alloc(2u << 20, w_bytes);
    if (w && getenv("HUGE")) madvise(w, w_bytes, MADV_HUGEPAGE);
    float *x = aligned_alloc(64, (size_t)(rows * k * 4)), *out = aligned_alloc(64, (size_t)(rows * n * 4));
    if (!w || !x || !out) return 1;
    for (int64_t i = 0; i < copies * n * k; i++) { /* values in [-0.5, 0.5): no denormals either way */
        const float v = (float)((i * 7919) % 1000) / 1000.f - 0.5f;
        if (bf16) {
            uint32_t u;
            memcpy(&u, &v, 4);
            ((uint16_t *)w)[i] = (uint16_t)(u >> 16);
        } else {
            ((float *)w)[i] = v;
        }
    }
    for (int64_t i = 0; i < rows * k; i++) x[i] = (float)((i * 104729) % 1000) / 1000.f - 0.5f;
    /* IO=1: x and out in bfloat16, through interleaved_gemm_bf16 (its scratch: rows x (k + n) floats) */
    const int io = bf16 && getenv("IO") != NULL;
    bf16_t *x16 = io ? aligned_alloc(64, (size_t)(rows * k * 2 + 64)) : NULL, *out16 = io ? aligned_alloc(64, (size_t)(rows * n * 2 + 64)) : NULL;
    float *scratch = io ? aligned_alloc(64, (size_t)(rows * (k + n) * 4)) : NULL;
    if (io && (!x16 || !out16 || !scratch)) return 1;
    for (int64_t i = 0; io && i < rows * k; i++) x16[i] = f32_to_bf16(x[i]);
    interleaved_gemm(bf16, x, w, out, rows, n, k, threads); /* pages touched */
    double cpu_s[1000], wall_s[1000];
    for (int c = 0; c < calls; c++) {
        const char *weight = w + (size_t)((c % copies) * n * k * elem);
        const double cpu0 = seconds(CLOCK_THREAD_CPUTIME_ID), wall0 = seconds(CLOCK_MONOTONIC);
        if (io) interleaved_gemm_bf16(x16, (const bf16_t *)weight, out16, scratch, rows, n, k, threads);
        else interleaved_gemm(bf16, x, weight, out, rows, n, k, threads);
        cpu_s[c] = seconds(CLOCK_THREAD_CPUTIME_ID) - cpu0;
        wall_s[c] = seconds(CLOCK_MONOTONIC) - wall0;
    }
    qsort(cpu_s, (size_t)calls, sizeof(double), by_value);
    qsort(wall_s, (size_t)calls, sizeof(double), by_value);
    const double gflop = 2.0 * (double)(rows * n * k) / 1e9, cpu = cpu_s[calls / 2], wall = wall_s[calls / 2];
    printf("%ldx%ld rows %ld: (%ld copies) median cpu %.1f us %.1f GFLOP/s, median wall %.1f us %.1f GFLOP/s, fastest cpu %.1f us\n",
           (long)n, (long)k, (long)rows, (long)copies, cpu * 1e6, gflop / cpu, wall * 1e6, gflop / wall, cpu_s[0] * 1e6);
    return 0;
}
