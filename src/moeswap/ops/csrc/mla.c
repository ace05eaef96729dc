/* mla.c: Multi-head Latent Attention for one new token per sequence, in the absorbed form over the latent
 * cache (moeswap_mla_decode). models/layers/mla.py is the reference.
 */
#include "internal.h"

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
