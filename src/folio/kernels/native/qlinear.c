/* The linear layer of 4-, 6- and 8-bit quantized weights: out = x W^T (+ bias),
 * x and out fp32 or bf16, W as unsigned integer codes with a scale and
 * offset per (output feature, group of input features):
 *
 *     w[n][k] = q[n][k] * scale[n][g(k)] + offset[n][g(k)]
 *
 * held as float16 (with `zeros`, the offsets array holds integer zero points
 * z and offset = -z * scale, exact in fp32), or in two levels, as a GGUF
 * K-quant holds them (`supers`): int8 scales and offsets (offsets NULL: the
 * scales' int8s serve both, Q6_K's offset being -32 d sc) each times its
 * super-group's float16 pair, [tiles][supers][2][16], per_super groups a
 * super-group; the products are exact in fp32.
 *
 * Layout (folio.model.layers.quantization.int_groups, which says why): output
 * features in tiles of 16; input features in "positions": group order, each
 * group padded with zero codes to a multiple of 8 (perm, or NULL, gives the
 * input feature of each position, -1 for padding); per tile, per octet of
 * positions (8 of them), each output feature's codes in one 32-bit word:
 *   4 bits: [tiles][octets][16][4] bytes, byte b of a word holding positions
 *           b (low nibble) and b + 4 (high nibble) of the octet;
 *   8 bits: [tiles][octets][2][16][4] bytes, the words of positions 0..3,
 *           then of 4..7;
 *   6 bits: per pair of octets, [2][16][4] bytes of their low nibbles (the
 *           4-bit layout) and [16][4] of their top 2 bits (byte_words), made
 *           into the 8-bit form's words as they are read by the int8 path at
 *           few rows, else first widened once a call into the 8-bit layout
 *           (widen_codes; groups are padded to whole pairs of octets).
 * So one 64-byte load gives a tile's codes for 8 positions (4 bits) or 4
 * (8 bits), and either a shift and a mask make 16 lanes of one position's
 * codes (the float path) or a mask makes four positions' bytes per lane, the
 * operand of an integer dot product (the int16 path). scales and offsets:
 * [tiles][groups][16] float16; bounds[g] .. bounds[g + 1]: group g's positions.
 *
 * Two ways to multiply, both scaling per group:
 *     y[n] = sum_g scale[n][g] * (sum_{k in g} x[k] q[n][k])
 *          + offset[n][g] * (sum_{k in g} x[k])
 * - float (`quantize_x` 0), fp32 arithmetic: with few rows (a decode step,
 *   up to MR) the codes are widened as they are read and each group's sums
 *   scaled as above; with more, each group of tiles is first dequantized into
 *   fp32 scratch (w = q * scale + offset) and the rows run a plain float
 *   register block on it. Either way the result is the dequantized product up
 *   to the order of fp32 sums.
 * - int16 (`quantize_x` 1): x quantized per row and per block of 32 positions
 *   (within a group) to int16 with its own scale, and the codes multiplied as
 *   integers two at a time (vpdpwssd with AVX512-VNNI or AVX-VNNI, else
 *   vpmaddwd), each block's integer sum (exact in int32) scaled once. About
 *   half the instructions a weight of the float path; x carries the rounding
 *   of 16 bits relative to its block's largest value (2^-16), far below bf16's
 *   2^-9 per value.
 * - int8 (`quantize_x` 2): x quantized per row and per block of 32 positions
 *   to int8 (scale: the block's largest |x| / 127), the codes multiplied as
 *   bytes four at a time (vpdpbusd with VNNI, else vpmaddubsw; the int8 path
 *   below says how it stays exact), a quarter of the float path's
 *   instructions a weight. x carries up to 2^-8 of its block's largest value
 *   (the drift this gives a model's logprobs: docs/benchmarks.md, bounded by
 *   tests/engine/test_int8_activations.py).
 *   A K-quant's two-level scales (4- and 6-bit codes, groups of at most 32)
 *   take it as llama.cpp's q8_K does instead: x per super-block of 256
 *   positions, each group's integer sum times its int8 scale in integers,
 *   and per super-block two fp32 multiply-adds (sblock says how): at 32
 *   rows the AVX-512 build's pass over the 1B Q4_K_M 1.19-1.23x, the AVX2
 *   one's 1.04-1.06x, one row 1.02-1.09x; it costs a requantized default
 *   model +0.28 % perplexity where x per 32 costs +0.14 % (docs/benchmarks.md).
 * - `quantize_x` 3: int8 at up to folio_qlinear_int8_rows(bits) rows, where
 *   it wins; above, int16 for bf16 x and float for fp32 x.
 * The activations are first gathered into position order and widened to fp32
 * once, with their exact per-group sums (the prologue).
 *
 * Builds: AVX-512 (F + BW; a tile is one zmm) and AVX2 + FMA + F16C (a tile is
 * two ymm).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Compiled as one unit, or (the library's build, kernels/native/__init__.py)
 * as five that build in parallel, FOLIO_QLINEAR_PART selecting one: 1 the
 * float path of few rows, 4 of many, 2 the int16 path, 3 the int8 path, 0
 * the entry and the rest; each path's unrolled blocks take most of a -O3
 * build. */
#ifndef FOLIO_QLINEAR_PART
#define FOLIO_QLINEAR_PART (-1)
#define QL_PATH static
#else
#define QL_PATH __attribute__((visibility("hidden")))
#endif
/* How far ahead of its reads a few-row path (int8, float) asks for a tile's codes, in
 * positions (0: not at all): the hardware's prefetchers alone left one row's
 * product at 0.55-0.75 of the machine's read bandwidth (docs/bench/qlinear_prefetch.py
 * measures the distances). */
#ifndef FOLIO_QL_PREFETCH
#define FOLIO_QL_PREFETCH 256
#endif
/* The int8 path, one stream of codes a thread, asks in bytes instead: 8 KiB
 * ahead, whatever the code width. Against 256 positions (2 KiB of 4-bit
 * codes), one row's pass over the 1B Q4_K_M took 1.02x as many bytes a second
 * in the minutes the machine reads 42-48 GB/s and 1.15x in those it reads
 * 60-75 (3B: 1.12x and 1.14x; 1B Q8_0, whose 256 positions are 4 KiB: level);
 * the float path, three streams and bound by its arithmetic, lost 8% at that
 * distance and keeps its own, as does the int8 path at more than IMR rows
 * (32 rows: 0.97x and 1.06x in two runs, within the noise: left as it was)
 * (docs/bench/qlinear_prefetch.py --builds). */
#ifndef FOLIO_QL_PREFETCH_BYTES
#define FOLIO_QL_PREFETCH_BYTES 8192
#endif
/* Into which cache the int8 path asks for its codes FOLIO_QL_PREFETCH_BYTES
 * ahead (__builtin_prefetch's locality: 3 prefetcht0, L1; 2 prefetcht1, L2).
 * native/__init__.py builds 2 on Intel: on a Xeon (2 vCPUs) a one-row pass
 * over the 1B Q4_K_M read 1.08-1.16x as many bytes a second as with 3 (the
 * AVX2 build 1.06-1.13x), prefetchnta 0.78-0.85x; 32 rows level
 * (docs/bench/qlinear_prefetch.py --builds); 3, as measured on AMD's Zen 4
 * and 5, elsewhere. The float path, bound by its arithmetic, keeps 3 (2:
 * 0.97-0.99x). */
#ifndef FOLIO_QL_PREFETCH_LOCALITY
#define FOLIO_QL_PREFETCH_LOCALITY 3
#endif
/* The int8 path's K-quant arithmetic (sblock): 1 x per super-block and the
 * scales as integers, 0 x per block of 32 and every group's sums scaled in
 * fp32 (iblock's, as other formats'), kept to measure one against the other. */
#ifndef FOLIO_QL_SUPER
#define FOLIO_QL_SUPER 1
#endif
#define QL_PART(n) (FOLIO_QLINEAR_PART < 0 || FOLIO_QLINEAR_PART == (n))

#if (defined(__AVX512F__) && defined(__AVX512BW__)) || \
    (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
typedef __m512 vec;
typedef __m512i ivec;
#define VL 16
#define MR 4      /* float path: rows x tiles per register block */
#define NT 3
#define QMR 4     /* int16 path */
#define QNT 2
#define vzero() _mm512_setzero_ps()
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vsub(a, b) _mm512_sub_ps(a, b)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vbcast(p) _mm512_set1_ps(*(p))
#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, v) _mm512_storeu_ps(p, v)
#define vhalf(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define iload(p) _mm512_loadu_si512((const void *)(p))
#define istore(p, v) _mm512_storeu_si512((void *)(p), v)
#define iset1(v) _mm512_set1_epi32(v)
#define iand(a, b) _mm512_and_si512(a, b)
#define ior(a, b) _mm512_or_si512(a, b)
#define isrl(a, n) _mm512_srli_epi32(a, n)
#define isll(a, n) _mm512_slli_epi32(a, n)
#define vsmall(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define izero() _mm512_setzero_si512()
#define iadd(a, b) _mm512_add_epi32(a, b)
#define itof(a) _mm512_cvtepi32_ps(a)
#define ismall(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define imul32(a, b) _mm512_mullo_epi32(a, b)
#define vtoi(v) _mm512_castps_si512(v)
#define itov(i) _mm512_castsi512_ps(i)
#if defined(__AVX512VNNI__)
#define idot(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#define VNNI8 1
#define bdot(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#else
#define idot(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#define VNNI8 0
#endif
#define IMR 4     /* int8 path */
#define INT 2
#define iset16(v) _mm512_set1_epi16(v)
#define iadd16(a, b) _mm512_add_epi16(a, b)
#define imadd16(a, b) _mm512_madd_epi16(a, b)
#define imaddubs(u, s) _mm512_maddubs_epi16(u, s)
#define ixor(a, b) _mm512_xor_si512(a, b)
#define iabs8(a) _mm512_abs_epi8(a)
/* s negated where w < 0 (w == 0: |w| is 0 anyway); AVX-512 has no vpsignb */
#define isign8(s, w) _mm512_mask_sub_epi8(s, _mm512_movepi8_mask(w), izero(), s)
#else
typedef __m256 vec;
typedef __m256i ivec;
#define VL 8
#define MR 3
#define NT 1
#define QMR 2
#define QNT 1
#define vzero() _mm256_setzero_ps()
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vsub(a, b) _mm256_sub_ps(a, b)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vbcast(p) _mm256_broadcast_ss(p)
#define vload(p) _mm256_loadu_ps(p)
#define vstore(p, v) _mm256_storeu_ps(p, v)
#define vhalf(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define iload(p) _mm256_loadu_si256((const __m256i *)(p))
#define istore(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#define iset1(v) _mm256_set1_epi32(v)
#define iand(a, b) _mm256_and_si256(a, b)
#define ior(a, b) _mm256_or_si256(a, b)
#define isrl(a, n) _mm256_srli_epi32(a, n)
#define isll(a, n) _mm256_slli_epi32(a, n)
#define vsmall(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define izero() _mm256_setzero_si256()
#define iadd(a, b) _mm256_add_epi32(a, b)
#define itof(a) _mm256_cvtepi32_ps(a)
#define ismall(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define imul32(a, b) _mm256_mullo_epi32(a, b)
#define vtoi(v) _mm256_castps_si256(v)
#define itov(i) _mm256_castsi256_ps(i)
#if defined(__AVXVNNI__)
#define idot(acc, a, b) _mm256_dpwssd_avx_epi32(acc, a, b)
#define VNNI8 1
#define bdot(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#else
#define idot(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#define VNNI8 0
#endif
#define IMR 4
#define INT 1
#define iset16(v) _mm256_set1_epi16(v)
#define iadd16(a, b) _mm256_add_epi16(a, b)
#define imadd16(a, b) _mm256_madd_epi16(a, b)
#define imaddubs(u, s) _mm256_maddubs_epi16(u, s)
#define ixor(a, b) _mm256_xor_si256(a, b)
#define iabs8(a) _mm256_abs_epi8(a)
#define isign8(s, w) _mm256_sign_epi8(s, w)
#endif

#define VPT (16 / VL)      /* vectors per tile of 16 output features */
/* A sum held in a register at this point of a loop: else -O3 may gather an
 * unrolled block's integer products first and add them up from memory (the
 * sums are associative). Measured to matter (1.1x) where vpmaddubsw does the
 * products, with 16 registers; with VNNI it cost 5% at 32 rows, so not there. */
#if !VNNI8
#define HOLD(v) __asm__("" : "+v"(v))
#else
#define HOLD(v) (void)0
#endif
/* the kernels' switch keys: code width, then rows x 8 + tiles (both under 8) */
#define BITS_KEY(b) ((b) == 4 ? 0 : (b) == 6 ? 64 : 128)

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
    const float *x, *xsum;         /* [m][kp] fp32 in position order; [m][groups] */
    const int32_t *xq;             /* int16 path: [m][kp / 2] pairs, and per block its scale */
    const float *xscale;           /* [m][blocks] */
    const int8_t *x8;              /* int8 path: [m][kp] in position order */
    const int32_t *x8sum;          /* [m][blocks]: each block's sum of x8 */
    const int32_t *x8pair;         /* isuper: [m][groups / 2] two groups' sums of x8 as int16s */
    const uint8_t *codes;
    const void *scales, *offsets;   /* float16; with supers int8 (offsets NULL: the scales') */
    const uint16_t *supers;         /* two-level scales: float16 [tiles][supers][2][16] */
    const int32_t *bounds;
    const float *bias;
    void *out;
    int64_t m, n, kp, groups, blocks, supers_n;
    int bits, dtype, zeros, super_shift;     /* per_super = 1 << super_shift */
    int64_t code_tile0;             /* the tile `codes` starts at (a widened copy's) */
    int isuper;                     /* int8 path, two-level scales in integers (sblock) */
} job;

