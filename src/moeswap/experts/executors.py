"""Expert executors: how a MoE block's routed experts run, one object per execution path, each with a `name`
(reported by `generate --json` / `--stats`) and one call, `executor(h_TI, ids_TK, w_TK) -> [T, I]`. `choose`
picks one when the block's store, expert LoRA, served LoRA or trainable experts are set; per call only the
step itself decides (gradients wanted, a decode-size step for the table, which rows use served adapters).
Uses stores through their public calls only; knows no model. Entry points: `choose(block)`, `EXECUTORS`;
distributed/ep.py and engine/cuda_graph.py bring executors of their own.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from moeswap.experts.hybrid import fetch_step
from moeswap.experts.pairs import combine_pairs, pairs_by_expert
from moeswap.ops import cpu_kernels, expert_mxfp4
from moeswap.ops.kernel_experts import grouped_kind, resident_row
from moeswap.weights import autograd as expert_autograd
from moeswap.weights.registry import format_of

# Shapes: T tokens, I expert input width, K top-k, P (token, expert) pairs, E experts.


class ExpertExecutor:
    """The interface. `__call__` returns the routed sum [T, I] in h_TI's dtype; `in_torch` says whether a call
    runs as torch ops autograd follows (expert parallelism picks its exchange by it); `latent` is K3's whole
    latent routed part in one call where an executor has one (`fuses_latent`), else None; `resident_table`
    is the table the native decode step may read, or None."""

    name = "?"
    fuses_latent = False

    def __call__(self, h_TI: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def in_torch(self, h_TI: torch.Tensor, w_TK: torch.Tensor) -> bool:
        return True

    def latent(self, x_TD, down_w, norm_w, eps, up_w, ids_TK, w_TK) -> torch.Tensor | None:
        return None

    def resident_table(self) -> ResidentTable | None:
        return None


class NoStoreExecutor(ExpertExecutor):
    """A block without experts yet (built, not loaded): any call is an error."""

    name = "no-store"

    def __init__(self, block):
        self.layer = block.layer_idx

    def __call__(self, h_TI, ids_TK, w_TK):
        raise RuntimeError(f"layer {self.layer}: MoE block has no expert store attached")

    def in_torch(self, h_TI, w_TK) -> bool:
        return False


class ParameterExecutor(ExpertExecutor):
    """Full training: the block's experts as parameters (its `experts` submodule, train/experts.py), which
    compute the routed sum themselves with autograd through weights, inputs and routing weights."""

    name = "trainable-parameters"

    def __init__(self, block):
        self.experts = block.experts

    def __call__(self, h_TI, ids_TK, w_TK):
        return self.experts(h_TI, ids_TK, w_TK)


class ReferenceExecutor(ExpertExecutor):
    """Each expert's plain torch reference (its format's `reference`) on its rows, summed per token in fp32:
    the oracle every registered executor matches to fp32 rounding, 1e-5 of the output's largest magnitude
    (tests/experts/test_executors.py). Not chosen by `choose`; no autograd through the experts' bytes."""

    name = "reference"

    def __init__(self, block):
        self.block, self.store = block, block.store

    def __call__(self, h_TI, ids_TK, w_TK):
        b = self.block
        unique_ids, counts, token_of, weights = pairs_by_expert(ids_TK, w_TK)
        token_of = token_of.to(h_TI.device)
        experts = self.store.fetch(b.layer_idx, unique_ids)
        ys: list[torch.Tensor] = []
        start = 0
        for i, n in enumerate(counts):
            w = experts[i]
            ys.append(format_of(w).reference(w, h_TI.index_select(0, token_of[start : start + n]), b.act, b.situ_betas))
            del w
            start += n
        y_PI = torch.cat(ys) if ys else h_TI.new_zeros(0, h_TI.shape[-1])
        return combine_pairs(h_TI, y_PI, weights, token_of).to(h_TI.dtype)


