"""LoRAConfig: what an adapter is (rank, alpha, dropout, targets, rsLoRA, shared expert A) and its files'
form, both ways.

`adapter_config.json` holds PEFT's own keys only (those PEFT 0.17+ reads for a LoRA adapter, with their PEFT
defaults), so PEFT loads it without a word; what moeswap adds (the base model's fingerprint, the routed-expert
options) is `moeswap_adapter.json` beside it. moeswap before this wrote that section as a `moeswap` key inside
adapter_config.json (PEFT warned "Unexpected keyword arguments"); such adapters still load. Knows nothing of
models. Entry points: `LoRAConfig`, `.to_peft(...)`, `.to_moeswap(...)`, `LoRAConfig.from_peft(dict, ours)`,
`moeswap_section(raw, side)`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from moeswap.lora.layer import lora_scaling

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
MOESWAP_NAME = "moeswap_adapter.json"  # moeswap's own fields, beside adapter_config.json
LEGACY_KEY = "moeswap"  # where moeswap wrote them before: a key of adapter_config.json (still read)
FORMAT_VERSION = 1

# What PEFT writes for a plain LoRA (PEFT 0.17's LoraConfig fields with their defaults), beside the fields
# set from the config: a loader that knows only these finds nothing unexpected.
_PEFT_DEFAULTS = {
    "auto_mapping": None, "revision": None, "inference_mode": True, "fan_in_fan_out": False, "bias": "none",
    "lora_bias": False, "use_dora": False, "init_lora_weights": True, "modules_to_save": None,
    "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
    "exclude_modules": None, "target_parameters": None, "megatron_config": None, "megatron_core": "megatron.core",
    "loftq_config": {}, "layer_replication": None,
}


@dataclass(frozen=True)
class LoRAConfig:
    """target_modules: PEFT's two forms, a list of name suffixes (`q_proj` matches every module whose name
    is `q_proj` or ends in `.q_proj`) or one regex matched with re.fullmatch against full module names."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = ("q_proj", "k_proj", "v_proj", "o_proj")
    use_rslora: bool = False
    expert_shared_a: bool = False  # routed experts: one A per projection and layer, B per expert
    # per-module rank and alpha, PEFT's rank_pattern / alpha_pattern (read from adapters PEFT made)
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    # PEFT's LoRA on parameters (ParamWrapper), e.g. transformers' fused routed experts `experts.gate_up_proj`:
    # read from adapters PEFT made (lora.fused_experts maps them onto the experts); target_modules may then be []
    target_parameters: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 1:
            raise ValueError(f"LoRA rank r must be a positive integer, got {self.r!r}")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be a positive number, got {self.alpha!r}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        targets = self.target_modules
        if isinstance(targets, str):
            try:
                re.compile(targets)
            except re.error as err:
                raise ValueError(f"target_modules {targets!r} is not a valid regex: {err}") from None
        else:
            targets = tuple(targets)
            if (not targets and not self.target_parameters) or not all(isinstance(t, str) and t for t in targets):
                raise ValueError(f"target_modules must be a regex or a non-empty list of names, got {targets!r}")
            object.__setattr__(self, "target_modules", tuple(sorted(set(targets))))  # a set, as PEFT's

    def scaling(self) -> float:
        return lora_scaling(self.r, self.alpha, self.use_rslora)

    def rank_alpha(self, module: str) -> tuple[int, float]:
        """The rank and alpha of one module under rank_pattern / alpha_pattern (PEFT's rule: a pattern
        matches a name that is it or ends in `.` + it, read as a regex)."""
        return (_pattern_value(self.rank_pattern, module, self.r),
                _pattern_value(self.alpha_pattern, module, self.alpha))

    # -- PEFT's adapter_config.json ------------------------------------------------------------------

    def to_peft(self, base_model: str | None = None) -> dict:
        """adapter_config.json: PEFT's keys only."""
        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return {
            **_PEFT_DEFAULTS,
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": self.r, "lora_alpha": self.alpha, "lora_dropout": self.dropout, "target_modules": targets,
            "use_rslora": self.use_rslora, "rank_pattern": dict(self.rank_pattern),
            "alpha_pattern": dict(self.alpha_pattern),
            "target_parameters": list(self.target_parameters) or None,
        }

    def to_moeswap(self, fingerprint: dict | None = None) -> dict:
        """moeswap_adapter.json: the base model's fingerprint (lora.fingerprint) and the routed-expert options."""
        return {"format_version": FORMAT_VERSION, "base_fingerprint": fingerprint,
                "expert_shared_a": self.expert_shared_a}

    @classmethod
    def from_peft(cls, raw: object, where: str, ours: dict | None = None) -> LoRAConfig:
        """From a parsed adapter_config.json and moeswap's section (`moeswap_section`; None: an adapter made
        elsewhere); anything moeswap cannot apply exactly is a ValueError naming it.

        target_parameters: PEFT's LoRA of parameters rather than modules (lora.fused_experts takes those of
        fused routed experts; plan_adapter refuses the others by name)."""
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: expected a JSON object, found {type(raw).__name__}")
        if raw.get("peft_type") != "LORA":
            raise ValueError(f"{where}: peft_type is {raw.get('peft_type')!r}; moeswap applies LORA adapters only")
        unsupported = {"use_dora": False, "fan_in_fan_out": False, "lora_bias": False, "bias": "none",
                       "modules_to_save": None, "layer_replication": None,
                       "trainable_token_indices": None, "alora_invocation_tokens": None}
        for key, plain in unsupported.items():
            value = raw.get(key, plain)
            if value not in (plain, [], {}) and not (key == "bias" and value is None):
                raise ValueError(f"{where}: {key} = {value!r} is not supported (moeswap applies plain LoRA: "
                                 f"{key} must be {plain!r})")
        ours = ours or {}
        parameters = raw.get("target_parameters") or ()
        if not isinstance(parameters, (list, tuple)) or not all(isinstance(p, str) and p for p in parameters):
            raise ValueError(f"{where}: target_parameters must be a list of parameter names, got {parameters!r}")
        try:
            return cls(r=raw.get("r"), alpha=raw.get("lora_alpha"), dropout=raw.get("lora_dropout", 0.0) or 0.0,
                       target_modules=raw.get("target_modules") or (), target_parameters=tuple(parameters),
                       use_rslora=bool(raw.get("use_rslora", False)),
                       expert_shared_a=bool(ours.get("expert_shared_a", False)),
                       rank_pattern=_checked_pattern(raw.get("rank_pattern"), "rank_pattern", where),
                       alpha_pattern=_checked_pattern(raw.get("alpha_pattern"), "alpha_pattern", where))
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None


def moeswap_section(raw: dict, side: object | None, where: str) -> dict | None:
    """moeswap's fields of an adapter: `side` (moeswap_adapter.json parsed; None: no such file), else the
    `moeswap` key older moeswap wrote into adapter_config.json `raw`, else None (made elsewhere, e.g. by PEFT)."""
    ours = side if side is not None else raw.get(LEGACY_KEY) if isinstance(raw, dict) else None
    if ours is not None and not isinstance(ours, dict):
        what = MOESWAP_NAME if side is not None else f"{LEGACY_KEY!r} of adapter_config.json"
        raise ValueError(f"{where}: {what} must be a JSON object, found {type(ours).__name__}")
    return ours


def base_fingerprint(ours: dict | None) -> dict | None:
    """The base fingerprint moeswap's section of an adapter records (None: made elsewhere, e.g. by PEFT)."""
    return ours.get("base_fingerprint") if isinstance(ours, dict) else None


def _checked_pattern(value: object, key: str, where: str) -> dict:
    if value in (None, {}):
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, (int, float))
                                              and not isinstance(v, bool) for k, v in value.items()):
        raise ValueError(f"{where}: {key} must map module patterns to numbers")
    return dict(value)


def _pattern_value(patterns: dict, module: str, default):
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default
