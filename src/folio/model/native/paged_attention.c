/* Paged decode attention for the CPU: one query token per sequence, keys and
 * values read in place through the block table (no gathered copy).
 *
 * Layout (see backend.py): kv_cache [2][num_blocks][block_size][num_kv_heads][head_dim],
 * q and out [num_seqs][num_heads][head_dim], block_tables [num_seqs][max_blocks] int64,
 * context_lens [num_seqs] int64. Scores, softmax and the weighted sum of values are
 * accumulated in fp32; dtype 0 is float32, 1 is bfloat16.
 * One task per (sequence, KV head) serves that head's whole query group (GQA).
 *
 * Two implementations of a task:
 * - with AVX-512 (head_dim a multiple of 16): one pass over the blocks with an
 *   online softmax (running max and sum per query), vector exp, and the next
 *   block's keys and values prefetched while this one is computed. Decode
 *   attention reads every cached key and value once and does little arithmetic
 *   on each, so it is bound by memory latency: the prefetch is what matters.
 * - portable C otherwise: scores, softmax, then values, in three passes.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* Load n elements of the given dtype as floats. */
static inline void load_row(const void *base, int64_t index, int dtype, int n, float *dst) {
    if (dtype == 0) {
        memcpy(dst, (const float *)base + index, (size_t)n * sizeof(float));
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

static void one_task(const void *q, const void *kv, void *out, const int64_t *table,
                     int64_t ctx, int64_t seq, int kvh, int num_heads, int num_kv_heads,
                     int head_dim, int block_size, int64_t num_blocks, float scale, int dtype,
                     float *scores, float *qbuf, float *acc, float *row) {
    const int group = num_heads / num_kv_heads;
    const int64_t stride = (int64_t)num_kv_heads * head_dim;   /* between tokens of a block */
    const int64_t v_offset = num_blocks * block_size * stride;
    const int64_t nblk = (ctx + block_size - 1) / block_size;
    for (int g = 0; g < group; g++)
        load_row(q, (seq * num_heads + kvh * group + g) * head_dim, dtype, head_dim,
                 qbuf + g * head_dim);
    for (int64_t b = 0; b < nblk; b++) {
        int64_t p0 = b * block_size;
        int64_t rows = ctx - p0 < block_size ? ctx - p0 : block_size;
        int64_t first = table[b] * block_size * stride + (int64_t)kvh * head_dim;
        block_scores(kv, first, rows, stride, dtype, group, head_dim, qbuf, scale, row,
                     scores, ctx, p0);
    }
    for (int g = 0; g < group; g++) {
        float *sg = scores + g * ctx, m = -FLT_MAX, sum = 0.f;
        for (int64_t p = 0; p < ctx; p++) m = sg[p] > m ? sg[p] : m;
#pragma omp simd reduction(+:sum)
        for (int64_t p = 0; p < ctx; p++) { sg[p] = expf(sg[p] - m); sum += sg[p]; }
        float inv = 1.f / sum;
        for (int64_t p = 0; p < ctx; p++) sg[p] *= inv;
    }
    memset(acc, 0, sizeof(float) * group * head_dim);
    for (int64_t b = 0; b < nblk; b++) {
        int64_t p0 = b * block_size;
        int64_t rows = ctx - p0 < block_size ? ctx - p0 : block_size;
        int64_t first = v_offset + table[b] * block_size * stride + (int64_t)kvh * head_dim;
        for (int64_t r = 0; r < rows; r++) {
            load_row(kv, first + r * stride, dtype, head_dim, row);
            for (int g = 0; g < group; g++) {
                float w = scores[g * ctx + p0 + r];
                float *ag = acc + g * head_dim;
#pragma omp simd
                for (int d = 0; d < head_dim; d++) ag[d] += w * row[d];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        int64_t o = (seq * num_heads + kvh * group + g) * head_dim;
        if (dtype == 0) {
            memcpy((float *)out + o, acc + g * head_dim, sizeof(float) * head_dim);
        } else {
            for (int d = 0; d < head_dim; d++)
                ((uint16_t *)out)[o + d] = float_to_bf16(acc[g * head_dim + d]);
        }
    }
}


#if defined(__AVX512F__)
#include <immintrin.h>
#define FOLIO_HAVE_AVX512 1

/* 16 values at base[index] as fp32. */
static inline __m512 load16(const void *base, int64_t index, int dtype) {
    if (dtype == 0) return _mm512_loadu_ps((const float *)base + index);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* e^x for x <= 0 (scores minus their running max), about 2 ulp: x = n ln2 + r,
 * a degree-6 polynomial in r, scaled by 2^n. Below -87 the result is 0. */
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

static inline void prefetch_rows(const void *kv, int64_t first, int64_t rows, int64_t stride,
                                 int row_bytes, int elt) {
    const char *base = (const char *)kv + first * elt;
    for (int64_t r = 0; r < rows; r++)
        for (int off = 0; off < row_bytes; off += 64)
            __builtin_prefetch(base + r * stride * elt + off, 0, 1);   /* to L2: measured best */
}

/* A task's queries are a run of KV heads with their query groups: up to this many
 * 16-float vectors of queries (and as many of accumulators) live on its stack. */
#define FOLIO_TASK_VECTORS 64

/* Queries q_i (i < nq, scale folded in) against `rows` keys at kfirst + r * stride. */
static inline void block_scores16(const void *kv, int64_t kfirst, int64_t rows, int64_t stride,
                                  int dtype, int nv, int nq, const __m512 *qv, float *scores,
                                  int block_size) {
    for (int64_t r = 0; r < rows; r++) {
        __m512 k[FOLIO_TASK_VECTORS];
        for (int j = 0; j < nv; j++) k[j] = load16(kv, kfirst + r * stride + 16 * j, dtype);
        for (int i = 0; i < nq; i++) {
            const __m512 *qi = qv + i * nv;
            __m512 a = _mm512_mul_ps(qi[0], k[0]);
            for (int j = 1; j < nv; j++) a = _mm512_fmadd_ps(qi[j], k[j], a);
            scores[i * block_size + r] = _mm512_reduce_add_ps(a);
        }
    }
}

/* Online softmax over one block's scores of one query: exponentiates them in
 * place against the new running max, and returns the factor that rescales
 * what was accumulated before. */
static inline float block_softmax16(float *s, int64_t rows, float *m, float *l) {
    float bmax = -FLT_MAX;
    for (int64_t r = 0; r < rows; r++) bmax = s[r] > bmax ? s[r] : bmax;
    float mnew = bmax > *m ? bmax : *m;
    float corr = expf(*m - mnew), sum = 0.f;
    *m = mnew;
    for (int64_t r = 0; r < rows; r += 16) {
        __mmask16 mask = rows - r >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (rows - r)) - 1);
        __m512 x = _mm512_maskz_loadu_ps(mask, s + r);
        __m512 p = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(x, _mm512_set1_ps(mnew))));
        _mm512_mask_storeu_ps(s + r, mask, p);
        sum += _mm512_reduce_add_ps(p);
    }
    *l = *l * corr + sum;
    return corr;
}

static inline __attribute__((always_inline)) void task_avx512(
        const void *q, const void *kv, void *out, const int64_t *table, int64_t ctx,
        int64_t seq, int kvh0, int kvh1, int num_heads, int num_kv_heads, const int head_dim,
        int block_size, int64_t num_blocks, float scale, int dtype, float *scores) {
    const int group = num_heads / num_kv_heads;
    const int nv = head_dim / 16;
    const int nq = (kvh1 - kvh0) * group;          /* queries of this task */
    const int elt = dtype == 0 ? 4 : 2;
    const int64_t stride = (int64_t)num_kv_heads * head_dim;
    const int64_t v_offset = num_blocks * block_size * stride;
    const int64_t nblk = (ctx + block_size - 1) / block_size;
    const int64_t q0 = (seq * num_heads + (int64_t)kvh0 * group) * head_dim;
    /* the task's heads are adjacent in every cached row: one span per row */
    const int span = (kvh1 - kvh0) * head_dim * elt;
    __m512 qv[FOLIO_TASK_VECTORS], acc[FOLIO_TASK_VECTORS];
    float m[FOLIO_TASK_VECTORS], l[FOLIO_TASK_VECTORS];
    for (int i = 0; i < nq; i++) {
        for (int j = 0; j < nv; j++) {
            qv[i * nv + j] = _mm512_mul_ps(load16(q, q0 + i * head_dim + 16 * j, dtype),
                                           _mm512_set1_ps(scale));
            acc[i * nv + j] = _mm512_setzero_ps();
        }
        m[i] = -FLT_MAX;
        l[i] = 0.f;
    }
    for (int64_t b = 0; b < nblk; b++) {
        const int64_t p0 = b * block_size;
        const int64_t rows = ctx - p0 < block_size ? ctx - p0 : block_size;
        const int64_t base = table[b] * block_size * stride + (int64_t)kvh0 * head_dim;
        for (int64_t ahead = b + 1; ahead <= b + 2 && ahead < nblk; ahead++) {
            int64_t next = table[ahead] * block_size * stride + (int64_t)kvh0 * head_dim;
            int64_t left = ctx - ahead * block_size;
            int64_t nrows = left < block_size ? left : block_size;
            prefetch_rows(kv, next, nrows, stride, span, elt);
            prefetch_rows(kv, v_offset + next, nrows, stride, span, elt);
        }
        for (int h = 0; h < kvh1 - kvh0; h++) {
            const int64_t kfirst = base + (int64_t)h * head_dim;
            const __m512 *qh = qv + h * group * nv;
            __m512 *ah = acc + h * group * nv;
            block_scores16(kv, kfirst, rows, stride, dtype, nv, group, qh, scores, block_size);
            for (int g = 0; g < group; g++) {
                int i = h * group + g;
                float corr = block_softmax16(scores + g * block_size, rows, m + i, l + i);
                if (corr != 1.f)
                    for (int j = 0; j < nv; j++)
                        ah[g * nv + j] = _mm512_mul_ps(ah[g * nv + j], _mm512_set1_ps(corr));
            }
            for (int64_t r = 0; r < rows; r++) {
                __m512 v[FOLIO_TASK_VECTORS];
                for (int j = 0; j < nv; j++)
                    v[j] = load16(kv, v_offset + kfirst + r * stride + 16 * j, dtype);
                for (int g = 0; g < group; g++) {
                    __m512 w = _mm512_set1_ps(scores[g * block_size + r]);
                    for (int j = 0; j < nv; j++)
                        ah[g * nv + j] = _mm512_fmadd_ps(w, v[j], ah[g * nv + j]);
                }
            }
        }
    }
    for (int i = 0; i < nq; i++) {
        __m512 inv = _mm512_set1_ps(1.f / l[i]);
        for (int j = 0; j < nv; j++) {
            __m512 x = _mm512_mul_ps(acc[i * nv + j], inv);
            int64_t o = q0 + i * head_dim + 16 * j;
            if (dtype == 0) {
                _mm512_storeu_ps((float *)out + o, x);
            } else {
                float tmp[16];
                _mm512_storeu_ps(tmp, x);
                for (int d = 0; d < 16; d++) ((uint16_t *)out)[o + d] = float_to_bf16(tmp[d]);
            }
        }
    }
}

static void task_avx512_any(const void *q, const void *kv, void *out, const int64_t *table,
                            int64_t ctx, int64_t seq, int kvh0, int kvh1, int num_heads,
                            int num_kv_heads, int head_dim, int block_size, int64_t num_blocks,
                            float scale, int dtype, float *scores) {
    /* constant head_dim for the common sizes so the loops over it unroll */
    if (head_dim == 64)
        task_avx512(q, kv, out, table, ctx, seq, kvh0, kvh1, num_heads, num_kv_heads, 64,
                    block_size, num_blocks, scale, dtype, scores);
    else if (head_dim == 128)
        task_avx512(q, kv, out, table, ctx, seq, kvh0, kvh1, num_heads, num_kv_heads, 128,
                    block_size, num_blocks, scale, dtype, scores);
    else
        task_avx512(q, kv, out, table, ctx, seq, kvh0, kvh1, num_heads, num_kv_heads, head_dim,
                    block_size, num_blocks, scale, dtype, scores);
}
#endif

int folio_paged_decode(const void *q, const void *kv, void *out, const int64_t *block_tables,
                       const int64_t *context_lens, int64_t num_seqs, int64_t max_blocks,
                       int num_heads, int num_kv_heads, int head_dim, int block_size,
                       int64_t num_blocks, float scale, int dtype, int num_threads) {
    int64_t max_ctx = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        max_ctx = context_lens[s] > max_ctx ? context_lens[s] : max_ctx;
    const int group = num_heads / num_kv_heads;
    /* A task is a sequence and a run of `chunk` KV heads. The portable path
     * takes one head a task; the vector one takes as many as its stack holds,
     * and splits them only when there are too few sequences for the threads. */
    int chunk = 1, vector = 0;
#ifdef FOLIO_HAVE_AVX512
    vector = head_dim % 16 == 0 && group * (head_dim / 16) <= FOLIO_TASK_VECTORS;
    if (vector) {
        chunk = FOLIO_TASK_VECTORS / (group * (head_dim / 16));
        if (chunk > num_kv_heads) chunk = num_kv_heads;
        while (chunk > 1 && num_seqs * ((num_kv_heads + chunk - 1) / chunk) < 4 * num_threads)
            chunk = (chunk + 1) / 2;
        if (max_ctx < block_size) max_ctx = block_size;    /* scores of one block */
    }
#endif
    const int64_t per_seq = (num_kv_heads + chunk - 1) / chunk;
    const int64_t tasks = num_seqs * per_seq;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * max_ctx + 2 * group * head_dim + 4 * head_dim));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            if (!scores) continue;
            int64_t seq = t / per_seq;
            int kvh0 = (int)(t % per_seq) * chunk;
            int kvh1 = kvh0 + chunk < num_kv_heads ? kvh0 + chunk : num_kv_heads;
#ifdef FOLIO_HAVE_AVX512
            if (vector) {
                task_avx512_any(q, kv, out, block_tables + seq * max_blocks, context_lens[seq],
                                seq, kvh0, kvh1, num_heads, num_kv_heads, head_dim, block_size,
                                num_blocks, scale, dtype, scores);
                continue;
            }
#endif
            float *qbuf = scores + group * max_ctx;
            float *acc = qbuf + group * head_dim;
            float *row = acc + group * head_dim;
            one_task(q, kv, out, block_tables + seq * max_blocks, context_lens[seq], seq, kvh0,
                     num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale, dtype,
                     scores, qbuf, acc, row);
        }
        free(scores);
    }
    (void)vector;
    return failed;
}
