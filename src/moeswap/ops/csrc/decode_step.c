/* decode_step.c: a decode step's decoder layers in one call (moeswap_decode_layers; engine/native_step.py
 * builds the table of decode_layer rows, cpu_kernels.h lists their fields). models/decoder.py
 * DecoderModel.forward is the reference: this runs the kernels its eager CPU path calls, in the same order on
 * the same values (so the same bits), in one call instead of ~12 Python-driven kernel calls per layer.
 * One token per sequence, N rows.
 */
#include <stddef.h>
#include <time.h>

#include "expert_read.h"
#include "internal.h"

/* Rows of width w from column `from` of src [N, stride] into dst [N, w]. */
static void take_columns(const float *src, int64_t N, int64_t stride, int64_t from, int64_t w, float *dst) {
    for (int64_t n = 0; n < N; n++) memcpy(dst + n * w, src + n * stride + from, (size_t)w * sizeof(float));
}

/* y [T, O] = x [T, I] @ W^T for one of a layer's weights: codes with their scales s in the layer's dense_format
 * (block FP8 or INT4: csrc/quant.c; INT8: csrc/int8.c; fp32 inputs under either GEMM precision, as the kept
 * methods of weights/fp8_block.py, weights/int4.py and weights/int8.py compute them), else bf16. */
static int weight_linear(int bf16_in, const decode_layer *l, const float *x, int64_t T, int64_t I, const void *W,
                         const void *s, int64_t O, float *y, int nt) {
    if (s && l->dense_format == FORMAT_INT8) return moeswap_int8_linear(x, T, I, (const int8_t *)W, s, O, y, nt);
    if (s) return moeswap_quant_linear((int)l->dense_format, x, T, I, W, s, O, y, nt);
    return dense_linear(bf16_in, x, T, I, (const uint16_t *)W, O, y, nt);
}

/* The layer's gated MLP (dense, or the shared experts) on x [T, D] into y [T, D]. Block-FP8 weights (both set:
 * engine/native_step.py): gate|up in one product (each row summed as alone), act(gate) * up, down: the products
 * and the C activation that models/layers/basic.py GatedMLP runs for them, so the same bits. */
static int layer_mlp(int bf16_in, const decode_layer *l, const float *x, int64_t T, int64_t D, int act, float b1,
                     float b2, float *y, int nt) {
    const int64_t H = l->hidden;
    if (!l->s_gu) return gated_mlp(bf16_in, x, T, D, l->w_gu, H, l->w_down, act, b1, b2, y, nt);
    float *gu = (float *)malloc((size_t)(T * 3 * H) * sizeof(float) + 64);
    if (!gu) return 2;
    float *h = gu + T * 2 * H;
    int status = weight_linear(bf16_in, l, x, T, D, l->w_gu, l->s_gu, 2 * H, gu, nt);
    for (int64_t t = 0; !status && t < T; t++) glu_span(gu + t * 2 * H, gu + t * 2 * H + H, h + t * H, H, act, b1, b2);
    if (!status) status = weight_linear(bf16_in, l, h, T, H, l->w_down, l->s_down, D, y, nt);
    free(gu);
    return status;
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
    if (!status) status = weight_linear(bf16_in, l, y, N, C, l->w_o, l->s_o, D, out, nt);
    free(buf);
    return status;
}

/* x [R] turned by the angles whose cos/sin [R/2] are given (models/layers/rope.py Rotary.rotate): pairs
 * (2i, 2i+1) interleaved, else (i, i + R/2). Products and sums rounded one at a time, as torch's ops do (the
 * build is ISO C: no contraction into FMAs), so the same bits. */
static void rotate(float *x, const float *cs, const float *sn, int64_t R, int interleave) {
    const int64_t F = R / 2;
    for (int64_t i = 0; i < F; i++) {
        float *a = interleave ? x + 2 * i : x + i, *b = interleave ? x + 2 * i + 1 : x + F + i;
        const float x1 = *a, x2 = *b, p = x1 * cs[i], q = x2 * sn[i], r = x2 * cs[i], s = x1 * sn[i];
        *a = p - q;
        *b = r + s;
    }
}

