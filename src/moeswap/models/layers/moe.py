"""Mixture-of-experts block: sigmoid (or softmax) router with bias-corrected top-k, optional latent
projection (K3), routed experts, optional latent norm, shared experts.

Routed experts are not parameters of this module: the block routes and asks its expert executor
(experts/executors.py: `executor(h_TI, ids_TK, w_TK)`), chosen again whenever what it depends on is set
(the store, an expert LoRA, served LoRA, trainable experts: `EXECUTOR_INPUTS`); expert parallelism wraps it
(`wrap_executor`). Shapes: T tokens, D model width, I expert input width, E experts, K top-k.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch
from torch import nn

from moeswap.config import ModelConfig, routed_expert_shapes
from moeswap.experts import executors
from moeswap.experts.executors import ExpertExecutor, ResidentTable
from moeswap.models.layers.basic import GatedMLP, RMSNorm, adapter_split, derived, unadapted
from moeswap.models.layers.expert_lora import PROJS, ExpertLoRA, ExpertLoRASlots
from moeswap.ops import cpu_kernels
from moeswap.ops.gemm_precision import gemm_in_bf16
from moeswap.weights.dense import kernel_of

# what the block's expert executor is chosen from: setting (or deleting) one of these chooses it again
EXECUTOR_INPUTS = frozenset({"store", "experts", "expert_lora", "served_lora"})


class ExpertProvider(Protocol):
    def fetch(self, layer: int, expert_ids: Sequence[int]) -> Sequence: ...


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        m = cfg.moe
        self.weight = nn.Parameter(torch.zeros(m.num_experts, cfg.hidden_size, device=device))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(m.num_experts, device=device))
        self.top_k, self.scoring, self.renormalize = m.top_k, m.scoring, m.renormalize
        self.scaling, self.groups, self.topk_group = m.routed_scaling_factor, m.num_groups, m.topk_group
        self.top_p = 1.0  # LoadOptions.expert_top_p: skip each token's tail of experts (`tail_skip`); 1: off

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (expert ids [T, K], weights [T, K] fp32). Routing runs in fp32; eager CPU inference runs it
        as one C call (cpu_kernels.route, expert groups included), else `reference`."""
        kernel = cpu_kernels.for_inference(x_TD, self.weight, self.e_score_correction_bias)
        if (kernel is not None and x_TD.dtype == self.weight.dtype == torch.float32
                and self.e_score_correction_bias.dtype == torch.float32):
            got = kernel.route(x_TD, self.weight, self.e_score_correction_bias, self.top_k,
                               self.scoring != "sigmoid", self.renormalize, self.scaling, max(self.groups, 1),
                               self.topk_group if self.groups > 1 else 1)
        else:
            got = self.reference(x_TD)
        return got if self.top_p >= 1 else tail_skip(*got, self.top_p, self.renormalize)

    def reference(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router in torch ops (autograd, other devices, expert groups, the kernel's oracle)."""
        logits_TE = x_TD.float() @ self.weight.float().T
        scores_TE = logits_TE.sigmoid() if self.scoring == "sigmoid" else logits_TE.softmax(-1)
        choice_TE = scores_TE + self.e_score_correction_bias.float()  # the bias steers selection only
        if self.groups > 1:
            choice_TE = self._limit_groups(choice_TE)
        ids_TK = choice_TE.topk(self.top_k, dim=-1, sorted=True).indices
        w_TK = scores_TE.gather(-1, ids_TK)
        if self.renormalize:
            w_TK = w_TK / (w_TK.sum(-1, keepdim=True) + 1e-20)
        return ids_TK, w_TK * self.scaling

    def _limit_groups(self, choice_TE: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3 group-limited routing: keep the topk_group groups with the best top-2 sums."""
        T, E = choice_TE.shape
        grouped = choice_TE.view(T, self.groups, E // self.groups)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(self.topk_group, dim=-1).indices, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view(T, E)


def tail_skip(ids_TK: torch.Tensor, w_TK: torch.Tensor, p: float, renormalize: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """--expert-top-p: per token keep the fewest experts, by descending routing weight, whose share of the token's
    weight sum reaches p, and renormalise the kept ones to the sum the token had where the architecture
    renormalises (else they keep their weights). A skipped slot becomes a second pair of the token's first kept
    expert with weight 0: the shapes stay [T, K] for every executor and kernel, no skipped expert is fetched or
    read, and a zero-weight pair adds exactly nothing."""
    w_sorted, order = w_TK.sort(dim=-1, descending=True, stable=True)
    total = w_sorted.sum(-1, keepdim=True)
    before = (w_sorted.cumsum(-1) - w_sorted) / total  # share of the heavier ones: kept while it is below p
    keep_sorted = before < p
    keep = torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)
    first = ids_TK.gather(-1, order[:, :1]).expand_as(ids_TK)
    w_kept = torch.where(keep, w_TK, torch.zeros_like(w_TK))
    if renormalize:
        w_kept = w_kept * (total / w_kept.sum(-1, keepdim=True))
    return torch.where(keep, ids_TK, first), w_kept


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, device=None):
        super().__init__()
        m, d = cfg.moe, cfg.hidden_size
        self.layer_idx = layer_idx
        self.act, self.situ_betas = cfg.hidden_act, (cfg.situ_beta, cfg.situ_linear_beta)
        # submodules in the order forward runs them (the planner sums their costs in this order)
        self.gate = Router(cfg, device)
        if m.latent_dim:
            self.routed_expert_down_proj = nn.Linear(d, m.latent_dim, bias=False, device=device)
            self.routed_expert_up_proj = nn.Linear(m.latent_dim, d, bias=False, device=device)
            if m.latent_norm:
                self.routed_expert_norm = RMSNorm(m.latent_dim, cfg.rms_norm_eps, device)
        if m.num_shared_experts:
            self.shared_experts = GatedMLP(d, m.num_shared_experts * m.expert_dim, self.act, self.situ_betas, device)
        self.num_experts = m.num_experts
        self.expert_shapes = routed_expert_shapes(cfg)  # one routed expert's [out, in] per projection
        self.expert_width = m.latent_dim or d  # what the routed experts read (I)
        self.int8_activations = False  # LoadOptions.expert_activations: int8 activations in the grouped kernel
        # expert parallelism's wrapper of the chosen executor (distributed/ep.py), applied at each choice
        self.executor_wrap: Callable[[ExpertExecutor], ExpertExecutor] | None = None
        self.executor: ExpertExecutor  # how the routed experts run (experts/executors.py); set with the store
        self.store: ExpertProvider | None = None  # attached by the loader; never part of state_dict

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name in EXECUTOR_INPUTS:
            self.choose_executor()

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        if name in EXECUTOR_INPUTS:
            self.choose_executor()

    def choose_executor(self) -> ExpertExecutor:
        """Chooses how the routed experts run from what is set on the block (executors.choose), wrapped by
        `executor_wrap` where expert parallelism set one."""
        executor = executors.choose(self)
        if self.executor_wrap is not None:
            executor = self.executor_wrap(executor)
        self.executor = executor
        return executor

    def wrap_executor(self, wrap: Callable[[ExpertExecutor], ExpertExecutor]) -> ExpertExecutor:
        """Wraps this block's executor, now and at every later choice (expert parallelism, distributed/ep.py)."""
        self.executor_wrap = wrap
        return self.choose_executor()

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, executor={self.executor.name}"  # print(model) says which path runs

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        shape = x_BTD.shape
        x_TD = x_BTD.reshape(-1, shape[-1])
        ids_TK, w_TK = self.gate(x_TD)
        executor = self.executor
        y_TD = self._fused_latent(executor, x_TD, ids_TK, w_TK) if executor.fuses_latent else None
        if y_TD is None:
            h_TI = self.routed_expert_down_proj(x_TD) if hasattr(self, "routed_expert_down_proj") else x_TD
            routed_TI = executor(h_TI, ids_TK, w_TK)
            if hasattr(self, "routed_expert_norm"):
                routed_TI = self.routed_expert_norm(routed_TI)
            y_TD = self.routed_expert_up_proj(routed_TI) if hasattr(self, "routed_expert_up_proj") else routed_TI
        if hasattr(self, "shared_experts"):
            y_TD = y_TD + self.shared_experts(x_TD)
        return y_TD.reshape(shape)

    # -- routed-expert LoRA ---------------------------------------------------------------------------

    def attach_expert_lora(self, rank: int, alpha: float, dropout: float = 0.0, projections: Sequence[str] = PROJS,
                           shared_a: bool = False, generator: torch.Generator | None = None,
                           experts: Sequence[int] | None = None) -> ExpertLoRA:
        """Adds LoRA adapters to every routed expert's projections (the `expert_lora` submodule, fp32, on
        the router's device; B zero, so the block computes what it did until trained). Replaces one that
        was attached before. experts: only these experts' rows (ExpertLoRA's `experts`)."""
        self.expert_lora = ExpertLoRA(self.num_experts, self.expert_shapes, rank, alpha, dropout, projections,
                                      shared_a, device=self.gate.weight.device, generator=generator, experts=experts)
        return self.expert_lora.train(self.training)  # dropout only when the block trains, as LoRALinear

    def serve_expert_lora(self, rows) -> ExpertLoRASlots:
        """The block's routed-expert LoRA of served adapters (lora.serving), made on first use: adapters add
        theirs with `.add(slot, ExpertLoRA)`; `rows` is the model's row -> slot context."""
        served = self._modules.get("served_lora")
        if served is None:
            served = self.served_lora = ExpertLoRASlots(rows)
        return served

    def detach_expert_lora(self) -> ExpertLoRA | None:
        """Removes the expert LoRA (returned); the block computes its base experts again, on the fast paths."""
        lora = self._modules.pop("expert_lora", None)
        self.choose_executor()
        return lora

    def expert_lora_state_dict(self) -> dict[str, torch.Tensor]:
        """The expert LoRA's weights under PEFT's names (ExpertLoRA.peft_state_dict); {} when none is attached."""
        lora = self._modules.get("expert_lora")
        return {} if lora is None else lora.peft_state_dict(self.layer_idx)

    def load_expert_lora_state_dict(self, sd) -> list[str]:
        """Loads this layer's expert LoRA weights from PEFT-named `sd` (attach first); returns the keys taken."""
        lora = self._modules.get("expert_lora")
        if lora is None:
            raise RuntimeError(f"layer {self.layer_idx}: no expert LoRA attached to load into "
                               f"(call attach_expert_lora with the adapter's rank and projections first)")
        return lora.load_peft_state_dict(self.layer_idx, sd)

    # -- routed experts -----------------------------------------------------------------------------

    def run_experts(self, h_TI: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum [T, I] for expert inputs h_TI: what the executor computes."""
        return self.executor(h_TI, ids_TK, w_TK)

    def resident_table(self) -> ResidentTable | None:
        """The layer's table of the experts its store's fast tier holds, where decode steps may use it (the
        native decode step reads it): the executor's (ResidentTableExecutor), else None."""
        return self.executor.resident_table()

    def _fused_latent(self, executor: ExpertExecutor, x_TD: torch.Tensor, ids_TK: torch.Tensor,
                      w_TK: torch.Tensor) -> torch.Tensor | None:
        """K3's latent routed part of a step in one call of the executor (`latent`: the down projection, the
        experts, the norm, the up projection; the same bits as the calls in forward), where the projections are
        bf16 stored-weight Linears without served adapters in use. None: take the calls in forward."""
        down, up = self.routed_expert_down_proj, self.routed_expert_up_proj
        if adapter_split((down, up), x_TD.shape[0])[1] is not False:  # served adapters on them, in use
            return None
        down, up = unadapted(down), unadapted(up)
        if (kernel_of(down) != "bf16" or kernel_of(up) != "bf16" or gemm_in_bf16()
                or down.weight.dtype != torch.bfloat16 or up.weight.dtype != torch.bfloat16
                or x_TD.dtype != torch.float32):
            return None
        norm = getattr(self, "routed_expert_norm", None)
        norm_w = None if norm is None else derived(norm, "weight_fp32", norm.weight.float, norm.weight)
        return executor.latent(x_TD, down.weight, norm_w, 0.0 if norm is None else norm.eps, up.weight, ids_TK, w_TK)
