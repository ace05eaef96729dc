"""Parameter counts and matmul shapes per layer, read off the model itself.

Owns the shape table every other planner module builds on: one `Linear` per weight matrix with its
tensor-parallel split, plus small vectors (norms, biases, conv taps). Every shape comes from the
architecture's model (moeswap.models) built on `meta` and from `routed_expert_shapes`; this file adds
only what each weight is under tensor parallelism (KINDS). Knows nothing of bytes or time.
Entry point: `model_params(cfg)`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cached_property, lru_cache

from moeswap.config import ModelConfig

from .errors import PlanError

# How a matrix splits under tensor parallelism: by output rows ("col"), input columns ("row"),
# or not at all ("rep": small matrices engines replicate, e.g. the router and MLA down-projections).
SPLITS = ("col", "row", "rep")

# What every weight of a model in moeswap.models is, by module name (the name of the module that owns
# the weight, or of a bare parameter): a matrix [out, in] with its split; a replicated vector stored in
# bf16 ("vector") or in fp32 ("vector_fp32": as the published checkpoints store conv taps, A_log,
# dt_bias and the router bias); the embedding table or the output head. A weight missing here is an
# error, so that none is silently left out of the counts.
KINDS: dict[str, str] = {
    # attention (KDA and MLA): head-parallel projections split by heads, low-rank down-projections replicate
    "q_proj": "col", "k_proj": "col", "v_proj": "col", "b_proj": "col", "f_a_proj": "rep", "f_b_proj": "col",
    "g_proj": "col", "g_a_proj": "rep", "g_b_proj": "col", "q_a_proj": "rep", "q_b_proj": "col",
    "kv_a_proj_with_mqa": "rep", "kv_b_proj": "col", "o_proj": "row",
    "q_conv1d": "vector_fp32", "k_conv1d": "vector_fp32", "v_conv1d": "vector_fp32", "A_log": "vector_fp32",
    "dt_bias": "vector_fp32", "o_norm": "vector", "q_a_layernorm": "vector", "kv_a_layernorm": "vector",
    # dense MLP and shared experts; the MoE router, its bias and K3's latent projections and norm
    "gate_proj": "col", "up_proj": "col", "down_proj": "row",
    "gate": "rep", "e_score_correction_bias": "vector_fp32",
    "routed_expert_down_proj": "col", "routed_expert_up_proj": "row", "routed_expert_norm": "vector",
    # one routed expert (routed_expert_shapes' projection names)
    "w1": "col", "w3": "col", "w2": "row",
    # layer and model norms, K3's block attention residual vectors, embedding and head
    "input_layernorm": "vector", "post_attention_layernorm": "vector", "norm": "vector",
    "self_attention_res_norm": "vector", "self_attention_res_proj": "vector", "mlp_res_norm": "vector",
    "mlp_res_proj": "vector", "output_attn_res_norm": "vector", "output_attn_res_proj": "vector",
    "embed_tokens": "embed", "lm_head": "lm_head",
}
# The submodules of a decoder layer that hold its attention and its MLP (dense, or the MoE block).
LAYER_PARTS = {"self_attn": "attn", "mlp": "mlp", "block_sparse_moe": "mlp"}
_LAYER_WEIGHT = re.compile(r"model\.layers\.(\d+)\.(.+)")


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


@lru_cache(maxsize=16)
def model_params(cfg: ModelConfig) -> ModelParams:
    """The model of `cfg.arch` built on `meta` (shapes, no memory) with its weights sorted by KINDS, plus
    one routed expert. Kept per config: planning the same model again does not build it again."""
    from moeswap.archs import REGISTRY
    from moeswap.config import routed_expert_shapes

    if cfg.arch not in REGISTRY:
        raise PlanError(f"architecture {cfg.arch!r} has no model in moeswap.models (known: {', '.join(sorted(REGISTRY))})")
    weights = [(name, tuple(p.shape)) for name, p in _meta_model(cfg).named_parameters()]
    expert = tuple(Linear(proj, out, inp, _kind(proj, f"routed expert {proj}"))
                   for proj, (out, inp) in routed_expert_shapes(cfg).items())
    return from_weights(cfg, weights, expert)


def _meta_model(cfg: ModelConfig):
    import torch  # only when a model is planned: the hardware catalog alone stays torch-free
    from torch.overrides import TorchFunctionMode

    from moeswap.models import build_model

    class SkipMetaNormalInit(TorchFunctionMode):
        """nn.init.normal_ (the embedding's init) on a meta tensor runs a Python reference that imports
        torch._dynamo, several times the cost of the build itself; a meta tensor has no values to set."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.nn.init.normal_ and (args[0] if args else kwargs.get("tensor")).is_meta:
                return args[0] if args else kwargs["tensor"]
            return func(*args, **kwargs)

    with SkipMetaNormalInit():
        return build_model(cfg, device="meta")


def from_weights(cfg: ModelConfig, weights: list[tuple[str, tuple[int, ...]]], expert: tuple[Linear, ...]) -> ModelParams:
    """ModelParams from a model's (parameter name, shape) list, in module order, and one routed expert."""
    attn: list[list[Linear]] = [[] for _ in range(cfg.num_layers)]
    mlp: list[list[Linear]] = [[] for _ in range(cfg.num_layers)]
    vec, vec32 = [0] * cfg.num_layers, [0] * cfg.num_layers
    top = {"embed": 0, "lm_head": 0, "vector": 0}
    for name, shape in weights:
        # a parameter's module name: its owner's for a `.weight`, else its own (A_log, a router bias)
        kind = _kind(name.removesuffix(".weight").rpartition(".")[2], f"{cfg.arch} weight {name}")
        m = _LAYER_WEIGHT.fullmatch(name)
        if m is None:  # outside the layers: embedding, head, final norm and AttnRes vectors
            if kind not in top:
                raise PlanError(f"{cfg.arch} weight {name} ({kind}): outside the decoder layers the planner "
                                "counts only the embedding, the head and bf16 vectors (planner/params.py)")
            top[kind] += math.prod(shape)
            continue
        i, (part, _, rest) = int(m.group(1)), m.group(2).partition(".")
        if kind in SPLITS:
            where = LAYER_PARTS.get(part)
            if where is None or len(shape) != 2:
                raise PlanError(f"{cfg.arch} weight {name} {list(shape)}: the planner expects a matrix [out, in] "
                                f"inside one of {', '.join(LAYER_PARTS)} (planner/params.py LAYER_PARTS)")
            (attn if where == "attn" else mlp)[i].append(Linear(rest.removesuffix(".weight"), shape[0], shape[1], kind))
        elif kind in ("vector", "vector_fp32"):
            vec[i] += math.prod(shape)
            vec32[i] += math.prod(shape) if kind == "vector_fp32" else 0
        else:
            raise PlanError(f"{cfg.arch} weight {name} ({kind}): not expected inside decoder layer {i}")
    layers = tuple(
        LayerParams(i, ak, mk, tuple(attn[i]), tuple(mlp[i]), vec[i], vec32[i], cfg.moe.num_experts if mk == "moe" else 0)
        for i, (ak, mk) in enumerate(zip(cfg.attn_kinds, cfg.mlp_kinds)))
    return ModelParams(cfg, layers, expert, top["embed"], top["lm_head"], top["vector"])


def _kind(module: str, what: str) -> str:
    kind = KINDS.get(module)
    if kind is None:
        raise PlanError(f"{what}: module {module!r} has no entry in the planner's KINDS table "
                        "(planner/params.py), which says how each weight splits under tensor parallelism")
    return kind


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
