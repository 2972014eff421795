/* Vector helpers shared by the native kernels, one width a build:
 * - AVX-512 (FOLIO_HAVE_AVX512): 16 floats a vector;
 * - AVX2 + FMA (and F16C, which every such CPU has) without AVX-512: 8 floats
 *   a vector.
 * Either defines FOLIO_HAVE_VEC, FOLIO_VW (floats a vector), the vector type
 * fvec, a mask of the first n lanes (fmask) and the operations below; the
 * kernels keep a portable path for a build with neither. */
#ifndef FOLIO_SIMD_H
#define FOLIO_SIMD_H

#include <float.h>
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define FOLIO_HAVE_AVX512 1
#define FOLIO_HAVE_VEC 1
#define FOLIO_VW 16
typedef __m512 fvec;
typedef __mmask16 fmask;

#define fv_zero() _mm512_setzero_ps()
#define fv_set1(x) _mm512_set1_ps(x)
#define fv_fma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define fv_add(a, b) _mm512_add_ps(a, b)
#define fv_sub(a, b) _mm512_sub_ps(a, b)
#define fv_mul(a, b) _mm512_mul_ps(a, b)
#define fv_div(a, b) _mm512_div_ps(a, b)
#define fv_max(a, b) _mm512_max_ps(a, b)
#define fv_loadu(p) _mm512_loadu_ps(p)
#define fv_storeu(p, v) _mm512_storeu_ps(p, v)
#define fv_hmax(v) _mm512_reduce_max_ps(v)
#define fv_hadd(v) _mm512_reduce_add_ps(v)

/* The first n lanes (n >= VW: all). */
static inline fmask fv_first(int64_t n) {
    return n >= 16 ? (fmask)0xffff : (fmask)((1u << n) - 1);
}
static inline fvec fv_load_n(const float *p, fmask m) { return _mm512_maskz_loadu_ps(m, p); }
static inline void fv_store_n(float *p, fmask m, fvec v) { _mm512_mask_storeu_ps(p, m, v); }
/* max(acc, x) in the lanes of m, acc elsewhere. */
static inline fvec fv_max_n(fvec acc, fmask m, fvec x) { return _mm512_mask_max_ps(acc, m, acc, x); }
/* v in the lanes of m, 0 elsewhere. */
static inline fvec fv_keep(fmask m, fvec v) { return _mm512_maskz_mov_ps(m, v); }
/* The lowest lane where a == b, or -1. */
static inline int fv_first_eq(fvec a, fvec b) {
    __mmask16 hit = _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ);
    return hit ? __builtin_ctz(hit) : -1;
}

/* VW values at base[index] as fp32 (dtype 0 float32, 1 bfloat16, 2 int8, 3 fp8
 * e4m3 and 4 fp8 e5m2: the 8-bit KV caches' steps, their row scale not applied). An
 * e4m3's bits move into a float16's (its 4 exponent bits the low ones of
 * fp16's 5, its 3 mantissa bits the top of fp16's 10), which the hardware
 * widens, subnormals included: that is the e4m3 value times 2^-8, which
 * FOLIO_FP8_LOAD_SCALE gives back (the kernels fold it into the row's
 * scale). */
#define FOLIO_FP8_LOAD_SCALE 256.0f
static inline fvec fv_load(const void *base, int64_t index, int dtype) {
    if (dtype == 0) return _mm512_loadu_ps((const float *)base + index);
    if (dtype == 2)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)((const int8_t *)base + index))));
    if (dtype == 3) {
        const __m256i b = _mm256_cvtepu8_epi16(
            _mm_loadu_si128((const __m128i *)((const uint8_t *)base + index)));
        const __m256i h = _mm256_or_si256(
            _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7),
            _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
        return _mm512_cvtph_ps(h);
    }
    if (dtype == 4)             /* fp8 e5m2: the top byte of a float16, exactly */
        return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(
            _mm_loadu_si128((const __m128i *)((const uint8_t *)base + index))), 8));
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* fv_exp's width-specific parts: n rounded to the nearest integer; p * 2^n;
 * y where x >= lo, 0 below. */
static inline fvec fv_round_int(fvec x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline fvec fv_times_2n(fvec p, fvec n) { return _mm512_scalef_ps(p, n); }
static inline fvec fv_zero_below(fvec y, fvec x, fvec lo) {
    return _mm512_maskz_mov_ps((__mmask16)~_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), y);
}
#define fv_min(a, b) _mm512_min_ps(a, b)
#define fv_fnma(a, b, c) _mm512_fnmadd_ps(a, b, c)

/* fp32 bits rounded to bf16 (nearest even, as torch) in the high halves. */
static inline __m512i fv_bf16_bits(fvec x) {
    __m512i b = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
}

/* VW floats stored in the run dtype (bf16: rounded to nearest even, as torch). */
static inline void fv_store(void *base, int64_t index, fvec x, int dtype) {
    if (dtype == 0) {
        _mm512_storeu_ps((float *)base + index, x);
        return;
    }
    _mm256_storeu_si256((__m256i *)((uint16_t *)base + index),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(fv_bf16_bits(x), 16)));
}

