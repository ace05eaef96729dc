"""The architectures moeswap runs, by name: a plain dict of `Arch` descriptions (one file each here), which
config.py asks to recognise a config.json and the loader, init-tiny and the planner ask for names and
layouts. Torch-free: an architecture's model class is imported only when one is built.
Entry points: `REGISTRY`, `get(name)`, `detect(model_type, architectures, text)`.
"""

from __future__ import annotations

from moeswap.archs import deepseek_v3, kimi_k3, kimi_linear
from moeswap.archs.base import Arch

# Order: the CLI's --arch choices and error messages list them so
REGISTRY: dict[str, Arch] = {a.name: a for a in (kimi_k3.ARCH, kimi_linear.ARCH, deepseek_v3.ARCH)}


def get(name: str) -> Arch:
    if name not in REGISTRY:
        raise ValueError(f"unknown architecture {name!r}; known: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def detect(model_type: object, architectures: tuple[str, ...], text: dict) -> Arch | None:
    """The architecture recognising config.json with the highest rank (the first registered of equals);
    None: none does."""
    ranked = [(rank, -i, a) for i, a in enumerate(REGISTRY.values())
              if (rank := a.recognises(model_type, architectures, text)) is not None]
    return max(ranked, key=lambda r: r[:2])[2] if ranked else None


__all__ = ["Arch", "REGISTRY", "detect", "get"]
