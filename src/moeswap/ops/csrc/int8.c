/* int8.c: INT8 channel weights (compressed-tensors int-quantized, moeswap's int8 dense weights) multiplied
 * straight from their stored bytes:
 *   y[t, o] = sum_i x[t, i] * W[o, i],  W[o, i] = q[o, i] * s[o]
 * q int8 [O, I] row-major, s fp32 [O] (one scale per output row); each weight is the one fp32 product
 * formats/int8.decode forms, made in registers and used for every token of the call (no decoded copy kept).
 * x, y: fp32 row-major, x in natural column order. Every (row, token) sum runs in one order whatever the number
 * of tokens or rows in the tile, so a batched row gets the bits it gets alone.
 * AVX-512 builds decode 32 weights a step into the shared tiles (internal.h); AVX2 and portable builds run a
 * scalar tile (slower; each build sums a (row, token) in one order).
 * Entry point: moeswap_int8_linear; ops/kernel_library.py holds the contract, weights/int8.py the reference.
 */
#include "internal.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* 32 weights of row p (natural order) times the row's scale, as two 16-lane vectors. */
INLINE void int8_decode32(const int8_t *p, __m512 sc, __m512 *w0, __m512 *w1) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v))), sc);
    *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1))), sc);
}

INLINE void int8_tile(const float *x, const int TT, const int R, int64_t I, const int8_t *q, const float *s, int64_t o,
                      float *y, int64_t O) {
    __m512 sc[8];
    UNROLL for (int r = 0; r < R; r++) sc[r] = _mm512_set1_ps(s[o + r]);
    __m512 acc[8][8];
    tile_zero(acc, TT, R);
    for (int64_t c = 0; c < I; c += 32) {
        __m512 w0[8], w1[8];
        UNROLL for (int r = 0; r < R; r++) {
            const int8_t *p = q + (o + r) * I + c;
            if ((c & 63) == 0) _mm_prefetch((const char *)(p + R * I), _MM_HINT_T0);
            int8_decode32(p, sc[r], &w0[r], &w1[r]);
        }
        tile_fma(acc, w0, w1, x + c, I, TT, R);
    }
    tile_store(acc, y, O, o, TT, R);
}
#define INT8_TILE(TT_, R_) int8_tile(x, TT_, R_, I, q, s, o, y, O)

static void int8_rows(const float *x, int TT, int64_t I, const int8_t *q, const float *s, int64_t o, int64_t n,
                      float *y, int64_t O) {
    const int64_t end = o + n, step = TT <= 4 ? 4 : 2;
    for (; o + step <= end; o += step) BY_TOKENS(INT8_TILE, 4, 4, 2)
    for (; o < end; o++) BY_TOKENS(INT8_TILE, 4, 1, 1)
}
#else
/* One row, TT tokens: 32 weights decoded, then one sum per token over them, blocks in order. */
static void int8_rows(const float *x, int TT, int64_t I, const int8_t *q, const float *s, int64_t o, int64_t n,
                      float *y, int64_t O) {
    for (int64_t end = o + n; o < end; o++) {
        const float sc = s[o];
        float acc[8] = {0};
        for (int64_t c = 0; c < I; c += 32) {
            float w[32];
            for (int k = 0; k < 32; k++) w[k] = (float)q[o * I + c + k] * sc;
            for (int t = 0; t < TT; t++) {
                float sum = 0.f;
                for (int k = 0; k < 32; k++) sum += w[k] * x[t * I + c + k];
                acc[t] += sum;
            }
        }
        for (int t = 0; t < TT; t++) y[t * O + o] = acc[t];
    }
}
#endif

/* Rows [o, o + n) of y[T, O] for all T tokens, in tiles of up to 8. */
HIDDEN void int8_linear_rows(const float *x, int64_t T, int64_t I, const int8_t *q, const float *s, int64_t O,
                             int64_t o, int64_t n, float *y) {
    for (int64_t t = 0; t < T; t += 8) int8_rows(x + t * I, T - t < 8 ? (int)(T - t) : 8, I, q, s, o, n, y + t * O, O);
}

/* y[T, O] = x[T, I] @ W^T; I a multiple of 32. Returns 0, 1 for bad sizes, 2 out of memory. */
int moeswap_int8_linear(const float *x, int64_t T, int64_t I, const int8_t *q, const float *s, int64_t O, float *y,
                        int nthreads) {
    if (I % 32 || T < 0 || O < 0) return 1;
    float *xa = aligned_rows(x, T, I);
    if (!xa) return 2;
    const int64_t chunks = (O + CHUNK_ROWS - 1) / CHUNK_ROWS;
    #pragma omp parallel for num_threads(nthreads) schedule(dynamic, 4)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t o = c * CHUNK_ROWS;
        int8_linear_rows(xa, T, I, q, s, O, o, O - o < CHUNK_ROWS ? O - o : CHUNK_ROWS, y);
    }
    free(xa);
    return 0;
}
