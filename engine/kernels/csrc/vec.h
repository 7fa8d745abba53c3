/* What the C kernels in this folder share (engine/kernels/build.py digests every header into each
 * library's build key, so a change here rebuilds them all): bfloat16 <-> float32, 16-lane vector
 * types, rows of either element type as float32 (AVX-512 steps where the build has them), the
 * exp approximation, the parallel threshold, and the AMX tile setup.
 *
 * Element types: float32 (dtype code 0) and bfloat16 (code 1), computed in float32 and rounded to
 * the model dtype exactly where the torch path rounds (so bfloat16 results match it bit for bit
 * except for summation order). OpenMP: linked against the libgomp torch already loaded, and run
 * with the caller's thread count, so it shares the engine thread's team. */
#ifndef LLAMASERVE_VEC_H
#define LLAMASERVE_VEC_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------ bfloat16 */
typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline bf16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((v.u >> 16) | 0x40u); /* quiet NaN */
    return (bf16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* ------------------------------------------------------------------------------------------ 16-lane vectors
 * GCC vector extensions: the same code vectorizes at every build level (v16f is one zmm on AVX-512,
 * two ymm on AVX2). */
typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

/* ------------------------------------------------------------------------------------------ native vectors
 * The build's own vector width (16 lanes AVX-512, 8 AVX, 4 SSE): v16f is two registers on AVX2, and
 * GCC moves its halves through the stack in register-blocked loops (measured 10x slower in the
 * one-row linear and the LoRA kernel: bench/NOTES.md 'AVX2 one-row linear'). Kernels that block
 * their accumulators in registers (gemm.c, lora.c, attention.c) spell them in nvf. */
#if defined(LLAMASERVE_NV_LANES)
/* a test build's width (-DLLAMASERVE_NV_LANES=16 on x86-64-v3): the 16-lane generic code of the
 * AVX-512 builds runs as pairs of ymm on a CPU without AVX-512 (tests/engine/kernel_levels.py) */
#if LLAMASERVE_NV_LANES == 4 || LLAMASERVE_NV_LANES == 8 || LLAMASERVE_NV_LANES == 16
#define NV_LANES LLAMASERVE_NV_LANES
#else
#error "LLAMASERVE_NV_LANES must be 4, 8 or 16"
#endif
#elif defined(__AVX512F__)
#define NV_LANES 16
#elif defined(__AVX__)
#define NV_LANES 8
#else
#define NV_LANES 4
#endif
typedef float nvf __attribute__((vector_size(NV_LANES * 4)));
typedef uint16_t nvh __attribute__((vector_size(NV_LANES * 2)));
typedef uint32_t nvu __attribute__((vector_size(NV_LANES * 4)));
typedef int32_t nvi __attribute__((vector_size(NV_LANES * 4)));
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline __attribute__((always_inline)) nvf nv_loadf(const float *p) {
    nvf v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline __attribute__((always_inline)) void nv_storef(float *p, nvf v) { memcpy(p, &v, sizeof(v)); }

/* NV_LANES weights from element `index` of w: float32, or bfloat16 widened exactly to float32 (the
 * high half of the float's bits). Callers pass bf16 as a literal per instantiation, so the test folds. */
static inline __attribute__((always_inline)) nvf nv_load_weight(const void *w, int64_t index, int bf16) {
#if NV_LANES == 8 && defined(__AVX2__)
    /* GCC builds __builtin_convertvector's 8-lane widening from two 128-bit halves (two zero-extends,
     * a byte shift and an insert, 5 ops with the shift, against 2 here: vpmovzxwd from memory and
     * vpslld; bfloat16 weights cold, gemm.c at 32 rows 1.19-1.31x: bench/NOTES.md 'AVX2 many-rows
     * linear, part 2') */
    if (bf16)
        return (nvf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + index))), 16);
#elif NV_LANES == 16 && defined(__AVX512F__)
    /* the same at 16 lanes: GCC's widening was two 8-lane zero-extends and an insert */
    if (bf16)
        return (nvf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + index))), 16);
#endif
    if (bf16) {
        nvh h;
        memcpy(&h, (const uint16_t *)w + index, sizeof(h));
        const nvu u = __builtin_convertvector(h, nvu) << 16;
        nvf f;
        memcpy(&f, &u, sizeof(f));
        return f;
    }
    return nv_loadf((const float *)w + index);
}

