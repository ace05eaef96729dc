"""The torch models. `build_model(config)` builds the class its architecture's description names
(moeswap.archs); `routed_expert_shapes(config)` gives one routed expert's matrices, which no model holds
as parameters. Torch-free: a model's module is imported only when built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moeswap import archs

if TYPE_CHECKING:
    from moeswap.config import ModelConfig


def build_model(config: ModelConfig, **kwargs):
    return archs.get(config.arch).model()(config, **kwargs)


def routed_expert_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """One routed expert's weight shapes [out, in] by checkpoint projection name: w1 (gate) and w3 (up)
    [F, I], w2 (down) [I, F], where I is the latent width when the MoE has one (K3), else the model width."""
    width, f = config.moe.latent_dim or config.hidden_size, config.moe.expert_dim
    return {"w1": (f, width), "w3": (f, width), "w2": (width, f)}
