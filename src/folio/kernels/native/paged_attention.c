/* Paged attention for the CPU, for every query token of a step in one call:
 * decodes (one token of a sequence) and prefill chunks (consecutive tokens of
 * a sequence, each seeing the keys up to its own position) alike. Keys and
 * values are read in place through the block tables (no gathered copy).
 *
 * Layout (see backend.py): kv_cache [2][num_blocks][block_size][num_kv_heads][head_dim];
 * q [tokens][num_heads][head_dim] with a row stride of q_stride elements (the
 * fused qkv output, unsplit); out [tokens][num_heads][head_dim] contiguous;
 * block_tables [rows][max_blocks] int64; token_rows[t] is token t's row of the
 * tables and context_lens[t] the number of keys it sees (its position + 1).
 * Scores, softmax and the weighted sum of values are accumulated in fp32;
 * dtype (of q and out) is 0 float32 or 1 bfloat16; kv_dtype (of the cache,
 * --kv-cache-dtype) 0 float32, 1 bfloat16 (fp32 queries may read a bf16
 * cache, half the bytes a decode step streams), 2 int8, 3 fp8 (e4m3) or 4 fp8 e5m2: each
 * row of a token and KV head is head_dim 8-bit steps followed by its fp32
 * scale (4 bytes; attention/kv_quant.py), so a row is head_dim + 4 elements;
 * the steps are widened in registers, and the scales multiply a block's
 * scores (keys) and softmax weights (values), once a row, not once a value. A sliding window w > 0 (a local layer):
 * a token of context c sees only the keys at c - w .. c - 1 (positions
 * p - w < k <= p), and the blocks wholly before them are not read.
 *
 * Two implementations of a task:
 * - with AVX-512 or AVX2 + FMA (simd.h; head_dim a multiple of the vector
 *   width, 16 or 8 floats, and at most 256): a task is a tile of up to 16
 *   consecutive tokens of one sequence and a run of KV heads. One pass over
 *   the blocks with an online softmax (running max and sum per query); each
 *   key and value row loaded serves every query of the tile, so a prefill
 *   chunk reads its keys once per tile, not once per token. The next blocks
 *   are prefetched into L2 while this one is computed: decode attention reads
 *   every cached key and value once and does little arithmetic on each, so it
 *   is bound by memory latency. Where the CPU has AVX512-BF16, bf16 keys
 *   are transposed 16 rows at a time and meet the bf16 queries in vdpbf16ps
 *   (exact products, fp32 sums): a query's 16 scores come out as one vector.
 * - portable C otherwise: one token and one KV head a task; scores, softmax,
 *   then values, in three passes.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* An fp8 e4m3 as a float (as simd.h's fv_load: rebiased, subnormals by
 * subtraction). */
static inline float fp8_to_float(uint8_t b) {
    const uint32_t o = (uint32_t)(b & 0x7f) << 20;
    uint32_t bits = o + (120u << 23);
    float f;
    if ((o & (0xfu << 23)) == 0) {              /* a subnormal (or zero) */
        bits += 1u << 23;
        memcpy(&f, &bits, sizeof f);
        f -= 0x1p-6f;
    } else {
        memcpy(&f, &bits, sizeof f);
    }
    return b & 0x80 ? -f : f;
}

/* An fp8 e5m2 as a float: the top byte of a float16, widened exactly. */
static inline float e5m2_to_float(uint8_t b) { return half_to_float((uint16_t)(b << 8)); }

/* The scale of the 8-bit cache row of n steps at base[index]. */
static inline float row_scale(const void *base, int64_t index, int n) {
    float s;
    memcpy(&s, (const int8_t *)base + index + n, sizeof s);
    return s;
}

/* Elements of a cached row of one token and KV head (8-bit: its scale too). */
static inline int row_elements(int head_dim, int kv_dtype) {
    return kv_dtype >= 2 ? head_dim + 4 : head_dim;
}

/* Load n elements of the given dtype as floats (int8: times its row's scale). */
static inline void load_row(const void *base, int64_t index, int dtype, int n, float *dst) {
    if (dtype == 0) {
        memcpy(dst, (const float *)base + index, (size_t)n * sizeof(float));
    } else if (dtype == 2) {
        const int8_t *src = (const int8_t *)base + index;
        const float s = row_scale(base, index, n);
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = (float)src[i] * s;
    } else if (dtype == 3) {
        const uint8_t *src = (const uint8_t *)base + index;
        const float s = row_scale(base, index, n);
        for (int i = 0; i < n; i++) dst[i] = fp8_to_float(src[i]) * s;
    } else if (dtype == 4) {
        const uint8_t *src = (const uint8_t *)base + index;
        const float s = row_scale(base, index, n);
        for (int i = 0; i < n; i++) dst[i] = e5m2_to_float(src[i]) * s;
    } else {
        const uint16_t *src = (const uint16_t *)base + index;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = bf16_to_float(src[i]);
    }
}

/* scores[g][p] = scale * q_g . k_p for the rows of one block. Four rows at a
 * time: four independent reductions keep the FMA pipeline full instead of
 * waiting on one horizontal sum after another. */
