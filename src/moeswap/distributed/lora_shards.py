"""Routed-expert LoRA split by owner in expert-parallel training: each expert's LoRA rows (built so with
ExpertLoRA's `experts`, or cut by ExpertLoRA.keep_rows after a whole checkpoint's load) and AdamW state
live on the rank that computes its pairs; whole views are gathered only for each step's gradient norm,
checkpoints (one process's layout) and the adapter at the end, on rank 0 alone where only rank 0 needs
them (train/loop.py: the norm is computed there and broadcast; rank 0 writes). Other parameters stay
replicated. Knows nothing of the loop's schedule (train/loop.py calls it).
Entry point: `LoRAShards.split(ep, model, params, optimizer, make_optimizer)`."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn


class LoRAShards:
    """The split expert LoRA of one run: which trainable parameters are split, and over which experts."""

    def __init__(self, ep, parts: dict[int, tuple[nn.Module, str, int]]):
        self.ep = ep
        self.parts = parts  # id(parameter) -> (ExpertLoRA, "lora_A.w1", layer)

    @classmethod
    def split(cls, ep, model, params: list[tuple[str, nn.Parameter]], optimizer, make_optimizer):
        """Keeps each block's expert LoRA rows of this rank's experts only, and their optimizer state;
        returns (LoRAShards, the params list with the split parameters, a new optimizer over them). A LoRA
        built with only those rows (ExpertLoRA's `experts`, what `train` does unless it resumes) is kept as
        it is, and the optimizer too when no LoRA had other rows."""
        old_sd = optimizer.state_dict()
        old_order = [p for g in optimizer.param_groups for p in g["params"]]
        replaced: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}  # id(old) -> (new, rows kept)
        parts = {}
        for block in model.moe_blocks():
            lora = block._modules.get("expert_lora")
            if lora is None:
                continue
            owned = tuple(ep.placement.owned(ep.rank, block.layer_idx))
            if lora.experts == owned:  # built with this rank's rows only
                parts.update((id(p), (lora, name, block.layer_idx)) for name, p in _named(lora))
                continue
            rows = torch.tensor([lora.row(e) for e in owned], dtype=torch.int64)
            before = dict(_named(lora))
            lora.keep_rows(owned)
            for name, new in _named(lora):
                replaced[id(before[name])] = (new, rows)
                parts[id(new)] = (lora, name, block.layer_idx)
        if not replaced:
            return (cls(ep, parts) if parts else None), params, optimizer
        params = [(n, replaced[id(p)][0] if id(p) in replaced else p) for n, p in params]
        new_opt = make_optimizer(params)
        new_order = [p for g in new_opt.param_groups for p in g["params"]]
        state = {}
        for i, (old, _new) in enumerate(zip(old_order, new_order)):
            if i not in old_sd["state"]:
                continue
            st = dict(old_sd["state"][i])
            if id(old) in replaced:
                rows = replaced[id(old)][1]
                st = {k: v.index_select(0, rows) if torch.is_tensor(v) and v.shape == old.shape else v
                      for k, v in st.items()}
            state[i] = st
        new_opt.load_state_dict({"state": state, "param_groups": old_sd["param_groups"]})
        return cls(ep, parts), params, new_opt

    def _gather(self, p: torch.Tensor, layer: int, root: int | None = None) -> torch.Tensor | None:
        """The whole [E, ...] tensor from every rank's rows of `p` (each rank holds E/N experts' rows): on
        every rank, or with `root` on that rank only (None elsewhere; the others never hold it whole)."""
        ep = self.ep
        here = root is None or ep.rank == root
        parts = [torch.empty_like(p) for _ in range(ep.world)] if here else None
        try:
            if root is None:
                dist.all_gather(parts, p.detach().contiguous(), group=ep.group)
            else:
                dist.gather(p.detach().contiguous(), parts, dst=root, group=ep.group)
        except Exception as err:  # gloo/NCCL raise RuntimeError subclasses whose names vary by version
            raise ep._lost(layer, err) from None
        if not here:
            return None
        whole = p.new_empty((len(ep.placement.owners[layer]), *p.shape[1:]))
        for r, part in enumerate(parts):
            whole[torch.tensor(ep.placement.owned(r, layer), dtype=torch.int64, device=p.device)] = part
        return whole

    def clip_gradients(self, params: list[tuple[str, nn.Parameter]], max_norm: float) -> float:
        """torch.nn.utils.clip_grad_norm_ over `params` as one process computes it: the norm over the whole
        gradients (a split one gathered for it on rank 0, which computes the norm and broadcasts it), the
        same scale applied to each rank's rows. A split parameter with a gradient on any rank gets zeros
        where it has none, as its whole tensor would have in one process (index_select's backward), so that
        every rank's optimizer steps its rows."""
        split = [p for _, p in params if id(p) in self.parts]
        has = torch.tensor([p.grad is not None for p in split], dtype=torch.int64,
                           device=split[0].device if split else "cpu")  # NCCL: a CUDA tensor
        try:
            dist.all_reduce(has, group=self.ep.group)
        except Exception as err:
            raise self.ep._lost(-1, err) from None
        for p, n in zip(split, has.tolist()):
            if n and p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [self._gather(p.grad, self.parts[id(p)][2], root=0) if id(p) in self.parts else p.grad
                 for _, p in params if p.grad is not None]
        device = next((p.device for _, p in params), torch.device("cpu"))
        if self.ep.rank == 0:
            norm = torch.nn.utils.get_total_norm(grads, 2.0, False, None).to(device=device, dtype=torch.float32)
        else:
            norm = torch.empty((), dtype=torch.float32, device=device)
        del grads
        try:
            dist.broadcast(norm, src=0, group=self.ep.group)
        except Exception as err:
            raise self.ep._lost(-1, err) from None
        torch.nn.utils.clip_grads_with_norm_([p for _, p in params if p.grad is not None],
                                             max_norm if max_norm else math.inf, norm, None)
        return norm.item()

    def whole(self, params: list[tuple[str, nn.Parameter]], optimizer,
              root: int | None = None) -> tuple[list, "_StateDict"] | tuple[None, None]:
        """(params, optimizer) in one process's layout for a checkpoint: split parameters and their AdamW
        state gathered whole, on every rank or on `root` only ((None, None) elsewhere). Every rank takes
        part; the copies are dropped after the write."""
        out = [(n, self._gather(p, self.parts[id(p)][2], root) if id(p) in self.parts else p) for n, p in params]
        sd = optimizer.state_dict()
        order = [p for g in optimizer.param_groups for p in g["params"]]
        state = {}
        for i, p in enumerate(order):
            if i not in sd["state"]:
                continue
            st = sd["state"][i]
            if id(p) in self.parts:
                layer = self.parts[id(p)][2]
                st = {k: self._gather(v, layer, root) if torch.is_tensor(v) and v.shape == p.shape else v
                      for k, v in st.items()}
            state[i] = st
        if root is not None and self.ep.rank != root:
            return None, None
        return out, _StateDict({"state": state, "param_groups": sd["param_groups"]})

    def join(self, params: list[tuple[str, nn.Parameter]], root: int | None = None) -> list[tuple[str, nn.Parameter]]:
        """At the end of the run: every expert LoRA whole again (its rows gathered) on every rank, or on
        `root` only (the others keep their rows), so that the adapter is written as one process writes it;
        returns the params list with the whole tensors."""
        whole: dict[int, nn.Parameter] = {}
        by_lora: dict[int, tuple[nn.Module, int, dict]] = {}
        for pid, (lora, name, layer) in self.parts.items():
            by_lora.setdefault(id(lora), (lora, layer, {}))[2][name] = pid
        current = {id(p): p for _, p in params}
        for lora, layer, names in by_lora.values():
            tensors = {name: self._gather(current[pid], layer, root) for name, pid in names.items()}
            if root is not None and self.ep.rank != root:
                continue
            lora.keep_rows(range(lora.num_experts), tensors)
            for name, new in _named(lora):
                whole[names[name]] = new
        self.parts = {}
        return [(n, whole.get(id(p), p)) for n, p in params]  # (a rank other than root: its rows, unchanged)


class _StateDict:
    """An optimizer's stand-in for save_checkpoint: its state_dict in one process's layout."""

    def __init__(self, sd: dict):
        self._sd = sd

    def state_dict(self) -> dict:
        return self._sd


def _named(lora) -> list[tuple[str, nn.Parameter]]:
    return [(f"{part}.{p}", getattr(lora, part)[p]) for part in ("lora_A", "lora_B") for p in lora.projections]
