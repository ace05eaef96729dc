"""LoRA fine-tuning step model: forward, recompute and backward per micro-batch through the pipeline
(1F1B), adapter-gradient all-reduce, and the expert-swap traffic when experts spill.

The base model is frozen, so backward computes activation gradients only: matmuls cost one forward
again, attention/KDA cores and elementwise work about two. Knows nothing of serving. Entry point:
`lora_point`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import Hardware
from .layouts import Layout
from .memory import DeviceMemory, expert_bytes, lora_params_per_device
from .params import ModelParams
from .roofline import Cost, Pass, Placement, all_reduce, stage_cost, touched_fraction
from .workload import Lora, Precision

# Backward / forward time by category for a frozen base (activation gradients only).
_BACKWARD = {"gemm": 1.0, "experts": 1.0, "attention": 2.0, "elementwise": 2.0, "comm": 1.0,
             "overhead": 2.0, "swap": 0.0, "host": 1.0}


@dataclass
class LoraPoint:
    step_s: float
    tokens_per_step: int
    tok_s: float
    tok_s_device: float
    swap_bytes_device: float  # expert bytes pulled into each device per step (bottleneck stage)
    swap_passes: int  # passes over the experts that miss: forward and recompute (backward reuses)
    step_s_no_reuse: float  # the same step if backward fetched its experts again
    micro_batch_cost: Cost  # forward + recompute + backward of one micro-batch, bottleneck stage


def lora_point(mp: ModelParams, lay: Layout, stages: list[range], hw: Hardware, prec: Precision,
               lora: Lora, placements: list[Placement], mems: list[DeviceMemory]) -> LoraPoint:
    tokens = lora.tokens_per_micro_batch(lay.dp)
    p = Pass(tokens=tokens, ctx=lora.seq_len / 2, decode=False, logits=tokens / lay.dp)
    per_stage, per_stage_no_reuse, swaps = [], [], []
    worst = Cost()
    for s, layers in enumerate(stages):
        fwd = stage_cost(mp, layers, s, lay, hw, prec, placements[s], p)
        total = Cost()
        total.merge(fwd)
        if lora.checkpointing:
            total.merge(fwd)  # recompute each layer right before its backward
        total.merge(fwd.scaled(_BACKWARD))
        swap_fwd = fwd.parts.get("swap", 0.0)
        per_stage.append(total.total)
        per_stage_no_reuse.append(total.total + swap_fwd)  # backward would fetch the layer again
        swaps.append(_miss_bytes(mp, layers, lay, prec, placements[s], tokens))
        if total.total >= max(per_stage):
            worst = total
    m, pp = lora.grad_accum, lay.pp
    adapters = max(lora_params_per_device(mp, r, lay, lora) for r in stages)
    sync = all_reduce(hw, lay.replicas, adapters * 4) if lay.replicas > 1 else 0.0
    optim = adapters * 16 * 2 / (hw.mem_bw() * hw.engine.mem_efficiency)
    step = (m + pp - 1) * max(per_stage) + sync + optim
    step_nr = (m + pp - 1) * max(per_stage_no_reuse) + sync + optim
    passes = 2 if lora.checkpointing else 1
    tok = lay.replicas * m * tokens
    i = per_stage.index(max(per_stage))
    return LoraPoint(
        step_s=step, tokens_per_step=tok, tok_s=tok / step, tok_s_device=tok / step / lay.devices,
        swap_bytes_device=swaps[i] * passes * m, swap_passes=passes, step_s_no_reuse=step_nr,
        micro_batch_cost=worst,
    )


def _miss_bytes(mp: ModelParams, layers: range, lay: Layout, prec: Precision, pl: Placement, tokens: float) -> float:
    """Expert bytes one forward pass pulls into one device (misses over the stage's MoE layers)."""
    moe = mp.cfg.moe
    eb = expert_bytes(mp, prec) / lay.expert_tp
    out = 0.0
    for i in layers:
        if mp.layers[i].num_experts:
            pop = pl.touched[i] if pl.touched and i < len(pl.touched) else None
            out += moe.num_experts / lay.ep * touched_fraction(tokens, moe.top_k, moe.num_experts, pop) * eb
    return out * (1 - pl.hit_rate) if pl.compute_for(tokens) == "swap" else 0.0
