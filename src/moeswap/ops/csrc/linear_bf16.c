/* linear_bf16.c: bf16 weights (dense layers, weight-only) with fp32 activations: moeswap_bf16_linear,
 * y = x @ W^T with each bf16 weight widened exactly to fp32, products and sums in fp32; the opt-in
 * bf16-input form (moeswap_bf16x_linear, AVX-512 BF16 builds); and a gated MLP on such weights
 * (moeswap_bf16_mlp). ops/linear.py holds the contract and the plain-torch reference.
 */
#include "internal.h"

/* bf16 -> fp32 is exact: the 16 bits are the top half of the fp32 pattern. */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* R rows from o of W bf16 [O, I] times TT tokens of x; columns [0, I) with a scalar tail. */
INLINE void bf16_tile(const float *x, const int TT, const int R, int64_t I, const uint16_t *W, int64_t o,
                      float *y, int64_t O) {
    int64_t i = 0;
    float tail[8][8] = {{0}};
#if defined(__AVX512F__)
    __m512 acc[8][8];
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++) acc[r][t] = _mm512_setzero_ps();
    for (; i + 16 <= I; i += 16) {
        __m512 w[8];
        UNROLL for (int r = 0; r < R; r++) {
            const uint16_t *p = W + (o + r) * I + i;
            if ((i & 31) == 0) _mm_prefetch((const char *)(p + R * I), _MM_HINT_T0); /* the next tile's rows */
            w[r] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
        }
        UNROLL for (int t = 0; t < TT; t++) {
            const __m512 xv = _mm512_loadu_ps(x + t * I + i);
            UNROLL for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(w[r], xv, acc[r][t]);
        }
    }
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++) tail[r][t] = _mm512_reduce_add_ps(acc[r][t]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[4][8];
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++) acc[r][t] = _mm256_setzero_ps();
    for (; i + 8 <= I; i += 8) {
        __m256 w[4];
        UNROLL for (int r = 0; r < R; r++) {
            const uint16_t *p = W + (o + r) * I + i;
            if ((i & 31) == 0) _mm_prefetch((const char *)(p + R * I), _MM_HINT_T0);
            w[r] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
        }
        UNROLL for (int t = 0; t < TT; t++) {
            const __m256 xv = _mm256_loadu_ps(x + t * I + i);
            UNROLL for (int r = 0; r < R; r++) acc[r][t] = _mm256_fmadd_ps(w[r], xv, acc[r][t]);
        }
    }
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++) tail[r][t] = hsum(acc[r][t]);
#endif
    for (; i < I; i++)
        for (int r = 0; r < R; r++) {
            const float w = bf16_to_f32(W[(o + r) * I + i]);
            for (int t = 0; t < TT; t++) tail[r][t] += w * x[t * I + i];
        }
    for (int r = 0; r < R; r++) for (int t = 0; t < TT; t++) y[t * O + o + r] = tail[r][t];
}

/* One token, one row: the rows of a chunk are read as one sequential stream (what the hardware
 * prefetcher follows best), with four independent accumulators so the FMA latency is hidden. */
static float bf16_dot(const float *x, const uint16_t *w, int64_t I) {
    int64_t i = 0;
    float sum = 0.f;
#if defined(__AVX512F__)
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (; i + 64 <= I; i += 64)
        UNROLL for (int k = 0; k < 4; k++) {
            const __m512 wv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w + i + 16 * k))), 16));
            acc[k] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + i + 16 * k), acc[k]);
        }
    for (; i + 16 <= I; i += 16) {
        const __m512 wv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w + i))), 16));
        acc[0] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + i), acc[0]);
    }
    sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (; i + 32 <= I; i += 32)
        UNROLL for (int k = 0; k < 4; k++) {
            const __m256 wv = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + i + 8 * k))), 16));
            acc[k] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i + 8 * k), acc[k]);
        }
    sum = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
#endif
    for (; i < I; i++) sum += bf16_to_f32(w[i]) * x[i];
    return sum;
}

#if defined(__AVX512F__)
/* bf16_dot with x permuted per 32-column block (16 even columns, then the 16 odd ones, as
 * `permuted` lays it out) and I % 32 == 0: one 64-byte load holds 32 bf16 weights, and each 32-bit lane
 * pairs an even weight (low half) with the next odd one (high half). A 16-bit left shift makes the even
 * ones fp32, clearing the low half the odd ones: two plain integer ops per 32 weights instead of two
 * widening shuffles and two shifts, which bound one core's streaming rate once huge pages had taken the
 * page walks away (moeswap_bf16_linear uses it for one token). */
