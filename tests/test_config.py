"""config.json parsing: the published K3 and Kimi Linear files, key spellings, layer kinds, and every error."""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings

import pytest

from moeswap.config import ConfigError, load_config, parse_config
from moeswap.planner.models import preset_path

# The published config.json files, byte for byte: the planner ships them as its presets (package data)
K3_JSON = preset_path("kimi-k3")
LINEAR_JSON = preset_path("kimi-linear-48b")


def k3_raw() -> dict:
    return json.loads(K3_JSON.read_text())


def linear_raw() -> dict:
    return json.loads(LINEAR_JSON.read_text())


def parse_quietly(raw: dict):
    """Parse with every warning turned into an error: the published files must parse cleanly."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return parse_config(raw)


# -- the published files -------------------------------------------------------------------------


def test_k3_published_config():
    raw = k3_raw()
    cfg = parse_quietly(raw)
    lin = raw["text_config"]["linear_attn_config"]
    assert cfg.arch == "kimi_k3"
    assert cfg.weight_prefix == "language_model."
    assert cfg.num_layers == 93 and len(cfg.attn_kinds) == 93 and len(cfg.mlp_kinds) == 93
    assert (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size) == (7168, 163840, 33792)

    mla = [i for i, k in enumerate(cfg.attn_kinds) if k == "mla"]
    kda = [i for i, k in enumerate(cfg.attn_kinds) if k == "kda"]
    assert mla == sorted(i - 1 for i in lin["full_attn_layers"])  # read from the 1-based list
    assert kda == sorted(i - 1 for i in lin["kda_layers"])
    assert mla == [*range(3, 88 + 1, 4), 91, 92]  # 3, 7, ..., 87, then 91 and 92 both MLA
    assert len(mla) == 24 and len(kda) == 69
    assert cfg.attn_kinds[90] == "kda" and cfg.attn_kinds[91] == cfg.attn_kinds[92] == "mla"

    assert cfg.mlp_kinds[0] == "dense" and set(cfg.mlp_kinds[1:]) == {"moe"}
    assert cfg.layer_summary() == {"kda+dense": 1, "kda+moe": 68, "mla+moe": 24}

    m = cfg.moe
    assert (m.num_experts, m.top_k, m.num_shared_experts, m.expert_dim, m.latent_dim) == (896, 16, 2, 3072, 3584)
    assert m.latent_norm is True and m.scoring == "sigmoid" and m.renormalize is True
    assert (m.routed_scaling_factor, m.num_groups, m.topk_group) == (1.0, 1, 1)

    assert cfg.kda.gate_lower_bound == -5.0 and cfg.kda.full_rank_gate is True
    assert (cfg.kda.num_heads, cfg.kda.head_dim, cfg.kda.conv_kernel) == (96, 128, 4)
    assert (cfg.mla.num_heads, cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank) == (96, 1536, 512)
    assert (cfg.mla.qk_nope_head_dim, cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim) == (128, 64, 128)
    assert cfg.mla.output_gate is True and cfg.mla.use_nope is True

    assert cfg.hidden_act == "situ" and (cfg.situ_beta, cfg.situ_linear_beta) == (4.0, 25.0)
    assert cfg.attn_res_block_size == 12 and cfg.rms_norm_eps == 1e-5
    assert cfg.tie_word_embeddings is False and cfg.max_position_embeddings == 1048576
    assert cfg.eos_token_ids == (163586,) and cfg.bos_token_id == 163584

    assert cfg.quant is not None
    assert (cfg.quant.format, cfg.quant.group_size) == ("mxfp4-pack-quantized", 32)
    assert cfg.quant.is_ignored("model.layers.1.block_sparse_moe.shared_experts.up_proj")
    assert cfg.quant.is_ignored("model.layers.0.mlp.down_proj")
    assert not cfg.quant.is_ignored("model.layers.1.block_sparse_moe.experts.7.w1")
    assert cfg.unknown_keys == ()


def test_kimi_linear_published_config():
    raw = linear_raw()
    cfg = parse_quietly(raw)
    assert cfg.arch == "kimi_linear" and cfg.weight_prefix == ""
    assert cfg.num_layers == 27 and cfg.hidden_size == 2304
    mla = [i for i, k in enumerate(cfg.attn_kinds) if k == "mla"]
    assert mla == sorted(i - 1 for i in raw["linear_attn_config"]["full_attn_layers"]) == [3, 7, 11, 15, 19, 23, 26]
    assert cfg.attn_kinds.count("kda") == 20
    assert cfg.mlp_kinds[0] == "dense" and set(cfg.mlp_kinds[1:]) == {"moe"}
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.num_shared_experts) == (256, 8, 1)
    assert cfg.moe.latent_dim is None and cfg.moe.routed_scaling_factor == 2.446
    assert cfg.kda.gate_lower_bound is None and cfg.kda.full_rank_gate is False
    assert cfg.mla.q_lora_rank is None and cfg.mla.output_gate is False
    assert cfg.hidden_act == "silu" and cfg.attn_res_block_size is None and cfg.quant is None
    assert cfg.max_position_embeddings == 1048576  # spelled model_max_length in this file


def test_load_config_accepts_a_directory_or_a_file(tmp_path):
    (tmp_path / "config.json").write_text(K3_JSON.read_text())
    assert load_config(tmp_path) == load_config(tmp_path / "config.json") == load_config(K3_JSON)


def test_text_only_k3_config_is_k3_without_prefix():
    wrapped = parse_quietly(k3_raw())
    text_only = parse_quietly(k3_raw()["text_config"])  # says model_type kimi_linear, but has K3's features
    assert text_only.arch == "kimi_k3"
    assert text_only.weight_prefix == ""
    assert text_only.quant == wrapped.quant
    assert dataclasses.replace(wrapped, weight_prefix="") == text_only


# -- spellings ------------------------------------------------------------------------------------

KIMI_TO_DEEPSEEK = {
    "num_experts": "n_routed_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "moe_renormalize": "norm_topk_prob",
    "num_shared_experts": "n_shared_experts",
    "num_expert_group": "n_group",
    "moe_router_activation_func": "scoring_func",
}


def _respell(text: dict) -> dict:
    out = {KIMI_TO_DEEPSEEK.get(k, k): v for k, v in text.items()}
    assert len(out) == len(text)
    return out


@pytest.mark.parametrize("which", ["k3", "kimi_linear"])
@pytest.mark.parametrize("overrides", [
    {},
    # values that differ from every default, so a spelling that is not read would show
    {"moe_renormalize": False, "moe_router_activation_func": "softmax", "num_expert_group": 4,
     "num_shared_experts": 3, "num_experts": 64, "num_experts_per_token": 6},
])
def test_deepseek_spellings_give_the_same_config(which, overrides):
    kimi = k3_raw()["text_config"] if which == "k3" else linear_raw()
    kimi.update(overrides)
    deepseek = _respell(kimi)
    assert not set(KIMI_TO_DEEPSEEK) & set(deepseek)
    a, b = parse_quietly(kimi), parse_quietly(deepseek)
    assert a == b
    if overrides:
        assert (b.moe.renormalize, b.moe.scoring, b.moe.num_groups) == (False, "softmax", 4)
        assert (b.moe.num_shared_experts, b.moe.num_experts, b.moe.top_k) == (3, 64, 6)


def _transformers_written(raw: dict) -> dict:
    """What transformers' KimiLinearConfig.save_pretrained writes: layer_types / mlp_layer_types and
    flat linear_* keys instead of linear_attn_config's lists."""
    n = raw["num_hidden_layers"]
    lin = raw.pop("linear_attn_config")
    full = set(lin["full_attn_layers"])
    raw["layer_types"] = ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)]
    k = raw.pop("first_k_dense_replace")
    raw["mlp_layer_types"] = ["dense" if i < k else "sparse" for i in range(n)]
    raw.update(linear_head_dim=lin["head_dim"], linear_num_heads=lin["num_heads"],
               linear_conv_kernel_dim=lin["short_conv_kernel_size"], head_dim=raw["qk_rope_head_dim"],
               qk_head_dim=raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"], transformers_version="5.2.0",
               attention_bias=False, attention_dropout=0.0, pretraining_tp=1, output_router_logits=False)
    raw["max_position_embeddings"] = raw.pop("model_max_length")
    return _respell(raw)