static inline void block_scores(const void *kv, int64_t first_row, int64_t rows, int64_t stride,
                                int dtype, int group, int head_dim, const float *qbuf,
                                float scale, float *row, float *scores, int64_t ctx, int64_t p0) {
    int64_t r = 0;
    float *r0 = row, *r1 = row + head_dim, *r2 = row + 2 * head_dim, *r3 = row + 3 * head_dim;
    for (; r + 4 <= rows; r += 4) {
        load_row(kv, first_row + r * stride, dtype, head_dim, r0);
        load_row(kv, first_row + (r + 1) * stride, dtype, head_dim, r1);
        load_row(kv, first_row + (r + 2) * stride, dtype, head_dim, r2);
        load_row(kv, first_row + (r + 3) * stride, dtype, head_dim, r3);
        for (int g = 0; g < group; g++) {
            const float *qg = qbuf + g * head_dim;
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+:s0, s1, s2, s3)
            for (int d = 0; d < head_dim; d++) {
                s0 += qg[d] * r0[d];
                s1 += qg[d] * r1[d];
                s2 += qg[d] * r2[d];
                s3 += qg[d] * r3[d];
            }
            float *out = scores + g * ctx + p0 + r;
            out[0] = s0 * scale; out[1] = s1 * scale; out[2] = s2 * scale; out[3] = s3 * scale;
        }
    }
    for (; r < rows; r++) {
        load_row(kv, first_row + r * stride, dtype, head_dim, r0);
        for (int g = 0; g < group; g++) {
            const float *qg = qbuf + g * head_dim;
            float s = 0.f;
#pragma omp simd reduction(+:s)
            for (int d = 0; d < head_dim; d++) s += qg[d] * r0[d];
            scores[g * ctx + p0 + r] = s * scale;
        }
    }
}

/* Portable path: one query token and one KV head (its whole query group); the
 * token's queries start at q + q_row, its output at out + out_row. */
