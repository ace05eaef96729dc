/* linear_bf16.c: bf16 weights (dense layers, weight-only) with fp32 activations: moeswap_bf16_linear,
 * y = x @ W^T with each bf16 weight widened exactly to fp32, products and sums in fp32; the opt-in
 * bf16-input form (moeswap_bf16x_linear, AVX-512 BF16 builds); and a gated MLP on such weights
 * (moeswap_bf16_mlp). ops/linear.py holds the contract and the plain-torch reference.
 */
#include "internal.h"

/* The order of the sums. Every (row, token) sum of moeswap_bf16_linear runs the same steps whatever T is and
 * however the call tiles tokens and rows, so a token's outputs do not depend on the batch it came in (a server
 * decoding it with others gives the bits it gets alone). x is read in `permuted` column order (internal.h):
 * per block of 2L columns (L = PERMUTED_WIDTH lanes: 16 AVX-512, 8 AVX2) the L even columns, then the L odd
 * ones. One load of a block's 2L bf16 weights then holds in each 32-bit lane an even weight (low half) and
 * the next odd one (high half): a 16-bit left shift makes the even ones fp32, clearing the low half the odd
 * ones; two integer ops per 2L weights instead of widening shuffles, which bound one core's streaming rate
 * once huge pages had taken the page walks away (docs/benchmarks.md). Per (row, token), as mxfp4.c's tiles sum:
 *   acc = 0 (L fp32 lanes); for each whole block, in column order:
 *     acc = fma(W[even columns], x[even columns], acc);  acc = fma(W[odd columns], x[odd columns], acc);
 *   s = the horizontal sum of acc (one fixed sequence of adds); then s += W[i] x[i] for each column past
 *   the whole blocks, in order (portable C: s = 0 and every column so).
 * One accumulator per (row, token), so a tile of R rows and TT tokens holds R TT of them: as many rows and
 * tokens as one accumulator per 16 columns allowed before (two per (row, token) held a 4-token tile to 3 rows,
 * slower at 4 tokens). Its chain of two dependent FMAs per block is hidden by running several rows at
 * once, a token alone too: 4 rows (4 chains, 4 streams, the next 4 rows prefetched) streamed one core's
 * weights faster than the one row at a time with 4 accumulators of before (docs/benchmarks.md). */
#if PERMUTED_WIDTH == 16
typedef __m512 vec_f;
typedef __m512i vec_i;
#define W_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define W_EVEN(v) _mm512_castsi512_ps(_mm512_slli_epi32((v), 16))
#define W_ODD(v) _mm512_castsi512_ps(_mm512_and_si512((v), _mm512_set1_epi32((int)0xFFFF0000u)))
#define X_LOAD _mm512_loadu_ps
#define V_FMA _mm512_fmadd_ps
#define V_ZERO _mm512_setzero_ps
#define V_SUM _mm512_reduce_add_ps
/* tokens per tile, and rows per tile for TT tokens: R TT accumulators and 2 R weight vectors of 32 registers */
#define TOKENS_MAX 8
#define ROWS_FOR(TT) ((TT) <= 4 ? 4 : (TT) <= 6 ? 3 : 2)
#elif PERMUTED_WIDTH == 8
typedef __m256 vec_f;
typedef __m256i vec_i;
#define W_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define W_EVEN(v) _mm256_castsi256_ps(_mm256_slli_epi32((v), 16))
#define W_ODD(v) _mm256_castsi256_ps(_mm256_and_si256((v), _mm256_set1_epi32((int)0xFFFF0000u)))
#define X_LOAD _mm256_loadu_ps
#define V_FMA _mm256_fmadd_ps
#define V_ZERO _mm256_setzero_ps
#define V_SUM hsum
#define TOKENS_MAX 4 /* of 16 registers */
#define ROWS_FOR(TT) ((TT) == 1 ? 4 : (TT) == 2 ? 3 : 2)
#else
#define TOKENS_MAX 8
#define ROWS_FOR(TT) 1
#endif

/* R rows from o of W bf16 [O, I] times TT tokens of permuted x (R, TT compile-time after inlining), each
 * (row, token) in the order above. */
INLINE void bf16_tile(const float *xp, const int TT, const int R, int64_t I, const uint16_t *W, int64_t o,
                      float *y, int64_t O) {
    const int64_t whole = permuted_whole(I);
    float s[8][8];
#if PERMUTED_WIDTH
    enum { L = PERMUTED_WIDTH };
    vec_f acc[8][8];
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++) acc[r][t] = V_ZERO();
    for (int64_t i = 0; i < whole; i += 2 * L) {
        vec_f we[8], wo[8];
        UNROLL for (int r = 0; r < R; r++) {
            const uint16_t *p = W + (o + r) * I + i;
            /* the next tile's rows, a cache line a block: the hardware prefetcher follows R interleaved
             * streams less well */
            if ((i & 31) == 0) _mm_prefetch((const char *)(p + R * I), _MM_HINT_T0);
            const vec_i v = W_LOAD(p);
            we[r] = W_EVEN(v);
            wo[r] = W_ODD(v);
        }
        UNROLL for (int t = 0; t < TT; t++) {
            const vec_f xe = X_LOAD(xp + t * I + i), xo = X_LOAD(xp + t * I + i + L);
            UNROLL for (int r = 0; r < R; r++) acc[r][t] = V_FMA(wo[r], xo, V_FMA(we[r], xe, acc[r][t]));
        }
    }
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++) s[r][t] = V_SUM(acc[r][t]);
#else
    for (int r = 0; r < R; r++) for (int t = 0; t < TT; t++) s[r][t] = 0.f;
