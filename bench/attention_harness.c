/* Decode attention from C, for callgrind's instruction counts (steady on a shared machine, where
 * timings are not) and thread-CPU timings without Python around the calls: 32 decodes x 160 keys,
 * 9/3 heads of 64, 16-key blocks in shuffled order, LAYERS layers' caches called in turn (30: cold,
 * as in a step; 1: hot). HUGE=1 in the environment puts the caches on huge pages, as the engine's
 * allocate_kv_caches does (bench/NOTES.md 'Decode attention over a KV head's query rows').
 *
 *   gcc -O2 bench/attention_harness.c -o /tmp/attention_harness -fopenmp -Wl,--no-as-needed -ldl -lm
 *   /tmp/attention_harness LIB.so paged|decode LAYERS REPS [BF16 0|1] [THREADS]
 *   valgrind --tool=callgrind /tmp/attention_harness LIB.so paged 1 2   # then callgrind_annotate: *_omp_fn.0
 *
 * LIB.so: a cpu_kernels build (the kernel cache's, or engine.kernels.build.compile_library's). */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
static char *alloc_cache(size_t bytes) {
    if (!getenv("HUGE")) return malloc(bytes);
    void *p; size_t r = (bytes + (2 << 20) - 1) / (2 << 20) * (2 << 20);
    if (posix_memalign(&p, 2 << 20, r)) return 0;
    if (madvise(p, r, MADV_HUGEPAGE)) perror("madvise");
    return p;
}
typedef int (*pa_fn)(int, const void *, int64_t, void *, const int32_t *, const int32_t *, const int32_t *, const int32_t *, int64_t, int64_t, const void *, const void *, int64_t, int64_t, int64_t, int64_t, float, int);
typedef int (*pd_fn)(int, const void *, int64_t, void *, const int64_t *, const void *, const void *, const int32_t *, int64_t, const int32_t *, int64_t, int64_t, int64_t, int64_t, int64_t, float, int);
int main(int argc, char **argv) {
    /* harness LIB KERNEL(paged|decode) LAYERS REPS [bf16] */
    void *h = dlopen(argv[1], RTLD_NOW);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    const int decode = !strcmp(argv[2], "decode"), layers = atoi(argv[3]), reps = atoi(argv[4]), bf16 = argc > 5 && atoi(argv[5]), threads = argc > 6 ? atoi(argv[6]) : 1;
    const int64_t S = 32, keys = 160, bs = 16, KV = 3, H = 9, D = 64, blocks = (keys + bs - 1) / bs, es = bf16 ? 2 : 4;
    const size_t cache_bytes = (size_t)S * blocks * bs * KV * D * es;
    char **kc = malloc(layers * sizeof(char *)), **vc = malloc(layers * sizeof(char *));
    srand(1);
    for (int l = 0; l < layers; l++) {
        kc[l] = alloc_cache(cache_bytes), vc[l] = alloc_cache(cache_bytes);
        for (size_t i = 0; i < cache_bytes / 2; i++) ((uint16_t *)kc[l])[i] = 0x3c00 + (rand() & 0x3ff), ((uint16_t *)vc[l])[i] = 0x3c00 + (rand() & 0x3ff);
        if (!bf16) for (size_t i = 0; i < cache_bytes / 4; i++) ((float *)kc[l])[i] = rand() / (float)RAND_MAX - 0.5f, ((float *)vc[l])[i] = rand() / (float)RAND_MAX - 0.5f;
    }
    int32_t *tables = malloc(S * blocks * 4), *starts = malloc(S * 4), *ones = malloc(S * 4), *lens = malloc(S * 4);
    int64_t *rows = malloc(S * 8);
    for (int64_t i = 0; i < S * blocks; i++) tables[i] = (int32_t)i;
    for (int64_t i = S * blocks - 1; i > 0; i--) { int64_t j = rand() % (i + 1); int32_t t = tables[i]; tables[i] = tables[j]; tables[j] = t; }
    for (int64_t b = 0; b < S; b++) starts[b] = b, ones[b] = 1, lens[b] = keys, rows[b] = b;
    const int64_t qs = (H + 2 * KV) * D;
    float *q = malloc(S * qs * 4), *out = malloc(S * H * D * 4);
    for (int64_t i = 0; i < S * qs; i++) q[i] = rand() / (float)RAND_MAX - 0.5f;
    pa_fn pa = (pa_fn)dlsym(h, "paged_attention");
    pd_fn pd = (pd_fn)dlsym(h, "paged_decode_attention");
    struct timespec t0, t1;
    clock_gettime(threads > 1 ? CLOCK_MONOTONIC : CLOCK_THREAD_CPUTIME_ID, &t0);
    for (int r = 0; r < reps; r++)
        for (int l = 0; l < layers; l++)
            if (decode) pd(bf16, q, qs, out, rows, kc[l], vc[l], tables, blocks, lens, S, H, KV, D, bs, 0.125f, threads);
            else pa(bf16, q, qs, out, starts, ones, lens, tables, blocks, S, kc[l], vc[l], H, KV, D, bs, 0.125f, threads);
    clock_gettime(threads > 1 ? CLOCK_MONOTONIC : CLOCK_THREAD_CPUTIME_ID, &t1);
    printf("%.1f us/call\n", ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / 1e3 / reps / layers);
    double sum = 0; for (int64_t i = 0; i < S * H * D; i++) sum += out[i];
    fprintf(stderr, "checksum %.6f\n", sum);
    return 0;
}