static void one_task(const void *q, int64_t q_row, const void *kv, void *out, int64_t out_row,
                     const int64_t *table, int64_t ctx, int64_t lo, int kvh, int num_heads,
                     int num_kv_heads, int head_dim, int block_size, int64_t num_blocks,
                     float scale, int dtype, int kv_dtype, float *scores, float *qbuf,
                     float *acc, float *row) {
    const int group = num_heads / num_kv_heads;
    const int row_el = row_elements(head_dim, kv_dtype);
    const int64_t stride = (int64_t)num_kv_heads * row_el;     /* between tokens of a block */
    const int64_t v_offset = num_blocks * block_size * stride;
    const int64_t nblk = (ctx + block_size - 1) / block_size;
    for (int g = 0; g < group; g++)
        load_row(q, q_row + (int64_t)(kvh * group + g) * head_dim, dtype, head_dim,
                 qbuf + g * head_dim);
    const int64_t blo = lo / block_size;           /* the first block in the window */
    for (int64_t b = blo; b < nblk; b++) {
        int64_t p0 = b * block_size;
        int64_t rows = ctx - p0 < block_size ? ctx - p0 : block_size;
        int64_t first = table[b] * block_size * stride + (int64_t)kvh * row_el;
        block_scores(kv, first, rows, stride, kv_dtype, group, head_dim, qbuf, scale, row,
                     scores, ctx, p0);
    }
    for (int g = 0; g < group; g++) {
        float *sg = scores + g * ctx, m = -FLT_MAX, sum = 0.f;
        for (int64_t p = lo; p < ctx; p++) m = sg[p] > m ? sg[p] : m;
#pragma omp simd reduction(+:sum)
        for (int64_t p = lo; p < ctx; p++) { sg[p] = expf(sg[p] - m); sum += sg[p]; }
        float inv = 1.f / sum;
        for (int64_t p = lo; p < ctx; p++) sg[p] *= inv;
    }
    memset(acc, 0, sizeof(float) * group * head_dim);
    for (int64_t b = blo; b < nblk; b++) {
        int64_t p0 = b * block_size;
        int64_t rows = ctx - p0 < block_size ? ctx - p0 : block_size;
        int64_t first = v_offset + table[b] * block_size * stride + (int64_t)kvh * row_el;
        for (int64_t r = lo > p0 ? lo - p0 : 0; r < rows; r++) {
            load_row(kv, first + r * stride, kv_dtype, head_dim, row);
            for (int g = 0; g < group; g++) {
                float w = scores[g * ctx + p0 + r];
                float *ag = acc + g * head_dim;
#pragma omp simd
                for (int d = 0; d < head_dim; d++) ag[d] += w * row[d];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        int64_t o = out_row + (int64_t)(kvh * group + g) * head_dim;
        if (dtype == 0) {
            memcpy((float *)out + o, acc + g * head_dim, sizeof(float) * head_dim);
        } else {
            for (int d = 0; d < head_dim; d++)
                ((uint16_t *)out)[o + d] = float_to_bf16(acc[g * head_dim + d]);
        }
    }
}


#include "simd.h"
/* Whether a decode step with few tasks for the threads may split each
 * context into shares (below). Off by default: a split sums a row's keys in
 * another order than an unsplit task does, and whether a step splits depends
 * on what else is in it, so a request's last bits, and through int8
 * activations its tokens, would depend on the batch. On
 * (folio_attention_splits(1), FOLIO_ATTENTION_SPLITS=1): one sequence's
 * decode uses more threads than it has KV heads. */
static int folio_splits = 0;

void folio_attention_splits(int on) { folio_splits = on; }

#ifdef FOLIO_HAVE_VEC

static inline void prefetch_rows(const void *kv, int64_t first, int64_t rows, int64_t stride,
                                 int row_bytes, int elt) {
    const char *base = (const char *)kv + first * elt;
    for (int64_t r = 0; r < rows; r++)
        for (int off = 0; off < row_bytes; off += 64)
            __builtin_prefetch(base + r * stride * elt + off, 0, 1);   /* to L2: measured best */
}

/* A task's queries (a tile of tokens x a run of KV heads x their query groups)
 * take up to this many vectors on its stack, and as many accumulators. */
#define FOLIO_TASK_FLOATS 4096
#define FOLIO_TASK_VECTORS (FOLIO_TASK_FLOATS / FOLIO_VW)
#define FOLIO_MAX_DIM 256
#define FOLIO_MAX_NV (FOLIO_MAX_DIM / FOLIO_VW)
#define FOLIO_MAX_BLOCK 256    /* rows of a block the vector path takes (int8 scales) */

#ifdef FOLIO_HAVE_AVX512
/* Transpose of 16 rows of 16 32-bit elements: t[e] lane r = rows[r] element e. */
static inline void transpose16x16(const __m512i *rows, __m512i *t) {
    __m512i lo[8], hi[8], u[16];
    for (int j = 0; j < 8; j++) {
        lo[j] = _mm512_unpacklo_epi32(rows[2 * j], rows[2 * j + 1]);
        hi[j] = _mm512_unpackhi_epi32(rows[2 * j], rows[2 * j + 1]);
    }
    for (int g = 0; g < 4; g++) {    /* u[4g + k], 128-bit lane L: element 4L + k of rows 4g.. */
        u[4 * g + 0] = _mm512_unpacklo_epi64(lo[2 * g], lo[2 * g + 1]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(lo[2 * g], lo[2 * g + 1]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(hi[2 * g], hi[2 * g + 1]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(hi[2 * g], hi[2 * g + 1]);
    }
    for (int k = 0; k < 4; k++) {
        __m512i v = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);
        __m512i w = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xDD);
        __m512i v2 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
        __m512i w2 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xDD);
        t[k] = _mm512_shuffle_i32x4(v, v2, 0x88);
        t[8 + k] = _mm512_shuffle_i32x4(v, v2, 0xDD);
        t[4 + k] = _mm512_shuffle_i32x4(w, w2, 0x88);
        t[12 + k] = _mm512_shuffle_i32x4(w, w2, 0xDD);
    }
}

/* Scores of up to 16 key rows (either dtype, as fp32) for nq fp32 queries
 * (scale folded in): 16 dimensions of the 16 rows transposed at a time, then
 * each query's 16 scores are one chain of FMAs with its dimensions broadcast
 * (AVX-512: its 32 registers hold the transposed rows). */
static inline void block_scores_f32(const void *kv, int64_t kfirst, int64_t rows,
                                    int64_t stride, int dtype, int nv, int nq,
                                    const fvec *qv, float *scores, int block_size) {
    for (int64_t r0 = 0; r0 < rows; r0 += FOLIO_VW) {
        const int n = rows - r0 < FOLIO_VW ? (int)(rows - r0) : FOLIO_VW;
        fvec t[FOLIO_MAX_DIM];                      /* head_dim vectors */
        for (int c = 0; c < nv; c++) {
            fvec rw[FOLIO_VW];
            for (int r = 0; r < FOLIO_VW; r++)
                rw[r] = r < n ? fv_load(kv, kfirst + (r0 + r) * stride + FOLIO_VW * c, dtype)
                              : fv_zero();
            transpose16x16((const __m512i *)rw, (__m512i *)(t + FOLIO_VW * c));
        }
        const fmask mask = fv_first(n);
        for (int i = 0; i < nq; i++) {
            const float *qi = (const float *)(qv + (int64_t)i * nv);
            fvec a0 = fv_zero(), a1 = fv_zero(), a2 = fv_zero(), a3 = fv_zero();
            for (int d = 0; d < FOLIO_VW * nv; d += 4) {
                a0 = fv_fma(fv_set1(qi[d]), t[d], a0);
                a1 = fv_fma(fv_set1(qi[d + 1]), t[d + 1], a1);
                a2 = fv_fma(fv_set1(qi[d + 2]), t[d + 2], a2);
                a3 = fv_fma(fv_set1(qi[d + 3]), t[d + 3], a3);
            }
            fv_store_n(scores + (int64_t)i * block_size + r0, mask,
                       fv_add(fv_add(a0, a1), fv_add(a2, a3)));
        }
    }
}
#else
/* Each of 8 vectors' lane sum, as one vector (lane r: the sum of a[r]). */
static inline fvec fv_hsum8(const fvec *a) {
    const fvec t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const fvec t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const fvec u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* The scores with AVX2's 8-float vectors, rows kept as they lie: each
 * query's 8 rows are 8 chains of FMAs over the head's vectors (the key read
 * straight into the FMA), summed across lanes once at the end. Per query and
 * 8 rows that is head_dim FMAs and a 21-instruction sum, where transposing
 * the rows costs 3 shuffles an element before the first query, and the 16
 * registers cannot hold the transposed block (it went to the stack). */
static inline __attribute__((always_inline)) void block_scores_f32(
        const void *kv, int64_t kfirst, int64_t rows, int64_t stride, int dtype, const int nv,
        int nq, const fvec *qv, float *scores, int block_size) {
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
        const int n = rows - r0 < 8 ? (int)(rows - r0) : 8;
        const int64_t k0 = kfirst + r0 * stride;
        for (int i = 0; i < nq; i++) {
            const fvec *qi = qv + (int64_t)i * nv;
            fvec a[8];
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) a[r] = fv_zero();
            if (n == 8) {
#pragma GCC unroll 16
                for (int j = 0; j < nv; j++) {
                    const fvec qj = qi[j];
#pragma GCC unroll 8
                    for (int r = 0; r < 8; r++)
                        a[r] = fv_fma(qj, fv_load(kv, k0 + r * stride + 8 * j, dtype), a[r]);
                }
            } else {
                for (int r = 0; r < n; r++)
                    for (int j = 0; j < nv; j++)
                        a[r] = fv_fma(qi[j], fv_load(kv, k0 + r * stride + 8 * j, dtype), a[r]);
            }
            fv_store_n(scores + (int64_t)i * block_size + r0, fv_first(n), fv_hsum8(a));
        }
    }
}
#endif

#if defined(__AVX512BF16__)
/* Scores of up to 16 bf16 key rows for nq bf16 queries: the rows are
 * transposed into vectors of one dimension pair across the 16 rows, so a
 * query's scores come out as one vector of 32-pair dot products (vdpbf16ps
 * with the query's pair broadcast) with no horizontal sums. qp: nq queries of
 * head_dim / 2 pairs (32-bit). */
static inline void block_scores_bf16_t(const void *kv, int64_t kfirst, int64_t rows,
                                       int64_t stride, int nv, int nq, const uint32_t *qp,
                                       float scale, float *scores, int block_size) {
    const uint16_t *base = (const uint16_t *)kv + kfirst;
    const int npairs = nv * 8;                     /* head_dim / 2 */
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int n = rows - r0 < 16 ? (int)(rows - r0) : 16;
        __m512i t[FOLIO_MAX_DIM / 2];               /* npairs vectors (was 64: overran at head_dim > 128) */
        for (int c = 0; c < npairs / 16; c++) {    /* 32 dimensions (16 pairs) at a time */
            __m512i rw[16];
            for (int r = 0; r < 16; r++)
                rw[r] = r < n ? _mm512_loadu_si512(base + (r0 + r) * stride + 32 * c)
                              : _mm512_setzero_si512();
            transpose16x16(rw, t + 16 * c);
        }
        const __mmask16 mask = (__mmask16)((1u << n) - 1);
        for (int i = 0; i < nq; i++) {
            const uint32_t *qi = qp + (int64_t)i * npairs;
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
            __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
            for (int p = 0; p < npairs; p += 4) {
                a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_set1_epi32((int)qi[p]), (__m512bh)t[p]);
                a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_set1_epi32((int)qi[p + 1]),
                                      (__m512bh)t[p + 1]);
                a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_set1_epi32((int)qi[p + 2]),
                                      (__m512bh)t[p + 2]);
                a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_set1_epi32((int)qi[p + 3]),
                                      (__m512bh)t[p + 3]);
            }
            __m512 sum = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
            _mm512_mask_storeu_ps(scores + (int64_t)i * block_size + r0, mask,
                                  _mm512_mul_ps(sum, _mm512_set1_ps(scale)));
        }
    }
}