#endif
    for (int64_t i = whole; i < I; i++)
        for (int r = 0; r < R; r++) {
            const float w = bf16_to_f32(W[(o + r) * I + i]);
            for (int t = 0; t < TT; t++) s[r][t] += w * xp[t * I + i];
        }
    for (int r = 0; r < R; r++) for (int t = 0; t < TT; t++) y[t * O + o + r] = s[r][t];
}

#if defined(__AVX512BF16__)
/* R rows from o times TT tokens, x already rounded to bf16 (the opt-in --gemm-precision bf16: llama.cpp's
 * arithmetic for bf16 matmuls): each 32-column step is one vdpbf16ps per (row, token), the pair products
 * exact and summed into fp32 lanes. Every (row, token) sum runs the same steps whatever TT and R are, so
 * a token's outputs do not depend on the batch it is in. */
INLINE void bf16x_tile(const uint16_t *xb, const int TT, const int R, int64_t I, const uint16_t *W, int64_t o,
                       float *y, int64_t O) {
    __m512 acc[8][8];
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t i = 0; i < I; i += 32) {
        __m512bh w[8];
        UNROLL for (int r = 0; r < R; r++) {
            const uint16_t *p = W + (o + r) * I + i;
            _mm_prefetch((const char *)(p + R * I), _MM_HINT_T0); /* the next tile's rows */
            w[r] = (__m512bh)_mm512_loadu_si512((const void *)p);
        }
        UNROLL for (int t = 0; t < TT; t++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xb + t * I + i));
            UNROLL for (int r = 0; r < R; r++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], w[r], xv);
        }
    }
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++) y[t * O + o + r] = _mm512_reduce_add_ps(acc[r][t]);
}

#define BF16X_TILE(TT_, R_) bf16x_tile(xb, TT_, R_, I, W, o, y, O)
static void bf16x_rows(const uint16_t *xb, int TT, int64_t I, const uint16_t *W, int64_t o, int64_t n, float *y,
                       int64_t O) {
    /* one token streams one row at a time (what the hardware prefetcher follows best); more share rows */
    const int64_t end = o + n, step = TT == 1 ? 1 : TT <= 4 ? 4 : 2;
    for (; o + step <= end; o += step) BY_TOKENS(BF16X_TILE, 4, TT == 1 ? 1 : 4, 2)
    for (; o < end; o++) BY_TOKENS(BF16X_TILE, 4, 1, 1)
}

/* y[T, O] = xb[T, I] @ W^T, both bf16 (I % 32 == 0), fp32 sums. Returns 0, 1 for bad sizes. */
int moeswap_bf16x_linear(const uint16_t *x, int64_t T, int64_t I, const uint16_t *W, int64_t O, float *y,
                         int nthreads) {
    if (T < 1 || I < 32 || I % 32 || O < 1) return 1;
    const int64_t chunks = (O + CHUNK_ROWS - 1) / CHUNK_ROWS;
    #pragma omp parallel for num_threads(nthreads) schedule(dynamic, 2)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t o = c * CHUNK_ROWS, n = O - o < CHUNK_ROWS ? O - o : CHUNK_ROWS;
        for (int64_t t = 0; t < T; t += 8)
            bf16x_rows(x + t * I, T - t < 8 ? (int)(T - t) : 8, I, W, o, n, y + t * O, O);
    }
    return 0;
}
#undef BF16X_TILE
int moeswap_has_bf16_dot(void) { return 1; }
#else
int moeswap_bf16x_linear(const uint16_t *x, int64_t T, int64_t I, const uint16_t *W, int64_t O, float *y,
                         int nthreads) {
    (void)x; (void)T; (void)I; (void)W; (void)O; (void)y; (void)nthreads;
    return 3;
}
int moeswap_has_bf16_dot(void) { return 0; }
#endif

#define BF16_TILE(TT_, R_) bf16_tile(xp, TT_, R_, I, W, r, y, O)
#define BF16_TILE_FULL(TT_, R_) BF16_TILE(TT_, ROWS_FOR(TT_))
/* Rows [o, o + n) (internal.h): tokens in tiles of up to TOKENS_MAX, ROWS_FOR(TT) rows a tile, then the rows
 * left two, then one at a time. */
