"""ModelConfig, read from config.json: K3's `text_config` wrapper, both key spellings (Kimi, DeepSeek /
transformers), layer kinds (`linear_attn_config` 1-based lists, `layer_types`, `mlp_layer_types`), rotary
embedding (`rope_scaling` / `rope_parameters`, YaRN), the quantization scheme, every field's type and range.
Which architecture a file is and its choices (all MLA, rotary, MTP layers) it asks moeswap.archs; it never
names one, and knows nothing of tensors. Entry points: `load_config(path)`, `parse_config(dict)`.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeswap import archs
from moeswap.formats.files import confined, read_json, show


class ConfigError(ValueError):
    """A config.json that cannot describe a model moeswap runs."""


# Keys this parser understands (text part). Anything else is reported once, not silently ignored.
_KNOWN_KEYS = {
    "architectures", "auto_map", "model_type", "dtype", "torch_dtype", "transformers_version",
    "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "moe_intermediate_size",
    "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "qk_head_dim", "head_dim", "mla_use_nope", "mla_use_output_gate",
    "first_k_dense_replace", "moe_layer_freq", "num_experts", "n_routed_experts", "num_local_experts",
    "num_experts_per_token", "num_experts_per_tok", "num_shared_experts", "n_shared_experts",
    "routed_expert_hidden_size", "latent_moe_use_norm", "moe_router_activation_func", "scoring_func",
    "topk_method", "num_expert_group", "n_group", "topk_group", "use_grouped_topk", "moe_renormalize",
    "norm_topk_prob", "routed_scaling_factor", "hidden_act", "activation_situ_beta",
    "activation_situ_linear_beta", "attn_res_block_size", "rms_norm_eps", "max_position_embeddings",
    "model_max_length", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
    "linear_attn_config", "layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads",
    "linear_conv_kernel_dim", "quantization_config", "initializer_range", "use_cache",
    "num_nextn_predict_layers", "rope_scaling", "rope_theta", "rope_parameters", "attention_bias",
    "attention_dropout", "output_router_logits", "pretraining_tp", "ignore_index",
    # DeepSeek-V3 / Kimi K2 (training-only or implied by the fields above)
    "rope_interleave", "ep_size", "aux_loss_alpha", "seq_aux",
}
_KNOWN_ROPE_KEYS = {
    "type", "rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
    "mscale", "mscale_all_dim", "attention_factor", "truncate",
}
_KNOWN_LINEAR_ATTN_KEYS = {
    "kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size",
    "gate_lower_bound", "use_full_rank_gate",
}


@dataclass(frozen=True)
class QuantScheme:
    """The checkpoint's quantization: compressed-tensors (routed experts) or DeepSeek block FP8 (every
    quantised Linear, `weight` float8 + `weight_scale_inv` per fp8_block [rows, cols] block)."""

    format: str  # "mxfp4-pack-quantized", ..., or "fp8_block"
    group_size: int
    ignore: tuple[str, ...] = ()  # "re:<regex>" or exact module names left unquantised
    fp8_block: tuple[int, int] | None = None  # format "fp8_block": the weight_block_size
    dense_format: str | None = None  # compressed-tensors: a second group's format, for the dense weights it names

    def dense(self) -> str:
        """The format the dense weights stored quantised are declared in."""
        return self.dense_format or self.format

    def is_ignored(self, module_name: str) -> bool:
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module_name):
                    return True
            elif pattern == module_name:
                return True
        return False


@dataclass(frozen=True)
class KDAConfig:
    num_heads: int
    head_dim: int
    conv_kernel: int
    gate_lower_bound: float | None  # K3: -5.0 selects the bounded sigmoid gate; None: Kimi Linear softplus
    full_rank_gate: bool  # K3: one g_proj [H*D, d]; Kimi Linear: g_a_proj/g_b_proj of rank head_dim


@dataclass(frozen=True)
class RopeConfig:
    """DeepSeek-V3's rotary embedding of the R shared-key dims (qk_rope_head_dim), YaRN-scaled when
    `factor` > 1 (rope_type "yarn"): inverse frequencies blended between interpolation and extrapolation
    over [beta_fast, beta_slow] rotations, cos/sin times attention_factor, softmax scale times mscale^2."""

    theta: float
    interleave: bool  # rotate pairs (x0, x1), (x2, x3)... (DeepSeek's weights) rather than halves
    yarn: bool = False
    factor: float = 1.0
    original_max_positions: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # 0: absent
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # None: from factor, mscale and mscale_all_dim
    truncate: bool = True


@dataclass(frozen=True)
class MLAConfig:
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    output_gate: bool
    use_nope: bool
    rope: RopeConfig | None = None  # DeepSeek-V3: rotary shared key; None: NoPE (Kimi)


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    num_shared_experts: int
    expert_dim: int  # moe_intermediate_size
    latent_dim: int | None  # routed_expert_hidden_size (K3); None: experts run at full width
    latent_norm: bool
    scoring: str  # "sigmoid" | "softmax"
    renormalize: bool
    routed_scaling_factor: float
    num_groups: int
    topk_group: int


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    attn_kinds: tuple[str, ...]  # per layer: "kda" | "mla"
    mlp_kinds: tuple[str, ...]  # per layer: "dense" | "moe"
    intermediate_size: int
    hidden_act: str  # "situ" | "silu"
    situ_beta: float
    situ_linear_beta: float
    attn_res_block_size: int | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    kda: KDAConfig
    mla: MLAConfig
    moe: MoEConfig
    quant: QuantScheme | None
    weight_prefix: str  # "language_model." for K3's multimodal wrapper, "" for text-only files
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    max_position_embeddings: int = 1 << 20
    mtp_layers: int = 0  # DeepSeek-V3 num_nextn_predict_layers: stored after the last layer, not run
    unknown_keys: tuple[str, ...] = field(default=(), compare=False)

    def layer_summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for a, m in zip(self.attn_kinds, self.mlp_kinds):
            out[f"{a}+{m}"] = out.get(f"{a}+{m}", 0) + 1
        return out


# Upper bounds far above any published model (K3: 93 layers, 896 experts, hidden size 7168, vocabulary
# 163840): a larger value is a corrupt file, and building its model would allocate or loop without end.
MAX_LAYERS = 1 << 12
MAX_EXPERTS = 1 << 16
MAX_SIZE = 1 << 24  # any width, head count, rank or vocabulary size
MAX_POSITIONS = (1 << 31) - 1
FP32_TINY, FP32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38  # smallest normal, largest finite


def load_config(path: str | Path) -> ModelConfig:
    """Read `path` (a model directory or a config.json file). A directory's config.json must be a file
    inside it (formats.files.confined): a checkpoint never reads another file's keys through a link."""
    path = Path(path)
    file = confined(path, "config.json", ConfigError, str(path)) if path.is_dir() else path
    if not file.exists():
        raise ConfigError(f"{file}: no config.json found (expected a model directory or a config.json path)")
    if file.is_file() and _is_gguf(file):
        raise ConfigError(f"{file}: a GGUF file (llama.cpp's format); moeswap reads the published safetensors "
                          f"checkpoint, a directory with config.json, because it streams the routed experts as "
                          f"they are stored there (MXFP4, block FP8, INT4) by byte range")
    return parse_config(read_json(file, ConfigError), source=str(file))