/* ------------------------------------------------------------------------------------------ rows
 * AVX-512 rows of 16 (the v4 and v4-bf16 builds, -march=native on such CPUs): GCC's vectorizer stops
 * at 256 bits there and emulates bfloat16 rounding in ~8 integer ops a vector; these take 512-bit
 * steps with masked tails and, on AVX512_BF16, round with vcvtneps2bf16 (load_row and store_row
 * here, the elementwise kernels in elementwise.c). Other builds keep the portable loops; both give
 * the same bits (f32_to_bf16's round to nearest even). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define HAVE_AVX512_ROWS 1
#include <immintrin.h>

static inline __mmask16 row_mask(int64_t left) { /* the first `left` of 16 lanes (none for left <= 0) */
    return left >= 16 ? (__mmask16)0xffff : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
}

/* bfloat16 lane i to the high half of 32-bit lane i in one word permute (zero-extend and shift take two ops) */
static inline __m512 bf16x16_to_f32(__m256i v) {
    const __m512i idx = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7, 0, 6, 0, 5, 0, 4, 0, 3,
                                         0, 2, 0, 1, 0, 0, 0);
    return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, idx, _mm512_castsi256_si512(v)));
}

static inline __m512 bf16x16_load(const bf16_t *p, __mmask16 m) { return bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, p)); }

static inline __m256i bf16x16_round_soft(__m512 x) { /* f32_to_bf16 on 16 lanes */
    const __m512i u = _mm512_castps_si512(x), high = _mm512_srli_epi32(u, 16);
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(high, _mm512_set1_epi32(1)));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), high, _mm512_set1_epi32(0x40)); /* quiet NaN */
    return _mm512_cvtepi32_epi16(r);
}

/* vcvtneps2bf16 rounds as f32_to_bf16 does (NaNs quieted alike) but flushes denormal inputs to zero:
 * a vector holding one (fpclass 0x20) takes the integer path instead. */
#define DENORMAL 0x20

static inline __m256i bf16x16_round(__m512 x) {
#ifdef __AVX512BF16__
    if (__builtin_expect(_mm512_fpclass_ps_mask(x, DENORMAL) == 0, 1)) return (__m256i)_mm512_cvtneps_pbh(x);
#endif
    return bf16x16_round_soft(x);
}

#elif defined(__AVX2__)
/* AVX2 rows of 8 (the v3 build, -march=native on Zen 2): GCC's portable loops narrowed every lane to
 * 16 bits and widened it back around f32_to_bf16; these convert 8 lanes in 32-bit lanes (the same
 * bits: f32_to_bf16's round to nearest even, a NaN quieted alike). One thread, 512 rows, the demo's
 * bfloat16 RoPE + cache write 189 -> 160 us, silu_mul 706 -> 682 us (bench/NOTES.md 'bfloat16
 * prefill on AVX2'); elementwise.c's norm rows and quant_kernels.c's dequantizer use them too. */
#define HAVE_AVX2_ROWS 1

static inline __m256 bf16x8_load(const bf16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline __m256 bf16x8_round(__m256 x) { /* the value bfloat16 stores, in 32-bit lanes: the rounded bits' high half, a NaN quieted */
    const __m256i u = _mm256_castps_si256(x), high = _mm256_set1_epi32((int)0xffff0000u);
    const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, bias), high);
    const __m256i nan = _mm256_or_si256(_mm256_and_si256(u, high), _mm256_set1_epi32(0x00400000));
    return _mm256_castsi256_ps(_mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q))));
}

static inline void bf16x8_store(bf16_t *p, __m256 rounded) { /* rounded: bf16x8_round's (low halves zero) */
    const __m256i h = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08)));
}
#endif

/* A prefill step's elementwise kernels mostly read a linear's fresh output, which oneDNN leaves
 * outside the caches (Zen 4: 3 MB of it copied at ~12 GB/s, 4-5x a hot copy's time): they stream each
 * input with a software prefetch this many elements ahead (p a typed pointer: 4 KiB of bfloat16, 8
 * KiB of float32, the distance that paid on both), more misses in flight than the hardware
 * prefetcher keeps. silu_mul after the w13 linear, demo model, 512 rows, 1 thread: bfloat16 ~520 ->
 * ~300 us, float32 ~580 -> ~510 (bench/NOTES.md 'Elementwise kernels on Zen 4'). A prefetch past the
 * end of a buffer is harmless: it never faults. */
#define STREAM_PREFETCH_ELEMS 2048
#define stream_prefetch(p) __builtin_prefetch((p) + STREAM_PREFETCH_ELEMS, 0, 3)

