/* Every decoder layer of a Llama-family model for one step, in one call: the
 * same native kernels the torch modules call one by one (residual add +
 * RMSNorm, the linear layer, Qwen3's per-head q/k norms, rotary, paged attention,
 * SiLU-and-multiply), in
 * the same order on the same buffers; what goes is the Python between them
 * (module calls, tensor allocations, the KV write as two index_copy_ calls),
 * which at decode batch sizes cost about a quarter of a step (measured in
 * docs/benchmarks.md).
 *
 * Two kinds, one tensor-parallel rank each:
 * - dtype 1: bf16 activations and KV cache, weights packed for folio_linear
 *   (AVX512-BF16); bit-identical to the module path, which calls the same
 *   kernels.
 * - dtype 0: fp32 activations and KV cache, bf16-stored weights packed for
 *   folio_linear_bf16w (AVX2 + FMA). The module path keeps torch's fp32
 *   element-wise ops there, so the two agree to fp32 rounding, not bit for bit.
 * - quantized: 4-, 6- or 8-bit weights (folio_qweight, for folio_qlinear), with
 *   bf16 or fp32 activations, in the mode the modules' layers take
 *   (quantize_x: int8 at decode batch sizes, else int16 for bf16 and float for
 *   fp32); the element-wise kernels as for the dtype.
 * - fp8: e4m3 weights (folio_fp8weight, for folio_fp8_linear) with fp32
 *   activations, the element-wise kernels as for fp32.
 * LoRA adapters (lora.c) run after each projection that has slots, over the
 * step's runs of rows of one adapter, as the modules' layers run them.
 * A mixture-of-experts layer (Mixtral, Qwen3-MoE) runs its router (moe.c)
 * and each chosen expert once on all of the step's rows that chose it, as
 * layers/moe.py's fused_experts does (moe_block).
 * The final norm and the LM head stay in torch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

void folio_add_rmsnorm(const void *x, void *residual, const void *weight, void *out,
                       int64_t rows, int64_t hidden, float eps, int dtype, int has_residual,
                       int num_threads);
void folio_rotary(void *x, int64_t tokens, int64_t row_stride, int heads, int head_dim,
                  const float *cos_table, const float *sin_table, int dtype, int num_threads);
void folio_head_rmsnorm(void *x, int64_t tokens, int64_t row_stride, int heads, int head_dim,
                        const void *weight, float eps, int dtype, int num_threads);
void folio_silu_mul(const void *gate_up, void *out, int64_t rows, int64_t d, int dtype,
                    int num_threads);
void folio_linear(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                  const uint16_t *bias, uint16_t *out, int64_t m, int64_t n, int64_t k,
                  int num_threads);
void folio_linear_bf16w(const float *x, int64_t x_stride, const uint16_t *packed,
                        const float *bias, float *out, int64_t m, int64_t n, int64_t k,
                        int num_threads);
int folio_qlinear(const void *x, int64_t x_stride, int dtype, const int64_t *perm,
                  const uint8_t *codes, int bits, const uint16_t *scales,
                  const uint16_t *offsets, int zeros, const uint16_t *supers,
                  int64_t per_super, const int32_t *bounds, int64_t groups,
                  const float *bias, void *out, int64_t m, int64_t n, int64_t kp,
                  int quantize_x, int num_threads);
int folio_fp8_linear(const float *x, int64_t x_stride, const uint8_t *codes, const float *scales,
                     int64_t bk, const float *bias, float *out, int64_t m, int64_t n, int64_t k,
                     int num_threads);
int folio_lora(const void *x, int64_t x_stride, void *y, int64_t y_stride, int dtype,
               const void *at, const void *bt, int w_dtype, const int64_t *runs, int64_t nruns,
               int64_t in, int64_t out, int64_t width, int num_threads);
int folio_moe_route(const void *x, int64_t x_stride, int dtype, const float *router,
                    int experts, int64_t hidden, int64_t tokens, int top_k, int renormalize,
                    int weights_in_float, float *weights, int64_t *ids, int num_threads);
int folio_paged_attention_window(const void *q, int64_t q_stride, const void *kv, void *out,
                                 const int64_t *block_tables, int64_t max_blocks,
                                 const int64_t *token_rows, const int64_t *context_lens,
                                 int64_t tokens, int num_heads, int num_kv_heads, int head_dim,
                                 int block_size, int64_t num_blocks, float scale, int dtype,
                                 int kv_dtype, int num_threads, int64_t window);

/* A quantized projection: what folio_qlinear reads (int_groups.py's layout);
 * or one run of its output features (`rows` of them) held in a form of its
 * own, followed by the next run's (a RowParts: a fused GGUF layer whose parts
 * are of different types). */
