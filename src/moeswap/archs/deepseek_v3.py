"""DeepSeek-V3 / R1 and Kimi K2 (`DeepseekV3ForCausalLM`): all-MLA with a rotary (YaRN) shared key and
q-LoRA, a dense SwiGLU first, then MoE with group-limited sigmoid routing; built by models/decoder.py.
Owns what differs from Kimi: config.json's names and choices (all MLA, rotary, MTP layers), the
checkpoint names both ways (published `mlp.{gate,shared_experts,experts}` <-> the model's
`block_sparse_moe`, which every other part sees), and the init-tiny layouts (bf16, block FP8, INT4).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from moeswap.archs.base import Arch

# init-tiny's routed and shared expert width where it differs from the size's expert_dim: experts that take
# the full hidden width (no latent projection) get K3's parameters (3 x 1024 x 512 each) at --size bench
_PLAIN_EXPERT_DIM = {"bench": 512}


class DeepseekV3(Arch):
    name = "deepseek_v3"  # also Kimi K2, which ships this architecture under its own model_type
    model_types = ("deepseek_v3", "kimi_k2")
    architectures = ("DeepseekV3ForCausalLM",)
    rank = 2  # a file that also names Kimi Linear (or is a text-only K3) is DeepSeek-V3's
    attention = "mla"
    rotary = True
    mtp_key = "num_nextn_predict_layers"  # the multi-token-prediction module: stored, not run
    checkpoint_map = (
        # float, block FP8 (DeepSeek-V3, Kimi K2) or INT4 pack-quantized (Kimi K2-Thinking) routed experts
        (r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\."
         r"(weight|weight_scale_inv|weight_packed|weight_scale|weight_shape)", "expert"),
        (r"model\.layers\.(\d+)\.mlp\.(gate|shared_experts)\.(.*)", r"model.layers.\1.block_sparse_moe.\2.\3"),
        (r"(.*)", r"\1"),
    )
    published_map = (
        (r"model\.layers\.(\d+)\.block_sparse_moe\.(.*)", r"model.layers.\1.mlp.\2"),
        (r"(.*)", r"\1"),
    )
    expert_module = "model.layers.{layer}.mlp.experts.{expert}.{proj}"
    expert_projs = MappingProxyType({"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})
    module_aliases = (
        (r"model\.layers\.(\d+)\.mlp\.(gate|shared_experts)(\..*)?", r"model.layers.\1.block_sparse_moe.\2\3"),
    )
    tiny_quants = ("fp8", "int4")  # block FP8 (DeepSeek-V3, Kimi K2), INT4 routed experts (K2-Thinking)

    def tiny_config(self, dims: Mapping[str, int], size: str, quant: str) -> dict:
        """Its published keys (rope_scaling included) at `dims`: 4 expert groups of which 2 are kept, one
        dense layer first, YaRN with DeepSeek's parameters (factor 40 from a 64-token original context)."""
        s = dims
        out = {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "hidden_size": s["hidden"], "num_hidden_layers": s["layers"], "vocab_size": s["vocab"],
            "intermediate_size": s["dense"], "moe_intermediate_size": _PLAIN_EXPERT_DIM.get(size, s["expert_dim"]),
            "num_attention_heads": s["heads"], "num_key_value_heads": s["heads"],
            "q_lora_rank": s["q_lora"], "kv_lora_rank": s["kv_lora"], "qk_nope_head_dim": s["nope"],
            "qk_rope_head_dim": s["rope"], "v_head_dim": s["nope"],
            "n_routed_experts": s["experts"], "num_experts_per_tok": s["top_k"], "n_shared_experts": 1,
            "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 4, "topk_group": 2,
            "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
            "routed_scaling_factor": 2.5, "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "num_nextn_predict_layers": 0, "max_position_embeddings": 2560, "rope_theta": 10000,
            "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 64, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
            "attention_bias": False, "dtype": "bfloat16",
        }
        if quant == "fp8":
            out["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                          "weight_block_size": [128, 128]}
        elif quant == "int4":  # K2-Thinking's: every Linear but attention, shared experts, dense MLPs, lm_head
            from moeswap.formats import compressed_tensors as ct

            ignore = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                      r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
            out["quantization_config"] = ct.quantization_config("int4", ignore)
        return out


ARCH = DeepseekV3()
