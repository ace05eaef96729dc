/* quant.c: block-FP8 and INT4 weights (routed experts), multiplied straight from their stored bytes:
 *   y[t, o] = sum_i x[t, i] * W[o, i]
 * FP8 block (DeepSeek-V3): q uint8 [O, I] E4M3 codes, s fp32 [ceil(O/128), ceil(I/128)];
 *   W[o, i] = E4M3(q[o, i]) * s[o/128, i/128], one fp32 product (S.1111.111 is NaN, as torch's float8_e4m3fn).
 * INT4 pack-quantized (compressed-tensors): q int32 [O, I/8] (element 8w + k at bits 4k of word w, stored as
 *   code + 8; little-endian, so byte j holds column 2j low and 2j+1 high, as MXFP4), s bf16 [O, I/32];
 *   W[o, i] = bf16(code * s[o, i/32]): the product rounded to bf16, as compressed-tensors dequantises.
 * Each weight is decoded in registers and used for every token of the call; no decoded copy is kept.
 * Entry points: moeswap_quant_linear (one matrix) and, through moe.c, moeswap_quant_moe (a layer step's
 * experts); moeswap_int4_decode (INT4 rows to fp32, for prefill's GEMM: the dense method's decoded row chunks);
 * ops/expert_quant.py holds the contract and the plain-torch references.
 * x, y: fp32 row-major; x in natural column order for FP8, in `permuted` order (internal.h) for INT4. Every
 * (row, token) sum runs in one order whatever the number of tokens or rows in the tile, so a batched row gets
 * the bits it gets alone.
 * AVX-512 (F + BW) builds decode in vectors; AVX2 and portable builds run the scalar tile (each build sums a
 * (row, token) in one order; slower).
 */
#include "internal.h"

#define FP8_BLOCK 128
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define VECTOR 1
#else
#define VECTOR 0 /* the scalar tile */
#endif

static float E4M3[256];
/* INT4_MANTISSA[m][n] = bf16((n - 8) * (1 + m / 128)): the INT4 table of a bf16 scale of mantissa m and exponent 0.
 * A normal scale's table is this row times the scale's sign and power of two, exactly: its products stay
 * normal, and rounding commutes with a power of two there. 64-byte rows: one cache line each. */
static float INT4_MANTISSA[128][16] __attribute__((aligned(64)));
/* INT4_SIGN_EXP[k]: the fp32 value of sign and exponent bits k (a bf16 scale's top 9 bits), mantissa 0. */
static float INT4_SIGN_EXP[512];
/* FP8_BF16[0][c], [1][c]: the low and high bytes of the bf16 value of E4M3 code c (0-127, sign clear). */
static uint8_t FP8_BF16[2][128] __attribute__((aligned(64)));
static int quant_ready = 0;

static inline float bf16_round(float v);

static void quant_tables(void) {
    if (quant_ready) return; /* idempotent: a race writes the same values */
    for (int b = 0; b < 256; b++) {
        const int e = (b >> 3) & 15, m = b & 7;
        float v = e ? ldexpf(1.f + m / 8.f, e - 7) : ldexpf((float)m, -9);
        if ((b & 0x7F) == 0x7F) v = NAN;
        E4M3[b] = b & 0x80 ? -v : v;
    }
    for (int c = 0; c < 128; c++) { /* exact: E4M3 values have 4 significant bits and bf16's exponent range */
        uint32_t bits;
        memcpy(&bits, &E4M3[c], 4);
        if (c == 0x7F) bits = 0x7FC00000u;
        FP8_BF16[0][c] = (uint8_t)(bits >> 16);
        FP8_BF16[1][c] = (uint8_t)(bits >> 24);
    }
    for (uint32_t k = 0; k < 512; k++) {
        const uint32_t bits = k << 23;
        memcpy(&INT4_SIGN_EXP[k], &bits, 4);
    }
    for (int m = 0; m < 128; m++)
        for (int n = 0; n < 16; n++) INT4_MANTISSA[m][n] = bf16_round((float)(n - 8) * (1.f + (float)m / 128.f));
    quant_ready = 1;
}

/* bf16 rounding (to nearest even) of an fp32 value, kept as fp32; NaN stays NaN */
static inline float bf16_round(float v) {
    uint32_t b;
    memcpy(&b, &v, 4);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return v;
    b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&v, &b, 4);
    return v;
}

