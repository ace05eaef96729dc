"""Several LoRA adapters served at once, each request's rows with their own: the per-forward row -> adapter
context (`AdapterRows`) and the wrapper that applies it (`MultiLoRALinear`). It never trains, merges or
folds, leaves the model's state_dict unchanged, and base rows compute exactly what they compute without it.
Entry points: `AdapterRows`, `MultiLoRALinear(base, rows)`, `.add(slot, A, B, scaling)`, `.slot_groups(n)`.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from moeswap.lora.layer import add_update
from moeswap.weights.dense import linear_method, with_weight_values


class AdapterRows:
    """Which adapter slot each row of the next forward uses; one per model, shared by its wrappers (set by
    the scheduler around each forward with `use`). `slots`: an int (every row) or a tuple (row i: slots[i])."""

    def __init__(self, count: int):
        self.count = count  # slots 1..count hold adapters
        self.slots: int | tuple[int, ...] = 0
        self.active = False  # some row uses an adapter
        self._groups: dict = {}  # (rows, device) -> {slot: row indices}, for the current slots

    @contextmanager
    def use(self, slots: int | Sequence[int]):
        """Rows use `slots` for the forwards inside the block; every row is base again after it."""
        before = self.slots
        self._set(slots)
        try:
            yield self
        finally:
            self._set(before)

    def _set(self, slots: int | Sequence[int]) -> None:
        if not isinstance(slots, int):
            slots = tuple(slots)
            if slots and all(s == slots[0] for s in slots):
                slots = slots[0]  # one slot for all: no row indices needed
        for s in (slots,) if isinstance(slots, int) else slots:
            if not 0 <= s <= self.count:
                raise ValueError(f"adapter slot {s} does not exist (slots 1..{self.count} hold adapters, 0 is none)")
        self.slots = slots
        self.active = any(slots) if isinstance(slots, tuple) else slots != 0
        self._groups = {}

    def used(self) -> set[int]:
        """The adapter slots some row uses (0 excluded)."""
        if isinstance(self.slots, int):
            return {self.slots} - {0}
        return set(self.slots) - {0}

    def split(self, n: int, held: Container[int]) -> bool | tuple[torch.Tensor, torch.Tensor]:
        """Of n rows, those whose slot is in `held`: False (none), True (all), or (their indices, the others')."""
        if not self.active:
            return False
        if isinstance(self.slots, int):
            return self.slots in held
        mine = [s in held for s in self.per_row(n)]
        if all(mine) or not any(mine):
            return all(mine)
        return (torch.tensor([i for i, m in enumerate(mine) if m], dtype=torch.int64),
                torch.tensor([i for i, m in enumerate(mine) if not m], dtype=torch.int64))

    @contextmanager
    def subset(self, idx: torch.Tensor):
        """The forwards inside the block run over the rows `idx` of the current batch only."""
        before = self.slots
        self._set([before[i] for i in idx.tolist()] if isinstance(before, tuple) else before)
        try:
            yield self
        finally:
            self._set(before)

    def per_row(self, n: int) -> list[int]:
        """The slot of each of n rows."""
        if isinstance(self.slots, int):
            return [self.slots] * n
        if len(self.slots) != n:
            raise RuntimeError(f"a forward over {n} rows while adapter slots are set for {len(self.slots)}: "
                               f"per-row adapters need one row per sequence along dimension 0")
        return list(self.slots)

    def groups(self, n: int, device: torch.device, held: Container[int]) -> list[tuple[int, torch.Tensor | None]]:
        """[(slot, row indices, or None for all n rows)] for the slots in `held` that some row uses."""
        if isinstance(self.slots, int):
            return [(self.slots, None)] if self.slots in held else []
        key = (n, device)
        rows = self._groups.get(key)
        if rows is None:
            by_slot: dict[int, list[int]] = {}
            for i, s in enumerate(self.per_row(n)):
                if s:
                    by_slot.setdefault(s, []).append(i)
            rows = self._groups[key] = {s: torch.tensor(r, dtype=torch.int64, device=device)
                                        for s, r in by_slot.items()}
        return [(s, idx) for s, idx in rows.items() if s in held]


class MultiLoRALinear(nn.Module):
    """A Linear with LoRA adapters in slots; row r of an input adds the adapter of its slot (AdapterRows).
    `base` is the wrapped Linear (not a submodule: its parameters are this module's `weight` and `bias`).

    Adapters are numbered by slot, 1..n; slot 0 is the base model (no adapter). Before each forward the
    scheduler says which slot each row of the batch uses (`AdapterRows.use`): one slot for all rows (a prefill,
    which runs one sequence) or one per row (a decode step's batch, row i along dimension 0 of every
    projection's input). Each wrapper adds, for each distinct slot of the batch that it holds an adapter for,
    s · B A x on that slot's rows: one pair of products per adapter, not per row. Rows that use no adapter, or
    one that does not target the module, get the wrapped Linear's output untouched, and with no adapter row
    in the batch a wrapper costs one attribute check.

    Numerics: a slot's product is the same call LoRALinear makes (fp32 A and B, the same order of operations;
    the base product fused or not has the same values: basic.fuse_linears), so a request whose rows are the
    only ones of its adapter in a step computes what `load_adapter` + LoRALinear computes for it alone, bit for
    bit. Rows that share an adapter share one fp32 GEMM, and torch's CPU GEMM rounds a row differently with 1
    row than with several: those rows equal their run alone to fp32 rounding in the LoRA delta.

    The wrapper keeps the Linear's `weight` (and `bias`) under the same names and its adapters as non-persistent
    buffers. Callers that read a Linear's weight directly see through it for rows without an adapter
    (`row_adapters`, models.layers.basic.unadapted): a fused projection (basic.project) computes the base product
    for the whole batch and the wrapper adds its rows' deltas to its part (`add_deltas`); the fused MLP kernel
    takes the rows without an adapter there and the modules the others (basic.GatedMLP, `AdapterRows.split` /
    `subset`); MLA's absorbed kv_b_proj runs once per slot with that adapter folded in (`slot_groups`,
    `folded_weight_of`); the C decode step runs while no row uses an adapter (engine/native_step.py).
    """

    row_adapters = True  # rows without an adapter get exactly `base`'s output (models.layers.basic.unadapted)

    def __init__(self, base: nn.Linear, rows: AdapterRows):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"LoRA wraps nn.Linear layers, not {type(base).__name__}")
        base = with_weight_values(base)  # block-FP8 codes decoded: the LoRA paths read `weight` as values
        self.__dict__["base"] = base
        self.__dict__["rows"] = rows
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.lora_dtype = torch.promote_types(base.weight.dtype, torch.float32)  # as LoRALinear keeps them
        self.scalings: dict[int, float] = {}

    def add(self, slot: int, A: torch.Tensor, B: torch.Tensor, scaling: float) -> None:
        """Adapter `slot`'s A [r, in] and B [out, r] (copied, in the LoRA dtype, on the weight's device)."""
        r = A.shape[0]
        if tuple(A.shape) != (r, self.in_features) or tuple(B.shape) != (self.out_features, r):
            raise ValueError(f"slot {slot}: lora_A {list(A.shape)} / lora_B {list(B.shape)} do not fit a "
                             f"{self.in_features} -> {self.out_features} Linear")
        device = self.weight.device
        self.register_buffer(f"lora_A_{slot}", A.detach().to(device, self.lora_dtype, copy=True), persistent=False)
        self.register_buffer(f"lora_B_{slot}", B.detach().to(device, self.lora_dtype, copy=True), persistent=False)
        self.scalings[slot] = float(scaling)

    def remove(self, slot: int) -> None:
        """Drops adapter `slot` (nothing when it has none here); its rows get the base output again."""
        if self.scalings.pop(slot, None) is not None:
            delattr(self, f"lora_A_{slot}")
            delattr(self, f"lora_B_{slot}")

    def pair(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        return getattr(self, f"lora_A_{slot}"), getattr(self, f"lora_B_{slot}"), self.scalings[slot]

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        """What the wrapped Linear computes (ops.linear for a weight kept in its stored dtype), as LoRALinear."""
        return linear_method(self.base).apply_values(x, self.weight, self.bias)

    def add_update(self, slot: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + s · B A x for adapter `slot` (LoRALinear's operations, without dropout: lora.layer.add_update)."""
        A, B, s = self.pair(slot)
        return add_update(y, x, A, B, s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_deltas(x, self.base_forward(x))

    def add_deltas(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base output for x, e.g. a slice of a fused product: models.layers.basic.project) with each
        row's adapter delta added; y itself when no row has an adapter here."""
        if not self.rows.active:
            return y
        for slot, idx in self.rows.groups(x.shape[0], x.device, self.scalings):
            if idx is None:
                y = self.add_update(slot, x, y)
            else:  # into y in place (this call's own output), the rows of other slots untouched
                y.index_copy_(0, idx, self.add_update(slot, x.index_select(0, idx), y.index_select(0, idx)))
        return y

    def slot_groups(self, n: int, device: torch.device) -> list[tuple[int, torch.Tensor | None]] | None:
        """For callers that use the weight as a matrix (MLA's absorbed kv_b_proj): [(slot, rows)] covering
        all n rows (slot 0: no adapter here), or None when every row gets the base weight."""
        if not self.rows.active:
            return None
        groups = self.rows.groups(n, device, self.scalings)
        if not groups:
            return None
        if groups[0][1] is None:
            return groups
        taken = torch.zeros(n, dtype=torch.bool, device=device)
        for _, idx in groups:
            taken[idx] = True
        rest = (~taken).nonzero().flatten()
        return ([(0, rest)] if rest.numel() else []) + groups

    def folded_weight_of(self, slot: int) -> torch.Tensor:
        """W + s · B A for adapter `slot` (W for slot 0) in the LoRA dtype: LoRALinear.folded_weight's values."""
        w = self.weight.to(self.lora_dtype)
        if slot == 0:
            return w
        A, B, s = self.pair(slot)
        return w + (B @ A) * s

    def fold_sources_of(self, slot: int) -> tuple[torch.Tensor, ...]:
        return (self.weight,) if slot == 0 else (self.weight, *self.pair(slot)[:2])

    def extra_repr(self) -> str:
        ranks = {s: getattr(self, f"lora_A_{s}").shape[0] for s in self.scalings}
        return (f"in_features={self.in_features}, out_features={self.out_features}, slots={sorted(ranks)}, "
                f"ranks={list(ranks.values())}, base={type(self.base).__name__}")