def test_transformers_written_config_matches_the_original():
    original = parse_quietly(linear_raw())
    written = _transformers_written(linear_raw())
    assert "linear_attn_config" not in written and "first_k_dense_replace" not in written
    assert parse_quietly(written) == original


def test_mlp_layer_types_win_over_first_k_dense_replace():
    raw = _transformers_written(linear_raw())
    raw["mlp_layer_types"][1] = "dense"
    raw["first_k_dense_replace"] = 1
    cfg = parse_quietly(raw)
    assert cfg.mlp_kinds[:3] == ("dense", "dense", "moe")
    assert cfg.layer_summary()["kda+dense"] == 2


def test_unknown_keys_are_reported_by_name():
    raw = linear_raw()
    raw["frobnicate_level"] = 3
    raw["linear_attn_config"]["wibble"] = True
    with pytest.warns(UserWarning, match=r"unknown config keys: frobnicate_level, linear_attn_config\.wibble"):
        cfg = parse_config(raw)
    assert cfg.unknown_keys == ("frobnicate_level", "linear_attn_config.wibble")
    assert cfg == parse_quietly(linear_raw())  # reported, not used


# -- errors ----------------------------------------------------------------------------------------


def _text(raw: dict) -> dict:
    return raw.get("text_config", raw)


def _k3(mutate):
    raw = k3_raw()
    mutate(_text(raw))
    return raw


