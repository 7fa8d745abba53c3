/* The read rate of a decode attention's access pattern with no maths (bench/NOTES.md 'Decode
 * attention from L2 prefetches'): blocks of BLOCK_BYTES in shuffled order, all of a layer's K
 * blocks then its V blocks (as paged_decode_attention streams one task), LAYERS layers' caches in
 * turn (cold, on huge pages), each line read with two 32-byte loads, and a software prefetch DIST
 * lines ahead in that stream (0: the hardware prefetchers alone) with HINT 0 (prefetcht0), 1
 * (prefetcht1) or 2 (prefetchnta). One thread, thread CPU time, best of 5.
 *
 *   gcc -O2 -march=native bench/shuffled_read.c -o /tmp/shuffled_read
 *   /tmp/shuffled_read BLOCK_BYTES BLOCKS LAYERS DIST HINT    # e.g. 12288 256 30 128 1: float32 1 x 4096 keys of the demo
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

static char *huge_alloc(size_t bytes) {
    void *p;
    const size_t rounded = (bytes + (2 << 20) - 1) / (2 << 20) * (2 << 20);
    if (posix_memalign(&p, 2 << 20, rounded)) return NULL;
    madvise(p, rounded, MADV_HUGEPAGE);
    return p;
}

static double thread_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s BLOCK_BYTES BLOCKS LAYERS DIST HINT\n", argv[0]);
        return 2;
    }
    const size_t block_bytes = strtoul(argv[1], NULL, 10);
    const int blocks = atoi(argv[2]), layers = atoi(argv[3]), dist = atoi(argv[4]), hint = atoi(argv[5]);
    const size_t cache_bytes = block_bytes * blocks;
    char **caches = malloc(2 * layers * sizeof(char *));
    for (int c = 0; c < 2 * layers; c++) {
        if (!(caches[c] = huge_alloc(cache_bytes))) return 1;
        for (size_t i = 0; i < cache_bytes; i += 4) *(float *)(caches[c] + i) = 1.0f;
    }
    int *order = malloc(blocks * sizeof(int));
    for (int i = 0; i < blocks; i++) order[i] = i;
    srand(1);
    for (int i = blocks - 1; i > 0; i--) {
        const int j = rand() % (i + 1), t = order[i];
        order[i] = order[j], order[j] = t;
    }
    const int lines = (int)(block_bytes / 64), passes = 2 * blocks;
    double best = 1e30;
    __m256 sum = _mm256_setzero_ps();
    for (int round = 0; round < 5; round++) {
        const double start = thread_us();
        for (int l = 0; l < layers; l++) {
            char *k = caches[2 * l], *v = caches[2 * l + 1];
#define PASS(i) (((i) < blocks ? k : v) + (size_t)order[(i) % blocks] * block_bytes)
            int ahead_pass = dist / lines, ahead_line = dist % lines; /* the prefetch's place in the stream */
            __m256 a0 = sum, a1 = _mm256_setzero_ps();
            for (int i = 0; i < passes; i++) {
                const char *block = PASS(i);
                for (int j = 0; j < lines; j++) {
                    if (dist && ahead_pass < passes) {
                        const char *p = PASS(ahead_pass) + ahead_line * 64;
                        if (hint == 0) _mm_prefetch(p, _MM_HINT_T0);
                        else if (hint == 1) _mm_prefetch(p, _MM_HINT_T1);
                        else _mm_prefetch(p, _MM_HINT_NTA);
                        if (++ahead_line == lines) ahead_line = 0, ahead_pass++;
                    }
                    a0 = _mm256_add_ps(a0, _mm256_load_ps((const float *)(block + j * 64)));
                    a1 = _mm256_add_ps(a1, _mm256_load_ps((const float *)(block + j * 64 + 32)));
                }
            }
#undef PASS
            sum = _mm256_add_ps(a0, a1);
        }
        const double us = (thread_us() - start) / layers;
        best = us < best ? us : best;
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, sum);
    printf("block %zu B, prefetch %d lines ahead, hint %d: %.1f us a layer, %.2f GB/s (checksum %g)\n", block_bytes, dist,
           hint, best, 2.0 * cache_bytes / best / 1e3, lanes[0]);
    return 0;
}
