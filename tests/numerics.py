"""Tolerances from error bounds, for tests that compare two fp32 computations of one function which differ in
rounding only: summation order, fused or split products, moeswap's kernels against torch's GEMM. Torch's GEMM
(MKL) sums in an order that depends on the CPU's code path (its AVX-512 and AVX2 kernels differ, and on
AMD CPUs it takes paths of its own), so a tolerance picked where one CPU passed fails on another (docs/numerics.md).

`glu_expert_bound`: an a-priori bound (Higham's gamma_n per dot product, propagated to first order) on a
routed expert's fp32 result against the exact one. `assert_within_rounding`: for whole-model outputs, where
no a-priori bound is practical, a fast path's distance from the plain torch path measured in units of the
plain path's own rounding error against a float64 run of the same model."""

from __future__ import annotations

import torch
import torch.nn.functional as F

U32 = 2.0 ** -24  # fp32's unit roundoff
SILU_SLOPE = 1.1  # max |silu'(x)| (1.0998 at x = 2.4): how far an error in silu's input moves its output
ACT_ULPS = 8  # rounding of the activation itself (exp, the division, the product), in units of its result


def gamma(n: int) -> float:
    """Higham's gamma_n: |fl(sum of n products) - exact| <= gamma_n * sum of |products|, in any order."""
    return n * U32 / (1 - n * U32)


def glu_expert_bound(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on |fp32 result - exact| for y = w2 (silu(w1 x) * (w3 x)), computed in float64 from
    the exact weights (any summation order in each product). w1, w3 [F, I], w2 [I, F], x [T, I]."""
    w1, w3, w2, x = (t.double() for t in (w1, w3, w2, x))
    n_in, n_mid = x.shape[-1], w1.shape[0]
    h1, h3 = x @ w1.T, x @ w3.T
    e1, e3 = gamma(n_in) * (x.abs() @ w1.abs().T), gamma(n_in) * (x.abs() @ w3.abs().T)
    act = F.silu(h1)
    mid = act * h3
    e_mid = SILU_SLOPE * e1 * (h3.abs() + e3) + act.abs() * e3 + ACT_ULPS * U32 * mid.abs()
    return gamma(n_mid) * (mid.abs() @ w2.abs().T) + e_mid @ w2.abs().T


def glu_expert_exact(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The same expert in float64 (the reference the bound is about)."""
    w1, w3, w2, x = (t.double() for t in (w1, w3, w2, x))
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


ROUNDING_UNITS = 4  # a faster path's rounding is of the reference path's size: room for the maxima to fall apart


def assert_within_rounding(result: torch.Tensor, reference: torch.Tensor, exact: torch.Tensor) -> None:
    """result: a fast path's fp32 output; reference: the plain torch path's fp32 output of the same function;
    exact: its float64 output. result may differ from reference by ROUNDING_UNITS times the reference's own
    rounding error against `exact` (the largest over all elements), no more: a bug moves results by far more
    than rounding does; another summation order (a fused product, a kernel, another CPU's GEMM) does not."""
    unit = (reference.double() - exact.double()).abs().max().item()
    assert unit > 0, "the reference equals the float64 result exactly: nothing to measure rounding by"
    diff = (result.double() - reference.double()).abs().max().item()
    assert diff <= ROUNDING_UNITS * unit, (f"the result differs from the reference by {diff:.3g}, more than "
                                           f"{ROUNDING_UNITS} x the reference's fp32 rounding error {unit:.3g}")