/* bytes of a tile's codes: 16 output features x kp positions x bits / 8 */
static inline int64_t tile_bytes(const job *J) { return J->kp * 2 * J->bits; }

static inline __attribute__((always_inline)) void store_row(const job *J, int64_t row,
                                                            int64_t col, vec v) {
    float tmp[VL];
    const int64_t left = J->n - col;
    if (left <= 0) return;
    if (J->dtype == 0 && left >= VL && !J->bias) {
        vstore((float *)J->out + row * J->n + col, v);
        return;
    }
    vstore(tmp, v);
    const int cnt = left < VL ? (int)left : VL;
    const float *b = J->bias;
    if (J->dtype == 0) {
        float *o = (float *)J->out + row * J->n + col;
        for (int i = 0; i < cnt; i++) o[i] = tmp[i] + (b ? b[col + i] : 0.0f);
    } else {
        uint16_t *o = (uint16_t *)J->out + row * J->n + col;
        for (int i = 0; i < cnt; i++) o[i] = float_to_bf16(tmp[i] + (b ? b[col + i] : 0.0f));
    }
}

/* Ask for tiles t0 .. t0 + nt's codes `bytes` past position p's, or (bytes
 * 0) FOLIO_QL_PREFETCH positions past p. */
static inline __attribute__((always_inline)) void prefetch_codes(const job *J, int64_t t0,
                                                                 int nt, int64_t p,
                                                                 const int bits,
                                                                 const int64_t bytes) {
#if FOLIO_QL_PREFETCH
#pragma GCC unroll 3
    for (int j = 0; j < nt; j++) {
        const char *ahead = (const char *)J->codes + (t0 + j - J->code_tile0) * tile_bytes(J) +
                            (bytes ? p * 2 * bits + bytes : (p + FOLIO_QL_PREFETCH) * 2 * bits);
        if (bytes) {        /* the int8 path's, into FOLIO_QL_PREFETCH_LOCALITY's cache */
            __builtin_prefetch(ahead, 0, FOLIO_QL_PREFETCH_LOCALITY);
            if (bits > 4) __builtin_prefetch(ahead + 64, 0, FOLIO_QL_PREFETCH_LOCALITY);
        } else {
            __builtin_prefetch(ahead, 0, 3);
            if (bits > 4) __builtin_prefetch(ahead + 64, 0, 3);
        }
    }
#else
    (void)J, (void)t0, (void)nt, (void)p, (void)bits, (void)bytes;
#endif
}

/* A super-group's float16 pair of one tile vector as fp32: d (the scales')
 * and m (the offsets'). */
static inline __attribute__((always_inline)) void super_pair(const job *J, int64_t tile,
                                                             int64_t g, int v, vec *d, vec *m) {
    const uint16_t *at = J->supers + (tile * J->supers_n + (g >> J->super_shift)) * 32 + v * VL;
    *d = vhalf(at);
    *m = vhalf(at + 16);
}

/* Two-level scales: the group's int8s times its super-group's pair (d, m):
 * exact in fp32. */
static inline __attribute__((always_inline)) void super_scale(const job *J, int64_t tile,
                                                              int64_t g, int v, vec d, vec m,
                                                              vec *s, vec *o) {
    const int64_t at = (tile * J->groups + g) * 16 + v * VL;
    const int8_t *sc = (const int8_t *)J->scales + at;
    *s = vmul(d, vsmall(sc));
    *o = vmul(m, vsmall(J->offsets ? (const int8_t *)J->offsets + at : sc));
}

/* The group's scale and offset vectors of one tile, offset = -z * s with zeros. */
static inline __attribute__((always_inline)) void group_scale(const job *J, int64_t tile,
                                                              int64_t g, int v, vec *s, vec *o) {
    const int64_t at = (tile * J->groups + g) * 16 + v * VL;
    if (J->supers) {
        vec d, m;
        super_pair(J, tile, g, v, &d, &m);
        super_scale(J, tile, g, v, d, m, s, o);
        return;
    }
    *s = vhalf((const uint16_t *)J->scales + at);
    *o = vhalf((const uint16_t *)J->offsets + at);
    if (J->zeros) *o = vsub(vzero(), vmul(*o, *s));
}

/* An octet of 6- or 8-bit codes of one tile vector as 8-bit words: w[0] a
 * byte each of positions 0..3, w[1] of 4..7. 6 bits: per pair of octets, the
 * two octets' low nibbles as 4-bit words, then a word of their top 2 bits,
 * byte b holding (from its low bits) those of positions b and b + 4 of the
 * first octet, then of the second. */
static inline __attribute__((always_inline)) void byte_words(const uint8_t *tile, int64_t octet,
                                                             int v, const int bits, ivec *w) {
    if (bits == 8) {
        w[0] = iload(tile + octet * 128 + v * VL * 4);
        w[1] = iload(tile + octet * 128 + 64 + v * VL * 4);
        return;
    }
    const uint8_t *pair = tile + (octet >> 1) * 192 + v * VL * 4;
    const ivec lo = iload(pair + (octet & 1) * 64), m4 = iset1(0x0f0f0f0f),
               m2 = iset1(0x30303030);
    ivec hi = iload(pair + 128);
    if (octet & 1) hi = isrl(hi, 4);
    w[0] = ior(iand(lo, m4), iand(isll(hi, 4), m2));
    w[1] = ior(iand(isrl(lo, 4), m4), iand(isll(hi, 2), m2));
}

/* Codes of 8 positions of one tile vector (lanes = VL output features) as
 * fp32, position p in w[p]. */
static inline __attribute__((always_inline)) void widen_octet(const uint8_t *tile, int64_t octet,
                                                              int v, const int bits, vec *w) {
    if (bits == 4) {
        const ivec c = iload(tile + octet * 64 + v * VL * 4), m4 = iset1(0x0f);
#pragma GCC unroll 4
        for (int b = 0; b < 4; b++) {
            w[b] = itof(iand(isrl(c, 8 * b), m4));
            w[b + 4] = itof(iand(isrl(c, 8 * b + 4), m4));
        }
    } else {
        const ivec m8 = iset1(0xff);
        ivec c[2];
        byte_words(tile, octet, v, bits, c);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++)
#pragma GCC unroll 4
            for (int b = 0; b < 4; b++) w[4 * h + b] = itof(iand(isrl(c[h], 8 * b), m8));
    }
}

/* The largest |x| of 32 floats. */
static inline float amax32(const float *x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(x));
    for (int i = 8; i < 32; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

/* 32 floats times inv, rounded as lrintf rounds them (the current mode: to
 * nearest even), to int8 at out; returns their sum. The same bytes as the
 * scalar loop, 8 at a time. */
static inline int32_t quantize32(const float *x, float inv, int8_t *out) {
    const __m256 s = _mm256_set1_ps(inv);
    const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), s));
    const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), s));
    const __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), s));
    const __m256i q3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), s));
    /* packing works within 128-bit lanes: dwords come out as positions
     * 0-3, 8-11, 16-19, 24-27, 4-7, 12-15, 20-23, 28-31 */
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
    _mm256_storeu_si256((__m256i *)out,
                        _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i t = _mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3));
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
    return _mm_cvtsi128_si32(h);
}

/* The paths, each in its unit when split. */
QL_PATH void ftile_group(const job *J, int64_t t0, int nt, uint8_t *codes8);
QL_PATH void dequantize_tiles(const job *J, int64_t t0, int nt, float *wf);
QL_PATH void dtile_group(const job *J, int64_t t0, int nt, const float *wf);
QL_PATH void qtile_group(const job *J, int64_t t0, int nt, const uint8_t *next, vec *scratch,
                         uint8_t *codes8);
QL_PATH void itile_group(const job *J, int64_t t0, int nt, vec *scratch, uint8_t *codes8);

#if QL_PART(1)
/* ---------------------------------------------------------------- float path */

/* Rows r0 .. r0 + mr (few: a decode step) against tiles t0 .. t0 + nt, the
 * codes widened as they are read. */