#endif

/* Online softmax over one block's scores of one query: exponentiates them in
 * place against the new running max, and returns the factor that rescales
 * what was accumulated before. */
static inline float block_softmax_vec(float *s, int64_t rows, float *m, float *l) {
    fvec vmax = fv_set1(-FLT_MAX);
    for (int64_t r = 0; r < rows; r += FOLIO_VW) {
        const fmask mask = fv_first(rows - r);
        vmax = fv_max_n(vmax, mask, fv_load_n(s + r, mask));
    }
    float bmax = fv_hmax(vmax);
    float corr = 1.f, sum = 0.f;      /* once the running max settles, no rescaling */
    if (bmax > *m) {
        corr = expf(*m - bmax);
        *m = bmax;
    }
    const float mnew = *m;
    for (int64_t r = 0; r < rows; r += FOLIO_VW) {
        const fmask mask = fv_first(rows - r);
        fvec x = fv_load_n(s + r, mask);
        fvec p = fv_keep(mask, fv_exp(fv_sub(x, fv_set1(mnew))));
        fv_store_n(s + r, mask, p);
        sum += fv_hadd(p);
    }
    *l = *l * corr + sum;
    return corr;
}

#define FOLIO_TILE 16          /* query tokens a task, at most */
#define FOLIO_SHARE_BLOCKS 4   /* the fewest blocks of a context share (decode, few tasks) */


/* Values of one block for a few queries (decode: one token's query group),
 * rows outer: each row is converted once and the nq x jc accumulators stay in
 * registers (nq, nv and jc are constants where this is inlined). The head's
 * nv vectors go jc at a time, so that AVX2's 16 registers hold a pass. */
static inline __attribute__((always_inline)) void block_values_regs(
        const void *kv, int64_t vfirst, int64_t rows, int64_t stride, int dtype,
        const float *scores, int block_size, fvec *acc, const int nq, const int nv,
        const int jc) {
    for (int j0 = 0; j0 < nv; j0 += jc) {          /* jc divides nv */
        fvec a[8 * FOLIO_MAX_NV];
        for (int k = 0; k < nq; k++)
            for (int j = 0; j < jc; j++) a[k * jc + j] = acc[k * nv + j0 + j];
        for (int64_t r = 0; r < rows; r++) {
            fvec v[FOLIO_MAX_NV];
            for (int j = 0; j < jc; j++)
                v[j] = fv_load(kv, vfirst + r * stride + FOLIO_VW * (j0 + j), dtype);
            for (int k = 0; k < nq; k++) {
                fvec w = fv_set1(scores[(int64_t)k * block_size + r]);
                for (int j = 0; j < jc; j++) a[k * jc + j] = fv_fma(w, v[j], a[k * jc + j]);
            }
        }
        for (int k = 0; k < nq; k++)
            for (int j = 0; j < jc; j++) acc[k * nv + j0 + j] = a[k * jc + j];
    }
}

/* Vectors of one pass of block_values_regs for nq queries: the whole head with
 * AVX-512's 32 registers; with AVX2's 16, at most 12 accumulators (a divisor
 * of the head's vectors). */
#define FOLIO_DIVIDING(j, nv) ((nv) % (j) == 0 ? (j) : (nv) % ((j) / 2) == 0 ? (j) / 2 \
                               : (nv) % 2 == 0 ? 2 : 1)
#ifdef FOLIO_HAVE_AVX512
#define FOLIO_JC(nq, nv) (nv)
#else
#define FOLIO_JC(nq, nv) FOLIO_DIVIDING((nq) == 1 ? 8 : (nq) <= 3 ? 4 : 2, nv)
#endif

