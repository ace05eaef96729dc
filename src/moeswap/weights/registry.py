"""The registry of weight formats: plain dicts the loader, the expert store and quantize ask, and the one
choice of a dense Linear's method (`choose_linear_method`). A new format registers here.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moeswap.weights.dense import FLOAT_LINEAR, LinearMethod
from moeswap.weights.floating import BF16_STORED
from moeswap.weights.fp8_block import FP8_BLOCK_KEPT

# the methods that keep a dense weight as stored, asked in order; FLOAT_LINEAR (decoded to the compute dtype)
# is what no other keeps
LINEAR_METHODS: dict[str, LinearMethod] = {m.name: m for m in (FLOAT_LINEAR, BF16_STORED, FP8_BLOCK_KEPT)}


def linear_method_named(name: str) -> LinearMethod:
    return LINEAR_METHODS[name]


def choose_linear_method(stored: str, dtypes: Mapping[str, torch.dtype], block: tuple[int, int] | None,
                         compute: torch.dtype, device: str, dense_weights: str, keepable: bool) -> LinearMethod:
    """The method a dense weight gets at load: one that keeps it as stored (format `stored`, tensor dtypes by
    suffix, config.json's FP8 block) where --dense-weights allows, the layer can (`keepable`: a bias-free
    nn.Linear's weight) and a kernel runs it under `compute` on `device`; else FLOAT_LINEAR."""
    if dense_weights != "compute" and keepable:
        for method in LINEAR_METHODS.values():
            if method.keeps(stored, dtypes, block, compute, device):
                return method
    return FLOAT_LINEAR
