/* bf16 linear layer for CPUs with AVX512-BF16: out = x W^T (+ bias), bf16 in
 * and out, products exact and sums in fp32, the result rounded once to bf16
 * (to nearest even, as torch rounds).
 *
 * Why our own and not oneDNN's: at decode sizes (a few to a few dozen rows)
 * the product is bound by reading the weights, and oneDNN's packed product
 * reads them at about half the rate this simple kernel does (measured in
 * docs/benchmarks.md); from 512 rows on the two are about equal.
 *
 * Packed weight layout (built by folio.kernels.native.pack_linear): the output
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
 *
 * On CPUs with AMX (built with -march=native there), steps of FOLIO_AMX_ROWS
 * rows or more multiply on the tiles instead, from the same packed layout:
 * a tile's 16 pairs of input features are one B tile of 16 rows of 64 bytes
 * (the VNNI order TDPBF16PS reads), 16 rows of x by 32 input features one A
 * tile, 2 x 2 fp32 C tiles of 16 x 16 per register block. Rows past the last
 * whole 16 take the AVX512-BF16 path; each output is then one of the two
 * paths' sums, the same for the same step shape, so the one-call decoder
 * and the modules (which call this with the same rows) agree bit for bit.
 * At a few hundred rows this is 2x and more the dot-product path (measured
 * in docs/benchmarks.md), which oneDNN's AMX product had kept for itself.
 */
#include <stdint.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>
#include <string.h>

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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#define FOLIO_AMX_ROWS 16
#define FOLIO_AMX_CHUNK 256     /* rows of x a pass over the weights (a multiple of 32) */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Whether this process may use the tiles (Linux asks each process to say so
 * once; oneDNN may have already). */
static int amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0)
        permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return permitted;
}

/* Tiles 0-3: C, 16 rows of 16 fp32; 4-5: A, 16 rows of 32 bf16; 6-7: B, 16
 * pairs of input features of 16 output features (64 bytes each). Per thread. */
static void amx_configure(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.rows[i] = 16;
        c.colsb[i] = 64;
    }
    _tile_loadconfig(&c);
}

/* 16 rows of C (a tile, fp32) + bias -> out (bf16), the first `cols` columns. */
static void amx_store(const float *c, const uint16_t *bias, uint16_t *out, int64_t out_stride,
                      int64_t col, int64_t n) {
    const __mmask16 mask = n - col >= 16 ? (__mmask16)0xffff
                                         : (__mmask16)((1u << (n - col)) - 1);
    __m512 b = _mm512_setzero_ps();
    if (bias)
        b = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + col)), 16));
    for (int r = 0; r < 16; r++) {
        __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(c + r * 16), b));
        _mm256_mask_storeu_epi16(out + r * out_stride + col, mask, (__m256i)v);
    }
}

/* Rows [0, m) of x (m a multiple of 16, k of 32) against nt tiles at w. */
static void amx_group(const uint16_t *x, int64_t x_stride, const uint16_t *w,
                      int64_t tile_stride, int64_t pairs, const uint16_t *bias, uint16_t *out,
                      int64_t col, int64_t m, int64_t n, int nt) {
    float c[4][256] __attribute__((aligned(64)));
    const int64_t xb = x_stride * (int64_t)sizeof(uint16_t);
    for (int j = 0; j < nt; j += 2) {
        const uint16_t *w0 = w + j * tile_stride, *w1 = w0 + tile_stride;
        const int two = nt - j >= 2;
        for (int64_t r = 0; r < m; r += 32) {
            const uint16_t *x0 = x + r * x_stride, *x1 = x0 + 16 * x_stride;
            const int both = m - r >= 32;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t p = 0; p < pairs; p += 16) {       /* 32 input features */
                _tile_loadd(4, x0 + 2 * p, xb);
                _tile_loadd(6, w0 + p * 32, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (two) {
                    _tile_loadd(7, w1 + p * 32, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (both) {
                    _tile_loadd(5, x1 + 2 * p, xb);
                    _tile_dpbf16ps(2, 5, 6);
                    if (two) _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, c[0], 64);
            if (two) _tile_stored(1, c[1], 64);
            if (both) _tile_stored(2, c[2], 64);
            if (both && two) _tile_stored(3, c[3], 64);
            for (int i = 0; i < 2 * (1 + both); i++) {
                if (i % 2 && !two) continue;
                amx_store(c[i], bias, out + (r + 16 * (i / 2)) * n, n, col + (j + i % 2) * 16, n);
            }
        }
    }
}
int folio_linear_amx(void) { return amx_permitted(); }
#else
#define FOLIO_AMX_ROWS 0
int folio_linear_amx(void) { return 0; }
#endif

int folio_linear_available(void) { return 1; }

/* out [m][n] (contiguous) = x [m][k] (rows x_stride apart) @ W^T + bias;
 * k even; packed as described above; bias may be NULL. */
void folio_linear(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                  const uint16_t *bias, uint16_t *out, int64_t m, int64_t n, int64_t k,
                  int num_threads) {
    const int64_t pairs = k / 2, tiles = (n + 15) / 16, tile_stride = pairs * 32;
    int threads = tiles < num_threads ? (int)tiles : num_threads;
    /* rows on the AMX tiles (a multiple of 16), the rest on the dot products */
    int64_t on_tiles = 0;
#if FOLIO_AMX_ROWS
    if (m >= FOLIO_AMX_ROWS && k % 32 == 0 && amx_permitted()) on_tiles = m / 16 * 16;
#endif
#pragma omp parallel num_threads(threads)
    {
        const int id = omp_get_thread_num(), count = omp_get_num_threads();
        const int64_t first = tiles * id / count, last = tiles * (id + 1) / count;
#if FOLIO_AMX_ROWS
        if (on_tiles) amx_configure();
        /* the tiles' rows a chunk at a time, so that a chunk of x stays in L2
         * while the thread's weights pass it */
        for (int64_t r = 0; r < on_tiles; r += FOLIO_AMX_CHUNK)
            for (int64_t t = first; t < last; t += NT) {
                const int nt = last - t < NT ? (int)(last - t) : NT;
                amx_group(x + r * x_stride, x_stride, packed + t * tile_stride, tile_stride,
                          pairs, bias, out + r * n, t * 16,
                          on_tiles - r < FOLIO_AMX_CHUNK ? on_tiles - r : FOLIO_AMX_CHUNK, n, nt);
            }
#endif
        for (int64_t t = first; t < last; t += NT) {
            const int nt = last - t < NT ? (int)(last - t) : NT;
            const uint16_t *next = t + NT < last ? packed + (t + NT) * tile_stride : 0;
            if (on_tiles < m)
                tile_group(x + on_tiles * x_stride, x_stride, packed + t * tile_stride,
                           tile_stride, pairs, bias, out + on_tiles * n, t * 16, m - on_tiles,
                           n, nt, next);
        }
#if FOLIO_AMX_ROWS
        if (on_tiles) _tile_release();
#endif
    }
}

#else

/* Built without AVX512-BF16: the oneDNN or torch product is used instead. */
int folio_linear_available(void) { return 0; }
int folio_linear_amx(void) { return 0; }

void folio_linear(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                  const uint16_t *bias, uint16_t *out, int64_t m, int64_t n, int64_t k,
                  int num_threads) {
    (void)x; (void)x_stride; (void)packed; (void)bias; (void)out; (void)m; (void)n; (void)k;
    (void)num_threads;
}

#endif
