"""The torch models. `build_model(config)` builds the class its architecture's description names
(moeswap.archs). Torch-free: a model's module is imported only when built. (One routed expert's matrices,
which no model holds as parameters: config.routed_expert_shapes.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moeswap import archs

if TYPE_CHECKING:
    from moeswap.config import ModelConfig


def build_model(config: ModelConfig, **kwargs):
    return archs.get(config.arch).model()(config, **kwargs)