/* The register version for the shapes it fits (0 if it took the block). */
static inline __attribute__((always_inline)) int block_values_small(
        const void *kv, int64_t vfirst, int64_t rows, int64_t stride, int dtype,
        const float *scores, int block_size, fvec *acc, int nq, const int head_dim) {
#define FOLIO_PV(N, D) case N: block_values_regs(kv, vfirst, rows, stride, dtype, scores, \
        block_size, acc, N, D / FOLIO_VW, FOLIO_JC(N, D / FOLIO_VW)); return 0;
    if (head_dim == 64) {
        switch (nq) { FOLIO_PV(1, 64) FOLIO_PV(2, 64) FOLIO_PV(3, 64) FOLIO_PV(4, 64)
                      FOLIO_PV(5, 64) FOLIO_PV(6, 64) }
    } else if (head_dim == 128) {
        switch (nq) { FOLIO_PV(1, 128) FOLIO_PV(2, 128) FOLIO_PV(3, 128) }
    }
#undef FOLIO_PV
    return 1;
}

static inline __attribute__((always_inline)) void task_vec(
        const void *q, int64_t q_stride, const void *kv, void *out, const int64_t *table,
        const int64_t *ctx, int ntok, int64_t tok0, int kvh0, int kvh1, int num_heads,
        int num_kv_heads, const int head_dim, int block_size, int64_t num_blocks, float scale,
        int dtype, int kv_dtype, float *scores, int64_t b0, int64_t b1, float *part,
        int64_t window) {
    const int group = num_heads / num_kv_heads;
    const int nv = head_dim / FOLIO_VW;
    const int per_head = ntok * group;             /* queries of one KV head */
    float *vbuf = scores + (int64_t)FOLIO_TASK_VECTORS * block_size;   /* [block_size][head_dim] */
    const int elt = kv_dtype == 0 ? 4 : kv_dtype == 1 ? 2 : 1;   /* bytes of a cached element */
    const int eight = kv_dtype >= 2;                 /* 8-bit rows, each with its scale */
    /* what fv_load's steps are short of their value (fp8: simd.h's 2^-8) */
    const float load_scale = kv_dtype == 3 ? FOLIO_FP8_LOAD_SCALE : 1.f;
    const int row_el = row_elements(head_dim, kv_dtype);
    const int64_t stride = (int64_t)num_kv_heads * row_el;
    const int64_t v_offset = num_blocks * block_size * stride;
    const int64_t last_ctx = ctx[ntok - 1];        /* positions rise along the tile */
    const int64_t all_blocks = (last_ctx + block_size - 1) / block_size;
    const int64_t nblk = b1 < all_blocks ? b1 : all_blocks;   /* this task's blocks b0 .. */
    /* the first key any token of the tile sees (the first token's: positions rise) */
    const int64_t lo0 = window > 0 && ctx[0] > window ? ctx[0] - window : 0;
    if (b0 < lo0 / block_size) b0 = lo0 / block_size;
    const int span = (kvh1 - kvh0) * row_el * elt;     /* the task's heads in a cached row */
    float kscale[FOLIO_MAX_BLOCK], vscale[FOLIO_MAX_BLOCK];   /* int8: the block's row scales */
    /* query i = (head h, token t, group member g) at (h * ntok + t) * group + g */
    fvec qv[FOLIO_TASK_VECTORS], acc[FOLIO_TASK_VECTORS];
    float m[FOLIO_TASK_VECTORS], l[FOLIO_TASK_VECTORS];
#if defined(__AVX512BF16__)
    /* bf16 queries meet bf16 keys in vdpbf16ps; 8-bit keys too in a tile of
     * several tokens (a prefill chunk: each block's keys widened to bf16 once,
     * exactly, for all its queries; a decode keeps the fp32 products) */
    const int dot_bf16 = dtype == 1 && (kv_dtype == 1 || (eight && ntok > 1)) && nv % 2 == 0;
    __m512bh qb[FOLIO_TASK_VECTORS / 2];
#endif
    for (int h = 0; h < kvh1 - kvh0; h++)
        for (int t = 0; t < ntok; t++)
            for (int g = 0; g < group; g++) {
                const int i = (h * ntok + t) * group + g;
                const int64_t src = (tok0 + t) * q_stride
                                    + (int64_t)((kvh0 + h) * group + g) * head_dim;
                for (int j = 0; j < nv; j++) {
                    qv[i * nv + j] = fv_mul(fv_load(q, src + FOLIO_VW * j, dtype), fv_set1(scale));
                    acc[i * nv + j] = fv_zero();
                }
#if defined(__AVX512BF16__)
                if (dot_bf16)
                    for (int j = 0; j < nv / 2; j++)
                        qb[i * (nv / 2) + j] = (__m512bh)_mm512_loadu_si512(
                            (const uint16_t *)q + src + 32 * j);
#endif
                m[i] = -FLT_MAX;
                l[i] = 0.f;
            }
    for (int64_t b = b0; b < nblk; b++) {
        const int64_t p0 = b * block_size;
        const int64_t rows = last_ctx - p0 < block_size ? last_ctx - p0 : block_size;
        const int64_t base = table[b] * block_size * stride + (int64_t)kvh0 * row_el;
        /* two blocks ahead: the next one was asked for on the way to this one */
        for (int64_t ahead = b == b0 ? b + 1 : b + 2; ahead <= b + 2 && ahead < nblk; ahead++) {
            int64_t next = table[ahead] * block_size * stride + (int64_t)kvh0 * row_el;
            int64_t left = last_ctx - ahead * block_size;
            int64_t nrows = left < block_size ? left : block_size;
            prefetch_rows(kv, next, nrows, stride, span, elt);
            prefetch_rows(kv, v_offset + next, nrows, stride, span, elt);
        }
        for (int h = 0; h < kvh1 - kvh0; h++) {
            const int64_t kfirst = base + (int64_t)h * row_el;
            const int i0 = h * per_head;
            if (eight)
                for (int64_t r = 0; r < rows; r++) {
                    kscale[r] = row_scale(kv, kfirst + r * stride, head_dim) * load_scale;
                    vscale[r] = row_scale(kv, v_offset + kfirst + r * stride, head_dim)
                                * load_scale;
                }
#if defined(__AVX512BF16__)
            if (dot_bf16 && eight) {
                /* the steps as bf16 (exact: int8's are integers of 7 bits,
                 * e4m3's have 4 significant bits), in vbuf's room (the values
                 * take it after the scores) */
                uint16_t *kb = (uint16_t *)vbuf;
                for (int64_t r = 0; r < rows; r++)
                    for (int j = 0; j < nv; j += 2) {
                        const int64_t at = kfirst + r * stride + FOLIO_VW * j;
                        _mm512_storeu_si512(kb + r * head_dim + FOLIO_VW * j,
                                            (__m512i)_mm512_cvtne2ps_pbh(
                                                fv_load(kv, at + FOLIO_VW, kv_dtype),
                                                fv_load(kv, at, kv_dtype)));
                    }
                block_scores_bf16_t(kb, 0, rows, head_dim, nv, per_head,
                                    (const uint32_t *)(qb + i0 * (nv / 2)), scale, scores,
                                    block_size);
            } else if (dot_bf16)
                block_scores_bf16_t(kv, kfirst, rows, stride, nv, per_head,
                                    (const uint32_t *)(qb + i0 * (nv / 2)), scale, scores,
                                    block_size);
            else
#endif
                block_scores_f32(kv, kfirst, rows, stride, kv_dtype, nv, per_head, qv + i0 * nv,
                                 scores, block_size);
            if (eight)                  /* each key row's scale, on its scores */
                for (int i = 0; i < per_head; i++)
                    for (int64_t r = 0; r < rows; r++) scores[(int64_t)i * block_size + r] *= kscale[r];
            for (int t = 0; t < ntok; t++) {
                /* keys this token sees in the block, rows first .. valid - 1:
                 * causal within a prefill chunk, after its window's start */
                const int64_t valid = ctx[t] - p0 < rows ? ctx[t] - p0 : rows;
                const int64_t lo = window > 0 ? ctx[t] - window - p0 : 0;
                const int64_t first = lo > 0 ? lo : 0;
                for (int g = 0; g < group; g++) {
                    const int i = i0 + t * group + g;
                    float *si = scores + (int64_t)(t * group + g) * block_size;
                    if (valid <= first) {
                        memset(si, 0, sizeof(float) * (size_t)rows);
                        continue;
                    }
                    float corr = block_softmax_vec(si + first, valid - first, m + i, l + i);
                    for (int64_t r = 0; r < first; r++) si[r] = 0.f;
                    for (int64_t r = valid; r < rows; r++) si[r] = 0.f;
                    if (corr != 1.f)
                        for (int j = 0; j < nv; j++)
                            acc[i * nv + j] = fv_mul(acc[i * nv + j], fv_set1(corr));
                }
            }
            if (eight)                  /* each value row's scale, on its weights */
                for (int i = 0; i < per_head; i++)
                    for (int64_t r = 0; r < rows; r++) scores[(int64_t)i * block_size + r] *= vscale[r];
            if (!block_values_small(kv, v_offset + kfirst, rows, stride, kv_dtype, scores,
                                    block_size, acc + i0 * nv, per_head, head_dim))
                continue;
            /* more queries: the block's rows once as fp32, then four queries
             * at a time with their accumulators in registers */
            for (int64_t r = 0; r < rows; r++)
                for (int j = 0; j < nv; j++)
                    fv_storeu(vbuf + r * head_dim + FOLIO_VW * j,
                              fv_load(kv, v_offset + kfirst + r * stride + FOLIO_VW * j,
                                      kv_dtype));
            int k = 0;
            if (head_dim <= 128)
                for (; k + 4 <= per_head; k += 4)
                    block_values_regs(vbuf, 0, rows, head_dim, 0, scores + (int64_t)k * block_size,
                                      block_size, acc + (i0 + k) * nv, 4, nv, FOLIO_JC(4, nv));
            for (; k < per_head; k++)
                block_values_regs(vbuf, 0, rows, head_dim, 0, scores + (int64_t)k * block_size,
                                  block_size, acc + (i0 + k) * nv, 1, nv, FOLIO_JC(1, nv));
        }
    }
    if (part) {           /* a share of the context: unnormalized, with m and l */
        for (int i = 0; i < (kvh1 - kvh0) * per_head; i++) {
            float *dst = part + (int64_t)i * (head_dim + 2);
            for (int j = 0; j < nv; j++) fv_storeu(dst + FOLIO_VW * j, acc[i * nv + j]);
            dst[head_dim] = m[i];
            dst[head_dim + 1] = l[i];
        }
        return;
    }
    for (int h = 0; h < kvh1 - kvh0; h++)
        for (int t = 0; t < ntok; t++)
            for (int g = 0; g < group; g++) {
                const int i = (h * ntok + t) * group + g;
                const int64_t o = ((tok0 + t) * num_heads + (kvh0 + h) * group + g) * head_dim;
                fvec inv = fv_set1(1.f / l[i]);
                for (int j = 0; j < nv; j++)
                    fv_store(out, o + FOLIO_VW * j, fv_mul(acc[i * nv + j], inv), dtype);
            }
}

