/* AVX-512 helpers shared by the native kernels (defines FOLIO_HAVE_AVX512
 * where the compiler targets it; the kernels keep a portable path otherwise). */
#ifndef FOLIO_SIMD_H
#define FOLIO_SIMD_H

#if defined(__AVX512F__)
#include <immintrin.h>
#include <stdint.h>
#define FOLIO_HAVE_AVX512 1

/* 16 values at base[index] as fp32. */
static inline __m512 load16(const void *base, int64_t index, int dtype) {
    if (dtype == 0) return _mm512_loadu_ps((const float *)base + index);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* e^x, about 2 ulp: x = n ln2 + r, a degree-6 polynomial in r, scaled by 2^n.
 * Below -87 the result is 0; above 88, infinity. */
static inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps((__mmask16)~tiny, _mm512_scalef_ps(p, n));
}

/* 16 floats stored in the run dtype (bf16: rounded to nearest even, as torch). */
static inline void store16(void *base, int64_t index, __m512 x, int dtype) {
    if (dtype == 0) {
        _mm512_storeu_ps((float *)base + index, x);
        return;
    }
    __m512i b = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    _mm256_storeu_si256((__m256i *)((uint16_t *)base + index),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)));
}

/* x rounded to the run dtype's precision, kept as fp32. */
static inline __m512 round16(__m512 x, int dtype) {
    if (dtype == 0) return x;
    __m512i b = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32((int)0xffff0000u)));
}
#endif

#endif