/* An MLA layer for one token per sequence: appends [kv_norm(c) | k_r] at lengths[n] (then lengths[n] += 1)
 * in latent [N, cap, L + R], attends, gates, o_proj into out [N, D]. With RoPE, q's and k_r's R dims are
 * turned by the row's angles first (k_r before it is cached). */
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
        if (!status) status = weight_linear(bf16_in, l, qa, N, l->q_rank, l->w_qb, l->s_qb, Q, q, nt);
    } else {
        take_columns(proj, N, P, l->off[0], Q, q);
    }
    take_columns(proj, N, P, l->off[1], X, kv);
    if (!status && l->rope_cos) {
        const int64_t F = l->R / 2, NR = l->N + l->R;
        for (int64_t n = 0; n < N; n++) {
            const float *cs = l->rope_cos + n * F, *sn = l->rope_sin + n * F;
            for (int64_t h = 0; h < H; h++) rotate(q + n * Q + h * NR + l->N, cs, sn, l->R, (int)l->rope_interleave);
            rotate(kv + n * X + l->L, cs, sn, l->R, (int)l->rope_interleave);
        }
    }
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
    if (!status) status = weight_linear(bf16_in, l, att, N, HV, l->w_o, l->s_o, D, out, nt);
    free(buf);
    return status;
}

/* ---- in-call expert loads (cpu_kernels.h's load_* fields; experts/incall.py sets them up and books them) ----
 * A layer step's experts missing from its table are read here, in ascending expert order (as the store's
 * fetch takes them), each after evicting the offered victims it needs room from: the coldest first, passing
 * over any expert this call has used (routed to), which the store's policy would have made recent. With a
 * reader (LS_READER) and `guess`, each MoE layer also routes the next one on its input and reads ahead what
 * that guess lacks on the reader threads, to be put in the table when that layer routes (ahead_*). */
/* LS_ROOM, ...: load_state's slots; V_LAYER, ...: a load_victims entry's columns, VICTIM of them; G_LAYER, ...: a
 * load_log entry's, LOG of them; KIND_LOAD, ...: a log entry's kinds (all as cpu_kernels.h lists them). */
#define LOAD_SLOT(name) LS_##name,
#define VICTIM_COLUMN(name) V_##name,
#define LOG_COLUMN(name) G_##name,
#define LOAD_KIND(name) KIND_##name,
enum { MOESWAP_LOAD_STATE(LOAD_SLOT) LS_SLOTS };
enum { MOESWAP_LOAD_VICTIM(VICTIM_COLUMN) VICTIM };
enum { MOESWAP_LOAD_LOG(LOG_COLUMN) LOG };
enum { MOESWAP_LOAD_KINDS(LOAD_KIND) LOAD_KINDS };
#undef LOAD_SLOT
#undef VICTIM_COLUMN
#undef LOG_COLUMN
#undef LOAD_KIND

typedef void (*reads_submit_fn)(void *reads, msw_job *job, int urgent);
typedef void (*reads_wait_fn)(void *reads, msw_job *job);

/* Marks the offered victims of `layer` among ids [n] as used by this call (never evicted by it). */
static void mark_used(const decode_layer *l, int64_t layer, const int64_t *ids, int64_t n) {
    int64_t *v = l->load_victims;
    for (int64_t j = 0; j < l->load_state[LS_VICTIMS]; j++)
        if (v[VICTIM * j + V_LAYER] == layer && v[VICTIM * j + V_STATE] == 0)
            for (int64_t k = 0; k < n; k++)
                if (ids[k] == v[VICTIM * j + V_EXPERT]) { v[VICTIM * j + V_STATE] = 1; break; }
}

/* The distinct ids [n] ascending into out; returns how many. */
static int64_t sorted_unique(const int64_t *ids, int64_t n, int64_t *out) {
    int64_t m = 0;
    for (int64_t k = 0; k < n; k++) {
        int64_t j = m, e = ids[k];
        while (j > 0 && out[j - 1] > e) j--;
        if (j > 0 && out[j - 1] == e) continue;
        memmove(out + j + 1, out + j, (size_t)(m - j) * sizeof(int64_t));
        out[j] = e;
        m++;
    }
    return m;
}

/* Where the load_state counters stand while a layer's loads are planned (committed only when they happen). */
typedef struct { int64_t room, free_n, next, n_log; } load_cursor;

