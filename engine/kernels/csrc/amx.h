/* Whether this process may run AMX bfloat16 tiles, for the kernels that use them (amx_linear.c, and
 * cpu_kernels.c's paged attention): the CPU has AMX-BF16, AMX-TILE, AVX-512F and AVX512_BF16, and
 * Linux granted the tile data state, which it hands out on request only (arch_prctl
 * ARCH_REQ_XCOMP_PERM for XTILEDATA, once per process; oneDNN asks the same). The answer is cached:
 * it cannot change. AMX_COMPILED: the compiler can build tile code (each kernel then carries its own
 * target attributes, so every x86-64 build level, the prebuilt ones included, has it). */
#ifndef LLAMASERVE_AMX_H
#define LLAMASERVE_AMX_H

#if defined(__x86_64__) && (defined(__clang__) || __GNUC__ >= 11)
#define AMX_COMPILED 1
#include <cpuid.h>
#include <stdint.h>
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

static int amx_tiles_permitted(void) {
    static int state; /* 0: not asked yet, 1: granted, -1: refused */
    int s = __atomic_load_n(&state, __ATOMIC_RELAXED);
    if (s == 0) {
        s = amx_cpu_has_tiles() && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
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
static int amx_tiles_permitted(void) { return 0; }
#endif

#endif