/* Position in `permuted` order of column k (0..31) of a 32-column block. */
#if PERMUTED_WIDTH == 16
#define PPOS(k) ((k) % 2 ? 16 + (k) / 2 : (k) / 2)
#elif PERMUTED_WIDTH == 8
#define PPOS(k) (((k) / 16) * 16 + ((k) % 2 ? 8 + ((k) % 16) / 2 : ((k) % 16) / 2))
#else
#define PPOS(k) (k)
#endif

INLINE float fp8_scale(const float *s, int64_t o, int64_t b, int64_t I) {
    return s[(o / FP8_BLOCK) * ((I + FP8_BLOCK - 1) / FP8_BLOCK) + b * 32 / FP8_BLOCK];
}

/* Scalar tile (AVX2 and portable builds): one row, TT tokens; 32 weights decoded, then one sum per token. */
INLINE void scalar_tile(int fp8, const float *xp, const int TT, int64_t I, const uint8_t *q, const void *s,
                        int64_t o, float *y, int64_t O) {
    const int64_t nb = I / 32;
    float acc[8] = {0};
    for (int64_t b = 0; b < nb; b++) {
        float w[32];
        if (fp8) {
            const uint8_t *p = q + o * I + b * 32;
            const float sc = fp8_scale((const float *)s, o, b, I);
            for (int k = 0; k < 32; k++) w[k] = E4M3[p[k]] * sc; /* x in natural order */
        } else {
            const uint8_t *p = q + o * (I / 2) + b * 16;
            const float sc = bf16_to_f32(((const uint16_t *)s)[o * nb + b]);
            for (int k = 0; k < 16; k++) {
                w[PPOS(2 * k)] = bf16_round((float)((p[k] & 15) - 8) * sc);
                w[PPOS(2 * k + 1)] = bf16_round((float)((p[k] >> 4) - 8) * sc);
            }
        }
        for (int t = 0; t < TT; t++) {
            float sum = 0.f;
            for (int k = 0; k < 32; k++) sum += w[k] * xp[t * I + b * 32 + k];
            acc[t] += sum;
        }
    }
    for (int t = 0; t < TT; t++) y[t * O + o] = acc[t];
}

#if VECTOR
#if defined(__AVX512VBMI__)
/* FP8, x in natural order. Every E4M3 value is a bf16 value (4 exponent bits fit in 8, subnormal codes become
 * normal bf16, NaN codes bf16 NaN), and a bf16 value is the top half of an fp32 one: two byte lookups (vpermt2b,
 * 128 entries: the code less its sign) give each code's bf16 low and high bytes, the sign joins the high byte,
 * and four byte permutes put the pairs in the top halves of fp32 lanes, 16 codes each, in order. One product
 * by the block's scale then rounds once, as the published code * s. 64 codes per step (one cache line). */
INLINE void fp8_decode64(__m512i v, const __m512i *lut, __m512 w[4]) {
    const __m512i lo = _mm512_permutex2var_epi8(lut[0], v, lut[1]); /* the index's bit 7 is not read */
    __m512i hi = _mm512_permutex2var_epi8(lut[2], v, lut[3]);
    hi = _mm512_ternarylogic_epi32(hi, v, _mm512_set1_epi8((char)0x80), 0xD8); /* bit 7 from v, the rest from hi */
    UNROLL for (int k = 0; k < 4; k++) {
        /* lane j of w[k]: bytes 0-1 zero, byte 2 lo[16k + j], byte 3 hi[16k + j] (index bit 6: from hi) */
        const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(((16 * k) << 16) | ((64 + 16 * k) << 24)),
                                             _mm512_setr_epi32(0, 0x01010000, 0x02020000, 0x03030000, 0x04040000,
                                                               0x05050000, 0x06060000, 0x07070000, 0x08080000,
                                                               0x09090000, 0x0A0A0000, 0x0B0B0000, 0x0C0C0000,
                                                               0x0D0D0000, 0x0E0E0000, 0x0F0F0000));
        w[k] = _mm512_castsi512_ps(_mm512_maskz_permutex2var_epi8(0xCCCCCCCCCCCCCCCCull, lo, idx, hi));
    }
}

