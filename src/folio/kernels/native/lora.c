/* LoRA of several adapters in one step (issue 31), grouped by adapter: for
 * each run of consecutive rows of one adapter (its slot s, first row, end),
 *
 *     y[rows] += (x[rows] A_s^T) B_s^T        shrink, then expand
 *
 * with the slots stored transposed, in fp32 or bf16 (w_dtype 0 or 1):
 *     at [slots][in][width]    A^T: for each input feature, its width values
 *     bt [slots][width][out]   B^T (scaling folded in): for each rank column,
 *                              its out values
 * width a multiple of 16 (the caller zero-pads). x and y are fp32 or bf16
 * (dtype 0 or 1) with their own row strides; the product (x A^T) stays fp32
 * between the two halves and y is rounded once, after the sum.
 *
 * Both halves are broadcast-and-FMA over a contiguous run of width (shrink)
 * or out (expand) values: a block of up to MR rows (8 with AVX-512, 4 with
 * AVX2) against NV vectors of
 * them, MR x NV accumulators, so each adapter's weights are read once per
 * block of MR rows (a decode step's run of an adapter is usually one block),
 * every load a whole vector of one weight row. The work items (a run's block
 * of rows and a group of vectors) are shared out among the threads; with
 * bf16 slots a step reads half the bytes of fp32 ones.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "simd.h"

/* a block: MR rows against NV vectors of width or out (MR x NV accumulators,
 * NV weight vectors and a broadcast in registers: 24 + 4 of AVX-512's 32,
 * 12 + 4 of AVX2's 16) */
#ifdef FOLIO_HAVE_AVX512
#define MR 8
#else
#define MR 4
#endif
#define NV 3

