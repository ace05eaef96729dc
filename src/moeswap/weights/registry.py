"""The registry of weight formats, plain dicts the loader, the expert store and quantize ask: FORMATS (name ->
format object), `for_suffixes` (the format of a set of stored tensors, their dtypes telling apart formats
stored under the same suffixes: MXFP8 and INT8), `format_of` (the format that computes
a kept expert), and the one choice of a dense Linear's method (`choose_linear_method`). A new format is one
file plus `register(its object)` here or from its own module.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moeswap.weights.dense import FLOAT_LINEAR, LinearMethod
from moeswap.weights.floating import FLOAT
from moeswap.weights.format import WeightFormat
from moeswap.weights.fp8_block import FP8_BLOCK
from moeswap.weights.int4 import INT4
from moeswap.weights.int8 import INT8
from moeswap.weights.mxfp4 import MXFP4
from moeswap.weights.mxfp8 import MXFP8

FORMATS: dict[str, WeightFormat] = {}
BY_SUFFIXES: dict[frozenset[str], list[WeightFormat]] = {}  # in registration order
BY_FORM: dict[type, WeightFormat] = {}  # kept expert form (ops.expert) -> the format that computes it
# the methods a dense Linear may get: FLOAT_LINEAR (values in the compute dtype), then those that keep a
# format's weight as stored, asked in order
LINEAR_METHODS: dict[str, LinearMethod] = {FLOAT_LINEAR.name: FLOAT_LINEAR}


def register(fmt: WeightFormat) -> WeightFormat:
    """Adds a format (and its dense method, if it has one) to every table; its name must be new. A format stored
    under another's suffixes must be told apart from it by dtypes (its `dtypes_fit`; the contract tests check)."""
    if fmt.name in FORMATS:
        raise ValueError(f"{fmt!r}: a format named {fmt.name!r} is registered")
    FORMATS[fmt.name] = fmt
    BY_SUFFIXES.setdefault(fmt.suffixes, []).append(fmt)
    if fmt.kept_form is not None:
        BY_FORM.setdefault(fmt.kept_form, fmt)
    if fmt.linear_method is not None:
        LINEAR_METHODS[fmt.linear_method.name] = fmt.linear_method
    return fmt


def unregister(name: str) -> None:
    """Removes a registered format (tests that register a toy one)."""
    fmt = FORMATS.pop(name)
    BY_SUFFIXES[fmt.suffixes].remove(fmt)
    if not BY_SUFFIXES[fmt.suffixes]:
        del BY_SUFFIXES[fmt.suffixes]
    if fmt.kept_form is not None and BY_FORM.get(fmt.kept_form) is fmt:
        del BY_FORM[fmt.kept_form]
    if fmt.linear_method is not None and LINEAR_METHODS.get(fmt.linear_method.name) is fmt.linear_method:
        del LINEAR_METHODS[fmt.linear_method.name]


for _fmt in (FLOAT, MXFP4, MXFP8, FP8_BLOCK, INT4, INT8):
    register(_fmt)


def for_suffixes(suffixes, dtypes: Mapping[str, torch.dtype] | None = None) -> WeightFormat | None:
    """The format whose tensors are exactly these suffixes (weight, weight_packed, ...), or None; where several
    are, the first whose `dtypes_fit` these dtypes (by suffix), else (no dtypes, or none fits) the first."""
    found = BY_SUFFIXES.get(frozenset(suffixes))
    if not found:
        return None
    if dtypes is not None:
        for fmt in found:
            if fmt.dtypes_fit(dtypes):
                return fmt
    return found[0]


def format_of(w) -> WeightFormat:
    """The format that computes kept expert w (its ops.expert form's)."""
    return BY_FORM[type(w)]


def run_expert(w, x_TI: torch.Tensor, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
    """w2 act(w1 x, w3 x) for kept expert w by its format's fastest path (inference: no autograd graph)."""
    return BY_FORM[type(w)].forward(w, x_TI, act, situ_betas)


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
