"""What trains, and what a finished run writes: the one place the training loop meets the model's parameters
(mode "lora": moeswap.lora's adapters on a frozen base; mode "full": the model's own parameters, in fp32).
Entry points: `prepare_model(model, cfg)`, `save_trained(model, cfg, params, out_dir, base, metadata)`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moeswap import lora
from moeswap.lora.targets import matches, weight_prefix
from moeswap.train.experts import make_experts_trainable

FULL_WEIGHTS_FILE = "trained.safetensors"
ADAPTER_FILES = [lora.CONFIG_NAME, lora.WEIGHTS_NAME, lora.MOESWAP_NAME]
# Not trained by gradients: DeepSeek-style routers adjust the selection bias by a load-balancing rule.
NEVER_TRAINED = ("e_score_correction_bias",)
_REGEX_CHARS = set("*?[]()|\\^$+{}")


def prepare_model(model: nn.Module, cfg, owned: Callable[[int], Sequence[int]] | None = None
                  ) -> list[tuple[str, nn.Parameter]]:
    """Freezes the model, makes the parameters `cfg` trains trainable and returns them by name, in model
    order. ValueError when nothing, or a pattern, matches. owned: LoRA's routed-expert rows built for an MoE
    layer's experts `owned(layer)` only (lora.attach_lora; expert parallelism), the others never held.

    Mode "lora": adapters (`attach_lora`) on Linear modules and, through the MoE blocks' expert hook, on
    routed experts. Mode "full": every parameter, routed experts included (decoded from the store into
    parameters, train/experts.py; the router's selection bias follows K3's balancing rule instead of a
    gradient), or those under --target-modules (routed experts then stay frozen in the store, gradients
    flowing through them by weights.autograd to the router and everything before). Target patterns
    follow one rule in both modes, moeswap.lora's (`lora.targets.matches`, PEFT's). The order returned is what
    checkpoints, the optimizer and the manifest use; per-layer activation checkpointing is turned on when asked.
    """
    for p in model.parameters():
        p.requires_grad_(False)
    if cfg.mode == "full":
        if cfg.target_modules is None:  # every parameter: the routed experts become weights too
            make_experts_trainable(model)
        params = _full_parameters(model, cfg.target_modules)
    else:
        params = _lora_parameters(model, cfg, owned)
    # the model's own per-layer activation checkpointing (models/decoder.py)
    model.gradient_checkpointing = cfg.gradient_checkpointing
    if not params:
        raise ValueError("nothing to train: no trainable parameters")
    return params


def lora_config(cfg) -> lora.LoRAConfig:
    """The run's LoRAConfig (target_modules None: LoRAConfig's default)."""
    extra = {} if cfg.target_modules is None else {"target_modules": target_patterns(cfg.target_modules)}
    return lora.LoRAConfig(r=cfg.rank, alpha=cfg.alpha, dropout=cfg.dropout, expert_shared_a=cfg.shared_a, **extra)


def target_patterns(patterns: tuple[str, ...]) -> tuple[str, ...] | str:
    """--target-modules as moeswap.lora (and PEFT) take it: a list of names / dotted suffixes, or one
    regex (a single entry with regex characters), full-matched."""
    regex = [p for p in patterns if _REGEX_CHARS & set(p)]
    if not regex:
        return tuple(patterns)
    if len(patterns) > 1:
        raise ValueError(f"--target-modules: {regex[0]!r} is a regex, which must be the only pattern "
                         f"(write one regex for all, or plain names / dotted suffixes)")
    try:
        re.compile(patterns[0])
    except re.error as e:
        raise ValueError(f"--target-modules {patterns[0]!r} is not a valid regex ({e})") from None
    return patterns[0]


def _lora_parameters(model: nn.Module, cfg, owned=None) -> list[tuple[str, nn.Parameter]]:
    # the seed fixes A's initialisation (dense and routed experts), independent of what ran before
    lora.attach_lora(model, lora_config(cfg), generator=torch.Generator().manual_seed(cfg.seed), owned=owned)
    return list(lora.trainable_parameters(model).items())


def _full_parameters(model: nn.Module, patterns: tuple[str, ...] | None) -> list[tuple[str, nn.Parameter]]:
    named = full_choice(model, patterns)
    for _, p in named:
        if not p.dtype.is_floating_point:
            continue
        # the optimizer updates fp32 (or wider) weights: bf16 ones would lose small updates to rounding
        if p.dtype.itemsize < 4:
            p.data = p.data.float()
        p.requires_grad_(True)
    return named


def full_choice(model: nn.Module, patterns: tuple[str, ...] | None) -> list[tuple[str, nn.Parameter]]:
    """The parameters full mode trains (`patterns` None: all but NEVER_TRAINED), changing nothing."""
    named = [(n, p) for n, p in model.named_parameters() if n.rpartition(".")[2] not in NEVER_TRAINED]
    if patterns is not None:
        targets = target_patterns(patterns)
        entries = (targets,) if isinstance(targets, str) else targets
        prefix = weight_prefix(model)
        used: set[str] = set()
        chosen = []
        for name, p in named:
            # a parameter is chosen when the pattern selects it or a module above it
            parts = name.split(".")
            above = [".".join(parts[:k]) for k in range(1, len(parts) + 1)]
            hits = {t for t in entries for c in above
                    if matches(t if isinstance(targets, str) else (t,), c, prefix)}
            used |= hits
            if hits:
                chosen.append((name, p))
        unused = [t for t in entries if t not in used]
        if unused:
            raise ValueError(f"--target-modules {unused[0]!r} matches no module or parameter of this model "
                             f"(names look like {named[1][0]!r})")
        named = chosen
    return named


def trained_tensors(params: list[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor]:
    return {name: p.detach().contiguous() for name, p in params}


def save_trained(model: nn.Module, cfg, params: list[tuple[str, nn.Parameter]], directory: Path,
                 base: dict[str, Any], metadata: dict[str, Any]) -> list[str]:
    """Writes the run's result into `directory` (the run's staging directory: loop.py publishes it with
    the manifest) and returns the files written: the PEFT adapter, recording the base model and its
    fingerprint `base` (lora); the whole model in the base's layout (full, every parameter); or the trained
    parameters under the model's parameter names (full with --target-modules)."""
    if cfg.mode == "lora":
        lora.write_adapter(model, directory, base_model=cfg.model, base_fingerprint=base)
        return list(ADAPTER_FILES)
    if cfg.target_modules is None:  # everything trained: a model directory like the base
        from moeswap.train.export import write_model

        return write_model(model, cfg.model, directory)
    from safetensors.torch import save

    from moeswap import jsonio
    from moeswap.atomic_dir import atomic_file

    # one metadata entry: safetensors writes several in hash-map order, and equal runs must give equal bytes
    data = save(trained_tensors(params), metadata={"moeswap": jsonio.dumps(metadata, sort_keys=True)})
    with atomic_file(Path(directory) / FULL_WEIGHTS_FILE) as f:
        f.write(data)
    return [FULL_WEIGHTS_FILE]