def _lin(mutate):
    raw = linear_raw()
    mutate(raw)
    return raw


def _tf(mutate):
    raw = _transformers_written(linear_raw())
    mutate(raw)
    return raw


def _set_quant(**kw):
    def mutate(text):
        q = text["quantization_config"]
        for key, value in kw.items():
            if key in ("format", "quant_method"):
                q[key] = value
            if key == "format":
                q["config_groups"]["group_0"]["format"] = value
            if key == "group_size":
                q["config_groups"]["group_0"]["weights"]["group_size"] = value
    return mutate


ERRORS = {
    "missing hidden_size": (_k3(lambda t: t.pop("hidden_size")), r"required field 'hidden_size' is missing"),
    "hidden_size not an int": (_k3(lambda t: t.update(hidden_size="7168")),
                               r"field 'hidden_size' must be a non-negative integer, got '7168'"),
    "missing num_experts": (_lin(lambda t: t.pop("num_experts")),
                            r"required field 'num_experts' \(or n_routed_experts, num_local_experts\) is missing"),
    "unknown model_type": (
        _lin(lambda t: t.update(model_type="llama", architectures=["LlamaForCausalLM"])),
        r"unknown architecture \(model_type='llama', architectures=\['LlamaForCausalLM'\]\); "
        r"moeswap runs: kimi_k3, kimi_linear",
    ),
    "layer both KDA and MLA": (
        _k3(lambda t: t["linear_attn_config"]["kda_layers"].append(4)),
        r"layer 4 \(1-based\) is listed as both KDA and MLA",
    ),
    "layer in neither list": (
        _k3(lambda t: t["linear_attn_config"]["kda_layers"].remove(5)),
        r"linear_attn_config lists neither KDA nor MLA for layers \[5\] \(1-based\)",
    ),
    "1-based index past the end": (
        _k3(lambda t: t["linear_attn_config"]["full_attn_layers"].append(94)),
        r"linear_attn_config\.full_attn_layers lists layer 94, not an integer in 1\.\.93 \(1-based\)",
    ),
    "0-based index given": (
        _lin(lambda t: t["linear_attn_config"]["kda_layers"].insert(0, 0)),
        r"linear_attn_config\.kda_layers lists layer 0, not an integer in 1\.\.27 \(1-based\)",
    ),
    "layer index not an int": (
        _lin(lambda t: t["linear_attn_config"]["full_attn_layers"].__setitem__(0, "4")),
        r"linear_attn_config\.full_attn_layers lists layer '4', not an integer in 1\.\.27",
    ),
    "no layer kinds at all": (
        _lin(lambda t: t.pop("linear_attn_config")),
        r"cannot tell KDA from MLA layers: need linear_attn_config\.kda_layers/full_attn_layers or layer_types",
    ),
    "layer_types wrong length": (_tf(lambda t: t["layer_types"].pop()), r"layer_types must list 27 entries"),
    "layer_types unknown kind": (
        _tf(lambda t: t["layer_types"].__setitem__(2, "sliding_attention")), r"layer_types must list 27 entries",
    ),
    "mlp_layer_types wrong length": (_tf(lambda t: t["mlp_layer_types"].append("sparse")),
                                     r"mlp_layer_types must list 27 entries"),
    "top_k > num_experts": (
        _k3(lambda t: t.update(num_experts_per_token=897)),
        r"num_experts_per_token=897 must be in 1\.\.num_experts=896",
    ),
    "top_k > num_experts (DeepSeek spelling)": (
        _lin(lambda t: t.update(num_experts_per_tok=300, num_experts_per_token=None)),
        r"num_experts_per_token=300 must be in 1\.\.num_experts=256",
    ),
    "unsupported quant method": (_k3(_set_quant(quant_method="gptq")),
                                 r"quantization_config\.quant_method='gptq' is not supported"),
    "unsupported quant format": (_k3(_set_quant(format="nvfp4-pack-quantized")),
                                 r"quantization format 'nvfp4-pack-quantized' is not supported "
                                 r"\(expected mxfp4-pack-quantized or mxfp8-quantized or pack-quantized or int-quantized\)"),
    "wrong group size": (_k3(_set_quant(group_size=16)), r"MXFP4 group_size must be 32, got 16"),
    "unsupported activation": (_lin(lambda t: t.update(hidden_act="gelu")), r"hidden_act='gelu' is not supported"),
    "rotary MLA": (_lin(lambda t: t.update(mla_use_nope=False)), r"mla_use_nope=false"),
    "unknown router": (_lin(lambda t: t.update(moe_router_activation_func="relu")),
                       r"moe_router_activation_func='relu'; expected 'sigmoid' or 'softmax'"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_config_errors_name_the_field(case, tmp_path):
    raw, message = ERRORS[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError, match=message):
            parse_config(raw)
        # from a file, the message starts with the file's path
        path = tmp_path / "config.json"
        path.write_text(json.dumps(raw))
        with pytest.raises(ConfigError, match=message) as err:
            load_config(tmp_path)
    assert str(err.value).startswith(f"{path}: ")


def test_non_json_file(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 7168,')
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON"):
        load_config(tmp_path)


def test_binary_file_is_a_config_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    with pytest.raises(ConfigError, match=rf"{path}: not valid JSON"):
        load_config(path)


def test_json_that_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(ConfigError, match=r"expected a JSON object at the top level"):
        load_config(tmp_path)


def test_text_config_not_an_object():
    with pytest.raises(ConfigError, match=r"field 'text_config' must be an object"):
        parse_config({"model_type": "kimi_k3", "text_config": [1]})


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'config.json'}: no config\.json found"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match=r"no config\.json found"):
        load_config(tmp_path / "does-not-exist")


def test_errors_do_not_depend_on_mutating_the_input():
    raw = k3_raw()
    before = copy.deepcopy(raw)
    parse_quietly(raw)
    assert raw == before


def _deepseek(**edits) -> dict:
    raw = json.loads(preset_path("deepseek-v3").read_text())
    raw.update(edits)
    return raw


def test_deepseek_v3_and_kimi_k2_configs():
    """DeepSeek-V3's published config.json: all-MLA with YaRN RoPE, 3 dense layers, 8 groups of 32 experts,
    block FP8, one MTP layer; Kimi K2 is the same architecture under model_type kimi_k2."""
    cfg = parse_config(_deepseek())
    assert cfg.arch == "deepseek_v3" and set(cfg.attn_kinds) == {"mla"}
    assert cfg.mlp_kinds[:4] == ("dense",) * 3 + ("moe",)
    r = cfg.mla.rope
    assert (r.theta, r.factor, r.original_max_positions, r.mscale_all_dim, r.interleave) == (10000, 40, 4096, 1.0, True)
    assert (cfg.moe.num_groups, cfg.moe.topk_group, cfg.quant.format, cfg.quant.fp8_block, cfg.mtp_layers) == (
        8, 4, "fp8_block", (128, 128), 1)
    assert parse_config(_deepseek(model_type="kimi_k2", architectures=[])).arch == "deepseek_v3"
    # transformers 5 writes rope_parameters with rope_theta inside
    t5 = _deepseek(rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
                                    "original_max_position_embeddings": 4096})
    del t5["rope_scaling"]
    assert (parse_config(t5).mla.rope.theta, parse_config(t5).mla.rope.factor) == (50000.0, 32.0)


def test_a_config_naming_two_architectures_is_the_higher_ranked_one():
    """model_type and architectures disagreeing: K3's names outrank DeepSeek-V3's, which outrank Kimi Linear's
    (even a text-only K3's features), whichever key names which."""
    from moeswap.archs import detect

    k3, linear, ds = "KimiK3ForConditionalGeneration", "KimiLinearForCausalLM", "DeepseekV3ForCausalLM"
    k3_text = {"routed_expert_hidden_size": 8}
    cases = [("kimi_k3", (ds,), {}, "kimi_k3"), ("deepseek_v3", (k3,), {}, "kimi_k3"),
             ("kimi_linear", (ds,), {}, "deepseek_v3"), ("kimi_k2", (linear,), k3_text, "deepseek_v3"),
             (None, (linear, ds), k3_text, "deepseek_v3"), ("kimi_linear", (), k3_text, "kimi_k3"),
             ("kimi_linear", (linear,), {}, "kimi_linear"), ("llama", ("LlamaForCausalLM",), {}, None)]
    for model_type, names, text, want in cases:
        got = detect(model_type, names, text)
        assert (got.name if got else None) == want, (model_type, names, text)


@pytest.mark.parametrize("edits, message", [
    ({"rope_scaling": {"type": "longrope"}}, r"rope_scaling type 'longrope' is not supported for DeepSeek-V3"),
    ({"rope_scaling": {"type": "yarn", "factor": 40}}, r"'rope_scaling.original_max_position_embeddings' is missing"),
    ({"rope_scaling": {"type": "yarn", "factor": -1, "original_max_position_embeddings": 4096}},
     r"'rope_scaling.factor' must be a finite positive number"),
    ({"qk_rope_head_dim": 63}, r"qk_rope_head_dim=63 must be even"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}},
     r"weight_block_size must be \[rows, cols\]"),
])
def test_deepseek_v3_config_errors_name_the_field(edits, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(_deepseek(**edits))
