/* CPU kernels for the decode-sized matmuls moeswap runs (moeswap/ops/cpu_kernels.py builds and loads this
 * file; ops/expert_mxfp4.py and ops/linear.py hold the contracts and the plain-torch references).
 *
 * MXFP4 (routed experts), straight from the packed bytes:
 *   y[t, o] = sum_i x[t, i] * W[o, i],  W[o, i] = E2M1(nibble i of row o) * 2^(scale[o, i/32] - 127)
 * packed: uint8 [O, I/2], column 2j in the low nibble of byte j; scale: uint8 [O, I/32] E8M0 (0xFF = NaN,
 * 0 = 2^-127 unflushed). No decoded copy of W is kept: each 32-weight block is decoded into registers and
 * used for every token of the call. Entry points: moeswap_mxfp4_linear (matrices sharing an input),
 * moeswap_mxfp4_expert (one gated expert) and moeswap_mxfp4_moe (all experts of a layer step in one call,
 * weighted and summed per token, so a decode step pays one call and two thread fork/joins per layer).
 *
 * bf16 weights with fp32 activations (dense layers, weight-only): moeswap_bf16_linear, y = x @ W^T with
 * each bf16 weight widened exactly to fp32; products and sums in fp32.
 *
 * Gated activations (SiLU, K3's SiTU) of whole tensors: moeswap_glu, one vectorized pass; the expert
 * kernels use the same code for their hidden rows.
 *
 * x, y: fp32 row-major [T, I] / [T, O]. Paths: AVX-512 (16 fp32 lanes), AVX2+FMA (8 lanes), portable C.
 * Rows are split over OpenMP threads (the same libgomp torch loads), several rows and tokens per tile.
 */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

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

#define INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 8")

#if defined(__AVX512F__)
/* x is pre-permuted per block of 32: the 16 even columns, then the 16 odd ones (low, high nibbles). */
#define ISA 512
INLINE void tile(const float *xp, const int TT, const int R, int64_t I, const uint8_t *packed,
                 const uint8_t *scale, int64_t o, float *y, int64_t O) {
    const __m512 lut = _mm512_loadu_ps(E2M1);
    const int64_t nb = I / 32, half = I / 2;
    __m512 acc[8][8];
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++) acc[r][t] = _mm512_setzero_ps();
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
        UNROLL for (int t = 0; t < TT; t++) {
            __m512 xe = _mm512_loadu_ps(xp + t * I + b * 32), xo = _mm512_loadu_ps(xp + t * I + b * 32 + 16);
            UNROLL for (int r = 0; r < R; r++) {
                acc[r][t] = _mm512_fmadd_ps(ve[r], xe, acc[r][t]);
                acc[r][t] = _mm512_fmadd_ps(vo[r], xo, acc[r][t]);
            }
        }
    }
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++)
        y[t * O + o + r] = _mm512_reduce_add_ps(acc[r][t]);
}
#define PERMUTED_WIDTH 16

#elif defined(__AVX2__) && defined(__FMA__)
/* x is pre-permuted per block of 8 bytes: 8 even columns, then 8 odd ones. */
#define ISA 256
INLINE __m256 hsum_init(void) { return _mm256_setzero_ps(); }
INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
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
#define PERMUTED_WIDTH 8

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
#define PERMUTED_WIDTH 0
#endif

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

/* n rows from o, for a tile of TT tokens (1 to 8; each block is decoded once per tile, so a tile covers all
 * of an expert's tokens up to 8): 4 rows at a time up to 4 tokens, 2 rows above (registers), then the tail. */
#define TILE(TT_, R_) tile(xp, TT_, R_, I, packed, scale, o, y, O)
static void rows(const float *xp, int TT, int64_t I, const uint8_t *packed, const uint8_t *scale, int64_t o,
                 int64_t n, float *y, int64_t O) {
    const int64_t end = o + n, step = TT <= 4 ? 4 : 2;
    for (; o + step <= end; o += step) BY_TOKENS(TILE, 4, 4, 2)
    for (; o < end; o++) BY_TOKENS(TILE, 4, 1, 1)
}
#undef TILE

int moeswap_mxfp4_isa(void) { return ISA; }

/* MXFP4 x int8 activations (opt-in; what llama.cpp computes for MXFP4 weights): each 32-column block of an
 * activation row is quantized to int8 with its own scale d = max|x| / 127 (q = round-to-even(x 127 / max|x|);
 * d rounded to 11 significant bits, as llama.cpp's Q8_0 stores it in fp16, but with fp32's range), and
 * the block's dot product runs in integers (AVX-512 VNNI), then is scaled by d and the weights' E8M0 scale:
 *   y[t, o] ~ sum_b d[t, b] * 2^(scale[o, b] - 127) * sum_{i in b} q[t, i] * 2 E2M1(W[o, i]) / 2
 * Weights become the unsigned bytes 2 E2M1 + 12 (0..24); the +12 is taken back by starting each sum at
 * -12 sum(q). E8M0 0 (2^-127) counts as 0 and 255 (NaN) as infinity; a non-finite input block gives NaN.
 * Quantized rows are laid out per chunk of 128 columns (4 blocks, one 64-byte packed weight load): the 64
 * even columns, then the 64 odd ones (the low and high nibbles), then per 32-bit lane of the integer sums
 * (8 columns) the correction -12 sum(q) and the scale d / 2. */
#define Q8_CHUNK_BYTES (128 + 16 * 4 + 16 * 4)

typedef struct { const uint8_t *base; int64_t chunks; } q8_rows;

INLINE const int8_t *q8_values(q8_rows a, int64_t t, int64_t c) { return (const int8_t *)(a.base + (t * a.chunks + c) * Q8_CHUNK_BYTES); }
INLINE const int32_t *q8_corr(q8_rows a, int64_t t, int64_t c) { return (const int32_t *)(q8_values(a, t, c) + 128); }
INLINE const float *q8_scale(q8_rows a, int64_t t, int64_t c) { return (const float *)(q8_values(a, t, c) + 128 + 64); }

/* v rounded to nearest-even at 11 significant bits (fp16's precision); finite v stays finite. */
static float round_to_11_bits(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    u += 0x0FFFu + ((u >> 13) & 1u);
    u &= ~0x1FFFu;
    memcpy(&v, &u, 4);
    return v;
}

/* Block b of a row (32 columns of x from xb) into its chunk (zeroed before its first block), as described
 * above: the plain reference of q8_block_avx512, which it also serves for blocks with non-finite values. */
static void q8_block(const float *xb, int64_t b, uint8_t *chunk) {
    float amax = 0.f;
    int finite = 1;
    for (int k = 0; k < 32; k++) {
        finite &= isfinite(xb[k]) != 0;
        amax = fmaxf(amax, fabsf(xb[k]));
    }
    int8_t *q = (int8_t *)chunk;
    int32_t *corr = (int32_t *)(chunk + 128);
    float *d = (float *)(chunk + 128 + 64);
    const float inv = amax > 0.f && finite ? 127.f / amax : 0.f;
    for (int k = 0; k < 32; k++) {
        const int j = (int)(b % 4) * 32 + k; /* column within the chunk */
        float v = nearbyintf(xb[k] * inv);
        v = v > 127.f ? 127.f : v < -127.f ? -127.f : v;
        q[(j & 1) * 64 + j / 2] = (int8_t)v;
        corr[j / 8] -= 12 * (int32_t)v;
    }
    const float scale = finite ? round_to_11_bits(amax / 127.f) * 0.5f : NAN;
    for (int l = 0; l < 4; l++) d[(b % 4) * 4 + l] = scale;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* q8_block in 16-lane vectors, the same bytes (round-to-nearest-even conversion, the same products). */
static void q8_block_avx512(const float *xb, int64_t b, uint8_t *chunk) {
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const __m512 a0 = _mm512_abs_ps(x0), a1 = _mm512_abs_ps(x1);
    const __m512 inf = _mm512_set1_ps(INFINITY);
    if (_mm512_cmp_ps_mask(a0, inf, _CMP_NLT_UQ) | _mm512_cmp_ps_mask(a1, inf, _CMP_NLT_UQ)) {
        q8_block(xb, b, chunk); /* a NaN or an infinity: the block's scale is NaN */
        return;
    }
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127);
    const __m512i v0 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), lim), nlim);
    const __m512i v1 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(x1, inv)), lim), nlim);
    /* column k of the block: even ones to q[m 16 + k/2], odd ones to q[64 + m 16 + k/2] */
    const __m128i evens_first = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m128i b0 = _mm_shuffle_epi8(_mm512_cvtsepi32_epi8(v0), evens_first);
    const __m128i b1 = _mm_shuffle_epi8(_mm512_cvtsepi32_epi8(v1), evens_first);
    const int64_t m = b % 4;
    int8_t *q = (int8_t *)chunk;
    _mm_storeu_si128((__m128i *)(q + m * 16), _mm_unpacklo_epi64(b0, b1));
    _mm_storeu_si128((__m128i *)(q + 64 + m * 16), _mm_unpackhi_epi64(b0, b1));
    int32_t *corr = (int32_t *)(chunk + 128) + m * 4;
    corr[0] -= 12 * _mm512_mask_reduce_add_epi32(0x00FF, v0);
    corr[1] -= 12 * _mm512_mask_reduce_add_epi32(0xFF00, v0);
    corr[2] -= 12 * _mm512_mask_reduce_add_epi32(0x00FF, v1);
    corr[3] -= 12 * _mm512_mask_reduce_add_epi32(0xFF00, v1);
    const float scale = round_to_11_bits(amax / 127.f) * 0.5f;
    float *d = (float *)(chunk + 128 + 64) + m * 4;
    for (int l = 0; l < 4; l++) d[l] = scale;
}
#define Q8_BLOCK q8_block_avx512
#else
#define Q8_BLOCK q8_block
#endif

