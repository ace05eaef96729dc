/* moe.c: the routed experts of a layer step in one call, MXFP4 (fp32 or int8 activations), bf16, block FP8
 * or INT4 (quant.c): moeswap_mxfp4_moe / moeswap_bf16_moe / moeswap_quant_moe from the caller's grouping, moeswap_moe_resident straight from the
 * router's output and a table of resident experts, moeswap_latent_moe_resident with K3's latent projections
 * around them. One call and two thread fork/joins per layer step; models/layers/moe.py is the reference.
 */
#include "internal.h"

#define MOE_CHUNK_ROWS 128 /* see moe() */

typedef struct { int32_t expert; int32_t chunk; } work_item;

/* (expert, chunk) for every chunk of every expert that has tokens; returns how many. */
static int64_t list_items(work_item *items, const int64_t *off, int E, int64_t chunks) {
    int64_t n = 0;
    for (int e = 0; e < E; e++)
        if (off[e + 1] > off[e])
            for (int64_t c = 0; c < chunks; c++) items[n++] = (work_item){e, (int32_t)c};
    return n;
}

/* The activations one phase of `moe` multiplies, per pair, in the form its weight format reads: fp32 rows in
 * `permuted` column order (MXFP4, bf16, INT4), in natural order (block FP8), or quantized rows (FORMAT_MXFP4_Q8). */
typedef struct { const float *f; q8_rows q; int64_t width; } pair_rows;

/* Row tokens[k] of x for each of the P pairs (tokens NULL: x already has one row per pair), in `format`'s
 * form (x: [T, I]); buf: fp32 [P, I] scratch for gathering. Returns the block to free (NULL if none) and
 * sets *ok = 0 when out of memory. */