static inline float scalar(const void *p, int64_t i, int dtype) {
    return dtype ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

typedef struct {
    int64_t slot, row, rows, t_row;   /* the block: its slot, first row, rows, row in t */
} block;

/* The blocks of MR rows of every run; their count in *n. */
static block *blocks_of(const int64_t *runs, int64_t nruns, int64_t *n) {
    int64_t count = 0;
    for (int64_t r = 0; r < nruns; r++) count += (runs[3 * r + 2] - runs[3 * r + 1] + MR - 1) / MR;
    block *out = malloc((size_t)(count ? count : 1) * sizeof *out);
    if (out == NULL) return NULL;
    int64_t i = 0, t_row = 0;
    for (int64_t r = 0; r < nruns; r++) {
        for (int64_t row = runs[3 * r + 1]; row < runs[3 * r + 2]; row += MR) {
            const int64_t left = runs[3 * r + 2] - row;
            out[i++] = (block){runs[3 * r], row, left < MR ? left : MR, t_row};
            t_row += left < MR ? left : MR;
        }
    }
    *n = count;
    return out;
}

#ifdef FOLIO_HAVE_VEC
/* t[block rows][v0 .. v0 + nv vectors] = x[block rows] A^T; mr and nv are
 * constants where it is inlined (shrink's cases), so the loops unroll. */
static inline __attribute__((always_inline)) void shrink_k(
    const float *x, int64_t x_stride, int64_t x_row, const void *at, int w_dtype,
    const block *bl, int64_t in, int64_t width, int64_t v0, float *t, const int mr,
    const int nv) {
    const int64_t base = bl->slot * in * width + v0 * FOLIO_VW;
    fvec acc[MR][NV];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
        for (int j = 0; j < nv; j++) acc[r][j] = fv_zero();
    for (int64_t i = 0; i < in; i++) {
        fvec w[NV];
#pragma GCC unroll 3
        for (int j = 0; j < nv; j++) w[j] = fv_load(at, base + i * width + j * FOLIO_VW, w_dtype);
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            const fvec xv = fv_set1(x[(x_row + r) * x_stride + i]);
#pragma GCC unroll 3
            for (int j = 0; j < nv; j++) acc[r][j] = fv_fma(xv, w[j], acc[r][j]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
        for (int j = 0; j < nv; j++)
            fv_storeu(t + (bl->t_row + r) * width + (v0 + j) * FOLIO_VW, acc[r][j]);
}

/* y[block rows][o0 .. o0 + nv vectors] += t[block rows] B^T (as shrink_k). */
static inline __attribute__((always_inline)) void expand_k(
    const float *t, const void *bt, int w_dtype, const block *bl, int64_t width, int64_t out,
    int64_t o0, void *y, int64_t y_stride, int dtype, const int mr, const int nv) {
    const int64_t base = bl->slot * width * out + o0;
    fvec acc[MR][NV];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
        for (int j = 0; j < nv; j++) acc[r][j] = fv_zero();
    for (int64_t k = 0; k < width; k++) {
        fvec w[NV];
#pragma GCC unroll 3
        for (int j = 0; j < nv; j++) w[j] = fv_load(bt, base + k * out + j * FOLIO_VW, w_dtype);
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            const fvec tv = fv_set1(t[(bl->t_row + r) * width + k]);
#pragma GCC unroll 3
            for (int j = 0; j < nv; j++) acc[r][j] = fv_fma(tv, w[j], acc[r][j]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
        const int64_t at = (bl->row + r) * y_stride + o0;
#pragma GCC unroll 3
        for (int j = 0; j < nv; j++)
            fv_store(y, at + j * FOLIO_VW,
                     fv_add(fv_load(y, at + j * FOLIO_VW, dtype), acc[r][j]), dtype);
    }
}

/* The cases of rows (1 .. MR) and vectors (1 .. NV), each its own unrolled code. */
#define NV_CASES(call, mr) \
    switch (nv) { case 1: call(mr, 1); break; case 2: call(mr, 2); break; \
                  default: call(mr, 3); }
#define ROW_CASE(call, mr) case mr: NV_CASES(call, mr) break;
#if MR == 8
#define MR_CASES(call) \
    switch (bl->rows) { ROW_CASE(call, 1) ROW_CASE(call, 2) ROW_CASE(call, 3) \
                        ROW_CASE(call, 4) ROW_CASE(call, 5) ROW_CASE(call, 6) \
                        ROW_CASE(call, 7) default: NV_CASES(call, 8) }
#else
#define MR_CASES(call) \
    switch (bl->rows) { ROW_CASE(call, 1) ROW_CASE(call, 2) ROW_CASE(call, 3) \
                        default: NV_CASES(call, 4) }
#endif

/* x: fp32 rows, x_stride apart, the block's first at x_row. */
static void shrink(const float *x, int64_t x_stride, int64_t x_row, const void *at,
                   int w_dtype, const block *bl, int64_t in, int64_t width, int64_t v0, int nv,
                   float *t) {
#define SHRINK(mr, n) \
    shrink_k(x, x_stride, x_row, at, w_dtype, bl, in, width, v0, t, mr, n)
    MR_CASES(SHRINK)
#undef SHRINK
}

static void expand(const float *t, const void *bt, int w_dtype, const block *bl, int64_t width,
                   int64_t out, int64_t o0, int nv, void *y, int64_t y_stride, int dtype) {
#define EXPAND(mr, n) expand_k(t, bt, w_dtype, bl, width, out, o0, y, y_stride, dtype, mr, n)
    MR_CASES(EXPAND)
#undef EXPAND
}
#endif

/* The last out % VW outputs (or all of them without vectors), one row at a time. */
static void expand_tail(const float *t, const void *bt, int w_dtype, const block *bl,
                        int64_t width, int64_t out, int64_t o0, void *y, int64_t y_stride,
                        int dtype) {
    for (int64_t r = 0; r < bl->rows; r++) {
        const float *tr = t + (bl->t_row + r) * width;
        for (int64_t o = o0; o < out; o++) {
            float sum = 0;
            for (int64_t k = 0; k < width; k++)
                sum += tr[k] * scalar(bt, (bl->slot * width + k) * out + o, w_dtype);
            const int64_t at = (bl->row + r) * y_stride + o;
            const float v = scalar(y, at, dtype) + sum;
            if (dtype) ((uint16_t *)y)[at] = float_to_bf16(v);
            else ((float *)y)[at] = v;
        }
    }
}

/* 0, or -1: width not a multiple of 16, or no memory. runs: nruns x (slot,
 * first row, end), in any order, rows of no run untouched. */
int folio_lora(const void *x, int64_t x_stride, void *y, int64_t y_stride, int dtype,
               const void *at, const void *bt, int w_dtype, const int64_t *runs, int64_t nruns,
               int64_t in, int64_t out, int64_t width, int num_threads) {
    if (width % 16) return -1;
    int64_t nblocks;
    block *bl = blocks_of(runs, nruns, &nblocks);
    if (bl == NULL) return -1;
    const int64_t rows = nblocks ? bl[nblocks - 1].t_row + bl[nblocks - 1].rows : 0;
    float *t = malloc((size_t)(rows ? rows : 1) * width * sizeof *t);
    if (t == NULL) {
        free(bl);
        return -1;
    }
#ifdef FOLIO_HAVE_VEC
    const int64_t wv = width / FOLIO_VW, wgroups = (wv + NV - 1) / NV;
    const int64_t ov = out / FOLIO_VW, ogroups = (ov + NV - 1) / NV;
    /* bf16 rows widened once into fp32 ones, in t's row order: the shrink's
     * broadcasts then load floats (one instruction, not a widening each) */
    float *xf = NULL;
    if (dtype) {
        xf = malloc((size_t)(rows ? rows : 1) * in * sizeof *xf);
        if (xf == NULL) {
            free(t);
            free(bl);
            return -1;
        }
    }
#pragma omp parallel num_threads(num_threads)
    {
        if (xf) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < nblocks; i++)
                for (int64_t r = 0; r < bl[i].rows; r++)
                    for (int64_t j = 0; j < in; j++)
                        xf[(bl[i].t_row + r) * in + j] =
                            bf16_to_float(((const uint16_t *)x)[(bl[i].row + r) * x_stride + j]);
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < nblocks * wgroups; i++) {
            const int64_t g = i % wgroups, v0 = g * NV;
            const block *b = &bl[i / wgroups];
            shrink(xf ? xf : x, xf ? in : x_stride, xf ? b->t_row : b->row, at, w_dtype, b,
                   in, width, v0, (int)(wv - v0 < NV ? wv - v0 : NV), t);
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < nblocks * (ogroups + 1); i++) {
            const int64_t g = i % (ogroups + 1);
            const block *b = &bl[i / (ogroups + 1)];
            if (g == ogroups) {
                if (ov * FOLIO_VW < out)
                    expand_tail(t, bt, w_dtype, b, width, out, ov * FOLIO_VW, y, y_stride, dtype);
            } else {
                const int64_t v0 = g * NV;
                expand(t, bt, w_dtype, b, width, out, v0 * FOLIO_VW,
                       (int)(ov - v0 < NV ? ov - v0 : NV), y, y_stride, dtype);
            }
        }
    }
    free(xf);
#else
    for (int64_t i = 0; i < nblocks; i++) {
        for (int64_t r = 0; r < bl[i].rows; r++)
            for (int64_t k = 0; k < width; k++) {
                float sum = 0;
                for (int64_t j = 0; j < in; j++)
                    sum += scalar(x, (bl[i].row + r) * x_stride + j, dtype)
                           * scalar(at, (bl[i].slot * in + j) * width + k, w_dtype);
                t[(bl[i].t_row + r) * width + k] = sum;
            }
        expand_tail(t, bt, w_dtype, &bl[i], width, out, 0, y, y_stride, dtype);
    }
    (void)num_threads;
#endif
    free(t);
    free(bl);
    return 0;
}