/* One row of I columns into the chunk layout above (dst: chunks * Q8_CHUNK_BYTES bytes, 64-byte aligned);
 * plain: the reference blocks only (the parity test's). */
static void q8_quantize_row(const float *x, int64_t I, uint8_t *dst, int plain) {
    const int64_t chunks = (I + 127) / 128;
    memset(dst, 0, (size_t)(chunks * Q8_CHUNK_BYTES));
    for (int64_t b = 0; b < I / 32; b++) {
        uint8_t *chunk = dst + (b / 4) * Q8_CHUNK_BYTES;
        if (plain) q8_block(x + b * 32, b, chunk);
        else Q8_BLOCK(x + b * 32, b, chunk);
    }
}

/* T rows of x [T, I] into dst (T * chunks * Q8_CHUNK_BYTES bytes), rows over threads when there are many. */
static void q8_quantize_rows(const float *x, int64_t T, int64_t I, uint8_t *dst, int plain, int nthreads) {
    const int64_t row = (I + 127) / 128 * Q8_CHUNK_BYTES;
    #pragma omp parallel for num_threads(T * I >= (1 << 16) ? nthreads : 1) schedule(static)
    for (int64_t t = 0; t < T; t++) q8_quantize_row(x + t * I, I, dst + t * row, plain);
}

/* For the parity test: rows quantized by the vector blocks (plain 0) or the reference (plain 1). */
int moeswap_q8_quantize(const float *x, int64_t T, int64_t I, uint8_t *dst, int plain) {
    if (T < 0 || I < 32 || I % 32) return 1;
    q8_quantize_rows(x, T, I, dst, plain, 1);
    return 0;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define Q8 1
INLINE void q8_tile(q8_rows a, const int TT, const int R, int64_t I, const uint8_t *packed, const uint8_t *scale,
                    int64_t o, float *y, int64_t O) {
    const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m128i rep4 = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const int64_t nb = I / 32, half = I / 2;
    __m512 acc[4][8];
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < a.chunks; c++) {
        const int64_t blocks = nb - 4 * c < 4 ? nb - 4 * c : 4;
        const __mmask64 bytes_mask = blocks == 4 ? ~0ULL : (1ULL << (16 * blocks)) - 1;
        const __mmask16 scale_mask = (__mmask16)((1u << blocks) - 1);
        __m512i wl[4], wh[4];
        __m512 ws[4];
        UNROLL for (int r = 0; r < R; r++) {
            const uint8_t *p = packed + (o + r) * half + c * 64;
            _mm_prefetch((const char *)(p + R * half), _MM_HINT_T0); /* the next tile's rows */
            const __m512i bytes = _mm512_maskz_loadu_epi8(bytes_mask, p);
            wl[r] = _mm512_shuffle_epi8(lut, _mm512_and_si512(bytes, low4));
            wh[r] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4));
            const __m128i s = _mm_shuffle_epi8(_mm_maskz_loadu_epi8(scale_mask, scale + (o + r) * nb + c * 4), rep4);
            ws[r] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(s), 23));
        }
        UNROLL for (int t = 0; t < TT; t++) {
            const int8_t *q = q8_values(a, t, c);
            const __m512i lo = _mm512_load_si512(q), hi = _mm512_load_si512(q + 64);
            const __m512i corr = _mm512_load_si512(q8_corr(a, t, c));
            const __m512 d = _mm512_load_ps(q8_scale(a, t, c));
            UNROLL for (int r = 0; r < R; r++) {
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(corr, wl[r], lo), wh[r], hi);
                acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws[r], d), acc[r][t]);
            }
        }
    }
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++)
        y[t * O + o + r] = _mm512_reduce_add_ps(acc[r][t]);
}

/* As `rows`: 4 rows at a time up to 2 tokens, 2 rows above (32 vector registers), then the tail. */
#define Q8_TILE(TT_, R_) q8_tile(a, TT_, R_, I, packed, scale, o, y, O)
static void q8_rows_of(q8_rows a, int TT, int64_t I, const uint8_t *packed, const uint8_t *scale, int64_t o,
                       int64_t n, float *y, int64_t O) {
    const int64_t end = o + n, step = TT <= 2 ? 4 : 2;
    for (; o + step <= end; o += step) BY_TOKENS(Q8_TILE, 2, 4, 2)
    for (; o < end; o++) BY_TOKENS(Q8_TILE, 2, 1, 1)
}
#undef Q8_TILE

/* Rows [o, o + n) of y[T, O] for all T quantized rows, in tiles of up to 8. */
static void q8_linear_rows(q8_rows a, int64_t T, int64_t I, const uint8_t *packed, const uint8_t *scale,
                           int64_t O, int64_t o, int64_t n, float *y) {
    for (int64_t t = 0; t < T; t += 8) {
        q8_rows at = {a.base + t * a.chunks * Q8_CHUNK_BYTES, a.chunks};
        q8_rows_of(at, T - t < 8 ? (int)(T - t) : 8, I, packed, scale, o, n, y + t * O, O);
    }
}
#else
#define Q8 0
static void q8_linear_rows(q8_rows a, int64_t T, int64_t I, const uint8_t *packed, const uint8_t *scale,
                           int64_t O, int64_t o, int64_t n, float *y) {
    (void)a; (void)T; (void)I; (void)packed; (void)scale; (void)O; (void)o; (void)n; (void)y;
}
#endif

/* 1 when this build has the int8-activation MXFP4 path (AVX-512 VNNI), else 0. */
int moeswap_mxfp4_q8(void) { return Q8; }

#define CHUNK_ROWS 32
#define MOE_CHUNK_ROWS 128 /* see moe() */

static int ready = 0;

/* x [T, I] in the column order `tile` expects (see PERMUTED_WIDTH); NULL when out of memory. */
static float *permuted(const float *x, int64_t T, int64_t I) {
    if (!ready) { init_tables(); ready = 1; } /* idempotent: a race writes the same values */
    float *xp = (float *)malloc((size_t)(T * I) * sizeof(float) + 64);
    if (!xp) return NULL;
    for (int64_t t = 0; t < T; t++) {
        const float *src = x + t * I;
        float *dst = xp + t * I;
#if PERMUTED_WIDTH
        for (int64_t i = 0; i < I; i += 2 * PERMUTED_WIDTH)
            for (int k = 0; k < PERMUTED_WIDTH; k++) {
                dst[i + k] = src[i + 2 * k];
                dst[i + PERMUTED_WIDTH + k] = src[i + 2 * k + 1];
            }
#else
        memcpy(dst, src, (size_t)I * sizeof(float));
#endif
    }
    return xp;
}

/* Rows [o, o + n) of y[T, O] = x @ W^T for all T tokens, in tiles of up to 8 tokens. */
static void linear_rows(const float *xp, int64_t T, int64_t I, const uint8_t *packed, const uint8_t *scale,
                        int64_t O, int64_t o, int64_t n, float *y) {
    for (int64_t t = 0; t < T; t += 8) rows(xp + t * I, T - t < 8 ? (int)(T - t) : 8, I, packed, scale, o, n, y + t * O, O);
}

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

