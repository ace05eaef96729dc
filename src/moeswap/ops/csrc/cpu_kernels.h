/* cpu_kernels.h: the C ABI of moeswap's CPU kernels (the C files beside it, built into one shared library),
 * the one description both sides read. Every C file includes it, so the compiler checks each definition
 * against its prototype here; ops/kernel_abi.py reads the prototypes to set every function's ctypes
 * argtypes, the shared lists (format codes, activations, load_state's slots, ...) and constants below, and
 * decode_layer's fields, from which engine/native_step.py builds its ctypes `decode_layer`. The library
 * exports the lists and the fields as compiled (moeswap_abi_entry, moeswap_decode_layer_field), checked
 * entry by entry and field by field when it is loaded and before the first decode call.
 *
 * Python parses this file strictly: the include guard, #include, MOESWAP_ macros (a list `NAME(X) X(...)
 * X(...)` or an integer constant), the decode_layer typedef and one prototype per exported function, whose
 * parameters are `[const] T [* [const]]... name` with a scalar T of int, int64_t, float or double
 * (pointers may point at anything declared here). Anything else is an error there, not a guess.
 * Status returns: 0 done, 1 bad sizes, 2 out of memory, 3 a path this build lacks, 4 see the function.
 */
#ifndef MOESWAP_CPU_KERNELS_H
#define MOESWAP_CPU_KERNELS_H

#include <stdint.h>

/* ---- lists C and Python share: C builds its enums from them, ops/kernel_abi.py parses them, and the library
 * exports them as it was compiled (moeswap_abi_entry), checked entry by entry when it is loaded ---- */
/* The expert kernels' weight formats (`format` of moe.c, quant.c and the resident tables): FORMAT(name, code).
 * Python's kind of each is its name in lower case (ops/kernel_library.py FORMAT_CODES). */
#define MOESWAP_FORMATS(FORMAT) FORMAT(MXFP4, 0) FORMAT(BF16, 1) FORMAT(MXFP4_Q8, 2) FORMAT(FP8, 3) FORMAT(INT4, 4) FORMAT(INT8, 5)
/* The gated activations of every `act` parameter, from 0 (glue.c describes them); Python's names are these in
 * lower case (ops/kernel_library.py ACTS). */
#define MOESWAP_ACTIVATIONS(ACT) ACT(SILU) ACT(SITU)

/* decode_layer's load_state slots, in order (decode_step.c LS_*, experts/incall.py; described at load_state). */
#define MOESWAP_LOAD_STATE(SLOT)                                                                              \
    SLOT(ROOM) SLOT(FREE) SLOT(VICTIMS) SLOT(NEXT) SLOT(LOG) SLOT(LOG_CAP) SLOT(READ_NS) SLOT(KEEP) SLOT(READER) \
    SLOT(SUBMIT) SLOT(WAIT) SLOT(JOBS) SLOT(NJOBS) SLOT(AHEAD) SLOT(AHEAD_LAYER) SLOT(AHEAD_IDS) SLOT(GUESS)     \
    SLOT(N_GUESS) SLOT(PREDICTED) SLOT(ACTUAL) SLOT(CORRECT)
/* The columns of a load_victims entry and of a load_log entry, and a log entry's kinds (described at
 * load_state). */
#define MOESWAP_LOAD_VICTIM(COLUMN) COLUMN(LAYER) COLUMN(EXPERT) COLUMN(COST) COLUMN(STATE) COLUMN(BUFFER)
#define MOESWAP_LOAD_LOG(COLUMN) COLUMN(LAYER) COLUMN(EXPERT) COLUMN(BUFFER) COLUMN(KIND)
#define MOESWAP_LOAD_KINDS(KIND) KIND(LOAD) KIND(AHEAD) KIND(AHEAD_BAD)

