/* mxfp4.c: MXFP4 weights (routed experts), multiplied straight from the packed bytes:
 *   y[t, o] = sum_i x[t, i] * W[o, i],  W[o, i] = E2M1(nibble i of row o) * 2^(scale[o, i/32] - 127)
 * packed: uint8 [O, I/2], column 2j in the low nibble of byte j; scale: uint8 [O, I/32] E8M0 (0xFF = NaN,
 * 0 = 2^-127 unflushed). No decoded copy of W is kept: each 32-weight block is decoded into registers and
 * used for every token of the call. Entry points: moeswap_mxfp4_linear (matrices sharing an input),
 * moeswap_mxfp4_expert (one gated expert), moeswap_mxfp4_decode (rows to fp32 or bf16, for prefill's GEMM);
 * moe.c runs all experts of a layer step through the same tiles (mxfp4_rows).
 *
 * x, y: fp32 row-major [T, I] / [T, O]. Rows are split over OpenMP threads (the same libgomp torch loads),
 * several rows and tokens per tile. ops/expert_mxfp4.py holds the contract and the plain-torch reference.
 */
#include "internal.h"

static float E8M0[256];
static const float E2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

static void init_tables(void) {
    for (int s = 0; s < 256; s++) {
        uint32_t bits = (uint32_t)s << 23; /* 2^(s-127): exponent field s */
        if (s == 0) bits = 1u << 22;       /* 2^-127 is the fp32 subnormal 0x00400000 */
        if (s == 255) bits = 0x7FC00000u;  /* NaN */
        memcpy(&E8M0[s], &bits, 4);
    }
}

static int ready = 0;

void mxfp4_tables(void) {
    if (!ready) { init_tables(); ready = 1; } /* idempotent: a race writes the same values */
}

#if defined(__AVX512F__)
/* x is pre-permuted per block of 32: the 16 even columns, then the 16 odd ones (low, high nibbles). */
#define ISA 512
INLINE void tile(const float *xp, const int TT, const int R, int64_t I, const uint8_t *packed,
                 const uint8_t *scale, int64_t o, float *y, int64_t O) {
    const __m512 lut = _mm512_loadu_ps(E2M1);
    const int64_t nb = I / 32, half = I / 2;
    __m512 acc[8][8];
    tile_zero(acc, TT, R);
    for (int64_t b = 0; b < nb; b++) {
        __m512 ve[8], vo[8];
        UNROLL for (int r = 0; r < R; r++) {
            const uint8_t *p = packed + (o + r) * half + b * 16;
            /* The next tile's rows: the hardware prefetcher does not follow R interleaved streams well. */
            if ((b & 3) == 0) _mm_prefetch((const char *)(p + R * half), _MM_HINT_T0);
            __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
            __m512 table = _mm512_mul_ps(lut, _mm512_set1_ps(E8M0[scale[(o + r) * nb + b]]));
            ve[r] = _mm512_permutexvar_ps(bytes, table); /* uses the low 4 bits of each lane */
            vo[r] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
        }
        tile_fma(acc, ve, vo, xp + b * 32, I, TT, R);
    }
    tile_store(acc, y, O, o, TT, R);
}

