"""Routed-expert LoRA: adapters on the w1 / w2 / w3 projections of every routed expert of one MoE block, with
PEFT's math (y += B A dropout(x) * alpha / r; B zero, A as PEFT's kaiming_uniform(a=sqrt(5)) draws it), one A
per projection shared by all experts as an option, or some experts' rows only (expert parallelism).
`ExpertLoRA.adapters(ids)` feeds the torch executor's projections (weights.autograd.train_forward); PEFT key
names in and out; `ExpertLoRASlots`: several adapters served at once (lora.serving), each pair with its row's.
Shapes: E experts, r rank, O/N a projection's output/input width, P the (token, expert) pairs of a step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from moeswap.ops.kernel_abi import EXPERT_PROJS

PROJS = EXPERT_PROJS  # gate, down, up: the checkpoint's names, and PEFT's module names under experts.{e}


def peft_key(layer: int, expert: int, proj: str, part: str) -> str:
    """PEFT's name of one expert's lora_A / lora_B weight (without the `base_model.model.` prefix)."""
    return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.{part}.weight"


class ExpertLoRA(nn.Module):
    def __init__(self, num_experts: int, shapes: Mapping[str, tuple[int, int]], rank: int, alpha: float,
                 dropout: float = 0.0, projections: Sequence[str] = PROJS, shared_a: bool = False,
                 device=None, dtype: torch.dtype = torch.float32, generator: torch.Generator | None = None,
                 experts: Sequence[int] | None = None):
        """shapes: each projection's [O, N] (w1, w3 [F, I], w2 [I, F]). experts: hold only these experts' rows
        (ascending; expert parallelism, distributed/lora_shards.py), with the values the whole LoRA has there:
        A is drawn one expert at a time through an [r, N] scratch row, which on a CPU generator gives the
        whole [E, r, N] draw's values and leaves the generator where it leaves it; only the rows kept stay."""
        super().__init__()
        projections = tuple(projections)
        if not projections or len(set(projections)) != len(projections) or not set(projections) <= set(PROJS):
            raise ValueError(f"expert LoRA projections {list(projections)}: expected distinct names among "
                             f"{', '.join(PROJS)}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"expert LoRA rank must be a positive integer, got {rank!r}")
        if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"expert LoRA alpha must be a finite positive number, got {alpha!r}")
        if not (isinstance(dropout, (int, float)) and 0.0 <= dropout < 1.0):
            raise ValueError(f"expert LoRA dropout must be in [0, 1), got {dropout!r}")
        self.num_experts, self.rank, self.alpha, self.dropout = num_experts, rank, float(alpha), float(dropout)
        self.scaling = self.alpha / rank
        self.shared_a, self.projections = shared_a, projections
        self.shapes = {p: tuple(shapes[p]) for p in projections}
        rows = tuple(range(num_experts)) if experts is None else self._check_rows(experts)
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for p in projections:
            O, N = self.shapes[p]
            bound = 1.0 / math.sqrt(N)  # kaiming_uniform_(a=sqrt(5)) on an [r, N] weight: U(-1/sqrt(N), 1/sqrt(N))
            A = torch.empty(1 if shared_a else len(rows), rank, N, device=device, dtype=dtype)
            with torch.no_grad():
                if experts is None:
                    A.uniform_(-bound, bound, generator=generator)
                else:  # every expert's row drawn in order (the generator's state), the rows kept copied out
                    kept = dict(zip(rows, range(len(rows))))
                    scratch = A.new_empty(rank, N)
                    for e in range(num_experts):
                        scratch.uniform_(-bound, bound, generator=generator)
                        if e in kept:
                            A[kept[e]].copy_(scratch)
                    del scratch
            self.lora_A[p] = nn.Parameter(A)
            self.lora_B[p] = nn.Parameter(torch.zeros(len(rows), O, rank, device=device, dtype=dtype))
        self.experts: tuple[int, ...] = rows  # the expert of each row (experts= or keep_rows: a subset)
        self._row: dict[int, int] | None = None if experts is None else self._rows_map(rows)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, rank={self.rank}, alpha={self.alpha}, dropout={self.dropout}, "
                f"projections={list(self.projections)}, shared_a={self.shared_a}")

    def keep_rows(self, experts: Sequence[int], tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        """Holds the rows of `experts` only (ascending; expert parallelism keeps each expert's LoRA on the rank
        that owns it, distributed/lora_shards.py), in new parameters: taken from the current rows, or the
        whole [len(experts), ...] values from `tensors` ({"lora_A.w1": ..., "lora_B.w1": ...}). Not with a
        shared A."""
        experts = self._check_rows(experts)
        idx = None if tensors is not None else torch.tensor([self.row(e) for e in experts], dtype=torch.int64)
        for part in (self.lora_A, self.lora_B):
            for p in self.projections:
                old = part[p]
                name = f"{'lora_A' if part is self.lora_A else 'lora_B'}.{p}"
                value = tensors[name] if tensors is not None else old.detach().index_select(0, idx.to(old.device))
                part[p] = nn.Parameter(value.to(device=old.device, dtype=old.dtype).clone(),
                                       requires_grad=old.requires_grad)
        self.experts = experts
        self._row = self._rows_map(experts)

    def _check_rows(self, experts: Sequence[int]) -> tuple[int, ...]:
        experts = tuple(int(e) for e in experts)
        if self.shared_a:
            raise ValueError("expert LoRA with a shared A cannot be split by expert")
        if list(experts) != sorted(set(experts)) or not set(experts) <= set(range(self.num_experts)):
            raise ValueError(f"expert LoRA rows: expected ascending distinct experts below {self.num_experts}")
        return experts

    def _rows_map(self, experts: tuple[int, ...]) -> dict[int, int] | None:
        return None if experts == tuple(range(self.num_experts)) else {e: i for i, e in enumerate(experts)}

    def row(self, expert: int) -> int:
        """The parameters' row of `expert` (KeyError: held by another rank)."""
        return expert if self._row is None else self._row[expert]

    def adapters(self, expert_ids: Sequence[int]) -> list:
        """One adapter per expert of a step, `adapter(proj, x) -> delta or None` (weights.format.Adapter).
        The experts' A and B are taken with one gather and split per parameter, so backward scatters their
        gradients once per step instead of once per expert."""
        if not len(expert_ids):
            return []
        first = next(iter(self.lora_B.values()))
        idx = torch.as_tensor([self.row(e) for e in expert_ids], dtype=torch.int64, device=first.device)
        pairs: dict[str, tuple] = {}
        for p in self.projections:
            A, B = self.lora_A[p], self.lora_B[p]
            As = [A[0]] * len(idx) if self.shared_a else A.index_select(0, idx).unbind(0)
            pairs[p] = (As, B.index_select(0, idx).unbind(0))
        return [_Adapter(self, {p: (As[i], Bs[i]) for p, (As, Bs) in pairs.items()}) for i in range(len(idx))]

    def delta(self, proj: str, expert: int, x: torch.Tensor) -> torch.Tensor | None:
        """What the adapter adds to `proj`'s output for expert `expert` on input x (None: not adapted)."""
        if proj not in self.lora_A:
            return None
        A = self.lora_A[proj][0 if self.shared_a else self.row(expert)]
        return self._apply(x, A, self.lora_B[proj][self.row(expert)])

    def _apply(self, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        x = F.dropout(x.to(A.dtype), self.dropout, self.training) if self.dropout else x.to(A.dtype)
        return F.linear(F.linear(x, A), B) * self.scaling

    def merged_delta(self, proj: str, expert: int) -> torch.Tensor:
        """The adapter as a change of the expert's weight, scaling B A [O, N] (for merging into the base)."""
        with torch.no_grad():
            r = self.row(expert)
            return self.lora_B[proj][r] @ self.lora_A[proj][0 if self.shared_a else r] * self.scaling

    # -- PEFT names ------------------------------------------------------------------------------------

    def peft_state_dict(self, layer: int) -> dict[str, torch.Tensor]:
        """{peft_key: tensor}, lora_A [r, N] and lora_B [O, r] per expert and projection, each its own
        contiguous copy (safetensors refuses shared storage). PEFT has no shared-A form: with shared_a the
        one A is written under every expert's key (and load_peft_state_dict requires them to be equal)."""
        out = {}
        for p in self.projections:
            A, B = self.lora_A[p].detach(), self.lora_B[p].detach()
            for r, e in enumerate(self.experts):  # only the rows held here (keep_rows)
                out[peft_key(layer, e, p, "lora_A")] = A[0 if self.shared_a else r].clone()
                out[peft_key(layer, e, p, "lora_B")] = B[r].clone()
        return out

    def load_peft_state_dict(self, layer: int, sd: Mapping[str, torch.Tensor]) -> list[str]:
        """Copies this layer's adapter weights from PEFT-named `sd` (keys as peft_key makes them); returns the
        keys it took. Every expert's A and B of every adapted projection must be there with the right
        shapes, and none for a projection this adapter does not have."""
        prefix = f"model.layers.{layer}.block_sparse_moe.experts."
        mine = [k for k in sd if k.startswith(prefix)]
        stray = sorted({k[len(prefix):].split(".")[1] for k in mine} - set(self.projections))
        if stray:
            raise ValueError(f"adapter has routed-expert weights for layer {layer} {stray[0]}, which this model's "
                             f"expert LoRA does not adapt (projections {', '.join(self.projections)})")
        taken = []
        with torch.no_grad():
            for p in self.projections:
                O, N = self.shapes[p]
                for part, shape, param in (("lora_A", (self.rank, N), self.lora_A[p]),
                                           ("lora_B", (O, self.rank), self.lora_B[p])):
                    values = []
                    for e in self.experts:  # the rows held here
                        key = peft_key(layer, e, p, part)
                        if key not in sd:
                            raise ValueError(f"adapter is missing {key} (expert LoRA on layer {layer} has "
                                             f"{self.num_experts} experts, projections {', '.join(self.projections)})")
                        t = sd[key]
                        if tuple(t.shape) != shape:
                            raise ValueError(f"adapter tensor {key}: expected shape {list(shape)} (rank {self.rank}), "
                                             f"found {list(t.shape)}")
                        values.append(t)
                        taken.append(key)
                    if part == "lora_A" and self.shared_a:
                        if any(not torch.equal(v, values[0]) for v in values[1:]):
                            raise ValueError(f"adapter has different {part} weights per expert for layer {layer} {p}; "
                                             f"this model's expert LoRA shares one A (attach it with shared_a=False)")
                        values = values[:1]
                    param.copy_(torch.stack([v.to(param.dtype) for v in values]))
        return taken


class _Adapter:
    """ExpertLoRA's delta for one expert of a step, its A and B already split out."""

    __slots__ = ("lora", "mats")

    def __init__(self, lora: ExpertLoRA, mats: dict[str, tuple[torch.Tensor, torch.Tensor]]):
        self.lora, self.mats = lora, mats

    def __call__(self, proj: str, x: torch.Tensor) -> torch.Tensor | None:
        ab = self.mats.get(proj)
        return None if ab is None else self.lora._apply(x, *ab)


def model_peft_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every MoE block's expert LoRA weights under PEFT names (without `base_model.model.`)."""
    out: dict[str, torch.Tensor] = {}
    for block in model.moe_blocks():
        lora = block._modules.get("expert_lora")
        if lora is not None:
            out.update(lora.peft_state_dict(block.layer_idx))
    return out


def load_model_peft_state_dict(model: nn.Module, sd: Mapping[str, torch.Tensor]) -> list[str]:
    """Loads every MoE block's expert LoRA from PEFT-named `sd`; returns the keys taken."""
    taken: list[str] = []
    for block in model.moe_blocks():
        lora = block._modules.get("expert_lora")
        if lora is not None:
            taken += lora.load_peft_state_dict(block.layer_idx, sd)
    return taken


class ExpertLoRASlots(nn.Module):
    """Routed-expert LoRA of several adapters served at once (moeswap.lora.serving): an ExpertLoRA per adapter
    slot (`loras`, keyed by the slot's number) and the model's row -> slot context (`rows`, lora.multi.
    AdapterRows). The block's executor (experts/executors.py ServedLoRAExecutor) runs the rows whose adapter
    has expert LoRA here as torch ops with these deltas, each (token, expert) pair with its row's adapter, and
    the other rows on the inference kernels."""

    def __init__(self, rows):
        super().__init__()
        self.__dict__["rows"] = rows
        self.loras = nn.ModuleDict()

    def add(self, slot: int, lora: ExpertLoRA) -> None:
        lora.requires_grad_(False)
        self.loras[str(slot)] = lora.eval()

    def remove(self, slot: int) -> None:
        """Drops adapter `slot`'s routed-expert LoRA (nothing when it has none here)."""
        if str(slot) in self.loras:
            del self.loras[str(slot)]

    def in_use(self) -> bool:
        """Some row of this forward uses an adapter with expert LoRA here."""
        return self.rows.active and any(str(s) in self.loras for s in self.rows.used())

    def split(self, n: int) -> tuple[list[int], list[int], list[int]] | None:
        """(rows that use expert LoRA here, the other rows, each adapted row's slot) for n rows; None when no
        row does."""
        if not self.in_use():
            return None
        slots = self.rows.per_row(n)
        adapted = [i for i, s in enumerate(slots) if str(s) in self.loras]
        return adapted, [i for i, s in enumerate(slots) if str(s) not in self.loras], [slots[i] for i in adapted]

    def adapters(self, expert_ids: Sequence[int], counts: Sequence[int], token_of: torch.Tensor,
                 row_slots: Sequence[int]) -> list:
        """One adapter per expert of a step (as ExpertLoRA.adapters), each pair with the adapter of its row:
        token_of [P] the pairs' rows, grouped by expert (experts.pairs.pairs_by_expert), row_slots each row's slot."""
        pair_slots = [row_slots[t] for t in token_of.tolist()]
        out, start = [], 0
        for e, n in zip(expert_ids, counts):
            slots = pair_slots[start:start + n]
            start += n
            groups: dict[int, list[int]] = {}
            for p, s in enumerate(slots):
                groups.setdefault(s, []).append(p)
            out.append(_SlotsAdapter(self, e, n, groups))
        return out


class _SlotsAdapter:
    """One expert's delta over a step's pairs whose rows use different adapters: each adapter's delta on its
    pairs (pairs whose adapter does not adapt a projection add zero there)."""

    __slots__ = ("slots", "expert", "n", "groups")

    def __init__(self, slots: ExpertLoRASlots, expert: int, n: int, groups: dict[int, list[int]]):
        self.slots, self.expert, self.n, self.groups = slots, expert, n, groups

    def __call__(self, proj: str, x: torch.Tensor) -> torch.Tensor | None:
        loras = self.slots.loras
        parts = [(loras[str(s)], pairs) for s, pairs in self.groups.items() if proj in loras[str(s)].lora_A]
        if not parts:
            return None
        if len(parts) == 1 and len(parts[0][1]) == self.n:  # every pair with one adapter: as ExpertLoRA's own
            return parts[0][0].delta(proj, self.expert, x)
        out = None
        for lora, pairs in parts:
            idx = torch.tensor(pairs, dtype=torch.int64, device=x.device)
            d = lora.delta(proj, self.expert, x.index_select(0, idx))
            if out is None:
                out = d.new_zeros(x.shape[0], d.shape[-1])
            out.index_copy_(0, idx, d)
        return out