/* Routed experts' projections, PROJ(name, role), in the checkpoint's order; the expert kernels take them as
 * gate, up, down (moe.c's w1/p1, w3/p3, w2/p2). Python: ops/kernel_abi.py EXPERT_PROJS, KERNEL_PROJS. */
#define MOESWAP_EXPERT_PROJS(PROJ) PROJ(w1, gate) PROJ(w2, down) PROJ(w3, up)

/* ---- constants Python reads from here (ops/kernel_abi.py constant()), each written once ---- */
/* Entries of a resident-table row (moeswap_moe_resident's `table`, decode_layer's table and load_row): an
 * expert's matrix pointers as the expert kernels take them, w1, w3, w2, each matrix's data then its scales. */
#define MOESWAP_TABLE_ROW 6
/* Rows of a dense bf16 linear that take the kernel (moeswap_bf16_linear streams the weights once), up to and
 * including this many; a GEMM above. The native decode step (decode_step.c, whose products are these
 * kernels) runs batches of up to as many sequences, where the model's forward takes the same kernels. */
#define MOESWAP_DENSE_KERNEL_MAX_ROWS 32
/* Tokens of one routed expert from which a layer step multiplies it by decoded rows in a GEMM (prefill);
 * fewer take the grouped kernels (moe.c). Tuned apart from the dense crossover above: 32 tokens go to the
 * GEMM here, 32 rows to the kernel there. */
#define MOESWAP_EXPERT_GEMM_MIN_ROWS 32
/* Decoded bytes per chunk of rows where the torch paths decode a stored matrix (prefill GEMMs, backward
 * products): a chunk stays in L2. */
#define MOESWAP_ROW_CHUNK_BYTES (1 << 20)

/* ---- decode_step.c: a decode step's decoder layers in one call (engine/native_step.py builds the table) ----
 * One row per decoder layer; every weight bf16 [out, in] unless noted; norms, scores, router, taps and
 * absorbed MLA weights fp32. FIELD(type, name, array dimension or nothing), in struct order. */