static inline void load_row(float *dst, const void *src, int64_t n, int bf16) {
    if (bf16) {
        const bf16_t *s = (const bf16_t *)src;
#ifdef HAVE_AVX512_ROWS
        for (int64_t i = 0; i < n; i += 16) _mm512_mask_storeu_ps(dst + i, row_mask(n - i), bf16x16_load(s + i, row_mask(n - i)));
#elif defined(HAVE_AVX2_ROWS)
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, bf16x8_load(s + i));
        for (; i < n; i++) dst[i] = bf16_to_f32(s[i]);
#else
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
#endif
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

static inline void store_row(void *dst, const float *src, int64_t n, int bf16) {
    if (bf16) {
        bf16_t *d = (bf16_t *)dst;
#ifdef HAVE_AVX512_ROWS
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 m = row_mask(n - i);
            _mm256_mask_storeu_epi16(d + i, m, bf16x16_round(_mm512_maskz_loadu_ps(m, src + i)));
        }
#elif defined(HAVE_AVX2_ROWS)
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) bf16x8_store(d + i, bf16x8_round(_mm256_loadu_ps(src + i)));
        for (; i < n; i++) d[i] = f32_to_bf16(src[i]);
#else
#pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
#endif
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

static inline size_t elem_size(int bf16) { return bf16 ? 2 : 4; }

/* ------------------------------------------------------------------------------------------ exp
 * Cephes' exp2f polynomial: 2^f for f in [-0.5, 0.5], highest power first. exp_approx and its
 * 16-lane forms (silu16, pa_amx_exp) evaluate it as the same chain of FMAs: the same bits. */
#define EXP2_C6 1.535336188319500e-4f
#define EXP2_C5 1.339887440266574e-3f
#define EXP2_C4 9.618437357674640e-3f
#define EXP2_C3 5.550332471162809e-2f
#define EXP2_C2 2.402264791363012e-1f
#define EXP2_C1 6.931472028550421e-1f
#define EXP2_C0 1.0f

/* exp(x) to ~1e-7 relative error: 2^k * 2^f with the polynomial above for f in [-0.5, 0.5].
 * Plain arithmetic so loops over it vectorize (expf calls would not, without -ffast-math). */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float t = x * 1.44269504088896341f;
    float k = __builtin_rintf(t); /* to nearest (vectorizes as a round instruction) */
    float f = t - k;
    float p = EXP2_C6;
    p = p * f + EXP2_C5;
    p = p * f + EXP2_C4;
    p = p * f + EXP2_C3;
    p = p * f + EXP2_C2;
    p = p * f + EXP2_C1;
    p = p * f + EXP2_C0;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)k + 127) << 23;
    return p * scale.f;
}

/* exp_approx's polynomial on 16 lanes of f (an __m512). A macro, not a function: its users carry
 * different target attributes (the AVX-512 build's silu16, the AMX attention at every level). */
#define EXP2_POLY16(f)                                                                 \
    ({                                                                                 \
        const __m512 f_ = (f);                                                         \
        __m512 p_ = _mm512_fmadd_ps(_mm512_set1_ps(EXP2_C6), f_, _mm512_set1_ps(EXP2_C5)); \
        p_ = _mm512_fmadd_ps(p_, f_, _mm512_set1_ps(EXP2_C4));                         \
        p_ = _mm512_fmadd_ps(p_, f_, _mm512_set1_ps(EXP2_C3));                         \
        p_ = _mm512_fmadd_ps(p_, f_, _mm512_set1_ps(EXP2_C2));                         \
        p_ = _mm512_fmadd_ps(p_, f_, _mm512_set1_ps(EXP2_C1));                         \
        _mm512_fmadd_ps(p_, f_, _mm512_set1_ps(EXP2_C0));                              \
    })

/* Row tile t of `tiles` balanced ones over `rows`: its first row (the larger tiles first; the
 * register-blocked linears, gemm.c and linear.c's pairs gemm). */
static inline int64_t tile_start(int64_t t, int64_t rows, int64_t tiles) {
    const int64_t base = rows / tiles, extra = rows % tiles;
    return t * base + (t < extra ? t : extra);
}

/* Work below this many elements runs on the calling thread: a parallel region's fork and join
 * costs more than the work saves. */
#define PARALLEL_MIN_ELEMS 65536

/* ------------------------------------------------------------------------------------------ allocation
 * A kernel that allocates scratch returns KERNEL_OK, or KERNEL_NO_MEMORY when an allocation failed
 * (its output is then undefined): the bindings raise MemoryError and the engine fails that step's
 * requests, where a NULL used unchecked would take the server down. Every allocation goes through
 * kernel_malloc / kernel_calloc / kernel_aligned_alloc, so a test can make them fail from a chosen
 * one on (llamaserve_fail_allocs_after, exported by every library that includes this; inert until
 * called). The counter is one per library: weak definitions merge across its sources, and hidden
 * visibility keeps each library's own. */