def _is_gguf(file: Path) -> bool:
    """A file that begins with GGUF's magic bytes."""
    try:
        with open(file, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Every field checked for type and range; an error names the field and the value found."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object at the top level")
    wrapped = "text_config" in raw
    text = raw["text_config"] if wrapped else raw
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: field 'text_config' must be an object")
    top, g = _Getter(raw, source), _Getter(text, source)
    names = top.str_list("architectures") + (g.str_list("architectures") if wrapped else ())
    model_type = raw.get("model_type", text.get("model_type"))
    arch = _detect_arch(model_type, names, text, source)

    num_layers = g.int("num_hidden_layers", low=1, high=MAX_LAYERS)
    lin_raw = text.get("linear_attn_config")
    if lin_raw is not None and not isinstance(lin_raw, dict):
        raise ConfigError(f"{source}: field 'linear_attn_config' must be an object, got {show(lin_raw)}")
    lin = lin_raw or {}
    lg = _Getter(lin, source, "linear_attn_config.")
    attn_kinds = (arch.attention,) * num_layers if arch.attention else _attn_kinds(text, lin, num_layers, source)
    mlp_kinds = _mlp_kinds(g, num_layers, source)

    rope_raw = text.get("rope_scaling") or text.get("rope_parameters") or {}
    if not isinstance(rope_raw, dict):
        raise ConfigError(f"{source}: field 'rope_scaling' must be an object, got {show(rope_raw)}")
    unknown = sorted(_printable(k) for k in text if k not in _KNOWN_KEYS) + sorted(
        f"linear_attn_config.{_printable(k)}" for k in lin if k not in _KNOWN_LINEAR_ATTN_KEYS
    ) + sorted(f"rope_scaling.{_printable(k)}" for k in rope_raw if k not in _KNOWN_ROPE_KEYS)
    if unknown:
        warnings.warn(f"{source}: ignoring unknown config keys: {', '.join(unknown)}", stacklevel=2)

    has_kda, has_mla, has_moe = "kda" in attn_kinds, "mla" in attn_kinds, "moe" in mlp_kinds
    kda_heads, kda_dim = lg.opt_int("num_heads"), lg.opt_int("head_dim")
    kda = KDAConfig(
        num_heads=kda_heads if kda_heads is not None else g.opt_int("linear_num_heads") or 0,
        head_dim=kda_dim if kda_dim is not None else g.opt_int("linear_head_dim") or 0,
        conv_kernel=lg.int("short_conv_kernel_size", g.int("linear_conv_kernel_dim", 4, low=1), low=1),
        gate_lower_bound=lg.opt_float("gate_lower_bound", sign=-1),
        full_rank_gate=lg.bool("use_full_rank_gate", False),
    )
    if has_kda and (kda.num_heads <= 0 or kda.head_dim <= 0):
        raise ConfigError(f"{source}: KDA layers present but linear_attn_config.num_heads/head_dim missing")
    mla = MLAConfig(
        num_heads=g.int("num_attention_heads", low=int(has_mla)),
        q_lora_rank=g.opt_int("q_lora_rank", low=1),
        kv_lora_rank=g.int("kv_lora_rank", low=int(has_mla)),
        qk_nope_head_dim=g.int("qk_nope_head_dim", low=int(has_mla)),
        qk_rope_head_dim=g.int("qk_rope_head_dim"),
        v_head_dim=g.int("v_head_dim", low=int(has_mla)),
        output_gate=g.bool("mla_use_output_gate", False),
        use_nope=g.bool("mla_use_nope", not arch.rotary),
        rope=_rope(g, rope_raw, source) if arch.rotary else None,
    )
    if not mla.use_nope and mla.rope is None:
        raise ConfigError(f"{source}: mla_use_nope=false (rotary MLA) is supported for DeepSeek-V3 "
                          f"(model_type deepseek_v3 / kimi_k2) only; Kimi Linear and K3 use NoPE")
    if mla.rope is not None and (mla.qk_rope_head_dim == 0 or mla.qk_rope_head_dim % 2):
        raise ConfigError(f"{source}: qk_rope_head_dim={mla.qk_rope_head_dim} must be even and positive "
                          f"(rotary dims come in pairs)")
    scoring = g.first(("moe_router_activation_func", "scoring_func"), "sigmoid")
    if scoring not in ("sigmoid", "softmax"):
        raise ConfigError(f"{source}: moe_router_activation_func={show(scoring)}; expected 'sigmoid' or 'softmax'")
    num_experts = g.first_int(("num_experts", "n_routed_experts", "num_local_experts"), low=int(has_moe),
                              high=MAX_EXPERTS)
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=g.first_int(("num_experts_per_token", "num_experts_per_tok")),
        num_shared_experts=g.first_int(("num_shared_experts", "n_shared_experts"), 0, high=MAX_EXPERTS),
        expert_dim=g.int("moe_intermediate_size", low=int(has_moe)),
        latent_dim=g.opt_int("routed_expert_hidden_size"),  # 0 or absent: experts run at full width
        latent_norm=g.bool("latent_moe_use_norm", False),
        scoring=scoring,
        renormalize=g.first_bool(("moe_renormalize", "norm_topk_prob"), True),
        routed_scaling_factor=g.float("routed_scaling_factor", 1.0),
        num_groups=g.first_int(("num_expert_group", "n_group"), 1, high=MAX_EXPERTS) or 1,  # 0 means no groups
        topk_group=g.int("topk_group", 1, high=MAX_EXPERTS) or 1,
    )
    if has_moe:
        _check_routing(moe, source)

    act = text.get("hidden_act", "silu")
    if act not in ("situ", "silu"):
        raise ConfigError(f"{source}: hidden_act={show(act)} is not supported (expected 'situ' or 'silu')")
    vocab_size = g.int("vocab_size", low=1)
    tokens = _Getter({**raw, **text}, source)  # token ids may sit at the top of K3's wrapper or in text_config
    quant_raw = text.get("quantization_config") or raw.get("quantization_config")
    if quant_raw and not isinstance(quant_raw, dict):
        raise ConfigError(f"{source}: field 'quantization_config' must be an object, got {show(quant_raw)}")
    quant = _quant_scheme(quant_raw, source)

    cfg = ModelConfig(
        arch=arch.name,
        hidden_size=g.int("hidden_size", low=1),
        num_layers=num_layers,
        vocab_size=vocab_size,
        attn_kinds=attn_kinds,
        mlp_kinds=mlp_kinds,
        intermediate_size=g.int("intermediate_size", low=int("dense" in mlp_kinds)),
        hidden_act=act,
        situ_beta=g.float("activation_situ_beta", 4.0),
        situ_linear_beta=g.float("activation_situ_linear_beta", 25.0),
        attn_res_block_size=g.opt_int("attn_res_block_size"),  # 0 or absent: no attention residuals
        rms_norm_eps=g.float("rms_norm_eps", 1e-5),
        tie_word_embeddings=tokens.bool("tie_word_embeddings", False),
        kda=kda,
        mla=mla,
        moe=moe,
        quant=quant,
        weight_prefix="language_model." if wrapped else "",
        eos_token_ids=tokens.token_ids("eos_token_id", vocab_size),
        bos_token_id=tokens.opt_int("bos_token_id", high=vocab_size - 1),
        pad_token_id=tokens.opt_int("pad_token_id", high=vocab_size - 1),
        max_position_embeddings=g.first_int(("max_position_embeddings", "model_max_length"), 1 << 20, low=1,
                                            high=MAX_POSITIONS),
        mtp_layers=g.int(arch.mtp_key, 0, high=MAX_LAYERS) if arch.mtp_key else 0,
        unknown_keys=tuple(unknown),
    )
    return cfg


