"""Dense Linear layers and their weight format's method: `LinearMethod` (how a layer's weight is held and
multiplied: create/load its tensors, `apply`, its values for LoRA and merges), `WeightLinear` (the
bias-free nn.Linear the loader builds for a layer whose weight stays as stored; its forward is its
method's `apply`), and `linear_method(module)`, the method of any Linear. The methods live in their
format's file; registry.choose_linear_method picks one at load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod:
    """How a Linear's weight is held and multiplied. Stateless: one object per method, shared by layers."""

    name = ""  # in reprs and the registry
    # what ops.cpu_kernels calls the stored form where its kernels read it in place (bf16, fp8), else None
    kernel: str | None = None
    # `weight` holds the weight's values (possibly in a narrower dtype): readable by fused products and LoRA
    weight_is_values = True
    # where the kernel reads codes and scales in place: their parameters' names (the codes first), and the rows
    # one scale row covers (layers' input projections fuse where every part but the last fills whole ones)
    codes: tuple[str, str] | None = None
    code_rows = 1

    def __repr__(self) -> str:
        return f"<{self.name} linear method>"

    def __deepcopy__(self, memo):  # one object per method: copies of a model share it
        return self

    def __reduce__(self):
        from moeswap.weights import registry

        return registry.linear_method_named, (self.name,)

    def keeps(self, stored: str, dtypes: Mapping[str, torch.dtype], block: tuple[int, int] | None,
              compute: torch.dtype, device: str) -> bool:
        """Whether a weight stored in format `stored` (tensor dtypes by suffix) stays so under `compute` math
        on `device` at speed with this method."""
        return False

    def load_weights(self, layer: nn.Linear, tensors: Mapping[str, torch.Tensor], device: str) -> None:
        """The layer's parameters from its stored tensors (by suffix, the checkpoint's own names; a format
        without a `weight` tensor leaves the layer none)."""
        if "weight" not in tensors:
            del layer._parameters["weight"]
        for suffix, t in tensors.items():
            layer._parameters[suffix] = nn.Parameter(t.to(device).contiguous(), requires_grad=False)

    def apply(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return self.apply_values(x, layer.weight, layer.bias)

    def apply_values(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x weight^T (+ bias) for a weight of this method's values (a LoRA wrapper's own copy of them)."""
        return F.linear(x, weight, bias)

    def values(self, layer: nn.Linear) -> torch.Tensor:
        """The weight's values [out, in] (its `weight` where that holds them, as kept)."""
        return layer.weight

    def sources(self, layer: nn.Linear) -> tuple[torch.Tensor, ...]:
        """The parameters the values come from (for copies kept while they are unchanged)."""
        return (layer.weight,)

    def with_values(self, layer: nn.Linear) -> nn.Linear:
        """`layer` as a Linear whose `weight` holds values (what LoRA wrappers read and merge into): itself, or a
        plain fp32 Linear of its decoded weight."""
        if self.weight_is_values:
            return layer
        plain = nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta")
        plain.weight = nn.Parameter(self.values(layer), requires_grad=False)
        return plain


class FloatLinear(LinearMethod):
    """A weight held as values in the compute dtype (a plain nn.Linear: what --dense-weights compute loads)."""

    name = "float"


FLOAT_LINEAR = FloatLinear()


class WeightLinear(nn.Linear):
    """A bias-free nn.Linear whose weight stays as stored; `method` (chosen once at load) holds and
    multiplies it. Built on meta, filled by `method.load_weights`; state_dict names are the checkpoint's."""

    def __init__(self, in_features: int, out_features: int, method: LinearMethod):
        super().__init__(in_features, out_features, bias=False, device="meta")
        self.method = method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, method={self.method.name}"


def linear_method(module: nn.Module) -> LinearMethod | None:
    """The method of a Linear: a WeightLinear's own, a plain nn.Linear's the float one; None for anything else
    (a wrapper such as LoRA's)."""
    if type(module) is WeightLinear:
        return module.method
    if type(module) is nn.Linear:
        return FLOAT_LINEAR
    return None


def codes_of(module: nn.Module) -> tuple[str, str] | None:
    """The names of a Linear's codes and scales where its method's kernel reads them in place, else None."""
    method = linear_method(module)
    return None if method is None else method.codes


def kernel_of(module: nn.Module) -> str | None:
    """The ops.cpu_kernels kind a Linear's weight is kept in for its kernels to read ("bf16", "fp8", "int8",
    "int4"; its
    method's `kernel`), None for values in the compute dtype or anything not a Linear."""
    method = linear_method(module)
    return None if method is None else method.kernel


def weight_values(module: nn.Module) -> torch.Tensor:
    """A Linear's weight as values (block-FP8 codes decoded), whatever its method; a wrapper's `weight` as it is."""
    return (linear_method(module) or FLOAT_LINEAR).values(cast(nn.Linear, module))


def weight_sources(module: nn.Module) -> tuple[torch.Tensor, ...]:
    """The parameters a Linear's weight values come from (a wrapper's: its `weight`)."""
    return (linear_method(module) or FLOAT_LINEAR).sources(cast(nn.Linear, module))


def with_weight_values(module: nn.Linear) -> nn.Linear:
    """`module` as a Linear whose `weight` holds values (LoRA wrappers read and merge into `weight`)."""
    return (linear_method(module) or FLOAT_LINEAR).with_values(module)


def plain_weight(module: nn.Module) -> bool:
    """Whether `module` is a Linear whose `weight` holds its values (plain, or kept in a narrower dtype):
    what fused products and `linear(x, module.weight)` may read in its place."""
    method = linear_method(module)
    return method is not None and method.weight_is_values
