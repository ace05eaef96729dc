"""What trains, and what a finished run writes: the one place the training loop meets the model's parameters.

Mode "full": the model's own parameters (every one, or those under --target-modules), in fp32; routed
experts are not parameters and stay frozen. Mode "lora": adapters from moeswap.lora (imported when
asked for; a build without it says so). Both return the trainable parameters by name, which is what
checkpoints, the optimizer and the manifest use. Also applies gradient checkpointing from outside the
model. Entry points: `prepare_model(model, cfg)`, `save_trained(model, cfg, params, out_dir, ...)`.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

LORA_MISSING = ("LoRA support is not installed in this build (the moeswap.lora package is missing); "
                "train with --mode full, or use a build that has it")
FULL_WEIGHTS_FILE = "trained.safetensors"
# Not trained by gradients: DeepSeek-style routers adjust the selection bias by a load-balancing rule.
NEVER_TRAINED = ("e_score_correction_bias",)
_REGEX_CHARS = set("*?[]()|\\^$+{}")


def lora_module():
    """moeswap.lora, or the user error saying this build lacks it."""
    try:
        return importlib.import_module("moeswap.lora")
    except ModuleNotFoundError as e:
        if e.name in ("moeswap.lora", "moeswap"):
            raise ValueError(LORA_MISSING) from None
        raise


def prepare_model(model: nn.Module, cfg) -> list[tuple[str, nn.Parameter]]:
    """Freezes the model, makes the parameters `cfg` trains trainable and returns them by name, in a
    fixed order (the optimizer's and the checkpoints'). ValueError when nothing, or a pattern, matches."""
    for p in model.parameters():
        p.requires_grad_(False)
    if cfg.mode == "full":
        params = _full_parameters(model, cfg.target_modules)
        _stop_gradient_into_routed_experts(model)
    else:
        params = _lora_parameters(model, cfg)
    if cfg.gradient_checkpointing:
        checkpoint_layers(model)
    if not params:
        raise ValueError("nothing to train: no trainable parameters")
    return params


def _full_parameters(model: nn.Module, patterns: tuple[str, ...] | None) -> list[tuple[str, nn.Parameter]]:
    named = [(n, p) for n, p in model.named_parameters() if n.rpartition(".")[2] not in NEVER_TRAINED]
    if patterns is not None:
        used = {pat: False for pat in patterns}
        chosen = []
        for name, p in named:
            hits = [pat for pat in patterns if matches(name, pat)]
            for pat in hits:
                used[pat] = True
            if hits:
                chosen.append((name, p))
        unused = [pat for pat, hit in used.items() if not hit]
        if unused:
            raise ValueError(f"--target-modules {unused[0]!r} matches no module or parameter of this model "
                             f"(names look like {named[1][0]!r})")
        named = chosen
    for _, p in named:
        if not p.dtype.is_floating_point:
            continue
        # the optimizer updates fp32 (or wider) weights: bf16 ones would lose small updates to rounding
        if p.dtype.itemsize < 4:
            p.data = p.data.float()
        p.requires_grad_(True)
    return named


def matches(name: str, pattern: str) -> bool:
    """PEFT's rule, applied to a parameter name and each module above it: a plain pattern is a name or a
    dotted suffix (`q_proj`, `self_attn.q_proj`); one with regex characters must match a whole name."""
    parts = name.split(".")
    candidates = [".".join(parts[:k]) for k in range(1, len(parts) + 1)]
    if _REGEX_CHARS & set(pattern):
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"--target-modules {pattern!r} is not a valid regex ({e})") from None
        return any(rx.fullmatch(c) for c in candidates)
    return any(c == pattern or c.endswith("." + pattern) for c in candidates)


def _stop_gradient_into_routed_experts(model: nn.Module) -> None:
    """Routed experts run on kernels without a backward until the expert autograd lands (xfmt): some paths
    (the grouped C kernel) drop the gradient, others (many tokens per expert) fail under autograd. Their
    inputs and routing weights are detached, so the forward runs on every path and their contribution
    counts as a constant in the gradient, the same whichever path ran (the router and the latent down
    projection then get no gradient). INTEGRATION: drop this once MoE.run_experts is differentiable."""
    for block in model.moe_blocks():
        if "run_experts" in block.__dict__:
            continue
        run = block.run_experts
        block.run_experts = lambda h, ids, w, _run=run: _run(h.detach(), ids, w.detach())


def _lora_parameters(model: nn.Module, cfg) -> list[tuple[str, nn.Parameter]]:
    lora = lora_module()
    # INTEGRATION: the one call into moeswap.lora (names to be settled with it): wraps the targets (dense
    # modules, and routed experts through MoE.attach_expert_lora), raises ValueError for a pattern that
    # matches nothing, and returns the adapter parameters by name.
    params = lora.apply_lora(model, target_modules=cfg.target_modules, rank=cfg.rank, alpha=cfg.alpha,
                             dropout=cfg.dropout, shared_a=cfg.shared_a, seed=cfg.seed)
    return [(n, p) for n, p in params]


def checkpoint_layers(model: nn.Module) -> None:
    """Each layer's attention and MLP (or MoE) keep only their input for backward and run again there
    (torch.utils.checkpoint, non-reentrant, RNG state replayed so dropout masks repeat). Only calls
    without a per-sequence state are checkpointed: recomputing a call would update a state twice."""
    from torch.utils.checkpoint import checkpoint

    for layer in model.model.layers:
        for name in ("self_attn", "mlp", "block_sparse_moe"):
            mod = getattr(layer, name, None)
            if mod is None or "forward" in mod.__dict__:
                continue

            def forward(*args, _inner=mod.forward, **kwargs):
                stateful = any(a is not None for a in args[1:]) or any(v is not None for v in kwargs.values())
                if stateful or not torch.is_grad_enabled():
                    return _inner(*args, **kwargs)
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

            mod.forward = forward


def trained_tensors(params: list[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor]:
    return {name: p.detach().contiguous() for name, p in params}


def save_trained(model: nn.Module, cfg, params: list[tuple[str, nn.Parameter]], out_dir: Path,
                 metadata: dict[str, Any]) -> list[str]:
    """Writes the run's result into out_dir and returns the files written: the PEFT adapter (lora), or the
    trained parameters under the model's parameter names (full)."""
    if cfg.mode == "lora":
        # INTEGRATION: moeswap.lora writes adapter_config.json + adapter_model.safetensors (PEFT names)
        return list(lora_module().save_adapter(model, out_dir, base_model=cfg.model, metadata=metadata) or [])
    from safetensors.torch import save

    from moeswap import jsonio
    from moeswap.atomic_dir import atomic_file

    # one metadata entry: safetensors writes several in hash-map order, and equal runs must give equal bytes
    data = save(trained_tensors(params), metadata={"moeswap": jsonio.dumps(metadata, sort_keys=True)})
    with atomic_file(out_dir / FULL_WEIGHTS_FILE) as f:
        f.write(data)
    return [FULL_WEIGHTS_FILE]