def _check_routing(m: MoEConfig, source: str) -> None:
    """top_k and DeepSeek-V3 expert groups must describe a choice the router can make."""
    if not 0 < m.top_k <= m.num_experts:
        raise ConfigError(f"{source}: num_experts_per_token={m.top_k} must be in 1..num_experts={m.num_experts}")
    if m.num_groups <= 1:
        return
    per_group = m.num_experts // m.num_groups
    if m.num_experts % m.num_groups or per_group < 2:  # a group's score is the sum of its top 2 experts
        raise ConfigError(f"{source}: num_expert_group={m.num_groups} must split num_experts={m.num_experts} "
                          f"into equal groups of at least 2 experts")
    if not m.topk_group <= m.num_groups or m.top_k > m.topk_group * per_group:
        raise ConfigError(f"{source}: topk_group={m.topk_group} must be in 1..num_expert_group={m.num_groups} and "
                          f"keep at least num_experts_per_token={m.top_k} experts ({per_group} per group)")


def _printable(key: str) -> str:
    return key if key.isprintable() else show(key)


def _detect_arch(model_type: object, names: tuple[str, ...], text: dict, source: str) -> archs.Arch:
    arch = archs.detect(model_type, names, text)
    if arch is None:
        raise ConfigError(
            f"{source}: unknown architecture (model_type={show(model_type)}, architectures={show(list(names))}); "
            f"moeswap runs: {', '.join(archs.REGISTRY)}"
        )
    return arch