#define BF16_EVEN(v) _mm512_castsi512_ps(_mm512_slli_epi32((v), 16))
#define BF16_ODD(v) _mm512_castsi512_ps(_mm512_and_si512((v), _mm512_set1_epi32((int)0xFFFF0000u)))
static float bf16_dot_paired(const float *xp, const uint16_t *w, int64_t I) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t i = 0;
    for (; i + 64 <= I; i += 64) {
        const __m512i v0 = _mm512_loadu_si512((const void *)(w + i)), v1 = _mm512_loadu_si512((const void *)(w + i + 32));
        acc[0] = _mm512_fmadd_ps(BF16_EVEN(v0), _mm512_loadu_ps(xp + i), acc[0]);
        acc[1] = _mm512_fmadd_ps(BF16_ODD(v0), _mm512_loadu_ps(xp + i + 16), acc[1]);
        acc[2] = _mm512_fmadd_ps(BF16_EVEN(v1), _mm512_loadu_ps(xp + i + 32), acc[2]);
        acc[3] = _mm512_fmadd_ps(BF16_ODD(v1), _mm512_loadu_ps(xp + i + 48), acc[3]);
    }
    for (; i < I; i += 32) {
        const __m512i v = _mm512_loadu_si512((const void *)(w + i));
        acc[0] = _mm512_fmadd_ps(BF16_EVEN(v), _mm512_loadu_ps(xp + i), acc[0]);
        acc[1] = _mm512_fmadd_ps(BF16_ODD(v), _mm512_loadu_ps(xp + i + 16), acc[1]);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

#define BF16_PAIRED 1
#else
#define BF16_PAIRED 0
#endif

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

/* Rows [o, o + n) of y[T, O] = x @ W^T for bf16 W, tokens in tiles of 8, 4, 2, 1. */
void bf16_rows(const float *x, int64_t T, int64_t I, const uint16_t *W, int64_t O, int64_t o, int64_t n,
               float *y) {
    for (int64_t t = 0; t < T;) {
        const int TT = T - t >= 8 ? 8 : T - t >= 4 ? 4 : T - t >= 2 ? 2 : 1;
        const float *xt = x + t * I;
        float *yt = y + t * O;
        int64_t r = o;
        for (; TT == 8 && r + 2 <= o + n; r += 2) bf16_tile(xt, 8, 2, I, W, r, yt, O);
        for (; TT == 4 && r + 4 <= o + n; r += 4) bf16_tile(xt, 4, 4, I, W, r, yt, O);
        for (; TT == 2 && r + 4 <= o + n; r += 4) bf16_tile(xt, 2, 4, I, W, r, yt, O);
        for (; TT == 1 && r < o + n; r++) yt[r] = bf16_dot(xt, W + r * I, I);
        for (; r < o + n; r++) {
            switch (TT) {
            case 8: bf16_tile(xt, 8, 1, I, W, r, yt, O); break;
            case 4: bf16_tile(xt, 4, 1, I, W, r, yt, O); break;
            case 2: bf16_tile(xt, 2, 1, I, W, r, yt, O); break;
            default: bf16_tile(xt, 1, 1, I, W, r, yt, O); break;
            }
        }
        t += TT;
    }
}

/* y[T, O] = x[T, I] @ W^T, W bf16 [O, I] (row-major, as torch stores a Linear weight). Returns 0, 1 for bad
 * sizes. Small T is the point (decode); callers send large T to a GEMM library. */
int moeswap_bf16_linear(const float *x, int64_t T, int64_t I, const uint16_t *W, int64_t O, float *y,
                        int nthreads) {
    if (T < 1 || I < 1 || O < 1) return 1;
    const int64_t chunks = (O + CHUNK_ROWS - 1) / CHUNK_ROWS;
    /* one token: rows against permuted x (bf16_dot_paired); 17 -> 25 GB/s on one core, once huge pages
     * took the page walks away; more tokens are bound by their FMAs, not by widening the weights */
    float *xp = BF16_PAIRED && T == 1 && I % 32 == 0 ? permuted(x, 1, I) : NULL;
    if (BF16_PAIRED && T == 1 && I % 32 == 0 && !xp) return 2;
    #pragma omp parallel for num_threads(nthreads) schedule(dynamic, 2)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t o = c * CHUNK_ROWS, n = O - o < CHUNK_ROWS ? O - o : CHUNK_ROWS;
#if BF16_PAIRED
        if (xp) {
            for (int64_t r = o; r < o + n; r++) y[r] = bf16_dot_paired(xp, W + r * I, I);
            continue;
        }
#endif
        bf16_rows(x, T, I, W, O, o, n, y);
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
    if (T < 1 || D < 1 || H < 1 || (act != 0 && act != 1)) return 1;
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