static void *pair_inputs(int format, const float *x, int64_t T, int64_t I, const int64_t *tokens, int64_t P,
                         float *buf, pair_rows *out, int *ok, int nthreads) {
    *ok = 1;
    out->width = I;
    if (format == FORMAT_MXFP4_Q8) {
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
    float *xp = format == FORMAT_FP8 ? aligned_rows(x, P, I) : permuted(x, P, I);
    if (!xp) *ok = 0;
    out->f = xp;
    return xp;
}

/* Rows [o, o + n) of one expert matrix for the nt pairs from k0, in any of the weight formats (p: packed
 * MXFP4 with scale s, bf16 with s unused, block FP8 codes with fp32 scales, or INT4 words with bf16 scales). */
static void expert_rows(int format, pair_rows a, int64_t k0, int64_t nt, const void *p, const uint8_t *s, int64_t O,
                        int64_t o, int64_t n, float *y) {
    const int64_t I = a.width;
    if (format == FORMAT_BF16) bf16_rows(a.f + k0 * I, nt, I, (const uint16_t *)p, O, o, n, y);
    else if (format == FORMAT_MXFP4) linear_rows(a.f + k0 * I, nt, I, (const uint8_t *)p, s, O, o, n, y);
    else if (format == FORMAT_FP8 || format == FORMAT_INT4)
        quant_linear_rows(format == FORMAT_FP8, a.f + k0 * I, nt, I, (const uint8_t *)p, s, O, o, n, y);
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
 * (docs/benchmarks.md). The per-token sums run serially in pair order: deterministic. Returns 0,
 * 1 for bad sizes, 2 out of memory, 3 for MXFP4_Q8 in a build without it. */
static int moe(int format, const float *x, int64_t T, int64_t I, int64_t F, int E, const void *const *p1,
               const uint8_t *const *s1, const void *const *p3, const uint8_t *const *s3, const void *const *p2,
               const uint8_t *const *s2, const int64_t *off, const int64_t *tokens, const float *weight, int act,
               float b1, float b2, float *y, int nthreads) {
    if (format == FORMAT_MXFP4_Q8 && !Q8) return 3;
    if (format < FORMAT_MXFP4 || format > FORMAT_INT4) return 1;
    if ((format != FORMAT_BF16 && (I % 32 || F % 32)) || act < 0 || act >= ACTIVATIONS || E < 1 || off[0] != 0)
        return 1;
    mxfp4_tables();
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

/* q8: 0 computes in fp32, 1 quantizes the activations to int8 per block (FORMAT_MXFP4_Q8 above). */
int moeswap_mxfp4_moe(const float *x, int64_t T, int64_t I, int64_t F, int E, const uint8_t *const *p1,
                      const uint8_t *const *s1, const uint8_t *const *p3, const uint8_t *const *s3,
                      const uint8_t *const *p2, const uint8_t *const *s2, const int64_t *off, const int64_t *tokens,
                      const float *weight, int act, float b1, float b2, float *y, int nthreads, int q8) {
    return moe(q8 ? FORMAT_MXFP4_Q8 : FORMAT_MXFP4, x, T, I, F, E, (const void *const *)p1, s1,
               (const void *const *)p3, s3, (const void *const *)p2, s2, off, tokens, weight, act, b1, b2, y, nthreads);
}

/* The same for bf16 experts (w1, w3 [F, I], w2 [I, F] bf16; fp32 math). */
int moeswap_bf16_moe(const float *x, int64_t T, int64_t I, int64_t F, int E, const uint16_t *const *w1,
                     const uint16_t *const *w3, const uint16_t *const *w2, const int64_t *off, const int64_t *tokens,
                     const float *weight, int act, float b1, float b2, float *y, int nthreads) {
    return moe(FORMAT_BF16, x, T, I, F, E, (const void *const *)w1, NULL, (const void *const *)w3, NULL,
               (const void *const *)w2, NULL, off, tokens, weight, act, b1, b2, y, nthreads);
}

/* The same for block-FP8 (FORMAT_FP8: E4M3 codes [O, N] + fp32 scales per 128 x 128) or INT4 experts
 * (FORMAT_INT4: int32 words [O, N/8] + bf16 scales per 32), quant.c's math. */
int moeswap_quant_moe(int format, const float *x, int64_t T, int64_t I, int64_t F, int E, const void *const *p1,
                      const void *const *s1, const void *const *p3, const void *const *s3, const void *const *p2,
                      const void *const *s2, const int64_t *off, const int64_t *tokens, const float *weight, int act,
                      float b1, float b2, float *y, int nthreads) {
    if (format != FORMAT_FP8 && format != FORMAT_INT4) return 1;
    return moe(format, x, T, I, F, E, p1, (const uint8_t *const *)s1, p3, (const uint8_t *const *)s3, p2,
               (const uint8_t *const *)s2, off, tokens, weight, act, b1, b2, y, nthreads);
}

/* 0 when every one of the P chosen ids has a row in the table, 1 for an id out of range, 4 for one without. */
static int resident_ids(const int64_t *table, int64_t E_total, const int64_t *ids, int64_t P) {
    for (int64_t k = 0; k < P; k++) {
        if (ids[k] < 0 || ids[k] >= E_total) return 1;
        if (!table[ids[k] * TABLE_ROW]) return 4;
    }
    return 0;
}

/* A decode step's routed experts straight from the router's choice, for experts that stay resident:
 * table [E_total, TABLE_ROW] holds each expert's matrix pointers in moe()'s order (MXFP4: p1 s1 p3 s3 p2 s2;
 * bf16: w1 0 w3 0 w2 0; FP8 and INT4: codes and scales as MXFP4), a row of zeros where the caller has none;
 * ids, weight [T, K] are the router's
 * output. The pairs are grouped by expert, experts in id order and each one's tokens in order (as
 * models/layers/moe.py pairs_by_expert), then moe() runs them: the same call, the same sums. format: a FORMAT_
 * code (MXFP4_Q8: MXFP4 on int8 activations). *used: the distinct experts. Returns moe()'s status,
 * 1 for an id out of range, 4 when a chosen expert has no pointers (the caller takes the store's path). */

int moeswap_moe_resident(int format, const float *x, int64_t T, int64_t I, int64_t F, int64_t E_total,
                         const int64_t *table, const int64_t *ids, const float *weight, int64_t K, int act,
                         float b1, float b2, float *y, int nthreads, int64_t *used) {
    const int64_t P = T * K;
    if (T < 1 || K < 1 || E_total < 1 || format < FORMAT_MXFP4 || format > FORMAT_INT4) return 1;
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
        for (int m = 0; m < TABLE_ROW; m++) ptr[m * P + E] = (const void *)(intptr_t)table[e * TABLE_ROW + m];
        off[E + 1] = off[E] + at[e];
        at[e] = off[E]; /* from here: where this expert's next pair goes */
        E++;
    }
    for (int64_t k = 0; k < P; k++) { /* k = t K + slot: each expert's pairs come in token order */
        const int64_t slot = at[ids[k]]++;
        tokens[slot] = k / K;
        w[slot] = weight[k];
    }
    const int bf16 = format == FORMAT_BF16;
    const int status = moe(format, x, T, I, F, E, ptr, bf16 ? NULL : (const uint8_t *const *)(ptr + P),
                           ptr + 2 * P, bf16 ? NULL : (const uint8_t *const *)(ptr + 3 * P), ptr + 4 * P,
                           bf16 ? NULL : (const uint8_t *const *)(ptr + 5 * P), off, tokens, w, act, b1, b2, y,
                           nthreads);
    *used = E;
    free(at); free(off); free(tokens); free(w); free(ptr);
    return status;
}

/* K3's latent MoE for a decode step with resident experts (models/layers/moe.py MoE.forward, routed part):
 * h = x @ w_down^T (w_down [I, D] bf16), r = the experts of moeswap_moe_resident on h, r = rmsnorm(r; norm_w,
 * eps) when norm_w is given, y = r @ w_up^T (w_up [D, I] bf16), written to y [T, D]. The same functions as
 * the calls it replaces, so the same bits. Returns their status; 4 (y untouched) when a chosen expert has no
 * pointers in the table. */
int latent_moe(int bf16_in, int format, const float *x, int64_t T, int64_t D, const uint16_t *w_down,
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
