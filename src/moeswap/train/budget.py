"""The memory a training run certainly needs, checked before anything is allocated: a lower bound from the
model's shapes and the run's rank, targets and batch (trainable weights with their gradient and AdamW's two
moments, each layer's input kept for backward, a loss chunk's logits). Entry point: `check_fits(model, cfg)`."""

from __future__ import annotations

from torch import nn

from moeswap.lora import LoRAConfig
from moeswap.lora.targets import resolve_targets
from moeswap.procfs import memory_total_bytes
from moeswap.train.targets import full_choice
from moeswap.units import human_bytes

STATE_COPIES = 4  # a trainable fp32 value, its gradient, AdamW's first and second moments


def trainable_values(model: nn.Module, cfg, lora_config: LoRAConfig, experts: bool = True) -> int:
    """How many values the run trains: LoRA's A and B on each target (routed experts included), or in full
    mode every floating-point parameter plus, without targets, every routed expert. experts=False leaves the
    routed experts' share out (expert parallelism splits it over ranks)."""
    if cfg.mode == "full":
        n = sum(p.numel() for _, p in full_choice(model, cfg.target_modules) if p.dtype.is_floating_point)
        if cfg.target_modules is None and experts:
            n += sum(block.num_experts * sum(o * i for o, i in block.expert_shapes.values())
                     for block in model.moe_blocks())
        return n
    found = resolve_targets(model, lora_config.target_modules)
    modules = dict(model.named_modules())
    r = lora_config.r
    n = sum(r * (modules[name].in_features + modules[name].out_features) for name in found.linears)
    for block_name, projections in (found.experts.items() if experts else ()):
        block = modules[block_name]
        for proj in projections:
            out, inp = block.expert_shapes[proj]
            n += r * (inp * (1 if lora_config.expert_shared_a else block.num_experts) + out * block.num_experts)
    return n


def activation_values(model: nn.Module, cfg) -> int:
    """The values one micro-batch's forward keeps at the least: each layer's input, and the fp32 logits of
    one loss chunk (--loss-chunk tokens at a time, else all of the micro-batch's)."""
    c = model.config
    tokens = cfg.micro_batch * cfg.seq_len
    logit_tokens = min(tokens, cfg.loss_chunk) if cfg.loss_chunk else tokens
    return tokens * c.hidden_size * c.num_layers + logit_tokens * c.vocab_size


def check_fits(model: nn.Module, cfg, lora_config: LoRAConfig, experts: bool = True, total: int | None = None
               ) -> None:
    """ValueError when the run's lower bound exceeds the machine's memory (`total`: MemTotal by default)."""
    total = memory_total_bytes() if total is None else total
    if not total:
        return
    state = trainable_values(model, cfg, lora_config, experts) * 4 * STATE_COPIES
    acts = activation_values(model, cfg) * 4
    if state + acts > total:
        raise ValueError(f"this run needs at least {human_bytes(state + acts)} (trainable weights, gradients and "
                         f"optimizer state {human_bytes(state)}; activations {human_bytes(acts)} for "
                         f"--micro-batch {cfg.micro_batch} x --seq-len {cfg.seq_len}), more than this machine's "
                         f"{human_bytes(total)}; lower --rank, --micro-batch or --seq-len")