INLINE void fp8_tile(const float *x, const int TT, const int R, int64_t I, const uint8_t *q, const float *s,
                     int64_t o, float *y, int64_t O) {
    const __m512i lut[4] = {_mm512_load_si512(FP8_BF16[0]), _mm512_load_si512(FP8_BF16[0] + 64),
                            _mm512_load_si512(FP8_BF16[1]), _mm512_load_si512(FP8_BF16[1] + 64)};
    const int64_t cols = (I + FP8_BLOCK - 1) / FP8_BLOCK;
    const float *srow[8]; /* each row's scales: one per 128 columns, so columns c.. read srow[c / 128] */
    UNROLL for (int r = 0; r < R; r++) srow[r] = s + ((o + r) / FP8_BLOCK) * cols;
    __m512 acc[8][8];
    tile_zero(acc, TT, R);
    int64_t c = 0;
    for (; c + 64 <= I; c += 64) {
        __m512 w[4][8];
        UNROLL for (int r = 0; r < R; r++) {
            const uint8_t *p = q + (o + r) * I + c;
            _mm_prefetch((const char *)(p + R * I), _MM_HINT_T0);
            __m512 d[4];
            fp8_decode64(_mm512_loadu_si512(p), lut, d);
            const __m512 sc = _mm512_set1_ps(srow[r][c / FP8_BLOCK]);
            UNROLL for (int k = 0; k < 4; k++) w[k][r] = _mm512_mul_ps(d[k], sc);
        }
        tile_fma(acc, w[0], w[1], x + c, I, TT, R);
        tile_fma(acc, w[2], w[3], x + c + 32, I, TT, R);
    }
    if (c < I) { /* 32 columns left */
        __m512 w[2][8];
        UNROLL for (int r = 0; r < R; r++) {
            __m512 d[4];
            fp8_decode64(_mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(q + (o + r) * I + c))), lut, d);
            const __m512 sc = _mm512_set1_ps(srow[r][c / FP8_BLOCK]);
            w[0][r] = _mm512_mul_ps(d[0], sc);
            w[1][r] = _mm512_mul_ps(d[1], sc);
        }
        tile_fma(acc, w[0], w[1], x + c, I, TT, R);
    }
    tile_store(acc, y, O, o, TT, R);
}
#define FP8_TILE(TT_, R_) fp8_tile(xp, TT_, R_, I, q, (const float *)s, o, y, O)
#define FP8_TILE_BIG FP8_TILE
#define FP8_ONE_PRODUCT 1 /* whatever the scales */
#else
/* FP8 where AVX-512 has no byte permutes (VBMI), x in natural order: 32 codes widened to 16-bit lanes become fp16 bits by shifts (exponent and mantissa
 * under fp16's: code * 2^-8 exactly, subnormal codes as fp16 subnormals, which the conversion to fp32 takes
 * exactly and at full speed), NaN codes (S.1111.111) fp16 NaN; then fp32, times s * 2^8 (one product rounded
 * once, as the published code * s; scales past 2^119, whose 256-fold overflows, take two products, the first
 * exact: chosen per row chunk). */
INLINE void fp8_tile(const float *x, const int TT, const int R, int64_t I, const uint8_t *q, const float *s,
                     int64_t o, float *y, int64_t O, const int fold) {
    const int64_t nb = I / 32;
    const float *srow[8]; /* each row's scales: one per 128 columns, so block b of 32 reads srow[b / 4] */
    UNROLL for (int r = 0; r < R; r++) srow[r] = s + ((o + r) / FP8_BLOCK) * ((I + FP8_BLOCK - 1) / FP8_BLOCK);
    const __m512i low7 = _mm512_set1_epi16(0x7F), bit14 = _mm512_set1_epi16(0x4000);
    const __m512i nan16 = _mm512_set1_epi16(0x7E00);
    __m512 acc[8][8];
    tile_zero(acc, TT, R);
    for (int64_t b = 0; b < nb; b++) {
        __m512 w0[8], w1[8];
        UNROLL for (int r = 0; r < R; r++) {
            const uint8_t *p = q + (o + r) * I + b * 32;
            if ((b & 1) == 0) _mm_prefetch((const char *)(p + R * I), _MM_HINT_T0);
            const float sc = srow[r][b >> 2];
            const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
            /* code << 7: exponent and mantissa in place, the sign one bit low; adding bit 14 to itself moves
             * it to bit 15 */
            const __m512i a = _mm512_slli_epi16(v, 7);
            __m512i h = _mm512_add_epi16(a, _mm512_and_si512(a, bit14));
            h = _mm512_mask_mov_epi16(h, _mm512_cmpeq_epi16_mask(_mm512_and_si512(v, low7), low7), nan16);
            __m512 a0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h)), a1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
            if (fold) { /* constant per tile */
                w0[r] = _mm512_mul_ps(a0, _mm512_set1_ps(sc * 256.f));
                w1[r] = _mm512_mul_ps(a1, _mm512_set1_ps(sc * 256.f));
            } else {
                w0[r] = _mm512_mul_ps(_mm512_mul_ps(a0, _mm512_set1_ps(256.f)), _mm512_set1_ps(sc));
                w1[r] = _mm512_mul_ps(_mm512_mul_ps(a1, _mm512_set1_ps(256.f)), _mm512_set1_ps(sc));
            }
        }
        tile_fma(acc, w0, w1, x + b * 32, I, TT, R);
    }
    tile_store(acc, y, O, o, TT, R);
}

