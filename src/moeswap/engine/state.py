"""Per-sequence state of a batch (KDA recurrent + conv state, MLA latent cache): stacking sequences
that were prefilled one by one into a decode batch. The AttnRes bank is per token (it mixes depth,
not time), so nothing of it carries between steps; pipeline stages hand it over within a step.
"""

from __future__ import annotations

import torch

from moeswap.models.kimi_k3 import ModelState
from moeswap.models.layers.kda import KDAState
from moeswap.models.layers.mla import MLACache


def stack_states(states: list[ModelState]) -> ModelState:
    """One batched state from single-sequence states, layer by layer (MLA caches padded to one capacity)."""
    layers = []
    for per_seq in zip(*(s.layers for s in states)):
        first = per_seq[0]
        if isinstance(first, KDAState):
            layers.append(KDAState(torch.cat([s.recurrent_BHKK for s in per_seq]),
                                   torch.cat([s.conv_BWC for s in per_seq])))
        else:
            cap = max(s.latent_BSX.shape[1] for s in per_seq)
            padded = [torch.nn.functional.pad(s.latent_BSX, (0, 0, 0, cap - s.latent_BSX.shape[1])) for s in per_seq]
            layers.append(MLACache(torch.cat(padded), torch.cat([s.lengths_B for s in per_seq])))
    return ModelState(layers)
