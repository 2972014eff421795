/* The linear layer of fp8 (e4m3) weights, on CPUs with AVX2, FMA and F16C
 * (every AVX-512 one too): out = x W^T (+ bias), x and out fp32, W kept as
 * its e4m3 codes, one byte a weight, with an fp32 scale per output feature
 * and block of BK input features (a compressed-tensors FP8 checkpoint's
 * channel, tensor or 128x128 block scales; `--quantization fp8`'s channel
 * ones), widened to fp32 in registers.
 *
 * Decoding: an e4m3 byte's 4 exponent and 3 mantissa bits move into a
 * float16's (the low 4 of its 5 exponent bits, the top 3 of its 10 mantissa
 * bits) and its sign into the float16's, which F16C widens to fp32,
 * subnormals included: the e4m3 value times 2^-8, exactly. The 2^8 is folded
 * into the scales at packing (folio.kernels.native.pack_fp8_linear).
 *
 * Arithmetic, the same at every row count (a row's output does not depend
 * on what else is in the step): for each output, the products of a block of
 * BK input features summed in input order in fp32 (FMA), then the sum times
 * the block's scale added to the output's total (FMA), block by block.
 *
 * Packed layout: the output features in tiles of 8 (one ymm of fp32; the
 * last tile padded with zero rows); codes [tiles][K][8] bytes, each input
 * feature's 8 codes side by side (one 8-byte load widens to one FMA operand,
 * a tile's codes one sequential stream); scales [tiles][KB][8] fp32 (KB =
 * ceil(K / BK) blocks).
 *
 * Work split as in linear_avx2.c: each thread a contiguous range of tiles,
 * walked NT tiles at a time, every row block of MR rows against them. With
 * more rows than one block, the tiles' codes are widened once into fp32 in
 * scratch (exactly: the same values the blocks widen) rather than again for
 * every block of rows.
 */
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>

#define MR 4      /* rows of x per register block */
#define NT 2      /* tiles of 8 output features per register block */

/* 8 e4m3 codes -> 8 floats, each the code's value times 2^-8 */
static inline __attribute__((always_inline)) __m256 widen8(const uint8_t *c) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)c));
    const __m128i h = _mm_or_si128(
        _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(0x3f80)),
        _mm_and_si128(_mm_slli_epi16(b, 8), _mm_set1_epi16((short)0x8000)));
    return _mm256_cvtph_ps(h);
}

/* Rows [0, mr) of x against nt tiles: codes at c (or, wf not NULL, the same
 * tiles widened), scales at s; k0..k1 block by block. */
static inline __attribute__((always_inline)) void block(
    const float *x, int64_t x_stride, const uint8_t *c, const float *wf, int64_t tile_stride,
    const float *s, int64_t scale_stride, int64_t k, int64_t bk, const float *bias, float *out,
    int64_t out_stride, int64_t col, int64_t n, const int mr, const int nt) {
    __m256 tot[MR][NT];
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 2
        for (int j = 0; j < nt; j++) tot[r][j] = _mm256_setzero_ps();
    for (int64_t k0 = 0, b = 0; k0 < k; k0 += bk, b++) {
        const int64_t k1 = k0 + bk < k ? k0 + bk : k;
        __m256 acc[MR][NT];
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++)
#pragma GCC unroll 2
            for (int j = 0; j < nt; j++) acc[r][j] = _mm256_setzero_ps();
        for (int64_t i = k0; i < k1; i++) {
            __m256 wv[NT];
#pragma GCC unroll 2
            for (int j = 0; j < nt; j++)
                wv[j] = wf ? _mm256_loadu_ps(wf + j * tile_stride + i * 8)
                           : widen8(c + j * tile_stride + i * 8);
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) {
                const __m256 xv = _mm256_broadcast_ss(x + r * x_stride + i);
#pragma GCC unroll 2
                for (int j = 0; j < nt; j++) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
            }
        }
#pragma GCC unroll 2
        for (int j = 0; j < nt; j++) {
            const __m256 sv = _mm256_loadu_ps(s + j * scale_stride + b * 8);
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) tot[r][j] = _mm256_fmadd_ps(acc[r][j], sv, tot[r][j]);
        }
    }
#pragma GCC unroll 2
    for (int j = 0; j < nt; j++) {
        const int64_t cc = col + j * 8, left = n - cc;
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left >= 8 ? 8 : (int)left),
                                                lanes);
        const __m256 bv = bias ? _mm256_maskload_ps(bias + cc, mask) : _mm256_setzero_ps();
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++)
            _mm256_maskstore_ps(out + r * out_stride + cc, mask, _mm256_add_ps(tot[r][j], bv));
    }
}

/* Every row of x against nt tiles starting at codes c (column `col`). */
static void tile_group(const float *x, int64_t x_stride, const uint8_t *c, int64_t tile_stride,
                       const float *s, int64_t scale_stride, int64_t k, int64_t bk,
                       const float *bias, float *out, int64_t col, int64_t m, int64_t n, int nt,
                       float *scratch) {
    const float *wf = 0;
    if (scratch && m > MR) {
        for (int64_t i = 0; i < nt * tile_stride; i += 8)
            _mm256_storeu_ps(scratch + i, widen8(c + i));
        wf = scratch;
    }
    for (int64_t r = 0; r < m; r += MR) {
        const int mr = m - r < MR ? (int)(m - r) : MR;
        const float *xr = x + r * x_stride;
        float *o = out + r * n;
        /* constant block shapes, so that the accumulators live in registers */
#define FOLIO_BLOCK(R, T)                                                                    \
    case R * 4 + T:                                                                          \
        block(xr, x_stride, c, wf, tile_stride, s, scale_stride, k, bk, bias, o, n, col, n, \
              R, T);                                                                         \
        break;
        switch (mr * 4 + nt) {
            FOLIO_BLOCK(1, 1) FOLIO_BLOCK(1, 2)
            FOLIO_BLOCK(2, 1) FOLIO_BLOCK(2, 2)
            FOLIO_BLOCK(3, 1) FOLIO_BLOCK(3, 2)
            FOLIO_BLOCK(4, 1) FOLIO_BLOCK(4, 2)
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
    const int64_t tiles = (n + 7) / 8, tile_stride = k * 8;
    const int64_t blocks = (k + bk - 1) / bk, scale_stride = blocks * 8;
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
                       scales + t * scale_stride, scale_stride, k, bk, bias, out, t * 8, m, n,
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