def _attn_kinds(text: dict, lin: dict, n: int, source: str) -> tuple[str, ...]:
    if "kda_layers" in lin and "full_attn_layers" in lin:
        kinds: list[str | None] = [None] * n
        for key, kind in (("kda_layers", "kda"), ("full_attn_layers", "mla")):
            if not isinstance(lin[key], list):
                raise ConfigError(f"{source}: linear_attn_config.{key} must be a list of 1-based layer "
                                  f"numbers, got {show(lin[key])}")
            for one_based in lin[key]:
                if not (isinstance(one_based, int) and not isinstance(one_based, bool) and 1 <= one_based <= n):
                    raise ConfigError(
                        f"{source}: linear_attn_config.{key} lists layer {show(one_based)}, not an integer in "
                        f"1..{n} (1-based)"
                    )
                if kinds[one_based - 1] is not None:
                    raise ConfigError(f"{source}: layer {one_based} (1-based) is listed as both KDA and MLA")
                kinds[one_based - 1] = kind
        missing = [i + 1 for i, k in enumerate(kinds) if k is None]
        if missing:
            raise ConfigError(
                f"{source}: linear_attn_config lists neither KDA nor MLA for layers {show(missing)} (1-based)"
            )
        return tuple(kinds)  # type: ignore[arg-type]
    types = text.get("layer_types")
    if types:
        names = {"linear_attention": "kda", "full_attention": "mla", "kda": "kda", "mla": "mla"}
        if not isinstance(types, list) or len(types) != n or any(not isinstance(t, str) or t not in names
                                                                  for t in types):
            raise ConfigError(
                f"{source}: layer_types must list {n} entries of 'linear_attention'/'full_attention', "
                f"got {show(types)}"
            )
        return tuple(names[t] for t in types)
    raise ConfigError(
        f"{source}: cannot tell KDA from MLA layers: need linear_attn_config.kda_layers/full_attn_layers "
        "or layer_types (moeswap never guesses the pattern)"
    )


