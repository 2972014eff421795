/* The linear layer of fp8 (e4m3) weights, on CPUs with AVX2, FMA and F16C
 * (and in 512-bit registers on AVX-512 ones): out = x W^T (+ bias), x and out
 * fp32, W kept as its e4m3 codes, one byte a weight, with an fp32 scale per
 * output feature and block of BK input features (a compressed-tensors FP8
 * checkpoint's channel, tensor or 128x128 block scales; `--quantization
 * fp8`'s channel ones), widened to fp32 in registers.
 *
 * Decoding: a code's byte sign-extended to 16 bits and shifted left by 7 is
 * the float16 with the code's sign, its 4 exponent bits the low ones of the
 * float16's 5 and its 3 mantissa bits the top of the float16's 10, but for a
 * copy of the sign in the float16's top exponent bit, which an AND clears;
 * F16C widens that to fp32, subnormals included: the e4m3 value times 2^-8,
 * exactly. The 2^8 is folded into the scales at packing
 * (folio.kernels.native.pack_fp8_linear).
 *
 * Arithmetic, the same at every row count and in both builds (a row's output
 * does not depend on what else is in the step, nor on the CPU's vector
 * width): for each output, the products of a block of BK input features
 * summed in input order in fp32 (FMA), then the sum times the block's scale
 * added to the output's total (FMA; the first block's a product), block by
 * block.
 *
 * Packed layout: the output features in tiles of 16 (one zmm of fp32, two
 * ymm; the last tile padded with zero rows); codes [tiles][K][16] bytes, each
 * input feature's 16 codes side by side (a tile's codes one sequential
 * stream); scales [tiles][KB][16] fp32 (KB = ceil(K / BK) blocks).
 *
 * Work split: each thread a contiguous range of tiles, walked NT tiles at a
 * time, every row block of MR rows against them. With more rows than one
 * block, the tiles' codes are widened once into fp32 in scratch (the same
 * values the blocks widen) rather than again for every block of rows.
 */
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>

#define TW 16     /* output features a tile */
#define MR 4      /* rows of x per register block */

#if defined(__AVX512F__)
#define VL 16
#define NT 3      /* tiles per register block: 12 sums, 3 weights, 1 x of 32 zmm */
typedef __m512 vec;
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, v) _mm512_storeu_ps(p, v)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vbcast(p) _mm512_set1_ps(*(p))
/* 16 e4m3 codes -> 16 floats, each the code's value times 2^-8 */
static inline __attribute__((always_inline)) vec widen(const uint8_t *c) {
    const __m256i h = _mm256_and_si256(
        _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)c)), 7),
        _mm256_set1_epi16((short)0xbfff));
    return _mm512_cvtph_ps(h);
}
#else
#define VL 8
#define NT 1      /* one tile, two ymm: 8 sums, 2 weights, 1 x of 16 ymm */
typedef __m256 vec;
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vstore(p, v) _mm256_storeu_ps(p, v)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vbcast(p) _mm256_broadcast_ss(p)
/* 8 e4m3 codes -> 8 floats, each the code's value times 2^-8 */
static inline __attribute__((always_inline)) vec widen(const uint8_t *c) {
    const __m128i h = _mm_and_si128(
        _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)c)), 7),
        _mm_set1_epi16((short)0xbfff));
    return _mm256_cvtph_ps(h);
}
#endif
#define VPT (TW / VL)     /* vectors a tile */

/* Rows [0, mr) of x against nt tiles: codes at c (or, wf not NULL, the same
 * tiles widened), scales at s; the inputs block by block. */
static inline __attribute__((always_inline)) void block(
    const float *x, int64_t x_stride, const uint8_t *c, const float *wf, int64_t tile_stride,
    const float *s, int64_t scale_stride, int64_t k, int64_t bk, const float *bias, float *out,
    int64_t out_stride, int64_t col, int64_t n, const int mr, const int nt) {
    /* the totals, touched once a block: memory, so the sums keep the registers */
    float tot[MR][NT * TW] __attribute__((aligned(64)));
    for (int64_t k0 = 0, b = 0; k0 < k; k0 += bk, b++) {
        const int64_t k1 = k0 + bk < k ? k0 + bk : k;
        vec acc[MR][NT * VPT];
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
            for (int j = 0; j < nt * VPT; j++) acc[r][j] = vzero();
        for (int64_t i = k0; i < k1; i++) {
            vec wv[NT * VPT];
#pragma GCC unroll 3
            for (int j = 0; j < nt * VPT; j++) {
                const int64_t at = (j / VPT) * tile_stride + i * TW + (j % VPT) * VL;
                wv[j] = wf ? vload(wf + at) : widen(c + at);
            }
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) {
                const vec xv = vbcast(x + r * x_stride + i);
#pragma GCC unroll 3
                for (int j = 0; j < nt * VPT; j++) acc[r][j] = vfma(xv, wv[j], acc[r][j]);
            }
        }
#pragma GCC unroll 3
        for (int j = 0; j < nt * VPT; j++) {
            const vec sv = vload(s + (j / VPT) * scale_stride + b * TW + (j % VPT) * VL);
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) {
                float *t = tot[r] + j * VL;
                vstore(t, b ? vfma(acc[r][j], sv, vload(t)) : vmul(acc[r][j], sv));
            }
        }
    }
    for (int j = 0; j < nt * TW; j++) {
        const int64_t cc = col + j;
        if (cc >= n) break;
        const float add = bias ? bias[cc] : 0.0f;
        for (int r = 0; r < mr; r++) out[r * out_stride + cc] = tot[r][j] + add;
    }
}