static inline __attribute__((always_inline)) void fblock(const job *J, int64_t r0, int64_t t0,
                                                         const int bits, const int mr,
                                                         const int nt) {
    const int64_t kp = J->kp, stride = tile_bytes(J);
    /* with few rows, the sums of a group run in several independent chains
     * (FMA latency, not throughput, bounds one chain) */
    const int chains = mr == 1 ? 4 : mr == 2 ? 2 : 1;
    vec acc[MR][NT * VPT], gacc[4][MR][NT * VPT];
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 6
        for (int j = 0; j < nt * VPT; j++) acc[r][j] = vzero();
    for (int64_t g = 0; g < J->groups; g++) {
#pragma GCC unroll 4
        for (int c = 0; c < chains; c++)
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++)
#pragma GCC unroll 6
                for (int j = 0; j < nt * VPT; j++) gacc[c][r][j] = vzero();
        for (int64_t p = J->bounds[g]; p < J->bounds[g + 1]; p += 8) {
            prefetch_codes(J, t0, nt, p, bits, 0);
#pragma GCC unroll 3
            for (int j = 0; j < nt; j++)
#pragma GCC unroll 2
                for (int v = 0; v < VPT; v++) {
                    vec w[8];
                    widen_octet(J->codes + (t0 + j - J->code_tile0) * stride, p / 8, v, bits, w);
#pragma GCC unroll 4
                    for (int r = 0; r < mr; r++) {
                        const float *xr = J->x + (r0 + r) * kp + p;
#pragma GCC unroll 8
                        for (int i = 0; i < 8; i++)
                            gacc[i % chains][r][j * VPT + v] =
                                vfma(vbcast(xr + i), w[i], gacc[i % chains][r][j * VPT + v]);
                    }
                }
        }
#pragma GCC unroll 3
        for (int j = 0; j < nt; j++)
#pragma GCC unroll 2
            for (int v = 0; v < VPT; v++) {
                vec s, o;
                group_scale(J, t0 + j, g, v, &s, &o);
#pragma GCC unroll 4
                for (int r = 0; r < mr; r++) {
                    vec sum = gacc[0][r][j * VPT + v];
#pragma GCC unroll 4
                    for (int c = 1; c < chains; c++) sum = vadd(sum, gacc[c][r][j * VPT + v]);
                    vec a = vfma(sum, s, acc[r][j * VPT + v]);
                    acc[r][j * VPT + v] = vfma(vbcast(J->xsum + (r0 + r) * J->groups + g), o, a);
                }
            }
    }
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 6
        for (int j = 0; j < nt * VPT; j++)
            store_row(J, r0 + r, (t0 + j / VPT) * 16 + (j % VPT) * VL, acc[r][j]);
}

/* Up to MR rows against the tiles t0 .. t0 + nt. */
static const job *widen_codes(const job *J, int64_t t0, int nt, uint8_t *out, job *J8);

/* 6-bit codes are widened to bytes first (codes8, widen_codes): the float
 * and int16 paths have no 6-bit blocks of their own (each width is a set of
 * unrolled blocks to compile; 6-bit ones run mostly on the int8 path). */
QL_PATH void ftile_group(const job *J, int64_t t0, int nt, uint8_t *codes8) {
    const int mr = (int)J->m;
    job J8;
    if (J->bits == 6) J = widen_codes(J, t0, nt, codes8, &J8);
#define FOLIO_FBLOCK(B, R, T) \
    case BITS_KEY(B) + R * 8 + T: fblock(J, 0, t0, B, R, T); break;
    switch (BITS_KEY(J->bits) + mr * 8 + nt) {
#if MR == 4 && NT == 3
        FOLIO_FBLOCK(4, 1, 1) FOLIO_FBLOCK(4, 2, 1) FOLIO_FBLOCK(4, 3, 1) FOLIO_FBLOCK(4, 4, 1)
        FOLIO_FBLOCK(4, 1, 2) FOLIO_FBLOCK(4, 2, 2) FOLIO_FBLOCK(4, 3, 2) FOLIO_FBLOCK(4, 4, 2)
        FOLIO_FBLOCK(4, 1, 3) FOLIO_FBLOCK(4, 2, 3) FOLIO_FBLOCK(4, 3, 3) FOLIO_FBLOCK(4, 4, 3)
        FOLIO_FBLOCK(8, 1, 1) FOLIO_FBLOCK(8, 2, 1) FOLIO_FBLOCK(8, 3, 1) FOLIO_FBLOCK(8, 4, 1)
        FOLIO_FBLOCK(8, 1, 2) FOLIO_FBLOCK(8, 2, 2) FOLIO_FBLOCK(8, 3, 2) FOLIO_FBLOCK(8, 4, 2)
        FOLIO_FBLOCK(8, 1, 3) FOLIO_FBLOCK(8, 2, 3) FOLIO_FBLOCK(8, 3, 3) FOLIO_FBLOCK(8, 4, 3)
#else
        FOLIO_FBLOCK(4, 1, 1) FOLIO_FBLOCK(4, 2, 1) FOLIO_FBLOCK(4, 3, 1)
        FOLIO_FBLOCK(8, 1, 1) FOLIO_FBLOCK(8, 2, 1) FOLIO_FBLOCK(8, 3, 1)
#endif
    }
#undef FOLIO_FBLOCK
}

#endif
/* ------------------------------------------------- float path, many rows */

/* More rows than MR: each group of tiles is dequantized once into fp32
 * scratch, w = q * scale + offset ([nt][kp][16]), and the rows meet it in a
 * plain fp32 register block (DMR rows x DNT tiles of accumulators, no per-group
 * sums): the dequantized product up to the order of fp32 sums, as before, at
 * the FMA rate of a float GEMM. AVX2's 16 registers hold 6 rows x 2 vectors. */
#if VL == 16
#define DMR 8
#define DNT 3
#else
#define DMR 6
#define DNT 1
#endif

#if QL_PART(4)

QL_PATH void dequantize_tiles(const job *J, int64_t t0, int nt, float *wf) {
    const int64_t stride = tile_bytes(J);
    for (int j = 0; j < nt; j++)
        for (int64_t g = 0; g < J->groups; g++)
            for (int v = 0; v < VPT; v++) {
                vec s, o;
                group_scale(J, t0 + j, g, v, &s, &o);
                for (int64_t p = J->bounds[g]; p < J->bounds[g + 1]; p += 8) {
                    vec w[8];
                    widen_octet(J->codes + (t0 + j) * stride, p / 8, v, J->bits, w);
                    for (int i = 0; i < 8; i++)
                        vstore(wf + (j * J->kp + p + i) * 16 + v * VL, vfma(w[i], s, o));
                }
            }
}

