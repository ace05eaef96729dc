/* glue.c: the small kernels between a decode step's matmuls, which eager torch spent most of a batch-1 step
 * on: gated activations (moeswap_glu, and the experts' hidden rows through glu_span), RMSNorm, the block
 * attention residuals' mix, the MoE router and MLA's output gate; the torch code beside each caller
 * (ops/, models/layers/) is its reference.
 */
#include "internal.h"

/* Gated activations, for the experts' hidden rows (activate) and whole tensors (moeswap_glu): out = act(g, u),
 * ACT_SILU: silu(g) * u; ACT_SITU: b1 tanh(g/b1) sigmoid(g) * b2 tanh(u/b2). torch runs SiTU as nine
 * passes over memory (docs/benchmarks.md); this is one. exp is Cody-Waite range reduction
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

/* One loop per act: with the choice inside, the vectorized loop computed both (SiTU's three exps and
 * divisions for SiLU too: docs/benchmarks.md). The same per-element math either way. */
void glu_span(const float *g, const float *u, float *out, int64_t n, int act, float b1, float b2) {
    if (act == ACT_SILU) {
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            const float gv = g[i], uv = u[i];
            const float y = gv * act_sigmoid(gv) * uv;
            out[i] = gv != gv || uv != uv ? gv + uv : y;
        }
        return;
    }
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float gv = g[i], uv = u[i];
        const float y = (b1 * act_tanh(gv / b1) * act_sigmoid(gv)) * (b2 * act_tanh(uv / b2));
        out[i] = gv != gv || uv != uv ? gv + uv : y;
    }
}

/* out[i] = act(g[i], u[i]) for n elements (out may be g). Returns 0, or 1 for a bad act or size. */
int moeswap_glu(const float *g, const float *u, float *out, int64_t n, int act, float b1, float b2, int nthreads) {
    if (n < 0 || (act < 0 || act >= ACTIVATIONS)) return 1;
    const int64_t span = 16384;  /* 64 KB of g per work item */
    const int64_t spans = (n + span - 1) / span;
    #pragma omp parallel for num_threads(spans > 1 ? nthreads : 1) schedule(static)
    for (int64_t s = 0; s < spans; s++) {
        const int64_t o = s * span;
        glu_span(g + o, u + o, out + o, n - o < span ? n - o : span, act, b1, b2);
    }
    return 0;
}

/* The gradient of moeswap_glu for training: from dout, the gate's and the up half's gradients (dg, du),
 * recomputing the activation's parts from g and u instead of keeping them. silu: dg = dout u s (1 + g (1 - s)),
 * du = dout g s with s = sigmoid(g); SiTU with A = b1 tanh(g/b1) s, B = b2 tanh(u/b2):
 * dg = dout B ((1 - tanh^2(g/b1)) s + A (1 - s)), du = dout A (1 - tanh^2(u/b2)). */
int moeswap_glu_backward(const float *g, const float *u, const float *dout, float *dg, float *du, int64_t n, int act,
                         float b1, float b2, int nthreads) {
    if (n < 0 || (act < 0 || act >= ACTIVATIONS)) return 1;
    const int64_t span = 16384;
    const int64_t spans = (n + span - 1) / span;
    #pragma omp parallel for num_threads(spans > 1 ? nthreads : 1) schedule(static)
    for (int64_t sp = 0; sp < spans; sp++) {
        const int64_t o = sp * span, m = n - o < span ? n - o : span;
        if (act == ACT_SILU) { /* one loop per act, as glu_span */
            #pragma omp simd
            for (int64_t i = o; i < o + m; i++) {
                const float gv = g[i], uv = u[i], d = dout[i], s = act_sigmoid(gv);
                const float silu = gv * s;
                dg[i] = d * uv * s * (1.0f + gv * (1.0f - s));
                du[i] = d * silu;
            }
        } else {
            #pragma omp simd
            for (int64_t i = o; i < o + m; i++) {
                const float gv = g[i], uv = u[i], d = dout[i], s = act_sigmoid(gv);
                const float tg = act_tanh(gv / b1), tu = act_tanh(uv / b2);
                const float A = b1 * tg * s, B = b2 * tu;
                dg[i] = d * B * ((1.0f - tg * tg) * s + A * (1.0f - s));
                du[i] = d * A * (1.0f - tu * tu);
            }
        }
    }
    return 0;
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
 * [E, D]; scores = sigmoid(logits) (softmax over E when `softmax`); choice = scores + bias (bias steers the
 * choice only); with G > 1 expert groups (DeepSeek-V3), only the topk_group groups with the highest sums of
 * their two best choices stay eligible (ties to the lower group); the K experts of highest choice (ties to
 * the lower id) in descending order; their scores, divided by their sum (+1e-20) when `renorm`, times
 * `scale`. ids int64 [T, K], w fp32 [T, K]. */
int moeswap_route(const float *x, int64_t T, int64_t D, const float *W, int64_t E, const float *bias, int64_t K,
                  int softmax, int renorm, float scale, int64_t G, int64_t topk_group, int64_t *ids, float *w,
                  int nthreads) {
    if (T < 0 || D < 1 || E < 1 || E > 4096 || K < 1 || K > E || G < 1 || E % G || (G > 1 && E / G < 2)
        || topk_group < 1 || topk_group > G || (G > 1 && K > topk_group * (E / G)))
        return 1;
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
        if (G > 1) { /* group-limited: the other groups' experts drop out of the choice */
            const int64_t per = E / G;
            float gscore[4096];
            int keep[4096];
            for (int64_t g = 0; g < G; g++) {
                float a = -INFINITY, b = -INFINITY; /* the group's best two */
                for (int64_t e = g * per; e < (g + 1) * per; e++) {
                    if (choice[e] > a) { b = a; a = choice[e]; }
                    else if (choice[e] > b) b = choice[e];
                }
                gscore[g] = a + b;
                keep[g] = 0;
            }
            for (int64_t j = 0; j < topk_group; j++) {
                int64_t best = -1;
                for (int64_t g = 0; g < G; g++)
                    if (!keep[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
                keep[best] = 1;
            }
            for (int64_t e = 0; e < E; e++)
                if (!keep[e / per]) choice[e] = -INFINITY;
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

/* x[n, j] *= sigmoid(g[n * g_stride + j]) for n < rows, j < width (MLA's output gate, fp32). */
int moeswap_sigmoid_gate(float *x, const float *g, int64_t rows, int64_t width, int64_t g_stride) {
    if (rows < 0 || width < 0 || g_stride < width) return 1;
    for (int64_t n = 0; n < rows; n++)
        for (int64_t j = 0; j < width; j++) x[n * width + j] *= sigmoid_f32(g[n * g_stride + j]);
    return 0;
}
