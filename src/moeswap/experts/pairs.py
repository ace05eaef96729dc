"""A layer step's (token, expert) pairs: grouped by expert for the kernels (`pairs_by_expert`) and summed back
per token under autograd (`combine_pairs`). Pure tensor bookkeeping shared by every expert executor
(experts/executors.py), expert parallelism (distributed/) and full training (train/experts.py); knows nothing
of stores or kernels. Shapes: T tokens, I expert input width, K top-k, P (token, expert) pairs.
"""

from __future__ import annotations

import torch

PAIRS_IN_PYTHON = 256  # up to this many (token, slot) pairs, on the CPU: Python lists beat ~7 torch ops


def pairs_by_expert(ids_TK: torch.Tensor, w_TK: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs of a step grouped by expert, in expert order, each group in token order:
    (expert ids, pairs per expert, token of each pair [P] int64, weight of each pair [P]; in autograd's
    graph when w_TK is)."""
    K = ids_TK.shape[1]
    if ids_TK.numel() <= PAIRS_IN_PYTHON and ids_TK.is_cpu and not (torch.is_grad_enabled() and w_TK.requires_grad):
        flat = [e for row in ids_TK.tolist() for e in row]
        order = sorted(range(len(flat)), key=flat.__getitem__)  # stable: token order within an expert
        unique_ids: list[int] = []
        counts: list[int] = []
        for i in order:
            if unique_ids and unique_ids[-1] == flat[i]:
                counts[-1] += 1
            else:
                unique_ids.append(flat[i])
                counts.append(1)
        w = w_TK.flatten().tolist()
        return (unique_ids, counts, torch.tensor([i // K for i in order], dtype=torch.int64),
                torch.tensor([w[i] for i in order], dtype=w_TK.dtype))
    flat_ids = ids_TK.flatten()
    order_P = flat_ids.argsort(stable=True)
    unique_ids_t, counts_t = flat_ids[order_P].unique_consecutive(return_counts=True)
    return unique_ids_t.tolist(), counts_t.tolist(), order_P // K, w_TK.flatten()[order_P]


def combine_pairs(h_TI: torch.Tensor, y_PI: torch.Tensor, weights: torch.Tensor, token_of: torch.Tensor) -> torch.Tensor:
    """Each token's routed output under autograd: its pairs' outputs times their routing weights, added from
    zero in pair order in fp32 (float64 stays), as the inference kernels sum; [T, I] in that accumulator dtype."""
    acc = torch.promote_types(h_TI.dtype, torch.float32)
    contrib_PI = y_PI.to(acc) * weights.to(device=h_TI.device, dtype=acc)[:, None]
    return torch.zeros(h_TI.shape, dtype=acc, device=h_TI.device).index_add(0, token_of, contrib_PI)