static inline __attribute__((always_inline)) void dblock(const job *J, int64_t r0, int64_t t0,
                                                         const float *wf, const int mr,
                                                         const int nt) {
    const int64_t kp = J->kp;
    vec acc[DMR][DNT * VPT];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 6
        for (int j = 0; j < nt * VPT; j++) acc[r][j] = vzero();
    for (int64_t p = 0; p < kp; p++) {
        vec w[DNT * VPT];
#pragma GCC unroll 3
        for (int j = 0; j < nt; j++)
#pragma GCC unroll 2
            for (int v = 0; v < VPT; v++) {
                w[j * VPT + v] = vload(wf + (j * kp + p) * 16 + v * VL);
                /* held in a register: folded into each FMA, it was loaded once a row */
                __asm__("" : "+v"(w[j * VPT + v]));
            }
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            const vec xb = vbcast(J->x + (r0 + r) * kp + p);
#pragma GCC unroll 6
            for (int j = 0; j < nt * VPT; j++) acc[r][j] = vfma(xb, w[j], acc[r][j]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 6
        for (int j = 0; j < nt * VPT; j++)
            store_row(J, r0 + r, (t0 + j / VPT) * 16 + (j % VPT) * VL, acc[r][j]);
}

QL_PATH void dtile_group(const job *J, int64_t t0, int nt, const float *wf) {
    for (int64_t r = 0; r < J->m; r += DMR) {
        const int mr = J->m - r < DMR ? (int)(J->m - r) : DMR;
#define FOLIO_DBLOCK(R, T) case R * 8 + T: dblock(J, r, t0, wf, R, T); break;
        switch (mr * 8 + nt) {
#if DMR == 8 && DNT == 3
            FOLIO_DBLOCK(1, 1) FOLIO_DBLOCK(2, 1) FOLIO_DBLOCK(3, 1) FOLIO_DBLOCK(4, 1)
            FOLIO_DBLOCK(5, 1) FOLIO_DBLOCK(6, 1) FOLIO_DBLOCK(7, 1) FOLIO_DBLOCK(8, 1)
            FOLIO_DBLOCK(1, 2) FOLIO_DBLOCK(2, 2) FOLIO_DBLOCK(3, 2) FOLIO_DBLOCK(4, 2)
            FOLIO_DBLOCK(5, 2) FOLIO_DBLOCK(6, 2) FOLIO_DBLOCK(7, 2) FOLIO_DBLOCK(8, 2)
            FOLIO_DBLOCK(1, 3) FOLIO_DBLOCK(2, 3) FOLIO_DBLOCK(3, 3) FOLIO_DBLOCK(4, 3)
            FOLIO_DBLOCK(5, 3) FOLIO_DBLOCK(6, 3) FOLIO_DBLOCK(7, 3) FOLIO_DBLOCK(8, 3)
#else
            FOLIO_DBLOCK(1, 1) FOLIO_DBLOCK(2, 1) FOLIO_DBLOCK(3, 1) FOLIO_DBLOCK(4, 1)
            FOLIO_DBLOCK(5, 1) FOLIO_DBLOCK(6, 1)
#endif
        }
#undef FOLIO_DBLOCK
    }
}

#endif

/* With more rows than one register block, the integer paths' scale and
 * offset vectors of each group of tiles t0 .. t0 + nt (of `width` tiles at
 * most) once, for all of the row blocks: scratch [groups][2][width * VPT]. */
static const vec *hold_scales(const job *J, int64_t t0, int nt, int width, vec *scratch) {
    for (int64_t g = 0; g < J->groups; g++)
        for (int j = 0; j < nt; j++)
            for (int v = 0; v < VPT; v++)
                group_scale(J, t0 + j, g, v, scratch + (2 * g) * width * VPT + j * VPT + v,
                            scratch + (2 * g + 1) * width * VPT + j * VPT + v);
    return scratch;
}

/* Group g's scale and offset vectors of tiles t0 .. t0 + nt: hold_scales's
 * (held, `width` tiles a group), or computed. Computed two-level scales take
 * their super-group's pairs from sup [2][width * VPT], which the first group
 * of each super-group fills: converted once for its groups, not once a group
 * (the same products). Groups are asked for in order. */
static inline __attribute__((always_inline)) void scales_of(const job *J, const vec *held,
                                                            int width, int64_t t0, int64_t g,
                                                            int nt, vec *s, vec *o, vec *sup) {
    const int fill = (g & (((int64_t)1 << J->super_shift) - 1)) == 0;
#pragma GCC unroll 2
    for (int j = 0; j < nt; j++)
#pragma GCC unroll 2
        for (int v = 0; v < VPT; v++) {
            const int at = j * VPT + v;
            if (held) {
                s[at] = held[(2 * g) * width * VPT + at];
                o[at] = held[(2 * g + 1) * width * VPT + at];
            } else if (J->supers) {
                if (fill) super_pair(J, t0 + j, g, v, sup + at, sup + width * VPT + at);
                super_scale(J, t0 + j, g, v, sup[at], sup[width * VPT + at], s + at, o + at);
            } else {
                group_scale(J, t0 + j, g, v, s + at, o + at);
            }
        }
}

/* And 6-bit codes: those of tiles t0 .. t0 + nt widened once into the 8-bit
 * layout at out (nt * kp * 16 bytes), which every row block then reads as
 * bytes (J8: the job on them). The unpacking is then once a step, not once a
 * row block. */
static const job *widen_codes(const job *J, int64_t t0, int nt, uint8_t *out, job *J8) {
    const int64_t stride = tile_bytes(J), octets = J->kp / 8;
    for (int j = 0; j < nt; j++)
        for (int64_t o = 0; o < octets; o++)
            for (int v = 0; v < VPT; v++) {
                ivec w[2];
                byte_words(J->codes + (t0 + j - J->code_tile0) * stride, o, v, 6, w);
                istore(out + (j * octets + o) * 128 + v * VL * 4, w[0]);
                istore(out + (j * octets + o) * 128 + 64 + v * VL * 4, w[1]);
            }
    *J8 = *J;
    J8->codes = out;
    J8->bits = 8;
    J8->code_tile0 = t0;
    return J8;
}

#if QL_PART(2)
/* ---------------------------------------------------------------- int16 path */

static inline __attribute__((always_inline)) void qblock(const job *J, int64_t r0, int64_t t0,
                                                         const vec *held,
                                                         const uint8_t *prefetch,
                                                         const int bits, const int mr,
                                                         const int nt) {
    const int64_t kp = J->kp, stride = tile_bytes(J);
    const int chains = mr == 1 ? 4 : mr == 2 ? 2 : 1;      /* as in fblock */
    vec acc[QMR][QNT * VPT];
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int j = 0; j < nt * VPT; j++) acc[r][j] = vzero();
    int64_t blk = 0;
    vec sup[2 * QNT * VPT];
    for (int64_t g = 0; g < J->groups; g++) {
        vec s[QNT * VPT], o[QNT * VPT];
        scales_of(J, held, QNT, t0, g, nt, s, o, sup);
        for (int64_t p0 = J->bounds[g]; p0 < J->bounds[g + 1]; p0 += 32, blk++) {
            const int64_t p1 = p0 + 32 < J->bounds[g + 1] ? p0 + 32 : J->bounds[g + 1];
            ivec iacc[4][QMR][QNT * VPT];
#pragma GCC unroll 4
            for (int c = 0; c < chains; c++)
#pragma GCC unroll 4
                for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
                    for (int j = 0; j < nt * VPT; j++) iacc[c][r][j] = izero();
            for (int64_t p = p0; p < p1; p += 8) {
                /* four pairs of positions per octet: (0,2) (1,3) (4,6) (5,7),
                 * as the codes' int16 lanes come out of their words */
                ivec c[QNT * VPT][2];
                const int64_t at = (p / 8) * 16 * bits;      /* about where the octet is */
#pragma GCC unroll 2
                for (int j = 0; j < nt; j++) {
                    const uint8_t *t = J->codes + (t0 + j - J->code_tile0) * stride;
#pragma GCC unroll 2
                    for (int v = 0; v < VPT; v++) {
                        if (bits == 4)
                            c[j * VPT + v][0] = iload(t + at + v * VL * 4);
                        else
                            byte_words(t, p / 8, v, bits, c[j * VPT + v]);
                    }
                    /* the next group of tiles into L2 while this one runs */
                    if (prefetch) {
                        _mm_prefetch((const char *)(prefetch + j * stride + at), _MM_HINT_T1);
                        if (bits > 4)
                            _mm_prefetch((const char *)(prefetch + j * stride + at + 64),
                                         _MM_HINT_T1);
                    }
                }
#pragma GCC unroll 4
                for (int q = 0; q < 4; q++) {
                    ivec pair[QNT * VPT];
#pragma GCC unroll 4
                    for (int j = 0; j < nt * VPT; j++) {
                        if (bits == 4) {
                            const int shift = q == 0 ? 0 : q == 1 ? 8 : q == 2 ? 4 : 12;
                            pair[j] = iand(isrl(c[j][0], shift), iset1(0x000f000f));
                        } else {
                            pair[j] = iand(isrl(c[j][q / 2], (q & 1) * 8), iset1(0x00ff00ff));
                        }
                    }
#pragma GCC unroll 4
                    for (int r = 0; r < mr; r++) {
                        const ivec xv = iset1(J->xq[((r0 + r) * kp + p) / 2 + q]);
#pragma GCC unroll 4
                        for (int j = 0; j < nt * VPT; j++)
                            iacc[q % chains][r][j] = idot(iacc[q % chains][r][j], pair[j], xv);
                    }
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) {
                const vec xs = vbcast(J->xscale + (r0 + r) * J->blocks + blk);
#pragma GCC unroll 4
                for (int j = 0; j < nt * VPT; j++)
                {
                    ivec sum = iacc[0][r][j];
#pragma GCC unroll 4
                    for (int c = 1; c < chains; c++) sum = iadd(sum, iacc[c][r][j]);
                    acc[r][j] = vfma(itof(sum), vmul(s[j], xs), acc[r][j]);
                }
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) {
            const vec xsum = vbcast(J->xsum + (r0 + r) * J->groups + g);
#pragma GCC unroll 4
            for (int j = 0; j < nt * VPT; j++) acc[r][j] = vfma(xsum, o[j], acc[r][j]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int j = 0; j < nt * VPT; j++)
            store_row(J, r0 + r, (t0 + j / VPT) * 16 + (j % VPT) * VL, acc[r][j]);
}

/* `next`: the codes of the next group of tiles (or NULL), prefetched. */
QL_PATH void qtile_group(const job *J, int64_t t0, int nt, const uint8_t *next, vec *scratch,
                        uint8_t *codes8) {
    const vec *held = J->m > QMR && scratch ? hold_scales(J, t0, nt, QNT, scratch) : 0;
    job J8;
    if (J->bits == 6) {                 /* as ftile_group */
        J = widen_codes(J, t0, nt, codes8, &J8);
        next = 0;
    }
    for (int64_t r = 0; r < J->m; r += QMR) {
        const int mr = J->m - r < QMR ? (int)(J->m - r) : QMR;
        const uint8_t *pf = r == 0 ? next : 0;
#define FOLIO_QBLOCK(B, R, T) \
    case BITS_KEY(B) + R * 8 + T: qblock(J, r, t0, held, pf, B, R, T); break;
        switch (BITS_KEY(J->bits) + mr * 8 + nt) {
#if QMR == 4 && QNT == 2
            FOLIO_QBLOCK(4, 1, 1) FOLIO_QBLOCK(4, 2, 1) FOLIO_QBLOCK(4, 3, 1) FOLIO_QBLOCK(4, 4, 1)
            FOLIO_QBLOCK(4, 1, 2) FOLIO_QBLOCK(4, 2, 2) FOLIO_QBLOCK(4, 3, 2) FOLIO_QBLOCK(4, 4, 2)
            FOLIO_QBLOCK(8, 1, 1) FOLIO_QBLOCK(8, 2, 1) FOLIO_QBLOCK(8, 3, 1) FOLIO_QBLOCK(8, 4, 1)
            FOLIO_QBLOCK(8, 1, 2) FOLIO_QBLOCK(8, 2, 2) FOLIO_QBLOCK(8, 3, 2) FOLIO_QBLOCK(8, 4, 2)
#else
            FOLIO_QBLOCK(4, 1, 1) FOLIO_QBLOCK(4, 2, 1)
            FOLIO_QBLOCK(8, 1, 1) FOLIO_QBLOCK(8, 2, 1)
#endif
        }
#undef FOLIO_QBLOCK
    }
}

#endif

#if QL_PART(3)
/* ---------------------------------------------------------------- int8 path */

/* One step of a block's integer sums: the code bytes w (4 positions a lane)
 * times x's 4 bytes there (xv, the same in every lane). Without VNNI, 6-bit
 * codes take bpair6 (below) instead, a whole octet at once. */
static inline __attribute__((always_inline)) ivec bstep(ivec acc, ivec w, ivec xv,
                                                        const int bits) {
#if VNNI8
    (void)bits;
    return bdot(acc, w, xv);             /* unsigned codes x signed x, 4 into each int32 */
#else
    if (bits == 4)                       /* pairs into int16: at most 2 x 15 x 127 */
        return iadd16(acc, imaddubs(w, xv));
    /* w = q - 128 (signed): |w| times x with w's sign, at most 2 x 128 x 127 a pair */
    return iadd(acc, imadd16(imaddubs(iabs8(w), isign8(xv, w)), iset16(1)));
#endif
}

#if !VNNI8
/* 6-bit codes (under 64) without VNNI: the pairs of an octet's two halves
 * (wlo times x's bytes x0, whi times x1) summed in int16 (at most
 * 4 x 63 x 127), then widened once into acc's int32 sums. */
static inline __attribute__((always_inline)) ivec bpair6(ivec acc, ivec wlo, ivec whi, ivec x0,
                                                         ivec x1, ivec mul) {
    /* mul: ones, or (sblock) the groups' integer scales, each in both halves */
    return iadd(acc, imadd16(iadd16(imaddubs(wlo, x0), imaddubs(whi, x1)), mul));
}
#endif

/* One block's (positions p0 .. p1, at most 32) integer sums, rows r0 .. r0 +
 * mr against tiles t0 .. t0 + nt, into iacc (zeroed by the caller; chains:
 * iblock's). Without VNNI, 6-bit codes' int16 pairs are widened by vpmaddwd
 * with mul (ones; sblock: the groups' integer scales, so their sums come out
 * scaled). */
static inline __attribute__((always_inline)) void block_sums(const job *J, int64_t r0,
                                                             int64_t t0, int64_t p0, int64_t p1,
                                                             const int bits, const int mr,
                                                             const int nt, const int chains,
                                                             const ivec *mul,
                                                             ivec iacc[2][IMR][INT * VPT]) {
    const int64_t kp = J->kp, stride = tile_bytes(J);
    (void)mul;
    for (int64_t p = p0; p < p1; p += 8) {
        /* each lane's word: positions 0..3 of the octet (lo), 4..7 (hi) */
        ivec w[2][INT * VPT];
        prefetch_codes(J, t0, nt, p, bits, J->m <= IMR ? FOLIO_QL_PREFETCH_BYTES : 0);
#pragma GCC unroll 2
        for (int j = 0; j < nt; j++)
#pragma GCC unroll 2
            for (int v = 0; v < VPT; v++) {
                const uint8_t *t = J->codes + (t0 + j - J->code_tile0) * stride +
                                   (p >> 3) * 64 + v * VL * 4;
                if (bits == 4) {
                    const ivec c = iload(t), m4 = iset1(0x0f0f0f0f);
                    w[0][j * VPT + v] = iand(c, m4);
                    w[1][j * VPT + v] = iand(isrl(c, 4), m4);
                } else {
                    /* 6-bit codes packed, or widened by itile_group into
                     * the 8-bit layout (J->bits 8), the arithmetic of
                     * codes under 64 either way */
                    ivec b[2];
                    const uint8_t *at = J->codes + (t0 + j - J->code_tile0) * stride;
                    if (bits == 6 && J->bits == 8)
                        byte_words(at, p >> 3, v, 8, b);
                    else
                        byte_words(at, p >> 3, v, bits, b);
                    w[0][j * VPT + v] = b[0];
                    w[1][j * VPT + v] = b[1];
                    if (!VNNI8 && bits == 8) {
                        w[0][j * VPT + v] = ixor(w[0][j * VPT + v], iset1((int)0x80808080));
                        w[1][j * VPT + v] = ixor(w[1][j * VPT + v], iset1((int)0x80808080));
                    }
                }
            }
#if !VNNI8
        if (bits == 6) {
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) {
                int32_t word[2];
                memcpy(word, J->x8 + (r0 + r) * kp + p, 8);
                const ivec x0 = iset1(word[0]), x1 = iset1(word[1]);
#pragma GCC unroll 4
                for (int j = 0; j < nt * VPT; j++) {
                    iacc[0][r][j] = bpair6(iacc[0][r][j], w[0][j], w[1][j], x0, x1,
                                           mul[j]);
                    HOLD(iacc[0][r][j]);
                }
            }
            continue;
        }
#endif
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++)
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) {
                int32_t word;
                memcpy(&word, J->x8 + (r0 + r) * kp + p + 4 * h, 4);
                const ivec xv = iset1(word);
#pragma GCC unroll 4
                for (int j = 0; j < nt * VPT; j++) {
                    iacc[h % chains][r][j] = bstep(iacc[h % chains][r][j], w[h][j], xv, bits);
                    HOLD(iacc[h % chains][r][j]);
                }
            }
    }
}

static inline __attribute__((always_inline)) void iblock(const job *J, int64_t r0, int64_t t0,
                                                         const vec *held,
                                                         const int bits, const int mr,
                                                         const int nt) {
    /* vpdpbusd's latency: with one or two rows, the low and high words' sums in
     * two chains (vpmaddubsw's sums are a one-cycle add) */
    const int chains = VNNI8 && mr <= 2 ? 2 : 1;
    vec acc[IMR][INT * VPT];
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int j = 0; j < nt * VPT; j++) acc[r][j] = vzero();
    int64_t blk = 0;
    vec sup[2 * INT * VPT];
    ivec ones[INT * VPT];
#pragma GCC unroll 4
    for (int j = 0; j < INT * VPT; j++) ones[j] = iset16(1);
    for (int64_t g = 0; g < J->groups; g++) {
        vec s[INT * VPT], o[INT * VPT];
        scales_of(J, held, INT, t0, g, nt, s, o, sup);
        for (int64_t p0 = J->bounds[g]; p0 < J->bounds[g + 1]; p0 += 32, blk++) {
            const int64_t p1 = p0 + 32 < J->bounds[g + 1] ? p0 + 32 : J->bounds[g + 1];
            ivec iacc[2][IMR][INT * VPT];
#pragma GCC unroll 2
            for (int c = 0; c < chains; c++)
#pragma GCC unroll 4
                for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
                    for (int j = 0; j < nt * VPT; j++) iacc[c][r][j] = izero();
            block_sums(J, r0, t0, p0, p1, bits, mr, nt, chains, ones, iacc);
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) {
                const vec xs = vbcast(J->xscale + (r0 + r) * J->blocks + blk);
                const int32_t back = 128 * J->x8sum[(r0 + r) * J->blocks + blk];
#pragma GCC unroll 4
                for (int j = 0; j < nt * VPT; j++) {
                    ivec sum = iacc[0][r][j];
                    if (!VNNI8 && bits == 4) {
                        if (chains == 2) sum = iadd16(sum, iacc[1][r][j]);  /* a block fits */
                        sum = imadd16(sum, iset16(1));
                    } else {
                        if (chains == 2) sum = iadd(sum, iacc[1][r][j]);
                        if (!VNNI8 && bits == 8) sum = iadd(sum, iset1(back));  /* q = w + 128 */
                    }
                    acc[r][j] = vfma(itof(sum), vmul(s[j], xs), acc[r][j]);
                }
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) {
            const vec xsum = vbcast(J->xsum + (r0 + r) * J->groups + g);
#pragma GCC unroll 4
            for (int j = 0; j < nt * VPT; j++) acc[r][j] = vfma(xsum, o[j], acc[r][j]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int j = 0; j < nt * VPT; j++)
            store_row(J, r0 + r, (t0 + j / VPT) * 16 + (j % VPT) * VL, acc[r][j]);
}

/* Two-level scales in integers (J->isuper: a K-quant's int8 scales and
 * offsets under a float16 pair per super-block, x quantized to int8 per
 * super-block, groups of at most 32 positions): per super-block S, row r and
 * output feature n, exactly in int32,
 *     isc = sum_{g in S} sc[n][g] * (sum_{k in g} q[n][k] x8[r][k])
 *     ioff = sum_{g in S} off[n][g] * (sum_{k in g} x8[r][k])
 * then y += isc * (d[n][S] xs[r][S]); y += ioff * (m[n][S] xs[r][S]), two
 * fp32 multiply-adds a super-block, in this order on every path (sblock,
 * rows4s, rows4_q4_all), so a row's output is the same bits at any row
 * count. The integer scales multiply each group's sums as integers
 * (vpmaddwd by the scale in both halves of a lane without VNNI, vpmulld
 * with it), the offsets' sums two groups a vpmaddwd (x8pair). */
static inline __attribute__((always_inline)) ivec super_k(const job *J, int64_t tile, int64_t g,
                                                          int v) {
    const ivec k = ismall((const int8_t *)J->scales + (tile * J->groups + g) * 16 + v * VL);
#if VNNI8
    return k;
#else
    return ior(iand(k, iset1(0xffff)), isll(k, 16));
#endif
}

/* groups g (even) and g + 1's int8 offsets (Q6_K: the scales) as int16 pairs */
static inline __attribute__((always_inline)) ivec super_offpair(const job *J, int64_t tile,
                                                                int64_t g, int v) {
    const int8_t *o = (const int8_t *)(J->offsets ? J->offsets : J->scales) +
                      (tile * J->groups + g) * 16 + v * VL;
    return ior(iand(ismall(o), iset1(0xffff)), isll(ismall(o + 16), 16));
}

/* The integer scales held for all row blocks (isuper), width tiles a slot of
 * width * VPT vectors: slot g group g's super_k, slot groups + g / 2 the
 * pair of g's offsets, slots groups + groups / 2 + 2 S and + 1 super-block
 * S's d and m. */
static const vec *hold_super(const job *J, int64_t t0, int nt, int width, vec *scratch) {
    const int64_t per = (int64_t)1 << J->super_shift, half = J->groups / 2;
    for (int j = 0; j < nt; j++)
        for (int v = 0; v < VPT; v++) {
            const int at = j * VPT + v;
            for (int64_t g = 0; g < J->groups; g++) {
                scratch[g * width * VPT + at] = itov(super_k(J, t0 + j, g, v));
                if (!(g & 1))
                    scratch[(J->groups + g / 2) * width * VPT + at] =
                        itov(super_offpair(J, t0 + j, g, v));
            }
            for (int64_t S = 0; S < J->supers_n; S++)
                super_pair(J, t0 + j, S * per, v,
                           scratch + (J->groups + half + 2 * S) * width * VPT + at,
                           scratch + (J->groups + half + 2 * S + 1) * width * VPT + at);
        }
    return scratch;
}

/* The end of super-block S for one row: its offsets' integer sum (two groups
 * a vpmaddwd) and the two multiply-adds. op: the offset pairs of the tile
 * vector, a slot apart (stride vectors); pairs: the row's x8pair there. */
static inline __attribute__((always_inline)) vec super_end(vec acc, ivec isc, const vec *op,
                                                           int64_t stride, const int32_t *pairs,
                                                           int64_t npairs, vec d, vec m, vec xs) {
    ivec io = izero();
    for (int64_t p = 0; p < npairs; p++) io = iadd(io, imadd16(vtoi(op[p * stride]), iset1(pairs[p])));
    acc = vfma(itof(isc), vmul(d, xs), acc);
    return vfma(itof(io), vmul(m, xs), acc);
}

static inline __attribute__((always_inline)) void sblock(const job *J, int64_t r0, int64_t t0,
                                                         const vec *held, const int bits,
                                                         const int mr, const int nt) {
    const int chains = VNNI8 && mr <= 2 ? 2 : 1;
    const int64_t per = (int64_t)1 << J->super_shift, half = J->groups / 2, W = INT * VPT;
    vec acc[IMR][INT * VPT];
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int j = 0; j < nt * VPT; j++) acc[r][j] = vzero();
    for (int64_t S = 0; S < J->supers_n; S++) {
        ivec isc[IMR][INT * VPT];
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
            for (int j = 0; j < nt * VPT; j++) isc[r][j] = izero();
        for (int64_t g = S * per; g < (S + 1) * per; g++) {
            ivec k[INT * VPT];
#pragma GCC unroll 4
            for (int j = 0; j < nt * VPT; j++)
                k[j] = held ? vtoi(held[g * W + j]) : super_k(J, t0 + j / VPT, g, j % VPT);
            ivec iacc[2][IMR][INT * VPT];
#pragma GCC unroll 2
            for (int c = 0; c < chains; c++)
#pragma GCC unroll 4
                for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
                    for (int j = 0; j < nt * VPT; j++) iacc[c][r][j] = izero();
            block_sums(J, r0, t0, J->bounds[g], J->bounds[g + 1], bits, mr, nt, chains, k, iacc);
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
                for (int j = 0; j < nt * VPT; j++) {
                    ivec sum = iacc[0][r][j];
#if VNNI8
                    if (chains == 2) sum = iadd(sum, iacc[1][r][j]);
                    sum = imul32(sum, k[j]);
#else
                    if (bits == 4) sum = imadd16(sum, k[j]);   /* 6 bits: scaled already */
#endif
                    isc[r][j] = iadd(isc[r][j], sum);
                }
        }
        /* the super-block's float16 pairs and offset pairs: held, or
         * computed once for the rows (isuper: at most 8 pairs) */
        vec d[INT * VPT], m[INT * VPT], ops[INT * VPT][8];
        const vec *op = held ? held + (J->groups + S * per / 2) * W : ops[0];
        const int64_t ostride = held ? W : 1;
#pragma GCC unroll 4
        for (int j = 0; j < nt * VPT; j++) {
            if (held) {
                d[j] = held[(J->groups + half + 2 * S) * W + j];
                m[j] = held[(J->groups + half + 2 * S + 1) * W + j];
                continue;
            }
            super_pair(J, t0 + j / VPT, S * per, j % VPT, d + j, m + j);
            for (int64_t p = 0; p < per / 2; p++)
                ops[j][p] = itov(super_offpair(J, t0 + j / VPT, S * per + 2 * p, j % VPT));
        }
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) {
            const vec xs = vbcast(J->xscale + (r0 + r) * J->blocks + S);
            const int32_t *pairs = J->x8pair + (r0 + r) * half + S * per / 2;
#pragma GCC unroll 4
            for (int j = 0; j < nt * VPT; j++)
                acc[r][j] = super_end(acc[r][j], isc[r][j], op + (held ? j : 8 * j), ostride,
                                      pairs, per / 2, d[j], m[j], xs);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int j = 0; j < nt * VPT; j++)
            store_row(J, r0 + r, (t0 + j / VPT) * 16 + (j % VPT) * VL, acc[r][j]);
}

/* 1: rows4_q4_all (below) takes the AVX2 build's 4-bit groups at many rows */
#ifndef FOLIO_QL_GROUPED
#define FOLIO_QL_GROUPED 1
#endif

#if !VNNI8 && VL == 8
/* rows4's and rows4_q4_all's end of super-block S for one row: its 16
 * float sums and 16 integer ones in memory (the integer ones zeroed for the
 * next super-block), the scales held (hold_super). */
static inline __attribute__((always_inline)) void row_super_end(const job *J, const vec *held,
                                                                int64_t S, int64_t row,
                                                                float *acc, int32_t *isc) {
    const int64_t per = (int64_t)1 << J->super_shift, half = J->groups / 2;
    const vec *dm = held + (J->groups + half + 2 * S) * VPT;
    const vec x = vbcast(J->xscale + row * J->blocks + S);
    const int32_t *pairs = J->x8pair + row * half + S * per / 2;
#pragma GCC unroll 2
    for (int v = 0; v < 2; v++) {
        vstore(acc + 8 * v, super_end(vload(acc + 8 * v), iload(isc + 8 * v),
                                      held + (J->groups + S * per / 2) * VPT + v, VPT, pairs,
                                      per / 2, dm[v], dm[VPT + v], x));
        istore(isc + 8 * v, izero());
    }
}

/* AVX2 without VNNI, four rows of one tile, the scales held, every group one
 * block (4-bit codes: groups of 32 positions, Q4_K's; 6-bit ones widened to
 * bytes: groups of 16, Q6_K's), written for the 16 registers: a block's
 * integer sums stay in registers through its octets (iblock's general form
 * spills some), the float sums live in memory, touched once a block, and
 * the row pointers are taken once. The same sums as iblock's, in its order. */
static inline __attribute__((always_inline)) void rows4(const job *J, int64_t r0, int64_t t0,
                                                        const vec *held, const int bits,
                                                        const int octets, const int sup) {
    const int64_t kp = J->kp;
    const uint8_t *codes = J->codes + (t0 - J->code_tile0) * tile_bytes(J);
    const int8_t *x8[4];
    const float *xs[4], *xsum[4];
    float acc[4][16] __attribute__((aligned(32)));
    int32_t isc[4][16] __attribute__((aligned(32)));    /* sup: the super-block's */
    const int64_t per = (int64_t)1 << J->super_shift;
    for (int r = 0; r < 4; r++) {
        x8[r] = J->x8 + (r0 + r) * kp;
        xs[r] = J->xscale + (r0 + r) * J->blocks;
        xsum[r] = J->xsum + (r0 + r) * J->groups;
        vstore(acc[r], vzero());
        vstore(acc[r] + 8, vzero());
        istore(isc[r], izero());
        istore(isc[r] + 8, izero());
    }
    const ivec m4 = iset1(0x0f0f0f0f), ones = iset16(1);
    for (int64_t g = 0; g < J->groups; g++) {
        const int64_t p0 = J->bounds[g];
        const vec *sg = held + 2 * g * VPT, *og = sg + VPT;
        /* sup: the group's integer scales (6 bits: inside the sums) */
        ivec mul[2] = {ones, ones};
        if (sup) mul[0] = vtoi(held[g * VPT]), mul[1] = vtoi(held[g * VPT + 1]);
        ivec a[4][2];       /* 4 bits: int16 pairs (as iblock's); 6: int32 */
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) a[r][0] = a[r][1] = izero();
#pragma GCC unroll 4
        for (int oct = 0; oct < octets; oct++) {
            const int64_t at = p0 + oct * 8;
            if (bits == 4) {
                const uint8_t *c = codes + (at >> 3) * 64;
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    ivec w0 = iload(c), w1 = iload(c + 32);
                    if (h) w0 = isrl(w0, 4), w1 = isrl(w1, 4);
                    w0 = iand(w0, m4);
                    w1 = iand(w1, m4);
#pragma GCC unroll 4
                    for (int r = 0; r < 4; r++) {
                        int32_t word;
                        memcpy(&word, x8[r] + at + 4 * h, 4);
                        const ivec xv = iset1(word);
                        a[r][0] = bstep(a[r][0], w0, xv, 4);
                        a[r][1] = bstep(a[r][1], w1, xv, 4);
                        HOLD(a[r][0]);
                        HOLD(a[r][1]);
                    }
                }
            } else {        /* widened 6-bit codes, as iblock's */
                const uint8_t *c = codes + (at >> 3) * 128;
                const ivec w00 = iload(c), w01 = iload(c + 32), w10 = iload(c + 64),
                           w11 = iload(c + 96);
#pragma GCC unroll 4
                for (int r = 0; r < 4; r++) {
                    int32_t word[2];
                    memcpy(word, x8[r] + at, 8);
                    const ivec x0 = iset1(word[0]), x1 = iset1(word[1]);
                    a[r][0] = bpair6(a[r][0], w00, w10, x0, x1, mul[0]);
                    a[r][1] = bpair6(a[r][1], w01, w11, x0, x1, mul[1]);
                    HOLD(a[r][0]);
                    HOLD(a[r][1]);
                }
            }
        }
        if (sup) {
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++)
#pragma GCC unroll 2
                for (int v = 0; v < 2; v++) {
                    const ivec sum = bits == 4 ? imadd16(a[r][v], mul[v]) : a[r][v];
                    istore(isc[r] + 8 * v, iadd(iload(isc[r] + 8 * v), sum));
                }
            if ((g & (per - 1)) != per - 1) continue;
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++)
                row_super_end(J, held, g >> J->super_shift, r0 + r, acc[r], isc[r]);
            continue;
        }
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            const vec x = vbcast(xs[r] + g), xg = vbcast(xsum[r] + g);
#pragma GCC unroll 2
            for (int v = 0; v < 2; v++) {
                const ivec sum = bits == 4 ? imadd16(a[r][v], ones) : a[r][v];
                const vec t = vfma(itof(sum), vmul(sg[v], x), vload(acc[r] + 8 * v));
                vstore(acc[r] + 8 * v, vfma(xg, og[v], t));
            }
        }
    }
    for (int r = 0; r < 4; r++) {
        store_row(J, r0 + r, t0 * 16, vload(acc[r]));
        store_row(J, r0 + r, t0 * 16 + 8, vload(acc[r] + 8));
    }
}

