"""Model architectures. `build_model(config)` picks the file for `config.arch` through a plain dict;
`routed_expert_shapes(config)` gives one routed expert's matrices, which no model holds as parameters.
Torch-free: an architecture's module is imported only when built."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moeswap.config import ModelConfig

# arch -> "module:Class"; imported lazily so a CLI call loads only what it runs.
REGISTRY = {
    "kimi_k3": "moeswap.models.kimi_k3:KimiModel",
    "kimi_linear": "moeswap.models.kimi_k3:KimiModel",
    "deepseek_v3": "moeswap.models.deepseek_v3:DeepseekV3Model",  # also Kimi K2
}


def model_class(arch: str):
    import importlib

    if arch not in REGISTRY:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(sorted(REGISTRY))}")
    module, cls = REGISTRY[arch].split(":")
    return getattr(importlib.import_module(module), cls)


def build_model(config: ModelConfig, **kwargs):
    return model_class(config.arch)(config, **kwargs)


def routed_expert_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """One routed expert's weight shapes [out, in] by checkpoint projection name: w1 (gate) and w3 (up)
    [F, I], w2 (down) [I, F], where I is the latent width when the MoE has one (K3), else the model width."""
    width, f = config.moe.latent_dim or config.hidden_size, config.moe.expert_dim
    return {"w1": (f, width), "w3": (f, width), "w2": (width, f)}


def classify_name(checkpoint_map, name: str):
    """A (prefix-stripped) checkpoint name through an architecture's CHECKPOINT_MAP, (pattern, target)
    pairs, first match wins: ('expert' | 'skip' | the parameter's name, the match)."""
    import re

    for pattern, target in checkpoint_map:
        m = re.fullmatch(pattern, name)
        if m:
            return (target if target in ("expert", "skip") else m.expand(target)), m
    raise AssertionError("CHECKPOINT_MAP ends with a catch-all")