#define MOESWAP_DECODE_LAYER_FIELDS(FIELD)                                                                    \
    FIELD(int64_t, mla, )                  /* attention kind: 1 MLA, 0 KDA */                                 \
    FIELD(int64_t, moe, )                  /* FFN kind: 1 MoE, 0 dense MLP */                                 \
    FIELD(int64_t, bank_before, )          /* bank the partial sum first (AttnRes) */                         \
    FIELD(const float *, score_attn, )     /* AttnRes score vectors [D], NULL without */                      \
    FIELD(const float *, score_ffn, )                                                                         \
    FIELD(const float *, ln_in, )          /* input_layernorm [D] */                                          \
    FIELD(const float *, ln_post, )        /* post_attention_layernorm [D] */                                 \
    FIELD(const uint16_t *, w_in, )        /* the fused input projections [in_rows, D] */                     \
    FIELD(int64_t, in_rows, )                                                                                 \
    FIELD(int64_t, off, [6])               /* ... and their first rows (KDA: q k v f_a b g; MLA: q kv g) */   \
    FIELD(const uint16_t *, w_o, )         /* o_proj [D, H K] (KDA) or [D, H V] (MLA) */                      \
    /* KDA: f_b_proj [C, K]; g_b_proj [C, K] for Kimi Linear's low-rank output gate (NULL: full rank, in      \
     * w_in); conv taps [W, 3C], dt_bias [C], decay rates exp(A_log) [H], o_norm [K]; `bounded`: the          \
     * gate is lower * sigmoid (K3), else softplus (Kimi Linear); H heads of width K, conv width W */         \
    FIELD(const uint16_t *, w_fb, )                                                                           \
    FIELD(const uint16_t *, w_gb, )                                                                           \
    FIELD(const float *, taps, )                                                                              \
    FIELD(const float *, dt_bias, )                                                                           \
    FIELD(const float *, rate, )                                                                              \
    FIELD(const float *, o_norm, )                                                                            \
    FIELD(double, lower, )                                                                                    \
    FIELD(double, kda_scale, )                                                                                \
    FIELD(int64_t, bounded, )                                                                                 \
    FIELD(int64_t, H, )                                                                                       \
    FIELD(int64_t, K, )                                                                                       \
    FIELD(int64_t, W, )                                                                                       \
    /* MLA: q_a_layernorm [q_rank] + q_b_proj (NULL: w_in holds the queries), kv_a_layernorm [L],             \
     * kv_b_proj absorbed as keys [H, N, L] and values [H, L, V] (fp32); gated: w_in holds the output gate */ \
    FIELD(const float *, q_norm, )                                                                            \
    FIELD(const uint16_t *, w_qb, )                                                                           \
    FIELD(int64_t, q_rank, )                                                                                  \
    FIELD(const float *, kv_norm, )                                                                           \
    FIELD(const float *, wk, )                                                                                \
    FIELD(const float *, wv, )                                                                                \
    FIELD(int64_t, N, )                                                                                       \
    FIELD(int64_t, R, )                                                                                       \
    FIELD(int64_t, L, )                                                                                       \
    FIELD(int64_t, V, )                                                                                       \
    FIELD(int64_t, gated, )                                                                                   \
    FIELD(double, mla_scale, )                                                                                \
    /* RoPE MLA (DeepSeek-V3): cos and sin [N, R/2] of each row's position (NULL: NoPE), set per step; the   \
     * query's and shared key's R dims turn by them in pairs (2i, 2i+1) if rope_interleave, else (i, i + R/2) */ \
    FIELD(const float *, rope_cos, )                                                                          \
    FIELD(const float *, rope_sin, )                                                                          \
    FIELD(int64_t, rope_interleave, )                                                                         \
    /* dense MLP, or the shared experts: gate|up [2 hidden, D], down [D, hidden] (NULL: none) */              \
    FIELD(const uint16_t *, w_gu, )                                                                           \
    FIELD(const uint16_t *, w_down, )                                                                         \
    FIELD(int64_t, hidden, )                                                                                  \
    /* MoE: router [E, D] + bias [E]; resident table [E, TABLE_ROW] (format as moeswap_moe_resident; NULL  \
     * `stop`); K3's latent projections down [lat_dim, D], up [D, lat_dim] and norm [lat_dim] (NULL: the      \
     * experts read x) */                                                                                     \
    FIELD(const float *, router, )                                                                            \
    FIELD(const float *, router_bias, )                                                                       \
    FIELD(int64_t, E, )                                                                                       \
    FIELD(int64_t, topk, )                                                                                    \
    FIELD(int64_t, softmax, )                                                                                 \
    FIELD(int64_t, renorm, )                                                                                  \
    FIELD(double, route_scale, )                                                                              \
    FIELD(int64_t, groups, )               /* expert groups (DeepSeek-V3; 1: none) and how many stay eligible */ \
    FIELD(int64_t, topk_group, )                                                                              \
    FIELD(const int64_t *, table, )                                                                           \
    FIELD(int64_t, F, )                                                                                       \
    FIELD(int64_t, format, )                                                                                  \
    FIELD(const uint16_t *, lat_down, )                                                                       \
    FIELD(const uint16_t *, lat_up, )                                                                         \
    FIELD(const float *, lat_norm, )                                                                          \
    FIELD(int64_t, lat_dim, )                                                                                 \
    FIELD(int64_t *, chosen, )             /* out: the router's ids [N, topk] of a step (NULL: not kept) */   \
    FIELD(int64_t, stop, )                 /* stop before this layer's FFN: the caller runs it (status 4) */ \
    /* dense weights kept as codes, all of a layer's in one format `dense_format` (FORMAT_FP8: DeepSeek-V3's   \
     * published block FP8, E4M3 codes [out, in] with fp32 scales [ceil(out/128), ceil(in/128)]; FORMAT_INT8:  \
     * int8 codes [out, in] with fp32 scales [out]; FORMAT_INT4: int32 words [out, in/8] with bf16 scales      \
     * [out, in/32]): the scales of w_in, w_o, w_qb, w_gu and w_down; where one is set, that weight holds      \
     * codes instead of bf16, run by csrc/quant.c or csrc/int8.c (NULL: bf16) */                              \
    FIELD(const void *, s_in, )                                                                               \
    FIELD(const void *, s_o, )                                                                                \
    FIELD(const void *, s_qb, )                                                                               \
    FIELD(const void *, s_gu, )                                                                               \
    FIELD(const void *, s_down, )                                                                             \
    FIELD(int64_t, dense_format, )                                                                            \
    /* In-call expert loads (experts/incall.py): a chosen expert missing from `table` is read here instead of   \
     * stopping, where load_at is set: load_at [E, 2] each expert's (file descriptor, offset) of its bytes,     \
     * load_job an msw_job (expert_read.h) with their length and scale-byte checks filled in, load_row the six  \
     * table entries' offsets into those bytes (-1: a zero entry), load_cost the fast-tier bytes one takes.      \
     * Shared by the call's layers (NULL: no loads): load_state [slots of MOESWAP_LOAD_STATE] (free           \
     * bytes, free buffers, victims offered, next victim, log entries and capacity, read nanoseconds,         \
     * keep (0: the store keeps nothing), the reader threads' handle, submit and wait and the job slots       \
     * for reads ahead, those in flight and their layer, ids and guess, the guesses' counts);                 \
     * load_buffers [free buffers] their addresses, taken from the end; load_victims [offered, columns of     \
     * MOESWAP_LOAD_VICTIM] (layer, expert, cost, state: 0 evictable, 1 used by this call, 2 evicted; its     \
     * buffer, which a load may read into once it is evicted, or 0) coldest first; load_log [capacity,        \
     * columns of MOESWAP_LOAD_LOG] (layer, expert, index in load_buffers, -2 not kept or -3 - the victim     \
     * whose buffer it took, kind: MOESWAP_LOAD_KINDS, a load, read ahead, read ahead and bad) of a load,     \
     * (layer, expert, -1, LOAD) of an eviction, in order */                                                  \
    FIELD(const int64_t *, load_at, )                                                                         \
    FIELD(const void *, load_job, )                                                                           \
    FIELD(int64_t, load_row, [MOESWAP_TABLE_ROW])                                                             \
    FIELD(int64_t, load_cost, )                                                                               \
    FIELD(int64_t *, load_state, )                                                                            \
    FIELD(int64_t *, load_buffers, )                                                                          \
    FIELD(int64_t *, load_victims, )                                                                          \
    FIELD(int64_t *, load_log, )

