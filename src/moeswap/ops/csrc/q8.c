/* q8.c: MXFP4 weights x int8 activations (opt-in; what llama.cpp computes for MXFP4 weights): each
 * 32-column block of an activation row is quantized to int8 with its own scale d = max|x| / 127
 * (q = round-to-even(x 127 / max|x|); d rounded to 11 significant bits, as llama.cpp's Q8_0 stores it in
 * fp16, but with fp32's range), and the block's dot product runs in integers (AVX-512 VNNI), then is
 * scaled by d and the weights' E8M0 scale:
 *   y[t, o] ~ sum_b d[t, b] * 2^(scale[o, b] - 127) * sum_{i in b} q[t, i] * 2 E2M1(W[o, i]) / 2
 * Weights become the unsigned bytes 2 E2M1 + 12 (0..24); the +12 is taken back by starting each sum at
 * -12 sum(q). E8M0 0 (2^-127) counts as 0 and 255 (NaN) as infinity; a non-finite input block gives NaN.
 * Quantized rows are laid out per chunk of 128 columns (4 blocks, one 64-byte packed weight load): the 64
 * even columns, then the 64 odd ones (the low and high nibbles), then per 32-bit lane of the integer sums
 * (8 columns) the correction -12 sum(q) and the scale d / 2.
 * ops/expert_mxfp4.py reference_int8 is the reference; moe.c quantizes each matrix's inputs with
 * q8_quantize_rows and multiplies them with q8_linear_rows (internal.h). */
#include "internal.h"

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

/* The chunk layout above, one row (internal.h). */
void q8_quantize_row(const float *x, int64_t I, uint8_t *dst, int plain) {
    const int64_t chunks = (I + 127) / 128;
    memset(dst, 0, (size_t)(chunks * Q8_CHUNK_BYTES));
    for (int64_t b = 0; b < I / 32; b++) {
        uint8_t *chunk = dst + (b / 4) * Q8_CHUNK_BYTES;
        if (plain) q8_block(x + b * 32, b, chunk);
        else Q8_BLOCK(x + b * 32, b, chunk);
    }
}

/* For the parity test: rows quantized by the vector blocks (plain 0) or the reference (plain 1). */
int moeswap_q8_quantize(const float *x, int64_t T, int64_t I, uint8_t *dst, int plain) {
    if (T < 0 || I < 32 || I % 32) return 1;
    q8_quantize_rows(x, T, I, dst, plain, 1);
    return 0;
}

#if Q8
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

/* As mxfp4_rows: 4 rows at a time up to 2 tokens, 2 rows above (32 vector registers), then the tail. */
#define Q8_TILE(TT_, R_) q8_tile(a, TT_, R_, I, packed, scale, o, y, O)
void q8_rows_of(q8_rows a, int TT, int64_t I, const uint8_t *packed, const uint8_t *scale, int64_t o,
                int64_t n, float *y, int64_t O) {
    const int64_t end = o + n, step = TT <= 2 ? 4 : 2;
    for (; o + step <= end; o += step) BY_TOKENS(Q8_TILE, 2, 4, 2)
    for (; o < end; o++) BY_TOKENS(Q8_TILE, 2, 1, 1)
}
#undef Q8_TILE
#endif

/* 1 when this build has the int8-activation MXFP4 path (AVX-512 VNNI), else 0. */
int moeswap_mxfp4_q8(void) { return Q8; }
