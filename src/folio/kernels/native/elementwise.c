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
#include <stdlib.h>

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

/* Sampling's exponential race (model/layers/draws.py): each row's draw from
 * its weights, argmax of p / E over the vocabulary, E = -log u and u the
 * row key's uniform for the token, hashed as the torch definition does. A
 * token whose ratio cannot beat the best so far (-log u >= 1 - u, so p / E
 * <= p / (1 - u)) skips the log: after the first few tokens, nearly all. */
static inline uint32_t lowbias32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    return x ^ (x >> 16);
}

void folio_race(const float *probs, const int64_t *keys, int64_t *tokens, int64_t rows,
                int64_t vocab, int num_threads) {
    int threads = rows * vocab >= 4 * FOLIO_PARALLEL_MIN ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *p = probs + r * vocab;
        const uint64_t key = (uint64_t)keys[r];
        const uint32_t lo = (uint32_t)key, hi = (uint32_t)(key >> 32);
        float best = -1.f;
        int64_t best_i = 0;
        for (int64_t v = 0; v < vocab; v++) {
            const float w = p[v];
            if (w <= 0.f && best >= 0.f) continue;
            const uint32_t x = lowbias32(lowbias32((uint32_t)v ^ lo) ^ hi);
            const float u = (float)((x >> 9) * 2u + 1u) * 5.9604644775390625e-08f;
            /* a margin of 2^-20 over the bound covers the log's rounding */
            if (w < best * (1.f - u) * (1.f - 9.5367431640625e-07f)) continue;
            const float ratio = w / -logf(u);
            if (ratio > best) {
                best = ratio;
                best_i = v;
            }
        }
        tokens[r] = best_i;
    }
}

/* Repetition, frequency and presence penalties (model/layers/sampler.py,
 * step 2) read in place from the runner's persistent counts and seen masks
 * (worker/sampling_columns.py): out = logits of row r adjusted by the table
 * row rows[r], with no [rows, V] gather of the tables. */
/* (without -ffast-math's reciprocals and fused multiply-adds: rounded as
 * the torch definition rounds, so the two agree to the bit) */
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")
void folio_penalize(const float *logits, float *out, const float *counts,
                    const uint8_t *seen, const int64_t *rows, const float *presence,
                    const float *frequency, const float *repetition, int64_t n,
                    int64_t vocab, int num_threads) {
    int threads = n * vocab >= 4 * FOLIO_PARALLEL_MIN ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const float *x = logits + r * vocab;
        float *y = out + r * vocab;
        const float *c = counts + rows[r] * vocab;
        const uint8_t *s = seen + rows[r] * vocab;
        const float rep = repetition[r], f = frequency[r], p = presence[r];
        for (int64_t v = 0; v < vocab; v++) {
            float a = x[v];
            if (s[v]) a = a > 0.f ? a / rep : a * rep;
            const float k = c[v];
            a = a - f * k;
            y[v] = k > 0.f ? a - p : a;
        }
    }
}
#pragma GCC pop_options

/* Top-k and top-p (model/layers/sampler.py, steps 7-8) without sorting a row:
 * the k-th largest logit by selection, then the top-p boundary by
 * partitioning the kept tokens around pivots, tracking the mass above (each
 * pass keeps the part that holds the boundary: O(V) a row expected, where a
 * sort is O(V log V)). Tokens out are set to -inf in place. `top_k`: k a row
 * (>= vocab: off) or NULL; `top_p`: p a row (>= 1: off) or NULL. Where
 * tokens tie at a boundary all of them stay (a sort keeps some of them, in
 * whatever order it leaves ties). */
static float kth_largest(float *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, want = k - 1;          /* a[want] once sorted descending */
    while (lo < hi) {
        const float x = a[lo], y = a[(lo + hi) / 2], z = a[hi];
        const float pivot = x > y ? (y > z ? y : (x > z ? z : x)) : (x > z ? x : (y > z ? z : y));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) {
                const float t = a[i];
                a[i++] = a[j];
                a[j--] = t;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return a[want];
    }
    return a[want];
}