#define MOESWAP_DECLARE_FIELD(type, name, dims) type name dims;
typedef struct { MOESWAP_DECODE_LAYER_FIELDS(MOESWAP_DECLARE_FIELD) } decode_layer;
#undef MOESWAP_DECLARE_FIELD

int moeswap_decode_layers(const decode_layer *layers, int64_t n_layers, int64_t first, const int64_t *state,
                          float *partial, float *bank, int64_t max_bank, int64_t *n_bank, float *m_out,
                          const float *score_out, const float *final_norm, const uint16_t *head, int64_t V,
                          float *logits, int64_t N, int64_t D, float eps, float l2_eps, int act, float b1, float b2,
                          int64_t *used, int64_t *stopped, int64_t ffn_first, int guess, int bf16_in,
                          int nt);
/* The layout check: sizeof(decode_layer), and field i's name, offset, size and type as spelled above
 * (e.g. "const float *", "int64_t[6]": a named dimension as its value); 0, or 1 past the last field. */
int moeswap_decode_layer_size(void);
int moeswap_decode_layer_field(int64_t i, const char **name, int64_t *offset, int64_t *size, const char **type);
/* The shared lists above as compiled: entry i of `list` ("FORMATS", "LOAD_STATE", "LOAD_VICTIM", "LOAD_LOG",
 * "LOAD_KINDS": the macro's name without MOESWAP_) as its name and value (a format's code, else i); 0, or 1
 * past the last entry or for a list not named here; "ACTIVATIONS" too. */