class TorchExecutor(ExpertExecutor):
    """The experts as torch ops autograd follows: each expert's three projections (weights.autograd.project:
    the fast kernel forward, backward from the same bytes), the activation and the LoRA deltas, then the
    weighted sum, all out of place. Float experts without adapters instead run as one autograd node:
    `weights.autograd.frozen_moe` when every expert of the step is one, else `frozen_group` per run of them (the
    same math, far fewer calls). Experts come from the store one at a time; what the graph keeps of them for
    backward the store hands out and counts (`store.hold`). Chosen with an expert LoRA attached (its `lora`);
    the kernel executors fall back to it for calls that want gradients."""

    name = "torch-autograd"

    def __init__(self, block):
        self.block, self.store = block, block.store
        self.lora = block._modules.get("expert_lora")  # None where a kernel executor falls back to this one

    def __call__(self, h_TI, ids_TK, w_TK):
        return self.run(h_TI, ids_TK, w_TK)

    def run(self, h_TI: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor, served=None,
            row_slots: list[int] | None = None) -> torch.Tensor:
        """served, row_slots: served adapters (ExpertLoRASlots) and each row's slot, instead of `lora`."""
        b = self.block
        unique_ids, counts, token_of, weights = pairs_by_expert(ids_TK, w_TK)
        token_of = token_of.to(h_TI.device)
        if served is not None:
            adapters = served.adapters(unique_ids, counts, token_of, row_slots)
        else:
            adapters = self.lora.adapters(unique_ids) if self.lora is not None else [None] * len(unique_ids)
        experts = self.store.fetch(b.layer_idx, unique_ids)
        hold = getattr(self.store, "hold", None)  # (test stores without the autograd protocol keep the expert)
        ys: list[torch.Tensor] = []
        helds: list = []
        x_PI = None
        for i, e in enumerate(unique_ids):
            expert = experts[i]
            held = hold(b.layer_idx, e, expert) if hold is not None else expert_autograd.Held(expert)
            grouped = adapters[i] is None and expert_autograd.groupable(expert, h_TI)
            del expert  # the store may evict it while the next one loads; only `held` may keep it
            if grouped:
                helds.append(held)
                continue
            if x_PI is None:
                x_PI = h_TI.index_select(0, token_of).split(counts)  # one gather (and one scatter in backward)
            self._flush_frozen(ys, helds, x_PI, counts, i)
            ys.append(expert_autograd.train_forward(held, x_PI[i], b.act, b.situ_betas, adapters[i]))
            del held
        if x_PI is None and helds:
            return expert_autograd.frozen_moe(helds, h_TI, token_of, weights, counts, b.act,
                                            b.situ_betas).to(h_TI.dtype)
        self._flush_frozen(ys, helds, x_PI, counts, len(unique_ids))
        y_PI = torch.cat(ys) if len(ys) > 1 else ys[0] if ys else h_TI.new_zeros(0, h_TI.shape[-1])
        return combine_pairs(h_TI, y_PI, weights, token_of).to(h_TI.dtype)

    def _flush_frozen(self, ys: list, helds: list, x_PI, counts: list[int], end: int) -> None:
        """Appends to ys the output of the frozen experts in `helds` (those just before expert `end`), and
        empties `helds`."""
        if not helds:
            return
        first = end - len(helds)
        x = torch.cat(x_PI[first:end]) if end - first > 1 else x_PI[first]
        ys.append(expert_autograd.frozen_group(helds, x, counts[first:end], self.block.act, self.block.situ_betas))
        helds.clear()