/* Room and a buffer for one expert of layer l: evicts offered victims (with apply: rows cleared, evictions
 * logged) until it fits, then takes the buffer of the first evicted victim the store marked as held by
 * nothing else (*b = -3 - its index: the store gives its weights object, views of that buffer, to the new
 * expert), else a free buffer (*b its index; -2 where the store keeps nothing), and reserves the load's log
 * entry (*slot). Returns 0, or 4 where the victims, buffers or log run out. */
static int room_for(const decode_layer *layers, const decode_layer *l, load_cursor *c, int apply,
                    unsigned char **dst, int64_t *b, int64_t *slot) {
    int64_t *st = l->load_state, *v = l->load_victims, *log = l->load_log;
    const int keep = st[LS_KEEP] != 0;
    int64_t reuse = -1;
    while (keep && c->room < l->load_cost) {
        while (c->next < st[LS_VICTIMS] && v[VICTIM * c->next + V_STATE]) c->next++;
        if (c->next >= st[LS_VICTIMS] || c->n_log >= st[LS_LOG_CAP]) return 4;
        int64_t *gone = v + VICTIM * c->next;
        if (apply) {
            int64_t *rows = (int64_t *)layers[gone[V_LAYER]].table;
            if (rows) memset(rows + TABLE_ROW * gone[V_EXPERT], 0, TABLE_ROW * sizeof(int64_t));
            gone[V_STATE] = 2;
            int64_t *entry = log + LOG * c->n_log;
            entry[G_LAYER] = gone[V_LAYER], entry[G_EXPERT] = gone[V_EXPERT], entry[G_BUFFER] = -1;
            entry[G_KIND] = KIND_LOAD;
        }
        if (reuse < 0 && gone[V_BUFFER]) reuse = c->next;
        c->room += gone[V_COST];
        c->n_log++, c->next++;
    }
    if ((reuse < 0 && !c->free_n) || c->n_log >= st[LS_LOG_CAP]) return 4;
    if (reuse >= 0) {
        *dst = (unsigned char *)(intptr_t)v[VICTIM * reuse + V_BUFFER];
        *b = -3 - reuse;
    } else {
        c->free_n--;
        *dst = (unsigned char *)(intptr_t)l->load_buffers[c->free_n];
        *b = keep ? c->free_n : -2;
    }
    c->room -= l->load_cost;
    *slot = c->n_log++;
    return 0;
}

/* A job reading expert e of layer l into dst, from the layer's template. */
static msw_job expert_job(const decode_layer *l, int64_t e, unsigned char *dst) {
    msw_job job = *(const msw_job *)l->load_job;
    job.fd = l->load_at[2 * e], job.offset = l->load_at[2 * e + 1], job.dst = dst;
    return job;
}

/* Writes expert e's table row for its bytes at dst and logs the load in the slot reserved for it. */
static void loaded(const decode_layer *l, int64_t layer, int64_t e, const unsigned char *dst, int64_t b,
                   int64_t slot, int64_t kind) {
    int64_t *table = (int64_t *)l->table; /* the store's table, which the store writes the same way */
    for (int j = 0; j < TABLE_ROW; j++)
        table[TABLE_ROW * e + j] = l->load_row[j] < 0 ? 0 : (int64_t)(intptr_t)(dst + l->load_row[j]);
    int64_t *entry = l->load_log + LOG * slot;
    entry[G_LAYER] = layer, entry[G_EXPERT] = e, entry[G_BUFFER] = b, entry[G_KIND] = kind;
}

/* Layer `layer`'s missing experts among its step's distinct ids [m]: with apply 0, whether the offered
 * victims, free buffers and log can take them all (nothing changes); with apply 1, the evictions and reads.
 * A store that keeps nothing (LS_KEEP 0) evicts nothing: its loads are logged with buffer -2 and given back
 * after the layer (ffn_block). Returns 0, or 4: the caller stops there and the store loads them (it also
 * names a read that fails or a bad scale byte). */
