"""Tiny models' configs and weights in the exact published checkpoint layout (tokenizer: tokenizer.py).

K3: multimodal wrapper config with `text_config` and compressed-tensors quantization_config, `language_model.`
prefix, MXFP4 routed experts (`weight_packed`/`weight_scale`), A_log zero-padded; Kimi Linear: flat config,
bf16 per-expert `w{1,2,3}.weight`; DeepSeek-V3: flat config with `rope_scaling` (YaRN),
`mlp.experts.E.{gate,up,down}_proj`, bf16; or (quant="fp8") block FP8 as DeepSeek ships it, every Linear but
the router and lm_head float8_e4m3fn with a `weight_scale_inv` per 128 x 128 block; or (quant="int4") Kimi
K2-Thinking's compressed-tensors `pack-quantized` INT4 routed experts, the rest bf16. Always >= 2 shards with
an index and a tokenizer. Deterministic by seed: every tensor is drawn from a generator seeded by (seed, its
name).
Entry point: `write_tiny_model(out_dir, arch, size, seed)`.
"""

from __future__ import annotations

import importlib
import math
import re
import zlib
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from moeswap import jsonio
from moeswap.atomic_dir import atomic_directory
from moeswap.config import parse_config
from moeswap.text.tokenizer import load_tokenizer
from moeswap.formats import compressed_tensors as ct
from moeswap.formats import fp8_block, mxfp4
from moeswap.models import REGISTRY, build_model, routed_expert_shapes
from moeswap.tiny.sizes import SIZES
from moeswap.tiny.tokenizer import build_tiny_tokenizer



QUANTS = ("fp8", "int4")  # DeepSeek-V3 variants: block FP8 (DeepSeek-V3, Kimi K2), INT4 experts (K2-Thinking)


def tiny_config(arch: str, size: str, quant: str = "") -> dict:
    """config.json content in the layout the real model ships, for every architecture in the registry
    (tests/models/test_registry.py runs each one through init-tiny, so a new one needs its layout here)."""
    if arch not in REGISTRY:
        raise ValueError(f"--arch {arch!r}: expected one of {', '.join(REGISTRY)}")
    if arch not in ("kimi_k3", "kimi_linear", "deepseek_v3"):
        raise ValueError(f"init-tiny has no config layout for architecture {arch!r} yet (moeswap/tiny/model.py)")
    if quant and (arch != "deepseek_v3" or quant not in QUANTS):
        raise ValueError(f"--quant {quant}: the quantised variants ({', '.join(QUANTS)}) are DeepSeek-V3 / Kimi K2 "
                         f"layouts, not {arch}'s")
    s = SIZES[size]
    if arch == "deepseek_v3":
        return _deepseek_v3_config(s, quant)
    n = s["layers"]
    mla_layers = [i + 1 for i in range(n) if i % 4 == 3 or i == n - 1]  # 1-based, last layer MLA like K3
    kda_layers = [i + 1 for i in range(n) if i + 1 not in mla_layers]
    text = {
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
    if arch == "kimi_linear":
        text.update(hidden_act="silu", num_shared_experts=1, q_lora_rank=None, routed_scaling_factor=2.446)
        return text
    text.update(
        hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0, num_shared_experts=2,
        q_lora_rank=s["q_lora"], mla_use_output_gate=True, routed_expert_hidden_size=s["latent"],
        latent_moe_use_norm=True, routed_scaling_factor=1.0, attn_res_block_size=s["res_block"],
        quantization_config=_k3_quantization_config(),
    )
    text["linear_attn_config"].update(gate_lower_bound=-5.0, use_full_rank_gate=True)
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text,
            "tie_word_embeddings": False}


def _deepseek_v3_config(s: dict, quant: str) -> dict:
    """DeepSeek-V3's config.json layout (its published keys, rope_scaling included) at size `s`: 4 expert
    groups of which 2 are kept, one dense layer first, YaRN with DeepSeek's parameters (factor 40 from
    a 64-token original context)."""
    out = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": s["hidden"], "num_hidden_layers": s["layers"], "vocab_size": s["vocab"],
        "intermediate_size": s["dense"], "moe_intermediate_size": s.get("plain_expert_dim", s["expert_dim"]),
        "num_attention_heads": s["heads"], "num_key_value_heads": s["heads"],
        "q_lora_rank": s["q_lora"], "kv_lora_rank": s["kv_lora"], "qk_nope_head_dim": s["nope"],
        "qk_rope_head_dim": s["rope"], "v_head_dim": s["nope"],
        "n_routed_experts": s["experts"], "num_experts_per_tok": s["top_k"], "n_shared_experts": 1,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 4, "topk_group": 2,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
        "max_position_embeddings": 2560, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 64, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "attention_bias": False, "dtype": "bfloat16",
    }
    if quant == "fp8":
        out["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": [128, 128]}
    elif quant == "int4":  # Kimi K2-Thinking's: every Linear but attention, shared experts, dense MLPs, lm_head
        ignore = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
        out["quantization_config"] = ct.quantization_config("int4", ignore)
    return out


