"""Kimi K3 (`KimiK3ForConditionalGeneration`): Kimi Linear's blocks with K3's flags (bounded KDA gate,
full-rank output gate, gated MLA with q-LoRA, SiTU-GLU, latent MoE, block attention residuals), built by
models/decoder.py. Owns: its config.json names (and telling a text-only K3 file from Kimi Linear), the
multimodal wrapper's init-tiny layout with MXFP4 routed experts, A_log's zero-padded published layout.
Its checkpoint names are Kimi Linear's (archs/kimi_linear.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moeswap.archs import kimi_linear
from moeswap.archs.kimi_linear import KimiLinear, kimi_text_config


class KimiK3(KimiLinear):
    name = "kimi_k3"
    model_types = ("kimi_k3",)
    architectures = ("KimiK3ForConditionalGeneration",)
    rank = 3

    def recognises(self, model_type: object, architectures: tuple[str, ...], text: dict) -> int | None:
        named = super().recognises(model_type, architectures, text)
        if named is not None:
            return named
        # A text-only K3 file says kimi_linear too; K3's own features tell them apart.
        k3 = "attn_res_block_size" in text or "routed_expert_hidden_size" in text
        linear = kimi_linear.ARCH.recognises(model_type, architectures, text)
        return linear + 1 if k3 and linear is not None else None

    def publish(self, param_name: str, tensor: Any, config: Any) -> Any:
        if param_name.endswith("self_attn.A_log"):  # K3 ships [128] zero-padded; mimic with max(H, head_dim)
            out = tensor.new_zeros(max(tensor.numel(), config.kda.head_dim))
            out[: tensor.numel()] = tensor
            return out
        return tensor

    def tiny_config(self, dims: Mapping[str, int], size: str, quant: str) -> dict:
        text = kimi_text_config(dims)
        text.update(
            hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0, num_shared_experts=2,
            q_lora_rank=dims["q_lora"], mla_use_output_gate=True, routed_expert_hidden_size=dims["latent"],
            latent_moe_use_norm=True, routed_scaling_factor=1.0, attn_res_block_size=dims["res_block"],
            quantization_config=_mxfp4_experts(), use_grouped_topk=True, num_nextn_predict_layers=0,
            initializer_range=0.02, use_cache=True,
        )
        text["linear_attn_config"].update(gate_lower_bound=-5.0, use_full_rank_gate=True)
        return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text,
                "tie_word_embeddings": False, "dtype": "bfloat16"}


def _mxfp4_experts() -> dict:
    """K3's compressed-tensors quantization_config: MXFP4 routed experts, everything else unquantised."""
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group",
               "dynamic": False, "observer": "minmax", "scale_dtype": "torch.uint8", "actorder": None,
               "block_structure": None, "observer_kwargs": {}, "zp_dtype": None}
    return {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"], "weights": weights,
                                      "input_activations": None, "output_activations": None}},
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
                   "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
        "kv_cache_scheme": None, "global_compression_ratio": None,
    }


ARCH = KimiK3()