#if !FOLIO_QL_GROUPED      /* else rows4_q4_all takes every 4-row block of 4-bit codes */
static __attribute__((noinline)) void rows4_q4(const job *J, int64_t r0, int64_t t0,
                                                const vec *held) {
    rows4(J, r0, t0, held, 4, 4, 0);
}

static __attribute__((noinline)) void rows4_q4s(const job *J, int64_t r0, int64_t t0,
                                                 const vec *held) {
    rows4(J, r0, t0, held, 4, 4, 1);
}
#endif

static __attribute__((noinline)) void rows4_q6(const job *J, int64_t r0, int64_t t0,
                                                const vec *held) {
    rows4(J, r0, t0, held, 6, 2, 0);
}

static __attribute__((noinline)) void rows4_q6s(const job *J, int64_t r0, int64_t t0,
                                                 const vec *held) {
    rows4(J, r0, t0, held, 6, 2, 1);
}

/* 4-bit codes at more than IMR rows, the group outermost: a group's codes
 * (4 octets, 256 bytes) are unpacked once into 16 registers' worth of bytes
 * in L1 and every 4-row group of rows [0, rows) takes them from there, where
 * rows4 unpacked them again for each (8 times at 32 rows): the AVX2 build's
 * pass over the 1B Q4_K_M at 32 rows 1.10-1.16x (the 6-bit groups, widened
 * already, the same way: 0.91x, left to rows4). The float sums of up to GR
 * rows live in memory (sup: and the super-block's integer ones). The same
 * sums as rows4's, in its order. */