static int load_missing(const decode_layer *layers, int64_t layer, const int64_t *ids, int64_t m, int apply) {
    const decode_layer *l = layers + layer;
    int64_t *st = l->load_state;
    const int64_t *table = l->table;
    load_cursor c = {st[LS_ROOM], st[LS_FREE], st[LS_NEXT], st[LS_LOG]};
    for (int64_t k = 0; k < m; k++) {
        const int64_t e = ids[k];
        if (table[TABLE_ROW * e]) continue;
        unsigned char *dst;
        int64_t b, slot;
        if (room_for(layers, l, &c, apply, &dst, &b, &slot)) return 4;
        if (!apply) continue;
        msw_job job = expert_job(l, e, dst);
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        int error = msw_read_and_check(&job);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        st[LS_READ_NS] += (int64_t)(t1.tv_sec - t0.tv_sec) * 1000000000 + (t1.tv_nsec - t0.tv_nsec);
        if (error || job.bad) { /* a free buffer goes back; the evictions so far stand (logged) */
            st[LS_ROOM] = c.room + l->load_cost, st[LS_NEXT] = c.next, st[LS_LOG] = slot;
            return 4;
        }
        loaded(l, layer, e, dst, b, slot, KIND_LOAD);
        st[LS_ROOM] = c.room, st[LS_FREE] = c.free_n, st[LS_NEXT] = c.next, st[LS_LOG] = c.n_log;
    }
    return 0;
}

/* Reads ahead: layer `next`'s experts guessed from `ids` [n] (its router on this layer's input) that its table
 * lacks go to the reader threads now, each with its room and buffer as a load takes them, so their reads overlap
 * this layer's experts and the next attention; the guessed experts the tier holds are kept through the call. */
static void ahead_start(const decode_layer *layers, int64_t next, const int64_t *ids, int64_t n) {
    const decode_layer *l = layers + next;
    int64_t *st = l->load_state;
    if (!st || !st[LS_READER] || !l->load_at || !l->table || !st[LS_KEEP] || st[LS_AHEAD]) return;
    int64_t *guess = (int64_t *)(intptr_t)st[LS_GUESS], *ahead = (int64_t *)(intptr_t)st[LS_AHEAD_IDS];
    msw_job *jobs = (msw_job *)(intptr_t)st[LS_JOBS];
    const int64_t m = sorted_unique(ids, n, guess);
    st[LS_N_GUESS] = m, st[LS_AHEAD_LAYER] = next;
    mark_used(l, next, guess, m);
    load_cursor c = {st[LS_ROOM], st[LS_FREE], st[LS_NEXT], st[LS_LOG]};
    int64_t count = 0;
    for (int64_t k = 0; k < m && count < st[LS_NJOBS]; k++) {
        const int64_t e = guess[k];
        if (l->table[TABLE_ROW * e]) continue;
        unsigned char *dst;
        int64_t b, slot;
        if (room_for(layers, l, &c, 1, &dst, &b, &slot)) break;
        jobs[count] = expert_job(l, e, dst);
        ahead[3 * count] = e, ahead[3 * count + 1] = b, ahead[3 * count + 2] = slot;
        ((reads_submit_fn)(intptr_t)st[LS_SUBMIT])((void *)(intptr_t)st[LS_READER], jobs + count, 0);
        count++;
        st[LS_ROOM] = c.room, st[LS_FREE] = c.free_n, st[LS_NEXT] = c.next, st[LS_LOG] = c.n_log;
    }
    st[LS_AHEAD] = count;
}

/* The reads ahead for layer `layer`, waited for: good ones go in its table (logged as read ahead), a failed
 * or bad one is logged as such (its expert is loaded, or its problem named, when the layer asks for it). */
static void ahead_take(const decode_layer *layers, int64_t layer) {
    const decode_layer *l = layers + layer;
    int64_t *st = l->load_state;
    if (!st || !st[LS_AHEAD] || st[LS_AHEAD_LAYER] != layer) return;
    const int64_t *ahead = (const int64_t *)(intptr_t)st[LS_AHEAD_IDS];
    msw_job *jobs = (msw_job *)(intptr_t)st[LS_JOBS];
    for (int64_t j = 0; j < st[LS_AHEAD]; j++) {
        ((reads_wait_fn)(intptr_t)st[LS_WAIT])((void *)(intptr_t)st[LS_READER], jobs + j);
        const int64_t e = ahead[3 * j], b = ahead[3 * j + 1], slot = ahead[3 * j + 2];
        if (!jobs[j].error && !jobs[j].bad) {
            loaded(l, layer, e, jobs[j].dst, b, slot, KIND_AHEAD);
        } else {
            int64_t *entry = l->load_log + LOG * slot;
            entry[G_LAYER] = layer, entry[G_EXPERT] = e, entry[G_BUFFER] = b, entry[G_KIND] = KIND_AHEAD_BAD;
        }
    }
    st[LS_AHEAD] = 0;
}

