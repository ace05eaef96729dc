"""ModelConfig: the frozen description of a model, read from a checkpoint's config.json.

Owns: unwrapping K3's multimodal `text_config`, both key spellings (Kimi and DeepSeek/transformers),
layer kinds from `linear_attn_config` (1-based lists) or `layer_types`/`mlp_layer_types`, and the
compressed-tensors quantization scheme. Knows nothing of tensors or files beyond config.json.
Entry points: `load_config(path)` (a directory or a config.json) and `parse_config(dict)`.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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
}
_KNOWN_LINEAR_ATTN_KEYS = {
    "kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size",
    "gate_lower_bound", "use_full_rank_gate",
}


@dataclass(frozen=True)
class QuantScheme:
    """compressed-tensors quantization of the routed experts (the only quantised tensors moeswap reads)."""

    format: str  # "mxfp4-pack-quantized", ...
    group_size: int
    ignore: tuple[str, ...] = ()  # "re:<regex>" or exact module names left unquantised

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
class MLAConfig:
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    output_gate: bool
    use_nope: bool


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
    unknown_keys: tuple[str, ...] = field(default=(), compare=False)

    def layer_summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for a, m in zip(self.attn_kinds, self.mlp_kinds):
            out[f"{a}+{m}"] = out.get(f"{a}+{m}", 0) + 1
        return out


def load_config(path: str | Path) -> ModelConfig:
    """Read `path` (a model directory or a config.json file)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise ConfigError(f"{file}: no config.json found (expected a model directory or a config.json path)")
    try:
        raw = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    return parse_config(raw, source=str(file))


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object at the top level")
    archs = tuple(raw.get("architectures") or ())
    wrapped = "text_config" in raw
    text = raw["text_config"] if wrapped else raw
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: field 'text_config' must be an object")
    model_type = raw.get("model_type", text.get("model_type"))
    if wrapped:
        archs += tuple(text.get("architectures") or ())
    arch = _detect_arch(model_type, archs, text, source)
    g = _Getter(text, source)

    num_layers = g.int("num_hidden_layers")
    attn_kinds = _attn_kinds(text, num_layers, source)
    mlp_kinds = _mlp_kinds(text, num_layers, source)

    lin = text.get("linear_attn_config") or {}
    unknown = sorted(k for k in text if k not in _KNOWN_KEYS) + sorted(
        f"linear_attn_config.{k}" for k in lin if k not in _KNOWN_LINEAR_ATTN_KEYS
    )
    if unknown:
        warnings.warn(f"{source}: ignoring unknown config keys: {', '.join(unknown)}", stacklevel=2)

    kda = KDAConfig(
        num_heads=int(lin.get("num_heads", text.get("linear_num_heads", 0)) or 0),
        head_dim=int(lin.get("head_dim", text.get("linear_head_dim", 0)) or 0),
        conv_kernel=int(lin.get("short_conv_kernel_size", text.get("linear_conv_kernel_dim", 4))),
        gate_lower_bound=lin.get("gate_lower_bound"),
        full_rank_gate=bool(lin.get("use_full_rank_gate", False)),
    )
    if "kda" in attn_kinds and (kda.num_heads <= 0 or kda.head_dim <= 0):
        raise ConfigError(f"{source}: KDA layers present but linear_attn_config.num_heads/head_dim missing")
    mla = MLAConfig(
        num_heads=g.int("num_attention_heads"),
        q_lora_rank=g.opt_int("q_lora_rank"),
        kv_lora_rank=g.int("kv_lora_rank"),
        qk_nope_head_dim=g.int("qk_nope_head_dim"),
        qk_rope_head_dim=g.int("qk_rope_head_dim"),
        v_head_dim=g.int("v_head_dim"),
        output_gate=bool(text.get("mla_use_output_gate", False)),
        use_nope=bool(text.get("mla_use_nope", True)),
    )
    if not mla.use_nope:
        raise ConfigError(f"{source}: mla_use_nope=false (rotary MLA) is not supported; Kimi models use NoPE")
    scoring = g.first(("moe_router_activation_func", "scoring_func"), "sigmoid")
    if scoring not in ("sigmoid", "softmax"):
        raise ConfigError(f"{source}: moe_router_activation_func={scoring!r}; expected 'sigmoid' or 'softmax'")
    moe = MoEConfig(
        num_experts=int(g.first(("num_experts", "n_routed_experts", "num_local_experts"))),
        top_k=int(g.first(("num_experts_per_token", "num_experts_per_tok"))),
        num_shared_experts=int(g.first(("num_shared_experts", "n_shared_experts"), 0)),
        expert_dim=g.int("moe_intermediate_size"),
        latent_dim=g.opt_int("routed_expert_hidden_size"),
        latent_norm=bool(text.get("latent_moe_use_norm", False)),
        scoring=scoring,
        renormalize=bool(g.first(("moe_renormalize", "norm_topk_prob"), True)),
        routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
        num_groups=int(g.first(("num_expert_group", "n_group"), 1) or 1),
        topk_group=int(text.get("topk_group", 1) or 1),
    )
    if "moe" in mlp_kinds and not (0 < moe.top_k <= moe.num_experts):
        raise ConfigError(f"{source}: num_experts_per_token={moe.top_k} must be in 1..num_experts={moe.num_experts}")

    act = text.get("hidden_act", "silu")
    if act not in ("situ", "silu"):
        raise ConfigError(f"{source}: hidden_act={act!r} is not supported (expected 'situ' or 'silu')")
    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    quant = _quant_scheme(text.get("quantization_config") or raw.get("quantization_config"), source)

    cfg = ModelConfig(
        arch=arch,
        hidden_size=g.int("hidden_size"),
        num_layers=num_layers,
        vocab_size=g.int("vocab_size"),
        attn_kinds=attn_kinds,
        mlp_kinds=mlp_kinds,
        intermediate_size=g.int("intermediate_size"),
        hidden_act=act,
        situ_beta=float(text.get("activation_situ_beta", 4.0)),
        situ_linear_beta=float(text.get("activation_situ_linear_beta", 25.0)),
        attn_res_block_size=g.opt_int("attn_res_block_size"),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))),
        kda=kda,
        mla=mla,
        moe=moe,
        quant=quant,
        weight_prefix="language_model." if wrapped else "",
        eos_token_ids=eos_ids,
        bos_token_id=text.get("bos_token_id", raw.get("bos_token_id")),
        pad_token_id=text.get("pad_token_id", raw.get("pad_token_id")),
        max_position_embeddings=int(g.first(("max_position_embeddings", "model_max_length"), 1 << 20)),
        unknown_keys=tuple(unknown),
    )
    return cfg