#elif defined(__AVX2__) && defined(__FMA__)
/* x is pre-permuted per block of 8 bytes: 8 even columns, then 8 odd ones. */
#define ISA 256
INLINE __m256 hsum_init(void) { return _mm256_setzero_ps(); }
INLINE void tile(const float *xp, const int TT, const int R, int64_t I, const uint8_t *packed,
                 const uint8_t *scale, int64_t o, float *y, int64_t O) {
    const __m256 mag = _mm256_loadu_ps(E2M1); /* magnitudes of codes 0-7 */
    const __m256i sign = _mm256_set1_epi32((int)0x80000000u);
    const int64_t nb = I / 32, half = I / 2;
    __m256 acc[4][8];
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++) acc[r][t] = hsum_init();
    for (int64_t b = 0; b < nb; b++) {
        __m256 s[4];
        UNROLL for (int r = 0; r < R; r++) s[r] = _mm256_set1_ps(E8M0[scale[(o + r) * nb + b]]);
        for (int q = 0; q < 2; q++) { /* two halves of 8 bytes = 16 weights each */
            __m256 ve[4], vo[4];
            UNROLL for (int r = 0; r < R; r++) {
                const uint8_t *p = packed + (o + r) * half + b * 16 + q * 8;
                if (q == 0 && (b & 3) == 0) _mm_prefetch((const char *)(p + R * half), _MM_HINT_T0);
                __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
                __m256i hi = _mm256_srli_epi32(bytes, 4);
                __m256 lo_v = _mm256_permutevar8x32_ps(mag, bytes); /* low 3 bits index */
                __m256 hi_v = _mm256_permutevar8x32_ps(mag, hi);
                lo_v = _mm256_xor_ps(lo_v, _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(bytes, 28), sign)));
                hi_v = _mm256_xor_ps(hi_v, _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(hi, 28), sign)));
                ve[r] = _mm256_mul_ps(lo_v, s[r]);
                vo[r] = _mm256_mul_ps(hi_v, s[r]);
            }
            UNROLL for (int t = 0; t < TT; t++) {
                const float *xb = xp + t * I + b * 32 + q * 16;
                __m256 xe = _mm256_loadu_ps(xb), xo = _mm256_loadu_ps(xb + 8);
                UNROLL for (int r = 0; r < R; r++) {
                    acc[r][t] = _mm256_fmadd_ps(ve[r], xe, acc[r][t]);
                    acc[r][t] = _mm256_fmadd_ps(vo[r], xo, acc[r][t]);
                }
            }
        }
    }
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++) y[t * O + o + r] = hsum(acc[r][t]);
}

#else
/* Portable C: natural column order. */
#define ISA 0
INLINE void tile(const float *xp, const int TT, const int R, int64_t I, const uint8_t *packed,
                 const uint8_t *scale, int64_t o, float *y, int64_t O) {
    const int64_t nb = I / 32, half = I / 2;
    for (int r = 0; r < R; r++) {
        float acc[8] = {0};
        for (int64_t b = 0; b < nb; b++) {
            float w[32];
            const float s = E8M0[scale[(o + r) * nb + b]];
            const uint8_t *p = packed + (o + r) * half + b * 16;
            for (int k = 0; k < 16; k++) {
                w[2 * k] = E2M1[p[k] & 15] * s;
                w[2 * k + 1] = E2M1[p[k] >> 4] * s;
            }
            for (int t = 0; t < TT; t++) {
                float sum = 0.f;
                for (int k = 0; k < 32; k++) sum += w[k] * xp[t * I + b * 32 + k];
                acc[t] += sum;
            }
        }
        for (int t = 0; t < TT; t++) y[t * O + o + r] = acc[t];
    }
}
#endif

/* n rows from o, for a tile of TT tokens (1 to 8; each block is decoded once per tile, so a tile covers all
 * of an expert's tokens up to 8): 4 rows at a time up to 4 tokens, 2 rows above (registers), then the tail. */
#define TILE(TT_, R_) tile(xp, TT_, R_, I, packed, scale, o, y, O)
void mxfp4_rows(const float *xp, int TT, int64_t I, const uint8_t *packed, const uint8_t *scale, int64_t o,
                int64_t n, float *y, int64_t O) {
    const int64_t end = o + n, step = TT <= 4 ? 4 : 2;
    for (; o + step <= end; o += step) BY_TOKENS(TILE, 4, 4, 2)
    for (; o < end; o++) BY_TOKENS(TILE, 4, 1, 1)
}
#undef TILE

int moeswap_mxfp4_isa(void) { return ISA; }

/* n_mats matrices sharing x: y_m[T, O_m] = x[T, I] @ W_m^T. Returns 0, 1 for bad sizes, 2 out of memory. */
int moeswap_mxfp4_linear(const float *x, int64_t T, int64_t I, int n_mats, const uint8_t *const *packed,
                         const uint8_t *const *scale, const int64_t *O, float *const *y, int nthreads) {
    if (I % 32 || n_mats < 1 || n_mats > 4) return 1;
    float *xp = permuted(x, T, I);
    if (!xp) return 2;
    int64_t chunks[5] = {0};
    for (int m = 0; m < n_mats; m++) chunks[m + 1] = chunks[m] + (O[m] + CHUNK_ROWS - 1) / CHUNK_ROWS;
    #pragma omp parallel for num_threads(nthreads) schedule(dynamic, 4)
    for (int64_t c = 0; c < chunks[n_mats]; c++) {
        int m = 0;
        while (c >= chunks[m + 1]) m++;
        const int64_t o = (c - chunks[m]) * CHUNK_ROWS;
        linear_rows(xp, T, I, packed[m], scale[m], O[m], o, O[m] - o < CHUNK_ROWS ? O[m] - o : CHUNK_ROWS, y[m]);
    }
    free(xp);
    return 0;
}

