/* gemm_bf16.c: moeswap_bf16_gemm, the GEMM of training on frozen bf16 weights (weights/autograd.py's
 * frozen-experts node): c[M, N] (+)= a[M, K] @ op(W), a fp32 rows, W bf16 as stored, in either direction:
 * trans 1, W [N, K] (a Linear's [out, in]: the forward x W^T); trans 0, W [K, N] (the backward dy W). Each bf16
 * weight is widened exactly to fp32 and every product and sum is fp32, so no fp32 copy of W is ever made.
 *
 * How: the columns go in panels of NR; a panel of W is widened (and for trans 1 transposed) once into a
 * thread's fp32 buffer Bp[K][NR] (NR * K * 4 bytes, L1/L2-resident), then every tile of up to MR rows of a
 * runs a register-blocked outer product against it: per k, MR broadcasts of a[m][k] times NR/VL vectors of Bp.
 * That is a GEMM library's B packing, here also the widening the caller no longer does (torch's bf16 -> fp32
 * copy cost as much as a third of the products it fed).
 *
 * The order of the sums: each c[m][n] is one chain, s = (accumulate ? c[m][n] : 0), then s = fma(a[m][k],
 * W(k, n), s) for k = 0 .. K-1 in order, whatever the ISA (the portable path calls fmaf), the tile, the
 * panel, M or the thread count. So results are deterministic, batch-invariant, and identical across builds.
 * dx = dg W1 + du W3 as two calls (the second accumulating) is one chain over both.
 */
#include "internal.h"

#if defined(__AVX512F__)
#define VL 16
#define MR 12 /* rows per tile: 2 MR accumulators + 2 panel vectors + a broadcast of 32 registers */
typedef __m512 vf;
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VSET1 _mm512_set1_ps
#define VFMA _mm512_fmadd_ps
#define VZERO _mm512_setzero_ps
#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8
#define MR 6 /* 12 accumulators of 16 registers */
typedef __m256 vf;
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VSET1 _mm256_set1_ps
#define VFMA _mm256_fmadd_ps
#define VZERO _mm256_setzero_ps
#else
#define VL 8
#define MR 4
#endif
#define NR (2 * VL) /* columns per panel: two vectors */
#define UNROLL_MR _Pragma("GCC unroll 16") /* whole tiles and transposes, so they stay in registers */