void folio_top_k_top_p(float *logits, int64_t rows, int64_t vocab, const int64_t *top_k,
                       const float *top_p, int num_threads) {
    int threads = rows * vocab >= 4 * FOLIO_PARALLEL_MIN ? num_threads : 1;
#pragma omp parallel num_threads(threads)
    {
        float *w = (float *)malloc(sizeof(float) * (size_t)vocab);
        int32_t *idx = (int32_t *)malloc(sizeof(int32_t) * (size_t)vocab);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            float *x = logits + r * vocab;
            float floor_k = -INFINITY;
            const int64_t k = top_k ? top_k[r] : vocab;
            if (k > 0 && k < vocab) {
                for (int64_t v = 0; v < vocab; v++) w[v] = x[v];
                floor_k = kth_largest(w, vocab, k);
            }
            float floor_p = -INFINITY;
            const float p = top_p ? top_p[r] : 1.f;
            if (p < 1.f) {
                float m = -INFINITY;
                for (int64_t v = 0; v < vocab; v++)
                    if (x[v] >= floor_k && x[v] > m) m = x[v];
                int64_t v = 0;
#ifdef FOLIO_HAVE_VEC
                for (; v + FOLIO_VW <= vocab; v += FOLIO_VW)
                    fv_storeu(w + v, fv_exp(fv_sub(fv_load(x, v, 0), fv_set1(m))));
#endif
                for (; v < vocab; v++) w[v] = expf(x[v] - m);
                int64_t n = 0;
                double total = 0.0;
                for (v = 0; v < vocab; v++) {
                    if (x[v] >= floor_k && x[v] > -INFINITY) {
                        total += w[v];
                        idx[n++] = (int32_t)v;
                    }
                }
                const double target = (double)p * total;
                double above = 0.0;                 /* mass of tokens known to stay */
                int32_t *c = idx;
                floor_p = INFINITY;
                while (n > 0) {
                    const float a = w[c[0]], b = w[c[n / 2]], d = w[c[n - 1]];
                    const float pivot = a > b ? (b > d ? b : (a > d ? d : a))
                                              : (a > d ? a : (b > d ? d : b));
                    /* three ways: > pivot to the front, == next, < last */
                    int64_t lt = 0, i = 0, gt = n;
                    double m_hi = 0.0, m_eq = 0.0;
                    while (i < gt) {
                        const float y = w[c[i]];
                        if (y > pivot) {
                            const int32_t t = c[lt];
                            c[lt++] = c[i];
                            c[i++] = t;
                            m_hi += y;
                        } else if (y < pivot) {
                            const int32_t t = c[--gt];
                            c[gt] = c[i];
                            c[i] = t;
                        } else {
                            m_eq += y;
                            i++;
                        }
                    }
                    if (above + m_hi >= target) {   /* the boundary is above the pivot */
                        n = lt;
                    } else if (above + m_hi + m_eq >= target) {
                        floor_p = pivot;            /* the boundary token */
                        break;
                    } else {                        /* all down to the pivot stay */
                        above += m_hi + m_eq;
                        c += gt;
                        n -= gt;
                        /* (none left below: the mass, rounded, fell short of p) */
                        floor_p = n > 0 ? pivot : -INFINITY;
                    }
                }
            }
            for (int64_t v = 0; v < vocab; v++) {
                const int keep = x[v] >= floor_k && (p >= 1.f || (x[v] > -INFINITY
                                 && w[v] >= floor_p));
                if (!keep) x[v] = -INFINITY;
            }
        }
        free(w);
        free(idx);
    }
}

/* An embedding lookup in a table kept in its codes (int_groups.IntGroups's
 * layout, qlinear.c's head says it): out [count][k] (dtype 0 fp32, 1 bf16)
 * = the float rows `rows` of the weight, w = code * scale + offset rounded
 * as IntGroups.dequantize_rows rounds it (a product, then a sum: no fused
 * multiply-add), so the two agree to the bit. One token's row at decode,
 * where the torch ops cost tenths of a millisecond. 1 (nothing written)
 * when a row is outside 0..n-1. */
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")
int folio_dequantize_rows(const int64_t *rows, int64_t count, const int64_t *perm,
                          const uint8_t *codes, int bits, const void *scales,
                          const void *offsets, int zeros, const uint16_t *supers,
                          int64_t per_super, const int32_t *bounds, int64_t groups,
                          int64_t kp, int64_t k, int64_t n, void *out, int dtype,
                          int num_threads) {
    for (int64_t r = 0; r < count; r++)
        if (rows[r] < 0 || rows[r] >= n) return 1;      /* nothing written */
    const int64_t tile_bytes = kp * 2 * bits;
    const int64_t supers_n = supers ? (groups + per_super - 1) / per_super : 0;
    int threads = count * k >= 4 * FOLIO_PARALLEL_MIN ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < count; r++) {
        const int64_t tile = rows[r] / 16, lane = rows[r] % 16;
        const uint8_t *t = codes + tile * tile_bytes;
        char *dst = (char *)out + r * k * (dtype ? 2 : 4);
        for (int64_t g = 0; g < groups; g++) {
            const int64_t at = (tile * groups + g) * 16 + lane;
            float s, o;
            if (supers) {
                const uint16_t *pair = supers + (tile * supers_n + g / per_super) * 32 + lane;
                const int8_t *sc = (const int8_t *)scales;
                s = (float)sc[at] * half_to_float(pair[0]);
                o = (float)(offsets ? (const int8_t *)offsets : sc)[at] * half_to_float(pair[16]);
            } else {
                s = half_to_float(((const uint16_t *)scales)[at]);
                o = half_to_float(((const uint16_t *)offsets)[at]);
                if (zeros) o = -o * s;
            }
            for (int64_t p = bounds[g]; p < bounds[g + 1]; p++) {
                int code;
                const int64_t octet = p / 8, i = p % 8;
                if (bits == 4) {
                    const uint8_t byte = t[octet * 64 + lane * 4 + (i & 3)];
                    code = i < 4 ? byte & 0xf : byte >> 4;
                } else if (bits == 8) {
                    code = t[octet * 128 + (i / 4) * 64 + lane * 4 + (i & 3)];
                } else {            /* 6: a pair of octets' low nibbles, then top bits */
                    const uint8_t *pair = t + (octet / 2) * 192;
                    const int h = (int)(octet & 1), b = (int)(i & 3), upper = i >= 4;
                    const uint8_t low = pair[h * 64 + lane * 4 + b];
                    const int top = (pair[128 + lane * 4 + b] >> (2 * (2 * h + upper))) & 3;
                    code = (upper ? low >> 4 : low & 0xf) | top << 4;
                }
                const int64_t f = perm ? perm[p] : p;
                if (f < 0) continue;
                const float w = (float)code * s + o;
                if (dtype)
                    ((uint16_t *)dst)[f] = float_to_bf16(w);
                else
                    ((float *)dst)[f] = w;
            }
        }
    }
    return 0;
}
#pragma GCC pop_options
