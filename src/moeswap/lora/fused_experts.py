"""PEFT's LoRA of transformers' fused routed experts (`target_parameters`, PEFT's ParamWrapper) as moeswap's
per-expert routed-expert LoRA: each expert's slice of the fused factors, under the names ExpertLoRA takes.

transformers' MoE ports (Kimi Linear's KimiLinearExperts among them) hold all E experts of a layer in two 3-D
parameters, `experts.gate_up_proj` [E, 2F, H] (expert e's gate rows 0..F-1, then its up rows: the forward
splits the product with `.chunk(2, dim=-1)`, gate first) and `experts.down_proj` [E, H, F], each expert's
slice used as a Linear weight ([out, in]). PEFT (0.17+) adapts such a parameter [E, out, in] with one
ParamWrapper, whose factors are two Linears of rank r·E:

    lora_A.weight [r·E, in]    expert e's A_e [r, in] = rows e·r .. e·r + r - 1          (reshape (E, r, in))
    lora_B.weight [out, r·E]   expert e's B_e [out, r] = columns e, E + e, 2E + e, ...   (reshape (out, r, E))

and it applies them as a change of the whole parameter, expert e's slice becoming W_e + scaling · B_e A_e
(get_delta_weight's einsum "o r e, e r i -> e o i"; scaling alpha / r or rsLoRA's alpha / sqrt(r)). Note the
two layouts differ: A's rows are expert-major, B's columns rank-major. That update of W_e is exactly a rank-r
LoRA of the expert's Linear, so moeswap applies it as one: w2 gets (A_e, B_e) of down_proj; the gate and up
projections (w1, w3), one fused Linear in transformers, share gate_up_proj's A_e, w1 taking B_e's first F
rows and w3 the last F (a row block of B_e A_e is that block of B_e times A_e). Same function, moeswap's
rounding (x·Aᵀ·Bᵀ instead of x·(W + B A)ᵀ).

Targeting both parameters nests two ParamWrappers on the `experts` module, and PEFT saves the inner one's
factors under `experts.base_layer.lora_A.weight` (the nesting's order follows target_parameters); which
parameter a pair adapts is told here by its shapes, which cannot be confused ([2F, H] against [H, F]).
Entry point: `split_fused(module, tensors, block)`; `FUSED` matches the module part of such names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

# a ParamWrapper's module: `...experts`, with one `.base_layer` per wrapper around it
FUSED = re.compile(r"(?P<experts>.+\.experts)(?P<nest>(?:\.base_layer)*)")


def split_fused(module: str, pair: Mapping[str, torch.Tensor], block_name: str, num_experts: int,
                shapes: Mapping[str, tuple[int, int]]) -> tuple[dict[str, torch.Tensor], str | None]:
    """The per-expert LoRA tensors (keys `<block_name>.experts.<e>.<w1|w2|w3>.lora_<A|B>.weight`, as
    plan_adapter files routed-expert keys) of one fused pair {"lora_A": [r·E, in], "lora_B": [out, r·E]}
    saved for `module`, on a MoE block with `num_experts` experts whose projections have `shapes` [O, N]
    (w1, w3 [F, H]; w2 [H, F]). Returns (tensors, None), or ({}, the problem)."""
    A, B = pair.get("lora_A"), pair.get("lora_B")
    if A is None or B is None:
        return {}, f"{module}: has {'lora_A' if A is not None else 'lora_B'} without " \
                   f"{'lora_B' if A is not None else 'lora_A'}"
    if A.ndim != 2 or B.ndim != 2 or A.shape[0] != B.shape[1] or A.shape[0] % num_experts:
        return {}, (f"{module}: lora_A {list(A.shape)} / lora_B {list(B.shape)} are no fused LoRA of "
                    f"{num_experts} experts (expected [r·{num_experts}, in] / [out, r·{num_experts}])")
    out, n_in = B.shape[0], A.shape[1]
    F_, H = shapes["w1"]
    if (out, n_in) == (2 * F_, H) and shapes["w3"] == (F_, H):
        parts = {"w1": slice(0, F_), "w3": slice(F_, 2 * F_)}  # gate rows, then up rows (transformers' chunk(2))
    elif (out, n_in) == tuple(shapes["w2"]):
        parts = {"w2": slice(0, out)}
    else:
        return {}, (f"{module}: lora_A {list(A.shape)} / lora_B {list(B.shape)} fit neither gate_up_proj "
                    f"[{num_experts}, {2 * F_}, {H}] nor down_proj [{num_experts}, {shapes['w2'][0]}, "
                    f"{shapes['w2'][1]}] of this model's experts")
    E = num_experts
    r = A.shape[0] // E
    A_e = A.reshape(E, r, n_in)
    B_e = B.reshape(out, r, E).permute(2, 0, 1)  # [E, out, r]: expert e's column k is B's column k·E + e
    tensors = {}
    for e in range(E):
        for proj, rows in parts.items():
            tensors[f"{block_name}.experts.{e}.{proj}.lora_A.weight"] = A_e[e].contiguous()
            tensors[f"{block_name}.experts.{e}.{proj}.lora_B.weight"] = B_e[e, rows].contiguous()
    return tensors, None
