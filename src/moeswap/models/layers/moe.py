"""Mixture-of-experts block: sigmoid (or softmax) router with bias-corrected top-k, optional latent
projection (K3), routed experts fetched from an expert store, optional latent norm, shared experts.

Routed experts are not parameters of this module: `store.fetch(layer, ids)` returns callables
(see ops.expert.ExpertWeights); with hybrid experts (experts/hybrid.py) the store's `hybrid.fetch` hands over
some from host memory, which run on the CPU (OnHost) when the block is on an accelerator. Tokens routed to
the same expert in a step are computed together.
Inference takes the fast kernels; when autograd must see the experts (gradients wanted) or an expert
LoRA is attached (`attach_expert_lora`, models/layers/expert_lora.py), the experts run as torch ops
through ops.expert_format (`train_forward` per expert with an adapter; float experts without one as one
autograd node: `frozen_moe`, or `frozen_group` beside adapted ones), still fetched from the store one at a
time. Full training replaces the store by parameters (an `experts` submodule, train/experts.py). With served
adapters (`serve_expert_lora`, lora.serving) only the rows whose adapter has expert LoRA here run that way.
Shapes: T tokens, D model width, I expert input width, E experts, K top-k, P (token, expert) pairs.
"""

from __future__ import annotations

import ctypes
from typing import Protocol, Sequence

import torch
from torch import nn

