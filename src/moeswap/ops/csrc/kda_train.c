/* kda_train.c: the Kimi Delta Attention recurrence for training, forward and backward, on the CPU
 * (ops/kda.py KDATokenRecurrence is the autograd Function; kda_recurrent the reference).
 *
 * N independent heads (batch x heads), T tokens each; q is already l2-normalised and scaled, k
 * normalised, g the log decay (<= 0) per key channel, beta per token. Per token, on the state S [K, V]:
 *   S' = diag(exp g_t) S_{t-1};  w = S'^T k;  u = beta (v - w);  S_t = S' + k u^T;  o_t = S_t^T q.
 * The forward keeps S at the start of every chunk of C tokens; the backward recomputes one chunk's
 * states from there (C K V floats a head, in L2) and runs the chain rule back through it:
 *   dq = S_t dO;  dS += q dO^T;  dk += dS u;  du = dS^T k;  dbeta = du.(v - w);  dv = beta du;
 *   dw = -beta du;  dS' = dS + k dw^T;  dk += S' dw;  dg = rowsum(dS' * S');  dS_{t-1} = diag(exp g) dS'.
 * The token recurrence does K V work per token and head, where the chunked form's pairwise decays cost
 * C K more under autograd: ~50x measured on this CPU (docs/train.md). One work item per head.
 * Layouts: q, k, g [N, T, K]; v, o [N, T, V]; beta [N, T]; states [N, K, V]; checkpoints [N, T/C+1, K, V].
 */
#include "internal.h"

/* One token forward on S (in place): returns o_t in `o`, and leaves w (S'^T k) and u in the buffers. */
static inline void kda_token(const float *q, const float *k, const float *v, const float *g, float beta, float *S,
                             float *o, float *w, float *u, int64_t K, int64_t V) {
    for (int64_t j = 0; j < V; j++) w[j] = 0.f;
    for (int64_t i = 0; i < K; i++) {
        const float a = expf(g[i]), ki = k[i];
        float *row = S + i * V;
        for (int64_t j = 0; j < V; j++) { row[j] *= a; w[j] += row[j] * ki; }
    }
    for (int64_t j = 0; j < V; j++) { u[j] = beta * (v[j] - w[j]); o[j] = 0.f; }
    for (int64_t i = 0; i < K; i++) {
        const float ki = k[i], qi = q[i];
        float *row = S + i * V;
        for (int64_t j = 0; j < V; j++) { row[j] += ki * u[j]; o[j] += row[j] * qi; }
    }
}

int moeswap_kda_train_forward(const float *q, const float *k, const float *v, const float *g, const float *beta,
                              const float *S0, float *o, float *S_end, float *checkpoints, int64_t N, int64_t T,
                              int64_t K, int64_t V, int64_t C, int nthreads) {
    if (N < 1 || T < 1 || K < 1 || V < 1 || V > 4096 || C < 1) return 1;
    const int64_t n_chunks = (T + C - 1) / C, KV = K * V;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float w[4096], u[4096];
        float *S = S_end + n * KV;
        memcpy(S, S0 + n * KV, KV * sizeof(float));
        for (int64_t t = 0; t < T; t++) {
            if (t % C == 0) memcpy(checkpoints + (n * (n_chunks + 1) + t / C) * KV, S, KV * sizeof(float));
            const int64_t nt = n * T + t;
            kda_token(q + nt * K, k + nt * K, v + nt * V, g + nt * K, beta[nt], S, o + nt * V, w, u, K, V);
        }
        memcpy(checkpoints + (n * (n_chunks + 1) + n_chunks) * KV, S, KV * sizeof(float));
    }
    return 0;
}