void bf16_rows(const float *x, int64_t T, int64_t I, const uint16_t *W, int64_t O, int64_t o, int64_t n,
               float *y0) {
    for (int64_t t = 0; t < T; t += TOKENS_MAX) {
        const int TT = T - t < TOKENS_MAX ? (int)(T - t) : TOKENS_MAX, R = ROWS_FOR(TT);
        const float *xp = x + t * I;
        float *y = y0 + t * O;
        int64_t r = o;
        for (; r + R <= o + n; r += R) BY_TOKENS(BF16_TILE_FULL, 8, 1, 1)
        for (; R > 2 && r + 2 <= o + n; r += 2) BY_TOKENS(BF16_TILE, 8, 2, 2)
        for (; r < o + n; r++) BY_TOKENS(BF16_TILE, 8, 1, 1)
    }
}
#undef BF16_TILE
#undef BF16_TILE_FULL

/* y[T, O] = x[T, I] @ W^T, W bf16 [O, I] (row-major, as torch stores a Linear weight), each (row, token) sum in
 * the order above. Returns 0, 1 for bad sizes, 2 out of memory. Small T is the point (decode); callers send
 * large T to a GEMM library. */
int moeswap_bf16_linear(const float *x, int64_t T, int64_t I, const uint16_t *W, int64_t O, float *y,
                        int nthreads) {
    if (T < 1 || I < 1 || O < 1) return 1;
    float *xp = permuted(x, T, I);
    if (!xp) return 2;
    const int64_t chunks = (O + CHUNK_ROWS - 1) / CHUNK_ROWS;
    #pragma omp parallel for num_threads(nthreads) schedule(dynamic, 2)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t o = c * CHUNK_ROWS, n = O - o < CHUNK_ROWS ? O - o : CHUNK_ROWS;
        bf16_rows(xp, T, I, W, O, o, n, y);
    }
    free(xp);
    return 0;
}

/* fp32 -> bf16 rounded to nearest even, NaN to the quiet 0x7FC0: torch's Tensor.to(torch.bfloat16). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* dense_linear under --gemm-precision bf16 (internal.h): x rounded to bf16, then the bf16 dot products, or the
 * fp32 kernel on the rounded values where this build or I rules them out. */
int rounded_linear(const float *x, int64_t T, int64_t I, const uint16_t *W, int64_t O, float *y, int nt) {
    const int dot = moeswap_has_bf16_dot() && I % 32 == 0;
    void *buf = malloc((size_t)(T * I) * (dot ? sizeof(uint16_t) : sizeof(float)) + 64);
    if (!buf) return 2;
    int status;
    if (dot) {
        uint16_t *xb = (uint16_t *)buf;
        for (int64_t k = 0; k < T * I; k++) xb[k] = f32_to_bf16(x[k]);
        status = moeswap_bf16x_linear(xb, T, I, W, O, y, nt);
    } else {
        float *xr = (float *)buf;
        for (int64_t k = 0; k < T * I; k++) xr[k] = bf16_to_f32(f32_to_bf16(x[k]));
        status = moeswap_bf16_linear(xr, T, I, W, O, y, nt);
    }
    free(buf);
    return status;
}

/* A gated MLP on bf16 weights for a few rows (models/layers/basic.py GatedMLP: a decode step's shared
 * experts and dense MLP) in one call: gu = x @ w_gu^T (w_gu [2H, D]: gate rows, then up rows), h = act(gate,
 * up) per row, y = h @ w_down^T (w_down [D, H]). The same functions as the three calls it replaces
 * (moeswap_bf16_linear, moeswap_glu), so the same bits. Returns 0, 1 for bad sizes, 2 out of memory. */
int gated_mlp(int bf16_in, const float *x, int64_t T, int64_t D, const uint16_t *w_gu, int64_t H,
              const uint16_t *w_down, int act, float b1, float b2, float *y, int nthreads) {
    if (T < 1 || D < 1 || H < 1 || (act < 0 || act >= ACTIVATIONS)) return 1;
    float *gu = (float *)malloc((size_t)(T * 2 * H) * sizeof(float) + 64);
    float *h = (float *)malloc((size_t)(T * H) * sizeof(float) + 64);
    if (!gu || !h) { free(gu); free(h); return 2; }
    int status = dense_linear(bf16_in, x, T, D, w_gu, 2 * H, gu, nthreads);
    for (int64_t t = 0; !status && t < T; t++)
        status = moeswap_glu(gu + t * 2 * H, gu + t * 2 * H + H, h + t * H, H, act, b1, b2, nthreads);
    if (!status) status = dense_linear(bf16_in, h, T, H, w_down, D, y, nthreads);
    free(gu); free(h);
    return status;
}

int moeswap_bf16_mlp(const float *x, int64_t T, int64_t D, const uint16_t *w_gu, int64_t H, const uint16_t *w_down,
                     int act, float b1, float b2, float *y, int nthreads) {
    return gated_mlp(0, x, T, D, w_gu, H, w_down, act, b1, b2, y, nthreads);
}