#define FP8_TILE(TT_, R_) fp8_tile(xp, TT_, R_, I, q, (const float *)s, o, y, O, 1)
#define FP8_TILE_BIG(TT_, R_) fp8_tile(xp, TT_, R_, I, q, (const float *)s, o, y, O, 0)
#define FP8_ONE_PRODUCT 0
#endif

/* INT4: each (row, block) gets its 16-entry table bf16(code * scale), codes -8..7, as fp32 lanes; one lane
 * permute (vpermps) by the block's low nibbles gives the 16 even columns, one by its high nibbles the odd ones,
 * in `permuted` order, as MXFP4's tiles do. A normal scale's table is a row of INT4_MANTISSA times the scale with
 * its mantissa cleared (one exact product; the rows stay in L1). Blocks go in pairs: one 32-bit load holds both
 * scales. A tile with a subnormal or NaN scale (`normal` 0) rounds its products on the bits instead. */
#define TOP _mm512_set1_epi32((int)0xFFFF0000u)

/* v rounded to bf16 (to nearest even), kept as fp32 lanes; NaN stays NaN. */
INLINE __m512 bf16_rounded(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd), TOP);
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), bits));
}

/* The fp32 tables of two blocks whose bf16 scales are the low (t0) and high (t1) words of `both`. */
INLINE void int4_tables(uint32_t both, const int normal, __m512 *t0, __m512 *t1) {
    if (normal) { /* a compile-time choice per tile; broadcasts and products only, the indices in scalars */
        *t0 = _mm512_mul_ps(_mm512_load_ps(INT4_MANTISSA[both & 0x7F]), _mm512_set1_ps(INT4_SIGN_EXP[(both >> 7) & 0x1FF]));
        *t1 = _mm512_mul_ps(_mm512_load_ps(INT4_MANTISSA[(both >> 16) & 0x7F]), _mm512_set1_ps(INT4_SIGN_EXP[both >> 23]));
        return;
    }
    const __m512i pair = _mm512_set1_epi32((int)both);
    static const float CODES[16] = {-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f};
    const __m512 lut = _mm512_loadu_ps(CODES);
    *t0 = bf16_rounded(_mm512_mul_ps(lut, _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)))); /* exact: 4 x 8 bits */
    *t1 = bf16_rounded(_mm512_mul_ps(lut, _mm512_castsi512_ps(_mm512_and_si512(pair, TOP))));
}

/* The even and odd columns of the 32 weights of block p (16 bytes) under table t. */
INLINE void int4_decode(const uint8_t *p, __m512 t, __m512 *even, __m512 *odd) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *even = _mm512_permutexvar_ps(bytes, t); /* the low 4 bits of each lane */
    *odd = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), t);
}

/* Whether any of n bf16 scales is subnormal or NaN (exponent bits all 0 or all 1, mantissa not 0): their tables are
 * not a mantissa row times a power of two. 32 scales a step, per tile, on scales the tile is about to read (a scalar
 * pass over a chunk's scales before its tiles cost too much of a one-token call: docs/benchmarks.md). */
INLINE uint32_t abnormal_scales(const uint16_t *s, int64_t n) {
    const __m512i exp_bits = _mm512_set1_epi16(0x7F80), mantissa = _mm512_set1_epi16(0x7F);
    __mmask32 found = 0;
    int64_t k = 0;
    for (; k + 32 <= n; k += 32) {
        const __m512i v = _mm512_loadu_si512(s + k), e = _mm512_and_si512(v, exp_bits);
        const __mmask32 edge = _mm512_cmpeq_epi16_mask(e, _mm512_setzero_si512()) | _mm512_cmpeq_epi16_mask(e, exp_bits);
        found |= _mm512_mask_test_epi16_mask(edge, v, mantissa);
    }
    if (k < n) {
        const __mmask32 tail = (__mmask32)((1ull << (n - k)) - 1);
        const __m512i v = _mm512_maskz_loadu_epi16(tail, s + k), e = _mm512_and_si512(v, exp_bits);
        const __mmask32 edge = _mm512_cmpeq_epi16_mask(e, _mm512_setzero_si512()) | _mm512_cmpeq_epi16_mask(e, exp_bits);
        found |= _mm512_mask_test_epi16_mask(edge & tail, v, mantissa);
    }
    return found;
}

