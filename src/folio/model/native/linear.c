/* bf16 linear layer for CPUs with AVX512-BF16: out = x W^T (+ bias), bf16 in
 * and out, products exact and sums in fp32, the result rounded once to bf16
 * (to nearest even, as torch rounds).
 *
 * Why our own and not oneDNN's: at decode sizes (a few to a few dozen rows)
 * the product is bound by reading the weights, and oneDNN's packed product
 * reads them at about half the rate this simple kernel does (measured in
 * docs/benchmarks.md); from 512 rows on the two are about equal.
 *
 * Packed weight layout (built by folio.model.native.pack_linear): the output
 * features in tiles of 16 (the last tile padded with zero rows); in a tile,
 * for each pair of input features (k, k + 1), the 16 features' two weights
 * side by side: [tiles][K / 2][16][2]. One 64-byte load is then one
 * vdpbf16ps operand, and a tile's weights are one sequential stream.
 *
 * Work split: each thread takes a contiguous range of tiles (so each weight is
 * read from memory by one thread, once per call) and walks it NT tiles at a
 * time; for each group of tiles, every row of x in blocks of MR rows, the
 * group's weights staying in L2 between row blocks. MR x NT = 24 fp32
 * accumulators in registers, with NT weight vectors and one broadcast of
 * two x values. While the first row block of a group runs, the next group's
 * weights are prefetched into L2.
 */
#include <stdint.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#define MR 8      /* rows of x per register block */
#define NT 3      /* tiles of 16 output features per register block */

static inline __attribute__((always_inline)) void block(
    const uint16_t *x, int64_t x_stride, const uint16_t *w, int64_t tile_stride, int64_t pairs,
    const uint16_t *bias, uint16_t *out, int64_t out_stride, int64_t col, int64_t n,
    const int mr, const int nt, const uint16_t *prefetch) {
    __m512 acc[MR][NT];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
        for (int j = 0; j < nt; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512i wv[NT];
#pragma GCC unroll 3
        for (int j = 0; j < nt; j++)
            wv[j] = _mm512_loadu_si512((const void *)(w + j * tile_stride + p * 32));
        if (prefetch) {
#pragma GCC unroll 3
            for (int j = 0; j < nt; j++)
                _mm_prefetch((const char *)(prefetch + j * tile_stride + p * 32), _MM_HINT_T1);
        }
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            __m512i xv = _mm512_set1_epi32(*(const int32_t *)(x + r * x_stride + 2 * p));
#pragma GCC unroll 3
            for (int j = 0; j < nt; j++)
                acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)xv, (__m512bh)wv[j]);
        }
    }
#pragma GCC unroll 3
    for (int j = 0; j < nt; j++) {
        const int64_t c = col + j * 16;
        const __mmask16 mask = n - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - c)) - 1);
        __m512 b = _mm512_setzero_ps();
        if (bias)
            b = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + c)), 16));
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            /* bias added in fp32 before the one rounding */
            __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][j], b));
            _mm256_mask_storeu_epi16(out + r * out_stride + c, mask, (__m256i)v);
        }
    }
}

/* Every row of x against nt tiles starting at w (column `col`). */
static void tile_group(const uint16_t *x, int64_t x_stride, const uint16_t *w,
                       int64_t tile_stride, int64_t pairs, const uint16_t *bias, uint16_t *out,
                       int64_t col, int64_t m, int64_t n, int nt, const uint16_t *prefetch) {
    for (int64_t r = 0; r < m; r += MR) {
        const int mr = m - r < MR ? (int)(m - r) : MR;
        const uint16_t *xr = x + r * x_stride, *pf = r == 0 ? prefetch : 0;
        uint16_t *o = out + r * n;
        /* constant block shapes, so that the accumulators live in registers */
#define FOLIO_BLOCK(R, T) \
    case R * 4 + T: block(xr, x_stride, w, tile_stride, pairs, bias, o, n, col, n, R, T, pf); break;
        switch (mr * 4 + nt) {
            FOLIO_BLOCK(1, 1) FOLIO_BLOCK(1, 2) FOLIO_BLOCK(1, 3)
            FOLIO_BLOCK(2, 1) FOLIO_BLOCK(2, 2) FOLIO_BLOCK(2, 3)
            FOLIO_BLOCK(3, 1) FOLIO_BLOCK(3, 2) FOLIO_BLOCK(3, 3)
            FOLIO_BLOCK(4, 1) FOLIO_BLOCK(4, 2) FOLIO_BLOCK(4, 3)
            FOLIO_BLOCK(5, 1) FOLIO_BLOCK(5, 2) FOLIO_BLOCK(5, 3)
            FOLIO_BLOCK(6, 1) FOLIO_BLOCK(6, 2) FOLIO_BLOCK(6, 3)
            FOLIO_BLOCK(7, 1) FOLIO_BLOCK(7, 2) FOLIO_BLOCK(7, 3)
            FOLIO_BLOCK(8, 1) FOLIO_BLOCK(8, 2) FOLIO_BLOCK(8, 3)
        }
#undef FOLIO_BLOCK
    }
}

int folio_linear_available(void) { return 1; }

/* out [m][n] (contiguous) = x [m][k] (rows x_stride apart) @ W^T + bias;
 * k even; packed as described above; bias may be NULL. */
void folio_linear(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                  const uint16_t *bias, uint16_t *out, int64_t m, int64_t n, int64_t k,
                  int num_threads) {
    const int64_t pairs = k / 2, tiles = (n + 15) / 16, tile_stride = pairs * 32;
    int threads = tiles < num_threads ? (int)tiles : num_threads;
#pragma omp parallel num_threads(threads)
    {
        const int id = omp_get_thread_num(), count = omp_get_num_threads();
        const int64_t first = tiles * id / count, last = tiles * (id + 1) / count;
        for (int64_t t = first; t < last; t += NT) {
            const int nt = last - t < NT ? (int)(last - t) : NT;
            const uint16_t *next = t + NT < last ? packed + (t + NT) * tile_stride : 0;
            tile_group(x, x_stride, packed + t * tile_stride, tile_stride, pairs, bias, out,
                       t * 16, m, n, nt, next);
        }
    }
}

#else

/* Built without AVX512-BF16: the oneDNN or torch product is used instead. */
int folio_linear_available(void) { return 0; }

void folio_linear(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                  const uint16_t *bias, uint16_t *out, int64_t m, int64_t n, int64_t k,
                  int num_threads) {
    (void)x; (void)x_stride; (void)packed; (void)bias; (void)out; (void)m; (void)n; (void)k;
    (void)num_threads;
}

#endif