#define GR 64
static inline __attribute__((always_inline)) void rows4_q4_all(const job *J, int64_t rows,
                                                               int64_t t0, const vec *held,
                                                               const int sup) {
    const int64_t kp = J->kp;
    const uint8_t *codes = J->codes + (t0 - J->code_tile0) * tile_bytes(J);
    float acc[GR][16] __attribute__((aligned(32)));
    int32_t isc[GR][16] __attribute__((aligned(32)));
    ivec un[4][2][2];   /* [octet][half][lanes 0-7, 8-15] */
    const ivec m4 = iset1(0x0f0f0f0f), ones = iset16(1);
    const int64_t per = (int64_t)1 << J->super_shift;
    for (int64_t c0 = 0; c0 < rows; c0 += GR) {
        const int64_t cn = rows - c0 < GR ? rows - c0 : GR;
        for (int64_t r = 0; r < cn; r++) {
            vstore(acc[r], vzero());
            vstore(acc[r] + 8, vzero());
            if (sup) {
                istore(isc[r], izero());
                istore(isc[r] + 8, izero());
            }
        }
        for (int64_t g = 0; g < J->groups; g++) {
            const int64_t p0 = J->bounds[g];
#pragma GCC unroll 4
            for (int oct = 0; oct < 4; oct++) {
                const uint8_t *c = codes + ((p0 >> 3) + oct) * 64;
                const ivec w0 = iload(c), w1 = iload(c + 32);
                un[oct][0][0] = iand(w0, m4);
                un[oct][0][1] = iand(w1, m4);
                un[oct][1][0] = iand(isrl(w0, 4), m4);
                un[oct][1][1] = iand(isrl(w1, 4), m4);
            }
            const vec *sg = held + 2 * g * VPT, *og = sg + VPT;
            ivec mul[2] = {ones, ones};
            if (sup) mul[0] = vtoi(held[g * VPT]), mul[1] = vtoi(held[g * VPT + 1]);
            for (int64_t r0 = 0; r0 < cn; r0 += 4) {
                const int8_t *x8[4];
#pragma GCC unroll 4
                for (int r = 0; r < 4; r++) x8[r] = J->x8 + (c0 + r0 + r) * kp + p0;
                ivec a[4][2];
#pragma GCC unroll 4
                for (int r = 0; r < 4; r++) a[r][0] = a[r][1] = izero();
#pragma GCC unroll 4
                for (int oct = 0; oct < 4; oct++)
#pragma GCC unroll 2
                    for (int h = 0; h < 2; h++) {
                        const ivec w0 = un[oct][h][0], w1 = un[oct][h][1];
#pragma GCC unroll 4
                        for (int r = 0; r < 4; r++) {
                            int32_t word;
                            memcpy(&word, x8[r] + oct * 8 + 4 * h, 4);
                            const ivec xv = iset1(word);
                            a[r][0] = bstep(a[r][0], w0, xv, 4);
                            a[r][1] = bstep(a[r][1], w1, xv, 4);
                            HOLD(a[r][0]);
                            HOLD(a[r][1]);
                        }
                    }
                if (sup) {
#pragma GCC unroll 4
                    for (int r = 0; r < 4; r++)
#pragma GCC unroll 2
                        for (int v = 0; v < 2; v++) {
                            int32_t *at = isc[r0 + r] + 8 * v;
                            istore(at, iadd(iload(at), imadd16(a[r][v], mul[v])));
                        }
                    continue;
                }
#pragma GCC unroll 4
                for (int r = 0; r < 4; r++) {
                    const int64_t row = c0 + r0 + r;
                    const vec x = vbcast(J->xscale + row * J->blocks + g),
                              xg = vbcast(J->xsum + row * J->groups + g);
#pragma GCC unroll 2
                    for (int v = 0; v < 2; v++) {
                        const ivec sum = imadd16(a[r][v], ones);
                        float *at = acc[r0 + r] + 8 * v;
                        const vec t = vfma(itof(sum), vmul(sg[v], x), vload(at));
                        vstore(at, vfma(xg, og[v], t));
                    }
                }
            }
            if (!sup || (g & (per - 1)) != per - 1) continue;
            for (int64_t r = 0; r < cn; r++)
                row_super_end(J, held, g >> J->super_shift, c0 + r, acc[r], isc[r]);
        }
        for (int64_t r = 0; r < cn; r++) {
            store_row(J, c0 + r, t0 * 16, vload(acc[r]));
            store_row(J, c0 + r, t0 * 16 + 8, vload(acc[r] + 8));
        }
    }
}
#undef GR