/* Every row of x against nt tiles starting at codes c (column `col`). */
static void tile_group(const float *x, int64_t x_stride, const uint8_t *c, int64_t tile_stride,
                       const float *s, int64_t scale_stride, int64_t k, int64_t bk,
                       const float *bias, float *out, int64_t col, int64_t m, int64_t n, int nt,
                       float *scratch) {
    const float *wf = 0;
    if (scratch && m > MR) {
        for (int64_t i = 0; i < nt * tile_stride; i += VL) vstore(scratch + i, widen(c + i));
        wf = scratch;
    }
    for (int64_t r = 0; r < m; r += MR) {
        const int mr = m - r < MR ? (int)(m - r) : MR;
        const float *xr = x + r * x_stride;
        float *o = out + r * n;
        /* constant block shapes, so that the sums live in registers */
#define FOLIO_BLOCK(R, T)                                                                    \
    case R * 4 + T:                                                                          \
        block(xr, x_stride, c, wf, tile_stride, s, scale_stride, k, bk, bias, o, n, col, n, \
              R, T);                                                                         \
        break;
        switch (mr * 4 + nt) {
#if NT == 3
            FOLIO_BLOCK(1, 1) FOLIO_BLOCK(1, 2) FOLIO_BLOCK(1, 3)
            FOLIO_BLOCK(2, 1) FOLIO_BLOCK(2, 2) FOLIO_BLOCK(2, 3)
            FOLIO_BLOCK(3, 1) FOLIO_BLOCK(3, 2) FOLIO_BLOCK(3, 3)
            FOLIO_BLOCK(4, 1) FOLIO_BLOCK(4, 2) FOLIO_BLOCK(4, 3)
#else
            FOLIO_BLOCK(1, 1) FOLIO_BLOCK(2, 1) FOLIO_BLOCK(3, 1) FOLIO_BLOCK(4, 1)
#endif
        }
#undef FOLIO_BLOCK
    }
}

int folio_fp8_linear_available(void) { return 1; }

/* out [m][n] (contiguous) = x [m][k] (rows x_stride apart) @ W^T + bias;
 * codes and scales packed as described above (bk input features a scale
 * block); bias (fp32) may be NULL. Returns 1 if scratch memory could not
 * be had (out not written). */
int folio_fp8_linear(const float *x, int64_t x_stride, const uint8_t *codes, const float *scales,
                     int64_t bk, const float *bias, float *out, int64_t m, int64_t n, int64_t k,
                     int num_threads) {
    const int64_t tiles = (n + TW - 1) / TW, tile_stride = k * TW;
    const int64_t blocks = (k + bk - 1) / bk, scale_stride = blocks * TW;
    int threads = tiles < num_threads ? (int)tiles : num_threads;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        const int id = omp_get_thread_num(), count = omp_get_num_threads();
        const int64_t first = tiles * id / count, last = tiles * (id + 1) / count;
        float *scratch = m > MR ? (float *)malloc(sizeof(float) * NT * tile_stride) : 0;
        if (m > MR && !scratch) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t t = first; t < last && !(m > MR && !scratch); t += NT) {
            const int nt = last - t < NT ? (int)(last - t) : NT;
            tile_group(x, x_stride, codes + t * tile_stride, tile_stride,
                       scales + t * scale_stride, scale_stride, k, bk, bias, out, t * TW, m, n,
                       nt, scratch);
        }
        free(scratch);
    }
    return failed;
}

#else

/* Built without AVX2, FMA and F16C: the torch product of the dequantized
 * weights is used instead. */
int folio_fp8_linear_available(void) { return 0; }

int folio_fp8_linear(const float *x, int64_t x_stride, const uint8_t *codes, const float *scales,
                     int64_t bk, const float *bias, float *out, int64_t m, int64_t n, int64_t k,
                     int num_threads) {
    (void)x; (void)x_stride; (void)codes; (void)scales; (void)bk; (void)bias; (void)out;
    (void)m; (void)n; (void)k; (void)num_threads;
    return 1;
}

#endif