/* Gated activations, for the experts' hidden rows here and whole tensors (moeswap_glu): out = act(g, u),
 * act 0: silu(g) * u; act 1: SiTU, b1 tanh(g/b1) sigmoid(g) * b2 tanh(u/b2). torch runs SiTU as nine
 * passes over memory (~5.5 ns per element on 2 cores); this is one. exp is Cody-Waite range reduction
 * and Cephes' degree-5 polynomial (~2 ulp), tanh Cephes' odd polynomial below |x| = 0.625 and
 * 1 - 2 / (exp(2|x|) + 1) above, all branch-free so the loop vectorizes; NaN in, NaN out. */
static inline float act_exp(float x) {
    const float in = x;
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round to nearest: 1.5 * 2^23 */
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    union { int32_t i; float f; } two_n = {.i = ((int32_t)n + 127) << 23};
    /* past fp32's range: overflow to inf, underflow to 0 (denormal results flushed) */
    return in > 88.72f ? INFINITY : in < -87.33f ? 0.0f : p * two_n.f;
}

static inline float act_tanh(float x) {
    const float a = fabsf(x), z = x * x;
    float p = -5.70498872745e-3f;
    p = fmaf(p, z, 2.06390887954e-2f);
    p = fmaf(p, z, -5.37397155531e-2f);
    p = fmaf(p, z, 1.33314422036e-1f);
    p = fmaf(p, z, -3.33332819422e-1f);
    const float small = fmaf(p * z, x, x);
    const float t = 1.0f - 2.0f / (act_exp(2.0f * a) + 1.0f);
    const float large = x < 0.0f ? -t : t;
    return a < 0.625f ? small : large;
}

static inline float act_sigmoid(float x) { return 1.0f / (1.0f + act_exp(-x)); }

static void glu_span(const float *g, const float *u, float *out, int64_t n, int act, float b1, float b2) {
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float gv = g[i], uv = u[i];
        const float y = act == 0 ? gv * act_sigmoid(gv) * uv
                                 : (b1 * act_tanh(gv / b1) * act_sigmoid(gv)) * (b2 * act_tanh(uv / b2));
        out[i] = gv != gv || uv != uv ? gv + uv : y;
    }
}

/* g[t, r] <- act(g[t, r], u[t, r]) for columns [o, o + n) of T rows of width F (glu_span's math). */
static void activate(float *g, const float *u, int64_t T, int64_t F, int64_t o, int64_t n, int act, float b1,
                     float b2) {
    for (int64_t t = 0; t < T; t++) glu_span(g + t * F + o, u + t * F + o, g + t * F + o, n, act, b1, b2);
}

/* A whole expert: y[T, I] = W2 @ act(W1 x, W3 x) with W1, W3 [F, I] and W2 [I, F]. act 0: silu(g) * u;
 * act 1: SiTU, b1 tanh(g/b1) sigmoid(g) * b2 tanh(u/b2). Each work item computes the same rows of the
 * gate and the up projection and applies the activation to them, so h needs no extra pass. */