def _detect_arch(model_type: str | None, archs: tuple[str, ...], text: dict, source: str) -> str:
    if model_type == "kimi_k3" or "KimiK3ForConditionalGeneration" in archs:
        return "kimi_k3"
    if model_type == "kimi_linear" or "KimiLinearForCausalLM" in archs:
        # A text-only K3 file says kimi_linear too; K3's own features tell them apart.
        k3 = "attn_res_block_size" in text or "routed_expert_hidden_size" in text
        return "kimi_k3" if k3 else "kimi_linear"
    from moeswap.models import REGISTRY

    raise ConfigError(
        f"{source}: unknown architecture (model_type={model_type!r}, architectures={list(archs)}); "
        f"moeswap runs: {', '.join(REGISTRY)}"
    )


def _attn_kinds(text: dict, n: int, source: str) -> tuple[str, ...]:
    lin = text.get("linear_attn_config")
    if lin and "kda_layers" in lin and "full_attn_layers" in lin:
        kinds: list[str | None] = [None] * n
        for key, kind in (("kda_layers", "kda"), ("full_attn_layers", "mla")):
            for one_based in lin[key]:
                if not (isinstance(one_based, int) and not isinstance(one_based, bool) and 1 <= one_based <= n):
                    raise ConfigError(
                        f"{source}: linear_attn_config.{key} lists layer {one_based!r}, not an integer in 1..{n} (1-based)"
                    )
                if kinds[one_based - 1] is not None:
                    raise ConfigError(f"{source}: layer {one_based} (1-based) is listed as both KDA and MLA")
                kinds[one_based - 1] = kind
        missing = [i + 1 for i, k in enumerate(kinds) if k is None]
        if missing:
            raise ConfigError(
                f"{source}: linear_attn_config lists neither KDA nor MLA for layers {missing} (1-based)"
            )
        return tuple(kinds)  # type: ignore[arg-type]
    types = text.get("layer_types")
    if types:
        names = {"linear_attention": "kda", "full_attention": "mla", "kda": "kda", "mla": "mla"}
        if len(types) != n or any(t not in names for t in types):
            raise ConfigError(
                f"{source}: layer_types must list {n} entries of 'linear_attention'/'full_attention', got {types}"
            )
        return tuple(names[t] for t in types)
    raise ConfigError(
        f"{source}: cannot tell KDA from MLA layers: need linear_attn_config.kda_layers/full_attn_layers "
        "or layer_types (moeswap never guesses the pattern)"
    )


def _mlp_kinds(text: dict, n: int, source: str) -> tuple[str, ...]:
    types = text.get("mlp_layer_types")
    if types:
        names = {"dense": "dense", "sparse": "moe", "moe": "moe"}
        if len(types) != n or any(t not in names for t in types):
            raise ConfigError(f"{source}: mlp_layer_types must list {n} entries of 'dense'/'sparse', got {types}")
        return tuple(names[t] for t in types)
    k = int(text.get("first_k_dense_replace", 0))
    freq = int(text.get("moe_layer_freq", 1) or 1)
    return tuple("dense" if i < k or (i - k) % freq else "moe" for i in range(n))


def _quant_scheme(q: dict | None, source: str) -> QuantScheme | None:
    if not q:
        return None
    from moeswap.formats.compressed_tensors import parse_quantization_config

    try:
        scheme = parse_quantization_config(q, source)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return QuantScheme(format=scheme.format, group_size=scheme.group_size, ignore=scheme.ignore)


class _Getter:
    """Reads required/optional fields with errors that name the field."""

    def __init__(self, d: dict, source: str):
        self.d, self.source = d, source

    def int(self, key: str) -> int:
        if key not in self.d or self.d[key] is None:
            raise ConfigError(f"{self.source}: required field '{key}' is missing")
        v = self.d[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"{self.source}: field '{key}' must be a non-negative integer, got {v!r}")
        return v

    def opt_int(self, key: str) -> int | None:
        return None if self.d.get(key) is None else self.int(key)

    def first(self, keys: tuple[str, ...], default: Any = ...) -> Any:
        for k in keys:
            if self.d.get(k) is not None:
                return self.d[k]
        if default is ...:
            raise ConfigError(f"{self.source}: required field '{keys[0]}' (or {', '.join(keys[1:])}) is missing")
        return default