/* With `normal` set, a tile returns nonzero where one of its scales is subnormal or NaN: its sums are then not to be
 * used, and the caller runs it again with `normal` 0 (the tables' indices stay in range either way). */
INLINE uint32_t int4_tile(const float *xp, const int TT, const int R, int64_t I, const uint8_t *q, const uint16_t *s,
                          int64_t o, float *y, int64_t O, const int normal) {
    uint32_t bad = 0;
    const int64_t nb = I / 32, half = I / 2;
    const uint16_t *srow[8];
    UNROLL for (int r = 0; r < R; r++) srow[r] = s + (o + r) * nb;
    if (normal) bad = abnormal_scales(srow[0], R * nb);
    __m512 acc[8][8];
    tile_zero(acc, TT, R);
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        __m512 e0[8], o0[8], e1[8], o1[8];
        UNROLL for (int r = 0; r < R; r++) {
            const uint8_t *p = q + (o + r) * half + b * 16;
            if ((b & 3) == 0) _mm_prefetch((const char *)(p + R * half), _MM_HINT_T0);
            if ((b & 31) == 0) _mm_prefetch((const char *)(srow[r] + b + R * nb), _MM_HINT_T0); /* the next tile's */
            uint32_t both;
            memcpy(&both, srow[r] + b, 4); /* the scales of blocks b (low word) and b + 1 */
            __m512 t0, t1;
            int4_tables(both, normal, &t0, &t1);
            int4_decode(p, t0, &e0[r], &o0[r]);
            int4_decode(p + 16, t1, &e1[r], &o1[r]);
        }
        tile_fma(acc, e0, o0, xp + b * 32, I, TT, R);
        tile_fma(acc, e1, o1, xp + b * 32 + 32, I, TT, R);
    }
    if (b < nb) { /* an odd last block: its table twice */
        __m512 e0[8], o0[8];
        UNROLL for (int r = 0; r < R; r++) {
            __m512 t0, t1;
            int4_tables((uint32_t)srow[r][b] * 0x10001u, normal, &t0, &t1);
            int4_decode(q + (o + r) * half + b * 16, t0, &e0[r], &o0[r]);
        }
        tile_fma(acc, e0, o0, xp + b * 32, I, TT, R);
    }
    tile_store(acc, y, O, o, TT, R);
    return bad;
}
#undef TOP

/* a tile on the scales' tables (the rule); where a scale is subnormal or NaN (rare), again on rounded products */
#define INT4_TILE(TT_, R_)                                                                                     \
    if (int4_tile(xp, TT_, R_, I, q, (const uint16_t *)s, o, y, O, 1))                                         \
    int4_tile(xp, TT_, R_, I, q, (const uint16_t *)s, o, y, O, 0)
#endif

#define SCALAR_TILE(TT_, R_) scalar_tile(fp8, xp, TT_, I, q, s, o, y, O)

/* Whether a block-FP8 scale of rows [o, o + n) is finite while its 256-fold is not (the tile then takes two
 * products: code * 2^-8 * 2^8, exact, then * scale). */
static int big_scales(const float *s, int64_t o, int64_t n, int64_t I) {
    const int64_t cols = (I + FP8_BLOCK - 1) / FP8_BLOCK;
    int any = 0;
    for (int64_t k = (o / FP8_BLOCK) * cols; k < ((o + n - 1) / FP8_BLOCK + 1) * cols; k++)
        any |= isfinite(s[k]) && !isfinite(s[k] * 256.f);
    return any;
}