int moeswap_mxfp4_expert(const float *x, int64_t T, int64_t I, int64_t F, const uint8_t *p1, const uint8_t *s1,
                         const uint8_t *p3, const uint8_t *s3, const uint8_t *p2, const uint8_t *s2, int act,
                         float b1, float b2, float *y, int nthreads) {
    if (I % 32 || F % 32 || act < 0 || act > 1) return 1;
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
static void bf16_rows(const float *x, int64_t T, int64_t I, const uint16_t *W, int64_t O, int64_t o, int64_t n,
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

/* y = x @ W^T for bf16 W as ops/linear.py's linear() computes it for a decode-sized x: exact fp32 (bf16_in 0),
 * or, under --gemm-precision bf16, x rounded to bf16 and multiplied by AVX-512 BF16 dot products where the
 * build has them and I % 32 == 0, else by the fp32 kernel on the rounded values. */
static int dense_linear(int bf16_in, const float *x, int64_t T, int64_t I, const uint16_t *W, int64_t O, float *y,
                        int nt) {
    if (!bf16_in) return moeswap_bf16_linear(x, T, I, W, O, y, nt);
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

typedef struct { int32_t expert; int32_t chunk; } work_item;

/* (expert, chunk) for every chunk of every expert that has tokens; returns how many. */
static int64_t list_items(work_item *items, const int64_t *off, int E, int64_t chunks) {
    int64_t n = 0;
    for (int e = 0; e < E; e++)
        if (off[e + 1] > off[e])
            for (int64_t c = 0; c < chunks; c++) items[n++] = (work_item){e, (int32_t)c};
    return n;
}

enum { MXFP4 = 0, BF16 = 1, MXFP4_Q8 = 2 };

/* The activations one phase of `moe` multiplies, per pair, in the form its weight format reads: fp32 rows in
 * `permuted` column order (MXFP4), natural order (bf16), or quantized rows (MXFP4_Q8). */
typedef struct { const float *f; q8_rows q; int64_t width; } pair_rows;

/* Row tokens[k] of x for each of the P pairs (tokens NULL: x already has one row per pair), in `format`'s
 * form (x: [T, I]); buf: fp32 [P, I] scratch for gathering. Returns the block to free (NULL if none) and
 * sets *ok = 0 when out of memory. */
static void *pair_inputs(int format, const float *x, int64_t T, int64_t I, const int64_t *tokens, int64_t P,
                         float *buf, pair_rows *out, int *ok, int nthreads) {
    *ok = 1;
    out->width = I;
    if (format == MXFP4_Q8) {
        const int64_t chunks = (I + 127) / 128, row = chunks * Q8_CHUNK_BYTES;
        uint8_t *q = (uint8_t *)aligned_alloc(64, (size_t)(P * row) + 64);
        /* a token's row quantized once for all its pairs (a decode step's K experts), when that is less work */
        uint8_t *qt = tokens && T <= P ? (uint8_t *)aligned_alloc(64, (size_t)(T * row) + 64) : NULL;
        if (!q || (tokens && T <= P && !qt)) { free(q); free(qt); *ok = 0; return NULL; }
        if (qt) {
            q8_quantize_rows(x, T, I, qt, 0, nthreads);
            for (int64_t k = 0; k < P; k++) memcpy(q + k * row, qt + tokens[k] * row, (size_t)row);
            free(qt);
        } else if (tokens) {
            for (int64_t k = 0; k < P; k++) q8_quantize_row(x + tokens[k] * I, I, q + k * row, 0);
        } else {
            q8_quantize_rows(x, P, I, q, 0, nthreads);
        }
        out->q = (q8_rows){q, chunks};
        return q;
    }
    if (tokens) {
        for (int64_t k = 0; k < P; k++) memcpy(buf + k * I, x + tokens[k] * I, (size_t)I * sizeof(float));
        x = buf;
    }
    if (format == BF16) { out->f = x; return NULL; }
    float *xp = permuted(x, P, I);
    if (!xp) *ok = 0;
    out->f = xp;
    return xp;
}

/* Rows [o, o + n) of one expert matrix for the nt pairs from k0, in any of the weight formats (p: packed
 * MXFP4 with scale s, or bf16 with s unused). */
static void expert_rows(int format, pair_rows a, int64_t k0, int64_t nt, const void *p, const uint8_t *s, int64_t O,
                        int64_t o, int64_t n, float *y) {
    const int64_t I = a.width;
    if (format == BF16) bf16_rows(a.f + k0 * I, nt, I, (const uint16_t *)p, O, o, n, y);
    else if (format == MXFP4) linear_rows(a.f + k0 * I, nt, I, (const uint8_t *)p, s, O, o, n, y);
    else q8_linear_rows((q8_rows){a.q.base + k0 * a.q.chunks * Q8_CHUNK_BYTES, a.q.chunks}, nt, I,
                        (const uint8_t *)p, s, O, o, n, y);
}

/* All experts of one layer step: for expert e (0 <= e < E) and its token list tokens[off[e] .. off[e+1]),
 *   y[t] += weight[k] * W2_e @ act(W1_e x[t], W3_e x[t])   for each pair k = (t, e), pairs in order,
 * with W1_e, W3_e [F, I] and W2_e [I, F] (pointer arrays indexed by e; MXFP4 packed + scale, or bf16 with
 * the scale arrays unused; MXFP4_Q8 quantizes x and the hidden activations to int8 per block). Work items
 * are (expert, chunk of MOE_CHUNK_ROWS rows) pairs, so a decode step's 8-16 small experts keep every thread
 * busy in one fork/join per phase; a static schedule gives each thread a contiguous run of them, whole
 * experts at decode, which streams from memory far better than threads taking turns on 32-row chunks
 * (bench-k3's MXFP4 layer step 0.71 -> 0.41 ms, 16 tokens 6.3 -> 4.3 ms; a decode step's 8 bf16 experts
 * of 256 x 256, 229 -> 135 us). The per-token sums run serially in pair order: deterministic. Returns 0,
 * 1 for bad sizes, 2 out of memory, 3 for MXFP4_Q8 in a build without it. */
static int moe(int format, const float *x, int64_t T, int64_t I, int64_t F, int E, const void *const *p1,
               const uint8_t *const *s1, const void *const *p3, const uint8_t *const *s3, const void *const *p2,
               const uint8_t *const *s2, const int64_t *off, const int64_t *tokens, const float *weight, int act,
               float b1, float b2, float *y, int nthreads) {
    if (format == MXFP4_Q8 && !Q8) return 3;
    if ((format != BF16 && (I % 32 || F % 32)) || act < 0 || act > 1 || E < 1 || off[0] != 0) return 1;
    if (!ready) { init_tables(); ready = 1; }
    const int64_t P = off[E];
    for (int64_t k = 0; k < P; k++)
        if (tokens[k] < 0 || tokens[k] >= T) return 1;
    const int64_t up_chunks = (F + MOE_CHUNK_ROWS - 1) / MOE_CHUNK_ROWS;
    const int64_t down_chunks = (I + MOE_CHUNK_ROWS - 1) / MOE_CHUNK_ROWS;
    float *xg = (float *)malloc((size_t)(P * I) * sizeof(float) + 64);
    float *g = (float *)malloc((size_t)(2 * P * F) * sizeof(float) + 64);
    float *out = (float *)malloc((size_t)(P * I) * sizeof(float) + 64);
    work_item *items = (work_item *)malloc((size_t)E * (up_chunks > down_chunks ? up_chunks : down_chunks) * sizeof(work_item) + 64);
    pair_rows xa, ha;
    int ok = xg && g && out && items;
    void *xa_own = ok ? pair_inputs(format, x, T, I, tokens, P, xg, &xa, &ok, nthreads) : NULL;
    if (!ok) { free(xg); free(g); free(out); free(items); free(xa_own); return 2; }
    float *u = g + P * F;
    int64_t n_items = list_items(items, off, E, up_chunks);
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t w = 0; w < n_items; w++) {
        const int e = items[w].expert;
        const int64_t o = (int64_t)items[w].chunk * MOE_CHUNK_ROWS;
        const int64_t n = F - o < MOE_CHUNK_ROWS ? F - o : MOE_CHUNK_ROWS;
        const int64_t k0 = off[e], nt = off[e + 1] - off[e];
        float *ge = g + k0 * F, *ue = u + k0 * F;
        expert_rows(format, xa, k0, nt, p1[e], s1 ? s1[e] : NULL, F, o, n, ge);
        expert_rows(format, xa, k0, nt, p3[e], s3 ? s3[e] : NULL, F, o, n, ue);
        activate(ge, ue, nt, F, o, n, act, b1, b2);
    }
    free(xa_own);
    void *ha_own = pair_inputs(format, g, P, F, NULL, P, NULL, &ha, &ok, nthreads); /* one hidden row per pair */
    if (!ok) { free(xg); free(g); free(out); free(items); return 2; }
    n_items = list_items(items, off, E, down_chunks);
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t w = 0; w < n_items; w++) {
        const int e = items[w].expert;
        const int64_t o = (int64_t)items[w].chunk * MOE_CHUNK_ROWS;
        const int64_t n = I - o < MOE_CHUNK_ROWS ? I - o : MOE_CHUNK_ROWS;
        const int64_t k0 = off[e], nt = off[e + 1] - off[e];
        expert_rows(format, ha, k0, nt, p2[e], s2 ? s2[e] : NULL, I, o, n, out + k0 * I);
    }
    for (int64_t k = 0; k < P; k++) {
        float *yt = y + tokens[k] * I;
        const float *ok_row = out + k * I, wk = weight[k];
        for (int64_t i = 0; i < I; i++) yt[i] += wk * ok_row[i];
    }
    free(ha_own);
    free(xg); free(g); free(out); free(items);
    return 0;
}

/* q8: 0 computes in fp32, 1 quantizes the activations to int8 per block (MXFP4_Q8 above). */
int moeswap_mxfp4_moe(const float *x, int64_t T, int64_t I, int64_t F, int E, const uint8_t *const *p1,
                      const uint8_t *const *s1, const uint8_t *const *p3, const uint8_t *const *s3,
                      const uint8_t *const *p2, const uint8_t *const *s2, const int64_t *off, const int64_t *tokens,
                      const float *weight, int act, float b1, float b2, float *y, int nthreads, int q8) {
    return moe(q8 ? MXFP4_Q8 : MXFP4, x, T, I, F, E, (const void *const *)p1, s1, (const void *const *)p3, s3,
               (const void *const *)p2, s2, off, tokens, weight, act, b1, b2, y, nthreads);
}

/* The same for bf16 experts (w1, w3 [F, I], w2 [I, F] bf16; fp32 math). */
int moeswap_bf16_moe(const float *x, int64_t T, int64_t I, int64_t F, int E, const uint16_t *const *w1,
                     const uint16_t *const *w3, const uint16_t *const *w2, const int64_t *off, const int64_t *tokens,
                     const float *weight, int act, float b1, float b2, float *y, int nthreads) {
    return moe(BF16, x, T, I, F, E, (const void *const *)w1, NULL, (const void *const *)w3, NULL,
               (const void *const *)w2, NULL, off, tokens, weight, act, b1, b2, y, nthreads);
}

/* 0 when every one of the P chosen ids has a row in the table, 1 for an id out of range, 4 for one without. */
static int resident_ids(const int64_t *table, int64_t E_total, const int64_t *ids, int64_t P) {
    for (int64_t k = 0; k < P; k++) {
        if (ids[k] < 0 || ids[k] >= E_total) return 1;
        if (!table[ids[k] * 6]) return 4;
    }
    return 0;
}

/* A decode step's routed experts straight from the router's choice, for experts that stay resident:
 * table [E_total, 6] holds each expert's matrix pointers in moe()'s order (MXFP4: p1 s1 p3 s3 p2 s2;
 * bf16: w1 0 w3 0 w2 0), a row of zeros where the caller has none; ids, weight [T, K] are the router's
 * output. The pairs are grouped by expert, experts in id order and each one's tokens in order (as
 * models/layers/moe.py pairs_by_expert), then moe() runs them: the same call, the same sums. format:
 * 0 MXFP4, 1 bf16, 2 MXFP4 on int8 activations. *used: the distinct experts. Returns moe()'s status,
 * 1 for an id out of range, 4 when a chosen expert has no pointers (the caller takes the store's path). */

int moeswap_moe_resident(int format, const float *x, int64_t T, int64_t I, int64_t F, int64_t E_total,
                         const int64_t *table, const int64_t *ids, const float *weight, int64_t K, int act,
                         float b1, float b2, float *y, int nthreads, int64_t *used) {
    const int64_t P = T * K;
    if (T < 1 || K < 1 || E_total < 1 || format < MXFP4 || format > MXFP4_Q8) return 1;
    const int checked = resident_ids(table, E_total, ids, P);
    if (checked) return checked;
    int64_t *at = (int64_t *)calloc((size_t)E_total, sizeof(int64_t)); /* pairs per expert, then next slot */
    int64_t *off = (int64_t *)malloc((size_t)(P + 1) * sizeof(int64_t));
    int64_t *tokens = (int64_t *)malloc((size_t)P * sizeof(int64_t));
    float *w = (float *)malloc((size_t)P * sizeof(float));
    const void **ptr = (const void **)malloc((size_t)(6 * P) * sizeof(void *)); /* 6 arrays of <= P experts */
    if (!at || !off || !tokens || !w || !ptr) { free(at); free(off); free(tokens); free(w); free(ptr); return 2; }
    for (int64_t k = 0; k < P; k++) at[ids[k]]++;
    int E = 0;
    off[0] = 0;
    for (int64_t e = 0; e < E_total; e++) {
        if (!at[e]) continue;
        for (int m = 0; m < 6; m++) ptr[m * P + E] = (const void *)(intptr_t)table[e * 6 + m];
        off[E + 1] = off[E] + at[e];
        at[e] = off[E]; /* from here: where this expert's next pair goes */
        E++;
    }
    for (int64_t k = 0; k < P; k++) { /* k = t K + slot: each expert's pairs come in token order */
        const int64_t slot = at[ids[k]]++;
        tokens[slot] = k / K;
        w[slot] = weight[k];
    }
    const int bf16 = format == BF16;
    const int status = moe(format, x, T, I, F, E, ptr, bf16 ? NULL : (const uint8_t *const *)(ptr + P),
                           ptr + 2 * P, bf16 ? NULL : (const uint8_t *const *)(ptr + 3 * P), ptr + 4 * P,
                           bf16 ? NULL : (const uint8_t *const *)(ptr + 5 * P), off, tokens, w, act, b1, b2, y,
                           nthreads);
    *used = E;
    free(at); free(off); free(tokens); free(w); free(ptr);
    return status;
}

/* One KDA head for one token, in place on its state Sn [K, V] (ops/kda.py kda_recurrent is the reference):
 * q, k are l2-normalised here (eps inside the root) and q scaled by `scale`; then
 *   S <- diag(exp g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q.   Two passes over S. */
static void kda_head(const float *qn, const float *kn, const float *vn, const float *gn, float b, float *Sn,
                     float *on, int64_t K, int64_t V, float scale, float eps) {
    float qq = 0.f, kk = 0.f;
    for (int64_t i = 0; i < K; i++) { qq += qn[i] * qn[i]; kk += kn[i] * kn[i]; }
    const float qs = scale / sqrtf(qq + eps), ks = 1.f / sqrtf(kk + eps);
    float u[1024];
    for (int64_t j = 0; j < V; j++) u[j] = 0.f;
    for (int64_t i = 0; i < K; i++) { /* decay, and S^T k of the decayed state */
        const float d = expf(gn[i]), ki = kn[i] * ks;
        float *row = Sn + i * V;
        for (int64_t j = 0; j < V; j++) { row[j] *= d; u[j] += row[j] * ki; }
    }
    for (int64_t j = 0; j < V; j++) { u[j] = b * (vn[j] - u[j]); on[j] = 0.f; }
    for (int64_t i = 0; i < K; i++) { /* rank-one update, and S^T q of the new state */
        const float ki = kn[i] * ks, qi = qn[i] * qs;
        float *row = Sn + i * V;
        for (int64_t j = 0; j < V; j++) { row[j] += ki * u[j]; on[j] += row[j] * qi; }
    }
}

/* One decode token of Kimi Delta Attention for N = batch x heads independent heads (kda_head each).
 * q, k, g: [N, K]; v, o: [N, V]; beta: [N]; S: [N, K, V]; all fp32. */
int moeswap_kda_decode(const float *q, const float *k, const float *v, const float *g, const float *beta,
                       float *S, float *o, int64_t N, int64_t K, int64_t V, float scale, float eps, int nthreads) {
    if (N < 1 || K < 1 || V < 1 || K > 1024 || V > 1024) return 1;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++)
        kda_head(q + n * K, k + n * K, v + n * V, g + n * K, beta[n], S + n * K * V, o + n * V, K, V, scale, eps);
    return 0;
}