static void task_vec_any(const void *q, int64_t q_stride, const void *kv, void *out,
                         const int64_t *table, const int64_t *ctx, int ntok, int64_t tok0,
                         int kvh0, int kvh1, int num_heads, int num_kv_heads, int head_dim,
                         int block_size, int64_t num_blocks, float scale, int dtype,
                         int kv_dtype, float *scores, int64_t b0, int64_t b1, float *part,
                         int64_t window) {
    /* constant head_dim for the common sizes so the loops over it unroll */
    if (head_dim == 64)
        task_vec(q, q_stride, kv, out, table, ctx, ntok, tok0, kvh0, kvh1, num_heads,
                 num_kv_heads, 64, block_size, num_blocks, scale, dtype, kv_dtype, scores, b0,
                 b1, part, window);
    else if (head_dim == 128)
        task_vec(q, q_stride, kv, out, table, ctx, ntok, tok0, kvh0, kvh1, num_heads,
                 num_kv_heads, 128, block_size, num_blocks, scale, dtype, kv_dtype, scores, b0,
                 b1, part, window);
    else
        task_vec(q, q_stride, kv, out, table, ctx, ntok, tok0, kvh0, kvh1, num_heads,
                 num_kv_heads, head_dim, block_size, num_blocks, scale, dtype, kv_dtype, scores,
                 b0, b1, part, window);
}
#endif