/* The guess for layer `layer` against the experts it routed to (distinct ids [m]): the store's prefetch counts. */
static void ahead_score(const decode_layer *l, int64_t layer, const int64_t *ids, int64_t m) {
    int64_t *st = l->load_state;
    if (!st || !st[LS_READER] || st[LS_AHEAD_LAYER] != layer || !st[LS_N_GUESS]) return;
    const int64_t *guess = (const int64_t *)(intptr_t)st[LS_GUESS];
    int64_t correct = 0;
    for (int64_t i = 0, j = 0; i < st[LS_N_GUESS] && j < m;) {
        if (guess[i] == ids[j]) correct++, i++, j++;
        else if (guess[i] < ids[j]) i++;
        else j++;
    }
    st[LS_PREDICTED] += st[LS_N_GUESS], st[LS_ACTUAL] += m, st[LS_CORRECT] += correct;
    st[LS_N_GUESS] = 0;
}

static int next_guess(const decode_layer *next, const float *h, int64_t N, int64_t D, float eps, float *xn, int nt);

/* The FFN of layer `layer` on its normalised input xn [N, D] (h: before the norm) into out [N, D]: the dense
 * MLP, or the MoE block (router, routed experts from the resident table, shared experts added; with `guess`,
 * the next layer's reads ahead started on h, scratch [N, D] its norm). Returns 4, out untouched, when the
 * layer is marked `stop` or a chosen expert is not in the table and cannot be loaded here: the caller runs
 * this FFN through the expert store. */
static int ffn_block(int bf16_in, const decode_layer *layers, int64_t n_layers, int64_t layer, const float *h,
                     const float *xn, int64_t N, int64_t D, float eps, int act, float b1, float b2, float *out,
                     float *scratch, int guess, int nt, int64_t *used) {
    const decode_layer *l = layers + layer;
    *used = 0;
    ahead_take(layers, layer);
    if (l->stop) return 4;
    if (!l->moe) return layer_mlp(bf16_in, l, xn, N, D, act, b1, b2, out, nt);
    int64_t *ids = (int64_t *)malloc((size_t)(N * l->topk) * sizeof(int64_t) + 64);
    float *w = (float *)malloc((size_t)(N * l->topk) * sizeof(float) + 64);
    float *routed = (float *)calloc((size_t)(N * D), sizeof(float));
    float *shared = (float *)malloc((size_t)(N * D) * sizeof(float) + 64);
    int status = ids && w && routed && shared ? 0 : 2;
    if (!status)
        status = moeswap_route(xn, N, D, l->router, l->E, l->router_bias, l->topk, (int)l->softmax, (int)l->renorm,
                               (float)l->route_scale, l->groups, l->topk_group, ids, w, nt);
    if (!status && l->chosen) memcpy(l->chosen, ids, (size_t)(N * l->topk) * sizeof(int64_t));
    int64_t *distinct = NULL, m = 0, free_before = 0, log_before = 0; /* for in-call loads */
    if (!status && l->load_state) {
        mark_used(l, layer, ids, N * l->topk);
        distinct = (int64_t *)malloc((size_t)(N * l->topk) * sizeof(int64_t) + 64);
        if (!distinct) status = 2;
        else {
            m = sorted_unique(ids, N * l->topk, distinct);
            ahead_score(l, layer, distinct, m);
            free_before = l->load_state[LS_FREE], log_before = l->load_state[LS_LOG];
            status = l->load_at ? load_missing(layers, layer, distinct, m, 0) : 0;
            if (!status && l->load_at) status = load_missing(layers, layer, distinct, m, 1);
        }
        const decode_layer *next = layer + 1 < n_layers ? l + 1 : NULL;
        if (!status && guess && next && next->moe && next->router && next->chosen && next->load_state
            && next->load_state[LS_READER]) {
            status = next_guess(next, h, N, D, eps, scratch, nt);
            if (!status) ahead_start(layers, layer + 1, next->chosen, N * next->topk);
        }
    }
    if (!status && l->lat_down)
        status = latent_moe(bf16_in, (int)l->format, xn, N, D, l->lat_down, l->lat_dim, l->lat_norm, eps, l->lat_up,
                            l->F, l->E, l->table, ids, w, l->topk, act, b1, b2, routed, nt, used);
    else if (!status)
        status = moeswap_moe_resident((int)l->format, xn, N, D, l->F, l->E, l->table, ids, w, l->topk, act, b1, b2,
                                      routed, nt, used);
    if (distinct && !l->load_state[LS_KEEP]) { /* a store that keeps nothing: this layer's loads given back */
        const int64_t *log = l->load_log;
        for (int64_t j = log_before; j < l->load_state[LS_LOG]; j++)
            if (log[LOG * j + G_BUFFER] == -2)
                memset((int64_t *)l->table + TABLE_ROW * log[LOG * j + G_EXPERT], 0, TABLE_ROW * sizeof(int64_t));
        l->load_state[LS_FREE] = free_before;
    }
    free(distinct);
    if (!status && l->w_gu)
        status = layer_mlp(bf16_in, l, xn, N, D, act, b1, b2, shared, nt);
    if (!status)
        for (int64_t j = 0; j < N * D; j++) out[j] = l->w_gu ? routed[j] + shared[j] : routed[j];
    free(ids); free(w); free(routed); free(shared);
    return status;
}