static inline float sigmoid_f32(float x) { return 1.f / (1.f + expf(-x)); }

/* A KDA layer between its projections (models/layers/kda.py KDA.forward is the reference), for B
 * sequences of T tokens, H heads of width K (values too), C = H K channels; one decode token is T = 1:
 *   qkv [B, T, 3C]: the q, k and v projections; conv [B, W-1, 3C]: their last W-1 inputs, shifted in
 *     place token by token; taps [W, 3C]: the depthwise conv kernels; q, k, v = silu(causal conv);
 *   z [B, T, C]: f_b_proj's output; g = lower * sigmoid(A_h (z + dt_bias)) when bounded (K3),
 *     else -A_h softplus(z + dt_bias) (Kimi Linear); A [H] = exp(A_log);
 *   b_in [B, T, H]: beta = sigmoid(b_in);  S [B, H, K, K]: the recurrent state, in place (kda_head);
 *   gate [B, T, C]: y = rmsnorm(o; o_w, norm_eps) * sigmoid(gate), written to y [B, T, C].
 * Prefill runs the token recurrence too: a head's state [K, K] stays in L1, and the chunked form
 * (ops/kda.py), made to spread a chunk over a GPU's threads, does no less arithmetic on one core.
 * Every array fp32 and contiguous. One work item per (sequence, head): its channels, its state. */
int moeswap_kda_layer(const float *qkv, float *conv, const float *taps, int64_t W, const float *z,
                      const float *dt_bias, const float *A, float lower, int bounded, const float *b_in,
                      float *S, const float *gate, const float *o_w, float norm_eps, float scale,
                      float l2_eps, float *y, int64_t B, int64_t T, int64_t H, int64_t K, int nthreads) {
    if (B < 1 || T < 1 || H < 1 || K < 1 || K > 1024 || W < 1) return 1;
    const int64_t C = H * K, C3 = 3 * C;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < B * H; n++) {
        const int64_t b = n / H, h = n % H;
        float qkvh[3][1024], g[1024], o[1024];
        float *hist = conv + b * (W - 1) * C3;
        for (int64_t t = 0; t < T; t++) {
            const int64_t bt = b * T + t;
            const float *x = qkv + bt * C3;
            for (int part = 0; part < 3; part++)
                for (int64_t i = 0; i < K; i++) {
                    const int64_t c = part * C + h * K + i;
                    float acc = (W > 1 ? hist[c] : x[c]) * taps[c];
                    for (int64_t j = 1; j < W - 1; j++) acc += hist[j * C3 + c] * taps[j * C3 + c];
                    if (W > 1) acc += x[c] * taps[(W - 1) * C3 + c];
                    for (int64_t j = 0; j + 1 < W - 1; j++) hist[j * C3 + c] = hist[(j + 1) * C3 + c];
                    if (W > 1) hist[(W - 2) * C3 + c] = x[c];
                    qkvh[part][i] = acc * sigmoid_f32(acc);
                }
            for (int64_t i = 0; i < K; i++) {
                const float u = z[bt * C + h * K + i] + dt_bias[h * K + i];
                g[i] = bounded ? lower * sigmoid_f32(A[h] * u) : -A[h] * (u > 20.f ? u : log1pf(expf(u)));
            }
            kda_head(qkvh[0], qkvh[1], qkvh[2], g, sigmoid_f32(b_in[bt * H + h]), S + n * K * K, o, K, K, scale,
                     l2_eps);
            float ss = 0.f;
            for (int64_t j = 0; j < K; j++) ss += o[j] * o[j];
            const float r = 1.f / sqrtf(ss / (float)K + norm_eps);
            for (int64_t j = 0; j < K; j++)
                y[bt * C + h * K + j] = o[j] * r * o_w[j] * sigmoid_f32(gate[bt * C + h * K + j]);
        }
    }
    return 0;
}

/* Decode MXFP4 rows to fp32 in natural column order: out[o, i] = W[o, i] (the prefill path multiplies
 * the decoded rows with a GEMM library, which beats decoding in registers once ~32 tokens share them). */