/* Tiles: runs of consecutive tokens on the same table row, at most `limit` long.
 * Writes each tile's first token to starts[] (and the end after the last);
 * returns the number of tiles. */
static int64_t make_tiles(const int64_t *token_rows, const int64_t *context_lens, int64_t tokens,
                          int limit, int64_t *starts) {
    int64_t n = 0;
    for (int64_t t = 0; t < tokens; t++) {
        if (t == 0 || token_rows[t] != token_rows[t - 1]
                || context_lens[t] != context_lens[t - 1] + 1 || t - starts[n - 1] >= limit)
            starts[n++] = t;
    }
    starts[n] = tokens;
    return n;
}

/* Floats a vector of the tiled path (16 AVX-512, 8 AVX2), 0 in a portable build. */
int folio_attention_vector_width(void) {
#ifdef FOLIO_HAVE_VEC
    return FOLIO_VW;
#else
    return 0;
#endif
}

static int paged_attention(const void *q, int64_t q_stride, const void *kv, void *out,
                           const int64_t *block_tables, int64_t max_blocks,
                           const int64_t *token_rows, const int64_t *context_lens,
                           int64_t tokens, int num_heads, int num_kv_heads, int head_dim,
                           int block_size, int64_t num_blocks, float scale, int dtype,
                           int kv_dtype, int num_threads, int64_t window) {
    int64_t max_ctx = 0;
    for (int64_t t = 0; t < tokens; t++)
        max_ctx = context_lens[t] > max_ctx ? context_lens[t] : max_ctx;
    const int group = num_heads / num_kv_heads;
    int chunk = 1, tile = 1, vector = 0;
#ifdef FOLIO_HAVE_VEC
    const int per_head = group * (head_dim / FOLIO_VW);      /* vectors of one token's KV head */
    vector = head_dim % FOLIO_VW == 0 && head_dim <= FOLIO_MAX_DIM && per_head <= FOLIO_TASK_VECTORS
             && block_size <= FOLIO_MAX_BLOCK;
    if (vector) {
        tile = FOLIO_TASK_VECTORS / per_head;
        if (tile > FOLIO_TILE) tile = FOLIO_TILE;
    }
#endif
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(tokens + 1));
    if (!starts) return 1;
    const int64_t tiles = make_tiles(token_rows, context_lens, tokens, tile, starts);
#ifdef FOLIO_HAVE_VEC
    if (vector) {
        /* As many KV heads a task as the stack holds for the longest tile, split
         * further while there are too few tasks for the threads. */
        int longest = 1;
        for (int64_t i = 0; i < tiles; i++)
            longest = starts[i + 1] - starts[i] > longest ? (int)(starts[i + 1] - starts[i]) : longest;
        chunk = FOLIO_TASK_VECTORS / (per_head * longest);
        if (chunk < 1) chunk = 1;
        if (chunk > num_kv_heads) chunk = num_kv_heads;
        while (chunk > 1 && tiles * ((num_kv_heads + chunk - 1) / chunk) < 4 * num_threads)
            chunk = (chunk + 1) / 2;
        if (max_ctx < block_size) max_ctx = block_size;    /* scores of one block */
    }
#endif
    const int64_t per_tile = (num_kv_heads + chunk - 1) / chunk;
    /* Few tasks for the threads (a decode step of one or two sequences: a task
     * per KV head, 3 of them on 2 threads leave one idle a third of the time):
     * each task's context split into shares of at least FOLIO_SHARE_BLOCKS
     * blocks, their partial softmax sums (m, l and the unnormalized values)
     * merged after. Single-token tiles only. */
    int64_t shares = 1, share_blocks = 0;
    (void)share_blocks;
#ifdef FOLIO_HAVE_VEC
    /* (not for a windowed layer: its shares would lie mostly before the window) */
    if (folio_splits && vector && window <= 0 && tiles == tokens
            && tiles * per_tile < 4 * num_threads && num_threads > 1) {
        const int64_t blocks = (max_ctx + block_size - 1) / block_size;
        shares = (4 * num_threads + tiles * per_tile - 1) / (tiles * per_tile);
        if (shares > blocks / FOLIO_SHARE_BLOCKS) shares = blocks / FOLIO_SHARE_BLOCKS;
        if (shares < 1) shares = 1;
        share_blocks = (blocks + shares - 1) / shares;
        shares = (blocks + share_blocks - 1) / share_blocks;
    }
#endif
    const int64_t tasks = tiles * per_tile * shares;
    /* each share's queries: [tasks][chunk * group][head_dim + 2] */
    float *parts = 0;
    if (shares > 1) {
        parts = malloc(sizeof(float) * (size_t)(tasks * chunk * group * (head_dim + 2)));
        if (!parts) {
            free(starts);
            return 1;
        }
    }
    /* scratch: the portable path keeps a whole context of scores per query; the
     * vector path one block of scores per query of a task */
    size_t scratch = (size_t)(group * max_ctx + 2 * group * head_dim + 4 * head_dim);
