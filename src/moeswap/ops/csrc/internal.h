/* internal.h: what the kernel files share and the library does not export (cpu_kernels.h is the public
 * side). Helpers that run per element, row or tile are `static inline` here, so each file compiles them
 * into its own loops as one translation unit did; helpers that run once per call, per layer or per tile
 * of rows are HIDDEN functions of the file that owns them (not exported, and a call beside that much work
 * costs nothing). The path a file compiles is chosen by the build's ISA: AVX-512 (16 fp32 lanes),
 * AVX2+FMA (8 lanes), or portable C.
 */
#ifndef MOESWAP_INTERNAL_H
#define MOESWAP_INTERNAL_H

#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_kernels.h"

#define INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 8")
#define HIDDEN __attribute__((visibility("hidden")))

#define CHUNK_ROWS 32 /* output rows per work item of the linear kernels */
#define TABLE_ROW MOESWAP_TABLE_ROW /* entries of a resident-table row (cpu_kernels.h) */

/* FORMAT_MXFP4, FORMAT_BF16, ...: the `format` codes cpu_kernels.h lists. */
#define FORMAT_CODE(name, code) FORMAT_##name = code,
enum { MOESWAP_FORMATS(FORMAT_CODE) };
#undef FORMAT_CODE
/* ACT_SILU, ACT_SITU, then ACTIVATIONS (how many): the `act` codes cpu_kernels.h lists. */
#define ACT_CODE(name) ACT_##name,
enum { MOESWAP_ACTIVATIONS(ACT_CODE) ACTIVATIONS };
#undef ACT_CODE

/* bf16 -> fp32 is exact: the 16 bits are the top half of the fp32 pattern. */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#endif

#if defined(__AVX512F__)
/* The AVX-512 tiles of the direct kernels (mxfp4.c, quant.c): R rows by TT tokens of 16-lane fp32 sums, R and TT
 * compile-time constants (up to 8) so the sums stay in registers. A block of 32 columns adds w0[r] times x's
 * first 16 columns and w1[r] times its next 16 (the kernel's column order), in that order, to each (row, token):
 * every sum then runs in one order whatever the tile's shape. */
INLINE void tile_zero(__m512 acc[8][8], const int TT, const int R) {
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++) acc[r][t] = _mm512_setzero_ps();
}

/* x: the block's first column of token 0's row; rows of width I. */
INLINE void tile_fma(__m512 acc[8][8], const __m512 *w0, const __m512 *w1, const float *x, int64_t I, const int TT,
                     const int R) {
    UNROLL for (int t = 0; t < TT; t++) {
        const __m512 x0 = _mm512_loadu_ps(x + t * I), x1 = _mm512_loadu_ps(x + t * I + 16);
        UNROLL for (int r = 0; r < R; r++) {
            acc[r][t] = _mm512_fmadd_ps(w0[r], x0, acc[r][t]);
            acc[r][t] = _mm512_fmadd_ps(w1[r], x1, acc[r][t]);
        }
    }
}

/* y[t, o + r] = the lanes' sum of acc[r][t]. */
INLINE void tile_store(__m512 acc[8][8], float *y, int64_t O, int64_t o, const int TT, const int R) {
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++)
        y[t * O + o + r] = _mm512_reduce_add_ps(acc[r][t]);
}
#endif

/* TILE_(TT, R) for the runtime token count TT (1 to 8) as a compile-time constant: R_FEW rows per tile up to
 * FEW tokens, R_MANY above (what fits in the vector registers). */
#define BY_TOKENS(TILE_, FEW, R_FEW, R_MANY)                                                               \
    switch (TT) {                                                                                          \
    case 1: TILE_(1, 1 <= FEW ? R_FEW : R_MANY); break;                                                    \
    case 2: TILE_(2, 2 <= FEW ? R_FEW : R_MANY); break;                                                    \
    case 3: TILE_(3, 3 <= FEW ? R_FEW : R_MANY); break;                                                    \
    case 4: TILE_(4, 4 <= FEW ? R_FEW : R_MANY); break;                                                    \
    case 5: TILE_(5, 5 <= FEW ? R_FEW : R_MANY); break;                                                    \
    case 6: TILE_(6, 6 <= FEW ? R_FEW : R_MANY); break;                                                    \
    case 7: TILE_(7, 7 <= FEW ? R_FEW : R_MANY); break;                                                    \
    default: TILE_(8, R_MANY); break;                                                                      \
    }

/* ---- mxfp4.c ---- */
HIDDEN void mxfp4_tables(void); /* fills the E8M0 table once (idempotent) */