/* x rounded to the run dtype's precision, kept as fp32. */
static inline fvec fv_round(fvec x, int dtype) {
    if (dtype == 0) return x;
    return _mm512_castsi512_ps(_mm512_and_si512(fv_bf16_bits(x),
                                                _mm512_set1_epi32((int)0xffff0000u)));
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define FOLIO_HAVE_VEC 1
#define FOLIO_VW 8
typedef __m256 fvec;
typedef __m256i fmask;          /* all ones in a lane that takes part */

#define fv_zero() _mm256_setzero_ps()
#define fv_set1(x) _mm256_set1_ps(x)
#define fv_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define fv_add(a, b) _mm256_add_ps(a, b)
#define fv_sub(a, b) _mm256_sub_ps(a, b)
#define fv_mul(a, b) _mm256_mul_ps(a, b)
#define fv_div(a, b) _mm256_div_ps(a, b)
#define fv_max(a, b) _mm256_max_ps(a, b)
#define fv_loadu(p) _mm256_loadu_ps(p)
#define fv_storeu(p, v) _mm256_storeu_ps(p, v)

static inline float fv_hmax(fvec v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float fv_hadd(fvec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline fmask fv_first(int64_t n) {
    const int k = n >= 8 ? 8 : (int)n;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline fvec fv_load_n(const float *p, fmask m) { return _mm256_maskload_ps(p, m); }
static inline void fv_store_n(float *p, fmask m, fvec v) { _mm256_maskstore_ps(p, m, v); }
static inline fvec fv_max_n(fvec acc, fmask m, fvec x) {
    return _mm256_blendv_ps(acc, _mm256_max_ps(acc, x), _mm256_castsi256_ps(m));
}
static inline fvec fv_keep(fmask m, fvec v) { return _mm256_and_ps(_mm256_castsi256_ps(m), v); }
static inline int fv_first_eq(fvec a, fvec b) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ));
    return hit ? __builtin_ctz((unsigned)hit) : -1;
}

#define FOLIO_FP8_LOAD_SCALE 256.0f     /* fv_load's fp8 values are 2^-8 of theirs */
static inline fvec fv_load(const void *base, int64_t index, int dtype) {
    if (dtype == 0) return _mm256_loadu_ps((const float *)base + index);
    if (dtype == 2)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64((const __m128i *)((const int8_t *)base + index))));
    if (dtype == 3) {           /* as the AVX-512 path (F16C's widening) */
        const __m128i b = _mm_cvtepu8_epi16(
            _mm_loadl_epi64((const __m128i *)((const uint8_t *)base + index)));
        const __m128i h = _mm_or_si128(
            _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7),
            _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
        return _mm256_cvtph_ps(h);
    }
    if (dtype == 4)             /* fp8 e5m2: the top byte of a float16, exactly */
        return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(
            _mm_loadl_epi64((const __m128i *)((const uint8_t *)base + index))), 8));
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + index));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline fvec fv_round_int(fvec x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* n in [-126, 127] (fv_exp's range): 2^n is a normal float, exponent bits n + 127 */
static inline fvec fv_times_2n(fvec p, fvec n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
static inline fvec fv_zero_below(fvec y, fvec x, fvec lo) {
    return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), y);
}
#define fv_min(a, b) _mm256_min_ps(a, b)
#define fv_fnma(a, b, c) _mm256_fnmadd_ps(a, b, c)

static inline __m256i fv_bf16_bits(fvec x) {
    __m256i b = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
}

static inline void fv_store(void *base, int64_t index, fvec x, int dtype) {
    if (dtype == 0) {
        _mm256_storeu_ps((float *)base + index, x);
        return;
    }
    __m256i h = _mm256_srli_epi32(fv_bf16_bits(x), 16);           /* 8 x u32 < 2^16 */
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    _mm_storeu_si128((__m128i *)((uint16_t *)base + index), packed);
}

static inline fvec fv_round(fvec x, int dtype) {
    if (dtype == 0) return x;
    return _mm256_castsi256_ps(_mm256_and_si256(fv_bf16_bits(x),
                                                _mm256_set1_epi32((int)0xffff0000u)));
}
#endif

#ifdef FOLIO_HAVE_VEC
/* e^x, about 2 ulp: x = n ln2 + r, a degree-6 polynomial in r, scaled by 2^n.
 * Below -87 the result is 0; above 88 it is e^88 (1.65e38), not infinity: the
 * kernels build with -ffast-math, under which x / (1 + inf) came out NaN. */
static inline fvec fv_exp(fvec x) {
    const fvec lo = fv_set1(-87.0f);
    const fvec c = fv_min(fv_max(x, lo), fv_set1(88.0f));
    const fvec n = fv_round_int(fv_mul(c, fv_set1(1.44269504088896341f)));
    fvec r = fv_fnma(n, fv_set1(0.693359375f), c);
    r = fv_fnma(n, fv_set1(-2.12194440e-4f), r);
    fvec p = fv_set1(1.0f / 720);
    p = fv_fma(p, r, fv_set1(1.0f / 120));
    p = fv_fma(p, r, fv_set1(1.0f / 24));
    p = fv_fma(p, r, fv_set1(1.0f / 6));
    p = fv_fma(p, r, fv_set1(0.5f));
    p = fv_fma(p, r, fv_set1(1.0f));
    p = fv_fma(p, r, fv_set1(1.0f));
    return fv_zero_below(fv_times_2n(p, n), x, lo);
}
#endif

#endif