#ifdef FOLIO_HAVE_VEC
    if (vector) scratch = (size_t)(FOLIO_TASK_VECTORS + head_dim) * block_size;
#endif
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * scratch);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (!scores) continue;
            const int64_t tl = task / shares / per_tile, share = task % shares;
            const int kvh0 = (int)(task / shares % per_tile) * chunk;
            const int kvh1 = kvh0 + chunk < num_kv_heads ? kvh0 + chunk : num_kv_heads;
            const int64_t t0 = starts[tl];
            const int ntok = (int)(starts[tl + 1] - t0);
            (void)share;
            const int64_t *table = block_tables + token_rows[t0] * max_blocks;
#ifdef FOLIO_HAVE_VEC
            if (vector) {
                if (parts)
                    task_vec_any(q, q_stride, kv, out, table, context_lens + t0, ntok, t0, kvh0,
                                 kvh1, num_heads, num_kv_heads, head_dim, block_size,
                                 num_blocks, scale, dtype, kv_dtype, scores,
                                 share * share_blocks,
                                 (share + 1) * share_blocks,
                                 parts + task * chunk * group * (head_dim + 2), window);
                else
                    task_vec_any(q, q_stride, kv, out, table, context_lens + t0, ntok, t0, kvh0,
                                 kvh1, num_heads, num_kv_heads, head_dim, block_size,
                                 num_blocks, scale, dtype, kv_dtype, scores, 0, INT64_MAX, 0,
                                 window);
                continue;
            }
#endif
            (void)ntok;
            (void)kvh1;          /* the portable task: one token, one KV head */
            float *qbuf = scores + group * max_ctx;
            float *acc = qbuf + group * head_dim;
            float *row = acc + group * head_dim;
            const int64_t c = context_lens[t0];
            one_task(q, t0 * q_stride, kv, out, t0 * (int64_t)num_heads * head_dim, table,
                     c, window > 0 && c > window ? c - window : 0, kvh0, num_heads,
                     num_kv_heads, head_dim, block_size, num_blocks, scale, dtype, kv_dtype,
                     scores, qbuf,
                     acc, row);
        }
        free(scores);
#ifdef FOLIO_HAVE_VEC
        if (parts) {
            /* merge the shares of each (token, query head): after the loop's barrier */
            const int64_t queries = tokens * num_heads;
#pragma omp for schedule(static)
            for (int64_t qi = 0; qi < queries; qi++) {
                const int64_t t = qi / num_heads;
                const int head = (int)(qi % num_heads), kvh = head / group;
                const int64_t first = (t * per_tile + kvh / chunk) * shares;
                const int64_t row = (int64_t)(kvh % chunk) * group + head % group;
                const int64_t width = (int64_t)chunk * group * (head_dim + 2);
                float mmax = -FLT_MAX, lsum = 0.f;
                for (int64_t sh = 0; sh < shares; sh++) {
                    const float *pm = parts + (first + sh) * width + row * (head_dim + 2);
                    if (pm[head_dim + 1] > 0.f && pm[head_dim] > mmax) mmax = pm[head_dim];
                }
                float merged[FOLIO_MAX_DIM];
                for (int d = 0; d < head_dim; d++) merged[d] = 0.f;
                for (int64_t sh = 0; sh < shares; sh++) {
                    const float *pm = parts + (first + sh) * width + row * (head_dim + 2);
                    if (!(pm[head_dim + 1] > 0.f)) continue;       /* saw no key */
                    const float w = expf(pm[head_dim] - mmax);
                    lsum += w * pm[head_dim + 1];
                    for (int d = 0; d < head_dim; d++) merged[d] += w * pm[d];
                }
                const float inv = 1.f / lsum;
                const int64_t o = qi * head_dim;
                if (dtype == 0)
                    for (int d = 0; d < head_dim; d++) ((float *)out)[o + d] = merged[d] * inv;
                else
                    for (int d = 0; d < head_dim; d++)
                        ((uint16_t *)out)[o + d] = float_to_bf16(merged[d] * inv);
            }
        }
#endif
    }
    free(parts);
    free(starts);
    (void)vector;
    return failed;
}

int folio_paged_attention(const void *q, int64_t q_stride, const void *kv, void *out,
                          const int64_t *block_tables, int64_t max_blocks,
                          const int64_t *token_rows, const int64_t *context_lens, int64_t tokens,
                          int num_heads, int num_kv_heads, int head_dim, int block_size,
                          int64_t num_blocks, float scale, int dtype, int kv_dtype,
                          int num_threads) {
    return paged_attention(q, q_stride, kv, out, block_tables, max_blocks, token_rows,
                           context_lens, tokens, num_heads, num_kv_heads, head_dim, block_size,
                           num_blocks, scale, dtype, kv_dtype, num_threads, 0);
}

/* The same for a sliding-window layer: each token sees its last `window` keys. */
int folio_paged_attention_window(const void *q, int64_t q_stride, const void *kv, void *out,
                                 const int64_t *block_tables, int64_t max_blocks,
                                 const int64_t *token_rows, const int64_t *context_lens,
                                 int64_t tokens, int num_heads, int num_kv_heads, int head_dim,
                                 int block_size, int64_t num_blocks, float scale, int dtype,
                                 int kv_dtype, int num_threads, int64_t window) {
    return paged_attention(q, q_stride, kv, out, block_tables, max_blocks, token_rows,
                           context_lens, tokens, num_heads, num_kv_heads, head_dim, block_size,
                           num_blocks, scale, dtype, kv_dtype, num_threads, window);
}