int moeswap_mxfp4_decode(const uint8_t *packed, const uint8_t *scale, int64_t O, int64_t I, void *out, int bf16,
                         int nthreads) {
    if (I % 32 || O < 0) return 1;
    if (!ready) { init_tables(); ready = 1; }
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

/* out[i] = act(g[i], u[i]) for n elements (out may be g). Returns 0, or 1 for a bad act or size. */
int moeswap_glu(const float *g, const float *u, float *out, int64_t n, int act, float b1, float b2, int nthreads) {
    if (n < 0 || (act != 0 && act != 1)) return 1;
    const int64_t span = 16384;  /* 64 KB of g per work item */
    const int64_t spans = (n + span - 1) / span;
    #pragma omp parallel for num_threads(spans > 1 ? nthreads : 1) schedule(static)
    for (int64_t s = 0; s < spans; s++) {
        const int64_t o = s * span;
        glu_span(g + o, u + o, out + o, n - o < span ? n - o : span, act, b1, b2);
    }
    return 0;
}

/* A gated MLP on bf16 weights for a few rows (models/layers/basic.py GatedMLP: a decode step's shared
 * experts and dense MLP) in one call: gu = x @ w_gu^T (w_gu [2H, D]: gate rows, then up rows), h = act(gate,
 * up) per row, y = h @ w_down^T (w_down [D, H]). The same functions as the three calls it replaces
 * (moeswap_bf16_linear, moeswap_glu), so the same bits. Returns 0, 1 for bad sizes, 2 out of memory. */
static int gated_mlp(int bf16_in, const float *x, int64_t T, int64_t D, const uint16_t *w_gu, int64_t H,
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

int moeswap_rms_norm(const float *x, int64_t N, int64_t D, const float *w, float eps, float *y, int nthreads);

/* K3's latent MoE for a decode step with resident experts (models/layers/moe.py MoE.forward, routed part):
 * h = x @ w_down^T (w_down [I, D] bf16), r = the experts of moeswap_moe_resident on h, r = rmsnorm(r; norm_w,
 * eps) when norm_w is given, y = r @ w_up^T (w_up [D, I] bf16), written to y [T, D]. The same functions as
 * the calls it replaces, so the same bits. Returns their status; 4 (y untouched) when a chosen expert has no
 * pointers in the table. */
static int latent_moe(int bf16_in, int format, const float *x, int64_t T, int64_t D, const uint16_t *w_down,
                      int64_t I, const float *norm_w, float eps, const uint16_t *w_up, int64_t F, int64_t E_total,
                      const int64_t *table, const int64_t *ids, const float *weight, int64_t K, int act, float b1,
                      float b2, float *y, int nthreads, int64_t *used) {
    if (T < 1 || D < 1 || I < 1 || K < 1 || E_total < 1) return 1;
    const int checked = resident_ids(table, E_total, ids, T * K); /* before any work */
    if (checked) return checked;
    float *h = (float *)malloc((size_t)(T * I) * sizeof(float) + 64);
    float *r = (float *)calloc((size_t)(2 * T * I), sizeof(float)); /* the experts' sum, then its norm */
    if (!h || !r) { free(h); free(r); return 2; }
    int status = dense_linear(bf16_in, x, T, D, w_down, I, h, nthreads);
    if (!status)
        status = moeswap_moe_resident(format, h, T, I, F, E_total, table, ids, weight, K, act, b1, b2, r, nthreads,
                                      used);
    float *routed = r;
    if (!status && norm_w) {
        routed = r + T * I;
        status = moeswap_rms_norm(r, T, I, norm_w, eps, routed, nthreads);
    }
    if (!status) status = dense_linear(bf16_in, routed, T, I, w_up, D, y, nthreads);
    free(h); free(r);
    return status;
}

int moeswap_latent_moe_resident(int format, const float *x, int64_t T, int64_t D, const uint16_t *w_down,
                                int64_t I, const float *norm_w, float eps, const uint16_t *w_up, int64_t F,
                                int64_t E_total, const int64_t *table, const int64_t *ids, const float *weight,
                                int64_t K, int act, float b1, float b2, float *y, int nthreads, int64_t *used) {
    return latent_moe(0, format, x, T, D, w_down, I, norm_w, eps, w_up, F, E_total, table, ids, weight, K, act, b1,
                      b2, y, nthreads, used);
}

/* Sum of a[i] * b[i] over n fp32 values, in 16 (AVX-512) or 8 (AVX2) lanes, then the tail. */
static float dot_f32(const float *a, const float *b, int64_t n) {
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

/* Rows at once are worth a fork/join only when there is this much work. */
#define GLUE_PARALLEL_ELEMENTS (1 << 16)

/* RMSNorm of N rows of width D: y = x / sqrt(mean(x^2) + eps) * w (w may be NULL); fp32, y may be x. */
int moeswap_rms_norm(const float *x, int64_t N, int64_t D, const float *w, float eps, float *y, int nthreads) {
    if (N < 0 || D < 1) return 1;
    #pragma omp parallel for num_threads(N * D >= GLUE_PARALLEL_ELEMENTS ? nthreads : 1) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *xn = x + n * D;
        float *yn = y + n * D;
        const float r = 1.f / sqrtf(dot_f32(xn, xn, D) / (float)D + eps);
        if (w) for (int64_t i = 0; i < D; i++) yn[i] = xn[i] * r * w[i];
        else for (int64_t i = 0; i < D; i++) yn[i] = xn[i] * r;
    }
    return 0;
}

/* Block attention residuals' mix (models/layers/attn_res.py is the reference): for each of N tokens,
 * the S sources src[s][n] (rows of width D) are scored l_s = <rmsnorm(src[s][n]), score>, and
 * out[n] = sum_s softmax(l)_s src[s][n]. fp32; out may not alias a source. */
int moeswap_res_mix(const float *const *src, int S, int64_t N, int64_t D, const float *score, float eps,
                    float *out, int nthreads) {
    if (S < 1 || S > 64 || N < 0 || D < 1) return 1;
    #pragma omp parallel for num_threads(N * D * S >= GLUE_PARALLEL_ELEMENTS ? nthreads : 1) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float p[64], top = -INFINITY, total = 0.f;
        for (int s = 0; s < S; s++) {
            const float *xs = src[s] + n * D;
            p[s] = dot_f32(xs, score, D) / sqrtf(dot_f32(xs, xs, D) / (float)D + eps);
            top = p[s] > top ? p[s] : top;
        }
        for (int s = 0; s < S; s++) { p[s] = expf(p[s] - top); total += p[s]; }
        float *on = out + n * D;
        const float *x0 = src[0] + n * D;
        for (int64_t i = 0; i < D; i++) on[i] = p[0] / total * x0[i];
        for (int s = 1; s < S; s++) {
            const float *xs = src[s] + n * D, ps = p[s] / total;
            for (int64_t i = 0; i < D; i++) on[i] += ps * xs[i];
        }
    }
    return 0;
}

/* The MoE router for T tokens (models/layers/moe.py Router is the reference): logits = x W^T with W fp32
 * [E, D]; scores = sigmoid(logits) (softmax over E when `softmax`); the K experts of highest
 * scores + bias (bias steers the choice only; ties go to the lower id) in descending order; their
 * scores, divided by their sum (+1e-20) when `renorm`, times `scale`. ids int64 [T, K], w fp32 [T, K]. */
int moeswap_route(const float *x, int64_t T, int64_t D, const float *W, int64_t E, const float *bias, int64_t K,
                  int softmax, int renorm, float scale, int64_t *ids, float *w, int nthreads) {
    if (T < 0 || D < 1 || E < 1 || E > 4096 || K < 1 || K > E) return 1;
    #pragma omp parallel for num_threads(T * E * D >= 4 * GLUE_PARALLEL_ELEMENTS ? nthreads : 1) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float score[4096], choice[4096];
        const float *xt = x + t * D;
        float top = -INFINITY, total = 0.f;
        for (int64_t e = 0; e < E; e++) {
            score[e] = dot_f32(xt, W + e * D, D);
            top = score[e] > top ? score[e] : top;
        }
        for (int64_t e = 0; e < E; e++) {
            score[e] = softmax ? expf(score[e] - top) : sigmoid_f32(score[e]);
            total += score[e];
        }
        for (int64_t e = 0; e < E; e++) {
            if (softmax) score[e] /= total;
            choice[e] = score[e] + bias[e];
        }
        float sum = 0.f;
        for (int64_t k = 0; k < K; k++) { /* selection: K is small */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (choice[e] == choice[e] && (best < 0 || choice[e] > choice[best])) best = e;
            if (best < 0) best = 0; /* all NaN: the output is NaN anyway */
            ids[t * K + k] = best;
            w[t * K + k] = score[best];
            sum += score[best];
            choice[best] = NAN;
        }
        for (int64_t k = 0; k < K; k++) w[t * K + k] = (renorm ? w[t * K + k] / (sum + 1e-20f) : w[t * K + k]) * scale;
    }
    return 0;
}

/* y[j] += a * x[j] for n values (the compiler vectorizes it). */
static inline void axpy_f32(float *y, float a, const float *x, int64_t n) {
    for (int64_t j = 0; j < n; j++) y[j] += a * x[j];
}

/* MLA attention for one new token per sequence, in the absorbed form (models/layers/mla.py MLA.forward is
 * the reference), B sequences of H heads: q [B, H, N + R] (no-position part, then the shared-key part);
 * latent [B, cap, L + R], the cache rows [c | k_r] of which lengths[b] are valid (the new token's
 * included); wk [H, N, L] and wv [H, L, V]: kv_b_proj split per head. Per (sequence, head):
 *   q_lat = q_nope wk_h;  score_s = scale (q_lat . c_s + q_r . k_r_s);  p = softmax(score);
 *   out[b, h V : (h+1) V] = (sum_s p_s c_s) wv_h.
 * fp32, contiguous. Returns 0, 1 for bad sizes, 2 out of memory. */
