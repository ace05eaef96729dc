"""Non-finite values: the error the engine raises for NaN or Inf logits, and where in the model they begin.

The scheduler checks each step's logits with one reduction (`all_finite`); only when that fails does
`first_nonfinite` re-run the step through the model's modules (the reference path, whichever path ran the
step) with a check on every module's output. It knows the model's module names, not the scheduler's slots.
Entry points: `NonFiniteError`, `all_finite(tensor)`, `first_nonfinite(model, prefix, step, ...)`.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

import torch


class NonFiniteError(ValueError):
    """Logits (or a layer's output) that are NaN or infinite: a broken weight or config, never an answer."""


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of a floating-point tensor is finite, at the cost of one sum: the sum is finite
    unless a value is NaN or infinite, or the sum overflows, and only then does aminmax (min and max
    propagate NaN) decide; far cheaper than isfinite().all() (docs/benchmarks.md)."""
    if math.isfinite(t.sum().item()):
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(lo.item()) and math.isfinite(hi.item())


def finite(x) -> bool:
    """all_finite for any module output: a tensor (only floating-point values count), a tuple or list."""
    if isinstance(x, torch.Tensor):
        return not x.is_floating_point() or x.numel() == 0 or all_finite(x)
    if isinstance(x, (tuple, list)):
        return all(finite(v) for v in x)
    return True


def first_nonfinite(model, prefix: Sequence[int], step: Sequence[int], chunk: int,
                    dtype: torch.dtype | None = None, device=None) -> str:
    """Where a step's non-finite logits begin, in a few words ("decoder layer 2 (model.layers.2.mlp)").
    One sequence: `prefix` (the tokens before the step) rebuilds its state in a fresh one, unchecked; then
    `step` (a prompt, or one decode token) runs with a forward hook on every module, and the first module
    whose output is not finite is named (inner modules finish first, so it is the innermost one). Costs a
    prefill of prefix + step; nothing of the scheduler's state is read or written."""
    names = {m: n for n, m in model.named_modules() if n}
    found: list[str] = []

    def check(module, args, output):
        if not found and not finite(output):
            found.append(names[module])

    def feed(state, tokens: Sequence[int]) -> torch.Tensor | None:
        logits = None
        for start in range(0, len(tokens), chunk):
            piece = torch.tensor([list(tokens[start:start + chunk])], device=device)
            logits = model(piece, state, last_only=True)
        return logits

    try:
        state = model.make_state(1, dtype, device)
        feed(state, prefix)
        hooks = [m.register_forward_hook(check) for m in names]
        try:
            logits = feed(state, step)
        finally:
            for h in hooks:
                h.remove()
    except Exception as err:  # the error being reported matters more than this diagnosis
        return f"unknown (the re-run failed: {type(err).__name__}: {err})"
    if found:
        name = found[0]
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        where = (f"decoder layer {layer.group(1)}" if layer else
                 {"model.embed_tokens": "the token embedding", "model.norm": "the final norm"}.get(name))
        return f"{where} ({name})" if where else name
    if logits is not None and not finite(logits):
        head = "model.embed_tokens, tied" if model.config.tie_word_embeddings else "lm_head"
        return f"the output head ({head}; every module before it was finite)"
    return "none (the re-run's values were finite: not reproduced)"