class KernelExecutor(ExpertExecutor):
    """Base of the inference-kernel executors: `kernels` runs the step without autograd or adapters."""

    def __init__(self, block):
        self.block, self.store = block, block.store
        self.autograd = TorchExecutor(block)

    def in_torch(self, h_TI, w_TK) -> bool:
        return torch.is_grad_enabled() and (h_TI.requires_grad or w_TK.requires_grad)

    def __call__(self, h_TI, ids_TK, w_TK):
        # The one decision made per call: gradients wanted for this call's inputs (LoRA on attention only, a
        # gradient check) is a property of the call, not of the block, so autograd must see these experts now.
        if self.in_torch(h_TI, w_TK):
            return self.autograd(h_TI, ids_TK, w_TK)
        return self.kernels(h_TI, ids_TK, w_TK)

    def kernels(self, h_TI: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class GroupedExecutor(KernelExecutor):
    """The step's experts fetched from the store and computed by the grouped kernel (`Group`: one call per
    run of experts of one kind; C on the CPU, triton on CUDA), or alone where one cannot join (the GEMM path
    from GEMM_MIN_TOKENS rows on the CPU, formats without a grouped kernel)."""

    NAME = "{device}-grouped"

    def __init__(self, block):
        super().__init__(block)
        self.name = self.NAME.format(device=block.gate.weight.device.type)

    def kernels(self, h_TI, ids_TK, w_TK):
        unique_ids, counts, token_of, weights = pairs_by_expert(ids_TK, w_TK)
        # One fetch per layer step, so the store sees the whole active set (pins, traces, read-ahead); it hands
        # each expert over when indexed, one at a time (unless all are resident): a prefill step may route to
        # every expert of the layer, and holding them all would defeat the memory budget. With hybrid experts
        # (experts/hybrid.py) those the fast tier lacks may come from host memory.
        experts = fetch_step(self.store, self.block.layer_idx, unique_ids, h_TI.shape[0])
        count = getattr(self.store, "count_routing", None)  # (the dedup stats: test stores may lack it)
        if count is not None:
            count(len(token_of), len(unique_ids))
        out_TI = torch.zeros(h_TI.shape, dtype=torch.float32, device=h_TI.device)
        self.compute(experts, counts, h_TI, token_of, weights, out_TI)
        return out_TI.to(h_TI.dtype)

    def compute(self, experts, counts: list[int], h_TI, token_of, weights, out_TI, host: list[bool] | None = None):
        """Adds the step's experts into out_TI; host[i]: expert i runs apart on the CPU (OnHost). Where the fetch
        has reads in flight (`ready`: a streaming store) the group runs what it holds before waiting for the next
        expert's read, so compute overlaps the reads still in flight (the kernel's sums do not depend on where a
        group is cut: tests/experts/test_streaming.py compares with all-resident bits)."""
        b = self.block
        group = Group(h_TI, token_of, weights, out_TI, b.act, b.situ_betas, b.int8_activations)
        on_host = None
        start = 0
        ready = getattr(experts, "ready", None)  # a fetch with reads in flight (a store that streams experts)
        for i, n in enumerate(counts):
            if ready is not None and group.experts and not ready(i):
                group.flush()  # compute the experts already read while this one's read completes
            expert = experts[i]
            if host is not None and host[i]:
                on_host = on_host or OnHost(h_TI, token_of, weights, b)
                on_host.group.take(expert, start, n)
            else:
                group.take(expert, start, n)
            del expert  # the store may evict it while the next one loads; do not keep it alive here
            start += n
        group.flush()
        if on_host is not None:
            on_host.finish(out_TI)


class HybridExecutor(GroupedExecutor):
    """Hybrid experts on an accelerator (`--expert-compute cpu|auto`, experts/hybrid.py): the experts the fast
    tier holds run as GroupedExecutor runs them, those read into host memory run on the CPU apart (OnHost).
    On the CPU the host experts join the step's one group instead: no executor of their own there."""

    NAME = "hybrid"

    def compute(self, experts, counts, h_TI, token_of, weights, out_TI, host=None):
        # a HybridFetched marks the experts it read into host memory; a plain fetch (all resident) has no marks
        super().compute(experts, counts, h_TI, token_of, weights, out_TI, getattr(experts, "host", None))


class ResidentTableExecutor(GroupedExecutor):
    """Decode steps on the CPU straight from the layer's table of the experts the store's fast tier holds
    (ResidentTable; cpu_kernels.moe_resident: router choice to grouped kernel in one call, no fetch), and K3's
    whole latent routed part in one call (`latent`, cpu_kernels.latent_moe_resident). A step the table cannot
    take (GEMM_MIN_TOKENS tokens or more, gradients, an expert not resident) runs as GroupedExecutor."""

    NAME = "resident-table"

    def __init__(self, block):
        super().__init__(block)
        self.fuses_latent = hasattr(block, "routed_expert_down_proj") and hasattr(block, "routed_expert_up_proj")

    def kernels(self, h_TI, ids_TK, w_TK):
        table = self.step_table(h_TI, ids_TK)
        if table is not None:
            out_TI = torch.zeros(h_TI.shape, dtype=torch.float32, device=h_TI.device)
            if table.run(h_TI, ids_TK, w_TK, out_TI, self.block):
                return out_TI.to(h_TI.dtype)
        return super().kernels(h_TI, ids_TK, w_TK)

    def step_table(self, h_TI: torch.Tensor, ids_TK: torch.Tensor) -> ResidentTable | None:
        """The table for this step: eager CPU inference with too few tokens for any expert to take the GEMM
        path."""
        if ids_TK.shape[0] >= expert_mxfp4.GEMM_MIN_TOKENS or cpu_kernels.for_inference(h_TI) is None:
            return None
        return self.resident_table()

    def resident_table(self) -> ResidentTable | None:
        """The layer's table, made and mirrored by the store on first use (kept on the block, so that choosing
        again does not mirror a second one). None while the store records a trace (which wants every fetch;
        recording may begin after load) or the grouped CPU kernel is switched off (ENV_KERNEL)."""
        s, b = self.store, self.block
        if s.trace is not None or expert_mxfp4.grouped() is None:
            return None
        table = b.__dict__.get("_resident")
        if table is None or table.store is not s:
            table = b.__dict__["_resident"] = ResidentTable(s, b.num_experts, b.expert_width)
            s.mirror(b.layer_idx, table)
        return table

    def latent(self, x_TD, down_w, norm_w, eps, up_w, ids_TK, w_TK):
        """The down projection, the experts through the table, the norm and the up projection in one C call
        (the same bits as the block's calls), or None where the table does not take the step."""
        table = self.step_table(x_TD, ids_TK)
        if table is None or table.kind is None:
            return None
        b = self.block
        got = cpu_kernels.kernel().latent_moe_resident(
            x_TD.contiguous(), down_w, norm_w, eps, up_w, table.rows, ids_TK.contiguous(),
            w_TK.float().contiguous(), table.F, table.kind, b.act, b.situ_betas, b.int8_activations)
        if got is None:
            return None
        table.book(b.layer_idx, ids_TK, got[1])
        return got[0]


class ServedLoRAExecutor(ExpertExecutor):
    """Served adapters (lora.serving) with routed-expert LoRA here: rows whose adapter has some run as torch ops
    with their adapters' deltas (as a model with that one adapter loaded runs them), the others on the inner
    kernel executor (as without adapters). Which rows use which adapter is set per forward by the scheduler,
    so the split is decided per call; a step with both kinds fetches its experts once for each part."""

    def __init__(self, block):
        self.served = block.served_lora
        self.inner = kernel_executor(block)
        self.name = f"served-lora({self.inner.name})"
        self.fuses_latent = self.inner.fuses_latent

    def __call__(self, h_TI, ids_TK, w_TK):
        split = self.served.split(h_TI.shape[0])
        if split is None:
            return self.inner(h_TI, ids_TK, w_TK)
        adapted, others, slots = split
        adapters = self.inner.autograd
        if not others:
            return adapters.run(h_TI, ids_TK, w_TK, self.served, slots)
        out_TI = torch.empty_like(h_TI)
        for rows, adapter_slots in ((others, None), (adapted, slots)):
            idx = torch.tensor(rows, dtype=torch.int64, device=h_TI.device)
            h, ids, w = h_TI.index_select(0, idx), ids_TK.index_select(0, idx), w_TK.index_select(0, idx)
            out_TI[idx] = (self.inner.kernels(h, ids, w) if adapter_slots is None else
                           adapters.run(h, ids, w, self.served, adapter_slots))
        return out_TI

    def in_torch(self, h_TI, w_TK) -> bool:
        return self.inner.in_torch(h_TI, w_TK)

    def latent(self, *args):
        # rows with expert adapters need the split above; only while no row uses one
        return None if self.served.in_use() else self.inner.latent(*args)

    def resident_table(self):
        return self.inner.resident_table()


# every executor made from a block alone, by kind: cls(block), from what is set on the block (`choose` picks
# among them; `reference` is the oracle it never picks)
EXECUTORS: dict[str, type[ExpertExecutor]] = {
    "reference": ReferenceExecutor,
    "torch-autograd": TorchExecutor,
    "grouped": GroupedExecutor,
    "resident-table": ResidentTableExecutor,
    "hybrid": HybridExecutor,
    "served-lora": ServedLoRAExecutor,
    "trainable-parameters": ParameterExecutor,
}


def choose(block) -> ExpertExecutor:
    """The block's executor from what is set on it: trainable experts, else (without a store) none, else an
    attached expert LoRA's torch ops, else the inference kernels (behind served adapters where it has some).
    Served adapters and an attached expert LoRA do not meet (lora.serving refuses a model carrying LoRA)."""
    if block._modules.get("experts") is not None:
        return ParameterExecutor(block)
    if block.store is None:
        return NoStoreExecutor(block)
    if block._modules.get("expert_lora") is not None:
        return TorchExecutor(block)
    if block._modules.get("served_lora") is not None:
        return ServedLoRAExecutor(block)
    return kernel_executor(block)


def kernel_executor(block) -> KernelExecutor:
    """The inference kernels for the block's store: hybrid experts apart on an accelerator; the resident table
    where the store mirrors a fast tier in CPU memory; else the grouped fetch."""
    store = block.store
    if getattr(store, "hybrid", None) is not None and runs_apart(block.gate.weight.device):
        return HybridExecutor(block)
    fast = getattr(store, "fast", None)
    if hasattr(store, "mirror") and fast is not None and fast.device.type == "cpu":
        return ResidentTableExecutor(block)
    return GroupedExecutor(block)


def executor_names(blocks) -> str:
    """The blocks' executors' names, distinct ones in layer order joined by "+" (`generate --json`)."""
    names: list[str] = []
    for block in blocks:
        if block.executor.name not in names:
            names.append(block.executor.name)
    return "+".join(names)


def runs_apart(device: torch.device) -> bool:
    """Whether hybrid experts read into host memory run apart from a block on `device` (OnHost): on an
    accelerator; on the CPU they join the step's one group, the same calls as resident experts."""
    return device.type != "cpu"


_ZEROS = (0,) * 6


class ResidentTable:
    """Kernel pointers of the layer's experts that its store's fast tier holds, kept by the store as it
    stores and evicts them (ExpertStore.mirror): a decode step goes from the router's choice to the grouped
    kernel in one call (cpu_kernels.moe_resident: it groups the pairs itself, the same way) instead of the
    store's fetch and the per-expert grouping, and books the hits with the store (`book`). The store
    changes the table only inside its own calls, on the thread that makes them, which is the thread that
    runs the steps reading it."""

    def __init__(self, store, num_experts: int, I: int):
        self.store, self.I = store, I
        with torch.inference_mode(False):  # made in a scheduler step, written to outside one too
            self.rows = torch.zeros(num_experts, 6, dtype=torch.int64)  # zeros: not resident
        # the same memory for the store's writes: a ctypes slice assignment is far cheaper than a tensor's
        self._cells: Any = (ctypes.c_int64 * (num_experts * 6)).from_address(self.rows.data_ptr())
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
        got = resident_row(w, self.I, kind)
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
        ids = sorted(set(ids_TK.flatten().tolist()))  # (cheaper than torch.unique at decode sizes)
        if loaded:
            self.store.table_step(layer, ids, loaded)
        else:
            self.store.table_hits(layer, ids)

    def run(self, h_TI: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor, out_TI: torch.Tensor, block) -> bool:
        """Adds the step's experts into out_TI; False (nothing done) when one of them is not in the table."""
        if self.kind is None:
            return False
        used = cpu_kernels.kernel().moe_resident(
            h_TI.float().contiguous(), self.rows, ids_TK.contiguous(), w_TK.float().contiguous(), self.F, self.kind,
            block.act, block.situ_betas, out_TI, block.int8_activations)
        if used is None:
            return False
        self.book(block.layer_idx, ids_TK, used)
        return True


class OnHost:
    """The experts of a layer step that run on the CPU while the block runs on an accelerator (hybrid experts,
    experts/hybrid.py): the step's rows copied down once, its experts computed as a CPU-only run computes
    them (Group, or alone), their fp32 outputs copied back and added once."""

    def __init__(self, h_TI: torch.Tensor, token_of: torch.Tensor, weights: torch.Tensor, block):
        h_TI = h_TI.float().cpu()
        self.group = Group(h_TI, token_of.cpu(), weights.float().cpu(), torch.zeros(h_TI.shape, dtype=torch.float32),
                           block.act, block.situ_betas, block.int8_activations)

    def finish(self, out_TI: torch.Tensor) -> None:
        self.group.flush()
        out_TI += self.group.out_TI.to(out_TI.device)


class Group:
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
