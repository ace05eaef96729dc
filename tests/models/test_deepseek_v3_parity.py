"""Oracle parity: a tiny DeepSeek-V3 (RoPE MLA with YaRN, group-limited routing, shared experts, a dense
first layer) made and saved by transformers, loaded by moeswap in fp32: float weights, and block-FP8
weights written by moeswap's codec (formats/fp8_block.py), and INT4 routed experts written by `moeswap quantize`
(Kimi K2-Thinking's pack-quantized layout), against transformers on the decoded values."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moeswap.config import load_config  # noqa: E402
from moeswap.engine.generate import GenerationConfig, generate  # noqa: E402
from moeswap.formats import fp8_block  # noqa: E402
from moeswap.formats.files import read_json  # noqa: E402
from moeswap.formats.writer import layout, write_index, write_shard  # noqa: E402
from moeswap.jsonio import dumps  # noqa: E402
from moeswap.models.loader import LoadOptions, load_model  # noqa: E402

VOCAB = 320


def _reference_model(seed: int = 0):
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
        first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, max_position_embeddings=128,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                         "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        initializer_range=0.08, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():  # informative routing and norms rather than near-uniform ones
        for name, p in model.named_parameters():
            if name.endswith(("layernorm.weight", "norm.weight")):
                p.normal_(1.0, 0.1)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(0.0, 0.1)  # positive, as trained biases mostly are: no -inf vs 0 masking question
    return model


@pytest.fixture(scope="module")
def saved_reference(tmp_path_factory):
    ref = _reference_model()
    path = tmp_path_factory.mktemp("deepseek_v3_ref")
    ref.save_pretrained(path)
    return ref, path


def test_config_reads_transformers_rope_parameters(saved_reference):
    _, path = saved_reference
    cfg = load_config(path)
    assert cfg.arch == "deepseek_v3" and cfg.attn_kinds == ("mla",) * 4
    assert cfg.mlp_kinds == ("dense", "moe", "moe", "moe")
    rope = cfg.mla.rope
    assert rope.yarn and rope.factor == 8.0 and rope.original_max_positions == 16 and rope.interleave
    assert (cfg.moe.num_groups, cfg.moe.topk_group, cfg.moe.routed_scaling_factor) == (4, 2, 2.5)


def _check_logits(ref, path, tokens):
    model, _ = load_model(path, LoadOptions(dtype="float32"))
    with torch.no_grad():
        want = ref(tokens).logits
        got = model(tokens)
    assert got.shape == want.shape
    assert want.std() > 0.05  # not two near-constant outputs
    err = (got - want).abs().max().item()
    assert err <= 1e-4, err
    return model


def test_logits_match_transformers(saved_reference):
    ref, path = saved_reference
    # 48 tokens: past the YaRN original context (16), so the scaled frequencies matter
    tokens = torch.randint(3, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    _check_logits(ref, path, tokens)


def test_incremental_decode_equals_full_forward(saved_reference):
    _, path = saved_reference
    model, _ = load_model(path, LoadOptions(dtype="float32"))
    tokens = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        full = model(tokens)
        state = model.make_state(2)
        parts = [model(tokens[:, :7], state), model(tokens[:, 7:10], state)]
        parts += [model(tokens[:, t:t + 1], state) for t in range(10, 24)]
    assert (torch.cat(parts, dim=1) - full).abs().max().item() <= 1e-5 * full.abs().max().item()


def test_greedy_tokens_match_transformers(saved_reference):
    ref, path = saved_reference
    model, _ = load_model(path, LoadOptions(dtype="float32"))
    prompt = torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32)[0, 16:].tolist()
    got = generate(model, prompt[0].tolist(), GenerationConfig(max_tokens=32, stop_ids=())).tokens
    assert got == want
    assert len(set(want)) > 3  # greedy output is not one repeated token


def _set_weights(ref, weights: dict) -> None:
    """Checkpoint-named weights into transformers' model, whose routed experts are fused per layer
    (gate_up_proj [E, 2F, D], down_proj [E, D, F])."""
    sd = ref.state_dict()
    with torch.no_grad():
        for name, w in weights.items():
            if ".experts." not in name:
                sd[name].copy_(w)
                continue
            prefix, rest = name.split(".experts.")
            e, proj = rest.split(".")[:2]
            if proj == "down_proj":
                sd[f"{prefix}.experts.down_proj"][int(e)].copy_(w)
            else:
                F = w.shape[0]
                rows = slice(0, F) if proj == "gate_proj" else slice(F, 2 * F)
                sd[f"{prefix}.experts.gate_up_proj"][int(e), rows].copy_(w)


def _quantised(name: str, t: torch.Tensor) -> bool:
    """DeepSeek-V3's block-FP8 tensors: every Linear weight but the router's and lm_head."""
    return t.ndim == 2 and name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def test_block_fp8_checkpoint_matches_transformers_on_decoded_weights(saved_reference, tmp_path):
    """Every Linear (routed experts too) stored as float8 + weight_scale_inv by fp8_block.encode, as DeepSeek
    ships them; transformers runs the same model with the decoded values."""
    _, path = saved_reference
    ref = transformers.DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    from safetensors.torch import load_file

    stored = load_file(path / "model.safetensors")
    tensors, decoded = {}, {}
    for name, t in stored.items():
        if _quantised(name, t):
            q, scale_inv = fp8_block.encode(t)
            module = name.removesuffix(".weight")
            tensors[module + ".weight"], tensors[module + ".weight_scale_inv"] = q, scale_inv
            decoded[name] = fp8_block.decode(q, scale_inv, dtype=torch.float32)
        else:
            tensors[name] = t
    assert sum(n.endswith("weight_scale_inv") for n in tensors) > 16 * 3 * 3  # routed experts included
    out = tmp_path / "fp8"
    out.mkdir()
    specs = layout((n, t.dtype, tuple(t.shape)) for n, t in tensors.items())
    total = write_shard(out / "model-00001-of-00001.safetensors", specs, ((n, tensors[n]) for n, _, _ in specs))
    write_index(out, dict.fromkeys(tensors, "model-00001-of-00001.safetensors"), total)
    config = read_json(path / "config.json", ValueError)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (out / "config.json").write_text(dumps(config))
    # transformers on the decoded weights (its own fp8 path needs an accelerator)
    _set_weights(ref, decoded)
    tokens = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        float_logits = ref(tokens).logits
    _check_logits(ref, out, tokens)
    model, _ = load_model(path, LoadOptions(dtype="float32"))
    with torch.no_grad():  # the FP8 rounding is visible: the decoded weights are not the float ones
        assert (model(tokens) - float_logits).abs().max().item() > 1e-3


def test_int4_experts_written_by_moeswap_quantize_match_transformers_on_decoded_weights(saved_reference, tmp_path):
    """`moeswap quantize --experts int4`: routed experts as compressed-tensors pack-quantized INT4 (Kimi
    K2-Thinking's layout), the rest as stored; moeswap loads it, transformers runs the decoded experts."""
    from moeswap.formats import compressed_tensors as ct
    from moeswap.formats.checkpoint import Checkpoint
    from moeswap.quantize import QuantizeOptions, quantize

    _, path = saved_reference
    report = quantize(path, tmp_path / "int4", QuantizeOptions("int4"))
    assert report["format"] == "pack-quantized"
    ref = transformers.DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    decoded = {}
    with Checkpoint.open(tmp_path / "int4") as ckpt:
        packed = [n.removesuffix(".weight_packed") for n in ckpt.names() if n.endswith(".weight_packed")]
        assert len(packed) == 3 * 16 * 3 and all(".mlp.experts." in m for m in packed)
        for m in packed:
            stored = {k: ckpt.read(f"{m}.{k}") for k in ct.stored_names("int4")}
            assert stored["weight_packed"].dtype == torch.int32 and stored["weight_scale"].dtype == torch.bfloat16
            decoded[m + ".weight"] = ct.decode_weight("int4", stored, torch.float32)
    _set_weights(ref, decoded)
    tokens = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(5))
    _check_logits(ref, tmp_path / "int4", tokens)