typedef struct folio_qweight {
    const int64_t *perm;
    const uint8_t *codes;
    const uint16_t *scales, *offsets, *supers;
    const int32_t *bounds;
    int64_t groups, positions, per_super;
    int bits, zeros;
    const struct folio_qweight *next;         /* NULL: the last (or only) run */
    int64_t rows;
} folio_qweight;

/* An fp8 projection: what folio_fp8_linear reads (native.pack_fp8_linear's
 * tiles of codes and scales, `block` inputs a scale). */
typedef struct {
    const uint8_t *codes;
    const float *scales;
    int64_t block;
} folio_fp8weight;

/* A MoE layer in place of the MLP: its router's weight in fp32 and each
 * expert's two projections as `linear` takes a weight (w13: gate rows then
 * up rows, [2 * intermediate][hidden]; w2: [hidden][intermediate]). */
typedef struct {
    const float *router;                      /* [experts][hidden] */
    const void *const *w13, *const *w2;       /* [experts] */
    int64_t intermediate;
    int experts, top_k, renormalize, weights_in_float;
} folio_moe;

/* One layer's weights: norms [hidden] and the qkv bias (or NULL: no other
 * projection has one here) in the activations' dtype (fp32 for quantized
 * projections); projections packed for the step's linear kernel (quantized:
 * each a folio_qweight); its KV cache [2][num_blocks][block_size][kv_heads]
 * [head_dim], in the step's kv_dtype; Qwen3's per-head norms of q and k
 * [head_dim] in the activations' dtype, or NULL; each projection's LoRA
 * slots (qkv, o, gate_up, down: lora.c's at and bt, and their width), or NULL;
 * a checkpoint's static scales of keys and values, which an fp8 cache takes
 * (one per KV head; NULL: each row's own). */
typedef struct {
    const void *input_norm, *post_norm;
    const void *qkv, *qkv_bias, *o, *gate_up, *down;
    void *kv_cache;
    const void *q_norm, *k_norm;
    const void *lora_at[4], *lora_bt[4];
    int64_t lora_width[4];
    const float *kv_scale[2];                 /* a checkpoint's fp8 scales of keys and
                                                 values, one per KV head; NULL: each
                                                 row's own */
    const folio_moe *moe;                     /* NULL: a dense MLP (gate_up, down) */
    int64_t window;                           /* > 0: the keys a token sees (its last
                                                 `window`: Mistral's sliding window) */
} folio_layer;

/* The model's sizes and the step: hidden [tokens][hidden] in (the embeddings),
 * the last layer's output out; residual [tokens][hidden] written; scratch
 * buffers sized for this step's tokens; all in the step's dtype. */
typedef struct {
    int64_t tokens, hidden, intermediate;
    int heads, kv_heads, head_dim, block_size;
    int64_t num_blocks;
    float eps, scale;
    const float *cos, *sin;                   /* [tokens][head_dim / 2] */
    const int64_t *slots;                     /* [tokens] */
    const int64_t *block_tables;              /* [rows][max_blocks] */
    int64_t max_blocks;
    const int64_t *token_rows, *context_lens; /* [tokens] */
    void *hidden_states, *residual;
    void *normed, *qkv, *attn, *gate_up, *act;
    int num_threads;
    int dtype;                                /* 1: bf16 / folio_linear, 0: fp32 / bf16w */
    int quantized;                            /* 1: folio_qweight projections,
                                                 2: folio_fp8weight ones (fp32) */
    int quantize_x;                           /* their folio_qlinear mode */
    int kv_dtype;                             /* the KV cache's: 0 fp32, 1 bf16, 2 int8, 3 fp8 */
    const int64_t *lora_runs;                 /* [lora_nruns][3]: slot, first row, end */
    int64_t lora_nruns;
    int lora_dtype;                           /* the LoRA slots': 0 fp32, 1 bf16 */
    int residual_in;                          /* 1: residual holds the stream so far (a
                                                 pipeline stage after the first) */
} folio_step;

