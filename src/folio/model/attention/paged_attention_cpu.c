/* Paged decode attention for the CPU: one query token per sequence, keys and
 * values read in place through the block table (no gathered copy).
 *
 * Layout (see backend.py): kv_cache [2][num_blocks][block_size][num_kv_heads][head_dim],
 * q and out [num_seqs][num_heads][head_dim], block_tables [num_seqs][max_blocks] int64,
 * context_lens [num_seqs] int64. Scores, softmax and the weighted sum of values are
 * accumulated in fp32; dtype 0 is float32, 1 is bfloat16.
 * One task per (sequence, KV head) serves that head's whole query group (GQA).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7fff + ((bits >> 16) & 1);   /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

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

int folio_paged_decode(const void *q, const void *kv, void *out, const int64_t *block_tables,
                       const int64_t *context_lens, int64_t num_seqs, int64_t max_blocks,
                       int num_heads, int num_kv_heads, int head_dim, int block_size,
                       int64_t num_blocks, float scale, int dtype, int num_threads) {
    int64_t max_ctx = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        max_ctx = context_lens[s] > max_ctx ? context_lens[s] : max_ctx;
    const int group = num_heads / num_kv_heads;
    const int64_t tasks = num_seqs * num_kv_heads;
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
            int64_t seq = t / num_kv_heads;
            int kvh = (int)(t % num_kv_heads);
            float *qbuf = scores + group * max_ctx;
            float *acc = qbuf + group * head_dim;
            float *row = acc + group * head_dim;
            one_task(q, kv, out, block_tables + seq * max_blocks, context_lens[seq], seq, kvh,
                     num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale, dtype,
                     scores, qbuf, acc, row);
        }
        free(scores);
    }
    return failed;
}
