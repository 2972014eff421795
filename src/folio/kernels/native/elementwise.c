/* Fused element-wise layers for the CPU: residual add + RMSNorm, rotary
 * embedding in place, and SiLU-and-multiply. Each replaces several torch ops
 * (and their dispatch, which at decode batch sizes costs more than the
 * arithmetic) with one call.
 *
 * Arithmetic is fp32; every value torch would round to the run dtype between
 * its ops is rounded here at the same point (dtype 0: float32, 1: bfloat16),
 * so results match the torch layers up to the order of a sum. Rows run in
 * parallel only when there is enough work to pay for waking the threads.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "simd.h"

#define FOLIO_PARALLEL_MIN 32768      /* elements */

static inline float load(const void *base, int64_t i, int dtype) {
    return dtype ? bf16_to_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline void store(void *base, int64_t i, float v, int dtype) {
    if (dtype)
        ((uint16_t *)base)[i] = float_to_bf16(v);
    else
        ((float *)base)[i] = v;
}

/* With a residual: residual = x + residual (rounded), then out = norm(residual).
 * Without: out = norm(x). norm(h) = weight * round(h / sqrt(mean(h^2) + eps)). */
void folio_add_rmsnorm(const void *x, void *residual, const void *weight, void *out,
                       int64_t rows, int64_t hidden, float eps, int dtype, int has_residual,
                       int num_threads) {
    int threads = rows * hidden >= FOLIO_PARALLEL_MIN ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * hidden;
        float ss = 0.f;
        if (has_residual) {
#pragma omp simd reduction(+:ss)
            for (int64_t i = 0; i < hidden; i++) {
                float h = round_to(load(x, base + i, dtype) + load(residual, base + i, dtype), dtype);
                store(residual, base + i, h, dtype);
                ss += h * h;
            }
        } else {
#pragma omp simd reduction(+:ss)
            for (int64_t i = 0; i < hidden; i++) {
                float h = load(x, base + i, dtype);
                ss += h * h;
            }
        }
        const void *src = has_residual ? residual : x;
        const float inv = 1.f / sqrtf(ss / (float)hidden + eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) {
            float y = round_to(load(src, base + i, dtype) * inv, dtype);
            store(out, base + i, y * load(weight, i, dtype), dtype);
        }
    }
}

/* RMSNorm in place over each of `heads` heads of each token's row (Qwen3's
 * q_norm / k_norm: one weight [head_dim] for every head), rows row_stride
 * apart: x = weight * round(x / sqrt(mean(x^2) + eps)), as add_rmsnorm. */
void folio_head_rmsnorm(void *x, int64_t tokens, int64_t row_stride, int heads, int head_dim,
                        const void *weight, float eps, int dtype, int num_threads) {
    int threads = tokens * heads * head_dim >= FOLIO_PARALLEL_MIN ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        for (int h = 0; h < heads; h++) {
            const int64_t base = t * row_stride + (int64_t)h * head_dim;
            float ss = 0.f;
#pragma omp simd reduction(+:ss)
            for (int i = 0; i < head_dim; i++) {
                float v = load(x, base + i, dtype);
                ss += v * v;
            }
            const float inv = 1.f / sqrtf(ss / (float)head_dim + eps);
#pragma omp simd
            for (int i = 0; i < head_dim; i++) {
                float y = round_to(load(x, base + i, dtype) * inv, dtype);
                store(x, base + i, y * load(weight, i, dtype), dtype);
            }
        }
    }
}

/* Rotate-half rotary embedding in place on `heads` heads of each token's row
 * (q and k side by side), with cos/sin [tokens][head_dim / 2] in fp32. */
void folio_rotary(void *x, int64_t tokens, int64_t row_stride, int heads, int head_dim,
                  const float *cos_table, const float *sin_table, int dtype, int num_threads) {
    const int half = head_dim / 2;
    int threads = tokens * heads * head_dim >= FOLIO_PARALLEL_MIN ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_table + t * half, *s = sin_table + t * half;
        for (int h = 0; h < heads; h++) {
            const int64_t base = t * row_stride + (int64_t)h * head_dim;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                float a = load(x, base + i, dtype), b = load(x, base + half + i, dtype);
                float lo = a * c[i] - b * s[i], hi = b * c[i] + a * s[i];
                store(x, base + i, lo, dtype);
                store(x, base + half + i, hi, dtype);
            }
        }
    }
}

/* out[r][i] = silu(gate[r][i]) * up[r][i], with gate_up rows [gate | up] of 2 * d. */
void folio_silu_mul(const void *gate_up, void *out, int64_t rows, int64_t d, int dtype,
                    int num_threads) {
    int threads = rows * d >= FOLIO_PARALLEL_MIN ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t in = r * 2 * d, o = r * d;
        int64_t i = 0;
#ifdef FOLIO_HAVE_VEC
        for (; i + FOLIO_VW <= d; i += FOLIO_VW) {
            fvec g = fv_load(gate_up, in + i, dtype);
            fvec e = fv_exp(fv_sub(fv_zero(), g));
            fvec act = fv_round(fv_div(g, fv_add(fv_set1(1.f), e)), dtype);
            fv_store(out, o + i, fv_mul(act, fv_load(gate_up, in + d + i, dtype)), dtype);
        }
#endif
        for (; i < d; i++) {
            float g = load(gate_up, in + i, dtype);
            float act = round_to(g / (1.f + expf(-g)), dtype);
            store(out, o + i, act * load(gate_up, in + d + i, dtype), dtype);
        }
    }
}

/* Greedy sampling of logits [rows][vocab] in the run dtype: the first index of
 * each row's maximum, and its logprob, -log(sum(exp(x - max))) in fp32, in two
 * passes over the row and no [rows][vocab] output (torch's argmax and
 * log_softmax each write one, after a cast of the bf16 logits to fp32). */
void folio_greedy(const void *logits, int64_t *tokens, float *logprobs, int64_t rows,
                  int64_t vocab, int dtype, int num_threads) {
    int threads = rows * vocab >= 4 * FOLIO_PARALLEL_MIN ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t x = r * vocab;
        float m = load(logits, x, dtype), sum = 0.f;
        int64_t i = 0;
#ifdef FOLIO_HAVE_VEC
        fvec mv = fv_set1(m);
        for (; i + FOLIO_VW <= vocab; i += FOLIO_VW) mv = fv_max(mv, fv_load(logits, x + i, dtype));
        m = fv_hmax(mv);
#endif
        for (; i < vocab; i++) m = load(logits, x + i, dtype) > m ? load(logits, x + i, dtype) : m;
        int64_t best = -1;
        i = 0;
#ifdef FOLIO_HAVE_VEC
        for (; i + FOLIO_VW <= vocab; i += FOLIO_VW) {
            const int hit = fv_first_eq(fv_load(logits, x + i, dtype), fv_set1(m));
            if (hit >= 0) {
                best = i + hit;
                break;
            }
        }
#endif
        for (; best < 0 && i < vocab; i++)
            if (load(logits, x + i, dtype) == m) best = i;
        i = 0;
#ifdef FOLIO_HAVE_VEC
        fvec sv = fv_zero();
        for (; i + FOLIO_VW <= vocab; i += FOLIO_VW)
            sv = fv_add(sv, fv_exp(fv_sub(fv_load(logits, x + i, dtype), fv_set1(m))));
        sum = fv_hadd(sv);
#endif
        for (; i < vocab; i++) sum += expf(load(logits, x + i, dtype) - m);
        tokens[r] = best;
        logprobs[r] = -logf(sum);
    }
}