def _mlp_kinds(g: _Getter, n: int, source: str) -> tuple[str, ...]:
    types = g.d.get("mlp_layer_types")
    if types:
        names = {"dense": "dense", "sparse": "moe", "moe": "moe"}
        if not isinstance(types, list) or len(types) != n or any(not isinstance(t, str) or t not in names
                                                                  for t in types):
            raise ConfigError(f"{source}: mlp_layer_types must list {n} entries of 'dense'/'sparse', "
                              f"got {show(types)}")
        return tuple(names[t] for t in types)
    k = g.int("first_k_dense_replace", 0, high=MAX_LAYERS)
    freq = g.int("moe_layer_freq", 1, high=MAX_LAYERS) or 1
    return tuple("dense" if i < k or (i - k) % freq else "moe" for i in range(n))


def _rope(g: _Getter, r: dict, source: str) -> RopeConfig:
    """A rotary architecture's (DeepSeek-V3's) `rope_scaling` (published files) or `rope_parameters`
    (transformers 5, which moves rope_theta inside it); kind "yarn" or none/"default"."""
    rg = _Getter(r, source, "rope_scaling.")
    kind = r.get("rope_type", r.get("type", "default"))
    if kind not in ("yarn", "default"):
        raise ConfigError(f"{source}: rope_scaling type {show(kind)} is not supported for DeepSeek-V3 "
                          f"(expected 'yarn' or 'default')")
    theta = rg.float("rope_theta", g.float("rope_theta", 10000.0))
    interleave = g.bool("rope_interleave", True)
    if kind == "default":
        return RopeConfig(theta=theta, interleave=interleave)
    original = rg.int("original_max_position_embeddings", low=1, high=MAX_POSITIONS)
    truncate = rg.bool("truncate", True)
    return RopeConfig(
        # transformers: a missing factor is the ratio of the context lengths
        theta=theta, interleave=interleave, yarn=True,
        factor=rg.float("factor", g.float("max_position_embeddings", float(original)) / original),
        original_max_positions=original, beta_fast=rg.float("beta_fast", 32.0),
        beta_slow=rg.float("beta_slow", 1.0), mscale=rg.float("mscale", 0.0) if r.get("mscale") else 0.0,
        mscale_all_dim=rg.float("mscale_all_dim", 0.0) if r.get("mscale_all_dim") else 0.0,
        attention_factor=rg.opt_float("attention_factor", sign=1), truncate=truncate)


def _quant_scheme(q: dict | None, source: str) -> QuantScheme | None:
    if not q:
        return None
    if q.get("quant_method") == "fp8":
        from moeswap.formats import fp8_block

        try:
            block = fp8_block.block_size(q, source)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        ignore = q.get("modules_to_not_convert") or ()
        if not isinstance(ignore, (list, tuple)) or not all(isinstance(m, str) for m in ignore):
            raise ConfigError(f"{source}: quantization_config.modules_to_not_convert must be a list of names, "
                              f"got {show(ignore)}")
        return QuantScheme(format="fp8_block", group_size=block[1], ignore=tuple(ignore), fp8_block=block)
    from moeswap.formats.compressed_tensors import parse_quantization_config

    try:
        scheme = parse_quantization_config(q, source)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return QuantScheme(format=scheme.format, group_size=scheme.group_size, ignore=scheme.ignore,
                       dense_format=scheme.dense_format)


