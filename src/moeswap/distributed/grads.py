"""Data-parallel training's gradient sum: each rank runs its micro-batches of an optimizer step, and every
replicated trainable parameter's gradient is then summed over all the step's micro-batches, on every rank,
in micro-batch order, so that every rank holds one process's .grad (bit for bit) and their optimizers step
alike. Each micro-batch's backward already divided its loss by the whole step's target-token count
(train/loop.py), so the sum is the global batch's mean gradient, weighted by tokens as one process weights
it. The routed experts' LoRA split by owner (lora_shards.py) is left out: its owner computed every rank's
pairs, in the same order, and holds its gradient whole. Knows nothing of the loop's schedule.
Entry point: `StepGradients(ep, params, skip)`."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class StepGradients:
    """One optimizer step's gradients of the replicated parameters: `take(k)` after micro-batch k's backward
    moves them out of .grad (a rank holds those of its own micro-batches until the step ends), and
    `sum(n)` gathers every rank's (all_gather) and adds them in micro-batch order, as one process's backward
    passes accumulate them into .grad. An all_reduce of each rank's accumulated part would move less, but it
    adds in another order ((g0 + g2) + g1 for 3 micro-batches on 2 ranks); its last bits differ, and AdamW
    turns such differences into visible ones where a gradient is near zero (its first steps move each
    weight by about ±lr, whatever the gradient's size). The cost: each rank receives every micro-batch's
    gradients of the replicated parameters (for LoRA, the small attention and head adapters)."""

    def __init__(self, ep, params: list[tuple[str, nn.Parameter]], skip: set[int]):
        self.ep = ep
        self.params = [p for _, p in params if id(p) not in skip]
        self.mine: list[tuple[int, list[torch.Tensor | None]]] = []

    def take(self, k: int) -> None:
        """After micro-batch k's backward: its gradients kept here, .grad cleared for the next one."""
        self.mine.append((k, [p.grad for p in self.params]))
        for p in self.params:
            p.grad = None

    def sum(self, n: int) -> None:
        """Every rank's .grad = micro-batches 0..n-1's gradients (micro-batch k from rank k mod N) added in k
        order; None where no micro-batch reached the parameter. A micro-batch that did not reach it adds
        zeros (x + 0 = x)."""
        ep, world = self.ep, self.ep.world
        if not self.params:
            return
        slots = -(-n // world)  # micro-batches per rank, at most
        device = self.params[0].device  # NCCL gathers CUDA tensors only
        has = torch.zeros(slots, len(self.params), dtype=torch.int64, device=device)
        for i, (k, grads) in enumerate(self.mine):
            if k != ep.rank + i * world:
                raise RuntimeError(f"rank {ep.rank}: micro-batch {k} is not this rank's {i + 1}th (k mod {world})")
            has[i] = torch.tensor([g is not None for g in grads], dtype=torch.int64)
        reached = self._gather(has).sum((0, 1)) > 0  # [params]: some micro-batch reached it
        by_dtype: dict[torch.dtype, list[int]] = {}
        for j, p in enumerate(self.params):
            if bool(reached[j]):
                by_dtype.setdefault(p.dtype, []).append(j)
        for dtype, idx in by_dtype.items():
            sizes = [self.params[j].numel() for j in idx]
            flat = torch.zeros(slots, sum(sizes), dtype=dtype, device=device)
            for i, (_, grads) in enumerate(self.mine):
                parts = [torch.zeros(s, dtype=dtype, device=device) if grads[j] is None else grads[j].reshape(-1)
                         for j, s in zip(idx, sizes)]
                flat[i] = torch.cat(parts)
            every = self._gather(flat)  # [ranks, slots, size]
            total = every[0, 0].clone()  # micro-batch 0
            for k in range(1, n):
                total += every[k % world, k // world]
            for j, piece in zip(idx, total.split(sizes)):
                self.params[j].grad = piece.view_as(self.params[j]).clone()
        self.mine = []

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        ep = self.ep
        out = [torch.empty_like(t) for _ in range(ep.world)]
        try:
            dist.all_gather(out, t.contiguous(), group=ep.group)
        except Exception as err:  # gloo/NCCL raise RuntimeError subclasses whose names vary by version
            raise ep._lost(-1, err) from None
        return torch.stack(out)