/* The column order the MXFP4 tiles read x in: per block of 2 PERMUTED_WIDTH columns, the even ones, then
 * the odd ones (the packed bytes' low and high nibbles); 0: natural order (portable C). */
#if defined(__AVX512F__)
#define PERMUTED_WIDTH 16
#elif defined(__AVX2__) && defined(__FMA__)
#define PERMUTED_WIDTH 8
#else
#define PERMUTED_WIDTH 0
#endif

/* Columns of a row of width I in whole blocks of 2 PERMUTED_WIDTH (0 for portable C). */
static inline int64_t permuted_whole(int64_t I) {
#if PERMUTED_WIDTH
    return I - I % (2 * PERMUTED_WIDTH);
#else
    (void)I;
    return 0;
#endif
}

/* x [T, I] in that column order, the columns past the last whole block as they are (bf16 weights take any
 * width; MXFP4's is a multiple of 32); NULL when out of memory. */
static inline float *permuted(const float *x, int64_t T, int64_t I) {
    mxfp4_tables();
    /* 64-byte aligned: the tiles load x in whole cache lines where I allows (a split load costs two) */
    float *xp = (float *)aligned_alloc(64, ((size_t)(T * I) * sizeof(float) + 127) / 64 * 64);
    if (!xp) return NULL;
    const int64_t whole = permuted_whole(I);
    for (int64_t t = 0; t < T; t++) {
        const float *src = x + t * I;
        float *dst = xp + t * I;
#if PERMUTED_WIDTH
        for (int64_t i = 0; i < whole; i += 2 * PERMUTED_WIDTH)
            for (int k = 0; k < PERMUTED_WIDTH; k++) {
                dst[i + k] = src[i + 2 * k];
                dst[i + PERMUTED_WIDTH + k] = src[i + 2 * k + 1];
            }
#endif
        memcpy(dst + whole, src + whole, (size_t)(I - whole) * sizeof(float));
    }
    return xp;
}

/* x [T, I] copied in natural column order into a 64-byte aligned block (block FP8 reads its codes in order);
 * NULL when out of memory. */
static inline float *aligned_rows(const float *x, int64_t T, int64_t I) {
    float *xa = (float *)aligned_alloc(64, ((size_t)(T * I) * sizeof(float) + 127) / 64 * 64);
    if (xa) memcpy(xa, x, (size_t)(T * I) * sizeof(float));
    return xa;
}

/* n rows from o of y[TT, O] = x @ W^T for a tile of TT tokens (1 to 8), x permuted. */
HIDDEN void mxfp4_rows(const float *xp, int TT, int64_t I, const uint8_t *packed, const uint8_t *scale, int64_t o,
                       int64_t n, float *y, int64_t O);

/* Rows [o, o + n) of y[T, O] = x @ W^T for all T tokens, in tiles of up to 8 tokens. */
static inline void linear_rows(const float *xp, int64_t T, int64_t I, const uint8_t *packed, const uint8_t *scale,
                               int64_t O, int64_t o, int64_t n, float *y) {
    for (int64_t t = 0; t < T; t += 8)
        mxfp4_rows(xp + t * I, T - t < 8 ? (int)(T - t) : 8, I, packed, scale, o, n, y + t * O, O);
}

/* ---- quant.c ---- */
/* Rows [o, o + n) of y[T, O] = x @ W^T for all T tokens; fp8 1: block FP8 codes q [O, I] with fp32 scales s per
 * 128 x 128, x in natural order (aligned_rows); 0: INT4 words q [O, I/8] with bf16 scales s [O, I/32], x
 * permuted. */
HIDDEN void quant_linear_rows(int fp8, const float *xp, int64_t T, int64_t I, const uint8_t *q, const void *s,
                              int64_t O, int64_t o, int64_t n, float *y);

/* ---- q8.c: the quantized rows' layout (described there) ---- */
#define Q8_CHUNK_BYTES (128 + 16 * 4 + 16 * 4)

typedef struct { const uint8_t *base; int64_t chunks; } q8_rows;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define Q8 1
#else
#define Q8 0
#endif

/* One row of I columns into the chunk layout (dst: chunks * Q8_CHUNK_BYTES bytes, 64-byte aligned);
 * plain: the reference blocks only (the parity test's). */
HIDDEN void q8_quantize_row(const float *x, int64_t I, uint8_t *dst, int plain);

/* T rows of x [T, I] into dst (T * chunks * Q8_CHUNK_BYTES bytes), rows over threads when there are many. */
static inline void q8_quantize_rows(const float *x, int64_t T, int64_t I, uint8_t *dst, int plain, int nthreads) {
    const int64_t row = (I + 127) / 128 * Q8_CHUNK_BYTES;
    #pragma omp parallel for num_threads(T * I >= (1 << 16) ? nthreads : 1) schedule(static)
    for (int64_t t = 0; t < T; t++) q8_quantize_row(x + t * I, I, dst + t * row, plain);
}