/* The router of MoE layer `next` on h [N, D] normalised by next's ln_post (xn: scratch [N, D]), into next->chosen:
 * what DecoderModel's expert lookahead computes from the same h. */
static int next_guess(const decode_layer *next, const float *h, int64_t N, int64_t D, float eps, float *xn, int nt) {
    float *w = (float *)malloc((size_t)(N * next->topk) * sizeof(float) + 64);
    if (!w) return 2;
    int status = moeswap_rms_norm(h, N, D, next->ln_post, eps, xn, nt);
    if (!status)
        status = moeswap_route(xn, N, D, next->router, next->E, next->router_bias, next->topk, (int)next->softmax,
                               (int)next->renorm, (float)next->route_scale, next->groups, next->topk_group,
                               next->chosen, w, nt);
    free(w);
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

/* Layers [first, n_layers) of a decode step (DecoderModel._forward's loop, then its final AttnRes mix when
 * score_out is given) on the running sum partial [N, D] (in place), for N sequences of one token each.
 * state [n_layers, 3]: KDA (conv, S, 0) or MLA (latent, lengths, capacity) base pointers of rows 0..N-1.
 * bank [max_bank, N, D] with *n_bank of its rows in use (in and out). used[i]: the distinct experts layer i
 * ran. With final_norm and head (bf16 [V, D]) given, once every layer has run the step ends as the model's
 * does: logits [N, V] = rmsnorm(partial; final_norm, eps) @ head^T.
 * Returns 0; 4 when layer *stopped is marked `stop` or its experts are not all resident: its attention is
 * done, m_out [N, D] holds its FFN input before the norm, and the caller runs that FFN (and whatever the
 * model does there, such as an expert lookahead) and resumes at *stopped + 1, or calls again with
 * first = *stopped, ffn_first = 1 and m_out as it was to run that FFN here (its experts now in the table).
 * Each MoE layer whose `chosen` is set gets its router's ids there. With `guess`, a stop also writes into the
 * next layer's `chosen` (an MoE layer with a router) its router's ids on this FFN input, normalised by its
 * ln_post: the expert lookahead's guess (experts/prefetch.py NextLayerLookahead computes the same from m_out),
 * overwritten when that layer routes. Else 1 bad sizes, 2 out of memory (the step's state is then not to be
 * trusted). */
int moeswap_decode_layers(const decode_layer *layers, int64_t n_layers, int64_t first, const int64_t *state,
                          float *partial, float *bank, int64_t max_bank, int64_t *n_bank, float *m_out,
                          const float *score_out, const float *final_norm, const uint16_t *head, int64_t V,
                          float *logits, int64_t N, int64_t D, float eps, float l2_eps, int act, float b1, float b2,
                          int64_t *used, int64_t *stopped, int64_t ffn_first, int guess, int bf16_in,
                          int nt) {
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
        if (ffn_first && i == first) { /* resumed at the FFN the last call stopped before */
            memcpy(h, m_out, (size_t)(N * D) * sizeof(float));
        } else {
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
            if (!status) status = weight_linear(bf16_in, l, xn, N, D, l->w_in, l->s_in, l->in_rows, proj, nt);
            if (!status)
                status = l->mla ? mla_block(bf16_in, l, (float *)(intptr_t)st[0], (int64_t *)(intptr_t)st[1], st[2],
                                            proj, N, eps, y, D, nt)
                                : kda_block(bf16_in, l, (float *)(intptr_t)st[0], (float *)(intptr_t)st[1], proj, N,
                                            eps, l2_eps, y, D, nt);
            for (int64_t j = 0; !status && j < N * D; j++) partial[j] += y[j];
            if (!status) status = mixed(l->score_ffn, bank, *n_bank, partial, N, D, eps, h, nt);
        }
        if (!status) status = moeswap_rms_norm(h, N, D, l->ln_post, eps, xn, nt);
        if (!status)
            status = ffn_block(bf16_in, layers, n_layers, i, h, xn, N, D, eps, act, b1, b2, y, y, guess, nt, used + i);
        if (status == 4) {
            memcpy(m_out, h, (size_t)(N * D) * sizeof(float));
            *stopped = i;
            const decode_layer *next = i + 1 < n_layers ? l + 1 : NULL;
            if (guess && next && next->moe && next->router && next->chosen)
                status = next_guess(next, h, N, D, eps, xn, nt);
            if (!status) status = 4;
            break;
        }
        for (int64_t j = 0; !status && j < N * D; j++) partial[j] += y[j];
    }
    for (int64_t i = 0; i < n_layers; i++) /* reads ahead still in flight (a stop, an error): in their table */
        if (layers[i].load_state) { ahead_take(layers, layers[i].load_state[LS_AHEAD_LAYER]); break; }
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

/* decode_layer as the compiler laid it out, for the caller's ctypes mirror (checked before the first call). */
#define TEXT(x) TEXT_(x)
#define TEXT_(x) #x
#define FIELD_ROW(type, name, dims) \
    {#name, (int64_t)offsetof(decode_layer, name), (int64_t)sizeof(((decode_layer *)0)->name), TEXT(type) TEXT(dims)},
static const struct { const char *name; int64_t offset, size; const char *type; } layer_fields[] = {
    MOESWAP_DECODE_LAYER_FIELDS(FIELD_ROW)
};
#undef FIELD_ROW

int moeswap_decode_layer_size(void) { return (int)sizeof(decode_layer); }

int moeswap_decode_layer_field(int64_t i, const char **name, int64_t *offset, int64_t *size, const char **type) {
    if (i < 0 || i >= (int64_t)(sizeof(layer_fields) / sizeof(layer_fields[0]))) return 1;
    *name = layer_fields[i].name;
    *offset = layer_fields[i].offset;
    *size = layer_fields[i].size;
    *type = layer_fields[i].type;
    return 0;
}

/* The lists cpu_kernels.h shares with Python, as this library was compiled (checked when it is loaded). */
typedef struct { const char *name; int64_t value; } abi_entry;
#define NAMED(name) {#name, 0},
#define CODED(name, code) {#name, code},
static const abi_entry formats[] = {MOESWAP_FORMATS(CODED)}, load_state[] = {MOESWAP_LOAD_STATE(NAMED)},
                       load_victim[] = {MOESWAP_LOAD_VICTIM(NAMED)}, load_log[] = {MOESWAP_LOAD_LOG(NAMED)},
                       load_kinds[] = {MOESWAP_LOAD_KINDS(NAMED)}, activations[] = {MOESWAP_ACTIVATIONS(NAMED)};
#undef NAMED
#undef CODED
#define LIST(name, entries, coded) {name, entries, (int64_t)(sizeof(entries) / sizeof(entries[0])), coded}
static const struct { const char *name; const abi_entry *entries; int64_t n; int coded; } abi_lists[] = {
    LIST("FORMATS", formats, 1), LIST("LOAD_STATE", load_state, 0), LIST("LOAD_VICTIM", load_victim, 0),
    LIST("LOAD_LOG", load_log, 0), LIST("LOAD_KINDS", load_kinds, 0), LIST("ACTIVATIONS", activations, 0),
};
#undef LIST

int moeswap_abi_entry(const char *list, int64_t i, const char **name, int64_t *value) {
    for (size_t k = 0; k < sizeof(abi_lists) / sizeof(abi_lists[0]); k++) {
        if (strcmp(abi_lists[k].name, list) || i < 0 || i >= abi_lists[k].n) continue;
        *name = abi_lists[k].entries[i].name;
        *value = abi_lists[k].coded ? abi_lists[k].entries[i].value : i;
        return 0;
    }
    return 1;
}
