/* The linear layer of 4- and 8-bit quantized weights: out = x W^T (+ bias),
 * x and out fp32 or bf16, W as integer codes with a float16 scale and offset
 * per (output feature, group of input features):
 *
 *     w[n][k] = q[n][k] * scale[n][g(k)] + offset[n][g(k)].
 *
 * Layout (folio.model.layers.quantization.int_groups, which says why): output
 * features in tiles of 16; codes [tiles][K][8] (4 bits: byte j holds features
 * j and j + 8 of the tile, low and high nibble) or [tiles][K][16] (8 bits);
 * scales and offsets [tiles][groups][16] float16 (with `zeros`, the offsets
 * array holds integer zero points z, and offset = -z * scale, exact in fp32);
 * input features in group
 * order, group g spanning bounds[g] .. bounds[g + 1]; perm (or NULL) the
 * input feature of each position.
 *
 * Per group the codes are multiplied in fp32 and summed, then scaled:
 *     y[n] = sum_g scale[n][g] * (sum_{k in g} x[k] q[n][k])
 *          + offset[n][g] * (sum_{k in g} x[k]),
 * so a weight costs one widening and one FMA per row of x, and a group two
 * FMAs. The activations are first gathered into group order and widened to
 * fp32 once, with their per-group sums (the prologue).
 *
 * The weights are read once per call for up to MR rows at a time; with more
 * rows, a group of tiles is widened to fp32 once into scratch (in L2) and every
 * block of rows reads it from there.
 *
 * Two builds of one loop: AVX-512 (a tile is one zmm; blocks of 4 rows x 3
 * tiles) and AVX2 + FMA + F16C (a tile is two ymm; blocks of 3 rows x 1 tile).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#include <omp.h>

#if defined(__AVX512F__)
typedef __m512 vec;
#define VL 16
#define MR 4
#define NT 3
#define vzero() _mm512_setzero_ps()
#define vsub(a, b) _mm512_sub_ps(a, b)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vbcast(p) _mm512_set1_ps(*(p))
#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, v) _mm512_storeu_ps(p, v)
#define vhalf(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
static inline __attribute__((always_inline)) void codes_to_float(const uint8_t *p, int bits,
                                                                 vec *w) {
    __m128i b;
    if (bits == 4) {
        const __m128i lo4 = _mm_set1_epi8(0x0f);
        __m128i raw = _mm_loadl_epi64((const __m128i *)p);
        b = _mm_unpacklo_epi64(_mm_and_si128(raw, lo4),
                               _mm_and_si128(_mm_srli_epi16(raw, 4), lo4));
    } else {
        b = _mm_loadu_si128((const __m128i *)p);
    }
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
}
#else
typedef __m256 vec;
#define VL 8
#define MR 3
#define NT 1
#define vzero() _mm256_setzero_ps()
#define vsub(a, b) _mm256_sub_ps(a, b)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vbcast(p) _mm256_broadcast_ss(p)
#define vload(p) _mm256_loadu_ps(p)
#define vstore(p, v) _mm256_storeu_ps(p, v)
#define vhalf(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
static inline __attribute__((always_inline)) void codes_to_float(const uint8_t *p, int bits,
                                                                 vec *w) {
    __m128i lo, hi;
    if (bits == 4) {
        const __m128i lo4 = _mm_set1_epi8(0x0f);
        __m128i raw = _mm_loadl_epi64((const __m128i *)p);
        lo = _mm_and_si128(raw, lo4);
        hi = _mm_and_si128(_mm_srli_epi16(raw, 4), lo4);
    } else {
        lo = _mm_loadl_epi64((const __m128i *)p);
        hi = _mm_loadl_epi64((const __m128i *)(p + 8));
    }
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
}
#endif

#define VPT (16 / VL)      /* vectors per tile of 16 output features */

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {      /* nearest even, as torch */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

typedef struct {
    const float *x, *xsum;         /* [m][k] fp32 in group order; [m][groups] */
    const uint8_t *codes;
    const uint16_t *scales, *offsets;
    const int32_t *bounds;
    const float *bias;
    void *out;
    int64_t m, n, k, groups;
    int bits, dtype, zeros;
} job;

static inline __attribute__((always_inline)) void store_row(const job *J, int64_t row, int64_t col,
                                                            vec v, const float *bias) {
    float tmp[VL];
    int64_t left = J->n - col;
    if (left <= 0) return;
    if (J->dtype == 0 && left >= VL && !bias) {
        vstore((float *)J->out + row * J->n + col, v);
        return;
    }
    vstore(tmp, v);
    const int cnt = left < VL ? (int)left : VL;
    if (J->dtype == 0) {
        float *o = (float *)J->out + row * J->n + col;
        for (int i = 0; i < cnt; i++) o[i] = tmp[i] + (bias ? bias[col + i] : 0.0f);
    } else {
        uint16_t *o = (uint16_t *)J->out + row * J->n + col;
        for (int i = 0; i < cnt; i++) o[i] = float_to_bf16(tmp[i] + (bias ? bias[col + i] : 0.0f));
    }
}

/* Rows r0 .. r0 + mr against tiles t0 .. t0 + nt. qf: the tiles' codes widened
 * to fp32 ([nt][k][16]), or NULL to widen them here. */
static inline __attribute__((always_inline)) void block(const job *J, int64_t r0, int64_t t0,
                                                        const float *qf, const int bits,
                                                        const int mr, const int nt) {
    const int64_t k = J->k, groups = J->groups;
    const int64_t code_stride = k * (bits == 4 ? 8 : 16);      /* bytes per tile */
    vec acc[MR][NT * VPT], gacc[MR][NT * VPT];
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 6
        for (int j = 0; j < nt * VPT; j++) acc[r][j] = vzero();
    for (int64_t g = 0; g < groups; g++) {
        const int64_t k0 = J->bounds[g], k1 = J->bounds[g + 1];
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++)
#pragma GCC unroll 6
            for (int j = 0; j < nt * VPT; j++) gacc[r][j] = vzero();
        for (int64_t kk = k0; kk < k1; kk++) {
            vec w[NT * VPT];
#pragma GCC unroll 3
            for (int j = 0; j < nt; j++) {
                if (qf) {
#pragma GCC unroll 2
                    for (int v = 0; v < VPT; v++)
                        w[j * VPT + v] = vload(qf + (j * k + kk) * 16 + v * VL);
                } else {
                    codes_to_float(J->codes + (t0 + j) * code_stride + kk * (bits == 4 ? 8 : 16),
                                   bits, w + j * VPT);
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) {
                vec xv = vbcast(J->x + (r0 + r) * k + kk);
#pragma GCC unroll 6
                for (int j = 0; j < nt * VPT; j++) gacc[r][j] = vfma(xv, w[j], gacc[r][j]);
            }
        }
#pragma GCC unroll 3
        for (int j = 0; j < nt; j++) {
            const int64_t at = ((t0 + j) * groups + g) * 16;
#pragma GCC unroll 2
            for (int v = 0; v < VPT; v++) {
                vec s = vhalf(J->scales + at + v * VL), o = vhalf(J->offsets + at + v * VL);
                if (J->zeros) o = vsub(vzero(), vmul(o, s));
#pragma GCC unroll 4
                for (int r = 0; r < mr; r++) {
                    acc[r][j * VPT + v] = vfma(gacc[r][j * VPT + v], s, acc[r][j * VPT + v]);
                    acc[r][j * VPT + v] = vfma(vbcast(J->xsum + (r0 + r) * groups + g), o,
                                               acc[r][j * VPT + v]);
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 6
        for (int j = 0; j < nt * VPT; j++)
            store_row(J, r0 + r, (t0 + j / VPT) * 16 + (j % VPT) * VL, acc[r][j], J->bias);
}

static void widen_tiles(const job *J, int64_t t0, int nt, float *qf) {
    const int64_t per_k = J->bits == 4 ? 8 : 16, code_stride = J->k * per_k;
    for (int j = 0; j < nt; j++)
        for (int64_t kk = 0; kk < J->k; kk++) {
            vec w[VPT];
            codes_to_float(J->codes + (t0 + j) * code_stride + kk * per_k, J->bits, w);
            for (int v = 0; v < VPT; v++) vstore(qf + (j * J->k + kk) * 16 + v * VL, w[v]);
        }
}

static void tile_group(const job *J, int64_t t0, int nt, float *qf) {
    if (qf) widen_tiles(J, t0, nt, qf);
    for (int64_t r = 0; r < J->m; r += MR) {
        const int mr = J->m - r < MR ? (int)(J->m - r) : MR;
        /* constant block shapes, so that the accumulators live in registers */
#define FOLIO_QBLOCK(B, R, T) \
    case (B == 4 ? 0 : 64) + R * 8 + T: block(J, r, t0, qf, B, R, T); break;
        switch ((J->bits == 4 ? 0 : 64) + mr * 8 + nt) {
#if MR == 4
            FOLIO_QBLOCK(4, 1, 1) FOLIO_QBLOCK(4, 2, 1) FOLIO_QBLOCK(4, 3, 1) FOLIO_QBLOCK(4, 4, 1)
            FOLIO_QBLOCK(4, 1, 2) FOLIO_QBLOCK(4, 2, 2) FOLIO_QBLOCK(4, 3, 2) FOLIO_QBLOCK(4, 4, 2)
            FOLIO_QBLOCK(4, 1, 3) FOLIO_QBLOCK(4, 2, 3) FOLIO_QBLOCK(4, 3, 3) FOLIO_QBLOCK(4, 4, 3)
            FOLIO_QBLOCK(8, 1, 1) FOLIO_QBLOCK(8, 2, 1) FOLIO_QBLOCK(8, 3, 1) FOLIO_QBLOCK(8, 4, 1)
            FOLIO_QBLOCK(8, 1, 2) FOLIO_QBLOCK(8, 2, 2) FOLIO_QBLOCK(8, 3, 2) FOLIO_QBLOCK(8, 4, 2)
            FOLIO_QBLOCK(8, 1, 3) FOLIO_QBLOCK(8, 2, 3) FOLIO_QBLOCK(8, 3, 3) FOLIO_QBLOCK(8, 4, 3)
#else
            FOLIO_QBLOCK(4, 1, 1) FOLIO_QBLOCK(4, 2, 1) FOLIO_QBLOCK(4, 3, 1)
            FOLIO_QBLOCK(8, 1, 1) FOLIO_QBLOCK(8, 2, 1) FOLIO_QBLOCK(8, 3, 1)
#endif
        }
#undef FOLIO_QBLOCK
    }
}

int folio_qlinear_available(void) { return 1; }

/* out [m][n] (contiguous, x's dtype: 0 fp32, 1 bf16) = x [m][k] (rows
 * x_stride apart) @ W^T + bias (fp32 or NULL). Returns nonzero if scratch
 * memory could not be had (out is not all written then). */
int folio_qlinear(const void *x, int64_t x_stride, int dtype, const int64_t *perm,
                  const uint8_t *codes, int bits, const uint16_t *scales,
                  const uint16_t *offsets, int zeros, const int32_t *bounds, int64_t groups,
                  const float *bias, void *out, int64_t m, int64_t n, int64_t k,
                  int num_threads) {
    float *xf = (float *)malloc(sizeof(float) * (size_t)(m * k + m * groups));
    if (!xf) return 1;
    float *xsum = xf + m * k;
    const int64_t tiles = (n + 15) / 16;
    job J = {xf, xsum, codes, scales, offsets, bounds, bias, out, m, n, k, groups, bits, dtype,
             zeros};
    int failed = 0;
    int threads = num_threads < 1 ? 1 : num_threads;
#pragma omp parallel num_threads(threads)
    {
        /* the prologue: rows in group order, as fp32, and their group sums */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) {
            float *dst = xf + r * k;
            if (dtype == 0) {
                const float *src = (const float *)x + r * x_stride;
                if (perm)
                    for (int64_t i = 0; i < k; i++) dst[i] = src[perm[i]];
                else
                    memcpy(dst, src, sizeof(float) * (size_t)k);
            } else {
                const uint16_t *src = (const uint16_t *)x + r * x_stride;
                for (int64_t i = 0; i < k; i++) dst[i] = bf16_to_float(src[perm ? perm[i] : i]);
            }
            for (int64_t g = 0; g < groups; g++) {
                float s = 0;
                for (int64_t i = bounds[g]; i < bounds[g + 1]; i++) s += dst[i];
                xsum[r * groups + g] = s;
            }
        }
        const int id = omp_get_thread_num(), count = omp_get_num_threads();
        const int64_t first = tiles * id / count, last = tiles * (id + 1) / count;
        float *qf = 0;
        if (m > MR) {
            qf = (float *)malloc(sizeof(float) * (size_t)(NT * k * 16));
            if (!qf) {
#pragma omp atomic write
                failed = 1;
            }
        }
        if (m <= MR || qf)
            for (int64_t t = first; t < last; t += NT) {
                const int nt = last - t < NT ? (int)(last - t) : NT;
                tile_group(&J, t, nt, qf);
            }
        free(qf);
    }
    free(xf);
    return failed;
}

#else

/* Built without AVX2, FMA and F16C: the torch path dequantizes instead. */
int folio_qlinear_available(void) { return 0; }

int folio_qlinear(const void *x, int64_t x_stride, int dtype, const int64_t *perm,
                  const uint8_t *codes, int bits, const uint16_t *scales,
                  const uint16_t *offsets, int zeros, const int32_t *bounds, int64_t groups,
                  const float *bias, void *out, int64_t m, int64_t n, int64_t k,
                  int num_threads) {
    (void)x; (void)x_stride; (void)dtype; (void)perm; (void)codes; (void)bits; (void)scales;
    (void)offsets; (void)zeros; (void)bounds; (void)groups; (void)bias; (void)out; (void)m;
    (void)n; (void)k; (void)num_threads;
    return 1;
}

#endif