#if Q8
/* As mxfp4_rows, for a tile of TT quantized rows. */
HIDDEN void q8_rows_of(q8_rows a, int TT, int64_t I, const uint8_t *packed, const uint8_t *scale, int64_t o,
                       int64_t n, float *y, int64_t O);

/* Rows [o, o + n) of y[T, O] for all T quantized rows, in tiles of up to 8. */
static inline void q8_linear_rows(q8_rows a, int64_t T, int64_t I, const uint8_t *packed, const uint8_t *scale,
                                  int64_t O, int64_t o, int64_t n, float *y) {
    for (int64_t t = 0; t < T; t += 8) {
        q8_rows at = {a.base + t * a.chunks * Q8_CHUNK_BYTES, a.chunks};
        q8_rows_of(at, T - t < 8 ? (int)(T - t) : 8, I, packed, scale, o, n, y + t * O, O);
    }
}
#else
static inline void q8_linear_rows(q8_rows a, int64_t T, int64_t I, const uint8_t *packed, const uint8_t *scale,
                                  int64_t O, int64_t o, int64_t n, float *y) {
    (void)a; (void)T; (void)I; (void)packed; (void)scale; (void)O; (void)o; (void)n; (void)y;
}
#endif

/* ---- linear_bf16.c ---- */
/* Rows [o, o + n) of y[T, O] = x @ W^T for bf16 W and x in `permuted` column order, every (row, token) sum
 * in the one order linear_bf16.c defines, however many tokens there are. */
HIDDEN void bf16_rows(const float *x, int64_t T, int64_t I, const uint16_t *W, int64_t O, int64_t o, int64_t n,
                      float *y);
/* dense_linear's --gemm-precision bf16 path. */
HIDDEN int rounded_linear(const float *x, int64_t T, int64_t I, const uint16_t *W, int64_t O, float *y, int nt);
/* The gated MLP of moeswap_bf16_mlp, with dense_linear's bf16_in. */
HIDDEN int gated_mlp(int bf16_in, const float *x, int64_t T, int64_t D, const uint16_t *w_gu, int64_t H,
                     const uint16_t *w_down, int act, float b1, float b2, float *y, int nthreads);

/* y = x @ W^T for bf16 W as ops/linear.py's linear() computes it for a decode-sized x: exact fp32 (bf16_in 0),
 * or, under --gemm-precision bf16, x rounded to bf16 and multiplied by AVX-512 BF16 dot products where the
 * build has them and I % 32 == 0, else by the fp32 kernel on the rounded values. */
static inline int dense_linear(int bf16_in, const float *x, int64_t T, int64_t I, const uint16_t *W, int64_t O,
                               float *y, int nt) {
    if (!bf16_in) return moeswap_bf16_linear(x, T, I, W, O, y, nt);
    return rounded_linear(x, T, I, W, O, y, nt);
}

/* ---- moe.c ---- */
/* moeswap_latent_moe_resident, with dense_linear's bf16_in. */
HIDDEN int latent_moe(int bf16_in, int format, const float *x, int64_t T, int64_t D, const uint16_t *w_down,
                      int64_t I, const float *norm_w, float eps, const uint16_t *w_up, int64_t F, int64_t E_total,
                      const int64_t *table, const int64_t *ids, const float *weight, int64_t K, int act, float b1,
                      float b2, float *y, int nthreads, int64_t *used);

/* ---- glue.c ---- */
/* out[i] = act(g[i], u[i]) for n elements (moeswap_glu's math, described there). */
HIDDEN void glu_span(const float *g, const float *u, float *out, int64_t n, int act, float b1, float b2);

/* g[t, r] <- act(g[t, r], u[t, r]) for columns [o, o + n) of T rows of width F (glu_span's math). */
static inline void activate(float *g, const float *u, int64_t T, int64_t F, int64_t o, int64_t n, int act, float b1,
                            float b2) {
    for (int64_t t = 0; t < T; t++) glu_span(g + t * F + o, u + t * F + o, g + t * F + o, n, act, b1, b2);
}

static inline float sigmoid_f32(float x) { return 1.f / (1.f + expf(-x)); }

/* Sum of a[i] * b[i] over n fp32 values, in 16 (AVX-512) or 8 (AVX2) lanes, then the tail. */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float sum = 0.f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    sum = hsum(acc);
#endif
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

#endif