int moeswap_abi_entry(const char *list, int64_t i, const char **name, int64_t *value);

/* ---- mxfp4.c: MXFP4 weights straight from the packed bytes ---- */
int moeswap_mxfp4_isa(void);
int moeswap_mxfp4_linear(const float *x, int64_t T, int64_t I, int n_mats, const uint8_t *const *packed,
                         const uint8_t *const *scale, const int64_t *O, float *const *y, int nthreads);
int moeswap_mxfp4_expert(const float *x, int64_t T, int64_t I, int64_t F, const uint8_t *p1, const uint8_t *s1,
                         const uint8_t *p3, const uint8_t *s3, const uint8_t *p2, const uint8_t *s2, int act,
                         float b1, float b2, float *y, int nthreads);
int moeswap_mxfp4_decode(const uint8_t *packed, const uint8_t *scale, int64_t O, int64_t I, void *out, int bf16,
                         int nthreads);

/* ---- q8.c: int8 activations for MXFP4 weights (AVX-512 VNNI builds) ---- */
int moeswap_mxfp4_q8(void);
int moeswap_q8_quantize(const float *x, int64_t T, int64_t I, uint8_t *dst, int plain);

/* ---- linear_bf16.c: bf16 weights ---- */
int moeswap_bf16_linear(const float *x, int64_t T, int64_t I, const uint16_t *W, int64_t O, float *y,
                        int nthreads);
int moeswap_has_bf16_dot(void);
int moeswap_bf16x_linear(const uint16_t *x, int64_t T, int64_t I, const uint16_t *W, int64_t O, float *y,
                         int nthreads);
int moeswap_bf16_mlp(const float *x, int64_t T, int64_t D, const uint16_t *w_gu, int64_t H, const uint16_t *w_down,
                     int act, float b1, float b2, float *y, int nthreads);

/* ---- gemm_bf16.c: training's GEMM on frozen bf16 weights, either direction ---- */
int moeswap_bf16_gemm(const float *a, int64_t M, int64_t K, const uint16_t *W, int64_t N, int trans, int accumulate,
                      float *c, int nthreads);

/* ---- moe.c: a layer step's routed experts ---- */
int moeswap_mxfp4_moe(const float *x, int64_t T, int64_t I, int64_t F, int E, const uint8_t *const *p1,
                      const uint8_t *const *s1, const uint8_t *const *p3, const uint8_t *const *s3,
                      const uint8_t *const *p2, const uint8_t *const *s2, const int64_t *off, const int64_t *tokens,
                      const float *weight, int act, float b1, float b2, float *y, int nthreads, int q8);
int moeswap_bf16_moe(const float *x, int64_t T, int64_t I, int64_t F, int E, const uint16_t *const *w1,
                     const uint16_t *const *w3, const uint16_t *const *w2, const int64_t *off, const int64_t *tokens,
                     const float *weight, int act, float b1, float b2, float *y, int nthreads);
int moeswap_moe_resident(int format, const float *x, int64_t T, int64_t I, int64_t F, int64_t E_total,
                         const int64_t *table, const int64_t *ids, const float *weight, int64_t K, int act,
                         float b1, float b2, float *y, int nthreads, int64_t *used);
int moeswap_latent_moe_resident(int format, const float *x, int64_t T, int64_t D, const uint16_t *w_down,
                                int64_t I, const float *norm_w, float eps, const uint16_t *w_up, int64_t F,
                                int64_t E_total, const int64_t *table, const int64_t *ids, const float *weight,
                                int64_t K, int act, float b1, float b2, float *y, int nthreads, int64_t *used);

