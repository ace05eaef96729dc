"""Model architectures. `build_model(config)` picks the file for `config.arch` through a plain dict."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moeswap.config import ModelConfig

# arch -> "module:Class"; imported lazily so a CLI call loads only what it runs.
REGISTRY = {
    "kimi_k3": "moeswap.models.kimi_k3:KimiModel",
    "kimi_linear": "moeswap.models.kimi_k3:KimiModel",
}


def model_class(arch: str):
    import importlib

    if arch not in REGISTRY:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(sorted(REGISTRY))}")
    module, cls = REGISTRY[arch].split(":")
    return getattr(importlib.import_module(module), cls)


def build_model(config: ModelConfig, **kwargs):
    return model_class(config.arch)(config, **kwargs)
