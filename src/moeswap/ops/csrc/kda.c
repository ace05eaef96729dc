/* kda.c: Kimi Delta Attention on the CPU: one token for N independent heads (moeswap_kda_decode), and a
 * KDA layer between its projections, conv, gates, recurrence and output norm (moeswap_kda_layer: a decode
 * token, or a prompt's token recurrence). ops/kda.py and models/layers/kda.py are the references.
 */
#include "internal.h"

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