static __attribute__((noinline)) void rows4_q4_rows(const job *J, int64_t rows, int64_t t0,
                                                    const vec *held) {
    rows4_q4_all(J, rows, t0, held, 0);
}

static __attribute__((noinline)) void rows4_q4_rows_s(const job *J, int64_t rows, int64_t t0,
                                                      const vec *held) {
    rows4_q4_all(J, rows, t0, held, 1);
}

/* Which rows4 serves this job (read after 6-bit codes are widened): 4 (4-bit,
 * groups of 32), 6 (6-bit widened, groups of 16), else 0. */
static int rows4_kind(const job *J, int bits) {
    const int64_t len = bits == 4 ? 32 : 16;
    if (!(bits == 4 || (bits == 6 && J->bits == 8)) || (!J->isuper && J->blocks != J->groups))
        return 0;
    for (int64_t g = 0; g < J->groups; g++)
        if (J->bounds[g + 1] - J->bounds[g] != len) return 0;
    return bits;
}
#endif

QL_PATH void itile_group(const job *J, int64_t t0, int nt, vec *scratch, uint8_t *codes8) {
    const vec *held = !(J->m > IMR && scratch) ? 0
                      : J->isuper ? hold_super(J, t0, nt, INT, scratch)
                                  : hold_scales(J, t0, nt, INT, scratch);
    job J8;
    const int bits = J->bits;
    if (bits == 6 && J->m > IMR && codes8) J = widen_codes(J, t0, nt, codes8, &J8);
    /* 6-bit codes widened: without VNNI still the 6-bit blocks (their sums
     * in int16 pairs), with it the 8-bit ones (vpdpbusd takes any byte) */
    const int key = VNNI8 ? J->bits : bits;
#if !VNNI8 && VL == 8
    const int kind = held && nt == 1 ? rows4_kind(J, bits) : 0;
#endif
    int64_t first = 0;
#if !VNNI8 && VL == 8
    if (FOLIO_QL_GROUPED && kind == 4) {
        first = J->m & ~(int64_t)3;
        if (J->isuper)
            rows4_q4_rows_s(J, first, t0, held);
        else
            rows4_q4_rows(J, first, t0, held);
    }
#endif
    for (int64_t r = first; r < J->m; r += IMR) {
        const int mr = J->m - r < IMR ? (int)(J->m - r) : IMR;
#if !VNNI8 && VL == 8
        if (kind && mr == 4) {
#if !FOLIO_QL_GROUPED
            if (kind == 4)
                (J->isuper ? rows4_q4s : rows4_q4)(J, r, t0, held);
            else
#endif
                (J->isuper ? rows4_q6s : rows4_q6)(J, r, t0, held);
            continue;
        }
#endif
#define FOLIO_IBLOCK(B, R, T) \
    case BITS_KEY(B) + R * 8 + T:                                     \
        if (J->isuper && (VNNI8 || B != 8))                           \
            sblock(J, r, t, h, B, R, T);                              \
        else                                                          \
            iblock(J, r, t, h, B, R, T);                              \
        break;
        /* a remainder of fewer than IMR rows takes its tiles one at a time
         * (the same arithmetic a row; those blocks' build time saved), the
         * held scales of tile t at h (a tile's vectors VPT apart in each slot) */
        const int tn = mr < IMR ? 1 : nt;
        for (int64_t t = t0; t < t0 + nt; t += tn) {
            const vec *h = held ? held + (t - t0) * VPT : 0;
            switch (BITS_KEY(key) + mr * 8 + tn) {
#if INT == 2
                FOLIO_IBLOCK(4, 1, 1) FOLIO_IBLOCK(4, 2, 1) FOLIO_IBLOCK(4, 3, 1)
                FOLIO_IBLOCK(4, 4, 1) FOLIO_IBLOCK(4, 4, 2)
                FOLIO_IBLOCK(6, 1, 1) FOLIO_IBLOCK(6, 2, 1) FOLIO_IBLOCK(6, 3, 1)
                FOLIO_IBLOCK(6, 4, 1) FOLIO_IBLOCK(6, 4, 2)
                FOLIO_IBLOCK(8, 1, 1) FOLIO_IBLOCK(8, 2, 1) FOLIO_IBLOCK(8, 3, 1)
                FOLIO_IBLOCK(8, 4, 1) FOLIO_IBLOCK(8, 4, 2)
#else
                FOLIO_IBLOCK(4, 1, 1) FOLIO_IBLOCK(4, 2, 1) FOLIO_IBLOCK(4, 3, 1)
                FOLIO_IBLOCK(4, 4, 1)
                FOLIO_IBLOCK(6, 1, 1) FOLIO_IBLOCK(6, 2, 1) FOLIO_IBLOCK(6, 3, 1)
                FOLIO_IBLOCK(6, 4, 1)
                FOLIO_IBLOCK(8, 1, 1) FOLIO_IBLOCK(8, 2, 1) FOLIO_IBLOCK(8, 3, 1)
                FOLIO_IBLOCK(8, 4, 1)
#endif
            }
        }
#undef FOLIO_IBLOCK
    }
}

#endif

#if QL_PART(0)
/* ---------------------------------------------------------------- entry */

/* 2: the AVX-512 build, 1: the AVX2 one (0: neither, below). */
int folio_qlinear_available(void) { return VL == 16 ? 2 : 1; }

/* The most rows at which `quantize_x` 3 takes the int8 path for codes of
 * `bits`: where it beat the float and int16 paths in docs/bench/qlinear_rows.py.
 * Every row count, for every code width, on every build, so a row's
 * arithmetic does not depend on how many rows share its step:
 * - AVX512-VNNI: vpdpbusd is 2-2.9x the float path and 1.4-1.8x the int16
 *   one at every row count from 1 to 512, for both bits; AVX-VNNI (256-bit)
 *   is assumed alike.
 * - AVX2 without VNNI (and AVX-512 without it, assumed alike): 4-bit codes
 *   1.2-2.6x the float path at every row count from 1 to 512 (Zen 3, the
 *   modes alternated call by call). 6- and 8-bit codes once stopped at 32
 *   rows (0.9x the float path beyond 64 on Zen 3); since their sums are held
 *   in registers (HOLD), 6-bit codes summed in int16 pairs and 4-bit and 6-bit
 *   groups run by rows4, the int8 path is 1.15-1.55x the float one at 8 to 512
 *   rows for every width (the AVX2 build on a Zen 5, 2026-12-07,
 *   docs/benchmarks.md). */
#define FOLIO_INT8_EVERY_ROW 0x7fffffff
int folio_qlinear_int8_rows(int bits) {
    (void)bits;
    return FOLIO_INT8_EVERY_ROW;
}

/* out [m][n] (contiguous, x's dtype: 0 fp32, 1 bf16) = x [m][k] (rows
 * x_stride apart) @ W^T + bias (fp32 or NULL); kp positions (perm: the input
 * feature of each, -1 padding; NULL: position = feature, kp = k). Returns
 * 1 if scratch memory could not be had, 2 if per_super is not a power of two
 * (out is not all written then). */