/* n elements of a key or value row from the activations (dtype) into the
 * cache (kv_dtype): copied, or an fp32 row rounded to bf16 (nearest even, as
 * torch's cast); a cache is never wider than its run (build_config). */
static void store_kv(void *dst, const void *src, int64_t n, int dtype, int kv_dtype) {
    if (dtype == kv_dtype) {
        memcpy(dst, src, (size_t)n * (dtype ? sizeof(uint16_t) : sizeof(float)));
        return;
    }
    for (int64_t i = 0; i < n; i++)
        ((uint16_t *)dst)[i] = float_to_bf16(((const float *)src)[i]);
}

/* x (at most 448 in size) rounded to an fp8 e4m3's byte, to nearest even as
 * torch's float8_e4m3fn cast rounds. */
__attribute__((optimize("no-fast-math")))
static uint8_t to_e4m3(float x) {
    const uint8_t sign = signbit(x) ? 0x80 : 0;
    const float a = fabsf(x);
    if (a < 0x1p-6f)                        /* subnormal steps of 2^-9 (8: the first normal) */
        return sign | (uint8_t)nearbyintf(a * 512.f);
    uint32_t bits;
    memcpy(&bits, &a, sizeof bits);
    bits += 0x7ffff + ((bits >> 20) & 1);   /* 23 mantissa bits to 3, ties to even */
    const int e = (int)(bits >> 23) - 127 + 7;
    return sign | (uint8_t)((e << 3) | ((bits >> 20) & 7));
}

/* 16 lanes of GCC's vector extensions: AVX-512 registers where the CPU has
 * them, two AVX2 ones (or scalars) elsewhere. */
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

/* 16 values x * inv, clamped to +-largest, as int8 steps or e4m3 bytes (kv_dtype
 * 2 or 3) into out: what the scalar loop below makes, bit for bit (the
 * roundings to nearest even by adding and taking away 1.5 * 2^23, exact in
 * fp32 for these magnitudes, hence no fast-math here), 16 at a time: the
 * scalar e4m3 rounding was ~2% of a prefill-heavy run. */
/* a where mask m (all ones) is set, else b, bit for bit */
#define select16(m, a, b) (((a) & (m)) | ((b) & ~(m)))

__attribute__((optimize("no-fast-math")))
static void steps16(const float *x, float inv, float largest, int kv_dtype, uint8_t *out) {
    f32x16 v;
    memcpy(&v, x, sizeof v);
    v = v * inv;
    const f32x16 hi = (f32x16){0} + largest, lo = (f32x16){0} - largest;
    v = (f32x16)select16(v > hi, (i32x16)hi, (i32x16)v);
    v = (f32x16)select16(v < lo, (i32x16)lo, (i32x16)v);
    const f32x16 magic = (f32x16){0} + 12582912.0f;               /* 1.5 * 2^23 */
    i32x16 code;
    if (kv_dtype == 2) {
        code = __builtin_convertvector((v + magic) - magic, i32x16);
    } else {
        u32x16 bits;
        memcpy(&bits, &v, sizeof bits);
        const u32x16 sign = (bits >> 24) & 0x80;
        const u32x16 abits = bits & 0x7fffffff;
        f32x16 a;
        memcpy(&a, &abits, sizeof a);
        /* subnormal steps of 2^-9 below 2^-6 (8: the first normal's code) */
        const i32x16 sub = __builtin_convertvector((a * 512.f + magic) - magic, i32x16);
        /* 23 mantissa bits to 3, ties to even; the exponent rebiased to 7 */
        const u32x16 r = abits + 0x7ffff + ((abits >> 20) & 1);
        const u32x16 normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7);
        code = (i32x16)sign | select16(a < 0x1p-6f, sub, (i32x16)normal);
    }
    for (int i = 0; i < 16; i++) out[i] = (uint8_t)code[i];
}

/* A token's key or value rows of its kv_heads heads (activations, dtype) into
 * an 8-bit cache (kv_dtype 2 int8, 3 fp8): each head's head_dim values as
 * steps of its scale, then the scale (attention/kv_quant.py's layout),
 * rounded exactly as kv_quant.quantize rounds: scale = amax * (1/L), steps
 * x * ((1 / amax) * L) rounded to nearest even (int8, L = 127) or to e4m3
 * (fp8, L = 448); compiled without fast-math so that the two agree bit for
 * bit. fixed_scales (fp8, a checkpoint's, one per KV head): x * (1 / fixed) instead. */