/* A whole expert: y[T, I] = W2 @ act(W1 x, W3 x) with W1, W3 [F, I] and W2 [I, F]. act 0: silu(g) * u;
 * act 1: SiTU, b1 tanh(g/b1) sigmoid(g) * b2 tanh(u/b2). Each work item computes the same rows of the
 * gate and the up projection and applies the activation to them, so h needs no extra pass. */
int moeswap_mxfp4_expert(const float *x, int64_t T, int64_t I, int64_t F, const uint8_t *p1, const uint8_t *s1,
                         const uint8_t *p3, const uint8_t *s3, const uint8_t *p2, const uint8_t *s2, int act,
                         float b1, float b2, float *y, int nthreads) {
    if (I % 32 || F % 32 || act < 0 || act >= ACTIVATIONS) return 1;
    float *xp = permuted(x, T, I);
    float *g = (float *)malloc((size_t)(2 * T * F) * sizeof(float) + 64);
    if (!xp || !g) { free(xp); free(g); return 2; }
    float *u = g + T * F;
    const int64_t up_chunks = (F + CHUNK_ROWS - 1) / CHUNK_ROWS;
    #pragma omp parallel for num_threads(nthreads) schedule(dynamic, 2)
    for (int64_t c = 0; c < up_chunks; c++) {
        const int64_t o = c * CHUNK_ROWS, n = F - o < CHUNK_ROWS ? F - o : CHUNK_ROWS;
        linear_rows(xp, T, I, p1, s1, F, o, n, g);
        linear_rows(xp, T, I, p3, s3, F, o, n, u);
        activate(g, u, T, F, o, n, act, b1, b2);
    }
    free(xp);
    float *hp = permuted(g, T, F);
    free(g);
    if (!hp) return 2;
    const int64_t down_chunks = (I + CHUNK_ROWS - 1) / CHUNK_ROWS;
    #pragma omp parallel for num_threads(nthreads) schedule(dynamic, 2)
    for (int64_t c = 0; c < down_chunks; c++) {
        const int64_t o = c * CHUNK_ROWS;
        linear_rows(hp, T, F, p2, s2, I, o, I - o < CHUNK_ROWS ? I - o : CHUNK_ROWS, y);
    }
    free(hp);
    return 0;
}

/* Decode MXFP4 rows to fp32 in natural column order: out[o, i] = W[o, i] (the prefill path multiplies
 * the decoded rows with a GEMM library, which beats decoding in registers once ~32 tokens share them). */
int moeswap_mxfp4_decode(const uint8_t *packed, const uint8_t *scale, int64_t O, int64_t I, void *out, int bf16,
                         int nthreads) {
    if (I % 32 || O < 0) return 1;
    mxfp4_tables();
    const int64_t nb = I / 32;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t o = 0; o < O; o++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *p = packed + o * (I / 2) + b * 16;
            const float s = E8M0[scale[o * nb + b]];
            const int64_t at = o * I + b * 32;
#if defined(__AVX512F__)
            const __m512 table = _mm512_mul_ps(_mm512_loadu_ps(E2M1), _mm512_set1_ps(s));
            const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
            const __m512 ve = _mm512_permutexvar_ps(bytes, table), vo = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
            const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
            const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
            const __m512 first = _mm512_permutex2var_ps(ve, lo, vo), second = _mm512_permutex2var_ps(ve, hi, vo);
            if (bf16) {  /* the top half of each fp32: exact, MXFP4 values have at most 3 significant bits */
                uint16_t *dst = (uint16_t *)out + at;
                _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(first), 16)));
                _mm256_storeu_si256((__m256i *)(dst + 16), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(second), 16)));
            } else {
                _mm512_storeu_ps((float *)out + at, first);
                _mm512_storeu_ps((float *)out + at + 16, second);
            }
#else
            for (int k = 0; k < 32; k++) {
                const float v = E2M1[k & 1 ? p[k / 2] >> 4 : p[k / 2] & 15] * s;
                if (bf16) {
                    uint32_t bits;
                    memcpy(&bits, &v, 4);
                    ((uint16_t *)out)[at + k] = (uint16_t)(bits >> 16);
                } else {
                    ((float *)out)[at + k] = v;
                }
            }
#endif
        }
    }
    return 0;
}
