/* bfloat16 <-> float32, shared by the C kernels in this folder (engine.kernels.cpu._build_key
 * hashes this header too, so a change here rebuilds them). */
#ifndef LLAMASERVE_BF16_H
#define LLAMASERVE_BF16_H
#include <stdint.h>

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
#endif
