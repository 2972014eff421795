/* fp32 linear layer with bf16-stored weights, for CPUs with AVX2 and FMA:
 * out = x W^T (+ bias), x and out fp32, W kept as bf16 and widened to fp32 in
 * registers (a bf16 is the top half of an fp32: widening is a shift).
 *
 * Why: at decode sizes a linear layer is bound by reading its weights, and on
 * CPUs without native bf16 (AVX2-only) the fast choice was fp32, 4 bytes a
 * weight. Stored as bf16 a weight is 2 bytes, and the arithmetic stays fp32
 * (FMA), so a step reads half the bytes at the accuracy of bf16 weights.
 *
 * Packed weight layout (folio.kernels.native.pack_linear_avx2): the output
 * features in tiles of 8 (one ymm of fp32; the last tile padded with zero
 * rows); in a tile, for each input feature k, its 8 features' weights:
 * [tiles][K][8] bf16. One 16-byte load widens to one FMA operand, and a
 * tile's weights are one sequential stream.
 *
 * Work split as in linear.c: each thread a contiguous range of tiles, walked
 * NT tiles at a time, every row block of MR rows against them; MR x NT = 12
 * accumulators + NT weight vectors + one broadcast x = the 16 ymm registers.
 * The next group of tiles is prefetched into L2 during the first row block.
 */
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>

#define MR 4      /* rows of x per register block */
#define NT 3      /* tiles of 8 output features per register block */

static inline __attribute__((always_inline)) __m256 widen(const uint16_t *w) {
    __m128i h = _mm_loadu_si128((const __m128i *)w);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* w: bf16 tiles, or (wf not NULL) the same tiles already widened to fp32. */
static inline __attribute__((always_inline)) void block(
    const float *x, int64_t x_stride, const uint16_t *w, const float *wf, int64_t tile_stride,
    int64_t k, const float *bias, float *out, int64_t out_stride, int64_t col, int64_t n,
    const int mr, const int nt, const uint16_t *prefetch) {
    __m256 acc[MR][NT];
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
        for (int j = 0; j < nt; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        __m256 wv[NT];
#pragma GCC unroll 3
        for (int j = 0; j < nt; j++)
            wv[j] = wf ? _mm256_loadu_ps(wf + j * tile_stride + i * 8)
                       : widen(w + j * tile_stride + i * 8);
        if (prefetch && (i & 3) == 0) {     /* one 64-byte line holds 4 k's of a tile */
#pragma GCC unroll 3
            for (int j = 0; j < nt; j++)
                _mm_prefetch((const char *)(prefetch + j * tile_stride + i * 8), _MM_HINT_T1);
        }
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) {
            __m256 xv = _mm256_broadcast_ss(x + r * x_stride + i);
#pragma GCC unroll 3
            for (int j = 0; j < nt; j++) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
        }
    }
#pragma GCC unroll 3
    for (int j = 0; j < nt; j++) {
        const int64_t c = col + j * 8, left = n - c;
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left >= 8 ? 8 : (int)left),
                                                lanes);
        const __m256 b = bias ? _mm256_maskload_ps(bias + c, mask) : _mm256_setzero_ps();
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++)
            _mm256_maskstore_ps(out + r * out_stride + c, mask, _mm256_add_ps(acc[r][j], b));
    }
}

/* The nt tiles at w widened to fp32 once, into wf (same layout). */
static void widen_tiles(const uint16_t *w, float *wf, int64_t tile_stride, int nt) {
    for (int64_t i = 0; i < nt * tile_stride; i += 8)
        _mm256_storeu_ps(wf + i, widen(w + i));
}

/* Every row of x against nt tiles starting at w (column `col`). With more
 * rows than one block, the tiles are widened once into `scratch` (nt * k * 8
 * floats, in L2) rather than again for every block of rows. */
static void tile_group(const float *x, int64_t x_stride, const uint16_t *w, int64_t tile_stride,
                       int64_t k, const float *bias, float *out, int64_t col, int64_t m,
                       int64_t n, int nt, const uint16_t *prefetch, float *scratch) {
    const float *wf = 0;
    if (scratch && m > MR) {
        widen_tiles(w, scratch, tile_stride, nt);
        wf = scratch;
    }
    for (int64_t r = 0; r < m; r += MR) {
        const int mr = m - r < MR ? (int)(m - r) : MR;
        const float *xr = x + r * x_stride;
        const uint16_t *pf = r == 0 ? prefetch : 0;
        float *o = out + r * n;
        /* constant block shapes, so that the accumulators live in registers */
#define FOLIO_BLOCK(R, T) \
    case R * 4 + T: block(xr, x_stride, w, wf, tile_stride, k, bias, o, n, col, n, R, T, pf); break;
        switch (mr * 4 + nt) {
            FOLIO_BLOCK(1, 1) FOLIO_BLOCK(1, 2) FOLIO_BLOCK(1, 3)
            FOLIO_BLOCK(2, 1) FOLIO_BLOCK(2, 2) FOLIO_BLOCK(2, 3)
            FOLIO_BLOCK(3, 1) FOLIO_BLOCK(3, 2) FOLIO_BLOCK(3, 3)
            FOLIO_BLOCK(4, 1) FOLIO_BLOCK(4, 2) FOLIO_BLOCK(4, 3)
        }
#undef FOLIO_BLOCK
    }
}

int folio_linear_bf16w_available(void) { return 1; }

/* out [m][n] (contiguous) = x [m][k] (rows x_stride apart) @ W^T + bias;
 * W packed as described above; bias (fp32) may be NULL. */
void folio_linear_bf16w(const float *x, int64_t x_stride, const uint16_t *packed,
                        const float *bias, float *out, int64_t m, int64_t n, int64_t k,
                        int num_threads) {
    const int64_t tiles = (n + 7) / 8, tile_stride = k * 8;
    int threads = tiles < num_threads ? (int)tiles : num_threads;
#pragma omp parallel num_threads(threads)
    {
        const int id = omp_get_thread_num(), count = omp_get_num_threads();
        const int64_t first = tiles * id / count, last = tiles * (id + 1) / count;
        /* NULL if it cannot be had: the blocks then widen as they go */
        float *scratch = m > MR ? (float *)malloc(sizeof(float) * NT * tile_stride) : 0;
        for (int64_t t = first; t < last; t += NT) {
            const int nt = last - t < NT ? (int)(last - t) : NT;
            const uint16_t *next = t + NT < last ? packed + (t + NT) * tile_stride : 0;
            tile_group(x, x_stride, packed + t * tile_stride, tile_stride, k, bias, out, t * 8,
                       m, n, nt, next, scratch);
        }
        free(scratch);
    }
}

#else

/* Built without AVX2 and FMA: torch's fp32 product is used instead. */
int folio_linear_bf16w_available(void) { return 0; }

void folio_linear_bf16w(const float *x, int64_t x_stride, const uint16_t *packed,
                        const float *bias, float *out, int64_t m, int64_t n, int64_t k,
                        int num_threads) {
    (void)x; (void)x_stride; (void)packed; (void)bias; (void)out; (void)m; (void)n; (void)k;
    (void)num_threads;
}

#endif
