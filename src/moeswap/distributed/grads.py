"""Data-parallel training's gradient sum: after each rank's micro-batches, every replicated trainable
parameter's gradient summed over the ranks, so that every rank holds the gradient of the whole global batch
and their optimizers step alike. Each rank's backward already divided its losses by the global batch's
target-token count (train/loop.py), so the sum is the global mean's gradient, weighted by tokens as one
process weights it. The routed experts' LoRA split by owner (lora_shards.py) is left out: its owner computed
every rank's pairs and holds its gradient whole. Knows nothing of the loop's schedule.
Entry point: `sum_gradients(ep, params, skip)`."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def sum_gradients(ep, params: list[tuple[str, nn.Parameter]], skip: set[int]) -> None:
    """Sums the gradients of `params` (but those whose id is in `skip`) over ep's ranks in place: one
    all_reduce of which ranks have a gradient of each (a rank whose micro-batches were none has none: it
    then takes zeros, which a parameter no rank's loss reached does not get), then one all_reduce per dtype
    of every gradient flattened together."""
    mine = [p for _, p in params if id(p) not in skip]
    if not mine:
        return
    device = mine[0].device  # NCCL reduces CUDA tensors only
    has = torch.tensor([p.grad is not None for p in mine], dtype=torch.int64, device=device)
    _all_reduce(ep, has)
    for p, n in zip(mine, has.tolist()):
        if n and p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p, n in zip(mine, has.tolist()):
        if n:
            by_dtype.setdefault(p.grad.dtype, []).append(p)
    for group in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in group])
        _all_reduce(ep, flat)
        at = 0
        for p in group:
            p.grad.copy_(flat[at : at + p.numel()].view_as(p.grad))
            at += p.numel()


def _all_reduce(ep, t: torch.Tensor) -> None:
    try:
        dist.all_reduce(t, group=ep.group)
    except Exception as err:  # gloo/NCCL raise RuntimeError subclasses whose names vary by version
        raise ep._lost(-1, err) from None