class _Getter:
    """Reads fields of one JSON object, checking type and range; errors name the field and the value.
    A null value counts as absent."""

    def __init__(self, d: dict, source: str, prefix: str = ""):
        self.d, self.source, self.prefix = d, source, prefix

    def _value(self, key: str, default: Any) -> tuple[bool, Any]:
        """(present, value): a missing required field (default ...) is an error here."""
        v = self.d.get(key)
        if v is None and default is ...:
            raise ConfigError(f"{self.source}: required field '{self.prefix}{key}' is missing")
        return v is not None, v

    def int(self, key: str, default: Any = ..., low: int = 0, high: int = MAX_SIZE) -> int:
        present, v = self._value(key, default)
        return self._int(key, v, low, high) if present else default

    def opt_int(self, key: str, low: int = 0, high: int = MAX_SIZE) -> int | None:
        return self.int(key, None, low, high)

    def _int(self, key: str, v: Any, low: int, high: int) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"{self.source}: field '{self.prefix}{key}' must be a non-negative integer, "
                              f"got {show(v)}")
        if not low <= v <= high:
            raise ConfigError(f"{self.source}: field '{self.prefix}{key}' must be in {low}..{high}, got {v}")
        return v

    def float(self, key: str, default: float) -> float:
        v = self.opt_float(key, sign=1)
        return default if v is None else v

    def opt_float(self, key: str, sign: int) -> float | None:
        """A number whose sign is `sign` and whose magnitude is a normal, finite fp32 (the model computes
        with it in fp32: NaN, Inf, zero or a wrong sign would make every output garbage)."""
        v = self.d.get(key)
        if v is None:
            return None
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        if ok:
            try:
                f = float(v)
            except OverflowError:  # an int too large for a float
                ok = False
            else:
                ok = math.isfinite(f) and FP32_TINY <= sign * f <= FP32_MAX
        if not ok:
            which = "positive" if sign > 0 else "negative"
            raise ConfigError(f"{self.source}: field '{self.prefix}{key}' must be a finite {which} number "
                              f"(magnitude {FP32_TINY:.2g} to {FP32_MAX:.2g}, as fp32 holds), got {show(v)}")
        return f

    def bool(self, key: str, default: bool) -> bool:
        present, v = self._value(key, default)
        if not present:
            return default
        if not isinstance(v, bool):
            raise ConfigError(f"{self.source}: field '{self.prefix}{key}' must be true or false, got {show(v)}")
        return v

    def str_list(self, key: str) -> tuple[str, ...]:
        v = self.d.get(key) or []
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise ConfigError(f"{self.source}: field '{self.prefix}{key}' must be a list of names, got {show(v)}")
        return tuple(v)

    def token_ids(self, key: str, vocab_size: int) -> tuple[int, ...]:
        v = self.d.get(key)
        ids = v if isinstance(v, list) else [] if v is None else [v]
        return tuple(self._int(key, i, 0, vocab_size - 1) for i in ids)

    def _first_key(self, keys: tuple[str, ...], default: Any) -> str | None:
        for k in keys:
            if self.d.get(k) is not None:
                return k
        if default is ...:
            raise ConfigError(f"{self.source}: required field '{keys[0]}' (or {', '.join(keys[1:])}) is missing")
        return None

    def first(self, keys: tuple[str, ...], default: Any = ...) -> Any:
        k = self._first_key(keys, default)
        return default if k is None else self.d[k]

    def first_int(self, keys: tuple[str, ...], default: Any = ..., low: int = 0, high: int = MAX_SIZE) -> int:
        k = self._first_key(keys, default)
        return default if k is None else self.int(k, low=low, high=high)

    def first_bool(self, keys: tuple[str, ...], default: bool) -> bool:
        k = self._first_key(keys, default)
        return default if k is None else self.bool(k, default)


def routed_expert_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """One routed expert's weight shapes [out, in] by checkpoint projection name: w1 (gate) and w3 (up)
    [F, I], w2 (down) [I, F], where I is the latent width when the MoE has one (K3), else the model width."""
    width, f = config.moe.latent_dim or config.hidden_size, config.moe.expert_dim
    return {"w1": (f, width), "w3": (f, width), "w2": (width, f)}