int moeswap_mla_decode(const float *q, const float *latent, int64_t cap, const int64_t *lengths, const float *wk,
                       const float *wv, float scale, float *out, int64_t B, int64_t H, int64_t N, int64_t R,
                       int64_t L, int64_t V, int nthreads) {
    if (B < 1 || H < 1 || N < 1 || R < 0 || L < 1 || L > 4096 || V < 1 || cap < 1) return 1;
    for (int64_t b = 0; b < B; b++)
        if (lengths[b] < 1 || lengths[b] > cap) return 1;
    int failed = 0;
    #pragma omp parallel for num_threads(nthreads) schedule(static) reduction(|:failed)
    for (int64_t n = 0; n < B * H; n++) {
        const int64_t b = n / H, h = n % H, S = lengths[b], X = L + R;
        const float *qn = q + n * (N + R), *rows = latent + b * cap * X;
        float q_lat[4096], ctx[4096], small[1024];
        float *p = S <= 1024 ? small : (float *)malloc((size_t)S * sizeof(float));
        if (!p) { failed = 1; continue; }
        for (int64_t l = 0; l < L; l++) q_lat[l] = 0.f;
        for (int64_t i = 0; i < N; i++) axpy_f32(q_lat, qn[i], wk + (h * N + i) * L, L);
        float top = -INFINITY, total = 0.f;
        for (int64_t s = 0; s < S; s++) {
            const float *row = rows + s * X;
            p[s] = scale * (dot_f32(q_lat, row, L) + (R ? dot_f32(qn + N, row + L, R) : 0.f));
            top = p[s] > top ? p[s] : top;
        }
        for (int64_t s = 0; s < S; s++) { p[s] = expf(p[s] - top); total += p[s]; }
        for (int64_t l = 0; l < L; l++) ctx[l] = 0.f;
        for (int64_t s = 0; s < S; s++) axpy_f32(ctx, p[s] / total, rows + s * X, L);
        float *on = out + b * H * V + h * V;
        for (int64_t v = 0; v < V; v++) on[v] = 0.f;
        for (int64_t l = 0; l < L; l++) axpy_f32(on, ctx[l], wv + (h * L + l) * V, V);
        if (p != small) free(p);
    }
    return failed ? 2 : 0;
}

/* ---- A decode step's decoder layers in one call (engine/native_step.py builds the tables) ----
 * models/kimi_k3.py KimiModel.forward is the reference: this runs the kernels its eager CPU path calls, in
 * the same order on the same values (so the same bits), in one call instead of ~12 Python-driven kernel
 * calls per layer. One token per sequence, N rows.
 * Every weight bf16 [out, in] unless noted; norms, scores, router, taps and absorbed MLA weights fp32. */
typedef struct {
    int64_t mla, moe, bank_before;          /* attention kind, FFN kind; bank the partial sum first (AttnRes) */
    const float *score_attn, *score_ffn;    /* AttnRes score vectors [D], NULL without */
    const float *ln_in, *ln_post;           /* input_layernorm, post_attention_layernorm [D] */
    const uint16_t *w_in;                   /* the fused input projections [in_rows, D] */
    int64_t in_rows, off[6];                /* ... and their column offsets (KDA: q k v f_a b g; MLA: q kv g) */
    const uint16_t *w_o;                    /* o_proj [D, H K] (KDA) or [D, H V] (MLA) */
    /* KDA: f_b_proj [C, K]; g_b_proj [C, K] for Kimi Linear's low-rank output gate (NULL: full rank, in w_in) */
    const uint16_t *w_fb, *w_gb;
    const float *taps, *dt_bias, *rate, *o_norm;
    double lower, kda_scale;
    int64_t bounded, H, K, W;
    /* MLA: q_a_layernorm [q_rank] + q_b_proj (NULL: w_in holds the queries), kv_a_layernorm [L],
     * kv_b_proj absorbed as keys [H, N, L] and values [H, L, V] (fp32); gated: w_in holds the output gate */
    const float *q_norm;
    const uint16_t *w_qb;
    int64_t q_rank;
    const float *kv_norm, *wk, *wv;
    int64_t N, R, L, V, gated;
    double mla_scale;
    /* dense MLP, or the shared experts: gate|up [2 hidden, D], down [D, hidden] (NULL: none) */
    const uint16_t *w_gu, *w_down;
    int64_t hidden;
    /* MoE: router [E, D] + bias [E]; resident table [E, 6] (format as moeswap_moe_resident; NULL only with
     * `stop`); K3's latent projections down [lat_dim, D], up [D, lat_dim] and norm [lat_dim] (NULL: the
     * experts read x) */
    const float *router, *router_bias;
    int64_t E, topk, softmax, renorm;
    double route_scale;
    const int64_t *table;
    int64_t F, format;
    const uint16_t *lat_down, *lat_up;
    const float *lat_norm;
    int64_t lat_dim;
    int64_t stop;                           /* stop before this layer's FFN: the caller runs it (status 4) */
} decode_layer;

/* Rows of width w from column `from` of src [N, stride] into dst [N, w]. */
static void take_columns(const float *src, int64_t N, int64_t stride, int64_t from, int64_t w, float *dst) {
    for (int64_t n = 0; n < N; n++) memcpy(dst + n * w, src + n * stride + from, (size_t)w * sizeof(float));
}

/* A KDA layer for one token per sequence: out [N, D] = o_proj(kda(...)). state: conv [N, W-1, 3C], S. */
static int kda_block(int bf16_in, const decode_layer *l, float *conv, float *S, const float *proj, int64_t N,
                     float eps, float l2_eps, float *out, int64_t D, int nt) {
    const int64_t H = l->H, K = l->K, C = H * K, P = l->in_rows;
    float *buf = (float *)malloc((size_t)(N * (3 * C + K + C + H + C + K + C)) * sizeof(float) + 64);
    if (!buf) return 2;
    float *qkv = buf, *fa = qkv + N * 3 * C, *z = fa + N * K, *b = z + N * C, *gate = b + N * H,
          *ga = gate + N * C, *y = ga + N * K;
    take_columns(proj, N, P, l->off[0], 3 * C, qkv); /* q, k, v are adjacent in w_in */
    take_columns(proj, N, P, l->off[3], K, fa);
    take_columns(proj, N, P, l->off[4], H, b);
    int status = dense_linear(bf16_in, fa, N, K, l->w_fb, C, z, nt);
    if (!status && l->w_gb) {
        take_columns(proj, N, P, l->off[5], K, ga);
        status = dense_linear(bf16_in, ga, N, K, l->w_gb, C, gate, nt);
    } else if (!status) {
        take_columns(proj, N, P, l->off[5], C, gate);
    }
    if (!status)
        status = moeswap_kda_layer(qkv, conv, l->taps, l->W, z, l->dt_bias, l->rate, (float)l->lower,
                                   (int)l->bounded, b, S, gate, l->o_norm, eps, (float)l->kda_scale, l2_eps, y, N,
                                   1, H, K, nt);
    if (!status) status = dense_linear(bf16_in, y, N, C, l->w_o, D, out, nt);
    free(buf);
    return status;
}

/* x[n, j] *= sigmoid(g[n * g_stride + j]) for n < rows, j < width (MLA's output gate, fp32). */
int moeswap_sigmoid_gate(float *x, const float *g, int64_t rows, int64_t width, int64_t g_stride) {
    if (rows < 0 || width < 0 || g_stride < width) return 1;
    for (int64_t n = 0; n < rows; n++)
        for (int64_t j = 0; j < width; j++) x[n * width + j] *= sigmoid_f32(g[n * g_stride + j]);
    return 0;
}

/* An MLA layer for one token per sequence: appends [kv_norm(c) | k_r] at lengths[n] (then lengths[n] += 1)
 * in latent [N, cap, L + R], attends, gates, o_proj into out [N, D]. */
static int mla_block(int bf16_in, const decode_layer *l, float *latent, int64_t *lengths, int64_t cap,
                     const float *proj, int64_t N, float eps, float *out, int64_t D, int nt) {
    const int64_t H = l->H, X = l->L + l->R, Q = H * (l->N + l->R), P = l->in_rows, HV = H * l->V;
    for (int64_t n = 0; n < N; n++)
        if (lengths[n] < 0 || lengths[n] >= cap) return 1;
    float *buf = (float *)malloc((size_t)(N * (l->q_rank + Q + X + l->L + HV)) * sizeof(float) + 64);
    if (!buf) return 2;
    float *qa = buf, *q = qa + N * l->q_rank, *kv = q + N * Q, *c = kv + N * X, *att = c + N * l->L;
    int status = 0;
    if (l->w_qb) {
        take_columns(proj, N, P, l->off[0], l->q_rank, qa);
        status = moeswap_rms_norm(qa, N, l->q_rank, l->q_norm, eps, qa, nt);
        if (!status) status = dense_linear(bf16_in, qa, N, l->q_rank, l->w_qb, Q, q, nt);
    } else {
        take_columns(proj, N, P, l->off[0], Q, q);
    }
    take_columns(proj, N, P, l->off[1], X, kv);
    /* the cache row: the normalised latent, then the shared key slice as it came */
    take_columns(kv, N, X, 0, l->L, c);
    if (!status) status = moeswap_rms_norm(c, N, l->L, l->kv_norm, eps, c, nt);
    for (int64_t n = 0; !status && n < N; n++) {
        float *row = latent + (n * cap + lengths[n]) * X;
        memcpy(row, c + n * l->L, (size_t)l->L * sizeof(float));
        memcpy(row + l->L, kv + n * X + l->L, (size_t)l->R * sizeof(float));
        lengths[n]++;
    }
    if (!status)
        status = moeswap_mla_decode(q, latent, cap, lengths, l->wk, l->wv, (float)l->mla_scale, att, N, H, l->N,
                                    l->R, l->L, l->V, nt);
    if (!status && l->gated) status = moeswap_sigmoid_gate(att, proj + l->off[2], N, HV, P);
    if (!status) status = dense_linear(bf16_in, att, N, HV, l->w_o, D, out, nt);
    free(buf);
    return status;
}