/* n rows from o for a tile of TT tokens (1 to 8); fp8 1: block FP8, 0: INT4. */
static void quant_rows(int fp8, const float *xp, int TT, int64_t I, const uint8_t *q, const void *s, int64_t o,
                       int64_t n, float *y, int64_t O) {
    const int64_t end = o + n;
#if VECTOR
    const int64_t step = TT <= 4 ? 4 : 2;
    if (fp8) {
        if (FP8_ONE_PRODUCT || !big_scales((const float *)s, o, n, I)) {
            for (; o + step <= end; o += step) BY_TOKENS(FP8_TILE, 4, 4, 2)
            for (; o < end; o++) BY_TOKENS(FP8_TILE, 4, 1, 1)
        } else { /* a scale past 2^119: two products for these rows */
            for (; o + step <= end; o += step) BY_TOKENS(FP8_TILE_BIG, 4, 4, 2)
            for (; o < end; o++) BY_TOKENS(FP8_TILE_BIG, 4, 1, 1)
        }
    } else {
        for (; o + step <= end; o += step) BY_TOKENS(INT4_TILE, 4, 4, 2)
        for (; o < end; o++) BY_TOKENS(INT4_TILE, 4, 1, 1)
    }
#else
    for (; o < end; o++) BY_TOKENS(SCALAR_TILE, 4, 1, 1)
#endif
}

void quant_linear_rows(int fp8, const float *xp, int64_t T, int64_t I, const uint8_t *q, const void *s, int64_t O,
                       int64_t o, int64_t n, float *y) {
    quant_tables();
    for (int64_t t = 0; t < T; t += 8)
        quant_rows(fp8, xp + t * I, T - t < 8 ? (int)(T - t) : 8, I, q, s, o, n, y + t * O, O);
}

/* y[T, O] = x[T, I] @ W^T for one matrix; format FORMAT_FP8 or FORMAT_INT4 (cpu_kernels.h). Returns 0, 1 for bad
 * sizes, 2 out of memory. */
int moeswap_quant_linear(int format, const float *x, int64_t T, int64_t I, const void *q, const void *scale,
                         int64_t O, float *y, int nthreads) {
    if ((format != FORMAT_FP8 && format != FORMAT_INT4) || I % 32 || T < 0 || O < 0) return 1;
    quant_tables();
    float *xp = format == FORMAT_FP8 ? aligned_rows(x, T, I) : permuted(x, T, I);
    if (!xp) return 2;
    const int64_t chunks = (O + CHUNK_ROWS - 1) / CHUNK_ROWS;
    #pragma omp parallel for num_threads(nthreads) schedule(dynamic, 4)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t o = c * CHUNK_ROWS;
        quant_linear_rows(format == FORMAT_FP8, xp, T, I, (const uint8_t *)q, scale, O, o,
                          O - o < CHUNK_ROWS ? O - o : CHUNK_ROWS, y);
    }
    free(xp);
    return 0;
}

/* INT4 rows to fp32 in natural column order: out[o, i] = bf16(code * s[o, i/32]), the values formats/int4.decode
 * gives (the product rounded to bf16 to nearest even, NaN kept), for the dense method's prefill GEMM
 * (weights/int4.py): a decoded row chunk per GEMM, made here in one pass instead of torch's eight. Returns 0, 1
 * for bad sizes. */
int moeswap_int4_decode(const void *q, const void *scale, int64_t O, int64_t I, float *out, int nthreads) {
    if (I % 32 || O < 0) return 1;
    const int64_t nb = I / 32;
    const uint8_t *bytes = (const uint8_t *)q; /* little-endian words: byte j holds column 2j low, 2j + 1 high */
    const uint16_t *s = (const uint16_t *)scale;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t o = 0; o < O; o++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *p = bytes + o * (I / 2) + b * 16;
            const float sc = bf16_to_f32(s[o * nb + b]);
            float *dst = out + o * I + b * 32;
#if VECTOR
            static const float CODES[16] = {-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f,
                                            0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f};
            /* the block's 16 values, each one exact fp32 product (4 x 8 significant bits) rounded to bf16 */
            const __m512 table = bf16_rounded(_mm512_mul_ps(_mm512_loadu_ps(CODES), _mm512_set1_ps(sc)));
            const __m512i nib = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
            const __m512 ve = _mm512_permutexvar_ps(nib, table), vo = _mm512_permutexvar_ps(_mm512_srli_epi32(nib, 4), table);
            const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
            const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
            _mm512_storeu_ps(dst, _mm512_permutex2var_ps(ve, lo, vo));
            _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(ve, hi, vo));
#else
            for (int k = 0; k < 16; k++) {
                dst[2 * k] = bf16_round((float)((p[k] & 15) - 8) * sc);
                dst[2 * k + 1] = bf16_round((float)((p[k] >> 4) - 8) * sc);
            }
#endif
        }
    }
    return 0;
}
