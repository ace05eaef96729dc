"""kernel_experts: routed-expert weight objects as the C kernels take them (data pointers in the kernels' order).
Owns which grouped kernel runs an expert (`grouped_kind`, as its format says), its pointers (kept on the
expert), the resident tables' rows, and `moe` / `expert`, which call the ctypes binding with them. Knows no
ctypes and no C: kernel_library does. Entry points: `moe`, `expert`, `grouped_kind`, `resident_row`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from moeswap.ops.expert import kernel_kind, kernel_mats, tensors


def grouped_kind(w) -> str | None:
    """"mxfp4", "bf16", "fp8" or "int4": which of the grouped kernels (`moe`, the *_resident tables) runs expert
    w, as its form's layout says (ops.expert.kernel_kind); None: neither (another kind of expert, or not on the
    CPU)."""
    return kernel_kind(w)


def moe(kernel, x_TI: torch.Tensor, experts: Sequence, tokens: torch.Tensor, offsets: Sequence[int],
        weights: torch.Tensor, act: str, situ_betas: tuple[float, float], y_TI: torch.Tensor,
        int8_activations: bool = False) -> None:
    """`kernel.moe` (CpuKernels) for expert objects all of one `grouped_kind`: MXFP4 (MXFP4ExpertWeights), bf16
    (ExpertWeights with bf16 tensors), block FP8 (FP8ExpertWeights) or INT4 (Int4ExpertWeights), of one width.
    y[tokens[k]] += weights[k] * expert_e(x[tokens[k]]) for pair k of expert e (offsets[e]..offsets[e+1])."""
    I = x_TI.shape[1]
    kind = grouped_kind(experts[0])  # one kind per call (the caller groups them so)
    held: list[torch.Tensor] = []  # contiguous copies that must outlive the call
    widths, table = zip(*[_kernel_pointers(w, I, kind, held) for w in experts])
    if any(f != widths[0] for f in widths):
        raise ValueError("moe: experts of one call must share their width")
    kernel.moe(x_TI, kind, widths[0], table, tokens, offsets, weights, act, situ_betas, y_TI, int8_activations)


def expert(kernel, x_TI: torch.Tensor, w, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
    """`kernel.mxfp4_expert` for an MXFP4 expert object: x fp32 contiguous [T, I] -> w2 · act(w1 x, w3 x)."""
    if grouped_kind(w) != "mxfp4":
        raise ValueError(f"mxfp4_expert: got a {type(w).__name__}, not an MXFP4 expert on the CPU")
    mats = kernel_mats(w, x_TI.shape[1])  # (held until the call returns)
    return kernel.mxfp4_expert(x_TI, mats[0].shape[0], [m.data_ptr() for m in mats], act, situ_betas)


def resident_row(w, I: int, kind: str) -> tuple[int, tuple[int, ...]] | None:
    """(F, the expert's six `moe_resident` table entries) for input width I, or None where its matrices
    are not laid out for the kernel as they are (a copy would have to outlive the table)."""
    held: list[torch.Tensor] = []
    F, ptrs = _kernel_pointers(w, I, kind, held)
    if held:
        return None
    return F, ((ptrs[0], 0, ptrs[1], 0, ptrs[2], 0) if kind == "bf16" else ptrs)


def _kernel_pointers(w, I: int, kind: str | None, held: list) -> tuple[int, tuple[int, ...]]:
    """(F, data pointers of the expert's matrices in the kernels' order) for input width I, kept on the expert:
    a decode step hands the same experts over every step, and gathering six tensors' pointers per expert per
    call is not free (docs/benchmarks.md). Experts are values (tiers make new objects, never swap a tensor in
    place), so the pointers stay valid while the expert lives; a non-contiguous matrix is copied into `held`."""
    kept = w.__dict__.get("_kernel_pointers")
    if kept is not None and kept[0] == I and kept[1] == kind:
        return kept[2], kept[3]
    if grouped_kind(w) != kind:
        raise ValueError(f"moe: experts of one call must be of one kind (MXFP4, bf16, FP8 or INT4, on the CPU), got "
                         f"a {type(w).__name__} ({grouped_kind(w) or 'none'}) among {kind} ones")
    originals = list(tensors(w).values())
    mats = kernel_mats(w, I)
    F, ptrs = mats[0].shape[0], tuple(t.data_ptr() for t in mats)
    if all(m is o for m, o in zip(mats, originals)):
        w.__dict__["_kernel_pointers"] = (I, kind, F, ptrs)
    else:
        held.extend(mats)
    return F, ptrs
