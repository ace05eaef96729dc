"""DeepSeek-V3 / R1 and Kimi K2 (`DeepseekV3ForCausalLM`): every layer MLA with a rotary shared key (RoPE,
YaRN-scaled, models/layers/rope.py) and q-LoRA, the first `first_k_dense_replace` layers a dense SwiGLU,
the rest a MoE with group-limited sigmoid routing and a correction bias, shared experts, full-width
routed experts. The same blocks as Kimi Linear (kimi_k3.DecoderLayer, layers/mla.py, layers/moe.py),
so one model class serves both; this file owns what differs: the checkpoint names.

Published names put a MoE layer's router, shared and routed experts under `mlp.` (`mlp.gate`,
`mlp.shared_experts`, `mlp.experts.E.{gate,up,down}_proj`); the model keeps them under `block_sparse_moe`
like the other architectures, so the swap core, native step, planner and LoRA see one layout.
Layers after the last one (num_nextn_predict_layers: the multi-token-prediction module) are not run;
the loader skips them (models/loader.py `is_mtp_tensor`).
Entry point: `DeepseekV3Model(config, device=...)`, the loader's CHECKPOINT_MAP / classify / sanitize.
"""

from __future__ import annotations

import re

import torch

from moeswap.config import ModelConfig
from moeswap.models import classify_name
from moeswap.models.kimi_k3 import KimiModel

# Checkpoint tensor name -> what it is (as kimi_k3.CHECKPOINT_MAP). First match wins.
CHECKPOINT_MAP: tuple[tuple[str, str], ...] = (
    # float, block FP8 (DeepSeek-V3, Kimi K2) or INT4 pack-quantized (Kimi K2-Thinking) routed experts
    (r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\."
     r"(weight|weight_scale_inv|weight_packed|weight_scale|weight_shape)", "expert"),
    (r"model\.layers\.(\d+)\.mlp\.(gate|shared_experts)\.(.*)", r"model.layers.\1.block_sparse_moe.\2.\3"),
    (r"(.*)", r"\1"),
)
# The published routed-expert projection names -> the expert store's (ops.expert_format.PROJS)
EXPERT_PROJS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}

# The other way, for writers of the published layout (init-tiny): model parameter -> checkpoint name
PUBLISHED_MAP: tuple[tuple[str, str], ...] = (
    (r"model\.layers\.(\d+)\.block_sparse_moe\.(.*)", r"model.layers.\1.mlp.\2"),
    (r"(.*)", r"\1"),
)

# transformers' DeepseekV3ForCausalLM module names (PEFT adapters) -> ours; first match wins
MODULE_ALIASES: tuple[tuple[str, str], ...] = (
    (r"model\.layers\.(\d+)\.mlp\.(gate|shared_experts)(\..*)?", r"model.layers.\1.block_sparse_moe.\2\3"),
)


class DeepseekV3Model(KimiModel):
    """KimiModel's blocks built from a DeepSeek-V3 config (all-MLA with RoPE, no attention residuals)."""


def sanitize(param_name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    return tensor  # the published tensors have the model's shapes


def classify(name: str) -> tuple[str, re.Match]:
    """A (prefix-stripped) checkpoint name through CHECKPOINT_MAP: ('expert'|'skip'|param name, match)."""
    return classify_name(CHECKPOINT_MAP, name)


def published_name(param_name: str) -> str:
    """The checkpoint name of a model parameter (inverse of CHECKPOINT_MAP for parameters)."""
    for pattern, template in PUBLISHED_MAP:
        m = re.fullmatch(pattern, param_name)
        if m:
            return m.expand(template)
    raise AssertionError("PUBLISHED_MAP ends with a catch-all")


def expert_name(layer: int, expert: int, proj: str) -> str:
    """The checkpoint module name of one routed expert projection (proj: w1 / w2 / w3)."""
    published = {v: k for k, v in EXPERT_PROJS.items()}[proj]
    return f"model.layers.{layer}.mlp.experts.{expert}.{published}"
