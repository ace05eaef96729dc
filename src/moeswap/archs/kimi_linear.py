"""Kimi Linear (`KimiLinearForCausalLM`): KDA with an unbounded softplus gate and low-rank output gate,
NoPE MLA, SwiGLU, full-width routed experts, plain residuals; built by models/decoder.py from its flags.
Owns: its config.json names, its checkpoint names (nearly the identity: module names equal checkpoint
names), transformers' module names, A_log's published layout, the init-tiny layout K3 extends.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moeswap.archs.base import Arch


class KimiLinear(Arch):
    name = "kimi_linear"
    model_types = ("kimi_linear",)
    architectures = ("KimiLinearForCausalLM",)
    checkpoint_map = (
        (r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)",
         "expert"),
        (r"(vision_tower|mm_projector|multi_modal_projector)\..*", "skip"),
        # transformers writes the dense layer's MLP under block_sparse_moe; the original files say mlp
        (r"model\.layers\.(\d+)\.block_sparse_moe\.(gate|up|down)_proj\.weight", r"model.layers.\1.mlp.\2_proj.weight"),
        (r"(.*)", r"\1"),
    )
    # transformers' KimiLinearForCausalLM names some modules otherwise than the checkpoint does (its loader
    # renames the tensors); adapters PEFT saves from that model carry its names
    module_aliases = (
        (r"model\.layers\.(\d+)\.self_attn\.forget_gate\.(f_a_proj|f_b_proj)", r"model.layers.\1.self_attn.\2"),
        (r"model\.layers\.(\d+)\.mlp\.(shared_experts\..*)", r"model.layers.\1.block_sparse_moe.\2"),
        # the fused routed experts, which PEFT adapts with target_parameters (lora.fused_experts)
        (r"model\.layers\.(\d+)\.mlp\.experts", r"model.layers.\1.block_sparse_moe.experts"),
    )

    def sanitize(self, param_name: str, tensor: Any, config: Any) -> Any:
        """A_log is [128] zero-padded in K3 and [1,1,H,1] in transformers; the model holds [H]."""
        if param_name.endswith("self_attn.A_log"):
            return tensor.reshape(-1)[: config.kda.num_heads]
        return tensor

    def publish(self, param_name: str, tensor: Any, config: Any) -> Any:
        if param_name.endswith("self_attn.A_log"):
            return tensor.reshape(1, 1, -1, 1)  # transformers' Kimi Linear layout
        return tensor

    def tiny_config(self, dims: Mapping[str, int], size: str, quant: str) -> dict:
        text = kimi_text_config(dims)
        text.update(hidden_act="silu", num_shared_experts=1, q_lora_rank=None, routed_scaling_factor=2.446)
        return text


def kimi_text_config(s: Mapping[str, int]) -> dict:
    """The flat config.json both Kimi layouts start from: one dense layer first, every fourth layer and the
    last MLA (1-based lists, like K3), the rest KDA."""
    n = s["layers"]
    mla_layers = [i + 1 for i in range(n) if i % 4 == 3 or i == n - 1]
    kda_layers = [i + 1 for i in range(n) if i + 1 not in mla_layers]
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "hidden_size": s["hidden"], "num_hidden_layers": n, "vocab_size": s["vocab"],
        "intermediate_size": s["dense"], "moe_intermediate_size": s["expert_dim"],
        "num_attention_heads": s["heads"], "num_key_value_heads": s["heads"],
        "kv_lora_rank": s["kv_lora"], "qk_nope_head_dim": s["nope"], "qk_rope_head_dim": s["rope"],
        "v_head_dim": s["nope"], "mla_use_nope": True,
        "linear_attn_config": {"kda_layers": kda_layers, "full_attn_layers": mla_layers, "num_heads": s["heads"],
                               "head_dim": s["head_dim"], "short_conv_kernel_size": 4},
        "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_experts": s["experts"], "num_experts_per_token": s["top_k"],
        "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc", "num_expert_group": 1, "topk_group": 1,
        "moe_renormalize": True, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "max_position_embeddings": 1048576, "dtype": "bfloat16",
    }


ARCH = KimiLinear()