from moeswap.config import ModelConfig
from moeswap.experts.hybrid import fetch_step
from moeswap.models import routed_expert_shapes
from moeswap.models.layers.basic import GatedMLP, RMSNorm, adapter_split, derived, unadapted
from moeswap.models.layers.expert_lora import PROJS, ExpertLoRA, ExpertLoRASlots
from moeswap.ops import cpu_kernels, expert_mxfp4
from moeswap.ops.cpu_kernels import grouped_kind
from moeswap.ops.linear import gemm_in_bf16
from moeswap.weights import autograd as expert_autograd
from moeswap.weights.dense import kernel_of
from moeswap.weights.registry import format_of


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

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (expert ids [T, K], weights [T, K] fp32). Routing runs in fp32; eager CPU inference runs it
        as one C call (cpu_kernels.route, expert groups included), else `reference`."""
        kernel = cpu_kernels.for_inference(x_TD, self.weight, self.e_score_correction_bias)
        if (kernel is not None and x_TD.dtype == self.weight.dtype == torch.float32
                and self.e_score_correction_bias.dtype == torch.float32):
            return kernel.route(x_TD, self.weight, self.e_score_correction_bias, self.top_k,
                                self.scoring != "sigmoid", self.renormalize, self.scaling, max(self.groups, 1),
                                self.topk_group if self.groups > 1 else 1)
        return self.reference(x_TD)

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
        self.store: ExpertProvider | None = None  # attached by the loader; never part of state_dict
        self.int8_activations = False  # LoadOptions.expert_activations: int8 activations in the grouped kernel
        # engine/cuda_graph.py StepExperts while a graphed decode step runs the forward: the routed experts
        # through a table of addresses on the device; never part of state_dict
        self.step_experts = None

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        shape = x_BTD.shape
        x_TD = x_BTD.reshape(-1, shape[-1])
        ids_TK, w_TK = self.gate(x_TD)
        y_TD = self._latent_resident(x_TD, ids_TK, w_TK)
        if y_TD is None:
            h_TI = self.routed_expert_down_proj(x_TD) if hasattr(self, "routed_expert_down_proj") else x_TD
            routed_TI = self.run_experts(h_TI, ids_TK, w_TK)
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
        return self._modules.pop("expert_lora", None)

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

    def _experts_in_torch(self, h_TI: torch.Tensor, w_TK: torch.Tensor) -> bool:
        """Whether the experts must run as torch ops: autograd wants them, or an adapter changes them."""
        return "expert_lora" in self._modules or (torch.is_grad_enabled() and (h_TI.requires_grad or w_TK.requires_grad))

    def run_experts(self, h_TI: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
        trainable = self._modules.get("experts")  # full training (train/experts.py): experts as parameters
        if trainable is not None:
            return trainable(h_TI, ids_TK, w_TK)
        if self.store is None:
            raise RuntimeError(f"layer {self.layer_idx}: MoE block has no expert store attached")
        served = self._modules.get("served_lora")
        split = served.split(h_TI.shape[0]) if served is not None else None
        if split is not None:
            return self._run_experts_served(h_TI, ids_TK, w_TK, served, *split)
        if self._experts_in_torch(h_TI, w_TK):
            return self._run_experts_torch(h_TI, ids_TK, w_TK)
        return self._run_experts_fast(h_TI, ids_TK, w_TK)

    def _run_experts_fast(self, h_TI: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
        """The experts on the inference kernels (no autograd, no adapter)."""
        if self.step_experts is not None:
            return self.step_experts(self, h_TI, ids_TK, w_TK)
        out_TI = torch.zeros(h_TI.shape, dtype=torch.float32, device=h_TI.device)
        table = self._resident_table(h_TI, ids_TK)
        if table is not None and table.run(h_TI, ids_TK, w_TK, out_TI, self):
            return out_TI.to(h_TI.dtype)
        unique_ids, counts, token_of, weights = pairs_by_expert(ids_TK, w_TK)
        # One fetch per layer step, so the store sees the whole active set (pins, traces, read-ahead);
        # it hands each expert over when indexed, one at a time (unless all are resident): a prefill step
        # may route to every expert of the layer, and holding them all would defeat the memory budget.
        # With hybrid experts (experts/hybrid.py) those the fast tier lacks may come from host memory.
        experts = fetch_step(self.store, self.layer_idx, unique_ids, h_TI.shape[0])
        host = getattr(experts, "host", None) if runs_apart(h_TI.device) else None
        on_host = None
        group = _Group(h_TI, token_of, weights, out_TI, self.act, self.situ_betas, self.int8_activations)
        start = 0
        for i, n in enumerate(counts):
            expert = experts[i]
            if host is not None and host[i]:
                on_host = on_host or OnHost(h_TI, token_of, weights, self)
                on_host.group.take(expert, start, n)
            else:
                group.take(expert, start, n)
            del expert  # the store may evict it while the next one loads; do not keep it alive here
            start += n
        group.flush()
        if on_host is not None:
            on_host.finish(out_TI)
        return out_TI.to(h_TI.dtype)

    def _run_experts_served(self, h_TI: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor, served,
                            adapted: list[int], others: list[int], slots: list[int]) -> torch.Tensor:
        """Rows whose adapter (lora.serving) has expert LoRA here run as torch ops with their adapters'
        deltas, as a model with that one adapter loaded runs them; the other rows on the fast paths, as
        without adapters. A step with both fetches its experts once for each part."""
        if not others:
            return self._run_experts_torch(h_TI, ids_TK, w_TK, served, slots)
        out_TI = torch.empty_like(h_TI)
        for rows, adapter_slots in ((others, None), (adapted, slots)):
            idx = torch.tensor(rows, dtype=torch.int64, device=h_TI.device)
            h, ids, w = h_TI.index_select(0, idx), ids_TK.index_select(0, idx), w_TK.index_select(0, idx)
            out_TI[idx] = (self._run_experts_fast(h, ids, w) if adapter_slots is None else
                           self._run_experts_torch(h, ids, w, served, adapter_slots))
        return out_TI

    def _run_experts_torch(self, h_TI: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor, served=None,
                           row_slots: list[int] | None = None) -> torch.Tensor:
        """The experts as torch ops autograd follows: each expert's three projections (ops.expert_format.project:
        the fast kernel forward, backward from the same bytes), the activation and the LoRA deltas, then
        the weighted sum, all out of place. Float experts without adapters (LoRA on attention only) instead
        run as one autograd node: `expert_format.frozen_moe` when every expert of the step is one (gather,
        experts and weighted sum together), else `expert_format.frozen_group` per run of them (the same
        math, far fewer calls). Experts come from the store as at inference, one at a time; what the graph
        keeps of them for backward the store hands out and counts (`store.hold`).
        served, row_slots: served adapters (ExpertLoRASlots) and each row's slot, instead of `expert_lora`."""
        unique_ids, counts, token_of, weights = pairs_by_expert(ids_TK, w_TK)
        token_of = token_of.to(h_TI.device)
        lora = self._modules.get("expert_lora")
        if served is not None:
            adapters = served.adapters(unique_ids, counts, token_of, row_slots)
        else:
            adapters = lora.adapters(unique_ids) if lora is not None else [None] * len(unique_ids)
        experts = self.store.fetch(self.layer_idx, unique_ids)
        hold = getattr(self.store, "hold", None)
        ys, helds, x_PI = [], [], None
        for i, e in enumerate(unique_ids):
            expert = experts[i]
            held = hold(self.layer_idx, e, expert) if hold is not None else expert_autograd.Held(expert)
            grouped = adapters[i] is None and expert_autograd.groupable(expert, h_TI)
            del expert  # the store may evict it while the next one loads; only `held` may keep it
            if grouped:
                helds.append(held)
                continue
            if x_PI is None:
                x_PI = h_TI.index_select(0, token_of).split(counts)  # one gather (and one scatter in backward)
            self._flush_frozen(ys, helds, x_PI, counts, i)
            ys.append(expert_autograd.train_forward(held, x_PI[i], self.act, self.situ_betas, adapters[i]))
            del held
        if x_PI is None and helds:
            return expert_autograd.frozen_moe(helds, h_TI, token_of, weights, counts, self.act,
                                            self.situ_betas).to(h_TI.dtype)
        self._flush_frozen(ys, helds, x_PI, counts, len(unique_ids))
        y_PI = torch.cat(ys) if len(ys) > 1 else ys[0] if ys else h_TI.new_zeros(0, h_TI.shape[-1])
        return combine_pairs(h_TI, y_PI, weights, token_of).to(h_TI.dtype)

    def _flush_frozen(self, ys: list, helds: list, x_PI: tuple[torch.Tensor, ...], counts: list[int], end: int) -> None:
        """Appends to ys the output of the frozen experts in `helds` (those just before expert `end`), and
        empties `helds`."""
        if not helds:
            return
        first = end - len(helds)
        x = torch.cat(x_PI[first:end]) if end - first > 1 else x_PI[first]
        ys.append(expert_autograd.frozen_group(helds, x, counts[first:end], self.act, self.situ_betas))
        helds.clear()

    def _latent_resident(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor | None:
        """K3's latent routed part of a decode step in one C call (cpu_kernels.latent_moe_resident: the down
        projection, the experts through the resident table, the norm, the up projection; the same bits as
        the calls below), where the table applies and the projections are bf16 stored-weight Linears. None:
        take the calls below."""
        down, up = getattr(self, "routed_expert_down_proj", None), getattr(self, "routed_expert_up_proj", None)
        served = self._modules.get("served_lora")
        if served is not None and served.in_use():  # rows with expert adapters: run_experts splits the rows
            return None
        if down is not None and up is not None:  # served adapters on them: only while no row uses one
            if adapter_split((down, up), x_TD.shape[0])[1] is not False:
                return None
            down, up = unadapted(down), unadapted(up)
        if (kernel_of(down) != "bf16" or kernel_of(up) != "bf16" or gemm_in_bf16()
                or down.weight.dtype != torch.bfloat16 or up.weight.dtype != torch.bfloat16
                or x_TD.dtype != torch.float32):
            return None
        table = self._resident_table(x_TD, ids_TK)
        if table is None or table.kind is None:
            return None
        norm = getattr(self, "routed_expert_norm", None)
        norm_w = None if norm is None else derived(norm, "weight_fp32", norm.weight.float, norm.weight)
        got = cpu_kernels.kernel().latent_moe_resident(
            x_TD.contiguous(), down.weight, norm_w, 0.0 if norm is None else norm.eps, up.weight, table.rows,
            ids_TK.contiguous(), w_TK.float().contiguous(), table.F, table.kind, self.act, self.situ_betas,
            self.int8_activations)
        if got is None:
            return None
        table.book(self.layer_idx, ids_TK, got[1])
        return got[0]

    def _resident_table(self, h_TI: torch.Tensor, ids_TK: torch.Tensor) -> _ResidentTable | None:
        """`resident_table` for this step: eager CPU inference with too few tokens for any expert to take
        the GEMM path."""
        if (ids_TK.shape[0] >= expert_mxfp4.GEMM_MIN_TOKENS or cpu_kernels.for_inference(h_TI) is None
                or self.step_experts is not None):
            return None
        return self.resident_table()

    def resident_table(self) -> _ResidentTable | None:
        """The layer's table of the experts its store's fast tier holds, where decode steps may use it: a
        store that mirrors its fast tier into it (ExpertStore.mirror; a tier that keeps nothing has an empty
        table, which the native step's in-call loads fill for one step), records no trace (a trace wants every
        fetch), experts on the grouped CPU kernel. (Anything that would change
        what an expert computes, such as an attached expert LoRA or trainable experts, takes no table; served
        adapters' rows must take the fetch path.)"""
        s = self.store
        fast = getattr(s, "fast", None)
        if (not hasattr(s, "mirror") or fast is None or fast.device.type != "cpu"
                or s.trace is not None or expert_mxfp4.grouped() is None
                or "expert_lora" in self._modules or "experts" in self._modules):
            return None
        table = self.__dict__.get("_resident")
        if table is None or table.store is not s:
            table = self.__dict__["_resident"] = _ResidentTable(s, self.num_experts, self.expert_width)
            s.mirror(self.layer_idx, table)
        return table


_ZEROS = (0,) * 6


class _ResidentTable:
    """Kernel pointers of the layer's experts that its store's fast tier holds, kept by the store as it
    stores and evicts them (ExpertStore.mirror): a decode step goes from the router's choice to the grouped
    kernel in one call (cpu_kernels.moe_resident: it groups the pairs itself, the same way) instead of the
    store's fetch and the per-expert grouping here, and books the hits with the store (`book`). The store
    changes the table only inside its own calls, on the thread that makes them, which is the thread that
    runs the steps reading it."""

    def __init__(self, store, num_experts: int, I: int):
        self.store, self.I = store, I
        with torch.inference_mode(False):  # made in a scheduler step, written to outside one too
            self.rows = torch.zeros(num_experts, 6, dtype=torch.int64)  # zeros: not resident
        # the same memory for the store's writes: a ctypes slice assignment is ~20x cheaper than a tensor's
        self._cells = (ctypes.c_int64 * (num_experts * 6)).from_address(self.rows.data_ptr())
        self.experts: dict[int, object] = {}  # what the rows point into, kept alive with them
        self.kind: str | None = None
        self.F = 0

    def added(self, e: int, w) -> None:
        row = self.row(w)
        if row is not None:
            self._cells[6 * e : 6 * e + 6] = row
            self.experts[e] = w

    def loaded(self, e: int, w, row: tuple[int, ...]) -> None:
        """Expert w, loaded by the native decode step itself (experts/incall.py), with the row it wrote (written
        again: the store's books may have cleared it meanwhile, evicting the expert's previous copy)."""
        self._cells[6 * e : 6 * e + 6] = row
        self.experts[e] = w

    def removed(self, e: int) -> None:
        if self.experts.pop(e, None) is not None:
            self._cells[6 * e : 6 * e + 6] = _ZEROS

    def row(self, w) -> tuple[int, ...] | None:
        """Expert w's six table entries, or None where it cannot be in this table (another format, or
        matrices not laid out for the kernel); the first one fixes the table's format."""
        kind = grouped_kind(w)
        if kind is None or self.kind not in (None, kind):
            return None
        got = cpu_kernels.resident_row(w, self.I, kind)
        if got is None:
            return None
        self.kind, self.F = kind, got[0]
        return got[1]

    def book(self, layer: int, ids_TK: torch.Tensor, used: int, loaded: dict | None = None) -> None:
        """The store's books of a step this table served: the router's ids (any shape), `used` distinct experts;
        `loaded`: those the native decode step loaded itself (ExpertStore.table_step)."""
        if not self.store.can_evict:
            self.store.count_resident_hits(used)
            return
        ids = sorted(set(ids_TK.flatten().tolist()))  # (torch.unique: ~0.2 ms)
        if loaded:
            self.store.table_step(layer, ids, loaded)
        else:
            self.store.table_hits(layer, ids)

    def run(self, h_TI: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor, out_TI: torch.Tensor, moe: MoE) -> bool:
        """Adds the step's experts into out_TI; False (nothing done) when one of them is not in the table."""
        if self.kind is None:
            return False
        used = cpu_kernels.kernel().moe_resident(
            h_TI.float().contiguous(), self.rows, ids_TK.contiguous(), w_TK.float().contiguous(), self.F, self.kind,
            moe.act, moe.situ_betas, out_TI, moe.int8_activations)
        if used is None:
            return False
        self.book(moe.layer_idx, ids_TK, used)
        return True


def combine_pairs(h_TI: torch.Tensor, y_PI: torch.Tensor, weights: torch.Tensor, token_of: torch.Tensor) -> torch.Tensor:
    """Each token's routed output under autograd: its pairs' outputs times their routing weights, added from
    zero in pair order in fp32 (float64 stays), as the inference kernels sum; [T, I] in that accumulator dtype."""
    acc = torch.promote_types(h_TI.dtype, torch.float32)
    contrib_PI = y_PI.to(acc) * weights.to(device=h_TI.device, dtype=acc)[:, None]
    return torch.zeros(h_TI.shape, dtype=acc, device=h_TI.device).index_add(0, token_of, contrib_PI)


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
    order = flat_ids.argsort(stable=True)
    unique_ids_t, counts_t = flat_ids[order].unique_consecutive(return_counts=True)
    return unique_ids_t.tolist(), counts_t.tolist(), order // K, w_TK.flatten()[order]


def runs_apart(device: torch.device) -> bool:
    """Whether hybrid experts read into host memory run apart from a block on `device` (OnHost): on an
    accelerator; on the CPU they join the step's one group, the same calls as resident experts."""
    return device.type != "cpu"


class OnHost:
    """The experts of a layer step that run on the CPU while the block runs on an accelerator (hybrid experts,
    experts/hybrid.py): the step's rows copied down once, its experts computed as a CPU-only run computes
    them (_Group, or alone), their fp32 outputs copied back and added once."""

    def __init__(self, h_TI: torch.Tensor, token_of: torch.Tensor, weights: torch.Tensor, moe: MoE):
        h_TI = h_TI.float().cpu()
        self.group = _Group(h_TI, token_of.cpu(), weights.float().cpu(), torch.zeros(h_TI.shape, dtype=torch.float32),
                            moe.act, moe.situ_betas, moe.int8_activations)

    def finish(self, out_TI: torch.Tensor) -> None:
        self.group.flush()
        out_TI += self.group.out_TI.to(out_TI.device)


class _Group:
    """Consecutive experts of one kind (CPU: MXFP4, or bf16 kept as stored; CUDA: MXFP4 on triton) of a layer
    step computed by one kernel call (ops.expert_mxfp4.grouped): one call per decode step instead of one per
    expert. Flushed before it holds GROUP_BYTES of experts (the store's budget still bounds memory) or
    GROUP_SCRATCH bytes of activations, and when the kind changes. On the CPU an expert with GEMM_MIN_TOKENS
    pairs runs on its own (its GEMM); the triton kernel tiles those itself."""

    GROUP_BYTES = 64 << 20
    GROUP_SCRATCH = 64 << 20

    def __init__(self, h_TI, token_of, weights, out_TI, act, situ_betas, int8_activations=False):
        self.device_type = h_TI.device.type
        self.run = expert_mxfp4.grouped(self.device_type)
        self.int8 = int8_activations
        self.h_TI, self.token_of, self.weights, self.out_TI = h_TI, token_of, weights, out_TI
        self.act, self.situ_betas = act, situ_betas
        self.experts: list = []
        self.offsets = [0]
        self.start = self.nbytes = 0
        self.kind: str | None = None

    def add(self, expert, start: int, n: int) -> bool:
        """Takes the expert's n pairs from `start` into the group; False when it must run on its own."""
        kind = expert_mxfp4.group_kind(expert, self.device_type)
        if self.run is None or kind is None or (n >= expert_mxfp4.GEMM_MIN_TOKENS and self.device_type == "cpu"):
            self.flush()
            return False
        # a group's pairs are one run: an expert whose pairs do not follow (those between went to another
        # group, as hybrid experts split a step between the accelerator and the CPU) starts a new one
        if self.experts and (kind != self.kind or start != self.start + self.offsets[-1]):
            self.flush()
        if not self.experts:
            self.start, self.kind = start, kind
        self.experts.append(expert)
        self.offsets.append(self.offsets[-1] + n)
        self.nbytes += expert.nbytes
        width = format_of(expert).width(expert)
        pairs_bytes = self.offsets[-1] * 4 * 2 * (self.h_TI.shape[-1] + width)
        if self.nbytes >= self.GROUP_BYTES or pairs_bytes >= self.GROUP_SCRATCH:
            self.flush()
        return True

    def take(self, expert, start: int, n: int) -> None:
        """The expert's n pairs from `start`: into the group, or computed now on their own where it cannot join."""
        if not self.add(expert, start, n):
            rows = self.token_of[start : start + n]
            y = format_of(expert).forward(expert, self.h_TI[rows], self.act, self.situ_betas)
            self.out_TI.index_add_(0, rows, y.float() * self.weights[start : start + n, None])

    def flush(self) -> None:
        if not self.experts:
            return
        end = self.start + self.offsets[-1]
        self.run(self.h_TI, self.experts, self.token_of[self.start : end], self.offsets,
                 self.weights[self.start : end], self.act, self.situ_betas, self.out_TI,
                 self.int8 and self.kind == "mxfp4")
        self.experts, self.offsets, self.nbytes = [], [0], 0