int moeswap_quant_moe(int format, const float *x, int64_t T, int64_t I, int64_t F, int E, const void *const *p1,
                      const void *const *s1, const void *const *p3, const void *const *s3, const void *const *p2,
                      const void *const *s2, const int64_t *off, const int64_t *tokens, const float *weight, int act,
                      float b1, float b2, float *y, int nthreads);

/* ---- quant.c: block-FP8 (FORMAT FP8) and INT4 (FORMAT INT4) weights straight from their stored bytes ---- */
int moeswap_quant_linear(int format, const float *x, int64_t T, int64_t I, const void *q, const void *scale,
                         int64_t O, float *y, int nthreads);
int moeswap_int4_decode(const void *q, const void *scale, int64_t O, int64_t I, float *out, int nthreads);

/* ---- int8.c: INT8 channel weights (int8 codes [O, I], fp32 scale per row) straight from their bytes ---- */
int moeswap_int8_linear(const float *x, int64_t T, int64_t I, const int8_t *q, const float *s, int64_t O, float *y,
                        int nthreads);

/* ---- kda.c: Kimi Delta Attention ---- */
int moeswap_kda_decode(const float *q, const float *k, const float *v, const float *g, const float *beta,
                       float *S, float *o, int64_t N, int64_t K, int64_t V, float scale, float eps, int nthreads);
int moeswap_kda_layer(const float *qkv, float *conv, const float *taps, int64_t W, const float *z,
                      const float *dt_bias, const float *A, float lower, int bounded, const float *b_in,
                      float *S, const float *gate, const float *o_w, float norm_eps, float scale,
                      float l2_eps, float *y, int64_t B, int64_t T, int64_t H, int64_t K, int nthreads);

/* ---- kda_train.c: the KDA recurrence for training, forward (state checkpoints) and backward ---- */
int moeswap_kda_train_forward(const float *q, const float *k, const float *v, const float *g, const float *beta,
                              const float *S0, float *o, float *S_end, float *checkpoints, int64_t N, int64_t T,
                              int64_t K, int64_t V, int64_t C, int nthreads);
int moeswap_kda_train_backward(const float *q, const float *k, const float *v, const float *g, const float *beta,
                               const float *checkpoints, const float *d_o, const float *dS_end, float *dq, float *dk,
                               float *dv, float *dg, float *dbeta, float *dS0, int64_t N, int64_t T, int64_t K,
                               int64_t V, int64_t C, int nthreads);

/* ---- mla.c: Multi-head Latent Attention ---- */
int moeswap_mla_decode(const float *q, const float *latent, int64_t cap, const int64_t *lengths, const float *wk,
                       const float *wv, float scale, float *out, int64_t B, int64_t H, int64_t N, int64_t R,
                       int64_t L, int64_t V, int nthreads);

/* ---- glue.c: norms, the AttnRes mix, the router, gated activations, the MLA output gate ---- */
int moeswap_glu(const float *g, const float *u, float *out, int64_t n, int act, float b1, float b2, int nthreads);
int moeswap_glu_backward(const float *g, const float *u, const float *dout, float *dg, float *du, int64_t n, int act,
                         float b1, float b2, int nthreads);
int moeswap_rms_norm(const float *x, int64_t N, int64_t D, const float *w, float eps, float *y, int nthreads);
int moeswap_res_mix(const float *const *src, int S, int64_t N, int64_t D, const float *score, float eps,
                    float *out, int nthreads);
int moeswap_route(const float *x, int64_t T, int64_t D, const float *W, int64_t E, const float *bias, int64_t K,
                  int softmax, int renorm, float scale, int64_t G, int64_t topk_group, int64_t *ids, float *w,
                  int nthreads);
int moeswap_sigmoid_gate(float *x, const float *g, int64_t rows, int64_t width, int64_t g_stride);

#endif