__attribute__((optimize("no-fast-math")))
static void store_kv_8bit(void *dst, const void *src, int kv_heads, int64_t head_dim,
                          int dtype, int kv_dtype, const float *fixed_scales) {
    const float largest = kv_dtype == 2 ? 127.0f : 448.0f;
    for (int h = 0; h < kv_heads; h++) {
        float x[512], amax = 0.f;
        for (int64_t d = 0; d < head_dim; d++) {
            const int64_t i = h * head_dim + d;
            x[d] = dtype ? bf16_to_float(((const uint16_t *)src)[i]) : ((const float *)src)[i];
            amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
        }
        uint8_t *row = (uint8_t *)dst + h * (head_dim + 4);
        const float fixed = fixed_scales ? fixed_scales[h] : 0.f;
        const int own = !(kv_dtype == 3 && fixed > 0.f);
        const float scale = own ? amax * (1.0f / largest) : fixed;
        if (!own || amax > 0.f) {
            const float inv = own ? (1.0f / amax) * largest : 1.0f / fixed;
            int64_t d0 = 0;
            for (; d0 + 16 <= head_dim; d0 += 16)
                steps16(x + d0, inv, largest, kv_dtype, row + d0);
            for (int64_t d = d0; d < head_dim; d++) {
                float v = x[d] * inv;
                v = v > largest ? largest : v < -largest ? -largest : v;
                row[d] = kv_dtype == 2 ? (uint8_t)(int8_t)nearbyintf(v) : to_e4m3(v);
            }
        } else {
            memset(row, 0, (size_t)head_dim);
        }
        memcpy(row + head_dim, &scale, sizeof scale);
    }
}

/* out [m][n] = x [m][k] (rows x_stride elements apart) @ W^T (+ bias);
 * nonzero if scratch memory could not be had. */
static int qlinear(const folio_step *s, const void *x, int64_t x_stride,
                   const folio_qweight *q, const void *bias, void *out, int64_t m, int64_t n) {
    return folio_qlinear(x, x_stride, s->dtype, q->perm, q->codes, q->bits, q->scales,
                         q->offsets, q->zeros, q->supers, q->per_super, q->bounds, q->groups,
                         bias, out, m, n, q->positions, s->quantize_x, s->num_threads);
}

static int linear(const folio_step *s, const void *x, int64_t x_stride, const void *w,
                  const void *bias, void *out, int64_t m, int64_t n, int64_t k) {
    if (s->quantized == 2) {
        const folio_fp8weight *f = w;
        return folio_fp8_linear(x, x_stride, f->codes, f->scales, f->block, bias, out, m, n, k,
                                s->num_threads);
    }
    if (s->quantized) {
        const folio_qweight *q = w;
        if (q->next == NULL) return qlinear(s, x, x_stride, q, bias, out, m, n);
        /* runs of output features in forms of their own: each into its columns
         * (one row: in place; more: through a buffer, row by row) */
        const size_t elt = s->dtype ? sizeof(uint16_t) : sizeof(float);
        int64_t first = 0;
        for (; q != NULL; q = q->next) {
            const float *b = bias ? (const float *)bias + first : NULL;
            char *dst = (char *)out + elt * (size_t)first;
            if (m == 1) {
                if (qlinear(s, x, x_stride, q, b, dst, 1, q->rows)) return 1;
            } else {
                char *part = malloc(elt * (size_t)(m * q->rows));
                if (part == NULL || qlinear(s, x, x_stride, q, b, part, m, q->rows)) {
                    free(part);
                    return 1;
                }
                for (int64_t r = 0; r < m; r++)
                    memcpy(dst + elt * (size_t)(r * n), part + elt * (size_t)(r * q->rows),
                           elt * (size_t)q->rows);
                free(part);
            }
            first += q->rows;
        }
        return 0;
    }
    if (s->dtype)
        folio_linear(x, x_stride, w, bias, out, m, n, k, s->num_threads);
    else
        folio_linear_bf16w(x, x_stride, w, bias, out, m, n, k, s->num_threads);
    return 0;
}

/* y += the step's LoRA of projection j of layer w (x [m][in] its input, y
 * [m][out] its output); nonzero if scratch memory could not be had. */