/* Bp[k][c] = W(k, n0 + c) for c < nr, 0 past it (the tiles compute those columns and drop them). */
static void pack(const uint16_t *W, int trans, int64_t K, int64_t N, int64_t n0, int nr, float *Bp) {
    if (!trans) { /* W [K, N]: row k's nr weights from n0 are contiguous */
        for (int64_t k = 0; k < K; k++) {
            const uint16_t *src = W + k * N + n0;
            float *dst = Bp + k * NR;
            int c = 0;
#if defined(__AVX512F__)
            for (; c + 16 <= nr; c += 16) {
                const __m256i h = _mm256_loadu_si256((const __m256i *)(src + c));
                _mm512_storeu_ps(dst + c, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
            }
#elif defined(__AVX2__)
            for (; c + 8 <= nr; c += 8) {
                const __m128i h = _mm_loadu_si128((const __m128i *)(src + c));
                _mm256_storeu_ps(dst + c, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
            }
#endif
            for (; c < nr; c++) dst[c] = bf16_to_f32(src[c]);
            for (; c < NR; c++) dst[c] = 0.f;
        }
        return;
    }
    /* W [N, K]: column c of the panel is row n0 + c of W; transposed in 16 x 16 blocks (AVX-512) or 8 x 8 (AVX2) */
    int64_t k = 0;
#if defined(__AVX512F__)
    if (nr == NR)
        for (; k + 16 <= K; k += 16)
            for (int c0 = 0; c0 < NR; c0 += 16) {
                __m512 r[16], t[16];
                UNROLL_MR for (int i = 0; i < 16; i++) {
                    const __m256i h = _mm256_loadu_si256((const __m256i *)(W + (n0 + c0 + i) * K + k));
                    r[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                }
                /* r[i][j] = W(k + j, n0 + c0 + i) -> r'[j][i]: 32-bit, 64-bit, then 128-bit interleaves */
                UNROLL_MR for (int i = 0; i < 16; i += 2) {
                    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
                    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
                }
                UNROLL_MR for (int i = 0; i < 16; i += 4) {
                    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
                    const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
                    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
                    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
                    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
                    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
                }
                /* r[4g + q] now holds, in 128-bit lane L, column k + 4L + q of rows 4g .. 4g + 3 */
                UNROLL_MR for (int q = 0; q < 4; q++) {
                    /* lanes (0, 2) and (1, 3) of groups 0|1 and 2|3 */
                    const __m512 a02 = _mm512_shuffle_f32x4(r[q], r[4 + q], 0x88);
                    const __m512 a13 = _mm512_shuffle_f32x4(r[q], r[4 + q], 0xDD);
                    const __m512 b02 = _mm512_shuffle_f32x4(r[8 + q], r[12 + q], 0x88);
                    const __m512 b13 = _mm512_shuffle_f32x4(r[8 + q], r[12 + q], 0xDD);
                    t[q] = _mm512_shuffle_f32x4(a02, b02, 0x88);      /* lane 0: column k + q */
                    t[8 + q] = _mm512_shuffle_f32x4(a02, b02, 0xDD);  /* lane 2: k + 8 + q */
                    t[4 + q] = _mm512_shuffle_f32x4(a13, b13, 0x88);  /* lane 1: k + 4 + q */
                    t[12 + q] = _mm512_shuffle_f32x4(a13, b13, 0xDD); /* lane 3: k + 12 + q */
                }
                UNROLL_MR for (int j = 0; j < 16; j++) _mm512_storeu_ps(Bp + (k + j) * NR + c0, t[j]);
            }
#elif defined(__AVX2__)
    if (nr == NR)
        for (; k + 8 <= K; k += 8)
            for (int c0 = 0; c0 < NR; c0 += 8) {
                __m256 r[8], t[8];
                UNROLL_MR for (int i = 0; i < 8; i++) {
                    const __m128i h = _mm_loadu_si128((const __m128i *)(W + (n0 + c0 + i) * K + k));
                    r[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
                }
                /* 8 x 8: 32-bit interleaves, then 64-bit, then the 128-bit halves */
                UNROLL_MR for (int i = 0; i < 8; i += 2) {
                    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
                    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
                }
                UNROLL_MR for (int i = 0; i < 8; i += 4) { /* r[i + q]: columns k + q | k + 4 + q of rows i .. i + 3 */
                    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
                    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
                    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
                    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
                }
                UNROLL_MR for (int q = 0; q < 4; q++) {
                    _mm256_storeu_ps(Bp + (k + q) * NR + c0, _mm256_permute2f128_ps(r[q], r[4 + q], 0x20));
                    _mm256_storeu_ps(Bp + (k + 4 + q) * NR + c0, _mm256_permute2f128_ps(r[q], r[4 + q], 0x31));
                }
            }
#endif
    for (; k < K; k++) {
        float *dst = Bp + k * NR;
        int c = 0;
        for (; c < nr; c++) dst[c] = bf16_to_f32(W[(n0 + c) * K + k]);
        for (; c < NR; c++) dst[c] = 0.f;
    }
}

/* c rows [m0, m0 + R) x panel columns [0, NR) (+)= a @ Bp; R a compile-time constant after inlining. ldc: c's
 * row stride (N, or NR for a partial panel's scratch). */
INLINE void tile(const float *a, int64_t K, const float *Bp, float *c, int64_t ldc, int acc_in, const int R) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    vf s0[MR], s1[MR];
    UNROLL_MR for (int m = 0; m < R; m++) {
        s0[m] = acc_in ? VLOAD(c + m * ldc) : VZERO();
        s1[m] = acc_in ? VLOAD(c + m * ldc + VL) : VZERO();
    }
    for (int64_t k = 0; k < K; k++) {
        const vf b0 = VLOAD(Bp + k * NR), b1 = VLOAD(Bp + k * NR + VL);
        UNROLL_MR for (int m = 0; m < R; m++) {
            const vf x = VSET1(a[m * K + k]);
            s0[m] = VFMA(x, b0, s0[m]);
            s1[m] = VFMA(x, b1, s1[m]);
        }
    }
    UNROLL_MR for (int m = 0; m < R; m++) {
        VSTORE(c + m * ldc, s0[m]);
        VSTORE(c + m * ldc + VL, s1[m]);
    }
#else
    for (int m = 0; m < R; m++)
        for (int n = 0; n < NR; n++) {
            float s = acc_in ? c[m * ldc + n] : 0.f;
            for (int64_t k = 0; k < K; k++) s = fmaf(a[m * K + k], Bp[k * NR + n], s);
            c[m * ldc + n] = s;
        }
#endif
}

#define TILE_R(R_) tile(a, K, Bp, c, ldc, acc_in, R_)
static void tile_rows(const float *a, int64_t K, const float *Bp, float *c, int64_t ldc, int acc_in, int R) {
    switch (R) {
    case 1: TILE_R(1); break;
    case 2: TILE_R(2); break;
    case 3: TILE_R(3); break;
    case 4: TILE_R(4); break;
#if MR > 4
    case 5: TILE_R(5); break;
    case 6: TILE_R(6); break;
#endif
#if MR > 6
    case 7: TILE_R(7); break;
    case 8: TILE_R(8); break;
    case 9: TILE_R(9); break;
    case 10: TILE_R(10); break;
    case 11: TILE_R(11); break;
    case 12: TILE_R(12); break;
#endif
    default: break;
    }
}
#undef TILE_R

/* Panel p of c: pack it, then its tiles of MR rows (a partial panel through an NR-wide scratch tile). */
static void panel(const float *a, int64_t M, int64_t K, const uint16_t *W, int64_t N, int trans, int acc_in,
                  float *c, int64_t p, float *Bp) {
    const int64_t n0 = p * NR;
    const int nr = N - n0 < NR ? (int)(N - n0) : NR;
    pack(W, trans, K, N, n0, nr, Bp);
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int R = M - m0 < MR ? (int)(M - m0) : MR;
        if (nr == NR) {
            tile_rows(a + m0 * K, K, Bp, c + m0 * N + n0, N, acc_in, R);
            continue;
        }
        float scratch[MR * NR];
        for (int m = 0; acc_in && m < R; m++) memcpy(scratch + m * NR, c + (m0 + m) * N + n0, (size_t)nr * 4);
        tile_rows(a + m0 * K, K, Bp, scratch, NR, acc_in, R);
        for (int m = 0; m < R; m++) memcpy(c + (m0 + m) * N + n0, scratch + m * NR, (size_t)nr * 4);
    }
}

/* c[M, N] = a[M, K] @ op(W) (accumulate: c +=), op(W) = W^T for trans 1 (W [N, K]), W for trans 0 (W [K, N]);
 * all row-major and contiguous. Panels over threads (one pack buffer each); the sums' order above whatever
 * nthreads is. Returns 0, 1 for bad sizes, 2 out of memory. */
int moeswap_bf16_gemm(const float *a, int64_t M, int64_t K, const uint16_t *W, int64_t N, int trans, int accumulate,
                      float *c, int nthreads) {
    if (M < 0 || K < 0 || N < 0 || (trans != 0 && trans != 1) || (accumulate != 0 && accumulate != 1)) return 1;
    if (M == 0 || N == 0) return 0;
    if (K == 0) {
        if (!accumulate) memset(c, 0, (size_t)(M * N) * sizeof(float));
        return 0;
    }
    const int64_t panels = (N + NR - 1) / NR;
    /* one thread for small products: a parallel region costs a few us */
    const int nt = M * N * K < (1 << 18) ? 1 : (int)(nthreads < panels ? nthreads : panels);
    int failed = 0;
    #pragma omp parallel num_threads(nt > 0 ? nt : 1)
    {
        float *Bp = (float *)aligned_alloc(64, ((size_t)(K * NR) * sizeof(float) + 63) / 64 * 64);
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            if (Bp) {
                panel(a, M, K, W, N, trans, accumulate, c, p, Bp);
            } else {
                #pragma omp atomic write
                failed = 1;
            }
        }
        free(Bp);
    }
    return failed ? 2 : 0;
}