def _k3_quantization_config() -> dict:
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


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _init_dense(name: str, shape: tuple[int, ...], gen: torch.Generator, num_heads: int) -> torch.Tensor:
    """Initial values that keep a random model numerically tame (norms 1, small projections)."""
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
    if name.endswith("dt_bias"):
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    if name.endswith("e_score_correction_bias"):
        return torch.randn(shape, generator=gen) * 0.01
    if "norm" in leaf or leaf.endswith("res_proj"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("block_sparse_moe.gate.weight"):  # decisive routing: few near-ties between experts
        return torch.randn(shape, generator=gen) * (4.0 / math.sqrt(shape[-1]))
    if "conv1d" in leaf:
        return torch.randn(shape, generator=gen) * 0.3
    return torch.randn(shape, generator=gen) * (0.5 / math.sqrt(shape[-1]))


def tensors_for(arch: str, size: str, seed: int, quant: str = ""):
    """Yields (checkpoint name, tensor) in layer order, the routed experts of a layer together."""
    raw = tiny_config(arch, size, quant)
    cfg = parse_config(raw)
    prefix = cfg.weight_prefix
    model = build_model(cfg, device="meta")
    names = importlib.import_module(REGISTRY[arch].split(":")[0])  # the architecture's published names
    published = getattr(names, "published_name", lambda n: n)
    for name, param in model.named_parameters():
        gen = _generator(seed, name)
        value = _init_dense(name, tuple(param.shape), gen, cfg.kda.num_heads)
        if name.endswith("self_attn.A_log"):
            value = _a_log_layout(arch, value, cfg.kda.head_dim)
        keep_fp32 = name.endswith(("A_log", "dt_bias", "e_score_correction_bias", "conv1d.weight"))
        if quant == "fp8" and _fp8_quantised(name, value):
            yield from _fp8_block(prefix + published(name).removesuffix(".weight"), value)
            continue
        yield prefix + published(name), value.to(torch.float32 if keep_fp32 else torch.bfloat16)
    shapes = routed_expert_shapes(cfg)
    for layer in (i for i, k in enumerate(cfg.mlp_kinds) if k == "moe"):
        for e in range(cfg.moe.num_experts):
            for proj, shape in shapes.items():
                name = prefix + names.expert_name(layer, e, proj)
                gen = _generator(seed, name)
                if quant == "fp8":
                    yield from _fp8_block(name, torch.randn(shape, generator=gen) / math.sqrt(shape[1]))
                elif quant == "int4":
                    w = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
                    yield from ((f"{name}.{suffix}", t) for suffix, t in ct.encode_weight("int4", w).items())
                elif cfg.quant is not None:
                    packed, scale = _random_mxfp4(shape, gen)
                    yield name + ".weight_packed", packed
                    yield name + ".weight_scale", scale
                else:
                    yield name + ".weight", (torch.randn(shape, generator=gen) / math.sqrt(shape[1])).to(torch.bfloat16)


def _fp8_quantised(param_name: str, value: torch.Tensor) -> bool:
    """Which of DeepSeek-V3's tensors it ships as block FP8: every Linear weight (the *_proj and
    kv_a_proj_with_mqa) but the router's and lm_head."""
    return value.ndim == 2 and param_name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def _fp8_block(module: str, value: torch.Tensor):
    """`module`'s (weight, weight_scale_inv) for `value` by the block-FP8 codec (formats/fp8_block.py)."""
    q, scale_inv = fp8_block.encode(value.float())
    yield module + ".weight", q
    yield module + ".weight_scale_inv", scale_inv


def _random_mxfp4(shape: tuple[int, int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random E2M1 codes with block scales giving weights of std ~ 1/sqrt(fan_in). Drawing codes
    directly (not encoding random floats) keeps `--size bench` to seconds instead of many minutes."""
    out_dim, in_dim = shape
    packed = torch.randint(0, 256, (out_dim, in_dim // 2), dtype=torch.uint8, generator=gen)
    code_rms = math.sqrt(sum(v * v for v in mxfp4.E2M1_VALUES) / len(mxfp4.E2M1_VALUES))
    exponent = round(math.log2(1.0 / (math.sqrt(in_dim) * code_rms)))
    jitter = torch.randint(-1, 2, (out_dim, in_dim // 32), generator=gen)
    return packed, (127 + exponent + jitter).to(torch.uint8)


def _a_log_layout(arch: str, a_log_H: torch.Tensor, head_dim: int) -> torch.Tensor:
    if arch == "kimi_k3":  # K3 ships [128] zero-padded; mimic with padding to max(H, head_dim)
        out = torch.zeros(max(a_log_H.numel(), head_dim))
        out[: a_log_H.numel()] = a_log_H
        return out
    return a_log_H.reshape(1, 1, -1, 1)  # transformers' Kimi Linear layout


def write_tiny_model(out_dir: str | Path, arch: str = "kimi_k3", size: str = "tiny", seed: int = 0,
                     shard_bytes: int | None = None, progress: bool = False, quant: str = "",
                     tokenizer_lines: Iterable[str] | None = None) -> Path:
    """Writes the model atomically: into a temporary sibling directory, renamed at the end. quant: DeepSeek-V3
    with block-FP8 weights ("fp8") or INT4 routed experts ("int4"), as published. tokenizer_lines: the text
    its BPE is trained on (default: the built-in corpus)."""
    if size not in SIZES:
        raise ValueError(f"--size {size!r}: expected one of {', '.join(SIZES)}")
    tiny_config(arch, size, quant)  # checks the architecture before anything is written
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory; choose another directory")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose another directory or remove it")
    with atomic_directory(out) as tmp:
        _write(tmp, arch, size, seed, shard_bytes, progress, quant, tokenizer_lines)
    return out


def _write(out: Path, arch: str, size: str, seed: int, shard_bytes: int | None, progress: bool,
           quant: str = "", tokenizer_lines: Iterable[str] | None = None) -> None:
    config = tiny_config(arch, size, quant)
    text = config.get("text_config", config)
    build_tiny_tokenizer(out, text["vocab_size"], lines=tokenizer_lines)
    eos, bos, pad = _special_ids(out)
    for c in (config, text):
        c.update(eos_token_id=eos, bos_token_id=bos, pad_token_id=pad)
    (out / "config.json").write_text(jsonio.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(jsonio.dumps({"eos_token_id": eos, "bos_token_id": bos}, indent=2) + "\n")

    items = list(tqdm(tensors_for(arch, size, seed, quant), desc="making tensors", unit=" tensors",
                      disable=not progress))
    total = sum(t.numel() * t.element_size() for _, t in items)
    shard_bytes = shard_bytes or max(1, total // 3)
    # Shards are cut only between units: one dense tensor, or all tensors of one routed expert (the
    # published files never split an expert across shards).
    units: list[list[tuple[str, torch.Tensor]]] = []
    last_expert = None
    for name, tensor in items:
        m = _EXPERT_KEY.match(name)
        expert = m[1] if m else None
        if expert is not None and expert == last_expert:
            units[-1].append((name, tensor))
        else:
            units.append([(name, tensor)])
        last_expert = expert
    groups, current, current_bytes = [], [], 0
    for unit in units:
        current.append(unit)
        current_bytes += sum(t.numel() * t.element_size() for _, t in unit)
        if current_bytes >= shard_bytes:
            groups.append(current)
            current, current_bytes = [], 0
    if current:
        groups.append(current)
    if len(groups) == 1:  # the published layout is sharded: always write at least two
        half = len(units) // 2
        groups = [units[:half], units[half:]]
    shards = [{name: t.contiguous() for unit in group for name, t in unit} for group in groups]
    weight_map, total_size = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = file
            total_size += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(jsonio.dumps(index, indent=2) + "\n")


_EXPERT_KEY = re.compile(r"(.*\.experts\.\d+)\.")


def _special_ids(out: Path) -> tuple[int, int, int]:
    tok = load_tokenizer(out)
    eos = tok.eos_ids[0]
    bos = tok.bos_id if tok.bos_id is not None else eos
    return eos, bos, tok.vocab_size - 1
