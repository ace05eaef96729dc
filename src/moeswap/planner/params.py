"""Parameter counts and matmul shapes per layer, derived from ModelConfig (kimi_k3.md §7 shapes).

Owns the shape table every other planner module builds on: one `Linear` per weight matrix with its
tensor-parallel split, plus small vectors (norms, biases, conv taps). Knows nothing of bytes or time.
Entry point: `model_params(cfg)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from moeswap.config import ModelConfig

# How a matrix splits under tensor parallelism: by output rows ("col"), input columns ("row"),
# or not at all ("rep": small matrices engines replicate, e.g. the router and MLA down-projections).
SPLITS = ("col", "row", "rep")


@dataclass(frozen=True)
class Linear:
    name: str
    out_dim: int
    in_dim: int
    split: str  # one of SPLITS

    @property
    def params(self) -> int:
        return self.out_dim * self.in_dim


@dataclass(frozen=True)
class LayerParams:
    index: int
    attn_kind: str  # "kda" | "mla"
    mlp_kind: str  # "dense" | "moe"
    attn: tuple[Linear, ...]
    mlp: tuple[Linear, ...]  # dense MLP, or the MoE's non-expert part (router, latent, shared experts)
    vectors: int  # norms, AttnRes vectors, router bias, KDA conv/gate vectors (replicated, tiny)
    vectors_fp32: int  # the subset stored in fp32 (conv taps, A_log, dt_bias, router bias)
    num_experts: int  # routed experts in this layer (0 for a dense layer)

    @property
    def attn_params(self) -> int:
        return sum(l.params for l in self.attn)

    @property
    def mlp_params(self) -> int:
        return sum(l.params for l in self.mlp)

    @property
    def non_expert(self) -> int:
        return self.attn_params + self.mlp_params + self.vectors


@dataclass(frozen=True)
class ModelParams:
    cfg: ModelConfig
    layers: tuple[LayerParams, ...]
    expert: tuple[Linear, ...]  # one routed expert's matrices (w1 gate, w3 up, w2 down)
    embed: int
    lm_head: int
    final_vectors: int  # final norm + output AttnRes vectors

    @cached_property
    def expert_params(self) -> int:
        return sum(l.params for l in self.expert)

    @cached_property
    def num_experts_total(self) -> int:
        return sum(l.num_experts for l in self.layers)

    @cached_property
    def routed(self) -> int:
        return self.num_experts_total * self.expert_params

    @cached_property
    def non_expert(self) -> int:
        return sum(l.non_expert for l in self.layers) + self.embed + self.lm_head + self.final_vectors

    @cached_property
    def total(self) -> int:
        return self.routed + self.non_expert

    @cached_property
    def active(self) -> int:
        """Parameters used per token: everything but the embedding table (a lookup) and unchosen experts."""
        moe_layers = sum(1 for l in self.layers if l.num_experts)
        return self.non_expert - self.embed + moe_layers * self.cfg.moe.top_k * self.expert_params

    @cached_property
    def matmul_active(self) -> int:
        """Matrix parameters per token in the layers (2 FLOPs each); excludes lm_head and vectors."""
        moe_layers = sum(1 for l in self.layers if l.num_experts)
        dense = sum(l.attn_params + l.mlp_params for l in self.layers)
        return dense + moe_layers * self.cfg.moe.top_k * self.expert_params


def model_params(cfg: ModelConfig) -> ModelParams:
    d = cfg.hidden_size
    layers = []
    for i, (ak, mk) in enumerate(zip(cfg.attn_kinds, cfg.mlp_kinds)):
        attn, av, av32 = _kda(cfg) if ak == "kda" else _mla(cfg)
        mlp, mv, mv32, n_exp = _dense(cfg) if mk == "dense" else _moe(cfg)
        # Two RMSNorms per layer; K3's block attention residuals add a norm and a projection vector
        # before the attention and before the MLP.
        norms = 2 * d + (4 * d if cfg.attn_res_block_size else 0)
        layers.append(LayerParams(i, ak, mk, attn, mlp, av + mv + norms, av32 + mv32, n_exp))
    width = cfg.moe.latent_dim or d
    f = cfg.moe.expert_dim
    expert = (Linear("w1", f, width, "col"), Linear("w3", f, width, "col"), Linear("w2", width, f, "row"))
    embed = cfg.vocab_size * d
    lm_head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * d
    final = d + (2 * d if cfg.attn_res_block_size else 0)
    return ModelParams(cfg, tuple(layers), expert, embed, lm_head, final)


def _kda(cfg: ModelConfig) -> tuple[tuple[Linear, ...], int, int]:
    d, h, hd = cfg.hidden_size, cfg.kda.num_heads, cfg.kda.head_dim
    w = h * hd
    rank = hd  # the decay-gate (and Kimi Linear's output-gate) bottleneck is head_dim wide
    lin = [
        Linear("q_proj", w, d, "col"), Linear("k_proj", w, d, "col"), Linear("v_proj", w, d, "col"),
        Linear("f_a_proj", rank, d, "rep"), Linear("f_b_proj", w, rank, "col"),
        Linear("b_proj", h, d, "col"),
    ]
    if cfg.kda.full_rank_gate:
        lin.append(Linear("g_proj", w, d, "col"))
    else:
        lin += [Linear("g_a_proj", rank, d, "rep"), Linear("g_b_proj", w, rank, "col")]
    lin.append(Linear("o_proj", d, w, "row"))
    conv = 3 * w * cfg.kda.conv_kernel
    fp32 = conv + h + w  # conv taps, A_log (per head), dt_bias
    return tuple(lin), fp32 + hd, fp32  # + o_norm weight (bf16)


def _mla(cfg: ModelConfig) -> tuple[tuple[Linear, ...], int, int]:
    d, m = cfg.hidden_size, cfg.mla
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    lin = []
    vec = m.kv_lora_rank  # kv_a_layernorm
    if m.q_lora_rank:
        lin += [Linear("q_a_proj", m.q_lora_rank, d, "rep"), Linear("q_b_proj", m.num_heads * qk, m.q_lora_rank, "col")]
        vec += m.q_lora_rank
    else:
        lin.append(Linear("q_proj", m.num_heads * qk, d, "col"))
    lin += [
        Linear("kv_a_proj_with_mqa", m.kv_lora_rank + m.qk_rope_head_dim, d, "rep"),
        Linear("kv_b_proj", m.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, "col"),
    ]
    if m.output_gate:
        lin.append(Linear("g_proj", m.num_heads * m.v_head_dim, d, "col"))
    lin.append(Linear("o_proj", d, m.num_heads * m.v_head_dim, "row"))
    return tuple(lin), vec, 0


def _dense(cfg: ModelConfig) -> tuple[tuple[Linear, ...], int, int, int]:
    d, f = cfg.hidden_size, cfg.intermediate_size
    lin = (Linear("gate_proj", f, d, "col"), Linear("up_proj", f, d, "col"), Linear("down_proj", d, f, "row"))
    return lin, 0, 0, 0


def _moe(cfg: ModelConfig) -> tuple[tuple[Linear, ...], int, int, int]:
    d, moe = cfg.hidden_size, cfg.moe
    lin = [Linear("gate", moe.num_experts, d, "rep")]
    vec = vec32 = moe.num_experts  # e_score_correction_bias (fp32)
    if moe.latent_dim:
        lin += [Linear("routed_expert_down_proj", moe.latent_dim, d, "col"),
                Linear("routed_expert_up_proj", d, moe.latent_dim, "row")]
        vec += moe.latent_dim if moe.latent_norm else 0
    if moe.num_shared_experts:
        s = moe.num_shared_experts * moe.expert_dim
        lin += [Linear("shared.gate_proj", s, d, "col"), Linear("shared.up_proj", s, d, "col"),
                Linear("shared.down_proj", d, s, "row")]
    return tuple(lin), vec, vec32, moe.num_experts


def kda_state_bytes_per_seq(cfg: ModelConfig, state_bytes: float = 4.0, conv_bytes: float = 2.0) -> tuple[int, int]:
    """(recurrent state, conv state) bytes per sequence over all KDA layers; constant in context length."""
    n = cfg.attn_kinds.count("kda")
    h, hd = cfg.kda.num_heads, cfg.kda.head_dim
    state = n * h * hd * hd * state_bytes
    conv = n * 3 * h * hd * max(cfg.kda.conv_kernel - 1, 0) * conv_bytes
    return int(state), int(conv)


def mla_cache_values_per_token(cfg: ModelConfig) -> int:
    """Cached values per token over all MLA layers (latent c_kv + shared rope key, absorbed MLA)."""
    return cfg.attn_kinds.count("mla") * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)
