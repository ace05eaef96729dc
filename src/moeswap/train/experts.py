"""Routed experts as trainable parameters (full mode), and K3's load balancing by router-bias updates.
`make_experts_trainable` decodes every MoE block's experts once (through their format objects) into fp32
parameters w1 / w3 [E, F, I] and w2 [E, I, F] (a TrainableExperts, the block's `experts`, which its executor
then runs); `balance_routers` steers routers toward balance (DeepSeek-V3's auxiliary-loss-free rule);
`load_report` summarises the load; `expert_tensors` gives the weights back per expert for export.
"""

from __future__ import annotations

import torch
from torch import nn

from moeswap.experts.pairs import combine_pairs, pairs_by_expert
from moeswap.ops.activation import glu
from moeswap.weights.format import PROJS
from moeswap.weights.registry import format_of


class TrainableExperts(nn.Module):
    """A block's routed experts as parameters; forward computes the routed sum like the store's path
    (pairs grouped by expert, fp32 weighted sum) with autograd through weights, inputs and routing weights."""

    def __init__(self, weights: dict[str, torch.Tensor], act: str, situ_betas: tuple[float, float]):
        super().__init__()
        for proj in PROJS:
            setattr(self, proj, nn.Parameter(weights[proj]))
        self.act, self.situ_betas = act, situ_betas
        self.num_experts = weights["w1"].shape[0]
        self.register_buffer("load", torch.zeros(self.num_experts, dtype=torch.int64), persistent=False)

    def forward(self, h_TI: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
        if self.training:  # balancing counts training steps only, not evals
            self.load += torch.bincount(ids_TK.detach().flatten(), minlength=self.num_experts).to(self.load.device)
        unique_ids, counts, token_of, weights = pairs_by_expert(ids_TK, w_TK)
        token_of = token_of.to(h_TI.device)
        x_PI = h_TI.index_select(0, token_of).split(counts)
        # one unbind per projection: indexing the stacked weight per expert would give each expert's use a
        # backward that zero-fills and adds a whole [E, ., .] gradient (E times the work)
        w1, w3, w2 = self.w1.unbind(0), self.w3.unbind(0), self.w2.unbind(0)
        ys = []
        for i, e in enumerate(unique_ids):
            x = x_PI[i]
            h = glu(self.act, x @ w1[e].T, x @ w3[e].T, self.situ_betas)
            ys.append(h @ w2[e].T)
        y_PI = torch.cat(ys) if ys else h_TI.new_zeros(0, h_TI.shape[-1])
        return combine_pairs(h_TI, y_PI, weights, token_of).to(h_TI.dtype)


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    from moeswap.models.layers.moe import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]


def make_experts_trainable(model: nn.Module, dtype: torch.dtype = torch.float32) -> list[TrainableExperts]:
    """Decodes each MoE block's routed experts from its store into a TrainableExperts (`block.experts`)."""
    out = []
    for block in moe_blocks(model):
        if block.store is None:
            raise RuntimeError(f"layer {block.layer_idx}: MoE block has no expert store to read experts from")
        ids = list(range(block.num_experts))
        mats: dict[str, list[torch.Tensor]] = {p: [] for p in PROJS}
        fetched = block.store.fetch(block.layer_idx, ids)
        for i in ids:
            w = fetched[i]
            for proj in PROJS:
                mats[proj].append(format_of(w).weight(w, proj, dtype).to(block.gate.weight.device))
            del w
        trainable = TrainableExperts({p: torch.stack(m) for p, m in mats.items()}, block.act, block.situ_betas)
        block.experts = trainable
        out.append(trainable)
    return out


def expert_tensors(block: nn.Module) -> dict[tuple[int, str], torch.Tensor]:
    """(expert, projection) -> its [out, in] weight, from a block's TrainableExperts."""
    experts = block.experts
    return {(e, proj): getattr(experts, proj)[e].detach() for e in range(experts.num_experts) for proj in PROJS}


@torch.no_grad()
def balance_routers(model: nn.Module, rate: float) -> None:
    """One bias update per MoE block from the load counted since the last call, then the count restarts:
    `e_score_correction_bias` (which only steers selection, never the weights, and gets no gradient) moves by
    `rate`: up for experts that took fewer than the mean number of (token, expert) pairs, down for more."""
    for block in moe_blocks(model):
        experts = block._modules.get("experts")
        if experts is None:
            continue
        load = experts.load.float()
        if rate > 0 and load.sum() > 0:
            bias = block.gate.e_score_correction_bias
            bias.add_(torch.sign(load.mean() - load).to(bias), alpha=rate)
        experts.last_load = experts.load.clone()
        experts.load.zero_()


def load_report(model: nn.Module) -> dict[str, object]:
    """Per MoE layer: max / mean (token, expert) pairs per expert over the last step (1.0 = balanced), and
    the share of experts that took no pair."""
    layers = {}
    for block in moe_blocks(model):
        experts = block._modules.get("experts")
        last = getattr(experts, "last_load", None) if experts is not None else None
        if last is None or last.sum() == 0:
            continue
        load = last.float()
        layers[str(block.layer_idx)] = {"max_over_mean": round(float(load.max() / load.mean()), 4),
                                        "idle_share": round(float((load == 0).float().mean()), 4)}
    worst = max((v["max_over_mean"] for v in layers.values()), default=None)
    return {"layers": layers, "worst_max_over_mean": worst}


def balanced_biases(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The selection biases `balance_routers` updates (of blocks whose experts train), by name."""
    return [(n, p) for n, p in model.named_parameters()
            if n.endswith("gate.e_score_correction_bias") and "experts" in model.get_submodule(n.rsplit(".", 2)[0])._modules]