/* The FFN of a layer on its normalised input xn [N, D] into out [N, D]: the dense MLP, or the MoE block (router,
 * routed experts from the resident table, shared experts added). Returns 4, out untouched, when the layer is
 * marked `stop` or a chosen expert is not in the table: the caller runs this FFN through the expert store. */
static int ffn_block(int bf16_in, const decode_layer *l, const float *xn, int64_t N, int64_t D, float eps, int act,
                     float b1, float b2, float *out, int nt, int64_t *used) {
    *used = 0;
    if (l->stop) return 4;
    if (!l->moe) return gated_mlp(bf16_in, xn, N, D, l->w_gu, l->hidden, l->w_down, act, b1, b2, out, nt);
    int64_t *ids = (int64_t *)malloc((size_t)(N * l->topk) * sizeof(int64_t) + 64);
    float *w = (float *)malloc((size_t)(N * l->topk) * sizeof(float) + 64);
    float *routed = (float *)calloc((size_t)(N * D), sizeof(float));
    float *shared = (float *)malloc((size_t)(N * D) * sizeof(float) + 64);
    int status = ids && w && routed && shared ? 0 : 2;
    if (!status)
        status = moeswap_route(xn, N, D, l->router, l->E, l->router_bias, l->topk, (int)l->softmax, (int)l->renorm,
                               (float)l->route_scale, ids, w, nt);
    if (!status && l->lat_down)
        status = latent_moe(bf16_in, (int)l->format, xn, N, D, l->lat_down, l->lat_dim, l->lat_norm, eps, l->lat_up,
                            l->F, l->E, l->table, ids, w, l->topk, act, b1, b2, routed, nt, used);
    else if (!status)
        status = moeswap_moe_resident((int)l->format, xn, N, D, l->F, l->E, l->table, ids, w, l->topk, act, b1, b2,
                                      routed, nt, used);
    if (!status && l->w_gu)
        status = gated_mlp(bf16_in, xn, N, D, l->w_gu, l->hidden, l->w_down, act, b1, b2, shared, nt);
    if (!status)
        for (int64_t j = 0; j < N * D; j++) out[j] = l->w_gu ? routed[j] + shared[j] : routed[j];
    free(ids); free(w); free(routed); free(shared);
    return status;
}

/* AttnRes: the mix of the banked sums and the running one into out (models/layers/attn_res.py mix); with no
 * score or an empty bank, the running sum itself. */
static int mixed(const float *score, const float *bank, int64_t n_bank, const float *partial, int64_t N, int64_t D,
                 float eps, float *out, int nt) {
    if (!score || !n_bank) { memcpy(out, partial, (size_t)(N * D) * sizeof(float)); return 0; }
    const float *src[64];
    if (n_bank > 63) return 1;
    for (int64_t s = 0; s < n_bank; s++) src[s] = bank + s * N * D;
    src[n_bank] = partial;
    return moeswap_res_mix(src, (int)n_bank + 1, N, D, score, eps, out, nt);
}

/* Layers [first, n_layers) of a decode step (KimiModel._forward's loop, then its final AttnRes mix when
 * score_out is given) on the running sum partial [N, D] (in place), for N sequences of one token each.
 * state [n_layers, 3]: KDA (conv, S, 0) or MLA (latent, lengths, capacity) base pointers of rows 0..N-1.
 * bank [max_bank, N, D] with *n_bank of its rows in use (in and out). used[i]: the distinct experts layer i
 * ran. With final_norm and head (bf16 [V, D]) given, once every layer has run the step ends as the model's
 * does: logits [N, V] = rmsnorm(partial; final_norm, eps) @ head^T.
 * Returns 0; 4 when layer *stopped is marked `stop` or its experts are not all resident: its attention is
 * done, m_out [N, D] holds its FFN input before the norm, and the caller runs that FFN (and whatever the
 * model does there, such as an expert lookahead) and resumes at *stopped + 1; else 1 bad
 * sizes, 2 out of memory (the step's state is then not to be trusted). */
int moeswap_decode_layers(const decode_layer *layers, int64_t n_layers, int64_t first, const int64_t *state,
                          float *partial, float *bank, int64_t max_bank, int64_t *n_bank, float *m_out,
                          const float *score_out, const float *final_norm, const uint16_t *head, int64_t V,
                          float *logits, int64_t N, int64_t D, float eps, float l2_eps, int act, float b1, float b2,
                          int64_t *used, int64_t *stopped, int bf16_in, int nt) {
    if (N < 1 || D < 1 || first < 0 || first > n_layers || *n_bank < 0 || *n_bank > max_bank) return 1;
    float *buf = (float *)malloc((size_t)(3 * N * D) * sizeof(float) + 64);
    if (!buf) return 2;
    float *h = buf, *xn = h + N * D, *y = xn + N * D;
    float *proj = NULL;
    int status = 0;
    *stopped = -1;
    for (int64_t i = first; !status && i < n_layers; i++) {
        const decode_layer *l = layers + i;
        const int64_t *st = state + 3 * i;
        status = mixed(l->score_attn, bank, *n_bank, partial, N, D, eps, h, nt);
        if (!status && l->bank_before) {
            if (*n_bank >= max_bank) { status = 1; break; }
            memcpy(bank + *n_bank * N * D, partial, (size_t)(N * D) * sizeof(float));
            (*n_bank)++;
            memset(partial, 0, (size_t)(N * D) * sizeof(float));
        }
        if (!status) status = moeswap_rms_norm(h, N, D, l->ln_in, eps, xn, nt);
        free(proj);
        proj = status ? NULL : (float *)malloc((size_t)(N * l->in_rows) * sizeof(float) + 64);
        if (!status && !proj) status = 2;
        if (!status) status = dense_linear(bf16_in, xn, N, D, l->w_in, l->in_rows, proj, nt);
        if (!status)
            status = l->mla ? mla_block(bf16_in, l, (float *)(intptr_t)st[0], (int64_t *)(intptr_t)st[1], st[2],
                                        proj, N, eps, y, D, nt)
                            : kda_block(bf16_in, l, (float *)(intptr_t)st[0], (float *)(intptr_t)st[1], proj, N,
                                        eps, l2_eps, y, D, nt);
        for (int64_t j = 0; !status && j < N * D; j++) partial[j] += y[j];
        if (!status) status = mixed(l->score_ffn, bank, *n_bank, partial, N, D, eps, h, nt);
        if (!status) status = moeswap_rms_norm(h, N, D, l->ln_post, eps, xn, nt);
        if (!status) status = ffn_block(bf16_in, l, xn, N, D, eps, act, b1, b2, y, nt, used + i);
        if (status == 4) {
            memcpy(m_out, h, (size_t)(N * D) * sizeof(float));
            *stopped = i;
            break;
        }
        for (int64_t j = 0; !status && j < N * D; j++) partial[j] += y[j];
    }
    if (!status && score_out) {
        status = mixed(score_out, bank, *n_bank, partial, N, D, eps, h, nt);
        if (!status) memcpy(partial, h, (size_t)(N * D) * sizeof(float));
    }
    if (!status && final_norm && head) {
        status = moeswap_rms_norm(partial, N, D, final_norm, eps, h, nt);
        if (!status) status = dense_linear(bf16_in, h, N, D, head, V, logits, nt);
    }
    free(proj);
    free(buf);
    return status;
}

/* For the caller's mirror of decode_layer (a layout check before the first call). */
int moeswap_decode_layer_size(void) { return (int)sizeof(decode_layer); }