int folio_qlinear(const void *x, int64_t x_stride, int dtype, const int64_t *perm,
                  const uint8_t *codes, int bits, const uint16_t *scales,
                  const uint16_t *offsets, int zeros, const uint16_t *supers,
                  int64_t per_super, const int32_t *bounds, int64_t groups,
                  const float *bias, void *out, int64_t m, int64_t n, int64_t kp,
                  int quantize_x, int num_threads) {
    int super_shift = 0;        /* two-level scales: super-groups of a power of two groups */
    while (supers && ((int64_t)1 << super_shift) < per_super) super_shift++;
    if (supers && ((int64_t)1 << super_shift) != per_super) return 2;
    if (quantize_x == 3)        /* int8 where it wins; else int16 for bf16, float for fp32 */
        quantize_x = m <= folio_qlinear_int8_rows(bits) ? 2 : dtype == 1;
    /* int8 with a K-quant's two-level scales: x per super-block, the scales
     * as integers (sblock says how), where every group fits a block and the
     * super-blocks are whole, of an even number of groups, at most 16, and
     * the codes under 64 (the int32 sums then exact: 256 x 63 x 128 x 127) */
    int isuper = FOLIO_QL_SUPER && quantize_x == 2 && supers && bits <= 6 && per_super % 2 == 0 &&
                 per_super <= 16 && groups % per_super == 0;
    for (int64_t g = 0; isuper && g < groups; g++)
        if (bounds[g + 1] - bounds[g] > 32) isuper = 0;
    int64_t blocks = 0;
    for (int64_t g = 0; g < groups; g++) blocks += (bounds[g + 1] - bounds[g] + 31) / 32;
    if (isuper) blocks = groups / per_super;
    /* floats: x, group sums, block scales; then the int16 pairs (2 per word),
     * or the int8 blocks' sums (isuper: the groups' pairs of sums) and bytes */
    const size_t floats = (size_t)(m * kp + m * groups + (quantize_x ? m * blocks : 0));
    const size_t ints = quantize_x == 1 ? 2 * (size_t)(m * kp)
                        : quantize_x == 2 ? 4 * (size_t)(m * (isuper ? groups / 2 : blocks)) +
                                                (size_t)(m * kp)
                                          : 0;
    float *xf = (float *)malloc(sizeof(float) * floats + ints);
    if (!xf) return 1;
    float *xsum = xf + m * kp, *xscale = xsum + m * groups;
    int32_t *xq = quantize_x == 1 ? (int32_t *)(xscale + m * blocks) : 0;
    int32_t *x8sum = quantize_x == 2 ? (int32_t *)(xscale + m * blocks) : 0;
    int8_t *x8 = quantize_x == 2 ? (int8_t *)(x8sum + m * (isuper ? groups / 2 : blocks)) : 0;
    const int64_t tiles = (n + 15) / 16;
    job J = {xf, xsum, xq, xscale, x8, x8sum, isuper ? x8sum : 0, codes, scales, offsets, supers,
             bounds, bias, out, m, n, kp, groups, blocks,
             supers ? (groups + per_super - 1) / per_super : 0, bits, dtype, zeros, super_shift,
             0, isuper};
    const float limit = quantize_x == 2 ? 127.0f : 32767.0f;
    /* the group sums serve the int16 path and the few-row float one, not the panel */
    const int sums = quantize_x || m <= MR;
    int failed = 0;
    int threads = num_threads < 1 ? 1 : num_threads;
#pragma omp parallel num_threads(threads)
    {
        /* the prologue: rows in position order as fp32, group sums, int16 blocks */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) {
            float *dst = xf + r * kp;
            if (dtype == 0) {
                const float *src = (const float *)x + r * x_stride;
                if (perm)
                    for (int64_t i = 0; i < kp; i++) dst[i] = perm[i] < 0 ? 0.0f : src[perm[i]];
                else
                    memcpy(dst, src, sizeof(float) * (size_t)kp);
            } else {
                const uint16_t *src = (const uint16_t *)x + r * x_stride;
                for (int64_t i = 0; i < kp; i++) {
                    const int64_t at = perm ? perm[i] : i;
                    dst[i] = at < 0 ? 0.0f : bf16_to_float(src[at]);
                }
            }
            if (!sums) continue;
            if (isuper) {
                /* per super-block: one scale, the bytes, each two groups' sums */
                for (int64_t S = 0; S < blocks; S++) {
                    const int64_t p0 = bounds[S * per_super], p1 = bounds[(S + 1) * per_super];
                    float amax = 0;
                    int64_t i = p0;
                    for (; i + 32 <= p1; i += 32) amax = fmaxf(amax, amax32(dst + i));
                    for (; i < p1; i++) amax = fmaxf(amax, fabsf(dst[i]));
                    const float inv = amax > 0 ? limit / amax : 0.0f;
                    xscale[r * blocks + S] = amax / limit;
                    int8_t *q = x8 + r * kp;
                    for (i = p0; i + 32 <= p1; i += 32) quantize32(dst + i, inv, q + i);
                    for (; i < p1; i++) q[i] = (int8_t)lrintf(dst[i] * inv);
                    for (int64_t g = S * per_super; g < (S + 1) * per_super; g += 2) {
                        int32_t a = 0, b = 0;
                        for (i = bounds[g]; i < bounds[g + 1]; i++) a += q[i];
                        for (i = bounds[g + 1]; i < bounds[g + 2]; i++) b += q[i];
                        x8sum[r * (groups / 2) + g / 2] =
                            (int32_t)((uint32_t)(uint16_t)a | ((uint32_t)(uint16_t)b << 16));
                    }
                }
                continue;
            }
            int64_t blk = 0;
            for (int64_t g = 0; g < groups; g++) {
                float s = 0;
                for (int64_t i = bounds[g]; i < bounds[g + 1]; i++) s += dst[i];
                xsum[r * groups + g] = s;
                if (!quantize_x) continue;
                float qsum = 0;     /* int8: the group sum of x as quantized (below) */
                for (int64_t p0 = bounds[g]; p0 < bounds[g + 1]; p0 += 32, blk++) {
                    const int64_t p1 = p0 + 32 < bounds[g + 1] ? p0 + 32 : bounds[g + 1];
                    const int whole = p1 - p0 == 32;
                    float amax = 0;
                    if (whole)
                        amax = amax32(dst + p0);
                    else
                        for (int64_t i = p0; i < p1; i++) amax = fmaxf(amax, fabsf(dst[i]));
                    const float scale = amax / limit, inv = amax > 0 ? limit / amax : 0.0f;
                    xscale[r * blocks + blk] = scale;
                    if (x8) {
                        int32_t bsum = 0;
                        if (whole)
                            bsum = quantize32(dst + p0, inv, x8 + r * kp + p0);
                        else
                            for (int64_t i = p0; i < p1; i++) {
                                const int32_t v = (int32_t)lrintf(dst[i] * inv);
                                x8[r * kp + i] = (int8_t)v;
                                bsum += v;
                            }
                        x8sum[r * blocks + blk] = bsum;
                        qsum += scale * (float)bsum;
                        continue;
                    }
                    /* per octet the pairs (0,2) (1,3) (4,6) (5,7), low half first */
                    int32_t *pairs = xq + (r * kp + p0) / 2;
                    for (int64_t o = 0; o < p1 - p0; o += 8)
                        for (int q = 0; q < 4; q++) {
                            const int a = (q & 1) + (q & 2) * 2;      /* 0, 1, 4, 5 */
                            const int32_t lo = (int32_t)lrintf(dst[p0 + o + a] * inv);
                            const int32_t hi = (int32_t)lrintf(dst[p0 + o + a + 2] * inv);
                            pairs[o / 2 + q] = (int32_t)((uint32_t)(uint16_t)lo |
                                                         ((uint32_t)(uint16_t)hi << 16));
                        }
                }
                /* the offsets then multiply the x the scales' sums saw: each
                 * output off by sum_k w[k] (x - x8 scale)[k], the zero points'
                 * share cancelling */
                if (x8) xsum[r * groups + g] = qsum;
            }
        }
        const int id = omp_get_thread_num(), count = omp_get_num_threads();
        const int64_t first = tiles * id / count, last = tiles * (id + 1) / count;
        /* the integer paths' scales held once for all row blocks (none: each
         * row block computes them again) */
        void *held = 0, *codes8 = 0;
        const int width = quantize_x == 2 ? INT : quantize_x ? QNT : NT;
        const int many = m > (quantize_x == 2 ? IMR : QMR);
        const int64_t slots = isuper ? groups + groups / 2 + 2 * blocks : 2 * groups;  /* hold_super's */
        if (quantize_x && many &&
            posix_memalign(&held, 64, sizeof(vec) * (size_t)(slots * width * VPT)))
            held = 0;
        /* 6-bit codes as bytes: the int8 path's for many rows, the int16 and
         * few-row float paths' always (the panel path widens as it dequantizes) */
        const int widen = bits == 6 && (quantize_x == 2 ? many : quantize_x || m <= MR);
        if (widen && !(codes8 = malloc((size_t)(width * kp * 16)))) {
#pragma omp atomic write
            failed = 1;
        }
        if (widen && !codes8) {
            /* nothing: failed is set */
        } else if (quantize_x == 2) {
            /* a decode step's few rows one tile at a time: one stream of
             * codes a thread, 0.94-0.97 of the read bandwidth at one row
             * where two tiles at once (two streams) took 0.78-0.82 (AVX-512,
             * 1B and 3B Q4_K_M, docs/benchmarks.md) */
            const int step = m <= IMR ? 1 : INT;
            for (int64_t t = first; t < last; t += step)
                itile_group(&J, t, last - t < step ? (int)(last - t) : step, (vec *)held,
                            (uint8_t *)codes8);
        } else if (quantize_x) {
            /* one row: one tile at a time, as the int8 path (1.07x on the
             * 1B and 3B Q4_K_M passes, AVX-512); from 4 rows it costs 14%
             * (the int16 products are the bound there), at 2 it is level */
            const int step = m == 1 ? 1 : QNT;
            for (int64_t t = first; t < last; t += step)
                qtile_group(&J, t, last - t < step ? (int)(last - t) : step,
                            t + 2 * step <= last ? codes + (t + step) * tile_bytes(&J) : 0,
                            (vec *)held, (uint8_t *)codes8);
        } else if (m <= MR) {
            for (int64_t t = first; t < last; t += NT)
                ftile_group(&J, t, last - t < NT ? (int)(last - t) : NT, (uint8_t *)codes8);
        } else {
            float *wf = (float *)malloc(sizeof(float) * (size_t)(DNT * kp * 16));
            if (!wf) {
#pragma omp atomic write
                failed = 1;
            }
            for (int64_t t = first; wf && t < last; t += DNT) {
                const int nt = last - t < DNT ? (int)(last - t) : DNT;
                dequantize_tiles(&J, t, nt, wf);
                dtile_group(&J, t, nt, wf);
            }
            free(wf);
        }
        free(held);
        free(codes8);
    }
    free(xf);
    return failed;
}

#endif  /* QL_PART(0) */

#else

#if QL_PART(0)
/* Built without AVX2, FMA and F16C: the torch path dequantizes instead. */
int folio_qlinear_available(void) { return 0; }

int folio_qlinear_int8_rows(int bits) {
    (void)bits;
    return 0;
}

int folio_qlinear(const void *x, int64_t x_stride, int dtype, const int64_t *perm,
                  const uint8_t *codes, int bits, const uint16_t *scales,
                  const uint16_t *offsets, int zeros, const uint16_t *supers,
                  int64_t per_super, const int32_t *bounds, int64_t groups,
                  const float *bias, void *out, int64_t m, int64_t n, int64_t kp,
                  int quantize_x, int num_threads) {
    (void)supers; (void)per_super;
    (void)x; (void)x_stride; (void)dtype; (void)perm; (void)codes; (void)bits; (void)scales;
    (void)offsets; (void)zeros; (void)bounds; (void)groups; (void)bias; (void)out; (void)m;
    (void)n; (void)kp; (void)quantize_x; (void)num_threads;
    return 1;
}

#endif  /* QL_PART(0) */
#endif
