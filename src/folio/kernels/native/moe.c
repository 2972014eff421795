/* A mixture-of-experts layer's router on the CPU, for a step's tokens in one
 * call: the torch version (layers/moe.py's Router and route) is a product,
 * a softmax, a top-k, a division and casts, six ops of a few microseconds
 * each per MoE layer, which at one token cost more than the arithmetic.
 *
 * For each token x [hidden] (dtype 0: fp32, 1: bf16): logits over the
 * experts = x . router[e] in fp32 (a bf16 run rounds them to bf16, as the
 * bf16 Router does), softmax in fp32, the top_k largest (ties: the lower
 * expert id) in descending order, renormalized over those k where asked,
 * and, unless weights_in_float, rounded to the run dtype (Qwen3-MoE applies
 * its weights in the run dtype, Mixtral in fp32). The module path of a bf16
 * run and the one-call decoder both call this, so they route alike. Built
 * without fast-math, so that NaN logits compare as NaN: the experts left
 * then go in id order, weighted 0, never one twice (a token's rows in
 * decoder.c's grouping are then at most one per expert).
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

#define FOLIO_MAX_EXPERTS 1024

__attribute__((optimize("no-fast-math")))
int folio_moe_route(const void *x, int64_t x_stride, int dtype, const float *router,
                    int experts, int64_t hidden, int64_t tokens, int top_k, int renormalize,
                    int weights_in_float, float *weights, int64_t *ids, int num_threads) {
    if (experts > FOLIO_MAX_EXPERTS || top_k > experts || top_k < 1) return 1;
    const int threads = tokens * experts * hidden >= (1 << 20) ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        float row[hidden], p[FOLIO_MAX_EXPERTS];
        char taken[FOLIO_MAX_EXPERTS] = {0};
        for (int64_t i = 0; i < hidden; i++)
            row[i] = dtype ? bf16_to_float(((const uint16_t *)x)[t * x_stride + i])
                           : ((const float *)x)[t * x_stride + i];
        float top = -INFINITY;
        for (int e = 0; e < experts; e++) {
            const float *w = router + (int64_t)e * hidden;
            float dot = 0.f;
#pragma omp simd reduction(+:dot)
            for (int64_t i = 0; i < hidden; i++)
                dot += row[i] * w[i];
            p[e] = round_to(dot, dtype);
            top = p[e] > top ? p[e] : top;
        }
        float sum = 0.f;
        for (int e = 0; e < experts; e++) {
            p[e] = expf(p[e] - top);
            sum += p[e];
        }
        float *wt = weights + t * top_k, chosen = 0.f;
        int64_t *id = ids + t * top_k;
        for (int j = 0; j < top_k; j++) {     /* k passes: k and the experts are few */
            int best = -1;
            for (int e = 0; e < experts; e++)
                if (!taken[e] && p[e] >= 0.f && (best < 0 || p[e] > p[best])) best = e;
            if (best < 0) {                   /* NaN probabilities: the next free id, 0 */
                for (best = 0; taken[best]; best++) {}
                taken[best] = 1;
                id[j] = best;
                wt[j] = 0.f;
                continue;
            }
            taken[best] = 1;
            id[j] = best;
            wt[j] = p[best] / sum;
            chosen += wt[j];
        }
        for (int j = 0; j < top_k; j++) {
            if (renormalize) wt[j] /= chosen;
            if (!weights_in_float) wt[j] = round_to(wt[j], dtype);
        }
    }
    return 0;
}
