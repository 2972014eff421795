/* bfloat16 <-> float for the native kernels (bf16 is the top half of a float),
 * and float16 -> float. */
#ifndef FOLIO_BF16_H
#define FOLIO_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffff) > 0x7f800000)  /* NaN: a quiet one, as torch gives */
        return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fff + ((bits >> 16) & 1);   /* round to nearest even, as torch does */
    return (uint16_t)(bits >> 16);
}

/* float16 bits as a float, exactly (scalar: no F16C needed). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f,
                   man = h & 0x3ff;
    uint32_t bits;
    float f;
    if (exp == 0x1f)                /* inf, nan */
        bits = sign | 0x7f800000 | man << 13;
    else if (exp)
        bits = sign | (exp + 112) << 23 | man << 13;
    else {                          /* zero or subnormal: man * 2^-24 */
        f = (float)man * 0x1p-24f;
        return sign ? -f : f;
    }
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round a float to the run dtype's precision (dtype 1: bf16; 0: fp32, as is). */
static inline float round_to(float f, int dtype) {
    return dtype ? bf16_to_float(float_to_bf16(f)) : f;
}

#endif