static int lora(const folio_step *s, const folio_layer *w, int j, const void *x,
                int64_t x_stride, void *y, int64_t y_stride, int64_t in, int64_t out) {
    if (s->lora_nruns == 0 || w->lora_at[j] == NULL) return 0;
    return folio_lora(x, x_stride, y, y_stride, s->dtype, w->lora_at[j], w->lora_bt[j],
                      s->lora_dtype, s->lora_runs, s->lora_nruns, in, out, w->lora_width[j],
                      s->num_threads) != 0;
}

/* A MoE layer's output into out [t][hidden] from its normed input x: the
 * step's t * k (token, expert) rows grouped by expert (counting sort, each
 * expert's rows in token order), each chosen expert run once on its rows
 * (gathered), each row's output weighted and rounded to the run dtype, the
 * rows added to their tokens in fp32 in ascending expert order and rounded
 * once: the sum fused_experts makes (torch's index_add_ adds bf16 rows so);
 * nonzero if memory could not be had. A token takes an expert at most once
 * (moe.c), so an expert has at most t rows. */
static int moe_block(const folio_step *s, const folio_moe *m, const void *x, void *out) {
    const int64_t t = s->tokens, h = s->hidden, inter = m->intermediate, k = m->top_k;
    const int64_t rows = t * k;
    const int dtype = s->dtype;
    const size_t elt = dtype ? sizeof(uint16_t) : sizeof(float);
    float *weights = malloc(sizeof(float) * (size_t)rows);
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)rows);
    int64_t *order = malloc(sizeof(int64_t) * (size_t)rows);
    int64_t *start = calloc((size_t)m->experts + 1, sizeof(int64_t));
    float *acc = calloc((size_t)(t * h), sizeof(float));
    char *xs = malloc(elt * (size_t)(t * h)), *ys = malloc(elt * (size_t)(t * h));
    char *gate_up = malloc(elt * (size_t)(t * 2 * inter));
    char *act = malloc(elt * (size_t)(t * inter));
    int failed = !weights || !ids || !order || !start || !acc || !xs || !ys || !gate_up || !act;
    if (!failed)
        failed = folio_moe_route(x, h, dtype, m->router, m->experts, h, t, m->top_k,
                                 m->renormalize, m->weights_in_float, weights, ids,
                                 s->num_threads);
    if (!failed) {
        for (int64_t r = 0; r < rows; r++) start[ids[r] + 1]++;
        for (int e = 0; e < m->experts; e++) start[e + 1] += start[e];
        int64_t *next = malloc(sizeof(int64_t) * (size_t)m->experts);
        failed = next == NULL;
        if (!failed) {
            memcpy(next, start, sizeof(int64_t) * (size_t)m->experts);
            for (int64_t r = 0; r < rows; r++) order[next[ids[r]]++] = r;
            free(next);
        }
    }
    for (int e = 0; e < m->experts && !failed; e++) {
        const int64_t first = start[e], n = start[e + 1] - first;
        if (n == 0) continue;
        const int threads = n * h >= 32768 ? s->num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t i = 0; i < n; i++)
            memcpy(xs + elt * (size_t)(i * h),
                   (const char *)x + elt * (size_t)(order[first + i] / k * h), elt * (size_t)h);
        if (linear(s, xs, h, m->w13[e], 0, gate_up, n, 2 * inter, h)) {
            failed = 1;
            break;
        }
        folio_silu_mul(gate_up, act, n, inter, dtype, s->num_threads);
        if (linear(s, act, inter, m->w2[e], 0, ys, n, h, inter)) {
            failed = 1;
            break;
        }
        /* the expert's rows are distinct tokens: their sums in parallel */
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t i = 0; i < n; i++) {
            const float w = weights[order[first + i]];
            float *sum = acc + order[first + i] / k * h;
            for (int64_t d = 0; d < h; d++) {
                const int64_t j = i * h + d;
                const float y = dtype ? bf16_to_float(((const uint16_t *)ys)[j])
                                      : ((const float *)ys)[j];
                sum[d] += round_to(y * w, dtype);
            }
        }
    }
    if (!failed)
        for (int64_t j = 0; j < t * h; j++) {
            if (dtype)
                ((uint16_t *)out)[j] = float_to_bf16(acc[j]);
            else
                ((float *)out)[j] = acc[j];
        }
    free(weights), free(ids), free(order), free(start), free(acc);
    free(xs), free(ys), free(gate_up), free(act);
    return failed;
}