int moeswap_kda_train_backward(const float *q, const float *k, const float *v, const float *g, const float *beta,
                               const float *checkpoints, const float *d_o, const float *dS_end, float *dq, float *dk,
                               float *dv, float *dg, float *dbeta, float *dS0, int64_t N, int64_t T, int64_t K,
                               int64_t V, int64_t C, int nthreads) {
    if (N < 1 || T < 1 || K < 1 || V < 1 || V > 4096 || C < 1) return 1;
    const int64_t n_chunks = (T + C - 1) / C, KV = K * V;
    int failed = 0;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float w[4096], u[4096], du[4096], dw[4096], tmp[4096];
        float *prev = malloc((size_t)(C + 1) * KV * sizeof(float)); /* S_{t-1} of each token in the chunk */
        if (!prev) { failed = 1; continue; }
        float *dS = dS0 + n * KV;
        memcpy(dS, dS_end + n * KV, KV * sizeof(float));
        for (int64_t c = n_chunks - 1; c >= 0; c--) {
            const int64_t t0 = c * C, t1 = t0 + C < T ? t0 + C : T;
            memcpy(prev, checkpoints + (n * (n_chunks + 1) + c) * KV, KV * sizeof(float));
            for (int64_t t = t0; t < t1 - 1; t++) { /* the chunk's states, replayed */
                const int64_t nt = n * T + t;
                float *S = prev + (t - t0 + 1) * KV;
                memcpy(S, prev + (t - t0) * KV, KV * sizeof(float));
                kda_token(q + nt * K, k + nt * K, v + nt * V, g + nt * K, beta[nt], S, tmp, w, u, K, V);
            }
            for (int64_t t = t1 - 1; t >= t0; t--) {
                const int64_t nt = n * T + t;
                const float *Sp = prev + (t - t0) * KV; /* S_{t-1} */
                const float *qt = q + nt * K, *kt = k + nt * K, *vt = v + nt * V, *gt = g + nt * K, *dot = d_o + nt * V;
                const float b = beta[nt];
                float *dqt = dq + nt * K, *dkt = dk + nt * K, *dgt = dg + nt * K, *dvt = dv + nt * V;
                for (int64_t j = 0; j < V; j++) { w[j] = 0.f; du[j] = 0.f; }
                for (int64_t i = 0; i < K; i++) {
                    const float a = expf(gt[i]) * kt[i];
                    const float *row = Sp + i * V;
                    for (int64_t j = 0; j < V; j++) w[j] += row[j] * a;
                }
                for (int64_t j = 0; j < V; j++) u[j] = b * (vt[j] - w[j]);
                for (int64_t i = 0; i < K; i++) { /* through o = S_t^T q and S_t = S' + k u^T */
                    const float a = expf(gt[i]), ki = kt[i], qi = qt[i];
                    const float *row = Sp + i * V;
                    float *drow = dS + i * V;
                    float dqi = 0.f, dki = 0.f;
                    for (int64_t j = 0; j < V; j++) {
                        const float St = a * row[j] + ki * u[j];
                        dqi += St * dot[j];
                        drow[j] += qi * dot[j];
                        dki += drow[j] * u[j];
                        du[j] += drow[j] * ki;
                    }
                    dqt[i] = dqi;
                    dkt[i] = dki;
                }
                float db = 0.f;
                for (int64_t j = 0; j < V; j++) {
                    db += du[j] * (vt[j] - w[j]);
                    dvt[j] = b * du[j];
                    dw[j] = -b * du[j];
                }
                dbeta[nt] = db;
                for (int64_t i = 0; i < K; i++) { /* through w = S'^T k and S' = diag(exp g) S_{t-1} */
                    const float a = expf(gt[i]), ki = kt[i];
                    const float *row = Sp + i * V;
                    float *drow = dS + i * V;
                    float dki = 0.f, dgi = 0.f;
                    for (int64_t j = 0; j < V; j++) {
                        const float Sprime = a * row[j], dSp = drow[j] + ki * dw[j];
                        dki += Sprime * dw[j];
                        dgi += dSp * Sprime;
                        drow[j] = a * dSp;
                    }
                    dkt[i] += dki;
                    dgt[i] = dgi;
                }
            }
        }
        free(prev);
    }
    return failed ? 2 : 0;
}