#define KERNEL_OK 0
#define KERNEL_NO_MEMORY (-12) /* -ENOMEM; apart from amx_linear_bf16's -1 (arguments refused) */
#define KERNEL_ALLOCS_UNLIMITED INT64_MAX

__attribute__((weak, visibility("hidden"))) int64_t kernel_allocs_left = KERNEL_ALLOCS_UNLIMITED;

/* Test hook: the next n allocations succeed and every one after fails; n < 0: none fails (the default). */
__attribute__((weak)) void llamaserve_fail_allocs_after(int64_t n) {
    __atomic_store_n(&kernel_allocs_left, n < 0 ? KERNEL_ALLOCS_UNLIMITED : n, __ATOMIC_RELAXED);
}

static inline int kernel_alloc_allowed(void) {
    if (__builtin_expect(__atomic_load_n(&kernel_allocs_left, __ATOMIC_RELAXED) == KERNEL_ALLOCS_UNLIMITED, 1)) return 1;
    return __atomic_fetch_sub(&kernel_allocs_left, 1, __ATOMIC_RELAXED) > 0;
}

static inline void *kernel_malloc(size_t bytes) { return kernel_alloc_allowed() ? malloc(bytes) : NULL; }

static inline void *kernel_calloc(size_t count, size_t size) { return kernel_alloc_allowed() ? calloc(count, size) : NULL; }

static inline void *kernel_aligned_alloc(size_t alignment, size_t bytes) {
    return kernel_alloc_allowed() ? aligned_alloc(alignment, bytes) : NULL;
}

/* ------------------------------------------------------------------------------------------ AMX tiles
 * Whether this process may run AMX bfloat16 tiles, for the kernels that use them (amx_linear.c, and
 * attention.c's paged attention): the CPU has AMX-BF16, AMX-TILE, AVX-512F and AVX512_BF16, and
 * Linux granted the tile data state, which it hands out on request only (arch_prctl
 * ARCH_REQ_XCOMP_PERM for XTILEDATA, once per process; oneDNN asks the same), and ONEDNN_MAX_CPU_ISA
 * does not cap the process below AMX (amx_capped_off). The answer is cached:
 * it cannot change. AMX_COMPILED: the compiler can build tile code (each kernel then carries its own
 * target attributes, so every x86-64 build level, the prebuilt ones included, has it). */
#if defined(__x86_64__) && (defined(__clang__) || __GNUC__ >= 11)
#define AMX_COMPILED 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

static int amx_cpu_has_tiles(void) {
    unsigned a, b, c, d;
    if (__get_cpuid_max(0, 0) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    const int amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1, avx512f = (b >> 16) & 1;
    __cpuid_count(7, 1, a, b, c, d);
    const int avx512_bf16 = (a >> 5) & 1;
    return amx_bf16 && amx_tile && avx512f && avx512_bf16;
}

/* Whether ONEDNN_MAX_CPU_ISA, oneDNN's cap on the instructions it uses, leaves the tiles out: any
 * value but ALL/DEFAULT that names no AMX level (AVX2, AVX512_CORE_BF16, ...). The kernels follow
 * the cap as oneDNN does, so one variable holds a whole process to a CPU without tiles. */
static int amx_capped_off(void) {
    const char *cap = getenv("ONEDNN_MAX_CPU_ISA");
    if (!cap || !*cap) return 0;
    char upper[64];
    size_t i = 0;
    for (; cap[i] && i + 1 < sizeof upper; i++) upper[i] = (char)(cap[i] >= 'a' && cap[i] <= 'z' ? cap[i] - 32 : cap[i]);
    upper[i] = 0;
    return strcmp(upper, "ALL") != 0 && strcmp(upper, "DEFAULT") != 0 && !strstr(upper, "AMX");
}

static __attribute__((unused)) int amx_tiles_permitted(void) {
    static int state; /* 0: not asked yet, 1: granted, -1: refused */
    int s = __atomic_load_n(&state, __ATOMIC_RELAXED);
    if (s == 0) {
        s = amx_cpu_has_tiles() && !amx_capped_off() && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELAXED);
    }
    return s > 0;
}

/* The instruction sets tile code compiles for, around it: AMX_TARGET_BEGIN ... AMX_TARGET_END. */
#define AMX_TARGET_BEGIN \
    _Pragma("GCC push_options") _Pragma("GCC target(\"amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16\")")
#define AMX_TARGET_END _Pragma("GCC pop_options")

/* ldtilecfg's operand, palette 1: each tile's bytes per row and rows */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) AmxTileConfig;
#else
static __attribute__((unused)) int amx_tiles_permitted(void) { return 0; }
#endif

#endif