int folio_decoder_layers(const folio_layer *layers, int num_layers, const folio_step *s) {
    const int64_t t = s->tokens, h = s->hidden, inter = s->intermediate;
    const int64_t d = s->head_dim, q_size = s->heads * d, kv_size = s->kv_heads * d;
    const int64_t qkv_width = q_size + 2 * kv_size;
    /* a token's cached row of every KV head (int8: each head's scale too) */
    const int64_t kv_row = s->kv_dtype >= 2 ? s->kv_heads * (d + 4) : kv_size;
    const int64_t v_offset = s->num_blocks * s->block_size * kv_row;
    const int dtype = s->dtype, threads = s->num_threads;
    const size_t elt = dtype ? sizeof(uint16_t) : sizeof(float);
    const size_t kv_elt = s->kv_dtype >= 2 ? 1 : s->kv_dtype ? sizeof(uint16_t) : sizeof(float);
    char *x = s->hidden_states, *qkv = s->qkv;
    for (int i = 0; i < num_layers; i++) {
        const folio_layer *w = layers + i;
        folio_add_rmsnorm(x, s->residual, w->input_norm, s->normed, t, h, s->eps, dtype,
                          i > 0 || s->residual_in, threads);
        if (i == 0 && !s->residual_in)  /* the model's first layer: its input is the residual */
            memcpy(s->residual, x, elt * (size_t)(t * h));
        if (linear(s, s->normed, h, w->qkv, w->qkv_bias, qkv, t, qkv_width, h)) return 1;
        if (lora(s, w, 0, s->normed, h, qkv, qkv_width, h, qkv_width)) return 1;
        if (w->q_norm) {            /* Qwen3: each head of q and of k normed before rotary */
            folio_head_rmsnorm(qkv, t, qkv_width, s->heads, s->head_dim, w->q_norm, s->eps,
                               dtype, threads);
            folio_head_rmsnorm(qkv + elt * (size_t)q_size, t, qkv_width, s->kv_heads,
                               s->head_dim, w->k_norm, s->eps, dtype, threads);
        }
        folio_rotary(qkv, t, qkv_width, s->heads + s->kv_heads, s->head_dim, s->cos, s->sin,
                     dtype, threads);
        char *cache = w->kv_cache;
        for (int64_t j = 0; j < t; j++) {
            const char *k = qkv + elt * (size_t)(j * qkv_width + q_size);
            char *kdst = cache + kv_elt * (size_t)(s->slots[j] * kv_row);
            char *vdst = cache + kv_elt * (size_t)(v_offset + s->slots[j] * kv_row);
            if (s->kv_dtype >= 2) {
                store_kv_8bit(kdst, k, s->kv_heads, d, dtype, s->kv_dtype, w->kv_scale[0]);
                store_kv_8bit(vdst, k + elt * (size_t)kv_size, s->kv_heads, d, dtype,
                              s->kv_dtype, w->kv_scale[1]);
                continue;
            }
            store_kv(kdst, k, kv_size, dtype, s->kv_dtype);
            store_kv(vdst, k + elt * (size_t)kv_size, kv_size, dtype, s->kv_dtype);
        }
        if (folio_paged_attention_window(qkv, qkv_width, cache, s->attn, s->block_tables,
                                         s->max_blocks, s->token_rows, s->context_lens, t,
                                         s->heads, s->kv_heads, s->head_dim, s->block_size,
                                         s->num_blocks, s->scale, dtype, s->kv_dtype, threads,
                                         w->window))
            return 1;
        if (linear(s, s->attn, q_size, w->o, 0, x, t, h, q_size)) return 1;
        if (lora(s, w, 1, s->attn, q_size, x, h, q_size, h)) return 1;
        folio_add_rmsnorm(x, s->residual, w->post_norm, s->normed, t, h, s->eps, dtype, 1,
                          threads);
        if (w->moe) {
            if (moe_block(s, w->moe, s->normed, x)) return 1;
            continue;
        }
        if (linear(s, s->normed, h, w->gate_up, 0, s->gate_up, t, 2 * inter, h)) return 1;
        if (lora(s, w, 2, s->normed, h, s->gate_up, 2 * inter, h, 2 * inter)) return 1;
        folio_silu_mul(s->gate_up, s->act, t, inter, dtype, threads);
        if (linear(s, s->act, inter, w->down, 0, x, t, h, inter)) return 1;
        if (lora(s, w, 3, s->act, inter, x, h, inter, h)) return 1;
    }
    return 0;
}
